"""Synchronous vs one-step-off vs fully asynchronous training, same model, prompts and process count.

    python -m benchmarks.async_pipelines                         # both workloads, 2 repeats
    python -m benchmarks.async_pipelines --workloads warm --repeats 1 --modes sync fully_async

Every mode runs through the CLI, as a user would, on the machine's 2 cores: ``sync`` = the colocated
hybrid engine on 2 data-parallel ranks (process back end, 1 thread each); ``one_step_off``,
``fully_async`` (staleness 0.5) and ``fully_async_s1`` (staleness 1) = 1 trainer process + 1 rollout
process (their packaged overlays); and, outside the issue's comparison, ``sync_one_rank`` = one
process with 2 threads (no data-parallel collectives). Workloads:

- ``warm``: the packaged, SFT-warm-started arithmetic policy on the synthetic task (the default run's
  workload: responses vary between "85" and "The answer is 85."), 16 prompts × 8, 30 steps,
  validation every 10 steps — the learning curve per sample trained.
- ``shape``: Qwen2.5-0.5B's layer shape (hidden 896, MLP 4864, 14 heads / 2 KV heads, ``--layers``),
  random weights, 4 prompts × 4, 32-token responses — throughput only.

Per run, from the steps after the first: samples/s and trained tokens/s; the phase times the
pipeline overlaps (R = the rollout pool's generation time per step, T = the trainer's time per step
outside waiting for samples and the weight sync, S = the sync); the **overlap bound** max(R, T) + S
(what a pipeline on separate processes cannot beat) and the share of it reached — and, where the
staleness rule lets only a fraction a of the next batch be generated before a sync, the rule's own
bound max(T, a·R) + S + (1 − a)·R; staleness and
IS-weight statistics; validation accuracy by samples trained. Step times exclude validation and
checkpoints in every mode. Ratios are paired within a repeat (modes alternate in each). Writes
``benchmarks/results/async_pipelines.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, environment, save_results

# mode -> (config name, overrides, torch threads per process)
MODES = {
    "sync": (None, ["trainer.worker_backend=process", "trainer.n_gpus_per_node=2"], 1),
    "one_step_off": ("one_step_off_ppo_trainer", [], 1),
    "fully_async": ("fully_async_ppo_trainer", ["async_training.staleness_threshold=0.5"], 1),
    "fully_async_s1": ("fully_async_ppo_trainer", ["async_training.staleness_threshold=1.0"], 1),
    # not in the comparison: one process using both cores, no data-parallel collectives
    "sync_one_rank": (None, ["trainer.worker_backend=local", "trainer.n_gpus_per_node=1"], 2),
}
# how far ahead of the sync each pipeline may generate, in batches (one-step-off: the whole next one)
AHEAD = {"one_step_off": 1.0, "fully_async": 0.5, "fully_async_s1": 1.0}
VAL_KEY = "val-core/rlfoundry/arithmetic/reward/mean@1"


def workload_args(name: str, layers: int, model_dir: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Overrides common to every mode, and the ones each mode needs for the same batch shape."""
    if name == "warm":
        common = ["trainer.total_training_steps=30", "trainer.test_freq=10", "data.train_batch_size=16",
                  "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
        fully = ["async_training.require_batches=2", "data.gen_batch_size=4"]
        return common, {"fully_async": fully, "fully_async_s1": fully}
    common = [f"actor_rollout_ref.model.path={model_dir}", "trainer.total_training_steps=4", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_response_length=32",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    fully = ["async_training.require_batches=1", "data.gen_batch_size=2"]
    return common, {"fully_async": fully, "fully_async_s1": fully}


def shape_model(layers: int, cache: Path) -> Path:
    path = cache / f"qwen2.5-0.5b-shape-l{layers}"
    if not (path / "config.json").is_file():
        code = ("import sys; from rlfoundry.models.tiny import save_tiny_model; save_tiny_model(sys.argv[1], "
                "hidden_size=896, num_layers=int(sys.argv[2]), num_heads=14, num_kv_heads=2, intermediate_size=4864)")
        subprocess.run([sys.executable, "-c", code, str(path), str(layers)], check=True, cwd=REPO_ROOT)
    return path


def run_mode(mode: str, common: list[str], extra: list[str], run_dir: Path) -> list[dict[str, Any]]:
    config, keys, threads = MODES[mode]
    cmd = [sys.executable, "-m", "rlfoundry", "train", *(["--config-name", config] if config else []),
           *common, *keys, *extra, f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1",
           "trainer.logger=file"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**_env(), "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def summarize(mode: str, records: list[dict[str, Any]], samples_per_step: int) -> dict[str, Any]:
    steps = [r for r in records if "timing_s/step" in r][1:]  # the first step warms up
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steps)  # noqa: E731
    step_s = mean("timing_s/step")
    sync_s = mean("timing_s/sync_weights")
    if mode.startswith("sync"):
        rollout_s, train_s = mean("timing_s/gen"), step_s - mean("timing_s/gen")
    elif mode == "one_step_off":
        rollout_s, train_s = mean("timing_s/rollout_gen"), step_s - mean("timing_s/gen") - sync_s
    else:
        rollout_s = mean("timing_s/rollouter_gen")
        train_s = step_s - mean("timing_s/wait_rollout") - mean("timing_s/wait_rollout_pause") - sync_s
    bound = max(rollout_s, train_s) + sync_s if not mode.startswith("sync") else step_s
    # the staleness rule's own bound: a fraction a < 1 of the next batch may be generated before the
    # sync, the rest only after it, while the trainer waits
    ahead = min(1.0, AHEAD.get(mode, 1.0))
    rule_bound = max(train_s, ahead * rollout_s) + sync_s + (1 - ahead) * rollout_s if mode in AHEAD else step_s
    val = {r["step"] * samples_per_step: r[VAL_KEY] for r in records if VAL_KEY in r}
    return {
        "mode": mode, "step_s": step_s, "samples_per_s": samples_per_step / step_s,
        "tokens_per_s": mean("perf/total_num_tokens") / step_s, "rollout_s": rollout_s, "train_s": train_s,
        "sync_s": sync_s, "overlap_bound_s": bound, "of_bound": bound / step_s, "rule_bound_s": rule_bound,
        "of_rule_bound": rule_bound / step_s,
        "staleness_mean": mean("async/staleness_mean"), "staleness_max": max((r.get("async/staleness_max", 0)
                                                                              for r in steps), default=0),
        "is_weight_mean": mean("rollout_corr/rollout_is_mean") if not mode.startswith("sync") else None,
        "is_weight_max": max((r.get("rollout_corr/rollout_is_max", 0) for r in steps), default=0),
        "val_by_samples": val,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["warm", "shape"], choices=["warm", "shape"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="layers of the 0.5B-shape model")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="which modes to run (the ratios need sync among them)")
    a = p.parse_args(argv)
    started, results = time.time(), {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.workloads:
            model = shape_model(a.layers, Path(tmp)) if name == "shape" else Path()
            common, per_mode = workload_args(name, a.layers, model)
            samples = 16 * 8 if name == "warm" else 4 * 4
            rows = []
            for repeat in range(a.repeats):
                for mode in a.modes:
                    records = run_mode(mode, common, per_mode.get(mode, []), Path(tmp) / f"{name}-{mode}-{repeat}")
                    rows.append({"repeat": repeat, **summarize(mode, records, samples)})
                    print(json.dumps({"workload": name, **rows[-1]}, default=str), flush=True)
            results[name] = {"runs": rows, "ratios": _ratios(rows)}
    payload = {"environment": environment(), "argv": sys.argv, "wall_s": time.time() - started, "results": results}
    print(f"wrote {save_results('async_pipelines', payload)}")
    return payload


def _ratios(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """samples/s of each mode over the synchronous 2-rank run of the same repeat."""
    out: dict[str, list[float]] = {}
    for mode in MODES:
        if mode == "sync":
            continue
        for r in (r for r in rows if r["mode"] == mode and any(b["mode"] == "sync" for b in rows)):
            base = next(b for b in rows if b["mode"] == "sync" and b["repeat"] == r["repeat"])
            out.setdefault(mode, []).append(r["samples_per_s"] / base["samples_per_s"])
    return out


if __name__ == "__main__":
    main()
