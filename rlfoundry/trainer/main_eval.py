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

``data.output_path`` (rlfoundry's) also writes them as JSON. A scorer returning a dict gives its ``score``.
"""

from __future__ import annotations

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


def _score(fn: Callable, source: str, response: str, ground_truth: Any, where: str) -> float:
    from rlfoundry.rewards import UnknownDataSourceError

    try:
        out = fn(source, response, ground_truth)
    except UnknownDataSourceError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's scorer: say where it failed
        raise ConfigError(f"{where}: the reward function raised {type(e).__name__}: {e}") from e
    return float(out["score"] if isinstance(out, dict) else out)


def score_rows(cfg: DictConfig) -> dict[str, list[list[float]]]:
    """Each data source's rows, each row its responses' scores."""
    fn = _reward_fn(cfg)
    path, cols = _columns(cfg)
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    rows = zip(cols["data.response_key"], cols["data.data_source_key"], cols["data.reward_model_key"])
    for i, (responses, source, reward_data) in enumerate(rows):
        where = f"{path}, row {i}"
        if not isinstance(responses, list):
            raise ConfigError(f"{where}: column {cfg.data.response_key!r} (data.response_key) holds "
                              f"{type(responses).__name__}, not a list of responses.")
        if not isinstance(reward_data, dict) or "ground_truth" not in reward_data:
            raise ConfigError(f"{where}: column {cfg.data.reward_model_key!r} (data.reward_model_key) has no "
                              "'ground_truth': it must be {'ground_truth': ...}, as the prompt data sets carry it.")
        by_source[str(source)].append([_score(fn, str(source), str(r), reward_data["ground_truth"], where)
                                       for r in responses])
    return by_source


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
