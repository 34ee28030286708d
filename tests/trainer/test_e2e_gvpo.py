"""verl's GVPO recipe end to end: its entry module's config with the recipe script's keys trains the tiny
model, the trainer hands the actor whole numbered groups, and the loss the actor reports is GVPO's formula
recomputed on the batch it was trained on."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.algos.gvpo import GROUP_KEY
from rlfoundry.recipe.gvpo.gvpo_main_ppo import ENTRY
from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

N = 4  # rollout.n in _e2e.tiny_overrides
# the keys run_qwen2-7b_math_gvpo.sh sets for the algorithm
RECIPE = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=False",
          "actor_rollout_ref.actor.policy_loss.loss_mode=gvpo", "actor_rollout_ref.actor.gvpo_beta=0.1",
          "algorithm.use_kl_in_reward=False", "algorithm.norm_adv_by_std_in_grpo=False"]


def test_the_recipe_trains_on_whole_groups_and_reports_gvpos_loss(tiny_model_dir, tmp_path):
    reward = E.write_reward_file(tmp_path)
    overrides = E.tiny_overrides(tiny_model_dir, tmp_path / "run", f"custom_reward_function.path={reward}", *RECIPE)
    run = E.train(ENTRY.overrides(overrides), config_name=ENTRY.config_name)
    assert run.trainer is None and len(run.batches) == 2
    spread = 0.0
    for step, batch in enumerate(run.batches, start=1):
        groups = E.groups(batch)
        # rows in whole groups of n, numbered in row order, as the loss reads them
        assert batch[GROUP_KEY].tolist() == [i // N for i in range(len(batch[GROUP_KEY]))]
        assert all(rows == list(range(rows[0], rows[0] + N)) for rows in groups.values())
        # the recipe's advantage: the score minus its group's mean (GRPO without the std)
        mask, scores = batch["response_mask"], E.sequence_scores(batch)
        a = (batch["advantages"] * mask).sum(-1) / mask.sum(-1)
        centred = scores - scores.view(-1, N).mean(-1).repeat_interleave(N)
        torch.testing.assert_close(a, centred, atol=1e-5, rtol=0)
        # one mini-batch at the weights that wrote old_log_probs: implicit rewards 0, so the loss is the
        # mean over groups of sum_i a_i^2 / 2 / (n - 1)
        want = float((0.5 * a.square() / (N - 1)).sum() / (len(a) // N))
        assert run.step(step)["actor/pg_loss"] == pytest.approx(want, rel=1e-4, abs=1e-7), step
        spread = max(spread, want)
    assert spread > 1e-3  # the scores varied within a group: the comparison is not 0 == 0
