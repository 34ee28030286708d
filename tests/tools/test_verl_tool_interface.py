"""verl's tool interface in full: verl's own GSM8K tool file (``verl_gsm8k_tool.py``, a fixture copy with
only its imports changed) gives verl's outputs call for call, and so does the built-in tool its class
name maps to; and each piece a verl tool file or config relies on, with values derived by hand."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlfoundry.rewards import gsm8k as gsm8k_scorer
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.gsm8k import Gsm8kTool as BuiltinGsm8kTool
from rlfoundry.tools.registry import ToolConfigError, initialize_tools_from_config
from rlfoundry.tools.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionToolSchema,
    ToolResponse,
)
from tests.tools.verl_gsm8k_tool import Gsm8kTool as VerlGsm8kTool

GSM8K_SCHEMA = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
    "name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "The answer"}},
                   "required": ["answer"]}}})

# One instance, ground truth "72", these calls in order. Expected by reading verl's code (verl/tools/
# gsm8k_tool.py + verl/utils/reward_score/gsm8k.py, flexible method): the text is
# f"Current parsed {answer=} {reward=}" with `answer` the argument as given (str() of a non-string);
# the scorer takes the last run of [0-9.,] in "#### <answer>" (the answer itself if it starts with
# "#### "), returns score=1.0 if it equals the truth, format_score=0.0 if not, and the int 0 when there
# is none; the step reward is 0.0 if the score rose above the previous one (which starts at 0.0), else -0.05.
VERL_CALLS = [
    ({"answer": "70"}, "Current parsed answer='70' reward=0.0", -0.05),  # "70" != "72": 0.0, not above 0.0
    ({"answer": "I am not sure"}, "Current parsed answer='I am not sure' reward=0", -0.05),  # no number: int 0
    ({"answer": "#### 72"}, "Current parsed answer='#### 72' reward=1.0", 0.0),  # kept as given; 1.0 > 0
    ({"answer": 72}, "Current parsed answer='72' reward=1.0", -0.05),  # str(72); 1.0 is not above 1.0
    ({}, "Current parsed answer='' reward=0", -0.05),  # "#### " has no number: 0
]


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("cls", [VerlGsm8kTool, BuiltinGsm8kTool], ids=["verl_file", "builtin"])
def test_gsm8k_tool_gives_verls_outputs_call_for_call(cls):
    tool = cls({"type": "native"}, GSM8K_SCHEMA)
    assert tool.name == "calc_gsm8k_reward" and tool.get_openai_tool_schema() is GSM8K_SCHEMA
    # verl's agent loop: create(create_kwargs=...), execute(..., agent_data=...)
    instance, created = _run(tool.create(create_kwargs={"ground_truth": "72"}))
    assert isinstance(instance, str) and created.is_empty()
    for arguments, text, step in VERL_CALLS:
        response, reward, metrics = _run(tool.execute(instance, arguments, agent_data=object()))
        assert (response.text, reward, metrics) == (text, step, {})
        assert response.is_text_only()
    final = _run(tool.calc_reward(instance))
    assert final == 0 and type(final) is int  # the last answer ("") scores verl's int 0
    _run(tool.release(instance))
    # verl's SGLang rollout: create(instance_id, ground_truth=...)
    assert _run(tool.create("given-id", ground_truth="18"))[0] == "given-id"
    response, reward, _ = _run(tool.execute("given-id", {"answer": "18"}))
    assert (response.text, reward) == ("Current parsed answer='18' reward=1.0", 0.0)
    assert _run(tool.calc_reward("given-id")) == 1.0


def test_the_verl_class_name_in_a_tool_config_loads_the_builtin_and_verls_file_loads_by_its_path(tmp_path):
    entry = ("  - class_name: {}\n    config: {{type: native}}\n    tool_schema:\n      type: function\n"
             "      function: {{name: {}, description: d, parameters: {{type: object, properties: "
             "{{answer: {{type: string}}}}, required: [answer]}}}}\n")
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n" + entry.format("verl.tools.gsm8k_tool.Gsm8kTool", "a")
                    + entry.format("tests.tools.verl_gsm8k_tool.Gsm8kTool", "b"))
    builtin, verl = initialize_tools_from_config(path)
    assert (type(builtin), type(verl)) == (BuiltinGsm8kTool, VerlGsm8kTool)


def test_gsm8k_scorer_values_are_verls_and_its_value_comparison_is_ours():
    # verl: `return 0` when nothing is extracted, `score` / `format_score` as passed otherwise
    assert type(gsm8k_scorer.compute_score("no number here", "72")) is int
    assert gsm8k_scorer.compute_score("#### 70", "72", format_score=0.1) == 0.1
    assert gsm8k_scorer.compute_score("#### 72", "72", score=2) == 2
    # on purpose not verl's: verl compares strings, so "72.00" and "1,234" (flexible) score 0.0 there
    assert gsm8k_scorer.compute_score("#### 72.00", "72", method="flexible") == 1.0
    assert gsm8k_scorer.compute_score("so 1,234", "1234", method="flexible") == 1.0


# ---- schemas ---------------------------------------------------------------------------------


def test_tool_response_is_empty_and_is_text_only():
    # (text, image, video) -> (is_empty, is_text_only): verl's `not text and not image and not video` and
    # `text and not image and not video`, here as bools
    cases = [((None, None, None), (True, False)), (("", None, None), (True, False)), (("hi", None, None), (False, True)),
             ((None, [], None), (True, False)), (("hi", ["img"], None), (False, False)), ((None, None, ["v"]), (False, False))]
    for (text, image, video), expected in cases:
        response = ToolResponse(text=text, image=image, video=video)
        assert (response.is_empty(), response.is_text_only()) == expected, (text, image, video)
        assert all(type(v) is bool for v in (response.is_empty(), response.is_text_only()))


@pytest.mark.parametrize("arguments, decoded, error", [
    ('{"answer": "72"}', {"answer": "72"}, False),
    ("{}", {}, False),
    ('{"answer": ', {}, True),  # not JSON
    ('["72"]', {}, True),  # JSON, but not an object
    ('"72"', {}, True),
    ("null", {}, True),
])
def test_call_from_parsed_schema_decodes_arguments_or_flags_them(arguments, decoded, error):
    parsed = OpenAIFunctionParsedSchema(name="calc_gsm8k_reward", arguments=arguments)
    call, has_decode_error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
    assert (call.name, call.arguments, has_decode_error) == ("calc_gsm8k_reward", decoded, error)


def test_properties_take_a_list_of_types_and_non_string_enums():
    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": "zoom", "description": "d", "parameters": {"type": "object", "required": ["level"], "properties": {
            "level": {"type": ["integer", "number"], "enum": [1, 2, 2.5]},
            "mode": {"type": "string", "enum": ["fast", "exact"]}}}}})
    props = schema.function.parameters.properties
    assert props["level"].type == ["integer", "number"] and props["level"].enum == [1, 2, 2.5]
    assert [type(v) for v in props["level"].enum] == [int, int, float]  # not coerced to strings
    dumped = schema.model_dump()["function"]["parameters"]["properties"]
    assert json.loads(json.dumps(dumped))["level"] == {"type": ["integer", "number"], "description": None, "enum": [1, 2, 2.5]}
    assert OpenAIFunctionPropertySchema(type="string").enum is None


# ---- tool classes and configs -----------------------------------------------------------------


class _SelfDescribing(BaseTool):
    """A verl-style tool that supplies its own schema (its config entry has no tool_schema)."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {"type": "function", "function": {"name": "self_described", "description": "d"}})


