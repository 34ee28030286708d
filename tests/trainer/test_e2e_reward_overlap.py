"""verl's ``reward_model.launch_reward_fn_async``: the reward function scores while the log-prob pass
runs, and the run trains exactly as with the reward in line.

Overlap is shown by order, not by a clock: the reward function waits until the old-log-prob pass has
begun, which only a reward running beside it can see (in line, the pass starts after the reward).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.trainer import _e2e as E

STEPS = 2


def _run(model: Path, run_dir: Path, overlap: bool) -> tuple[list[bool], list[dict]]:
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_trainer

    reward = E.write_reward_file(model.parent)
    cfg = load_config(E.tiny_overrides(model, run_dir, f"custom_reward_function.path={reward}",
                                       "actor_rollout_ref.actor.use_rollout_log_probs=false",  # the pass runs
                                       f"reward_model.launch_reward_fn_async={str(overlap).lower()}",
                                       f"trainer.total_training_steps={STEPS}"))
    trainer = build_trainer(cfg)
    pass_begun, saw_pass = threading.Event(), []
    compute_log_prob, reward_fn = trainer.actor_rollout_wg.compute_log_prob, trainer.reward_fn

    def observed_pass(data):
        # set until the step's update: a reward thread that starts late, after the pass has ended, still
        # sees that the pass did not wait for it (the property); in line, the reward runs before the pass
        pass_begun.set()
        return compute_log_prob(data)

    def waiting_reward(batch, **kwargs):
        saw_pass.append(pass_begun.wait(timeout=30 if overlap else 0.5))  # in line: it cannot have begun
        return reward_fn(batch, **kwargs)

    trainer.actor_rollout_wg.compute_log_prob, trainer.reward_fn = observed_pass, waiting_reward
    batches = []
    update_actor = trainer._update_actor
    trainer._update_actor = lambda batch, timing: (batches.append(E._snapshot(batch)), pass_begun.clear(),
                                                   update_actor(batch, timing))[2]
    trainer.fit()
    return saw_pass, batches


@pytest.mark.slow
def test_the_reward_overlaps_the_log_prob_pass_and_the_run_trains_the_same(tiny_model_dir, tmp_path):
    saw_pass, overlapped = _run(tiny_model_dir, tmp_path / "overlap", overlap=True)
    assert saw_pass == [True] * STEPS  # each step's reward ran while its log-prob pass had begun
    in_line, serial = _run(tiny_model_dir, tmp_path / "in_line", overlap=False)
    assert in_line == [False] * STEPS
    assert len(overlapped) == len(serial) == STEPS
    for a, b in zip(overlapped, serial):
        for key in ("responses", "token_level_scores", "old_log_probs", "advantages"):
            assert torch.equal(a[key], b[key]), key
    records = {r["step"]: r for r in E.read_records(tmp_path / "overlap") if "timing_s/step" in r}
    serial_records = {r["step"]: r for r in E.read_records(tmp_path / "in_line") if "timing_s/step" in r}
    for step in range(1, STEPS + 1):
        assert records[step]["actor/pg_loss"] == serial_records[step]["actor/pg_loss"]
        assert records[step]["critic/score/mean"] == serial_records[step]["critic/score/mean"]
        assert "timing_s/reward_overlapped" in records[step] and "timing_s/reward_overlapped" not in serial_records[step]
