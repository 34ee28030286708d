"""LoRA adapters on megatron-core's tensor-parallel linears (``model.lora_rank > 0`` with strategy=megatron).

One adapter per Hugging Face module, as peft puts them on the FSDP2 engine's model (verl's
``canonical_lora``): ``linear_qkv`` carries three (q_proj, k_proj, v_proj), ``linear_fc1`` two
(gate_proj, up_proj), ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) one each. Each adapter
adds ``scaling · B A x`` (scaling = alpha / rank) to its part of the layer's output; the base weights
are frozen, so megatron-core's DDP and optimiser hold the adapters alone.

Tensor parallelism, the layer's own split carried over to its adapter:

- column-parallel (qkv, fc1): ``A`` (r × in) whole on every rank, ``B`` split along its output rows
  like the base weight. ``h = A x`` is the same on every rank, but its gradient is the sum of every
  rank's ``B_localᵀ g_local``: ``h`` passes through megatron-core's copy-to-TP region (identity forward,
  all-reduce backward), so A's gradient and the input's are whole and equal on every rank.
- row-parallel (proj, fc2): ``A`` split along its input columns like the base weight, ``B`` (out × r)
  whole. Each rank's ``A_local x_local`` is a partial sum: it is all-reduced over TP before ``B``.

With sequence parallelism (``megatron.sequence_parallel``) the linears' sequence-split side is split
for the adapters too: a column-parallel linear's input is this rank's 1/TP of the positions, so
``h = A x`` is all-gathered along the sequence (backward: reduce-scatter, which sums the ranks' shares
as the copy-to-TP region did); a row-parallel linear's output is this rank's positions, so the partial
``A_local x_local`` is reduce-scattered along the sequence instead of all-reduced (backward: all-gather).
The whole factor (column: ``A``, row: ``B``) then sees only this rank's positions: its gradient is
marked ``sequence_parallel``, which megatron-core's ``finalize_model_grads`` sums over the TP group
(as the norms', ``sequence_parallel.py``).

Megatron's ``linear_qkv`` output interleaves the query groups (per group: its query heads, then its
key, then its value), its ``linear_fc1`` output is [gate, up] on each rank: the parts' outputs are
laid out the same way before they are added. Names and the TP split of every B are those of the HF
modules, so an adapter moves between this engine and peft (``adapter_model.safetensors`` names) as a
whole tensor, and the merged weights are W + scaling · B A per HF module, as peft's ``merge_and_unload``.

A critic (``modules_to_save=("score",)``, as the FSDP2 critic's peft model) trains its value head in
full beside the adapters: the head stays trainable when the backbone is frozen, and it travels with the
adapter under peft's names for a saved module (``base_model.model.score.weight`` / ``.bias``).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlfoundry.config.verl_compat import MEGATRON_NAMES

__all__ = ["LoraLayout", "MegatronLora", "PARTS", "attach", "hf_targets"]

# megatron-core linear -> (the bridge's weight key, the HF modules it holds, parallel kind)
PARTS = {
    "linear_qkv": ("self_attention.linear_qkv.weight", ("q_proj", "k_proj", "v_proj"), "column"),
    "linear_proj": ("self_attention.linear_proj.weight", ("o_proj",), "row"),
    "linear_fc1": ("mlp.linear_fc1.weight", ("gate_proj", "up_proj"), "column"),
    "linear_fc2": ("mlp.linear_fc2.weight", ("down_proj",), "row"),
}
HF_MODULES = tuple(m for _, mods, _ in PARTS.values() for m in mods)
_PEFT_PREFIX = "base_model.model."
_HEAD = "score"  # a critic's value head in HF (AutoModelForTokenClassification) and peft names


def hf_targets(target_modules: Any) -> tuple[str, ...]:
    """``model.target_modules`` as the HF modules adapted here; a name outside them is a ValueError."""
    if target_modules == "all-linear":
        return HF_MODULES
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    unknown = sorted(n for n in names if n not in HF_MODULES and n not in MEGATRON_NAMES)
    if unknown:
        raise ValueError(f"model.target_modules {unknown}: LoRA on the Megatron engine adapts the attention and MLP "
                         f"projections only: all-linear, {list(HF_MODULES)} or verl's {sorted(MEGATRON_NAMES)}")
    wanted = {m for n in names for m in MEGATRON_NAMES.get(n, (n,))}
    for linear, (_, parts, kind) in PARTS.items():
        if kind == "column" and wanted & set(parts) and not set(parts) <= wanted:
            raise ValueError(f"model.target_modules: {sorted(wanted & set(parts))} without {sorted(set(parts) - wanted)}: "
                             f"they share Megatron's {linear}; adapting some of them is not built: name all of "
                             f"{list(parts)} or none")
    return tuple(m for m in HF_MODULES if m in wanted)


@dataclass(frozen=True)
class LoraLayout:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # HF module names (hf_targets)
    seed: int = 0
    task_type: str = "CAUSAL_LM"  # TOKEN_CLS: a critic
    modules_to_save: tuple[str, ...] = ()  # ("score",): a critic's value head, trained in full

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class _Switch:
    """The adapters' on/off state, shared by every adapter of a model (off: the reference policy)."""

    on = True


