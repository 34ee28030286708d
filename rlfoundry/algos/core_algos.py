"""Core RL algorithms: advantage estimators, policy/value losses, loss aggregation, KL penalties.

Pure tensor functions with verl 0.9's names and keyword arguments (``verl.trainer.ppo.core_algos``),
so users' code ports over. No workers, Ray, Hydra or config machinery: a ``config`` argument is any
object with the named attributes (a dataclass, ``SimpleNamespace``, OmegaConf ``DictConfig`` or dict).

Shapes: ``B`` sequences in the (micro-)batch, ``T`` response positions. ``response_mask`` is 1 on
tokens that count (up to and including EOS; 0 on padding and on tool/observation tokens).
``index`` is a length-B array of prompt ids (the ``uid`` column): responses sharing an id form a group.

Deliberate differences from verl (valid positions are unaffected unless stated):
- estimators return exact zeros at masked positions (``where``, so NaN/inf there cannot leak);
- REINFORCE++ carries the running return across masked positions instead of resetting it: the same
  for trailing padding, but a multi-turn reward now reaches earlier turns' tokens;
- every policy loss reports the same three metric keys (0.0 where a quantity does not apply), and
  ``actor/ppo_kl`` always means mean(log pi_old - log pi) (verl's KL-Cov reports mean |log r|);
- ``agg_loss`` returns 0, not NaN, for a micro-batch without valid tokens.

Global-batch contract (see ``agg_loss``): pass the mini-batch-wide counts from
``compute_global_batch_info`` (all-reduced over ranks) to every micro-batch, sum gradients over
micro-batches, let DP average over ranks: the update is then independent of micro-batch size and
rank count. Policy losses receive the counts as ``config.global_batch_info``; build that with
``with_global_batch_info(actor_config, info)`` instead of mutating the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import numpy as np
import torch

from rlfoundry.algos import rollout_corr
from rlfoundry.algos.pf_ppo import compute_pf_ppo_reweight_data  # verl's home for it
from rlfoundry.utils import torch_functional as F_

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AGG_LOSS_MODES",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "agg_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_global_batch_info",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_pf_ppo_reweight_data",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "kl_penalty_forward",
    "register_adv_est",
    "register_policy_loss",
    "with_global_batch_info",
]


# ─────────────────────────────── config access ───────────────────────────────


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` for attribute-style configs, ``config[name]`` for mappings; None -> ``default``."""
    if config is None:
        return default
    value = config.get(name, None) if isinstance(config, Mapping) else getattr(config, name, None)
    return default if value is None else value


# ─────────────────────────────── registries ───────────────────────────────


class AdvantageEstimator(str, Enum):
    """Names of the registered advantage estimators (verl's values); plug-ins may use any string."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}
POLICY_LOSS_REGISTRY: dict[str, Callable] = {}


def _key(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else str(name_or_enum)


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator; re-registering a name with another function is an error."""

    def decorator(fn: Callable) -> Callable:
        name = _key(name_or_enum)
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered as {ADV_ESTIMATOR_REGISTRY[name]}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable:
    """The estimator registered under ``name_or_enum``; the error lists the known names."""
    name = _key(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}. "
            f"Register a custom one with @register_adv_est({name!r})."
        )
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss ``fn(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)`` under ``name``."""

    def decorator(fn: Callable) -> Callable:
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered under ``name``; the error lists the known names."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"unknown policy loss mode {name!r}; known: {sorted(POLICY_LOSS_REGISTRY)}. "
            f"Register a custom one with @register_policy_loss({name!r})."
        )
    return POLICY_LOSS_REGISTRY[name]


# ─────────────────────────────── KL controllers ───────────────────────────────


class FixedKLController:
    """Constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences", §2.2).

    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    The clip bounds the step so one noisy KL estimate cannot swing the coefficient.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by ``kl_ctrl.type`` (``fixed`` or ``adaptive``) from
    ``kl_ctrl.kl_coef`` (and ``target_kl``, ``horizon`` for adaptive)."""
    kind = _cfg(kl_ctrl, "type")
    if kind == "fixed":
        return FixedKLController(kl_coef=_cfg(kl_ctrl, "kl_coef"))
    if kind == "adaptive":
        horizon = _cfg(kl_ctrl, "horizon")
        if horizon is None or horizon <= 0:
            raise ValueError(f"adaptive KL controller needs kl_ctrl.horizon > 0, got {horizon}")
        return AdaptiveKLController(_cfg(kl_ctrl, "kl_coef"), _cfg(kl_ctrl, "target_kl"), horizon)
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; expected 'fixed' or 'adaptive'")


# ─────────────────────────────── group statistics ───────────────────────────────


def _group_ids(index: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map prompt ids (numpy array of str/int/objects, list, or tensor) to dense ints 0..G-1. -> ((B,), G)."""
    if isinstance(index, torch.Tensor):
        uniq, inverse = torch.unique(index, return_inverse=True)
        return inverse.to(device), int(uniq.numel())
    uniq, inverse = np.unique(np.asarray(index), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device), len(uniq)


