"""Partial rollout with multi-turn agent loops (``trainer/ppo/partial_rollout.py``: ``ChunkedEngine``): the real
``AgentLoop`` (tool_agent, its server, tools, a simulated user) over chunked engine calls, a weight sync at a
chosen boundary.

On the real HF engine and a tiny model (greedy): with the weights unchanged the chunked trajectories are the
one-call ones token for token; with a sync between two chunks of the first turn, or between the first and the
second turn, every sampled token before it keeps the old weights' log-prob and every one after it has the new
weights', each checked against a direct forward of that weight version. With a scripted policy and a real tool:
the tool runs once per call however the turn was chunked, the layout is the unchunked one, and each token's
log-prob is the version's that sampled it, by hand.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlfoundry.config.schema import MultiTurnConfig
from rlfoundry.interactions.base import BaseInteraction
from rlfoundry.models.tiny import build_tiny_model, build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rlfoundry.trainer.ppo.partial_rollout import ChunkedEngine, ChunkedGeneration
from rlfoundry.workers.rollout.agent_loop import ENGINE_ONLY, AgentLoop
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from tests.workers.test_agent_loop import _prompts

WIDTH = 100  # the trajectory's response budget
PROMPT = 40
QUESTIONS = ["What is 2+3?", "Name a colour.", "Hi"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class Again(BaseInteraction):
    """A simulated user who asks again until the assistant has answered three times."""

    async def generate_response(self, instance_id, messages, **kwargs):
        return sum(m["role"] == "assistant" for m in messages) >= 3, "again", 0.0, {}


# a turn ends at any of these (about 1 token in 11 of the 260): the tiny random model's greedy turns then end
# after 6 to 37 tokens, so the trajectories have several turns of different lengths within the budget
EOS = [2] + [i for i in range(3, 260) if i % 11 == 0]


def _hf(model) -> HFRollout:
    cfg = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": False, "response_length": WIDTH,
           "seed": 3, "val_kwargs": {}}
    return HFRollout(model, OmegaConf.create(cfg), pad_token_id=0, eos_token_id=EOS)


def _agents(tokenizer, engine, tools: dict | None = None) -> AgentLoop:
    return AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True, tokenization_sanity_check_mode="disable"),
                     tools or {}, WIDTH, interactions={"again": Again({})})


def _chunked(engine, chunk: int, boundary, eos=EOS) -> ChunkedEngine:
    chunked = ChunkedEngine(ChunkedGeneration(engine.generate_sequences, response_length=WIDTH, chunk_tokens=chunk,
                                              pad_id=0, eos_ids=eos), engine.config)
    chunked.boundary = boundary
    return chunked


def _sync_at(call: int, change) -> callable:
    """A boundary that is a weight sync at its ``call``-th call (1: before the first chunk): ``change()``
    there, version 1 from then on."""
    calls = []

    def boundary() -> int:
        calls.append(1)
        if len(calls) == call:
            change()
        return int(len(calls) >= call)

    return boundary


def _scored(model, out: DataProto) -> torch.Tensor:
    """log π(response token | everything before it) under ``model``, (B, WIDTH)."""
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits[:, -WIDTH - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, out.batch["responses"][..., None])[..., 0]


def _assistant_mask(turns) -> list[int]:
    mask = [0] * WIDTH
    for role, start, end in turns:
        mask[start:end] = [int(role == "assistant")] * (end - start)
    return mask


@pytest.mark.numerics
def test_chunked_turns_with_unchanged_weights_give_the_one_call_trajectories(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32)
    prompts = _prompts(tokenizer, {}, QUESTIONS, width=PROMPT)
    whole = _agents(tokenizer, _hf(model)).generate_sequences(prompts)
    engine = _chunked(_hf(model), chunk=4, boundary=lambda: 0)
    out = _agents(tokenizer, engine).generate_sequences(prompts)
    assert torch.equal(out.batch["responses"], whole.batch["responses"])
    assert torch.equal(out.batch["response_mask"], whole.batch["response_mask"])
    assert list(out.non_tensor_batch["turns"]) == list(whole.non_tensor_batch["turns"])
    assert min(len(t) for t in whole.non_tensor_batch["turns"]) >= 3  # several turns, a user turn between
    assert engine.chunked.engine_calls > 3 * 2  # the turns went in chunks (one call per turn without them)
    valid = whole.batch["response_mask"].bool()
    # chunked decode restarts the KV cache at chunk boundaries: fp32 rounding only (~1e-6 per log-prob)
    assert torch.allclose(out.batch["rollout_log_probs"][valid], whole.batch["rollout_log_probs"][valid], atol=1e-5)
    assert list(out.non_tensor_batch["param_version_start"]) == [0] * 3
    assert list(out.non_tensor_batch["param_version_end"]) == [0] * 3


@pytest.mark.numerics
@pytest.mark.parametrize("chunk, where", [(4, "mid_turn"), (WIDTH, "turn_boundary")])
def test_a_sync_mid_flight_scores_each_token_by_the_weights_that_sampled_it(tokenizer, chunk, where):
    """The sync at the second boundary: with chunks of 4, after the first chunk of the first turn; with one
    chunk per turn, between the first turn and the second (the trajectories waiting on the server)."""
    model, old = build_tiny_model(tokenizer, hidden_size=32), build_tiny_model(tokenizer, hidden_size=32)

    def change():
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)

    prompts = _prompts(tokenizer, {}, QUESTIONS, width=PROMPT)
    out = _agents(tokenizer, _chunked(_hf(model), chunk, _sync_at(2, change))).generate_sequences(prompts)
    lp, sampled = out.batch["rollout_log_probs"], out.batch["response_mask"].bool()
    old_scores, new_scores = _scored(old, out), _scored(model, out)
    for r, turns in enumerate(out.non_tensor_batch["turns"]):
        first_turn_end = turns[0][2]
        cut = min(chunk, first_turn_end) if where == "mid_turn" else first_turn_end  # tokens sampled before the sync
        before, after = sampled[r].clone(), sampled[r].clone()
        before[cut:], after[:cut] = False, False
        assert before.sum() == cut and after.sum() > 0 and len(turns) >= 3
        # the engine's and a direct forward's rounding (fp32, another layout); the versions differ by > 1e-2
        assert torch.allclose(lp[r][before], old_scores[r][before], atol=1e-4)
        assert torch.allclose(lp[r][after], new_scores[r][after], atol=1e-4)
        assert not torch.allclose(old_scores[r][after], new_scores[r][after], atol=1e-2)
        # the layout of a run without partial rollout: sampled exactly on the assistant turns
        assert out.batch["response_mask"][r].tolist() == _assistant_mask(turns)
    assert list(out.non_tensor_batch["param_version_start"]) == [0] * 3
    assert list(out.non_tensor_batch["param_version_end"]) == [1] * 3


ADD_SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number", "description": "first"},
                                         "b": {"type": "number", "description": "second"}},
        "required": ["a", "b"]}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
HEADER = "<|im_start|>assistant\n"


class CountingAdd(BaseTool):
    """A real tool that records every call it runs."""

    def __init__(self):
        super().__init__({}, OpenAIFunctionToolSchema.model_validate(ADD_SCHEMA))
        self.calls: list[dict] = []

    async def execute(self, instance_id, parameters, **kwargs):
        self.calls.append(dict(parameters))
        return ToolResponse(text=str(parameters["a"] + parameters["b"])), 0.0, {}


class VersionedScript:
    """Stands in for the model, continuing a turn from wherever its context stops: the k-th assistant turn of a
    conversation is ``script[k]`` + <|im_end|>; its token j has log-prob -(j + 1) / 100 - ``version`` (so each
    token says which weights sampled it); every row reports ``param_version`` = 10 × ``version``, as a rollout
    worker stamps its actor version."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script, self.version = tokenizer, script, 0
        self.eos_token_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.config = type("Config", (), {"n": 1, "val_kwargs": type("Val", (), {"n": 1})()})()
        self.header = tokenizer.encode(HEADER, add_special_tokens=False)
        self.engine_only: list = []  # each call's meta_info[ENGINE_ONLY]

    def generate_sequences(self, batch: DataProto) -> DataProto:
        width, rows = int(batch.meta_info["response_length"]), []
        self.engine_only.append(batch.meta_info.get(ENGINE_ONLY))
        for ids, mask in zip(batch.batch["input_ids"], batch.batch["attention_mask"]):
            ids = ids[mask.bool()].tolist()
            starts = [i + len(self.header) for i in range(len(ids)) if ids[i:i + len(self.header)] == self.header]
            turn = self.tokenizer.encode(self.script[len(starts) - 1] + "<|im_end|>", add_special_tokens=False)
            done = ids[starts[-1]:]
            assert turn[:len(done)] == done, "the context ends inside another turn than the script's"
            rows.append((len(done), turn[len(done):][:width]))
        responses, sampled = torch.zeros((len(rows), width), dtype=torch.long), torch.zeros((len(rows), width))
        log_probs = torch.zeros((len(rows), width))
        for i, (offset, new) in enumerate(rows):
            responses[i, :len(new)], sampled[i, :len(new)] = torch.tensor(new, dtype=torch.long), 1
            log_probs[i, :len(new)] = -(torch.arange(len(new)) + offset + 1) / 100 - self.version
        versions = torch.full((len(rows),), 10 * self.version).numpy().astype(object)
        return DataProto.from_dict(tensors={"responses": responses, "response_mask": sampled.long(),
                                            "rollout_log_probs": log_probs}, non_tensors={"param_version": versions})


