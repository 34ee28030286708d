"""Rollout engines. ``hf`` is always available; others load lazily, only when configured.

No engine module is imported at package import time, and nothing here imports vLLM or SGLang at
top level, so a machine without them never pays for (or breaks on) their import.
"""

from __future__ import annotations

import importlib

from rlfoundry.config.rollout_engines import ROLLOUT_ENGINES, engine_problem
from rlfoundry.workers.rollout.base import BaseRollout, SamplingParams, resolve_sampling_params

__all__ = ["BaseRollout", "SamplingParams", "resolve_sampling_params", "get_rollout_class"]


def get_rollout_class(name: str) -> type[BaseRollout]:
    """The engine class for ``rollout.name``; a clear error if it is unknown or not installed."""
    problem = engine_problem(name)
    if problem is not None:
        raise (ValueError if name not in ROLLOUT_ENGINES else ImportError)(problem)
    engine = ROLLOUT_ENGINES[name]
    return getattr(importlib.import_module(engine.module), engine.cls)
