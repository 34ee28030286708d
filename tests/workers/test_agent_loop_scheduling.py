"""Agent loops beyond one tool conversation: how trajectories share engine calls (a slow tool does not
stall the others), loops chosen by name (custom ones from a config file), and simulated users
(interactions, verl's GSM8K one). The scripted policy of test_agent_loop.py stands in for the model."""

from __future__ import annotations

import asyncio
import selectors
import threading

import numpy as np
import pytest
import torch

from rlfoundry.config.schema import AgentConfig, MultiTurnConfig
from rlfoundry.interactions import InteractionConfigError, initialize_interactions_from_config
from rlfoundry.interactions.gsm8k import CORRECT, RETRY
from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rlfoundry.trainer.metric_utils import multi_turn_metrics
from rlfoundry.workers.rollout.agent_loop import AgentLoop, AgentLoopBase, AgentLoopError, AgentLoopOutput
from rlfoundry.workers.rollout.agent_loop.server import GenerationServer
from tests.workers.test_agent_loop import ScriptedPolicy, _prompts

SLEEP_SCHEMA = {"type": "function", "function": {
    "name": "sleep", "description": "Wait.", "parameters": {
        "type": "object", "properties": {"seconds": {"type": "number", "description": "how long"}},
        "required": ["seconds"]}}}
GATE_SCHEMA = {"type": "function", "function": {"name": "gate", "description": "Wait for the gate."}}
GATE_CALL = '<tool_call>{"name": "gate", "arguments": {}}</tool_call>'


def sleep_call(seconds: float) -> str:
    return '<tool_call>{"name": "sleep", "arguments": {"seconds": %s}}</tool_call>' % seconds


class SleepTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(float(parameters["seconds"]))
        return ToolResponse(text="slept"), 0.0, {}


class GateTool(BaseTool):
    """Answers once the test opens ``gate``, then logs that it did: a tool exactly as slow as the test wants."""

    def __init__(self, gate: threading.Event, events: list):
        super().__init__({}, OpenAIFunctionToolSchema.model_validate(GATE_SCHEMA))
        self.gate, self.events = gate, events

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.to_thread(self.gate.wait, 60)  # the limit only turns a hang into a failure
        self.events.append("tool returned")
        return ToolResponse(text="opened"), 0.0, {}


class LoggingPolicy(ScriptedPolicy):
    """The scripted policy, logging to ``events`` which conversations (by their first user text) each
    call served, then calling ``after_call`` with the number of calls so far."""

    def __init__(self, tokenizer, script, events: list, after_call=lambda calls: None):
        super().__init__(tokenizer, script)
        self.events, self.after_call = events, after_call

    def generate_sequences(self, batch):
        texts = [self.tokenizer.decode(ids[m.bool()]) for ids, m in
                 zip(batch.batch["input_ids"], batch.batch["attention_mask"])]
        self.events.append([t.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0] for t in texts])
        out = super().generate_sequences(batch)
        self.after_call(self.calls)
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _sleep_loop(tokenizer, script, max_wait_s, events: list, gate: GateTool | None = None,
                after_call=lambda calls: None):
    tools = {"sleep": SleepTool({}, OpenAIFunctionToolSchema.model_validate(SLEEP_SCHEMA))}
    kwargs = {"tools": [SLEEP_SCHEMA]}
    if gate is not None:
        tools["gate"], kwargs["tools"] = gate, [SLEEP_SCHEMA, GATE_SCHEMA]
    policy = LoggingPolicy(tokenizer, script, events, after_call)
    loop = AgentLoop(policy, tokenizer, MultiTurnConfig(enable=True), tools, 400, chat_template_kwargs=kwargs,
                     agent=AgentConfig(max_wait_s=max_wait_s))
    return loop, kwargs


def test_a_slow_tool_does_not_stall_the_other_trajectories(tokenizer):
    """A sits in a tool that answers only once B's last turn is generated, so B's three further turns
    can only come meanwhile, each in an engine call of its own; A's last turn comes after its tool.
    (How long B waits for A before going alone is timed exactly on the event loop's clock below.)"""
    gate, events = threading.Event(), []
    script = {"A": [GATE_CALL, "done"], "B": [sleep_call(0), sleep_call(0), sleep_call(0), "done"]}
    loop, kwargs = _sleep_loop(tokenizer, script, 0.1, events, GateTool(gate, events),
                               after_call=lambda calls: calls == 4 and gate.set())
    out = loop.generate_sequences(_prompts(tokenizer, kwargs, ["A", "B"]))
    assert events == [["A", "B"], ["B"], ["B"], ["B"], "tool returned", ["A"]]
    assert list(out.non_tensor_batch["num_turns"]) == [3, 7] and loop.last_engine_calls == 5


