"""Context parallelism on the Megatron engine (``megatron.context_parallel_size``), on CPU processes
over gloo: the CP attention equals whole-sequence attention (values and gradients); the engine at
CP=2 (and TP=2 × CP=2, CP=2 × PP=2) gives the log-probs, entropy and one actor update of CP=1, and
the critic's update and values, with row lengths that 2·CP does not divide (padded); a CP=2
checkpoint loads at CP=1."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


def test_chunk_layout_is_megatrons_load_balanced_one():
    from rlfoundry.engines.megatron.context_parallel import chunk_index
    from rlfoundry.engines.megatron.forward import padded_length

    # 2·CP = 4 chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_index(12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert chunk_index(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    assert [padded_length(n, 2) for n in (11, 12, 13)] == [12, 12, 16]
    # sequence parallelism over TP=2: each CP rank's 2 chunks split over 2 ranks (2·CP·TP = 8); without CP, 2
    assert [padded_length(n, 2, 2) for n in (11, 16, 17)] == [16, 16, 24]
    assert [padded_length(n, 1, 2) for n in (11, 12)] == [12, 12] and padded_length(11, 1) == 11


def _attention_inputs(seq: int = 8, batch: int = 2, heads: int = 4, groups: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq, batch, heads, dim, generator=g)
    k, v = (torch.randn(seq, batch, groups, dim, generator=g) for _ in range(2))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    weight = torch.randn(seq, batch, heads * dim, generator=g)  # the loss: <output, weight>
    return q, k, v, mask, weight


def _reference_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d) over unmasked keys) v, by hand, grouped keys repeated per query head."""
    from rlfoundry.engines.megatron.forward import attention_mask_4d

    heads, groups = q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(heads // groups, dim=2) for x in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(attention_mask_4d(mask), -10000.0)  # megatron-core's masked value
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
    return out.reshape(*out.shape[:2], -1)


def _cp_attention(rank: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from rlfoundry.engines.megatron import context_parallel as cpl
    from rlfoundry.engines.megatron.forward import attention_mask_4d

    q, k, v, mask, weight = _attention_inputs()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               kv_channels=8, context_parallel_size=2, masked_softmax_fusion=False,
                               attention_dropout=0.0)
    attention = cpl.attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                      attention_type="self")
    local = [cpl.split(x, dim=0).requires_grad_() for x in (q, k, v)]
    out = attention(*local, attention_mask_4d(mask))
    (out * cpl.split(weight, dim=0)).sum().backward()
    # each rank's own rows of the output and of the input gradients, back in sequence order
    whole = [cpl.gather(x.detach(), dim=0) for x in (out, *(t.grad for t in local))]
    return whole


def test_cp_attention_equals_whole_sequence_attention(tmp_path):
    """Queries of two chunks against gathered keys/values = attention over the whole sequence, and
    the keys' and values' gradients (summed over the ranks whose queries used them) = the whole
    attention's; fp32, d=8: rounding only (1e-6)."""
    q, k, v, mask, weight = _attention_inputs()
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    expected = _reference_attention(q, k, v, mask)
    (expected * weight).sum().backward()
    for out, dq, dk, dv in run_ranks(_cp_attention, 2, tmp_path, cp=2):
        torch.testing.assert_close(out, expected.detach(), atol=1e-6, rtol=0)
        for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def _megatron_actor(rank: int, model_dir: str, data, tp: int, cp: int, pp: int = 1):
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor
    from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                              dtype="float32")
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
    assert engine.dp_size == 1  # every rank holds every row
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI, MICRO))
    out = actor.compute_log_prob_outputs(data, calculate_entropy=True)
    metrics = actor.update_policy(data)
    return {"log_probs": out["log_probs"], "entropy": out["entropy"], "metrics": metrics,
            "weights": dict(engine.iter_hf_weights())}


