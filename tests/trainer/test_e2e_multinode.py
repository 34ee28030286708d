"""The CLI on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``, 1 CPU per node, all on
127.0.0.1), joined through ``RAY_ADDRESS`` as a user joins a real cluster:

- the default (GRPO) job with ``trainer.nnodes=2 trainer.n_gpus_per_node=1``: one rank per node,
  the same updates as two ranks on one machine; a node whose raylet is killed mid-run ends the run
  within a bounded time with exit 3 and a message naming the node, the role and the rank, and
  ``trainer.resume_mode=auto`` on a replacement node continues from the newest checkpoint;
- one-step-off with the rollout pool on the other node than the trainer: weights cross nodes
  through the checkpoint engine after every update.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfoundry.utils.errors import EXIT_RUN_ABORTED
from tests.single_controller.test_multinode import HEAD_NODE_ARGS, _forget_marker
from tests.trainer import _e2e as E

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 4
DETECT_S = 90  # from the killed raylet to the driver's exit: Ray's health checks (~1.5 s, HEAD_NODE_ARGS) + shutdown
PLACED = re.compile(r"worker group '(\w+)' \(([^)]*)\): (.*)")


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from rlfoundry.single_controller.ray.cluster import _loopback_node

    if ray.is_initialized():
        ray.shutdown()
    with _loopback_node():
        c = Cluster(initialize_head=True, head_node_args=HEAD_NODE_ARGS)
        _forget_marker(c.address)
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
    yield c
    c.shutdown()
    _forget_marker(c.address)


def _args(model: Path, run: Path, *extra: str) -> list[str]:
    reward = E.write_reward_file(model.parent)
    return E.tiny_overrides(model, run, f"custom_reward_function.path={reward}", "actor_rollout_ref.actor.optim.lr=0.02",
                            "trainer.worker_backend=ray", *extra)


def _env(cluster) -> dict[str, str]:
    return {**E.subprocess_env(), "RAY_ADDRESS": cluster.address}


def _cli(args: list[str], env: dict, config_name: str | None = None) -> subprocess.Popen:
    flags = ["--config-name", config_name] if config_name else []
    return subprocess.Popen([sys.executable, "-m", "rlfoundry", "train", *flags, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _placement(stdout: str) -> dict[str, list[str]]:
    """Pool name → node id of each rank, from the lines the run prints at start-up."""
    return {m.group(1): re.findall(r"\(([0-9a-f]{40,})\)", m.group(3)) for m in PLACED.finditer(stdout)}


def _power_off(node) -> None:
    """The node's raylet and every worker it started die at once, as when a machine loses power. Killing
    the raylet alone leaves its workers running until they notice; on a loaded machine the two remaining
    tiny steps can finish in that window and the run ends 0 with nothing to report."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    workers = raylet.children(recursive=True)
    node.kill_raylet()
    for proc in workers:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in E.read_records(run) if "timing_s/step" in r}


def test_one_step_off_runs_with_the_rollout_pool_on_the_other_node(tiny_model_dir, tmp_path, cluster):
    run = tmp_path / "async"
    rc, out, err = _finish(_cli(_args(tiny_model_dir, run, "rollout.n_gpus_per_node=1", "data.gen_batch_size=1",
                                      "async_training.require_batches=1"), _env(cluster), "one_step_off_ppo_trainer"))
    assert rc == 0, out[-3000:] + err[-3000:]
    placed = _placement(out)
    assert len(placed["global_pool"]) == len(placed["rollout_pool"]) == 1
    assert placed["global_pool"] != placed["rollout_pool"]  # trainer and rollout on different nodes
    steps = _steps(run)
    assert sorted(steps) == [1, 2] and all(steps[s]["async/sync_megabytes"] > 0 for s in steps)  # crossed nodes
    assert steps[1]["rollout_corr/log_ppl_abs_diff"] <= 1e-6  # the rollout node starts from the trainer's weights


@pytest.mark.numerics
def test_default_job_on_two_nodes_names_a_killed_node_and_resumes(tiny_model_dir, tmp_path, cluster):
    run = tmp_path / "two_nodes"
    args = _args(tiny_model_dir, run, "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.save_freq=1",
                 f"trainer.total_training_steps={STEPS}")
    proc = _cli(args, _env(cluster))
    latest = run / "latest_checkpointed_iteration.txt"
    while not (latest.exists() and int(latest.read_text() or 0) >= 1) and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, _finish(proc)[2][-3000:]
    victim = next(iter(cluster.worker_nodes))  # never the head: the driver is there
    _power_off(victim)
    killed = time.monotonic()
    rc, out, err = _finish(proc)
    took = time.monotonic() - killed
    placed = _placement(out)["global_pool"]
    assert len(placed) == 2 and len(set(placed)) == 2  # one rank per node
    rank = placed.index(victim.node_id)
    assert rc == EXIT_RUN_ABORTED, out[-2000:] + err[-3000:]
    assert f"NodeDiedError: Ray node 127.0.0.1 (node id {victim.node_id}) died while worker group 'global_pool/" in err
    assert re.search(rf"rank {rank} of actor_rollout\w* ran on it", err)
    assert "trainer.resume_mode=auto to continue from the newest intact checkpoint" in err
    assert "Traceback" not in err.split("rlfoundry: NodeDiedError")[-1]
    assert took < DETECT_S, took

    cluster.remove_node(victim, allow_graceful=False)  # the rest of its processes
    cluster.add_node(num_cpus=1)  # the replacement node
    cluster.wait_for_nodes()
    rc, out, err = _finish(_cli([*args, "trainer.resume_mode=auto"], _env(cluster)))
    assert rc == 0, out[-3000:] + err[-3000:]
    resumed = int(re.search(r"resumed from \S*global_step_(\d+)", out + err).group(1))
    assert resumed >= 1
    steps = _steps(run)
    assert sorted(steps) == list(range(1, STEPS + 1))
    # the job learns as on one node: two ranks of one machine (process back end) make the same updates
    local = tmp_path / "one_node"
    rc, out, err = _finish(_cli([*_args(tiny_model_dir, local, "trainer.n_gpus_per_node=2",
                                        f"trainer.total_training_steps={STEPS}"), "trainer.worker_backend=process"],
                                E.subprocess_env()))
    assert rc == 0, out[-3000:] + err[-3000:]
    assert sorted(_steps(local)) == list(range(1, STEPS + 1))
    for step, record in _steps(local).items():
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            # the same two ranks and arithmetic on Ray nodes as in local processes, resumed: bit for bit in practice
            assert steps[step][key] == pytest.approx(record[key], rel=1e-4, abs=1e-6), (step, key)
    print(json.dumps({"node_death_reported_s": round(took, 1), "resumed_from": resumed}))
