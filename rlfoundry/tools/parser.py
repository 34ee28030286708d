"""Tool calls out of an assistant turn's text, in the hermes format (Qwen2.5 / Qwen3 and verl's
``multi_turn.format=hermes``)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

A call that is not valid JSON, lacks a name, or whose arguments are not an object is not dropped
silently: it comes back as an error text for the model (the trajectory goes on).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from rlfoundry.tools.schemas import OpenAIFunctionCallSchema

__all__ = ["ParsedTurn", "parse_hermes"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedTurn:
    """``content``: the text outside the calls; ``calls`` in order; ``errors``: one message per bad call."""

    content: str
    calls: list[OpenAIFunctionCallSchema] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_hermes(text: str) -> ParsedTurn:
    turn = ParsedTurn(content=_CALL.sub("", text).strip())
    for raw in _CALL.findall(text):
        call, error = _parse_one(raw.strip())
        if call is not None:
            turn.calls.append(call)
        else:
            turn.errors.append(error)
    return turn


def _parse_one(raw: str) -> tuple[OpenAIFunctionCallSchema | None, str]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'error: a tool call must be an object with a "name" and "arguments"'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"error: the arguments of {obj['name']!r} are not a JSON object"
    if not isinstance(args, dict):
        return None, f"error: the arguments of {obj['name']!r} must be a JSON object"
    return OpenAIFunctionCallSchema(name=obj["name"], arguments=args), ""
