"""How far the rollout engine's sampled log-probs are from the actor's recomputed ones.

When a separate engine (vLLM) generates, it scores the sampled tokens with its own kernels and its
own copy of the weights; the actor rescores the same tokens as ``old_log_probs``. Stale weights (a
missed sync), a dtype mismatch or a sampler that reports processed log-probs all show up here
first, so this is the metric to read when the engines disagree.

Pure function: tensors in, ``dict[str, float]`` out, verl's metric names.
"""

from __future__ import annotations

import torch

__all__ = ["compute_rollout_actor_probs_diff"]


def compute_rollout_actor_probs_diff(
    rollout_log_probs: torch.Tensor,
    actor_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Compare the two scorings on probability scale over the response tokens.

    Args:
        rollout_log_probs: (B, Tr) log-probs of the sampled tokens as the engine reported them.
        actor_log_probs: (B, Tr) the actor's log-probs of the same tokens (``old_log_probs``).
        response_mask: (B, Tr) 1 for real response tokens (up to and including EOS).

    Returns:
        ``training/rollout_actor_probs_diff_{mean,max,std}`` of |exp(rollout) - exp(actor)| and
        ``training/rollout_actor_probs_pearson``, the correlation of the two probability vectors.
        Probabilities rather than log-probs: a token at p=1e-9 vs 1e-8 is a 2.3-nat log-prob gap but
        harmless, while 0.9 vs 0.5 matters; the probability scale weighs them as training does.
        The std uses Bessel's correction (0 for a single token); the correlation is NaN when either
        side is constant (undefined). No response token at all gives an empty dict.
    """
    mask = response_mask.bool()
    if rollout_log_probs.shape != actor_log_probs.shape or rollout_log_probs.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: rollout_log_probs {tuple(rollout_log_probs.shape)}, actor_log_probs "
            f"{tuple(actor_log_probs.shape)}, response_mask {tuple(mask.shape)}; all three must be (B, Tr)"
        )
    if not bool(mask.any()):
        return {}
    rollout_probs = rollout_log_probs.detach().double()[mask].exp()
    actor_probs = actor_log_probs.detach().double()[mask].exp()
    diff = (rollout_probs - actor_probs).abs()
    std = diff.std() if diff.numel() > 1 else diff.new_zeros(())
    return {
        "training/rollout_actor_probs_diff_mean": diff.mean().item(),
        "training/rollout_actor_probs_diff_max": diff.max().item(),
        "training/rollout_actor_probs_diff_std": std.item(),
        "training/rollout_actor_probs_pearson": _pearson(rollout_probs, actor_probs),
    }


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Sample correlation of two 1-D tensors; NaN when either has zero variance."""
    xc, yc = x - x.mean(), y - y.mean()
    denom = (xc.square().sum() * yc.square().sum()).sqrt()
    if float(denom) == 0.0:
        return float("nan")
    return float((xc * yc).sum() / denom)
