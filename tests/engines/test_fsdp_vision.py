"""The FSDP engine on a vision-language model: the pixel inputs reach the forward, log-probs do not
depend on micro-batching, and model.freeze_vision_tower keeps the tower out of the update."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.data.rl_dataset import RLHFDataset, collate_fn
from rlfoundry.engines.base import LogProbs, MicroBatching
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models.vision import load_processor
from rlfoundry.protocol import DataProto
from rlfoundry.utils.torch_functional import logprobs_from_logits
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture

RESPONSE = 6


def _png(size, colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def image_batch(tiny_vlm_dir, tmp_path_factory) -> DataProto:
    """Four prompts (one text-only, one with two images), each with a random right-padded response."""
    path = tmp_path_factory.mktemp("vl") / "d.parquet"
    rows = [
        {"prompt": "<image>Which colour?", "images": [{"bytes": _png((32, 32), "red")}]},
        {"prompt": "Count: <image><image>", "images": [{"bytes": _png((48, 32), "blue")}, {"bytes": _png((16, 16), "red")}]},
        {"prompt": "no picture here", "images": []},
        {"prompt": "<image>Big?", "images": [{"bytes": _png((64, 48), "green")}]},
    ]
    pq.write_table(pa.Table.from_pylist([{"data_source": "t", "prompt": [{"role": "user", "content": r["prompt"]}],
                                          "images": r["images"], "reward_model": {"ground_truth": "1"}} for r in rows]), path)
    processor = load_processor(tiny_vlm_dir)
    ds = RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 48}, processor=processor)
    batch = collate_fn([ds[i] for i in range(len(ds))])
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(4, 200, (4, RESPONSE), generator=g)
    lengths = torch.tensor([6, 3, 5, 1])
    response_mask = (torch.arange(RESPONSE)[None] < lengths[:, None]).long()
    responses = responses.masked_fill(response_mask == 0, processor.tokenizer.pad_token_id)
    prompt_pos = batch["position_ids"]  # (B, 3, Tp): text after the prompt goes on from its last position
    steps = torch.arange(1, RESPONSE + 1).view(1, 1, -1)
    return DataProto.from_dict(
        tensors={"input_ids": torch.cat([batch["input_ids"], responses], 1),
                 "attention_mask": torch.cat([batch["attention_mask"], response_mask], 1),
                 "position_ids": torch.cat([prompt_pos, prompt_pos[..., -1:] + steps], -1),
                 "responses": responses, "response_mask": response_mask},
        non_tensors={"multi_modal_inputs": batch["multi_modal_inputs"]})


def _engine(path, optim=None, **fields) -> FSDPEngine:
    config = FSDPEngineConfig(path=str(path), fsdp=FSDPConfig(), optim=optim, grad_clip=1.0, cpu_kernels="off", **fields)
    return FSDPEngine.build(config, "cpu", role="actor")


def plain_logits(module, data: DataProto) -> torch.Tensor:
    """One plain HF forward over the whole batch with every row's pixels (the model's logits)."""
    inputs = data.non_tensor_batch["multi_modal_inputs"]
    pixels = {k: torch.cat([r[k] for r in inputs if r]) for k in ("pixel_values", "image_grid_thw")}
    b = data.batch
    with torch.no_grad():
        return module(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                      position_ids=b["position_ids"].transpose(0, 1), **pixels).logits


def _reference_log_probs(module, data: DataProto) -> torch.Tensor:
    b, logits = data.batch, plain_logits(module, data)
    # the policy's vocabulary leaves out the image / video placeholders (never sampled)
    logits[..., [module.config.image_token_id, module.config.video_token_id]] = float("-inf")
    lp = logprobs_from_logits(logits[:, -RESPONSE - 1:-1], b["responses"])
    return lp * b["response_mask"]


@pytest.mark.numerics
def test_log_probs_take_the_pixels_and_ignore_micro_batching(process_group, tiny_vlm_dir, image_batch):
    engine = _engine(tiny_vlm_dir)
    outs = {mb: engine.infer_batch(image_batch, LogProbs(1.0, entropy=True), MicroBatching(mb)) for mb in (1, 2, 4)}
    for mb in (1, 2):
        # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(outs[mb]["log_probs"], outs[4]["log_probs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(outs[mb]["entropy"], outs[4]["entropy"], atol=1e-5, rtol=0)
    # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(outs[1]["log_probs"], _reference_log_probs(engine.module, image_batch), atol=1e-5, rtol=0)
    # the images matter: the same tokens without their pixels' features give other log-probs
    blank = image_batch.select(deepcopy=True)
    for r in blank.non_tensor_batch["multi_modal_inputs"]:
        if r:
            r["pixel_values"] = torch.zeros_like(r["pixel_values"])
    other = engine.infer_batch(blank, LogProbs(1.0), MicroBatching(4))["log_probs"]
    assert (other[0] - outs[4]["log_probs"][0]).abs().max() > 1e-4
    torch.testing.assert_close(other[2], outs[4]["log_probs"][2], atol=1e-5, rtol=0)  # the text-only row


def test_freeze_vision_tower_keeps_the_tower_out_of_the_update(process_group, tiny_vlm_dir, image_batch):
    from rlfoundry.engines.base import LossOutput, UpdatePlan

    engine = _engine(tiny_vlm_dir, optim=OptimConfig(lr=1e-2), freeze_vision_tower=True)
    module = engine.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert all(not p.requires_grad for n, p in module.named_parameters() if ".visual." in f".{n}")

    def loss_fn(outputs, batch, info):
        return LossOutput(-(outputs["log_probs"] * batch["response_mask"]).sum() / info["batch_num_tokens"], {}, {})

    plan = UpdatePlan(mini_batch_size=4, micro=MicroBatching(2))
    engine.train_batch(image_batch, LogProbs(1.0), loss_fn, plan)
    changed = {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and not any(".visual." in f".{n}" for n in changed)
    assert any("embed_tokens" in n or "layers" in n for n in changed)


def test_megatron_refuses_a_vision_language_model(tiny_vlm_dir, tiny_model_dir):
    from omegaconf import OmegaConf

    from rlfoundry.engines.megatron.plugin import PLUGIN

    def errors(path):
        return [e for e in PLUGIN.check(OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(path)}}}), [], 1)
                if "vision-language" in e]

    assert errors(tiny_vlm_dir) and "strategy=fsdp" in errors(tiny_vlm_dir)[0]
    assert not errors(tiny_model_dir)
