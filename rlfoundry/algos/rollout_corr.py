"""Rollout correction: the policy that sampled is not quite the policy being trained.

The rollout engine's log-probs (``rollout_log_probs``, π_rollout) differ from the trainer's
(``old_log_probs``, π_train) because of numerics (vLLM in bf16 against FSDP in fp32, other kernels)
and, in asynchronous training, because the weights that sampled are older. With the per-token log
ratio ``log ρ_t = log π_train − log π_rollout`` this module gives verl 0.9's three corrections
(``algorithm.rollout_correction``), as pure functions:

- **truncated importance sampling** (TIS, ``rollout_is``): loss weights ``min(ρ, C)`` per token
  (``token``) or one per sequence, ``ρ = Π_t ρ_t`` (``sequence``), optionally scaled to mean 1 over the
  batch (``rollout_is_batch_normalize``). A threshold ``"lower_upper"`` (verl >= 0.7's IcePop) keeps
  ``ρ`` where it lies in ``[lower, upper]`` and gives 0 elsewhere, instead of truncating. The policy losses multiply each token's loss by its weight
  (``core_algos._finish``); the weights carry no gradient;
- **rejection sampling** (masked IS, ``rollout_rs``): tokens (``token``) or whole sequences
  (``sequence``: ``Π_t ρ_t``; ``geometric``: ``exp(mean_t log ρ_t)``) whose ratio lies outside
  ``[lower, upper]`` (``lower`` defaults to ``1 / upper``) leave ``response_mask``;
- **veto** (``rollout_token_veto_threshold``): a sequence with any token ``ρ_t`` below the threshold
  leaves ``response_mask`` whole;
- **divergence rejection** (verl >= 0.7's ``rollout_rs`` options, ``divergence_rejection_mask``): a
  comma list of ``token_k{1,2,3}``, ``seq_{sum,mean}_k{1,2,3}``, ``seq_max_k{2,3}`` over the per-token
  estimators k1 = −log ρ_t, k2 = ½(log ρ_t)², k3 = ρ_t − 1 − log ρ_t (Schulman's KL estimators), each
  option keeping what lies within its threshold, all options together (AND). ``rollout_rs_threshold``
  is one spec for all options or one per option, comma-separated; a k1 spec is ``lower_upper`` on the
  ratio scale (compared with k1 in logs) or ``upper`` alone (lower = 1/upper); k2/k3 specs are an upper bound.

In ``bypass_mode`` the rollout's log-probs are the old log-probs (no recompute pass) and the same
functions run inside the policy loss against the current policy (``core_algos``'s ``bypass_mode``
loss: PPO-clip on π_θ / π_rollout, or REINFORCE −w·A·log π_θ).

Metrics (``rollout_corr/…``, verl's names) describe the ratios before truncation, and the mismatch:
KL(π_rollout‖π_train) by the direct and k3 estimators, both perplexities, χ² per token and sequence.
Exponentials of summed log ratios are clamped at ``exp(±20)``.
"""

from __future__ import annotations

import math

import torch

from rlfoundry.utils.torch_functional import masked_mean as _mean

__all__ = ["divergence_rejection_mask", "importance_weights", "mismatch_metrics", "parse_is_threshold", "parse_rs_thresholds",
           "rejection_mask", "rollout_correction", "rs_options", "veto_mask"]

SAFETY_BOUND = 20.0  # |log ratio| beyond this is clamped before exponentiating
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
DIVERGENCE_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                         "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def rs_options(rollout_rs: str) -> list[str] | None:
    """The divergence options of a ``rollout_rs`` comma list (duplicates dropped); None for one of the
    ratio levels (``RS_LEVELS``). Raises ValueError naming an option that is neither."""
    if rollout_rs in RS_LEVELS:
        return None
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    unknown = [o for o in options if o not in DIVERGENCE_RS_OPTIONS]
    if unknown or not options:
        raise ValueError(f"rollout_rs={rollout_rs!r}: {unknown or 'no option'}; one of {list(RS_LEVELS)} or a comma "
                         f"list of {list(DIVERGENCE_RS_OPTIONS)}")
    return options


