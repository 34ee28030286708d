"""The OpenAI endpoint's wider surface, as clients and agent frameworks use it: streaming, log-probs,
seeds, tool_choice, text completions, model names; and the tokens a client received are the tokens
trained (the scripted policy of ``test_agent_loop.py`` makes every token derivable by hand)."""

from __future__ import annotations

import json

import pytest
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.config.schema import MultiTurnConfig
from rlfoundry.tools.registry import initialize_tools_from_config
from rlfoundry.workers.rollout.agent_loop import AgentLoop
from tests.workers.test_agent_loop import CALL, TOOLS, ScriptedPolicy, _prompts
from tests.workers.test_openai_agent import TOOL_SCHEMAS, _agent_loop, _row_text

openai = pytest.importorskip("openai")

HERE = "tests.workers.test_openai_endpoint_api"
SEEN: dict[str, list] = {}
QUESTION, FINAL = "What is 123*456?", "The answer is 56088."


@pytest.fixture(scope="module")
def tokenizer():
    from rlfoundry.models.tiny import build_tokenizer

    return build_tokenizer()


def _client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def _ids(entries) -> list[int]:
    """Token ids from log-prob entries named ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""
    return [int(e.token.split(":", 1)[1]) if hasattr(e, "token") else int(e.split(":", 1)[1]) for e in entries]


def _sampled(tokenizer, out, r: int) -> tuple[list[int], list[float]]:
    """Row r's tokens the policy sampled (mask 1) and their trained log-probs."""
    _, resp, mask = _row_text(tokenizer, out, r)
    lp = out.batch["rollout_log_probs"][r][:len(resp)].tolist()
    return [t for t, m in zip(resp, mask) if m], [v for v, m in zip(lp, mask) if m]


def _tool_agent_rows(tokenizer, script, prompts):
    loop = AgentLoop(ScriptedPolicy(tokenizer, script), tokenizer, MultiTurnConfig(enable=True, max_assistant_turns=2),
                     {t.name: t for t in initialize_tools_from_config(TOOLS)}, 256,
                     chat_template_kwargs={"tools": TOOL_SCHEMAS})
    return loop.generate_sequences(prompts)


def _assert_same_rows(got, expected):
    for key in ("input_ids", "attention_mask", "responses", "response_mask", "rollout_log_probs"):
        torch.testing.assert_close(got.batch[key], expected.batch[key], rtol=0, atol=0)


# ---- agents (loaded by the loop from this module) ----------------------------------------------


def streaming_react(base_url, api_key, prompt, extra_info):
    """The ReAct shape with stream=true: content and tool calls accumulated from the chunks, as frameworks do;
    the token ids and log-probs it received recorded."""
    client, messages, received = _client(base_url, api_key), list(prompt), []
    for _ in range(2):
        content, calls, finish, usage = "", {}, None, None
        stream = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOL_SCHEMAS, stream=True, logprobs=True,
            stream_options={"include_usage": True}, extra_body={"return_tokens_as_token_ids": True})
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += call.id or ""
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
                if choice.logprobs and choice.logprobs.content:
                    received += [(i, e.logprob) for i, e in zip(_ids(choice.logprobs.content), choice.logprobs.content)]
                finish = choice.finish_reason or finish
        SEEN.setdefault("streaming_react", []).append((content, dict(calls), finish, usage.completion_tokens))
        if not calls:
            SEEN["streaming_react_tokens"] = received
            return content
        messages.append({"role": "assistant", "content": content or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()]})
        for c in calls.values():  # the calculator, as the tool agent loop's tool answers
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "56088"})
    return None


def text_react(base_url, api_key, prompt, extra_info):
    """A text-completion agent: renders its own prompt with the chat template, continues it with the tool's
    answer rendered the same way; the second request streams."""
    from rlfoundry.models.tiny import build_tokenizer

    tok, client = build_tokenizer(), _client(base_url, api_key)
    text = tok.apply_chat_template(prompt, tools=TOOL_SCHEMAS, add_generation_prompt=True, tokenize=False)
    first = client.completions.create(model="rlfoundry-policy", prompt=text, max_tokens=100, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True})
    chat = [*prompt, {"role": "assistant", "content": first.choices[0].text}, {"role": "tool", "content": "56088"}]
    follow = tok.apply_chat_template(chat, tools=TOOL_SCHEMAS, add_generation_prompt=True, tokenize=False)
    pieces, received = [], _ids(first.choices[0].logprobs.tokens)
    for chunk in client.completions.create(model="policy", prompt=follow, max_tokens=100, logprobs=0, stream=True,
                                           extra_body={"return_tokens_as_token_ids": True}):
        pieces.append(chunk.choices[0].text)
        received += _ids(chunk.choices[0].logprobs.tokens) if chunk.choices[0].logprobs else []
    SEEN["text_react"] = [first.choices[0], "".join(pieces), received,
                          [v for v in first.choices[0].logprobs.token_logprobs]]
    return "".join(pieces)


