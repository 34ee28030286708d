"""Mixture-of-experts models on the Megatron engine: megatron-core's MoE layers (router, token
dispatcher, experts), expert parallelism, and the HF <-> megatron-core names of the experts.

mbridge (``qwen3_moe``: the family built and tested here, :data:`BUILT_FAMILIES`) maps the experts to HF's per-expert checkpoint names
(``mlp.experts.{e}.gate_proj.weight``...), which is how ``save_pretrained`` writes them. An HF module
in memory (transformers 5) holds each layer's experts as two 3-D tensors instead,
``mlp.experts.gate_up_proj`` (E, 2·I, H: expert e's gate rows, then its up rows) and
``mlp.experts.down_proj`` (E, H, I); the rollout copies weights by those in-memory names, so the
export collects a layer's per-expert tensors (:func:`fuse_experts`) and hands on the two fused ones.

Routing as HF computes it: ``softmax → top-k → renormalise`` (``norm_topk_prob``) is, for the chosen
experts, the softmax over their k logits — megatron-core's ``moe_router_pre_softmax=False``; without
renormalisation the weights are the full softmax's (``pre_softmax=True``).

Token dispatch: "alltoall" (the default) runs over gloo too (``all_to_all_single``; cpu_compat.py
takes its CUDA stream out on the CPU). megatron-core's "allgather" refuses variable sequence lengths,
which the engine's micro-batches have (each as long as its longest row), and "flex" needs DeepEP or
HybridEP (CUDA): both are start-up errors (:func:`layout_problems`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["BUILT_FAMILIES", "expert_tensor_parallel_bridge", "fuse_experts", "is_moe", "layout_problems",
           "mark_expert_parameters", "moe_overrides", "replay_problems", "sequential_experts_bridge"]

# SequentialMLP's expert e (local to this expert-parallel rank) -> mbridge's (grouped-GEMM) name for it
_SEQUENTIAL = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


# the MoE families built and tested here; mbridge converts more (qwen2_moe: its shared expert's gate is
# not mapped for the local layers and its log-probs differ from HF's; mixtral, deepseek_v3, glm4_moe: not tried)
BUILT_FAMILIES = ("qwen3_moe",)
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe(hf_config: Any) -> bool:
    """Whether the HF config describes routed experts (under any of the families' names for their number)."""
    return any(int(getattr(hf_config, k, 0) or 0) > 0 for k in _EXPERT_COUNT_KEYS)


def moe_overrides(hf_config: Any, user: dict[str, Any], grouped_gemm: bool) -> dict[str, Any]:
    """TransformerConfig fields for an MoE family, under the user's ``override_transformer_config``.

    ``grouped_gemm``: megatron-core's GroupedMLP / TEGroupedMLP (the grouped-GEMM kernels, CUDA); off,
    its SequentialMLP (one ordinary MLP per local expert). The aux loss: megatron-core adds it only
    with a load-balancing type other than "none" (mbridge's RL default), so a positive
    ``moe_aux_loss_coeff`` without a type asks for megatron-core's "aux_loss"."""
    out: dict[str, Any] = {
        "moe_grouped_gemm": grouped_gemm,
        "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", True)),
        "moe_router_score_function": "softmax",
        "moe_token_dispatcher_type": "alltoall",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_load_balancing_type": "none",
        # megatron-core's RouterReplay on every router: idle (its own top-k) unless a batch replays or
        # records routing (verl's router_replay, routing.py)
        "moe_enable_routing_replay": True,
    }
    out.update(user)
    if float(out.get("moe_aux_loss_coeff") or 0.0) > 0 and "moe_router_load_balancing_type" not in user:
        out["moe_router_load_balancing_type"] = "aux_loss"
    return out