class MegatronLora(nn.Module):
    """The adapters of one megatron-core linear: ``A_<hf>`` / ``B_<hf>`` per HF module it holds
    (each this rank's shard, as the module docstring says), applied by a forward hook on the linear."""

    def __init__(self, linear: nn.Module, kind: str, parts: dict[str, tuple[int, int]], layout: LoraLayout,
                 interleave: Any, switch: _Switch):
        super().__init__()
        from megatron.core import parallel_state as ps

        self.kind, self.scaling, self._interleave, self._switch = kind, layout.scaling, interleave, switch
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False))
        self.hf_names: dict[str, str] = {}  # part -> whole HF module name, set by attach
        dtype, device = linear.weight.dtype, linear.weight.device
        for part, (out_features, in_features) in parts.items():
            a_shape = (layout.rank, in_features // (self.tp if kind == "row" else 1))
            b_shape = (out_features // (self.tp if kind == "column" else 1), layout.rank)
            self.register_parameter(f"A_{part}", nn.Parameter(torch.empty(a_shape, dtype=dtype, device=device)))
            self.register_parameter(f"B_{part}", nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device)))
        self._mark_tensor_parallel()
        self.parts = tuple(parts)

    def _mark_tensor_parallel(self) -> None:
        from megatron.core import tensor_parallel

        split = "B_" if self.kind == "column" else "A_"
        for name, param in self.named_parameters():
            if name.startswith(split):
                tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0 if split == "B_" else 1, 1)
            else:
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
                # whole on every rank, each rank's gradient from its own positions: summed over TP
                param.sequence_parallel = self.sequence_parallel

    def split_dim(self, which: str) -> int | None:
        """The dimension of A or B that is split over TP ranks (None: whole on every rank)."""
        if self.kind == "column":
            return 0 if which == "B" else None
        return 1 if which == "A" else None

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling · B A x for every part, laid out as the linear's (local) output."""
        from megatron.core.tensor_parallel import mappings

        outs = []
        for part in self.parts:
            h = x @ getattr(self, f"A_{part}").T
            # column: h's gradient sums every rank's share of the output; row: A x is a partial sum
            # (with sequence parallelism each also moves h between this rank's positions and all of them)
            if self.kind == "column":
                h = (mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
                     if self.sequence_parallel else mappings.copy_to_tensor_model_parallel_region(h))
            else:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                     else mappings.reduce_from_tensor_model_parallel_region(h))
            outs.append(h @ getattr(self, f"B_{part}").T)
        return self._interleave(outs) * self.scaling

    def hook(self, linear: nn.Module, args: tuple, output: tuple) -> tuple:
        if not self._switch.on:
            return output
        out, bias = output
        return out + self.delta(args[0]), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """dist-checkpointing's view: each split A or B a shard of the whole adapter tensor."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {name: self.split_dim(name[0]) for name, _ in self.named_parameters()}
        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix,
                                                   {k: v for k, v in axes.items() if v is not None}, sharded_offsets)


def _qkv_interleave(config: Any, tp: int):
    """Megatron's qkv layout on a rank: per query group, [its query heads, key, value]."""
    groups = (config.num_query_groups or config.num_attention_heads) // tp

    def interleave(outs: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = (o.unflatten(-1, (groups, -1)) for o in outs)
        return torch.cat([q, k, v], dim=-1).flatten(-2)
    return interleave


def _concat(outs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(outs, dim=-1)


def _part_shapes(config: Any, linear_name: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF module a linear holds, whole."""
    hidden, heads, hd = config.hidden_size, config.num_attention_heads, config.kv_channels
    groups = config.num_query_groups or heads
    ffn = config.ffn_hidden_size
    return {"linear_qkv": {"q_proj": (heads * hd, hidden), "k_proj": (groups * hd, hidden), "v_proj": (groups * hd, hidden)},
            "linear_proj": {"o_proj": (hidden, heads * hd)},
            "linear_fc1": {"gate_proj": (ffn, hidden), "up_proj": (ffn, hidden)},
            "linear_fc2": {"down_proj": (hidden, ffn)}}[linear_name]


def attach(bridge: Any, chunks: list[nn.Module], layout: LoraLayout) -> "Adapters":
    """Adapters on every targeted linear of ``chunks`` (frozen first, but for a critic's value head when
    ``layout.modules_to_save`` names it), A initialised as peft does (kaiming-uniform, a=√5) from a seed
    per HF module, the same whatever the layout; B zero."""
    switch, adapters = _Switch(), []
    for chunk in chunks:
        chunk.requires_grad_(False)
        if not chunk.config.gated_linear_unit:
            raise ValueError("LoRA on the Megatron engine expects a gated MLP (gate_proj, up_proj), as Llama/Qwen")
        for layer in chunk.decoder.layers:
            adapters += _attach_layer(bridge, layer, layout, switch)
    found = Adapters(adapters, switch, layout, _trained_heads(chunks, layout))
    found.init_fresh()
    return found


def _trained_heads(chunks: list[nn.Module], layout: LoraLayout) -> list[nn.Module]:
    """The value heads that train in full (this rank's: the last pipeline stage has the one), made trainable."""
    from rlfoundry.engines.megatron.bridge import ValueHead

    unknown = sorted(set(layout.modules_to_save) - {"score"})
    if unknown:
        raise ValueError(f"LoRA on the Megatron engine: modules_to_save {unknown}: only a critic's value head "
                         "(score) trains in full beside the adapters")
    if not layout.modules_to_save:
        return []
    heads = [c.output_layer for c in chunks if isinstance(getattr(c, "output_layer", None), ValueHead)]
    for head in heads:
        head.requires_grad_(True)
    return heads


def _attach_layer(bridge: Any, layer: nn.Module, layout: LoraLayout, switch: _Switch) -> list[MegatronLora]:
    """One transformer layer's adapters, each a sibling module of its linear named ``<linear>_lora``
    (megatron-core's sharded checkpoint then reaches it), applied by a forward hook on the linear."""
    from megatron.core import parallel_state as ps

    config, found = layer.config, []
    for linear_name, (key, hf_parts, kind) in PARTS.items():
        parent = layer.self_attention if key.startswith("self_attention") else layer.mlp
        shapes = {p: s for p, s in _part_shapes(config, linear_name).items() if p in layout.targets}
        if not shapes:  # hf_targets: a column-parallel linear's parts all or none
            continue
        if not hasattr(parent, linear_name):
            raise ValueError(f"LoRA on the Megatron engine: layer {layer.layer_number} has no {linear_name} "
                             f"({type(parent).__name__}); adapters on MoE experts are not built (use strategy=fsdp)")
        linear = getattr(parent, linear_name)
        interleave = (_qkv_interleave(config, ps.get_tensor_model_parallel_world_size())
                      if linear_name == "linear_qkv" else _concat)
        lora = MegatronLora(linear, kind, shapes, layout, interleave, switch)
        template = bridge._ATTENTION_MAPPING.get(key) or bridge._MLP_MAPPING[key]
        for part, hf in zip(hf_parts, template):
            lora.hf_names[part] = hf.format(layer_number=layer.layer_number - 1).removesuffix(".weight")
        parent.add_module(f"{linear_name}_lora", lora)
        linear.register_forward_hook(lora.hook)
        found.append(lora)
    return found


class Adapters:
    """This rank's adapters of a model, and what the engine does with them as whole HF-named tensors."""

    def __init__(self, modules: list[MegatronLora], switch: _Switch, layout: LoraLayout, heads: list[nn.Module] = ()):
        self.modules, self.switch, self.layout = modules, switch, layout
        self.heads = list(heads)  # value heads trained in full (a critic's, on the last stage only)

    def _items(self) -> Iterator[tuple[MegatronLora, str, str]]:
        for lora in self.modules:
            for part in lora.parts:
                yield lora, part, lora.hf_names[part]

    def init_fresh(self) -> None:
        """A from its own seed per HF module (the whole tensor, then this rank's shard), B zero."""
        with torch.no_grad():
            for lora, part, hf in self._items():
                a = getattr(lora, f"A_{part}")
                whole = _whole_shape(lora, "A", a)
                g = torch.Generator().manual_seed(self.layout.seed * 1_000_003 + zlib.crc32(hf.encode()))
                bound = 1.0 / math.sqrt(whole[1])  # kaiming_uniform_(a=√5): U(-1/√fan_in, 1/√fan_in), peft's A
                full = (torch.rand(whole, generator=g, dtype=torch.float64) * 2 - 1) * bound
                a.copy_(_shard(lora, "A", full.to(a.dtype)))
                getattr(lora, f"B_{part}").zero_()

    def load_peft(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set every adapter from peft's file names (``adapter_model.safetensors``), whole tensors."""
        with torch.no_grad():
            for lora, part, hf in self._items():
                for which in ("A", "B"):
                    key = f"{_PEFT_PREFIX}{hf}.lora_{which}.weight"
                    if key not in tensors:
                        raise ValueError(f"model.lora_adapter_path: the adapter has no {key}; it was trained on other "
                                         "target modules (set model.target_modules to its own)")
                    param = getattr(lora, f"{which}_{part}")
                    param.copy_(_shard(lora, which, tensors[key].to(param.dtype)))
            # a saved head replaces the model directory's (or the fresh zero one); without one it stays, as in peft
            for head in self.heads:
                for attr in ("weight", "bias"):
                    saved = tensors.get(f"{_PEFT_PREFIX}{_HEAD}.{attr}")
                    if saved is not None:
                        getattr(head, attr).copy_(saved.reshape(getattr(head, attr).shape))

    def whole(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF module name -> (A, B) whole, on every rank (gathered over TP, then pipeline stages), copies
        of the parameters: a half that needs no gather (replicated over TP) would otherwise be the live
        parameter on the CPU, and a caller keeping the adapter would see the next update's values. Collective."""
        from megatron.core import parallel_state as ps

        mine = {hf: tuple(_gather(lora, w, getattr(lora, f"{w}_{part}").detach()).to("cpu", copy=True) for w in "AB")
                for lora, part, hf in self._items()}
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return mine
        stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
        return {k: v for stage in stages for k, v in stage.items()}

    def merged(self, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF stream with each adapted weight merged: W + scaling · B A (peft's merge)."""
        adapters = self.whole()
        for name, tensor in named:
            pair = adapters.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if pair is not None:
                a, b = (t.to(tensor.device) for t in pair)
                tensor = (tensor.float() + (b.float() @ a.float()) * self.layout.scaling).to(tensor.dtype)
            yield name, tensor

    def head_tensors(self) -> dict[str, torch.Tensor]:
        """The value head trained in full, in peft's file names, on every rank (copies; from the last
        stage); empty for a model without one. Collective over the pipeline stages."""
        from rlfoundry.engines.megatron.bridge import from_last_stage

        if not self.layout.modules_to_save:
            return {}
        mine = {f"{_PEFT_PREFIX}{_HEAD}.{attr}": getattr(head, attr).detach().to("cpu", copy=True)
                for head in self.heads for attr in ("weight", "bias")}
        return from_last_stage(mine)

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter (and a critic's head) in peft's file names. Collective."""
        pairs = {f"{_PEFT_PREFIX}{hf}.lora_{w}.weight": t for hf, pair in self.whole().items() for w, t in zip("AB", pair)}
        return {**pairs, **self.head_tensors()}

    def peft_config(self) -> dict[str, Any]:
        """adapter_config.json's contents for ``peft_tensors`` (PeftModel.from_pretrained, vLLM)."""
        from peft import LoraConfig

        from rlfoundry.models.lora import config_json

        return config_json(LoraConfig(r=self.layout.rank, lora_alpha=self.layout.alpha, lora_dropout=0.0, bias="none",
                                      target_modules=list(self.layout.targets), task_type=self.layout.task_type,
                                      modules_to_save=list(self.layout.modules_to_save) or None))

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model for the block (the reference policy)."""
        before, self.switch.on = self.switch.on, False
        try:
            yield
        finally:
            self.switch.on = before

    @contextlib.contextmanager
    def detached(self, chunks: list[nn.Module]) -> Iterator[None]:
        """The chunks without their adapter modules (mbridge converts the parameters it knows only)."""
        owners = [(m, n, c) for chunk in chunks for m in chunk.modules()
                  for n, c in list(m.named_children()) if isinstance(c, MegatronLora)]
        for owner, name, _ in owners:
            delattr(owner, name)
        try:
            yield
        finally:
            for owner, name, child in owners:
                owner.add_module(name, child)


def read_peft_adapter(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = Path(path).expanduser() / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"model.lora_adapter_path {path!r}: no adapter_model.safetensors (write one with "
                                "`rlfoundry export --format adapter` or PeftModel.save_pretrained)")
    return load_file(str(file))


def _whole_shape(lora: MegatronLora, which: str, local: torch.Tensor) -> tuple[int, int]:
    dim, shape = lora.split_dim(which), list(local.shape)
    if dim is not None:
        shape[dim] *= lora.tp
    return tuple(shape)


def _shard(lora: MegatronLora, which: str, whole: torch.Tensor) -> torch.Tensor:
    dim = lora.split_dim(which)
    return whole if dim is None else whole.chunk(lora.tp, dim=dim)[lora.tp_rank]


def _gather(lora: MegatronLora, which: str, local: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    dim = lora.split_dim(which)
    if dim is None or lora.tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(lora.tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)
