"""SPIN, Self-Play fIne-tuNing (Chen et al. 2024, arXiv:2401.01335), as verl's recipe (``recipe/spin``)
builds it: online DPO (Rafailov et al. 2023) on pairs of the policy's own samples, against a reference
that the trainer refreshes from the policy every ``trainer.ref_update_freq`` steps.

Pairing (``algorithm.adv_estimator=spin``): a prompt's ``rollout.n = 2`` samples form a pair; the one
with the higher summed score is *chosen*, the other *rejected*; a tie goes to the first sample (verl's
argmax). The estimator writes the label as the advantage: +1 on the chosen row's tokens, -1 on the
rejected row's. Note: verl's recipe does not use the data set's ground-truth response as the chosen
one (the paper's SPIN does); it ranks two generations by the reward, and so does this port.

Loss (``actor.policy_loss.loss_mode=spin``), per pair, with S = sum_t m_t log pi(y_t) the policy's and
R the reference's sequence log-prob over the response mask m, beta = ``actor.dpo_beta``:

    z    = (S_c - R_c) - (S_r - R_r)
    sigmoid: l = -(1 - eps) log sigma(beta z) - eps log sigma(-beta z)    (eps = algorithm.dpo_label_smoothing)
    ipo:     l = (z - 1 / (2 beta))^2                                     (algorithm.dpo_loss_type)

and the mini-batch loss is the mean of l over pairs, as verl's (micro-batch means / micro-batch count).

Reference schedule: step s starts by copying the actor into the reference when ``ref_update_freq`` f > 0
divides s (``refreshes_reference``). A checkpoint after step s holds the reference's weights only when a
resume could not rebuild it otherwise (``reference_to_checkpoint``): once refreshed it is no longer the
model path's, unless step s + 1 refreshes it first anyway — so never with f = 1 or f = -1 (fixed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlfoundry.algos.core_algos import _agg_kwargs, _cfg, agg_loss, register_adv_est, register_policy_loss
from rlfoundry.utils import torch_functional as F_

__all__ = ["DPO_LOSS_TYPES", "PAIR_METRICS", "compute_policy_loss_spin", "compute_spin_preference",
           "dpo_losses", "reference_to_checkpoint", "refreshes_reference", "spin_pair_terms"]

DPO_LOSS_TYPES = ("sigmoid", "ipo")  # verl's compute_online_dpo_loss knows these two
# per-pair metrics with verl's names, reported as mini-batch means (summed shares, like the loss)
PAIR_METRICS = ("actor/dpo_logits", "actor/policy_chosen_logps", "actor/policy_rejected_logps",
                "actor/reference_chosen_logps", "actor/reference_rejected_logps", "actor/rewards_chosen",
                "actor/rewards_rejected", "actor/rewards_margins", "actor/rewards_accuracies")


def dpo_losses(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0,
               loss_type: str = "sigmoid") -> torch.Tensor:
    """Per-pair DPO losses (P,) from z = (S_c - R_c) - (S_r - R_r) (P,) (module doc)."""
    if loss_type == "sigmoid":
        # label smoothing: a (eps) chance that the pair's label is flipped (conservative DPO)
        return (-(1 - label_smoothing) * F.logsigmoid(beta * logits)
                - label_smoothing * F.logsigmoid(-beta * logits))
    if loss_type == "ipo":  # Azar et al. 2023: regress z onto 1 / (2 beta) instead of pushing it to infinity
        return (logits - 1 / (2 * beta)).square()
    raise ValueError(f"algorithm.dpo_loss_type={loss_type!r}: choose one of {list(DPO_LOSS_TYPES)}")


def refreshes_reference(step: int, freq: int) -> bool:
    """Whether training step ``step`` (1-based) starts by copying the actor into the reference
    (``trainer.ref_update_freq`` = ``freq``; -1: never, the reference stays the initial model)."""
    return freq > 0 and step % freq == 0


def reference_to_checkpoint(step: int, freq: int) -> bool:
    """Whether a checkpoint taken after step ``step`` must hold the reference's weights for an exact
    resume: it was refreshed at least once (step >= freq) and step + 1 does not refresh it first."""
    return freq > 0 and step >= freq and not refreshes_reference(step + 1, freq)


@register_adv_est("spin")
def compute_spin_preference(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                            index: np.ndarray, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both the pair label (B, T): +1 × mask on each pair's chosen row, -1 × mask
    on its rejected row. A pair is the two rows sharing ``index`` (their prompt's uid), in row order;
    the higher summed score wins, a tie goes to the first row (verl's ``compute_onlinedpo_pref``)."""
    scores = (token_level_rewards * response_mask).sum(-1).tolist()
    rows: dict[Any, list[int]] = {}
    for i, uid in enumerate(index):
        rows.setdefault(uid, []).append(i)
    label = torch.empty(len(scores), dtype=token_level_rewards.dtype)
    for uid, pair in rows.items():
        if len(pair) != 2:
            raise ValueError(f"SPIN pairs two samples per prompt (actor_rollout_ref.rollout.n=2); prompt {uid!r} "
                             f"has {len(pair)}")
        first_wins = scores[pair[0]] >= scores[pair[1]]
        label[pair[0]], label[pair[1]] = (1.0, -1.0) if first_wins else (-1.0, 1.0)
    label = label.to(response_mask.device).unsqueeze(-1) * response_mask
    return label, label


