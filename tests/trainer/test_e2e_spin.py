"""verl's SPIN recipe through its entry module's config (``rlfoundry.recipe.spin.main_spin``: the packaged
``spin_trainer`` and both SPIN halves) on the tiny model: each prompt's two samples are paired by their score,
the DPO loss the actor reports is the formula recomputed from the batch, the reference takes the actor's
weights every ``trainer.ref_update_freq`` steps and only then, and training raises the chosen-over-rejected
margin of the pairs it saw (``trainer.log_freq``, which verl's recipe script adds, thins the metrics log); a run
resumed between two refreshes trains the next step against the uninterrupted run's reference, and a tie goes to
the prompt's first generated sample through the trainer's row ordering."""

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

FSDP = ("actor_rollout_ref.actor.fsdp_config.single_rank=fsdp", "actor_rollout_ref.ref.fsdp_config.single_rank=fsdp")


def _run(model, run_dir, reward, *extra, keep=False, prepare=None):
    overrides = spin_overrides(E.tiny_overrides(model, run_dir, f"custom_reward_function.path={reward}", *SETTINGS,
                                                *extra))
    return E.train(overrides, keep_trainer=keep, config_name=ENTRY.config_name, prepare=prepare)


def _components(step_dir) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir() if p.is_dir())


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
    run = _run(tiny_model_dir, tmp_path / "run", E.write_reward_file(tmp_path), "trainer.ref_update_freq=2", *FSDP,
               "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1")
    # only step 2 saved the reference (refreshed at 2, not at 3); pruning step 2's actor took it along
    assert [_components(tmp_path / "run" / f"global_step_{s}") for s in (1, 2, 3)] == [[], [], ["actor"]]
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
               "trainer.log_freq=3", "trainer.save_freq=3", keep=True)
    assert [r["step"] for r in run.records if "timing_s/step" in r] == [3]  # verl's +trainer.log_freq: every 3rd
    assert _components(tmp_path / "run" / "global_step_3") == ["actor"]  # the fixed reference is the model path's
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


def test_a_run_resumed_between_refreshes_trains_the_next_step_against_the_uninterrupted_runs_reference(
        tiny_model_dir, tmp_path):
    # FSDP2 on the one rank, as on several: the reference's DTensor shards are saved and loaded
    reward, fsdp = E.write_reward_file(tmp_path), ("trainer.ref_update_freq=2", *FSDP)
    full = _run(tiny_model_dir, tmp_path / "full", reward, *fsdp, "trainer.save_freq=2")  # saves after steps 2, 3
    # refreshed at step 2 and not at 3: saved; after step 3, step 4 would refresh first: not saved
    assert _components(tmp_path / "full" / "global_step_2") == ["actor", "ref"]
    assert _components(tmp_path / "full" / "global_step_3") == ["actor"]
    resumed = _run(tiny_model_dir, tmp_path / "resumed", reward, *fsdp, "trainer.resume_mode=resume_path",
                   f"trainer.resume_from_path={tmp_path / 'full' / 'global_step_2'}")
    assert len(resumed.batches) == 1  # step 3 only
    want, got = full.batches[2], resumed.batches[0]
    torch.testing.assert_close(got["responses"], want["responses"], rtol=0, atol=0)
    # step 3's reference is the policy after step 1 (refreshed at step 2), not the initial model
    torch.testing.assert_close(got["ref_log_prob"], want["ref_log_prob"], rtol=0, atol=1e-6)
    assert resumed.step(3)["actor/dpo_loss"] == pytest.approx(full.step(3)["actor/dpo_loss"], rel=1e-6, abs=1e-7)
    assert resumed.step(3)["actor/dpo_logits"] == pytest.approx(full.step(3)["actor/dpo_logits"], rel=1e-5, abs=1e-7)


TIED_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"


def test_with_tied_scores_the_first_generated_sample_is_chosen_through_the_trainer(tiny_model_dir, tmp_path):
    generated = []  # each step's rollout output, rows in generation order (a prompt's samples by index)

    def record_generations(trainer):
        generate = trainer.rollout_wg.generate_sequences

        def recording(prompts, *args, **kwargs):
            out = generate(prompts, *args, **kwargs)
            generated.append({"uid": list(out.non_tensor_batch["uid"]), "responses": out.batch["responses"].clone()})
            return out
        trainer.rollout_wg.generate_sequences = recording

    (tmp_path / "tied.py").write_text(TIED_REWARD)
    run = _run(tiny_model_dir, tmp_path / "run", tmp_path / "tied.py", "trainer.total_training_steps=2",
               prepare=record_generations)
    distinct = 0
    for gen, batch in zip(generated, run.batches, strict=True):
        assert (E.sequence_scores(batch) == 0.5).all()
        first = {uid: gen["responses"][gen["uid"].index(uid)] for uid in set(gen["uid"])}
        second = {uid: gen["responses"][len(gen["uid"]) - 1 - gen["uid"][::-1].index(uid)] for uid in first}
        chosen = batch["advantages"].amax(-1) > 0
        for row, uid in enumerate(batch["uid"]):
            if torch.equal(first[uid], second[uid]):
                continue  # the two samples are the same text: which one is chosen is not observable
            distinct += 1
            assert bool(chosen[row]) == torch.equal(batch["responses"][row], first[uid]), (uid, row)
    assert distinct >= 8  # most pairs differ, so the check above saw the tie rule
