"""The Megatron engine under the PPO actor (the same role and loss as FSDP): on CPU processes over
gloo, log-probs (and sum_v p_v^2, ``calculate_sum_pi_squared``) and one actor update (two optimiser steps, KL and entropy terms, clipping) at TP=2
(with sequence parallelism, megatron.sequence_parallel's default), at PP=2, at PP=2 with two virtual stages
each (the interleaved 1F1B schedule) and at DP=2 with the distributed optimiser equal the 1-rank FSDP2
engine's; at TP=2 sequence parallelism on and off give the same numbers (rows of 11 positions: padded to 12)."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # every test compares Megatron with FSDP or HF (#51)

# optim.eps=1e-4: Adam divides each gradient by its own running magnitude, which turns an element's
# fp32 rounding noise into an lr-sized step when its gradient is near zero (as small as eps=1e-8);
# a larger eps keeps such elements' steps proportional to their gradients, so the weights compare
# at 1e-5 while every other element still takes Adam's normalised step. The bound: a step changes by
# at most lr/eps = 10x a change in its gradient element, and TP/PP re-associate sums of a few hundred
# terms (hidden, vocabulary, tokens) of gradient elements <= 0.5 (grad_clip): ~1e-7 apart, ~1e-6 a
# step, two steps well inside 1e-5; a gradient scaled or routed wrongly moves thousands of weights ~lr
ACTOR = ["actor.use_kl_loss=true", "actor.entropy_coeff=0.01", "actor.grad_clip=0.5", "actor.optim.eps=1e-4"]
ROWS, MINI, MICRO = 8, 4, 2  # two optimiser steps of 4 rows, micro-batches of 2


def _scored_batch(model_dir: str):
    """Rows as update_actor gets them: padded prompts and responses, old/ref log-probs near the
    model's own, random advantages."""
    from transformers import AutoModelForCausalLM

    from rlfoundry.protocol import DataProto
    from tests.engines.test_megatron_model import _batch

    parts = [_batch(seed=s) for s in (0, 1)]
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    width = batch["responses"].shape[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -width - 1:-1]
    lp = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["attention_mask"][:, -width:]
    g = torch.Generator().manual_seed(3)
    batch.update(response_mask=mask, old_log_probs=(lp + 0.05 * torch.randn(lp.shape, generator=g)) * mask,
                 ref_log_prob=(lp + 0.1 * torch.randn(lp.shape, generator=g)) * mask,
                 advantages=torch.randn(lp.shape, generator=g) * mask)
    return DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0, "calculate_entropy": True})


def _actor_config(model_dir: str):
    from rlfoundry.config.schema import ActorConfig
    from rlfoundry.config.typed import to_typed
    from tests.workers import worker_config

    return to_typed(ActorConfig, worker_config(model_dir, ACTOR).actor)


def _fsdp_update(rank: int, model_dir: str, data):
    from rlfoundry.config.schema import FSDPConfig
    from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    engine = FSDPEngine.build(FSDPEngineConfig(path=model_dir, fsdp=FSDPConfig(), optim=cfg.optim,
                                               grad_clip=cfg.grad_clip, cpu_kernels="off"), "cpu")
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI, MICRO))
    out = actor.compute_log_prob_outputs(data, calculate_sum_pi_squared=True)
    metrics = actor.update_policy(data)
    return out["log_probs"], metrics, dict(engine.iter_hf_weights()), out["sum_pi_squared"]


def _megatron_update(rank: int, model_dir: str, data, tp: int, pp: int, distributed_optimizer: bool,
                     vpp: int | None = None, sequence_parallel: bool = True):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, dtype="float32",
                              use_distributed_optimizer=distributed_optimizer, virtual_pipeline_model_parallel_size=vpp,
                              sequence_parallel=sequence_parallel)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = data.chunk(dp)[dp_rank]  # what the worker's dispatch will hand this data-parallel rank
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO))
    out = actor.compute_log_prob_outputs(mine, calculate_entropy=True, calculate_sum_pi_squared=True)
    metrics = actor.update_policy(mine)
    return {"dp": dp, "dp_rank": dp_rank, "log_probs": out["log_probs"], "sum_pi_squared": out["sum_pi_squared"],
            "entropy": out["entropy"], "metrics": metrics, "weights": dict(engine.iter_hf_weights()),
            "sequence_parallel": engine.sequence_parallel}


@pytest.mark.parametrize("tp, pp, world, distributed_optimizer", [
    (2, 1, 2, False), (1, 2, 2, False), (1, 1, 2, True),
])
def test_actor_update_equals_fsdp(tiny_model_dir, tmp_path, tp, pp, world, distributed_optimizer):
    _check_update_equals_fsdp(str(tiny_model_dir), tmp_path, tp, pp, world, distributed_optimizer)


