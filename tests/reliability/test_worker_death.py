"""A Ray worker process dies, or hangs, in the middle of a real Ray-backed run of the CLI.

``python -m rlfoundry.trainer.main_ppo trainer.worker_backend=ray``; the fault hook SIGKILLs (or
stalls) the worker inside its actor update (the environment reaches Ray's worker processes). The
driver must name the role, the rank and the cause, and exit non-zero within a bounded time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlfoundry.utils.errors import EXIT_RUN_ABORTED
from tests.reliability._harness import overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOUND_S = 150  # Ray start-up + model load + one step on 2 busy cores, with room to spare


def _cli(argv: list[str], fault: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "RLFOUNDRY_FAULT_INJECT": fault}
    env.pop("RLFOUNDRY_DEBUG", None)
    env.pop("RAY_ADDRESS", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rlfoundry.trainer.main_ppo", *argv], capture_output=True,
                          text=True, env=env, timeout=BOUND_S)
    return proc, time.monotonic() - start


def _ray_argv(model, run_dir, reward_file, *extra):
    return overrides(model, run_dir, reward_file, 2, "trainer.worker_backend=ray", "trainer.n_gpus_per_node=1",
                     "ray_init.num_cpus=2", "trainer.save_freq=-1", *extra)


def test_killed_ray_worker_is_reported_with_role_rank_and_cause(tiny_model_dir, reward_file, tmp_path):
    proc, elapsed = _cli(_ray_argv(tiny_model_dir, tmp_path / "run", reward_file), fault="update_actor@1")
    assert proc.returncode == EXIT_RUN_ABORTED, proc.stderr[-3000:]
    err = proc.stderr
    # role (the colocated group's actor_rollout view), rank, method, and Ray's cause
    assert ("WorkerDiedError: worker group 'global_pool/actor_rollout' rank 0 died while running "
            "'actor_rollout_update_actor': ActorDiedError") in err
    assert "worker process has died" in err
    assert "Traceback" not in err.split("rlfoundry: WorkerDiedError")[-1]
    assert elapsed < BOUND_S


def test_hung_ray_worker_hits_the_call_timeout(tiny_model_dir, reward_file, tmp_path):
    proc, elapsed = _cli(_ray_argv(tiny_model_dir, tmp_path / "run", reward_file, "trainer.worker_call_timeout_s=15"),
                         fault="update_actor@1:hang")
    assert proc.returncode == EXIT_RUN_ABORTED, proc.stderr[-3000:]
    assert ("WorkerCallTimeout: worker group 'global_pool/actor_rollout' ranks [0] did not finish "
            "'actor_rollout_update_actor' within 15 s") in proc.stderr
    assert elapsed < BOUND_S
