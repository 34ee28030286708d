"""Start-up checks of ``trainer.spo`` (verl's SPO recipe, ``trainer/ppo/spo.py``, ``algos/spo.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["spo_errors"]

# verl's SPO script's agent loop: it stops generation at "</code>" and runs the code between <code> tags
# (its own parser and sampling stop), which the tool agent loop here does not do
_SPO_TOOL_AGENT = "spo_tool_agent"


def spo_errors(cfg: Any) -> list[str]:
    """Problems of a typed ``PPOConfig`` with ``trainer.spo`` (and of the recipe's names used without it)."""
    errors = []
    if cfg.actor_rollout_ref.rollout.agent.default_agent_loop == _SPO_TOOL_AGENT:
        errors.append(f"actor_rollout_ref.rollout.agent.default_agent_loop={_SPO_TOOL_AGENT} (verl's SPO recipe loop: "
                      "it stops sampling at '</code>' and runs the code between <code> tags) is not ported; use "
                      "default_agent_loop=tool_agent with a model that emits tool calls, or drop multi_turn.")
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
