"""The shared-prompt training forward in one pass, for Llama-family causal LMs (Qwen2, Qwen3, Llama, Mistral):
one of the CPU kernels (``rlfoundry/cpu``).

Why: the actor's shared-prompt forward (``model.use_shared_prompt``) runs each distinct prompt
once and every sampled response on that prompt's KV cache. Through Hugging Face that is two model
calls per micro-batch — two rounds of mask building, cache bookkeeping and per-module dispatch, and
every projection run twice (once over the prompt tokens, once over the response tokens), then the
same again in backward. On a small model on a CPU that machinery costs as much as the arithmetic.
Here the prompt tokens and the response tokens are one set of rows for every matrix product, so a
layer is:

- RMSNorm, one product for q/k/v (weights concatenated per call, so the gradients flow back to the
  separate ``nn.Linear`` weights), then o, gate, up and down as in HF (one gate/up product was no
  faster: its halves are strided, and SiLU and the product after it ran slower on them);
- RoPE from the model's own rotary module (any static variant HF supports), q and k rotated
  together with one ``roll``;
- two attention calls: prompts over themselves (causal, left padding masked) and responses over
  [their prompt's keys, their own keys] (causal), both with torch's SDPA.

The model is still called through ``module(...)`` (its ``forward`` swapped for the duration), so
FSDP2's hooks on the root unit gather the parameters and reduce the gradients exactly as for the
HF forward. Models whose forward this does not reproduce (``unsupported_reason``), per-layer FSDP
units, gradient checkpointing and training-time attention dropout keep the HF path. The tests
compare logits and gradients with the HF forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rlfoundry.models import lora
from rlfoundry.cpu.linear import OneDNNLinear, linear as onednn_linear
from rlfoundry.cpu.llama_ops import rms_norm, rope, signed_sin
from rlfoundry.cpu.llama_ops import unsupported_reason as _family_reason

__all__ = ["shared_prompt_logits", "unsupported_reason"]


def unsupported_reason(module: nn.Module, length: int = 0) -> str | None:
    """None when ``shared_prompt_logits`` reproduces ``module``'s forward over sequences of up to
    ``length`` tokens; otherwise why not."""
    if lora.is_lora(module):
        return "LoRA adapters (the one-pass training forward has no adapter terms)"
    reason = _family_reason(module, capacity=length)
    if reason is not None:
        return reason
    if any(getattr(m, "gradient_checkpointing", False) for m in module.model.layers):
        return "gradient checkpointing"
    if module.training and float(getattr(module.config, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout in training"
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if units and units != [module]:
        return "FSDP units below the root (each would need its own hooks)"
    if "forward" in vars(module):
        return "the module's forward is already replaced"
    for layer in module.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(proj) not in (nn.Linear, OneDNNLinear):
                return f"{type(proj).__name__} projections (adapters?)"
    return None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    return onednn_linear(x, weight, bias) if onednn else F.linear(x, weight, bias)


def _cat_bias(*projs: nn.Module) -> torch.Tensor | None:
    biases = [p.bias for p in projs]
    return torch.cat(biases) if all(b is not None for b in biases) else None


class _Pass:
    """Shapes, masks and RoPE tables of one call, shared by every layer."""

    def __init__(self, inner: nn.Module, prompt_ids, prompt_mask, prompt_pos, responses, response_pos, group):
        cfg = inner.config
        self.hq = int(cfg.num_attention_heads)
        self.hkv = int(getattr(cfg, "num_key_value_heads", None) or self.hq)
        self.d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq)
        (self.u, self.tp), (self.b, self.tr) = prompt_ids.shape, responses.shape
        self.group = group
        self.prompt_rows = self.u * self.tp
        device = prompt_ids.device
        # prompts: causal over real keys; a padding query may see itself (a row with no key at all
        # would give NaN, and its output is never read)
        causal_p = torch.ones(self.tp, self.tp, dtype=torch.bool, device=device).tril()
        eye = torch.eye(self.tp, dtype=torch.bool, device=device)
        self.prompt_attn_mask = ((causal_p & prompt_mask.bool()[:, None, :]) | eye).unsqueeze(1)  # (U, 1, Tp, Tp)
        # responses: their prompt's real keys, then their own, causally
        causal_r = torch.ones(self.tr, self.tr, dtype=torch.bool, device=device).tril()
        keys_p = prompt_mask.bool()[group][:, None, :].expand(self.b, self.tr, self.tp)
        self.response_attn_mask = torch.cat([keys_p, causal_r.expand(self.b, -1, -1)], dim=2).unsqueeze(1)
        positions = torch.cat([prompt_pos.reshape(-1), response_pos.reshape(-1)])
        probe = torch.empty(1, device=device, dtype=inner.lm_head.weight.dtype)
        cos, sin = inner.model.rotary_emb(probe, positions.unsqueeze(0))
        self.cos, self.signed_sin = cos[0].unsqueeze(1), signed_sin(sin[0]).unsqueeze(1)  # (N, 1, d)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        return rope(x, self.cos, self.signed_sin)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (N, Hq, d), k/v (N, Hkv, d) over all rows -> (N, Hq*d)."""
        n_p, u, tp, b, tr = self.prompt_rows, self.u, self.tp, self.b, self.tr

        def heads(x: torch.Tensor, rows: int, t: int) -> torch.Tensor:
            return x.view(rows, t, x.shape[1], self.d).transpose(1, 2)

        def prompt_and_response(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # split, not two slices: a slice's backward zero-fills a full-size gradient per piece
            # and adds the pieces up; a split's backward is one concatenation
            x_p, x_r = x.split([n_p, x.shape[0] - n_p])
            return heads(x_p, u, tp), heads(x_r, b, tr)

        (qp, qr), (kp, kr), (vp, vr) = prompt_and_response(q), prompt_and_response(k), prompt_and_response(v)
        gqa = self.hq != self.hkv
        out_p = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=self.prompt_attn_mask, scale=scaling,
                                               enable_gqa=gqa)
        # index_select, not kp[group]: its backward adds a group's rows in row order, indexing's with
        # parallel atomic adds, in an order that changes from run to run (engines/fsdp/forward.py, _gather_rows)
        keys = torch.cat([kp.index_select(0, self.group), kr], dim=2)
        values = torch.cat([vp.index_select(0, self.group), vr], dim=2)
        out_r = F.scaled_dot_product_attention(qr, keys, values, attn_mask=self.response_attn_mask, scale=scaling,
                                               enable_gqa=gqa)
        flat = [o.transpose(1, 2).reshape(-1, self.hq * self.d) for o in (out_p, out_r)]
        return torch.cat(flat)


