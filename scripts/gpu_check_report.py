"""The summary of ``scripts/gpu_check.sh``: one line per part (verdict, time, figures) and a verdict.

    python scripts/gpu_check_report.py OUT WORK DEVICE

reads what the parts left (``WORK/parts.tsv``: name, exit code, seconds, limit; ``WORK/tier.xml``:
the GPU tier's JUnit report; ``WORK/demo/metrics.jsonl``: the calculator demo's metrics;
``OUT/realistic_<device>.json``: the benchmark's results; ``OUT/large_<device>.json``: the large-shape
runs against the planner) and writes ``OUT/summary.json`` and the
lines it prints (the script appends them to ``OUT/summary.txt``). A part passes when it exited 0 and
its own condition holds: the tier ran every test it collected without a failure (on CUDA at least
one passed: all skipped means CUDA was not seen), the demo logged validation and tool calls (on CUDA,
over its 10 steps, at least one call), the benchmark produced a samples/s figure for every framework,
each large-shape run measured its steps and the planner predicted them.
"""

from __future__ import annotations

import json
import math
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

VAL = "val-core/rlfoundry/arithmetic/reward/mean@1"
CALLS = "multi_turn/tool_calls/mean"


def read_parts(work: Path) -> dict[str, dict[str, Any]]:
    parts = {}
    path = work / "parts.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds, limit = line.split("\t")
        parts[name] = {"rc": int(rc), "seconds": int(seconds), "limit_s": int(limit)}
    return parts


def tier_figures(xml_path: Path, log_path: Path | None = None) -> dict[str, Any]:
    """Counts of the JUnit report and the names of the tests that passed, failed or were skipped. A
    tier stopped by its time limit writes no report: then the verbose log's result lines say how far
    it got (``unfinished``: the report was missing)."""
    failed, skipped, passed = [], [], []
    if xml_path.exists():
        for case in ET.parse(xml_path).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(name)
            elif case.find("skipped") is not None:
                skipped.append(name)
            else:
                passed.append(name)
    elif log_path is not None and log_path.exists():
        for path, test, outcome in re.findall(r"^(\S+?\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", log_path.read_text(), re.M):
            name = f"{Path(path).stem}::{test}"
            {"PASSED": passed, "SKIPPED": skipped}.get(outcome, failed).append(name)
    else:
        return {"error": "no JUnit report and no log (pytest did not run)"}
    return {"passed": len(passed), "failed": len(failed), "skipped": len(skipped), "failed_tests": failed,
            "passed_tests": passed, "skipped_tests": skipped, "unfinished": not xml_path.exists()}


def demo_figures(metrics: Path) -> dict[str, Any]:
    """Validation first -> last and the tool calls per trajectory of the first and last steps."""
    if not metrics.exists():
        return {"error": f"no metrics at {metrics}"}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    val = {r["step"]: r[VAL] for r in records if VAL in r}
    calls = [r[CALLS] for r in records if CALLS in r and "timing_s/step" in r]
    steps = [r["step"] for r in records if "timing_s/step" in r]
    if not val or not calls:
        return {"error": "the demo logged no validation or no tool calls"}
    first, last = min(val), max(val)
    return {"steps": max(steps), "val_first": val[first], "val_last": val[last], "val_steps": [first, last],
            "tool_calls_first": calls[0], "tool_calls_last": calls[-1], "tool_calls_max": max(calls)}