def _check_cp_equals_cp1(model_dir: str, tmp_path, tp: int, cp: int, pp: int = 1) -> None:
    from tests.engines.test_megatron_engine import _initial, _scored_batch

    data = _scored_batch(model_dir)
    assert data.batch["input_ids"].shape[1] % (2 * cp)  # 11 tokens a row: the padded path
    [ref] = run_ranks(_megatron_actor, 1, tmp_path, args=(model_dir, data, 1, 1))
    moved = max((ref["weights"][k] - v).abs().max().item() for k, v in _initial(model_dir).items())
    assert moved > 1e-3  # the update moved the weights: equality is not vacuous
    for r in run_ranks(_megatron_actor, tp * cp * pp, tmp_path, tp=tp, cp=cp, pp=pp, args=(model_dir, data, tp, cp, pp)):
        # CP splits each row's attention into two chunks' worth of queries over the gathered keys: the same
        # sums, other GEMM shapes (fp32 rounding, ~1e-7 a log-prob)
        torch.testing.assert_close(r["log_probs"], ref["log_probs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["entropy"], ref["entropy"], atol=1e-5, rtol=0)
        # the loss's gradient from each rank's tokens, summed over the data × context group: the same
        # update; the bound as test_megatron_engine's (ACTOR's eps: a step moves <= 10x its gradient's
        # rounding, two steps of ~1e-6)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
        assert set(r["weights"]) == set(ref["weights"])
        for name, tensor in ref["weights"].items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_cp2_log_probs_and_update_equal_cp1(tiny_model_dir, tmp_path):
    _check_cp_equals_cp1(str(tiny_model_dir), tmp_path, tp=1, cp=2)


@pytest.mark.heavy  # CI: CP=2 above; this adds TP inside each CP rank (4 ranks)
def test_tp2_cp2_log_probs_and_update_equal_cp1(tiny_model_dir, tmp_path):
    """Four ranks: each CP rank's chunks split again over two tensor-parallel ranks (heads and vocabulary)."""
    _check_cp_equals_cp1(str(tiny_model_dir), tmp_path, tp=2, cp=2)


@pytest.mark.heavy  # CI: CP=2 above and PP=2 in test_megatron_engine; together on 4 ranks
def test_cp2_pp2_log_probs_and_update_equal_cp1(tiny_model_dir, tmp_path):
    """Four ranks: two pipeline stages, each passing its CP rank's chunks of the hidden states on."""
    _check_cp_equals_cp1(str(tiny_model_dir), tmp_path, tp=1, cp=2, pp=2)


def _megatron_critic(rank: int, model_dir: str, data, cp: int):
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.critic import CriticBatchSizes, DataParallelPPOCritic
    from tests.engines.test_megatron_critic import MICRO, MINI, _critic_config

    cfg = _critic_config()
    megatron = MegatronConfig(context_parallel_size=cp, dtype="float32")
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip,
                                                 model_kind="token_classification"), "cpu", role="critic")
    critic = DataParallelPPOCritic(cfg, engine, CriticBatchSizes(MINI, MICRO, MICRO))
    metrics = critic.update_critic(data)
    return {"values": critic.compute_values(data), "metrics": metrics, "weights": dict(engine.iter_hf_weights())}


def test_cp2_critic_update_and_values_equal_cp1(tiny_model_dir, tmp_path):
    """The value head's outputs gathered over CP like the log-probs: one critic update and the values
    after it at CP=2 equal CP=1's."""
    from tests.engines.test_megatron_critic import _value_batch

    data = _value_batch()
    [ref] = run_ranks(_megatron_critic, 1, tmp_path, args=(str(tiny_model_dir), data, 1))
    assert ref["values"].abs().max() > 1e-3  # the zero-initialised head moved: equality is not vacuous
    for r in run_ranks(_megatron_critic, 2, tmp_path, cp=2, args=(str(tiny_model_dir), data, 2)):
        torch.testing.assert_close(r["values"], ref["values"], atol=1e-5, rtol=0)  # fp32 rounding of O(1) values
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
            assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
        for name, tensor in ref["weights"].items():  # the bound as the actor's (Adam eps=1e-4)
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_the_model_saved_at_cp2_loads_on_one_rank(tiny_model_dir, tmp_path):
    """The weights are whole on every CP rank (megatron-core saves them once): a CP=2 checkpoint
    (distributed optimiser sharded over the CP ranks) loads at CP=1 with the same weights."""
    from tests.engines.test_megatron_checkpoint import check_loads_on_one_rank

    check_loads_on_one_rank(str(tiny_model_dir), tmp_path, tp=1, cp=2, distributed_optimizer=True)
