"""Sequence parallelism (``megatron.sequence_parallel``, at TP > 1) on megatron-core's local layers.

Under sequence parallelism each tensor-parallel rank holds 1/TP of the sequence between the
tensor-parallel linears (megatron-core all-gathers it into the column-parallel ones and
reduce-scatters it out of the row-parallel ones; gloo runs both collectives, so CPU processes
run it too). The norms between them then see only this rank's tokens, so the
gradients of their replicated weights differ between the ranks and must be summed over the group:
megatron-core's ``finalize_model_grads`` sums those of parameters marked ``sequence_parallel``.
TransformerEngine's norms carry that mark; the local spec's torch norms refuse sequence parallelism
instead (``WrappedTorchNorm`` asserts it is off), so :func:`use_in_spec` puts
:class:`SequenceParallelNorm` in their place: the same torch norm, its weights marked.

The sequence the model runs on must split evenly over the ranks: ``forward.py`` pads each
micro-batch on the right with masked tokens (``model_length``) and drops those positions again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SequenceParallelNorm", "use_in_spec"]


class SequenceParallelNorm:
    """megatron-core's torch norm for ``config`` (RMSNorm / LayerNorm), built as if sequence parallelism were
    off (the check it fails), its weights marked for the tensor-parallel gradient sum when it is on. A
    class whose ``__new__`` returns the norm, as ``WrappedTorchNorm`` is (megatron-core's ``build_module``
    hands a plain function back uncalled)."""

    def __new__(cls, config: Any, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            module = WrappedTorchNorm(config, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for param in module.parameters():
            param.sequence_parallel = sp
        return module


def use_in_spec(spec: Any) -> Any:
    """``spec`` (a local decoder block spec, changed in place) with every torch norm built by
    :class:`SequenceParallelNorm`: the block's final norm, each layer's input / pre-MLP norms and its
    query / key norms."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen: set[int] = set()

    def visit(node: Any) -> None:
        if id(node) in seen:  # the layers of one kind share their spec
            return
        seen.add(id(node))
        if isinstance(node, ModuleSpec):
            if node.module is WrappedTorchNorm:
                node.module = SequenceParallelNorm
            visit(node.submodules)
        elif isinstance(node, list):
            for item in node:
                visit(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                if value is WrappedTorchNorm:
                    setattr(node, field.name, SequenceParallelNorm)
                else:
                    visit(value)

    visit(spec)
    return spec
