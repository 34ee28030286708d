"""SPO, Single-stream Policy Optimization (Xu & Ding 2025, arXiv:2509.13232; verl's ``recipe/spo``).

One response per prompt; the baseline is not a group mean but a persistent per-prompt success
estimate, the mean of a Beta(alpha, beta) tracker that is updated every time the prompt is sampled:

    p_hat = alpha / (alpha + beta)                       the prompt's baseline
    A     = (r - p_hat - mean_batch) / (std_batch + 1e-8)   one scalar per response, on every token
    alpha <- rho * alpha + r,   beta <- rho * beta + (1 - r)  after the update, with the forgetting
    rho   = clip(2 ** (-D / 0.06), clip_lower, 0.96)        (rho.type=kl) or rho.value (constant)

``D`` is the mean |log pi_then - log pi_now| over the tokens of the prompt's previous response:
how far the policy moved since the prompt was last seen (0 on a first visit). The tracker starts
from offline scores (``offline_prior``), ``N_init = 1 / (1 - clip_lower)`` pseudo-counts spread by
the Jeffreys-smoothed success rate, and prompts are drawn with weight ``sqrt(p(1 - p)) + 0.05``
(``sampling_weights``): the prompts whose outcome is least certain are trained on most.

All functions are pure; the trainer keeps the tracker (``trainer/ppo/spo.py``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from rlfoundry.algos.core_algos import register_adv_est

__all__ = ["D_HALF", "EXPLORATION_EPSILON", "RHO_MAX", "compute_spo_advantage", "draw_prompts", "kl_rho", "offline_prior",
           "sampling_weights", "spo_advantages", "update_beta"]

D_HALF = 0.06  # the policy distance D at which the tracker keeps half its evidence (before clipping)
RHO_MAX = 0.96  # rho's upper clip: even an unchanged policy forgets a little
EXPLORATION_EPSILON = 0.05  # every tracked prompt keeps at least this sampling weight


def offline_prior(scores: list[float], offline_n: int, clip_lower: float,
                  rng: random.Random | None = None) -> tuple[float, float]:
    """(alpha, beta) of a prompt from its offline scores: each score counts as a success when > 0; more
    than ``offline_n`` scores are subsampled to ``offline_n`` (with ``rng``); ``offline_n == 0`` is the
    uninformed Beta(0.5, 0.5). Otherwise the Jeffreys-smoothed rate (k + 1/2) / (N + 1) is given
    ``N_init = 1 / (1 - clip_lower)`` pseudo-counts, the steady-state evidence of a tracker forgetting at
    ``rho = clip_lower``. Note: k and N are the kept count and ``offline_n`` (verl's formula), even when
    a prompt has fewer than ``offline_n`` scores."""
    if offline_n == 0:
        return 0.5, 0.5
    wins = [int(s > 0) for s in scores]
    if len(wins) > offline_n:
        wins = (rng or random).sample(wins, offline_n)
    n_init = 1.0 / (1.0 - clip_lower)
    k = sum(wins)
    return n_init * (k + 0.5) / (offline_n + 1), n_init * (offline_n - k + 0.5) / (offline_n + 1)


def sampling_weights(alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Prioritised sampling: weight sqrt(p (1 - p)) + epsilon, p = alpha / (alpha + beta); the standard
    deviation of the prompt's Bernoulli outcome, so solved and hopeless prompts are drawn rarely."""
    p = np.asarray(alpha, dtype=np.float64) / (np.asarray(alpha, dtype=np.float64) + np.asarray(beta))
    return np.sqrt(p * (1.0 - p)) + EXPLORATION_EPSILON


def draw_prompts(weights: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``size`` prompts drawn with probability proportional to ``weights`` (uniform when they
    are all 0), without replacement unless ``size`` exceeds the candidates."""
    w = np.asarray(weights, dtype=np.float64)
    total = float(w.sum())
    probs = w / total if total > 0 else np.full(len(w), 1.0 / len(w))
    return rng.choice(len(w), size=size, replace=size > len(w), p=probs / probs.sum())


def spo_advantages(rewards: torch.Tensor, p_hat: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Per-response advantages (B,): r - p_hat (p_hat = alpha / (alpha + beta), the tracker's mean),
    normalised over the whole batch by its mean and (unbiased) standard deviation. ``rewards`` is each
    response's summed score."""
    raw = rewards - p_hat.to(rewards.dtype)
    return (raw - raw.mean()) / (raw.std() + eps)


def kl_rho(then_log_probs: torch.Tensor, now_log_probs: torch.Tensor, response_mask: torch.Tensor,
           clip_lower: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho, D), each (B,): D = token-mean |log pi_then - log pi_now| over ``response_mask``; rho =
    2 ** (-D / D_HALF), clipped to [clip_lower, RHO_MAX]."""
    mask = response_mask.to(now_log_probs.dtype)
    d = ((then_log_probs - now_log_probs).abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    rho = torch.pow(2.0, -d / D_HALF)
    return rho.clamp(min=clip_lower, max=RHO_MAX), d


def update_beta(alpha: torch.Tensor, beta: torch.Tensor, rho: torch.Tensor,
                rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted Beta update: alpha' = rho alpha + r, beta' = rho beta + (1 - r)."""
    return rho * alpha + rewards, rho * beta + (1.0 - rewards)


@register_adv_est("spo")
def compute_spo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                          reward_baselines: torch.Tensor, config: Any = None,
                          **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """SPO's advantages as a registered estimator: ``reward_baselines`` (B,) is each row's tracker mean
    p_hat (the trainer writes it, ``trainer/ppo/spo.py``). Returns (advantages, returns), both the
    normalised scalar on every response token, as verl's recipe sets them."""
    with torch.no_grad():
        rewards = token_level_rewards.sum(-1)
        adv = spo_advantages(rewards, reward_baselines).unsqueeze(-1) * response_mask.to(rewards.dtype)
    return adv, adv
