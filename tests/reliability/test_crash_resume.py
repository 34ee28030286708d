"""SIGKILL during a save and in the middle of a step; the next ``resume_mode=auto`` run must pick up
from the newest complete checkpoint, clean the partial one, and train exactly as if never killed.

The kills are real (``os.kill(getpid(), SIGKILL)`` at named points, ``rlfoundry/utils/faults.py``)
in a child process running ``main_ppo.main``; see ``_harness.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfoundry.checkpoint import layout as ckpt_dirs
from tests.reliability._harness import (
    SIGKILLED,
    assert_same_metrics,
    latest_step,
    overrides,
    raw_records,
    run_trainer,
)

# (fault point, step the next run must resume from, debris the killed save leaves in global_step_2)
# Every save below is the one of step 2, after a complete step 1. With max_actor_ckpt_to_keep=1.
SAVE_KILLS = [
    ("save.staged", 1, "actor.tmp"),  # shards written, role directory not yet published
    ("save.published", 1, "actor"),  # role directory complete, trainer state not yet written
    ("save.trainer_state", 1, "data.pt"),  # everything written, step not yet marked complete
    # Marker written, pointer not: step 2 is complete but not announced; the pointer's step 1 wins,
    # and step 2 is saved again on top of it.
    ("save.step_marked", 1, ckpt_dirs.STEP_MARKER),
    # Step 2 complete and announced; step 1's actor (beyond max_actor_ckpt_to_keep) renamed, not deleted.
    ("save.pruning", 2, ckpt_dirs.STEP_MARKER),
]


def _debris(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name.endswith(ckpt_dirs.TMP_SUFFIX))


@pytest.mark.numerics
def test_kill_at_each_point_of_a_save_resumes_from_the_newest_complete_checkpoint(
        tiny_model_dir, reward_file, reference_run, tmp_path):
    run_dir = tmp_path / "run"

    def run(steps: int, fault: str | None, n: int):
        argv = overrides(tiny_model_dir, run_dir, reward_file, steps, "trainer.max_actor_ckpt_to_keep=1")
        return run_trainer(argv, tmp_path / f"log{n}.txt", env={"RLFOUNDRY_FAULT_INJECT": fault} if fault else {})

    assert run(1, None, 0).exitcode == 0
    expected_resume = 1
    for n, (point, resume_next, left) in enumerate(SAVE_KILLS, start=1):
        result = run(2, f"{point}@1", n)
        assert result.exitcode == SIGKILLED, (point, result.log[-2000:])
        assert result.resumed_from_step == expected_resume, (point, result.log[-2000:])
        assert (run_dir / "global_step_2" / left).exists(), (point, sorted(p.name for p in run_dir.rglob("*")))
        newest = ckpt_dirs.find_latest_ckpt_path(run_dir)
        assert newest == str(run_dir / f"global_step_{resume_next}"), point
        assert ckpt_dirs.is_complete_step_dir(newest)
        expected_resume = resume_next
    final = run(3, None, len(SAVE_KILLS) + 1)
    assert final.exitcode == 0, final.log[-3000:]
    assert final.resumed_from_step == 2
    assert _debris(run_dir) == [] and latest_step(run_dir) == 3
    # max_actor_ckpt_to_keep=1: older steps keep their trainer state but lose the actor shards
    assert sorted(p.parent.name for p in run_dir.glob("global_step_*/actor")) == ["global_step_3"]
    # one record per completed step, and each equal to the uninterrupted run's
    records = raw_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert_same_metrics(reference_run["records"][record["step"]], record, f"step {record['step']}")


@pytest.mark.numerics
def test_kill_mid_step_resumes_with_the_same_data_order_and_metrics(tiny_model_dir, reward_file, reference_run,
                                                                    tmp_path):
    run_dir, order = tmp_path / "run", tmp_path / "order.txt"
    argv = overrides(tiny_model_dir, run_dir, reward_file, 4)
    env = {"ORDER_LOG": str(order)}
    # killed inside the 3rd step's actor update: after generation and scoring, before any save
    killed = run_trainer(argv, tmp_path / "log1.txt", env={**env, "RLFOUNDRY_FAULT_INJECT": "update_actor@3"})
    assert killed.exitcode == SIGKILLED, killed.log[-2000:]
    assert latest_step(run_dir) == 2
    scored_before_kill = order.read_text().split()
    order.unlink()
    resumed = run_trainer(argv, tmp_path / "log2.txt", env=env)
    assert resumed.exitcode == 0, resumed.log[-3000:]
    assert resumed.resumed_from_step == 2
    # data order: the resumed run scores exactly the uninterrupted run's prompts of steps 3-4
    per_step = 2 * 2  # prompts × samples
    assert scored_before_kill == reference_run["order"][: 3 * per_step]
    assert order.read_text().split() == reference_run["order"][2 * per_step:]
    records = raw_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert_same_metrics(reference_run["records"][record["step"]], record, f"step {record['step']}")


def test_a_checkpoint_damaged_after_saving_is_skipped_by_auto_and_named_by_resume_path(
        tiny_model_dir, reward_file, tmp_path):
    """A flipped byte in step 2's actor shard (after it was published): auto resumes from step 1 and
    says which file it skipped; asking for step 2 by path stops with that file named, no traceback.
    With every step damaged, auto stops too, rather than train from scratch over them."""
    run_dir = tmp_path / "run"
    assert run_trainer(overrides(tiny_model_dir, run_dir, reward_file, 2), tmp_path / "log0.txt").exitcode == 0
    shard = next((run_dir / "global_step_2" / "actor" / "dcp").glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))

    explicit = overrides(tiny_model_dir, run_dir, reward_file, 3, "trainer.resume_mode=resume_path",
                         f"trainer.resume_from_path={run_dir / 'global_step_2'}")
    refused = run_trainer(explicit, tmp_path / "log1.txt")
    assert refused.exitcode == 3, refused.log[-2000:]
    assert f"CheckpointCorruptError: checkpoint file {shard} does not match the SHA-256" in refused.log
    assert "Traceback" not in refused.log

    auto = run_trainer(overrides(tiny_model_dir, run_dir, reward_file, 3), tmp_path / "log2.txt")
    assert auto.exitcode == 0, auto.log[-2000:]
    assert auto.resumed_from_step == 1
    assert f"skipping {run_dir / 'global_step_2'}: checkpoint file {shard}" in auto.log
    assert latest_step(run_dir) == 3

    states = sorted(run_dir.glob("global_step_*/data.pt"))
    assert len(states) == 3
    for state in states:
        state.write_bytes(state.read_bytes()[:-1])
    stopped = run_trainer(overrides(tiny_model_dir, run_dir, reward_file, 4), tmp_path / "log3.txt")
    assert stopped.exitcode == 3, stopped.log[-2000:]
    assert f"CheckpointCorruptError: no intact checkpoint under {run_dir}" in stopped.log
    assert all(f"{state} has " in stopped.log for state in states)
    assert "Traceback" not in stopped.log
    assert latest_step(run_dir) == 3 and sorted(run_dir.glob("global_step_*/data.pt")) == states  # untouched
