"""PF-PPO: policy filtration by reward (Zhang et al. 2024, "Policy Filtration in RLHF to Fine-Tune
LLM for Code Generation", arXiv:2409.06957), as verl's ``compute_pf_ppo_reweight_data`` does it.

The scores of a noisy reward model are most reliable at their extremes, so the batch is resampled
(with replacement, to the same size) with weights that favour high-|score| samples; the PPO update
then learns mostly from those. verl applies it after GAE advantages (``algorithm.use_pf_ppo``).

Weights over the B sequence scores s (``reweight_method``):

- ``pow``:        w = |s| ** weight_pow
- ``max_min``:    w = 1 where s is the batch's maximum or minimum, else 0
- ``max_random``: w = 0.4 where s is the batch's maximum, else 0.1

each plus 1e-8 (a batch of zero scores still has a distribution; a zero-weight row is never drawn
in practice). Pure tensor functions; the DataProto helper only indexes rows.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PF_PPO_METHODS", "compute_pf_ppo_reweight_data", "pf_ppo_sample_indices", "pf_ppo_weights"]

PF_PPO_METHODS = ("pow", "max_min", "max_random")
_FLOOR = 1e-8  # verl's: keeps the weights a valid distribution when every score is 0


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """(B,) sampling weights (unnormalised) for the (B,) sequence scores; see the module doc."""
    if reweight_method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif reweight_method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={reweight_method!r} is not one of {list(PF_PPO_METHODS)}")
    return (weights + _FLOOR).clamp(min=_FLOOR)


@torch.no_grad()
def pf_ppo_sample_indices(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """(B,) row indices drawn with replacement, each with probability weight / sum(weights)."""
    weights = pf_ppo_weights(scores.float(), reweight_method, weight_pow)
    return torch.multinomial(weights.cpu(), len(scores), replacement=True, generator=generator)


def compute_pf_ppo_reweight_data(data: Any, reweight_method: str = "pow", weight_pow: float = 2.0,
                                 generator: torch.Generator | None = None) -> Any:
    """verl's function: ``data`` (a DataProto) resampled by its summed ``token_level_scores``.

    Every tensor and non-tensor column follows the drawn rows, and so does each ``meta_info`` list
    with one entry per row (e.g. ``global_token_num``), as in verl. ``generator`` makes the draw
    reproducible (the trainer seeds one per step, so a resumed run draws the same rows).
    """
    scores = data.batch["token_level_scores"].sum(dim=-1)
    idx = pf_ppo_sample_indices(scores, reweight_method, weight_pow, generator)
    out = data.select_idxs(idx)
    rows = idx.tolist()
    out.meta_info = {k: [v[i] for i in rows] if isinstance(v, list) and len(v) == len(data) else v
                     for k, v in data.meta_info.items()}
    return out
