"""The tool interface: verl's ``BaseTool`` life cycle, so a verl tool class ports by changing imports.

Per trajectory: ``create`` an instance (with the row's ``extra_info.tools_kwargs[<name>].create_kwargs``,
e.g. the ground truth) → ``execute`` it once per call with the parsed arguments (and ``agent_data=``, the
trajectory so far), getting the text for the model, a step reward and metrics → ``calc_reward`` at the
end → ``release``. Every method is async: the agent loop runs many trajectories' calls concurrently.
Older verl tools return a bare instance id from ``create`` and a bare string from ``execute``; the loop
accepts both forms.

The schema comes from the tool config's ``tool_schema``, or, when the entry has none, from the class's own
``get_openai_tool_schema()`` (as verl's ``BaseTool.__init__`` does with ``tool_schema=None``).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rlfoundry.utils.rollout_trace import rollout_trace_op

__all__ = ["BaseTool", "ToolSchemaError"]


class ToolSchemaError(ValueError):
    """A tool with no schema: neither its config entry nor its class gave one."""


class BaseTool:
    """A tool with no state of its own beyond what subclasses keep per instance id."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema
        if tool_schema is None:  # the class supplies it; this base class has none to give
            self.tool_schema = self.get_openai_tool_schema()
        if not isinstance(self.tool_schema, OpenAIFunctionToolSchema):
            raise ToolSchemaError(f"{type(self).__name__} has no tool schema: give the entry a tool_schema, or "
                                  "override get_openai_tool_schema() to return one")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start an instance for one trajectory; returns its id (and an optional first message)."""
        return instance_id or str(uuid4()), ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        """Run one call: (response for the model, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        pass
