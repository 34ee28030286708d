"""The one-pass shared-prompt training forward reproduces the Hugging Face forward it replaces."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from transformers import AutoModelForCausalLM

from rlfoundry.engines.fsdp.forward import CausalLMForward
from rlfoundry.cpu import fused_forward
from rlfoundry.cpu import fused_shared_prompt_logits
from rlfoundry.cpu.linear import use_onednn_linear
from tests.cpu.test_fused_decode import _model


def _batch(vocab: int, prompts: int = 3, n: int = 4, tp: int = 9, tr: int = 11) -> TensorDict:
    """n rows per prompt; prompts left-padded by different amounts, responses ending at different lengths."""
    gen = torch.Generator().manual_seed(0)
    p_ids = torch.randint(3, vocab, (prompts, tp), generator=gen)
    p_mask = torch.ones(prompts, tp, dtype=torch.long)
    p_mask[0, :4], p_mask[1, :1] = 0, 0
    p_ids[p_mask == 0] = 0
    rows = prompts * n
    responses = torch.randint(3, vocab, (rows, tr), generator=gen)
    r_mask = (torch.arange(tr) < torch.randint(1, tr + 1, (rows,), generator=gen)[:, None]).long()
    r_mask[0] = 1  # one row runs to the last column
    responses[r_mask == 0] = 0
    ids = torch.cat([p_ids.repeat_interleave(n, 0), responses], 1)
    mask = torch.cat([p_mask.repeat_interleave(n, 0), r_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return TensorDict(dict(input_ids=ids, attention_mask=mask, position_ids=pos, responses=responses),
                      batch_size=[rows])


def _lm(model: nn.Module, fused: bool) -> CausalLMForward:
    """The engine's shared-prompt forward, one pass (``fused``) or HF's two calls."""
    return CausalLMForward(model, dp_size=1, dp_group=None, use_remove_padding=False, use_shared_prompt=True,
                           shared_prompt_logits=fused_shared_prompt_logits if fused else None)


def _logits_and_grads(model: nn.Module, batch: TensorDict, fused: bool):
    actor = _lm(model, fused)
    first, group = actor._prompt_groups(batch)
    model.zero_grad(set_to_none=True)
    logits, *_ = actor._shared_prompt_response_logits(batch, first, group)
    valid = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    (logits[valid].logsumexp(-1) * torch.linspace(0.5, 1.5, int(valid.sum()))).sum().backward()
    return logits.detach()[valid], {k: p.grad.clone() for k, p in model.named_parameters()}


def _assert_matches_hf(model: nn.Module, batch: TensorDict) -> None:
    assert fused_forward.unsupported_reason(model, batch["input_ids"].shape[1]) is None
    calls = []
    original = fused_forward._forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    fused_forward._forward = counted
    try:
        logits, grads = _logits_and_grads(model, batch, fused=True)
    finally:
        fused_forward._forward = original
    assert calls, "the fused pass did not run"
    ref_logits, ref_grads = _logits_and_grads(model, batch, fused=False)
    # fused kernels re-associate the sums (vector width, oneDNN/MKL blocking): fp32 rounding of O(10) logits
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-5)
    for name, grad in ref_grads.items():
        assert grad.abs().max() > 0, name  # every weight takes part, so equality is not vacuous
        # gradients through the same kernels: fp32 re-association over tokens and hidden; atol for elements ~0
        torch.testing.assert_close(grads[name], grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.numerics
def test_saved_tiny_qwen2_logits_and_gradients_match_hf(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    _assert_matches_hf(model, _batch(model.config.vocab_size))


@pytest.mark.parametrize("model_type,extra", [
    ("qwen2", {}), ("llama", {}), ("qwen3", {"head_dim": 12}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
])
@pytest.mark.numerics
def test_model_families_match_hf(model_type, extra):
    """GQA (6 query / 2 kv heads), q/k/v biases (qwen2), q/k norms (qwen3), scaled RoPE."""
    model = _model(model_type, **extra).train()
    _assert_matches_hf(model, _batch(97))


@pytest.mark.numerics
def test_onednn_linear_layers_match_hf(monkeypatch):
    """Products big enough for the oneDNN blocks (prompt and response rows share every product)."""
    from transformers import AutoConfig

    from rlfoundry.cpu import linear as cpu_linear

    if not cpu_linear.onednn_available():
        pytest.skip("this torch build has no oneDNN")
    config = AutoConfig.for_model("qwen2", vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    use_onednn_linear(model, "cpu")
    calls = []
    original = cpu_linear._onednn
    monkeypatch.setattr(cpu_linear, "_onednn", lambda *a: calls.append(1) or original(*a))
    _assert_matches_hf(model, _batch(97, prompts=4, n=8, tp=16, tr=40))
    assert calls


def test_what_it_does_not_reproduce_takes_the_hf_path():
    model = _model("llama").train()
    assert fused_forward.unsupported_reason(model, 40) is None
    model.config.attention_dropout = 0.1
    assert "dropout" in fused_forward.unsupported_reason(model, 40)
    assert fused_forward.unsupported_reason(model.eval(), 40) is None  # no dropout outside training
    model.config.attention_dropout = 0.0
    model.train().gradient_checkpointing_enable()
    assert "checkpointing" in fused_forward.unsupported_reason(model, 40)
    model.gradient_checkpointing_disable()

    class Adapter(nn.Module):  # what a LoRA wrapper looks like from outside
        def __init__(self, base: nn.Linear):
            super().__init__()
            self.base, self.weight = base, base.weight

        def forward(self, x):
            return self.base(x)

    model.model.layers[0].self_attn.q_proj = Adapter(model.model.layers[0].self_attn.q_proj)
    assert "Adapter" in fused_forward.unsupported_reason(model, 40)
    window = _model("mistral", sliding_window=8)
    assert "sliding window" in fused_forward.unsupported_reason(window, 40)
    # and the actor then runs the HF forward, with the switch on
    batch = _batch(97)
    a, _ = _logits_and_grads(model, batch, fused=True)
    b, _ = _logits_and_grads(model, batch, fused=False)
    assert torch.equal(a, b)


def test_forward_is_restored_after_the_call_even_on_error():
    model = _model("qwen2")
    batch = _batch(97)
    actor = _lm(model, True)
    first, group = actor._prompt_groups(batch)
    actor._shared_prompt_response_logits(batch, first, group)
    assert "forward" not in vars(model)
    with pytest.raises(IndexError):
        fused_forward.shared_prompt_logits(model, batch["input_ids"][first, :9], batch["attention_mask"][first, :9],
                                           batch["position_ids"][first, :9], batch["responses"],
                                           batch["position_ids"][:, 9:], group + 100)
    assert "forward" not in vars(model)



@pytest.mark.parametrize("fused", [True, False], ids=["fused", "hf"])
def test_gradients_on_two_threads_are_bitwise_reproducible(fused):
    """The calculator run's model (docs/on_policy.md, "Replay": a 4 x 128 Qwen2, 260 tokens) on two intra-op
    threads. Each prompt's keys/values and first-token logits are gathered to its rows (135 x 260 = 35,100
    logits: over torch's 32,768-element grain); 5 samples a prompt put a group across the threads' halves.
    Through indexing, the backward added a group's rows with parallel atomic adds: sums in an order that
    varied from pass to pass. Now in row order: equal to torch's deterministic mode, and pass to pass."""
    model = _model("qwen2", vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    use_onednn_linear(model, "cpu")
    batch = _batch(model.config.vocab_size, prompts=27, n=5, tp=32, tr=12)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [_logits_and_grads(model, batch, fused) for _ in range(2)]
        torch.use_deterministic_algorithms(True)
        runs.append(_logits_and_grads(model, batch, fused))
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    for logits, grads in runs[1:]:
        assert torch.equal(logits, runs[0][0])
        differ = [k for k, g in grads.items() if not torch.equal(g, runs[0][1][k])]
        assert not differ, differ
