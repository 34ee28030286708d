"""Faults injected into real (in-process) trainer runs of ``main_ppo.main``: non-finite updates,
out-of-memory in every kind of pass, a full disk during a save, a full set of reward faults."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfoundry.utils import faults
from rlfoundry.utils.errors import EXIT_RUN_ABORTED
from rlfoundry.checkpoint import layout as ckpt_dirs
from rlfoundry.checkpoint import state as ckpt
from tests.reliability._harness import latest_step, overrides, raw_records
from tests.reliability.conftest import run_main


def _weights(step_dir, model_dir) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ckpt.load_checkpoint(step_dir / "actor", model, load_rng=False)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# ───────────────────────────────────────── non-finite ─────────────────────────────────────────


def test_nan_every_step_stops_after_max_consecutive_and_weights_stay_finite(
        tiny_model_dir, reward_file, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(faults.ENV_VAR, "update_actor:nan")  # NaN advantages reach the loss every step
    code, err = run_main(overrides(tiny_model_dir, run_dir, reward_file, 6, "trainer.max_consecutive_nan_steps=3"),
                         capsys)
    assert code == EXIT_RUN_ABORTED, err[-2000:]
    assert "NonFiniteLossError" in err and "3 consecutive steps (up to step 3)" in err
    assert "optim.lr" in err and "grad_clip" in err and "reward" in err
    records = raw_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["actor/nan_skipped"] == 1 for r in records)
    assert latest_step(run_dir) == 2  # the stopping step is not checkpointed; earlier ones are intact
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    saved = _weights(run_dir / "global_step_2", tiny_model_dir)
    assert _same(initial, saved) and all(torch.isfinite(v).all() for v in saved.values())


def test_one_nan_step_is_skipped_counted_and_training_goes_on(tiny_model_dir, reward_file, tmp_path, monkeypatch,
                                                              capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(faults.ENV_VAR, "update_actor@2:nan")
    code, err = run_main(overrides(tiny_model_dir, run_dir, reward_file, 3), capsys)
    assert code == 0, err[-2000:]
    assert [r["actor/nan_skipped"] for r in raw_records(run_dir)] == [0, 1, 0]
    w1, w2, w3 = (_weights(run_dir / f"global_step_{s}", tiny_model_dir) for s in (1, 2, 3))
    assert _same(w1, w2) and not _same(w2, w3)  # step 2 left the weights alone; step 3 trained


# ───────────────────────────────────────── out of memory ─────────────────────────────────────────


def test_oom_in_forward_passes_retries_with_half_the_micro_batch_and_keeps_it(
        tiny_model_dir, reward_file, tmp_path, monkeypatch, caplog):
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_trainer

    # every forward pass "runs out of memory" whenever it holds more than one row
    monkeypatch.setenv(faults.ENV_VAR, ",".join(f"{p}>1:oom" for p in (
        "generate_sequences", "compute_log_prob", "compute_ref_log_prob", "compute_values")))
    argv = overrides(tiny_model_dir, tmp_path / "run", reward_file, 2, "trainer.save_freq=-1",
                     "algorithm.adv_estimator=gae", f"critic.model.path={tiny_model_dir}",
                     "critic.ppo_micro_batch_size_per_gpu=2", "critic.forward_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.actor.use_rollout_log_probs=false")  # so compute_log_prob runs
    trainer = build_trainer(load_config(argv))
    with caplog.at_level(logging.WARNING, logger="rlfoundry.engines.oom"):
        summary = trainer.fit()
    assert summary["global_step"] == 2
    for name, first in (("generate_sequences", 2), ("compute_log_prob", 4), ("compute_ref_log_prob", 4),
                        ("compute_values", 4)):
        assert f"{name} ran out of memory with {first} rows per micro-batch; retrying with {first // 2}" in caplog.text
        # halved down to 1 during step 1, then kept: step 2 never retried
        assert caplog.text.count(f"{name} ran out of memory") == first.bit_length() - 1, name
    actor = trainer.actor_rollout_wg.worker.workers["actor_rollout"]
    critic = trainer.critic_wg.worker.workers["critic"]
    assert actor._oom_backoff.caps == {"generate_sequences": 1, "compute_log_prob": 1, "compute_ref_log_prob": 1}
    assert critic._oom_backoff.caps == {"compute_values": 1} and critic.critic.sizes.forward_micro_batch_size == 1


def test_oom_in_the_update_stops_naming_the_keys_to_lower(tiny_model_dir, reward_file, tmp_path, monkeypatch,
                                                         capsys):
    monkeypatch.setenv(faults.ENV_VAR, "update_actor:oom")
    code, err = run_main(overrides(tiny_model_dir, tmp_path / "run", reward_file, 2), capsys)
    assert code == EXIT_RUN_ABORTED, err[-2000:]
    assert "TrainingOutOfMemoryError: Out of memory in the actor update" in err
    for key in ("ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "response_length",
                "param_offload", "optimizer_offload", "enable_gradient_checkpointing"):
        assert key in err, key


# ───────────────────────────────────────── disk ─────────────────────────────────────────


def test_unwritable_checkpoint_dir_is_an_error_before_training(tiny_model_dir, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # works as root too, unlike chmod
    code, err = run_main([f"actor_rollout_ref.model.path={tiny_model_dir}",
                          f"trainer.default_local_dir={blocker / 'ckpt'}"], capsys)
    assert code == 2 and "Cannot write to the run directory" in err and "trainer.default_local_dir" in err


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_says_so(
        tiny_model_dir, reward_file, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(faults.ENV_VAR, "save.staged@2:enospc")  # the 2nd save runs out of space
    code, err = run_main(overrides(tiny_model_dir, run_dir, reward_file, 3), capsys)
    assert code == EXIT_RUN_ABORTED, err[-2000:]
    assert "CheckpointSaveError" in err and "No space left on device" in err
    assert f"previous checkpoint {run_dir / 'global_step_1'} is intact" in err
    assert latest_step(run_dir) == 1 and not (run_dir / "global_step_2").exists()
    assert ckpt_dirs.is_complete_step_dir(run_dir / "global_step_1")
    _weights(run_dir / "global_step_1", tiny_model_dir)  # and it loads


# ───────────────────────────────────────── reward functions ─────────────────────────────────────────

FAULTY_REWARD = textwrap.dedent('''
    import os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        kind = extra_info["index"] % 5
        if kind == 0:
            raise ValueError("scorer bug (test)")
        if kind == 1:
            time.sleep(60)  # past reward_kwargs.timeout_s
        if kind == 2:
            return "not a number"
        if kind == 3:
            os._exit(1)  # kills the scoring process
        return 0.5
''')


@pytest.mark.slow
def test_reward_faults_are_contained_and_reported_by_a_real_run(tiny_model_dir, tmp_path, capsys):
    reward = tmp_path / "faulty_reward.py"
    reward.write_text(FAULTY_REWARD)
    run_dir = tmp_path / "run"
    argv = overrides(tiny_model_dir, run_dir, reward, 2, "data.train_batch_size=8",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=1",
                     "algorithm.adv_estimator=reinforce_plus_plus", "reward_model.reward_kwargs.num_workers=2",
                     "reward_model.reward_kwargs.timeout_s=1.0", "trainer.save_freq=-1")
    code, err = run_main(argv, capsys)
    assert code == 0, err[-3000:]
    records = raw_records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for kind in ("exception", "timeout", "bad_return", "crash"):
        assert sum(r[f"reward/errors/{kind}"] for r in records) > 0, kind
    assert sum(r["reward/errors"] for r in records) == sum(
        r[f"reward/errors/{k}"] for r in records for k in ("exception", "timeout", "bad_return", "crash"))