def test_with_quick_tools_every_turn_is_one_batch_whatever_the_timing(tokenizer):
    """Tools that answer within max_wait_s: the engine waits for every trajectory, so each turn of the
    batch is one engine call, composed as in a synchronous loop (what keeps seeded runs reproducible)."""
    script = {q: [sleep_call(0.05 * i), sleep_call(0), "done"] for i, q in enumerate("ABCD")}
    events = []
    loop, kwargs = _sleep_loop(tokenizer, script, 5.0, events)
    loop.generate_sequences(_prompts(tokenizer, kwargs, list("ABCD")))
    assert events == [list("ABCD")] * 3


# ---- the server's grace period, on virtual time -------------------------------------------

class _JumpingSelector(selectors.DefaultSelector):
    """Where the loop would sleep until its next timer with nothing else to do, it moves its clock there."""

    loop: VirtualTimeLoop

    def select(self, timeout=None):
        if timeout is None or self.loop.jobs:  # an engine call in a thread: wait for it, time stands still
            return super().select(timeout)
        ready = super().select(0)
        if not ready:
            self.loop.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: ``asyncio.sleep`` and ``wait_for`` timeouts take no real time, an
    executor job (an engine call) takes none of the loop's, and every ``loop.time()`` is exact."""

    def __init__(self):
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop, self.now, self.jobs = self, 0.0, 0

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor, func, *args):
        self.jobs += 1
        future = super().run_in_executor(executor, func, *args)
        future.add_done_callback(lambda _: setattr(self, "jobs", self.jobs - 1))
        return future


class _ClockedEngine:
    """One token per row; logs (the loop's time, each row's last prompt token) per call."""

    def __init__(self, clock):
        self.clock, self.calls = clock, []

    def generate_sequences(self, batch: DataProto) -> DataProto:
        self.calls.append((self.clock(), batch.batch["input_ids"][:, -1].tolist()))
        ones = torch.ones((len(batch), 1), dtype=torch.long)
        return DataProto.from_dict(tensors={"responses": ones, "response_mask": ones,
                                            "rollout_log_probs": torch.zeros((len(batch), 1))})


def test_a_trajectory_waits_max_wait_s_for_one_in_a_tool_by_the_event_loop_clock():
    """Trajectory 0 (prompt token 10) spends 3 s in a tool after its first turn; trajectory 1 (token 11)
    asks again at once after each of its first three. By hand, with grace 0.1: both turns at t = 0 share
    a call; 1 then goes alone 0.1 after each request (t = 0.1, 0.2, 0.3), and 0's last turn goes the
    moment its tool ends (t = 3.0): no one else is live, so it waits for no one."""

    async def run() -> list:
        engine = _ClockedEngine(asyncio.get_running_loop().time)
        server = GenerationServer(engine, pad_id=0, meta={}, grace_s=0.1)

        async def trajectory(key: int, tool_s: list[float]) -> None:
            try:
                for seconds in tool_s:
                    await server.generate(key, [10 + key], 1)
                    await asyncio.sleep(seconds)
                await server.generate(key, [10 + key], 1)
            finally:
                server.leave()

        server.join(), server.join()
        serving = asyncio.create_task(server.serve())
        await asyncio.gather(trajectory(0, [3.0]), trajectory(1, [0.0, 0.0, 0.0]))
        serving.cancel()
        return engine.calls

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        calls = runner.run(run())
    assert [rows for _, rows in calls] == [[10, 11], [11], [11], [11], [10]]
    assert [t for t, _ in calls] == pytest.approx([0.0, 0.1, 0.2, 0.3, 3.0])


# ---- loops by name ------------------------------------------------------------------------

