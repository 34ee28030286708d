"""``algorithm.filter_groups`` (DAPO dynamic sampling) through the trainer.

The test reward makes half of the groups uninformative by construction: prompts with an even dataset
index score a constant, odd ones score by their response text (so their samples differ). The update
must see exactly ``data.train_batch_size`` groups, all odd, each varying; the loader must have moved
on by every batch generated; and a reward under which no group varies must stop the run with a
message that says what to change.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info["index"] % 2 == 0:
            return {"score": 0.5, "acc": 0.5}
        score = (sum(ord(c) for c in solution_str) % 11) / 10.0
        return {"score": score, "acc": score}
''')
CONSTANT = 'def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n'


def _run(model, tmp_path, reward_text, *extra):
    reward = tmp_path / "reward.py"
    reward.write_text(reward_text)
    # spelled as verl >= 0.7's DAPO recipe spells its reward (reward.*; the older keys are tested alike)
    return E.train(E.tiny_overrides(model, tmp_path / "run", f"reward.custom_reward_function.path={reward}",
                                    "reward.reward_manager.name=dapo", "algorithm.filter_groups.enable=true",
                                    *extra), keep_trainer=True)


def test_only_informative_groups_reach_the_update(tiny_model_dir, tmp_path):
    run = _run(tiny_model_dir, tmp_path, REWARD, "algorithm.filter_groups.metric=acc",
               "actor_rollout_ref.rollout.temperature=1.5")
    generated = dropped = 0
    for step, batch in enumerate(run.batches, start=1):
        record = run.step(step)
        groups = E.groups(batch)
        assert len(groups) == 2  # data.train_batch_size prompts' worth, whatever was generated
        for rows in groups.values():
            assert all(batch["extra_info"][r]["index"] % 2 == 1 for r in rows)  # the constant ones were dropped
            assert np.std([float(batch["token_level_scores"][r].sum()) for r in rows]) > 0
        assert record["train/kept_groups"] + record["train/dropped_groups"] == 2 * record["train/num_gen_batches"]
        assert record["train/kept_groups"] >= 2
        generated += record["train/num_gen_batches"]
        dropped += record["train/dropped_groups"]
    assert dropped >= 1  # the even prompts met on the way were dropped
    # the loader moved on by every batch generated (the checkpoint's loader state: resume continues there)
    assert 3 <= generated < 8  # within the first epoch of 16 / 2 batches
    assert run.trainer.train_dataloader.state_dict()["_num_yielded"] == generated


@pytest.mark.numerics
def test_a_run_resumed_mid_way_gets_the_same_batches_as_the_straight_run(tiny_model_dir, tmp_path):
    """The checkpoint holds the loader past every batch generated (kept or dropped) and the RNG: the
    resumed run's step 3 draws the same batches, keeps the same groups and samples the same tokens."""
    extra = ("algorithm.filter_groups.metric=acc", "actor_rollout_ref.rollout.temperature=1.5")
    for name in ("straight", "split"):
        (tmp_path / name).mkdir()
    straight = _run(tiny_model_dir, tmp_path / "straight", REWARD, *extra, "trainer.total_training_steps=3")
    _run(tiny_model_dir, tmp_path / "split", REWARD, *extra, "trainer.total_training_steps=2", "trainer.save_freq=2")
    resumed = _run(tiny_model_dir, tmp_path / "split", REWARD, *extra, "trainer.total_training_steps=3")
    assert len(resumed.batches) == 1
    for key in ("responses", "token_level_scores", "advantages", "old_log_probs"):
        # resume repeats the straight run's arithmetic (bit for bit in practice); a resume bug (another batch or lost
        # optimiser state) moves these by >1e-2
        np.testing.assert_allclose(resumed.batches[0][key], straight.batches[-1][key], atol=1e-6, err_msg=key)
    assert [i["index"] for i in resumed.batches[0]["extra_info"]] == [i["index"] for i in straight.batches[-1]["extra_info"]]
    for key in ("train/num_gen_batches", "train/kept_groups", "train/dropped_groups", "actor/pg_loss"):
        # resume repeats the straight run's arithmetic (bit for bit in practice); a resume bug (another batch or lost
        # optimiser state) moves these by >1e-2
        assert resumed.step(3)[key] == pytest.approx(straight.step(3)[key], rel=1e-5, abs=1e-7), key


def test_when_no_group_varies_the_run_stops_and_says_what_to_change(tiny_model_dir, tmp_path):
    with pytest.raises(RuntimeError, match=r"3 generated batches \(max_num_gen_batches=3\) kept 0 of the 2 "
                                           r"informative groups needed.*Raise algorithm.filter_groups.max_num_gen_batches"):
        _run(tiny_model_dir, tmp_path, CONSTANT, "algorithm.filter_groups.metric=seq_reward",
             "algorithm.filter_groups.max_num_gen_batches=3")


def test_a_metric_the_reward_function_does_not_give_is_named(tiny_model_dir, tmp_path):
    with pytest.raises(RuntimeError, match=r"metric='nope' is neither seq_reward, seq_final_reward nor a "
                                           r"reward_extra_info key of the reward function \(it gives \['acc', 'score'\]\)"):
        _run(tiny_model_dir, tmp_path, REWARD, "algorithm.filter_groups.metric=nope")


@pytest.mark.parametrize("overrides, message", [
    ([], "needs algorithm.filter_groups.metric"),
    (["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"], "use seq_reward"),
    (["algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=-1"], "must be >= 0"),
])
def test_bad_filter_groups_configs_say_what_to_change(overrides, message):
    from rlfoundry.trainer.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(["algorithm.filter_groups.enable=true", *overrides]))
