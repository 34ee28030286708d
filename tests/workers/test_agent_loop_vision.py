"""The multi-turn agent loop on image rows (docs/vision.md): every turn's engine call gets the prompt's
pixels and 3-D rotary positions, the first turn is the single-turn rollout's, and the trainer takes the
loop's output (pixel inputs, the model's own positions) for its log-probs and an update."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlfoundry.config.schema import FSDPConfig, MultiTurnConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models.vision import RopeIndex, load_processor
from rlfoundry.protocol import DataProto
from rlfoundry.tools.registry import initialize_tools_from_config
from rlfoundry.workers.rollout.agent_loop import AgentLoop, AgentLoopError
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.engines.test_fsdp_vision import image_batch  # noqa: F401 - fixture
from tests.workers import scripted_turn

TOOLS = Path(__file__).resolve().parents[2] / "rlfoundry" / "config" / "tools" / "calculator.yaml"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


class Recording:
    """The HF engine, with every call's input kept; ``first`` (token ids) answers the first call instead."""

    def __init__(self, rollout: HFRollout, first: list[int] | None = None):
        self.rollout, self.first, self.seen = rollout, first, []

    def __getattr__(self, name):
        return getattr(self.rollout, name)

    def generate_sequences(self, batch: DataProto) -> DataProto:
        self.seen.append(batch)
        if self.first is None or len(self.seen) > 1:
            return self.rollout.generate_sequences(batch)
        return scripted_turn(batch, self.first)


@pytest.fixture(scope="module")
def setup(process_group, tiny_vlm_dir, image_batch):  # noqa: F811
    processor = load_processor(tiny_vlm_dir)
    engine = FSDPEngine.build(FSDPEngineConfig(path=str(tiny_vlm_dir), fsdp=FSDPConfig(), optim=OptimConfig(lr=1e-3),
                                               grad_clip=1.0, cpu_kernels="off"), "cpu", role="actor")
    text = engine.module.config.text_config
    tp = image_batch.batch["input_ids"].shape[1] - image_batch.batch["responses"].shape[1]
    prompts = DataProto.from_dict(  # 4 rows: one image, two images, text only, one image
        tensors={k: image_batch.batch[k][..., :tp] for k in ("input_ids", "attention_mask", "position_ids")},
        non_tensors={"multi_modal_inputs": image_batch.non_tensor_batch["multi_modal_inputs"]}, meta_info={"n": 1})

    def rollout(response_length):
        return HFRollout(engine.rollout_module(), {"n": 1, "response_length": response_length, "do_sample": False},
                         pad_token_id=text.pad_token_id, eos_token_id=text.eos_token_id)

    return engine, processor.tokenizer, prompts, rollout, RopeIndex(engine.module.config)


def _agent_loop(engine, tokenizer, response_length, **config):
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}
    return AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True, **config), tools, response_length)


def _model_positions(rope_index, image_token_id, data: DataProto) -> torch.Tensor:
    """The model's own get_rope_index over each whole row (prompt + response), (B, 3, T)."""
    ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
    inputs = [r for r in data.non_tensor_batch["multi_modal_inputs"] if r]
    grid = torch.cat([r["image_grid_thw"] for r in inputs]) if inputs else None
    return rope_index(ids, mask, (ids == image_token_id).long(), grid).transpose(0, 1)


def test_first_turn_is_the_single_turn_rollout_with_the_pixels(setup):
    engine, tokenizer, prompts, rollout, _ = setup
    single = rollout(8).generate_sequences(prompts)
    recording = Recording(rollout(8))
    out = _agent_loop(recording, tokenizer, 8, max_assistant_turns=1).generate_sequences(prompts)
    # the engine got the rows' own pixel inputs and 3-D positions (text row: {} and 0, 1, … in each axis)
    seen = recording.seen[0]
    assert seen.batch["position_ids"].shape[:2] == (4, 3)
    for i in range(4):
        mask = prompts.batch["attention_mask"][i].bool()
        assert torch.equal(seen.batch["position_ids"][i][:, seen.batch["attention_mask"][i].bool()],
                           prompts.batch["position_ids"][i][:, mask])
        row_inputs = prompts.non_tensor_batch["multi_modal_inputs"][i]
        assert seen.non_tensor_batch["multi_modal_inputs"][i] is row_inputs if row_inputs else \
            seen.non_tensor_batch["multi_modal_inputs"][i] == {}
    # greedy: the same tokens, log-probs (bit for bit) and (B, 3, T) positions as the single-turn rollout
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs"):
        assert torch.equal(out.batch[key], single.batch[key]), key
    assert out.non_tensor_batch["multi_modal_inputs"][1] is prompts.non_tensor_batch["multi_modal_inputs"][1]


