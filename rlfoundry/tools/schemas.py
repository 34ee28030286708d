"""Tool schemas in OpenAI's function-calling format, under verl's class names (``verl.tools.schemas``),
so that verl users' tool classes and tool configs carry over (their ``verl`` imports resolve here: utils/verl_imports.py).

A tool config's ``tool_schema`` validates into :class:`OpenAIFunctionToolSchema`; the chat
template renders ``model_dump()`` of it as the ``tools`` it offers the model. A parsed call is an
:class:`OpenAIFunctionCallSchema` (name + arguments dict); a tool answers with a :class:`ToolResponse`.

Wider than verl's on purpose: an argument's ``type`` may be a list of JSON types (``[integer, number]``)
and its ``enum`` may hold numbers, both valid JSON Schema that verl's ``type: str`` / ``enum: list[str]``
refuse. Keys the models do not name (``items``, ``minimum`` ...) are dropped, as in verl.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = ["OpenAIFunctionCallSchema", "OpenAIFunctionParametersSchema", "OpenAIFunctionParsedSchema",
           "OpenAIFunctionPropertySchema", "OpenAIFunctionSchema", "OpenAIFunctionToolCall",
           "OpenAIFunctionToolSchema", "ToolResponse"]


class OpenAIFunctionPropertySchema(BaseModel):
    """One argument: its JSON type (or types), description and allowed values."""

    type: str | list[str]
    description: str | None = None
    enum: list[str | int | float | bool | None] | None = None


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

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """``(call, has_decode_error)``, verl's contract: arguments that are not a JSON object (bad JSON,
        or JSON that decodes to a list, string or number) become ``{}`` with the flag set."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            arguments = None
        ok = isinstance(arguments, dict)
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments if ok else {}), not ok


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool hands back to the model (text; image/video for multimodal models, unused here)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    def is_empty(self) -> bool:
        """No text (None or ""), no images, no videos."""
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        """Non-empty text and nothing else (verl returns the truthy text itself; this returns a bool)."""
        return bool(self.text) and not self.image and not self.video
