"""Megatron-FSDP (verl's ``*.megatron.use_megatron_fsdp=true``): megatron-core's fully sharded data
parallelism in place of its DDP.

megatron-core's adapter (``megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel``)
wraps each model chunk as its DDP does; with ``data_parallel_sharding_strategy="optim_grads_params"``
(verl's) the parameters, gradients and optimiser state are sharded over the data-parallel ranks, and each
``TransformerLayer`` (an FSDP unit) is all-gathered for its forward and backward and released after.
The optimiser is megatron-core's distributed optimiser over those shards (verl sets
``use_distributed_optimizer`` with it; so does this engine whatever the key says). The numbers are
DDP's: the same gradients reduced over the same ranks, the same Adam on each element.

Between forwards the model's parameters are the shards (DTensors). The HF export (the rollout's weight
sync, ``save_hf_model``) reads whole tensors: :func:`full_parameters` all-gathers every bucket that is
not gathered already, puts the gathered parameters in the model for the duration, then puts back what
was there and frees the buckets it gathered.

On CPU processes megatron-core's Megatron-FSDP runs under ``cpu_compat``'s stand-ins (streams, device
names, the device mesh); ``gradient_reduce_div_fusion`` (a ``PREMUL_SUM`` reduction, NCCL's only) is off
there: the gradients are scaled and then summed, the same products.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["available", "full_parameters", "combination_problems", "gathered_storages", "inner_module", "load_optimizer_shards", "optimizer_shards",
           "problems", "wrap"]

_OFFLOAD = ("param_offload", "grad_offload", "optimizer_offload")


def available() -> bool:
    """Whether this megatron-core ships Megatron-FSDP (0.14 and later do); without importing it (the driver)."""
    import importlib.util

    try:
        return all(importlib.util.find_spec(f"megatron.core.distributed.fsdp.{m}") is not None
                   for m in ("mcore_fsdp_adapter", "src.megatron_fsdp"))
    except ImportError:  # no megatron-core (the plug-in reports that)
        return False


def problems(key: str, m: Any, world_size: int | None = None) -> list[str]:
    """Start-up errors for ``{key}.megatron.use_megatron_fsdp=true``: a megatron-core without it, pipeline
    stages (megatron-core's mesh has none), one data-parallel rank, or the offload keys beside it (not built)."""
    if not getattr(m, "use_megatron_fsdp", False):
        return []
    name = f"{key}.megatron.use_megatron_fsdp=true"
    if not available():
        return [f"{name}: this megatron-core has no Megatron-FSDP (megatron.core.distributed.fsdp, 0.14 and later)."]
    errors = []
    if m.pipeline_model_parallel_size > 1:
        # megatron-core 0.16's adapter lays its device mesh over every rank of the world as data × context ×
        # tensor (mcore_fsdp_adapter._get_dp_tp_mesh): with pipeline stages the shapes disagree and it raises
        errors.append(f"{name} with {key}.megatron.pipeline_model_parallel_size={m.pipeline_model_parallel_size}: "
                      "megatron-core's Megatron-FSDP lays its device mesh over data × context × tensor ranks only "
                      "(no pipeline stages); set pipeline_model_parallel_size=1 or use_megatron_fsdp=false.")
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if world_size is not None and world_size == model_parallel:
        # nothing to shard; and measured on the CPU (TP=2 over 2 ranks), its second update differs from DDP's by
        # 9e-4 in the loss where DP=2 (with and without TP=2) equals DDP within 1e-6: not understood, so refused
        errors.append(f"{name} with one data-parallel rank ({world_size} ranks = tensor × pipeline × context "
                      "parallel): Megatron-FSDP shards over data-parallel ranks and is not built over one; set "
                      "use_megatron_fsdp=false (megatron-core's DDP) or use more ranks.")
    offloads = [f"{key}.megatron.{k}" for k in _OFFLOAD if getattr(m, k, False)]
    if offloads:
        errors.append(f"{name} with {', '.join(offloads)}: offloading Megatron-FSDP's sharded buffers is not built "
                      "(the offload here releases megatron-core DDP's); set them to false.")
    return errors


def combination_problems(key: str, lora: bool, cpu_optimizer: bool) -> list[str]:
    """Start-up errors for what is not built beside Megatron-FSDP in the rest of a role's config."""
    name, errors = f"{key}.megatron.use_megatron_fsdp=true", []
    if lora:
        errors.append(f"{name} with LoRA (model.lora_rank > 0): adapters under Megatron-FSDP are not built; "
                      "LoRA runs with megatron-core's DDP (use_megatron_fsdp=false).")
    if cpu_optimizer:
        errors.append(f"{name} with optim.override_optimizer_config.optimizer_cpu_offload: megatron-core's "
                      "HybridDeviceOptimizer over Megatron-FSDP's shards is not built; use one or the other.")
    return errors


def wrap(config: Any, chunk: nn.Module, device: torch.device) -> nn.Module:
    """``chunk`` under megatron-core's Megatron-FSDP, with verl's DDP config for it (sharded
    parameters, gradients and optimiser state; gradients reduced in fp32 as this engine's DDP does)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    ddp = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
        grad_reduce_in_fp32=True,
        # the engine's DDP reduces at the end of the backward too (same order, same numbers); overlap is a
        # GPU-stream optimisation
        overlap_grad_reduce=False, overlap_param_gather=False,
        gradient_reduce_div_fusion=device.type == "cuda")
    return FullyShardedDataParallel(config, ddp, chunk, device=device if device.type != "cuda" else None)


def _fsdp_of(chunk: nn.Module) -> Any:
    """The ``MegatronFSDP`` inside an adapter-wrapped chunk, else None."""
    inner = getattr(chunk, "module", None)
    return inner if type(inner).__name__ == "MegatronFSDP" else None


def inner_module(chunk: nn.Module) -> nn.Module:
    """The model chunk itself under megatron-core's DDP (one ``.module``) or Megatron-FSDP (two)."""
    fsdp = _fsdp_of(chunk)
    return fsdp.module if fsdp is not None else getattr(chunk, "module", chunk)


def gathered_storages(chunks: list[nn.Module]) -> list[torch.Tensor]:
    """The gathered parameters (views into Megatron-FSDP's buckets, freed after :func:`full_parameters`)."""
    return [p for c in chunks if (f := _fsdp_of(c)) is not None for p in f.raw_param.values()]


def _set_parameter(module: nn.Module, name: str, param: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)


@contextlib.contextmanager
def full_parameters(chunks: list[nn.Module]) -> Iterator[None]:
    """Whole (data-parallel-gathered) parameters in the model chunks for the duration; collective.
    No-op for chunks that are not under Megatron-FSDP."""
    restore = []
    try:
        for chunk in chunks:
            fsdp = _fsdp_of(chunk)
            if fsdp is None:
                continue
            from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import BucketStatus

            pipeline, groups = fsdp.all_gather_pipeline, fsdp.param_and_grad_buffer.param_to_param_group
            raw = fsdp.raw_param
            buckets = {groups[p] for p in raw.values()}
            # those gathered here are freed on exit; ones a forward left gathered stay as they were
            empty = {b for b in buckets if pipeline.bucket_status[pipeline.get_bucket_key(b, False)] is BucketStatus.EMPTY}
            current = dict(fsdp.module.named_parameters())
            restore.append((fsdp, current, empty, fsdp.is_param_fsdp_distributed))
            fsdp.all_gather_and_wait_parameters_ready(list(raw.values()), prefetch=False)
            for name, param in raw.items():
                _set_parameter(fsdp.module, name, param)
            # its state_dict pre-hook puts the shards back unless the flag says they are there already
            # (mbridge's export reads state_dict() beside named_parameters())
            fsdp.is_param_fsdp_distributed = True
        yield
    finally:
        for fsdp, current, empty, flag in restore:
            for name, param in current.items():
                _set_parameter(fsdp.module, name, param)
            fsdp.is_param_fsdp_distributed = flag
            for bucket in empty:
                fsdp.all_gather_pipeline.release_bucket(bucket, False)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_shards(optimizer: Any) -> dict[str, Any]:
    """This rank's part of the optimiser: its parameters (the fp32 shards it steps) and Adam's state,
    local tensors by position (resuming needs the same layout, which the checkpoint's meta checks)."""
    inner = optimizer.optimizer
    saved = inner.state_dict()
    copy = lambda v: _local(v).detach().clone() if torch.is_tensor(v) else v  # noqa: E731
    return {"params": [copy(p) for g in inner.param_groups for p in g["params"]],
            "state": {i: {k: copy(v) for k, v in s.items()} for i, s in saved["state"].items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]}


@torch.no_grad()
def load_optimizer_shards(optimizer: Any, chunks: list[nn.Module], saved: dict[str, Any]) -> None:
    """Put back what :func:`optimizer_shards` saved, then install the weights into the model's
    (sharded) weight buffers and drop any gathered copy of the old ones."""
    inner = optimizer.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    if len(params) != len(saved["params"]):
        raise ValueError(f"a Megatron-FSDP checkpoint of {len(saved['params'])} optimiser parameters; this "
                         f"optimiser has {len(params)} (resuming needs the same model and layout)")
    for param, value in zip(params, saved["params"]):
        _local(param).copy_(value)
    for index, state in saved["state"].items():
        mine = inner.state[params[index]]
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() and torch.is_tensor(mine.get(key)):
                _local(mine[key]).copy_(value)
            elif torch.is_tensor(value) and value.dim():  # a fresh optimiser: the state shaped as its parameter
                mine[key] = torch.zeros_like(params[index])
                _local(mine[key]).copy_(value)
            else:
                mine[key] = value.clone() if torch.is_tensor(value) else value
    for group, stored in zip(inner.param_groups, saved["param_groups"]):
        group.update(stored)
    for chunk in chunks:
        fsdp = _fsdp_of(chunk)
        if fsdp is None:
            continue
        fsdp.param_and_grad_buffer.copy_main_weights_to_model_weights()
        for bucket in range(fsdp.all_gather_pipeline.num_buckets):
            fsdp.all_gather_pipeline.release_bucket(bucket, False)
