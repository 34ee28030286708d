"""verl's ``model.use_fused_kernels``: the LM head's log-probs and entropies from the final hidden
states in chunks of tokens, never the whole (tokens, vocabulary) logits.

How: for one model call, the causal LM's ``lm_head`` forward is swapped for
``fused_logprobs_entropy`` (``utils/torch_functional.py``) over the labels the caller gives (the
next token of each kept position); what the model returns as ``logits`` is then (..., 2): each
position's (log-prob, entropy) in fp32, or (..., 3) with sum_v p_v^2 as well (``COLUMNS``). verl patches the whole ``*ForCausalLM.forward`` per model
family to the same end; swapping the head alone keeps every family whose forward ends in
``self.lm_head(hidden)`` (all of transformers' causal LMs that have no logit soft-capping).

Why inside the model call: FSDP2 gathers the head's weight for the root unit's forward and may hold
only this rank's shard outside it, and its backward hooks (gather again, reduce the gradient) hang on
the root's outputs; a head computed from the weight after the call could see a shard and would
bypass the hooks.

``fused_kernel_options.impl_backend``: "torch" is this. verl's "triton" is its GPU kernel of the
same math; here it runs as "torch" (same values, same memory bound; a start-up line says so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rlfoundry.engines.base import say_once
from rlfoundry.utils.torch_functional import fused_logprobs_entropy

__all__ = ["BACKENDS", "COLUMNS", "FusedHead", "check_fused_kernels", "fused_kernels_wanted"]

BACKENDS = ("torch", "triton")
COLUMNS = ("log_probs", "entropy", "sum_pi_squared")  # the fused head's output columns, in order


def check_fused_kernels(options: dict[str, Any] | None, key: str = "model") -> list[str]:
    """Start-up errors for ``<key>.use_fused_kernels=true`` with these ``fused_kernel_options``."""
    options = dict(options or {})
    unknown = sorted(set(options) - {"impl_backend"})
    errors = [f"{key}.fused_kernel_options.{name}: not an option; verl's fused kernels take impl_backend only."
              for name in unknown]
    backend = options.get("impl_backend", "torch")
    if backend not in BACKENDS:
        errors.append(f"{key}.fused_kernel_options.impl_backend={backend!r}: use one of {', '.join(BACKENDS)}.")
    return errors


def fused_kernels_wanted(use: bool, options: dict[str, Any] | None, model_kind: str) -> bool:
    """Whether a causal LM's log-probs take the fused head (either engine's): its start-up errors
    raised, the Triton backend's stand-in said once."""
    if not use or model_kind != "causal_lm":
        return False
    errors = check_fused_kernels(options)
    if errors:
        raise ValueError(" ".join(errors))
    if (options or {}).get("impl_backend") == "triton":
        say_once("model.fused_kernel_options.impl_backend=triton runs the torch backend (the same chunked "
                 "log-probs and memory bound; verl's Triton kernel is not built here)")
    return True


def output_head(module: nn.Module) -> nn.Linear:
    """The causal LM's ``lm_head`` (through a peft wrapper), checked to be one the fused path reproduces."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = getattr(base, "config", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"model.use_fused_kernels=true needs the LM head to be a plain linear map without bias; "
                         f"this model's is {type(head).__name__} (a LoRA adapter on lm_head?): "
                         "set model.use_fused_kernels=false.")
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError("model.use_fused_kernels=true: this model soft-caps its logits after the head, which the "
                         "fused head does not; set model.use_fused_kernels=false.")
    return head


class FusedHead:
    """The swap of one causal LM's head for ``fused_logprobs_entropy`` (see the module docstring).
    ``excluded_ids``: a vision-language policy's image/video placeholders, never sampled (probability 0)."""

    def __init__(self, module: nn.Module, excluded_ids: list[int] | None = None):
        self.head = output_head(module)
        self.excluded_ids = list(excluded_ids or [])

    @contextlib.contextmanager
    def labelled(self, labels: torch.Tensor, temperature: float, entropy_grad: bool,
                 sum_pi_squared: bool = False) -> Iterator[None]:
        """Within: a model call keeping positions (b, n) returns ``logits`` (b, n, 2) = (log p(labels), entropy),
        fp32, with the logits divided by ``temperature``; (b, n, 3) with ``sum_pi_squared`` (``COLUMNS``).
        ``labels`` (b, n): each kept position's next token."""
        head = self.head

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            columns = fused_logprobs_entropy(hidden, head.weight, labels, temperature, self.excluded_ids,
                                             entropy_grad=entropy_grad, sum_pi_squared=sum_pi_squared)
            return torch.stack(columns, dim=-1)

        head.forward = forward
        try:
            yield
        finally:
            del head.forward  # the class's forward again
