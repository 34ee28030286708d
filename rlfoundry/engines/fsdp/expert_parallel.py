"""Expert parallelism on the FSDP2 engine (``fsdp_config.expert_parallel_size``; verl's
``<role>.veomni.expert_parallel_size``).

With EP = e over W ranks the ranks form a ``(W/e, e)`` mesh named ``("efsdp", "ep")``. Each routed
layer's experts (transformers' fused 3-D ``gate_up_proj`` / ``down_proj`` and biases) become ``Shard(0)``
DTensors on the ``ep`` dim: rank j of an EP group holds experts ``[j·E/e, (j+1)·E/e)``. A layer's tokens
go to the ranks holding their top-k experts with an all-to-all and their outputs come back with a second,
both differentiable (transformers' ``AllToAllEP``, ``transformers.distributed.expert_parallel``: the
library's dispatch is used as it is). The experts module is then its own FSDP2 unit on the ``efsdp`` dim
(the W/e ranks holding the same experts); every other parameter is FSDP'd over all W ranks as without EP.

Gradient scale. Each rank's loss is its share of the global loss × W (FSDP2 averages over its ranks,
``engines/loop.py``), and the all-to-all's backward brings every token's contribution home to the rank
holding its expert: an expert's gradient on one rank already sums the e ranks of its EP group, and the
``efsdp`` reduction sums the W/e groups. So its unit divides by W, not by its own W/e ranks
(``set_gradient_divide_factor``; gloo has no PREMUL_SUM, so the reduction sums and FSDP2 divides after).
The grad norm takes each mesh's parameters apart (``utils.clip_grad_norm_tensor_``): DTensors on two meshes
do not stack. Checkpoints (torch.distributed.checkpoint) and the HF weight stream (``full_tensor``) read the
DTensors' global shape, so a checkpoint or an export is the same with and without EP.

Ulysses. Outside attention each rank of a sequence-parallel group computes its own slice of the packed
sequence, so it dispatches its own tokens as any rank does; its loss gradients are scaled so that all W
ranks' contributions sum to W × the gradient, as without SP (``ulysses.py``): the divide factor stays W.

Rollout. The HF rollout decodes rank by rank, each rank a different number of tokens, so no collective can
run inside a decode step: while the parameters are gathered for it (``utils.unsharded``) every rank holds
its layers' full experts and runs them itself (``full_experts``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfoundry.models import moe as moe_lib

__all__ = ["ExpertParallel", "check_expert_parallel", "EP_ATTR"]

# on the root module: its ExpertParallel, for utils.apply_fsdp2 / unsharded and the engine
EP_ATTR = "_rlf_expert_parallel"


def check_expert_parallel(size: int, module: nn.Module | None = None, *, world: int | None = None,
                          lora: bool = False, fsdp_size: int = -1, num_experts: int | None = None,
                          key: str = "fsdp_config.expert_parallel_size") -> None:
    """Start-up errors, naming the fix, for a layout expert parallelism cannot take (``module``: the model,
    or ``num_experts``: its experts per layer, when known)."""
    if size < 1:
        raise ValueError(f"{key} must be >= 1, got {size}")
    if size == 1:
        return
    world = dist.get_world_size() if world is None else world
    problems = []
    if world % size:
        problems.append(f"it does not divide the {world} ranks of the worker group (use a divisor of {world})")
    if lora:
        problems.append("with LoRA (model.lora_rank > 0) is not built (the adapter-only checkpoints and the merged "
                        "export are not built for experts on an expert mesh); train the full model or set "
                        "expert_parallel_size=1")
    if fsdp_size not in (-1, world) and fsdp_size < world:
        problems.append(f"with fsdp_config.fsdp_size={fsdp_size} (hybrid sharding) is not built; use "
                        "fsdp_size=-1")
    counts = {num_experts} if num_experts is not None else set()
    if module is not None:
        layers = moe_lib.moe_layers(module)
        if not layers:
            problems.append(f"{type(module).__name__} has no routed experts (expert parallelism is for MoE models; "
                            "set it to 1)")
        counts = {layer.num_experts for layer in layers}
    for n in sorted(counts):
        if n % size:
            problems.append(f"it does not divide the model's {n} experts per layer (use a divisor of {n})")
    if problems:
        raise ValueError(f"{key}={size}: " + "; ".join(problems) + " (docs/moe.md)")


@dataclass
class ExpertParallel:
    """The meshes and the expert modules of one EP-sharded model (``shard`` builds it)."""

    size: int
    mesh: Any  # (efsdp, ep[, etp=1]) device mesh over the worker group
    experts: list[nn.Module]

    @property
    def ep_mesh(self) -> Any:
        return self.mesh["ep"]

    @property
    def efsdp_mesh(self) -> Any:
        return self.mesh["efsdp"]

    @classmethod
    def shard(cls, module: nn.Module, size: int, device: torch.device) -> ExpertParallel:
        """Shard each routed layer's experts by expert over the EP mesh (every rank loaded the full weights:
        each keeps its slice, no communication) and put transformers' all-to-all dispatch in front of them."""
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        world = dist.get_world_size()
        # a third, size-1 dim: transformers' dispatch asks for the ranks sharing a batch (tensor parallelism), none here
        mesh = init_device_mesh(device.type, (world // size, size, 1), mesh_dim_names=("efsdp", "ep", "etp"))
        names = {id(m): n for n, m in module.named_modules()}
        plan: dict[str, str] = {}
        experts = [layer.block.experts for layer in moe_lib.moe_layers(module)]
        for layer, exp in zip(moe_lib.moe_layers(module), experts):
            name = names[id(exp)]
            for pname, param in exp.named_parameters(recurse=False):
                if param.dim() >= 1 and param.shape[0] == layer.num_experts:
                    plan[f"{name}.{pname}"] = "grouped_gemm"  # Shard(0) on ep; experts.num_experts -> E/e
            plan[name] = "ep_dispatch_experts"  # after its parameters: the dispatch reads the local count
        module.to(device)
        apply_expert_parallelism(module, mesh["ep"], mesh["etp"], plan, ep_implementation="all_to_all")
        ep = cls(size, mesh, experts)
        setattr(module, EP_ATTR, ep)
        return ep

    def fully_shard_experts(self, **kwargs: Any) -> None:
        """Each experts module its own FSDP2 unit over ``efsdp`` (kwargs: ``fully_shard``'s, without mesh)."""
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        for exp in self.experts:
            fully_shard(exp, mesh=self.efsdp_mesh, **kwargs)
            exp._rlf_reshard_after_forward = bool(kwargs.get("reshard_after_forward", True))
            exp.set_gradient_divide_factor(float(world))  # see the module docstring: W, not W/e
            if self.efsdp_mesh.size() > 1:
                # a divide factor other than the group size is a PREMUL_SUM, which gloo lacks: sum, then divide
                exp.set_force_sum_reduction_for_comms(True)

    @contextlib.contextmanager
    def full_experts(self) -> Iterator[None]:
        """Every rank runs its layers' full experts locally for the block (no-grad forwards: the rollout).
        Collective on entry (each expert tensor gathered over both meshes, in the same order on every rank)."""
        if torch.is_grad_enabled():
            raise RuntimeError("full_experts runs the experts outside the update: use it under torch.no_grad()")
        saved = []
        for exp in self.experts:
            saved.append(exp.__dict__.get("forward"))
            exp.forward = _local_copy(exp).__call__
        try:
            yield
        finally:
            for exp, forward in zip(self.experts, saved):
                exp.__dict__.pop("forward", None)
                if forward is not None:
                    exp.forward = forward


def _plain_class(module: nn.Module) -> type:
    """The model's own class of a module FSDP2 re-classed (``FSDP<Name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _local_copy(experts: nn.Module) -> nn.Module:
    """A hook-free copy of an EP experts module holding every expert's full weights (gathered now)."""
    full = OrderedDict((name, p.full_tensor() if hasattr(p, "full_tensor") else p)
                       for name, p in experts.named_parameters(recurse=False))
    twin = object.__new__(_plain_class(experts))  # no __init__: the attributes are the module's (config, activation)
    twin.__dict__.update(experts.__dict__)  # shallow: its own parameter and hook dicts below
    twin.__dict__.pop("forward", None)
    twin._parameters = OrderedDict((k, nn.Parameter(v, requires_grad=False)) for k, v in full.items())
    twin._forward_hooks, twin._forward_pre_hooks = OrderedDict(), OrderedDict()
    twin._forward_hooks_with_kwargs, twin._forward_pre_hooks_with_kwargs = OrderedDict(), OrderedDict()
    twin._forward_hooks_always_called = OrderedDict()
    twin.num_experts = next(iter(full.values())).shape[0]
    twin._is_expert_parallel = False
    return twin

