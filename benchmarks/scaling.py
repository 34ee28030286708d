"""How rlfoundry's step time grows with the work: response length, prompts per step, worker processes.

    python -m benchmarks.scaling                                   # all three sweeps
    python -m benchmarks.scaling --sweep length --lengths 32 64 128 256 512
    python -m benchmarks.scaling --sweep prompts --prompts 8 16 32 64 128
    python -m benchmarks.scaling --sweep workers --workers 1 2     # Ray back end, 1 vs 2 processes
    python -m benchmarks.scaling --frameworks rlfoundry floor      # the floor alongside

Each point is the shared workload (``benchmarks/common.py``) with one knob changed. Besides
s/step and tokens/s, each row shows how much the step time grew relative to the first point and
how much the generated tokens grew: "cost/tokens" = (time growth) / (token growth) should stay at
or below 1 (the cost grows no faster than the tokens do). The worker sweep runs rlfoundry with
``trainer.worker_backend=ray trainer.n_gpus_per_node=K`` (each worker one process, each process
``--threads`` threads; on a 2-core machine K=2 uses both cores). Writes
``benchmarks/results/scaling.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    Workload,
    add_workload_args,
    format_table,
    interleaved_runs,
    median_row,
    prepare,
    save_results,
    workload_from_args,
)

COLUMNS = [
    ("framework", "framework", ""), ("point", "point", ""), ("s/step", "step_s", ".3f"),
    ("tok/step", "gen_tokens_per_step", ".0f"), ("gen tok/s", "gen_tokens_per_s", ".0f"),
    ("samples/s", "samples_per_s", ".2f"), ("time x", "time_growth", ".2f"), ("tokens x", "token_growth", ".2f"),
    ("cost/tokens", "cost_per_token_growth", ".2f"), ("peak RSS MB", "peak_rss_mb", ".0f"),
    ("tree RSS MB", "peak_tree_rss_mb", ".0f"), ("tree PSS MB", "peak_tree_pss_mb", ".0f"),
]


def sweep_points(sweep: str, base: Workload, a: argparse.Namespace) -> list[tuple[str, Workload]]:
    if sweep == "length":
        return [(f"len={v}", base.replace(max_response_length=v)) for v in a.lengths]
    if sweep == "prompts":
        return [(f"P={v}", base.replace(prompts_per_step=v)) for v in a.prompts]
    return [(f"ray x{k}", base.replace(rlfoundry_backend="ray", rlfoundry_workers=k)) for k in a.workers]


def run_sweep(sweep: str, base: Workload, a: argparse.Namespace) -> list[dict[str, Any]]:
    frameworks = ["rlfoundry"] if sweep == "workers" else a.frameworks  # the others have no Ray back end
    rows: list[dict[str, Any]] = []
    first: dict[str, dict] = {}
    for label, w in sweep_points(sweep, base, a):
        runs = interleaved_runs(frameworks, w, prepare(w, a.work_dir), a.repeats, a.work_dir / "runs",
                                label=f"scaling-{sweep}-{label.replace('=', '').replace(' ', '')}", timeout_s=a.timeout)
        for fw, fw_runs in runs.items():
            row = {"framework": fw, "point": label, "workload": w.to_json(), **median_row(fw_runs)}
            if "error" not in row:
                ref = first.setdefault(fw, row)
                row["time_growth"] = row["step_s"] / ref["step_s"]
                row["token_growth"] = row["gen_tokens_per_step"] / ref["gen_tokens_per_step"]
                row["cost_per_token_growth"] = row["time_growth"] / row["token_growth"]
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweeps = ["length", "prompts", "workers"]
    p.add_argument("--sweep", nargs="+", default=sweeps, choices=sweeps)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--prompts", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--response-length", type=int, default=64, help="for the prompts and workers sweeps")
    p.add_argument("--frameworks", nargs="+", default=["rlfoundry"], choices=["rlfoundry", "trl", "floor"])
    add_workload_args(p, Workload(steps=3))
    p.set_defaults(repeats=1)
    a = p.parse_args(argv)
    base = workload_from_args(a, max_response_length=a.response_length)
    results = {}
    for sweep in a.sweep:
        results[sweep] = run_sweep(sweep, base, a)
        print(f"\n== scaling: {sweep} ({base.steps} steps, {base.warmup_steps} warm-up excluded, "
              f"{a.repeats} run(s) each)")
        print(format_table(results[sweep], COLUMNS))
        for row in results[sweep]:
            if "error" in row:
                print(f"  {row['framework']} {row['point']} FAILED: {row['error'][:1500]}")
    path = save_results("scaling", {"base_workload": base.to_json(), "sweeps": results}, a.results_dir)
    print(f"\nsaved {path}")
    return {"sweeps": results, "path": str(path)}


if __name__ == "__main__":
    main()
