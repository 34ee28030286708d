"""The SGLang rollout on image + text prompts (issue 37, "the engines agree"), for real on CPU (SGLang's CPU
engine, scripts/setup_sglang_cpu.sh): greedy SGLang gives the HF engine's tokens on the same image rows, and
SGLang's log-probs of its samples are the actor's (FSDP2 forward with the pixel inputs) within the text
contract's SGLang bound (1e-4, fp32).

Runs in the SGLang environment (``bash scripts/test_sglang.sh``); skipped without SGLang. The rows are the vLLM
test's (tests/workers/test_vllm_vision.py), through the data set with Qwen2-VL's PIL image processor: the
environment's torchvision is an import-only stand-in, which transformers would otherwise pick to resize.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.workers import local_worker, worker_config
from tests.workers.test_vllm_rollout import _max_abs, _with_meta
from tests.workers.test_vllm_vision import TP, image_rows, vlm_dir  # noqa: F401 - fixture

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
LOGP_TOL = 1e-4  # the rollout contract's SGLang bound
OVERRIDES = ["rollout.name=sglang", "rollout.dtype=float32", "rollout.load_format=dummy_dtensor",
             f"rollout.prompt_length={TP}", "rollout.response_length=8", "rollout.max_num_seqs=16"]
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed here; run "
                                                     "scripts/setup_sglang_cpu.sh then scripts/test_sglang.sh")]


@pytest.fixture(scope="module")
def image_prompts(vlm_dir, tmp_path_factory):  # noqa: F811
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlfoundry.models.vision import load_processor

    processor = load_processor(vlm_dir)
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(vlm_dir)
    return image_rows(processor, tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def group(vlm_dir):  # noqa: F811
    return local_worker(worker_config(vlm_dir, OVERRIDES), role="actor_rollout")


def test_sglang_generates_from_images_as_the_hf_engine_and_the_actor_score_it(group, image_prompts):
    from PIL import Image

    from rlfoundry.workers.rollout.hf_rollout import HFRollout
    from rlfoundry.workers.rollout.sglang_rollout import SGLangRollout

    w = group.worker
    assert isinstance(w.rollout, SGLangRollout)
    image_id = w.actor.module.config.image_token_id
    assert all(int((r == image_id).sum()) >= 1 for r in image_prompts.batch["input_ids"][:4])  # expanded runs

    # greedy: SGLang's tokens are the HF engine's (same module, same pixels), positions continue alike
    greedy = _with_meta(image_prompts, validate=True)
    out = group.generate_sequences(greedy)
    hf = HFRollout(w.actor.module, w.config.rollout, pad_token_id=w.tokenizer.pad_token_id,
                   eos_token_id=w.tokenizer.eos_token_id).generate_sequences(greedy)
    assert torch.equal(out.batch["responses"], hf.batch["responses"])
    assert torch.equal(out.batch["position_ids"], hf.batch["position_ids"])
    assert out.batch["position_ids"].shape == (5, 3, TP + 8)
    mask = out.batch["response_mask"]
    assert _max_abs(out.batch["rollout_log_probs"], hf.batch["rollout_log_probs"], mask) < LOGP_TOL

    # the pixels reach SGLang: a blanked image changes its greedy first token's log-prob
    blank = image_prompts.select(deepcopy=True)
    pixels = blank.non_tensor_batch["multi_modal_inputs"][0]
    blank.non_tensor_batch["multi_modal_inputs"][0] = {**pixels, "pixel_values": torch.zeros_like(pixels["pixel_values"])}
    blank.non_tensor_batch["multi_modal_data"][0] = {"image": [Image.new("RGB", (32, 32), "black")]}
    blanked = group.generate_sequences(_with_meta(blank, validate=True)).batch["rollout_log_probs"][0, 0]
    assert abs(float(blanked - out.batch["rollout_log_probs"][0, 0])) > 1e-4

    # sampled: SGLang's log-probs of its tokens are the actor's (FSDP2 forward with the pixel inputs)
    sampled = group.generate_sequences(_with_meta(image_prompts, temperature=1.0, n=2))
    assert len(sampled.non_tensor_batch["multi_modal_inputs"]) == 10  # each sample keeps its pixels
    assert sampled.batch["position_ids"].shape == (10, 3, TP + 8)
    actor = group.compute_log_prob(_with_meta(sampled, temperature=1.0)).batch["old_log_probs"]
    mask = sampled.batch["response_mask"]
    assert int(mask.sum()) > 10
    assert _max_abs(actor, sampled.batch["rollout_log_probs"], mask) < LOGP_TOL
    # no sampled image placeholder (the policy's vocabulary leaves them out, as the HF engine's does)
    placeholders = [image_id, w.actor.module.config.video_token_id]
    assert not torch.isin(sampled.batch["responses"], torch.tensor(placeholders)).any()
