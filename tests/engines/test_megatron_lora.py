"""LoRA on the Megatron engine (engines/megatron/lora.py) against LoRA on FSDP2 (peft): two gloo CPU
ranks at TP=2, fp32, both engines starting from the same peft adapter directory (random A and B, so
the adapted model differs from the base from the first forward).

The actor's log-probs, the reference's (adapter off), one actor update (losses, gradient norm, the
adapter after two optimiser steps) equal FSDP2's; the frozen base weights stay the same bits; the
merged HF stream equals peft's ``merge_and_unload`` of the adapter the engine exports; a checkpoint
resumes the same adapter and takes the same next update. TP=2 runs with sequence parallelism
(megatron.sequence_parallel's default), and gives the numbers it gives without."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config, _scored_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

RANK, ALPHA = 4, 8


def _adapter_dir(model_dir: str, out) -> str:
    """A peft adapter on every linear projection with A and B random (a fresh adapter's B is 0, which
    would hide a wrong B layout or a missing reduction until after the first step)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(str(out))
    return str(out)


def _spec(adapter: str):
    from rlfoundry.models.lora import LoraSpec

    return LoraSpec(rank=RANK, alpha=ALPHA, adapter_path=adapter)


def _fsdp(rank: int, model_dir: str, data, adapter: str):
    from rlfoundry.config.schema import FSDPConfig
    from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    engine = FSDPEngine.build(FSDPEngineConfig(path=model_dir, fsdp=FSDPConfig(), optim=cfg.optim, grad_clip=cfg.grad_clip,
                                               cpu_kernels="off", lora=_spec(adapter)), "cpu")
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI, MICRO))
    log_probs = actor.compute_log_prob_outputs(data)["log_probs"]
    with engine.adapter_disabled():
        ref = actor.compute_log_prob_outputs(data)["log_probs"]
    metrics = actor.update_policy(data)
    return {"log_probs": log_probs, "ref": ref, "metrics": metrics, "adapter": engine.adapter_weights()}


def _megatron_actor(model_dir: str, spec, tp: int = 2, pp: int = 1, sequence_parallel: bool = True):
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, dtype="float32",
                              sequence_parallel=sequence_parallel)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip, lora=spec), "cpu")
    return DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI, MICRO))