def _group_sum(x: torch.Tensor, g: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums of a (B,) tensor. -> (G,)."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, g, x)


def _group_mean_std(scores: torch.Tensor, g: torch.Tensor, num_groups: int):
    """Per-sample group count, mean and unbiased std. (B,) -> three (B,) tensors.

    A group of one has mean 0 and std 1 (verl's convention), so its advantage is its raw score.
    """
    counts = _group_sum(torch.ones_like(scores), g, num_groups)
    mean = _group_sum(scores, g, num_groups) / counts
    sq_dev = _group_sum((scores - mean[g]) ** 2, g, num_groups)  # two-pass: no catastrophic cancellation
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    single = counts[g] == 1
    mean_b = torch.where(single, torch.zeros_like(scores), mean[g])
    std_b = torch.where(single, torch.ones_like(scores), std[g])
    return counts[g], mean_b, std_b


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the mask, exact 0 elsewhere (``where``, not ``*``, so NaN/inf at masked positions cannot leak)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _broadcast(scalars: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence advantage -> (B, T), zero outside the mask."""
    return scalars.unsqueeze(-1) * response_mask.to(scalars.dtype)


# ─────────────────────────────── advantage estimators ───────────────────────────────


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor = None,
    lam: float | torch.Tensor = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next, where "next" is the
    next *valid* position: masked positions (padding, observation tokens) are skipped, so their
    rewards and values never enter the recursion. returns = A + V (unwhitened, the critic's target);
    advantages are whitened over the mask (batch statistics). Both are 0 outside the mask.

    Args:
        token_level_rewards, values, response_mask: (B, T).
        gamma, lam: discount and GAE lambda; taken from ``config.gamma`` / ``config.lam`` if None.
    Returns:
        advantages, returns: (B, T).
    """
    gamma = _cfg(config, "gamma") if gamma is None else gamma
    lam = _cfg(config, "lam") if lam is None else lam
    if gamma is None or lam is None:
        raise ValueError("compute_gae_advantage_return needs gamma and lam (arguments or config.gamma/config.lam)")
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        next_adv = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * next_adv
            m = mask[:, t]
            # masked position: carry the next valid token's value/advantage through unchanged
            next_value = torch.where(m.bool(), values[:, t], next_value)
            next_adv = torch.where(m.bool(), adv_t, next_adv)
            advantages[:, t] = adv_t
        returns = _zero_outside(advantages + values, mask)
        advantages = _zero_outside(F_.masked_whiten(_zero_outside(advantages, mask), mask), mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, §4.1.2).

    score_i = sum_t r_{i,t};  A_i = (score_i - mean_g) / (std_g + epsilon) with the unbiased std of the
    prompt group g, broadcast over the response. ``norm_adv_by_std_in_grpo=False`` drops the division
    (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783: the std term biases toward too-easy/too-hard prompts).
    A group of one keeps its raw score (mean 0, std 1).

    Args:
        token_level_rewards, response_mask: (B, T);  index: (B,) prompt ids.
    Returns:
        advantages, returns: (B, T), identical.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g, num_groups = _group_ids(index, scores.device)
        _, mean, std = _group_mean_std(scores, g, num_groups)
        centred = scores - mean
        scalars = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = _broadcast(scalars, response_mask)
    return advantages, advantages


compute_grpo_vectorized_outcome_advantage = compute_grpo_outcome_advantage


@register_adv_est(AdvantageEstimator.GDPO)
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: Mapping[str, Any] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, group reward-decoupled normalisation (arXiv:2601.05242; verl 0.9.1's ``gdpo``).

    Summing reward components before GRPO lets the component with the largest spread decide every
    group's ranking; GDPO normalises each component k within its prompt group first:
      A_k = GRPO advantage of component k;  A = sum_k w_k A_k;  advantages = whiten(A) over the mask.
    Components are the columns ``config.gdpo_reward_keys`` of ``non_tensor_batch`` (the reward
    function's ``reward_extra_info``), weights ``config.gdpo_reward_weights`` (default all 1).
    Without ``non_tensor_batch`` the single component is the summed ``token_level_rewards``.

    Args:
        token_level_rewards, response_mask: (B, T);  index: (B,) prompt ids.
        non_tensor_batch: column name -> (B,) numbers.
    Returns:
        advantages, returns: (B, T), identical, 0 outside the mask.
    """
    components, weights = _gdpo_components(token_level_rewards, config, non_tensor_batch)
    with torch.no_grad():
        total = torch.zeros_like(token_level_rewards)
        for weight, scores in zip(weights, components):
            adv, _ = compute_grpo_outcome_advantage(scores.unsqueeze(-1), response_mask, index, epsilon,
                                                    norm_adv_by_std_in_grpo)
            total = total + weight * adv
        mask = response_mask.to(total.dtype)
        advantages = _zero_outside(F_.masked_whiten(total, mask), mask)
    return advantages, advantages


def _gdpo_components(token_level_rewards, config, non_tensor_batch) -> tuple[list[torch.Tensor], list[float]]:
    """GDPO's per-component sequence scores (B,) and their weights; errors name the missing key."""
    if non_tensor_batch is None:
        return [token_level_rewards.sum(dim=-1)], [1.0]
    keys = list(_cfg(config, "gdpo_reward_keys", None) or [])
    if not keys:
        raise ValueError("adv_estimator 'gdpo' needs algorithm.gdpo_reward_keys: the reward function's "
                         "reward_extra_info keys to normalise separately, e.g. [format_reward,accuracy_reward]")
    weights = list(_cfg(config, "gdpo_reward_weights", None) or [1.0] * len(keys))
    if len(weights) != len(keys):
        raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys)} gdpo_reward_keys")
    components = []
    for key in keys:
        if key not in non_tensor_batch:
            raise ValueError(f"GDPO reward component {key!r} (algorithm.gdpo_reward_keys) is not a column of the batch "
                             f"({sorted(non_tensor_batch)}): the reward function must return it in its dict "
                             "(reward_extra_info) for every sample")
        scores = torch.as_tensor(np.asarray(non_tensor_batch[key], dtype=np.float64), device=token_level_rewards.device)
        if not torch.isfinite(scores).all():
            bad = int((~torch.isfinite(scores)).sum())
            raise ValueError(f"GDPO reward component {key!r} is missing (NaN) or infinite for {bad} of {scores.numel()} "
                             "samples: compute_score must return it, as a number, for every sample")
        components.append(scores.to(token_level_rewards.dtype))
    return components, [float(w) for w in weights]


@register_adv_est(AdvantageEstimator.RLOO)
@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740, eq. 6).

    A_i = score_i - mean_{j != i} score_j = n/(n-1) * (score_i - mean_g) for a group of n > 1;
    a group of one keeps its raw score. ``epsilon`` is unused (kept for a uniform call).

    Args:
        token_level_rewards, response_mask: (B, T);  index: (B,) prompt ids.
    Returns:
        advantages, returns: (B, T), identical.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g, num_groups = _group_ids(index, scores.device)
        counts = _group_sum(torch.ones_like(scores), g, num_groups)[g]
        sums = _group_sum(scores, g, num_groups)[g]
        loo = (counts * scores - sums) / (counts - 1).clamp(min=1)
        advantages = _broadcast(torch.where(counts > 1, loo, scores), response_mask)
    return advantages, advantages


compute_rloo_vectorized_outcome_advantage = compute_rloo_outcome_advantage


@register_adv_est(AdvantageEstimator.OPO)
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585).

    Baseline b_g = sum_i |y_i| score_i / sum_i |y_i| (length-weighted group mean, |y_i| = valid tokens);
    A_i = score_i - b_g; a group of one keeps its raw score. -> advantages, returns: (B, T), identical.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        g, num_groups = _group_ids(index, scores.device)
        counts = _group_sum(torch.ones_like(scores), g, num_groups)[g]
        baseline = _group_sum(lengths * scores, g, num_groups)[g] / _group_sum(lengths, g, num_groups)[g].clamp(
            min=1e-12
        )
        baseline = torch.where(counts > 1, baseline, torch.zeros_like(baseline))
        advantages = _broadcast(scores - baseline, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (Chen et al. 2025, arXiv:2503.19595): only the best response of each group
    gets a non-zero advantage, r_max - r_second_max (divided by std_g + epsilon when normalising).

    ``config.norm_adv_by_std_in_grpo`` overrides the argument when a config is given (as verl).
    Every group needs at least two responses. -> advantages, returns: (B, T), identical.
    """
    norm = bool(_cfg(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo))
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g, num_groups = _group_ids(index, scores.device)
        counts, _, std = _group_mean_std(scores, g, num_groups)
        if bool((counts < 2).any()):
            raise ValueError("grpo_passk needs at least 2 responses per prompt group (rollout.n >= 2)")
        # order by (group, score descending); stable sorts make the first of tied maxima the winner
        by_score = torch.sort(scores, descending=True, stable=True).indices
        order = by_score[torch.sort(g[by_score], stable=True).indices]
        group_sizes = torch.bincount(g, minlength=num_groups)
        starts = torch.cumsum(group_sizes, 0) - group_sizes
        best, second = order[starts], order[starts + 1]
        gap = scores[best] - scores[second]
        if norm:
            gap = gap / (std[best] + epsilon)
        scalars = torch.zeros_like(scores).index_copy_(0, best, gap)
        advantages = _broadcast(scalars, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GPG)
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient advantage (Chu et al. 2025, arXiv:2504.02546).

    A_i = alpha * (score_i - mean_g) / f_norm with alpha = B / #(non-zero scores) (the paper's
    correction for groups whose rewards are all zero; it replaces the ``alpha`` argument, as in verl).
    A group of one keeps alpha * score / f_norm. -> advantages, returns: (B, T), identical.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        alpha = scores.numel() / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
        g, num_groups = _group_ids(index, scores.device)
        _, mean, _ = _group_mean_std(scores, g, num_groups)
        advantages = _broadcast(alpha * (scores - mean) / f_norm, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    G_t = r_t + gamma * G_next over valid positions only: a masked position adds no reward, is not
    discounted and does not reset the running return (it is skipped). gamma comes from
    ``config.gamma`` (verl 0.9), else a ``gamma`` keyword. advantages = whiten(G) over the mask.

    Args:
        token_level_rewards, response_mask: (B, T).
    Returns:
        advantages (whitened), returns (G): (B, T), 0 outside the mask.
    """
    gamma = _cfg(config, "gamma", kwargs.get("gamma"))
    if gamma is None:
        raise ValueError("reinforce_plus_plus needs config.gamma (algorithm.gamma)")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        running = torch.zeros_like(token_level_rewards[:, 0])
        returns = torch.zeros_like(token_level_rewards)
        for t in reversed(range(token_level_rewards.shape[-1])):
            m = mask[:, t]
            running = torch.where(m.bool(), token_level_rewards[:, t] + gamma * running, running)
            returns[:, t] = running
        returns = _zero_outside(returns, mask)
        advantages = _zero_outside(F_.masked_whiten(returns, mask), mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): subtract the prompt-group mean score,
    then whiten over all valid tokens of the batch (global normalisation instead of GRPO's per-group std).

    A group of one uses baseline 0. -> advantages, returns: (B, T), identical, 0 outside the mask.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g, num_groups = _group_ids(index, scores.device)
        _, mean, _ = _group_mean_std(scores, g, num_groups)
        mask = response_mask.to(scores.dtype)
        advantages = F_.masked_whiten(_broadcast(scores - mean, mask), mask) * mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): REINFORCE with the greedy response's reward as baseline.

    G_t = sum_{s >= t} mask_s r_s (undiscounted return-to-go); A_t = G_t - b for valid t.

    Args:
        token_level_rewards, response_mask: (B, T);  reward_baselines: (B,) greedy-decode scores.
    Returns:
        advantages, returns: (B, T), 0 outside the mask.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
        advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


def _otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    """Return-to-go G and cumulative path-variance proxy W of the optimal token baseline. -> (B, T) each.

    ||grad log pi(a_t)||^2 w.r.t. the logits is ||e_a - pi||^2 = 1 - 2 pi(a_t) + sum_v pi_v^2 per token;
    W_t sums it over the valid tokens up to t, scaled by the squared rollout IS weight where given.
    """
    if sum_pi_squared is None or old_log_probs is None:
        raise ValueError("the optimal token baseline needs old_log_probs and sum_pi_squared (the actor's per-token "
                         "sum of squared probabilities, verl's actor.calculate_sum_pi_squared)")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    return returns, (w * mask).cumsum(-1)


def _optimal_baseline(returns, w_cum, lengths, g, num_groups, in_group, handle_zero_tail, epsilon):
    """Per-position baseline b_t = sum_i G_it W_it / (sum_i W_it + eps) over each prompt group.

    ``returns``/``w_cum`` (B, T) are 0 where a row has no token at t; rows outside ``in_group`` do not
    count toward a group's size. A group of one gets baseline 0. With ``handle_zero_tail``, a group's
    single longest row gets baseline 0 from the second-longest row's length on (no other row is there
    to estimate it). -> (B, T).
    """
    T = returns.shape[-1]
    num = torch.zeros(num_groups, T, dtype=returns.dtype, device=returns.device).index_add_(0, g, returns * w_cum)
    den = torch.zeros_like(num).index_add_(0, g, w_cum) + epsilon
    baseline = (num / den)[g]
    sizes = _group_sum(in_group.to(returns.dtype), g, num_groups)[g]
    baseline = torch.where((sizes > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        lens = torch.where(in_group, lengths, torch.full_like(lengths, -1))
        gmax = torch.full((num_groups,), -1, dtype=lens.dtype, device=lens.device).scatter_reduce(0, g, lens, "amax")
        at_max = in_group & (lens == gmax[g])
        others = torch.where(at_max, torch.full_like(lens, -1), lens)
        second = torch.full_like(gmax, -1).scatter_reduce(0, g, others, "amax")[g].clamp(min=0)
        unique_longest = at_max & (_group_sum(at_max.to(returns.dtype), g, num_groups)[g] == 1) & (sizes > 1)
        tail = torch.arange(T, device=returns.device).unsqueeze(0) >= second.unsqueeze(-1)
        baseline = torch.where(unique_longest.unsqueeze(-1) & tail, torch.zeros_like(baseline), baseline)
    return baseline


@register_adv_est(AdvantageEstimator.OPTIMAL_TOKEN_BASELINE)
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (verl 0.9.1's ``optimal_token_baseline``): a baseline per position t.

    The variance-minimising baseline of a policy gradient weights each sample's return by its squared
    score norm (Greensmith et al. 2004); per token this is b_t = E[G_t W_t] / E[W_t] over the prompt
    group, W_t the cumulative 1 - 2 pi(a_j) + sum pi^2 (``_otb_inputs``). A_t = G_t - b_t, positions
    aligned by column. Rows of a group of one keep A = G.

    Args:
        token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights: (B, T);
        index: (B,) prompt ids.
    Returns:
        advantages, returns (return-to-go G): (B, T), 0 outside the mask.
    """
    with torch.no_grad():
        returns, w_cum = _otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                     rollout_is_weights)
        mask = response_mask.to(returns.dtype)
        g, num_groups = _group_ids(index, returns.device)
        lengths = response_mask.sum(-1).long()
        in_group = torch.ones_like(lengths, dtype=torch.bool)
        baseline = _optimal_baseline(returns * mask, w_cum * mask, lengths, g, num_groups, in_group,
                                     handle_zero_tail, epsilon)
        advantages = _zero_outside(returns - baseline, mask)
    return advantages, _zero_outside(returns, mask)


@register_adv_est(AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE)
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline for tool-integrated (multi-turn) rollouts (verl's ``tir_optimal_token_baseline``).

    As ``compute_optimal_token_baseline_advantage``, but positions are aligned by the index of the
    *generated* token (the k-th valid token of each row), not by column: tool output between turns
    is masked and would otherwise shift one row's k-th action against another's. Rows without a
    valid token leave their group. -> advantages, returns (G): (B, T), 0 outside the mask.
    """
    with torch.no_grad():
        returns, w_cum = _otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                     rollout_is_weights)
        valid = response_mask.bool()
        lengths = valid.sum(-1)
        # k-th valid token of row i -> column k of a compacted (B, T) layout
        rows, cols = valid.nonzero(as_tuple=True)
        k = (valid.cumsum(-1) - 1)[rows, cols]
        compact_g, compact_w = torch.zeros_like(returns), torch.zeros_like(w_cum)
        compact_g[rows, k], compact_w[rows, k] = returns[rows, cols], w_cum[rows, cols]
        g, num_groups = _group_ids(index, returns.device)
        baseline = _optimal_baseline(compact_g, compact_w, lengths, g, num_groups, lengths > 0,
                                     handle_zero_tail, epsilon)
        advantages = torch.zeros_like(returns)
        advantages[rows, cols] = (compact_g - baseline)[rows, k]
    return advantages, _zero_outside(returns, response_mask)


# ─────────────────────────────── rewards ───────────────────────────────


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """KL-penalised reward r - beta * (log pi_old - log pi_ref) (Ziegler et al. 2019, eq. 2). All (B, T)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


# ─────────────────────────────── loss aggregation ───────────────────────────────

AGG_LOSS_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _require_global(name: str, value: Any, dp_size: int, mode: str) -> None:
    if value is None and dp_size > 1:
        raise ValueError(
            f"agg_loss({mode!r}) with dp_size={dp_size} needs {name} (counted over the whole mini-batch on "
            f"all ranks); without it each rank would normalise by its own count and the update would "
            f"depend on how the batch is split"
        )


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix (B, T) of one micro-batch to a scalar.

    Modes (N = valid tokens, S = sequences with at least one valid token, L = loss_scale_factor):
      token-mean               sum_{i,t} m l / N
      token-sum                sum_{i,t} m l
      seq-mean-token-sum       (1/S) sum_i sum_t m l
      seq-mean-token-mean      (1/S) sum_i (sum_t m l / sum_t m)
      seq-mean-token-sum-norm  (1/S) sum_i sum_t m l / L   (Dr.GRPO, Liu et al. 2025: L a constant budget)

    Global-batch contract (what makes a mini-batch update independent of micro-batch size and of the
    number of data-parallel ranks). A mini-batch is split over ``dp_size`` ranks, and each rank's share
    into micro-batches. Pass to every micro-batch's call the SAME mini-batch-wide counts:
      batch_num_tokens   N = sum of loss_mask over the whole mini-batch on all ranks (token-mean);
      global_batch_size  S = number of sequences with >= 1 valid token in the whole mini-batch on all
                         ranks (seq-mean-*);
      dp_size            the number of data-parallel ranks whose gradients are AVERAGED (FSDP/DDP);
      loss_scale_factor  L, a constant such as the max response length (seq-mean-token-sum-norm).
    Each call then returns  dp_size * (its share of the numerator) / (global count), e.g. token-mean
    gives dp_size * sum(l * m) / N. The worker must backpropagate each micro-batch loss as is and
    SUM the gradients over micro-batches (no extra 1/num_micro_batches); the DP all-reduce mean over
    ranks then divides by dp_size, and the result equals the gradient of the mode's loss over the
    whole mini-batch exactly. (token-sum needs only dp_size.) ``compute_global_batch_info`` counts
    N and S from a mask; with several ranks, all-reduce (SUM) the counts before use.

    Fallback: with the global arguments None and dp_size == 1, the statistic of this micro-batch is
    used (exact for a single micro-batch; the worker must then weight micro-batches itself). None with
    dp_size > 1 is an error. If L is None, the padded width T of this micro-batch is used, which is
    invariant only when every micro-batch is padded to the same width.

    Empty micro-batches (no valid token) give 0, never NaN.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        _require_global("batch_num_tokens", batch_num_tokens, dp_size, loss_agg_mode)
        denom = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return F_.masked_sum(loss_mat, mask) * dp_size / _at_least_one(denom, loss_mat)
    if loss_agg_mode == "token-sum":
        return F_.masked_sum(loss_mat, mask) * dp_size
    if loss_agg_mode not in AGG_LOSS_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {list(AGG_LOSS_MODES)}")
    _require_global("global_batch_size", global_batch_size, dp_size, loss_agg_mode)
    seq_tokens = mask.sum(dim=-1)
    seq_losses = F_.masked_sum(loss_mat, mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / _nonzero(seq_tokens)
    num_seqs = (seq_tokens > 0).sum() if global_batch_size is None else global_batch_size
    loss = seq_losses.sum() * dp_size / _at_least_one(num_seqs, loss_mat)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _at_least_one(count: int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A count as a tensor of ``like``'s dtype, 0 replaced by 1 so an empty batch gives 0/1 = 0, not NaN."""
    return _nonzero(torch.as_tensor(count, dtype=like.dtype, device=like.device))


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x == 0, torch.ones_like(x), x)


def compute_global_batch_info(loss_mask: torch.Tensor, dp_size: int = 1) -> dict[str, Any]:
    """Counts for ``agg_loss``'s global-batch contract from the loss mask of a whole mini-batch (B, T).

    Returns ``{"dp_size", "batch_num_tokens", "global_batch_size"}`` (ints). With dp_size > 1, call it
    on each rank's share and all-reduce (SUM) the two counts before passing them on.
    """
    seq_tokens = loss_mask.sum(dim=-1)
    return {
        "dp_size": dp_size,
        "batch_num_tokens": int(seq_tokens.sum().item()),
        "global_batch_size": int((seq_tokens > 0).sum().item()),
    }


# ─────────────────────────────── policy losses ───────────────────────────────

_AGG_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


class _ConfigWithBatchInfo:
    """Read-only view of a config plus ``global_batch_info``: lets a worker hand the mini-batch counts
    to any verl-style policy loss (which reads ``config.global_batch_info``) without mutating the config."""

    def __init__(self, config: Any, info: Mapping[str, Any]):
        self._config, self.global_batch_info = config, dict(info)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_config":
            raise AttributeError(name)
        return _cfg(self._config, name) if isinstance(self._config, Mapping) else getattr(self._config, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self.global_batch_info if name == "global_batch_info" else _cfg(self._config, name, default)


def with_global_batch_info(config: Any, global_batch_info: Mapping[str, Any]) -> Any:
    """``config`` seen through a view whose ``global_batch_info`` is the given counts (see ``agg_loss``)."""
    return _ConfigWithBatchInfo(config, global_batch_info)


def _agg_kwargs(config: Any) -> dict[str, Any]:
    """The ``agg_loss`` global-batch keywords carried by ``config.global_batch_info`` (verl's channel),
    plus ``config.loss_scale_factor`` when the info does not set it."""
    info = dict(_cfg(config, "global_batch_info", {}) or {})
    unknown = set(info) - set(_AGG_KEYS)
    if unknown:
        raise ValueError(f"config.global_batch_info has unknown keys {sorted(unknown)}; allowed: {list(_AGG_KEYS)}")
    if info.get("loss_scale_factor") is None and _cfg(config, "loss_scale_factor") is not None:
        info["loss_scale_factor"] = _cfg(config, "loss_scale_factor")
    return {k: v for k, v in info.items() if v is not None}


def _clip_range(config: Any) -> tuple[float, float]:
    """(eps_low, eps_high): ``clip_ratio_low``/``clip_ratio_high``, each defaulting to ``clip_ratio``."""
    eps = _cfg(config, "clip_ratio")
    low, high = _cfg(config, "clip_ratio_low", eps), _cfg(config, "clip_ratio_high", eps)
    if low is None or high is None:
        raise ValueError("the policy loss needs config.clip_ratio (or both clip_ratio_low and clip_ratio_high)")
    return low, high


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    # log(pi / pi_old), clamped to +-20 so exp() cannot overflow on a stale or corrupt old log-prob
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def _metrics(clipfrac: Any, ppo_kl: torch.Tensor, clipfrac_lower: Any = 0.0) -> dict[str, Any]:
    """The policy loss's metrics as detached 0-d tensors (plain floats stay floats): the update reads them
    to the host once per mini-batch, together (``engines/loop.MiniBatchStats``), not once each per micro-batch."""
    def as_metric(x: Any) -> Any:
        return x.detach() if isinstance(x, torch.Tensor) else float(x)

    return {
        "actor/pg_clipfrac": as_metric(clipfrac),
        "actor/ppo_kl": as_metric(ppo_kl),
        "actor/pg_clipfrac_lower": as_metric(clipfrac_lower),
    }


def _ppo_clip_losses(old_log_prob, log_prob, advantages, response_mask, eps_low, eps_high, clip_ratio_c):
    """Per-token PPO-clip loss with dual clip. -> (loss (B, T), clipfrac, ppo_kl, clipfrac_lower).

    PPO (Schulman et al. 2017): max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); asymmetric eps_high >
    eps_low is DAPO's clip-higher (Yu et al. 2025). Dual clip (Ye et al. 2020, arXiv:1912.09729): for
    A < 0 the loss is also capped at -A c, so one token with a huge ratio cannot dominate the update.
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip PPO needs clip_ratio_c > 1.0, got {clip_ratio_c}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    ppo_kl = F_.masked_mean(-log_ratio, response_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clip_loss = torch.maximum(unclipped, clipped)
    clipfrac = F_.masked_mean((clipped > unclipped).float(), response_mask)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    clipfrac_lower = F_.masked_mean(((clip_loss > dual_bound) & negative).float(), response_mask)
    loss = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    return loss, clipfrac, ppo_kl, clipfrac_lower


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
):
    """PPO-clip with dual clip, plain-argument form (verl's legacy API). All inputs (B, T).

    ``cliprange_low``/``cliprange_high`` default to ``cliprange``. Aggregates over this batch only
    (no global-batch arguments; use ``compute_policy_loss_vanilla`` for those).
    Returns: (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), scalar tensors.
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss needs cliprange (or both cliprange_low and cliprange_high)")
    losses, clipfrac, ppo_kl, clipfrac_lower = _ppo_clip_losses(
        old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c
    )
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode)
    return pg_loss, clipfrac, ppo_kl, clipfrac_lower


def _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights):
    """Apply rollout importance weights (token-level, detached by the caller) and aggregate."""
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    return agg_loss(losses, response_mask, loss_agg_mode, **_agg_kwargs(config))


_POLICY_LOSS_DOC = """
    Common contract of the registered policy losses:
      fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
         rollout_is_weights=None) -> (loss: scalar tensor, metrics: dict of floats)
    old_log_prob, log_prob, advantages, response_mask, rollout_is_weights: (B, T); gradients flow
    through ``log_prob`` only. ``config`` is the actor config: ``clip_ratio``, ``clip_ratio_low``,
    ``clip_ratio_high``, ``clip_ratio_c`` and the loss's own fields under ``config.policy_loss``.
    The mini-batch counts for ``agg_loss`` travel as ``config.global_batch_info`` (a mapping with any
    of dp_size, batch_num_tokens, global_batch_size, loss_scale_factor — verl's channel), and
    ``config.loss_scale_factor`` is used when the mapping has none. Workers should pass
    ``with_global_batch_info(actor_config, info)`` rather than mutate the config. Metrics:
    actor/pg_clipfrac, actor/ppo_kl (mean of log pi_old - log pi), actor/pg_clipfrac_lower.
"""


def _with_contract_doc(fn: Callable) -> Callable:
    fn.__doc__ = (fn.__doc__ or "") + _POLICY_LOSS_DOC  # __doc__ is None under python -OO
    return fn


@register_policy_loss("vanilla")
@_with_contract_doc
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (Schulman et al. 2017) with asymmetric range and dual clip (Ye et al. 2020).

    ratio = exp(clamp(log pi - log pi_old, -20, 20)); per token
    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and for A < 0 additionally min(l, -A c)
    with c = ``config.clip_ratio_c`` (default 3.0, must exceed 1).
    """
    if config is None:
        raise ValueError("policy loss 'vanilla' needs the actor config (clip_ratio, clip_ratio_c, ...)")
    low, high = _clip_range(config)
    losses, clipfrac, ppo_kl, clipfrac_lower = _ppo_clip_losses(
        old_log_prob, log_prob, advantages, response_mask, low, high, _cfg(config, "clip_ratio_c", 3.0)
    )
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return loss, _metrics(clipfrac, ppo_kl, clipfrac_lower)



@register_policy_loss("bypass_mode")
@_with_contract_doc
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``algorithm.rollout_correction.bypass_mode``: ``old_log_prob`` is the rollout's log-prob.

    The correction (``config.policy_loss.rollout_correction``) is computed here, without gradient,
    between the current policy and the rollout (``algos/rollout_corr.py``): rejected tokens leave the
    mask; then ``loss_type`` ``ppo_clip`` is PPO-clip on π_θ / π_rollout with no further weight (the
    ratio is the correction), and ``reinforce`` is −w·A·log π_θ with w the truncated IS weight (1
    without ``rollout_is``). ``rollout_is_weights`` from the batch are not used.
    """
    correction = _cfg(_cfg(config, "policy_loss"), "rollout_correction")
    if correction is None:
        raise ValueError("policy loss 'bypass_mode' needs actor.policy_loss.rollout_correction "
                         "(set algorithm.rollout_correction.bypass_mode=true, which fills it)")
    weights, metrics = None, {}
    if response_mask.any():
        with torch.no_grad():
            weights, response_mask, metrics = rollout_corr.rollout_correction(
                log_prob.detach(), old_log_prob, response_mask, **{k: _cfg(correction, k) for k in (
                    "rollout_is", "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                    "rollout_token_veto_threshold")},
                rollout_is_threshold=_cfg(correction, "rollout_is_threshold", 2.0),
                rollout_is_batch_normalize=bool(_cfg(correction, "rollout_is_batch_normalize", False)))
    if _cfg(correction, "loss_type", "ppo_clip") == "reinforce":
        losses = -advantages * log_prob * (weights if weights is not None else 1.0)
        loss = _finish(losses, response_mask, loss_agg_mode, config, None)
        ppo_kl = F_.masked_mean(old_log_prob - log_prob.detach(), response_mask) if response_mask.any() else 0.0
        return loss, {"actor/ppo_kl": float(ppo_kl), **metrics}
    loss, ppo_metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                                    config, None)
    return loss, {**ppo_metrics, **metrics}


@register_policy_loss("gspo")
@_with_contract_doc
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071, eq. 7 and 10).

    Sequence ratio s_i = exp(mean_t log(pi / pi_old)) over valid tokens; the token-level form
    s_{i,t} = sg(s_i) * pi_t / sg(pi_t) has value s_i and gradient s_i * grad log pi_t (GSPO-token).
    l = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)), with log s clamped at 10 for overflow.
    Aggregated by ``loss_agg_mode`` as verl 0.9.1 does (the actor passes ``actor.loss_agg_mode``,
    default token-mean); the paper's own objective is seq-mean-token-mean, which verl <= 0.9.0
    forced and which stays this function's default. ``pg_clipfrac_lower`` is 0.
    """
    if config is None:
        raise ValueError("policy loss 'gspo' needs the actor config (clip_ratio, ...)")
    low, high = _clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = F_.masked_sum(log_ratio, mask, axis=-1) / mask.sum(dim=-1).clamp(min=1)
    log_s = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * torch.clamp(s, 1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    clipfrac = F_.masked_mean((clipped > unclipped).float(), response_mask)
    return loss, _metrics(clipfrac, F_.masked_mean(-log_ratio, response_mask))



@register_policy_loss("gpg")
@_with_contract_doc
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE, l = -A log pi,
    no ratio and no clipping. ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0."""
    losses = -log_prob * advantages
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return loss, _metrics(0.0, F_.masked_mean(old_log_prob - log_prob, response_mask))