def layout_problems(key: str, hf_config: Any, megatron: Any, on_cpu: bool | None, trains: bool = True) -> list[str]:
    """What in a role's ``megatron`` subtree (``key``) the model of ``hf_config`` cannot run with:
    expert parallelism on a dense model or not dividing the experts, an expert tensor parallelism this
    engine does not build, TP > 1 without sequence parallelism for a model that ``trains`` (a frozen
    reference's MoE layers run without), a token dispatcher that cannot run here (``on_cpu`` None: not
    known yet)."""
    ep = int(megatron.expert_model_parallel_size)
    etp = megatron.expert_tensor_parallel_size
    overrides = dict(megatron.override_transformer_config or {})
    if not is_moe(hf_config):
        moe_keys = sorted(k for k in overrides if k.startswith("moe_"))
        if ep == 1 and not moe_keys:
            return []
        return [f"{key}: expert_model_parallel_size={ep} / override_transformer_config {moe_keys}: the model "
                f"({hf_config.model_type}) has no experts; set expert_model_parallel_size=1 and drop the moe_* keys."]
    if hf_config.model_type not in BUILT_FAMILIES:
        return [f"{key}: the model is a {hf_config.model_type} mixture of experts; the Megatron engine builds "
                f"{list(BUILT_FAMILIES)} MoE models (docs/moe.md). Use strategy=fsdp for this model."]
    errors = []
    if hf_config.num_experts % ep:
        errors.append(f"{key}.expert_model_parallel_size={ep} does not divide the model's {hf_config.num_experts} "
                      "experts; each expert-parallel rank holds the same number of them.")
    tp = megatron.tensor_model_parallel_size
    if etp is not None and tp % etp:
        # megatron-core lays an expert tensor-parallel group inside a tensor-parallel one only when ETP
        # divides TP (both innermost in its rank order); the export at EP = 1 relies on that
        # (expert_tensor_parallel_bridge), and nothing here was run with another layout
        errors.append(f"{key}.expert_tensor_parallel_size={etp} does not divide tensor_model_parallel_size={tp}: "
                      f"each expert is split over a part of a tensor-parallel group here (one of "
                      f"{[d for d in range(1, tp + 1) if tp % d == 0]}, or null: {tp}); experts split across "
                      "tensor-parallel groups are not built (docs/moe.md).")
    if trains and megatron.tensor_model_parallel_size > 1 and not megatron.sequence_parallel:
        # MoELayer.forward raises in training when TP > 1 runs without sequence parallelism
        errors.append(f"{key}.sequence_parallel=False at tensor_model_parallel_size="
                      f"{megatron.tensor_model_parallel_size}: megatron-core trains MoE layers at TP > 1 only with "
                      f"sequence parallelism; set {key}.sequence_parallel=True (the default) or "
                      "tensor_model_parallel_size=1.")
    problem = _dispatcher_problem(key, overrides.get("moe_token_dispatcher_type"), on_cpu)
    return errors + ([problem] if problem else [])


def replay_problems(key: str, megatron: Any) -> list[str]:
    """What in a policy's ``megatron`` subtree (``key``) routing replay (``actor.router_replay.mode`` R2 / R3,
    routing.py) cannot run with: a path that routes without megatron-core's RouterReplay."""
    overrides = dict(megatron.override_transformer_config or {})
    where, fix = f"{key}.override_transformer_config", "remove it, or set actor_rollout_ref.actor.router_replay.mode=disabled"
    errors = []
    if overrides.get("moe_router_fusion"):
        errors.append(f"{where}.moe_router_fusion=true with routing replay: TransformerEngine's fused top-k bypasses "
                      f"megatron-core's RouterReplay; {fix}.")
    if overrides.get("moe_router_load_balancing_type") == "sinkhorn":
        errors.append(f"{where}.moe_router_load_balancing_type='sinkhorn' with routing replay: sinkhorn routing "
                      f"bypasses megatron-core's RouterReplay; {fix}.")
    if overrides.get("moe_enable_routing_replay") is False:
        errors.append(f"{where}.moe_enable_routing_replay=false with routing replay: the routers are built without "
                      f"megatron-core's RouterReplay; {fix}.")
    return errors


def _dispatcher_problem(key: str, chosen: Any, on_cpu: bool | None) -> str | None:
    """Why ``override_transformer_config.moe_token_dispatcher_type=chosen`` cannot run here (None: it can)."""
    where = f"{key}.override_transformer_config.moe_token_dispatcher_type={chosen!r}"
    if chosen is None or chosen == "alltoall":
        return None
    if chosen == "allgather":  # megatron-core's TransformerConfig refuses it with variable_seq_lengths
        return (f"{where}: megatron-core's allgather dispatcher needs every micro-batch the same length, and "
                "this engine's micro-batches are as long as their longest row; use 'alltoall' (the default).")
    if chosen != "flex":
        return f"{where}: megatron-core's dispatchers are ['alltoall', 'allgather', 'flex']; use 'alltoall'."
    if on_cpu:
        return f"{where} needs DeepEP/HybridEP kernels (CUDA); on CPU processes (gloo) use 'alltoall'."
    return None