class SelfCheckLoop(AgentLoopBase):
    """A custom loop: answer, be told "Check your answer.", answer again."""

    async def run(self, sampling_params, **row):
        ids, mask, lps = [], [], []
        for turn in range(2):
            out = await self.server.generate(self.key, row["prompt_ids"] + ids, self.response_length - len(ids))
            ids, mask, lps = ids + out.token_ids, mask + [1] * len(out.token_ids), lps + out.log_probs
            if turn == 0:
                user = self.tokenizer.encode("\n<|im_start|>user\nCheck your answer.<|im_end|>\n<|im_start|>assistant\n",
                                             add_special_tokens=False)
                ids, mask, lps = ids + user, mask + [0] * len(user), lps + [0.0] * len(user)
        return AgentLoopOutput(list(row["prompt_ids"]), ids, mask, lps, num_turns=4,
                               extra_fields={"checked": True})


def test_rows_choose_their_loop_by_name_and_custom_loops_load_from_a_config_file(tokenizer, tmp_path):
    config = tmp_path / "agent_loops.yaml"
    config.write_text(f"- name: self_check\n  _target_: {__name__}.SelfCheckLoop\n")
    script = {"A": ["1", "2"], "B": [sleep_call(0), "done"]}
    tools = {"sleep": SleepTool({}, OpenAIFunctionToolSchema.model_validate(SLEEP_SCHEMA))}
    loop = AgentLoop(ScriptedPolicy(tokenizer, script), tokenizer, MultiTurnConfig(enable=True), tools, 400,
                     chat_template_kwargs={"tools": [SLEEP_SCHEMA]},
                     agent=AgentConfig(agent_loop_config_path=str(config)))
    prompts = _prompts(tokenizer, {"tools": [SLEEP_SCHEMA]}, ["A", "B"])
    prompts.non_tensor_batch["agent_name"] = np.array(["self_check", None], dtype=object)  # B: the default
    out = loop.generate_sequences(prompts)
    text = tokenizer.decode(out.batch["responses"][0][out.batch["attention_mask"][0, 160:].bool()])
    assert text == "1<|im_end|>\n<|im_start|>user\nCheck your answer.<|im_end|>\n<|im_start|>assistant\n2<|im_end|>"
    extras = out.non_tensor_batch
    assert list(extras["checked"]) == [True, None] and list(extras["stop_reason"]) == [None, "no_call"]
    assert list(extras["num_turns"]) == [4, 3]
    metrics = multi_turn_metrics(extras)  # the custom loop's row has no tool columns: skipped, not zeros
    assert metrics["multi_turn/tool_calls/mean"] == 1.0 and metrics["multi_turn/stop/no_call"] == 0.5

    prompts.non_tensor_batch["agent_name"] = np.array(["nobody", None], dtype=object)
    with pytest.raises(AgentLoopError, match=r"agent loop 'nobody'.*known: \['openai_agent', 'self_check', 'single_turn_agent', "
                                             r"'spo_tool_agent', 'tool_agent'\]"):
        loop.generate_sequences(prompts)


def test_the_single_turn_agent_samples_every_response_token(tokenizer):
    loop = AgentLoop(ScriptedPolicy(tokenizer, {"A": ["42"]}), tokenizer, MultiTurnConfig(enable=True), {}, 8,
                     agent=AgentConfig(default_agent_loop="single_turn_agent"))
    out = loop.generate_sequences(_prompts(tokenizer, {}, ["A"]))
    expected = tokenizer.encode("42<|im_end|>", add_special_tokens=False)
    assert out.batch["responses"][0, :len(expected)].tolist() == expected
    assert out.batch["response_mask"][0].tolist() == [1] * len(expected) + [0] * (8 - len(expected))
    assert out.non_tensor_batch["num_turns"][0] == 2


# ---- interactions ------------------------------------------------------------------------

def _gsm8k_loop(tokenizer, script, tmp_path, **config):
    path = tmp_path / "interaction.yaml"  # verl's layout and class name
    path.write_text("interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
                    "    config: {}\n")
    return AgentLoop(ScriptedPolicy(tokenizer, script), tokenizer, MultiTurnConfig(enable=True, **config), {}, 400,
                     interactions=initialize_interactions_from_config(path))


def _gsm8k_prompts(tokenizer, questions, truth):
    prompts = _prompts(tokenizer, {}, questions)
    prompts.non_tensor_batch["extra_info"] = np.array(
        [{"interaction_kwargs": {"name": "gsm8k", "ground_truth": truth}} for _ in questions], dtype=object)
    return prompts


