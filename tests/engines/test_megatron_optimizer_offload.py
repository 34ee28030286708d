"""megatron-core's CPU optimiser on the Megatron engine (verl's ``optim.override_optimizer_config``
``optimizer_cpu_offload`` / ``optimizer_offload_fraction`` / ``overlap_cpu_optimizer_d2h_h2d`` with
``use_precision_aware_optimizer``): megatron-core's own HybridDeviceOptimizer inside its distributed
optimiser, on two gloo CPU ranks (DP=2, bf16, the tiny dense model). On the CPU the "device" is host
memory too, so nothing moves between memories, but the path is megatron-core's: the split of the
parameters by the fraction, the host copies, the per-parameter host sub-optimisers (overlap), the copy
back after each host step, the state dict (cpu_compat.py stands in for the CUDA streams only).

- offload = no offload: after two updates (four optimiser steps) the losses, gradient norms and bf16
  weights equal the plain distributed optimiser's bit for bit, at fraction 1 (every parameter's step on
  the host), 0.5 (split: some on the host, the others on the "device" sub-optimiser), 0 (none) and 1
  without overlap (one host sub-optimiser); Adam's moments and step counts are the same bits too, and
  the fp32 master weights differ by at most 4 float32 ulps of each tensor's largest weight (one rounding
  of the weight per step, four steps; seen: under 1): megatron-core builds its host AdamW with
  ``fused=True``, whose kernel rounds ``p - lr * (wd * p + update)`` in another order than the for-loop
  AdamW of the plain path; among the fractions (the same kernel wherever it runs) they are the same bits;
  with verl's ``megatron.*_offload`` flags on as well (their scripts set both), the same bits;
- the flags' ``optimizer`` part is the device sub-optimiser's (released between updates), the host side
  is left alone;
- resume: saved with offload on (fraction 1 and 0.5, verl's ``megatron.*_offload`` on), loaded into a
  fresh engine, the next update equals the uninterrupted one's bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config, _scored_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

MASTER_ULPS = 4  # fp32 master weights, offload against the plain optimiser: ulps of the tensor's largest (docstring)


def _offload(fraction: float, overlap: bool = True) -> dict:
    """verl's keys as its Megatron example scripts set them (fraction and overlap varied)."""
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
            "overlap_cpu_optimizer_d2h_h2d": overlap, "use_precision_aware_optimizer": True}


# name -> (override_optimizer_config, megatron.param/grad/optimizer_offload)
CASES = {"plain": ({}, False), "f1": (_offload(1.0), False), "f0.5": (_offload(0.5), False), "f0": (_offload(0.0), False),
         "f1-no-overlap": (_offload(1.0, overlap=False), False), "f1-verl": (_offload(1.0), True),
         "f0.5-verl": (_offload(0.5), True)}


def _actor(model_dir: str, overrides: dict, megatron_offload: bool):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    optim = dataclasses.replace(cfg.optim, override_optimizer_config=overrides)
    megatron = MegatronConfig(dtype="bfloat16", use_distributed_optimizer=True, param_offload=megatron_offload,
                              grad_offload=megatron_offload, optimizer_offload=megatron_offload)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, optim, cfg.grad_clip), "cpu")
    dp = ps.get_data_parallel_world_size()
    return DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO)), dp, ps.get_data_parallel_rank()


def _hybrid(engine):
    return engine.optimizer.chained_optimizers[0].optimizer


