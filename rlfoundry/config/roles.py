"""Which roles a PPO run has, read off the config: the trainer builds its worker groups by these and the
planner (``plan/build.py``) predicts the same roles' memory, so both ask the one function."""

from __future__ import annotations

from typing import Any

__all__ = ["adv_estimator", "need_reference_policy", "use_critic"]


def adv_estimator(cfg: Any) -> str:
    """``algorithm.adv_estimator``; null means gae when a critic model is given (verl's PPO), spin with
    SPIN's loss (verl's recipe sets null: its trainer pairs the samples itself), else grpo."""
    est = cfg.algorithm.adv_estimator
    if est is not None:
        return str(est)
    if cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "spin":
        return "spin"
    return "gae" if cfg.critic.model.path is not None or cfg.critic.enable else "grpo"


def use_critic(cfg: Any) -> bool:
    """The critic runs when ``critic.enable`` says so, or (enable null) exactly for gae."""
    enable = cfg.critic.enable
    return bool(enable) if enable is not None else adv_estimator(cfg) == "gae"


def need_reference_policy(cfg: Any) -> bool:
    """A reference model is needed for a KL term (in the reward or in the actor loss) and by SPIN's DPO loss."""
    actor = cfg.actor_rollout_ref.actor
    return bool(cfg.algorithm.use_kl_in_reward or actor.use_kl_loss or actor.policy_loss.loss_mode == "spin")
