"""Hugging Face export: an engine's live export, and a saved role alone turned into an HF directory."""

from __future__ import annotations

import json

import torch

from rlfoundry import checkpoint as ckpt
from rlfoundry.engines.fsdp import utils as fsdp_utils
from rlfoundry.models.hf import load_hf_model
from tests.checkpoint import _fsdp_policy, _logits, _train_step


def test_save_hf_model_loads_with_from_pretrained(process_group, tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, optim, sched = _fsdp_policy(tiny_model_dir)
    _train_step(model, optim, sched, seed=3)  # exported weights must be the trained ones
    out = ckpt.save_hf_model(model, tokenizer, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert any(out.glob("*.safetensors")) and not (tmp_path / "hf.tmp").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model), atol=1e-6, rtol=1e-6)
    assert AutoTokenizer.from_pretrained(out).encode("12+3") == tokenizer.encode("12+3")


def test_a_checkpoint_alone_exports_to_hf(process_group, tiny_critic_dir, tokenizer, tmp_path):
    from transformers import AutoModelForTokenClassification

    model = load_hf_model(tiny_critic_dir, "token_classification")
    fsdp_utils.apply_fsdp2(model, "cpu")
    path = ckpt.save_checkpoint(tmp_path / "global_step_1" / "critic", model, tokenizer=tokenizer)
    out = ckpt.export_hf_from_checkpoint(path, tmp_path / "exported")
    reloaded = AutoModelForTokenClassification.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model.eval()), atol=1e-6, rtol=1e-6)
    assert (out / "tokenizer.json").is_file()


def test_one_dispatch_exports_each_role_with_the_exporter_of_the_engine_that_saved_it(tmp_path, monkeypatch):
    from rlfoundry.engines.megatron import export as megatron_export

    # every engine the table names resolves (it names modules, so the import-direction test cannot see them)
    assert ckpt.engine_exporter({"engine": "megatron"}) is megatron_export.export_megatron_checkpoint
    assert all(callable(ckpt.engine_exporter({"engine": engine})) for engine in ckpt.ENGINE_EXPORTERS)
    assert ckpt.engine_exporter({}) is None  # the FSDP engine's DCP shards: read by export_hf_from_checkpoint

    role = tmp_path / "global_step_1" / "actor"
    role.mkdir(parents=True)
    (role / ckpt.COMPONENT_MARKER).write_text(json.dumps({"engine": "megatron"}))
    calls = []
    monkeypatch.setattr(megatron_export, "export_megatron_checkpoint", lambda src, out: calls.append((src, out)) or out)
    assert ckpt.export_hf_from_checkpoint(role, tmp_path / "hf") == tmp_path / "hf"
    assert calls == [(role, tmp_path / "hf")]
