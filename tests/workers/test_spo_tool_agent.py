"""verl's SPO loop (``spo_tool_agent``) on hand-built trajectories: a scripted policy writes each turn's text
(past ``</code>``, to show the stop), real programs run in this machine's sandbox through a tool written as
verl's SPO recipe writes it, and every token of the result, its mask and log-prob is derived by hand."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from rlfoundry.config.schema import MultiTurnConfig
from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.tools.sandbox_fusion import SandboxFusionTool
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema
from rlfoundry.workers.rollout.agent_loop import AgentLoop
from rlfoundry.workers.rollout.agent_loop.base import resolve_agent_loops
from rlfoundry.workers.rollout.agent_loop.spo_tool_agent import SPOToolAgentLoop, code_blocks
from tests.workers import test_agent_loop as agent_loop_tests

TAIL = " and then more text the stop string cuts off<|im_end|>"
RUN = "Let me compute.<code>\n```python\n{}\n```\n</code>"
RELEASE = threading.Event()  # the hanging program's thread waits on it (set at the end of the test)


class ScriptedPolicy(agent_loop_tests.ScriptedPolicy):
    """test_agent_loop's scripted model (the prompt's user text -> its turns' texts; token j of a turn gets
    log-prob -(j + 1) / 100), whose k-th turn here is the one after k turns, each closed with ``</code>``;
    the texts carry their own end (or none)."""

    def _turn(self, ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(ids)
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return self.tokenizer.encode(self.script[user][text.count("</code>")], add_special_tokens=False)


class RecipeTool(SandboxFusionTool):
    """verl's SPO recipe tool (its CustomSandboxFusionTool), written afresh: ``execute`` gets the code as a
    string and runs it through verl's pool; two programs stand for a tool that raises and one that hangs."""

    async def execute(self, instance_id: str, code: str, **kwargs: Any) -> tuple[Any, None, None]:
        if code == "explode()":
            raise RuntimeError("the sandbox went away")
        if code == "hang()":
            RELEASE.wait(60)
        result = await self.execution_pool.execute.remote(self.execute_code, instance_id, code, self.default_timeout,
                                                          self.default_language)
        return result, None, None


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _run(tokenizer, script: dict[str, list[str]], response_length: int = 256, **config) -> DataProto:
    schema = {"type": "function", "function": {"name": "code_interpreter", "description": "runs code", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
    tool = RecipeTool({"type": "native", "default_timeout": 5}, OpenAIFunctionToolSchema.model_validate(schema))
    loop = AgentLoop(ScriptedPolicy(tokenizer, script), tokenizer,
                     MultiTurnConfig(enable=True, format="spo", **config), {"code_interpreter": tool}, response_length)
    assert loop.default_loop == "spo_tool_agent"  # format=spo names the loop
    chats = [[{"role": "user", "content": q}] for q in script]
    ids = [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False) for c in chats]
    width = max(map(len, ids))
    input_ids, mask = torch.zeros((len(ids), width), dtype=torch.long), torch.zeros((len(ids), width), dtype=torch.long)
    for r, row in enumerate(ids):
        input_ids[r, width - len(row):], mask[r, width - len(row):] = torch.tensor(row), 1
    raw = np.empty(len(chats), dtype=object)
    raw[:] = chats
    return loop.generate_sequences(DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"raw_prompt": raw}, meta_info={"n": 1}))


def _row(out: DataProto, r: int) -> tuple[list[int], list[int], list[float]]:
    width = out.batch["responses"].shape[1]
    n = int(out.batch["attention_mask"][r, -width:].sum())
    return (out.batch["responses"][r, :n].tolist(), out.batch["response_mask"][r, :n].tolist(),
            out.batch["rollout_log_probs"][r, :n].tolist())


def _sampled(tokenizer, text: str) -> list[int]:
    """A turn's tokens as the loop keeps them: the scripted turn (with its tail) cut after ``</code>``."""
    ids = tokenizer.encode(text + TAIL, add_special_tokens=False)
    keep = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith("</code>"))
    assert tokenizer.decode(ids[:keep]) == text
    return ids[:keep]


def _expect(tokenizer, turns: list[tuple[str, Any]]) -> tuple[list[int], list[int], list[float]]:
    ids, mask, lp = [], [], []
    for role, part in turns:
        tokens = part if role == "assistant" else tokenizer.encode(part, add_special_tokens=False)
        ids += tokens
        mask += [int(role == "assistant")] * len(tokens)
        lp += [-(j + 1) / 100 for j in range(len(tokens))] if role == "assistant" else [0.0] * len(tokens)
    return ids, mask, lp


