"""verl's GSM8K interaction: a user who checks the answer and, when it is wrong, asks for another try.

``interaction_kwargs``: ``ground_truth``. The last assistant message is scored with the GSM8K rule scorer
(strict: the ``#### <answer>`` line, as the data set's instruction asks); a correct answer ends the
trajectory with score 1, a wrong one asks the model to reflect and answer again (score 0).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from rlfoundry.interactions.base import BaseInteraction
from rlfoundry.rewards import gsm8k

__all__ = ["Gsm8kInteraction"]

CORRECT = "Your response is correct!"
RETRY = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"ground_truth": ground_truth, "response": ""}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = last
        score = await self.calculate_score(instance_id)
        return (True, CORRECT, score, {}) if score == 1.0 else (False, RETRY, score, {})

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return float(gsm8k.compute_score(state["response"], str(state["ground_truth"]), method="strict",
                                         format_score=0.0, score=1.0))

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
