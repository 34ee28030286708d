"""SPPO: Self-Play Preference Optimization (Wu et al. 2024, arXiv:2405.00675), as verl's SPPO recipe
(``recipe/sppo``) trains it with a scalar reward in place of the paper's pairwise preference model.

The paper's update (eq. 3.6 / Algorithm 1) regresses the sequence log-ratio onto the centred
preference: for a response y with estimated win rate P(y ≻ π_t),

    loss = ( log π_θ(y)/π_t(y)  −  η (P(y ≻ π_t) − 1/2) )²

verl's recipe replaces the win rate by the sequence reward R_i = Σ_t r_{i,t} centred by a soft mean
over the whole batch (not per prompt), with the temperature ``algorithm.sppo_eta``:

    SoftMean_β(R) = (1/β) log( (1/B) Σ_j exp(β R_j) )    (β = 0: the arithmetic mean)
    Â_i = R_i − SoftMean_β(R)

and the actor minimises, per sequence, (Σ_t m (log π_θ − log π_old)  −  η Â_i)² with
η = ``actor.sppo_eta``, averaged over the sequences with at least one valid token. The log-ratio is a
token SUM (the sequence's log-probability ratio), not a mean; there is no clipping.

Here the centred reward travels as the batch's ``advantages`` (broadcast over the response, like GRPO's
sequence advantages), written by the estimator ``sppo`` and read back per sequence by the policy loss
``sppo``; both are registered with ``core_algos`` when ``rlfoundry.algos`` is imported.
"""

from __future__ import annotations

from typing import Any

import torch

from rlfoundry.algos import core_algos

__all__ = [
    "compute_policy_loss_sppo",
    "compute_sppo_outcome_advantage",
    "softmean",
    "sppo_sequence_losses",
    "sequence_values",
]

SPPO = "sppo"  # the estimator's and the policy loss's registered name


def softmean(x: torch.Tensor, beta: float, dim: int = -1) -> torch.Tensor:
    """SoftMean_β(x) = (1/β) log((1/n) Σ exp(β x)) along ``dim`` (reduced), the arithmetic mean at β = 0.

    β > 0 leans towards the maximum, β < 0 towards the minimum; logsumexp keeps large β·x finite.
    """
    if beta == 0:
        return x.mean(dim=dim)
    n = torch.tensor(float(x.shape[dim]), dtype=x.dtype, device=x.device)
    return (torch.logsumexp(beta * x, dim=dim) - torch.log(n)) / beta


@core_algos.register_adv_est(SPPO)
def compute_sppo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    sppo_eta: float | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPPO's centred sequence reward Â_i = R_i − SoftMean_η(R) over the whole batch, broadcast over the response.

    Args:
        token_level_rewards, response_mask: (B, T).
        sppo_eta: the soft mean's temperature; ``config.sppo_eta`` (``algorithm.sppo_eta``) when None, else 1.
    Returns:
        advantages, returns: (B, T), identical, 0 outside the mask.
    """
    eta = core_algos._cfg(config, "sppo_eta", 1.0) if sppo_eta is None else sppo_eta
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = core_algos._broadcast(scores - softmean(scores, float(eta)), response_mask)
    return advantages, advantages


def sequence_values(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The per-sequence value of a broadcast advantage (B, T) -> (B,): its mean over the valid tokens (0 if none)."""
    mask = response_mask.to(advantages.dtype)
    return (advantages * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def sppo_sequence_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    seq_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    eta: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence SPPO losses (log r_i − η Â_i)², with log r_i = Σ_t m (log π_θ − log π_old).

    Args:
        old_log_prob, log_prob, response_mask: (B, T); gradients flow through ``log_prob`` only.
        seq_rewards: (B,) the centred rewards Â_i.
    Returns:
        losses, log_ratios, targets (η Â_i): (B,) each.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratios = (log_prob * mask).sum(dim=-1) - (old_log_prob * mask).sum(dim=-1)
    targets = eta * seq_rewards.to(log_prob.dtype)
    return (log_ratios - targets) ** 2, log_ratios, targets


@core_algos.register_policy_loss(SPPO)
def compute_policy_loss_sppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """SPPO's squared regression loss, averaged over the sequences with a valid token (module doc).

    η is ``config.sppo_eta`` (``actor.sppo_eta``, default 1). verl's recipe defines the loss for
    ``loss_agg_mode`` token-mean only, as the mean over sequences; so does this. The mini-batch's
    sequence count (``config.global_batch_info``, ``agg_loss``'s contract) makes the update the same
    for any micro-batch size and rank count. Metrics (verl's recipe): ``actor/log_ratio_mean``,
    ``actor/preference_mean`` (mean η Â), plus the common three (``actor/ppo_kl``; clip fractions 0).
    """
    if loss_agg_mode != "token-mean":
        raise ValueError(f"policy loss 'sppo' is a mean over sequences (verl's recipe: loss_agg_mode=token-mean "
                         f"only), got loss_agg_mode={loss_agg_mode!r}")
    if rollout_is_weights is not None:
        raise ValueError("policy loss 'sppo' takes no rollout importance weights "
                         "(algorithm.rollout_correction.rollout_is)")
    eta = float(core_algos._cfg(config, "sppo_eta", 1.0))
    losses, log_ratios, targets = sppo_sequence_losses(
        old_log_prob, log_prob, sequence_values(advantages, response_mask), response_mask, eta)
    valid = response_mask.any(dim=-1, keepdim=True)
    # a (B, 1) "token" per sequence: seq-mean-token-sum is then the mean over the mini-batch's valid sequences
    loss = core_algos.agg_loss(losses.unsqueeze(-1), valid, "seq-mean-token-sum", **core_algos._agg_kwargs(config))
    with torch.no_grad():
        rows = valid.squeeze(-1).to(log_ratios.dtype)
        count = rows.sum().clamp(min=1)
        metrics = core_algos._metrics(0.0, core_algos.F_.masked_mean(old_log_prob - log_prob, response_mask))
        metrics["actor/log_ratio_mean"] = (log_ratios * rows).sum() / count
        metrics["actor/preference_mean"] = (targets * rows).sum() / count
    return loss, metrics
