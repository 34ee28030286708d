"""What the fused Llama-family passes share (``cpu/fused_decode.py``, ``cpu/fused_forward.py``).

Both redo a Hugging Face Qwen2/Qwen3/Llama/Mistral forward with fewer, larger tensor ops; these are
the pieces that must equal HF's bit for bit (RMSNorm, RoPE) and the check of which models they
reproduce at all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfoundry.models import lora

__all__ = ["rms_norm", "rope", "signed_sin", "unsupported_reason"]

_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


def _rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def unsupported_reason(module: nn.Module, capacity: int) -> str | None:
    """None when the fused passes reproduce ``module``'s forward over sequences of up to
    ``capacity`` tokens; otherwise why they do not."""
    if lora.is_lora(module):  # adapters fold into the weights the fused passes copy anyway
        reason = lora.unfusable_reason(module)
        if reason is not None:
            return reason
        module = lora.base_of(module)
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {_MODEL_TYPES}"
    if not hasattr(module, "lm_head") or not hasattr(getattr(module, "model", None), "layers"):
        return "not a *ForCausalLM with .model.layers and .lm_head"
    if _rope_type(config) not in _STATIC_ROPE:
        return f"RoPE type {_rope_type(config)!r} depends on the sequence length"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and capacity > window:
        return f"sequences ({capacity}) longer than the sliding window ({window})"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if model_type == "qwen3" and not hasattr(module.model.layers[0].self_attn, "q_norm"):
        return "qwen3 without q_norm/k_norm"
    return None


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's RMSNorm: in fp32, then back to the input dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``signed_sin`` = sin, first half negated."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` (..., d) with its first half negated: rotate_half(x) * sin == roll(x, d/2) * signed_sin(sin),
    bit for bit (one roll instead of two slices, a negation and a concatenation per rotation)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
