"""The tool-call parsers of ``rollout.multi_turn.format`` on hand-written model outputs: what each finds
(names, arguments, the text around), several calls in one turn, and malformed calls as error texts."""

from __future__ import annotations

import warnings

import pytest

from rlfoundry.config import schema
from rlfoundry.tools.parser import (
    FORMATS,
    TOOL_CALL_FORMATS,
    CallError,
    ParsedCall,
    harmony_tool_answers,
    parse_tool_calls,
)
from rlfoundry.trainer.config import ConfigError, load_config


def test_the_config_accepts_exactly_the_registered_formats_with_no_warning():
    assert TOOL_CALL_FORMATS == schema.TOOL_CALL_FORMATS == ("hermes", "qwen", "gpt-oss", "qwen3_coder")
    for name in TOOL_CALL_FORMATS + ("spo",):  # spo: verl's SPO loop's <code> blocks (test_spo_tool_agent.py)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "accepted with no effect" warning: the key takes effect
            cfg = load_config([f"actor_rollout_ref.rollout.multi_turn.format={name}"])
        assert cfg.actor_rollout_ref.rollout.multi_turn.format == name
    with pytest.raises(ConfigError, match=r"multi_turn.format='glm' is not one of \['hermes', 'qwen', 'gpt-oss', "
                                          r"'qwen3_coder', 'spo'\]"):
        load_config(["actor_rollout_ref.rollout.multi_turn.format=glm"])
    with pytest.raises(ValueError, match="known: \\['hermes', 'qwen', 'gpt-oss', 'qwen3_coder'\\]"):
        parse_tool_calls("llama3", "text")


# ---- hermes / qwen ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hermes", "qwen"])
def test_hermes_two_calls_in_one_turn_with_the_text_around(name):
    text = ('I will compute both.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query_list": ["a", "b"]}}\n</tool_call>')
    turn = parse_tool_calls(name, text)
    assert turn.calls == [ParsedCall("calculator", {"expression": "2*3"}),
                          ParsedCall("search", {"query_list": ["a", "b"]})]
    assert turn.content == "I will compute both." and turn.errors == []


def test_hermes_malformed_calls_are_errors_and_the_good_ones_still_run():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'   # cut JSON
            '<tool_call>["calculator"]</tool_call>'                                         # not an object
            '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>'           # arguments a list
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>'            # a string, not JSON
            '<tool_call>{"name": "never closed"')
    turn = parse_tool_calls("hermes", text)
    assert turn.calls == [ParsedCall("calculator", {"expression": "1+1"})]  # the double-encoded one decodes
    assert [e.name for e in turn.errors] == ["", "", "calculator", "calculator"]
    assert "not valid JSON" in turn.errors[0].message and '"name"' in turn.errors[1].message
    assert turn.errors[2].message == "error: the arguments of 'calculator' must be a JSON object"
    assert turn.errors[3].message == "error: the arguments of 'calculator' are not a JSON object"
    assert turn.content == '<tool_call>{"name": "never closed"'  # an unclosed tag is text, as in verl


def test_no_call_is_no_call():
    for name in TOOL_CALL_FORMATS:
        turn = parse_tool_calls(name, "The answer is 6.")
        assert (turn.calls, turn.errors, turn.content) == ([], [], "The answer is 6.")


# ---- gpt-oss (harmony) ------------------------------------------------------------------------

_ANALYSIS = "<|channel|>analysis<|message|>I should call to=functions.fake <|constrain|>json<|message|>{}<|call|>?<|end|>"


def test_gpt_oss_calls_after_the_reasoning_and_as_the_first_message():
    second = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
              '{"location": "Tokyo"}<|call|>')
    turn = parse_tool_calls("gpt-oss", _ANALYSIS + second)
    # the reasoning's look-alike call is removed with the reasoning (verl removes analysis first)
    assert turn.calls == [ParsedCall("get_weather", {"location": "Tokyo"})]
    assert turn.content == "" and turn.errors == []
    first = '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "2*3"}<|call|>'
    assert parse_tool_calls("gpt-oss", first).calls == [ParsedCall("calculator", {"expression": "2*3"})]


