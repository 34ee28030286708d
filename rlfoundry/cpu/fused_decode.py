"""A lean one-token decode step for Llama-family causal LMs (Qwen2, Qwen3, Llama, Mistral): one of
the CPU kernels (``rlfoundry/cpu``), taken by the HF rollout (``workers/rollout/hf_rollout.py``).

Why: decoding one token for a batch is a few small matrix products per layer, and on a CPU (or a
GPU without CUDA graphs) a Hugging Face forward spends more time in its per-call machinery — mask
construction, cache bookkeeping, output dataclasses, module hooks — than in the arithmetic. This
step does the same arithmetic with about fifteen tensor ops per layer:

- q/k/v and gate/up projections are each one matrix product over weights concatenated once per
  ``generate_sequences`` call (the same dot products as the separate ``nn.Linear`` s);
- on the CPU in fp32 every wide projection's weight is packed once per call into oneDNN's blocked
  layout, which a decode step's few-row products run faster than torch's default (MKL, unpacked)
  path (``_Linear``; figures in benchmarks/README.md, "CPU kernels");
- RoPE reads a cos/sin table built once per call by the model's own rotary module (so every
  static RoPE variant — default, linear, llama3, yarn — is whatever HF computes), and rotates q
  and k together with one ``roll`` (bit-identical to HF's ``rotate_half``);
- keys/values are written in place into the preallocated cache that the HF prefill filled.

Everything else (prefill, sampling, dropping finished rows) stays in ``hf_rollout``. Models it does
not recognise fall back to the HF forward (``unsupported_reason`` says why); the tests compare its
logits with HF's token by token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlfoundry.cpu.linear import onednn_available
from rlfoundry.cpu.llama_ops import rms_norm, rope, signed_sin, unsupported_reason
from rlfoundry.cpu.tuning import DECODE_PACK_MIN as _PACK_MIN
from rlfoundry.models.lora import base_of, effective_weight

__all__ = ["FusedDecoder", "unsupported_reason"]


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= _PACK_MIN
            and onednn_available())


class _Linear:
    """``x Wᵀ + b`` for one call's fixed weights: packed once for oneDNN where that is faster (fp32 on
    the CPU), else ``F.linear`` on the weight as it is."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        packable = _packable(weight)
        self.weight = None if packable else weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if packable else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class _Layer:
    """One decoder layer's projections (q/k/v and gate/up concatenated) and its other modules; a
    LoRA adapter is folded into each weight (W + scaling · B A) as the weights are copied."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        (wq, bq), (wk, bk), (wv, bv) = (effective_weight(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        biases = [bq, bk, bv]
        self.qkv = _Linear(torch.cat([wq, wk, wv]), torch.cat(biases) if all(b is not None for b in biases) else None)
        self.o = _Linear(*effective_weight(attn.o_proj))
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        # gate and up: one product on a concatenated weight, or two on packed weights (packing each
        # in place of a copy into one halves the build, for a slightly slower step)
        (gate, _), (up, _) = effective_weight(mlp.gate_proj), effective_weight(mlp.up_proj)
        if _packable(gate):
            self.gate_up, self.gate, self.up = None, _Linear(gate), _Linear(up)
        else:
            self.gate_up = _Linear(torch.cat([gate, up]))
        self.down, self.act = _Linear(effective_weight(mlp.down_proj)[0]), mlp.act_fn
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.scaling = float(attn.scaling)


class FusedDecoder:
    """Decode one token per row of an HF prefill cache; returns next-token logits (N, V).

    Built inside ``torch.no_grad()`` and the rollout's unsharded-FSDP context, once per
    ``generate_sequences`` call (weights change between calls). ``cache`` is the rollout's
    DynamicCache whose layers expose preallocated ``key_buf``/``value_buf`` (N, Hkv, C, d).
    """

    def __init__(self, module: nn.Module, max_positions: int):
        module = base_of(module)  # a peft (LoRA) model: its adapters fold into the copied weights
        cfg = module.config
        self.module = module
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.layers = [_Layer(layer) for layer in module.model.layers]
        self.embed, self.norm, self.lm_head = module.model.embed_tokens, module.model.norm, module.lm_head
        head_weight, head_bias = effective_weight(self.lm_head)
        self.head, self.dtype = _Linear(head_weight, head_bias), head_weight.dtype
        # cos/sin for every position this call can reach, from the model's own rotary module
        positions = torch.arange(max_positions, device=head_weight.device).unsqueeze(0)
        probe = torch.empty(1, device=positions.device, dtype=self.dtype)
        cos, sin = module.model.rotary_emb(probe, positions)
        self.cos, self.signed_sin = cos[0], signed_sin(sin[0])  # (P, d)

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
            h = rms_norm(x, layer.in_norm)
            qkv = layer.qkv(h)
            v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
            if layer.q_norm is None:  # q and k rotated together: they are adjacent in qkv
                qk = rope(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]
            else:
                q = rope(layer.q_norm(qkv[:, : hq * d].view(n, hq, d)), cos, sin)
                k = rope(layer.k_norm(qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)), cos, sin)
            kv.key_buf[:, :, length - 1] = k
            kv.value_buf[:, :, length - 1] = v
            keys, values = kv.key_buf[:, :, :length], kv.value_buf[:, :, :length]
            # grouped-query attention without repeating the keys: (N*Hkv, g, d) x (N*Hkv, d, L); the
            # scale and the mask ride in the product (one kernel instead of three)
            scores = torch.baddbmm(bias, q.reshape(n * hkv, hq // hkv, d), keys.flatten(0, 1).transpose(1, 2),
                                   alpha=layer.scaling)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            attn = torch.bmm(probs.to(values.dtype), values.flatten(0, 1)).reshape(n, hq * d)
            x = x + layer.o(attn)
            h = rms_norm(x, layer.post_norm)
            if layer.gate_up is None:
                gate, up = layer.gate(h), layer.up(h)
            else:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(layer.act(gate) * up)
        for kv in cache.layers:
            kv.length = length
            kv._refresh_views()
        return self.head(rms_norm(x, self.norm))
