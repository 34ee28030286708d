"""``rollout.multi_turn.use_inference_chat_template``: the engine's context for each turn is the chat
re-rendered by the template (verl's SGLang rollout), while the training row keeps the sampled tokens.

The template here drops the reasoning (<think>…</think>) of every assistant message it renders, as
Qwen3's does for earlier turns: turn 1's reasoning is in the row but, with the key on, not in what the
engine sees for turn 2 — which the scripted policy records."""

from __future__ import annotations

import pytest

from rlfoundry.config.schema import MultiTurnConfig
from rlfoundry.config.typed import ConfigError
from rlfoundry.config.verl_compat import no_effect_keys_set
from rlfoundry.models.tiny import CHAT_TEMPLATE, build_tokenizer
from rlfoundry.tools.registry import initialize_tools_from_config
from rlfoundry.trainer.config import load_config, resolve_config, validate_config
from rlfoundry.workers.rollout.agent_loop import AgentLoop, AgentLoopError
from tests.workers.test_agent_loop import CALL, TOOLS, ScriptedPolicy, _prompts

THINK = "<think>I should use the calculator.</think>"
QUESTION, FINAL = "What is 123*456?", "The answer is 56088."
# the tiny ChatML template with an assistant message's text cut to what follows its last </think>
DROP_THINK = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
    "{% set content = message['content'].split('</think>')[-1] if message['role'] == 'assistant' "
    "else message['content'] %}{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}")


class RecordingPolicy(ScriptedPolicy):
    """The scripted policy, keeping every prompt the engine was asked to continue."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    def _turn(self, ids: list[int]) -> list[int]:
        self.prompts.append(ids)
        return super()._turn(ids)


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = DROP_THINK
    assert DROP_THINK != CHAT_TEMPLATE  # the replacement found its target
    return tok


def _run(tokenizer, on: bool):
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}
    kwargs = {"tools": [t.get_openai_tool_schema().model_dump() for t in tools.values()]}
    policy = RecordingPolicy(tokenizer, {QUESTION: [THINK + CALL, FINAL]})
    loop = AgentLoop(policy, tokenizer, MultiTurnConfig(enable=True, use_inference_chat_template=on), tools, 256,
                     chat_template_kwargs=kwargs)
    return loop.generate_sequences(_prompts(tokenizer, kwargs, [QUESTION])), policy.prompts, kwargs


def test_the_engine_sees_the_rerendered_chat_and_the_row_keeps_the_sampled_tokens(tokenizer):
    on, on_prompts, kwargs = _run(tokenizer, True)
    off, off_prompts, _ = _run(tokenizer, False)
    assert len(on_prompts) == len(off_prompts) == 2  # the same two turns either way
    # key on: turn 2's context is the template's rendering of the chat, turn 1's reasoning left out
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": THINK + CALL},
            {"role": "tool", "content": "56088"}]
    without_think = [chat[0], {"role": "assistant", "content": CALL}, chat[2]]  # what the template should make of it
    rendered = tokenizer.apply_chat_template(without_think, tokenize=False, add_generation_prompt=True,
                                             chat_template=CHAT_TEMPLATE, **kwargs)
    assert on_prompts[1] == tokenizer.encode(rendered, add_special_tokens=False)
    assert "<think>" not in tokenizer.decode(on_prompts[1])
    # key off: turn 2's context is the row's tokens up to turn 2, reasoning included
    turn2 = tokenizer.encode(FINAL + "<|im_end|>", add_special_tokens=False)
    row = off.batch["input_ids"][0][off.batch["attention_mask"][0].bool()].tolist()
    assert off_prompts[1] == row[:len(row) - len(turn2)] and THINK in tokenizer.decode(off_prompts[1])
    assert on_prompts[0] == off_prompts[0]  # turn 1: the rendered prompt is the data set's own
    # the training rows are the same, token for token, mask for mask
    for key in ("input_ids", "attention_mask", "responses", "response_mask", "rollout_log_probs"):
        assert off.batch[key].equal(on.batch[key]), key
    assert THINK in tokenizer.decode(on.batch["responses"][0])
    assert on.non_tensor_batch["stop_reason"][0] == off.non_tensor_batch["stop_reason"][0] == "no_call"
    # the mismatch audit's evidence: with the key on, turn 2 (the row's last len(turn2) response tokens) was
    # sampled after a context the row does not hold; turn 1 after the row's own prompt. Off: every turn as trained
    response_len = int(on.batch["response_mask"][0].nonzero().max()) + 1
    assert on.non_tensor_batch["retokenised_from"][0] == response_len - len(turn2)
    assert off.non_tensor_batch["retokenised_from"][0] == -1


def test_the_key_needs_the_rows_messages(tokenizer):
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}
    loop = AgentLoop(RecordingPolicy(tokenizer, {QUESTION: [FINAL]}), tokenizer,
                     MultiTurnConfig(enable=True, use_inference_chat_template=True), tools, 256, chat_template_kwargs={})
    prompts = _prompts(tokenizer, {}, [QUESTION])
    del prompts.non_tensor_batch["raw_prompt"]
    with pytest.raises(AgentLoopError, match="data.return_raw_chat"):
        loop.generate_sequences(prompts)


def test_config_takes_the_key_and_never_reuses_the_engines_log_probs():
    """The engine's log-probs are conditioned on the re-rendered chat, not on the row the actor scores:
    auto (null) recomputes the old log-probs, and an explicit reuse is refused."""
    key = "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template"
    assert MultiTurnConfig().use_inference_chat_template is False
    assert no_effect_keys_set(load_config([f"{key}=true"]), [key]) == []
    one_batch = ["actor_rollout_ref.actor.ppo_mini_batch_size=${data.train_batch_size}",
                 "actor_rollout_ref.rollout.multi_turn.enable=true"]
    reuse = lambda *o: resolve_config(load_config([*one_batch, *o]), steps_per_epoch=1,  # noqa: E731
                                      cuda_available=False).actor_rollout_ref.actor.use_rollout_log_probs
    assert reuse() is True and reuse(f"{key}=true") is False
    with pytest.raises(ConfigError, match="use_inference_chat_template"):
        validate_config(load_config([*one_batch, f"{key}=true", "actor_rollout_ref.actor.use_rollout_log_probs=true"]))
