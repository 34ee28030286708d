"""Tiny Hugging Face models and a character-level tokenizer, built locally.

No machine this project runs on can reach a model hub, so tests, the default run and the
benchmarks make their own model: a Qwen2 (or Llama) config from ``transformers`` and a
character-level tokenizer from ``tokenizers``, saved as an ordinary HF directory so that every
downstream code path (``from_pretrained``, chat templates, ``save_pretrained``) is the real one.

    python -m rlfoundry.models.tiny --out /tmp/tiny-qwen2 [--hidden-size 64 --num-layers 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, "<unk>"]
ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss")  # build_tiny_model's families

# Qwen2-style ChatML template. The role names are spelled out character by character by this
# tokenizer, which is fine: prompts stay a few dozen tokens long.
# ChatML, as Qwen's; with ``tools`` a short system turn lists them (a byte tokenizer makes every
# character a token, so not their full JSON schemas) and tool results come back as user turns
# wrapped in <tool_response>, as Qwen2.5's template does.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools:' }}"
    "{% for tool in tools %}{% set f = tool['function'] if 'function' in tool else tool %}"
    "{{ ' ' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ') if 'parameters' in f else '') + ')' }}"
    "{% endfor %}{{ '. Call: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255, in byte order.

    Bytes that are printable Latin-1 stand for themselves; the others are shifted past 255
    (the scheme of GPT-2's ``bytes_to_unicode``, which Qwen2's tokenizer also uses).
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def build_tokenizer(chat_template: bool = True, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with one token per byte plus ChatML special tokens.

    It is the GPT-2/Qwen2 byte-level BPE scheme with an empty merge list, so any text round-trips
    exactly (``decode(encode(s)) == s``), and ``AutoTokenizer`` may load it as a Qwen2 tokenizer
    (which re-applies byte-level pre-tokenisation) without changing a single id.

    ``vocab_size``: pad the vocabulary to this many tokens with three-byte filler tokens that no
    merge produces (encoding is unchanged; a sampled filler decodes to its bytes), so a model can
    have a real model's vocabulary — e.g. Qwen2.5's 151,936 — where the softmax over it, not the
    layers, decides the memory and time of log-probs.
    """
    alphabet = _byte_alphabet()
    tokens = SPECIAL_TOKENS + alphabet
    if vocab_size is not None and vocab_size > len(tokens):
        n = len(alphabet)
        tokens += [alphabet[i // (n * n) % n] + alphabet[i // n % n] + alphabet[i % n]
                   for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=None,
        unk_token="<unk>",
        additional_special_tokens=[BOS_TOKEN],
        padding_side="left",  # decoder-only generation pads prompts on the left
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    head: str = "causal_lm",
    tie_word_embeddings: bool = False,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
):
    """A randomly initialised model of the given family, sized for CPU tests.

    ``arch``: ``qwen2``, ``llama``, ``qwen3`` (dense; Qwen3: Qwen2 with q/k norms, the dense twin of
    ``qwen3_moe``) or ``qwen3_moe`` / ``qwen2_moe`` / ``deepseek_v3`` / ``gpt_oss``
    (mixture of experts: every layer sparse with ``num_experts`` experts of width ``intermediate_size``,
    ``num_experts_per_tok`` routed per token; Qwen2-MoE adds its shared expert of the same width;
    DeepSeek-V3 has MLA attention, a dense first layer, one shared expert and grouped routing (the
    experts in 4 groups, a token's experts from the best 2 groups, sigmoid scores); GPT-OSS alternates
    sliding-window and full attention layers and has biased experts and attention sinks).

    ``head`` is ``causal_lm`` (policy), ``token_classification`` (critic: one value per token) or
    ``sequence_classification`` (reward model: one score per sequence). ``tie_word_embeddings``: the
    LM head is the input embedding (as in Qwen2.5-0.5B).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    keys = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        num_labels=1,
    )
    keys.update(_moe_keys(arch, intermediate_size or 2 * hidden_size, num_experts, num_experts_per_tok,
                          hidden_size // num_heads, num_heads))
    config = AutoConfig.for_model(arch, **keys)
    torch.manual_seed(seed)
    if head == "causal_lm":
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    cls = {
        "token_classification": AutoModelForTokenClassification,
        "sequence_classification": AutoModelForSequenceClassification,
    }[head]
    return cls.from_config(config, dtype=torch.float32)


def _moe_keys(arch: str, width: int, num_experts: int, top_k: int, head_dim: int, heads: int) -> dict:
    """The config keys of an MoE family (none for a dense one but Qwen3's head width): experts as wide as the
    dense MLP."""
    if arch == "qwen3":  # Qwen3Config's head_dim defaults to 128 whatever the hidden size; Qwen3-MoE's follows it
        return dict(head_dim=head_dim)
    if arch == "deepseek_v3":
        # MLA with the head split DeepSeek-V3 uses (half rotary, half not), no query compression;
        # grouped routing needs the experts to divide into n_group groups of at least 2
        return dict(n_routed_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                    n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
                    routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=2 * head_dim,
                    qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim // 2, v_head_dim=head_dim,
                    num_key_value_heads=heads)
    if arch == "gpt_oss":
        return dict(num_local_experts=num_experts, num_experts_per_tok=top_k, head_dim=head_dim, sliding_window=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if not arch.endswith("_moe"):
        return {}
    keys = dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch == "qwen2_moe":
        keys["shared_expert_intermediate_size"] = width
    return keys


def save_tiny_model(out_dir: str | Path, **kwargs) -> Path:
    """Build tokenizer + model and save both as one Hugging Face directory; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size=kwargs.pop("vocab_size", None))
    model = build_tiny_model(tok, **kwargs)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="qwen2", choices=list(ARCHS))
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head", default="causal_lm", choices=["causal_lm", "token_classification", "sequence_classification"])
    a = p.parse_args(argv)
    path = save_tiny_model(
        a.out, arch=a.arch, hidden_size=a.hidden_size, num_layers=a.num_layers,
        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, seed=a.seed, head=a.head,
    )
    print(f"saved tiny {a.arch} ({a.head}) to {path}")


if __name__ == "__main__":
    main()
