"""The update on one GPU without the FSDP2 wrapper (issue 34), on CUDA: what
tests/engines/test_fsdp_single_rank.py proves on the CPU, again with CUDA's kernels and its default
mixed precision (no ``mixed_precision`` key: bf16 compute over fp32 weights).

Bounds: log-probs as the tier's bf16-vs-fp32 test (|Δ| <= 0.1 per token, <= 0.02 mean; the two paths
are both bf16, the CPU measures 2.0e-3 / 6.4e-4 between them); one update within bf16's rounding of the
loss and gradients. The compiled, CUDA-graphed decode must read the bf16 copy the update refreshed."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from rlfoundry.engines.base import LogProbs, MicroBatching
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from tests.engines.test_fsdp_single_rank import _data, _engine, _head_dtypes, _rel, _step
from tests.workers import make_prompts, worker_config

pytestmark = pytest.mark.gpu

CUDA_DEFAULT: dict = {}  # no param_dtype: bf16 on CUDA


@pytest.fixture(scope="module")
def cuda_group():
    from tests.engines.test_fsdp_utils import world_of_one

    return world_of_one("cpu:gloo,cuda:nccl")


@pytest.mark.numerics
def test_cuda_default_is_the_plain_module_under_autocast_and_matches_fsdp2(cuda_group, tiny_model_dir):
    data = _data("cuda")
    mask = data.batch["response_mask"].bool()
    plain = _engine(tiny_model_dir, mixed=CUDA_DEFAULT, device="cuda", eps=1.0)
    wrapped = _engine(tiny_model_dir, mixed=CUDA_DEFAULT, device="cuda", eps=1.0, single_rank="fsdp")
    assert not any(isinstance(m, FSDPModule) for m in plain.module.modules()) and isinstance(wrapped.module, FSDPModule)
    assert fu.plain_autocast_dtype(plain.module) == torch.bfloat16
    seen = _head_dtypes(plain)
    a = plain.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=4))
    b = wrapped.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=4))
    diff = (a["log_probs"] - b["log_probs"])[mask].abs()
    print(f"gpu tier: one-rank autocast vs FSDP2 mixed log-probs: max {diff.max():.4f}, mean {diff.mean():.5f}")
    assert set(seen) == {torch.bfloat16} and a["log_probs"].dtype == torch.float32
    assert diff.max() <= 0.1 and diff.mean() <= 0.02
    m_plain, g_plain, dw_plain = _step(plain, data)
    m_wrapped, _, dw_wrapped = _step(wrapped, data)
    rel = _rel(dw_plain, dw_wrapped)
    print(f"gpu tier: one update, autocast vs FSDP2: loss {m_plain['sft/loss'][0]:.5f} vs {m_wrapped['sft/loss'][0]:.5f}, "
          f"grad norm {m_plain['actor/grad_norm'][0]:.5f} vs {m_wrapped['actor/grad_norm'][0]:.5f}, gradient rel {rel:.2e}")
    assert {dtype for dtype, _ in g_plain.values()} == {g.dtype for _, g in g_plain.values()} == {torch.float32}
    assert m_plain["sft/loss"][0] == pytest.approx(m_wrapped["sft/loss"][0], rel=1e-2)
    assert m_plain["actor/grad_norm"][0] == pytest.approx(m_wrapped["actor/grad_norm"][0], rel=5e-2)
    assert rel <= 0.1


def test_the_compiled_decode_reads_the_bf16_copy_each_update_refreshes(cuda_group, tiny_model_dir, tokenizer):
    """After an update and ``on_actor_update`` the CUDA-graphed decode scores its tokens as the updated
    actor does (the bf16 decode vs the autocast recompute: mean |Δ log p| <= 0.05; on the CPU 1.0e-3),
    while a rollout whose copy was not refreshed is far off (on the CPU mean 0.24)."""
    engine = _engine(tiny_model_dir, mixed=CUDA_DEFAULT, device="cuda")
    cfg = worker_config(tiny_model_dir, ["rollout.response_length=16"])["rollout"]
    compiled = HFRollout(engine.rollout_module(), cfg, tokenizer.pad_token_id, tokenizer.eos_token_id)
    stale = HFRollout(engine.rollout_module(), cfg, tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=False)
    prompts = make_prompts(tokenizer, ["hello world", "a", "the quick brown fox"]).to("cuda")
    prompts.meta_info.update(n=2, do_sample=False)
    compiled.generate_sequences(prompts)  # captures the decode graphs on the copy's storage
    assert compiled._static is not None and compiled._static._graphs
    assert {p.dtype for p in compiled.module.parameters()} == {torch.bfloat16}
    _step(engine, _data("cuda"))
    compiled.on_actor_update()
    held = dict(compiled.module.named_parameters())
    for name, p in engine.module.named_parameters():
        assert torch.equal(held[name], p.detach().to(torch.bfloat16)), name

    def gap(rollout) -> float:
        out = rollout.generate_sequences(prompts)
        recomputed = engine.infer_batch(out, LogProbs(), MicroBatching(size=6))["log_probs"]
        mask = out.batch["response_mask"].bool()
        return float((out.batch["rollout_log_probs"] - recomputed)[mask].abs().mean())

    fresh, old = gap(compiled), gap(stale)
    print(f"gpu tier: compiled decode on the refreshed bf16 copy vs the actor's recompute: mean |dlogp| {fresh:.2e} "
          f"(a copy left stale: {old:.2e})")
    assert fresh <= 0.05 and old > 2 * fresh
