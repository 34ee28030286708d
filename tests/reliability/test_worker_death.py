"""A Ray worker process dies, or hangs, in the middle of a real Ray-backed run of the CLI.

``python -m rlfoundry.trainer.main_ppo trainer.worker_backend=ray``; the fault hook SIGKILLs (or
stalls) the worker inside its actor update (the environment reaches Ray's worker processes). The
driver must name the role, the rank and the cause, and exit non-zero within a bounded time *after
the fault* (the fault hook stamps the moment it fires): start-up on a machine busy with other jobs
may take minutes and is not what these tests measure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlfoundry.utils import faults
from rlfoundry.utils.errors import EXIT_RUN_ABORTED
from tests.reliability._harness import overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DETECT_S = 60  # from the fault to the driver's exit: Ray's death notice (or the call timeout) + shutdown
RUN_LIMIT_S = 900  # the whole run, only so that a driver that never notices fails instead of hanging CI


def _cli(argv: list[str], fault: str, stamp) -> tuple[subprocess.CompletedProcess, float]:
    """Run the CLI with ``fault``; returns the process and the seconds from the fault to the exit."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", faults.ENV_VAR: fault,
           faults.STAMP_VAR: str(stamp)}
    env.pop("RLFOUNDRY_DEBUG", None)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "rlfoundry.trainer.main_ppo", *argv], capture_output=True,
                          text=True, env=env, timeout=RUN_LIMIT_S)
    ended = time.time()
    assert stamp.is_file(), f"the fault never fired:\n{proc.stderr[-3000:]}"
    return proc, ended - float(stamp.read_text().split()[0])


def _ray_argv(model, run_dir, reward_file, *extra):
    return overrides(model, run_dir, reward_file, 2, "trainer.worker_backend=ray", "trainer.n_gpus_per_node=1",
                     "ray_init.num_cpus=2", "trainer.save_freq=-1", *extra)


def test_killed_ray_worker_is_reported_with_role_rank_and_cause(tiny_model_dir, reward_file, tmp_path):
    proc, detected_s = _cli(_ray_argv(tiny_model_dir, tmp_path / "run", reward_file), "update_actor@1",
                            tmp_path / "fault.stamp")
    assert proc.returncode == EXIT_RUN_ABORTED, proc.stderr[-3000:]
    err = proc.stderr
    # role (the colocated group's actor_rollout view), rank, method, and Ray's cause
    assert ("WorkerDiedError: worker group 'global_pool/actor_rollout' rank 0 died while running "
            "'actor_rollout_update_actor': ActorDiedError") in err
    assert "worker process has died" in err
    assert "Traceback" not in err.split("rlfoundry: WorkerDiedError")[-1]
    assert detected_s < DETECT_S


def test_hung_ray_worker_hits_the_call_timeout(tiny_model_dir, reward_file, tmp_path):
    proc, detected_s = _cli(_ray_argv(tiny_model_dir, tmp_path / "run", reward_file, "trainer.worker_call_timeout_s=15"),
                            "update_actor@1:hang", tmp_path / "fault.stamp")
    assert proc.returncode == EXIT_RUN_ABORTED, proc.stderr[-3000:]
    assert ("WorkerCallTimeout: worker group 'global_pool/actor_rollout' ranks [0] did not finish "
            "'actor_rollout_update_actor' within 15 s") in proc.stderr
    assert 15 <= detected_s < 15 + DETECT_S