def parse_rs_thresholds(options: list[str], spec: float | str) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs_threshold`` for divergence options: option -> (lower or None, upper). One spec for every
    option or one per option (comma-separated); k1: ``lower_upper`` or ``upper`` (lower = 1/upper)."""
    specs = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold={spec!r}: give one threshold for all {len(options)} rollout_rs "
                         f"options or one per option ({','.join(options)})")
    out = {}
    for option, text in zip(options, specs * len(options) if len(specs) == 1 else specs):
        if "_" in text and not option.endswith("k1"):
            raise ValueError(f"rollout_rs_threshold {text!r} for {option}: a k2/k3 option takes one upper bound")
        try:
            bounds = [float(x) for x in text.split("_", 1)]
        except ValueError:
            raise ValueError(f"rollout_rs_threshold {text!r} for {option} is not a number (or lower_upper)") from None
        if min(bounds) <= 0:
            raise ValueError(f"rollout_rs_threshold {text!r} for {option}: bounds must be > 0")
        lower = (bounds[0] if len(bounds) == 2 else 1.0 / bounds[0]) if option.endswith("k1") else None
        if lower is not None and lower > bounds[-1]:  # an empty band would reject every token, silently
            raise ValueError(f"rollout_rs_threshold {text!r} for {option}: the lower bound is above the upper")
        out[option] = (lower, bounds[-1])
    return out


def _divergence_stat(option: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The option's statistic: (B, T) per token, or (B, 1) per sequence (masked sum / mean / max)."""
    k = {"k1": -log_ratio, "k2": 0.5 * log_ratio.square(), "k3": torch.expm1(log_ratio) - log_ratio}[option[-2:]]
    if option.startswith("token"):
        return k
    if option.startswith("seq_sum"):
        return (k * mask).sum(-1, keepdim=True)
    if option.startswith("seq_mean"):
        return _mean(k, mask, axis=-1).unsqueeze(-1)
    largest = k.masked_fill(~mask.bool(), float("-inf")).amax(-1, keepdim=True)
    return torch.where(torch.isinf(largest), torch.zeros_like(largest), largest)  # an empty row: 0


