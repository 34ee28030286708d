"""Agents written with real agent frameworks, trained through the OpenAI endpoint unchanged: the OpenAI
Agents SDK (``openai-agents``: an ``Agent`` with a function tool on ``OpenAIChatCompletionsModel``) and
LangChain (``langchain-openai``: ``ChatOpenAI(streaming=True).bind_tools``). On the scripted policy of
``test_agent_loop.py``, each framework's agent gets the tool agent loop's rows tensor for tensor, and the
token ids and log-probs its HTTP client received (recorded below the framework, on the HTTP client it
is given) are the row's sampled tokens and trained log-probs. At the rollout level: training these rows
is the trainer's path for every agent loop (``test_openai_agent_demo.py`` trains the endpoint through the
command line)."""

from __future__ import annotations

import json

import pytest

from tests.workers.test_agent_loop import CALL, ScriptedPolicy, _prompts
from tests.workers.test_openai_agent import TOOL_SCHEMAS, _agent_loop
from tests.workers.test_openai_endpoint_api import FINAL, QUESTION, _assert_same_rows, _sampled, _tool_agent_rows

openai = pytest.importorskip("openai")

HERE = "tests.workers.test_agent_frameworks"
RECEIVED: dict[str, list] = {}
TOKENS_AS_IDS = {"logprobs": True, "return_tokens_as_token_ids": True}  # what each client asks for on top


def _record(name: str, body: bytes) -> None:
    """The (token id, log-prob) pairs of a reply as received: a JSON completion or a stream's events."""
    replies = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")] \
        if body.startswith(b"data:") else [json.loads(body)]
    for reply in replies:
        for choice in reply.get("choices", []):
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                RECEIVED[name].append((int(entry["token"].split(":", 1)[1]), entry["logprob"]))


def _recording_http_client(name: str, sync: bool):
    RECEIVED[name] = []
    if sync:
        return openai.DefaultHttpxClient(event_hooks={"response": [lambda r: _record(name, r.read())]})

    async def hook(response):
        _record(name, await response.aread())

    return openai.DefaultAsyncHttpxClient(event_hooks={"response": [hook]})


# ---- agents (loaded by the loop from this module) ----------------------------------------------


async def agents_sdk(base_url, api_key, prompt, extra_info):
    """An OpenAI Agents SDK agent: the calculator as a function tool, the policy as a chat-completions model."""
    from agents import Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no traces sent anywhere
    schema = TOOL_SCHEMAS[0]["function"]

    async def calculate(context, arguments: str) -> str:
        RECEIVED.setdefault("agents_sdk_calls", []).append(json.loads(arguments))
        return "56088"

    calculator = FunctionTool(name=schema["name"], description=schema["description"],
                              params_json_schema=schema["parameters"], on_invoke_tool=calculate, strict_json_schema=False)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=_recording_http_client("agents_sdk", sync=False))
    agent = Agent(name="calculator agent", tools=[calculator],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(extra_body=TOKENS_AS_IDS))
    result = await Runner.run(agent, input=prompt, max_turns=3)
    return result.final_output


def langchain_agent(base_url, api_key, prompt, extra_info):
    """LangChain's ChatOpenAI, streaming, with the calculator bound as a tool; a plain tool-calling loop."""
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, streaming=True,
                     stream_usage=True, extra_body=TOKENS_AS_IDS,
                     http_client=_recording_http_client("langchain", sync=True))
    bound, messages = llm.bind_tools(TOOL_SCHEMAS), list(prompt)
    for _ in range(3):
        reply = bound.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return reply.content
        for call in reply.tool_calls:
            RECEIVED.setdefault("langchain_calls", []).append(call["args"])
            messages.append(ToolMessage("56088", tool_call_id=call["id"]))
    return None


# ---- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework, agent", [("agents", "agents_sdk"), ("langchain_openai", "langchain_agent")])
def test_a_framework_agent_trains_the_tokens_it_received(tokenizer, framework, agent):
    pytest.importorskip(framework)
    script = {QUESTION: [CALL, FINAL]}
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [QUESTION])
    out = _agent_loop(ScriptedPolicy(tokenizer, script), tokenizer, agent, path=HERE).generate_sequences(prompts)
    _assert_same_rows(out, _tool_agent_rows(tokenizer, script, prompts))
    extras = out.non_tensor_batch
    assert extras["extra_info"][0] == {"answer": FINAL} and extras["stop_reason"][0] == "agent_done"
    assert not extras["sanity_check_failed"][0]
    name = "agents_sdk" if agent == "agents_sdk" else "langchain"
    assert RECEIVED[f"{name}_calls"] == [{"expression": "123*456"}]  # the framework parsed the call and ran it
    ids, log_probs = _sampled(tokenizer, out, 0)
    assert [i for i, _ in RECEIVED[name]] == ids
    assert [v for _, v in RECEIVED[name]] == pytest.approx(log_probs, abs=1e-7)


@pytest.fixture(scope="module")
def tokenizer():
    from rlfoundry.models.tiny import build_tokenizer

    return build_tokenizer()

