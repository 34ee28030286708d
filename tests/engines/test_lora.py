"""LoRA on the FSDP engine (peft): the adapter starts as a no-op, only it trains, the base comes back
exactly with the adapter off, and the merged / adapter weights and checkpoints reproduce the model."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models.hf import load_hf_model
from rlfoundry.models.lora import LoraSpec, hf_weight_name
from rlfoundry.utils.errors import CheckpointMismatchError
from tests.engines.test_fsdp_engine import _batch, _nll
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture

pytest.importorskip("peft")

SPEC = LoraSpec(rank=4, alpha=8)
PLAN = UpdatePlan(mini_batch_size=4, micro=MicroBatching(size=2))


def _engine(model_dir, lora: LoraSpec | None = SPEC, trainable: bool = True, cpu_kernels: str = "off") -> FSDPEngine:
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels=cpu_kernels,
                              optim=OptimConfig(lr=1e-2, weight_decay=0.0) if trainable else None, lora=lora)
    return FSDPEngine.build(config, "cpu", role="actor")


def _log_probs(engine_or_module, data) -> torch.Tensor:
    if isinstance(engine_or_module, FSDPEngine):
        return engine_or_module.infer_batch(data, LogProbs(), MicroBatching(size=4))["log_probs"]
    out = engine_or_module(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"],
                           position_ids=data.batch["position_ids"]).logits
    width = data.batch["responses"].shape[1]
    logits = out[:, -width - 1:-1].float().log_softmax(-1)
    lp = logits.gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
    return lp * data.batch["response_mask"]


def _trained(model_dir, steps: int = 2) -> FSDPEngine:
    engine = _engine(model_dir)
    for _ in range(steps):
        engine.train_batch(_batch(), LogProbs(), _nll, PLAN)
    return engine


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
@pytest.mark.numerics
def test_a_new_adapter_leaves_the_log_probs_unchanged(process_group, tiny_model_dir, cpu_kernels):
    data = _batch()
    base = _log_probs(_engine(tiny_model_dir, lora=None, trainable=False, cpu_kernels=cpu_kernels), data)
    adapted = _engine(tiny_model_dir, cpu_kernels=cpu_kernels)
    assert torch.equal(_log_probs(adapted, data), base)  # B = 0: bit for bit
    trainable = [n for n, p in adapted.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in adapted.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in adapted.module.parameters() if p.requires_grad}


@pytest.mark.numerics
def test_an_update_moves_only_the_adapter_and_the_adapter_off_is_the_base(process_group, tiny_model_dir):
    data = _batch()
    engine = _engine(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.train_batch(data, LogProbs(), _nll, PLAN)
    moved = {n for n, p in engine.module.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved), moved
    assert any(".lora_B." in n for n in moved)  # B leaves zero: the policy changed
    base = _log_probs(load_hf_model(tiny_model_dir).eval(), data)
    with engine.adapter_disabled():
        torch.testing.assert_close(_log_probs(engine, data), base, atol=1e-6, rtol=0)  # the reference
    assert (_log_probs(engine, data) - base).abs().max() > 1e-3
    # moments for the adapter only (A's first gradient is zero while B = 0, so only B moved yet)
    assert len(engine.optimizer.state) == sum(p.requires_grad for p in engine.module.parameters()) == 2 * len(moved)


@pytest.mark.numerics
def test_merged_weights_are_hf_named_and_reproduce_the_adapted_model(process_group, tiny_model_dir):
    data = _batch()
    engine = _trained(tiny_model_dir)
    merged = dict(engine.iter_hf_weights())
    plain = load_hf_model(tiny_model_dir).eval()
    assert set(merged) == set(dict(plain.named_parameters()))
    plain.load_state_dict(merged)
    # W + s·BA merged into one matrix vs applied apart: one more fp32 rounding per weight, ~u·H·|logit|
    torch.testing.assert_close(_log_probs(plain, data), _log_probs(engine, data), atol=1e-5, rtol=0)


@pytest.mark.numerics
def test_both_exports_load_and_give_the_trained_log_probs(process_group, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = _batch()
    engine = _trained(tiny_model_dir)
    want = _log_probs(engine, data)
    engine.save_hf_model(str(tmp_path / "merged"))
    engine.save_hf_model(str(tmp_path / "adapter"), adapter_only=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    # W + s·BA merged into one matrix vs applied apart: one more fp32 rounding per weight, ~u·H·|logit|
    torch.testing.assert_close(_log_probs(merged, data), want, atol=1e-5, rtol=0)
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    adapter = PeftModel.from_pretrained(load_hf_model(tiny_model_dir), str(tmp_path / "adapter")).eval()
    # the same adapter applied the same way (peft): bit for bit in practice; 1e-6 for the log-softmax's order
    torch.testing.assert_close(_log_probs(adapter, data), want, atol=1e-6, rtol=0)
    # and a run can start from it (model.lora_adapter_path)
    resumed = _engine(tiny_model_dir, lora=LoraSpec(rank=4, alpha=8, adapter_path=str(tmp_path / "adapter")))
    # the same adapter applied the same way (peft): bit for bit in practice; 1e-6 for the log-softmax's order
    torch.testing.assert_close(_log_probs(resumed, data), want, atol=1e-6, rtol=0)
    assert any(p.requires_grad for p in resumed.module.parameters())


@pytest.mark.numerics
def test_a_checkpoint_holds_the_adapter_and_resumes_the_next_step_exactly(process_group, tiny_model_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    engine = _trained(tiny_model_dir)
    engine.save_checkpoint(str(tmp_path / "ckpt"), {})
    saved = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    adapter = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert model_keys == {f"model.{n}" for n in adapter}  # no base weight: the model directory has them
    assert any(k.startswith("optimizer.state.") and ".lora_A." in k for k in saved)
    engine.train_batch(_batch(), LogProbs(), _nll, PLAN)
    resumed = _engine(tiny_model_dir)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    resumed.train_batch(_batch(), LogProbs(), _nll, PLAN)
    want = dict(engine.module.named_parameters())
    for name, param in resumed.module.named_parameters():
        assert torch.equal(param, want[name]), name  # same weights, same Adam moments before the step
    with pytest.raises(CheckpointMismatchError, match="holds a LoRA adapter, but the model"):
        _engine(tiny_model_dir, lora=None).load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointMismatchError, match="'r': 4.*'r': 8"):
        _engine(tiny_model_dir, lora=LoraSpec(rank=8, alpha=8)).load_checkpoint(str(tmp_path / "ckpt"))


def test_hf_weight_names_drop_peft_prefixes_and_adapter_tensors():
    assert hf_weight_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert hf_weight_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") is None
    assert hf_weight_name("base_model.model.score.modules_to_save.default.weight") == "score.weight"
    assert hf_weight_name("base_model.model.score.original_module.weight") is None
    assert hf_weight_name("model.norm.weight") == "model.norm.weight"


def test_the_adapter_handed_out_keeps_its_values_through_later_updates(process_group, tiny_model_dir):
    """``adapter_weights`` is a snapshot (the FSDP engine at one rank would otherwise hand out the live
    parameters, and a caller keeping them, as a rollout's adapter, would see the next update)."""
    engine = _trained(tiny_model_dir, steps=1)
    taken = engine.adapter_weights()
    kept = {k: v.clone() for k, v in taken.items()}
    engine.train_batch(_batch(), LogProbs(), _nll, PLAN)
    assert all(torch.equal(taken[k], v) for k, v in kept.items())
    assert any(not torch.equal(engine.adapter_weights()[k], v) for k, v in kept.items())  # it did move