def divergence_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, options: list[str],
                              threshold: float | str) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` without the tokens / sequences that any option rejects (verl's trust-region masks):
    k1 statistics must lie in [log lower, log upper], k2 / k3 statistics at most upper."""
    bounds = parse_rs_thresholds(options, threshold)
    log_ratio = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    keep = torch.ones_like(response_mask, dtype=torch.bool)
    metrics = {}
    for option in options:
        lower, upper = bounds[option]
        stat = _divergence_stat(option, log_ratio, response_mask)
        ok = (stat >= math.log(lower)) & (stat <= math.log(upper)) if lower is not None else stat <= upper
        ok = ok.expand_as(response_mask)
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(_mean((~ok).float(), response_mask))
        keep &= ok
    kept = response_mask * keep.to(response_mask.dtype)
    dropped = response_mask.bool() & ~keep
    rows = response_mask.bool().any(-1)
    metrics["rollout_rs_masked_fraction"] = float(_mean(dropped.float(), response_mask))
    metrics["rollout_rs_seq_masked_fraction"] = float(dropped.any(-1)[rows].float().mean())
    return kept, metrics


def _per_level(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the log ratio at ``level``: (B, T) for tokens, (B, 1) per sequence; the ratios broadcast to (B, T))."""
    if level == "token":
        at_level = log_ratio
    elif level == "sequence":
        at_level = (log_ratio * mask).sum(-1, keepdim=True)
    elif level == "geometric":
        at_level = _mean(log_ratio, mask, axis=-1).unsqueeze(-1)
    else:
        raise ValueError(f"unknown level {level!r}; one of {RS_LEVELS}")
    ratios = torch.exp(at_level.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    return at_level, ratios


def _ratio_stats(prefix: str, at_level: torch.Tensor, ratios: torch.Tensor, mask: torch.Tensor,
                 upper: float, lower: float) -> dict[str, float]:
    """Mean / max / min / std / effective sample size of the ratios, and the shares above / below the bounds."""
    valid = mask.bool()
    if at_level.shape[-1] == 1:  # one ratio per sequence: counted once per sequence
        rows = valid.any(-1)
        log_values = at_level[rows, 0]
        high, low = (log_values > math.log(upper)).float().mean(), (log_values < math.log(lower)).float().mean()
        largest, smallest = torch.exp(log_values.max().clamp(max=SAFETY_BOUND)), torch.exp(log_values.min())
    else:
        high, low = _mean((ratios > upper).float(), mask), _mean((ratios < lower).float(), mask)
        largest, smallest = ratios[valid].max(), ratios[valid].min()
    bounded = ratios.clamp(lower, upper)  # std and ESS of the bounded ratios: one outlier does not dominate
    spread = (_mean(bounded.square(), mask) - _mean(bounded, mask).square()).clamp_min(0.0).sqrt()
    ess = 1.0 / _mean((bounded / (_mean(bounded, mask) + 1e-8)).square(), mask)
    stats = {"mean": _mean(ratios, mask), "max": largest, "min": smallest, "std": spread, "eff_sample_size": ess,
             "ratio_fraction_high": high, "ratio_fraction_low": low}
    return {f"{prefix}_{k}": float(v) for k, v in stats.items()}


def parse_is_threshold(spec: float | str) -> tuple[float | None, float]:
    """``rollout_is_threshold``: (lower or None, upper) from a number or a number-like string (truncation at
    upper) or ``"lower_upper"`` (IcePop's bounds)."""
    if isinstance(spec, bool):
        raise ValueError(f"rollout_is_threshold={spec!r} must be a number or a 'lower_upper' string")
    try:
        bounds = [float(x) for x in str(spec).strip().split("_", 1)]
    except ValueError:
        raise ValueError(f"rollout_is_threshold={spec!r} must be a number or a 'lower_upper' string") from None
    lower, upper = (bounds[0], bounds[1]) if len(bounds) == 2 else (None, bounds[0])
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold={spec!r}: bounds must be > 0 (and lower <= upper)")
    return lower, upper


def importance_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str = "token",
                       threshold: float | str = 2.0, batch_normalize: bool = False
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights (0 on padding), detached, and their metrics: ``min(ρ, upper)`` for a number, or ρ within
    ``[lower, upper]`` and 0 outside for a ``"lower_upper"`` threshold (IcePop)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}: one of {IS_LEVELS} (or null)")
    lower, upper = parse_is_threshold(threshold)
    at_level, ratios = _per_level(log_ratio, response_mask, level)
    metrics = _ratio_stats("rollout_is", at_level, ratios, response_mask, upper, 1.0 / upper if lower is None else lower)
    if lower is None:
        weights = (ratios.clamp(max=upper) * response_mask).detach()
    else:
        inside = (ratios >= lower) & (ratios <= upper)
        weights = (torch.where(inside, ratios, torch.zeros_like(ratios)) * response_mask).detach()
        metrics["rollout_is_oob_ratio"] = float(_mean((~inside).float(), response_mask))
    if batch_normalize:
        if level == "token":
            scale = _mean(weights, response_mask)
        else:  # one weight per sequence, each sequence counted once
            rows = response_mask.bool().any(-1)
            scale = _mean(weights, response_mask, axis=-1)[rows].mean()
        scale = scale if scale > 1e-8 else torch.ones_like(scale)
        weights = weights / scale
        metrics["rollout_is_batch_norm_factor"] = float(scale)
    return weights, metrics


def rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str = "token",
                   upper: float = 2.0, lower: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` without the tokens / sequences whose ratio lies outside ``[lower, upper]``."""
    if level not in RS_LEVELS:
        raise ValueError(f"rollout_rs={level!r}: one of {RS_LEVELS} (or null)")
    lower = 1.0 / upper if lower is None else lower
    at_level, ratios = _per_level(log_ratio, response_mask, level)
    metrics = _ratio_stats("rollout_rs", at_level, ratios, response_mask, upper, lower)
    keep = ((ratios >= lower) & (ratios <= upper)).to(response_mask.dtype)
    kept = response_mask * keep
    dropped = response_mask.bool() & ~kept.bool()
    rows = response_mask.bool().any(-1)
    metrics["rollout_rs_masked_fraction"] = float(_mean(dropped.float(), response_mask))
    metrics["rollout_rs_seq_masked_fraction"] = float(dropped.any(-1)[rows].float().mean())
    return kept, metrics


def veto_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor,
              threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` without every sequence that has a token with ``ρ_t < threshold``."""
    if threshold <= 0:
        raise ValueError(f"rollout_token_veto_threshold={threshold} must be > 0")
    bad = (log_ratio < math.log(threshold)) & response_mask.bool()
    vetoed = bad.any(-1, keepdim=True)
    rows = response_mask.bool().any(-1)
    metrics = {"rollout_is_veto_fraction": float(vetoed[rows].float().mean()),
               "rollout_is_catastrophic_token_fraction": float(_mean(bad.float(), response_mask))}
    return response_mask * (~vetoed).to(response_mask.dtype), metrics


def mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's distribution is from the trainer's, on the sampled tokens."""
    mask = response_mask
    rows = mask.bool().any(-1)
    log_ratio = old_log_prob - rollout_log_prob
    train_nll, rollout_nll = -_mean(old_log_prob, mask, -1)[rows], -_mean(rollout_log_prob, mask, -1)[rows]
    log_ppl_diff = train_nll - rollout_nll  # log(PPL_train / PPL_rollout) per sequence
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = (log_ratio * mask).sum(-1)[rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    values = {
        "kl": _mean(-log_ratio, mask),  # E_rollout[log π_rollout − log π_train]
        "k3_kl": _mean(rho - log_ratio - 1.0, mask),
        "training_ppl": torch.exp(train_nll).mean(), "training_log_ppl": train_nll.mean(),
        "rollout_ppl": torch.exp(rollout_nll).mean(), "rollout_log_ppl": rollout_nll.mean(),
        "log_ppl_diff": log_ppl_diff.mean(), "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": _mean(rho.square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }
    return {k: float(v) for k, v in values.items()}


def rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is: str | None = None, rollout_is_threshold: float | str = 2.0,
                       rollout_rs: str | None = None, rollout_rs_threshold: float | str | None = None,
                       rollout_rs_threshold_lower: float | None = None,
                       rollout_token_veto_threshold: float | None = None,
                       rollout_is_batch_normalize: bool = False,
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, the response mask after rejection and veto, ``rollout_corr/…`` metrics).
    The weights are computed on the original mask; rejected tokens then carry no loss at all."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"shapes differ: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}")
    if not response_mask.any():
        raise ValueError("response_mask has no valid token")
    log_ratio = (old_log_prob - rollout_log_prob).float()
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, m = importance_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                        rollout_is_batch_normalize)
        metrics |= m
    mask = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs is set but rollout_rs_threshold is null; give the upper bound")
        options = rs_options(rollout_rs)
        if options is None:
            mask, m = rejection_mask(log_ratio, response_mask, rollout_rs, float(rollout_rs_threshold),
                                     rollout_rs_threshold_lower)
        else:
            mask, m = divergence_rejection_mask(log_ratio, response_mask, options, rollout_rs_threshold)
        metrics |= m
    if rollout_token_veto_threshold is not None:
        vetoed, m = veto_mask(log_ratio, response_mask, rollout_token_veto_threshold)
        mask = mask * vetoed
        metrics |= m
    metrics |= mismatch_metrics(old_log_prob.float(), rollout_log_prob.float(), response_mask)
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
