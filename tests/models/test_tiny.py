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
