"""The Megatron-core engine's plug-in (``strategy=megatron``): the ranks of one tensor × pipeline ×
context group compute on the same rows, so a role has world / (that product) data-parallel ranks.
Its start-up checks say what the engine does not do yet."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch
from omegaconf import OmegaConf

from rlfoundry.config.schema import MEGATRON_INSTALL, model_parallel_size
from rlfoundry.config.typed import pick
from rlfoundry.engines.base import EnginePlugin, EngineRequest, TrainingEngine
from rlfoundry.engines.fsdp.fused_head import check_fused_kernels
from rlfoundry.engines.megatron import megatron_fsdp, moe

__all__ = ["PLUGIN"]

# the roles whose engine builds the model's MTP layers (model.mtp): the PPO actor and SFT's model
_MTP_ROLES = ("actor", "sft")
_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
           "context_parallel_size")


class MegatronPlugin(EnginePlugin):
    name = "megatron"
    supports_lora = True  # the actor's and the critic's (lora.py; the critic's value head trains in full)
    supports_routing_replay = True  # megatron-core's RouterReplay (routing.py); what it cannot run with: check
    supports_mtp = True  # mtp.py
    dtype_key = "megatron.dtype"
    layout_key = "megatron"

    def build(self, request: EngineRequest, device: torch.device | str, role: str) -> TrainingEngine:
        from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

        # a critic's value head starts at zero unless the directory has one (the bridge builds it so)
        config = MegatronEngineConfig(str(request.model.path), request.megatron, request.optim, request.grad_clip,
                                      model_kind=request.model_kind,
                                      use_fused_kernels=bool(getattr(request.model, "use_fused_kernels", False)),
                                      fused_kernel_options=dict(getattr(request.model, "fused_kernel_options", None) or {}),
                                      lora=request.lora,
                                      # the actor's and SFT's MTP layers (mtp.py); the reference and the critic
                                      # build without
                                      mtp=getattr(request.model, "mtp", None) if role in _MTP_ROLES else None)
        return MegatronEngine(config, device, role=role)

    def data_parallel_rank(self, role: Any, rank: int, world_size: int) -> tuple[int, int]:
        """megatron-core's groups, joined now (``build`` finds them set up): its rank order is its own."""
        from megatron.core import parallel_state as ps

        from rlfoundry.engines.megatron.bridge import initialize_parallel

        m = role.megatron
        initialize_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                            m.virtual_pipeline_model_parallel_size, m.context_parallel_size, seed=m.seed,
                            ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size)
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def teardown(self) -> None:
        """megatron-core's groups are subgroups of the default process group: destroyed with it, a later run
        builds its own."""
        if importlib.util.find_spec("megatron") is not None:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()

    def data_parallel_size(self, world_size: int, megatron: Any, sequence_parallel: int = 1) -> int:
        return max(1, world_size // model_parallel_size(megatron))

    def optimizer_fields(self) -> tuple[set[str], str]:
        """megatron-core's OptimizerConfig fields (none where megatron-core is missing: ``check`` reports that)."""
        what = "megatron-core OptimizerConfig fields"
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return set(), what
        import dataclasses

        from megatron.core.optimizer import OptimizerConfig

        return {f.name for f in dataclasses.fields(OptimizerConfig)}, what

    def optimizer_problems(self, key: str, overrides: dict, role: Any = None) -> list[str]:
        """megatron-core's precision-aware optimiser and its CPU optimiser (``optimizer_cpu_offload``:
        HybridDeviceOptimizer, built on any device: cpu_compat.py), as megatron-core and Megatron-LM
        accept them, and what megatron-core 0.16 cannot build or load back here."""
        return _optimizer_offload_problems(key, overrides, role)

    def sequence_split(self, role: Any) -> tuple[int, str]:
        return int(role.megatron.context_parallel_size), "megatron.context_parallel_size"  # CP splits sequences

    def model_copy(self, role: Any) -> tuple[int, str]:
        return model_parallel_size(role.megatron), "megatron.tensor x pipeline x context_parallel_size"

    def adopt(self, cfg: Any, roles: list[str], user_keys: list[str]) -> None:
        """A frozen reference runs in the actor's layout, as verl runs it (the first role to start sets
        megatron-core's one layout per process; verl's engine skips its own initialisation then): the
        layout changes its log-probs by rounding only. One the user gave otherwise is warned about. A
        trained critic keeps the error in ``check`` (its checkpoint records its layout)."""
        ref, actor = "actor_rollout_ref.ref", "actor_rollout_ref.actor"
        if ref not in roles or actor not in roles:
            return
        differ = [n for n in _LAYOUT if pick(cfg, f"{ref}.megatron.{n}") != pick(cfg, f"{actor}.megatron.{n}")]
        told = [n for n in differ if f"{ref}.megatron.{n}" in user_keys]
        given = ", ".join(f"{n}={pick(cfg, f'{ref}.megatron.{n}')}" for n in told)
        mine = ", ".join(f"{n}={pick(cfg, f'{actor}.megatron.{n}')}" for n in told)
        for n in differ:
            OmegaConf.update(cfg, f"{ref}.megatron.{n}", f"${{{actor}.megatron.{n}}}")
        if not told:
            return
        warnings.warn(f"{ref}.megatron: {given} differs from {actor}.megatron ({mine}); the reference runs in the "
                      "actor's layout, as in verl: every role shares the processes and megatron-core has one parallel "
                      "layout per process (its log-probs change by rounding only).", stacklevel=2)

    def check(self, cfg: Any, roles: list[str], world_size: int) -> list[str]:
        errors: list[str] = []
        if any(importlib.util.find_spec(m) is None for m in ("megatron", "mbridge")):
            errors.append(f"strategy=megatron needs megatron-core and mbridge: {MEGATRON_INSTALL}")
        sizes = {k: tuple(pick(cfg, f"{k}.megatron.{n}") for n in _LAYOUT) for k in roles}
        for key in roles[1:]:
            if sizes[key] != sizes[roles[0]]:
                errors.append(f"{key}.megatron: every role runs in the same processes, and megatron-core has one "
                              f"parallel layout per process; set its {', '.join(_LAYOUT)} as {roles[0]}'s "
                              f"({sizes[roles[0]]}).")
        for key in roles:
            errors += _check_role(key, pick(cfg, f"{key}.megatron"), world_size, _model_path(cfg, key))
            if pick(cfg, f"{key}.megatron.use_megatron_fsdp", False):
                owner = "actor_rollout_ref" if key.startswith("actor_rollout_ref.") else key
                lora = key != "actor_rollout_ref.ref" and int(pick(cfg, f"{owner}.model.lora_rank", 0) or 0) > 0
                cpu_optimizer = bool(pick(cfg, f"{key}.optim.override_optimizer_config.optimizer_cpu_offload", False))
                errors += megatron_fsdp.combination_problems(key, lora, cpu_optimizer)
                sync = int(pick(cfg, "async_training.trigger_parameter_sync_step", 1) or 1)
                if key == "actor_rollout_ref.actor" and sync > 1:
                    errors.append(f"{key}.megatron.use_megatron_fsdp=true with async_training.trigger_parameter_sync_step"
                                  f"={sync}: the proximal log-probs' copy of the sync period's first weights "
                                  "(compute_prox_log_prob) is not built over Megatron-FSDP's shards; set "
                                  "use_megatron_fsdp=false or trigger_parameter_sync_step=1.")
            if int(pick(cfg, f"{key}.ulysses_sequence_parallel_size", 1) or 1) > 1:
                errors.append(f"{key}.ulysses_sequence_parallel_size > 1: Ulysses is the FSDP engine's sequence "
                              "parallelism; with strategy=megatron set it to 1 and split sequences with "
                              f"{key}.megatron.context_parallel_size.")
        if _is_vision_language(((cfg.get("actor_rollout_ref") or {}).get("model") or {}).get("path")):
            errors.append("actor_rollout_ref.model.path is a vision-language model: the Megatron engine takes text "
                          "models only (docs/vision.md); use strategy=fsdp for image prompts.")
        errors += _check_lora(cfg, roles)
        policy = any(k.startswith("actor_rollout_ref.") for k in roles)
        if "actor_rollout_ref.actor" in roles and pick(cfg, "actor_rollout_ref.actor.router_replay.mode", "disabled") != "disabled":
            errors += moe.replay_problems("actor_rollout_ref.actor.megatron", pick(cfg, "actor_rollout_ref.actor.megatron"))
        if "actor_rollout_ref.actor" in roles and pick(cfg, "actor_rollout_ref.model.mtp.enable", False):
            errors += _check_mtp(cfg)
        if policy and pick(cfg, "actor_rollout_ref.model.use_fused_kernels", False):
            errors += check_fused_kernels(pick(cfg, "actor_rollout_ref.model.fused_kernel_options", None),
                                          "actor_rollout_ref.model")
        return errors


def _check_mtp(cfg: Any) -> list[str]:
    """model.mtp.enable: a model with MTP layers this engine builds, in a layout it trains them in (mtp.py)."""
    from rlfoundry.engines.megatron import mtp

    key = "actor_rollout_ref.model"
    if int(pick(cfg, f"{key}.lora_rank", 0) or 0) > 0:
        return [f"{key}.mtp.enable=true with {key}.lora_rank > 0 on the Megatron engine: MTP layers beside LoRA "
                "adapters are not built (which of them would train, and the adapters' export, are undecided); "
                "set mtp.enable=false or lora_rank=0."]
    try:
        from rlfoundry.models import mimo  # noqa: F401  (model_type "mimo" for AutoConfig)

        hf_config = _local_hf_config(pick(cfg, f"{key}.path"))
    except (OSError, ValueError):  # the model's own checks say what is wrong with the path
        return []
    if hf_config is None:
        return []
    return mtp.layout_problems(key, pick(cfg, f"{key}.mtp"), hf_config, pick(cfg, "actor_rollout_ref.actor.megatron"))


def _optimizer_offload_problems(key: str, overrides: dict, role: Any = None) -> list[str]:
    """``override_optimizer_config``'s precision-aware and CPU-offload keys (``key``: its own key; ``role``:
    the role's subtree, for its ``megatron`` keys)."""
    errors = []
    owner = key.rsplit(".optim.", 1)[0]  # the role's key: actor_rollout_ref.actor, critic
    offload, aware = bool(overrides.get("optimizer_cpu_offload")), bool(overrides.get("use_precision_aware_optimizer"))
    fraction = overrides.get("optimizer_offload_fraction")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1):
        errors.append(f"{key}.optimizer_offload_fraction={fraction}: the share of the optimizer's parameters whose Adam "
                      "step megatron-core's HybridDeviceOptimizer runs on the host, a number in [0, 1].")
    if aware and not offload and importlib.util.find_spec("transformer_engine") is None:
        errors.append(f"{key}.use_precision_aware_optimizer=true needs TransformerEngine's FusedAdam "
                      "(pip install transformer_engine[pytorch], CUDA); remove it, or install it (with "
                      "optimizer_cpu_offload=True megatron-core's HybridDeviceOptimizer takes its place and needs none).")
    megatron = getattr(role, "megatron", None)
    if aware and megatron is not None and not megatron.use_distributed_optimizer:
        errors.append(f"{key}.use_precision_aware_optimizer=true needs {owner}.megatron.use_distributed_optimizer=True "
                      "(megatron-core builds it inside its distributed optimizer only).")
    if not offload:
        return errors
    if not aware:
        errors.append(f"{key}.optimizer_cpu_offload=True needs {key}.use_precision_aware_optimizer=True, as Megatron-LM "
                      "requires (its HybridDeviceOptimizer keeps the fp32 master weights on that path; without it "
                      "megatron-core 0.16 cannot load the optimizer back from a checkpoint); set both, as verl's scripts do.")
    if overrides.get("decoupled_weight_decay") is False:
        errors.append(f"{key}.decoupled_weight_decay=False with optimizer_cpu_offload=True: megatron-core's CPU optimizer "
                      "is AdamW (decoupled weight decay) only; remove decoupled_weight_decay.")
    if megatron is not None and str(megatron.dtype) in ("float32", "fp32"):
        errors.append(f"{key}.optimizer_cpu_offload=True with {owner}.megatron.dtype={megatron.dtype}: megatron-core builds "
                      "its HybridDeviceOptimizer over the distributed optimizer's shards of the weights, which for fp32 "
                      "weights are views, not leaves, and torch.optim refuses them; train in bfloat16, or drop the offload.")
    return errors


