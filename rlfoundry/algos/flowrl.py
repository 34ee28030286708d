"""FlowRL: reward-distribution matching by flow balance (Zhu et al. 2025, arXiv:2509.15207), as verl's recipe
(``recipe/flowrl/flowrl_actor.py``) computes it.

A learned log-partition log Z(x) of each prompt (a small head on the policy's prompt hidden states,
``ProjZHead``) turns the reward into a target distribution exp(beta r) pi_ref / Z; the policy is pulled
onto it by the squared trajectory-balance residual of each sequence i (token means over its valid tokens):

    delta_i = log Z(x_i) + mean_t log pi(y_t) - beta * mean_t A_t - mean_t log pi_ref(y_t)
    w_i     = min(exp(sum_t (log pi - log pi_old)), 10)          (detached)
    loss    = mean_i w_i * delta_i^2

verl's choices, kept: the "reward" is the advantage (GRPO's group-normalised score, broadcast over the
tokens), beta = 15 is fixed, the importance weight is a whole-sequence ratio (token *sum*) clamped above
at 10 only (``clip_ratio`` is passed but unused), and it is detached. The loss replaces PPO's surrogate,
entropy bonus and KL loss. Registered as ``policy_loss.loss_mode=flowrl``; the actor supplies the two
inputs the common policy-loss contract lacks, ``ref_log_prob`` and ``log_z``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfoundry.algos import core_algos
from rlfoundry.utils import torch_functional as F_

__all__ = ["FLOWRL_BETA", "FLOWRL_WEIGHT_CAP", "SEQUENCE_METRICS", "ProjZHead", "compute_policy_loss_flowrl",
           "flowrl_residual", "flowrl_seq_losses", "prompt_mean_hidden"]

FLOWRL_BETA = 15.0  # verl's flowrl_beta_coef, fixed in its actor ("as per paper")
FLOWRL_WEIGHT_CAP = 10.0  # verl's clamp of the sequence importance weight (upper bound only)
# per-sequence metrics, scaled like the loss (summed over micro-batches they give the mini-batch's mean)
SEQUENCE_METRICS = ("actor/log_z", "actor/importance_weight")


class ProjZHead(nn.Module):
    """log Z(x) from a prompt's mean hidden state: (num_layers - 1) × [Linear(H, H), GELU, LayerNorm,
    Dropout(0.1)] then Linear(H, 1), the layout of verl's ``ProjZModule`` (``actor.proj_layer``, default 3)."""

    def __init__(self, hidden_size: int, num_layers: int = 3, dropout: float = 0.1):
        super().__init__()
        block = lambda: [nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.LayerNorm(hidden_size),  # noqa: E731
                         nn.Dropout(dropout)]
        self.net = nn.Sequential(*[m for _ in range(num_layers - 1) for m in block()], nn.Linear(hidden_size, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def prompt_mean_hidden(hidden: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """(B, H): the mean of the last layer's hidden states (B, Tp+Tr, H) over the prompt's real tokens.

    verl slices the prompt as the columns before ``-response_length - 1``: the prompt's last column (its
    last real token, prompts being left-padded) is left out, and so it is here.
    """
    width = hidden.shape[1] - response_length - 1
    mask = attention_mask[:, :width].unsqueeze(-1).to(hidden.dtype)
    return (hidden[:, :width] * mask).sum(1) / (mask.sum(1) + 1e-8)  # verl's masked_mean epsilon


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1) / (mask.sum(-1) + 1e-8)  # verl's masked_mean(axis=1)


def flowrl_residual(log_z: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                    advantages: torch.Tensor, response_mask: torch.Tensor, beta: float = FLOWRL_BETA) -> torch.Tensor:
    """(B,) delta = log Z + mean log pi - beta mean A - mean log pi_ref; ``log_z`` (B,), the rest (B, Tr)."""
    mask = response_mask.to(log_prob.dtype)
    return (log_z + _token_mean(log_prob, mask) - beta * _token_mean(advantages, mask)
            - _token_mean(ref_log_prob, mask))


def flowrl_seq_losses(log_z, log_prob, old_log_prob, ref_log_prob, advantages, response_mask,
                      beta: float = FLOWRL_BETA, weight_cap: float = FLOWRL_WEIGHT_CAP):
    """(B,) w * delta^2 and (B,) w, the detached sequence importance weight (module doc)."""
    mask = response_mask.to(log_prob.dtype)
    delta = flowrl_residual(log_z, log_prob, ref_log_prob, advantages, response_mask, beta)
    weight = torch.exp(((log_prob - old_log_prob) * mask).sum(-1)).detach().clamp(max=weight_cap)
    return weight * delta.square(), weight


@core_algos.register_policy_loss("flowrl")
def compute_policy_loss_flowrl(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                               rollout_is_weights: torch.Tensor | None = None, *,
                               ref_log_prob: torch.Tensor | None = None,
                               log_z: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """FlowRL's loss (module doc) over a micro-batch; ``log_z`` (B,), gradients through it and ``log_prob``.

    The mean over sequences uses the mini-batch's sequence count (``config.global_batch_info``, as every
    policy loss here) so micro-batching does not change the step; ``loss_agg_mode``, ``loss_scale_factor``
    and ``rollout_is_weights`` are not used (verl's loss ignores them too). A row without response tokens
    (a rank's stand-in row) adds nothing.
    """
    if ref_log_prob is None or log_z is None:
        raise ValueError("policy loss 'flowrl' needs ref_log_prob (actor.use_kl_loss=true) and log_z (the actor's "
                         "log-partition head): run it through the actor, whose FlowRL path passes both")
    seq_losses, weight = flowrl_seq_losses(log_z, log_prob, old_log_prob, ref_log_prob, advantages, response_mask)
    has_tokens = (response_mask.sum(-1) > 0).to(seq_losses.dtype)
    dp_size, sequences = _sequence_count(config, has_tokens)
    seq_mean = lambda x: (x * has_tokens).sum() * dp_size / sequences  # noqa: E731  the mini-batch's, as the loss
    loss = seq_mean(seq_losses)
    metrics = {  # SEQUENCE_METRICS are this micro-batch's share of the mini-batch mean, as the loss
        "actor/log_z": seq_mean(log_z.detach()),
        "actor/importance_weight": seq_mean(weight),
        "actor/ppo_kl": F_.masked_mean(old_log_prob - log_prob.detach(), response_mask),
        "actor/ref_kl": F_.masked_mean(ref_log_prob - log_prob.detach(), response_mask),
        "actor/log_reward": F_.masked_mean(advantages, response_mask),
        "actor/log_prob": F_.masked_mean(log_prob.detach(), response_mask),
        "actor/old_log_prob": F_.masked_mean(old_log_prob, response_mask),
        "actor/ref_log_prob": F_.masked_mean(ref_log_prob, response_mask),
    }
    return loss, metrics


def _sequence_count(config: Any, has_tokens: torch.Tensor) -> tuple[float, Any]:
    """(dp_size, sequences of the whole mini-batch) from ``config.global_batch_info``; this micro-batch's alone
    without one (a direct call)."""
    info = getattr(config, "global_batch_info", None) or {}
    if "global_batch_size" in info:
        return float(info.get("dp_size", 1)), max(float(info["global_batch_size"]), 1.0)
    return 1.0, has_tokens.sum().clamp(min=1)