def _megatron(rank: int, model_dir: str, data, adapter: str, out: str, tp: int, pp: int):
    actor = _megatron_actor(model_dir, _spec(adapter), tp, pp)
    engine = actor.engine
    frozen = {n: p.detach().clone() for c in engine.chunks for n, p in c.named_parameters() if not p.requires_grad}
    trainable = sorted(n for c in engine.chunks for n, p in c.named_parameters() if p.requires_grad)
    log_probs = actor.compute_log_prob_outputs(data)["log_probs"]
    with engine.adapter_disabled():
        ref = actor.compute_log_prob_outputs(data)["log_probs"]
    metrics = actor.update_policy(data)
    base_kept = all(torch.equal(p, frozen[n]) for c in engine.chunks for n, p in c.named_parameters() if n in frozen)
    engine.save_hf_model(out, adapter_only=True)
    return {"log_probs": log_probs, "ref": ref, "metrics": metrics, "adapter": engine.adapter_weights(),
            "merged": dict(engine.iter_hf_weights()), "base_kept": base_kept, "frozen": len(frozen),
            "trainable": trainable}


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_lora_equals_fsdp_lora(tiny_model_dir, tmp_path, tp, pp):
    """TP=2 (the adapters' splits and reductions) and PP=2 (each stage's layers, numbered globally)."""
    model_dir = str(tiny_model_dir)
    adapter = _adapter_dir(model_dir, tmp_path / "start")
    data = _scored_batch(model_dir)
    [fsdp] = run_ranks(_fsdp, 1, tmp_path, args=(model_dir, data, adapter))
    results = run_ranks(_megatron, 2, tmp_path, tp=tp, pp=pp, args=(model_dir, data, adapter, str(tmp_path / "out"), tp, pp))
    start = _load(f"{adapter}/adapter_model.safetensors")
    assert max((fsdp["adapter"][k] - v).abs().max().item() for k, v in start.items()) > 1e-3  # the update moved it
    assert (fsdp["log_probs"] - fsdp["ref"]).abs().max() > 1e-3  # the adapter changes the policy
    for r in results:
        # only adapters train: 7 modules x (A, B) x the rank's 2 / pp layers; the base (embeddings, norms, linears,
        # head) is frozen
        assert len(r["trainable"]) == 28 // pp and all("_lora." in n for n in r["trainable"]) and r["frozen"] > 0
        assert r["base_kept"]
        # TP re-associates the forward's sums (fp32 rounding, ~1e-6 per log-prob; see test_megatron_engine)
        torch.testing.assert_close(r["log_probs"], fsdp["log_probs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["ref"], fsdp["ref"], atol=1e-5, rtol=0)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert r["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
        assert set(r["adapter"]) == set(fsdp["adapter"]) == set(start)
        for name, tensor in fsdp["adapter"].items():
            torch.testing.assert_close(r["adapter"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    _check_merged(model_dir, str(tmp_path / "out"), results[0]["merged"])


def _sequence_parallel_on_and_off(rank: int, model_dir: str, data, adapter: str):
    out = []
    for sp in (True, False):
        actor = _megatron_actor(model_dir, _spec(adapter), sequence_parallel=sp)
        log_probs = actor.compute_log_prob_outputs(data)["log_probs"]
        with actor.engine.adapter_disabled():
            ref = actor.compute_log_prob_outputs(data)["log_probs"]
        out.append({"log_probs": log_probs, "ref": ref, "metrics": actor.update_policy(data),
                    "adapter": actor.engine.adapter_weights(), "sequence_parallel": actor.engine.sequence_parallel})
    return out


def test_lora_with_sequence_parallel_equals_without(tiny_model_dir, tmp_path):
    """TP=2 with sequence parallelism: the column-parallel adapters' A x gathered along the sequence, the
    row-parallel ones' partial sums reduce-scattered, the whole factors' gradients summed over the ranks;
    log-probs (adapter on and off), the update and the adapter after it equal TP=2 without it."""
    model_dir = str(tiny_model_dir)
    adapter = _adapter_dir(model_dir, tmp_path / "start")
    data = _scored_batch(model_dir)
    for on, off in run_ranks(_sequence_parallel_on_and_off, 2, tmp_path, tp=2, args=(model_dir, data, adapter)):
        assert (on["sequence_parallel"], off["sequence_parallel"]) == (True, False)
        # the same sums in another order (fp32 rounding, ~1e-7); an A or B gradient not summed over the two
        # ranks leaves each rank's copy its own positions' share (another Adam step, ~lr apart)
        for key in ("log_probs", "ref"):
            torch.testing.assert_close(on[key], off[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=1e-5, abs=1e-7), key
        for name, tensor in off["adapter"].items():
            torch.testing.assert_close(on["adapter"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _save_then_resume(rank: int, model_dir: str, data, ckpt: str):
    from rlfoundry.models.lora import LoraSpec

    spec = LoraSpec(rank=RANK, alpha=ALPHA)
    actor = _megatron_actor(model_dir, spec)
    actor.update_policy(data)
    actor.engine.step_lr_scheduler()
    actor.engine.save_checkpoint(ckpt, {"global_step": 1})
    saved = actor.engine.adapter_weights()
    uninterrupted = actor.update_policy(data)

    resumed = _megatron_actor(model_dir, spec)
    fresh = resumed.engine.adapter_weights()
    resumed.engine.load_checkpoint(ckpt)
    loaded = resumed.engine.adapter_weights()
    again = resumed.update_policy(data)
    try:
        _megatron_actor(model_dir, LoraSpec(rank=2 * RANK, alpha=ALPHA)).engine.load_checkpoint(ckpt)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"saved": saved, "fresh": fresh, "loaded": loaded, "uninterrupted": uninterrupted, "again": again,
            "after": actor.engine.adapter_weights(), "resumed_after": resumed.engine.adapter_weights(), "refused": refused}


def _save_then_train_on(rank: int, model_dir: str, data, ckpt: str):
    from rlfoundry.models.lora import LoraSpec

    actor = _megatron_actor(model_dir, LoraSpec(rank=RANK, alpha=ALPHA))
    actor.update_policy(data)
    actor.engine.save_checkpoint(ckpt, {"global_step": 1})
    saved = actor.engine.adapter_weights()
    actor.update_policy(data)  # training goes on after the save
    return saved


def _export_offline(rank: int, ckpt: str, out: str):
    from rlfoundry.engines.megatron.export import export_megatron_checkpoint

    export_megatron_checkpoint(ckpt, f"{out}/merged")
    export_megatron_checkpoint(ckpt, f"{out}/adapter", adapter_only=True)


def test_checkpoint_resumes_the_adapter(tiny_model_dir, tmp_path):
    """A fresh adapter (B = 0) trained one step, saved, resumed at TP=2: the same adapter tensors and the
    same next update bit for bit; a run with another rank is refused naming the keys."""
    data, ckpt = _scored_batch(str(tiny_model_dir)), str(tmp_path / "global_step_1" / "actor")
    for r in run_ranks(_save_then_resume, 2, tmp_path, tp=2, args=(str(tiny_model_dir), data, ckpt)):
        assert any(not torch.equal(r["saved"][k], r["fresh"][k]) for k in r["saved"])  # the load has work to do
        assert all(torch.equal(r["loaded"][k], v) for k, v in r["saved"].items())
        assert r["again"] == r["uninterrupted"]
        assert all(torch.equal(r["resumed_after"][k], v) for k, v in r["after"].items())
        assert "model.lora_rank" in r["refused"] and "'r': 4" in r["refused"] and "'r': 8" in r["refused"]


def test_offline_export_of_a_lora_checkpoint(tiny_model_dir, tmp_path):
    """``rlfoundry export``'s Megatron path (one process, resharded from TP=2) writes the saved adapter
    (peft directory) and the model merged with it; the saving process trains on after the save, and the
    adapter it took at the save keeps its values (``adapter_weights`` copies: the TP-replicated halves
    would otherwise be the live parameters and show the later update)."""
    data, ckpt = _scored_batch(str(tiny_model_dir)), str(tmp_path / "global_step_1" / "actor")
    [saved, _] = run_ranks(_save_then_train_on, 2, tmp_path, tp=2, args=(str(tiny_model_dir), data, ckpt))
    run_ranks(_export_offline, 1, tmp_path, args=(ckpt, str(tmp_path / "export")))
    exported = _load(str(tmp_path / "export" / "adapter" / "adapter_model.safetensors"))
    assert set(exported) == set(saved) and all(torch.equal(exported[k], v) for k, v in saved.items())
    merged = _load(str(tmp_path / "export" / "merged" / "model.safetensors"))
    _check_merged(str(tiny_model_dir), str(tmp_path / "export" / "adapter"), merged)


def _check_merged(model_dir: str, adapter: str, merged: dict) -> None:
    """The engine's merged stream = peft's merge_and_unload of the adapter directory it exported."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    assert set(merged) <= set(expected) and "model.layers.0.self_attn.q_proj.weight" in merged
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _load(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)
