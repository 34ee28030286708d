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

# The models verl's example command lines name most (scripts/verl_plan_check.py), from the same model cards'
# config.json. Qwen2-7B, Qwen2.5-Math-7B and Qwen2.5-7B share one architecture (QWEN25_7B), as do Qwen2-72B and
# Qwen2.5-72B; the small Qwen2.5 and Qwen3 models tie their embeddings.
QWEN25_05B = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
QWEN25_15B = dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)
QWEN25_3B = dict(model_type="qwen2", hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True)
QWEN25_14B = dict(model_type="qwen2", hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
                  num_key_value_heads=8, intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False)
QWEN3_06B = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
QWEN3_4B = dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False)
QWEN3_32B = dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False)
# deepseek-ai/deepseek-llm-7b-base/-chat: Llama architecture, multi-head attention (DeepSeek LLM paper, table 2)
DEEPSEEK_LLM_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=30, num_attention_heads=32,
                       num_key_value_heads=32, intermediate_size=11008, vocab_size=102400, tie_word_embeddings=False)


def write_config(directory, cfg: dict) -> str:
    """A model directory holding config.json alone (no weights, no tokenizer)."""
    import json
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-6,
                                               "max_position_embeddings": 32768}))
    return str(d)