def _token_covariance(advantages, log_prob, response_mask):
    """Centred product (A - mean A)(log pi - mean log pi) per token, means over valid tokens (B, T), no grad.

    Cui et al. 2025 (arXiv:2505.22617) show entropy change tracks this covariance; the few tokens with
    the largest values drive entropy collapse.
    """
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - F_.masked_mean(adv, response_mask)) * (logp - F_.masked_mean(logp, response_mask))


@register_policy_loss("clip_cov")
@_with_contract_doc
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617, §4.2): PPO-clip, plus the gradient of a random
    ``max(1, int(clip_cov_ratio * N))`` of the valid, not already clipped tokens whose covariance lies
    in (clip_cov_lb, clip_cov_ub) is removed (their loss is multiplied by 0).

    Fields under ``config.policy_loss``: clip_cov_ratio (0.0002), clip_cov_lb (1.0), clip_cov_ub (5.0).
    ``pg_clipfrac`` is the fraction of tokens so removed; no dual clip, so ``pg_clipfrac_lower`` is 0.
    """
    if config is None:
        raise ValueError("policy loss 'clip_cov' needs the actor config (clip_ratio, policy_loss.clip_cov_*)")
    low, high = _clip_range(config)
    pl = _cfg(config, "policy_loss")
    ratio_k = _cfg(pl, "clip_cov_ratio", 0.0002)
    lb, ub = _cfg(pl, "clip_cov_lb", 1.0), _cfg(pl, "clip_cov_ub", 5.0)
    if not ratio_k > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {ratio_k}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    valid = response_mask.bool()
    cov = _token_covariance(advantages, log_prob, response_mask)
    eligible = valid & ~(clipped > unclipped) & (cov > lb) & (cov < ub)
    candidates = torch.nonzero(eligible.reshape(-1)).squeeze(-1)
    num_clip = max(int(ratio_k * int(valid.sum().item())), 1)
    chosen = candidates[torch.randperm(candidates.numel(), device=candidates.device)[:num_clip]]
    keep = torch.ones(advantages.numel(), dtype=log_prob.dtype, device=log_prob.device).index_fill_(0, chosen, 0.0)
    keep = keep.view_as(advantages)
    losses = torch.maximum(unclipped, clipped) * keep
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    clipfrac = F_.masked_mean((keep == 0).float(), response_mask)
    return loss, _metrics(clipfrac, F_.masked_mean(-log_ratio, response_mask))



@register_policy_loss("kl_cov")
@_with_contract_doc
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, §4.2): unclipped -A r everywhere, plus a penalty
    ppo_kl_coef * |log r| on the top ``max(1, int(kl_cov_ratio * N))`` valid tokens by covariance.

    Fields under ``config.policy_loss``: kl_cov_ratio (0.0002), ppo_kl_coef (1.0).
    No clipping, so ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0 (verl reports mean |log r| as
    ppo_kl here; we keep ppo_kl = mean(log pi_old - log pi) for every loss).
    """
    pl = _cfg(config, "policy_loss")
    ratio_k = _cfg(pl, "kl_cov_ratio", 0.0002)
    coef = _cfg(pl, "ppo_kl_coef", 1.0)
    if not ratio_k > 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {ratio_k}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    losses = -advantages * torch.exp(log_ratio)
    valid_idx = torch.nonzero(response_mask.reshape(-1).bool()).squeeze(-1)
    if valid_idx.numel() > 0:
        cov = _token_covariance(advantages, log_prob, response_mask).reshape(-1)[valid_idx]
        top = valid_idx[torch.topk(cov, max(1, int(valid_idx.numel() * ratio_k))).indices]
        penalty = torch.zeros(losses.numel(), dtype=losses.dtype, device=losses.device).index_fill_(0, top, 1.0)
        losses = losses + coef * log_ratio.abs() * penalty.view_as(losses)
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return loss, _metrics(0.0, F_.masked_mean(-log_ratio, response_mask))



