"""The HF rollout engine samples from image + text prompts, and the trainer's forward on its output
gives back the log-probs it sampled with."""

from __future__ import annotations

import torch

from rlfoundry.engines.base import LogProbs, MicroBatching
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.config.schema import FSDPConfig
from rlfoundry.protocol import DataProto
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.engines.test_fsdp_vision import image_batch  # noqa: F401 - fixture


def test_generates_from_image_and_text_and_log_probs_match_a_recompute(process_group, tiny_vlm_dir, image_batch):
    tp = image_batch.batch["input_ids"].shape[1] - image_batch.batch["responses"].shape[1]
    prompts = DataProto.from_dict(
        tensors={k: image_batch.batch[k][..., :tp] for k in ("input_ids", "attention_mask", "position_ids")},
        non_tensors={"multi_modal_inputs": image_batch.non_tensor_batch["multi_modal_inputs"]})
    engine = FSDPEngine.build(FSDPEngineConfig(path=str(tiny_vlm_dir), fsdp=FSDPConfig(), optim=None, grad_clip=None,
                                               cpu_kernels="auto"), "cpu", role="actor")
    tok_pad, tok_eos = engine.module.config.text_config.pad_token_id, engine.module.config.text_config.eos_token_id
    rollout = HFRollout(engine.rollout_module(), {"n": 2, "response_length": 8, "temperature": 1.0, "seed": 3},
                        pad_token_id=tok_pad, eos_token_id=tok_eos, cpu_kernels=True)
    out = rollout.generate_sequences(prompts)
    assert out.batch["responses"].shape == (8, 8) and out.batch["position_ids"].shape == (8, 3, tp + 8)
    assert len(out.non_tensor_batch["multi_modal_inputs"]) == 8  # each sample keeps its prompt's pixels
    # response positions go on from the prompt's last one in all three axes (as the model's own generate does)
    last = prompts.batch["position_ids"][..., -1].repeat_interleave(2, 0)
    assert torch.equal(out.batch["position_ids"][..., tp], last + 1)
    recomputed = engine.infer_batch(out, LogProbs(1.0), MicroBatching(3))["log_probs"]
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(recomputed[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)
    # the pixels steer the samples: zeroing them changes the first token's distribution of an image row
    blank = prompts.select(deepcopy=True)
    blank.non_tensor_batch["multi_modal_inputs"][0]["pixel_values"].zero_()
    rollout.load_state_dict({"seed": 3, "calls": 0})
    first = HFRollout(engine.rollout_module(), {"n": 2, "response_length": 1, "temperature": 1.0, "seed": 3},
                      pad_token_id=tok_pad, eos_token_id=tok_eos).generate_sequences
    assert not torch.allclose(first(blank).batch["rollout_log_probs"][:2], first(prompts).batch["rollout_log_probs"][:2])
