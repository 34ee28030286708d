"""Ulysses sequence parallelism for the FSDP engine (``*.ulysses_sequence_parallel_size``), as verl
does it (``verl/utils/ulysses.py``; Jacobs et al. 2023, "DeepSpeed Ulysses").

The ranks form a (dp, sp) grid: consecutive groups of ``sp`` ranks are one sequence-parallel group
and compute on the same rows (``pool_rows``: each rank's rows are pooled across its group, as
Megatron's model-parallel groups do); ranks with the same place in their groups form a
data-parallel group, which is what batch counts and metrics are reduced over. FSDP2 still shards
the weights over all ranks.

Per forward (packed rows only: ``model.use_remove_padding``), the packed sequence of N tokens is
padded to a multiple of ``sp`` and rank r keeps tokens [r N/sp, (r+1) N/sp). Everything outside
attention is per token, so it runs on the rank's own slice; around attention an all-to-all turns
sequence-sharded q, k, v (b, h, N/sp, d) into head-sharded ones (b, h/sp, N, d), SDPA runs on
whole sequences for its heads (the block-causal mask of the packed rows), and a second all-to-all
turns the output back. Per-token results (log-probs, entropies, values) are gathered over the
group at the end, so every rank of a group holds the same outputs and computes the same loss.

Gradient scale: every rank of a group backpropagates the same loss, but only through its own
slice (``_GatherSeq``'s backward keeps the rank's part), so the group's gradients sum to the
loss's gradient; FSDP averages over all dp x sp ranks, hence the factor ``sp`` in that backward
(verl's ``Gather(grad_scaler=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlfoundry.protocol import DataProto

__all__ = ["ATTN_IMPLEMENTATION", "SequenceParallel", "install_attention", "pool_rows"]

ATTN_IMPLEMENTATION = "rlfoundry_ulysses_sdpa"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group (``group``, ``size``, ``rank``) and data-parallel group."""

    size: int
    rank: int
    group: Any
    dp_group: Any
    dp_size: int

    @classmethod
    def create(cls, size: int) -> SequenceParallel:
        """Groups of ``size`` consecutive ranks (verl's ("dp", "sp") mesh). Collective over the world."""
        world, me = dist.get_world_size(), dist.get_rank()
        if size < 1 or world % size:
            raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the {world} ranks of this "
                             f"worker group; use a divisor of {world}")
        key = (size, world)
        if key not in _GROUPS:  # new_group is collective: every rank makes every group, in one order
            sp = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
            dp = [dist.new_group(list(range(r, world, size))) for r in range(size)]
            _GROUPS[key] = (sp, dp)
        sp, dp = _GROUPS[key]
        return cls(size=size, rank=me % size, group=sp[me // size], dp_group=dp[me % size], dp_size=world // size)


_GROUPS: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}


def pool_rows(data: DataProto, sp: SequenceParallel) -> tuple[DataProto, slice]:
    """The rows of this rank's whole sequence-parallel group (every rank of it computes on them), and
    where this rank's own rows sit in them (``TrainingEngine.model_parallel_rows``)."""
    parts: list[Any] = [None] * sp.size
    dist.all_gather_object(parts, data.to("cpu"), group=sp.group)
    start = sum(len(p) for p in parts[: sp.rank])
    device = data.batch.device if data.batch is not None else "cpu"
    return DataProto.concat(parts).to(device), slice(start, start + len(data))


# ---- collectives with gradients --------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Scatter ``scatter_dim`` over the group, gather ``gather_dim``; the backward is the reverse swap."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0; the backward keeps this rank's part, times ``scale`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, scale: float) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.rank, ctx.scale, ctx.part = rank, scale, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mine = grad[ctx.rank * ctx.part: (ctx.rank + 1) * ctx.part]
        return mine * ctx.scale, None, None, None


def gather_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(N/sp, ...) per rank -> (N, ...) on every rank of the group, in sequence order."""
    return _GatherSeq.apply(x, sp.group, sp.rank, float(sp.size))


# ---- attention -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _AttentionState:
    """What the attention layers of one sequence-parallel forward need (passed as a model kwarg, so
    it reaches them also when gradient checkpointing recomputes a layer during the backward)."""

    sp: SequenceParallel
    mask: torch.Tensor  # (1, 1, N, N) bool: block-causal over the packed rows of the whole sequence


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, ulysses_sp: _AttentionState | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: SDPA, with Ulysses' two all-to-alls inside an SP forward.

    q (b, h, N/sp, d), k and v (b, h_kv, N/sp, d) -> output (b, N/sp, h, d). Outside an SP forward
    (the rollout's generate, SP=1) it is HF's SDPA unchanged.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if ulysses_sp is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sp = ulysses_sp.sp
    if key.shape[1] % sp.size:  # fewer KV heads than ranks: each rank takes the KV heads of its query heads
        key, value = (repeat_kv(t, query.shape[1] // key.shape[1]) for t in (key, value))
    # scatter heads (dim 1), gather the sequence (dim 2): each rank sees whole sequences for h/sp heads
    q, k, v = (_AllToAll.apply(t, sp.group, 1, 2) for t in (query, key, value))
    out, _ = sdpa_attention_forward(module, q, k, v, ulysses_sp.mask, **kwargs)  # (b, N, h/sp, d)
    return _AllToAll.apply(out, sp.group, 1, 2), None  # back to (b, N/sp, h, d)


def install_attention(module: nn.Module, size: int) -> None:
    """Route the HF model's attention through ``ulysses_attention`` (SDPA when no SP forward runs)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    heads = getattr(module.config, "num_attention_heads", None)
    if heads is None or heads % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the model's {heads} attention "
                         "heads: each rank of a group attends with heads / SP of them; use a divisor")

    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    module.set_attn_implementation(ATTN_IMPLEMENTATION)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, N) positions of packed rows -> (1, 1, N, N) bool: a token sees earlier tokens of its own row.

    A row starts wherever the position does not continue the previous one (HF's
    ``find_packed_sequence_indices``), so the SP padding (positions 0, 1, ...) is a row of its own.
    """
    pos = position_ids[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    row = starts.cumsum(0)
    n = pos.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=pos.device).tril()
    return (causal & (row[:, None] == row[None, :]))[None, None]


# ---- the packed forward --------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalSlice:
    """One rank's slice of a packed sequence padded to a multiple of ``sp.size``."""

    sp: SequenceParallel
    total: int  # padded length
    start: int
    stop: int

    @classmethod
    def of(cls, length: int, sp: SequenceParallel) -> LocalSlice:
        total = length + (-length) % sp.size
        chunk = total // sp.size
        return cls(sp, total, sp.rank * chunk, (sp.rank + 1) * chunk)