@register_policy_loss("cispo")
@_with_contract_doc
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025, arXiv:2506.13585, eq. 4): clip the importance weight, not the update.

    l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi: every token keeps a gradient (PPO would
    drop clipped tokens entirely), scaled by the bounded, detached ratio.
    ``pg_clipfrac`` counts tokens whose ratio was clipped; ``pg_clipfrac_lower`` is 0.
    """
    if config is None:
        raise ValueError("policy loss 'cispo' needs the actor config (clip_ratio, ...)")
    low, high = _clip_range(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = -weight.detach() * advantages * log_prob
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    clipfrac = F_.masked_mean((weight != ratio).float(), response_mask)
    return loss, _metrics(clipfrac, F_.masked_mean(-log_ratio, response_mask))



@register_policy_loss("sapo")
@_with_contract_doc
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO, soft adaptive policy optimisation (Gao et al. 2025, arXiv:2511.20347).

    A smooth gate replaces the hard clip: l = -A f(r), f(r) = sigmoid(tau (r - 1)) * 4 / tau, so
    df/dlog r = 4 r sigmoid'(.) equals 1 at r = 1 (PPO's on-policy gradient) and fades as r leaves 1
    instead of dropping to 0 at 1 +- eps. tau = ``config.tau_pos`` where A > 0, else ``config.tau_neg``
    (larger: negative updates, which spread mass over the vocabulary, fade faster).
    Aggregated seq-mean-token-mean whatever ``loss_agg_mode`` says, as verl 0.9.1 does. No clipping:
    ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0.
    """
    tau_pos, tau_neg = _cfg(config, "tau_pos", 1.0), _cfg(config, "tau_neg", 1.05)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"policy loss 'sapo' needs actor.tau_pos and actor.tau_neg > 0, got {tau_pos}, {tau_neg}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss = _finish(-gate * advantages, response_mask, "seq-mean-token-mean", config, rollout_is_weights)
    return loss, _metrics(0.0, F_.masked_mean(-log_ratio, response_mask))