def refused(base_url, api_key, prompt, extra_info):
    """Parameters the scripted engine cannot honour are refused naming them; tool_choice none is honoured."""
    client, errors = _client(base_url, api_key), []
    for kwargs in ({"seed": 3}, {"logprobs": True, "top_logprobs": 2}):
        try:
            client.chat.completions.create(model="policy", messages=prompt, **kwargs)
        except openai.BadRequestError as e:
            errors.append((e.status_code, e.body["param"]))
    try:
        client.chat.completions.create(model="gpt-4o", messages=prompt)
    except openai.NotFoundError as e:
        errors.append((e.status_code, e.body["param"], e.body["message"]))
    for kwargs in ({"echo": True}, {"suffix": "x"}, {"best_of": 3}):
        try:
            client.completions.create(model="policy", prompt="hi", **kwargs)
        except openai.BadRequestError as e:
            errors.append((e.status_code, e.body["param"]))
    reply = client.chat.completions.create(model="policy", messages=prompt, tools=TOOL_SCHEMAS, tool_choice="none")
    SEEN["refused"] = [errors, reply.choices[0]]
    return reply.choices[0].message.content


# ---- tests -----------------------------------------------------------------------------------------


def test_a_streaming_agent_trains_the_tokens_it_was_streamed(tokenizer):
    """stream=true through the official client: chat.completion.chunk deltas that add up to the replies (a
    tool call accumulated from its delta), usage in a last chunk; the token ids and log-probs streamed are
    the row's sampled tokens and trained log-probs, and the rows equal the tool agent loop's."""
    script = {QUESTION: [CALL, FINAL]}
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [QUESTION])
    out = _agent_loop(ScriptedPolicy(tokenizer, script), tokenizer, "streaming_react", path=HERE).generate_sequences(prompts)
    _assert_same_rows(out, _tool_agent_rows(tokenizer, script, prompts))
    (content1, calls, finish1, used1), (content2, none, finish2, used2) = SEEN["streaming_react"]
    assert content1 == "" and finish1 == "tool_calls" and none == {} and finish2 == "stop"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("calculator", {"expression": "123*456"})]
    assert content2 == FINAL
    ids, log_probs = _sampled(tokenizer, out, 0)
    assert [i for i, _ in SEEN["streaming_react_tokens"]] == ids
    assert [v for _, v in SEEN["streaming_react_tokens"]] == pytest.approx(log_probs, abs=1e-7)
    assert used1 + used2 == len(ids) == len(tokenizer.encode(CALL + FINAL, add_special_tokens=False)) + 2


def test_a_text_completion_agent_trains_what_the_chat_loop_trains(tokenizer):
    """/v1/completions: a prompt that continues the last one (its text, the sampled tokens' text, then more)
    reuses the sampled ids and tokenises only what was added, so a text agent that renders the chat
    itself gets the tool agent loop's rows; token ids and log-probs received are those trained; the second
    request streamed (text_completion chunks) adds up to its text."""
    script = {QUESTION: [CALL, FINAL]}
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [QUESTION])
    out = _agent_loop(ScriptedPolicy(tokenizer, script), tokenizer, "text_react", path=HERE).generate_sequences(prompts)
    _assert_same_rows(out, _tool_agent_rows(tokenizer, script, prompts))
    first, streamed, received, first_lps = SEEN["text_react"]
    assert first.text == CALL and first.finish_reason == "stop" and streamed == FINAL
    ids, log_probs = _sampled(tokenizer, out, 0)
    assert received == ids and first_lps == pytest.approx(log_probs[:len(first_lps)], abs=1e-7)
    assert out.non_tensor_batch["num_turns"][0] == 3


def test_what_an_engine_cannot_honour_is_refused_naming_the_parameter(tokenizer):
    """The scripted engine keys no draws and gives no alternatives: seed and top_logprobs are 400s naming
    them; an unknown model is a 404 listing the served names; echo/suffix/best_of are 400s; tool_choice
    none returns the policy's call as text."""
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [QUESTION])
    out = _agent_loop(ScriptedPolicy(tokenizer, {QUESTION: [CALL]}), tokenizer, "refused", path=HERE).generate_sequences(prompts)
    errors, choice = SEEN["refused"]
    assert [e[:2] for e in errors] == [(400, "seed"), (400, "top_logprobs"), (404, "model"), (400, "echo"),
                                       (400, "suffix"), (400, "best_of")]
    assert "'policy', 'rlfoundry-policy'" in errors[2][2]
    assert choice.message.content == CALL and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert out.non_tensor_batch["stop_reason"][0] == "agent_done"


