"""fp32 linear layers on the CPU: torch's default path (MKL sgemm) against oneDNN, side by side.

    python -m benchmarks.cpu_linear [--rows 1472 32 --threads 1 --repeats 200]
    python -m benchmarks.cpu_linear --rows 512 --repeats 5 --hidden-size 896 --intermediate-size 4864 \
        --heads 14 --kv-heads 2 --vocab-size 151936 --name cpu_linear_qwen2.5-0.5b

For every linear layer shape of the benchmark model (``Workload``: hidden 128, MLP 256, 4 heads,
2 KV heads, vocabulary 260; or the shape given) and each row count, times the three products a training step makes per
layer — forward ``x Wᵀ``, input gradient ``dy W`` and weight gradient ``dyᵀ x`` — with
``F.linear`` / ``@`` (what ``nn.Linear`` and autograd run) and with ``rlfoundry.cpu.linear``'s
oneDNN calls, alternating the two, and reports the medians, GFLOP/s and the ratio; then a whole
forward + backward of the layer as training runs it (``F.linear`` vs ``rlfoundry.cpu.linear.linear``, whose
fixed-size row blocks cost padding, copies and Python; below 256 rows it is ``F.linear`` itself). 1472 rows is one
rank's training micro-batch at response length 64 (23 rows × 64 tokens); 32 rows is a decode step.
Also checks that both give the same numbers (max relative difference). Writes
``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, format_table, save_results


def _shapes(hidden: int = 128, intermediate: int = 256, heads: int = 4, kv_heads: int = 2,
            vocab: int = 260) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each distinct linear layer of a Qwen2 decoder."""
    head_dim = hidden // heads
    return [("q_proj/o_proj", hidden, hidden), ("k_proj/v_proj", hidden, kv_heads * head_dim),
            ("gate_proj/up_proj", hidden, intermediate), ("down_proj", intermediate, hidden),
            ("lm_head", hidden, vocab)]


def _median_us(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median µs per call of each function, calls of the functions interleaved."""
    import torch

    for fn in fns.values():  # first calls build oneDNN's kernels; not measured
        for _ in range(10):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for _ in range(repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t) * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def measure(rows: int, k: int, n: int, repeats: int) -> dict[str, Any]:
    import torch

    from rlfoundry.cpu.linear import _onednn

    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen) for s in ((rows, k), (n, k), (rows, n)))
    products = {
        "fwd": (lambda: x @ w.t(), lambda: _onednn(x, w, None)),
        "dx": (lambda: dy @ w, lambda: _onednn(dy, w.t(), None)),
        "dW": (lambda: dy.t() @ x, lambda: _onednn(dy.t(), x.t(), None)),
    }
    row: dict[str, Any] = {"rows": rows, "in": k, "out": n}
    flops = 2 * rows * k * n
    for name, (aten, onednn) in products.items():
        t = _median_us({"aten": aten, "onednn": onednn}, repeats)
        a, b = aten(), onednn()
        row[f"{name}_aten_us"], row[f"{name}_onednn_us"] = t["aten"], t["onednn"]
        row[f"{name}_speedup"] = t["aten"] / t["onednn"]
        row[f"{name}_max_rel_diff"] = float((a - b).abs().max() / a.abs().max())
    row.update(_layer_pass(x, w, dy, repeats))
    row["aten_gflops"] = 3 * flops / sum(row[f"{p}_aten_us"] for p in products) / 1e3
    row["onednn_gflops"] = 3 * flops / sum(row[f"{p}_onednn_us"] for p in products) / 1e3
    return row


def _layer_pass(x, w, dy, repeats: int) -> dict[str, float]:
    """What training runs: forward + backward of ``F.linear`` against ``cpu_linear.linear``, which
    multiplies in fixed-size row blocks (padding, copies and Python included)."""
    import torch
    import torch.nn.functional as F

    from rlfoundry.cpu.linear import linear

    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def step(fn):
        def run():
            with torch.enable_grad():
                fn(xg, wg).backward(dy)
            xg.grad = wg.grad = None
        return run

    t = _median_us({"aten": step(F.linear), "rlfoundry": step(linear)}, repeats)
    return {"layer_aten_us": t["aten"], "layer_rlfoundry_us": t["rlfoundry"], "layer_speedup": t["aten"] / t["rlfoundry"]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1472, 32], help="rows (tokens) per product")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (one rank of the benchmark: 1)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per product and library")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="cpu_linear", help="results file name (benchmarks/results/<name>.json)")
    shape = p.add_argument_group("model shape (default: the benchmark model; Qwen2.5-0.5B is 896 4864 14 2 151936)")
    shape.add_argument("--hidden-size", type=int, default=128)
    shape.add_argument("--intermediate-size", type=int, default=256)
    shape.add_argument("--heads", type=int, default=4)
    shape.add_argument("--kv-heads", type=int, default=2)
    shape.add_argument("--vocab-size", type=int, default=260)
    a = p.parse_args(argv)
    import torch

    from rlfoundry.cpu.linear import onednn_available

    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN (torch.backends.mkldnn): nothing to compare")
    torch.set_num_threads(a.threads)
    rows = []
    for count in a.rows:
        for layer, k, n in _shapes(a.hidden_size, a.intermediate_size, a.heads, a.kv_heads, a.vocab_size):
            rows.append({"layer": layer, **measure(count, k, n, a.repeats)})
            print(f"[bench] {count} rows, {layer}: {rows[-1]['onednn_gflops']:.0f} vs {rows[-1]['aten_gflops']:.0f} GFLOP/s")
    columns = [("layer", "layer", ""), ("rows", "rows", "d"), ("in", "in", "d"), ("out", "out", "d"),
               ("fwd aten/oneDNN µs", "fwd", ""), ("dx µs", "dx", ""), ("dW µs", "dW", ""),
               ("aten GFLOP/s", "aten_gflops", ".0f"), ("oneDNN GFLOP/s", "onednn_gflops", ".0f"),
               ("speed-up fwd/dx/dW", "speedup", ""), ("layer fwd+bwd aten/rlfoundry µs", "layer_pass", ""),
               ("layer speed-up", "layer_speedup", ".2f")]
    shown = [{**r, **{p: f"{r[p + '_aten_us']:.0f}/{r[p + '_onednn_us']:.0f}" for p in ("fwd", "dx", "dW")},
              "speedup": "/".join(f"{r[p + '_speedup']:.2f}" for p in ("fwd", "dx", "dW")),
              "layer_pass": f"{r['layer_aten_us']:.0f}/{r['layer_rlfoundry_us']:.0f}"} for r in rows]
    print(f"\n== fp32 linear, torch default (aten → MKL) vs oneDNN, {a.threads} thread(s), medians of {a.repeats}")
    print(format_table(shown, columns))
    worst = max(r[f"{p}_max_rel_diff"] for r in rows for p in ("fwd", "dx", "dW"))
    print(f"largest relative difference between the two libraries: {worst:.1e} (fp32 rounding)")
    payload = {"threads": a.threads, "repeats": a.repeats, "rows": rows, "max_rel_diff": worst,
               "model_shape": {k: getattr(a, k) for k in ("hidden_size", "intermediate_size", "heads", "kv_heads",
                                                           "vocab_size")}}
    print(f"saved {save_results(a.name, payload, a.results_dir)}")
    return payload


if __name__ == "__main__":
    main()
