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
- Modules that allocate with a literal ``device="cuda"`` (``_CUDA_LITERAL_MODULES``: the schedules'
  token counter, the optimisers' scale and overflow buffers, the gradient-norm buffers, the
  gradient buffer's warm-up tensor) see a ``torch`` whose tensor factories map a CUDA device to the
  CPU (every other attribute is torch's own).
- The distributed optimiser sorts parameters into fp32 and 16-bit groups by their type names
  (``DistributedOptimizer._build_model_and_main_param_groups`` accepts only ``torch.cuda.*Tensor``):
  while it does, a CPU tensor's ``type()`` reads as the CUDA type of the same dtype.
- ``clip_grads.clip_grad_by_total_norm_fp32`` asserts every gradient is a ``torch.cuda.FloatTensor``
  before scaling them: on the CPU the same scaling runs without that check.
- ``LanguageModule.setup_embeddings_and_output_layer``: with tied embeddings and pipeline stages, the
  last stage's copy of the word embeddings starts at zero and is all-reduced with the first stage's,
  after ``weight.data = weight.data.cuda()``; while it runs, ``Tensor.cuda()`` of a CPU tensor is the
  tensor itself (the all-reduce then runs over gloo, on the CPU where the weights were built).
- ``rope_utils.get_pos_emb_on_this_cp_rank`` (context parallelism: this rank's chunks of the rotary
  angles) builds its index tensor in pinned memory and moves it with ``.cuda()``: its module gets
  the CPU ``torch`` above (which also drops ``pin_memory``), and ``.cuda()`` of a CPU tensor is the
  tensor itself while it runs (in each module that imported it by name).
- The MoE all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``) creates a CUDA stream when
  first built and, once per layer, copies its token counts to the host on that stream, turning the
  split sizes into numpy arrays, then waits on a CUDA event. On the CPU the counts are on the host
  already: the class gets a placeholder instead of a stream, and ``_maybe_dtoh_and_synchronize``
  only does the numpy conversion of the split sizes (``_dispatcher_splits_on_host``).
- gloo's ``all_gather`` takes equal sizes only. The all-to-all dispatcher gathers the tokens bound for
  this rank's experts over the expert tensor-parallel group with ``output_split_sizes`` (each rank
  sends as many as its sequence slice routed there); at EP = 1 the sizes are equal, with EP > 1 and
  expert tensor parallelism they differ. ``mappings._gather_along_first_dim`` then pads each rank's part
  to the longest, gathers, and cuts the padding off (``_gather_uneven``); its backward, an uneven
  ``reduce_scatter``, gloo runs as it is.
- Without TransformerEngine (CPU or GPU), megatron-core's MoE router reads ``moe_utils.te_general_gemm``,
  a name it binds only when TransformerEngine imports: :func:`define_missing_te_names` binds it to
  None, which is megatron-core's own "no TE GEMM" value (the router's torch path then runs). It also
  answers ``OptimizerConfig``'s ``is_te_min_version`` with False (``_no_te_version``): megatron-core's
  compares the missing version (None) with one and raises, which made
  ``use_precision_aware_optimizer`` with ``optimizer_cpu_offload`` unbuildable without TransformerEngine.
- The model-parallel RNG tracker (``tensor_parallel/random.py``) keeps one generator state per
  parallel group and swaps it in and out of the CUDA generator; here it swaps the CPU generator's
  (:func:`seed_model_parallel` replaces ``model_parallel_cuda_manual_seed``, which seeds CUDA).
- ``HybridDeviceOptimizer`` (``optimizer_cpu_offload``: Adam on the host for a fraction of the
  state, ``cpu_offloading/hybrid_optimizer.py``) takes its CUDA streams and events from
  ``torch.cuda`` when built and at each step, and picks what to move to the host by
  ``param.is_cuda``, copying each picked parameter with ``.cpu().pin_memory()``. Its module gets the
  CPU ``torch`` above whose ``cuda`` hands out host streams (``_HostStream``: the copies are
  synchronous, so waiting, recording and synchronising have nothing to do), and while
  ``_get_sub_optimizer_param_groups`` runs, tensors read ``is_cuda`` as they would on a GPU: the
  parameters it was built over (the "device" ones: on the CPU they are in host memory too) and their
  fp32 copies True, what ``.cpu()`` returned (and copies of it) False, and ``pin_memory()`` of a CPU
  tensor is the tensor itself (``_device_params_read_as_cuda``). Everything else is megatron-core's own: the split by
  ``optimizer_offload_fraction``, the host copies of the parameters and their gradients, the
  sub-optimisers, the copy back after each host step and the state dict (the bytes move between two
  buffers in host memory instead of between the GPU and the host).
