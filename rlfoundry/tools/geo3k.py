"""verl's Geo3K answer tool (``verl.tools.geo3k_tool.Geo3kTool``): the answer itself, not a ``\\boxed{}``
in a response, is compared with the ground truth mathematically (verl: ``geo3k.compute_score`` with
``use_boxed=False, format_score=0.0``, mathruler's grader; here math-verify, ``rewards/math.py``), so
the score is 1.0 or 0.0. The life cycle, the reply text and the step rewards are ``answer.AnswerTool``'s.
"""

from __future__ import annotations

from rlfoundry.rewards.math import math_verify_equal
from rlfoundry.tools.answer import AnswerTool

__all__ = ["Geo3kTool"]


class Geo3kTool(AnswerTool):
    """``calc_geo3k_reward(answer)`` for one trajectory's question."""

    def score(self, response: str, ground_truth: str) -> float:
        if response.strip() == ground_truth.strip():
            return 1.0  # the common exact case, without sympy
        # boxed, so that math-verify reads the whole answer as LaTeX (2\sqrt{3}, 60^\circ)
        return 1.0 if response.strip() and math_verify_equal(f"\\boxed{{{response}}}", ground_truth) else 0.0
