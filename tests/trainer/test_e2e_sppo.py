"""verl's SPPO recipe through its entry module's config (``rlfoundry.recipe.sppo.main_sppo``, ``sppo_trainer``)
on the tiny model: the batch the actor trains on carries SPPO's centred rewards, and the loss the actor
reports is SPPO's regression loss recomputed from that batch; and the recipe's keys at start-up."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from rlfoundry.algos.sppo import softmean
from rlfoundry.trainer.config import ConfigError, load_config
from rlfoundry.recipe.sppo.main_sppo import ENTRY
from tests.trainer import _e2e as E

BATCH = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]  # the packaged n=1 with verl's micro-batch


def _load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(ENTRY.overrides([*BATCH, *overrides]), config_name=ENTRY.config_name)


def _megatron():
    missing = [m for m in ("megatron", "mbridge") if importlib.util.find_spec(m) is None]
    return pytest.mark.skip(reason=f"not installed: {missing}") if missing else []


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", pytest.param("megatron", marks=_megatron())])
def test_the_actor_regresses_the_sequence_log_ratio_onto_the_soft_mean_centred_reward(tiny_model_dir, tmp_path, engine):
    # two different temperatures, so mixing them up (or dropping one) changes the numbers below
    beta, eta = 2.0, 0.5
    reward = E.write_reward_file(tmp_path)
    overrides = E.tiny_overrides(tiny_model_dir, tmp_path / "run", f"custom_reward_function.path={reward}",
                                 f"algorithm.sppo_eta={beta}", f"actor_rollout_ref.actor.sppo_eta={eta}",
                                 "trainer.total_training_steps=1",
                                 f"model_engine={'dp' if engine == 'fsdp' else engine}")
    # the overrides as main_sppo reads a command line
    run = E.train(ENTRY.overrides(overrides), keep_trainer=True, config_name=ENTRY.config_name)
    batch, record = run.batches[0], run.step(1)
    mask = batch["response_mask"].bool()
    scores = batch["token_level_scores"].sum(-1).double()
    assert scores.std() > 0  # the dense test reward spreads the 8 samples, so the centring is not vacuous
    # the estimator: R - SoftMean_beta(R) over all 8 rows (2 prompts x 4 samples; not per prompt), on the mask
    centred = scores - softmean(scores, beta)
    expected = torch.where(mask, centred.unsqueeze(-1), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(batch["advantages"].double(), expected, atol=1e-5, rtol=1e-5)
    # the loss: one mini-batch (8 rows, in two micro-batches of 4) before any step, so the policy is the one
    # that scored old_log_probs and log r_i = 0 up to float rounding; the loss is mean_i (0 - eta A_i)^2
    assert record["actor/log_ratio_mean"] == pytest.approx(0.0, abs=1e-3)
    assert record["actor/pg_loss"] == pytest.approx(float(((eta * centred) ** 2).mean()), rel=1e-3, abs=1e-5)
    assert record["actor/preference_mean"] == pytest.approx(float((eta * centred).mean()), abs=1e-3)
    assert "critic/vf_loss" not in record  # SPPO runs without a critic, as verl's recipe
    assert run.trainer.config.actor_rollout_ref.actor.strategy == engine  # the engine that ran the loss


@pytest.mark.slow
def test_the_update_fits_the_log_ratios_to_the_targets(tiny_model_dir, tmp_path):
    # two epochs over one mini-batch, no warm-up (the recipe's 15 steps start at lr 0): epoch 1 sees
    # log r = 0, so its loss is L0 = mean (eta A)^2; the logged pg_loss is the mean of both epochs' losses,
    # so epoch 2's is L1 = 2 pg_loss - L0. One Adam step must bring the log-ratios most of the way to their
    # targets (measured: L1 ~ 0.1 L0 at lr 1e-4), and their mean follows the targets' mean
    eta = 0.5
    reward = E.write_reward_file(tmp_path)
    overrides = E.tiny_overrides(tiny_model_dir, tmp_path / "run", f"custom_reward_function.path={reward}",
                                 "algorithm.sppo_eta=2.0", f"actor_rollout_ref.actor.sppo_eta={eta}",
                                 "trainer.total_training_steps=1", "actor_rollout_ref.actor.ppo_epochs=2",
                                 "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
                                 "actor_rollout_ref.actor.optim.lr=1e-4")
    run = E.train(ENTRY.overrides(overrides), config_name=ENTRY.config_name)
    scores, record = run.batches[0]["token_level_scores"].sum(-1).double(), run.step(1)
    first = float(((eta * (scores - softmean(scores, 2.0))) ** 2).mean())
    second = 2 * record["actor/pg_loss"] - first
    assert 0 <= second < 0.5 * first
    assert record["actor/log_ratio_mean"] * record["actor/preference_mean"] > 0  # epoch 2 moved towards the targets


def test_the_entry_config_is_verls_recipe():
    cfg = _load()
    actor = cfg.actor_rollout_ref.actor
    assert (cfg.algorithm.adv_estimator, actor.policy_loss.loss_mode) == ("sppo", "sppo")
    assert (cfg.algorithm.sppo_eta, actor.sppo_eta) == (1.0, 1.0)  # verl's defaults
    assert (actor.optim.lr_warmup_steps, cfg.actor_rollout_ref.rollout.n,
            cfg.actor_rollout_ref.rollout.val_kwargs.n) == (15, 1, 2)
    assert (cfg.critic.enable in (None, False)) and cfg.algorithm.use_kl_in_reward is False


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"], "adv_estimator=sppo writes.*set .*loss_mode=sppo"),
    (["algorithm.adv_estimator=grpo"], "loss_mode=sppo regresses.*Set algorithm.adv_estimator=sppo"),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], "loss_agg_mode=seq-mean-token-mean.*token-mean only"),
    (["algorithm.rollout_correction.rollout_is=token"], "rollout_is=token.*no importance weights"),
    (["algorithm.sppo_eta=abc"], "algorithm.sppo_eta"),
])
def test_a_broken_sppo_config_is_an_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=f"(?is){message}"):
        _load(*overrides)


VERL_RECIPE_YAML = """\
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    _target_: recipe.sppo.config.SPPOActorConfig
    sppo_eta: 0.25
