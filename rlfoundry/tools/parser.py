"""Tool calls out of an assistant turn's text, one parser per ``rollout.multi_turn.format`` (verl's key
and parser names; ``FORMATS`` is the registry, ``TOOL_CALL_FORMATS`` the names the config accepts).

- ``hermes`` (Qwen2.5 / Qwen3, vLLM's and verl's hermes parser): each call is a JSON object between tags::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "123 * 456"}}
      </tool_call>

- ``qwen``: the same syntax under SGLang's name for Qwen2.5's detector (verl's search example config
  names it; verl's own agent loop has no parser of that name and refuses it).
- ``gpt-oss`` (OpenAI's harmony format; the markup is special tokens, so the text is decoded with them)::

      <|channel|>analysis<|message|>…reasoning…<|end|><|start|>assistant<|channel|>commentary
      to=functions.calculator <|constrain|>json<|message|>{"expression": "2*3"}<|call|>

  Reasoning (``analysis``) messages are removed first, as in verl: a call written inside the reasoning
  is not a call. Unlike verl, a call that is the turn's first message counts too (the generation
  prompt, not the model, wrote its ``<|start|>assistant``).
- ``qwen3_coder`` (Qwen3-Coder / Qwen3.5; verl ≥ 0.9): XML inside the tags, values typed by the tool's
  schema (integers, numbers, booleans, JSON objects, Python literals; anything else stays a string)::

      <tool_call>
      <function=calculator>
      <parameter=expression>
      2*3
      </parameter>
      </function>
      </tool_call>

A call that cannot be read (arguments that are not a JSON object, no name) is not dropped silently as
verl drops it: it comes back as an error text for the model (the trajectory goes on). Pure functions of
the text, which the agent loop decodes with its special tokens (padding removed), as verl does.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMATS", "TOOL_CALL_FORMATS", "CallError", "ParsedCall", "ParsedTurn", "ToolCallFormat",
           "harmony_tool_answers", "parse_gpt_oss", "parse_hermes", "parse_qwen3_coder", "parse_tool_calls"]

# A tool's argument types by name, from its schema: {tool: {argument: JSON type (or list of types)}}
ArgumentTypes = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ParsedCall:
    """A call with its arguments decoded (what ``execute`` gets as ``parameters``)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A call that could not be read: the tool's name when it was readable, and the text for the model."""

    name: str
    message: str


@dataclass
class ParsedTurn:
    """``content``: the text outside the calls; ``calls`` in order; ``errors``: one per bad call."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    errors: list[CallError] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallFormat:
    parse: Callable[[str, ArgumentTypes], ParsedTurn]
    special_tokens: bool  # the markup is special tokens: text decoded without them (the OpenAI endpoint's) has no calls
    # (tool names, answer texts) -> the text after the turn, generation prompt included; None: the chat
    # template renders the tool messages
    render_answers: Callable[[list[str], list[str]], str] | None = None


# ---- hermes (and qwen) ------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str, types: ArgumentTypes | None = None) -> ParsedTurn:
    turn = ParsedTurn(content=_HERMES.sub("", text).strip())
    for raw in _HERMES.findall(text):
        _add(turn, *_hermes_call(raw.strip()))
    return turn


def _hermes_call(raw: str) -> tuple[str, Any, str | None]:
    """(name, arguments, error text or None)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return "", None, f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "", None, 'error: a tool call must be an object with a "name" and "arguments"'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates double-encode the arguments
        return (obj["name"], *_json_arguments(obj["name"], args))
    return obj["name"], args, None


def _json_arguments(name: str, text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError:
        return None, f"error: the arguments of {name!r} are not a JSON object"


def _add(turn: ParsedTurn, name: str, arguments: Any, error: str | None = None) -> None:
    """Appends the call, or the error it is (unreadable, or arguments that are not an object)."""
    if error is None and not isinstance(arguments, dict):
        error = f"error: the arguments of {name!r} must be a JSON object"
    if error is None:
        turn.calls.append(ParsedCall(name, arguments))
    else:
        turn.errors.append(CallError(name, error))


# ---- gpt-oss (harmony) ------------------------------------------------------------------------

_HARMONY_ANALYSIS = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL)
_HARMONY_CALL = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>[^<]* to=functions\.([^<]+) "
                           r"<\|constrain\|>json<\|message\|>(.*?)<\|call\|>", re.DOTALL)