def bench_figures(result_json: Path) -> dict[str, Any]:
    """samples/s (and s/step) per framework and the rlfoundry/TRL ratio, per benchmarked shape."""
    if not result_json.exists():
        return {"error": f"no result file {result_json.name}"}
    data = json.loads(result_json.read_text())
    shapes = []
    for result in data.get("results", []):
        w = result.get("workload", {})
        rows = {r["framework"]: r for r in result.get("rows", [])}
        ratio = (result.get("ratios", {}).get("rlfoundry/trl samples_per_s") or {}).get("median")
        hf = result.get("hf_static_generate")
        errors = {fw: r["error"][:300] for fw, r in rows.items() if "error" in r}
        if hf and "error" in hf:
            errors["hf_static_generate"] = hf["error"][:300]
        shapes.append({"layers": w.get("num_layers"), "response_length": w.get("max_response_length"),
                       "samples_per_s": {fw: r.get("samples_per_s") for fw, r in rows.items()},
                       "errors": errors, "ratio": ratio,
                       **({"hf_static_generate": hf} if hf and "error" not in hf else {})})
    return {"device": data.get("peaks", {}).get("device_name") or data.get("peaks", {}).get("device"),
            "shapes": shapes}


def large_figures(result_json: Path) -> dict[str, Any]:
    """Per large-shape run (``benchmarks/large_shape.py``): its medians and their ratios to the plan, or its error."""
    if not result_json.exists():
        return {"error": f"no result file {result_json.name}"}
    runs = []
    for r in json.loads(result_json.read_text()).get("results", []):
        s, plan = r.get("summary", {}), r.get("plan", {})
        runs.append({"run": r.get("run"), "error": r.get("error", "")[:300], "device": r.get("device_name"),
                     **{k: s.get(k) for k in ("step_s", "tokens_per_s", "mfu_update", "mfu_step", "step_vs_plan",
                                              "update_vs_plan", "peak_memory_bytes", "plan_peak_bytes", "memory_vs_plan",
                                              "memory_source")},
                     "plan_step_s": (plan.get("times_s") or {}).get("step"), "plan_peak_phase": plan.get("peak_phase")})
    return {"runs": runs}


def _ok_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def judge(name: str, part: dict[str, Any], figures: dict[str, Any], device: str) -> tuple[bool, str]:
    """(passed, why not) for one part."""
    if part["rc"] in (124, 137):
        got = f" ({figures['passed']} passed, {figures['failed']} failed before)" if name == "tier" and "passed" in figures else ""
        return False, f"timed out after {part['limit_s']}s{got}"
    if part["rc"] != 0 and name != "tier":  # a failing test makes pytest exit 1: the counts say which
        return False, f"exit {part['rc']}"
    if "error" in figures:
        return False, figures["error"]
    if name == "tier":
        if figures["failed"]:
            return False, f"{figures['failed']} failed: {', '.join(figures['failed_tests'])}"
        if part["rc"] != 0:
            return False, f"pytest exit {part['rc']}"
        if device == "cuda" and not figures["passed"]:
            return False, "every test skipped: CUDA was not seen"
    if name == "demo" and device == "cuda" and not figures["tool_calls_max"] > 0:  # a dry run's step may call none
        return False, "no tool call in any step"
    if name in BENCHES:
        if not figures["shapes"]:
            return False, "no benchmark result"
        for shape in figures["shapes"]:
            if shape["errors"] or not all(_ok_number(v) for v in shape["samples_per_s"].values()):
                return False, f"a framework failed: {shape['errors'] or shape['samples_per_s']}"
    if name == "large":
        if not figures["runs"]:
            return False, "no large-shape run"
        for r in figures["runs"]:
            if r["error"] or not all(_ok_number(r[k]) for k in ("tokens_per_s", "plan_step_s", "plan_peak_bytes",
                                                                 "peak_memory_bytes")):
                return False, f"{r['run']}: {r['error'] or 'no measurement or no prediction'}"
    return True, ""


