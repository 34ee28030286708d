"""verl's GSM8K answer tool: the model submits an answer and is told whether it is right so far.

``create_kwargs``: ``ground_truth`` (from the row's ``extra_info.tools_kwargs``). Each call scores
``#### <answer>`` with the GSM8K rule scorer; the step reward is 0 when the score improved and a small
penalty otherwise (resubmitting the same wrong answer does not pay); ``calc_reward`` is the last score.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from rlfoundry.rewards import gsm8k
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.schemas import ToolResponse

__all__ = ["Gsm8kTool"]

_NO_GAIN_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    """``calc_gsm8k_reward(answer)`` for one trajectory's question."""

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", "")).strip()
        answer = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = gsm8k.compute_score(answer, str(state["ground_truth"]), method="flexible")
        step = 0.0 if reward > state["reward"] else _NO_GAIN_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer[5:]!r} reward={reward}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return float(self._instances[instance_id]["reward"])

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
