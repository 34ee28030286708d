"""Tool schemas in OpenAI's function-calling format, under verl's class names (``verl.tools.schemas``),
so that verl users' tool classes and tool configs carry over with their imports changed.

A tool config's ``tool_schema`` validates into :class:`OpenAIFunctionToolSchema`; the chat
template renders ``model_dump()`` of it as the ``tools`` it offers the model. A parsed call is an
:class:`OpenAIFunctionCallSchema` (name + arguments dict); a tool answers with a :class:`ToolResponse`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = ["OpenAIFunctionCallSchema", "OpenAIFunctionParametersSchema", "OpenAIFunctionParsedSchema",
           "OpenAIFunctionPropertySchema", "OpenAIFunctionSchema", "OpenAIFunctionToolCall",
           "OpenAIFunctionToolSchema", "ToolResponse"]


class OpenAIFunctionPropertySchema(BaseModel):
    """One argument: its JSON type, description and allowed values."""

    type: str
    description: str | None = None
    enum: list[str] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as the model wrote it: the arguments still a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with its arguments decoded."""

    name: str
    arguments: dict[str, Any]


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool hands back to the model (text; image/video for multimodal models, unused here)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None