def test_a_sync_inside_a_tool_calling_turn_keeps_the_call_and_the_layout(tokenizer):
    """Turn 1 (a tool call) in chunks of 5 tokens, the sync after its first chunk: the call runs once, with
    its arguments; the tokens, mask and turns are the one-call run's; tokens 0-4 carry version 0's log-probs,
    the rest version 1's; the sample's actor version is its first chunk's."""
    script = [CALL, "It is 5."]
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    unchunked_tool, tool = CountingAdd(), CountingAdd()
    prompts = _prompts(tokenizer, {"tools": [ADD_SCHEMA]}, ["What is 2+3?"], width=160)
    agents = AgentLoop(VersionedScript(tokenizer, script), tokenizer, MultiTurnConfig(enable=True), {"add": unchunked_tool},
                       400, chat_template_kwargs={"tools": [ADD_SCHEMA]})
    whole = agents.generate_sequences(prompts)
    policy = VersionedScript(tokenizer, script)
    engine = ChunkedEngine(ChunkedGeneration(policy.generate_sequences, response_length=400, chunk_tokens=5, pad_id=0,
                                             eos_ids=eos), policy.config)
    engine.boundary = _sync_at(2, lambda: setattr(policy, "version", 1))
    agents = AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True), {"add": tool}, 400,
                       chat_template_kwargs={"tools": [ADD_SCHEMA]})
    out = agents.generate_sequences(prompts)
    assert tool.calls == unchunked_tool.calls == [{"a": 2, "b": 3}]  # not re-run on resume
    for key in ("responses", "response_mask", "input_ids", "attention_mask"):
        assert torch.equal(out.batch[key], whole.batch[key]), key
    extras = out.non_tensor_batch
    assert extras["turns"][0] == whole.non_tensor_batch["turns"][0]
    assert extras["tool_results"][0] == [{"tool": "add", "text": "5", "error": None}]
    (_, a0, a1), (_, t0, t1), (_, b0, b1) = extras["turns"][0]
    # by hand: turn token j has -(j + 1) / 100 - version; 0 on the tool's tokens
    expected = [-(j + 1) / 100 - (j >= 5) for j in range(a1 - a0)] + [0.0] * (t1 - t0) + \
               [-(j + 1) / 100 - 1 for j in range(b1 - b0)]
    torch.testing.assert_close(out.batch["rollout_log_probs"][0, :b1], torch.tensor(expected))
    assert (extras["param_version_start"][0], extras["param_version_end"][0], extras["param_version"][0]) == (0, 1, 0)
    assert policy.engine_only == [True] * len(policy.engine_only)  # the rollout worker answers with its plain engine


def test_image_rows_are_refused_with_the_fix(tokenizer):
    """Their pixels would not follow the chunks: the first such engine call says to turn partial rollout off."""
    policy = VersionedScript(tokenizer, ["x"])
    engine = ChunkedEngine(ChunkedGeneration(policy.generate_sequences, response_length=8, chunk_tokens=2, pad_id=0,
                                             eos_ids=policy.eos_token_ids), policy.config)
    engine.boundary = lambda: 0
    pixels = torch.zeros(1).numpy().astype(object)
    pixels[0] = {"pixel_values": torch.zeros(1)}
    rows = DataProto.from_dict(tensors={"input_ids": torch.ones((1, 3), dtype=torch.long),
                                        "attention_mask": torch.ones((1, 3), dtype=torch.long)},
                               non_tensors={"multi_modal_inputs": pixels}, meta_info={"response_length": 8})
    with pytest.raises(ValueError, match="does not take image rows.*set partial_rollout=false"):
        engine.generate_sequences(rows)
    assert policy.engine_only == []  # refused before any engine call