def test_gpt_oss_two_calls_a_bad_one_and_the_final_answer_as_content():
    call = '<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>'
    text = (_ANALYSIS + call.format("calculator", '{"expression": "1+1"}') + call.format("calculator", "{1+1}")
            + call.format("search", '{"query_list": ["x"]}') + "<|start|>assistant<|channel|>final<|message|>done")
    turn = parse_tool_calls("gpt-oss", text)
    assert turn.calls == [ParsedCall("calculator", {"expression": "1+1"}), ParsedCall("search", {"query_list": ["x"]})]
    assert turn.errors == [CallError("calculator", "error: the arguments of 'calculator' are not a JSON object")]
    assert turn.content == "<|start|>assistant<|channel|>final<|message|>done"
    # a call written without the json constraint is not harmony's function-call syntax (as in verl)
    loose = '<|channel|>commentary to=functions.calculator<|message|>{"expression": "2"}<|call|>'
    assert parse_tool_calls("gpt-oss", loose).calls == []


def test_gpt_oss_tool_answers_are_harmony_messages_from_the_function():
    assert FORMATS["gpt-oss"].render_answers is harmony_tool_answers and FORMATS["gpt-oss"].special_tokens
    assert all(FORMATS[n].render_answers is None for n in ("hermes", "qwen", "qwen3_coder"))
    assert harmony_tool_answers(["calculator", "search"], ["6", "no results"]) == (
        "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>6<|end|>"
        "<|start|>functions.search to=assistant<|channel|>commentary<|message|>no results<|end|>"
        "<|start|>assistant")


# ---- qwen3_coder (XML) ------------------------------------------------------------------------

_TYPES = {"f": {"n": "integer", "x": "number", "ok": "boolean", "o": "object", "l": "array", "s": "string",
                "u": ["integer", "null"]}}


def _xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_values_are_typed_by_the_schema():
    text = "Let me see.\n" + _xml("f", n="7", x="2.5", ok="True", o='{"a": 1}', l="[1, 2]", s="007", u="3",
                                   extra="keep me")
    turn = parse_tool_calls("qwen3_coder", text, _TYPES)
    # number 2.5 stays a float, "True" is a boolean by lower case, the unknown argument stays a string
    assert turn.calls == [ParsedCall("f", {"n": 7, "x": 2.5, "ok": True, "o": {"a": 1}, "l": [1, 2], "s": "007",
                                           "u": 3, "extra": "keep me"})]
    assert turn.content == "Let me see." and turn.errors == []


def test_qwen3_coder_conversions_that_fail_stay_strings_and_code_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    text = _xml("f", n="seven", x="4.0", ok="yes", l=f"__import__('pathlib').Path('{marker}').touch()", s="null")
    [call] = parse_tool_calls("qwen3_coder", text, _TYPES).calls
    # 4.0 is an integer-valued number: verl gives 4; "yes" is not "true"; null is None whatever the type
    assert call.arguments == {"n": "seven", "x": 4, "ok": False, "l": f"__import__('pathlib').Path('{marker}').touch()",
                              "s": None}
    assert not marker.exists()


def test_qwen3_coder_two_calls_an_open_one_and_a_bad_one():
    text = (_xml("a", s="1") + "\n" + "<tool_call>\n<function=b no close</function>\n</tool_call>\n"
            + "<tool_call>\n<function=c>\n<parameter=s>\nopen")  # the turn ended inside the call
    turn = parse_tool_calls("qwen3_coder", text, {})
    assert turn.calls == [ParsedCall("a", {"s": "1"}), ParsedCall("c", {"s": "open"})]
    assert [e.name for e in turn.errors] == [""] and "has no '>'" in turn.errors[0].message
    assert turn.content == ""
