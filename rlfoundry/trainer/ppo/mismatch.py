"""The mismatch audit (docs/on_policy.md): where and why the rollout's log-probs disagree with the trainer's.

Pure functions of tensors, a ``DataProto`` and plain values; the driver (``ray_trainer._audit_mismatch``)
gathers the facts (``StepFacts``), calls ``audit`` and logs its diagnosis.

``mismatch_metrics`` splits |log p_rollout − log p_trainer| per valid response token (B, Tr) by
position (quarters of each row's valid tokens), by turn (the k-th run of ``response_mask`` 1s of a
multi-turn row: the policy's own turns, tool replies between them are masked) and by ``data_source``.

``diagnose`` names the causes its evidence supports, in the issue's order, those with direct
evidence first: re-tokenisation (rows whose ``retokenised_from`` column, written by the agent loops
from the engine calls themselves, says the engine did not sample their tokens after the trained
context), stale or partial weights (versions of a synchronous run), staleness (versions of an
asynchronous run), sampling settings (temperature, or top-k/top-p on an engine that renormalises),
precision proven by an fp32 recompute of the worst rows (``precision_finding``); then the
circumstantial ones: unverified weight syncs, MoE routing (a mixture-of-experts policy whose routing is
not replayed, or the share of tokens routed elsewhere when it is; docs/moe.md), and precision as a
candidate (a non-fp32 dtype the recompute did not clear or could not run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlfoundry.protocol import DataProto

POSITION_BUCKETS = ("q1", "q2", "q3", "q4")
MAX_TURN_METRICS = 8  # turns past the 8th share one bucket ("8+"): a bounded number of metric names
# engines whose reported log-prob is renormalised over the top-k/top-p kept set (vLLM processed_logprobs);
# the HF and SGLang engines report softmax(logits / T) before filtering, what compute_log_prob scores
RENORMALISING_ENGINES = frozenset({"vllm"})
PRECISION_ROWS = 4  # the worst rows the fp32 recompute scores: a few rows' forward, not a step's
# precision is proven when fp32 log-probs leave under a quarter of those rows' gap: rounding of a sum of
# independent errors would leave about half of it (1/sqrt 2 each); other causes leave nearly all
PRECISION_CLOSES = 0.25


def position_buckets(mask: torch.Tensor, n: int = len(POSITION_BUCKETS)) -> torch.Tensor:
    """(B, Tr) -> (B, Tr) int32: the n-quantile of each valid token's rank among its row's valid tokens
    (0 .. n-1), -1 on masked tokens. A row of 3 valid tokens in quarters: 0, 1, 2."""
    valid = mask.bool()
    rank = valid.to(torch.int32).cumsum(-1, dtype=torch.int32)  # int32: half the memory traffic of int64
    count = rank[:, -1:].clamp(min=1)
    return torch.where(valid, (rank - 1) * n // count, -1)


def turn_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, Tr) -> (B, Tr) int32: which run of consecutive valid tokens each valid token is in (0-based),
    -1 on masked tokens. In an agent loop's row the runs are the policy's turns (tool replies are 0s)."""
    valid = mask.bool()
    before = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    starts = (valid & ~before).to(torch.int32).cumsum(-1, dtype=torch.int32)
    return torch.where(valid, starts - 1, -1)


