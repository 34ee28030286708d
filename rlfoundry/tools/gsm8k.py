"""verl's GSM8K answer tool (``verl.tools.gsm8k_tool.Gsm8kTool``): each answer is scored as ``#### <answer>``
with the GSM8K rule scorer (flexible), the value as it is (``0`` when no number was found). The life
cycle, the reply text and the step rewards are ``answer.AnswerTool``'s.
"""

from __future__ import annotations

from rlfoundry.rewards import gsm8k
from rlfoundry.tools.answer import AnswerTool

__all__ = ["Gsm8kTool"]


class Gsm8kTool(AnswerTool):
    """``calc_gsm8k_reward(answer)`` for one trajectory's question."""

    def as_response(self, answer: str) -> str:
        return answer if answer.startswith("#### ") else f"#### {answer}"

    def score(self, response: str, ground_truth: str) -> float:
        return gsm8k.compute_score(response, ground_truth, method="flexible")
