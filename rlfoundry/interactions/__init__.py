"""Simulated users for multi-turn rollouts (verl's interactions): ``rollout.multi_turn.interaction_config_path``."""

from rlfoundry.interactions.base import BaseInteraction
from rlfoundry.interactions.registry import InteractionConfigError, initialize_interactions_from_config

__all__ = ["BaseInteraction", "InteractionConfigError", "initialize_interactions_from_config"]
