"""``openai_agent``: agents that speak the OpenAI chat API, trained through a local endpoint.

The scripted policy of ``test_agent_loop.py`` (each conversation's k-th turn a fixed text, log-probs
known) makes every token and mask derivable by hand; the packaged calculator policy on the HF engine
checks that a ReAct agent written with the official client gets the tool agent loop's trajectories,
token for token."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfoundry.config.schema import AgentConfig, MultiTurnConfig, OpenAIAgentConfig
from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.tools.registry import initialize_tools_from_config
from rlfoundry.trainer.metric_utils import multi_turn_metrics
from rlfoundry.workers.rollout.agent_loop import AgentLoop
from rlfoundry.workers.rollout.agent_loop.openai_server import OpenAIEndpoint, parse_chat_request
from tests.workers.test_agent_loop import CALL, TOOLS, ScriptedPolicy, _prompts

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
HERE = "tests.workers.test_openai_agent"  # the agent functions below, by dotted module
TOOL_SCHEMAS = [t.get_openai_tool_schema().model_dump() for t in initialize_tools_from_config(TOOLS)]
SEEN: dict[str, list] = {}  # what the agents below saw, by question


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _agent_loop(engine, tokenizer, name: str, response_length: int = 256, max_segments: int = 1,
                timeout_s: float = 30.0, path: str = HERE, **multi_turn) -> AgentLoop:
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}
    agent = AgentConfig(default_agent_loop="openai_agent", max_wait_s=30.0, openai=OpenAIAgentConfig(
        path=path, name=name, timeout_s=timeout_s, max_segments=max_segments))
    return AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True, **multi_turn), tools, response_length,
                     chat_template_kwargs={"tools": TOOL_SCHEMAS}, agent=agent)


def _client(base_url: str, api_key: str):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def _row_text(tokenizer, out: DataProto, r: int) -> tuple[list[int], list[int], list[int]]:
    """Row r's real prompt ids, response ids and response mask."""
    width = out.batch["prompts"].shape[1]
    prompt = out.batch["prompts"][r][out.batch["attention_mask"][r, :width].bool()].tolist()
    real = out.batch["attention_mask"][r, width:].bool()
    return prompt, out.batch["responses"][r][real].tolist(), out.batch["response_mask"][r][real].tolist()


# ---- agents (loaded by the loop from this module) ----------------------------------------------


def react_scripted(base_url, api_key, prompt, extra_info):
    """Calls the calculator once, then answers (the ReAct demo's shape, on the scripted policy)."""
    from rlfoundry.agents.react_calculator import run_agent

    return run_agent(base_url, api_key, prompt, extra_info)


def summarising(base_url, api_key, prompt, extra_info):
    """Rewrites its history after the tool call: the second request starts a new conversation."""
    client = _client(base_url, api_key)
    first = client.chat.completions.create(model="policy", messages=prompt, tools=TOOL_SCHEMAS).choices[0].message
    call = first.tool_calls[0]
    summary = [{"role": "user", "content": f"Summary: {call.function.arguments} gave 56088. Answer."}]
    return client.chat.completions.create(model="policy", messages=summary).choices[0].message.content


async def async_answer(base_url, api_key, prompt, extra_info):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model="policy", messages=prompt, stop=["answer"])
    SEEN[prompt[0]["content"]] = [reply]
    return {"answer": reply.choices[0].message.content, "agent_note": extra_info["index"]}


def raising(base_url, api_key, prompt, extra_info):
    _client(base_url, api_key).chat.completions.create(model="policy", messages=prompt)
    raise RuntimeError("the agent broke")


def hanging(base_url, api_key, prompt, extra_info):
    SEEN["hanging"] = [base_url, api_key]
    time.sleep(3)
    try:
        _client(base_url, api_key).chat.completions.create(model="policy", messages=prompt)
    except openai.PermissionDeniedError as e:
        SEEN["hanging"].append(e.status_code)


def silent(base_url, api_key, prompt, extra_info):
    return "42"


def long_winded(base_url, api_key, prompt, extra_info):
    """Keeps feeding long tool replies until the endpoint says the context is full, then stops."""
    client, messages = _client(base_url, api_key), list(prompt)
    while True:
        try:
            choice = client.chat.completions.create(model="policy", messages=messages, tools=TOOL_SCHEMAS).choices[0]
        except openai.BadRequestError as e:
            SEEN["long_winded"] = [e.code]
            return None
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "7 " * 40})


# ---- token in, token out ------------------------------------------------------------------------


