"""The plan for people (text) and for programs (JSON), and the changes that would make it fit, each
re-planned from the same command line plus its overrides."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlfoundry.plan.build import Plan
from rlfoundry.plan.hardware import GIB
from rlfoundry.plan.timing import HBM_EFFICIENCY


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Fix:
    why: str
    overrides: tuple[str, ...]
    plan: Plan


def verdict(plan: Plan) -> str:
    """One line: fits or not, by how much, on which rank and in which phase."""
    pool, phase = plan.worst
    room = plan.headroom_bytes
    state = f"fits with {gib(room)} to spare" if room >= 0 else f"DOES NOT FIT: short by {gib(-room)}"
    if room >= 0 and plan.problems:
        state = f"DOES NOT START ({len(plan.problems)} problem(s) below), memory has {gib(room)} to spare"
    return (f"{state} — {pool.name}, {pool.rank_label}, peak in phase '{phase.name}': "
            f"{gib(phase.total)} of {gib(plan.capacity_bytes)}")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _header(plan: Plan) -> str:
    m, lay = plan.model, plan.layout
    moe = f", {m.experts} experts top-{m.experts_per_token}" if m.is_moe else ""
    par = ", ".join(f"{k}={v}" for k, v in lay["actor"].items() if v != 1) or "dp=1"
    return (f"model {m.name or '?'}: {_count(lay['params_total'])} parameters ({_count(lay['params_active'])} active"
            f"{moe}); {lay['ranks']} × {plan.hardware.name}; actor layout {par}; rollout tp={lay['rollout_tp']}"
            f"{'; rollout on its own pool' if lay['separate_rollout_pool'] else ''}")


def breakdown_lines(plan: Plan) -> list[str]:
    """Each pool's phases, and the peak phase item by item."""
    lines = []
    for pool in plan.pools:
        lines.append(f"{pool.name} ({pool.ranks} ranks), {pool.rank_label}:")
        lines += [f"  {p.name:<16} {gib(p.total):>12}" for p in pool.phases]
        peak = pool.peak
        lines.append(f"  peak '{peak.name}':")
        lines += [f"    {k:<28} {gib(v):>12}" for k, v in sorted(peak.device.items(), key=lambda kv: -kv[1])]
        if peak.host:
            lines.append(f"    offloaded to host: {gib(sum(peak.host.values()))} per rank")
    return lines


def render(plan: Plan, fixes: list[Fix] | None = None) -> str:
    lines = [_header(plan), "", "verdict: " + verdict(plan)] + [f"  problem: {p}" for p in plan.problems]
    lines += [""] + breakdown_lines(plan)
    lines += ["", f"time per step (lower bounds: training at the stated MFU, decode at {HBM_EFFICIENCY:.0%} of HBM "
                  "bandwidth):"]
    lines += [f"  {k:<16} {v:>10.2f} s" for k, v in plan.times.items()]
    lines += ["", "assumptions:"] + [f"  - {a}" for a in plan.assumptions]
    if fixes is not None and not plan.fits:
        lines += ["", "changes that make it fit (each re-planned):" if fixes else
                  "no single change or combination tried makes it fit: add GPUs (trainer.nnodes) or a larger device"]
        lines += [f"  - {' '.join(f.overrides)}\n      ({f.why}) → {verdict(f.plan)}" for f in fixes]
    return "\n".join(lines)


def to_json(plan: Plan, fixes: list[Fix] | None = None) -> dict[str, Any]:
    pool, phase = plan.worst
    return {
        "model": {"name": plan.model.name, **{k: plan.layout[k] for k in ("params_total", "params_active")}},
        "hardware": plan.hardware.__dict__, "layout": plan.layout,
        "fits": plan.fits, "verdict": verdict(plan), "problems": plan.problems, "headroom_bytes": plan.headroom_bytes, "capacity_bytes": plan.capacity_bytes,
        "worst": {"pool": pool.name, "rank": pool.rank_label, "phase": phase.name, "bytes": phase.total},
        "pools": [{"name": p.name, "ranks": p.ranks, "rank": p.rank_label,
                   "phases": [{"name": ph.name, "bytes": ph.total, "device": ph.device, "host": ph.host}
                              for ph in p.phases]} for p in plan.pools],
        "times_s": plan.times, "assumptions": plan.assumptions,
        "fixes": [{"overrides": list(f.overrides), "why": f.why, "fits": f.plan.fits,
                   "peak_bytes": f.plan.worst[1].total} for f in (fixes or [])],
    }


# ───────────────────────────────────── changes that would fit ─────────────────────────────────────


def _halvings(value: int, floor: int) -> list[int]:
    out, v = [], value // 2
    while v >= floor:
        out.append(v)
        v //= 2
    return out


