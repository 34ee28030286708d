"""Benchmark runner: rlfoundry through its real entry point (``rlfoundry.trainer.main_ppo.main``).

The workload becomes verl-style overrides (``overrides(w, prepared, run_dir)``; print them with
``python -m benchmarks.rlfoundry_grpo --print-overrides`` to rerun by hand as
``python -m rlfoundry.trainer.main_ppo <overrides>``). One step = one mini-batch of P prompts × n
samples = one optimiser step. Micro-batches: rows of similar response length within a token budget
(``TOKEN_BUDGET``, padding counted); the other frameworks run the whole batch at once.

Timing: ``PPOTrainer.train_step`` is wrapped in this process only, to stamp the wall clock at
the start and end of every step (the trainer's own ``timing_s/*`` phase times are recorded too).
The step-to-step interval the benchmark reports therefore also includes what ``fit()`` does
between steps (logging, data loading).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


# Tokens (padding included) per update micro-batch: with length-sorted micro-batches this caps
# activation memory and lets short responses skip the padding of long ones.
TOKEN_BUDGET = 2048


def overrides(w, prepared, run_dir: Path) -> list[str]:
    """The workload as ``key=value`` overrides of the trainer's defaults (``rlfoundry/config/schema.py``)."""
    rows = w.samples_per_step // w.rlfoundry_workers  # micro-batch = a rank's whole share
    return [*verl_keys(w, prepared, run_dir, rows), *(speed_keys(w) if w.rlfoundry_keys == "tuned" else []),
            *w.rlfoundry_overrides]


def verl_keys(w, prepared, run_dir: Path, rows: int) -> list[str]:
    """What a verl user writes for this workload; rlfoundry's defaults decide the rest."""
    return [
        f"data.train_files={prepared.train_file}",
        f"data.train_batch_size={w.prompts_per_step}",
        f"data.max_prompt_length={w.max_prompt_length}",
        f"data.max_response_length={w.max_response_length}",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={prepared.model_dir}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={w.prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.optim.lr={w.lr}",
        f"actor_rollout_ref.actor.optim.weight_decay={w.weight_decay}",
        "actor_rollout_ref.actor.optim.warmup_style=constant",
        f"actor_rollout_ref.actor.clip_ratio={w.clip_ratio}",
        f"actor_rollout_ref.actor.clip_ratio_low={w.clip_ratio}",
        f"actor_rollout_ref.actor.clip_ratio_high={w.clip_ratio}",
        f"actor_rollout_ref.actor.grad_clip={w.grad_clip}",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        f"actor_rollout_ref.rollout.n={w.n}",
        f"actor_rollout_ref.rollout.temperature={w.temperature}",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows}",
        f"actor_rollout_ref.rollout.seed={w.seed}",
        # keep the sampler's log-probs in the batch, so the trainer logs how far its own differ
        # (training/rollout_log_probs_diff_*: the benchmark's mismatch column)
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"trainer.total_training_steps={w.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.device={w.device}",  # cuda: FSDP2 computes in bf16 over the fp32 weights (its default)
        "trainer.logger=[file]",
        f"trainer.seed={w.seed}",
        f"trainer.n_gpus_per_node={w.rlfoundry_workers}",
        f"trainer.run_dir={run_dir}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
    ]


def speed_keys(w) -> list[str]:
    """rlfoundry-specific speed settings (same math)."""
    return [
        f"trainer.worker_backend={w.rlfoundry_backend}",
        # speed settings (same math): the sampler's log-probs are pi_old (one epoch, on-policy),
        # each rank holds the whole 0.66 M-parameter model (fsdp_size=1: plain data parallelism,
        # no gathers, gradients all-reduced once per update), and micro-batches hold rows of
        # similar response length within a token budget (padding counted)
        "actor_rollout_ref.actor.use_rollout_log_probs=true",
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max(TOKEN_BUDGET, w.max_prompt_length + w.max_response_length)}",
    ]


def logprob_diff(metrics: dict) -> dict[str, float] | None:
    """The step's rollout-vs-trainer |Δ log p| (max, mean): the trainer's rescoring of the rollout's
    tokens where it ran one (``training/rollout_log_probs_diff_*``); else (``use_rollout_log_probs``,
    on by default here) the update's first forward against the rollout's log-probs
    (``actor/log_ratio_abs_*``: one mini-batch and one epoch per step, so before any optimiser step)."""
    for prefix in ("training/rollout_log_probs_diff", "actor/log_ratio_abs"):
        if f"{prefix}_max" in metrics and f"{prefix}_mean" in metrics:
            return {"max": float(metrics[f"{prefix}_max"]), "mean": float(metrics[f"{prefix}_mean"])}
    return None


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    show = "--print-overrides" in argv
    argv = [a for a in argv if a != "--print-overrides"]

    from benchmarks.common import StepClock, runner_args

    w, prepared, out, args = runner_args(argv, "rlfoundry runner")
    run_dir = Path(args.work_dir) / "rlfoundry-run"
    cli = overrides(w, prepared, run_dir)
    if show:
        print("python -m rlfoundry.trainer.main_ppo \\\n    " + " \\\n    ".join(cli))
        return

    from rlfoundry.trainer import main_ppo
    from rlfoundry.trainer.ppo.ray_trainer import PPOTrainer

    clock = StepClock("rlfoundry")
    untimed = PPOTrainer.train_step

    def timed_train_step(self, *args, **kwargs):
        clock.step_begin()
        metrics = untimed(self, *args, **kwargs)
        samples = w.samples_per_step
        phases = {k.split("/", 1)[1]: float(v) for k, v in metrics.items() if k.startswith("timing_s/")}
        clock.step_end(round(float(metrics["response_length/mean"]) * samples), samples,
                       float(metrics["critic/score/mean"]), phases, logprob_diff(metrics))
        return metrics

    PPOTrainer.train_step = timed_train_step
    code = main_ppo.main(cli)
    if code != 0:
        raise SystemExit(code)
    clock.info = {"overrides": cli}
    if w.device == "cuda":  # rank 0 runs in this process (local and process back ends)
        import torch

        clock.info["cuda_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        clock.info["cuda_device_name"] = torch.cuda.get_device_name()
    clock.save(out)


if __name__ == "__main__":
    main()