def test_a_conversation_that_outgrows_its_budget_is_refused_and_the_row_stays_within_it(tokenizer):
    """The refused request's tool reply is not kept: the row holds what fitted, the sample is not lost."""
    question = "What is 123*456?"
    loop = _agent_loop(ScriptedPolicy(tokenizer, {question: [CALL] * 20}), tokenizer, "long_winded", response_length=96)
    out = loop.generate_sequences(_prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [question]))
    assert SEEN["long_winded"] == ["context_length_exceeded"]
    assert out.non_tensor_batch["stop_reason"][0] == "agent_done"
    assert 0 < int(out.batch["attention_mask"][0, out.batch["prompts"].shape[1]:].sum()) <= 96


def test_a_react_agent_gets_the_tool_agents_tokens_masks_and_log_probs(tokenizer):
    """The demo agent (official client, its own calculator) through the endpoint, against the tool agent
    loop on the same scripted policy: the same rows, tensor for tensor; the reply's text reaches the
    reward as the final turn, the agent's answer lands in extra_info."""
    question, final = "What is 123*456?", "The answer is 56088."
    script = {question: [CALL, final]}
    tool = AgentLoop(ScriptedPolicy(tokenizer, script), tokenizer, MultiTurnConfig(enable=True, max_assistant_turns=2),
                     {t.name: t for t in initialize_tools_from_config(TOOLS)}, 256,
                     chat_template_kwargs={"tools": TOOL_SCHEMAS})
    ours = _agent_loop(ScriptedPolicy(tokenizer, script), tokenizer, "react_scripted")
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [question])
    expected, got = tool.generate_sequences(prompts), ours.generate_sequences(prompts)
    for key in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "rollout_log_probs"):
        torch.testing.assert_close(got.batch[key], expected.batch[key], rtol=0, atol=0)
    extras = got.non_tensor_batch
    assert extras["stop_reason"][0] == "agent_done" and not extras["sanity_check_failed"][0]
    assert extras["last_turn_start"][0] == expected.non_tensor_batch["last_turn_start"][0]
    assert extras["extra_info"][0] == {"answer": final}
    assert extras["num_turns"][0] == expected.non_tensor_batch["num_turns"][0] == 3


def test_a_history_rewriting_agent_gets_one_segment_per_conversation(tokenizer):
    """Request 1: the data set's chat → the call (segment A, prompt = the data set's prompt, its turn all
    sampled). Request 2: a summary, not an extension → segment B: its whole chat rendered afresh (mask 0,
    prompt part padding), then the sampled answer (mask 1). Each row is scored on its own last turn."""
    from rlfoundry.rewards.reward_manager import decode_samples

    question, final = "What is 123*456?", "56088"
    summary = 'Summary: {"expression": "123*456"} gave 56088. Answer.'
    policy = ScriptedPolicy(tokenizer, {question: [CALL], summary: [final]})
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [question])
    prompts.non_tensor_batch.update(data_source=np.array(["demo"], dtype=object), uid=np.array(["u0"], dtype=object),
                                    reward_model=np.array([{"ground_truth": final}], dtype=object))
    out = _agent_loop(policy, tokenizer, "summarising", max_segments=3).generate_sequences(prompts)
    assert len(out) == 3
    eos = "<|im_end|>"
    prompt_a, resp_a, mask_a = _row_text(tokenizer, out, 0)
    assert prompt_a == prompts.batch["input_ids"][0][prompts.batch["attention_mask"][0].bool()].tolist()
    assert resp_a == tokenizer.encode(CALL + eos, add_special_tokens=False) and mask_a == [1] * len(resp_a)
    prompt_b, resp_b, mask_b = _row_text(tokenizer, out, 1)
    context = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": summary}], tokenize=False,
                                                             add_generation_prompt=True), add_special_tokens=False)
    sampled = tokenizer.encode(final + eos, add_special_tokens=False)
    assert prompt_b == [] and resp_b == context + sampled
    assert mask_b == [0] * len(context) + [1] * len(sampled)
    lp = out.batch["rollout_log_probs"][1][:len(resp_b)].tolist()
    assert lp == pytest.approx([0.0] * len(context) + [-(j + 1) / 100 for j in range(len(sampled))])
    assert _row_text(tokenizer, out, 2)[1:] == ([], [])  # padding: no tokens, no loss
    extras = out.non_tensor_batch
    assert list(extras["uid"][:2]) == ["u0", "u0"] and extras["uid"][2] == "u0/excluded/2"
    assert list(extras["stop_reason"]) == ["agent_done", "agent_done", "segment_padding"]
    assert not any(extras["sanity_check_failed"][:2])
    # segment B re-renders the history, and the engine sampled after that rendering: no row is re-tokenised
    assert list(extras["retokenised_from"]) == [-1, -1, -1]
    # turn boundaries in each row's response: A's sampled call; B's rendered context, then its sampled answer
    assert extras["turns"][0] == [["assistant", 0, len(resp_a)]]
    assert extras["turns"][1] == [["context", 0, len(context)], ["assistant", len(context), len(resp_b)]]
    assert list(extras["excluded"]) == [False, False, True] and len(set(extras["trajectory_id"])) == 1
    metrics = multi_turn_metrics(extras)  # one trajectory of two conversations; the padding row has no turns
    assert (metrics["num_turns/mean"], metrics["num_turns/min"]) == (1.0, 1.0)
    assert metrics["multi_turn/stop/agent_done"] == 1.0 and "multi_turn/stop/segment_padding" not in metrics
    assert metrics["multi_turn/segments_dropped"] == 0 and metrics["multi_turn/lost_samples"] == 0
    texts = [s.solution_str for s in decode_samples(out, tokenizer, "data_source")]
    assert texts == [CALL, final, ""]

    one = _agent_loop(ScriptedPolicy(tokenizer, {question: [CALL], summary: [final]}), tokenizer, "summarising")
    kept = one.generate_sequences(prompts)  # one row per trajectory: the latest segment, the other counted
    assert len(kept) == 1 and _row_text(tokenizer, kept, 0)[1] == resp_b
    assert kept.non_tensor_batch["segments_dropped"][0] == 1
    assert multi_turn_metrics(kept.non_tensor_batch)["multi_turn/segments_dropped"] == 1


