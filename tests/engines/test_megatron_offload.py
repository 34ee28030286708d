"""Offload on the Megatron engine (verl's ``*.megatron.param_offload`` / ``grad_offload`` /
``optimizer_offload``), on two gloo CPU ranks:

- offload = no offload, bit for bit: the hybrid worker built from verl's keys (actor and reference on
  Megatron) computes the same log-probs, reference log-probs, losses, gradient norms and weights over
  two updates of two optimiser steps each, and a third; at TP=2 (fp32, the plain optimiser; a
  checkpoint saved and loaded while offloaded before the third) and at DP=2 with the distributed
  optimiser (bf16: its fp32 main parameters are the optimiser's own; no checkpoint: megatron-core's
  distributed-optimiser state dict fails for this bf16 model on the CPU with or without offload, its
  fp32 norm weights beside bf16 ones in one parameter group);
- between the worker's phases what the flags name is released (0 bytes) and nothing else;
- ``offload()`` releases exactly the parts its flags name and ``onload()`` brings back the same bytes
  (the gradients zeroed), for each flag alone, all three and none, with and without the distributed
  optimiser; a frozen reference releases its parameters and computes the same log-probs after.

Start-up (spawning ranks, importing megatron-core, building process groups) costs more than the
checks, so the DP=2 comparison and the release checks (both TP=1 on two ranks) share one job per
module; TP=2 has its own.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_engine import ACTOR, MICRO, MINI, _actor_config, _scored_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = pytest.mark.slow

FLAGS = ("param_offload", "grad_offload", "optimizer_offload")
PARTS = ("params", "grads", "optimizer")


def _worker_overrides(model_dir: str, tp: int, distributed_optimizer: bool, dtype: str, offload: bool) -> list[str]:
    keys = [f"{role}.megatron.{k}" for role in ("actor", "ref") for k in
            (f"tensor_model_parallel_size={tp}", f"use_distributed_optimizer={distributed_optimizer}", f"dtype={dtype}",
             *(f"{flag}={offload}" for flag in FLAGS))]
    # 8 rows = 4 prompts x n=2; ppo_mini_batch_size=2 prompts: two optimiser steps per update
    return [*ACTOR, "actor.strategy=megatron", "ref.strategy=megatron", "actor.ppo_mini_batch_size=2",
            f"actor.ppo_micro_batch_size_per_gpu={MICRO}", *keys]


def _released(engine) -> tuple[bool, ...]:
    """The engine's account of each part, then whether every parameter's and every gradient view's
    storage is empty (0 bytes), seen from the tensors themselves (a frozen model has no gradients)."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    grads = [p.main_grad for p in params if hasattr(p, "main_grad")]
    empty = all(p.untyped_storage().nbytes() == 0 for p in params)
    return (*(engine.released(p) for p in PARTS), empty, bool(grads) and all(g.untyped_storage().nbytes() == 0 for g in grads))


def _worker_run(rank: int, model_dir: str, data, tp: int, distributed_optimizer: bool, dtype: str, ckpt: str | None):
    """Per rank: for offload on and off, a hybrid actor+ref worker from verl's keys through two updates
    (and, offloaded, a checkpoint saved and loaded back), then a third update."""
    from rlfoundry.workers.actor_rollout_ref import ActorRolloutRefWorker
    from tests.workers import worker_config

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the process group exists already (run_ranks)
    os.environ.setdefault("MASTER_PORT", "0")
    mine = data.chunk(2)[rank]  # what DP_COMPUTE_PROTO hands each of the world's two ranks
    out = {}
    for offload in (True, False):
        config = worker_config(model_dir, _worker_overrides(model_dir, tp, distributed_optimizer, dtype, offload))
        worker = ActorRolloutRefWorker(config, "actor_ref")
        worker.init_model()
        actor, ref = worker.engine, worker.ref_policy.engine
        run = {"built": (_released(actor), _released(ref)), "steps": []}
        for _ in range(2):
            old = worker.compute_log_prob(mine).batch["old_log_probs"]
            ref_lp = worker.compute_ref_log_prob(mine).batch["ref_log_prob"]
            after_log_probs = (_released(actor), _released(ref))
            metrics = worker.update_actor(mine).meta_info["metrics"]
            run["steps"].append({"old": old, "ref": ref_lp, "metrics": metrics, "after_log_probs": after_log_probs,
                                 "after_update": (_released(actor), _released(ref))})
        if offload and ckpt:
            worker.save_checkpoint(ckpt, global_step=2)
            worker.load_checkpoint(ckpt)
            run["after_load"] = _released(actor)
        run["third"] = worker.update_actor(mine).meta_info["metrics"]
        run["weights"] = {k: v.clone() for k, v in actor.iter_hf_weights()}
        run["after_export"] = _released(actor)
        out[offload] = run
    return out


