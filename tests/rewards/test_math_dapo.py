"""DAPO's math scorer (rlfoundry/rewards/math_dapo.py): expected values derived by hand from the rules
in its docstring."""

from __future__ import annotations

import pytest

from rlfoundry.rewards.math_dapo import compute_score, normalize_final_answer


@pytest.mark.parametrize("answer, normal", [
    ("$\\frac12$", "\\frac{1}{2}"),  # $..$ unwrapped, \fracab spelled out
    ("1,000 dollars", "1000"),  # spaces and the unit dropped, then the thousands comma
    ("x = 5", "5"),  # the text after the last "="
    ("\\text{(B)}", "(B)"),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}"),
    ("90^\\circ", "90"),
    ("[INVALID]", "[INVALID]"),
])
def test_minerva_normal_form(answer, normal):
    assert normalize_final_answer(answer) == normal


def test_the_default_reads_the_last_answer_line_of_the_last_300_characters():
    assert compute_score("Work.\nAnswer: 1,000 dollars", "1000") == {"score": 1.0, "acc": True, "pred": "1000"}
    assert compute_score("Answer: 7\nAnswer: $\\frac12$", "\\frac{1}{2}")["acc"]  # the last line counts
    assert compute_score("Answer: 0.5", "\\frac{1}{2}") == {"score": -1.0, "acc": False, "pred": "0.5"}
    assert compute_score("I think it is 204.", "204") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    far = "Answer: 204\n" + "x" * 300  # the answer line lies before the window
    assert compute_score(far, "204")["pred"] == "[INVALID]"


def test_strict_box_needs_the_exact_string_in_the_last_box_near_the_end():
    assert compute_score("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", strict_box_verify=True) == \
        {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}
    assert compute_score("\\boxed{3} then \\boxed{ 204}", "204", strict_box_verify=True) == \
        {"score": -1.0, "acc": False, "pred": " 204"}  # the last box; no normalisation
    early = "\\boxed{204}" + "." * 95  # the box starts 106 characters from the end: outside the 100
    assert compute_score(early, "204", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}
    cut = "\\boxed{20"  # generation stopped inside the box
    assert compute_score(cut, "204", strict_box_verify=True)["pred"] is None
    paused = "\\boxed{204}" + "." * 200
    assert compute_score(paused, "204", strict_box_verify=True, pause_tokens_index=[0, 0, 0, 100])["acc"]