def test_stop_strings_async_agents_and_reward_inputs(tokenizer):
    """An async agent with a stop string: the ids are cut after the token that completes it, the reply's
    text before it; the returned dict reaches the reward function's extra_info."""
    question = "Say it."
    policy = ScriptedPolicy(tokenizer, {question: ["the answer is 7"]})
    prompts = _prompts(tokenizer, {}, [question])  # the agent offers no tools
    prompts.non_tensor_batch["extra_info"] = np.array([{"index": 3}], dtype=object)
    out = _agent_loop(policy, tokenizer, "async_answer").generate_sequences(prompts)
    reply = SEEN[question][0]
    assert reply.choices[0].message.content == "the " and reply.choices[0].finish_reason == "stop"
    _, resp, mask = _row_text(tokenizer, out, 0)
    assert tokenizer.decode(resp) == "the answer" and mask == [1] * len(resp)
    assert out.non_tensor_batch["retokenised_from"][0] == -1  # a prefix of what was sampled is as sampled
    assert out.non_tensor_batch["extra_info"][0] == {"index": 3, "answer": "the ", "agent_note": 3}
    assert reply.usage.completion_tokens == len(resp)


@pytest.mark.parametrize("name, reason", [("raising", "agent_raised"), ("hanging", "agent_timeout"),
                                          ("silent", "agent_no_requests")])
