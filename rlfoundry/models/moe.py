"""Mixture-of-experts pieces a training engine asks a Hugging Face MoE model for: its routed layers, what
their routers chose during a forward, and the router's auxiliary losses and metrics from that record.

Every MoE family transformers 5.x ships (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS, Mixtral ...) has
the same shape: a decoder layer's ``mlp`` block holds ``experts`` (3-D weights, one slice per expert)
and a router (``gate`` or ``router``) that returns ``(router_logits, top_k_weights, top_k_index)`` for
the block's flattened tokens. ``RouterRecorder`` hooks those routers, so the losses come from the
update's own forward (no second forward), whatever the forward's layout (padded or packed).

Losses (``router_losses``), per sequence so that they add up over micro-batches and ranks exactly:

- load balancing (Switch Transformer, https://arxiv.org/abs/2101.03961 eqs. 4-6, as transformers'
  ``load_balancing_loss_func`` computes it): ``N · Σ_e f_e · P_e`` with ``f_e`` the share of the
  sequence's real tokens whose top-k includes expert e (Σ_e f_e = k) and ``P_e`` their mean router
  softmax probability of e; 1 layer and 1 sequence give exactly transformers' number. The batch-wide
  f of transformers' form is not a sum over micro-batches (a product of two batch means), so here it
  is taken per sequence (DeepSeek-V3's sequence-wise balance loss, Megatron's ``seq_aux_loss``) and
  averaged over the mini-batch's sequences and over the routed layers;
- router z-loss (ST-MoE, https://arxiv.org/abs/2202.08906 eq. 5): the mean over a sequence's real
  tokens of ``logsumexp(router_logits)^2``, averaged the same way.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["MoELayer", "RouterRecord", "RouterRecorder", "moe_layers", "router_losses", "router_metrics",
           "router_tallies", "shared_prompt_record",
           "token_rows", "router_loss_coefficients", "use_grouped_experts"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")


@dataclass(frozen=True)
class MoELayer:
    """One routed block: its decoder-layer index, the block, its router and the router's N and k."""

    index: int
    block: nn.Module
    router: nn.Module
    num_experts: int
    top_k: int


def moe_layers(module: nn.Module) -> list[MoELayer]:
    """The routed ``mlp`` blocks of ``module`` (empty for a dense model), by decoder-layer index. Dense
    layers of an MoE model (DeepSeek-V3's first ``first_k_dense_replace``) are left out."""
    found = []
    for name, block in module.named_modules():
        match = _LAYER.search(name)
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if match is None or not hasattr(block, "experts") or not hasattr(router, "top_k"):
            continue
        found.append(MoELayer(int(match.group(1)), block, router, int(router.num_experts), int(router.top_k)))
    return sorted(found, key=lambda layer: layer.index)


def use_grouped_experts(module: nn.Module) -> str | None:
    """Run the experts as grouped matrix products (``torch.nn.functional.grouped_mm``: one kernel over
    all experts' token groups) instead of transformers' eager loop over experts; returns the start-up
    line, or None for a model without experts. transformers picks ``grouped_mm`` by default already;
    this makes it the engine's choice rather than an accident of the installed version."""
    config = getattr(module, "config", None)
    if not moe_layers(module) or config is None:
        return None
    if hasattr(module, "set_experts_implementation"):
        module.set_experts_implementation("grouped_mm")
    else:
        config._experts_implementation = "grouped_mm"
    return (f"MoE ({config.model_type}, {len(moe_layers(module))} routed layers): experts as grouped matrix "
            "products (transformers' experts_implementation=grouped_mm), not a loop over experts")


def router_loss_coefficients(config: Any) -> tuple[float, float]:
    """(load-balancing, z-loss) coefficients from a model config, as transformers applies them: on when
    ``output_router_logits`` is true (``model.override_config.output_router_logits=true``), with its
    ``router_aux_loss_coef`` and, where the family has one (Switch, NLLB-MoE), ``router_z_loss_coef``;
    both 0 otherwise, which is what verl's FSDP actor applies (it reads only the logits)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0, 0.0
    return tuple(float(getattr(config, key, 0.0) or 0.0) for key in ("router_aux_loss_coef", "router_z_loss_coef"))


@dataclass
class RouterRecord:
    """One router call: the block's token grid ``shape`` (b, T), the logits (b·T, N) and the experts
    chosen (b·T, k), in the block's row-major token order."""

    shape: tuple[int, int]
    logits: torch.Tensor
    indices: torch.Tensor


