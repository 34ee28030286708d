"""The FSDP2 engine's plug-in (``strategy=fsdp`` / ``fsdp2``): every rank is a data-parallel rank."""

from __future__ import annotations

from typing import Any

import torch

from rlfoundry.engines.base import EnginePlugin, EngineRequest, TrainingEngine

__all__ = ["PLUGIN"]


class FSDPPlugin(EnginePlugin):
    name = "fsdp"
    supports_lora = True

    def build(self, request: EngineRequest, device: torch.device | str, role: str) -> TrainingEngine:
        from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig

        config = FSDPEngineConfig.for_model(
            request.model, request.fsdp, optim=request.optim, grad_clip=request.grad_clip,
            model_kind=request.model_kind, override_config=dict(request.override_config),
            gradient_checkpointing=request.gradient_checkpointing, use_shared_prompt=request.use_shared_prompt,
            lora=request.lora)
        return FSDPEngine.build(config, device, role=role, prepare=request.prepare)

    def check(self, cfg: Any, roles: list[str], world_size: int) -> list[str]:
        return []


PLUGIN = FSDPPlugin()
