"""verl's ``actor_rollout_ref.model.use_liger``: Liger's Triton kernels patched into the HF model.

As verl does (``fsdp_workers._build_model_optimizer``), the loaded actor and reference models go
through liger-kernel's ``_apply_liger_kernel_to_instance(model=...)`` before sharding: RMSNorm, SwiGLU
MLP and rotary embedding as fused Triton kernels, and the causal LM's forward replaced by Liger's
(which computes logits as before when given no labels, as the log-prob forward does). Triton kernels
run on CUDA only, so on the CPU the key is a start-up error rather than a silent no-op, and so is a
missing liger-kernel or a model type Liger has no kernels for.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["KEY", "LIGER_INSTALL", "apply_liger", "liger_problems"]

KEY = "actor_rollout_ref.model.use_liger"
LIGER_INSTALL = "pip install liger-kernel"


def liger_problems(device: str) -> list[str]:
    """Why ``use_liger=true`` cannot run on ``device`` (cuda / cpu) here (empty: it can)."""
    if device != "cuda":
        return [(f"{KEY}=true: Liger's kernels are Triton GPU kernels and the training device is {device}; "
                 f"set {KEY}=false (or train on CUDA).")]
    if importlib.util.find_spec("liger_kernel") is None:
        return [f"{KEY}=true needs liger-kernel, which is not installed: {LIGER_INSTALL} (or set {KEY}=false)."]
    return []


def apply_liger(module: Any, device: str) -> str:
    """Patch ``module`` (an HF model, before LoRA and sharding) in place; returns what was done for the
    run's first lines. Raises ``ValueError`` naming the key where it cannot be done."""
    problems = liger_problems(device)
    if problems:
        raise ValueError(problems[0])
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"{KEY}=true: liger-kernel has no kernels for model type {model_type!r} (it has "
                         f"{sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}); set {KEY}=false.")
    _apply_liger_kernel_to_instance(model=module)
    return f"{KEY}: Liger's Triton kernels patched into the {model_type} model"