class _StrictExecute(BaseTool):
    async def execute(self, instance_id, parameters):  # no **kwargs: agent_data= would break every call
        return ToolResponse(text="x"), 0.0, {}


def test_an_entry_without_tool_schema_takes_the_class_schema_and_one_with_neither_is_an_error(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {__name__}._SelfDescribing\n    config: {{type: native}}\n")
    [tool] = initialize_tools_from_config(path)
    assert tool.name == "self_described" and tool.tool_schema.function.description == "d"
    path.write_text("tools:\n  - class_name: rlfoundry.tools.base.BaseTool\n    config: {type: native}\n")
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: BaseTool has no tool schema: give the entry a tool_schema"):
        initialize_tools_from_config(path)


def test_a_class_whose_execute_cannot_take_agent_data_is_refused_at_load(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {__name__}._StrictExecute\n"
                    "    tool_schema: {type: function, function: {name: s, description: d}}\n")
    with pytest.raises(ToolConfigError, match=r"_StrictExecute.execute must take \*\*kwargs.*agent_data"):
        initialize_tools_from_config(path)


def test_verl_tools_rollout_trace_op_records_runner_calls_with_the_trajectorys_tags(tmp_path):
    """The runner runs each call on a thread of its own; the trace still carries the tags of the
    rollout_trace_attr the calls were made under (the threads start in a copy of the caller's context)."""
    from rlfoundry.tools.runner import ToolCall, run_tool_calls
    from rlfoundry.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr

    tool = VerlGsm8kTool({}, GSM8K_SCHEMA)
    instance, _ = _run(tool.create(ground_truth="72"))
    RolloutTraceConfig.init("p", "exp", "file", path=tmp_path / "trace.jsonl")
    try:
        with rollout_trace_attr(sample_index=4, step=9, rollout_n=0):
            [result] = run_tool_calls({tool.name: tool}, [ToolCall(instance, OpenAIFunctionCallSchema(
                name=tool.name, arguments={"answer": "72"}))], max_parallel=1, timeout_s=10, agent_data="the trajectory")
    finally:
        RolloutTraceConfig.reset()
    assert (result.text, result.reward, result.error) == ("Current parsed answer='72' reward=1.0", 0.0, None)
    [record] = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert record["op"] == "Gsm8kTool.execute"
    assert record["inputs"] == {"instance_id": instance, "parameters": {"answer": "72"},
                                "kwargs": {"agent_data": "the trajectory"}}
    assert record["attributes"] == {"sample_index": 4, "step": 9, "rollout_n": 0, "validate": False, "experiment_name": "exp"}
    assert record["output"] == [{"text": "Current parsed answer='72' reward=1.0", "image": None, "video": None}, 0.0, {}]