# ---- the HF engine: seeds and alternatives -----------------------------------------------------------


def _calculator_policy(response_length: int):
    """The packaged calculator policy and an HF engine sampling it at temperature 2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.workers.rollout.hf_rollout import HFRollout
    from tests.workers.test_openai_agent import REPO

    path = REPO / "rlfoundry" / "assets" / "calculator-policy"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = {"n": 1, "temperature": 2.0, "do_sample": True, "response_length": response_length, "seed": 3}
    return tok, model, HFRollout(model, config, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def test_the_hf_engines_top_logprobs_are_the_distribution_its_log_probs_come_from():
    """meta_info top_logprobs=4: each step's 4 most likely tokens (distinct) and log-probs equal a teacher-forced
    forward's log softmax(logits / T) at that position (1e-4), the sampled token's rollout log-prob is
    that distribution's value for it, and asking for them changes no sampled token."""
    tok, model, engine = _calculator_policy(12)
    prompts = _prompts(tok, {"tools": TOOL_SCHEMAS}, ["What is 37*59?", "What is 12*34?"])
    plain = engine.generate_sequences(prompts)
    engine.calls = 0  # the same draws again
    out = engine.generate_sequences(DataProto(prompts.batch, prompts.non_tensor_batch, {"top_logprobs": 4}))
    torch.testing.assert_close(out.batch["responses"], plain.batch["responses"], rtol=0, atol=0)
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits.float() / 2.0
    width = prompts.batch["input_ids"].shape[1]
    reference = torch.log_softmax(logits[:, width - 1:-1], dim=-1)  # position t predicts response token t
    mask = out.batch["response_mask"].bool()
    values = reference.topk(4, dim=-1).values  # the top 4 by value, and the engine's ids hold those values (tie-proof)
    torch.testing.assert_close(out.batch["rollout_top_logprobs"][mask], values[mask], rtol=0, atol=1e-4)
    at_ids = reference.gather(-1, out.batch["rollout_top_ids"])
    torch.testing.assert_close(at_ids[mask], values[mask], rtol=0, atol=1e-4)
    assert all(len(set(row)) == 4 for row in out.batch["rollout_top_ids"][mask].tolist())
    sampled = reference.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], sampled[mask], rtol=0, atol=1e-4)
    assert int(mask.sum(-1).min()) >= 3  # both rows sampled several tokens (their answer and its end)


def seeded(base_url, api_key, prompt, extra_info):
    client, replies = _client(base_url, api_key), []
    for seed in (7, 7, 8, 9, 10):
        replies.append(client.chat.completions.create(model="policy", messages=prompt, seed=seed, logprobs=True,
                                                      top_logprobs=3, max_tokens=24,
                                                      extra_body={"return_tokens_as_token_ids": True}))
    SEEN["seeded"] = replies
    return replies[-1].choices[0].message.content


def test_seed_and_top_logprobs_on_the_hf_engine():
    """The packaged calculator policy at temperature 2 on the HF engine: the same seed and context give the
    same tokens (the two requests sit in different segments and engine calls), other seeds other tokens;
    each token's log-prob is the one trained, its top 3 alternatives sorted and, where they hold the sampled
    token, with the same value."""
    tok, model, engine = _calculator_policy(160)
    loop = _agent_loop(engine, tok, "seeded", response_length=160, max_segments=5, path=HERE)
    prompts = _prompts(tok, {"tools": TOOL_SCHEMAS}, ["What is 37*59?"])
    prompts.meta_info = {}
    out = loop.generate_sequences(prompts)
    replies = SEEN["seeded"]
    tokens = [_ids(r.choices[0].logprobs.content) for r in replies]
    assert tokens[0] == tokens[1] and len({tuple(t) for t in tokens}) >= 3
    trained = [_sampled(tok, out, r) for r in range(5)]
    for reply, ids in zip(replies, tokens):
        ids_lps = next(t for t in trained if t[0] == ids)  # its row, whichever order the rows are in
        entries = reply.choices[0].logprobs.content
        assert [e.logprob for e in entries] == pytest.approx(ids_lps[1], abs=1e-7)
        for e in entries:
            values = [a.logprob for a in e.top_logprobs]
            assert len(values) == 3 and values == sorted(values, reverse=True)
            assert e.logprob <= values[0] + 1e-5 and sum(torch.tensor(values).exp()) <= 1 + 1e-5
            assert all(a.logprob == e.logprob for a in e.top_logprobs if a.token == e.token)
