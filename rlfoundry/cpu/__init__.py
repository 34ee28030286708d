"""The CPU kernels: speed-ups for models that run on the CPU, applied as model conversions under
one switch per model, ``*.model.cpu_kernels = auto | off``.

``auto`` turns them on only when the model runs on the CPU; GPUs always take the plain HF/FSDP2
path, which is also the reference the invariance and parity tests run on (``off``). What ``on``
changes, all applied when the model is built (``engines/fsdp/engine.py``, ``workers/rollout``):

- fp32 ``nn.Linear`` layers multiply through oneDNN where it beats MKL (AMD CPUs; ``cpu/linear.py``);
- the actor's shared-prompt training forward runs as one pass (``cpu/fused_forward.py``);
- the HF rollout decodes Llama-family models with a lean one-token step (``cpu/fused_decode.py``);
- FSDP2 keeps one unit (the root) when parameters are not sharded, and skips its per-forward hooks
  where they have nothing to do (``engines/fsdp/utils.py``: ``continued_forward``, ``inference_unsharded``);
- worker processes keep freed memory in glibc's heap (``cpu/malloc.py``; ``trainer.tune_malloc``).

Each is tested for equality against the plain path (``tests/cpu``). The tuning constants live in
``cpu/tuning.py``; what they were measured at, in benchmarks/README.md ("CPU kernels"). Nothing
here imports the engines, workers or trainer: they call in, passing what a kernel needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfoundry.config.schema import CPU_KERNELS

__all__ = ["CHOICES", "apply_cpu_kernels", "enabled", "fused_shared_prompt_logits", "normalise"]

CHOICES = CPU_KERNELS  # one list, beside the config field it constrains


def normalise(setting: Any) -> str:
    """``off`` as YAML reads it on a command line (``cpu_kernels=off`` arrives as False) is ``off``."""
    return "off" if setting is False or str(setting).lower() in ("off", "false") else str(setting)


def enabled(setting: Any, device: torch.device | str) -> bool:
    """Whether the speed-ups are on for a model on ``device`` under ``setting``."""
    setting = normalise(setting)
    if setting not in CHOICES:
        raise ValueError(f"model.cpu_kernels must be one of {list(CHOICES)}, got {setting!r}")
    return setting == "auto" and torch.device(device).type == "cpu"


def apply_cpu_kernels(module: nn.Module, device: torch.device | str) -> str:
    """Swap the model's fp32 linear layers for oneDNN ones where that is faster on this machine;
    returns which library multiplies and why (for the run's first lines)."""
    from rlfoundry.cpu import linear as cpu_linear

    why = cpu_linear.onednn_preferred()
    if why is None:
        return "fp32 linear layers on torch's default path (MKL on Intel CPUs is as fast as oneDNN or faster)"
    return f"{cpu_linear.use_onednn_linear(module, device)} fp32 linear layers on oneDNN ({why})"


def fused_shared_prompt_logits(module: nn.Module, prompt_ids: torch.Tensor, *rest: Any) -> torch.Tensor | None:
    """The one-pass shared-prompt forward where it reproduces ``module`` (else None: use HF's)."""
    from rlfoundry.cpu import fused_forward

    responses = rest[2]
    if fused_forward.unsupported_reason(module, prompt_ids.shape[1] + responses.shape[1]) is not None:
        return None
    return fused_forward.shared_prompt_logits(module, prompt_ids, *rest)
