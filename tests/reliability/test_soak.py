"""Soak: many short steps, a checkpoint every step, random SIGKILLs; nothing may be lost or doubled.

Each attempt is killed either by a fault at a random point (save path, generation, log-probs,
update; ``rlfoundry/utils/faults.py``) or by the test after a random delay, until a run finishes.
Then: the final checkpoint loads, the checkpointed step is the last one, ``metrics.jsonl`` has
exactly one line per step 1..N, and every step's metrics equal an uninterrupted run's.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rlfoundry.checkpoint import layout as ckpt_dirs
from rlfoundry.checkpoint import state as ckpt
from tests.reliability._harness import (
    SIGKILLED,
    assert_same_metrics,
    latest_step,
    overrides,
    raw_records,
    run_trainer,
)

POINTS = ["save.staged", "save.published", "save.trainer_state", "save.step_marked", "save.pruning",
          "generate_sequences", "compute_log_prob", "update_actor"]


def _kill_plan(rng: random.Random) -> tuple[dict[str, str], float | None]:
    """A fault at a random point and hit, or (one time in three) an external kill after a random delay."""
    if rng.random() < 1 / 3:
        return {}, rng.uniform(0.5, 4.0)
    return {"RLFOUNDRY_FAULT_INJECT": f"{rng.choice(POINTS)}@{rng.randint(1, 3)}"}, None


def _check_invariants(run_dir: Path) -> None:
    """After any kill: the newest complete checkpoint (if any) is the pointer's or older, and complete."""
    newest = ckpt_dirs.find_latest_ckpt_path(run_dir)
    if newest is not None:
        assert ckpt_dirs.is_complete_step_dir(newest)


def _check_final(run_dir: Path, model_dir: Path, steps: int) -> None:
    from transformers import AutoModelForCausalLM

    assert latest_step(run_dir) == steps
    step_dir = Path(ckpt_dirs.find_latest_ckpt_path(run_dir))
    assert step_dir.name == f"global_step_{steps}"
    extra = ckpt.load_checkpoint(step_dir / "actor", AutoModelForCausalLM.from_pretrained(model_dir), load_rng=False)
    assert extra["global_step"] == steps
    assert ckpt_dirs.load_trainer_state(step_dir / "data.pt")["global_step"] == steps
    assert [r["step"] for r in raw_records(run_dir)] == list(range(1, steps + 1))  # one line per step
    assert not [p for p in run_dir.rglob(f"*{ckpt_dirs.TMP_SUFFIX}")]


def soak(model: Path, reward_file: Path, tmp_path: Path, steps: int, kills: int, seed: int) -> list[dict]:
    rng, run_dir = random.Random(seed), tmp_path / "run"
    argv = overrides(model, run_dir, reward_file, steps, "trainer.max_actor_ckpt_to_keep=2")
    killed = 0
    for attempt in range(kills + 1):
        env, kill_after = _kill_plan(rng) if killed < kills else ({}, None)
        result = run_trainer(argv, tmp_path / f"log{attempt}.txt", env=env, kill_after_s=kill_after)
        if result.exitcode == 0:
            break
        assert result.exitcode == SIGKILLED, (env, result.log[-3000:])
        killed += 1
        _check_invariants(run_dir)
    else:
        raise AssertionError(f"no run finished after {kills} kills")
    _check_final(run_dir, model, steps)
    return raw_records(run_dir)


@pytest.mark.numerics
def test_soak_short_random_kills_lose_and_double_nothing(tiny_model_dir, reward_file, reference_run, tmp_path):
    records = soak(tiny_model_dir, reward_file, tmp_path, steps=4, kills=3, seed=7)
    for record in records:
        assert_same_metrics(reference_run["records"][record["step"]], record, f"step {record['step']}")


@pytest.mark.soak
@pytest.mark.slow
def test_soak_long_random_kills(tiny_model_dir, reward_file, tmp_path):
    soak(tiny_model_dir, reward_file, tmp_path, steps=24, kills=30, seed=2024)
