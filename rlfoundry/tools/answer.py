"""verl's answer-submission tools (GSM8K, Geo3K): the model submits an answer and is told its score so far.

The ground truth comes from ``create``: as ``ground_truth=`` or inside ``create_kwargs={...}`` (how
verl's agent loop passes the row's ``extra_info.tools_kwargs.<name>.create_kwargs``). Each call scores the
answer (the subclass's ``score``), answers ``Current parsed answer='…' reward=…`` as verl's tools do (the
scorer's value as it is), and gives a step reward of 0 when the score improved and a small penalty
otherwise (resubmitting the same wrong answer does not pay); ``calc_reward`` is the score of the last answer.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.schemas import ToolResponse
from rlfoundry.utils.rollout_trace import rollout_trace_op

__all__ = ["AnswerTool"]

_NO_GAIN_PENALTY = -0.05


class AnswerTool(BaseTool):
    """Subclasses say how an answer is stored (``as_response``) and scored (``score``)."""

    def __init__(self, config: dict, tool_schema=None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def as_response(self, answer: str) -> str:
        return answer

    def score(self, response: str, ground_truth: str) -> float:
        raise NotImplementedError

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        state["response"] = self.as_response(answer)
        reward = await self.calc_reward(instance_id)
        step = 0.0 if reward > state["reward"] else _NO_GAIN_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward!r}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return self.score(state["response"], str(state["ground_truth"]))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
