"""Tokens/s of the HF rollout with and without the MTP draft (``model.mtp.enable_rollout``), side by side.

Builds the tiny MiMo (``models/mimo.save_tiny_mimo``) and its "good draft" variant from the tests
(``tests/workers/test_mtp_speculative._good_draft_mimo``: a target close to a bigram model and an MTP layer
computing that bigram), then times pairs of calls (plain, speculative) on the same prompts and reports the
median over pairs of each one's tokens/s and of their ratio, and the draft's acceptance rate. Which side
goes first alternates over the pairs, so a load that swings over minutes (the shared VM) hits both alike.

    python -m benchmarks.mtp_speculative [--pairs 5] [--k 1 2 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from rlfoundry.models.hf import load_hf_model
    from rlfoundry.models.mimo import save_tiny_mimo
    from rlfoundry.models.tiny import build_tokenizer
    from rlfoundry.workers.rollout.hf_rollout import HFRollout
    from tests.workers import make_prompts
    from tests.workers.test_mtp_speculative import _good_draft_mimo

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--response-length", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tokenizer = build_tokenizer()
    prompts = make_prompts(tokenizer, ["the quick brown fox", "12+7=", "hello world", "a"] * 2)
    with tempfile.TemporaryDirectory() as tmp:
        base = save_tiny_mimo(Path(tmp) / "random")
        dirs = {"random draft": base, "good draft": _good_draft_mimo(base, Path(tmp) / "good", 0.3)}
        print(f"{'draft':>12} {'mode':>7} {'k':>2} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'accept':>6}")
        for name, model_dir in dirs.items():
            model = load_hf_model(model_dir).eval()
            cfg = {"response_length": a.response_length, "n": 4, "ignore_eos": True, "seed": 1}
            plain = HFRollout(model, cfg, 0, 0)
            for k in a.k:
                spec = HFRollout(model, cfg, 0, 0, mtp_draft_path=model_dir, speculative_tokens=k)
                for mode, meta in (("greedy", {"do_sample": False}), ("sample", {"temperature": 1.0})):
                    rates, rows = [], []
                    for i in range(a.pairs + 1):  # the first pair warms up
                        pair = {}
                        for engine in ((plain, spec) if i % 2 else (spec, plain)):
                            data = prompts.select()
                            data.meta_info.update(meta)
                            start = time.perf_counter()
                            out = engine.generate_sequences(data)
                            pair[engine is spec] = float(out.batch["response_mask"].sum()) / (time.perf_counter() - start)
                            if engine is spec:
                                drafted = out.batch["mtp_draft_tokens"].sum()
                                rates.append(float(out.batch["mtp_accepted_tokens"].sum() / drafted))
                        rows.append((pair[False], pair[True]))
                    rows = rows[1:]
                    med = lambda xs: statistics.median(xs)  # noqa: E731
                    print(f"{name:>12} {mode:>7} {k:>2} {med([r[0] for r in rows]):>11.0f} {med([r[1] for r in rows]):>10.0f}"
                          f" {med([r[1] / r[0] for r in rows]):>6.2f} {med(rates[1:]):>6.2f}", flush=True)


if __name__ == "__main__":
    main()