def _layer(x: torch.Tensor, layer: nn.Module, p: _Pass, onednn: bool) -> torch.Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    hq, hkv, d = p.hq, p.hkv, p.d
    h = rms_norm(x, layer.input_layernorm)
    qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    qkv = _linear(h, qkv_w, _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), onednn)
    if getattr(attn, "q_norm", None) is None:  # q and k rotated together: adjacent in qkv
        qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=1)
        q, k = p.rope(qk.view(-1, hq + hkv, d)).split([hq, hkv], dim=1)
    else:
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        q, k = p.rope(attn.q_norm(q.view(-1, hq, d))), p.rope(attn.k_norm(k.view(-1, hkv, d)))
    v = v.view(-1, hkv, d)
    x = x + _linear(p.attention(q, k, v, float(attn.scaling)), attn.o_proj.weight, attn.o_proj.bias, onednn)
    h = rms_norm(x, layer.post_attention_layernorm)
    gate, up = _linear(h, mlp.gate_proj.weight, None, onednn), _linear(h, mlp.up_proj.weight, None, onednn)
    return x + _linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, None, onednn)


def _forward(inner: nn.Module, prompt_ids, prompt_mask, prompt_pos, responses, response_pos, group) -> torch.Tensor:
    p = _Pass(inner, prompt_ids, prompt_mask, prompt_pos, responses, response_pos, group)
    onednn = isinstance(inner.lm_head, OneDNNLinear)
    x = inner.model.embed_tokens(torch.cat([prompt_ids.reshape(-1), responses.reshape(-1)]))
    for layer in inner.model.layers:
        x = _layer(x, layer, p, onednn)
    # the logits that predict response tokens: each prompt's last position (its rows' first token),
    # then every response position but the last
    prompt_x, response_x = x.split([p.prompt_rows, x.shape[0] - p.prompt_rows])
    last = prompt_x.view(p.u, p.tp, -1)[:, -1]
    body = response_x.view(p.b, p.tr, -1)[:, :-1].reshape(-1, x.shape[-1])
    h = rms_norm(torch.cat([last, body]), inner.model.norm)
    logits = _linear(h, inner.lm_head.weight, getattr(inner.lm_head, "bias", None), onednn)
    first, rest = logits.split([p.u, logits.shape[0] - p.u])  # index_select: as for the keys in _Pass.attention
    return torch.cat([first.index_select(0, group).unsqueeze(1), rest.view(p.b, p.tr - 1, -1)], dim=1)


@contextlib.contextmanager
def _forward_swapped(module: nn.Module, fn) -> Iterator[None]:
    module.forward = fn
    try:
        yield
    finally:
        del module.forward


def shared_prompt_logits(module: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         prompt_pos: torch.Tensor, responses: torch.Tensor, response_pos: torch.Tensor,
                         group: torch.Tensor) -> torch.Tensor:
    """Logits (B, Tr, V) predicting every response token; same as the HF shared-prompt forward.

    prompt_ids/mask/pos: (U, Tp) one row per distinct prompt, left-padded. responses, response_pos:
    (B, Tr). group: (B,) each row's prompt. ``module`` must pass ``unsupported_reason``.
    """
    def fn(**kwargs: Any) -> torch.Tensor:
        return _forward(module, **kwargs)

    with _forward_swapped(module, fn):
        return module(prompt_ids=prompt_ids, prompt_mask=prompt_mask, prompt_pos=prompt_pos, responses=responses,
                      response_pos=response_pos, group=group)
