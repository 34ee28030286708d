"""Run the real trainer entry point in a child process that a fault (or the test) can SIGKILL.

Each run is ``rlfoundry.trainer.main_ppo.main(argv)`` in its own process, forked from a
``multiprocessing`` forkserver that imported torch, transformers and the trainer once: a run then
costs its training time rather than ~5 s of imports (the suite must stay fast on 2 cores). Output
goes to a log file per run; faults come from ``RLFOUNDRY_FAULT_INJECT`` (``rlfoundry/utils/faults.py``).
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfoundry.utils.faults import ENV_VAR

# Imported once by the forkserver (only if this harness starts it; otherwise children import them).
_PRELOAD = ["tests.reliability._warm"]

# Deterministic dense score in [0, 1] (the real arithmetic score is ~0 for an untrained policy, which
# would make every compared metric 0). Appends each scored prompt's dataset index to $ORDER_LOG, so
# tests can check the data order across a crash and a resume.
REWARD_FILE = textwrap.dedent('''
    import os

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        log = os.environ.get("ORDER_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{extra_info['index']}\\n")
        return (sum(ord(c) for c in solution_str) % 11) / 10.0
''')

SIGKILLED = -signal.SIGKILL


@dataclass
class Result:
    exitcode: int | None
    log: str

    @property
    def resumed_from_step(self) -> int | None:
        m = re.search(r"resumed from \S*global_step_(\d+)", self.log)
        return int(m.group(1)) if m else None


def write_reward_file(directory: Path) -> Path:
    path = directory / "dense_reward.py"
    path.write_text(REWARD_FILE)
    return path


def overrides(model: Path, run_dir: Path, reward_file: Path, steps: int, *extra: str) -> list[str]:
    """GRPO, 2 prompts × 2 samples per step, 4-token responses, a checkpoint every step."""
    return [
        f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}",
        "data.synthetic.train_size=16", "data.synthetic.val_size=4", "data.train_batch_size=2",
        "data.max_response_length=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "reward_model.reward_kwargs.num_workers=0", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=1", "trainer.logger=file", f"trainer.total_training_steps={steps}",
        f"custom_reward_function.path={reward_file}", *extra,
    ]


def _child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.pop(ENV_VAR, None)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    from rlfoundry.trainer.main_ppo import main

    code = main(argv)
    # A multiprocessing child ends in os._exit, after joining its non-daemonic children: run the exit
    # hooks a real process runs first (the process back end's rank shutdown), or a run with a pool of
    # child ranks (one-step-off, fully async) would wait for them for ever.
    atexit._run_exitfuncs()
    sys.exit(code)


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect if another test started the forkserver first
    return ctx


def run_trainer(argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                kill_after_s: float | None = None, timeout_s: float = 180) -> Result:
    """Run ``main(argv)`` in a child; SIGKILL it after ``kill_after_s`` if given. Returns exit code and log."""
    base = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = _context().Process(target=_child, args=(list(argv), {**base, **(env or {})}, str(log_path)))
    proc.start()
    proc.join(kill_after_s if kill_after_s is not None else timeout_s)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        if kill_after_s is None:
            raise TimeoutError(f"trainer run did not finish within {timeout_s} s; log:\n{log_path.read_text()[-3000:]}")
    return Result(proc.exitcode, log_path.read_text() if log_path.exists() else "")


def raw_records(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl as written (no de-duplication, unlike read_metrics_jsonl)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def latest_step(run_dir: Path) -> int | None:
    path = run_dir / "latest_checkpointed_iteration.txt"
    return int(path.read_text()) if path.exists() else None


def assert_same_metrics(a: dict, b: dict, what: str = "") -> None:
    """Every algorithm metric of two records of the same step equal (wall-clock ones excluded)."""
    import pytest

    skip = ("timing_s/", "timing_per_token_ms/", "perf/")
    keys = {k for k in a if not k.startswith(skip) and isinstance(a[k], (int, float))}
    assert keys, a
    for key in sorted(keys):
        assert key in b, f"{what}: {key} missing"
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), f"{what}: {key} {a[key]} != {b[key]}"
