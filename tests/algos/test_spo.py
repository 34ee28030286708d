"""SPO's math (algos/spo.py) on numbers worked out by hand, and the tracker's state round trip."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlfoundry.algos import core_algos, spo


def test_offline_prior_is_the_smoothed_rate_with_n_init_pseudo_counts():
    # clip_lower 0.875 -> N_init = 1 / 0.125 = 8; 3 wins of 4 -> 8 * 3.5 / 5 = 5.6, 8 * 1.5 / 5 = 2.4
    assert spo.offline_prior([1, 0, 1, 1], 4, 0.875) == pytest.approx((5.6, 2.4))
    # scores > 0 count as wins (0.5 yes; -1, 0 no); N is offline_N = 8 even with 3 scores (verl's formula):
    # alpha = 8 * 1.5 / 9 = 1.3333, beta = 8 * (8 - 1 + 0.5) / 9 = 6.6667
    assert spo.offline_prior([0.5, -1, 0], 8, 0.875) == pytest.approx((12 / 9, 60 / 9))
    # more scores than offline_N: N of them kept; all wins -> 8 * 4.5 / 5 = 7.2, 8 * 0.5 / 5 = 0.8
    assert spo.offline_prior([1] * 10, 4, 0.875, random.Random(0)) == pytest.approx((7.2, 0.8))
    assert spo.offline_prior([1, 1], 0, 0.875) == (0.5, 0.5)  # offline_N = 0: uninformed


def test_sampling_weights_are_the_outcome_std_plus_epsilon():
    # p = 1/2 -> sqrt(1/4) + 0.05 = 0.55; p = 3/4 -> sqrt(3/16) + 0.05 = 0.4830127; p = 1 -> 0.05
    w = spo.sampling_weights(np.array([1.0, 3.0, 1.0]), np.array([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(w, [0.55, 0.4330127 + 0.05, 0.05], rtol=1e-6)


def test_draw_prompts_follows_the_weights():
    rng = np.random.default_rng(0)
    assert spo.draw_prompts(np.array([0.0, 1.0, 0.0]), 1, rng).tolist() == [1]
    # more wanted than candidates: with replacement, and only the weighted one is drawn
    assert spo.draw_prompts(np.array([0.0, 2.0, 0.0]), 5, rng).tolist() == [1] * 5
    # all weights 0: uniform, so every index can come out
    assert set(spo.draw_prompts(np.zeros(3), 60, rng).tolist()) == {0, 1, 2}


def test_advantages_subtract_the_tracker_mean_and_normalise_over_the_batch():
    # raw = r - p_hat = [0.5, -0.5, 0.25, -0.25]; mean 0; unbiased var = 0.625 / 3; std = 0.4564355
    adv = spo.spo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.5, 0.5, 0.75, 0.25]))
    torch.testing.assert_close(adv, torch.tensor([1.0954451, -1.0954451, 0.5477226, -0.5477226]), atol=1e-5, rtol=0)


def test_the_registered_estimator_puts_the_scalar_on_every_response_token():
    fn = core_algos.get_adv_estimator_fn("spo")
    # sums 1 and 0, baselines 0.5: raw [0.5, -0.5], std sqrt(0.5) -> +-0.7071068 on the masked tokens
    adv, ret = fn(token_level_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
                  response_mask=torch.tensor([[1, 1], [1, 0]]), reward_baselines=torch.tensor([0.5, 0.5]))
    want = torch.tensor([[0.7071068, 0.7071068], [-0.7071068, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, want, atol=1e-6, rtol=0)


def test_kl_rho_halves_per_d_half_and_is_clipped():
    then = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
    now = torch.tensor([[-1.06, -2.0, -9.0], [-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: |diff| on the mask = [0.06, 0] -> D = 0.03 -> rho = 2 ** -0.5 = 0.7071068 (column 3 masked)
    # row 1: D = 0 -> rho = 1, clipped to 0.96
    rho, d = spo.kl_rho(then, now, mask, clip_lower=0.5)
    torch.testing.assert_close(d, torch.tensor([0.03, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rho, torch.tensor([0.7071068, 0.96]), atol=1e-5, rtol=0)
    rho, _ = spo.kl_rho(then, now, mask, clip_lower=0.875)  # 0.7071 is below the floor
    torch.testing.assert_close(rho, torch.tensor([0.875, 0.96]), atol=1e-6, rtol=0)


def test_update_beta_forgets_then_counts_the_outcome():
    # (2, 1) with rho 0.5 and a win -> (1 + 1, 0.5 + 0); with rho 0.9 and a loss -> (1.8, 0.9 + 1)
    alpha, beta = spo.update_beta(torch.tensor([2.0, 2.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.9]),
                                  torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(alpha, torch.tensor([2.0, 1.8]))
    torch.testing.assert_close(beta, torch.tensor([0.5, 1.9]))


def test_the_tracker_restricts_to_its_table_and_round_trips_through_a_checkpoint(tmp_path):
    from types import SimpleNamespace

    from rlfoundry import checkpoint as ckpt
    from rlfoundry.trainer.ppo.spo import SPOTracker

    table = tmp_path / "offline.json"
    table.write_text('{"a": [1, 0, 1, 1], "b": [0, 0, 0, 0]}')
    cfg = SimpleNamespace(offline_values=str(table), offline_N=4, rho=SimpleNamespace(clip_lower=0.875))
    tracker = SPOTracker(cfg)
    # a: (5.6, 2.4) -> p = 0.7; b: (0.8, 7.2) -> p = 0.1; c is not in the table: weight 0, prior (0.5, 0.5)
    torch.testing.assert_close(tracker.baselines(["a", "b", "c"]), torch.tensor([0.7, 0.1, 0.5]))
    np.testing.assert_allclose(tracker.weights(["a", "b", "c"]), [0.21 ** 0.5 + 0.05, 0.09 ** 0.5 + 0.05, 0.0])
    # a drawn twice: the last row's update stays: 0.5 * 5.6 + 0 = 2.8, 0.5 * 2.4 + 1 = 2.2
    tracker.update(["a", "a"], torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]))
    assert (tracker.alpha["a"], tracker.beta["a"], tracker.visits["a"]) == pytest.approx((2.8, 2.2, 2))
    tracker.rows["a"] = {"responses": torch.tensor([[5, 6]])}
    tracker.log_probs["a"] = torch.tensor([[-0.5, -0.25]])
    ckpt.save_trainer_state(tmp_path / "data.pt", {"spo_tracker": tracker.state_dict()})
    restored = SPOTracker(cfg)
    restored.load_state_dict(ckpt.load_trainer_state(tmp_path / "data.pt")["spo_tracker"])
    torch.testing.assert_close(restored.baselines(["a", "b"]), tracker.baselines(["a", "b"]))
    assert restored.visits == {"a": 2} and torch.equal(restored.log_probs["a"], tracker.log_probs["a"])


def test_stack_rows_pads_prompts_left_and_responses_right():
    from rlfoundry.trainer.ppo.spo import stack_rows

    short = {"prompts": torch.tensor([[7]]), "responses": torch.tensor([[8]]), "input_ids": torch.tensor([[7, 8]]),
             "attention_mask": torch.tensor([[1, 1]]), "response_mask": torch.tensor([[1]])}
    long = {"prompts": torch.tensor([[1, 2]]), "responses": torch.tensor([[3, 4]]),
            "input_ids": torch.tensor([[1, 2, 3, 4]]), "attention_mask": torch.tensor([[1, 1, 1, 1]]),
            "response_mask": torch.tensor([[1, 1]])}
    out = stack_rows([short, long], pad_id=0).batch
    assert out["input_ids"].tolist() == [[0, 7, 8, 0], [1, 2, 3, 4]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 0], [1, 1, 1, 1]]
    assert out["responses"].tolist() == [[8, 0], [3, 4]] and out["prompts"].tolist() == [[0, 7], [1, 2]]


def test_start_up_errors_name_the_key(tmp_path):
    from rlfoundry.config.typed import ConfigError
    from rlfoundry.trainer.config import load_config

    # format=spo is spo_tool_agent's: another loop would parse tool-call markup the model never writes
    with pytest.raises(ConfigError, match=r"multi_turn.format=spo with actor_rollout_ref.rollout.agent."
                                          r"default_agent_loop=tool_agent: only the spo_tool_agent loop reads"):
        load_config(["actor_rollout_ref.rollout.multi_turn.format=spo",
                     "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"])
    for loop in ("spo_tool_agent", "null"):
        load_config(["actor_rollout_ref.rollout.multi_turn.format=spo",
                     f"actor_rollout_ref.rollout.agent.default_agent_loop={loop}"])
    # a vision-language model: rho=kl would recompute log-probs without the images; constant is fine
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text('{"model_type": "qwen2_vl", "vision_config": {"depth": 1}}')
    with pytest.raises(ConfigError, match=r"trainer.spo.rho.type=kl with a vision-language model"):
        load_config(["trainer.spo.enable=true", f"actor_rollout_ref.model.path={vlm}"])
    load_config(["trainer.spo.enable=true", f"actor_rollout_ref.model.path={vlm}", "trainer.spo.rho.type=constant"])
    with pytest.raises(ConfigError, match=r"trainer.spo.offline_values=.*nowhere.json is not a file"):
        load_config(["trainer.spo.enable=true", f"trainer.spo.offline_values={tmp_path / 'nowhere.json'}"])
    with pytest.raises(ConfigError, match=r"trainer.spo.rho.clip_lower=1.0 must be in \[0, 1\)"):
        load_config(["trainer.spo.enable=true", "trainer.spo.rho.clip_lower=1.0"])
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator=spo needs the tracker's baselines"):
        load_config(["algorithm.adv_estimator=spo"])
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.enable with trainer.spo.enable=true"):
        load_config(["trainer.spo.enable=true", "algorithm.filter_groups.enable=true",
                     "algorithm.filter_groups.metric=acc"])
    # SPO changes no actor: the Megatron engine's config is accepted (its compute_log_prob serves the tracker)
    cfg = load_config(["trainer.spo.enable=true"], config_name="ppo_megatron_trainer")
    assert cfg.trainer.spo.enable and cfg.actor_rollout_ref.actor.strategy == "megatron"
