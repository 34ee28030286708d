"""Context parallelism (``megatron.context_parallel_size``) for megatron-core's local layers.

Each micro-batch's sequence is cut into 2·CP equal chunks and CP rank r holds chunks r and
2·CP-1-r (megatron-core's load-balanced layout: under a causal mask the early chunks are cheap and
the late ones dear, so every rank gets one of each). megatron-core's rotary embedding already
expects this layout when CP > 1 (``rope_utils.get_pos_emb_on_this_cp_rank``): it computes the angles
of the whole (padded) sequence and keeps this rank's two chunks, so the embedding, the MLPs and the
norms run on the local tokens unchanged; only attention needs the other ranks' tokens.

``ContextParallelAttention`` (:func:`attention_class`) is the local spec's core attention with that
exchange: keys and values are all-gathered over the CP group (backward: each rank gets the sum of
every rank's gradient for its own chunks), and this rank's queries attend to the whole sequence with
their rows of the (causal + padded-key) mask. megatron-core leaves CP to TransformerEngine's
attention, which takes packed sequences with causal masks, not the engine's padded rows with a 4D
mask: with CP > 1 the model is built from the local layers wherever it runs (``bridge.build_bridge``).

:func:`split` and :func:`gather` move (batch, sequence, ...) tensors between the whole sequence and
this rank's two chunks; ``gather``'s backward hands each rank its own chunks of the gradient, since
every CP rank computes the same loss from the gathered values (a sum would count it CP times).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["attention_class", "chunk_index", "gather", "split", "use_in_spec"]


def _group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def chunk_index(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the sequence that CP rank ``rank`` holds: chunks ``rank`` and ``2·cp-1-rank``."""
    size = length // (2 * cp)
    return torch.cat([torch.arange(rank * size, (rank + 1) * size),
                      torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)])


def _natural_order(length: int, cp: int) -> torch.Tensor:
    """For the concatenation of every rank's chunks (rank 0's first), where each position of the
    whole sequence sits in it."""
    held = torch.cat([chunk_index(length, cp, r) for r in range(cp)])
    return torch.argsort(held)


class _GatherSequence(torch.autograd.Function):
    """All-gather ``x`` (this rank's two chunks along ``dim``) into the whole sequence in order.
    ``reduce_grad``: the gradient of each rank's chunks is the sum over ranks (the keys and values
    every rank attends to); otherwise each rank keeps its own chunks' gradient (an identical
    loss on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, reduce_grad: bool) -> torch.Tensor:
        group = _group()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.reduce_grad, ctx.cp, ctx.rank = dim, reduce_grad, cp, rank
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        joined = torch.cat(parts, dim=dim)
        return joined.index_select(dim, _natural_order(joined.shape[dim], cp).to(x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        length = grad.shape[ctx.dim]
        if not ctx.reduce_grad:
            return grad.index_select(ctx.dim, chunk_index(length, ctx.cp, ctx.rank).to(grad.device)), None, None
        # the ranks' chunks one after another (rank-major), reduce-scattered: each rank receives the sum of
        # its own chunks' gradients only (half the traffic of an all-reduce)
        held = torch.cat([chunk_index(length, ctx.cp, r) for r in range(ctx.cp)]).to(grad.device)
        parts = grad.index_select(ctx.dim, held).movedim(ctx.dim, 0).contiguous()
        mine = parts.new_empty((parts.shape[0] // ctx.cp, *parts.shape[1:]))
        dist.reduce_scatter_tensor(mine, parts, group=_group())
        return mine.movedim(0, ctx.dim), None, None


def gather(x: torch.Tensor, dim: int = 1, reduce_grad: bool = False) -> torch.Tensor:
    """This rank's two chunks along ``dim`` -> the whole sequence, in order (see the module docstring)."""
    return _GatherSequence.apply(x, dim, reduce_grad)


def split(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The whole sequence along ``dim`` (its length a multiple of 2·CP: ``forward.padded_length``) -> this
    rank's two chunks."""
    group = _group()
    return x.index_select(dim, chunk_index(x.shape[dim], dist.get_world_size(group), dist.get_rank(group)).to(x.device))


@functools.cache
def attention_class() -> type:
    """:class:`ContextParallelAttention`, defined on first use (megatron-core is an optional install)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ContextParallelAttention(DotProductAttention):
        """megatron-core's local DotProductAttention whose queries are this CP rank's two chunks and
        whose keys and values are the whole sequence (gathered here). The mask it gets is the whole
        sequence's (batch, 1, S, S); it keeps this rank's query rows."""

        def __init__(self, config, *args: Any, **kwargs: Any):
            # the parent refuses CP > 1 (megatron-core leaves CP to TransformerEngine); its
            # attention itself is what runs here on the gathered keys and values
            cp = config.context_parallel_size
            config.context_parallel_size = 1
            try:
                super().__init__(config, *args, **kwargs)
            finally:
                config.context_parallel_size = cp

        def forward(self, query, key, value, attention_mask, *args: Any, **kwargs: Any):
            if dist.get_world_size(_group()) > 1:
                key, value = gather(key, dim=0, reduce_grad=True), gather(value, dim=0, reduce_grad=True)
                if attention_mask is not None:
                    attention_mask = split(attention_mask, dim=2)
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return ContextParallelAttention


def use_in_spec(block_spec: Any) -> Any:
    """A local (non-TransformerEngine) decoder block spec with each layer's core attention
    replaced by ``ContextParallelAttention``."""
    cls = attention_class()
    for layer in block_spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = cls
    return block_spec
