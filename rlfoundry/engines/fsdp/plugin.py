"""The FSDP2 engine's plug-in (``strategy=fsdp`` / ``fsdp2``): every rank is a data-parallel rank,
except that under Ulysses sequence parallelism (``*.ulysses_sequence_parallel_size``) each group of
that many ranks shares its rows, so the data-parallel size is the ranks / SP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlfoundry.config.typed import pick
from rlfoundry.engines.base import EnginePlugin, EngineRequest, TrainingEngine
from rlfoundry.engines.fsdp.fused_head import check_fused_kernels

__all__ = ["PLUGIN"]


class FSDPPlugin(EnginePlugin):
    name = "fsdp"
    supports_lora = True
    supports_routing_replay = True
    supports_exact_log_probs = True  # the engine installs models/batch_invariant.py (engine.py)
    supports_vision_language = True  # models/vision.py: the tower and the merged image tokens

    def build(self, request: EngineRequest, device: torch.device | str, role: str) -> TrainingEngine:
        from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig

        config = FSDPEngineConfig.for_model(
            request.model, request.fsdp, optim=request.optim, grad_clip=request.grad_clip,
            model_kind=request.model_kind, override_config=dict(request.override_config),
            gradient_checkpointing=request.gradient_checkpointing, use_shared_prompt=request.use_shared_prompt,
            lora=request.lora, ulysses_sequence_parallel_size=request.ulysses_sequence_parallel_size,
            use_torch_compile=request.use_torch_compile, exact=request.exact)
        return FSDPEngine.build(config, device, role=role, prepare=request.prepare)

    def data_parallel_size(self, world_size: int, megatron: Any, sequence_parallel: int = 1) -> int:
        return max(1, world_size // max(1, int(sequence_parallel or 1)))

    def check(self, cfg: Any, roles: list[str], world_size: int) -> list[str]:
        errors = [e for key in roles
                  for e in _check_ulysses(cfg, key, world_size) + _check_experts(cfg, key, world_size)]
        if int(pick(cfg, "reward_model.ulysses_sequence_parallel_size", 1) or 1) > 1:
            errors.append("reward_model.ulysses_sequence_parallel_size > 1: sequence parallelism for the reward "
                          "model is not built (actor, reference and critic have it); set it to 1.")
        return errors + _check_fused_kernels(cfg, roles)


def _check_ulysses(cfg: Any, key: str, world_size: int) -> list[str]:
    """verl's rules for ``<role>.ulysses_sequence_parallel_size``: it divides the ranks and the model's
    attention heads, and rows are packed (``model.use_remove_padding``)."""
    sp = int(pick(cfg, f"{key}.ulysses_sequence_parallel_size", 1) or 1)
    if sp == 1:
        return []
    model = "critic.model" if key == "critic" else "actor_rollout_ref.model"
    name = f"{key}.ulysses_sequence_parallel_size={sp}"
    errors = []
    if sp < 1 or world_size % sp:
        errors.append(f"{name} does not divide the {world_size} ranks (trainer.nnodes × n_gpus_per_node); use a divisor.")
    if not pick(cfg, f"{model}.use_remove_padding", False):
        errors.append(f"{name} needs {model}.use_remove_padding=true: only packed rows are split by sequence "
                      "(verl's rule too).")
    heads = _attention_heads(pick(cfg, f"{model}.path", None))
    if heads is not None and heads % sp:
        errors.append(f"{name} does not divide the model's {heads} attention heads: each rank of a group "
                      "attends with heads / SP of them; use a divisor of the head count.")
    return errors


def _check_experts(cfg: Any, key: str, world_size: int) -> list[str]:
    """``<role>.fsdp_config.expert_parallel_size``: the layout checks of ``expert_parallel.check_expert_parallel``
    (the experts' count read from the model's config.json where there is one; the engine checks the model again)."""
    from rlfoundry.engines.fsdp.expert_parallel import check_expert_parallel

    model = "critic.model" if key == "critic" else "actor_rollout_ref.model"
    fsdp = f"{model}.fsdp_config" if key == "critic" else f"{key}.fsdp_config"
    size = int(pick(cfg, f"{fsdp}.expert_parallel_size", 1) or 1)
    if size == 1:
        return []
    try:
        check_expert_parallel(size, world=world_size, num_experts=_config_value(pick(cfg, f"{model}.path", None),
                                                                              EXPERT_COUNT_KEYS),
                              lora=int(pick(cfg, f"{model}.lora_rank", 0) or 0) > 0 and key != "actor_rollout_ref.ref",
                              fsdp_size=int(pick(cfg, f"{fsdp}.fsdp_size", -1)), key=f"{fsdp}.expert_parallel_size")
    except ValueError as e:
        return [str(e)]
    return []


# the routed experts per layer in transformers' MoE configs (Qwen2/3-MoE, DeepSeek-V3, Mixtral/GPT-OSS)
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def _check_fused_kernels(cfg: Any, roles: list[str]) -> list[str]:
    """``actor_rollout_ref.model.use_fused_kernels``: a backend it has."""
    model = "actor_rollout_ref.model"
    if not any(k.startswith("actor_rollout_ref.") for k in roles) or not pick(cfg, f"{model}.use_fused_kernels", False):
        return []
    return check_fused_kernels(pick(cfg, f"{model}.fused_kernel_options", None), model)


def _attention_heads(path: Any) -> int | None:
    """``num_attention_heads`` from a local HF directory's config.json (None where there is none to read:
    the engine checks again when it builds the model)."""
    return _config_value(path, ("num_attention_heads",))


def _config_value(path: Any, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` in a local HF directory's config.json (None where there is none to read)."""
    config = Path(str(path)).expanduser() / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    values = json.loads(config.read_text())
    return next((values[k] for k in keys if values.get(k) is not None), None)


PLUGIN = FSDPPlugin()
