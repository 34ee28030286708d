"""The combiner of rule, reward-model and judge scores: expected tensors derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlfoundry.rewards.combine import (
    JudgeScores,
    RuleScores,
    Weights,
    combine,
    error_metrics,
    place_scores,
    rule_needed,
)

NO_ERRORS = {"reward/errors": 0, "reward/errors/exception": 0, "reward/errors/timeout": 0,
             "reward/errors/crash": 0, "reward/errors/bad_return": 0, "reward/errors/judge": 0}


def rows(*values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_place_scores_builds_on_the_lengths_device():
    """A judge or reward model whose lengths live on the GPU gets its scores there (issue 33's audit);
    checked on the meta device, which carries the device but no data."""
    meta = torch.device("meta")
    placed = place_scores([2.0, -1.0], torch.tensor([3, 1]).to(meta), 4)
    assert placed.device == meta and placed.shape == (2, 4) and placed.dtype == torch.float32


def test_place_scores_puts_each_score_on_the_last_valid_token():
    # extents 3 and 1 -> indices 2 and 0; an empty response (extent 0) is clamped to index 0
    placed = place_scores([2.0, -1.0, 0.5], torch.tensor([3, 1, 0]), 4)
    assert torch.equal(placed, rows([0, 0, 2, 0], [-1, 0, 0, 0], [0.5, 0, 0, 0]))
    assert placed.dtype == torch.float32


def test_rule_only_with_default_weights_is_the_rule_score_and_counts_failures():
    # sample 2 timed out, so the rule scorer gave it failure_score = -1
    rule = RuleScores([1.0, 0.0, -1.0], torch.tensor([1, 3, 2]), [None, None, "timeout"], {"acc": [1.0, 0.0, math.nan]})
    out = combine(Weights(), 3, rule)
    assert torch.equal(out.scores, rows([1, 0, 0], [0, 0, 0], [0, -1, 0]))
    assert out.metrics == {**NO_ERRORS, "reward/errors": 1, "reward/errors/timeout": 1}
    assert list(out.extra_info) == ["acc"] and out.extra_info["acc"][:2] == [1.0, 0.0]


def test_weighted_rule_plus_judge_by_hand():
    # rule: 1 and failure_score -1 (the scorer raised); judge: 0.5 and its failure_score -0.25 (no verdict)
    # row 0, index 1: 0.5 * 1 + 2 * 0.5 = 1.5;  row 1, index 2: 0.5 * -1 + 2 * -0.25 = -1.0
    rule = RuleScores([1.0, -1.0], torch.tensor([2, 3]), [None, "exception"])
    judge = JudgeScores(rows([0, 0.5, 0], [0, 0, -0.25]), [None, "no_verdict"])
    out = combine(Weights(rule=0.5, judge=2.0), 3, rule, judge=judge)
    assert torch.equal(out.scores, rows([0, 1.5, 0], [0, 0, -1.0]))
    # sample 1 failed twice: one sample in reward/errors, one failure in each kind
    assert out.metrics == {**NO_ERRORS, "reward/errors": 1, "reward/errors/exception": 1, "reward/errors/judge": 1}
    assert out.extra_info["judge_score"][0] == 0.5 and math.isnan(out.extra_info["judge_score"][1])
    assert out.extra_info["judge_error"] == [None, "no_verdict"]


def test_scores_stay_where_each_source_put_them():
    # the rule score sits on index 2 (extent 3), the judge's on index 1: added position by position, not moved
    rule = RuleScores([1.0], torch.tensor([3]), [None])
    judge = JudgeScores(rows([0, 0.25, 0]), [None])
    assert torch.equal(combine(Weights(rule=1.0), 3, rule, judge=judge).scores, rows([0, 0.25, 1.0]))


def test_with_a_judge_the_default_rule_weight_is_0_and_the_rule_scorer_is_not_needed():
    weights = Weights()
    assert weights.rule_weight(judged=True) == 0.0 and weights.rule_weight(judged=False) == 1.0
    assert not rule_needed(weights, has_rm_scores=False, judged=True)
    assert rule_needed(Weights(rule=0.1), has_rm_scores=False, judged=True)
    assert rule_needed(Weights(rule=0.0), has_rm_scores=False, judged=False)  # no judge: the rule is all there is
    judge = JudgeScores(rows([0, 1.0], [0.5, 0]), [None, None])
    out = combine(Weights(judge=3.0), 2, judge=judge)  # 3 x the judge
    assert torch.equal(out.scores, rows([0, 3.0], [1.5, 0]))
    assert out.metrics == NO_ERRORS and out.extra_info == {"judge_score": [1.0, 0.5], "judge_error": [None, None]}


def test_rm_scores_replace_everything_by_default():
    rm = rows([0, 0.5], [-0.25, 0])
    rule = RuleScores([1.0, 1.0], torch.tensor([2, 1]), ["crash", None], {"acc": [0.0, 1.0]})
    judge = JudgeScores(rows([0, 1.0], [1.0, 0]), [None, "no_verdict"])
    assert not rule_needed(Weights(), has_rm_scores=True, judged=False)
    out = combine(Weights(), 2, rule, rm, judge)
    assert out.scores is rm and out.extra_info == {} and out.metrics == NO_ERRORS  # verl: the model score wins


def test_rm_scores_added_to_the_weighted_rule_score():
    # rule weight 2: row 0 index 0: 2 * 1 + 0.25 = 2.25; row 1 index 1: 2 * 0.5 + (-1) = 0
    rule = RuleScores([1.0, 0.5], torch.tensor([1, 2]), [None, None])
    rm = rows([0.25, 0], [0, -1.0]).double()  # another dtype comes back as float32
    out = combine(Weights(rule=2.0, rm_combine="add"), 2, rule, rm)
    assert rule_needed(Weights(rm_combine="add"), has_rm_scores=True, judged=False)
    assert torch.equal(out.scores, rows([2.25, 0], [0, 0])) and out.scores.dtype == torch.float32


def test_error_metrics_count_a_sample_once():
    assert error_metrics() == NO_ERRORS
    assert error_metrics(["bad_return", None, "crash"], ["x", "y", None]) == {
        **NO_ERRORS, "reward/errors": 3, "reward/errors/bad_return": 1, "reward/errors/crash": 1, "reward/errors/judge": 2}
    assert error_metrics(judge_errors=[None, "no_verdict"]) == {**NO_ERRORS, "reward/errors": 1, "reward/errors/judge": 1}


def test_bad_settings_are_errors():
    with pytest.raises(ValueError, match="rm_combine='sum' must be one of"):
        Weights(rm_combine="sum")
    with pytest.raises(ValueError, match="nothing to combine"):
        combine(Weights(), 3)
    assert Weights(rule=1, judge=2) == Weights(rule=1.0, judge=2.0)  # numbers from YAML become floats