- Megatron-FSDP (``use_megatron_fsdp``; ``megatron.core.distributed.fsdp``: the adapter
  ``mcore_fsdp_adapter`` and its ``megatron_fsdp`` package) takes streams from ``torch.cuda`` (two side
  streams when built, ``torch.cuda.stream(...)`` around its reduce-scatters and all-gathers,
  ``current_stream().wait_stream``, ``record_event()`` and the event's ``wait()``), names its device
  ``cuda:{current_device()}`` and allocates its gather buffers on ``current_device()``, lays its
  DTensors on a ``DeviceMesh`` of type "cuda", and ``validate_uneven_dtensor`` moves its boundary
  checks to CUDA with ``.cuda()``. Its modules get a ``torch`` (``_fsdp_torch``) whose ``cuda`` hands out
  host streams (``_HostStream``: gloo's collectives return when done, so there is nothing to wait
  for), whose ``device("cuda…")`` is the CPU and whose ``current_device()`` is 0 (only formatted into
  that name); the adapter's ``DeviceMesh.from_group`` builds CPU meshes (``_CpuMesh``: the same
  groups, gloo's); ``validate_uneven_dtensor`` runs with ``.cuda()`` of a CPU tensor the tensor itself.
  Its collectives (``reduce_scatter_tensor``, ``all_gather_into_tensor``, both under
  ``_coalescing_manager`` without a device: issued as one coalesced call, which gloo runs) are gloo's
  own; ``ReduceOp.PREMUL_SUM`` (``gradient_reduce_div_fusion``) is NCCL's only, so the engine turns
  that fusion off on the CPU (the gradients are scaled, then summed: the same products).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Any, Callable

import torch

__all__ = ["define_missing_te_names", "install", "installed", "seed_model_parallel"]

_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",  # local_multi_tensor_l2_norm: the gradient norm without apex/TransformerEngine
    "megatron.core.models.common.embeddings.rope_utils",  # get_pos_emb_on_this_cp_rank's index tensor
)
# modules holding their own reference to rope_utils.get_pos_emb_on_this_cp_rank
_CP_ROPE_MODULES = ("megatron.core.models.common.embeddings.rope_utils",
                    "megatron.core.models.common.embeddings.rotary_pos_embedding",
                    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
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
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mp_optimizer
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _no_op
    cpu_torch = _cpu_torch()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = cpu_torch
    clip_grads.clip_grad_by_total_norm_fp32 = mp_optimizer.clip_grad_by_total_norm_fp32 = _clip_by_total_norm
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    groups = DistributedOptimizer._build_model_and_main_param_groups.__func__
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(groups))
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _with_cuda_as_cpu(LanguageModule.setup_embeddings_and_output_layer)
    for name in _CP_ROPE_MODULES:
        module = importlib.import_module(name)
        module.get_pos_emb_on_this_cp_rank = _with_cuda_as_cpu(module.get_pos_emb_on_this_cp_rank)
    _install_moe_dispatcher()
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _gather_uneven(mappings._gather_along_first_dim)
    _install_hybrid_optimizer(cpu_torch)
    _install_megatron_fsdp(cpu_torch)
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    _installed = True
    return True


def define_missing_te_names() -> None:
    """Without TransformerEngine (any device): ``moe_utils.te_general_gemm = None`` where it was not
    defined, and ``OptimizerConfig``'s TransformerEngine version check reads "not at least" (False)."""
    from megatron.core.optimizer import optimizer_config
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.utils import get_te_version

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if get_te_version() is None:
        optimizer_config.is_te_min_version = _no_te_version


def _no_te_version(version: str, check_equality: bool = True) -> bool:
    """``is_te_min_version`` where TransformerEngine is not installed: no version is "at least" one.
    ``OptimizerConfig.__post_init__`` with ``use_precision_aware_optimizer`` asks it (to turn
    ``store_param_remainders``, a TransformerEngine FusedAdam option, off below TE 2.1) before it
    returns early for ``optimizer_cpu_offload``, whose HybridDeviceOptimizer needs no TransformerEngine;
    megatron-core's own compares None with a version and raises TypeError."""
    return False