def sp_model_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, sp: SequenceParallel
                    ) -> tuple[dict[str, Any], LocalSlice]:
    """The model kwargs of this rank's slice of packed (1, N) rows, and the slice."""
    n = input_ids.shape[1]
    part = LocalSlice.of(n, sp)
    pad = part.total - n
    ids = F.pad(input_ids, (0, pad))
    pos = torch.cat([position_ids, torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)[None]], 1)
    state = _AttentionState(sp, block_causal_mask(pos))
    kwargs = dict(input_ids=ids[:, part.start: part.stop], position_ids=pos[:, part.start: part.stop],
                  attention_mask=None, use_cache=False, ulysses_sp=state)
    return kwargs, part


def packed_logits_at(module: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor,
                     labels: torch.Tensor, sp: SequenceParallel,
                     lm: Callable[..., torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """Logits of the packed positions ``keep`` (K,) that fall in this rank's slice, their ``labels``,
    ``gather``: per-kept-position values computed from those logits (k_local, ...) -> (K, ...) for
    ``keep`` in order, the same on every rank of the group (with gradients), and ``select``: per-kept-
    position inputs (K, ...) -> this rank's (k_local, ...), as ``labels`` were taken. ``lm(labels, **inputs)``:
    the model call given the kept positions' labels (the fused head's, ``forward.py``, returns
    (log-prob, entropy) pairs in place of logits); None: ``module(**inputs).logits``."""
    kwargs, part = sp_model_inputs(input_ids, position_ids, sp)
    dev = input_ids.device
    at = torch.full((part.total,), -1, dtype=torch.long, device=dev)
    at[keep] = torch.arange(keep.numel(), device=dev)
    local_at = at[part.start: part.stop]
    local_keep = (local_at >= 0).nonzero().squeeze(1)  # positions in this rank's slice
    mine = local_at[local_keep]
    local_labels = labels[mine]
    if lm is not None:
        logits = lm(local_labels[None], **kwargs, logits_to_keep=local_keep)
    else:
        logits = module(**kwargs, logits_to_keep=local_keep).logits

    def gather(values: torch.Tensor) -> torch.Tensor:
        local = values.new_zeros((part.stop - part.start, *values.shape[1:]))
        local = local.index_put((local_keep,), values)
        return gather_sequence(local, sp)[keep]

    return logits[0], local_labels, gather, lambda kept: kept[mine]


def packed_outputs(module: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   sp: SequenceParallel) -> torch.Tensor:
    """Per-token logits (1, N, ·) of packed rows (a value head's), gathered over the group."""
    kwargs, part = sp_model_inputs(input_ids, position_ids, sp)
    local = module(**kwargs).logits[0]  # (N_padded/sp, ·)
    return gather_sequence(local, sp)[: input_ids.shape[1]][None]