def test_a_tool_call_then_an_answer_on_image_rows_trains(setup):
    engine, tokenizer, prompts, rollout, rope_index = setup
    call = tokenizer.encode(CALL + "<|im_end|>", add_special_tokens=False)
    recording = Recording(rollout(48), first=call)
    out = _agent_loop(recording, tokenizer, 48 + len(call), max_assistant_turns=2).generate_sequences(prompts)
    assert list(out.non_tensor_batch["tool_calls"]) == [1] * 4 and len(recording.seen) == 2
    # turn 2's engine call: the prompt, the call, the tool's answer; the pixels again, the positions going on
    second = recording.seen[1]
    tp = prompts.batch["input_ids"].shape[1]
    for i in range(4):
        ids = second.batch["input_ids"][i][second.batch["attention_mask"][i].bool()].tolist()
        prompt = prompts.batch["input_ids"][i][prompts.batch["attention_mask"][i].bool()].tolist()
        assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(call)] == call
        row_inputs = prompts.non_tensor_batch["multi_modal_inputs"][i]
        assert second.non_tensor_batch["multi_modal_inputs"][i] is row_inputs if row_inputs else \
            second.non_tensor_batch["multi_modal_inputs"][i] == {}
        assert "42" in tokenizer.decode(ids[len(prompt) + len(call):])
    image_id = engine.module.config.image_token_id
    # every engine call's positions are the model's own over its context (exact)
    for seen in recording.seen:
        assert torch.equal(seen.batch["position_ids"][seen.batch["attention_mask"].bool().unsqueeze(1).expand(-1, 3, -1)],
                           _model_positions(rope_index, image_id, seen)[
                               seen.batch["attention_mask"].bool().unsqueeze(1).expand(-1, 3, -1)])
    # the output: (B, 3, T) positions equal to the model's own over prompt + whole trajectory, pixels kept
    assert out.batch["position_ids"].shape == (4, 3, tp + 48 + len(call))
    valid = out.batch["attention_mask"].bool().unsqueeze(1).expand(-1, 3, -1)
    assert torch.equal(out.batch["position_ids"][valid], _model_positions(rope_index, image_id, out)[valid])
    assert all(a is b for a, b in zip(out.non_tensor_batch["multi_modal_inputs"],
                                      prompts.non_tensor_batch["multi_modal_inputs"]))
    # the actor's recompute gives back turn 2's log-probs (sampled with the pixels; turn 1 was scripted)
    log_probs = engine.infer_batch(out, LogProbs(1.0), MicroBatching(2))["log_probs"]
    turn2 = out.batch["response_mask"].bool().clone()
    turn2[:, :len(call)] = False
    assert turn2.sum() > 0
    torch.testing.assert_close(log_probs[turn2], out.batch["rollout_log_probs"][turn2], atol=1e-4, rtol=0)
    # one update on the trajectories: finite loss, the weights move
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    losses = []

    def loss_fn(outputs, batch, info):
        loss = -(outputs["log_probs"] * batch["response_mask"]).sum() / info["batch_num_tokens"]
        losses.append(loss.detach())
        return LossOutput(loss, {}, {})

    engine.train_batch(out, LogProbs(1.0), loss_fn, UpdatePlan(mini_batch_size=4, micro=MicroBatching(2)))
    assert len(losses) == 2 and all(torch.isfinite(x) for x in losses)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in engine.module.named_parameters())
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


def test_a_loop_that_does_not_take_images_refuses_image_rows(setup, monkeypatch):
    engine, tokenizer, prompts, rollout, _ = setup
    from rlfoundry.workers.rollout.agent_loop import AgentLoopBase, base

    class TextOnly(AgentLoopBase):
        async def run(self, sampling_params, **row):
            raise AssertionError("not reached")

    # registered for this test only: the registry is process-wide, and other tests list what it holds
    monkeypatch.setitem(base._REGISTRY, "text_only_test_agent", TextOnly)

    loop = _agent_loop(rollout(4), tokenizer, 4)
    names = np.array(["text_only_test_agent"] * 4, dtype=object)
    data = DataProto(batch=prompts.batch, non_tensor_batch={**prompts.non_tensor_batch, "agent_name": names},
                     meta_info=prompts.meta_info)
    with pytest.raises(AgentLoopError, match="does not take image rows"):
        loop.generate_sequences(data)
    with pytest.raises(AgentLoopError, match="use_inference_chat_template"):
        _agent_loop(rollout(4), tokenizer, 4, use_inference_chat_template=True).generate_sequences(prompts)
