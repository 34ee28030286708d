"""Start-up checks of ``trainer.spo`` (verl's SPO recipe, ``trainer/ppo/spo.py``, ``algos/spo.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfoundry.config.schema import SPO_FORMAT

__all__ = ["spo_errors"]

# verl's SPO loop, and the multi_turn.format its scripts name it by (workers/rollout/agent_loop/spo_tool_agent.py)
_SPO_TOOL_AGENT = "spo_tool_agent"


def _is_vision_language(path: Any) -> bool:
    """A local model directory whose config.json has a vision tower (a hub name: not known here)."""
    config = Path(str(path)).expanduser() / "config.json" if path else None
    try:
        return bool(config and config.is_file() and "vision_config" in json.loads(config.read_text()))
    except (OSError, ValueError):
        return False


def spo_errors(cfg: Any) -> list[str]:
    """Problems of a typed ``PPOConfig`` with ``trainer.spo`` (and of the recipe's names used without it)."""
    errors = []
    rollout = cfg.actor_rollout_ref.rollout
    loop = rollout.agent.default_agent_loop
    if rollout.multi_turn.format == SPO_FORMAT and loop not in (None, _SPO_TOOL_AGENT):
        errors.append(f"actor_rollout_ref.rollout.multi_turn.format={SPO_FORMAT} with "
                      f"actor_rollout_ref.rollout.agent.default_agent_loop={loop}: only the {_SPO_TOOL_AGENT} loop reads "
                      "code from <code> tags, other loops parse tool-call markup in a format such as hermes; set "
                      f"default_agent_loop={_SPO_TOOL_AGENT} (or leave it unset), or give that loop's format.")
    spo, alg = cfg.trainer.spo, cfg.algorithm
    if alg.adv_estimator == "spo" and not spo.enable:
        errors.append("algorithm.adv_estimator=spo needs the tracker's baselines: set trainer.spo.enable=true instead "
                      "(SPO then replaces the estimator, as in verl's recipe).")
    if not spo.enable:
        return errors
    if spo.offline_values is not None and not Path(str(spo.offline_values)).expanduser().is_file():
        errors.append(f"trainer.spo.offline_values={spo.offline_values} is not a file; give the JSON "
                      "{prompt: [scores]} of verl's merge_offline_values.py, or null (every prompt starts at Beta(.5, .5)).")
    if not 0.0 <= spo.rho.clip_lower < 1.0:
        errors.append(f"trainer.spo.rho.clip_lower={spo.rho.clip_lower} must be in [0, 1).")
    if spo.rho.type == "kl" and _is_vision_language(cfg.actor_rollout_ref.model.path):
        errors.append("trainer.spo.rho.type=kl with a vision-language model (actor_rollout_ref.model.path has a "
                      "vision_config): the tracker recomputes the previous responses' log-probs from their tokens "
                      "alone, without the prompts' images; use trainer.spo.rho.type=constant.")
    if spo.rho.type == "constant" and not 0.0 < spo.rho.value <= 1.0:
        errors.append(f"trainer.spo.rho.value={spo.rho.value} must be in (0, 1].")
    if spo.offline_N < 0:
        errors.append(f"trainer.spo.offline_N={spo.offline_N} must be >= 0 (0: ignore the offline scores).")
    for key, bad in (("async_training.mode", cfg.async_training.mode != "sync"),
                     ("algorithm.filter_groups.enable", alg.filter_groups.enable)):
        if bad:
            errors.append(f"{key} with trainer.spo.enable=true: SPO draws its prompts itself on the synchronous "
                          "trainer; set async_training.mode=sync and filter_groups.enable=false, or turn SPO off.")
    return errors
