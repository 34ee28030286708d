"""Where an rlfoundry GRPO step spends its time, from the trainer's own ``timing_s/*`` metrics.

    python -m benchmarks.phases [--response-length 64 --steps 4 --repeats 3 --frameworks rlfoundry floor trl]

Runs the shared workload (``benchmarks/common.py``) and prints, per phase (gen, reward,
old_log_prob, ref, values, adv, update_critic, update_actor), the median seconds per step, its
share of ``timing_s/step``, and the same phase in the floor and in TRL where they have it
(the floor: gen / reward / update; TRL: gen / reward+adv / update, measured by the runners).
"other" is step minus the listed phases (driver work between phases). Phases are medians over the
measured steps of each run, then over runs. Writes ``benchmarks/results/phases.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    add_workload_args,
    format_table,
    interleaved_runs,
    median_row,
    prepare,
    save_results,
    workload_from_args,
)

PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
# the other runners' phase names -> the trainer's
ALIASES = {"reward+adv": "reward"}


def phase_rows(medians: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per phase: rlfoundry seconds and share, and the other frameworks' seconds."""
    per_fw = {fw: {ALIASES.get(k, k): v for k, v in m.get("phases_s", {}).items()} for fw, m in medians.items()}
    rlf = per_fw.get("rlfoundry", {})
    step = rlf.get("step", 0.0)
    rows = []
    listed = [p for p in PHASES if p in rlf or any(p in f for f in per_fw.values())]
    for phase in [*listed, "other", "step"]:
        if phase == "other":
            values = {fw: f["step"] - sum(f.get(p, 0.0) for p in PHASES) for fw, f in per_fw.items() if "step" in f}
        else:
            values = {fw: f.get(phase) for fw, f in per_fw.items()}
        row = {"phase": phase, **{f"{fw}_s": v for fw, v in values.items()}}
        if values.get("rlfoundry") is not None and step:
            row["share"] = 100 * values["rlfoundry"] / step
        if values.get("rlfoundry") is not None and values.get("floor"):
            row["x_floor"] = values["rlfoundry"] / values["floor"]
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--frameworks", nargs="+", default=["rlfoundry", "floor"], choices=["rlfoundry", "trl", "floor"])
    add_workload_args(p)
    a = p.parse_args(argv)
    if "rlfoundry" not in a.frameworks:
        p.error("the phase breakdown is rlfoundry's: keep rlfoundry in --frameworks")
    w = workload_from_args(a, max_response_length=a.response_length)
    runs = interleaved_runs(a.frameworks, w, prepare(w, a.work_dir), a.repeats, a.work_dir / "runs",
                            label=f"phases-len{a.response_length}", timeout_s=a.timeout)
    medians = {fw: median_row(r) for fw, r in runs.items()}
    rows = phase_rows(medians)
    columns = [("phase", "phase", ""), ("rlfoundry s", "rlfoundry_s", ".3f"), ("% of step", "share", ".1f")]
    columns += [(f"{fw} s", f"{fw}_s", ".3f") for fw in a.frameworks if fw != "rlfoundry"]
    if "floor" in a.frameworks:
        columns.append(("rlfoundry/floor", "x_floor", ".2f"))
    print(f"\n== phase breakdown, response length {a.response_length}, {w.prompts_per_step} prompts x n={w.n}, "
          f"medians over {a.repeats} run(s) x {w.steps - w.warmup_steps} measured steps")
    print(format_table(rows, columns))
    for fw, m in medians.items():
        if "error" in m:
            print(f"  {fw} FAILED: {m['error'][:1500]}")
    path = save_results("phases", {"workload": w.to_json(), "rows": rows, "medians": medians, "runs": runs},
                        a.results_dir)
    print(f"\nsaved {path}")
    return {"rows": rows, "path": str(path)}


if __name__ == "__main__":
    main()