def test_code_runs_in_the_sandbox_and_its_output_is_appended_masked(tokenizer):
    final = "The answer is 42.<|im_end|>"
    out = _run(tokenizer, {"What is 6*7?": [RUN.format("print(6 * 7)") + TAIL, final]})
    ids, mask, lp = _row(out, 0)
    turn1 = _sampled(tokenizer, RUN.format("print(6 * 7)"))
    expected = _expect(tokenizer, [("assistant", turn1), ("tool", "<interpreter>\n42\n\n</interpreter>\n\n"),
                                   ("assistant", tokenizer.encode(final, add_special_tokens=False))])
    assert ids == expected[0]  # the tail after </code> is gone; the sandbox printed 42
    assert mask == expected[1]  # the interpreter's tokens are never trained
    torch.testing.assert_close(torch.tensor(lp), torch.tensor(expected[2]))
    extras = out.non_tensor_batch
    assert (extras["num_turns"][0], extras["tool_calls"][0], extras["stop_reason"][0]) == (4, 1, "no_call")  # verl counts the prompt as a turn
    assert extras["last_turn_start"][0] == 0  # the reward reads the whole response, code and output included
    assert extras["turns"][0] == [["assistant", 0, len(turn1)],
                                  ["tool", len(turn1), len(ids) - len(tokenizer.encode(final, add_special_tokens=False))],
                                  ["assistant", len(ids) - len(tokenizer.encode(final, add_special_tokens=False)), len(ids)]]


def test_max_assistant_turns_ends_after_the_turn_without_running_its_code(tokenizer):
    turn = RUN.format("print(1 + 1)")
    out = _run(tokenizer, {"Keep going": [turn + TAIL] * 3}, max_assistant_turns=2)
    ids, mask, _ = _row(out, 0)
    sampled = _sampled(tokenizer, turn)
    answer = "<interpreter>\n2\n\n</interpreter>\n\n"
    assert (ids, mask) == _expect(tokenizer, [("assistant", sampled), ("tool", answer), ("assistant", sampled)])[:2]
    extras = out.non_tensor_batch
    assert (extras["num_turns"][0], extras["tool_calls"][0], extras["stop_reason"][0]) == (4, 1, "max_assistant_turns")


def test_a_failing_program_or_tool_costs_only_its_own_sample(tokenizer):
    final = "Done.<|im_end|>"
    programs = {"fine": "print(6 * 7)", "raises": "1 / 0", "tool raises": "explode()", "tool hangs": "hang()"}
    try:
        out = _run(tokenizer, {q: [RUN.format(code) + TAIL, final] for q, code in programs.items()}, tool_timeout_s=1.0)
    finally:
        RELEASE.set()
    texts = [tokenizer.decode([t for t, m in zip(*_row(out, r)[:2]) if m == 0]) for r in range(4)]
    assert texts[0] == "<interpreter>\n42\n\n</interpreter>\n\n"
    assert texts[1].startswith("<interpreter>\nTraceback") and "ZeroDivisionError" in texts[1]  # the program's own error
    assert texts[2] == "Error when executing tool: the sandbox went away"  # verl's text, without the tags
    assert texts[3] == "Error when executing tool: no answer within 1 s"
    extras = out.non_tensor_batch
    assert list(extras["stop_reason"]) == ["no_call"] * 4  # every sample went on to its final turn
    assert [extras["tool_errors"][r] for r in range(4)] == [{}, {}, {"code_interpreter/error": 1},
                                                            {"code_interpreter/error": 1}]
    for r in range(4):
        ids, mask, _ = _row(out, r)
        assert tokenizer.decode(ids).endswith(final) and mask[-1] == 1


def test_verls_agent_loop_config_file_names_the_port(tmp_path):
    path = tmp_path / "spo_agent.yaml"  # the layout of verl's recipe/spo/config/spo_agent.yaml
    path.write_text("- name: spo_tool_agent\n  _target_: recipe.spo.agent_loop.spo_tool_agent_loop.SPOToolAgentLoop\n")
    assert resolve_agent_loops({"spo_tool_agent"}, str(path)) == {"spo_tool_agent": SPOToolAgentLoop}
    assert resolve_agent_loops({"spo_tool_agent"}, None) == {"spo_tool_agent": SPOToolAgentLoop}


def test_code_blocks_drop_the_markdown_fence():
    assert code_blocks("a<code>\n```python\nx = 1\nprint(x)\n```\n</code>b<code>print(2)</code>") == \
        ["x = 1\nprint(x)", "print(2)"]


def test_format_spo_without_a_code_interpreter_fails_at_start_up(tokenizer):
    from rlfoundry.trainer.config import load_config
    from rlfoundry.workers.rollout.agent_loop import AgentLoopError, build_agent_loop

    rollout = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true",
                           "actor_rollout_ref.rollout.multi_turn.format=spo"]).actor_rollout_ref.rollout
    with pytest.raises(AgentLoopError, match="spo_tool_agent loop runs code with a tool named 'code_interpreter'"):
        build_agent_loop(ScriptedPolicy(tokenizer, {}), tokenizer, rollout)
