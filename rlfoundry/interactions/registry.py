"""Interactions from an interaction-config YAML in verl's layout
(``actor_rollout_ref.rollout.multi_turn.interaction_config_path``)::

    interaction:
      - name: gsm8k                                              # what rows name in interaction_kwargs
        class_name: rlfoundry.interactions.gsm8k.Gsm8kInteraction  # or verl's class name
        config: {}

verl's built-in class names resolve to this package's equivalents, so a verl config loads unchanged;
any other ``module.Class`` is imported as it is.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlfoundry.interactions.base import BaseInteraction

__all__ = ["InteractionConfigError", "initialize_interactions_from_config"]

_VERL_CLASSES = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "rlfoundry.interactions.gsm8k.Gsm8kInteraction",
    "verl.interactions.base.BaseInteraction": "rlfoundry.interactions.base.BaseInteraction",
}


class InteractionConfigError(ValueError):
    """An interaction config that cannot be loaded; the message names the file, the entry and the fix."""


def _load_class(class_name: str, where: str) -> type[BaseInteraction]:
    if class_name.startswith("verl.") and class_name not in _VERL_CLASSES:  # e.g. verl's weather demo
        raise InteractionConfigError(f"{where}: class_name {class_name!r} is not one of verl's interactions that "
                                     f"rlfoundry provides ({sorted(_VERL_CLASSES)}); port the class (change its "
                                     "imports to rlfoundry.interactions) and name it")
    module_name, _, attr = _VERL_CLASSES.get(class_name, class_name).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise InteractionConfigError(f"{where}: class_name {class_name!r} cannot be imported ({e}); "
                                     "give a dotted module.Class") from e
    if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
        raise InteractionConfigError(f"{where}: class_name {class_name!r} is not a subclass of "
                                     "rlfoundry.interactions.BaseInteraction")
    return cls


def initialize_interactions_from_config(path: str | Path) -> dict[str, BaseInteraction]:
    """One interaction object per entry, by name (unique)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InteractionConfigError(f"interaction config {path} does not exist "
                                     "(actor_rollout_ref.rollout.multi_turn.interaction_config_path)")
    entries = (OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}).get("interaction")
    if not isinstance(entries, list) or not entries:
        raise InteractionConfigError(f"{path}: expected a non-empty 'interaction:' list")
    interactions: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise InteractionConfigError(f"{where} needs class_name (and a name)")
        config: dict[str, Any] = dict(entry.get("config") or {})
        name = entry.get("name") or config.get("name") or "interaction_agent"
        if name in interactions:
            raise InteractionConfigError(f"{where}: name {name!r} is used twice; names must be unique")
        interactions[name] = _load_class(entry["class_name"], where)({**config, "name": name})
    return interactions
