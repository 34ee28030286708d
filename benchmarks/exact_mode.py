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
prints torch.profiler's top ops of one exact forward and one exact decode. ``--before REV``: a third copy
converted by ``models/batch_invariant.py`` as it was at git revision REV (loaded beside the current one, its
attention registered under another name), so that a change's before and after run in the same pairs (who
goes first rotating over the three); reported as well: after / before, and whether both give the same bits.

``--steps N``: the whole default job's GRPO step instead (the schema's defaults: the arithmetic policy, 16
prompts × 8 samples, 16 response tokens), one real trainer per variant in this process
(``trainer.worker_backend=local``): normal (the default: the CPU kernels on), plain (``model.cpu_kernels=off``,
the path exact mode replaces) and exact (``rollout.exact_log_probs=true``), one step of each in turn (the
order rotating) for 2 untimed rounds and N timed ones; reported: each round's exact / normal and exact /
plain ratios of ``timing_s/step`` and its phases, their medians. With ``--before REV`` a fourth trainer, exact too,
built first and its models converted again by REV's kernels (``_kernels_before``), joins the rotation: reported as
well, before / normal and exact / before. Writes ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import rlfoundry
from benchmarks.common import save_results

POLICY = Path(rlfoundry.__file__).resolve().parent / "assets" / "arithmetic-policy"


def _models():
    from transformers import AutoModelForCausalLM

    from rlfoundry.models.batch_invariant import apply_exact

    plain = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32, attn_implementation="sdpa")
    exact = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    apply_exact(exact)
    return plain.eval(), exact.eval()


def _kernels_before(rev: str):
    """``models/batch_invariant.py`` at git revision ``rev``, loaded as a module of its own (its attention
    registered as ``rlfoundry_exact_before`` once applied)."""
    import importlib.util
    import subprocess
    import tempfile

    root = Path(rlfoundry.__file__).resolve().parent.parent
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:rlfoundry/models/batch_invariant.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "batch_invariant_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("batch_invariant_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ATTENTION = "rlfoundry_exact_before"
    return module


