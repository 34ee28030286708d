"""The public config.json figures of the models docs/plan.md plans (from their Hugging Face model cards'
config.json), as the planner reads them."""

QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
QWEN25_32B = dict(model_type="qwen2", hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                  num_key_value_heads=8, intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False)
QWEN25_72B = dict(model_type="qwen2", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, intermediate_size=29568, vocab_size=152064, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                     vocab_size=151936, tie_word_embeddings=False)
QWEN3_235B_A22B = dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                       num_key_value_heads=4, head_dim=128, intermediate_size=12288, moe_intermediate_size=1536,
                       num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                       vocab_size=151936, tie_word_embeddings=False)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                   n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536,
                   kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
                   tie_word_embeddings=False)


def write_config(directory, cfg: dict) -> str:
    """A model directory holding config.json alone (no weights, no tokenizer)."""
    import json
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-6,
                                               "max_position_embeddings": 32768}))
    return str(d)
