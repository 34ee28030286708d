"""verl's ``model.use_fused_kernels`` on the Megatron engine: the output layer computes each position's
(log-prob, entropy[, sum p^2]) from the final hidden states in chunks of tokens, and never returns
the (tokens × vocabulary / TP) logits.

How: for one model call, the last stage's ``output_layer`` (megatron-core's vocab-parallel
``ColumnParallelLinear``) has its forward swapped for ``fused_logprobs_entropy`` over this rank's
vocabulary rows, its chunk statistics summed over the tensor-parallel group (``vocab_group``). The
input goes through the same mapping the layer's own forward applies — copied into the
tensor-parallel region (each rank's dL/dhidden is its slice's part, summed over the group in
backward), or gathered from sequence-parallel chunks (reduce-scattered in backward) — and a tied
embedding's weight comes in as the layer's ``weight`` argument, as megatron-core passes it. What the
model returns as logits is then (batch, positions, columns) in fp32, ``COLUMNS`` of the FSDP
engine's fused head; with context parallelism, this rank's positions (the caller gathers them).

Why the swap and not a separate head after the model call: the pipeline schedule runs the model's
forward and its backward (through the DDP wrapper's gradient hooks on the head's weight) as one
unit; a swapped forward keeps that unit whole and keeps every megatron-core GPT model's own
post-processing (the transpose to batch-first, tied weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from rlfoundry.engines.fsdp.fused_head import COLUMNS
from rlfoundry.utils.torch_functional import fused_logprobs_entropy

__all__ = ["COLUMNS", "MegatronFusedHead", "output_layer"]


def output_layer(chunk: nn.Module) -> nn.Module | None:
    """The GPT model's ``output_layer`` inside ``chunk`` (through DDP / fp16 wrappers); None on a
    pipeline stage that has none."""
    for module in chunk.modules():
        layer = getattr(module, "output_layer", None)
        if isinstance(layer, nn.Module):
            return layer
    return None


class MegatronFusedHead:
    """The swap of one model chunk's output layer (see the module docstring)."""

    def __init__(self, layer: nn.Module):
        if getattr(layer, "bias", None) is not None:
            raise ValueError("model.use_fused_kernels=true needs the output layer without bias; "
                             "set model.use_fused_kernels=false.")
        self.layer = layer

    @contextlib.contextmanager
    def labelled(self, labels: torch.Tensor, temperature: float, entropy_grad: bool,
                 sum_pi_squared: bool = False) -> Iterator[None]:
        """Within: the model call's logits are (batch, positions, 2 or 3) = (log p(label), entropy
        [, sum p^2]) of ``softmax(logits / temperature)``; ``labels`` (batch, positions): each
        position's next token (this rank's positions with context parallelism)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import mappings

        layer = self.layer
        tp = ps.get_tensor_model_parallel_world_size()
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None

        def forward(hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
            if getattr(layer, "sequence_parallel", False):
                hidden = mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
            elif tp > 1:
                hidden = mappings.copy_to_tensor_model_parallel_region(hidden)
            columns = fused_logprobs_entropy(hidden, layer.weight if weight is None else weight, labels.t(),
                                             temperature, entropy_grad=entropy_grad, sum_pi_squared=sum_pi_squared,
                                             vocab_group=group)
            return torch.stack(columns, dim=-1), None  # (positions, batch, columns): the model transposes

        layer.forward = forward
        try:
            yield
        finally:
            del layer.forward  # the class's forward again
