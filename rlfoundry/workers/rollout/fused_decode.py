"""A lean one-token decode step for Llama-family causal LMs (Qwen2, Qwen3, Llama, Mistral).

Why: decoding one token for a batch is a few small matrix products per layer, and on a CPU (or a
GPU without CUDA graphs) a Hugging Face forward spends more time in its per-call machinery — mask
construction, cache bookkeeping, output dataclasses, module hooks — than in the arithmetic. This
step does the same arithmetic with about fifteen tensor ops per layer:

- q/k/v and gate/up projections are each one matrix product over weights concatenated once per
  ``generate_sequences`` call (the same dot products as the separate ``nn.Linear`` s);
- RoPE reads a cos/sin table built once per call by the model's own rotary module (so every
  static RoPE variant — default, linear, llama3, yarn — is whatever HF computes), and rotates q
  and k together with one ``roll`` (bit-identical to HF's ``rotate_half``);
- keys/values are written in place into the preallocated cache that the HF prefill filled.

Everything else (prefill, sampling, dropping finished rows) stays in ``hf_rollout``. Models it does
not recognise fall back to the HF forward (``unsupported_reason`` says why); the tests compare its
logits with HF's token by token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedDecoder", "unsupported_reason"]

_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


def _rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def unsupported_reason(module: nn.Module, capacity: int) -> str | None:
    """None when ``FusedDecoder`` reproduces ``module``'s forward; otherwise why it does not."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {_MODEL_TYPES}"
    if not hasattr(module, "lm_head") or not hasattr(getattr(module, "model", None), "layers"):
        return "not a *ForCausalLM with .model.layers and .lm_head"
    if _rope_type(config) not in _STATIC_ROPE:
        return f"RoPE type {_rope_type(config)!r} depends on the sequence length"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and capacity > window:
        return f"sequences ({capacity}) longer than the sliding window ({window})"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if model_type == "qwen3" and not hasattr(module.model.layers[0].self_attn, "q_norm"):
        return "qwen3 without q_norm/k_norm"
    return None


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's RMSNorm: in fp32, then back to the input dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``signed_sin`` = sin, first half negated."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class _Layer:
    """One decoder layer's weights, projections concatenated (refs to the module's tensors otherwise)."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv_b = torch.cat(biases) if all(b is not None for b in biases) else None
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.down_w, self.act = mlp.down_proj.weight, mlp.act_fn
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.scaling = float(attn.scaling)


class FusedDecoder:
    """Decode one token per row of an HF prefill cache; returns next-token logits (N, V).

    Built inside ``torch.no_grad()`` and the rollout's unsharded-FSDP context, once per
    ``generate_sequences`` call (weights change between calls). ``cache`` is the rollout's
    DynamicCache whose layers expose preallocated ``key_buf``/``value_buf`` (N, Hkv, C, d).
    """

    def __init__(self, module: nn.Module, max_positions: int):
        cfg = module.config
        self.module = module
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.layers = [_Layer(layer) for layer in module.model.layers]
        self.embed, self.norm, self.lm_head = module.model.embed_tokens, module.model.norm, module.lm_head
        self.dtype = self.lm_head.weight.dtype
        # cos/sin for every position this call can reach, from the model's own rotary module
        positions = torch.arange(max_positions, device=self.lm_head.weight.device).unsqueeze(0)
        probe = torch.empty(1, device=positions.device, dtype=self.dtype)
        cos, sin = module.model.rotary_emb(probe, positions)
        # rotate_half(x) * sin == roll(x, d/2) * (sin with its first half negated), bit for bit:
        # one roll instead of two slices, a negation and a concatenation per rotation
        half = self.head_dim // 2
        self.cos, self.signed_sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # (P, d)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """tokens, positions (N,); mask (N, L) 1 = attend, covering the cache plus this token.

        Writes this token's keys/values at column L-1 of every layer's buffers and advances the
        cache layers' lengths to L.
        """
        n, length = tokens.shape[0], mask.shape[1]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(tokens)  # (N, H)
        cos, sin = self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)  # (N, 1, d)
        # the mask as an additive bias in the layout of the score products below (built once per step)
        bias = torch.zeros(n, 1, 1, length, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill_((mask == 0).view(n, 1, 1, length), float("-inf"))
        bias = bias.expand(n, hkv, hq // hkv, length).reshape(n * hkv, hq // hkv, length)
        for layer, kv in zip(self.layers, cache.layers):
            h = _rms_norm(x, layer.in_norm)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
            v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
            if layer.q_norm is None:  # q and k rotated together: they are adjacent in qkv
                qk = _rope(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]
            else:
                q = _rope(layer.q_norm(qkv[:, : hq * d].view(n, hq, d)), cos, sin)
                k = _rope(layer.k_norm(qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)), cos, sin)
            kv.key_buf[:, :, length - 1] = k
            kv.value_buf[:, :, length - 1] = v
            keys, values = kv.key_buf[:, :, :length], kv.value_buf[:, :, :length]
            # grouped-query attention without repeating the keys: (N*Hkv, g, d) x (N*Hkv, d, L); the
            # scale and the mask ride in the product (one kernel instead of three)
            scores = torch.baddbmm(bias, q.reshape(n * hkv, hq // hkv, d), keys.flatten(0, 1).transpose(1, 2),
                                   alpha=layer.scaling)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            attn = torch.bmm(probs.to(values.dtype), values.flatten(0, 1)).reshape(n, hq * d)
            x = x + F.linear(attn, layer.o_w, layer.o_b)
            h = _rms_norm(x, layer.post_norm)
            gate, up = F.linear(h, layer.gate_up_w).chunk(2, dim=-1)
            x = x + F.linear(layer.act(gate) * up, layer.down_w)
        for kv in cache.layers:
            kv.length = length
            kv._refresh_views()
        return F.linear(_rms_norm(x, self.norm), self.lm_head.weight, getattr(self.lm_head, "bias", None))