def test_the_gsm8k_interaction_asks_for_a_retry_until_the_answer_is_right(tokenizer, tmp_path):
    wrong, right = "I think #### 5", "Let me redo it. #### 72"
    loop = _gsm8k_loop(tokenizer, {"Q": [wrong, right]}, tmp_path)
    out = loop.generate_sequences(_gsm8k_prompts(tokenizer, ["Q"], "72"))
    retry = tokenizer.encode(f"\n<|im_start|>user\n{RETRY}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    turn1 = tokenizer.encode(wrong + "<|im_end|>", add_special_tokens=False)
    turn2 = tokenizer.encode(right + "<|im_end|>", add_special_tokens=False)
    length = int(out.batch["attention_mask"][0, 160:].sum())
    assert out.batch["responses"][0, :length].tolist() == turn1 + retry + turn2  # no closing "correct!" turn
    assert out.batch["response_mask"][0, :length].tolist() == [1] * len(turn1) + [0] * len(retry) + [1] * len(turn2)
    extras = out.non_tensor_batch
    assert (extras["stop_reason"][0], extras["turn_scores"][0], extras["num_turns"][0]) == ("interaction_done",
                                                                                             [0.0, 1.0], 3)
    assert extras["last_turn_start"][0] == len(turn1) + len(retry) and not extras["sanity_check_failed"][0]
    assert CORRECT not in tokenizer.decode(out.batch["responses"][0])


def test_the_interaction_is_bounded_by_the_turn_limits(tokenizer, tmp_path):
    loop = _gsm8k_loop(tokenizer, {"Q": ["#### 1", "#### 2", "#### 3"]}, tmp_path, max_user_turns=2)
    out = loop.generate_sequences(_gsm8k_prompts(tokenizer, ["Q"], "72"))
    assert out.non_tensor_batch["stop_reason"][0] == "max_user_turns"
    assert out.non_tensor_batch["turn_scores"][0] == [0.0, 0.0] and out.non_tensor_batch["num_turns"][0] == 4
    loop = _gsm8k_loop(tokenizer, {"Q": ["#### 1", "#### 2", "#### 3"]}, tmp_path, max_assistant_turns=2)
    out = loop.generate_sequences(_gsm8k_prompts(tokenizer, ["Q"], "72"))
    assert (out.non_tensor_batch["stop_reason"][0], out.non_tensor_batch["num_turns"][0]) == ("no_call", 3)


def test_a_row_naming_no_configured_interaction_is_an_error_that_says_which(tokenizer, tmp_path):
    loop = _gsm8k_loop(tokenizer, {"Q": ["#### 1"]}, tmp_path)
    prompts = _gsm8k_prompts(tokenizer, ["Q"], "72")
    prompts.non_tensor_batch["extra_info"][0]["interaction_kwargs"]["name"] = "tutor"
    with pytest.raises(AgentLoopError, match=r"interaction_kwargs.name='tutor'.*configured: \['gsm8k'\]"):
        loop.generate_sequences(prompts)


@pytest.mark.parametrize("text, message", [
    ("interaction: []\n", "non-empty 'interaction:' list"),
    ("interaction:\n  - name: x\n", r"interaction\[0\] needs class_name"),
    ("interaction:\n  - name: x\n    class_name: nowhere.Nothing\n", "cannot be imported"),
    ("interaction:\n  - name: x\n    class_name: rlfoundry.tools.base.BaseTool\n", "not a subclass"),
])
def test_bad_interaction_configs_name_the_entry(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InteractionConfigError, match=message):
        initialize_interactions_from_config(path)


def test_real_gsm8k_rows_reach_the_interaction_through_the_data_set(shared_data, tokenizer, tmp_path):
    """``preprocess gsm8k --multiturn interaction`` rows, loaded and collated as the trainer does: the
    ground truth reaches the interaction, and the rule reward sees the retry's answer and the scores."""
    from omegaconf import OmegaConf

    from rlfoundry.data import RLHFDataset, collate_fn
    from rlfoundry.data.preprocess.__main__ import main as preprocess_main
    from rlfoundry.protocol import DataProto
    from rlfoundry.rewards.reward_manager import decode_samples

    lines = (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:2]
    (tmp_path / "test.jsonl").write_text("\n".join(lines) + "\n")
    assert preprocess_main(["gsm8k", "--input", str(tmp_path / "test.jsonl"), "--output", str(tmp_path / "rows"),
                            "--multiturn", "interaction"]) == 0
    data = RLHFDataset(str(tmp_path / "rows" / "test.parquet"), tokenizer,
                       OmegaConf.create({"max_prompt_length": 600, "truncation": "error", "return_raw_chat": True}))
    batch = DataProto.from_single_dict(collate_fn([data[0], data[1]]))
    first, second = (batch.non_tensor_batch["raw_prompt"][i][1]["content"] for i in range(2))
    assert batch.non_tensor_batch["raw_prompt"][0][0]["role"] == "system"
    assert list(batch.non_tensor_batch["agent_name"]) == ["tool_agent", "tool_agent"]
    loop = _gsm8k_loop(tokenizer, {first: ["#### 17", "#### 18"], second: ["#### 3"]}, tmp_path)
    loop.default_loop = "single_turn_agent"  # the rows' agent_name decides, not the default
    batch.meta_info["n"] = 1
    out = loop.generate_sequences(batch)
    assert list(out.non_tensor_batch["stop_reason"]) == ["interaction_done", "interaction_done"]
    assert list(out.non_tensor_batch["turn_scores"]) == [[0.0, 1.0], [1.0]]  # ground truths 18 and 3
    samples = decode_samples(out, tokenizer, "data_source")
    assert [s.solution_str for s in samples] == ["#### 18", "#### 3"]
    assert samples[0].extra_info["turn_scores"] == [0.0, 1.0] and samples[0].extra_info["num_turns"] == 3


def test_format_trajectory_marks_exactly_the_unsampled_spans(tokenizer):
    from rlfoundry.workers.rollout.agent_loop import format_trajectory

    ids = tokenizer.encode("ab<|im_end|>cdef", add_special_tokens=False)  # a, b, <|im_end|>, c, d, e, f
    assert format_trajectory(tokenizer, ids, [1, 1, 1, 0, 0, 1, 1]) == "ab<|im_end|>⟦cd⟧ef"
    assert format_trajectory(tokenizer, ids, [0] * 7, "[", "]") == "[ab<|im_end|>cdef]"
    assert format_trajectory(tokenizer, [], []) == ""


# ---- sampling that does not depend on the batching ---------------------------------------------------

def check_draws_do_not_depend_on_batching(engine, tokenizer, atol: float = 1e-5) -> None:
    """Four trajectories' two turns through a ``GenerationServer`` on ``engine``, sampled all together (two
    engine calls) or arriving one by one (an engine call each): the same tokens, and the engine's call
    counter moved by one either way, so the next batch draws the same too."""
    contexts = [tokenizer.encode(t) for t in ("hello world", "a", "the quick brown fox", "12+7=")]

    async def run(grace_s: float, stagger_s: float):
        server = GenerationServer(engine, tokenizer.pad_token_id, {}, grace_s)
        for _ in contexts:
            server.join()
        serving = asyncio.create_task(server.serve())

        async def trajectory(k: int):
            await asyncio.sleep(stagger_s * k)
            first = await server.generate(k, contexts[k], 6)
            second = await server.generate(k, contexts[k] + first.token_ids, 6)
            server.leave()
            return first, second

        try:
            turns = await asyncio.gather(*(trajectory(k) for k in range(len(contexts))))
        finally:
            serving.cancel()
        return turns, server.engine_calls

    start = engine.calls
    together, calls_together = asyncio.run(run(grace_s=30.0, stagger_s=0.0))
    assert engine.calls == start + 1
    engine.calls = start  # the same reserved call number: as a rerun of the same step
    apart, calls_apart = asyncio.run(run(grace_s=0.0, stagger_s=0.5))
    assert calls_together == 2 and calls_apart >= 4 and engine.calls == start + 1
    for (a1, a2), (b1, b2) in zip(together, apart):
        assert a1.token_ids == b1.token_ids and a2.token_ids == b2.token_ids
        np.testing.assert_allclose(a1.log_probs + a2.log_probs, b1.log_probs + b2.log_probs, atol=atol)
    assert len({tuple(a.token_ids) for a, _ in together}) > 1  # sampled, not one fixed string


def test_a_requests_tokens_do_not_depend_on_how_the_server_batched_it(tiny_model_dir, tokenizer):
    """On the HF engine the server keys each request's draws by (the batch's reserved call, trajectory,
    turn). (A black-box agent's requests arrive as its own code runs; vLLM's test reuses the check.)"""
    from tests.workers import local_worker, worker_config

    check_draws_do_not_depend_on_batching(local_worker(worker_config(tiny_model_dir), role="rollout").worker.rollout,
                                          tokenizer)
