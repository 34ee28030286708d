"""``model.use_fused_kernels`` on CUDA (the GPU tier): with CUDA's default bf16 compute the fused head's
log-probs equal the logits path's to bf16 rounding, and an update's peak GPU memory above its start falls
by at least the (tokens, vocabulary) logits it no longer holds. The CPU proves the math
(tests/engines/test_fsdp_fused_kernels.py, tests/utils/test_fused_logprobs.py); this checks CUDA's
kernels and allocator. Written without a GPU session: not run yet (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.protocol import DataProto

pytestmark = pytest.mark.gpu

VOCAB, ROWS, TP, TR = 65536, 8, 16, 512  # response logits: 4096 x 65536 bf16 = 512 MiB


@pytest.fixture(scope="module")
def cuda_group():
    from tests.engines.test_fsdp_utils import world_of_one

    return world_of_one("cpu:gloo,cuda:nccl")


@pytest.fixture(scope="module")
def big_vocab_dir(tmp_path_factory):
    from rlfoundry.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("fused-gpu"), vocab_size=VOCAB, tie_word_embeddings=True)


def _data() -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (ROWS, TP + TR), generator=gen)
    mask = torch.ones_like(ids)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                                        "responses": ids[:, TP:], "response_mask": mask[:, TP:]}).to("cuda")


def _loss(outputs, batch, info) -> LossOutput:
    m = batch["response_mask"]
    loss = ((-outputs["log_probs"] - 0.01 * outputs["entropy"]) * m).sum() / info["batch_num_tokens"]
    return LossOutput(loss, {"actor/loss": float(loss.detach())}, {})


def _run(model_dir, fused: bool, data: DataProto) -> tuple[dict, int]:
    """Log-probs, then the peak GPU bytes above the start of a second update (the first made Adam's moments)."""
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels="off",
                              optim=OptimConfig(lr=1e-6), use_fused_kernels=fused)
    engine = FSDPEngine.build(config, "cuda", role="actor")
    spec, plan = LogProbs(entropy=True), UpdatePlan(mini_batch_size=ROWS, micro=MicroBatching(size=ROWS))
    out = engine.infer_batch(data, spec, MicroBatching(size=ROWS))
    engine.train_batch(data, spec, _loss, plan)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    engine.train_batch(data, spec, _loss, plan)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    del engine
    torch.cuda.empty_cache()
    return out, peak


def test_fused_head_on_cuda_same_log_probs_less_memory(cuda_group, big_vocab_dir):
    data = _data()
    plain, plain_peak = _run(big_vocab_dir, False, data)
    fused, fused_peak = _run(big_vocab_dir, True, data)
    diff = (fused["log_probs"] - plain["log_probs"]).abs()
    logits_bytes = ROWS * TR * VOCAB * 2
    print(f"gpu tier: fused vs logits log-probs max {diff.max():.2e} mean {diff.mean():.2e}; update peak "
          f"{plain_peak / 2**20:.0f} -> {fused_peak / 2**20:.0f} MiB (bf16 logits {logits_bytes / 2**20:.0f} MiB)")
    assert diff.max() <= 5e-2 and diff.mean() <= 5e-3
    assert fused_peak <= plain_peak - logits_bytes