def _grouped_means(gap: torch.Tensor, groups: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``gap`` per group id 0..n-1 (ids < 0 ignored) and each group's count: (n,), (n,).
    Ignored ids go to a bin n that is dropped: no boolean gather of the (B, Tr) tensors."""
    ids = torch.where(groups >= 0, groups, n).flatten().long()
    total = torch.bincount(ids, weights=gap.flatten().double(), minlength=n + 1)[:n]
    count = torch.bincount(ids, minlength=n + 1)[:n]
    return total / count.clamp(min=1), count


def mismatch_metrics(gap: torch.Tensor, mask: torch.Tensor, data_sources: np.ndarray | None = None,
                     multi_turn: bool = False) -> dict[str, float]:
    """``mismatch/position/<q>/mean``, ``mismatch/turn/<k>/mean`` (multi-turn rows only) and
    ``mismatch/data_source/<name>/mean`` of ``gap`` (B, Tr) = |Δ log p| over the valid tokens of ``mask``;
    a group with no valid token reports nothing. ``mismatch/frac_tokens_above_0.1`` counts tokens whose
    probability ratio is off by more than ~10 %."""
    gap, valid = gap.float(), mask.bool()
    metrics: dict[str, float] = {"mismatch/frac_tokens_above_0.1": float((gap[valid] > 0.1).float().mean())
                                 if valid.any() else 0.0}
    means, counts = _grouped_means(gap, position_buckets(mask), len(POSITION_BUCKETS))
    metrics |= {f"mismatch/position/{q}/mean": float(means[i]) for i, q in enumerate(POSITION_BUCKETS) if counts[i] > 0}
    if multi_turn:
        turns = turn_index(mask).clamp(max=MAX_TURN_METRICS)  # -1 (masked) stays -1
        means, counts = _grouped_means(gap, turns, MAX_TURN_METRICS + 1)
        names = [str(k) for k in range(MAX_TURN_METRICS)] + [f"{MAX_TURN_METRICS}+"]
        metrics |= {f"mismatch/turn/{names[k]}/mean": float(means[k]) for k in range(len(names)) if counts[k] > 0}
    if data_sources is not None:
        names, rows = np.unique(np.asarray(data_sources, dtype=str), return_inverse=True)
        groups = torch.where(valid, torch.as_tensor(rows, dtype=torch.int32).view(-1, 1), -1)
        means, counts = _grouped_means(gap, groups, len(names))
        metrics |= {f"mismatch/data_source/{n}/mean": float(means[i]) for i, n in enumerate(names) if counts[i] > 0}
    return metrics


@dataclass(frozen=True)
class StepFacts:
    """What the driver knows of the step beyond the batch: the evidence ``diagnose`` weighs.

    ``trainer_version``: the actor's ``param_version`` when it computed the old log-probs (None: unknown).
    ``asynchronous``: a rollout pool of its own (versions may lag by design). ``dtypes``: role -> the dtype
    it computes in (``"fp32"``, ``"bfloat16"`` ...)."""

    trainer_version: int | None = None
    asynchronous: bool = False
    rollout_temperature: float = 1.0
    trainer_temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    engine: str = "hf"
    fire: bool = False  # rollout.use_fire_sampling: the first token's log-prob is at temperature 30
    digests_verified: bool = True
    dtypes: dict[str, str] = field(default_factory=dict)
    moe_layers: int = 0  # MoE routers of the policy (0: dense, or routers routing replay does not know)
    router_replay: str = "disabled"  # actor.router_replay.mode
    routing_changed_frac: float | None = None  # R3: response tokens the trainer would route elsewhere
    fp32_recompute: bool = False  # the actor's engine can recompute log-probs in fp32 (compute_log_prob_fp32)


@dataclass(frozen=True)
class Finding:
    cause: str  # retokenisation | stale_weights | staleness | sampling | precision | unverified_sync | moe_routing
    evidence: str
    proven: bool = True  # False: a candidate the evidence cannot confirm


def _retokenisation_finding(gap: torch.Tensor, mask: torch.Tensor, retokenised_from: np.ndarray | None) -> Finding | None:
    """Rows trained on policy tokens the engine sampled after another context (the agent loops' record,
    ``retokenised_from``: the first such response position per row, -1 or None where there is none)."""
    if retokenised_from is None:
        return None
    start = torch.as_tensor([-1 if v is None else int(v) for v in retokenised_from], dtype=torch.long)
    columns = torch.arange(mask.shape[-1])
    affected = (start.view(-1, 1) >= 0) & (columns >= start.view(-1, 1)) & mask.bool()
    if not affected.any():
        return None
    rest = mask.bool() & ~affected
    clean = f"{float(gap[rest].mean()):.4g}" if rest.any() else "n/a (no other token)"
    return Finding("retokenisation", f"{int(affected.any(-1).sum())}/{len(start)} rows train on "
                   f"{int(affected.sum())} policy tokens (from response positions "
                   f"{int(start[start >= 0].min())}..{int(start.max())}) that the engine sampled after another "
                   f"context than the trained one (a re-rendered or re-tokenised chat); their mean |Δ log p| "
                   f"{float(gap[affected].mean()):.4g} vs {clean} on the tokens sampled as trained")


def _row_means(gap: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    valid = mask.float()
    return (gap.float() * valid).sum(-1) / valid.sum(-1).clamp(min=1)


def _version_finding(gap: torch.Tensor, mask: torch.Tensor, versions: np.ndarray | None,
                     facts: StepFacts) -> Finding | None:
    """Rows sampled by weights other than those the trainer scored them with: in a synchronous run the
    engine missed a sync (stale weights); in an asynchronous one, staleness (bounded, by design)."""
    if versions is None or facts.trainer_version is None:
        return None
    lag = torch.as_tensor(facts.trainer_version - np.asarray(versions, dtype=np.int64))
    behind = lag != 0
    if not behind.any():
        return None
    rows = _row_means(gap, mask)
    fresh = f"{float(rows[~behind].mean()):.4g}" if (~behind).any() else "n/a (no row at the trainer's version)"
    evidence = (f"{int(behind.sum())}/{len(lag)} rows were sampled at param_version != the trainer's "
                f"{facts.trainer_version} (lag up to {int(lag.abs().max())}); their mean |Δ log p| "
                f"{float(rows[behind].mean()):.4g} vs {fresh} at the trainer's version")
    if facts.asynchronous:
        return Finding("staleness", evidence + "; an asynchronous run's staleness (async_training.staleness_threshold)")
    return Finding("stale_weights", evidence + "; a synchronous run must sample with the current weights: a weight "
                   "sync was skipped or did not reach the engine")


def _sampling_finding(gap_signed: torch.Tensor, mask: torch.Tensor, facts: StepFacts) -> Finding | None:
    """The rollout reported log-probs under settings other than those the trainer scores with."""
    if abs(facts.rollout_temperature - facts.trainer_temperature) > 1e-6:
        return Finding("sampling", f"the rollout sampled at temperature {facts.rollout_temperature} but the trainer "
                       f"computed log-probs at {facts.trainer_temperature}")
    if facts.fire:
        first = position_buckets(mask, n=mask.shape[-1]) == 0
        return Finding("sampling", "rollout.use_fire_sampling: each response's first token is sampled and scored "
                       "by the rollout at temperature 30, by the trainer at "
                       f"{facts.trainer_temperature}; mean |Δ log p| on first tokens "
                       f"{float(gap_signed.abs()[first].mean()):.4g}")
    filtering = facts.top_p < 1.0 or facts.top_k > 0
    if filtering and facts.engine in RENORMALISING_ENGINES:
        signed = float(gap_signed[mask.bool()].float().mean()) if mask.any() else 0.0
        return Finding("sampling", f"top_p={facts.top_p}, top_k={facts.top_k} on {facts.engine}, which reports "
                       f"log-probs renormalised over the kept tokens while the trainer scores the full softmax; "
                       f"mean log p_rollout − log p_trainer = {signed:+.4g} (renormalising raises it)")
    return None


def _circumstantial(facts: StepFacts) -> list[Finding]:
    """Causes the driver cannot test directly, only name as candidates with what it knows."""
    found = []
    if not facts.digests_verified:
        found.append(Finding("unverified_sync", "weight syncs are not digest-checked "
                             "(actor_rollout_ref.rollout.checkpoint_engine.verify=false): a partial sync cannot be "
                             "ruled out", proven=False))
    moe = _routing_finding(facts)
    if moe is not None:
        found.append(moe)
    low = _low_precision(facts.dtypes)
    if low:
        found.append(Finding("precision", f"computing in {low}; a candidate, not a proof: an fp32 recompute of the "
                             "worst rows decides it where the actor computes below fp32 and its engine can "
                             "(docs/on_policy.md)", proven=False))
    return found


def _low_precision(dtypes: dict[str, str]) -> str:
    """``"actor=bfloat16, rollout=bfloat16"``: the roles computing below fp32 ("" for none)."""
    return ", ".join(f"{r}={d}" for r, d in sorted(dtypes.items()) if d not in ("fp32", "float32"))


def wants_fp32_recompute(findings: list[Finding], facts: StepFacts) -> bool:
    """Whether an fp32 recompute can decide a precision candidate: the actor computes below fp32 (else the
    recompute is its own log-probs again) and its engine can compute in fp32."""
    actor = facts.dtypes.get("actor", "float32")
    return facts.fp32_recompute and actor not in ("fp32", "float32") and any(
        f.cause == "precision" and not f.proven for f in findings)


def worst_rows(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor,
               k: int = PRECISION_ROWS) -> list[int]:
    """The ``k`` rows (all (B, Tr)) with the largest mean |Δ log p| over their valid tokens, worst first."""
    rows = _row_means((rollout_log_probs.float() - old_log_probs.float()).abs(), mask)
    return rows.topk(min(k, len(rows))).indices.tolist()


def precision_finding(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, fp32_log_probs: torch.Tensor,
                      mask: torch.Tensor, dtypes: dict[str, str]) -> Finding:
    """Precision decided on a few rows (all (k, Tr)) by the trainer's log-probs recomputed in fp32: proven when
    mean |log p_rollout − log p_fp32| < ``PRECISION_CLOSES`` × mean |log p_rollout − log p_trainer| over their
    valid tokens, else a candidate (the rollout's own rounding, which no recompute here reaches)."""
    valid = mask.bool()
    before = float((rollout_log_probs.float() - old_log_probs.float()).abs()[valid].mean())
    after = float((rollout_log_probs.float() - fp32_log_probs.float()).abs()[valid].mean())
    rows, low = len(mask), _low_precision(dtypes)
    if after < PRECISION_CLOSES * before:
        return Finding("precision", f"computing in {low}: an fp32 recompute of the {rows} worst rows closes the gap, "
                       f"mean |Δ log p| {after:.4g} against the rollout's log-probs vs {before:.4g} in the trainer's "
                       f"dtype (under 1/{round(1 / PRECISION_CLOSES)} of it)")
    return Finding("precision", f"computing in {low}; an fp32 recompute of the {rows} worst rows leaves {after:.4g} of "
                   f"their mean |Δ log p| {before:.4g}, so the trainer's rounding is not the gap; the rollout's own "
                   "rounding stays a candidate, not a proof", proven=False)


def settle_precision(findings: list[Finding], finding: Finding) -> list[Finding]:
    """``findings`` with the precision candidate replaced by the recompute's ``finding``: after the other
    proven causes when it is proven, else last, as a candidate."""
    rest = [f for f in findings if f.cause != "precision"]
    if not finding.proven:
        return rest + [finding]
    proven = [f for f in rest if f.proven]
    return proven + [finding] + [f for f in rest if not f.proven]


def _routing_finding(facts: StepFacts) -> Finding | None:
    """An MoE policy routes each token by a top-k that rounding can flip between rollout and trainer."""
    if facts.moe_layers == 0:
        return None
    if facts.router_replay == "disabled":
        return Finding("moe_routing", f"an MoE policy ({facts.moe_layers} routed layers) without routing replay: the "
                       "trainer may send a token to other experts than the rollout did; set "
                       "actor_rollout_ref.actor.router_replay.mode=R3 and rollout.enable_rollout_routing_replay=true",
                       proven=False)
    if facts.routing_changed_frac:
        return Finding("moe_routing", f"{facts.routing_changed_frac:.2%} of response tokens would be routed elsewhere "
                       f"by the trainer; router_replay.mode={facts.router_replay} replays the recorded experts, so "
                       "routing is not the gap unless the records are misaligned", proven=False)
    return None


def routing_changed_frac(changed: torch.Tensor, counted: torch.Tensor) -> float:
    """The share of counted tokens (per-row counts (B,)) whose routing the trainer would change; 0 when none counted."""
    total = float(counted.sum())
    return float(changed.sum()) / total if total > 0 else 0.0


def replay_gap_metrics(rollout_log_probs: torch.Tensor, replayed: torch.Tensor, unreplayed: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, float]:
    """|log p_rollout − log p_trainer| over the valid tokens (all (B, Tr)) with the rollout's routing replayed
    and with the trainer's own: ``mismatch/router_replay/{on,off}/{mean,max}``."""
    valid = mask.bool()
    if not valid.any():
        return {}
    out = {}
    for name, scored in (("on", replayed), ("off", unreplayed)):
        gap = (rollout_log_probs.float() - scored.float()).abs()[valid]
        out |= {f"mismatch/router_replay/{name}/mean": float(gap.mean()), f"mismatch/router_replay/{name}/max": float(gap.max())}
    return out


def diagnose(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor,
             versions: np.ndarray | None, facts: StepFacts, retokenised_from: np.ndarray | None = None) -> list[Finding]:
    """The causes the evidence supports, most direct first (see the module docstring); empty: none found.
    ``versions``: the batch's ``param_version`` column (B,) or None; ``retokenised_from``: its column of
    that name (B,) or None (rows that no agent loop made)."""
    signed = rollout_log_probs.float() - old_log_probs.float()
    direct = [f for f in (_retokenisation_finding(signed.abs(), mask, retokenised_from),
                          _version_finding(signed.abs(), mask, versions, facts),
                          _sampling_finding(signed, mask, facts)) if f is not None]
    return direct + _circumstantial(facts)


def diagnosis_message(step: int, mean_gap: float, threshold: float, findings: list[Finding]) -> str:
    """One log record: the step, the gap, the cause named first and every finding's evidence."""
    head = (f"step {step}: mean |log p_rollout − log p_trainer| = {mean_gap:.4g} passes "
            f"trainer.mismatch_audit_threshold={threshold}")
    if not findings:
        return head + "; no cause found (docs/on_policy.md lists what is checked)"
    return head + f"; likely cause: {findings[0].cause}. " + " | ".join(f"{f.cause}: {f.evidence}" for f in findings)


def audit(batch: DataProto, old_log_probs: torch.Tensor, facts: StepFacts,
          threshold: float) -> tuple[dict[str, float], float, list[Finding] | None]:
    """One step's audit of a batch carrying ``rollout_log_probs`` and ``response_mask`` (B, Tr) against
    the trainer's ``old_log_probs`` (B, Tr): its metrics, the mean |Δ log p| per valid token, and the
    findings when that mean passes ``threshold`` (None below it). Multi-turn rows are those of a batch
    with a ``num_turns`` column (the agent loops')."""
    rollout, mask, columns = batch.batch["rollout_log_probs"], batch.batch["response_mask"], batch.non_tensor_batch
    gap = (rollout.float() - old_log_probs.float()).abs()
    metrics = mismatch_metrics(gap, mask, columns.get("data_source"), multi_turn="num_turns" in columns)
    mean_gap = float((gap * mask).sum() / mask.sum().clamp(min=1))
    if mean_gap <= threshold:
        return metrics, mean_gap, None
    return metrics, mean_gap, diagnose(rollout, old_log_probs, mask, columns.get("param_version"), facts,
                                       columns.get("retokenised_from"))


def should_log(step: int, cause: str, last: tuple[int, str], every: int) -> bool:
    """Rate limit: a diagnosis is logged unless the last one (``last`` = (step, cause)) named the same
    cause fewer than ``every`` steps ago; the driver calls this at most once a step."""
    return cause != last[1] or step - last[0] >= every