def _split(engine) -> dict:
    """How megatron-core's HybridDeviceOptimizer split the parameters (None: the plain optimiser)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    hdo = _hybrid(engine)
    if not isinstance(hdo, HybridDeviceOptimizer):
        return {"type": type(hdo).__name__}
    params = [p for g in hdo.param_groups for p in g["params"]]
    host = [p for p in params if p in hdo.gpu_params_map_cpu_copy]
    return {"type": type(hdo).__name__, "params": len(params), "host": len(host),
            "host_numel": sum(p.numel() for p in host), "numel": sum(p.numel() for p in params),
            "host_optimizers": len(hdo.cpu_optimizers), "device_optimizer": hdo.gpu_optimizer is not None,
            "fp32_masters": len(hdo.param_to_fp32_param),
            # the host copies are their own memory, not the model's (as a GPU's pinned host copies are)
            "own_memory": all(hdo.gpu_params_map_cpu_copy[p].untyped_storage()._cdata != p.untyped_storage()._cdata
                              for p in host)}


def _masters(engine) -> dict[str, dict[str, torch.Tensor]]:
    """megatron-core's own view of this rank's optimiser state (what its checkpoints save): each model
    parameter's fp32 master shard, Adam's moments and step."""
    opt = engine.optimizer.chained_optimizers[0]
    names = {p: n for chunk in engine.chunks for n, p in chunk.named_parameters()}
    out = {}
    for param in opt.model_param_group_index_map:
        state = opt._get_main_param_and_optimizer_states(param)
        out[names[param]] = {k: state[k].detach().float().clone() for k in ("param", "exp_avg", "exp_avg_sq", "step")}
    return out


def _device_part(engine) -> dict:
    """With the flags on, after an update: the optimiser part's account, and the bytes of the device
    sub-optimiser's fp32 masters and of the host side's copies."""
    hdo = _hybrid(engine)
    device = [p for g in hdo.gpu_optimizer.param_groups for p in g["params"]] if hdo.gpu_optimizer else []
    host = [p for o in hdo.cpu_optimizers for g in o.param_groups for p in g["params"]]
    return {"released": engine.released("optimizer"), "device": [p.untyped_storage().nbytes() for p in device],
            "host": [p.untyped_storage().nbytes() for p in host]}


def _updates(rank: int, model_dir: str, data):
    out = {}
    for name, (overrides, megatron_offload) in CASES.items():
        actor, dp, dp_rank = _actor(model_dir, overrides, megatron_offload)
        mine = data.chunk(dp)[dp_rank]
        run = {"split": _split(actor.engine), "metrics": []}
        for _ in range(2):
            run["metrics"].append(actor.update_policy(mine))
            actor.engine.step_lr_scheduler()
        if megatron_offload:
            run["parts"] = _device_part(actor.engine)
        actor.engine.onload()
        run["weights"] = {k: v.clone() for k, v in actor.engine.iter_hf_weights()}
        run["masters"] = _masters(actor.engine)
        out[name] = run
    return out


@pytest.fixture(scope="module")
def updates(tiny_model_dir, tmp_path_factory):
    data = _scored_batch(str(tiny_model_dir))
    return run_ranks(_updates, 2, tmp_path_factory.mktemp("hdo"), args=(str(tiny_model_dir), data))


def test_the_offload_runs_megatron_cores_hybrid_optimizer_split_by_the_fraction(updates):
    for r in updates:
        assert r["plain"]["split"] == {"type": "AdamW"}
        f1, half, none, serial = (r[k]["split"] for k in ("f1", "f0.5", "f0", "f1-no-overlap"))
        for s in (f1, half, none, serial):
            assert s["type"] == "HybridDeviceOptimizer" and s["params"] > 2 and s["own_memory"]
            assert s["fp32_masters"] == s["params"]  # bf16 shards: fp32 masters made by the hybrid optimiser
        # fraction 1: every parameter's step on the host, one host sub-optimiser each (overlap), none on the device
        assert f1["host"] == f1["params"] == f1["host_optimizers"] and not f1["device_optimizer"]
        assert serial["host"] == serial["params"] and serial["host_optimizers"] == 1 and not serial["device_optimizer"]
        # 0.5: the first parameters up to half the elements on the host, the rest on the device sub-optimiser
        assert 0 < half["host"] < half["params"] and half["device_optimizer"] and half["host_optimizers"] == half["host"]
        assert half["numel"] / 2 <= half["host_numel"] < half["numel"]
        assert none["host"] == none["host_optimizers"] == 0 and none["device_optimizer"]


def test_offload_equals_no_offload(updates):
    for r in updates:
        plain = r["plain"]
        assert plain["metrics"][1] != plain["metrics"][0]  # the first update moved the policy
        for name in CASES:
            run = r[name]
            assert run["metrics"] == plain["metrics"], name  # losses, gradient norms, clip fractions: bit for bit
            assert run["weights"].keys() == plain["weights"].keys()
            for key, tensor in plain["weights"].items():
                assert torch.equal(run["weights"][key], tensor), (name, key)
            for key, state in plain["masters"].items():
                assert int(state["step"]) == 4
                for what, value in state.items():
                    got = run["masters"][key][what]
                    if what == "param":  # the fused host kernel's rounding (module docstring)
                        bound = MASTER_ULPS * torch.finfo(torch.float32).eps * float(value.abs().max())
                        assert float((got - value).abs().max()) <= bound, (name, key)
                    else:
                        assert torch.equal(got, value), (name, key, what)
                    if name != "plain":  # among the offload cases (one kernel, wherever it runs) the same bits
                        assert torch.equal(got, r["f1"]["masters"][key][what]), (name, key, what)


def test_megatron_optimizer_offload_moves_the_device_sub_optimizer_only(updates):
    for r in updates:
        f1, half = r["f1-verl"]["parts"], r["f0.5-verl"]["parts"]
        # fraction 1: nothing of the optimiser on the device (its masters and moments are the host side's)
        assert f1["released"] and f1["device"] == [] and 0 not in f1["host"]
        # 0.5: the device sub-optimiser's fp32 masters released between updates, the host copies kept
        assert half["released"] and half["device"] and set(half["device"]) == {0} and 0 not in half["host"]


def _save_then_resume(rank: int, model_dir: str, data, ckpt: str, overrides: dict):
    actor, dp, dp_rank = _actor(model_dir, overrides, True)
    mine = data.chunk(dp)[dp_rank]
    actor.update_policy(mine)
    actor.engine.step_lr_scheduler()
    actor.engine.save_checkpoint(ckpt, {"global_step": 1})
    uninterrupted = actor.update_policy(mine)
    actor.engine.onload()
    weights, masters = dict(actor.engine.iter_hf_weights()), _masters(actor.engine)

    resumed, _, _ = _actor(model_dir, overrides, True)
    extra = resumed.engine.load_checkpoint(ckpt)
    again = resumed.update_policy(mine)
    resumed.engine.onload()
    return {"extra": extra, "uninterrupted": uninterrupted, "again": again, "weights": weights, "masters": masters,
            "resumed_weights": dict(resumed.engine.iter_hf_weights()), "resumed_masters": _masters(resumed.engine),
            "split": _split(resumed.engine)}


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_resume_with_offload_takes_exactly_the_next_update(tiny_model_dir, tmp_path, fraction):
    data = _scored_batch(str(tiny_model_dir))
    ckpt = str(tmp_path / "global_step_1" / "actor")
    results = run_ranks(_save_then_resume, 2, tmp_path, args=(str(tiny_model_dir), data, ckpt, _offload(fraction)))
    for r in results:
        assert r["extra"]["global_step"] == 1 and r["split"]["type"] == "HybridDeviceOptimizer"
        assert r["split"]["device_optimizer"] == (fraction < 1)
        assert r["again"] == r["uninterrupted"]  # losses, clip fractions, gradient norms: bit for bit
        for name, tensor in r["weights"].items():
            assert torch.equal(r["resumed_weights"][name], tensor), name
        for name, state in r["masters"].items():  # fp32 masters, moments, step count: the same bits
            for what, value in state.items():
                assert torch.equal(r["resumed_masters"][name][what], value), (name, what)
