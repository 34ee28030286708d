"""The locally built tokenizer and model behave like hub ones through the real HF code paths."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfoundry.models.tiny import build_tokenizer


def test_tokenizer_round_trips_any_text_and_reloads_with_same_ids(tiny_model_dir):
    text = "Natalia sold 48/2 = 24 clips.\n#### 72 ½ \\frac{1}{2}"
    built = build_tokenizer()
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = built(text)["input_ids"]
    # one token per UTF-8 byte: "½" is two bytes
    assert len(ids) == len(text.encode("utf-8"))
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids) == text


def test_chat_template_and_special_tokens(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2
    assert tokenizer.padding_side == "left"


def test_saved_model_loads_and_is_deterministic(tiny_model_dir):
    m1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    m2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    x = torch.tensor([[1, 50, 51, 52]])
    torch.testing.assert_close(m1(x).logits, m2(x).logits, rtol=0, atol=0)
    assert m1.config.vocab_size == 260


def test_tiny_moe_routes_each_token_to_top_k_of_its_experts_and_reloads_identically(tiny_moe_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers) == (8, 2, 2)
    x = torch.tensor([[1, 50, 51, 52, 53]])
    out = model(x, output_router_logits=True)
    # one router distribution per layer over the 8 experts for each of the 5 tokens
    assert [tuple(r.shape) for r in out.router_logits] == [(5, 8), (5, 8)]
    again = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)(x).logits
    torch.testing.assert_close(out.logits, again, rtol=0, atol=0)


def test_tiny_qwen3_is_the_dense_twin_of_the_tiny_qwen3_moe():
    """The MoE cost benchmark's pair (benchmarks/moe_step_cost.py): the same attention (Qwen3Config's head_dim
    would default to 128; here hidden / heads = 24, as Qwen3-MoE's), and a dense MLP of k x the expert width
    holding exactly the weights a token passes through in the MoE (2 experts x 3 x 96 x 96)."""
    from rlfoundry.models.tiny import build_tiny_model

    tok = build_tokenizer()
    shape = dict(hidden_size=96, num_layers=1, num_heads=4, num_kv_heads=2)
    dense = build_tiny_model(tok, arch="qwen3", intermediate_size=192, **shape)
    moe = build_tiny_model(tok, arch="qwen3_moe", intermediate_size=96, num_experts=8, num_experts_per_tok=2, **shape)
    attn = {n: p.shape for n, p in dense.model.layers[0].self_attn.named_parameters()}
    assert attn == {n: p.shape for n, p in moe.model.layers[0].self_attn.named_parameters()}
    assert attn["q_proj.weight"] == (4 * 24, 96)
    active = 2 * sum(p[0].numel() for p in moe.model.layers[0].mlp.experts.parameters())
    assert sum(p.numel() for p in dense.model.layers[0].mlp.parameters()) == active == 2 * 3 * 96 * 96
