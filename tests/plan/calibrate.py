"""Predicted vs measured peak memory of real training runs on the CPU (docs/plan.md, "Calibration").

What is measured: each rank process's peak anonymous resident memory (``anon_bytes``) over a whole run
of ``rlfoundry train`` (two steps, so the optimizer's moments exist during the second update), in a
fresh process. A run's peak also holds what no plan line counts (Python, torch, the tokenizer, the
data), so each run is measured beside the same command (the same layout: ranks, engine) on a 64-wide
model of the same family whose state is a few megabytes: measured = peak(model) − peak(64-wide), rank
by rank; predicted = plan(model) − plan(64-wide). The difference cancels the process overhead; what
remains is the state the plan predicts.

Several ranks (``trainer.worker_backend=process``): rank 0 runs in the driver process and the others in
forked children (rlfoundry/single_controller/process.py), so each rank is one process and its peak is
that process's; the plan's figure is its worst rank's, compared with the worst measured rank.

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
    model: dict  # build_tiny_model's arguments
    overrides: tuple[str, ...] = ()
    # the process layout, shared with the baseline run: ranks, engine, parallel sizes
    layout: tuple[str, ...] = ()
    config_name: str | None = None
    base_model: dict | None = None  # the baseline's 64-wide model (BASELINE's by default)


MOE = dict(arch="qwen3_moe", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1024,
           num_experts=16, num_experts_per_tok=2, vocab_size=16384)
TWO_RANKS = ("trainer.worker_backend=process", "trainer.n_gpus_per_node=2")
WIDE = dict(hidden_size=1024, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=2816, vocab_size=16384)
# the LM head's and the activations' terms measured: a narrower model (25M parameters, 0.4 GB of state)
# on micro-batches of 8 × (64 + 448) = 4096 tokens, where the (tokens, vocabulary) logits are 0.27 GB a
# tensor and the saved activations 0.6 GB
NARROW = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1408, vocab_size=16384)
LONG = ("data.max_response_length=448", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8")
# packing: padding removed and micro-batches of at most 2048 real tokens; the batch's 8 sequences of
# about 470 real tokens each (3.8k) split into two micro-batches near the budget the plan counts
PACKED = ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048")
# the baselines: 64-wide models of each family, a few megabytes of state
BASELINE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=16384)
MOE_BASELINE = dict(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    num_experts=16, num_experts_per_tok=2, vocab_size=16384)
CASES = {
    "dense": Case("dense", WIDE),
    "dense-checkpointing": Case("dense-checkpointing", WIDE, ("actor_rollout_ref.model.enable_gradient_checkpointing=true",)),
    "lora": Case("lora", WIDE, ("actor_rollout_ref.model.lora_rank=16",)),
    "moe": Case("moe", MOE),
    "long": Case("long", NARROW, LONG),
    "fused-kernels": Case("fused-kernels", NARROW, (*LONG, "actor_rollout_ref.model.use_fused_kernels=true")),
    "packing": Case("packing", NARROW, (*LONG, *PACKED)),
    "fsdp-2-ranks": Case("fsdp-2-ranks", WIDE, layout=TWO_RANKS),
    "megatron-tp2": Case("megatron-tp2", WIDE, config_name="ppo_megatron_trainer",
                         layout=(*TWO_RANKS, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")),
    "megatron-pp2": Case("megatron-pp2", WIDE, config_name="ppo_megatron_trainer",
                         layout=(*TWO_RANKS, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2")),
    "megatron-moe-ep2": Case("megatron-moe-ep2", MOE, config_name="ppo_megatron_trainer", base_model=MOE_BASELINE,
                             layout=(*TWO_RANKS, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2")),
}


def anon_bytes(pid: int | str = "self") -> int:
    """A process's anonymous resident memory (``RssAnon``): what it allocated. File-backed pages are
    left out: the weights load zero-copy from the safetensors mmap, and once the optimizer writes them
    the clean file pages stay mapped beside their private copies (counted twice by the total RSS,
    ``ru_maxrss``), though the kernel drops them under pressure. 0 for a process that has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    raise RuntimeError("no RssAnon in /proc/<pid>/status (Linux only)")


