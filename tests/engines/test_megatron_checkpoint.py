"""Megatron engine checkpoints (megatron-core dist-checkpointing inside the project's role
directory): a resumed engine takes exactly the update the uninterrupted one took, at TP=2 and at
DP=2 with the distributed optimiser; the model saved at TP=2 loads on one rank (resharded) with the
same weights; a damaged shard is refused before anything loads."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config, _scored_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = pytest.mark.slow


def _actor(model_dir: str, tp: int, distributed_optimizer: bool, trainable: bool = True):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, dtype="float32", use_distributed_optimizer=distributed_optimizer)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim if trainable else None, cfg.grad_clip), "cpu")
    dp = ps.get_data_parallel_world_size()
    return DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO)), dp, ps.get_data_parallel_rank()


def _save_then_resume(rank: int, model_dir: str, data, ckpt: str, tp: int, distributed_optimizer: bool):
    actor, dp, dp_rank = _actor(model_dir, tp, distributed_optimizer)
    mine = data.chunk(dp)[dp_rank]
    actor.update_policy(mine)
    actor.engine.step_lr_scheduler()
    actor.engine.save_checkpoint(ckpt, {"global_step": 1})
    uninterrupted = actor.update_policy(mine)
    weights = dict(actor.engine.iter_hf_weights())

    resumed, _, _ = _actor(model_dir, tp, distributed_optimizer)
    extra = resumed.engine.load_checkpoint(ckpt)
    again = resumed.update_policy(mine)
    return {"extra": extra, "uninterrupted": uninterrupted, "again": again, "weights": weights,
            "resumed_weights": dict(resumed.engine.iter_hf_weights()), "calls": resumed.engine.update_calls}


@pytest.mark.parametrize("tp, distributed_optimizer", [(2, False), (1, True)])
def test_resume_takes_exactly_the_next_update(tiny_model_dir, tmp_path, tp, distributed_optimizer):
    data = _scored_batch(str(tiny_model_dir))
    ckpt = str(tmp_path / "global_step_1" / "actor")
    results = run_ranks(_save_then_resume, 2, tmp_path, tp=tp, args=(str(tiny_model_dir), data, ckpt, tp, distributed_optimizer))
    for r in results:
        assert r["extra"]["global_step"] == 1 and r["calls"] == 2
        assert r["again"] == r["uninterrupted"]  # losses, clip fractions, grad norms: bit for bit
        for name, tensor in r["weights"].items():
            assert torch.equal(r["resumed_weights"][name], tensor), name


def _export_after_update(rank: int, model_dir: str, data, ckpt: str):
    actor, _, _ = _actor(model_dir, 2, False)
    actor.update_policy(data)
    actor.engine.save_checkpoint(ckpt, {})
    return dict(actor.engine.iter_hf_weights())


def _load_on_one_rank(rank: int, model_dir: str, ckpt: str):
    actor, _, _ = _actor(model_dir, 1, False, trainable=False)
    actor.engine.load_checkpoint(ckpt)
    return dict(actor.engine.iter_hf_weights())


def test_the_model_saved_at_tp2_loads_on_one_rank_and_damage_is_refused(tiny_model_dir, tmp_path):
    data = _scored_batch(str(tiny_model_dir))
    ckpt = tmp_path / "global_step_1" / "actor"
    saved = run_ranks(_export_after_update, 2, tmp_path, tp=2, args=(str(tiny_model_dir), data, str(ckpt)))[0]
    [loaded] = run_ranks(_load_on_one_rank, 1, tmp_path, args=(str(tiny_model_dir), str(ckpt)))
    assert set(loaded) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    shard = sorted((ckpt / "mcore").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-8] + b"damaged!")
    with pytest.raises(AssertionError, match="mcore/.*distcp"):
        run_ranks(_load_on_one_rank, 1, tmp_path / "again", args=(str(tiny_model_dir), str(ckpt)))