def candidates(cfg: Any) -> list[tuple[str, list[list[str]]]]:
    """Changes to try, each as (why, override lists from mildest to strongest); the first list of
    each that fits is reported. Only changes that differ from the run's config are offered."""
    arr, out = cfg.actor_rollout_ref, []
    actor, model, ro = arr.actor, arr.model, arr.rollout
    k = "actor_rollout_ref"
    if not model.enable_gradient_checkpointing:
        out.append(("keep each layer's input only, recompute in backward", [[f"{k}.model.enable_gradient_checkpointing=true"]]))
    if not model.use_fused_kernels and actor.strategy == "fsdp":
        out.append(("log-probs from chunks of the LM head, never the whole logits", [[f"{k}.model.use_fused_kernels=true"]]))
    if actor.use_dynamic_bsz:
        seq = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
        out.append(("a smaller token budget per training micro-batch",
                    [[f"{k}.actor.ppo_max_token_len_per_gpu={v}"] for v in _halvings(int(actor.ppo_max_token_len_per_gpu), seq)]))
        out.append(("a smaller token budget per log-prob micro-batch",
                    [[f"{k}.rollout.log_prob_max_token_len_per_gpu={v}", f"{k}.ref.log_prob_max_token_len_per_gpu={v}"]
                     for v in _halvings(int(ro.log_prob_max_token_len_per_gpu), seq)]))
    else:
        out.append(("fewer sequences per training micro-batch (the same update: gradients accumulate)",
                    [[f"{k}.actor.ppo_micro_batch_size_per_gpu={v}"] for v in _halvings(int(actor.ppo_micro_batch_size_per_gpu or 1), 1)]))
        out.append(("fewer sequences per log-prob micro-batch",
                    [[f"{k}.rollout.log_prob_micro_batch_size_per_gpu={v}", f"{k}.ref.log_prob_micro_batch_size_per_gpu={v}"]
                     for v in _halvings(int(ro.log_prob_micro_batch_size_per_gpu or 1), 1)]))
    section = "megatron" if actor.strategy == "megatron" else "fsdp_config"
    offload = getattr(actor, section)
    if not (offload.param_offload and offload.optimizer_offload):
        out.append(("weights and optimizer state in host memory between uses",
                    [[f"{k}.actor.{section}.param_offload=true", f"{k}.actor.{section}.optimizer_offload=true",
                      f"{k}.ref.{section}.param_offload=true"]]))
    if ro.name != "hf" and not int(cfg.rollout.n_gpus_per_node):
        out.append(("a smaller share of the device for the rollout engine's KV cache",
                    [[f"{k}.rollout.gpu_memory_utilization={v}"] for v in (0.4, 0.3, 0.2) if v < ro.gpu_memory_utilization]))
    if ro.name != "hf" and actor.strategy == "fsdp" and not int(cfg.rollout.n_gpus_per_node):
        # the hybrid vLLM/SGLang engines hold the whole model on each GPU (rollout TP is not built); the HF
        # engine generates on the actor's own FSDP-sharded module, gathering a layer at a time
        out.append(("generate on the actor's sharded weights (the HF engine: slower, no second copy)",
                    [[f"{k}.rollout.name=hf"]]))
    if actor.strategy == "megatron":
        meg, per_node = actor.megatron, int(cfg.trainer.n_gpus_per_node)
        tps = [t for t in (2, 4, 8) if t > meg.tensor_model_parallel_size and per_node % t == 0]
        out.append(("more tensor parallelism", [[f"{k}.actor.megatron.tensor_model_parallel_size={t}",
                                                 f"{k}.ref.megatron.tensor_model_parallel_size={t}"] for t in tps]))
        eps = [e for e in (2, 4, 8, 16, 32, 64) if e > meg.expert_model_parallel_size]
        out.append(("more expert parallelism (MoE)", [[f"{k}.actor.megatron.expert_model_parallel_size={e}",
                                                       f"{k}.ref.megatron.expert_model_parallel_size={e}"] for e in eps]))
    nodes = int(cfg.trainer.nnodes)
    out.append(("more nodes: the same layout over more data-parallel ranks",
                [[f"trainer.nnodes={n}"] for n in (nodes * 2, nodes * 4, nodes * 8)]))
    return [(why, lists) for why, lists in out if lists]


def _score(plan: Plan) -> tuple[int, int]:
    """Lower is better: fewer start-up problems first, then a lower peak."""
    return len(plan.problems), plan.worst[1].total


def find_fixes(cfg: Any, replan: Callable[[list[str]], Plan | None]) -> list[Fix]:
    """Each candidate alone (its mildest setting that fits); when none fits alone, the candidates
    combined: in order, each one's setting that most improves the plan so far (more nodes excluded:
    more hardware is offered alone), then overrides the result fits without are dropped."""
    fixes = []
    for why, lists in candidates(cfg):
        for overrides in lists:
            plan = replan(overrides)
            if plan is not None and plan.fits:
                fixes.append(Fix(why, tuple(overrides), plan))
                break
    if fixes:
        return fixes
    combined: list[str] = []
    best = replan([])
    for why, lists in candidates(cfg):
        if lists[0][0].startswith("trainer.nnodes") or best is None:
            continue
        trials = [(p, o) for o in lists if (p := replan(combined + o)) is not None]
        if trials:
            plan, overrides = min(trials, key=lambda t: _score(t[0]))
            if _score(plan) < _score(best):
                best, combined = plan, combined + overrides
        if best.fits:
            return [_prune(combined, best, replan)]
    return []


def _prune(combined: list[str], plan: Plan, replan: Callable[[list[str]], Plan | None]) -> Fix:
    """Drop each override of a fitting combination that it still fits without (last added first)."""
    kept = list(combined)
    for override in reversed(combined):
        trial = [o for o in kept if o != override]
        smaller = replan(trial)
        if smaller is not None and smaller.fits:
            kept, plan = trial, smaller
    return Fix("these together", tuple(kept), plan)