def _check_lora(cfg: Any, roles: list[str]) -> list[str]:
    """LoRA on this engine: the actor's and the critic's, on the attention and MLP projections (lora.py)."""
    from rlfoundry.engines.megatron.lora import hf_targets

    owners = {"actor_rollout_ref.actor": "actor_rollout_ref", "critic": "critic"}
    errors = []
    for owner in (owners[r] for r in roles if r in owners):
        model = pick(cfg, f"{owner}.model")
        if int(model.lora_rank or 0) <= 0:
            continue
        if getattr(model, "exclude_modules", None):
            errors.append(f"{owner}.model.exclude_modules with strategy=megatron: not built; name the modules to "
                          "adapt in model.target_modules instead.")
        try:
            hf_targets(model.target_modules)
        except ValueError as e:
            errors.append(f"{owner}.{e}")
    return errors


def _is_vision_language(path: Any) -> bool:
    """A local HF directory whose config.json has a vision tower (None: nothing to read here)."""
    import json

    from rlfoundry.models.hf import resolve_model_path

    config = resolve_model_path(path) / "config.json" if path else None
    return bool(config and config.is_file() and "vision_config" in json.loads(config.read_text()))


def _model_path(cfg: Any, key: str) -> Any:
    """The model directory of a role's key (the actor's and the ref's: actor_rollout_ref.model.path)."""
    owner = "actor_rollout_ref" if key.startswith("actor_rollout_ref.") else key
    return pick(cfg, f"{owner}.model.path", None)