def describe(name: str, figures: dict[str, Any]) -> str:
    if "error" in figures:
        return ""
    if name == "tier":
        return f"{figures['passed']} passed, {figures['failed']} failed, {figures['skipped']} skipped"
    if name == "demo":
        return (f"validation {figures['val_first']:.3f} (step {figures['val_steps'][0]}) -> {figures['val_last']:.3f} "
                f"(step {figures['val_steps'][1]}), tool calls per trajectory {figures['tool_calls_first']:.2f} -> "
                f"{figures['tool_calls_last']:.2f}")
    if name in BENCHES:
        out = []
        for s in figures["shapes"]:
            per = ", ".join(f"{fw} {v:.2f}" for fw, v in s["samples_per_s"].items() if _ok_number(v))
            ratio = f", rlfoundry/TRL {s['ratio']:.2f}x" if _ok_number(s["ratio"]) else ""
            hf = s.get("hf_static_generate") or {}
            if "rlfoundry_ms_per_step" in hf:
                ratio += (f", decode {hf['rlfoundry_ms_per_step']:.2f} ms/step vs transformers' static-cache generate "
                          f"{hf['hf_static_ms_per_step']:.2f} ({hf['rlfoundry/hf_static gen time']:.2f}x its time)")
            out.append(f"{s['layers']} layers, {s['response_length']} tokens: samples/s {per}{ratio}")
        return "; ".join(out)
    if name == "large":
        return "; ".join(_describe_large(r) for r in figures["runs"])
    return ""


def _describe_large(r: dict[str, Any]) -> str:
    if r["error"] or not _ok_number(r["tokens_per_s"]):
        return f"{r['run']} failed"
    mfu = f", MFU update {r['mfu_update']:.1%}" if _ok_number(r["mfu_update"]) else ""
    return (f"{r['run']} {r['step_s']:.2f} s/step ({r['step_vs_plan']:.2f}x plan), {r['tokens_per_s']:,.0f} tok/s{mfu}, "
            f"peak {r['peak_memory_bytes'] / 2**30:.1f} GiB vs plan {r['plan_peak_bytes'] / 2**30:.1f} "
            f"({r['memory_vs_plan']:.2f}x)")


FIGURES = {"tier": lambda out, work, dev: tier_figures(work / "tier.xml", out / "tier.log"),
           "demo": lambda out, work, dev: demo_figures(work / "demo" / "metrics.jsonl"),
           "bench": lambda out, work, dev: bench_figures(out / f"realistic_{dev}.json"),
           "dynamic": lambda out, work, dev: bench_figures(out / f"realistic_dynamic_{dev}.json"),
           "vocab": lambda out, work, dev: bench_figures(out / f"realistic_vocab_{dev}.json"),
           "fused": lambda out, work, dev: bench_figures(out / f"realistic_fused_{dev}.json"),
           "wrapped": lambda out, work, dev: bench_figures(out / f"realistic_wrapped_{dev}.json"),
           "hfgen": lambda out, work, dev: bench_figures(out / f"realistic_hfgen_{dev}.json"),
           "large": lambda out, work, dev: large_figures(out / f"large_{dev}.json")}
BENCHES = ("bench", "dynamic", "vocab", "fused", "wrapped", "hfgen")


def report(out: Path, work: Path, device: str) -> tuple[dict[str, Any], list[str]]:
    parts, lines, summary = read_parts(work), [], {"device": device, "parts": {}}
    for name, part in parts.items():
        figures = FIGURES[name](out, work, device) if name in FIGURES else {}
        passed, why = judge(name, part, figures, device)
        summary["parts"][name] = {**part, "passed": passed, "why": why, "figures": figures}
        detail = describe(name, figures)
        verdict = "PASS" if passed else f"FAIL ({why})"
        lines.append(f"{name:6s} {verdict} in {part['seconds']}s (limit {part['limit_s']}s)"
                     + (f": {detail}" if detail else ""))
    summary["passed"] = bool(parts) and all(p["passed"] for p in summary["parts"].values())
    summary["total_s"] = sum(p["seconds"] for p in parts.values())
    n_pass = sum(p["passed"] for p in summary["parts"].values())
    lines.append(f"RESULT {'PASS' if summary['passed'] else 'FAIL'}: {n_pass}/{len(parts)} parts passed "
                 f"on {device} in {summary['total_s']}s")
    return summary, lines


def main(argv: list[str]) -> int:
    out, work, device = Path(argv[0]), Path(argv[1]), argv[2]
    summary, lines = report(out, work, device)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(lines))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
