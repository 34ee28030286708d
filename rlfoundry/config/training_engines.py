"""The training engines a role's ``strategy`` can name, and where each one's plug-in lives.

A table, not imports: the driver's start-up checks and the workers load the chosen engine's plug-in
(``engines.base.EnginePlugin``) from it, so nothing imports megatron-core unless a role asks for it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RUNS_ON", "TRAINING_ENGINES", "engine_plugin", "training_engine"]

# strategy -> "module:attribute" of the engine's plug-in (verl spells FSDP2 both ways)
TRAINING_ENGINES = {
    "fsdp": "rlfoundry.engines.fsdp.plugin:PLUGIN",
    "fsdp2": "rlfoundry.engines.fsdp.plugin:PLUGIN",
    "megatron": "rlfoundry.engines.megatron.plugin:PLUGIN",
}

# verl's engine names that run here on one of the engines above: model_engine=dp is verl's FSDP engine group,
# and veomni (model_engine=veomni, <role>.strategy=veomni) is the FSDP2 engine with verl's veomni keys put onto
# the FSDP ones (config/veomni.py), as is fsdp_turbo (its turbo_config onto the FSDP keys: config/fsdp_turbo.py)
RUNS_ON = {"dp": "fsdp", "veomni": "fsdp", "fsdp_turbo": "fsdp"}


def training_engine(name: str) -> str:
    """The ``TRAINING_ENGINES`` name of the engine that runs verl's engine or strategy ``name`` here (other
    names unchanged)."""
    return RUNS_ON.get(name, name)


def engine_plugin(strategy: str) -> Any:
    """The ``EnginePlugin`` registered for ``strategy``."""
    if strategy not in TRAINING_ENGINES:
        raise ValueError(f"unknown strategy {strategy!r}; training engines: {sorted(TRAINING_ENGINES)}")
    module, attribute = TRAINING_ENGINES[strategy].split(":")
    return getattr(importlib.import_module(module), attribute)
