"""Rule scorers on hand-written and real GSM8K / MATH-500 solution strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfoundry.rewards import arithmetic, gsm8k
from rlfoundry.rewards import math as math_scorer
from rlfoundry.rewards.default import SCORERS, UnknownDataSourceError, default_compute_score

# ---- GSM8K ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("solution", "truth", "strict", "flexible"),
    [
        ("She pays 1000 + 234 = 1234 dollars.\n#### 1,234", "1234", 1.0, 1.0),  # separator dropped
        ("#### 1234", "1,234", 1.0, 1.0),  # ... on either side
        ("She makes 9 * 2 = $18 every day.\n#### $18", "18", 1.0, 1.0),  # dollar sign
        ("The temperature fell to -10 degrees.\n#### -10", "-10", 1.0, 1.0),  # negative
        ("#### -10", "10", 0.0, 0.0),  # sign matters
        ("#### 2.50", "2.5", 1.0, 1.0),  # decimals compare by value
        ("#### 0.75.", "0.75", 1.0, 1.0),  # sentence-ending period
        ("#### 17", "18", 0.0, 0.0),  # wrong
        ("So the answer is $1,234.", "1234", 0.0, 1.0),  # no ####: only flexible finds it
        ("#### 5 but actually #### 7", "7", 1.0, 1.0),  # the LAST #### counts
        ("I do not know.", "18", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(solution: str, truth: str, strict: float, flexible: float) -> None:
    assert gsm8k.compute_score(solution, truth) == strict
    assert gsm8k.compute_score(solution, truth, method="flexible") == flexible


def test_gsm8k_format_score_and_custom_score() -> None:
    assert gsm8k.compute_score("#### 17", "18", format_score=0.1) == 0.1  # answer found, wrong
    assert gsm8k.compute_score("no number", "18", format_score=0.1) == 0.0  # nothing found
    assert gsm8k.compute_score("#### 18", "18", score=2.0) == 2.0
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 18", "18", method="lenient")


def test_gsm8k_reference_solutions_agree(shared_data: Path) -> None:
    """The data set's own reference solution scores 1.0 on the first 200 test rows (both methods)."""
    from rlfoundry.data.preprocess.gsm8k import extract_ground_truth

    lines = (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:200]
    rows = [json.loads(line) for line in lines]
    for method in ("strict", "flexible"):
        scores = [gsm8k.compute_score(r["answer"], extract_ground_truth(r["answer"]), method) for r in rows]
        assert scores == [1.0] * 200, method
    # and the next row's answer is wrong for (almost) every row: these 200 have no equal neighbours
    crossed = [gsm8k.compute_score(rows[i]["answer"], extract_ground_truth(rows[i + 1]["answer"])) for i in range(199)]
    same = [i for i in range(199) if extract_ground_truth(rows[i]["answer"]) == extract_ground_truth(rows[i + 1]["answer"])]
    assert [i for i, s in enumerate(crossed) if s] == same


# ---- MATH -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
        ("So $x = \\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("Hence the probability is $\\boxed{\\dfrac{3}{56}}$.", "\\frac{3}{56}", 1.0),
        ("Hence the probability is $\\boxed{\\dfrac{3}{56}}$.", "\\frac{3}{55}", 0.0),
        ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}", 1.0),
        ("The solution set is $\\boxed{(-\\infty, 3]}$.", "(-\\infty,3]", 1.0),
        ("The solution set is $\\boxed{(-\\infty, 3)}$.", "(-\\infty,3]", 0.0),  # open vs closed end
        ("The side is $\\boxed{10\\text{ cm}}$.", "10", 1.0),  # units stripped
        ("The angle is $\\boxed{30^\\circ}$.", "30", 1.0),
        ("First I guessed \\boxed{4}, but the answer is \\boxed{5}.", "5", 1.0),  # last box wins
        ("The answer is \\boxed{5}.", "6", 0.0),
        ("no final answer at all", "6", 0.0),
    ],
)
def test_math_equivalences(solution: str, truth: str, expected: float) -> None:
    assert math_scorer.compute_score(solution, truth) == expected


def test_math_reference_solutions_agree(shared_data: Path) -> None:
    """First 100 MATH-500 rows: the reference solution matches its answer, also via math-verify alone.

    Measured: 100/100 through ``compute_score`` and 100/100 through math-verify without the exact
    string fast path (500/500 on the whole file). Crossing each solution with the NEXT row's answer
    scores 1.0 only for row 22 ("5" vs next row's "x=5", which math-verify rightly calls equal).
    """
    rows = [json.loads(line) for line in (shared_data / "math500" / "test.jsonl").read_text().splitlines()[:100]]
    assert [math_scorer.compute_score(r["solution"], r["answer"]) for r in rows] == [1.0] * 100
    assert all(math_scorer.math_verify_equal(r["solution"], r["answer"]) for r in rows)
    crossed = [i for i in range(99) if math_scorer.compute_score(rows[i]["solution"], rows[i + 1]["answer"])]
    assert crossed == [22]
    assert (rows[22]["answer"], rows[23]["answer"]) == ("5", "x=5")


# ---- arithmetic and dispatch ------------------------------------------------------------------


def test_arithmetic_scorer_is_exact() -> None:
    assert arithmetic.compute_score("85", "85") == 1.0
    assert arithmetic.compute_score(" 85\n", "85") == 1.0
    assert arithmetic.compute_score("-11", "-11") == 1.0
    assert arithmetic.compute_score("84", "85", format_score=0.1) == 0.1
    assert arithmetic.compute_score("85 apples", "85") == 0.0  # extra text is not the answer
    assert arithmetic.compute_score("", "85") == 0.0


def test_default_compute_score_dispatches_and_lists_known_sources() -> None:
    assert default_compute_score("openai/gsm8k", "#### 1,234", "1234") == 1.0
    assert default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{\\frac12}", "0.5") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "3") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "4") == 0.0
    assert default_compute_score("rlfoundry/arithmetic", "85", "85", extra_info={"index": 0}) == 1.0
    with pytest.raises(UnknownDataSourceError) as err:
        default_compute_score("my/dataset", "x", "y")
    message = str(err.value)
    assert "my/dataset" in message and all(name in message for name in SCORERS)
    assert "custom_reward_function.path" in message
