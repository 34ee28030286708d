"""megatron-core on the CPU: the few places where it assumes CUDA, each redirected to the CPU.

megatron-core (0.16) runs its layers, tensor-parallel collectives and pipeline schedules on any
device torch.distributed serves (gloo on the CPU), except where it names CUDA outright. Each shim
below says which megatron-core call it stands in for; ``tests/engines/test_megatron_cpu_compat.py``
checks that those calls still exist and still need it, so a megatron-core upgrade that changes one
fails a test instead of silently changing behaviour. :func:`install` applies them only in a
process without CUDA (a GPU process runs megatron-core untouched) and is idempotent.

- ``torch.cuda.current_device()``: megatron-core places buffers with it (rotary ``inv_freq`` moved
  "to the GPU once", pipeline send/receive shape tensors, tensor-parallel gather buffers). Without
  CUDA it raises; here it names the CPU device.
- ``torch.cuda.synchronize()``: called after batched point-to-point exchanges in the pipeline;
  without CUDA there is nothing to wait for.
- The schedules (``pipeline_parallel/schedules.py``) allocate their token counter with
  ``device="cuda"``: the schedules module sees a ``torch`` whose tensor factories map a CUDA device
  to the CPU (every other attribute is torch's own).
- The model-parallel RNG tracker (``tensor_parallel/random.py``) keeps one generator state per
  parallel group and swaps it in and out of the CUDA generator; here it swaps the CPU generator's
  (:func:`seed_model_parallel` replaces ``model_parallel_cuda_manual_seed``, which seeds CUDA).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["install", "installed", "seed_model_parallel"]

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like")
_installed = False


def installed() -> bool:
    return _installed


def install() -> bool:
    """Apply the CPU shims when this process has no CUDA; True when they are (now or before) in place."""
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available():
        return False
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _no_op
    schedules.torch = _cpu_torch()
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    _installed = True
    return True


def seed_model_parallel(seed: int) -> None:
    """What ``model_parallel_cuda_manual_seed`` sets up, on the CPU generator: the default state
    seeded with ``seed`` (the same across tensor-parallel ranks), and the tracker's states for the
    tensor-parallel region (``seed + 2718 + tp rank``) and the expert region, as megatron-core derives them."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.initialize_rng_tracker(force_reset=True)
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tp_rank = ps.get_tensor_model_parallel_rank()
    states = {
        mp_random._DATA_PARALLEL_RNG_TRACKER_NAME: seed,
        mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + 2718 + tp_rank,
        mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME: seed + 1024 + 100 * ps.get_expert_model_parallel_rank()
        + ps.get_expert_tensor_parallel_rank(),
    }
    for name, value in states.items():
        generator = torch.Generator()
        generator.manual_seed(value)
        tracker.states_[name] = generator.get_state()
        tracker.seeds_.add(value)
    tracker._is_initialized = True


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _get_cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _on_cpu(device: Any) -> Any:
    if device is None:
        return None
    return "cpu" if torch.device(device if not isinstance(device, int) else "cuda").type == "cuda" else device


def _cpu_factory(fn):
    def factory(*args: Any, **kwargs: Any):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return fn(*args, **kwargs)
    return factory


def _cpu_torch() -> types.ModuleType:
    """A stand-in for the ``torch`` module as one megatron-core module sees it: the tensor factories
    put what they would have put on a GPU on the CPU; everything else is torch itself."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})
    for name in _FACTORIES:
        setattr(proxy, name, _cpu_factory(getattr(torch, name)))
    proxy.__getattr__ = lambda name: getattr(torch, name)  # submodules imported later (torch.cuda...)
    return proxy