def fuse_experts(named: Iterable[tuple[str, torch.Tensor]], num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF per-expert tensors (as mbridge exports them) -> the in-memory layout of transformers' MoE
    modules: each layer's ``gate_up_proj`` (E, 2·I, H) and ``down_proj`` (E, H, I), handed on once the
    layer's last expert has arrived; every other tensor passes through as it comes."""
    pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in named:
        match = _EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        layer = pending.setdefault(match["prefix"], {})
        # a tensor may be a view of a buffer reused for the next one: keep a copy
        layer[(match["proj"], int(match["e"]))] = tensor.detach().clone()
        if len(layer) == 3 * num_experts:
            yield from _fused(match["prefix"], pending.pop(match["prefix"]), num_experts)
    if pending:
        raise RuntimeError(f"fuse_experts: incomplete expert sets for {sorted(pending)} "
                           f"(expected {num_experts} experts × gate/up/down each)")


def _fused(prefix: str, layer: dict[tuple[str, int], torch.Tensor], num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    experts = range(num_experts)
    gate_up = torch.stack([torch.cat([layer[("gate_proj", e)], layer[("up_proj", e)]]) for e in experts])
    yield f"{prefix}.gate_up_proj", gate_up
    yield f"{prefix}.down_proj", torch.stack([layer[("down_proj", e)] for e in experts])


def mark_expert_parameters(chunk: torch.nn.Module) -> None:
    """The experts' parameters flagged as megatron-core's expert-parallel ones (``allreduce=False``) when
    their data-parallel ranks are not the dense layers'.

    megatron-core flags them only at EP > 1 (``ColumnParallelLinear``: ``allreduce = not (is_expert and
    expert_parallel)``); at EP = 1 its DDP reduces them over the dense data-parallel group. With
    ``expert_tensor_parallel_size`` < TP each expert tensor-parallel group runs only its own ranks'
    sequence slices through its experts (whole experts: each rank its own slice), so the gradients of
    the TP/ETP copies of an expert part must also be summed, over ranks of one tensor-parallel group,
    which the expert data-parallel group holds and the dense one does not."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_tensor_parallel_world_size() == ps.get_tensor_model_parallel_world_size():
        return
    for name, param in chunk.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def sequential_experts_bridge(cls: type) -> type:
    """``cls`` (an mbridge MoE bridge) for a model whose experts are megatron-core's SequentialMLP.

    mbridge names experts as the grouped-GEMM modules do (``mlp.experts.linear_fc1.weight{e}``, one
    parameter per expert on one module); SequentialMLP holds expert e as a module of its own
    (``mlp.experts.local_experts.{e}.linear_fc1.weight``). mbridge reads parameters by their real
    (local) names and converts by the global name it derives from each: here that global name is
    the grouped one, with the expert's number shifted by this expert-parallel rank's first expert.

    mbridge's loader recognises experts by their grouped local names, so it would read these as dense
    tensor-parallel weights, split over the tensor-parallel group: right only while the experts are
    split like the dense layers. The experts are therefore loaded apart, each rank reading its own
    experts' slice over the expert tensor-parallel ranks (whole at ``expert_tensor_parallel_size=1``)."""

    class SequentialExpertsBridge(cls):
        _without_experts = False

        def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True) -> dict[str, str]:
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            first = self.mpu.ep_rank * (self.config.num_moe_experts // self.mpu.ep_size) if consider_ep else 0
            return {local: _grouped_name(name, first) for local, name in names.items()
                    if not (self._without_experts and _SEQUENTIAL.search(local))}

        def load_weights(self, models: list[Any], weights_path: str, memory_efficient: bool = False) -> None:
            self._without_experts = True
            try:
                super().load_weights(models, weights_path, memory_efficient)
            finally:
                self._without_experts = False
            for model in models:
                self._load_local_experts(model)

        def _load_local_experts(self, model: Any) -> None:
            names = {local: name for local, name in self._weight_name_mapping_mcore_local_to_global(model).items()
                     if _SEQUENTIAL.search(local)}
            hf_names = {local: self._weight_name_mapping_mcore_to_hf(name) for local, name in names.items()}
            stored = self.safetensor_io.load_some_hf_weight(sorted({n for ns in hf_names.values() for n in ns}))
            state = model.state_dict()
            with torch.no_grad():
                for local, name in names.items():
                    whole = self._weight_to_mcore_format(name, [stored[n] for n in hf_names[local]])
                    part = self._weight_split_across_tp(name, whole, state[local], self.mpu.etp_size)[self.mpu.etp_rank]
                    state[local].copy_(part)

    SequentialExpertsBridge.__name__ = SequentialExpertsBridge.__qualname__ = f"SequentialExperts{cls.__name__}"
    return SequentialExpertsBridge


def expert_tensor_parallel_bridge(cls: type) -> type:
    """``cls`` (an mbridge MoE bridge) exporting experts split over fewer ranks than the dense layers
    (``expert_tensor_parallel_size`` < TP; whole experts at 1). mbridge gathers an expert over the
    expert groups at EP > 1, but over the tensor-parallel group at EP = 1, and then expects as many
    parts as expert tensor-parallel ranks. megatron-core lays each expert tensor-parallel group out as
    consecutive ranks inside a tensor-parallel one (both innermost in its rank order, ETP dividing TP),
    so the TP parts are the ETP parts TP / ETP times over: the first ETP of them are the expert."""

    class ExpertTensorParallelBridge(cls):
        def _weight_merge_across_tp(self, name: str, weights: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
            if ".mlp.experts.linear_fc" in name:
                weights = weights[:self.mpu.etp_size]
            return super()._weight_merge_across_tp(name, weights, param)

    name = f"ExpertTensorParallel{cls.__name__}"
    ExpertTensorParallelBridge.__name__ = ExpertTensorParallelBridge.__qualname__ = name
    return ExpertTensorParallelBridge


def _grouped_name(name: str, first_expert: int) -> str:
    """A SequentialMLP expert's parameter name in mbridge's spelling, its expert number + ``first_expert``."""
    return _SEQUENTIAL.sub(lambda m: f".mlp.experts.{m[2]}.weight{int(m[1]) + first_expert}", name)
