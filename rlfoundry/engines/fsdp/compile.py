"""verl's ``use_torch_compile`` for the training forwards: regional compilation of the decoder layers.

verl compiles its entropy-from-logits function (``torch.compile(..., dynamic=True)``); here log-probs
and entropy are already chunked autograd Functions over blocks of the vocabulary, so the time that
compiling can save is in the layers. As torchtitan and accelerate do, each repeated decoder layer's
``forward`` is compiled on its own ("regional" compilation): every layer shares one graph (dynamo
caches per code object, and treats the layer's parameters as inputs), so compile time is one layer's,
not the model's, and ``dynamic=True`` marks the token dimension dynamic so micro-batches of other
lengths reuse the graph instead of recompiling every step.

A call with a KV cache stays eager: the cache's per-layer state (``layers[i].is_initialized``) is a
guard, so dynamo would compile once per layer and stop at its recompile limit. Hence the compiled
forwards are swapped in only around the engine's own training and log-prob forwards
(``CompiledLayers.active``; the HF rollout samples from the same module with a cache), and the engine
turns the shared-prompt forward (a KV cache of each prompt) off when it compiles. FSDP2's hooks live on
the module, outside the compiled ``forward``, as they do in torchtitan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["KEYS", "CompiledLayers", "compile_problems", "is_vision_model"]

KEYS = "actor_rollout_ref.actor.use_torch_compile / actor_rollout_ref.ref.use_torch_compile"


class CompiledLayers:
    """The decoder layers of a model with a compiled ``forward`` each, used inside ``active()``."""

    def __init__(self, layers: Sequence[nn.Module]):
        if not layers:
            raise ValueError(f"{KEYS}: the model has no repeated decoder layers to compile "
                             "(no _no_split_modules class, no nn.ModuleList)")
        self.layers = list(layers)
        self.compiled = [_uncached_compiled(layer.forward) for layer in self.layers]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Each layer runs its compiled forward (an instance attribute that ``nn.Module.__call__`` finds
        before the class's) until the block ends."""
        before = [vars(layer).get("forward") for layer in self.layers]  # a forward patched on the instance
        for layer, fn in zip(self.layers, self.compiled):
            layer.forward = fn
        try:
            yield
        finally:
            for layer, fn in zip(self.layers, before):
                if fn is None:
                    del layer.forward
                else:
                    layer.forward = fn


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # transformers 5's name, then 4's


def _uncached_compiled(eager: Any) -> Any:
    compiled = torch.compile(eager, dynamic=True)

    def forward(*args: Any, **kwargs: Any) -> Any:
        cached = any(kwargs.get(k) is not None for k in _CACHE_KWARGS)
        return eager(*args, **kwargs) if cached else compiled(*args, **kwargs)

    return forward


def compile_problems(*, ulysses: int, vision: bool) -> list[str]:
    """Why the layers cannot be compiled with these other settings (empty: they can)."""
    problems = []
    if ulysses > 1:
        problems.append("Ulysses sequence parallelism's all-to-all inside attention is not compiled; use "
                        "ulysses_sequence_parallel_size=1 or use_torch_compile=false")
    if vision:
        problems.append("vision-language models (3-D rotary positions, the vision tower) are not compiled here; "
                        "set use_torch_compile=false")
    return problems


def is_vision_model(module: Any) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "vision_config", None) is not None
