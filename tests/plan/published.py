"""The published plans of docs/plan.md: ``python -m tests.plan.published`` prints its table.

One recipe for every model (GRPO with a KL loss, verl's FSDP2 recipe settings), the models'
config.json figures from tests/plan/configs.py, H100 80GB, 8 GPUs a node.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.plan.configs import QWEN3_30B_A3B, QWEN3_235B_A22B, QWEN25_7B, QWEN25_32B, QWEN25_72B, write_config

RECIPE = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=256",
          "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=1024", "data.max_response_length=2048",
          "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
          "actor_rollout_ref.ref.fsdp_config.param_offload=true", "actor_rollout_ref.rollout.name=vllm",
          "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "trainer.n_gpus_per_node=8"]
# (name, config, rollout tp, [GPU counts], extra overrides)
MODELS = [
    ("Qwen2.5-7B", QWEN25_7B, 2, [8], []),
    ("Qwen2.5-32B", QWEN25_32B, 4, [8, 16], []),
    ("Qwen2.5-72B", QWEN25_72B, 8, [16, 32, 64], []),
    ("Qwen2.5-72B + offload", QWEN25_72B, 8, [16, 32],
     ["actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]),
    ("Qwen3-30B-A3B", QWEN3_30B_A3B, 4, [8, 16], []),
    ("Qwen3-235B-A22B", QWEN3_235B_A22B, 16, [32, 64, 128], []),
    ("Qwen3-235B-A22B + offload", QWEN3_235B_A22B, 16, [32],
     ["actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]),
]


def rows(work: Path, with_fixes: bool = True) -> list[str]:
    from rlfoundry.plan_cli import plan_args
    from rlfoundry.plan.hardware import GIB, resolve_hardware
    from rlfoundry.plan.report import find_fixes
    from rlfoundry.trainer.config import load_config

    hw, out = resolve_hardware("h100-80g"), []
    for name, cfg, tp, gpus, extra in MODELS:
        path = write_config(work / name.split()[0], cfg)
        for n in gpus:
            args = [*RECIPE, f"actor_rollout_ref.model.path={path}", f"trainer.nnodes={n // 8}",
                    f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}", *extra]
            plan = plan_args(args, hw)
            pool, phase = plan.worst
            t = plan.times
            verdict = "fits" if plan.fits else ("does not start" if plan.problems else "**no**")
            fix = ""
            if not plan.fits and with_fixes:
                fixes = find_fixes(load_config(args), lambda o, a=args: _try(plan_args, [*a, *o], hw))
                fix = "; ".join(" ".join(f"`{o.removeprefix('actor_rollout_ref.')}`" for o in f.overrides) for f in fixes[:2]) or "none found"
            out.append(f"| {name} | {n} | {phase.total / GIB:.1f} ({phase.name}) | {verdict} | {t['gen']:.0f} | "
                       f"{t['update_actor']:.0f} | {t['step']:.0f} | {fix} |")
    return out


def _try(fn, args, hw):
    from rlfoundry.plan.model import PlanInputError
    from rlfoundry.trainer.config import ConfigError

    try:
        return fn(args, hw)
    except (ConfigError, PlanInputError, ValueError):
        return None


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print("| model | H100s | peak GiB/rank (phase) | verdict | gen s | update s | step s | fix (re-planned) |")
        print("|---|---|---|---|---|---|---|---|")
        for row in rows(Path(tmp), with_fixes="--no-fixes" not in sys.argv):
            print(row, flush=True)