def test_interleaved_pipeline_update_equals_fsdp(tmp_path):
    """PP=2 × VPP=2 on a four-layer model: each rank holds two non-adjacent layers."""
    from rlfoundry.models.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "tiny-qwen2-4l", num_layers=4))
    _check_update_equals_fsdp(model_dir, tmp_path, 1, 2, 2, False, vpp=2)


def test_tied_embeddings_pipeline_update_equals_fsdp(tmp_path):
    """PP=2 with the LM head tied to the input embedding (Qwen2.5-0.5B ties them): the last stage keeps
    a copy of the embedding, set from the first stage's at start-up and kept equal by summing the two
    stages' gradients; log-probs, the update and the exported weights equal the 1-rank FSDP2 engine's."""
    from rlfoundry.models.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "tiny-qwen2-tied", tie_word_embeddings=True))
    _check_update_equals_fsdp(model_dir, tmp_path, 1, 2, 2, False)


def _check_update_equals_fsdp(model_dir: str, tmp_path, tp: int, pp: int, world: int, distributed_optimizer: bool,
                              vpp: int | None = None) -> None:
    data = _scored_batch(model_dir)
    dp = world // (tp * pp)
    # data-parallel rank r takes rows [r·8/dp, (r+1)·8/dp) and steps on its own mini-batches of 4/dp
    # rows (verl's semantics): one rank steps on the same rows when they come in this order
    order = torch.arange(ROWS).view(dp, ROWS // MINI, MINI // dp).transpose(0, 1).reshape(-1)
    [(ref_lp, ref_metrics, ref_weights, ref_squares)] = run_ranks(_fsdp_update, 1, tmp_path,
                                                                   args=(model_dir, data[order]))
    ref_lp, ref_squares = ref_lp[torch.argsort(order)], ref_squares[torch.argsort(order)]
    results = run_ranks(_megatron_update, world, tmp_path, tp=tp, pp=pp, vpp=vpp,
                        args=(model_dir, data, tp, pp, distributed_optimizer, vpp))
    assert results[0]["dp"] == dp
    assert all(r["sequence_parallel"] == (tp > 1) for r in results)  # the default: on wherever TP > 1
    moved = max((ref_weights[k] - v).abs().max().item() for k, v in _initial(model_dir).items())
    assert moved > 1e-3  # the update moved the weights: equality is not vacuous
    for r in results:
        rows = ROWS // dp
        expected = ref_lp[r["dp_rank"] * rows:(r["dp_rank"] + 1) * rows]
        # TP/PP re-associate the forward's sums: fp32 rounding only: the same forward in another order (~u·sqrt(H +
        # V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(r["log_probs"], expected, atol=1e-5, rtol=0)
        # calculate_sum_pi_squared: sum_v p_v^2 from the vocabulary slices equals the FSDP engine's
        # (|dS| <= 2 max|d logit|, and the logits agree as the log-probs do)
        squares = ref_squares[r["dp_rank"] * rows:(r["dp_rank"] + 1) * rows]
        torch.testing.assert_close(r["sum_pi_squared"], squares, atol=1e-6, rtol=0)
        # both mini-batches' numbers: TP/PP re-associate the sums (u x a few hundred terms ~ 1e-5), and the
        # second mini-batch's weights are <= ~1e-6 apart (ACTOR's eps)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert r["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
        assert set(r["weights"]) == set(ref_weights)
        for name, tensor in ref_weights.items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _sequence_parallel_on_and_off(rank: int, model_dir: str, data):
    return [_megatron_update(rank, model_dir, data, 2, 1, False, sequence_parallel=sp) for sp in (True, False)]


def test_sequence_parallel_equals_off(tiny_model_dir, tmp_path):
    """TP=2 with megatron-core's sequence parallelism (each rank 1/2 of the positions between the
    tensor-parallel linears: reduce-scatter / all-gather over gloo; the norms' weight gradients summed
    over the two ranks) and without it: the same log-probs, entropy, metrics and updated weights."""
    model_dir = str(tiny_model_dir)
    data = _scored_batch(model_dir)
    assert data.batch["input_ids"].shape[1] % 2 == 1  # rows the engine pads for the split
    for on, off in run_ranks(_sequence_parallel_on_and_off, 2, tmp_path, tp=2, args=(model_dir, data)):
        assert (on["sequence_parallel"], off["sequence_parallel"]) == (True, False)
        # the same arithmetic on the same positions: only the order of the norms' gradient sums (over the
        # positions, then the ranks) and of the row-parallel linears' reductions changes, fp32 rounding
        # (~1e-7 per element); a norm gradient not summed over the ranks moves every norm weight ~lr apart
        for key in ("log_probs", "entropy", "sum_pi_squared"):
            torch.testing.assert_close(on[key], off[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=1e-5, abs=1e-7), key
        for name, tensor in off["weights"].items():
            torch.testing.assert_close(on["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")