@register_policy_loss("geo_mean")
@_with_contract_doc
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv:2507.20673).

    The sequence objective uses the geometric mean of the token ratios, so one outlier token moves
    it far less than GRPO's arithmetic mean. Per token the log-ratio is clipped the PPO way in log
    space: for A > 0 min(log r, eps_high), for A < 0 max(log r, -eps_low) (unclipped on the other
    side; A = 0 gives 0). Per sequence: s = exp(mean_t clipped log r), a = mean_t A, l = -a s
    (a per-sequence advantage is assumed, as in verl). Rollout IS weights enter as their geometric
    mean per sequence. The mean over sequences ignores ``loss_agg_mode`` (verl: ``torch.mean`` over
    the micro-batch's rows); with ``global_batch_info`` it divides by the mini-batch's count of
    sequences with a valid token, and locally rows without one do not count (verl counts them).
    ``pg_clipfrac``/``pg_clipfrac_lower``: tokens outside [-eps_low, eps_high] with A > 0 / A < 0.
    """
    if config is None:
        raise ValueError("policy loss 'geo_mean' needs the actor config (clip_ratio, ...)")
    low, high = _clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob  # unclamped, as verl: the clip below bounds what reaches exp()
    clamped = torch.clamp(log_ratio, -low, high)
    sign = torch.sign(advantages)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_ratio = torch.exp(F_.masked_sum(clipped_log_ratio, mask, axis=-1) / lengths)
    seq_losses = -(F_.masked_sum(advantages, mask, axis=-1) / lengths) * seq_ratio
    if rollout_is_weights is not None:
        seq_losses = seq_losses * torch.exp(F_.masked_sum(torch.log(rollout_is_weights + 1e-10), mask, axis=-1) / lengths)
    has_tokens = (mask.sum(dim=-1) > 0).unsqueeze(-1)
    loss = agg_loss(seq_losses.unsqueeze(-1), has_tokens, "seq-mean-token-sum", **_agg_kwargs(config))
    outside = (log_ratio != clamped).float()
    return loss, _metrics(F_.masked_mean(outside * (advantages > 0), response_mask),
                          F_.masked_mean(-log_ratio, response_mask),
                          F_.masked_mean(outside * (advantages < 0), response_mask))


@register_policy_loss("dro")
@_with_contract_doc
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO, direct reward optimisation (Richemond et al. 2024, arXiv:2405.19107; verl 0.9.1's ``dro``).

    A policy gradient with a quadratic trust region instead of a clip: l = -(A log pi - beta/2 (log r)^2),
    beta = ``config.policy_loss.dro_beta`` (> 0, no default), so the pull back toward pi_old grows
    with the log-ratio and never switches a token off. No clipping: both clip fractions are 0.
    """
    beta = _cfg(_cfg(config, "policy_loss"), "dro_beta")
    if beta is None or not beta > 0:
        raise ValueError(f"policy loss 'dro' needs actor.policy_loss.dro_beta > 0, got {beta}")
    log_ratio = log_prob - old_log_prob  # unclamped, as verl: the penalty is what bounds it
    losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return loss, _metrics(0.0, F_.masked_mean(-log_ratio, response_mask))


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
               inside: Callable[..., tuple[torch.Tensor, torch.Tensor]]):
    """DPPO's shared loss (Yang et al. 2026, arXiv:2602.04879): l = -A sg(min(r, c)) log pi on tokens
    whose probability change stays inside the divergence trust region, 0 elsewhere.

    ``inside(log_prob, old_log_prob, delta_low, delta_high)`` -> (ok where A > 0, ok where A <= 0); deltas are
    ``clip_ratio_low``/``clip_ratio_high`` read as divergence thresholds. c = ``clip_ratio_c`` truncates
    the importance weight (TIS, not dual clip; the paper's §5.4 advises a large one). Metrics:
    ``pg_clipfrac`` = tokens outside the region, ``pg_clipfrac_lower`` = inside ones with r > c.
    """
    if config is None:
        raise ValueError("the DPPO policy losses need the actor config (clip_ratio, clip_ratio_c, ...)")
    low, high = _clip_range(config)
    c = _cfg(config, "clip_ratio_c", 20.0)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        ok_pos, ok_neg = inside(log_prob, old_log_prob, low, high)
        keep = torch.where(advantages > 0, ok_pos, ok_neg).to(log_prob.dtype)
        weight = torch.clamp(ratio, max=c)
    losses = -advantages * weight * log_prob * keep
    loss = _finish(losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return loss, _metrics(F_.masked_mean(1.0 - keep, response_mask), F_.masked_mean(-log_ratio, response_mask),
                          F_.masked_mean((ratio > c).to(keep.dtype) * keep, response_mask))


def _tv_region(log_prob, old_log_prob, low, high):
    """Binary total variation |pi - pi_old| of the sampled token: only the move the advantage asks
    for is bounded (up by ``high`` for A > 0, down by ``low`` otherwise)."""
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    return change <= high, change >= -low


def _kl_region(log_prob, old_log_prob, low, high):
    """Binary KL(Bern(pi_old) || Bern(pi)) of the sampled token, bounded only in the direction the
    advantage pushes; 1e-8 keeps log(1 - p) finite at p = 1."""
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)


