"""FSDP2 plumbing of the FSDP engine (and of the HF rollout that runs on its module).

- ``apply_fsdp2``        ``fully_shard`` each decoder layer, then the root
- ``build_optimizer`` / ``build_lr_scheduler``   AdamW + warm-up/constant/cosine (verl keys)
- ``clip_grad_norm_``    works on FSDP2 DTensor gradients, returns a plain float
- ``offload_optimizer`` / ``load_optimizer``     move AdamW state between host and device (GPU)
- ``unsharded``          context manager: gather the parameters once for many forwards (rollout)
- ``fsdp_does_nothing``  one rank, nothing to shard: the plain module (under ``compute_precision``'s
  autocast where it computes in bf16 over fp32 weights; ``decode_copy`` for the rollout)
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from rlfoundry.config.schema import LR_SCHEDULES, OptimConfig
from rlfoundry.engines.fsdp.expert_parallel import EP_ATTR
from rlfoundry.models.hf import resolve_dtype, trainer_only_prefixes

__all__ = [
    "apply_fsdp2",
    "get_decoder_layers",
    "build_optimizer",
    "build_lr_scheduler",
    "lr_lambda",
    "clip_grad_norm_",
    "offload_optimizer",
    "load_optimizer",
    "unsharded",
    "inference_unsharded",
    "fsdp_modules",
    "default_device",
    "hf_parameter_name",
    "iter_full_parameters",
    "fsdp_does_nothing",
    "compute_dtype",
    "plain_autocast_dtype",
    "autocast_off",
    "compute_precision",
    "decode_copy",
    "refresh_decode_copy",
]


def default_device() -> torch.device:
    """The local accelerator when there is one (``LOCAL_RANK`` picks it), else the CPU."""
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


# --------------------------------------------------------------------------- FSDP2

def get_decoder_layers(module: nn.Module, classes: Sequence[str] | None = None) -> list[nn.Module]:
    """The repeated transformer blocks: HF's ``_no_split_modules`` classes, else ModuleList items.

    ``classes`` (verl's ``fsdp_config.wrap_policy.transformer_layer_cls_to_wrap``): the modules of
    these class names instead, plus, as verl's FSDP2 wrapping does, the embeddings when the model
    does not tie them to the LM head. A name that matches no module is an error naming the key.
    """
    classes = [classes] if isinstance(classes, str) else classes
    if classes:
        tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
        units = [m for m in module.modules()
                 if type(m).__name__ in set(classes) or (isinstance(m, nn.Embedding) and not tied)]
        if not any(type(m).__name__ in set(classes) for m in units):
            raise ValueError(f"fsdp_config.wrap_policy.transformer_layer_cls_to_wrap={list(classes)} names no "
                             f"module of {type(module).__name__}; its layer classes: "
                             f"{sorted(getattr(module, '_no_split_modules', None) or [])}")
        return units
    names = set(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _ensure_process_group(device: torch.device) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "apply_fsdp2 needs torch.distributed initialised (even with one rank). Call "
            "Worker.init_distributed() first, or dist.init_process_group('gloo') on CPU."
        )


def device_mesh(device_type: str, fsdp_size: int = -1) -> Any:
    """The ranks' mesh for FSDP2, from verl's ``fsdp_config.fsdp_size``.

    -1 (or >= the world size): one dimension, every parameter sharded over all ranks. Otherwise
    ``(world / fsdp_size, fsdp_size)`` named ("ddp", "fsdp"): hybrid sharding, each group of
    ``fsdp_size`` ranks shards the model and the groups replicate it; gradients are
    reduce-scattered within a group and all-reduced across groups. ``fsdp_size=1`` is plain data
    parallelism: no all-gathers at all, one all-reduce per unit per mini-batch, at the price of a
    whole copy of the weights, gradients and optimiser state on every rank (fine for small models;
    on a multi-node GPU cluster, the node's GPU count keeps the gathers on fast links).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if fsdp_size == 0 or fsdp_size < -1:
        raise ValueError(f"fsdp_config.fsdp_size must be -1 (shard over all ranks) or >= 1, got {fsdp_size}")
    if fsdp_size == -1 or fsdp_size >= world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    if world % fsdp_size:
        raise ValueError(f"fsdp_config.fsdp_size={fsdp_size} does not divide the {world} ranks of this worker "
                         f"group; use a divisor of {world} or -1")
    return init_device_mesh(device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def fsdp_does_nothing(device: torch.device | str, param_dtype: torch.dtype | str | None = None,
                      param_offload: bool = False, module_dtype: torch.dtype = torch.float32) -> bool:
    """True when FSDP2 would have nothing to shard or offload and no cast that autocast does not do:
    one rank, no offload, computing in the weights' own dtype or in bf16 over fp32 weights (CUDA's
    default mixed precision: the plain module under ``torch.autocast``, see ``plain_autocast_dtype``).
    FSDP2 would still copy every parameter into an unsharded buffer on each forward and every gradient
    out of one on each backward (for a 120 M-parameter model on a 2-core CPU ~2 s of a 5.6 s update,
    and ~1 GB more memory; on a GPU, per-layer hooks, gathers and casts that buy nothing there), so
    the engine uses the plain module.
    """
    device = torch.device(device)
    compute = compute_dtype(device, param_dtype)
    autocast = compute == torch.bfloat16 and module_dtype == torch.float32
    return (dist.get_world_size() == 1 and (compute == module_dtype or autocast)
            and not (param_offload and device.type == "cuda"))


def compute_dtype(device: torch.device | str, param_dtype: torch.dtype | str | None = None) -> torch.dtype:
    """``mixed_precision.param_dtype``, or its default: bf16 on CUDA, fp32 elsewhere."""
    return resolve_dtype(param_dtype, torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)


# On a plain (unwrapped) module: the dtype its engine computes in under torch.autocast, where that
# is not the weights' own. The HF rollout reads it to decode from a copy in that dtype.
AUTOCAST_ATTR = "_rlf_autocast_dtype"


def plain_autocast_dtype(module: nn.Module) -> torch.dtype | None:
    """The autocast dtype of a plain single-rank module (``AUTOCAST_ATTR``); None: it computes as it is."""
    return getattr(module, AUTOCAST_ATTR, None)


def compute_precision(module: nn.Module, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context every forward of ``module`` runs in: ``torch.autocast`` to its autocast dtype on a
    plain module computing below its weights' precision, else nothing (FSDP2 casts by itself)."""
    dtype = plain_autocast_dtype(module)
    return contextlib.nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


@contextlib.contextmanager
def autocast_off(module: nn.Module) -> Iterator[None]:
    """Forwards of a plain module under autocast (``AUTOCAST_ATTR``) compute in its weights' own dtype
    inside this context: ``compute_precision`` finds no autocast dtype until it ends."""
    dtype = module.__dict__.pop(AUTOCAST_ATTR, None)
    try:
        yield
    finally:
        if dtype is not None:
            setattr(module, AUTOCAST_ATTR, dtype)


def decode_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen copy of ``module`` with its parameters in ``dtype`` (buffers as they are, as FSDP2's
    mixed precision casts parameters only), for the rollout to decode from: half the weight reads of
    an fp32 module under autocast, and every cast done once per update instead of once per token.
    Built without a second full-precision copy; tied parameters stay tied. ``refresh_decode_copy``
    keeps it equal to ``module``'s weights rounded to ``dtype``, in place (a captured CUDA graph
    keeps reading the same storage)."""
    import copy

    with torch.no_grad():
        memo: dict[int, Any] = {id(p): nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
                                for p in module.parameters()}
        twin = copy.deepcopy(module, memo)
    twin.__dict__.pop(AUTOCAST_ATTR, None)
    return twin.eval()


@torch.no_grad()
def refresh_decode_copy(twin: nn.Module, module: nn.Module) -> None:
    """Copy ``module``'s current weights into its ``decode_copy`` (rounded to the copy's dtype)."""
    held = dict(twin.named_parameters())
    for name, p in module.named_parameters():
        held[name].copy_(p)


def apply_fsdp2(
    module: nn.Module,
    device: torch.device | str,
    param_dtype: torch.dtype | str | None = None,
    reduce_dtype: torch.dtype | str | None = None,
    param_offload: bool = False,
    reshard_after_forward: bool = True,
    mesh: Any = None,
    fsdp_size: int = -1,
    layer_units: bool | None = None,
    layer_classes: Sequence[str] | None = None,
    forward_prefetch: bool = False,
    offload_policy: bool = False,
) -> nn.Module:
    """Shard ``module`` in place with FSDP2: each decoder layer is its own unit, then the root.

    Mixed precision defaults to bf16 parameters with fp32 gradient reduction on CUDA and plain fp32
    on CPU (CPU bf16 matmuls are slow and would break the fp32 invariance tests). Parameter CPU
    offload is honoured only on GPU: on a CPU-only run the parameters already live on the host.
    ``fsdp_size`` (verl's ``fsdp_config.fsdp_size``) picks the mesh when ``mesh`` is None: see
    ``device_mesh``.

    ``layer_units`` (None: decide): on the CPU with unsharded parameters (a shard group of one rank:
    ``fsdp_size=1``, or a single rank) the root is the only unit. Per-layer units there save no
    memory and cannot overlap their gradient all-reduces with compute (gloo collectives block), so
    one all-reduce of all gradients replaces one per layer (~7 % off a 2-rank CPU update).

    verl's FSDP2 keys: ``layer_classes`` (``wrap_policy.transformer_layer_cls_to_wrap``) names the
    unit classes and makes units even where ``layer_units`` would not; ``forward_prefetch``: each
    unit starts the next one's all-gather before its own forward runs (FSDP1's ``forward_prefetch``,
    FSDP2's ``set_modules_to_forward_prefetch``); ``offload_policy``: FSDP2's ``CPUOffloadPolicy``
    (parameters, gradients and the optimiser step on the host), like ``param_offload`` GPU-only.
    """
    device = torch.device(device)
    _ensure_process_group(device)
    on_gpu = device.type == "cuda"
    param_dtype = compute_dtype(device, param_dtype)
    reduce_dtype = resolve_dtype(reduce_dtype, torch.float32)
    if mesh is None:
        mesh = device_mesh(device.type, fsdp_size)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if (param_offload or offload_policy) and on_gpu:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    else:
        module.to(device)
    if layer_units is None or layer_classes:
        layer_units = on_gpu or mesh.size(-1) > 1 or bool(layer_classes)  # the last mesh dim is the one that shards
    units = get_decoder_layers(module, layer_classes) if layer_units else []
    experts = getattr(module, EP_ATTR, None)
    if experts is not None:  # expert parallelism: the experts first, as units of their own on the efsdp mesh
        experts.fully_shard_experts(**{k: v for k, v in kwargs.items() if k != "mesh"})
    # a trainer-only head (FlowRL's log Z) runs outside the model's forward: a unit of its own gathers itself
    heads = [module.get_submodule(p.rstrip(".")) for p in trainer_only_prefixes(module)]
    for layer in [*units, *heads]:
        fully_shard(layer, **kwargs)
        layer._rlf_reshard_after_forward = bool(reshard_after_forward)
    if forward_prefetch:
        for unit, after in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([after])
    fully_shard(module, **kwargs)
    module._rlf_reshard_after_forward = bool(reshard_after_forward)
    return module


def activation_offload(device: torch.device) -> contextlib.AbstractContextManager:
    """verl's ``model.enable_activation_offload``: tensors the forward saves for backward wait in
    pinned host memory instead of the accelerator's (copied back as backward reaches them). On the
    CPU they already live in host memory, so nothing is done (a copy would only double them)."""
    if device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every FSDP2 unit inside ``module`` (root last), for bulk unshard/reshard."""
    return [m for m in reversed(list(module.modules())) if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(module: nn.Module) -> Iterator[nn.Module]:
    """Gather all parameters once and keep them gathered across many forwards.

    Autoregressive decoding calls forward once per token; letting FSDP2 all-gather and free every
    layer on every call would dominate small-model generation. Inside this block every unit is
    unsharded and told not to reshard after forward; on exit the previous behaviour is restored and
    the memory freed. A module without FSDP is yielded unchanged. Under expert parallelism every rank
    also holds each layer's full experts for the block and runs them itself (``expert_parallel.full_experts``:
    ranks decoding different prompts run no collective inside a forward).
    """
    units = fsdp_modules(module)
    previous = [_reshard_after_forward(u) for u in units]
    try:
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)
        handles = [u.unshard(async_op=True) for u in units]
        for h in handles:
            if h is not None:
                h.wait()
        experts = getattr(module, EP_ATTR, None)
        with experts.full_experts() if experts is not None else contextlib.nullcontext():
            yield module
    finally:
        for u, prev in zip(units, previous):
            u.set_reshard_after_forward(prev, recurse=False)
            u.reshard()


@contextlib.contextmanager
def accumulate_unsharded(module: nn.Module) -> Iterator[Callable[[bool], None]]:
    """Gradient accumulation over micro-batches with one gather and one reduction per mini-batch.

    For units built with ``reshard_after_forward=False`` (``fsdp_config.reshard_after_forward``):
    parameters stay gathered from the first micro-batch's forward to the last one's backward, and
    gradients accumulate unsharded on each rank; only the last backward reduce-scatters them (FSDP2's
    equivalent of DDP's ``no_sync``). Without it every micro-batch pays an all-gather per unit in
    forward and backward plus a reduce-scatter — on gloo, milliseconds of latency each. Yields
    ``before_backward(last)``, to call before each micro-batch's backward. Units that reshard after
    forward (the memory-lean default) are left alone.
    """
    units = [u for u in fsdp_modules(module) if not _reshard_after_forward(u)]

    def before_backward(last: bool) -> None:
        for u in units:
            u.set_requires_gradient_sync(last, recurse=False)
            u.set_reshard_after_backward(last, recurse=False)

    try:
        yield before_backward
    finally:
        for u in units:
            u.set_requires_gradient_sync(True, recurse=False)
            u.set_reshard_after_backward(True, recurse=False)


@contextlib.contextmanager
def continued_forward(module: nn.Module) -> Iterator[None]:
    """A second forward of ``module`` that continues the first one's graph, seen by FSDP2 as one.

    FSDP2 prepares backward in every forward: a second call before the backward (the shared-prompt
    forward runs the prompts, then the responses on their KV cache) makes each unit reduce-scatter
    its gradients once per call, reshard in between and all-gather again for the rest of the
    backward: twice the collectives, milliseconds each on gloo. When every unit keeps its
    parameters gathered after forward (``reshard_after_forward=False``) the second call needs none
    of FSDP2's hooks: its gradients accumulate into the gathered parameters and the first call's
    post-backward reduces both, once, after both graphs are done (a unit's post-backward runs when
    its input gradients are complete, which the continuation feeds). Units that reshard after
    forward need the hooks to gather again, and keep them.
    """
    units = fsdp_modules(module)
    if not units or any(_reshard_after_forward(u) for u in units):
        yield
        return
    with _fsdp_forward_hooks_paused(units):
        yield


def _is_fsdp_hook(hook: Any) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return isinstance(getattr(hook, "__self__", None), FSDPState)


@contextlib.contextmanager
def _fsdp_forward_hooks_paused(units: list[FSDPModule]) -> Iterator[None]:
    """Detach FSDP2's own forward hooks from ``units`` for the block; other hooks stay."""
    saved = [(u._forward_pre_hooks.copy(), u._forward_hooks.copy()) for u in units]
    try:
        for unit in units:
            for hooks in (unit._forward_pre_hooks, unit._forward_hooks):
                for key in [k for k, h in hooks.items() if _is_fsdp_hook(h)]:
                    del hooks[key]
        yield
    finally:
        for unit, (pre, post) in zip(units, saved):
            unit._forward_pre_hooks.clear()
            unit._forward_pre_hooks.update(pre)  # original order: FSDP's pre-hook is prepended
            unit._forward_hooks.clear()
            unit._forward_hooks.update(post)


@contextlib.contextmanager
def inference_unsharded(module: nn.Module) -> Iterator[nn.Module]:
    """``unsharded`` plus FSDP2's per-forward hooks skipped: for many small no-grad forwards.

    With every unit gathered and waited on, FSDP2's forward hooks have nothing left to do under
    ``no_grad`` except bookkeeping (re-checking the unshard, casting floating-point inputs to
    ``param_dtype`` — decoding feeds integer ids and masks only — and preparing backward). On a
    small model that bookkeeping is 20-40% of a decode step, so generation runs without it.
    """
    if torch.is_grad_enabled():
        raise RuntimeError("inference_unsharded skips FSDP's autograd hooks: use it under torch.no_grad()")
    with unsharded(module):
        with _fsdp_forward_hooks_paused(fsdp_modules(module)):
            yield module


def _reshard_after_forward(unit: FSDPModule) -> bool:
    """The setting ``apply_fsdp2`` gave this unit (recorded there: FSDP2 has no public getter)."""
    return bool(getattr(unit, "_rlf_reshard_after_forward", True))


# --------------------------------------------------------------------------- optimiser + schedule

def build_optimizer(module: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, from verl's ``optim`` keys (lr, betas, weight_decay, eps).

    ``fused=True`` (CPU and CUDA): one kernel per parameter and no temporaries. torch's default on
    the CPU loops over the parameters (with FSDP2 every op a DTensor dispatch), and ``foreach``
    allocates whole-model temporaries (a sqrt of every second moment) whose pages fault in afresh
    each step: for a 120 M-parameter model on 2 cores 0.07 s a step against 0.34-1.3 s. The update
    is the same to float rounding. Other devices keep ``foreach``.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)
    # verl's optim.override_optimizer_config: more AdamW arguments (amsgrad, ...; checked at start-up). One
    # that picks the implementation (fused / foreach) replaces this choice
    overrides = dict(getattr(optim, "override_optimizer_config", None) or {})
    impl = {} if {"fused", "foreach"} & overrides.keys() else {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                             eps=optim.eps, **impl, **overrides)


def _total_steps(optim: OptimConfig, total_training_steps: int | None) -> int | None:
    """The schedule's length: Megatron's ``lr_decay_steps`` when set (the warm-up ratio and the cosine
    count in it, the lr holds at its floor after it), else the run's steps."""
    decay = getattr(optim, "lr_decay_steps", None)
    total = decay if decay is not None else \
        total_training_steps if total_training_steps is not None else optim.total_training_steps
    return int(total) if total is not None and int(total) > 0 else None


def _warmup_steps(optim: OptimConfig, total: int | None) -> int:
    """``lr_warmup_steps`` when positive, else ``lr_warmup_steps_ratio`` × total steps (verl rule)."""
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps > 0:
        return int(optim.lr_warmup_steps)
    return int(optim.lr_warmup_steps_ratio * total) if total is not None else 0


def lr_lambda(
    step: int, warmup: int, total: int | None, style: str, min_lr_ratio: float, num_cycles: float = 0.5,
    warmup_init_ratio: float = 0.0,
) -> float:
    """Multiplier of the base lr after ``step`` optimiser steps.

    Warm-up is linear from ``warmup_init_ratio`` (0: the HF/verl convention, step 0 has factor 0;
    Megatron's ``lr_warmup_init`` / lr otherwise) up to 1. After warm-up, ``constant``
    stays at 1; ``cosine`` follows min + (1 - min)·½(1 + cos(2π·num_cycles·progress)), which with
    the default ``num_cycles`` 0.5 is half a cosine from 1 down to ``min_lr_ratio`` at ``total``.
    Without a known total (None/-1) there is no decay.
    """
    if step < warmup:
        return warmup_init_ratio + (1.0 - warmup_init_ratio) * step / max(1, warmup)
    if style == "constant" or total is None:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_training_steps: int | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up (from ``lr_warmup_init``) then constant or cosine, from ``lr_scheduler_type`` (verl ≥0.5;
    Megatron's ``lr_decay_style`` is copied there at load) or ``warmup_style``."""
    total = _total_steps(optim, total_training_steps)
    style = optim.lr_scheduler_type or optim.warmup_style
    if style not in LR_SCHEDULES:
        raise ValueError(f"optim.lr_scheduler_type/warmup_style must be one of {list(LR_SCHEDULES)}, got {style!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_lambda, warmup=_warmup_steps(optim, total), total=total, style=style,
        min_lr_ratio=float(optim.min_lr_ratio or 0.0), num_cycles=optim.num_cycles,
        warmup_init_ratio=_warmup_init_ratio(optim),
    ))


def _warmup_init_ratio(optim: Any) -> float:
    """Megatron's ``lr_warmup_init`` as a fraction of ``lr`` (0 when either is 0: a frozen lr has no warm-up)."""
    init, lr = float(getattr(optim, "lr_warmup_init", 0.0) or 0.0), float(optim.lr)
    return init / lr if init and lr else 0.0


# --------------------------------------------------------------------------- gradients

def clip_grad_norm_(parameters: Any, max_norm: float | None) -> float:
    """Total L2 grad norm over (possibly DTensor-sharded) parameters; clips when ``max_norm`` > 0.

    With FSDP2 the per-parameter norms are DTensors, so the total is reduced across ranks before it
    is read back as a float. A non-finite norm is returned as is and nothing is clipped: the caller
    skips the optimiser step instead (scaling by NaN would poison the weights).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    total = _total_grad_norm(params)
    norm = float(total)
    if max_norm is not None and max_norm > 0 and math.isfinite(norm):
        _clip_grads(params, max_norm, total)
    return norm


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by their DTensor mesh (plain tensors together): with expert parallelism the experts
    live on another mesh than the rest, and DTensors on two meshes cannot meet in one op."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(groups.values())


def _total_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``params``' gradients as a plain 0-d tensor: each mesh's norm reduced over its
    ranks, then the meshes' norms combined."""
    norms = []
    for group in _by_mesh(params):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, error_if_nonfinite=False,
                                             foreach=None)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _clip_grads(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    for group in _by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)


def clip_grad_norm_tensor_(parameters: Any, max_norm: float | None) -> torch.Tensor:
    """``clip_grad_norm_`` without reading the norm: returns it as a 0-d tensor on the gradients' device.

    Clips whatever the norm: a non-finite one leaves non-finite gradients, which is harmless because
    the caller reads the norm next (with its metrics, in one read) and then skips the optimiser step
    and drops the gradients."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    total = _total_grad_norm(params)
    if max_norm is not None and max_norm > 0:
        _clip_grads(params, max_norm, total)
    return total


# --------------------------------------------------------------------------- optimiser offload

def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Move AdamW moments to host memory between updates (``fsdp_config.optimizer_offload``)."""
    _move_optimizer_state(optimizer, "cpu")
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Bring AdamW moments back to their parameters before ``optimizer.step``: the GPU, or the host
    when FSDP2 offloads the parameters too (``param_offload``: its CPUOffloadPolicy steps the
    optimiser on the host, and a fused AdamW refuses moments on another device than their parameter)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step" and value.device != param.device:
                    state[key] = value.to(param.device, non_blocking=True)


# --------------------------------------------------------------------------- full weights, HF names

# Wrapper modules that prefix parameter names without being part of the HF checkpoint layout.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_parameter_name(name: str) -> str:
    """The checkpoint name of a parameter: wrapper prefixes (compile, checkpointing) removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def iter_full_parameters(module: nn.Module, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) per parameter (``trainable_only``: those with ``requires_grad``); FSDP2
    DTensor shards are gathered one at a time.

    One parameter is materialised at a time, so the peak is the largest parameter, not the model.
    ``full_tensor()`` is a collective: every rank must run this generator to the end, in the same
    order (``named_parameters`` order is the same on every rank).
    """
    skip = trainer_only_prefixes(module)  # FlowRL's log Z head: not the rollout's
    with torch.no_grad():
        for name, param in module.named_parameters():
            if (trainable_only and not param.requires_grad) or hf_parameter_name(name).startswith(skip):
                continue
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield hf_parameter_name(name), full.detach()