def _model_before(rev: str):
    """The policy converted by ``models/batch_invariant.py`` at git revision ``rev`` (``_kernels_before``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    _kernels_before(rev).apply_exact(model)
    return model.eval()


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


VARIANTS = {"normal": [], "plain": ["actor_rollout_ref.model.cpu_kernels=off"],
            "exact": ["actor_rollout_ref.rollout.exact_log_probs=true"]}
PHASES = ("step", "gen", "old_log_prob", "update_actor")


def _job_steps(rounds: int, work: Path, before: str = "") -> dict:
    import gc

    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_trainer

    base = [f"trainer.total_training_steps={rounds + 2}", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.logger=file", "trainer.worker_backend=local"]
    variants = dict(VARIANTS, before=VARIANTS["exact"]) if before else VARIANTS
    trainers = {}
    if before:  # built first, alone: every exact model in the process is its own, converted again by REV's kernels
        trainers["before"] = build_trainer(load_config(base + [f"trainer.default_local_dir={work / 'before'}"]
                                                       + variants["before"]))
        kernels = _kernels_before(before)
        models = [m for m in gc.get_objects() if isinstance(m, torch.nn.Module) and getattr(m, "_rlf_exact", False)]
        for model in models:
            kernels.apply_exact(model)
        print(f"before: {len(models)} exact model(s) converted by {before}'s kernels", flush=True)
    trainers.update({v: build_trainer(load_config(base + [f"trainer.default_local_dir={work / v}"] + extra))
                     for v, extra in VARIANTS.items()})
    timed = []
    try:
        for r in range(rounds + 2):
            row = {}
            names = list(trainers)
            for v in names[r % len(names):] + names[: r % len(names)]:  # who goes first rotates
                t = trainers[v]
                t.state.global_steps += 1
                metrics = t.train_step()
                row[v] = {p: float(metrics.get(f"timing_s/{p}", 0.0)) for p in PHASES}
                row[v]["rollout_probs_diff_max"] = float(metrics.get("training/rollout_probs_diff_max", float("nan")))
            if r >= 2:
                timed.append(row)
                print(f"round {len(timed)}: " + ", ".join(f"{v} {x['step']:.3f} s" for v, x in row.items()), flush=True)
    finally:
        for t in trainers.values():
            t.source.close()
    out = {"rounds": timed, "ratios": {}}
    pairs = [("exact", "normal"), ("exact", "plain")] + ([("before", "normal"), ("exact", "before")] if before else [])
    for top, base_v in pairs:
        out["ratios"][f"{top}/{base_v}"] = {
            p: {"median": statistics.median(row[top][p] / row[base_v][p] for row in timed),
                "min": min(row[top][p] / row[base_v][p] for row in timed),
                "max": max(row[top][p] / row[base_v][p] for row in timed)} for p in PHASES}
    out["median_s"] = {v: {p: statistics.median(row[v][p] for row in timed) for p in PHASES} for v in trainers}
    for v, m in out["median_s"].items():
        print(f"{v:7s} " + "  ".join(f"{p} {m[p]:.3f} s" for p in PHASES))
    for name, r in out["ratios"].items():
        print(f"{name:13s} " + "  ".join(f"{p} {r[p]['median']:.2f}x ({r[p]['min']:.2f}-{r[p]['max']:.2f})"
                                          for p in PHASES))
    for v in ("exact", "before") if before else ("exact",):
        print(f"{v} rollout_probs_diff_max over the rounds:", max(row[v]["rollout_probs_diff_max"] for row in timed))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=9)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--steps", type=int, default=0, help="timed rounds of the whole default job's step (0: the phases)")
    p.add_argument("--name", default="exact_mode")
    p.add_argument("--before", default="", help="git revision whose exact kernels run as another side (with --steps: "
                   "a second exact trainer whose models they convert again)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.steps:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = _job_steps(a.steps, Path(tmp), a.before)
        load = os.getloadavg()
        print(f"threads {a.threads}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        save_results(a.name, {"threads": a.threads, "steps": a.steps, "before": a.before, "load_average": load, **out})
        return
    plain, exact = _models()
    sides = {"plain": plain, "exact": exact}
    if a.before:
        sides["before"] = _model_before(a.before)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (a.rows, a.tokens), generator=g)
    prompt, steps = ids[:, : a.tokens // 2], a.tokens - a.tokens // 2
    if a.profile:
        _profile(exact, ids, prompt, steps)
    phases = {"forward": lambda m: _forward(m, ids), "forward+backward": lambda m: _update(m, ids),
              "decode": lambda m: _decode(m, prompt, steps)}
    for fn in phases.values():  # warm-up, every side
        for model in sides.values():
            fn(model)
    if a.before:
        same = {name: torch.equal(fn(exact), fn(sides["before"])) for name, fn in phases.items() if name != "forward+backward"}
        print("same bits as --before:", same)
    rows = {}
    for name, fn in phases.items():
        ratios, after_before, times = [], [], {side: [] for side in sides}
        for i in range(a.pairs):
            names = list(sides)[i % len(sides):] + list(sides)[: i % len(sides)]  # who goes first rotates
            pair = {side: _timed(lambda: fn(sides[side])) for side in names}
            for side in pair:
                times[side].append(pair[side])
            ratios.append(pair["exact"] / pair["plain"])
            if a.before:
                after_before.append(pair["exact"] / pair["before"])
        rows[name] = {"plain_s": statistics.median(times["plain"]), "exact_s": statistics.median(times["exact"]),
                      "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        r = rows[name]
        line = (f"{name:17s} plain {r['plain_s'] * 1e3:8.1f} ms  exact {r['exact_s'] * 1e3:8.1f} ms  "
                f"exact/plain median {r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}, {a.pairs} pairs)")
        if a.before:
            before = [t / p for t, p in zip(times["before"], times["plain"])]
            r.update(before_s=statistics.median(times["before"]), before_ratio_median=statistics.median(before),
                     after_before_median=statistics.median(after_before))
            line += (f"  before/plain {r['before_ratio_median']:.2f}x  after/before {r['after_before_median']:.2f}x "
                     f"({min(after_before):.2f}-{max(after_before):.2f})")
        print(line)
    load = os.getloadavg()
    print(f"threads {a.threads}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    save_results(a.name, {"threads": a.threads, "pairs": a.pairs, "rows": a.rows, "tokens": a.tokens,
                          "before": a.before, "load_average": load, "phases": rows})


if __name__ == "__main__":
    main()
