"""verl's ``verl.trainer.main_eval``: ``python -m rlfoundry.trainer.main_eval [key=value ...]``.

Scores a generated parquet (``main_generation``'s output) offline. The keys are verl's ``evaluation.yaml``
(typed: ``config/generation.py``): ``data.path``; the columns ``data.response_key`` (a list of responses a
row), ``data.data_source_key`` and ``data.reward_model_key`` (``{"ground_truth": ...}``); and
``custom_reward_function.path`` / ``.name`` (called as verl calls it: ``fn(data_source, response,
ground_truth)``). Without a custom function every response is scored by the built-in scorer of its data
source, the trainer's ``default_compute_score`` (verl needs the custom function here).

Printed, per data source (verl's metric name first):

- ``test_score/<data_source>``: the mean over its rows of each row's mean score (mean@n);
- ``pass@<n>/<data_source>``: the share of its rows with at least one response at full marks (score >= 1,
  what the built-in scorers give a right answer); n is the most responses a row has.

``data.output_path`` (rlfoundry's) also writes them as JSON. ``--cfg job`` prints the config a command line gives and exits
(main_generation's ``entry_main``). A scorer returning a dict gives its ``score``.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rlfoundry.trainer.config import ConfigError
from rlfoundry.trainer.main_generation import Flags, entry_main, load_overlay

MODULE = "rlfoundry.trainer.main_eval"


def load_eval_config(overrides: Sequence[str] = (), flags: Flags | None = None) -> DictConfig:
    from rlfoundry.config.generation import EvaluationConfig

    cfg = load_overlay(EvaluationConfig, overrides, flags or Flags(None, None, None, False), "evaluation")
    if cfg.data.path is None:
        raise ConfigError("main_eval: data.path is not set: give the generated parquet (main_generation's output).")
    return cfg


def _reward_fn(cfg: DictConfig) -> Callable[[str, str, Any], Any]:
    """The custom function (loaded now: a bad file fails before any scoring), else the built-in dispatch."""
    from rlfoundry.rewards import default_compute_score, load_custom_reward_fn

    return load_custom_reward_fn(cfg) or default_compute_score


def _columns(cfg: DictConfig) -> tuple[Path, dict[str, list]]:
    from rlfoundry.data.rl_dataset import DataError, _read_parquet

    path = Path(str(cfg.data.path)).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.path={cfg.data.path}: no such file; give the parquet main_generation wrote.")
    table = _read_parquet(path)
    keys = {"data.response_key": cfg.data.response_key, "data.data_source_key": cfg.data.data_source_key,
            "data.reward_model_key": cfg.data.reward_model_key}
    for key, column in keys.items():
        if column not in table.column_names:
            raise DataError(f"{path} has no column {column!r} ({key}); its columns are {table.column_names}. "
                            f"Set {key} to the right column.")
    return path, {key: table.column(column).to_pylist() for key, column in keys.items()}


def _positional(fn: Callable, data_source: str, response: str, ground_truth: Any) -> float:
    """One response's score, ``fn`` called as verl's main_eval calls it (positionally); a dict gives its score.
    Module-level, so that a partial of it pickles into the scorer processes."""
    out = fn(data_source, response, ground_truth)
    return float(out["score"] if isinstance(out, dict) else out)


def _check_rows(cfg: DictConfig, path: Path, cols: dict[str, list]) -> None:
    for i, (responses, reward_data) in enumerate(zip(cols["data.response_key"], cols["data.reward_model_key"])):
        where = f"{path}, row {i}"
        if not isinstance(responses, list):
            raise ConfigError(f"{where}: column {cfg.data.response_key!r} (data.response_key) holds "
                              f"{type(responses).__name__}, not a list of responses.")
        if not isinstance(reward_data, dict) or "ground_truth" not in reward_data:
            raise ConfigError(f"{where}: column {cfg.data.reward_model_key!r} (data.reward_model_key) has no "
                              "'ground_truth': it must be {'ground_truth': ...}, as the prompt data sets carry it.")


def score_rows(cfg: DictConfig) -> dict[str, list[list[float]]]:
    """Each data source's rows, each row its responses' scores. Scored in the trainer's scorer pool: a
    response whose scorer fails (raises, hangs past scoring.timeout_s, kills its process) scores
    scoring.failure_score and is reported on stderr; the others are unaffected."""
    from rlfoundry.rewards import default_compute_score
    from rlfoundry.rewards.default import check_data_sources
    from rlfoundry.rewards.pool import LazyScoringPool
    from rlfoundry.rewards.rule import RuleOptions

    fn = _reward_fn(cfg)
    path, cols = _columns(cfg)
    _check_rows(cfg, path, cols)
    sources = [str(s) for s in cols["data.data_source_key"]]
    if fn is default_compute_score:  # before any scoring: a source without a scorer is the user's to fix
        check_data_sources(set(sources))
    calls, where = [], []
    for i, (responses, source, reward_data) in enumerate(
            zip(cols["data.response_key"], sources, cols["data.reward_model_key"])):
        for j, response in enumerate(responses):
            calls.append({"data_source": source, "response": str(response), "ground_truth": reward_data["ground_truth"]})
            where.append((i, j))
    sc = cfg.scoring
    options = RuleOptions(timeout_s=sc.timeout_s, failure_score=sc.failure_score, num_workers=sc.num_workers)
    with LazyScoringPool(functools.partial(_positional, fn), options.workers, options.timeout_s) as pool:
        outcomes = pool.map(calls)
    _report_failures(path, calls, where, outcomes)
    scores: dict[int, list[float]] = defaultdict(list)
    for (i, _), outcome in zip(where, outcomes):
        scores[i].append(float(options.failure_score) if outcome.error else float(outcome.value))
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for i, source in enumerate(sources):
        by_source[source].append(scores.get(i, []))
    return by_source


def _report_failures(path: Path, calls: list[dict], where: list[tuple[int, int]], outcomes: list) -> None:
    failed = [(w, c, o) for w, c, o in zip(where, calls, outcomes) if o.error]
    if not failed:
        return
    kinds = defaultdict(int)
    for _, _, o in failed:
        kinds[o.error] += 1
    (row, k), call, first = failed[0]
    detail = (first.detail or "").strip().splitlines()[-1:] or [""]
    print(f"main_eval: {len(failed)} of {len(calls)} responses could not be scored ({dict(kinds)}) and score "
          f"scoring.failure_score; the first: {path}, row {row}, response {k} ({call['data_source']}): "
          f"{first.error} {detail[0]}", file=sys.stderr, flush=True)


def metrics(by_source: dict[str, list[list[float]]]) -> dict[str, float]:
    """verl's ``test_score/<source>`` (mean over rows of the row's mean) and ``pass@<n>/<source>``."""
    out: dict[str, float] = {}
    for source, rows in sorted(by_source.items()):
        scored = [row for row in rows if row]
        n = max((len(row) for row in scored), default=0)
        out[f"test_score/{source}"] = sum(sum(row) / len(row) for row in scored) / max(len(scored), 1)
        out[f"pass@{n}/{source}"] = sum(max(row) >= 1.0 for row in scored) / max(len(scored), 1)
    return out


def run_eval(cfg: DictConfig) -> dict[str, float]:
    result = metrics(score_rows(cfg))
    print(result, flush=True)
    if cfg.data.output_path:
        out = Path(str(cfg.data.output_path)).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return entry_main(argv, MODULE, __doc__, load_eval_config, run_eval)


if __name__ == "__main__":
    sys.exit(main())