@dataclass
class RouterRecorder:
    """Forward hooks on every routed block of ``module``; they keep what they see only inside
    ``recording()``, so log-prob forwards, the rollout and gradient checkpointing's recomputation in
    backward (which runs the hooks again) record nothing."""

    module: nn.Module
    layers: list[MoELayer] = field(init=False)
    records: dict[int, list[RouterRecord]] = field(init=False, default_factory=dict)
    _on: bool = field(init=False, default=False)
    _shape: tuple[int, int] = field(init=False, default=(0, 0))

    def __post_init__(self) -> None:
        self.layers = moe_layers(self.module)
        for layer in self.layers:
            layer.block.register_forward_pre_hook(self._block_input)
            layer.router.register_forward_hook(self._router_output(layer.index))

    def _block_input(self, _block: nn.Module, args: tuple) -> None:
        if self._on and args:
            self._shape = tuple(args[0].shape[:2]) if args[0].dim() == 3 else (1, args[0].shape[0])

    def _router_output(self, index: int):
        def hook(router: nn.Module, _args: tuple, out: tuple) -> None:
            if not self._on:
                return
            if not (isinstance(out, tuple) and len(out) == 3):  # remote code may route otherwise
                raise TypeError(f"MoE layer {index}: {type(router).__name__} returned {type(out).__name__}, not "
                                "transformers' (router_logits, top_k_weights, top_k_index); the router losses and "
                                "metrics need that output")
            self.records.setdefault(index, []).append(RouterRecord(self._shape, out[0], out[2]))
        return hook

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[int, list[RouterRecord]]]:
        self.records, self._on = {}, True
        try:
            yield self.records
        finally:
            self._on = False


def shared_prompt_record(head: RouterRecord, tail: RouterRecord, group: torch.Tensor) -> RouterRecord:
    """The two calls of the shared-prompt forward (each distinct prompt once: ``head`` (g, Tp); then every
    row's response from its prompt's KV cache: ``tail`` (b, Tr)) as the one padded call of (b, Tp + Tr)
    they compute: row r's prompt tokens are its group's (``group`` (b,)). A prompt's router logits then
    take each of its rows' gradient, as they do when every row runs its own prompt."""
    (g, tp), (b, tr) = head.shape, tail.shape

    def rows(head_values: torch.Tensor, tail_values: torch.Tensor) -> torch.Tensor:
        width = head_values.shape[-1]
        # index_select, not [group]: its backward adds a prompt's rows in order (engines/fsdp/forward.py, _gather_rows)
        prompt = head_values.reshape(g, tp, width).index_select(0, group)
        return torch.cat([prompt, tail_values.reshape(b, tr, width)], dim=1).reshape(b * (tp + tr), width)

    return RouterRecord((b, tp + tr), rows(head.logits, tail.logits), rows(head.indices, tail.indices))


def token_rows(shape: tuple[int, int], attention_mask: torch.Tensor, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each router token (n,), 1.0 where it is a real token (n,)) for a block that saw the
    (b, T) ``attention_mask``'s rows as the ``shape`` grid: the padded rows themselves (``packed``
    False), or their real tokens laid end to end in one row (``packed``). No read of the device."""
    b, width = attention_mask.shape
    device = attention_mask.device
    if not packed:
        if shape != (b, width):
            raise ValueError(f"router saw a {shape} token grid, the padded micro-batch is {(b, width)}")
        return torch.arange(b, device=device).repeat_interleave(width), attention_mask.reshape(-1).float()
    if shape[0] != 1:
        raise ValueError(f"router saw a {shape} token grid; a packed micro-batch is one row")
    lengths = attention_mask.sum(-1)
    rows = torch.repeat_interleave(torch.arange(b, device=device), lengths, output_size=shape[1])
    return rows, torch.ones(shape[1], device=device)


def _per_row(values: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Sum of ``values`` (n, ...) by row: (n_rows, ...)."""
    return values.new_zeros((n_rows, *values.shape[1:])).index_add_(0, rows, values)


