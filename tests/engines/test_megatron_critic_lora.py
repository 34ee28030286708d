"""LoRA on the Megatron critic (engines/megatron/lora.py, the value head trained in full) against the
FSDP2 critic's peft model (``TOKEN_CLS``, ``modules_to_save=["score"]``): two gloo CPU ranks at TP=2
and at PP=2, fp32, both engines starting from one peft adapter directory (random A, B and head, so the adapted
critic differs from the base and its values from zero at the first forward).

The values before and after one critic update (two optimiser steps, value clipping, weight decay),
the update's metrics and the adapter + head after it equal FSDP2's; only adapters and the head train,
and the frozen base stays the same bits. A fresh adapter trained a step, saved and resumed takes the
uninterrupted run's next update bit for bit; its adapter export (peft directory with the head) and its
merged export give the engine's values in peft / transformers; the offline export of the checkpoint
writes the saved adapter."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_critic import MICRO, MINI, _critic_config, _value_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

RANK, ALPHA = 4, 8


def _spec(adapter: str | None = None, rank: int = RANK):
    from rlfoundry.models.lora import LoraSpec

    # what CriticWorker asks of either engine
    return LoraSpec(rank=rank, alpha=ALPHA, adapter_path=adapter, task_type="TOKEN_CLS", modules_to_save=("score",))


def _adapter_dir(model_dir: str, out) -> str:
    """A critic's peft adapter (every projection, the head saved in full) with A, B and the head random: a
    fresh adapter's B = 0 and zero head would hide a wrong B layout, a missing reduction or an unloaded head."""
    from peft import get_peft_model
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(11)
    base = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model = get_peft_model(base, _spec().peft_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.05)
            elif ".modules_to_save." in name:  # the head: values of O(0.1-1) from the first forward
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    return str(out)


def _fsdp(rank: int, model_dir: str, data, adapter: str):
    from rlfoundry.config.schema import FSDPConfig
    from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
    from rlfoundry.workers.critic import CriticBatchSizes, DataParallelPPOCritic, zero_init_new_value_head

    cfg = _critic_config()
    engine = FSDPEngine.build(
        FSDPEngineConfig(path=model_dir, fsdp=FSDPConfig(), optim=cfg.optim, grad_clip=cfg.grad_clip,
                         model_kind="token_classification", override_config={"classifier_dropout": 0.0},
                         cpu_kernels="off", lora=_spec(adapter)),
        "cpu", role="critic", prepare=lambda m: zero_init_new_value_head(m, model_dir))
    critic = DataParallelPPOCritic(cfg, engine, CriticBatchSizes(MINI, MICRO, MICRO))
    before = critic.compute_values(data)
    metrics = critic.update_critic(data)
    return {"before": before, "values": critic.compute_values(data), "metrics": metrics,
            "adapter": engine.adapter_weights()}


def _megatron_critic(model_dir: str, spec, tp: int = 2, pp: int = 1):
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.critic import CriticBatchSizes, DataParallelPPOCritic

    cfg = _critic_config()
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, dtype="float32")
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip,
                                                 model_kind="token_classification", lora=spec), "cpu", role="critic")
    return DataParallelPPOCritic(cfg, engine, CriticBatchSizes(MINI, MICRO, MICRO))


