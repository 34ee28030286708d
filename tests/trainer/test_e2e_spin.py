"""verl's SPIN recipe through its entry module's config (``rlfoundry.recipe.spin.main_spin``: the packaged
``spin_trainer`` and both SPIN halves) on the tiny model: each prompt's two samples are paired by their score,
the DPO loss the actor reports is the formula recomputed from the batch, the reference takes the actor's
weights every ``trainer.ref_update_freq`` steps and only then, and training raises the chosen-over-rejected
margin of the pairs it saw (``trainer.log_freq``, which verl's recipe script adds, thins the metrics log)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfoundry.algos.spin import dpo_losses
from rlfoundry.protocol import DataProto
from rlfoundry.recipe.spin.main_spin import ENTRY, spin_overrides
from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

# 4 prompts x 2 samples per step, one mini-batch in two micro-batches of two pairs; a large lr so 3 steps move
SETTINGS = ("actor_rollout_ref.rollout.n=2", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
            "trainer.total_training_steps=3")


def _run(model, run_dir, reward, *extra, keep=False):
    overrides = spin_overrides(E.tiny_overrides(model, run_dir, f"custom_reward_function.path={reward}", *SETTINGS,
                                                *extra))
    return E.train(overrides, keep_trainer=keep, config_name=ENTRY.config_name)


def _pairs(batch) -> list[tuple[int, int]]:
    """(chosen row, rejected row) of each prompt, read off the scores: the higher sum wins, a tie the first row."""
    rows: dict[str, list[int]] = {}
    for i, uid in enumerate(batch["uid"]):
        rows.setdefault(uid, []).append(i)
    scores = E.sequence_scores(batch)
    assert all(len(r) == 2 for r in rows.values())
    return [(a, b) if scores[a] >= scores[b] else (b, a) for a, b in rows.values()]


def _z(batch, policy: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """z = (S_c - R_c) - (S_r - R_r) per pair, S / R the summed token log-probs over the response mask."""
    mask = batch["response_mask"].float()
    d = (policy * mask).sum(-1) - (ref * mask).sum(-1)
    return torch.tensor([float(d[c] - d[r]) for c, r in _pairs(batch)])


def test_the_actor_reports_the_dpo_loss_of_its_pairs_and_the_reference_is_refreshed_on_schedule(tiny_model_dir,
                                                                                                tmp_path):
    # wrapped in FSDP2 on the one rank, as on several: the refresh copies DTensor shards
    run = _run(tiny_model_dir, tmp_path / "run", E.write_reward_file(tmp_path), "trainer.ref_update_freq=2",
               "actor_rollout_ref.actor.fsdp_config.single_rank=fsdp",
               "actor_rollout_ref.ref.fsdp_config.single_rank=fsdp")
    mask = [b["response_mask"].bool() for b in run.batches]
    same = [torch.allclose(b["ref_log_prob"][m], b["old_log_probs"][m], atol=1e-5) for b, m in zip(run.batches, mask)]
    # step 1: nothing trained yet; step 2: refreshed (2 % 2 == 0) to the policy of that step; step 3: not refreshed
    assert same == [True, True, False]
    for step, batch in enumerate(run.batches, start=1):
        for chosen, rejected in _pairs(batch):  # the estimator's labels are the score ranking
            adv = batch["advantages"]
            assert float(adv[chosen].max()) == 1.0 and float(adv[rejected].min()) == -1.0
        # one mini-batch: both micro-batches see the weights that computed old_log_probs, so log pi = old_log_probs
        z = _z(batch, batch["old_log_probs"], batch["ref_log_prob"])
        record = run.step(step)
        assert record["actor/dpo_loss"] == pytest.approx(float(dpo_losses(z, 0.1).mean()), rel=1e-4, abs=1e-6)
        assert record["actor/pg_loss"] == record["actor/dpo_loss"]
        assert record["actor/dpo_logits"] == pytest.approx(float(z.mean()), rel=1e-4, abs=1e-5)
    assert abs(run.step(3)["actor/dpo_logits"]) > 1e-3  # step 3's pairs are measured against an older policy


def test_training_against_a_fixed_reference_raises_the_margin_of_the_pairs_it_saw(tiny_model_dir, tmp_path):
    run = _run(tiny_model_dir, tmp_path / "run", E.write_reward_file(tmp_path), "trainer.ref_update_freq=-1",
               "trainer.log_freq=3", keep=True)
    assert [r["step"] for r in run.records if "timing_s/step" in r] == [3]  # verl's +trainer.log_freq: every 3rd
    wg, gains = run.trainer.actor_rollout_wg, []
    for batch in run.batches:  # each step's pairs, scored again by the trained policy and the (initial) reference
        keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
        data = DataProto.from_dict(tensors={k: batch[k] for k in keys}, meta_info={"temperature": 1.0})
        after = wg.compute_log_prob(data).batch["old_log_probs"]
        ref = wg.compute_ref_log_prob(data).batch["ref_log_prob"]
        torch.testing.assert_close(ref, batch["ref_log_prob"])  # the reference never moved
        gains.append(_z(batch, after, ref) - _z(batch, batch["old_log_probs"], batch["ref_log_prob"]))
    gain = torch.cat(gains)
    assert float(gain.mean()) > 0.5 and float((gain > 0).float().mean()) > 0.75, np.round(gain.numpy(), 3)
