"""Megatron-FSDP (``megatron.use_megatron_fsdp=true``, ``engines/megatron/megatron_fsdp.py``) on CPU
processes over gloo: the PPO actor's update (two optimiser steps) at DP=2 with parameters, gradients
and optimiser state sharded equals DP=2 under megatron-core's DDP with the distributed optimiser and
the one-rank engine (log-probs, losses, gradient norms, the exported HF weights); TP=2 × FSDP=2 too
(heavy: 4 ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_engine import MICRO, MINI, ROWS, _actor_config, _initial, _scored_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl")


def _update(rank: int, model_dir: str, data, tp: int, fsdp: bool):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, dtype="float32", use_megatron_fsdp=fsdp)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = data.chunk(dp)[dp_rank]
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO))
    metrics = actor.update_policy(mine)
    # after the update: a forward over the sharded parameters, then the export (twice: the gathered
    # buckets are freed and gathered again)
    log_probs = actor.compute_log_prob_outputs(mine)["log_probs"]
    weights = dict(engine.iter_hf_weights())
    again = dict(engine.iter_hf_weights())
    wrapper = type(engine.chunks[0]).__name__
    return {"dp": dp, "dp_rank": dp_rank, "metrics": metrics, "weights": weights, "again": again,
            "log_probs": log_probs, "wrapper": wrapper}


def _layouts(model_dir: str, tmp_path, tp: int):
    data = _scored_batch(model_dir)
    fsdp = run_ranks(_update, 2 * tp, tmp_path, tp=tp, args=(model_dir, data, tp, True))
    ddp = run_ranks(_update, 2 * tp, tmp_path, tp=tp, args=(model_dir, data, tp, False))
    return data, fsdp, ddp


def _check(fsdp, ddp, model_dir: str) -> None:
    assert {r["wrapper"] for r in fsdp} == {"FullyShardedDataParallel"}
    assert {r["wrapper"] for r in ddp} == {"DistributedDataParallel"}
    moved = max((ddp[0]["weights"][k] - v).abs().max().item() for k, v in _initial(model_dir).items())
    assert moved > 1e-3  # the update moved the weights
    for a, b in zip(fsdp, ddp):
        assert a["dp"] == b["dp"] == 2 and a["dp_rank"] == b["dp_rank"]
        for key in METRICS:  # the same reductions over the same ranks: fp32 rounding of the order only
            assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-6, abs=1e-7), key
        torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=1e-6, rtol=0)
        assert set(a["weights"]) == set(b["weights"])
        for name, tensor in b["weights"].items():
            torch.testing.assert_close(a["weights"][name], tensor, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
            assert torch.equal(a["again"][name], a["weights"][name]), name


def test_fsdp_dp2_equals_ddp_dp2_and_one_rank(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir)
    data, fsdp, ddp = _layouts(model_dir, tmp_path, 1)
    _check(fsdp, ddp, model_dir)
    # one rank steps on the same rows when they come in the order the two data-parallel ranks take them
    order = torch.arange(ROWS).view(2, ROWS // MINI, MINI // 2).transpose(0, 1).reshape(-1)
    [one] = run_ranks(_update, 1, tmp_path, args=(model_dir, data[order], 1, False))
    for key in METRICS:  # the ACTOR settings' bound (test_megatron_engine): sums re-associated, eps=1e-4
        assert fsdp[0]["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(fsdp[0]["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.heavy  # CI: DP=2 above; TP=2 inside each of the two FSDP ranks (4 ranks)
def test_tp2_fsdp2_equals_tp2_ddp2(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir)
    _, fsdp, ddp = _layouts(model_dir, tmp_path, 2)
    _check(fsdp, ddp, model_dir)


def _resume(rank: int, model_dir: str, data, root: str, fsdp: bool):
    """Two updates straight; an engine resumed from the checkpoint after the first takes the second."""
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    halves = [h.chunk(dp)[dp_rank] for h in data.chunk(2)]

    def actor():
        megatron = MegatronConfig(dtype="float32", use_megatron_fsdp=fsdp)
        engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
        return engine, DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp // 2, MICRO // 2))

    engine, straight = actor()
    straight.update_policy(halves[0])
    engine.save_checkpoint(root, {"step": 1})
    second = straight.update_policy(halves[1])
    weights = dict(engine.iter_hf_weights())
    resumed_engine, resumed = actor()
    extra = resumed_engine.load_checkpoint(root)
    again = resumed.update_policy(halves[1])
    # into megatron-core's DDP: not built, an error naming the key
    ddp = MegatronEngine(MegatronEngineConfig(model_dir, MegatronConfig(dtype="float32"), cfg.optim, cfg.grad_clip), "cpu")
    with pytest.raises(ValueError, match="use_megatron_fsdp"):
        ddp.load_checkpoint(root)
    return {"step": extra.get("step"), "straight": (second, weights),
            "resumed": (again, dict(resumed_engine.iter_hf_weights()))}


def test_fsdp_resume_takes_exactly_the_next_update_and_not_into_ddp(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir)
    data = _scored_batch(model_dir)
    for r in run_ranks(_resume, 2, tmp_path, args=(model_dir, data, str(tmp_path / "ckpt"), True)):
        assert r["step"] == 1
        (m1, w1), (m2, w2) = r["straight"], r["resumed"]
        assert m1 == m2  # bit for bit: the same shards, Adam state and RNG
        assert set(w1) == set(w2) and all(torch.equal(w1[k], w2[k]) for k in w1)

