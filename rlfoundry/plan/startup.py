"""The trainer's start-up check (``trainer.plan_check``, on by default): plan the run against the
devices this process sees, before any weight file is opened, and stop a run that cannot fit.

It reads only the model's ``config.json``: a directory holding a 72B model's config alone is refused
here, with the per-rank breakdown, rather than later for lacking weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfoundry.plan.hardware import PRESETS, Hardware, cpu_hardware, host_available_bytes


def visible_hardware(device: str) -> Hardware:
    """The device the run will use: the smallest visible CUDA device's total memory (bandwidth and
    FLOP/s figures of an H100 for the times, which the check does not judge), or the host's memory
    available now on the CPU."""
    if device != "cuda":
        return cpu_hardware(host_available_bytes())
    import dataclasses

    import torch

    smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return dataclasses.replace(PRESETS["h100-80g"], name=torch.cuda.get_device_name(0), memory_bytes=int(smallest))


def _has_config(path: str | None) -> bool:
    from rlfoundry.trainer.config import resolve_asset_path

    resolved = resolve_asset_path(path) if path else None
    return bool(resolved) and (Path(resolved).expanduser() / "config.json").is_file()


def refusal(plan: Any) -> str:
    """The message of a run that does not fit: the verdict (rank, phase, by how much), the breakdown,
    and what to change."""
    from rlfoundry.plan.report import breakdown_lines, verdict

    lines = [f"The run does not fit this machine ({plan.hardware.name}, {plan.capacity_bytes / 1024**3:.1f} GiB "
             f"per rank): {verdict(plan)}"]
    lines += [f"  problem: {p}" for p in plan.problems] + breakdown_lines(plan)
    offload = ("" if plan.hardware.device != "cuda" else
               "actor_rollout_ref.actor.fsdp_config.param_offload=true / optimizer_offload=true, ")
    lines.append("To fit: actor_rollout_ref.model.enable_gradient_checkpointing=true, a smaller "
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (or ppo_max_token_len_per_gpu), "
                 f"{offload}more ranks (trainer.nnodes, trainer.n_gpus_per_node), or a smaller model; `rlfoundry plan` "
                 "with the same arguments re-plans each change (docs/plan.md). To start anyway: trainer.plan_check=false.")
    return "\n".join(lines)


def check_plan_fits(cfg: Any) -> None:
    """Raise ``ConfigError`` when the run's per-rank peak exceeds the visible device memory. Skipped with
    ``trainer.plan_check=false``, or where a model directory has no config.json (the path check
    reports that)."""
    from rlfoundry.config.typed import ConfigError
    from rlfoundry.plan.build import plan_config
    from rlfoundry.plan.model import PlanInputError
    from rlfoundry.trainer.config import resolve_config, use_critic

    if not cfg.trainer.plan_check or not _has_config(cfg.actor_rollout_ref.model.path):
        return
    if use_critic(cfg) and cfg.critic.model.path and not _has_config(cfg.critic.model.path):
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