def _check_role(key: str, m: Any, world_size: int, model_path: Any = None) -> list[str]:
    if m.context_parallel_size < 1:
        return [f"{key}.megatron.context_parallel_size={m.context_parallel_size}: must be 1 or more."]
    errors = []
    if world_size % model_parallel_size(m):
        errors.append(f"{key}.megatron: tensor × pipeline × context parallel = {model_parallel_size(m)} does not divide "
                      f"the {world_size} ranks (trainer.nnodes × trainer.n_gpus_per_node).")
    if not m.use_mbridge:
        errors.append(f"{key}.megatron.use_mbridge=False: mbridge is the only HF <-> Megatron converter here; "
                      "set it to True (the default).")
    errors += megatron_fsdp.problems(key, m, world_size)  # offload beside it (LoRA and the CPU optimiser: check())
    errors += _check_dist_checkpoint(key, m)
    return errors + _check_experts(key, m, world_size, model_path)


def _check_experts(key: str, m: Any, world_size: int, model_path: Any) -> list[str]:
    """Expert parallelism: sizes megatron-core can lay out on the ranks (the experts' groups span
    expert tensor × expert × pipeline ranks); what the model itself allows is checked against its
    config where this machine has it (engines/megatron/moe.py), else when the engine is built."""
    ep, etp = m.expert_model_parallel_size, m.get("expert_tensor_parallel_size")
    if ep < 1 or (etp is not None and etp < 1):
        return [f"{key}.megatron: expert_model_parallel_size={ep} and expert_tensor_parallel_size={etp} must be "
                "1 or more (expert_tensor_parallel_size null: tensor_model_parallel_size)."]
    errors = []
    span = ep * (etp or m.tensor_model_parallel_size) * m.pipeline_model_parallel_size
    if world_size % span:
        errors.append(f"{key}.megatron: expert × expert tensor × pipeline parallel = {span} does not divide the "
                      f"{world_size} ranks (trainer.nnodes × trainer.n_gpus_per_node).")
    hf_config = _local_hf_config(model_path)
    # the reference is frozen (verl's ref has no optimiser): its MoE layers run at TP > 1 without sequence parallelism
    trains = not key.endswith(".ref")
    return errors + ([] if hf_config is None else moe.layout_problems(f"{key}.megatron", hf_config, m, on_cpu=None,
                                                                      trains=trains))


def _local_hf_config(path: Any) -> Any:
    """The HF config of a local model directory (None: none here to read; the engine checks it when built)."""
    from rlfoundry.models.hf import resolve_model_path

    if not path or not (resolve_model_path(path) / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(resolve_model_path(path)))


def _check_dist_checkpoint(key: str, m: Any) -> list[str]:
    """use_dist_checkpointing: a path, and where it exists on this machine, a dist checkpoint (a path
    absent here may be on the workers' nodes: the engine checks it there, and compares the tensors)."""
    from pathlib import Path

    from rlfoundry.engines.megatron.dist_weights import CONVERTER, dist_checkpoint_problem

    path = m.get("dist_checkpointing_path")
    if not m.get("use_dist_checkpointing") or (path and not Path(str(path)).exists()):
        return []
    problem = dist_checkpoint_problem(path)
    if problem is None:
        return []
    return [f"{key}.megatron.use_dist_checkpointing=True loads the initial weights from "
            f"{key}.megatron.dist_checkpointing_path, which {problem}: make one with `{CONVERTER}` and set it, or set "
            "use_dist_checkpointing=False to load model.path's HF weights."]


PLUGIN = MegatronPlugin()