def _install_moe_dispatcher() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # not None: its __init__ then skips torch.cuda.Stream(); nothing on the CPU reads the stream
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no stream"
    original = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize

    # wraps: inspect.unwrap still reaches megatron-core's method (its source is checked by the tests)
    @functools.wraps(original)
    def on_host(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        return _dispatcher_splits_on_host(self, point, tokens_per_expert)

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = on_host


def _install_hybrid_optimizer(cpu_torch: types.ModuleType) -> None:
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    host_torch = types.ModuleType("torch")
    host_torch.__dict__.update(vars(cpu_torch))
    host_torch.cuda = _HOST_CUDA
    hybrid_optimizer.torch = host_torch
    cls = hybrid_optimizer.HybridDeviceOptimizer
    cls._get_sub_optimizer_param_groups = _device_params_read_as_cuda(cls._get_sub_optimizer_param_groups)


_FSDP_MODULES = tuple(f"megatron.core.distributed.fsdp.src.megatron_fsdp.{name}" for name in
                      ("megatron_fsdp", "param_and_grad_buffer", "mixed_precision", "uneven_dtensor", "utils"))
_FSDP_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"


def _install_megatron_fsdp(cpu_torch: types.ModuleType) -> None:
    try:
        adapter = importlib.import_module(_FSDP_ADAPTER)
        modules = [importlib.import_module(name) for name in _FSDP_MODULES]
    except ImportError:  # a megatron-core without Megatron-FSDP: the engine refuses use_megatron_fsdp
        return
    fsdp_torch = _fsdp_torch(cpu_torch)
    for module in (*modules, adapter):
        module.torch = fsdp_torch
    adapter.DeviceMesh = _CpuMesh
    if not isinstance(adapter.TELinear, type):  # without TransformerEngine megatron-core's stand-in is a MagicMock,
        adapter.TELinear = _NoTELinear          # which isinstance() refuses (TP > 1 stopped at wrapping)
    uneven, buffers = modules[3], modules[1]
    # param_and_grad_buffer holds its own reference (imported by name)
    uneven.validate_uneven_dtensor = buffers.validate_uneven_dtensor = _with_cuda_as_cpu(uneven.validate_uneven_dtensor)


def _fsdp_torch(cpu_torch: types.ModuleType) -> types.ModuleType:
    """Megatron-FSDP's ``torch``: the CPU one, with host streams, "cuda" devices on the CPU and device 0."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(vars(cpu_torch))
    proxy.device = _cuda_device_on_cpu
    proxy.cuda = _FsdpCuda()
    return proxy


def _cuda_device_on_cpu(*args: Any, **kwargs: Any) -> torch.device:
    if args and isinstance(args[0], str) and args[0].startswith("cuda"):
        return torch.device("cpu")
    return torch.device(*args, **kwargs)


class _FsdpCuda:
    """``torch.cuda`` as Megatron-FSDP's modules see it on the CPU: host streams, nothing to wait for or
    free, device 0 (only formatted into the "cuda:N" name ``_cuda_device_on_cpu`` maps to the CPU);
    anything else is torch.cuda's own (its random-state helpers are megatron-core's tracker's, shimmed above)."""

    Stream = staticmethod(lambda *args, **kwargs: _HostStream())
    current_stream = staticmethod(lambda device=None: _HostStream())
    stream = staticmethod(lambda stream=None: contextlib.nullcontext())
    synchronize = empty_cache = staticmethod(lambda *args, **kwargs: None)
    current_device = staticmethod(lambda: 0)
    # TP > 1: the adapter broadcasts rank 0's random states over the TP group; the CPU generator's travels in
    # the same dict (torch_rng_state), and there is no CUDA generator to carry
    get_rng_state = staticmethod(lambda device="cuda": torch.empty(0, dtype=torch.uint8))
    set_rng_state = staticmethod(lambda state, device="cuda": None)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _NoTELinear:
    """TransformerEngine's ``TELinear`` where TE is not installed: no module is one (the local layers' TP
    parameters carry megatron-core's own ``tensor_model_parallel`` marks)."""


class _CpuMesh:
    """``DeviceMesh`` for the adapter: ``from_group`` over the same (gloo) groups, as a CPU mesh."""

    @staticmethod
    def from_group(*args: Any, device_type: str = "cuda", **kwargs: Any) -> Any:
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(*args, device_type="cpu", **kwargs)


class _HostEvent:
    """A CUDA event's stand-in: the copies it would mark are done when it is recorded."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class _HostStream:
    """A CUDA stream's stand-in for ``HybridDeviceOptimizer``: host copies are synchronous."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()


_HOST_CUDA = types.SimpleNamespace(current_stream=lambda device=None: _HostStream(), Stream=lambda *a, **k: _HostStream(),
                                   stream=lambda stream=None: contextlib.nullcontext())


def _device_params_read_as_cuda(split: Callable) -> Callable:
    """``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` with CUDA's placement semantics, while
    it runs: a tensor is "on the device" (``is_cuda`` True) unless it came from ``.cpu()`` (called on a
    fresh clone: a new tensor, as on a GPU), ``pin_memory()`` of a CPU tensor is the tensor itself, and
    ``detach`` / ``clone`` / ``float`` keep their source's side (the fp32 copy of a bf16 parameter stays
    where the parameter is). The method reads ``is_cuda`` of its parameters and of those copies only, so
    the parameters it picks by ``optimizer_offload_fraction`` get host copies and the others stay with
    the "device" sub-optimiser, as on a GPU; afterwards torch's own methods are back."""
    @functools.wraps(split)
    def call(self: Any, *args: Any, **kwargs: Any):
        host: dict[int, torch.Tensor] = {}  # by identity; held, so that no identity is reused meanwhile
        own = {name: getattr(torch.Tensor, name) for name in ("detach", "clone", "float", "cpu")}

        def same_side(name: str) -> Callable:
            def method(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
                out = own[name](t, *a, **k)
                if id(t) in host:
                    host[id(out)] = out
                return out
            return method

        def to_host(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            out = own["cpu"](t, *a, **k)
            host[id(out)] = out
            return out

        with _tensor_attributes(is_cuda=property(lambda t: id(t) not in host), cpu=to_host,
                                pin_memory=lambda t, *a, **k: t,
                                **{name: same_side(name) for name in ("detach", "clone", "float")}):
            return split(self, *args, **kwargs)
    return call


@contextlib.contextmanager
def _tensor_attributes(**replacements: Any) -> Any:
    """``torch.Tensor``'s attributes replaced for the duration; then torch's own again (deleted where
    ``torch.Tensor`` had none of its own: its base class's)."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in replacements}
    for name, value in replacements.items():
        setattr(torch.Tensor, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


_SPLITS = ("input_splits", "output_splits", "output_splits_tp")


def _dispatcher_splits_on_host(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on the CPU: at the point where it
    would copy them to the host, the all-to-all split sizes become numpy arrays (as its copy makes
    them; the all-to-all reads them as host integers); no stream, no event."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in _SPLITS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _gather_uneven(gather: Callable) -> Callable:
    """``mappings._gather_along_first_dim`` whose parts of unequal length (``output_split_sizes``)
    travel padded to the longest, as gloo's equal-size ``all_gather`` needs, and are cut back after."""

    @functools.wraps(gather)
    def call(input_: torch.Tensor, group: Any, output_split_sizes: list[int] | None = None,
             use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    return call


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


def _clip_by_total_norm(parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """``clip_grad_by_total_norm_fp32`` without its CUDA type check: every gradient (or decoupled
    gradient) times ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in params if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)


def _with_tensor_method(name: str, make: Callable[[Any], Any]) -> Callable:
    """A decorator: while the decorated call runs, ``torch.Tensor.<name>`` is ``make(torch's own)``."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any):
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, make(original))
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(torch.Tensor, name, original)
        return call
    return wrap


def _cuda_type_names(original: Any) -> Any:
    def type_name(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kw)
    return type_name


def _cpu_tensor_stays(original: Any) -> Any:
    def cuda(self, *args: Any, **kwargs: Any):
        return self if self.device.type == "cpu" else original(self, *args, **kwargs)
    return cuda


_with_cuda_type_names = _with_tensor_method("type", _cuda_type_names)
_with_cuda_as_cpu = _with_tensor_method("cuda", _cpu_tensor_stays)


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
        kwargs.pop("pin_memory", None)  # page-locked memory needs a CUDA allocator
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
