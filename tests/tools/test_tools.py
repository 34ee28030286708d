"""Tools for multi-turn rollouts: verl-format tool configs load (verl's class names included), the
built-in tools answer exactly, hermes calls parse (bad ones become messages), and the runner
contains every way a tool can fail within its timeout."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.parser import parse_hermes
from rlfoundry.tools.registry import ToolConfigError, initialize_tools_from_config
from rlfoundry.tools.runner import ToolCall, run_tool_calls
from rlfoundry.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionToolSchema, ToolResponse

CONFIGS = Path(__file__).resolve().parents[2] / "rlfoundry" / "config" / "tools"


def _tool(name: str):
    [tool] = initialize_tools_from_config(CONFIGS / f"{name}.yaml")
    return tool


def _execute(tool, arguments: dict, instance: str = "t0"):
    return asyncio.run(tool.execute(instance, arguments))


# ---- configs -------------------------------------------------------------------------------


def test_packaged_configs_load_and_verl_class_names_resolve():
    tools = {n: _tool(n) for n in ("calculator", "code_interpreter", "gsm8k")}
    assert {n: type(t).__name__ for n, t in tools.items()} == {
        "calculator": "CalculatorTool", "code_interpreter": "CodeInterpreterTool", "gsm8k": "Gsm8kTool"}
    schema = tools["gsm8k"].get_openai_tool_schema().model_dump()
    assert schema["function"]["name"] == "calc_gsm8k_reward"
    assert schema["function"]["parameters"]["required"] == ["answer"]
    assert tools["code_interpreter"].limits.memory_bytes == 1024 << 20  # its config block reached it


@pytest.mark.parametrize("body, message", [
    ("tools: []", "non-empty 'tools:' list"),
    ("tools:\n  - class_name: x.Y\n    tool_schema: {type: function, function: {name: a, description: d}}",
     "tools[0]: class_name 'x.Y' cannot be imported"),
    ("tools:\n  - class_name: rlfoundry.tools.calculator.CalculatorTool\n    config: {type: mcp}\n"
     "    tool_schema: {type: function, function: {name: a, description: d}}",
     "CalculatorTool.: config.type=mcp cannot run here: verl.s MCP tools"),
    ("tools:\n  - class_name: rlfoundry.tools.calculator.CalculatorTool\n    config: {type: sse}\n"
     "    tool_schema: {type: function, function: {name: a, description: d}}", "config.type='sse' is not supported"),
    ("tools:\n  - class_name: rlfoundry.tools.calculator.CalculatorTool\n    tool_schema: {type: function}",
     "tool_schema is not an OpenAI function schema"),
    ("tools:\n" + "".join("  - class_name: rlfoundry.tools.calculator.CalculatorTool\n"
                          "    tool_schema: {type: function, function: {name: same, description: d}}\n" for _ in range(2)),
     "tool names must be unique"),
])
def test_bad_tool_configs_name_the_entry_and_the_problem(tmp_path, body, message):
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    with pytest.raises(ToolConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        initialize_tools_from_config(path)
    with pytest.raises(ToolConfigError, match="does not exist"):
        initialize_tools_from_config(tmp_path / "missing.yaml")


# ---- built-in tools ------------------------------------------------------------------------


@pytest.mark.parametrize("expression, text", [
    ("123456789 * 987654321", "121932631112635269"),  # exact: no float rounding
    ("(2 + 3) * -4", "-20"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("2 ** 100", str(2 ** 100)),
    ("1 / 0", "error: division by zero"), ("9 ** 9 ** 9", "error: the power is too large"),
    ("__import__('os')", "error: unsupported element"), ("2 +", "error: not an arithmetic expression"),
])
def test_calculator(expression, text):
    response, reward, _ = _execute(_tool("calculator"), {"expression": expression})
    assert response.text.startswith(text) and reward == 0.0


def test_gsm8k_tool_scores_answers_against_its_instance_ground_truth():
    tool = _tool("gsm8k")
    instance, _ = asyncio.run(tool.create(ground_truth="72"))
    wrong, step_wrong, _ = _execute(tool, {"answer": "70"}, instance)
    right, step_right, _ = _execute(tool, {"answer": "72"}, instance)
    again, step_again, _ = _execute(tool, {"answer": "72"}, instance)
    assert "reward=0.0" in wrong.text and "reward=1.0" in right.text
    assert (step_wrong, step_right, step_again) == (-0.05, 0.0, -0.05)  # no gain: a small penalty
    assert asyncio.run(tool.calc_reward(instance)) == 1.0
    asyncio.run(tool.release(instance))
    assert instance not in tool._instances


def test_code_interpreter_runs_code_and_reports_limits():
    tool = _tool("code_interpreter")
    ok, _, metrics = _execute(tool, {"code": "print(sum(range(101)))"})
    assert ok.text == "5050\n" and metrics["status"] == "ok"
    bomb, _, metrics = _execute(tool, {"code": "import os\nwhile True:\n    os.fork()"})
    # refused by the kernel (seccomp) in the namespaced sandbox, by the audit hook in the unisolated mode
    refusal = ("PermissionError: [Errno 1] Operation not permitted", "PermissionError: sandbox: os.fork is not allowed")
    assert any(r in bomb.text for r in refusal) and metrics["status"] == "error"
    empty, _, metrics = _execute(tool, {"code": ""})
    assert empty.text.startswith("error:") and metrics == {"error": 1}


# ---- parser --------------------------------------------------------------------------------


def test_hermes_calls_are_parsed_and_bad_ones_become_messages():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>')
    turn = parse_hermes(text)
    assert turn.content == "Let me compute."
    assert [c.arguments for c in turn.calls] == [{"expression": "2*3"}, {"expression": "1+1"}]
    assert len(turn.errors) == 2 and "not valid JSON" in turn.errors[0].message and '"name"' in turn.errors[1].message
    assert parse_hermes("The answer is 6.").calls == []


# ---- runner --------------------------------------------------------------------------------


class _Misbehaving(BaseTool):
    """Each argument value names a way to fail."""

    release = threading.Event()  # what a blocked call waits for: set by the test once the turn is over
    in_flight = peak = 0

    async def execute(self, instance_id, parameters, **kwargs):
        how = parameters["how"]
        if how == "raise":
            raise RuntimeError("broken tool")
        if how == "block":
            _Misbehaving.release.wait(60)  # a sync call inside async code: blocks its event loop
        if how == "nap":
            await asyncio.sleep(0.05)
            return ToolResponse(text="rested"), 0.5, {"naps": 1}
        if how == "gather":  # returns once three calls are running at the same time (or gives up)
            _Misbehaving.in_flight += 1
            _Misbehaving.peak = max(_Misbehaving.peak, _Misbehaving.in_flight)
            for _ in range(500):
                if _Misbehaving.in_flight >= 3:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)  # let the others see the count before it drops
            _Misbehaving.in_flight -= 1
            return ToolResponse(text="met"), 0.0, {}
        if how == "bytes":
            return b"\x00\x01", 0.0, {}
        return "plain string", 0.0, {}  # an older verl tool's return form


def _runner_tools():
    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": "odd", "description": "d"}})
    return {"odd": _Misbehaving({}, schema)}


def _calls(*hows: str, name: str = "odd") -> list[ToolCall]:
    return [ToolCall(f"t{i}", OpenAIFunctionCallSchema(name=name, arguments={"how": h})) for i, h in enumerate(hows)]


def test_every_tool_failure_is_contained_within_the_timeout():
    _Misbehaving.release.clear()
    try:
        results = run_tool_calls(_runner_tools(), _calls("raise", "block", "bytes", "plain", "nap"), max_parallel=8,
                                 timeout_s=1.5)
        # the turn came back while the blocked call was still blocked: it did not hold the turn up
        assert not _Misbehaving.release.is_set()
    finally:
        _Misbehaving.release.set()
    assert [r.error for r in results] == ["exception", "timeout", "non_text", None, None]
    assert "RuntimeError: broken tool" in results[0].text and "timed out after 1.5 s" in results[1].text
    assert (results[3].text, results[4].text, results[4].reward, results[4].metrics) == ("plain string", "rested", 0.5, {"naps": 1})


def test_calls_run_concurrently_up_to_the_limit_and_unknown_tools_are_named():
    _Misbehaving.in_flight = _Misbehaving.peak = 0
    results = run_tool_calls(_runner_tools(), _calls("gather", "gather", "gather", "gather"), max_parallel=3,
                             timeout_s=30)
    assert _Misbehaving.peak == 3  # three calls ran at once (one after another, each would have seen only itself)
    assert [r.error for r in results] == [None, None, None, "too_many_calls"]
    [unknown] = run_tool_calls(_runner_tools(), _calls("nap", name="search"), max_parallel=1, timeout_s=5)
    assert unknown.error == "unknown_tool" and "'odd'" in unknown.text