def parse_gpt_oss(text: str, types: ArgumentTypes | None = None) -> ParsedTurn:
    text = _HARMONY_ANALYSIS.sub("", text)
    turn = ParsedTurn(content=_HARMONY_CALL.sub("", text).strip())
    for name, raw in _HARMONY_CALL.findall(text):
        name = name.strip()
        _add(turn, name, *_json_arguments(name, raw))
    return turn


def harmony_tool_answers(names: list[str], texts: list[str]) -> str:
    """Tool answers as harmony messages from ``functions.<name>``, then the next assistant turn's start.
    Written out, as verl does for gpt-oss: the template renders a tool message only after the assistant
    message holding its call, which the chat here does not carry."""
    answers = "".join(f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{text}<|end|>"
                      for name, text in zip(names, texts))
    return answers + "<|start|>assistant"


# ---- qwen3_coder (XML) -----------------------------------------------------------------------

_XML_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|$)", re.DOTALL)


def parse_qwen3_coder(text: str, types: ArgumentTypes | None = None) -> ParsedTurn:
    """As verl's: a call left open at the end of the turn still counts (the closing tags are optional)."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(content=text.strip())
    turn = ParsedTurn(content=text[:start].strip())
    for call in _XML_CALL.findall(text):
        for function in _XML_FUNCTION.findall(call):
            name, sep, body = function.partition(">")
            if not sep:  # verl skips it silently
                _add(turn, "", None, f"error: the tool call <function={function.strip()[:40]} has no '>'")
            else:
                _add(turn, name, _xml_arguments(body, (types or {}).get(name, {})))
    return turn


def _xml_arguments(body: str, types: Mapping[str, Any]) -> dict[str, Any]:
    arguments = {}
    for parameter in _XML_PARAMETER.findall(body):
        key, sep, value = parameter.partition(">")
        if sep:  # a parameter without '>' is skipped, as verl skips it
            arguments[key] = _typed(value.removeprefix("\n").removesuffix("\n"), types.get(key))
    return arguments


def _typed(value: str, json_type: Any) -> Any:
    """``value`` as the schema's type says (verl's conversion); what does not convert stays a string."""
    if value.lower() == "null":
        return None
    if json_type is None:
        return value
    kind = str(next((t for t in json_type if t != "null"), "string") if isinstance(json_type, list) else json_type)
    kind = kind.strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        return _or_string(int, value)
    if kind.startswith(("num", "float")):
        number = _or_string(float, value)
        return int(number) if isinstance(number, float) and number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind == "object" or kind.startswith("dict"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return _or_string(ast.literal_eval, value)  # literals only: the text is the model's, never evaluated


def _or_string(convert: Callable[[str], Any], value: str) -> Any:
    try:
        return convert(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


# ---- the registry -----------------------------------------------------------------------------

FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(parse_hermes, special_tokens=False),
    "qwen": ToolCallFormat(parse_hermes, special_tokens=False),
    "gpt-oss": ToolCallFormat(parse_gpt_oss, special_tokens=True, render_answers=harmony_tool_answers),
    "qwen3_coder": ToolCallFormat(parse_qwen3_coder, special_tokens=False),
}
TOOL_CALL_FORMATS: tuple[str, ...] = tuple(FORMATS)


def parse_tool_calls(format_name: str, text: str, types: ArgumentTypes | None = None) -> ParsedTurn:
    """The calls of one turn's decoded text in ``format_name`` (a key of ``FORMATS``)."""
    if format_name not in FORMATS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={format_name!r} is not a known tool-call "
                         f"format; known: {list(TOOL_CALL_FORMATS)}")
    return FORMATS[format_name].parse(text, types or {})