@register_policy_loss("dppo_tv")
@_with_contract_doc
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (arXiv:2602.04879): PPO's ratio clip replaced by a bound on the sampled token's
    probability change, pi - pi_old <= delta_high (A > 0) or >= -delta_low (A <= 0); see ``_dppo_loss``."""
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                      rollout_is_weights, _tv_region)


@register_policy_loss("dppo_kl")
@_with_contract_doc
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (arXiv:2602.04879): the token is dropped when the binary KL between old and new
    probability of the sampled token exceeds delta_high (A > 0, probability rising) or delta_low
    (A <= 0, probability falling); see ``_dppo_loss``."""
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                      rollout_is_weights, _kl_region)



# ─────────────────────────────── value and entropy losses ───────────────────────────────


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO, Schulman et al. 2017; as in OpenAI baselines' ppo2).

    v_clip = clamp(vpreds, values - c, values + c);  loss = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2)):
    the critic cannot move further than c from the rollout-time value in one update.

    Args:
        vpreds (current critic), returns (targets R), values (rollout-time critic), response_mask: (B, T).
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see ``agg_loss``.
    Returns:
        vf_loss: scalar;  vf_clipfrac: fraction of valid tokens where the clipped error was larger.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(err_unclipped, err_clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = F_.masked_mean((err_clipped > err_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **global_batch_info
) -> torch.Tensor:
    """Aggregated token entropy of ``softmax(logits)``. logits (B, T, V), response_mask (B, T) -> scalar.

    ``global_batch_info`` keywords (dp_size, batch_num_tokens, ...) are forwarded to ``agg_loss``.
    """
    entropy = F_.entropy_from_logits(logits)
    return agg_loss(entropy, response_mask, loss_agg_mode, **global_batch_info)


# ─────────────────────────────── KL penalty ───────────────────────────────

_KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs. (B, T) -> (B, T).

    With log r = log pi_ref - log pi (Schulman 2020, "Approximating KL Divergence",
    http://joschu.net/blog/kl-approx.html):
      kl/k1: -log r (unbiased, high variance, can be negative);  abs: |log r|;
      mse/k2: 0.5 (log r)^2 (biased, low variance);
      low_var_kl/k3: r - 1 - log r (unbiased, non-negative). log r is clamped to +-20 so exp() cannot
      overflow and the result to [-10, 10] so one far-off-policy token cannot dominate (as verl).
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_r = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        # r - 1 - log r written as expm1(log r) - log r: no cancellation near r = 1, never below 0
        return torch.clamp(torch.expm1(log_r) - log_r, min=-10.0, max=10.0)
    if kl_penalty == "full":
        raise NotImplementedError(
            "kl_penalty='full' (exact KL over the whole vocabulary) needs full logits of both policies, "
            "which this API does not receive; use 'low_var_kl' (k3) or 'k3+' instead"
        )
    raise ValueError(
        f"unknown kl_penalty {kl_penalty!r}; expected one of {list(_KL_ESTIMATORS)}, "
        f"optionally with a '+' suffix (e.g. 'k3+'), or 'full'"
    )


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """KL estimate per token, (B, T) -> (B, T); see ``kl_penalty_forward`` for the estimators.

    A ``+`` suffix (e.g. ``k3+``) keeps the estimator's value but takes k2's gradient by a
    straight-through trick, k2 + sg(k - k2): k1 and k3 are unbiased for the KL's value but not for its
    gradient, while the gradient of k2 is the (on-policy) gradient of the KL (Schulman 2020).
    """
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    value = kl_penalty_forward(logprob, ref_logprob, base)
    if not straight_through or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return (k2 - k2.detach()) + value.detach()  # exactly 0 + value in the forward pass
