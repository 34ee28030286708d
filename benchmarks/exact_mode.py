"""Exact mode's cost per phase: the arithmetic policy with plain HF ops against its exact copy, side by side.

    python -m benchmarks.exact_mode [--threads 1 --pairs 9 --rows 128 --tokens 32 --profile]

Two copies of the benchmark policy (``rlfoundry/assets/arithmetic-policy``: 4 layers, hidden 128, 4 heads,
2 KV heads, vocabulary 260) in one process, one plain (``sdpa``, ``nn.Linear``), one converted by
``models.batch_invariant.apply_exact``; per pair, the plain and the exact copy run the same phase one right
after the other (which goes first alternates), so a load that swings over minutes (the shared 2-core VM)
hits both sides of a pair alike; reported: the median over pairs of exact / plain, with the range.
Phases: a scoring forward of ``rows`` × ``tokens`` tokens (what ``compute_log_prob`` runs), the same forward
with its backward (the update), and a decode of ``rows`` rows from a ``tokens / 2``-token prompt for
``tokens / 2`` steps over a dynamic KV cache (the HF rollout's loop without sampling). ``--profile``
prints torch.profiler's top ops of one exact forward and one exact decode. Writes
``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import save_results

POLICY = Path(__file__).resolve().parent.parent / "rlfoundry" / "assets" / "arithmetic-policy"


def _models():
    from transformers import AutoModelForCausalLM

    from rlfoundry.models.batch_invariant import apply_exact

    plain = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32, attn_implementation="sdpa")
    exact = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    apply_exact(exact)
    return plain.eval(), exact.eval()


def _forward(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _update(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()


def _decode(model, ids, steps):
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for t in range(ids.shape[1], ids.shape[1] + steps):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, past_key_values=cache, use_cache=True,
                           position_ids=torch.full_like(token, t)).logits[:, -1]
    return logits


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _profile(exact, ids, prompt, steps) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("forward", lambda: _forward(exact, ids)), ("decode", lambda: _decode(exact, prompt, steps))):
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"--- exact {name}, {torch.get_num_threads()} thread(s)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=9)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--name", default="exact_mode")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    plain, exact = _models()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (a.rows, a.tokens), generator=g)
    prompt, steps = ids[:, : a.tokens // 2], a.tokens - a.tokens // 2
    if a.profile:
        _profile(exact, ids, prompt, steps)
    phases = {"forward": lambda m: _forward(m, ids), "forward+backward": lambda m: _update(m, ids),
              "decode": lambda m: _decode(m, prompt, steps)}
    for fn in phases.values():  # warm-up, both sides
        fn(plain), fn(exact)
    rows = {}
    for name, fn in phases.items():
        ratios, times = [], {"plain": [], "exact": []}
        for i in range(a.pairs):
            order = (("plain", plain), ("exact", exact)) if i % 2 == 0 else (("exact", exact), ("plain", plain))
            pair = {side: _timed(lambda: fn(model)) for side, model in order}
            for side in pair:
                times[side].append(pair[side])
            ratios.append(pair["exact"] / pair["plain"])
        rows[name] = {"plain_s": statistics.median(times["plain"]), "exact_s": statistics.median(times["exact"]),
                      "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        r = rows[name]
        print(f"{name:17s} plain {r['plain_s'] * 1e3:8.1f} ms  exact {r['exact_s'] * 1e3:8.1f} ms  "
              f"exact/plain median {r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}, {a.pairs} pairs)")
    load = os.getloadavg()
    print(f"threads {a.threads}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    save_results(a.name, {"threads": a.threads, "pairs": a.pairs, "rows": a.rows, "tokens": a.tokens,
                          "load_average": load, "phases": rows})


if __name__ == "__main__":
    main()
