"""verl's batch-size arithmetic, once: what one data-parallel rank of a role gets per optimiser step.

verl's keys count a mini-batch in prompts (``ppo_mini_batch_size``) and a micro-batch in samples per
rank (``ppo_micro_batch_size_per_gpu``; the deprecated global ``ppo_micro_batch_size`` is divided
over the data-parallel ranks). The driver's start-up check and the workers call the same functions,
so they agree on every number and every message.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

__all__ = ["BatchSizeError", "RoleBatch", "per_gpu", "role_batch"]


class BatchSizeError(ValueError):
    """Batch sizes that cannot be split as asked; the message names the numbers that disagree."""


@dataclass(frozen=True)
class RoleBatch:
    mini_batch_size: int  # samples per optimiser step on one data-parallel rank
    micro_batch_size: int | None  # samples per forward/backward on one rank; None: token budgets decide


def per_gpu(per_gpu_size: int | None, global_size: int | None, dp_size: int) -> int | None:
    """A ``*_per_gpu`` size, or verl's deprecated global spelling divided over the ranks (at least 1)."""
    if per_gpu_size is not None or global_size is None:
        return per_gpu_size
    return max(1, int(global_size) // dp_size)


def role_batch(role: str, mini_prompts: int, n: int, dp_size: int, micro: int | None, dynamic: bool,
               require_micro: bool = False, micro_divides: bool = True) -> RoleBatch:
    """One role's per-rank sizes (``role``: its config key, for messages). ``dynamic``: use_dynamic_bsz,
    where token budgets cut the micro-batches and ``micro`` is not checked. ``require_micro``: a worker
    built without the driver (which fills in a default) must be told one. ``micro_divides``: refuse a
    micro-batch that does not divide the per-rank mini-batch (the driver's start-up rule)."""
    samples = mini_prompts * n
    if samples <= 0 or samples % dp_size:
        raise BatchSizeError(_uneven_split(role, mini_prompts, n, dp_size))
    per_rank = samples // dp_size
    if dynamic:
        return RoleBatch(per_rank, micro)
    if micro is None:
        if require_micro:
            raise BatchSizeError(f"set {role}.ppo_micro_batch_size_per_gpu (or {role}.use_dynamic_bsz=true with "
                                 f"{role}.ppo_max_token_len_per_gpu)")
        return RoleBatch(per_rank, None)
    if micro <= 0 or (micro_divides and per_rank % micro):
        raise BatchSizeError(
            f"{role}.ppo_micro_batch_size_per_gpu={micro} does not divide the {per_rank} samples each "
            f"rank gets per mini-batch ({role}.ppo_mini_batch_size={mini_prompts} × rollout.n={n} / {dp_size} "
            f"ranks); choose a divisor of {per_rank} (the per-rank mini-batch of {per_rank} rows) instead of "
            f"ppo_micro_batch_size_per_gpu={micro}.")
    return RoleBatch(per_rank, micro)


def _uneven_split(role: str, mini_prompts: int, n: int, dp_size: int) -> str:
    """Why a mini-batch cannot go to the ranks, that verl does not run it either, and the nearest sizes that do.

    verl's engine workers (August 2026) assert ``mini_batch_size % data_parallel_size == 0`` before an update
    (``engine_workers.py`` ``train_mini_batch``); January's legacy FSDP worker floors the per-rank share instead
    (``ppo_mini_batch_size //= dp``), so each rank takes more, smaller optimiser steps than the config asks,
    and its dispatch refuses a step whose rows do not divide the ranks (docs/verl_keys.md, "Mini-batches that
    do not divide the data-parallel ranks")."""
    samples = mini_prompts * n
    head = (f"{role}.ppo_mini_batch_size={mini_prompts} × rollout.n={n} = {samples} samples per mini-batch "
            f"cannot be split evenly over {dp_size} data-parallel ranks (nnodes × n_gpus_per_node, over "
            "tensor × pipeline parallel under Megatron)")
    if samples <= 0:
        return head + "."
    step = dp_size // gcd(n, dp_size)  # prompts per mini-batch must be a multiple of this
    near = sorted({m for m in (mini_prompts // step * step, -(-mini_prompts // step) * step) if m > 0})
    below = max(d for d in range(1, min(dp_size, samples + 1)) if samples % d == 0)
    above = next((d for d in range(dp_size + 1, samples + 1) if samples % d == 0), None)
    ranks = [d for d in (below, above) if d]
    floor = samples // dp_size
    january = (f"January's floors each rank's share to {floor}, so more, smaller optimiser steps than asked" if floor
               else "January's asserts each rank's share is at least one sample")
    return (f"{head}; verl does not run it as asked either (August's engine worker asserts {samples} % {dp_size} "
            f"== 0; {january}). Set {role}.ppo_mini_batch_size to a multiple of {step} "
            f"({' or '.join(map(str, near))}), or train on a data-parallel size that divides {samples} "
            f"({' or '.join(map(str, ranks))}).")