algorithm:
  adv_estimator: null
  sppo_eta: 1.0
"""


def test_verls_own_recipe_yaml_runs_sppo_through_the_entry(tmp_path, monkeypatch):
    # verl's recipe file (its keys: the recipe's actor dataclass as _target_, adv_estimator null, which the
    # recipe's trainer never reads) given with --config-path: the entry still runs both SPPO halves
    (tmp_path / "recipe" / "sppo" / "config").mkdir(parents=True)
    (tmp_path / "recipe" / "sppo" / "config" / "sppo_trainer.yaml").write_text(VERL_RECIPE_YAML)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(ENTRY.overrides(BATCH), config_name="sppo_trainer", config_path="recipe/sppo/config")
    assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.actor.policy_loss.loss_mode) == ("sppo", "sppo")
    assert cfg.actor_rollout_ref.actor.sppo_eta == 0.25  # the file's value, typed on the actor


def test_an_sppo_eta_without_sppo_is_an_error_not_a_silent_no_op():
    base = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"]
    with pytest.raises(ConfigError, match="algorithm.sppo_eta=2.0 has no effect"):
        load_config([*base, "algorithm.sppo_eta=2"])
    with pytest.raises(ConfigError, match="actor.sppo_eta=0.5 has no effect"):
        load_config([*base, "actor_rollout_ref.actor.sppo_eta=0.5"])


def test_megatron_takes_the_same_loss():
    # the actor role brings the loss to any engine (workers/actor.py): SPPO is not refused on Megatron
    for overrides in (["model_engine=megatron"], ["actor_rollout_ref.actor.strategy=megatron"]):
        cfg = _load(*overrides)
        assert cfg.actor_rollout_ref.actor.strategy == "megatron"
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == cfg.algorithm.adv_estimator == "sppo"
