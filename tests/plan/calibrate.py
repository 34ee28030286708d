"""Predicted vs measured peak memory of real training runs on the CPU (docs/plan.md, "Calibration").

What is measured: the process's peak anonymous resident memory (``anon_bytes``) over a whole run of
``rlfoundry train`` (two steps, so the optimizer's moments exist during the second update), in a
fresh process. A run's peak also holds what no plan line counts (Python, torch, the tokenizer, the
data), so each run is measured beside the same command on a 64-wide model whose state is a few
megabytes: measured = peak(model) − peak(64-wide); predicted = plan(model) − plan(64-wide). The
difference cancels the process overhead; what remains is the state the plan predicts.

    python -m tests.plan.calibrate [name ...]     # prints the table docs/plan.md shows
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# one run's command line beside the model path: 2 steps of GRPO on the arithmetic task, one rank
RUN = ["trainer.device=cpu", "trainer.worker_backend=local", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
       "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console]",
       "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "data.max_response_length=8",
       "actor_rollout_ref.model.cpu_kernels=off", "trainer.mismatch_audit=false", "trainer.tune_malloc=false",
       # the shared-prompt forward (a prompt's samples share one prompt pass) holds about 0.4 GB more in
       # the update here, which no formula counts yet (docs/plan.md, "Calibration on the CPU")
       "actor_rollout_ref.model.use_shared_prompt=false"]


@dataclass(frozen=True)
class Case:
    name: str
    model: dict  # save_tiny_model's arguments
    overrides: tuple[str, ...] = ()


WIDE = dict(hidden_size=1024, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=2816, vocab_size=16384)
CASES = {
    "dense": Case("dense", WIDE),
    "dense-checkpointing": Case("dense-checkpointing", WIDE, ("actor_rollout_ref.model.enable_gradient_checkpointing=true",)),
    "lora": Case("lora", WIDE, ("actor_rollout_ref.model.lora_rank=16",)),
    "moe": Case("moe", dict(arch="qwen3_moe", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                            intermediate_size=1024, num_experts=16, num_experts_per_tok=2, vocab_size=16384)),
}
BASELINE = Case("baseline", dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=16384))


def anon_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``): what it allocated. File-backed pages are
    left out: the weights load zero-copy from the safetensors mmap, and once the optimizer writes them
    the clean file pages stay mapped beside their private copies (counted twice by the total RSS,
    ``ru_maxrss``), though the kernel drops them under pressure."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def _child(model_dir: str, run_dir: str, overrides: list[str]) -> None:
    """In the fresh process: the run, sampling ``anon_bytes`` every 2 ms on a thread; prints the peak.
    The states persist for whole phases and activations for a whole backward, so the sampling
    sees them (a thread reads /proc while torch's kernels run without the GIL)."""
    import threading

    from rlfoundry.trainer import main_ppo

    peak, done = [anon_bytes()], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], anon_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    main_ppo.run([f"actor_rollout_ref.model.path={model_dir}", f"trainer.run_dir={run_dir}",
                  f"trainer.default_local_dir={run_dir}/ckpt", *RUN, *overrides])
    done.set()
    thread.join()
    print("PEAK", max(peak[0], anon_bytes()), flush=True)


def measured_peak(model_dir: Path, overrides: tuple[str, ...], work: Path) -> int:
    # every block over 64 KiB its own mmap, returned when freed: the resident set is the live set, not
    # glibc's heap with its freed holes (trainer.tune_malloc=false keeps the trainer from changing it)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_TRIM_THRESHOLD_": "0"}
    code = f"from tests.plan.calibrate import _child; _child({str(model_dir)!r}, {str(work / 'run')!r}, {list(overrides)!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).parents[2])
    peaks = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("PEAK ")]
    if out.returncode or not peaks:
        raise RuntimeError(f"the run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return int(peaks[-1])


def planned_peak(model_dir: Path, overrides: tuple[str, ...]) -> int:
    from rlfoundry.plan.build import plan_args
    from rlfoundry.plan.hardware import cpu_hardware

    plan = plan_args([f"actor_rollout_ref.model.path={model_dir}", *RUN, *overrides], cpu_hardware())
    return plan.worst[1].total


def build(case: Case, where: Path) -> Path:
    """The model saved in bf16: loading it into the engine's fp32 (``fsdp_config.model_dtype``) copies
    every weight into anonymous memory. An fp32 file would load zero-copy from the safetensors mmap
    (file-backed pages, outside ``anon_bytes``) until the optimizer's first write copies them."""
    import torch

    from rlfoundry.models.tiny import build_tiny_model, build_tokenizer

    kwargs = dict(case.model)
    tokenizer = build_tokenizer(vocab_size=kwargs.pop("vocab_size", None))
    out = where / case.name
    build_tiny_model(tokenizer, **kwargs).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def calibrate(case: Case, base: tuple[int, int], work: Path) -> dict:
    """{name, predicted, measured, error}: bytes above the 64-wide baseline's (measured, planned)."""
    model = build(case, work)
    measured = measured_peak(model, case.overrides, work) - base[0]
    predicted = planned_peak(model, case.overrides) - base[1]
    return {"name": case.name, "predicted": predicted, "measured": measured, "error": predicted / measured - 1}


def baseline(work: Path) -> tuple[int, int]:
    model = build(BASELINE, work)
    return measured_peak(model, (), work), planned_peak(model, ())


def main(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = baseline(work)
        for name in names or list(CASES):
            row = calibrate(CASES[name], base, work)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
