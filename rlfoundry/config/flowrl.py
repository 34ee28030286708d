"""Start-up rules of FlowRL (``actor.policy_loss.loss_mode=flowrl``: ``algos/flowrl.py``, verl's ``recipe/flowrl``).

What the loss needs and what is built for it: the reference's log-probs (verl's recipe reads them
unconditionally, so its script turns ``use_kl_loss`` on with a zero coefficient), and the log Z head on the
FSDP engine's packed or padded forwards; elsewhere the run stops at start-up with the key to change.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from rlfoundry.config.schema import ActorConfig
from rlfoundry.config.training_engines import training_engine
from rlfoundry.config.verl_compat import NoEffectKeyWarning

__all__ = ["flowrl_errors", "flowrl_warnings"]

_ACTOR = "actor_rollout_ref.actor"
_HEAD_LAYERS = next(f.default for f in dataclasses.fields(ActorConfig) if f.name == "proj_layer")  # the schema's


def _on(cfg: Any) -> bool:
    return cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "flowrl"


def flowrl_errors(cfg: Any) -> list[str]:
    """The problems of a FlowRL config (none when the loss is another)."""
    if not _on(cfg):
        return []
    actor, model, errors = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model, []
    why = f"{_ACTOR}.policy_loss.loss_mode=flowrl"
    if not actor.use_kl_loss:
        errors.append(f"{why} reads the reference's log-probs: set {_ACTOR}.use_kl_loss=true (its kl_loss_coef is "
                      "not used; verl's recipe script sets kl_loss_coef=0.0).")
    if training_engine(actor.strategy) not in ("fsdp", "fsdp2"):
        errors.append(f"{why} trains its log Z head on the FSDP engine only: {_ACTOR}.strategy={actor.strategy} is not "
                      f"built for it; use {_ACTOR}.strategy=fsdp.")
    if actor.ulysses_sequence_parallel_size > 1:
        errors.append(f"{why} with {_ACTOR}.ulysses_sequence_parallel_size={actor.ulysses_sequence_parallel_size} is "
                      "not built (the head's prompt forward is not split by sequence); set it to 1.")
    if model.lora_rank > 0:
        errors.append(f"{why} with actor_rollout_ref.model.lora_rank={model.lora_rank} is not built (the adapter "
                      "would freeze the log Z head); set lora_rank=0.")
    if actor.proj_layer < 1:
        errors.append(f"{_ACTOR}.proj_layer={actor.proj_layer}: the log Z head needs at least 1 layer.")
    return errors


def flowrl_warnings(cfg: Any) -> None:
    """verl's FlowRL actor drops the entropy bonus and the KL loss: a coefficient set for them does nothing; nor
    does ``proj_layer`` under another loss (only verl's FlowRL worker reads it)."""
    actor = cfg.actor_rollout_ref.actor
    if not _on(cfg):
        if actor.proj_layer != _HEAD_LAYERS:
            warnings.warn(f"{_ACTOR}.proj_layer={actor.proj_layer} has no effect: only "
                          f"{_ACTOR}.policy_loss.loss_mode=flowrl has a log Z head.", NoEffectKeyWarning, stacklevel=2)
        return
    unused = [f"{_ACTOR}.{k}={getattr(actor, k)}" for k in ("entropy_coeff", "kl_loss_coef") if getattr(actor, k) != 0]
    if unused:
        warnings.warn(f"{', '.join(unused)} has no effect with policy_loss.loss_mode=flowrl: FlowRL's loss replaces "
                      "PPO's surrogate, entropy bonus and KL loss (as in verl's recipe).", NoEffectKeyWarning,
                      stacklevel=2)