def _dp2_cases(rank: int, model_dir: str, data):
    """Everything the TP=1 tests compare, in one job: the DP=2 worker run (the distributed optimiser,
    bf16, no checkpoint), then each part released and restored."""
    return {"worker": _worker_run(rank, model_dir, data, 1, True, "bfloat16", None),
            "release": _release_and_restore(rank, model_dir, data)}


@pytest.fixture(scope="module")
def dp2(tiny_model_dir, tmp_path_factory):
    data = _scored_batch(str(tiny_model_dir))
    return run_ranks(_dp2_cases, 2, tmp_path_factory.mktemp("dp2"), args=(str(tiny_model_dir), data))


@pytest.mark.numerics
@pytest.mark.parametrize("tp, distributed_optimizer, dtype, checkpoint",
                         [(2, False, "float32", True), (1, True, "bfloat16", False)],
                         ids=["tp2-fp32", "dp2-distributed-optimizer-bf16"])
def test_offload_equals_no_offload_exactly(request, tiny_model_dir, tmp_path, tp, distributed_optimizer, dtype,
                                           checkpoint):
    if tp == 1:  # the module's DP=2 job ran it
        results = [r["worker"] for r in request.getfixturevalue("dp2")]
    else:
        data = _scored_batch(str(tiny_model_dir))
        ckpt = str(tmp_path / "global_step_2" / "actor") if checkpoint else None
        results = run_ranks(_worker_run, 2, tmp_path, tp=tp,
                            args=(str(tiny_model_dir), data, tp, distributed_optimizer, dtype, ckpt))
    everything, nothing, ref_params = (True,) * 5, (False,) * 5, (True, False, False, True, False)
    for r in results:
        on, off = r[True], r[False]
        # the keys reached both engines: the reference (frozen) releases its parameters only
        assert on["built"] == (everything, ref_params) and off["built"] == (nothing, nothing)
        for a, b in zip(on["steps"], off["steps"]):
            assert a["after_log_probs"] == a["after_update"] == (everything, ref_params)
            assert b["after_log_probs"] == b["after_update"] == (nothing, nothing)
            assert torch.equal(a["old"], b["old"]) and torch.equal(a["ref"], b["ref"])
            assert a["metrics"] == b["metrics"]  # losses, KL, entropy, gradient norms, lr: bit for bit
        assert on["steps"][1]["metrics"]["actor/grad_norm"] != on["steps"][0]["metrics"]["actor/grad_norm"]
        assert not torch.equal(on["steps"][1]["old"], on["steps"][0]["old"])  # the first update moved the policy
        assert on["after_load" if checkpoint else "after_export"] == on["after_export"] == everything
        assert on["third"] == off["third"]  # (TP=2: the checkpoint saved and loaded while offloaded held everything)
        assert on["weights"].keys() == off["weights"].keys()
        for name, tensor in off["weights"].items():
            assert torch.equal(on["weights"][name], tensor), name


# ---- each part released and restored -----------------------------------------------------------