def _megatron(rank: int, model_dir: str, data, adapter: str, tp: int, pp: int):
    critic = _megatron_critic(model_dir, _spec(adapter), tp, pp)
    chunks = critic.engine.chunks
    frozen = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters() if not p.requires_grad}
    trainable = sorted(n for c in chunks for n, p in c.named_parameters() if p.requires_grad)
    before = critic.compute_values(data)
    metrics = critic.update_critic(data)
    base_kept = all(torch.equal(p, frozen[n]) for c in chunks for n, p in c.named_parameters() if n in frozen)
    moments = {id(p) for p in critic.engine.optimizer.optimizer.state}
    return {"before": before, "values": critic.compute_values(data), "metrics": metrics, "frozen": len(frozen),
            "adapter": critic.engine.adapter_weights(), "base_kept": base_kept, "trainable": trainable,
            "moments": len(moments), "last_stage": critic.engine._last_stage()}


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_critic_lora_equals_fsdp_lora(tiny_model_dir, tmp_path, tp, pp):
    """TP=2 (the adapters' splits and reductions) and PP=2 (the head on the last stage, gathered from it)."""
    model_dir = str(tiny_model_dir)
    adapter = _adapter_dir(model_dir, tmp_path / "start")
    data = _value_batch()
    [fsdp] = run_ranks(_fsdp, 1, tmp_path, args=(model_dir, data, adapter))
    results = run_ranks(_megatron, 2, tmp_path, tp=tp, pp=pp, args=(model_dir, data, adapter, tp, pp))
    start = _load(f"{adapter}/adapter_model.safetensors")
    assert "base_model.model.score.weight" in start and "base_model.model.score.bias" in start
    assert fsdp["before"].abs().max() > 1e-2  # the saved head is loaded: the values are not the zero head's
    assert (fsdp["values"] - fsdp["before"]).abs().max() > 1e-3  # the update moved them
    assert fsdp["metrics"]["critic/vf_clipfrac"][0] > 0  # the clipped branch is exercised
    for name in ("base_model.model.score.weight", "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"):
        assert (fsdp["adapter"][name] - start[name]).abs().max() > 1e-4, name  # the head and B both train
    for r in results:
        # only the adapters (7 modules x (A, B) x the rank's 2 / pp layers) and, on the last stage, the head
        # (weight, bias) train; Adam holds them alone
        trains = 28 // pp + 2 * r["last_stage"]
        assert len(r["trainable"]) == trains and r["moments"] == trains and r["frozen"] > 0
        assert all("_lora." in n or n.endswith(("output_layer.weight", "output_layer.bias")) for n in r["trainable"])
        assert r["base_kept"]
        # TP/PP re-associate the forward's sums: fp32 rounding of O(1) values (test_megatron_critic's bound)
        torch.testing.assert_close(r["before"], fsdp["before"], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["values"], fsdp["values"], atol=1e-5, rtol=0)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            assert r["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
        assert set(r["adapter"]) == set(fsdp["adapter"]) == set(start)
        # two Adam steps with eps=1e-4 move a weight by <= lr/eps = 10x its gradient's rounding, ~1e-6
        for name, tensor in fsdp["adapter"].items():
            torch.testing.assert_close(r["adapter"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _save_then_resume(rank: int, model_dir: str, data, ckpt: str, out: str):
    critic = _megatron_critic(model_dir, _spec())
    critic.update_critic(data)
    critic.engine.step_lr_scheduler()
    critic.engine.save_checkpoint(ckpt, {"global_step": 1})
    saved, saved_values = critic.engine.adapter_weights(), critic.compute_values(data)
    critic.engine.save_hf_model(f"{out}/adapter", adapter_only=True)
    critic.engine.save_hf_model(f"{out}/merged")
    uninterrupted = critic.update_critic(data)

    resumed = _megatron_critic(model_dir, _spec())
    fresh = resumed.engine.adapter_weights()
    resumed.engine.load_checkpoint(ckpt)
    loaded = resumed.engine.adapter_weights()
    again = resumed.update_critic(data)
    try:
        _megatron_critic(model_dir, _spec(rank=2 * RANK)).engine.load_checkpoint(ckpt)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"saved": saved, "saved_values": saved_values, "fresh": fresh, "loaded": loaded,
            "uninterrupted": uninterrupted, "again": again, "after": critic.engine.adapter_weights(),
            "resumed_after": resumed.engine.adapter_weights(), "refused": refused}


def _export_offline(rank: int, ckpt: str, out: str):
    from rlfoundry.engines.megatron.export import export_megatron_checkpoint

    export_megatron_checkpoint(ckpt, out, adapter_only=True)


def test_critic_checkpoint_resumes_and_exports_the_adapter(tiny_model_dir, tmp_path):
    """A fresh adapter (B = 0, the head zero: a causal LM's directory) trained one step at TP=2, saved and
    resumed: the same adapter and head, the same next update bit for bit; another rank is refused naming
    the keys. The peft directory it exports (adapter + head) and its merged export give its values."""
    from rlfoundry import checkpoint as ckpt_lib

    model_dir, data = str(tiny_model_dir), _value_batch()
    ckpt, out = str(tmp_path / "global_step_1" / "critic"), str(tmp_path / "export")
    [r, _] = run_ranks(_save_then_resume, 2, tmp_path, tp=2, args=(model_dir, data, ckpt, out))
    assert r["fresh"]["base_model.model.score.weight"].abs().max() == 0  # the fresh head is zero ...
    assert r["saved"]["base_model.model.score.weight"].abs().max() > 0  # ... the update trained it
    assert all(torch.equal(r["loaded"][k], v) for k, v in r["saved"].items())
    assert r["again"] == r["uninterrupted"]
    assert all(torch.equal(r["resumed_after"][k], v) for k, v in r["after"].items())
    assert "model.lora_rank" in r["refused"] and "'r': 4" in r["refused"] and "'r': 8" in r["refused"]
    marker = ckpt_lib.read_component_marker(tmp_path / "global_step_1" / "critic")["lora"]
    assert marker["task_type"] == "TOKEN_CLS" and marker["modules_to_save"] == ["score"]

    exported = _load(f"{out}/adapter/adapter_model.safetensors")
    assert set(exported) == set(r["saved"]) and all(torch.equal(exported[k], v) for k, v in r["saved"].items())
    assert r["saved_values"].abs().max() > 1e-3
    torch.testing.assert_close(_peft_values(model_dir, f"{out}/adapter", data), r["saved_values"], atol=1e-5, rtol=0)
    torch.testing.assert_close(_hf_values(f"{out}/merged", data), r["saved_values"], atol=1e-5, rtol=0)

    run_ranks(_export_offline, 1, tmp_path, args=(ckpt, str(tmp_path / "offline")))
    offline = _load(str(tmp_path / "offline" / "adapter_model.safetensors"))
    assert set(offline) == set(r["saved"]) and all(torch.equal(offline[k], v) for k, v in r["saved"].items())


def _peft_values(model_dir: str, adapter: str, data) -> torch.Tensor:
    """The values of peft's critic from the base directory and the exported adapter (the head from the adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    base = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    return _values(PeftModel.from_pretrained(base, adapter), data)


def _hf_values(path: str, data) -> torch.Tensor:
    from transformers import AutoModelForTokenClassification

    return _values(AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32), data)


def _values(model, data) -> torch.Tensor:
    """V before each response token, padding zero (as the critic returns them)."""
    batch = data.batch
    width = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    return logits[:, -width - 1:-1, 0] * batch["response_mask"]


def _load(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)
