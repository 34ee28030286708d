"""rlfoundry vs TRL's GRPOTrainer vs the hand-written floor, on the same GRPO workload.

    python -m benchmarks.vs_trl                                  # response lengths 64 and 256
    python -m benchmarks.vs_trl --response-lengths 64 --steps 4 --repeats 3
    python -m benchmarks.vs_trl --frameworks rlfoundry floor     # = benchmarks.floor_vs_rlfoundry

For each response length, every framework runs ``--repeats`` times in its own process, the order
rotating each round (so slow drift of a shared machine hits all alike); medians are reported, and
the ratios are taken per round (same machine state) and then their median. Definitions of each
figure (start-up exclusion, peak RSS, ...) are in ``benchmarks/common.py``. Prints one table per
response length and writes ``benchmarks/results/<name>.json``.

Targets (issue 6, same-run ratios on a 2-core CPU): samples/s ≥ 2.0× TRL, step time ≤ 1.15× the
floor, memory ≤ TRL's (peak tree PSS, printed with tree RSS alongside), and an equal-or-better
final reward.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    MISMATCH_COLUMNS,
    add_workload_args,
    format_table,
    interleaved_runs,
    median_row,
    paired_ratios,
    prepare,
    save_results,
    workload_from_args,
)

COLUMNS = [
    ("framework", "framework", ""),
    ("s/step", "step_s", ".3f"),
    ("gen tok/s", "gen_tokens_per_s", ".0f"),
    ("samples/s", "samples_per_s", ".2f"),
    ("tok/step", "gen_tokens_per_step", ".0f"),
    ("peak RSS MB", "peak_rss_mb", ".0f"),
    ("tree RSS MB", "peak_tree_rss_mb", ".0f"),
    ("tree PSS MB", "peak_tree_pss_mb", ".0f"),
    ("start-up s", "startup_s", ".1f"),
    ("reward 1st", "reward_first", ".3f"),
    ("reward last", "reward_last", ".3f"),
    *MISMATCH_COLUMNS,
    ("runs ok", "ok_runs", "d"),
]


def compare(frameworks: Sequence[str], a: argparse.Namespace, response_length: int) -> dict[str, Any]:
    """All frameworks at one response length: per-run rows, medians and same-round ratios."""
    w = workload_from_args(a, max_response_length=response_length)
    prepared = prepare(w, a.work_dir)
    runs = interleaved_runs(frameworks, w, prepared, a.repeats, a.work_dir / "runs", label=f"len{response_length}",
                            timeout_s=a.timeout)
    medians = {fw: median_row(rows) for fw, rows in runs.items()}
    ratios: dict[str, Any] = {}
    if "rlfoundry" in runs:
        for other, key, name in (("trl", "samples_per_s", "rlfoundry/trl samples_per_s"),
                                 ("trl", "gen_tokens_per_s", "rlfoundry/trl gen_tokens_per_s"),
                                 ("trl", "peak_rss_mb", "rlfoundry/trl peak_rss_mb"),
                                 ("trl", "peak_tree_rss_mb", "rlfoundry/trl peak_tree_rss_mb"),
                                 ("trl", "peak_tree_pss_mb", "rlfoundry/trl peak_tree_pss_mb"),
                                 ("floor", "step_s", "rlfoundry/floor step_s"),
                                 ("floor", "gen_tokens_per_s", "rlfoundry/floor gen_tokens_per_s")):
            if other in runs:
                ratios[name] = paired_ratios(runs["rlfoundry"], runs[other], key)
    return {"workload": w.to_json(), "medians": medians, "ratios": ratios, "runs": runs}


def print_comparison(result: dict[str, Any]) -> None:
    w = result["workload"]
    print(f"\n== response length {w['max_response_length']}: {w['prompts_per_step']} prompts x n={w['n']} per step, "
          f"{w['steps']} steps ({w['warmup_steps']} warm-up excluded), {w['threads']} thread(s), "
          f"medians of {max(m.get('ok_runs', 0) for m in result['medians'].values())} runs")
    rows = [{"framework": fw, **m} for fw, m in result["medians"].items()]
    print(format_table(rows, COLUMNS))
    ratios = result["ratios"]
    # memory: tree PSS is the target (shared library pages counted once), tree RSS shown beside it
    tree_rss = ratios.get("rlfoundry/trl peak_tree_rss_mb")
    memory_target = "<= 1.0" + (f"; tree RSS {tree_rss['median']:.2f}x" if tree_rss else "")
    targets = {"rlfoundry/trl samples_per_s": ">= 2.0", "rlfoundry/floor step_s": "<= 1.15",
               "rlfoundry/trl peak_tree_pss_mb": memory_target}
    for name, r in ratios.items():
        if r:
            target = f"  (target {targets[name]})" if name in targets else ""
            print(f"  {name}: {r['median']:.2f}x  [per-round {', '.join(f'{x:.2f}' for x in r['per_repeat'])}]{target}")
    for fw, m in result["medians"].items():
        if "error" in m:
            print(f"  {fw} FAILED: {m['error'][:1500]}")
        elif m.get("tree_pss_source", "smaps_rollup") != "smaps_rollup":
            print(f"  {fw}: tree PSS is {m['tree_pss_source']}: it counts shared pages once per process")


def main(argv: Sequence[str] | None = None, default_frameworks: Sequence[str] = ("rlfoundry", "trl", "floor"),
         name: str = "vs_trl") -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--response-lengths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--frameworks", nargs="+", default=list(default_frameworks), choices=["rlfoundry", "trl", "floor"])
    p.add_argument("--name", default=name, help="results file name (benchmarks/results/<name>.json)")
    add_workload_args(p)
    a = p.parse_args(argv)
    results = [compare(a.frameworks, a, length) for length in a.response_lengths]
    for result in results:
        print_comparison(result)
    path = save_results(a.name, {"frameworks": a.frameworks, "results": results}, a.results_dir)
    print(f"\nsaved {path}")
    return {"results": results, "path": str(path)}


if __name__ == "__main__":
    main()
