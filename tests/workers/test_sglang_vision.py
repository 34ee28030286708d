"""The SGLang rollout on image + text prompts (issue 37, "the engines agree"), for real on CPU (SGLang's CPU
engine, scripts/setup_sglang_cpu.sh): greedy SGLang gives the HF engine's tokens on the same image rows, and
SGLang's log-probs of its samples are the actor's (FSDP2 forward with the pixel inputs) within the text
contract's SGLang bound (1e-4, fp32); the same through the multi-turn agent loop.

Runs in the SGLang environment (``bash scripts/test_sglang.sh``); skipped without SGLang. The rows are the vLLM
test's (tests/workers/test_vllm_vision.py), through the data set with Qwen2-VL's PIL image processor, which
``load_processor`` takes where torchvision is the environment's import-only stand-in.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.workers import local_worker, worker_config
from tests.workers.test_vllm_rollout import _with_meta
from tests.workers.test_vllm_vision import (  # noqa: F401 - vlm_dir: fixture
    TP,
    agent_loop_as_hf,
    an_update_reaches_the_engine,
    greedy_as_hf,
    image_rows,
    sampled_as_actor,
    two_grpo_steps_on_image_rows,
    vlm_dir,
)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
LOGP_TOL = 1e-4  # the rollout contract's SGLang bound
OVERRIDES = ["rollout.name=sglang", "rollout.dtype=float32", "rollout.load_format=dummy_dtensor",
             f"rollout.prompt_length={TP}", "rollout.response_length=8", "rollout.max_num_seqs=16",
             "rollout.max_model_len=320"]  # room for the agent loop's tool turn after a prompt
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed here; run "
                                                     "scripts/setup_sglang_cpu.sh then scripts/test_sglang.sh")]


@pytest.fixture(scope="module")
def image_prompts(vlm_dir, tmp_path_factory):  # noqa: F811
    from rlfoundry.models.vision import load_processor

    processor = load_processor(vlm_dir)  # Qwen2-VL's PIL image processor here (the torchvision is a stand-in)
    assert processor.image_processor.backend == "pil"
    return image_rows(processor, tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def group(vlm_dir):  # noqa: F811
    return local_worker(worker_config(vlm_dir, OVERRIDES), role="actor_rollout")


def test_sglang_generates_from_images_as_the_hf_engine_and_the_actor_score_it(group, image_prompts):
    from PIL import Image

    from rlfoundry.workers.rollout.sglang_rollout import SGLangRollout

    assert isinstance(group.worker.rollout, SGLangRollout)
    out = greedy_as_hf(group, image_prompts)  # greedy = the HF engine's tokens and 3-D positions

    # the pixels reach SGLang: a blanked image changes its greedy first token's log-prob
    blank = image_prompts.select(deepcopy=True)
    pixels = blank.non_tensor_batch["multi_modal_inputs"][0]
    blank.non_tensor_batch["multi_modal_inputs"][0] = {**pixels, "pixel_values": torch.zeros_like(pixels["pixel_values"])}
    blank.non_tensor_batch["multi_modal_data"][0] = {"image": [Image.new("RGB", (32, 32), "black")]}
    blanked = group.generate_sequences(_with_meta(blank, validate=True)).batch["rollout_log_probs"][0, 0]
    assert abs(float(blanked - out.batch["rollout_log_probs"][0, 0])) > 1e-4

    # sampled: SGLang's log-probs of its tokens are the actor's (FSDP2 forward with the pixel inputs)
    sampled_as_actor(group, image_prompts, LOGP_TOL)


def test_the_agent_loop_drives_sglang_on_image_rows_as_the_hf_engine(group, image_prompts):
    """single_turn_agent and tool_agent over SGLang on the image rows (the loop's requests carry each image
    row's pixel inputs, which SGLang takes as processor output, on every turn): greedy tokens and 3-D
    positions equal the loop over the HF engine's, and SGLang's sampled turn after a tool reply is scored by
    the actor within the bound."""
    agent_loop_as_hf(group, image_prompts, LOGP_TOL)


def test_an_update_reaches_sglang_and_verify_mode_checks_it(group, image_prompts):
    """A PPO step on image rows syncs the vision-language weights into SGLang under the checkpoint's names,
    verify mode (on by default) compares the engine's digests with the actor's and passes, and SGLang's
    log-probs after the step are the updated actor's (its multimodal embedding cache emptied)."""
    an_update_reaches_the_engine(group, image_prompts, LOGP_TOL)


@pytest.mark.slow
def test_two_grpo_steps_on_image_rows_with_sglang(vlm_dir, tmp_path):  # noqa: F811
    two_grpo_steps_on_image_rows("sglang", vlm_dir, tmp_path, LOGP_TOL)
