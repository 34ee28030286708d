"""Helpers for the end-to-end trainer tests: tiny configs, an in-process run that keeps its batches.

``train(...)`` builds the real trainer from command-line overrides (``main_ppo.build_trainer``),
wraps ``_update_actor`` to keep a copy of every step's fully assembled batch (scores, values,
advantages, baselines, log-probs ... exactly what the actor was trained on) and runs ``fit()``.
Tests then check the algorithm's arithmetic on those batches and the logged metrics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# A dense, deterministic score in [0, 1] that a random tiny policy already spreads out (the real
# arithmetic score is ~always 0 before training, which would make every advantage test vacuous).
# It also returns ``acc`` (extra info) and raises for some ground truths, so reward errors and the
# NaN-mean of extra info are exercised on the way.
REWARD_FILE = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info["index"] % 3 == 0:
            raise ValueError("scorer failure on purpose (tests)")
        score = (sum(ord(c) for c in solution_str) % 11) / 10.0
        return {"score": score, "acc": float(score >= 0.5)}
''')


def scorer_fails(extra_info: Any) -> bool:
    """Whether the test scorer raises for a row (its prompt's dataset index is a multiple of 3)."""
    return extra_info["index"] % 3 == 0


def dense_score(text: str) -> float:
    return (sum(ord(c) for c in text) % 11) / 10.0


def tiny_overrides(model: Path, run_dir: Path, *extra: str) -> list[str]:
    """2 prompts × 4 samples per step, 4-token responses, one mini-batch; no validation, no saving."""
    return [
        f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}",
        "data.synthetic.train_size=16", "data.synthetic.val_size=4", "data.train_batch_size=2",
        "data.max_response_length=4", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=4",
        "reward_model.reward_kwargs.num_workers=0", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=file", "trainer.total_training_steps=2", *extra,
    ]


def write_reward_file(directory: Path) -> Path:
    path = directory / "dense_reward.py"
    path.write_text(REWARD_FILE)
    return path


@dataclass
class Run:
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    batches: list[dict[str, Any]] = field(default_factory=list)  # one per step: tensors + non-tensors
    trainer: Any = None

    def step(self, n: int) -> dict[str, Any]:
        """The training record of step ``n`` (the one with actor metrics, not a validation-only line)."""
        return next(r for r in self.records if r["step"] == n and "timing_s/step" in r)


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    from rlfoundry.utils.tracking import read_metrics_jsonl

    return read_metrics_jsonl(run_dir / "metrics.jsonl")


def _snapshot(batch) -> dict[str, Any]:
    out = {k: v.detach().clone() for k, v in batch.batch.items()}
    out.update({k: np.array(v, copy=True) for k, v in batch.non_tensor_batch.items()})
    return out


def train(overrides: list[str], keep_trainer: bool = False, config_name: str | None = None,
          prepare: Callable[[Any], None] | None = None) -> Run:
    """Build the trainer from ``overrides`` (as on the command line), record each step's batch, fit.
    ``prepare(trainer)`` runs before ``fit`` (e.g. to record what a worker group returns)."""
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_trainer

    cfg = load_config(overrides, config_name=config_name)
    trainer = build_trainer(cfg)
    batches: list[dict[str, Any]] = []
    update_actor = trainer._update_actor

    def recording_update_actor(batch, timing):
        batches.append(_snapshot(batch))
        return update_actor(batch, timing)

    trainer._update_actor = recording_update_actor
    if prepare is not None:
        prepare(trainer)
    summary = trainer.fit()
    run_dir = Path(trainer.config.trainer.run_dir)
    return Run(summary, read_records(run_dir), batches, trainer if keep_trainer else None)


def sequence_scores(batch: dict[str, Any]) -> torch.Tensor:
    return batch["token_level_scores"].sum(-1)


def assert_dump_is_the_batch(trajectories: list, batch: dict[str, Any]) -> None:
    """``trainer.rollout_data_dir``'s step, read back (``utils.trajectories.read_trajectories``), is the
    batch the actor trained on, row for row: prompt and response ids without padding, the response mask,
    the engine's log-probs, the summed scores and the reward's position."""
    width = batch["prompts"].shape[1]
    assert len(trajectories) == len(batch["responses"])
    for i, t in enumerate(trajectories):
        attention = batch["attention_mask"][i].bool()
        real = attention[width:]
        assert t.prompt_ids == batch["prompts"][i][attention[:width]].tolist(), i
        assert t.response_ids == batch["responses"][i][real].tolist(), i
        assert t.response_mask == batch["response_mask"][i][real].tolist(), i
        if "rollout_log_probs" in batch:
            assert t.record["rollout_log_probs"] == batch["rollout_log_probs"][i][real].tolist(), i
        assert t.score == float(batch["token_level_scores"][i].sum()), i
        assert sum(v for _, v in t.rewards) == pytest.approx(t.score, abs=1e-6)
        assert sum(b - a for _, a, b in t.turns) == len(t.response_ids), i  # the turns tile the response


def groups(batch: dict[str, Any]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, uid in enumerate(batch["uid"]):
        out.setdefault(str(uid), []).append(i)
    return out




REPO = Path(__file__).resolve().parents[2]
# Set in this (driver) process by the in-process worker group for its own gloo group; a child
# process that inherits them would try to rendezvous on the same port (EADDRINUSE).
_RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "RLFOUNDRY_WORKER_GROUP", "RLFOUNDRY_DEBUG")


def subprocess_env() -> dict[str, str]:
    """The environment for running the CLI as a user would: this repo importable (ahead of what the
    path held: on a GPU machine, the carried wheels' folder), one torch thread."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_ENV}
    path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def preprocess_shapes(out: Path, train_size: int, test_size: int, seed: int) -> Path:
    """``rlfoundry preprocess shapes`` (the counting task's image rows) into ``out``, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "rlfoundry.cli", "preprocess", "shapes", "--output", str(out),
                           "--train-size", str(train_size), "--test-size", str(test_size), "--seed", str(seed)],
                          check=False, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out