def spin_pair_terms(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, label: torch.Tensor,
                    response_mask: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each row's pair quantities (B,): ``z`` and the chosen / rejected sequence log-probs of the policy
    (``S_c``, ``S_r``) and the reference (``R_c``, ``R_r``). ``label`` (B, T) is the estimator's ±1;
    ``index`` (B,) the pair ids: pass whole pairs. Both rows of a pair get the same values."""
    mask = response_mask.to(log_prob.dtype)
    seq = F_.masked_sum(log_prob, mask, axis=-1)
    ref = F_.masked_sum(ref_log_prob, mask, axis=-1)
    chosen = (F_.masked_sum(label, mask, axis=-1) > 0).to(seq.dtype)
    # a (B, B) same-pair matrix, not unique(): no data-dependent shape, so no host sync
    same = (index.reshape(-1, 1) == index.reshape(1, -1)).to(seq.dtype)
    terms = {"S_c": same @ (seq * chosen), "S_r": same @ (seq * (1 - chosen)),
             "R_c": same @ (ref * chosen), "R_r": same @ (ref * (1 - chosen))}
    terms["z"] = (terms["S_c"] - terms["R_c"]) - (terms["S_r"] - terms["R_r"])
    return terms


@register_policy_loss("spin")
def compute_policy_loss_spin(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                             rollout_is_weights: torch.Tensor | None = None, *,
                             ref_log_prob: torch.Tensor | None = None,
                             index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """SPIN's DPO loss of one micro-batch (module doc): the mean over the mini-batch's pairs, each
    pair's two rows counted once each over the mini-batch's rows (``config.global_batch_info``).

    ``advantages`` holds the pair labels (``compute_spin_preference``), ``ref_log_prob`` the reference's
    token log-probs, ``index`` (B,) the pair ids; ``config`` gives ``dpo_beta``, ``dpo_loss_type`` and
    ``dpo_label_smoothing``. ``old_log_prob``, ``loss_agg_mode`` and rollout IS weights are not used (nor
    by verl). Metrics: ``PAIR_METRICS`` and ``actor/dpo_loss``, mini-batch means summed over calls.
    """
    if ref_log_prob is None or index is None:
        raise ValueError("policy loss 'spin' needs ref_log_prob and the rows' pair ids: run it through the actor")
    beta = float(_cfg(config, "dpo_beta", 0.1))
    terms = spin_pair_terms(log_prob, ref_log_prob, advantages, response_mask, index)
    losses = dpo_losses(terms["z"], beta, float(_cfg(config, "dpo_label_smoothing", 0.0)),
                        str(_cfg(config, "dpo_loss_type", "sigmoid")))
    has_tokens = (response_mask.sum(-1) > 0).unsqueeze(-1)
    mean = lambda x: agg_loss(x.unsqueeze(-1), has_tokens, "seq-mean-token-sum", **_agg_kwargs(config))  # noqa: E731
    loss = mean(losses)
    z = terms["z"].detach()
    chosen, rejected = beta * (terms["S_c"] - terms["R_c"]), beta * (terms["S_r"] - terms["R_r"])
    values = (z, terms["S_c"], terms["S_r"], terms["R_c"], terms["R_r"], chosen, rejected, chosen - rejected,
              (z > 0).to(z.dtype))
    metrics = {name: mean(v.detach()) for name, v in zip(PAIR_METRICS, values)}
    return loss, metrics | {"actor/dpo_loss": loss.detach()}
