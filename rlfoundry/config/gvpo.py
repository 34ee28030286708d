"""Start-up checks of ``actor.policy_loss.loss_mode=gvpo`` (verl's GVPO recipe, ``algos/gvpo.py``).

GVPO's loss centres each sample's implicit reward on its group's mean, so every micro-batch must
hold whole groups: the trainer puts a prompt's ``rollout.n`` samples in consecutive rows and whole
groups on each rank (``ray_trainer.order_groups``), the actor cuts mini- and micro-batches in row
order. A setting that would cut a group is refused here, naming the keys; so is what verl's recipe
does not build (token-budget micro-batches) or this port does not (Megatron, Ulysses).
"""

from __future__ import annotations

from typing import Any

__all__ = ["gvpo_errors", "whole_group_errors"]

_ACTOR = "actor_rollout_ref.actor"


def gvpo_errors(cfg: Any) -> list[str]:
    """Problems of a typed ``PPOConfig`` running GVPO (none for another loss)."""
    actor = cfg.actor_rollout_ref.actor
    if actor.policy_loss.loss_mode != "gvpo":
        return []
    n = int(cfg.actor_rollout_ref.rollout.n)
    errors = [] if actor.gvpo_beta > 0 else [f"{_ACTOR}.gvpo_beta={actor.gvpo_beta} must be > 0."]
    if n < 2:
        errors.append(f"{_ACTOR}.policy_loss.loss_mode=gvpo needs actor_rollout_ref.rollout.n >= 2 (a group's "
                      f"variance), got {n}.")
    errors += whole_group_errors(cfg, "GVPO", "GVPO's loss needs each prompt's samples in one micro-batch")
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None or rc.bypass_mode:
        errors.append("algorithm.rollout_correction.rollout_is / bypass_mode with policy_loss.loss_mode=gvpo: GVPO has "
                      "no importance weight (verl's recipe drops them); unset them.")
    return errors


def whole_group_errors(cfg: Any, name: str, why: str) -> list[str]:
    """What would cut a prompt's samples apart in a micro-batch of a loss that reads whole groups
    (``policy_loss.loss_mode`` = ``name``, lower case), or what such a loss is not built for here."""
    actor, mode = cfg.actor_rollout_ref.actor, f"policy_loss.loss_mode={name.lower()}"
    n = int(cfg.actor_rollout_ref.rollout.n)
    ws = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    errors = []
    for key, value, fix in (
        ("strategy", actor.strategy == "megatron", f"{name} is built on the FSDP engine only: use strategy=fsdp"),
        ("use_dynamic_bsz", actor.use_dynamic_bsz, f"{why} (verl's recipe refuses it too): set it false"),
        ("shuffle", actor.shuffle, f"{why}; shuffled rows would split groups: set it false"),
        ("ulysses_sequence_parallel_size", actor.ulysses_sequence_parallel_size > 1,
         f"not built for {name}: set it 1"),
    ):
        if value:
            errors.append(f"{_ACTOR}.{key}={getattr(actor, key)} with {mode}: {fix}.")
    micro = actor.ppo_micro_batch_size_per_gpu or (actor.ppo_micro_batch_size or 0) // max(ws, 1)
    if not actor.use_dynamic_bsz and n >= 2 and micro % n:
        errors.append(f"{_ACTOR}.ppo_micro_batch_size_per_gpu={micro} is not a multiple of actor_rollout_ref."
                      f"rollout.n={n}: {why}; make it a multiple of n.")
    for key, prompts in ((f"{_ACTOR}.ppo_mini_batch_size", actor.ppo_mini_batch_size),
                         ("data.train_batch_size", cfg.data.train_batch_size)):
        if prompts % ws:
            errors.append(f"{key}={prompts} prompts do not divide over trainer.nnodes × n_gpus_per_node={ws} ranks: "
                          f"{why} on one rank; make it a multiple of {ws}.")
    return errors
