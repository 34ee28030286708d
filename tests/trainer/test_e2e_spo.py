"""verl's SPO recipe end to end through its entry module (trainer.spo.enable, one response per prompt): each
step trains on prompts drawn from the loader's gen_batch_size, its advantages are SPO's formula on the
batch, with baselines from a tracker that learned the earlier steps' rewards of the same prompts; and a
run resumed from a checkpoint trains the next step with the uninterrupted run's baselines and advantages."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.algos import spo
from rlfoundry.recipe.spo.spo_main_ppo import ENTRY
from rlfoundry.trainer.ppo.spo import prompt_keys
from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

# the keys train.sh sets for METHOD=SPO (scaled down): n=1, a gen batch larger than the train batch
RECIPE = ["algorithm.adv_estimator=grpo", "trainer.spo.enable=True", "actor_rollout_ref.rollout.n=1",
          "data.train_batch_size=4", "+data.gen_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
          "data.synthetic.train_size=8", "actor_rollout_ref.actor.use_kl_loss=False",
          "algorithm.use_kl_in_reward=False"]


def _overrides(model, run_dir, reward, *extra):
    tiny = [o for o in E.tiny_overrides(model, run_dir, f"custom_reward_function.path={reward}", *RECIPE, *extra)
            if o != "actor_rollout_ref.rollout.n=4"]
    return ENTRY.overrides(tiny)


def _row_advantages(batch):
    mask = batch["response_mask"]
    return (batch["advantages"] * mask).sum(-1) / mask.sum(-1)


def test_advantages_use_the_tracker_that_learned_earlier_steps(tiny_model_dir, tmp_path):
    reward = E.write_reward_file(tmp_path)
    run = E.train(_overrides(tiny_model_dir, tmp_path / "run", reward, "trainer.total_training_steps=3",
                             "trainer.spo.rho.type=constant", "trainer.spo.rho.value=0.5"), config_name=ENTRY.config_name)
    assert len(run.batches) == 3
    alpha, beta = {}, {}  # the tracker, recomputed by hand: no offline table, every prompt starts at (0.5, 0.5)
    revisits = 0
    for step, batch in enumerate(run.batches, start=1):
        keys, r = prompt_keys_of(batch), E.sequence_scores(batch)
        assert len(keys) == 4  # train_batch_size prompts drawn from the loader's 8, one response each
        p_hat = torch.tensor([alpha.get(k, 0.5) / (alpha.get(k, 0.5) + beta.get(k, 0.5)) for k in keys])
        revisits += sum(k in alpha for k in keys)
        torch.testing.assert_close(batch["reward_baselines"], p_hat, atol=1e-6, rtol=0)
        torch.testing.assert_close(_row_advantages(batch), spo.spo_advantages(r, p_hat), atol=1e-5, rtol=0)
        for k, ri in zip(keys, r.tolist()):  # rho = 0.5: alpha' = alpha / 2 + r, beta' = beta / 2 + 1 - r
            alpha[k], beta[k] = 0.5 * alpha.get(k, 0.5) + ri, 0.5 * beta.get(k, 0.5) + 1 - ri
        assert run.step(step)["spo/p_hats"] == pytest.approx(float(p_hat.mean()), abs=1e-6)
        assert run.step(step)["spo/rho"] == 0.5
    assert revisits > 0  # some baseline came from an earlier step: the comparison is not 0.5 == 0.5
    assert run.step(1)["training/epoch"] == 0 and run.step(2)["training/epoch"] == 1  # 8 prompts per loader batch


def prompt_keys_of(batch):
    return prompt_keys({"raw_prompt": batch["raw_prompt"]})


def test_a_resumed_run_trains_the_next_step_like_the_uninterrupted_one(tiny_model_dir, tmp_path):
    reward = E.write_reward_file(tmp_path)
    full = E.train(_overrides(tiny_model_dir, tmp_path / "full", reward, "trainer.total_training_steps=4",
                              "trainer.save_freq=2"), config_name=ENTRY.config_name)
    resumed = E.train(_overrides(tiny_model_dir, tmp_path / "full", reward, "trainer.total_training_steps=4",
                                 "trainer.save_freq=-1", "trainer.resume_mode=resume_path",
                                 f"trainer.resume_from_path={tmp_path / 'full' / 'global_step_2'}"), config_name=ENTRY.config_name)
    assert len(resumed.batches) == 2  # steps 3 and 4: step 4's baselines went through rho from restored rows
    for want, got in zip(full.batches[2:], resumed.batches):
        assert prompt_keys_of(got) == prompt_keys_of(want)
        torch.testing.assert_close(got["reward_baselines"], want["reward_baselines"], atol=1e-6, rtol=0)
        torch.testing.assert_close(_row_advantages(got), _row_advantages(want), atol=1e-5, rtol=0)
        # the tracker moved the baselines off the uninformed prior for the prompts seen before
        assert (want["reward_baselines"] != 0.5).any()
    # the KL-adaptive rho was measured on revisited prompts (D > 0 somewhere) and lies in [0.875, 0.96]
    assert any(full.step(s)["spo/D"] > 0 for s in (2, 3, 4))
    assert all(0.875 <= full.step(s)["spo/rho_clipped"] <= 0.96 for s in (1, 2, 3, 4))
    assert full.step(1)["spo/rho"] == 1.0  # all first visits: D = 0, rho = 1 before its clip to 0.96