def _cmdline(pid: int | str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def forked_children() -> list[int]:
    """This process's children that carry its command line: forks of it (a helper such as
    multiprocessing's resource tracker runs a command of its own)."""
    me, own = os.getpid(), _cmdline("self")
    children = []
    for task in Path(f"/proc/{me}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return sorted(c for c in set(children) if _cmdline(c) == own)


def _child(model_dir: str, run_dir: str, overrides: list[str], ranks: int) -> None:
    """In the fresh process: the run, sampling every rank's ``anon_bytes`` every 2 ms on a thread; prints
    each rank's peak, rank 0 (this process) first. The other ranks are the first ``ranks − 1`` forks of
    this process: the worker group starts them, in rank order, before anything else forks (a data
    loader's workers, later, are forks too). The states persist for whole phases and activations for a
    whole backward, so the sampling sees them (a thread reads /proc while torch's kernels run without
    the GIL)."""
    import threading

    from rlfoundry.trainer import main_ppo

    peaks: dict[int, int] = {os.getpid(): 0}  # in order of first sight
    done = threading.Event()

    def sample() -> None:
        while True:
            # the children are looked for only until the ranks' forks are all seen (one rank: never): a
            # look reads /proc for every thread of this process, 4x the sample itself, every 2 ms
            if len(peaks) < ranks:
                peaks.update((pid, 0) for pid in forked_children() if pid not in peaks)
            for pid in list(peaks):
                peaks[pid] = max(peaks[pid], anon_bytes(pid))
            if done.wait(0.002):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    main_ppo.run([f"actor_rollout_ref.model.path={model_dir}", f"trainer.run_dir={run_dir}",
                  f"trainer.default_local_dir={run_dir}/ckpt", *RUN, *overrides])
    done.set()
    thread.join()
    peaks[os.getpid()] = max(peaks[os.getpid()], anon_bytes())
    print("PEAK", *list(peaks.values())[:ranks], flush=True)


def _args(case: Case, overrides: tuple[str, ...]) -> list[str]:
    return [*(["--config-name", case.config_name] if case.config_name else []), *case.layout, *overrides]


def measured_peaks(model_dir: Path, args: list[str], work: Path) -> list[int]:
    """Each rank's peak ``anon_bytes``, rank 0 first."""
    # every block over 64 KiB its own mmap, returned when freed: the resident set is the live set, not
    # glibc's heap with its freed holes (trainer.tune_malloc=false keeps the trainer from changing it)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_TRIM_THRESHOLD_": "0"}
    ranks = int([a for a in [*RUN, *args] if a.startswith("trainer.n_gpus_per_node=")][-1].split("=")[1])
    code = f"from tests.plan.calibrate import _child; _child({str(model_dir)!r}, {str(work / 'run')!r}, {args!r}, {ranks})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                         cwd=Path(__file__).parents[2])
    peaks = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("PEAK ")]
    if out.returncode or not peaks:
        raise RuntimeError(f"the run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return [int(p) for p in peaks[-1]]


def planned_peak(model_dir: Path, args: list[str]) -> int:
    """The plan's worst rank, from the same arguments (``--config-name`` included)."""
    from rlfoundry.plan_cli import plan_args
    from rlfoundry.plan.hardware import cpu_hardware

    config_name = args[1] if args[:1] == ["--config-name"] else None
    overrides = args[2:] if config_name else args
    plan = plan_args([f"actor_rollout_ref.model.path={model_dir}", *RUN, *overrides], cpu_hardware(), config_name)
    return plan.worst[1].total


def build(name: str, model: dict, where: Path) -> Path:
    """The model saved in bf16: loading it into the engine's fp32 (``fsdp_config.model_dtype``) copies
    every weight into anonymous memory. An fp32 file would load zero-copy from the safetensors mmap
    (file-backed pages, outside ``anon_bytes``) until the optimizer's first write copies them."""
    import torch

    from rlfoundry.models.tiny import build_tiny_model, build_tokenizer

    kwargs = dict(model)
    tokenizer = build_tokenizer(vocab_size=kwargs.pop("vocab_size", None))
    out = where / name
    if not (out / "config.json").is_file():
        build_tiny_model(tokenizer, **kwargs).to(torch.bfloat16).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def baseline(case: Case, work: Path) -> tuple[list[int], int]:
    """(each rank's measured peak, the planned peak) of the case's layout on its family's 64-wide model."""
    base = case.base_model or BASELINE
    model = build("baseline-" + ("moe" if base is MOE_BASELINE else "dense"), base, work)
    args = _args(case, ())
    return measured_peaks(model, args, work), planned_peak(model, args)


def baseline_key(case: Case) -> tuple:
    """Cases with the same key share one baseline run."""
    return case.config_name, case.layout, json.dumps(case.base_model or BASELINE, sort_keys=True)


def calibrate(case: Case, base: tuple[list[int], int], work: Path) -> dict:
    """{name, predicted, measured, error, ranks}: bytes above the 64-wide baseline's, the worst rank's
    (``ranks``: each rank's measured bytes above its baseline rank's)."""
    model = build(case.name, case.model, work)
    args = _args(case, case.overrides)
    ranks = [p - b for p, b in zip(measured_peaks(model, args, work), base[0], strict=True)]
    measured = max(ranks)
    predicted = planned_peak(model, args) - base[1]
    return {"name": case.name, "predicted": predicted, "measured": measured, "error": predicted / measured - 1,
            "ranks": ranks}


def main(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work, bases = Path(tmp), {}
        for name in names or list(CASES):
            case = CASES[name]
            key = baseline_key(case)
            if key not in bases:
                bases[key] = baseline(case, work)
            print(json.dumps(calibrate(case, bases[key], work)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
