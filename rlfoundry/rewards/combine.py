"""Combining a batch's scores into ``token_level_scores``: pure functions, no scoring, no processes.

A batch can carry up to three kinds of score, each already on its response's last valid token
(``place_scores``): the rule scorer's (``RuleScores``), a classifier reward model's ``rm_scores``
(``workers/reward_model.py``) and a generative judge's ``judge_scores`` (``rewards/judge.py``).
They combine as

    rm_combine=replace and rm_scores present:  rm_scores (verl's behaviour; nothing else counts)
    otherwise:  weights.rule × rule + weights.judge × judge  (+ rm_scores with rm_combine=add)

where ``weights.rule`` unset means 0 when a judge scored the batch (it replaces the rule score) and 1
otherwise, and a missing source contributes nothing. The config check allows a classifier reward
model or a judge, not both.

Failures: a rule sample that failed already holds ``failure_score`` (the rule scorer chose it) and
a failed judgement holds the judge's ``failure_score``; both count in ``reward/errors`` (a sample
once, however many of its sources failed) and per kind in ``reward/errors/<kind>``, and a failed
judgement's ``judge_score`` column is NaN so that means over it are not pulled toward the stand-in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

# rule failures (rewards/pool.py's Outcome kinds plus a return that is not a finite number) and the judge's
ERROR_KINDS = ("exception", "timeout", "crash", "bad_return", "judge")
RM_COMBINE_MODES = ("replace", "add")


@dataclass(frozen=True)
class Weights:
    """``reward.weights.{rule,judge}`` and ``reward_kwargs.rm_combine``."""

    rule: float | None = None  # None: 0 with a judge, else 1
    judge: float = 1.0
    rm_combine: str = "replace"

    def __post_init__(self) -> None:
        object.__setattr__(self, "judge", float(self.judge))
        object.__setattr__(self, "rule", None if self.rule is None else float(self.rule))
        if self.rm_combine not in RM_COMBINE_MODES:
            raise ValueError(f"rm_combine={self.rm_combine!r} must be one of {RM_COMBINE_MODES}")

    def rule_weight(self, judged: bool) -> float:
        if self.rule is None:
            return 0.0 if judged else 1.0
        return self.rule


@dataclass(frozen=True)
class RuleScores:
    """The rule scorer's result: one score per sample (``failure_score`` where ``errors`` names a
    failure), the response extents that place them, and the ``reward_extra_info`` columns."""

    values: Sequence[float]
    lengths: torch.Tensor  # (B,) one past each response's last valid token
    errors: Sequence[str | None]
    extra_info: Mapping[str, list] = field(default_factory=dict)


@dataclass(frozen=True)
class JudgeScores:
    """The generative reward model's ``judge_scores`` (B, Tr) and each row's ``judge_error``."""

    scores: torch.Tensor
    errors: Sequence[str | None]


@dataclass(frozen=True)
class Combined:
    scores: torch.Tensor  # (B, Tr) token_level_scores
    extra_info: dict[str, list]
    metrics: dict[str, int]


def place_scores(scores: Sequence[float], lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) zeros with each score on its sequence's last valid response token, on ``lengths``' device."""
    device = lengths.device
    tensor = torch.zeros(len(scores), width, dtype=torch.float32, device=device)
    last = torch.clamp(lengths - 1, min=0)  # an empty response still gets its score somewhere (masked out later)
    tensor[torch.arange(len(scores), device=device), last] = torch.tensor(list(scores), dtype=torch.float32, device=device)
    return tensor


def rm_replaces(weights: Weights, has_rm_scores: bool) -> bool:
    return has_rm_scores and weights.rm_combine == "replace"


def rule_needed(weights: Weights, has_rm_scores: bool, judged: bool) -> bool:
    """Whether the rule scorer must run: not when the reward model's scores replace everything,
    nor when a judge scored the batch and the rule weight is 0."""
    return not rm_replaces(weights, has_rm_scores) and not (judged and weights.rule_weight(judged) == 0)


def combine(weights: Weights, width: int, rule: RuleScores | None = None, rm_scores: torch.Tensor | None = None,
            judge: JudgeScores | None = None) -> Combined:
    """``token_level_scores`` (B, width), ``reward_extra_info`` and ``reward/errors*`` from the
    sources present (see the module docstring for the formula)."""
    if rm_replaces(weights, rm_scores is not None):
        return Combined(rm_scores, {}, error_metrics())
    parts = []
    if rule is not None:
        parts.append(weights.rule_weight(judge is not None) * place_scores(rule.values, rule.lengths, width))
    if rm_scores is not None:
        parts.append(rm_scores.float())
    if judge is not None:
        parts.append(weights.judge * judge.scores.float())
    if not parts:
        raise ValueError("nothing to combine: no rule, reward-model or judge scores")
    extra_info = dict(rule.extra_info) if rule is not None else {}
    extra_info.update(judge_columns(judge) if judge is not None else {})
    metrics = error_metrics(rule.errors if rule is not None else None, judge.errors if judge is not None else None)
    return Combined(sum(parts[1:], parts[0]), extra_info, metrics)


def judge_columns(judge: JudgeScores) -> dict[str, list]:
    """``judge_score`` (NaN where the judgement failed) and ``judge_error`` per sample."""
    totals = judge.scores.sum(-1).tolist()  # one non-zero entry per row: its last response token
    return {"judge_score": [float("nan") if err else s for s, err in zip(totals, judge.errors)],
            "judge_error": list(judge.errors)}


def error_metrics(rule_errors: Sequence[str | None] | None = None,
                  judge_errors: Sequence[str | None] | None = None) -> dict[str, int]:
    """``reward/errors``: samples with any failed source; ``reward/errors/<kind>``: failures per kind."""
    judge_failed = [bool(err) for err in judge_errors] if judge_errors is not None else []
    rule_errors = list(rule_errors) if rule_errors is not None else [None] * len(judge_failed)
    judge_failed = judge_failed if judge_errors is not None else [False] * len(rule_errors)
    kinds = [err for err in rule_errors if err is not None] + ["judge"] * sum(judge_failed)
    metrics = {"reward/errors": sum(r is not None or j for r, j in zip(rule_errors, judge_failed))}
    metrics.update({f"reward/errors/{kind}": kinds.count(kind) for kind in ERROR_KINDS})
    return metrics
