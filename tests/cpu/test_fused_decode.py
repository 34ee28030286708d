"""The fused one-token decode step reproduces the Hugging Face forward it replaces."""

from __future__ import annotations

import contextlib

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from rlfoundry.protocol import DataProto
from rlfoundry.cpu.fused_decode import FusedDecoder, unsupported_reason
from rlfoundry.workers.rollout.hf_rollout import HFRollout, _new_kv_cache


def _model(model_type: str, **extra):
    """A random 2-layer model of the family; q/k/v biases for qwen2, q/k norms for qwen3."""
    sizes = {"vocab_size": 97, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
             "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256}
    config = AutoConfig.for_model(model_type, tie_word_embeddings=False, **{**sizes, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-initialises biases and norms: make every term count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _left_padded(batch: int = 3, width: int = 9, vocab: int = 97):
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (batch, width))
    mask = torch.ones(batch, width, dtype=torch.long)
    mask[0, :4], mask[1, :1] = 0, 0
    ids[mask == 0] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("model_type,extra", [
    ("qwen2", {}), ("llama", {}), ("qwen3", {"head_dim": 12}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    # wide enough that the projections run on oneDNN-packed weights (cpu/tuning.py: DECODE_PACK_MIN)
    ("qwen2", {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}),
])
@pytest.mark.numerics
def test_step_logits_equal_hf_forward_with_cache(model_type, extra):
    model = _model(model_type, **extra)
    assert unsupported_reason(model, 40) is None
    ids, mask, pos = _left_padded()
    steps = 6
    with torch.no_grad():
        ref_cache, our_cache = _new_kv_cache(model.config, 40), _new_kv_cache(model.config, 40)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=ref_cache, use_cache=True)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=our_cache, use_cache=True)
        fused = FusedDecoder(model, max_positions=64)
        from rlfoundry.cpu.linear import onednn_available

        wide = model.config.hidden_size >= 512
        first = fused.layers[0]
        mlp = (first.gate, first.up) if first.gate_up is None else (first.gate_up,)
        assert (first.gate_up is None) == (wide and onednn_available())  # packed: gate and up apart
        assert all((p.packed is not None) == (wide and onednn_available()) for p in (first.qkv, first.o, *mlp, first.down))
        tokens, next_pos = torch.tensor([5, 17, 60]), pos[:, -1] + 1
        for t in range(steps):
            full = torch.cat([mask, torch.ones(3, t + 1, dtype=torch.long)], dim=1)
            ref = model(input_ids=tokens[:, None], attention_mask=full, position_ids=next_pos[:, None],
                        past_key_values=ref_cache, use_cache=True).logits[:, -1]
            ours = fused.step(tokens, next_pos, full, our_cache)
            # the fused step re-associates the layer sums (oneDNN/MKL blocking): fp32 rounding of logits ~O(10)
            assert torch.allclose(ours, ref, atol=2e-5, rtol=1e-5), (t, (ours - ref).abs().max())
            tokens, next_pos = ref.argmax(-1), next_pos + 1
        assert our_cache.layers[0].keys.shape[2] == ids.shape[1] + steps


def _rollout(model, fused: bool, **over) -> HFRollout:
    cfg = {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": True, "response_length": 16,
           "seed": 4, "val_kwargs": {}, **over}  # a seed where some rows end early and some run to 16 tokens
    return HFRollout(model, OmegaConf.create(cfg), pad_token_id=0, eos_token_id=list(range(3, 97, 7)), cpu_kernels=fused)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.numerics
def test_rollouts_match_with_sampling_eos_and_row_dropping(model_type):
    """Same seed: same tokens, lengths and log-probs; many EOS ids make rows finish (and leave) early."""
    model = _model(model_type)
    ids, mask, pos = _left_padded()
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    ref = _rollout(model, fused=False).generate_sequences(prompts)
    out = _rollout(model, fused=True).generate_sequences(prompts)
    assert torch.equal(out.batch["responses"], ref.batch["responses"])
    lengths = out.batch["response_mask"].sum(-1)
    assert torch.equal(lengths, ref.batch["response_mask"].sum(-1))
    assert lengths.min() < 16 and lengths.max() == 16, "rows should stop at assorted steps"
    # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    assert torch.allclose(out.batch["rollout_log_probs"], ref.batch["rollout_log_probs"], atol=1e-5)


def test_unsupported_models_name_the_reason_and_fall_back():
    dynamic = _model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "depends on the sequence length" in unsupported_reason(dynamic, 40)
    window = _model("mistral", sliding_window=8)
    assert "sliding window" in unsupported_reason(window, 40)
    assert unsupported_reason(window, 8) is None
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=97, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in unsupported_reason(gpt2, 40)
    # the rollout then takes HF's forward and still samples the same as with the switch off
    ids, mask, pos = _left_padded()
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    a = _rollout(dynamic, fused=True).generate_sequences(prompts)
    b = _rollout(dynamic, fused=False).generate_sequences(prompts)
    assert torch.equal(a.batch["responses"], b.batch["responses"])


def test_cpu_kernels_off_takes_the_plain_path(monkeypatch):
    """Off (what the worker passes on GPUs): no FusedDecoder and plain ``unsharded`` (no FSDP hook pausing)."""
    from rlfoundry.workers.rollout import hf_rollout

    used = []

    def spy(name):
        real = getattr(hf_rollout, name)
        return lambda *args, **kwargs: used.append(name) or real(*args, **kwargs)

    for name in ("FusedDecoder", "inference_unsharded", "unsharded"):
        monkeypatch.setattr(hf_rollout, name, spy(name))
    ids, mask, pos = _left_padded()
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    _rollout(_model("qwen2"), fused=False).generate_sequences(prompts)
    assert used == ["unsharded"]
    used.clear()
    _rollout(_model("qwen2"), fused=True).generate_sequences(prompts)
    assert used == ["inference_unsharded", "FusedDecoder"]


@pytest.mark.parametrize("extra", [{}, {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}],
                         ids=["small", "packed"])
@pytest.mark.numerics
def test_a_lora_adapter_folds_into_the_fused_step(extra):
    """A peft model (adapter B ≠ 0): the fused step folds W + scaling·BA into the weights it copies and
    gives peft's own forward; with the adapter disabled, the base model's."""
    peft = pytest.importorskip("peft")

    torch.manual_seed(2)
    model = peft.get_peft_model(_model("qwen2", **extra), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval()
    assert unsupported_reason(model, 40) is None
    ids, mask, pos = _left_padded()
    with torch.no_grad():
        for disabled in (False, True):
            ref_cache, our_cache = _new_kv_cache(model.config, 40), _new_kv_cache(model.config, 40)
            context = model.disable_adapter() if disabled else contextlib.nullcontext()
            with context:
                model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=ref_cache, use_cache=True)
                model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=our_cache, use_cache=True)
                fused = FusedDecoder(model, max_positions=64)
                tokens, next_pos = torch.tensor([5, 17, 60]), pos[:, -1] + 1
                full = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
                ref = model(input_ids=tokens[:, None], attention_mask=full, position_ids=next_pos[:, None],
                            past_key_values=ref_cache, use_cache=True).logits[:, -1]
                ours = fused.step(tokens, next_pos, full, our_cache)
            # as above, plus the adapter folded into W (one more rounding of W + s·BA)
            assert torch.allclose(ours, ref, atol=5e-5, rtol=1e-5), (disabled, (ours - ref).abs().max())
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    plain, folded = (_rollout(model, fused=f).generate_sequences(prompts) for f in (False, True))
    assert torch.equal(folded.batch["responses"], plain.batch["responses"])
    # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    assert torch.allclose(folded.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-5)