def _part_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """What each flag names, found independently of the engine's own bookkeeping: the parameters, the
    gradient views DDP hands the parameters, and the optimiser's moments and the parameters it steps
    that are not the model's own (the fp32 main copies of bf16 weights)."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    model = {p.untyped_storage()._cdata for p in params}
    grads = [p.main_grad for p in params]
    optimizer = []
    for part in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = part.optimizer
        optimizer += [p for g in inner.param_groups for p in g["params"] if p.untyped_storage()._cdata not in model]
        optimizer += [s[k] for s in inner.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return {"params": params, "grads": grads, "optimizer": optimizer}


def _bytes(tensors: list[torch.Tensor]) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tensors]


def _release_and_restore(rank: int, model_dir: str, data):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = data.chunk(dp)[dp_rank]
    checks = []
    for distributed_optimizer, dtype in ((True, "bfloat16"), (False, "float32")):
        for asked in [(True, True, True), (True, False, False), (False, True, False), (False, False, True),
                      (False, False, False)]:
            megatron = MegatronConfig(dtype=dtype, use_distributed_optimizer=distributed_optimizer,
                                      **dict(zip(FLAGS, asked)))
            engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
            actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO))
            engine.onload()
            actor.update_policy(mine)  # Adam's moments exist, the gradient buffers hold the last step's
            parts = _part_tensors(engine)
            before = {k: [t.detach().clone() for t in ts] for k, ts in parts.items()}
            sizes = {k: _bytes(ts) for k, ts in parts.items()}
            engine.offload()
            released = {k: _bytes(ts) for k, ts in parts.items()}
            kept = {k: all(torch.equal(t, b) for t, b in zip(parts[k], before[k])) for k in PARTS if k not in
                    [p for p, a in zip(PARTS, asked) if a]}
            engine.onload()
            restored = {k: _bytes(ts) for k, ts in parts.items()}
            values = {k: all(torch.equal(t, b) for t, b in zip(parts[k], before[k])) for k in PARTS}
            zeroed = all(bool((g == 0).all()) for g in parts["grads"])
            nonzero_before = any(bool((g != 0).any()) for g in before["grads"])
            checks.append({"distributed_optimizer": distributed_optimizer, "asked": asked, "sizes": sizes,
                           "released": released, "kept": kept, "restored": restored, "values": values,
                           "zeroed": zeroed, "nonzero_before": nonzero_before,
                           "counts": {k: len(v) for k, v in parts.items()}})

    # a frozen reference: its parameters (no DDP buffers: each its own storage) released and restored
    ref = MegatronEngine(MegatronEngineConfig(model_dir, MegatronConfig(dtype="float32", param_offload=True)), "cpu")
    ref_actor = DataParallelPPOActor(cfg, ref)
    params = [p for chunk in ref.chunks for p in chunk.parameters()]
    frozen_released = _bytes(params)
    offloaded_lp = ref_actor.compute_log_prob_outputs(mine)["log_probs"]
    frozen_after = _bytes(params)
    ref.onload()
    resident_lp = ref_actor.compute_log_prob_outputs(mine)["log_probs"]
    return {"checks": checks, "frozen": (frozen_released, frozen_after, _bytes(params), ref.offload_parts),
            "log_probs": (offloaded_lp, resident_lp)}


@pytest.mark.numerics
def test_offload_releases_what_the_flags_name_and_onload_restores_it(dp2):
    for r in (r["release"] for r in dp2):
        for c in r["checks"]:
            where = (c["distributed_optimizer"], c["asked"])
            assert all(c["counts"][k] for k in PARTS) and all(all(c["sizes"][k]) for k in PARTS), where
            for part, asked in zip(PARTS, c["asked"]):
                if asked:
                    assert set(c["released"][part]) == {0}, (where, part)
                else:  # a part no flag names is left alone
                    assert c["released"][part] == c["sizes"][part] and c["kept"][part], (where, part)
            assert c["restored"] == c["sizes"], where
            grads_asked = c["asked"][1]
            assert c["nonzero_before"]
            # parameters and optimiser state come back bit for bit; released gradients come back zeroed
            assert c["values"]["params"] and c["values"]["optimizer"], where
            assert c["zeroed"] if grads_asked else c["values"]["grads"], where
        released, after, restored, parts = r["frozen"]
        assert parts == ("params",) and set(released) == set(after) == {0} and 0 not in restored
        assert torch.equal(*r["log_probs"])
