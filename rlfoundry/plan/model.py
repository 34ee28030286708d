"""A model's shape from its ``config.json`` alone: parameter counts (total and active per token), the
KV cache per token and the activation footprint per token. No weights are opened.

Families read: Llama/Qwen2/Qwen3/Mistral (dense, grouped-query attention), Qwen2-MoE / Qwen3-MoE /
Mixtral (routed experts, optional shared expert) and DeepSeek-V2/V3 (multi-head latent attention,
``first_k_dense_replace`` dense layers, shared experts). A vision-language config plans its
``text_config`` (the language model dominates weights and activations).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PlanInputError(ValueError):
    """A model directory or config the planner cannot read."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # the shared expert(s)' total MLP width
    moe_layers: int = 0  # how many of ``layers`` are MoE
    # multi-head latent attention (DeepSeek): 0 = standard attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    name: str = ""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and self.moe_layers > 0


def _get(cfg: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _moe_layer_count(cfg: dict, layers: int) -> int:
    """Qwen MoE: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``; DeepSeek: all after
    ``first_k_dense_replace``; Mixtral: all."""
    if "first_k_dense_replace" in cfg:
        return layers - int(cfg["first_k_dense_replace"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def shape_from_config(cfg: dict, name: str = "") -> ModelShape:
    """Read the figures the planner needs from a parsed ``config.json`` (a dict)."""
    if isinstance(cfg.get("text_config"), dict):  # vision-language: plan the language model
        cfg = {**cfg, **cfg["text_config"]}
    try:
        hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        heads, vocab = int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
    except KeyError as e:
        raise PlanInputError(f"config.json lacks {e.args[0]!r}; the planner reads hidden_size, num_hidden_layers, "
                             "num_attention_heads and vocab_size") from None
    experts = int(_get(cfg, "num_experts", "n_routed_experts", "num_local_experts", default=0) or 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    moe_inter = int(_get(cfg, "moe_intermediate_size", default=0) or 0)
    if experts and not moe_inter:  # Mixtral: experts as wide as the dense MLP
        moe_inter = int(cfg["intermediate_size"])
    if cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * moe_inter
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=hidden // heads)), intermediate=int(cfg.get("intermediate_size") or 0),
        vocab=vocab, tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type", "").startswith("qwen2"))),
        qk_norm=str(cfg.get("model_type", "")).startswith("qwen3"),
        experts=experts, experts_per_token=int(_get(cfg, "num_experts_per_tok", default=0) or 0),
        moe_intermediate=moe_inter, shared_intermediate=shared,
        moe_layers=_moe_layer_count(cfg, layers) if experts else 0,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0), qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0), name=name or str(cfg.get("_name_or_path", "")),
    )


def load_shape(model_dir: str | Path) -> ModelShape:
    """``config.json`` of a model directory (only that file is read)."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        raise PlanInputError(f"{path} does not exist; the planner needs the model's config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanInputError(f"{path} is not valid JSON ({e})") from None
    return shape_from_config(cfg, name=Path(model_dir).name)


# ───────────────────────────────────── parameter counts ─────────────────────────────────────


def attention_params(m: ModelShape) -> int:
    """One layer's attention weights. GQA: q and o are hidden × heads·head_dim, k and v hidden ×
    kv_heads·head_dim (+ biases on q, k, v in Qwen2; + a head_dim RMSNorm on q and k in Qwen3).
    MLA (DeepSeek): q through a rank-``q_lora_rank`` bottleneck, k/v from one ``kv_lora_rank`` latent
    plus a shared rope key; o is heads·v_head_dim × hidden."""
    h = m.hidden
    if m.kv_lora_rank:
        qk = m.qk_nope_dim + m.qk_rope_dim
        q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.heads * qk) if m.q_lora_rank else h * m.heads * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_dim) + m.kv_lora_rank + m.kv_lora_rank * m.heads * (m.qk_nope_dim + m.v_head_dim)
        return q + kv + m.heads * m.v_head_dim * h
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    weights = h * q + 2 * h * kv + q * h
    bias = (q + 2 * kv) if m.qkv_bias else 0
    return weights + bias + (2 * m.head_dim if m.qk_norm else 0)


def mlp_params(width: int, hidden: int) -> int:
    """A gated (SwiGLU) MLP: gate and up are hidden × width, down width × hidden: 3·hidden·width."""
    return 3 * hidden * width


def moe_layer_params(m: ModelShape) -> tuple[int, int]:
    """(total, active per token) of one MoE MLP: the router (hidden × experts), every expert, the shared
    expert (+ Qwen2-MoE's 1-wide shared-expert gate); a token runs ``experts_per_token`` experts."""
    router = m.hidden * m.experts
    shared = mlp_params(m.shared_intermediate, m.hidden) + (m.hidden if m.shared_intermediate and not m.kv_lora_rank else 0)
    expert = mlp_params(m.moe_intermediate, m.hidden)
    return router + shared + m.experts * expert, router + shared + m.experts_per_token * expert


def param_counts(m: ModelShape) -> tuple[int, int]:
    """(total, active per token): embeddings + (untied) LM head + layers (attention, MLP or MoE, two
    RMSNorms) + the final norm."""
    embed = m.vocab * m.hidden * (1 if m.tied else 2)
    norms = 2 * m.hidden
    dense_layers = m.layers - m.moe_layers
    dense = attention_params(m) + mlp_params(m.intermediate, m.hidden) + norms
    total = active = embed + m.hidden + dense_layers * dense
    if m.moe_layers:
        moe_total, moe_active = moe_layer_params(m)
        base = attention_params(m) + norms
        total += m.moe_layers * (base + moe_total)
        active += m.moe_layers * (base + moe_active)
    return total, active


def expert_params(m: ModelShape) -> int:
    """Routed-expert weights over all layers: what expert parallelism divides."""
    return m.moe_layers * m.experts * mlp_params(m.moe_intermediate, m.hidden) if m.is_moe else 0


def lora_params(m: ModelShape, rank: int) -> int:
    """LoRA on every linear of the layers ("all-linear"): A (in × r) + B (r × out) per projection, i.e.
    r·(in + out). Routed experts are not adapted (peft's all-linear skips the fused expert weights of
    the MoE families here; an approximation for per-expert linears)."""
    if rank <= 0:
        return 0
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    attn = (h + q) + 2 * (h + kv) + (q + h)
    dense_mlp = 2 * (h + m.intermediate) + (m.intermediate + h)
    per_layer_moe = 3 * (h + m.shared_intermediate) if m.shared_intermediate else 0
    dense_layers = m.layers - m.moe_layers
    return rank * (m.layers * attn + dense_layers * dense_mlp + m.moe_layers * per_layer_moe)


# ───────────────────────────────────── per-token figures ─────────────────────────────────────


def kv_bytes_per_token(m: ModelShape, dtype_bytes: int) -> int:
    """KV cache per token: K and V for each layer, kv_heads·head_dim each: 2·layers·kv_heads·head_dim·bytes.
    MLA caches the compressed latent and the rope key instead: layers·(kv_lora_rank + qk_rope_dim)·bytes."""
    if m.kv_lora_rank:
        return m.layers * (m.kv_lora_rank + m.qk_rope_dim) * dtype_bytes
    return 2 * m.layers * m.kv_heads * m.head_dim * dtype_bytes


def layer_activation_bytes_per_token(m: ModelShape, dtype_bytes: int, moe: bool) -> int:
    """What one decoder layer keeps for its backward, per token, with flash/SDPA attention (no
    seq×seq score matrix). Values saved (each ``dtype_bytes``):
      attention: the norm's input (h), q/k/v's input (h), q, k, v (heads·hd + 2·kv·hd), o's input (heads·hd)
      MLP: the residual (h), the norm's output (h), gate and up outputs (2·I), silu(gate) (I), the
           product into down (I): 4·I
    i.e. (4h + 2·heads·hd + 2·kv·hd + 4·I) values; a MoE layer's I is experts_per_token·moe_I +
    shared_I (each routed copy of a token keeps its expert's values) plus the router's fp32 logits.
    Korthikanti et al. 2022 (arXiv 2205.05198) count 34·h bytes for a GPT layer with a 4h MLP;
    SwiGLU's wider MLP and GQA change the terms, hence this derivation."""
    attn = 4 * m.hidden + 2 * m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim
    if moe:
        width = m.experts_per_token * m.moe_intermediate + m.shared_intermediate
        return (attn + 4 * width) * dtype_bytes + 4 * m.experts
    return (attn + 4 * m.intermediate) * dtype_bytes
