"""Agents written with real agent frameworks, trained through the command line's path
(``--config-name calculator_openai_agent`` with the agent module swapped): the OpenAI Agents SDK and
LangChain, each a calculator agent over the packaged calculator policy, two GRPO steps. What is checked:
both steps train; the dumped trajectories are the batch the actor trained on, token for token (the
tokens the framework's client received are the ones trained); the policy called the calculator
through the framework and was shown its result; no trajectory was lost to the agent.

Heavy (about 1-3 minutes a framework on 2 CPU cores): CI checks the same agents at the rollout level
(``tests/workers/test_agent_frameworks.py``: each framework's rows equal the tool agent loop's, which the
trainer trains as every agent loop's rows)."""

from __future__ import annotations

import json
import math

import pytest

from rlfoundry.agents.react_calculator import TOOLS, calculator
from rlfoundry.utils.trajectories import read_trajectories
from tests.trainer import _e2e as E

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

HERE = "tests.trainer.test_agent_frameworks_e2e"
STEPS = 2


async def agents_sdk_agent(base_url, api_key, prompt, extra_info):
    """The OpenAI Agents SDK: the calculator as a function tool, the policy as a chat-completions model."""
    import openai
    from agents import Agent, FunctionTool, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    schema = TOOLS[0]["function"]

    async def calculate(context, arguments: str) -> str:
        return calculator(arguments)

    tool = FunctionTool(name=schema["name"], description=schema["description"], params_json_schema=schema["parameters"],
                        on_invoke_tool=calculate, strict_json_schema=False)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="calculator agent", tools=[tool], model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    try:
        return (await Runner.run(agent, input=prompt, max_turns=3)).final_output
    except MaxTurnsExceeded:  # no answer within the turns, as a user's agent would give up
        return None


def langchain_agent(base_url, api_key, prompt, extra_info):
    """LangChain's ChatOpenAI (streaming) with the calculator bound: a plain tool-calling loop."""
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, streaming=True)
    bound, messages = llm.bind_tools(TOOLS), list(prompt)
    for _ in range(2):
        reply = bound.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return reply.content
        for call in reply.tool_calls:
            messages.append(ToolMessage(calculator(json.dumps(call["args"])), tool_call_id=call["id"]))
    return None


@pytest.mark.parametrize("framework, agent", [("agents", "agents_sdk_agent"), ("langchain_openai", "langchain_agent")])
def test_a_framework_agent_trains_through_the_endpoint(tmp_path, framework, agent):
    pytest.importorskip(framework)
    run = E.train([f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.total_training_steps={STEPS}",
                   "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=file",
                   "reward_model.reward_kwargs.num_workers=0", f"trainer.rollout_data_dir={tmp_path / 'dump'}",
                   f"actor_rollout_ref.rollout.agent.openai.path={HERE}", f"actor_rollout_ref.rollout.agent.openai.name={agent}"],
                  config_name="calculator_openai_agent")
    assert len(run.batches) == STEPS
    called = 0
    for step, batch in enumerate(run.batches, start=1):
        record = run.step(step)
        assert math.isfinite(record["actor/pg_loss"]) and record["actor/grad_norm"] > 0
        assert not any(k.startswith("multi_turn/stop/agent_") and k != "multi_turn/stop/agent_done" and v > 0
                       for k, v in record.items()), record  # no trajectory lost to the agent
        trajectories = read_trajectories(tmp_path / "dump", step=step)
        E.assert_dump_is_the_batch(trajectories, batch)
        for t in trajectories:
            called += bool(t.tool_results)
            assert all(r["tool"] == "calculator" for r in t.tool_results)
            assert [r for r, _, _ in t.turns if r != "assistant"] == ["tool"] * len(t.tool_results)
    assert called > 0  # the policy called the calculator through the framework and was shown its answer