def test_an_agent_that_fails_loses_its_sample_and_is_counted(tokenizer, name, reason):
    question = "What is 123*456?"
    policy = ScriptedPolicy(tokenizer, {question: [CALL]})
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [question, question])
    prompts.non_tensor_batch["uid"] = np.array(["a", "b"], dtype=object)
    out = _agent_loop(policy, tokenizer, name, timeout_s=1.0).generate_sequences(prompts)
    assert out.batch["response_mask"].sum() == 0 and out.batch["attention_mask"][:, 160:].sum() == 0
    assert list(out.non_tensor_batch["uid"]) == ["a/excluded/0", "b/excluded/1"]
    metrics = multi_turn_metrics(out.non_tensor_batch)
    assert metrics[f"multi_turn/stop/{reason}"] == 1.0 and metrics["multi_turn/lost_samples"] == 2
    assert "num_turns/mean" not in metrics  # no real row: no turns to average (they counted as 0 before)
    if name == "hanging":  # the hung agent's late request is refused, not served
        deadline = time.monotonic() + 10
        while len(SEEN["hanging"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert SEEN["hanging"][2] == 403


# ---- the endpoint ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _echo_endpoint():
    """An endpoint and an event loop for its sessions (one per module: shutting a server down waits for
    its poll interval)."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = OpenAIEndpoint()
    yield server, loop
    server.shutdown()
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture()
def served(_echo_endpoint):
    """A session whose handler echoes the parsed request."""
    server, loop = _echo_endpoint

    async def echo(request):
        return {"id": "x", "object": "chat.completion", "created": 0, "model": request.model, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": json.dumps(request.messages)},
             "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    sid, base_url = server.open(echo, loop, 30.0)
    yield server, sid, base_url
    server.close(sid)


def _post(url: str, body: bytes, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body, param", [
    (b"{not json", "body"), (b"[]", "body"), (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0]"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}', "stop"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', "tools"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}', "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": 1.5}', "seed"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', "tool_choice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", '
     b'"function": {"name": "calculator"}}}', "tool_choice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}', "tool_choice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}', "response_format"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
     b'"json_schema": {"name": "a", "schema": {}}}}', "response_format"),
])
def test_a_malformed_request_gets_an_openai_error_not_a_crash(served, body, param):
    server, _, base_url = served
    status, reply = _post(f"{base_url}/chat/completions", body, server.api_key)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param
    assert reply["error"]["message"]
    status, _ = _post(f"{base_url}/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}',
                      server.api_key)
    assert status == 200  # the endpoint still serves


def test_the_secret_is_required_and_a_closed_session_refuses(served):
    server, sid, base_url = served
    ok = b'{"messages": [{"role": "user", "content": "hi"}], "model": "policy"}'
    assert _post(f"{base_url}/chat/completions", ok, None)[0] == 401
    status, reply = _post(f"{base_url}/chat/completions", ok, server.api_key + "x")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(base_url, "wrong").models.list()
    client = _client(base_url, server.api_key)
    assert [m.id for m in client.models.list()] == ["policy", "rlfoundry-policy"]
    assert client.models.retrieve("rlfoundry-policy").id == "rlfoundry-policy"
    with pytest.raises(openai.NotFoundError, match="serves"):
        client.models.retrieve("gpt-4o")
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert json.loads(reply.choices[0].message.content) == [{"role": "user", "content": "hi"}]
    assert _post(base_url.replace(sid, "nope") + "/chat/completions", ok, server.api_key)[0] == 403
    assert _post(base_url.rsplit("/s/", 1)[0] + "/v1/chat/completions", ok, server.api_key)[0] == 404
    server.close(sid)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert server.host == "127.0.0.1"  # loopback by default


def test_requests_after_the_deadline_are_refused(served):
    import asyncio

    server, _, _ = served
    loop = asyncio.new_event_loop()
    sid, base_url = server.open(lambda request: None, loop, 0.0)
    status, reply = _post(f"{base_url}/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}',
                          server.api_key)
    assert status == 403 and reply["error"]["code"] == "deadline_exceeded"
    loop.close()


def test_tool_calls_are_parsed_and_content_parts_flattened():
    request = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}],
                                  "stop": "x", "max_completion_tokens": 5})
    assert request.messages[0]["content"] == "ab" and request.stop == ["x"] and request.max_tokens == 5


# ---- the real HF engine ----------------------------------------------------------------------------


def react(base_url, api_key, prompt, extra_info):
    from rlfoundry.agents.react_calculator import run_agent

    return run_agent(base_url, api_key, prompt, extra_info)


def test_the_react_demo_agent_equals_the_tool_agent_on_the_seeded_calculator_policy():
    """The packaged calculator policy sampling at temperature 1 on the HF engine, seeded: 64 trajectories
    of the ReAct demo agent through the endpoint are the tool agent loop's, token for token, mask for
    mask, log-prob for log-prob (the same engine calls, composed the same way)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.data.preprocess.arithmetic import ArithmeticSpec, generate_problems
    from rlfoundry.workers.rollout.hf_rollout import HFRollout

    path = REPO / "rlfoundry" / "assets" / "calculator-policy"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    problems = generate_problems(16, seed=5, spec=ArithmeticSpec(digits=2, ops="*"))

    def engine():
        cfg = {"n": 4, "temperature": 1.0, "do_sample": True, "response_length": 160, "seed": 11}
        return HFRollout(model, cfg, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    tool = AgentLoop(engine(), tok, MultiTurnConfig(enable=True, max_assistant_turns=2),
                     {t.name: t for t in initialize_tools_from_config(TOOLS)}, 160,
                     chat_template_kwargs={"tools": TOOL_SCHEMAS}, agent=AgentConfig(max_wait_s=30.0))
    ours = _agent_loop(engine(), tok, "react", response_length=160, max_assistant_turns=2)
    prompts = _prompts(tok, {"tools": TOOL_SCHEMAS}, [p for p, _ in problems])
    prompts.meta_info = {}
    expected, got = tool.generate_sequences(prompts), ours.generate_sequences(prompts)
    assert ours.last_engine_calls == tool.last_engine_calls
    for key in ("input_ids", "attention_mask", "responses", "response_mask", "rollout_log_probs"):
        torch.testing.assert_close(got.batch[key], expected.batch[key], rtol=0, atol=0)
    calls = np.asarray(expected.non_tensor_batch["tool_calls"], dtype=float)
    print(f"tool calls in {int((calls > 0).sum())} of {len(calls)} trajectories; engine calls {tool.last_engine_calls}")
    assert (calls > 0).sum() >= 2  # the comparison covers tool turns, not only direct answers
    assert list(got.non_tensor_batch["num_turns"]) == list(expected.non_tensor_batch["num_turns"])
    assert list(got.non_tensor_batch["last_turn_start"]) == list(expected.non_tensor_batch["last_turn_start"])
    assert not any(got.non_tensor_batch["sanity_check_failed"])


def two_choices(base_url, api_key, prompt, extra_info):
    reply = _client(base_url, api_key).chat.completions.create(model="policy", messages=prompt, n=2)
    return [c.index for c in reply.choices] and reply.choices[1].message.content


def test_n_choices_are_one_segment_each(tokenizer):
    question = "Pick."
    policy = ScriptedPolicy(tokenizer, {question: ["a"]})
    prompts = _prompts(tokenizer, {}, [question])
    out = _agent_loop(policy, tokenizer, "two_choices", max_segments=2).generate_sequences(prompts)
    sampled = tokenizer.encode("a<|im_end|>", add_special_tokens=False)
    assert [_row_text(tokenizer, out, r)[1:] for r in range(2)] == [(sampled, [1] * len(sampled))] * 2
    assert list(out.non_tensor_batch["stop_reason"]) == ["agent_done", "agent_done"]


def test_a_wildcard_bind_gives_agents_an_address_they_can_reach():
    """``rollout.agent.openai.host=0.0.0.0`` (an agent on another machine): base_url names this node's
    address, never the wildcard, and the endpoint answers there; ``advertise_host`` overrides the name."""
    import asyncio
    import ipaddress

    from rlfoundry.workers.rollout.agent_loop.openai_agent import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1" and advertised_host("0.0.0.0", "gpu-7") == "gpu-7"
    server = OpenAIEndpoint("0.0.0.0", 0, advertised_host("0.0.0.0"))  # as endpoint() starts it
    loop = asyncio.new_event_loop()
    try:
        sid, base_url = server.open(lambda request: None, loop, 30.0)
        host = base_url.split("//", 1)[1].split(":", 1)[0]
        assert not ipaddress.ip_address(host).is_unspecified
        assert [m.id for m in _client(base_url, server.api_key).models.list()] == ["policy", "rlfoundry-policy"]
        server.close(sid)
    finally:
        server.shutdown()
        loop.close()


def test_the_endpoint_returns_calls_in_the_configured_format_typed_by_the_requests_tools():
    from types import SimpleNamespace

    from rlfoundry.workers.rollout.agent_loop.openai_agent import _Recorder

    def recorder(fmt):
        return SimpleNamespace(loop=SimpleNamespace(config=MultiTurnConfig(format=fmt)))

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"},
                                         "odd": ["not", "a", "schema"]}}}}]
    xml = ("Let me compute.\n<tool_call>\n<function=calculator>\n<parameter=expression>\n2*3\n</parameter>\n"
           "<parameter=digits>\n4\n</parameter>\n<parameter=odd>\n5\n</parameter>\n</function>\n</tool_call>")
    message, finish = _Recorder._message(recorder("qwen3_coder"), xml, tools)
    assert finish == "tool_calls" and message["content"] == "Let me compute."
    [call] = message["tool_calls"]
    # digits typed by the request's schema; a malformed property gives no type, so its value stays text
    assert json.loads(call["function"]["arguments"]) == {"expression": "2*3", "digits": 4, "odd": "5"}
    # the same text under hermes holds no hermes call: it comes back as content, as vLLM's parser answers
    assert _Recorder._message(recorder("hermes"), xml, tools) == ({"role": "assistant", "content": xml}, "stop")


def test_the_endpoint_refuses_a_format_written_in_special_tokens():
    import asyncio

    from rlfoundry.workers.rollout.agent_loop.base import AgentLoopError
    from rlfoundry.workers.rollout.agent_loop.openai_agent import OpenAIAgentLoop

    loop = OpenAIAgentLoop(server=None, tokenizer=None, config=MultiTurnConfig(format="gpt-oss"), tools={},
                           interactions={}, response_length=8, chat_template_kwargs={}, key=0)
    with pytest.raises(AgentLoopError, match="format=gpt-oss writes its calls in special tokens"):
        asyncio.run(loop.run({}, prompt_ids=[1]))
