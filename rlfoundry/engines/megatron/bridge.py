"""HF checkpoints <-> megatron-core models, through mbridge (the converter verl uses by default).

mbridge maps every supported family's HF tensor names onto Megatron's, splits and merges them
across tensor-parallel ranks and pipeline stages, and exports HF-named tensors back. It builds the
model with TransformerEngine layers; without TransformerEngine (the CPU, or a GPU without it) this
module builds megatron-core's local layer spec instead. The only difference mbridge sees is that the
local spec keeps each layer's two RMSNorms as modules of their own (``input_layernorm``,
``pre_mlp_layernorm``) where TransformerEngine fuses them into the next linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``): :func:`_local_spec_bridge`
names them after the fused entries of the family's own mapping, so no name table is written here.

A critic (value model) is the same backbone with the vocabulary head replaced by a one-output linear
layer (:class:`ValueHead`) on the last pipeline stage; in HF names it is ``score.*``, the layout of
``AutoModelForTokenClassification`` with one label that the FSDP critic uses, so a critic moves
between the engines through its HF directory. mbridge converts the backbone only; the head is read
and written here.

``parallel_state`` must be initialised first (:func:`initialize_parallel`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlfoundry.config.schema import MEGATRON_INSTALL
from rlfoundry.engines.megatron import moe

__all__ = ["MEGATRON_INSTALL", "ValueHead", "build_bridge", "build_model", "export_hf_weights", "from_last_stage",
           "initialize_parallel", "load_hf_weights", "megatron_available", "transformer_engine_available"]


# megatron-core fusions that need CUDA kernels (apex / TransformerEngine); off without them
_UNFUSED = dict(masked_softmax_fusion=False, gradient_accumulation_fusion=False, bias_activation_fusion=False,
                bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)


def megatron_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("megatron.core", "mbridge"))


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def initialize_parallel(tp: int, pp: int, vpp: int | None = None, cp: int = 1, seed: int = 0, ep: int = 1,
                        etp: int | None = None) -> None:
    """megatron-core's parallel groups over the default process group (already initialised), and
    its model-parallel RNG states; on a process without CUDA, the CPU shims first. ``ep`` / ``etp``:
    the experts' parallel sizes (``etp`` None: ``tp``, megatron-core's default)."""
    from megatron.core import parallel_state as ps

    from rlfoundry.engines.megatron import cpu_compat

    on_cpu = cpu_compat.install()
    cpu_compat.define_missing_te_names()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if on_cpu:
        cpu_compat.seed_model_parallel(seed)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_bridge(model_path: str, dtype: torch.dtype, override_transformer_config: dict[str, Any] | None = None,
                 use_te: bool | None = None, value_model: bool = False, mtp: bool = False) -> Any:
    """The mbridge bridge of the checkpoint's model family, for this process's parallel layout
    (``value_model``: the backbone for a :class:`ValueHead`, its input embedding never tied to a head;
    ``mtp``: with the checkpoint's multi-token-prediction layers, ``mtp.py``; without, they are not built)."""
    from mbridge import AutoBridge
    from transformers import AutoConfig

    from rlfoundry.engines.megatron import mtp as mtp_layers
    from rlfoundry.models import mimo  # noqa: F401  (model_type "mimo" for AutoConfig)

    hf_config = AutoConfig.from_pretrained(model_path)
    if value_model:
        hf_config.tie_word_embeddings = False
    if not hasattr(hf_config, "rope_theta"):  # transformers 5 keeps it under rope_parameters
        hf_config.rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    supported = AutoBridge.list_supported_models()
    if hf_config.model_type not in supported:
        raise ValueError(f"{model_path}: model_type {hf_config.model_type!r} has no mbridge converter; "
                         f"the Megatron engine supports {sorted(supported)}. Use strategy=fsdp for this model.")
    cls = type(AutoBridge.from_config(hf_config))
    if use_te is None:
        # CP > 1: the engine feeds padded rows with a (batch, 1, S, S) mask, which TransformerEngine's
        # context-parallel attention does not take (it wants packed sequences); the local layers'
        # CP attention (context_parallel.py) does
        use_te = transformer_engine_available() and _context_parallel_size() == 1
    if not use_te:
        cls = _local_spec_bridge(cls)
        if moe.is_moe(hf_config):  # experts as megatron-core's SequentialMLP, not mbridge's grouped names
            cls = moe.sequential_experts_bridge(cls)
    if mtp:
        cls = mtp_layers.mtp_bridge(cls, use_te)
    if moe.is_moe(hf_config):  # expert_tensor_parallel_size < TP (moe.py)
        cls = moe.expert_tensor_parallel_bridge(cls)
    bridge = cls(hf_config, dtype=dtype)
    # perform_initialization stays on: megatron-core marks tensor-parallel weights (which dimension
    # is split) inside its initialisers, and the exporter, the gradient norm and the optimiser read the marks
    extra = {"use_cpu_initialization": True, "sequence_parallel": False}
    if not use_te:
        extra.update(_UNFUSED)
    overrides = dict(override_transformer_config or {})
    if not mtp and mtp_layers.hf_mtp_layers(hf_config):  # verl's check_mtp_config: not built unless mtp.enable
        overrides["mtp_num_layers"] = None
    if moe.is_moe(hf_config):  # the grouped-GEMM experts need TransformerEngine's (or CUDA) kernels
        overrides = moe.moe_overrides(hf_config, overrides, grouped_gemm=use_te)
    bridge.set_extra_args(**{**extra, **overrides})
    return bridge


def _context_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size()


def _local_spec_bridge(cls: type) -> type:
    """``cls`` building megatron-core's local (non-TransformerEngine) layers, its norms named after
    the fused norm entries of ``cls``'s own mapping."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from rlfoundry.engines.megatron import context_parallel, sequence_parallel

    attention_norm = cls._ATTENTION_MAPPING["self_attention.linear_qkv.layer_norm_weight"]
    # a dense MLP fuses its norm into linear_fc1; an MoE layer's stays a module in either spec
    mlp_norm = cls._MLP_MAPPING.get("mlp.linear_fc1.layer_norm_weight") or cls._MLP_MAPPING["pre_mlp_layernorm"]

    class LocalSpecBridge(cls):
        # "input_layernorm" has neither ".self_attention." nor "mlp" in its name: mbridge looks it up
        # in _OTHER_MAPPING; "pre_mlp_layernorm" goes to _MLP_MAPPING
        _OTHER_MAPPING = {**cls._OTHER_MAPPING, "input_layernorm.weight": attention_norm}
        _MLP_MAPPING = {**cls._MLP_MAPPING, "pre_mlp_layernorm.weight": mlp_norm}

        def _get_transformer_layer_spec(self, vp_stage: int | None = None):
            self.has_vp_stage = True
            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)
            if self.config.sequence_parallel:  # the local torch norms refuse it (sequence_parallel.py)
                spec = sequence_parallel.use_in_spec(spec)
            # megatron-core's local attention has no context parallelism (TransformerEngine's has)
            return context_parallel.use_in_spec(spec) if self.config.context_parallel_size > 1 else spec

    LocalSpecBridge.__name__ = LocalSpecBridge.__qualname__ = f"LocalSpec{cls.__name__}"
    return LocalSpecBridge


class ValueHead(nn.Linear):
    """V(s) from the last hidden state: one linear output, the same whole weight on every
    tensor-parallel rank (it is tiny), called as megatron-core's GPTModel calls its output layer
    (and named like it: ``output_layer.weight`` / ``.bias`` in its sharded checkpoints).

    Each tensor-parallel rank computes the same values and the same head gradients from the same
    hidden states, so neither needs a reduction. Under sequence parallelism the hidden states
    arrive split along the sequence: they are gathered first, and the backward pass hands each rank
    its own slice of the (identical) gradient back, not a sum over ranks."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__(hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return super().forward(hidden_states), None


@contextlib.contextmanager
def _without_value_heads(chunks: list[nn.Module]) -> Iterator[list[ValueHead]]:
    """The chunks as mbridge knows them (a backbone and maybe an LM head): the value heads taken out
    for the duration, handed to the caller."""
    owners = [c for c in chunks if isinstance(getattr(c, "output_layer", None), ValueHead)]
    heads = [c.output_layer for c in owners]
    for owner in owners:
        owner.output_layer = None
    try:
        yield heads
    finally:
        for owner, head in zip(owners, heads):
            owner.output_layer = head


def build_model(bridge: Any, device: torch.device | str = "cpu", value_head: bool = False) -> list[nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), on ``device``, weights uninitialised
    (``value_head``: the last stage ends in a zero-initialised :class:`ValueHead`)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    provider = bridge._model_provider([])
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for stage in range(vpp):
        stage_arg = stage if vpp > 1 else None
        chunk = provider(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage_arg),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage_arg),
                         vp_stage=stage_arg)
        if value_head and chunk.post_process:
            config = chunk.config
            chunk.output_layer = ValueHead(config.hidden_size, config.params_dtype, config.sequence_parallel)
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            # the local spec's norms (torch RMSNorm) are built in fp32 whatever params_dtype says; on a GPU
            # TransformerEngine's norms, or Float16Module's cast, make them 16-bit like the rest. Mixed, the
            # distributed optimiser's checkpoint maps a layer's state to another's (megatron-core orders
            # each group's main parameters fp32-first, its index map by model order)
            if param.is_floating_point() and param.dtype != chunk.config.params_dtype:
                param.data = param.data.to(chunk.config.params_dtype)
        moe.mark_expert_parameters(chunk)
        chunks.append(chunk.to(device))
    return chunks


