"""Start-up checks of verl's SPPO recipe keys (``algorithm.sppo_eta``, ``actor.sppo_eta``; algos/sppo.py).

SPPO is a pair: the estimator ``sppo`` writes the batch-centred sequence rewards and the policy loss
``sppo`` regresses the sequence log-ratio onto them; either without the other is another algorithm
(verl's recipe couples them in its own trainer and actor), so a half is refused, as is a key that
would have no effect.
"""

from __future__ import annotations

from rlfoundry.config.roles import adv_estimator
from rlfoundry.config.schema import PPOConfig

__all__ = ["sppo_errors"]

SPPO = "sppo"
_LOSS = "actor_rollout_ref.actor.policy_loss.loss_mode"
_RUN = "python -m rlfoundry.recipe.sppo.main_sppo sets both: drop an override naming another"


def sppo_errors(cfg: PPOConfig) -> list[str]:
    """Every problem of the SPPO keys (none when neither half is on and the etas are untouched)."""
    actor, est = cfg.actor_rollout_ref.actor, adv_estimator(cfg)
    loss_on, est_on = actor.policy_loss.loss_mode == SPPO, est == SPPO
    errors = []
    if loss_on and not est_on:
        errors.append(f"{_LOSS}=sppo regresses onto SPPO's centred sequence rewards, which algorithm.adv_estimator=sppo "
                      f"writes; got algorithm.adv_estimator={est}. Set algorithm.adv_estimator=sppo ({_RUN}).")
    if est_on and not loss_on:
        errors.append(f"algorithm.adv_estimator=sppo writes SPPO's regression targets, which only {_LOSS}=sppo reads; "
                      f"got {_LOSS}={actor.policy_loss.loss_mode}. Set {_LOSS}=sppo ({_RUN}).")
    if not est_on and cfg.algorithm.sppo_eta != 1.0:
        errors.append(f"algorithm.sppo_eta={cfg.algorithm.sppo_eta} has no effect without algorithm.adv_estimator=sppo; "
                      "drop it or run SPPO.")
    if not loss_on and actor.sppo_eta != 1.0:
        errors.append(f"actor_rollout_ref.actor.sppo_eta={actor.sppo_eta} has no effect without {_LOSS}=sppo; drop it "
                      "or run SPPO.")
    if loss_on and actor.loss_agg_mode != "token-mean":
        errors.append(f"actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode} with {_LOSS}=sppo: SPPO's loss is a "
                      "mean over sequences, defined (as in verl's recipe) for loss_agg_mode=token-mean only; set that.")
    if loss_on and cfg.algorithm.rollout_correction.rollout_is is not None:
        errors.append(f"algorithm.rollout_correction.rollout_is={cfg.algorithm.rollout_correction.rollout_is} with "
                      f"{_LOSS}=sppo: SPPO's loss takes no importance weights (verl's recipe has none); set it to null.")
    return errors
