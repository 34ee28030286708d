"""The trainer's start-up check (``trainer.plan_check``, on by default): plan the run against the
devices this process sees, before any weight file is opened, and stop a run that cannot fit.

It reads only the model's ``config.json``: a directory holding a 72B model's config alone is refused
here, with the per-rank breakdown, rather than later for lacking weights. The planning itself is
``rlfoundry.plan``'s (a function of the resolved config); resolving the config is the trainer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfoundry.config.roles import use_critic
from rlfoundry.config.typed import ConfigError
from rlfoundry.plan.build import plan_config
from rlfoundry.plan.model import PlanInputError
from rlfoundry.plan.startup import refusal, visible_hardware
from rlfoundry.trainer.config import resolve_asset_path, resolve_config

__all__ = ["check_plan_fits", "has_model_config"]


def has_model_config(path: str | None) -> bool:
    """``path`` (an ``rlfoundry://`` asset or a directory) holds a ``config.json``."""
    resolved = resolve_asset_path(path) if path else None
    return bool(resolved) and (Path(resolved).expanduser() / "config.json").is_file()


def check_plan_fits(cfg: Any) -> None:
    """Raise ``ConfigError`` when the run's per-rank peak exceeds the visible device memory. Skipped with
    ``trainer.plan_check=false``, or where a model directory has no config.json (the path check
    reports that)."""
    if not cfg.trainer.plan_check or not has_model_config(cfg.actor_rollout_ref.model.path):
        return
    if use_critic(cfg) and cfg.critic.model.path and not has_model_config(cfg.critic.model.path):
        return
    import torch

    cuda = torch.cuda.is_available()
    resolved = resolve_config(cfg, steps_per_epoch=1, cuda_available=cuda)
    try:
        plan = plan_config(resolved, visible_hardware(resolved.trainer.device))
    except PlanInputError:
        return  # a config.json the planner cannot read: the model loader's own errors say more
    if not plan.fits:
        raise ConfigError(refusal(plan))