_HEAD_NAMES = {"weight": "score.weight", "bias": "score.bias"}  # AutoModelForTokenClassification's head


def load_hf_weights(bridge: Any, chunks: list[nn.Module], model_path: str) -> None:
    """Each rank reads the HF safetensors and keeps its own shard of every tensor it holds; a value
    head takes ``score.*`` when the directory has them (a critic) and stays zero otherwise (a causal
    LM: every value starts at 0, as the FSDP critic's)."""
    with _without_value_heads(chunks) as heads:
        bridge.load_weights(chunks, model_path)
    if heads:
        stored = _read_tensors(model_path, set(_HEAD_NAMES.values()))
        if stored:
            with torch.no_grad():
                for head in heads:
                    for attr, name in _HEAD_NAMES.items():
                        getattr(head, attr).copy_(stored[name].reshape(getattr(head, attr).shape))


def _read_tensors(model_path: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors among ``names`` that the directory's safetensors files hold (all or none)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({n: handle.get_tensor(n) for n in names & set(handle.keys())})
    if found and set(found) != names:
        raise ValueError(f"{model_path}: a value head needs all of {sorted(names)}; found only {sorted(found)}")
    return found


def export_hf_weights(bridge: Any, chunks: list[nn.Module], value_head: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole HF-named tensors, one at a time (gathered across tensor and pipeline ranks; every rank
    takes part and receives each tensor); a value model's head last, as ``score.*``."""
    with _without_value_heads(chunks) as heads:
        named = bridge.export_weights(chunks)
        if moe.is_moe(bridge.hf_config):  # HF's in-memory expert layout (moe.py)
            named = moe.fuse_experts(named, bridge.hf_config.num_experts)
        yield from named
    if value_head:
        for attr, name in _HEAD_NAMES.items():
            yield name, from_last_stage(getattr(heads[0], attr).detach() if heads else None)


def from_last_stage(value: Any) -> Any:
    """``value`` as the last pipeline stage has it, on every stage of this rank's pipeline (tensors
    travel on the CPU)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value.cpu() if isinstance(value, torch.Tensor) else value]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    return box[0]
