"""The planner's half of the trainer's start-up check (``trainer.plan_check``, ``trainer/plan_check.py``):
the hardware this process sees, and the message of a run that does not fit it."""

from __future__ import annotations

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

