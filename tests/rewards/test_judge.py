"""The generative reward model's pure parts: templates, the two parsers, and how the reward manager
weighs the judge against the rule score and counts failed judgements. The judge on a real engine,
through ``main_ppo``: tests/trainer/test_e2e_judge.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlfoundry.config import to_typed
from rlfoundry.config.schema import GenerativeRewardModelConfig
from rlfoundry.rewards import NaiveRewardManager
from rlfoundry.rewards.judge import (
    JudgeConfigError,
    JudgeTemplate,
    check_judge_config,
    make_parser,
    parse_number,
    parse_verdict,
)
from rlfoundry.rewards.reward_manager import place_scores
from rlfoundry.models.tiny import build_tokenizer
from tests.rewards.test_reward_manager import TR, last_token_scores, make_batch

YES_NO = {"YES": 1.0, "NO": 0.0}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ---- templates ----------------------------------------------------------------------------------


def test_packaged_templates_fill_every_placeholder_once_and_leave_other_braces():
    template = JudgeTemplate.load(None, "verdict")
    assert template.source.endswith("correctness.txt")
    text = template.render(question="What is $\\frac{1}{2}$ of {response}?", response="It is {ground_truth}",
                           ground_truth="0.5", data_source="math")
    assert "What is $\\frac{1}{2}$ of {response}?" in text  # inserted text is not substituted again
    assert "It is {ground_truth}" in text and "[Reference answer]\n0.5\n" in text
    assert "[[YES]]" in text and "{question}" not in text
    rating = JudgeTemplate.load(None, "number")
    assert rating.source.endswith("rating.txt") and "[[7]]" in rating.render(question="q", response="r")
    assert JudgeTemplate.load("rating", "verdict").source == rating.source  # a packaged name, any parser


def test_a_template_file_is_used_as_written(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("Q:{question}|R:{response}|G:{ground_truth}|S:{data_source}")
    text = JudgeTemplate.load(str(path), "verdict").render(question="1+1=", response="2", ground_truth="2",
                                                            data_source="arith")
    assert text == "Q:1+1=|R:2|G:2|S:arith"


def test_template_problems_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(JudgeConfigError, match=r"prompt_template=nope: no such file.*packaged: correctness, rating"):
        JudgeTemplate.load("nope", "verdict")
    blind = tmp_path / "blind.txt"
    blind.write_text("Is {question} answered well?")
    with pytest.raises(JudgeConfigError, match=r"no \{response\} placeholder"):
        JudgeTemplate.load(str(blind), "verdict")


# ---- parsers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("The final result matches. [[YES]]", (1.0, None)),
    ("[[ no ]]", (0.0, None)),
    ("First I thought [[YES]] but no: [[NO]]", (0.0, None)),  # the last verdict decides
    ("Verdict: yes", (1.0, None)),  # no brackets: the last word
    ("yes, but the result is wrong", (None, "no_verdict")),
    ("[[MAYBE]]", (None, "unknown_verdict")),  # brackets with no verdict in the table do not fall back
    ("", (None, "no_verdict")),
])
def test_verdict_parser(text, expected):
    assert parse_verdict(text, YES_NO) == expected


def test_verdict_parser_with_a_pairwise_table():
    table = {"A": 1.0, "B": 0.0, "tie": 0.5}
    assert parse_verdict("Assistant A is better: [[A]]", table) == (1.0, None)
    assert parse_verdict("[[B]]", table) == (0.0, None) and parse_verdict("[[TIE]]", table) == (0.5, None)
    assert parse_verdict("Final verdict: A", table) == (1.0, None) and parse_verdict("tie", table) == (0.5, None)
    # without brackets a one-letter verdict keeps its case: a trailing article is no verdict
    assert parse_verdict("I prefer a", table) == (None, "no_verdict")


@pytest.mark.parametrize("text, expected", [
    ("Rating: [[7]]", (6 / 9, None)),
    ("[[10]] is too generous; [[4]]", (3 / 9, None)),
    ("Clear and correct, 8.5", (7.5 / 9, None)),  # no brackets: the last number
    ("Score [[7]] after reading 3 lines", (6 / 9, None)),  # a bracketed number wins
    ("[[11]]", (None, "out_of_range")),
    ("[[0]]", (None, "out_of_range")),
    ("no number here [[good]]", (None, "no_verdict")),
])
def test_number_parser_maps_the_range_onto_0_1(text, expected):
    score, error = parse_number(text, 1.0, 10.0)
    assert error == expected[1]
    assert score == (None if expected[0] is None else pytest.approx(expected[0]))


def test_parser_settings_that_cannot_work_are_start_up_problems():
    def config(**kw):
        return to_typed(GenerativeRewardModelConfig, kw, name="reward.reward_model")

    with pytest.raises(JudgeConfigError, match="verdicts must map each verdict to a finite score"):
        make_parser(config(verdicts={"YES": "high"}))
    problems = check_judge_config(config(parser="number", score_range=[5, 5], prompt_template="missing.txt"))
    assert len(problems) == 2 and "score_range must be [low, high]" in problems[1]
    assert check_judge_config(config()) == []


# ---- weighing the judge against the rule score ------------------------------------------------


def _judged(batch, scores: list[float], errors: list[str | None]):
    """The columns GenerativeRewardModel.compute_rm_score adds (failure_score 0 where it failed)."""
    lengths = batch.batch["response_mask"].sum(-1)
    batch.batch["judge_scores"] = place_scores(scores, lengths, TR)
    batch.non_tensor_batch["judge_error"] = np.array(errors, dtype=object)
    return batch


class _CountingScorer:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        self.calls += 1
        return float(solution_str == ground_truth)


def test_with_a_judge_the_rule_scorer_is_not_called_by_default(tok):
    scorer = _CountingScorer()
    manager = NaiveRewardManager(tok, compute_score=scorer, num_workers=0)
    batch = _judged(make_batch(tok, ["7", "8", "9"], ["7", "7", "7"]), [1.0, 0.0, 0.0], [None, None, "no_verdict"])
    result = manager(batch, return_dict=True)
    assert scorer.calls == 0
    assert last_token_scores(result["reward_tensor"], batch) == [1.0, 0.0, 0.0]
    assert result["reward_metrics"]["reward/errors"] == 1 and result["reward_metrics"]["reward/errors/judge"] == 1
    info = result["reward_extra_info"]
    assert info["judge_score"][:2] == [1.0, 0.0] and math.isnan(info["judge_score"][2])
    assert info["judge_error"] == [None, None, "no_verdict"]


def test_weights_add_the_sources_and_failures_are_counted_once_per_sample(tok):
    scorer = _CountingScorer()
    manager = NaiveRewardManager(tok, compute_score=scorer, num_workers=0, rule_weight=1.0, judge_weight=0.5)
    # rule scores 1, 0, 1, 0; judge scores 1, 1, failed (0), 0
    batch = _judged(make_batch(tok, ["7", "8", "7", "raise"], ["7", "7", "7", "7"]), [1.0, 1.0, 0.0, 0.0],
                    [None, None, "out_of_range", None])
    result = manager(batch, return_dict=True)
    assert scorer.calls == 4
    assert last_token_scores(result["reward_tensor"], batch) == [1.5, 0.5, 1.0, 0.0]
    assert result["reward_metrics"]["reward/errors"] == 1 and result["reward_metrics"]["reward/errors/judge"] == 1


def test_rule_weight_also_scales_a_run_without_a_judge(tok):
    manager = NaiveRewardManager(tok, compute_score=_CountingScorer(), num_workers=0, rule_weight=2.0)
    batch = make_batch(tok, ["7", "8"], ["7", "7"])
    assert last_token_scores(manager(batch), batch) == [2.0, 0.0]
    assert "judge_score" not in manager(batch, return_dict=True)["reward_extra_info"]
    assert torch.equal(NaiveRewardManager(tok, compute_score=_CountingScorer(), num_workers=0)(batch),
                       manager(batch) / 2)
