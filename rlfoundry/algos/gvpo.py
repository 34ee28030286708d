"""GVPO, Group Variance Policy Optimization (Zhang et al. 2025, arXiv:2504.19599, NeurIPS 2025), as
verl's recipe (``recipe/gvpo``) computes it: ``actor.policy_loss.loss_mode=gvpo``.

GVPO fits the policy's implicit reward to the observed one within each prompt's group, which makes
the KL-regularised optimum pi* ~ pi' exp(R / beta) the loss's unique minimiser, with no importance
ratio and no clip. Per sequence i of a group g of k samples (pi' = the sampling policy, whose
log-probs are ``old_log_probs``; m the response mask; beta = ``actor.gvpo_beta``):

    S_i   = sum_t m_it log pi(y_it)               (sequence log-prob; S'_i the same under pi')
    r_i   = beta (S_i - S'_i)                     (implicit reward)
    a_i   = sum_t m_it A_it / sum_t m_it          (token mean of the advantage: R_i - mean_g R)
    l_i   = 1/2 ((r_i - sg(mean_g r)) - a_i)^2 / (k - 1)

The group mean of r is taken without gradient, as verl does; with centred advantages (GRPO without
std, the recipe's setting) the gradient equals that of the full-gradient form, since the errors of
a group sum to zero. The mini-batch loss is the mean over groups of each group's sum of l_i.

Deliberate difference: verl sums l_i over a micro-batch and scales by 1 / (micro-batches per
mini-batch), so its loss (and gradient) is ``ppo_micro_batch_size_per_gpu / k`` times this one and
changes with the micro-batch size; the two are equal when each micro-batch holds one group
(``ppo_micro_batch_size_per_gpu = rollout.n``). The group mean needs every sample of a group in the
same micro-batch (see ``whole_group_problem``; the trainer orders the rows so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlfoundry.algos.core_algos import _agg_kwargs, _cfg, _metrics, agg_loss, register_policy_loss
from rlfoundry.utils import torch_functional as F_

__all__ = ["GROUP_KEY", "compute_policy_loss_gvpo", "gvpo_sequence_losses", "whole_group_problem"]

GROUP_KEY = "uid_tensor"  # verl's name: the (B,) int64 group number of each row, written by the trainer


def gvpo_sequence_losses(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                         response_mask: torch.Tensor, index: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row GVPO losses l_i (B,) and each row's group size k (B,) among these rows (module doc).

    log_prob, old_log_prob, advantages, response_mask: (B, T); index: (B,) group ids. A group is the
    rows of this call that share an id, so pass whole groups. A group of one has no variance: its
    l_i divides by 1 (and is 0 for a centred advantage). A row without valid tokens has a_i = 0.
    """
    mask = response_mask.to(log_prob.dtype)
    reward = beta * (F_.masked_sum(log_prob, mask, axis=-1) - F_.masked_sum(old_log_prob, mask, axis=-1))
    adv = F_.masked_sum(advantages, mask, axis=-1) / mask.sum(-1).clamp(min=1)
    # a (B, B) same-group matrix instead of unique(): no data-dependent shape, so no host sync
    same = (index.reshape(-1, 1) == index.reshape(1, -1)).to(reward.dtype)
    size = same.sum(-1)
    mean = (same @ reward.detach()) / size
    return 0.5 * ((reward - mean) - adv).square() / (size - 1).clamp(min=1), size


@register_policy_loss("gvpo")
def compute_policy_loss_gvpo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                             rollout_is_weights: torch.Tensor | None = None,
                             index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """GVPO's loss of one micro-batch (module doc); ``index`` (B,) the rows' group ids (``GROUP_KEY``).

    beta = ``config.gvpo_beta``. The loss is sum_i k_i l_i / S over the rows with a valid token, S
    their count in the whole mini-batch (``config.global_batch_info``): for groups of k, the mean over
    groups of the group's sum of l_i, however the mini-batch is cut into micro-batches. As in verl,
    ``loss_agg_mode`` does not apply (the loss is per sequence). Rollout IS weights are not defined
    for GVPO (verl's recipe drops them): given, they are an error. Metrics: ``actor/ppo_kl`` (mean of
    log pi_old - log pi); the clip fractions are 0 (nothing is clipped).
    """
    if index is None:
        raise ValueError(f"policy loss 'gvpo' needs the rows' group ids ({GROUP_KEY!r}, written by the trainer)")
    if rollout_is_weights is not None:
        raise ValueError("policy loss 'gvpo' has no rollout importance weights: unset algorithm.rollout_correction.rollout_is")
    beta = _cfg(config, "gvpo_beta")
    if beta is None:
        raise ValueError("policy loss 'gvpo' needs actor_rollout_ref.actor.gvpo_beta")
    losses, size = gvpo_sequence_losses(log_prob, old_log_prob, advantages, response_mask, index, float(beta))
    has_tokens = (response_mask.sum(-1) > 0).unsqueeze(-1)
    loss = agg_loss((size * losses).unsqueeze(-1), has_tokens, "seq-mean-token-sum", **_agg_kwargs(config))
    return loss, _metrics(0.0, F_.masked_mean(old_log_prob - log_prob.detach(), response_mask))


def whole_group_problem(index: Sequence[int], cuts: Sequence[int]) -> str | None:
    """None when ``index`` (a rank's group ids, row order) holds runs of whole groups of one size k
    that divides each of ``cuts`` (its mini- and micro-batch sizes), so every cut keeps groups
    whole; else what is wrong."""
    runs: list[int] = []
    seen = set()
    for i, g in enumerate(index):
        if i and g == index[i - 1]:
            runs[-1] += 1
            continue
        if g in seen:
            return f"group {g} is not in consecutive rows"
        seen.add(g)
        runs.append(1)
    if len(set(runs)) > 1:
        return f"groups of different sizes {sorted(set(runs))}"
    k = runs[0] if runs else 1
    bad = [c for c in cuts if c % k]
    return f"batches of {bad} rows would cut groups of {k}" if bad else None
