"""The training engines a role's ``strategy`` can name, and where each one's plug-in lives.

A table, not imports: the driver's start-up checks and the workers load the chosen engine's plug-in
(``engines.base.EnginePlugin``) from it, so nothing imports megatron-core unless a role asks for it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TRAINING_ENGINES", "engine_plugin"]

# strategy -> "module:attribute" of the engine's plug-in (verl spells FSDP2 both ways)
TRAINING_ENGINES = {
    "fsdp": "rlfoundry.engines.fsdp.plugin:PLUGIN",
    "fsdp2": "rlfoundry.engines.fsdp.plugin:PLUGIN",
    "megatron": "rlfoundry.engines.megatron.plugin:PLUGIN",
}


def engine_plugin(strategy: str) -> Any:
    """The ``EnginePlugin`` registered for ``strategy``."""
    if strategy not in TRAINING_ENGINES:
        raise ValueError(f"unknown strategy {strategy!r}; training engines: {sorted(TRAINING_ENGINES)}")
    module, attribute = TRAINING_ENGINES[strategy].split(":")
    return getattr(importlib.import_module(module), attribute)
