"""Start-up checks of SPIN (verl's recipe ``recipe.spin``, ``algos/spin.py``): ``actor.policy_loss.loss_mode=spin``
with its pairing estimator (``algorithm.adv_estimator`` null or ``spin``).

Each prompt's two samples form a pair whose DPO term needs both rows in one micro-batch: the trainer keeps
a prompt's samples in consecutive rows on one rank (``ray_trainer.order_groups``, as for GVPO) and the
rules that would cut them are refused here, naming the keys. The reference refresh copies the actor's
weights into the reference model, which a LoRA run does not have (its reference is the base model).
"""

from __future__ import annotations

from typing import Any

from rlfoundry.config.gvpo import whole_group_errors
from rlfoundry.config.roles import adv_estimator

__all__ = ["spin_errors"]

_ACTOR = "actor_rollout_ref.actor"


def spin_errors(cfg: Any) -> list[str]:
    """Problems of a typed ``PPOConfig`` running SPIN, or using one half of it without the other."""
    loss, est = cfg.actor_rollout_ref.actor.policy_loss.loss_mode, adv_estimator(cfg)
    if loss != "spin":
        return [f"algorithm.adv_estimator=spin writes SPIN's pair labels, read only by its DPO loss: set "
                f"{_ACTOR}.policy_loss.loss_mode=spin (or run python -m rlfoundry.recipe.spin.main_spin)."] \
            if est == "spin" else []
    errors = [] if est == "spin" else [
        f"algorithm.adv_estimator={est} with {_ACTOR}.policy_loss.loss_mode=spin: SPIN's loss reads the pair "
        "labels of adv_estimator=spin; set it to spin or null."]
    actor, n = cfg.actor_rollout_ref.actor, int(cfg.actor_rollout_ref.rollout.n)
    if n != 2:
        errors.append(f"actor_rollout_ref.rollout.n={n} with policy_loss.loss_mode=spin: SPIN pairs two samples "
                      "per prompt (verl's recipe pairs them two by two); set it to 2.")
    if actor.dpo_beta <= 0:
        errors.append(f"{_ACTOR}.dpo_beta={actor.dpo_beta} must be > 0.")
    if not 0.0 <= cfg.algorithm.dpo_label_smoothing < 0.5:
        errors.append(f"algorithm.dpo_label_smoothing={cfg.algorithm.dpo_label_smoothing} must lie in [0, 0.5).")
    if cfg.trainer.ref_update_freq > 0 and cfg.actor_rollout_ref.model.lora_rank > 0:
        errors.append(f"trainer.ref_update_freq={cfg.trainer.ref_update_freq} with actor_rollout_ref.model.lora_rank"
                      f"={cfg.actor_rollout_ref.model.lora_rank}: a LoRA run's reference is the base model, which "
                      "cannot take the actor's weights; set ref_update_freq=-1 (a fixed reference) or lora_rank=0.")
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None or rc.bypass_mode:
        errors.append("algorithm.rollout_correction.rollout_is / bypass_mode with policy_loss.loss_mode=spin: DPO has "
                      "no importance weight; unset them.")
    return errors + whole_group_errors(cfg, "SPIN", "SPIN's DPO term needs a prompt's two samples in one micro-batch")
