"""Partial rollout (``trainer/ppo/partial_rollout.py``) on the real HF engine and a tiny model.

Generated in chunks with the weights unchanged, the samples are the one-call generation's, token for
token (greedy) with the same log-probs; when the weights change between two chunks, the tokens
sampled before the change keep their tokens and log-probs, and every later token's log-prob is the
new policy's, so ``rollout_log_probs`` is the behaviour policy token by token.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlfoundry.protocol import DataProto
from rlfoundry.trainer.ppo.partial_rollout import ChunkedGeneration
from rlfoundry.workers.rollout.hf_rollout import HFRollout

EOS = [3]
WIDTH = 12


def _model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config).eval()


def _engine(model) -> HFRollout:
    cfg = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": False, "response_length": WIDTH,
           "seed": 3, "val_kwargs": {}}
    return HFRollout(model, OmegaConf.create(cfg), pad_token_id=0, eos_token_id=EOS, cpu_kernels=False)


def _prompts() -> DataProto:
    ids = torch.tensor([[0, 0, 7, 8, 9], [11, 12, 13, 14, 15], [0, 20, 21, 22, 23]])
    mask = (ids != 0).long()
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={"do_sample": False})


def _chunked(engine: HFRollout, chunk: int) -> ChunkedGeneration:
    return ChunkedGeneration(engine.generate_sequences, response_length=WIDTH, chunk_tokens=chunk, pad_id=0,
                             eos_ids=EOS)


def _scored(model, out: DataProto) -> torch.Tensor:
    """log π(response token | everything before it) under ``model``, (B, WIDTH)."""
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits[:, -WIDTH - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, out.batch["responses"][..., None])[..., 0]


@pytest.mark.numerics
def test_chunks_with_unchanged_weights_give_the_one_call_samples():
    model = _model()
    whole = _engine(model).generate_sequences(_prompts())
    out = _chunked(_engine(model), chunk=5).generate(_prompts(), 1, boundary=lambda: 0)
    assert torch.equal(out.batch["responses"], whole.batch["responses"])
    assert torch.equal(out.batch["response_mask"], whole.batch["response_mask"])
    valid = whole.batch["response_mask"].bool()
    # chunked decode restarts the KV cache at chunk boundaries: fp32 rounding only: the same forward in another order
    # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    assert torch.allclose(out.batch["rollout_log_probs"][valid], whole.batch["rollout_log_probs"][valid], atol=1e-5)
    assert torch.equal(out.batch["input_ids"], whole.batch["input_ids"])


@pytest.mark.numerics
def test_a_weight_change_between_chunks_keeps_the_earlier_tokens_and_scores_the_later_by_the_new_policy():
    model = _model()
    old = _model()  # a copy of the weights before the change
    before = _engine(old).generate_sequences(_prompts())
    versions = iter([0, 1, 1])

    def boundary() -> int:  # the sync between chunk 1 and chunk 2: the weights change in place
        version = next(versions)
        if version == 1 and not getattr(boundary, "synced", False):
            boundary.synced = True
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
        return version

    chunked = _chunked(_engine(model), chunk=4)
    out = chunked.generate(_prompts(), 1, boundary)
    assert chunked.engine_calls >= 2
    first = slice(0, 4)
    assert torch.equal(out.batch["responses"][:, first], before.batch["responses"][:, first])  # intact
    # chunked decode restarts the KV cache at chunk boundaries: fp32 rounding only: the same forward in another order
    # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    assert torch.allclose(out.batch["rollout_log_probs"][:, first], before.batch["rollout_log_probs"][:, first], atol=1e-5)
    later = out.batch["response_mask"].bool().clone()
    later[:, first] = False
    assert later.any(), "some sample must go on after the change"
    new_scores = _scored(model, out)
    # rescored by a forward in another layout than the scorer's: fp32 rounding (the change checked below is >1e-2)
    assert torch.allclose(out.batch["rollout_log_probs"][later], new_scores[later], atol=1e-4)
    assert not torch.allclose(_scored(old, out)[later], new_scores[later], atol=1e-2)  # the change is visible
    live = out.batch["response_mask"].sum(-1) > 4
    assert all(out.non_tensor_batch["param_version_start"][i] == 0 for i in range(len(out)))
    assert all(out.non_tensor_batch["param_version_end"][i] == (1 if live[i] else 0) for i in range(len(out)))
