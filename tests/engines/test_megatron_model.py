"""megatron-core models built from HF checkpoints through mbridge, on CPU processes over gloo: the
response log-probs, entropy and sum_v p_v^2 (``calculate_sum_pi_squared``) at TP=2, PP=2 and PP=2 with two virtual stages equal HF's forward
(vocab-parallel log-softmax, no full-vocabulary logits on any rank), and weights exported back to
HF names equal the checkpoint's."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # every test compares Megatron with FSDP or HF (#51)


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory):
    from rlfoundry.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-4l"), num_layers=4))


def _batch(seed: int = 0, rows: int = 4, tp: int = 6, tr: int = 5):
    """Left-padded prompts and right-padded responses, as a rollout lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (rows, tp + tr), generator=g)
    mask = torch.ones(rows, tp + tr, dtype=torch.long)
    for r in range(rows):
        mask[r, : r % 3] = 0  # prompt padding
        mask[r, tp + tr - (r % 2) * 2:] = 0  # response padding
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, tp:]}


def _hf_log_probs(path: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    width = batch["responses"].shape[1]
    logits = logits[:, -width - 1:-1]
    logp = torch.log_softmax(logits, -1)
    return (logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1),
            logp.exp().square().sum(-1))


def _megatron_log_probs(rank: int, path: str, batch: dict):
    from megatron.core import parallel_state as ps

    from rlfoundry.engines.megatron import bridge as mb
    from rlfoundry.engines.megatron.forward import response_logits, run_schedule, vocab_parallel_log_probs

    bridge = mb.build_bridge(path, torch.float32)
    chunks = mb.build_model(bridge)
    mb.load_hf_weights(bridge, chunks, path)
    for c in chunks:
        c.eval()
    width = batch["responses"].shape[1]

    def outputs(logits, micro):
        lp, ent, squares = vocab_parallel_log_probs(response_logits(logits, width), micro["responses"], entropy=True,
                                                    sum_pi_squared=True)
        return {"log_probs": lp, "entropy": ent, "sum_pi_squared": squares, "vocab_slice": torch.tensor(logits.shape[-1])}

    micros = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, batch["input_ids"].shape[0], 2)]
    with torch.no_grad():
        outs = run_schedule(chunks, micros, outputs, loss=None)
    exported = dict(mb.export_hf_weights(bridge, chunks))
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    return {"last": last, "outs": outs, "exported": exported}


@pytest.mark.parametrize("tp, pp, vpp", [(2, 1, None), (1, 2, None), (1, 2, 2)])
def test_log_probs_entropy_and_export_equal_hf(four_layer_model, tmp_path, tp, pp, vpp):
    from safetensors.torch import load_file

    batch = _batch()
    ref_lp, ref_ent, ref_squares = _hf_log_probs(four_layer_model, batch)
    results = run_ranks(_megatron_log_probs, tp * pp, tmp_path, tp=tp, pp=pp, vpp=vpp,
                        args=(four_layer_model, batch))
    last = [r for r in results if r["last"]]
    assert len(last) == tp  # every tensor-parallel rank of the last stage has the same outputs
    valid = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    for r in last:
        lp = torch.cat([o["log_probs"] for o in r["outs"]])
        ent = torch.cat([o["entropy"] for o in r["outs"]])
        # TP splits the hidden and vocabulary sums across ranks: fp32 rounding only: the same forward in another order
        # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(lp[valid], ref_lp[valid], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[valid], ref_ent[valid], atol=1e-5, rtol=0)
        squares = torch.cat([o["sum_pi_squared"] for o in r["outs"]])  # |dS| <= 2 max|d logit|: as tight
        torch.testing.assert_close(squares[valid], ref_squares[valid], atol=1e-6, rtol=0)
        assert all(int(o["vocab_slice"]) == 260 // tp for o in r["outs"])  # each rank saw its slice only
    hf = load_file(f"{four_layer_model}/model.safetensors")
    for r in results:
        assert set(r["exported"]) == set(hf)
        for name, tensor in hf.items():
            assert torch.equal(r["exported"][name], tensor), name