def _layer_losses(record: RouterRecord, num_experts: int, rows: torch.Tensor, real: torch.Tensor,
                  n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's per-row (load-balancing loss, z-loss), each (n_rows,); rows without real tokens 0."""
    logits = record.logits.float()
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(probs).scatter_(1, record.indices, 1.0)  # (n, N): 1 where e is in the top k
    tokens = _per_row(real, rows, n_rows).clamp(min=1.0)
    f = _per_row(chosen * real[:, None], rows, n_rows) / tokens[:, None]
    p = _per_row(probs * real[:, None], rows, n_rows) / tokens[:, None]
    z = _per_row(torch.logsumexp(logits, dim=-1).square() * real, rows, n_rows) / tokens
    return num_experts * (f * p).sum(-1), z


def router_losses(records: dict[int, list[RouterRecord]], layers: list[MoELayer], attention_mask: torch.Tensor,
                  packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (load-balancing loss, z-loss) (b,), each averaged over the routed layers (module
    docstring). ``attention_mask`` (b, T): the micro-batch as the model saw it."""
    n_rows = attention_mask.shape[0]
    aux = z = attention_mask.new_zeros(n_rows, dtype=torch.float32)
    for layer in layers:
        record = _one_call(records, layer.index)
        rows, real = token_rows(record.shape, attention_mask, packed)
        a, b = _layer_losses(record, layer.num_experts, rows, real, n_rows)
        aux, z = aux + a, z + b
    return aux / max(len(layers), 1), z / max(len(layers), 1)


def router_tallies(records: dict[int, list[RouterRecord]], layers: list[MoELayer], attention_mask: torch.Tensor,
                   packed: bool) -> torch.Tensor:
    """What the router metrics are made of, as sums that add up over micro-batches and ranks: per routed
    layer (rows, in ``layers``' order) the real tokens' top-k assignments to each expert (N columns),
    the sum of their routing entropies and their count; (layers, N + 2), no graph."""
    width = max(layer.num_experts for layer in layers)
    out = torch.zeros(len(layers), width + 2, device=attention_mask.device)
    with torch.no_grad():
        for row, layer in enumerate(layers):
            record = _one_call(records, layer.index)
            _, real = token_rows(record.shape, attention_mask, packed)
            chosen = torch.zeros_like(record.logits, dtype=torch.float32).scatter_(1, record.indices, 1.0)
            logp = torch.log_softmax(record.logits.float(), dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            out[row, : layer.num_experts] = (chosen * real[:, None]).sum(0)
            out[row, width] = (entropy * real).sum()
            out[row, width + 1] = real.sum()
    return out


def router_metrics(tallies: torch.Tensor, layers: list[MoELayer]) -> dict[str, float]:
    """Per routed layer, from its ``router_tallies`` (host numbers): ``moe/layer{i}/load_max`` and
    ``load_min`` (the busiest and idlest expert's share of the routed assignments × N: 1 is perfect
    balance), ``load_cv`` (the shares' coefficient of variation, std/mean) and ``routing_entropy`` (the
    mean entropy of a token's router distribution, nats; ln N is uniform)."""
    width = tallies.shape[1] - 2
    out = {}
    for row, layer in enumerate(layers):
        load = tallies[row, : layer.num_experts].double()
        load = load / load.sum().clamp(min=1.0)
        key = f"moe/layer{layer.index}"
        out[f"{key}/load_max"] = float(load.max()) * layer.num_experts
        out[f"{key}/load_min"] = float(load.min()) * layer.num_experts
        out[f"{key}/load_cv"] = float(load.std(unbiased=False) / load.mean())
        out[f"{key}/routing_entropy"] = float(tallies[row, width] / tallies[row, width + 1].clamp(min=1.0))
    return out


def _one_call(records: dict[int, list[RouterRecord]], index: int) -> RouterRecord:
    calls = records.get(index, [])
    if len(calls) != 1:
        raise RuntimeError(f"MoE layer {index}: its router ran {len(calls)} times in one micro-batch's forward; the "
                           "router losses and metrics are built for one model call per micro-batch (padded or packed; "
                           "the shared-prompt forward's two calls are merged first: shared_prompt_record)")
    return calls[0]
