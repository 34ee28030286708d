"""Parameter, gradient and optimiser-state offload for the Megatron engine: verl's
``*.megatron.param_offload``, ``grad_offload`` and ``optimizer_offload``.

megatron-core keeps a trained model's gradients, and with the distributed optimiser its parameters,
as views into contiguous buffers (DDP's ``buffer.grad_data`` / ``buffer.param_data``), and views of
those live on elsewhere (``param.main_grad``, the optimiser's shards and their ``.grad``). Moving a
tensor (``.to("cpu")``) would leave every other view on the old memory, so offload works on storages,
as verl's helpers do: what is kept is copied to a host tensor (pinned memory on CUDA) and the device
storage is resized to 0 bytes; every view stays a valid tensor object, and onload resizes the storage
back and copies the bytes in, so the values are restored bit for bit. Gradients are zero between
updates (every mini-batch zeroes its buffer first), so they are released without a copy and come back
zeroed.

What each part is (the storages, each once):

- ``params``: every parameter of every model chunk (a frozen reference has no DDP wrapper: each
  parameter's own storage). With the distributed optimiser over fp32 weights its fp32 shards are views
  of these, so they go with the parameters.
- ``grads``: DDP's gradient buffers (``buffers`` and ``expert_parallel_buffers`` of each chunk).
- ``optimizer``: what the torch optimiser inside megatron-core's steps (its parameters: the fp32 main
  copies of bf16/fp16 weights; of fp32 weights without the distributed optimiser, the weights
  themselves, which are the ``params`` part and left to it) and its state (Adam's moments; the 0-d step
  counts stay). With megatron-core's CPU optimiser (``optimizer_cpu_offload``: HybridDeviceOptimizer),
  its device sub-optimiser's only (the parameters ``optimizer_offload_fraction`` left on the device):
  the host side is host memory already, as on the CPU, where the same split is kept.

The mechanism is the same on every device: on a CPU-only run the "device" storage is host memory,
released and restored the same way (what the CPU tests observe), and only the gradients' release
saves memory there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["PARTS", "StorageOffload", "grad_tensors", "optimizer_tensors", "param_tensors", "storage_ids", "storages"]

PARTS = ("params", "grads", "optimizer")


def storages(tensors: Iterable[torch.Tensor], exclude: Iterable[int] = ()) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (by identity, so views of one buffer count once), those
    holding no bytes and those whose identity is in ``exclude`` left out."""
    seen, out = set(exclude), []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out.append(storage)
    return out


def storage_ids(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Identities of the storages under ``tensors``, released or not (a storage keeps its identity
    through ``resize_``)."""
    return {t.untyped_storage()._cdata for t in tensors}


def _ddp_buffers(chunk: nn.Module) -> list[Any]:
    """A DDP-wrapped chunk's parameter-and-gradient buffers (a bare chunk has none)."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(chunk, DistributedDataParallel):
        return []
    return list(chunk.buffers) + list(chunk.expert_parallel_buffers)


def param_tensors(chunks: list[nn.Module]) -> list[torch.Tensor]:
    """Every parameter of the chunks (DDP-wrapped or bare) and DDP's parameter buffers."""
    out = [p.data for chunk in chunks for p in chunk.parameters()]
    for chunk in chunks:
        out += [b.param_data for b in _ddp_buffers(chunk) if b.param_data is not None]
    return out


def grad_tensors(chunks: list[nn.Module]) -> list[torch.Tensor]:
    """DDP's gradient buffers (a chunk without the wrapper has none)."""
    return [b.grad_data for chunk in chunks for b in _ddp_buffers(chunk) if b.grad_data is not None]


def is_hybrid(optimizer: Any) -> bool:
    """Whether a torch optimiser is megatron-core's HybridDeviceOptimizer (``optimizer_cpu_offload``)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return isinstance(optimizer, HybridDeviceOptimizer)


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimisers megatron-core's (possibly chained) optimiser steps with on the device: of a
    HybridDeviceOptimizer (``optimizer_cpu_offload``), its device sub-optimiser (none when
    ``optimizer_offload_fraction`` is 1): its host side (the offloaded parameters' copies, their
    moments and gradients) is in host memory already and is not this module's to move."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    inner = [p.optimizer for p in parts if getattr(p, "optimizer", None) is not None]
    on_device = [o.gpu_optimizer if is_hybrid(o) else o for o in inner]
    return [o for o in on_device if o is not None]


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The parameters the torch optimisers step and their state tensors (0-d step counts left out)."""
    out: list[torch.Tensor] = []
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            out += [p.data for p in group["params"]]
        for state in inner.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


@dataclass
class _Released:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # the bytes kept on the host; None: restored as zeros (gradients)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (for copies in and out)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageOffload:
    """Storages released and restored by part name; a part is either resident or released."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._released: dict[str, list[_Released]] = {}

    def released(self, part: str) -> bool:
        return part in self._released

    def release(self, part: str, parts: list[torch.UntypedStorage], keep: bool = True) -> None:
        """Copy each storage's bytes to the host (``keep``; pinned on CUDA) and free the storage."""
        if part in self._released:
            return
        cuda = self.device.type == "cuda"
        held = []
        with torch.no_grad():
            for storage in parts:
                host = None
                if keep:
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=cuda)
                    host.copy_(_bytes(storage), non_blocking=cuda)
                held.append(_Released(storage, storage.nbytes(), host))
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()  # the copies are done before the frees
            for item in held:
                item.storage.resize_(0)
        self._released[part] = held
        if cuda:
            torch.cuda.empty_cache()  # to the rollout engine, or whoever allocates next

    def restore(self, part: str) -> None:
        """Re-allocate each storage of ``part`` and copy its bytes back (zeros where none were kept)."""
        held = self._released.pop(part, None)
        if held is None:
            return
        cuda = self.device.type == "cuda"
        with torch.no_grad():
            for item in held:
                item.storage.resize_(item.nbytes)
                if item.host is None:
                    _bytes(item.storage).zero_()
                else:
                    _bytes(item.storage).copy_(item.host, non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()  # before the host copies are freed
