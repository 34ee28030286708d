"""SPIN (verl's recipe/spin, arXiv:2401.01335): the DPO loss and the pairing against hand-derived numbers, the
loss's independence of micro-batching, its registration, the start-up checks that name their keys, the
reference's refresh / checkpoint schedule, and the tie rule surviving the trainer's pair ordering."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlfoundry.algos import core_algos
from rlfoundry.algos.spin import (compute_policy_loss_spin, compute_spin_preference, dpo_losses,
                                  reference_to_checkpoint, refreshes_reference)
from rlfoundry.config.roles import adv_estimator, need_reference_policy
from rlfoundry.config.typed import ConfigError
from rlfoundry.recipe.spin.main_spin import ENTRY, spin_overrides
from rlfoundry.trainer.config import load_config


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_dpo_losses_match_the_hand_derivation():
    z = torch.tensor([0.0, 2.0, -1.0])
    # sigmoid, beta 0.5: -log sigma(z / 2) = softplus(-z / 2) = ln 2, ln(1 + e^-1), ln(1 + e^0.5)
    want = [math.log(2.0), _softplus(-1.0), _softplus(0.5)]
    torch.testing.assert_close(dpo_losses(z, 0.5), torch.tensor(want))
    # label smoothing 0.1 at z = 2: 0.9 softplus(-1) + 0.1 softplus(1) = 0.9 * 0.313262 + 0.1 * 1.313262
    smoothed = dpo_losses(z, 0.5, label_smoothing=0.1)
    assert float(smoothed[1]) == pytest.approx(0.9 * _softplus(-1.0) + 0.1 * _softplus(1.0)) == pytest.approx(0.413262,
                                                                                                            abs=1e-6)
    # ipo, beta 0.5: (z - 1 / (2 * 0.5))^2 = (z - 1)^2
    torch.testing.assert_close(dpo_losses(z, 0.5, loss_type="ipo"), torch.tensor([1.0, 1.0, 4.0]))
    with pytest.raises(ValueError, match="dpo_loss_type='hinge'"):
        dpo_losses(z, 0.5, loss_type="hinge")


def test_the_pairing_ranks_a_prompts_two_samples_and_a_tie_goes_to_the_first():
    # rows: prompt a (scores 0, 1), prompt b (1, 1: a tie), prompt c (2, -1); interleaved a b c a b c
    rewards = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 2.0], [1.0, 0.0], [1.0, 0.0], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    index = np.array(list("abcabc"), dtype=object)
    adv, ret = compute_spin_preference(rewards, mask, index)
    # a: row 3 (1) beats row 0 (0); b: tie 1 = 1 -> row 1 (first); c: row 2 (2) beats row 5 (-1)
    label = torch.tensor([-1.0, 1.0, 1.0, 1.0, -1.0, -1.0]).unsqueeze(-1)
    torch.testing.assert_close(adv, label * mask)
    torch.testing.assert_close(ret, adv)
    assert core_algos.get_adv_estimator_fn("spin") is compute_spin_preference
    with pytest.raises(ValueError, match="rollout.n=2.*'a' has 3"):
        compute_spin_preference(rewards[:3], mask[:3], np.array(list("aaa"), dtype=object))


# Two pairs, T = 2, beta = 0.5 (S, R: the policy's / reference's summed log-probs over the mask)
#   pair 0: row 0 chosen   S = -2, R = -3 -> S - R = 1;   row 1 rejected S = -4, R = -3 -> -1;   z = 1 - (-1) = 2
#   pair 1: row 2 rejected S = -2, R = -2 -> 0;  row 3 chosen (token 1 masked) S = -3, R = -2 -> -1;  z = -1 - 0 = -1
# losses softplus(-1) = 0.313262, softplus(0.5) = 0.974077; the loss is their mean 0.643669
LOG_PROB = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0], [-3.0, 5.0]])
REF = torch.tensor([[-1.5, -1.5], [-2.0, -1.0], [-1.0, -1.0], [-2.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
LABEL = torch.tensor([1.0, -1.0, -1.0, 1.0]).unsqueeze(-1) * MASK
INDEX = torch.tensor([0, 0, 1, 1])
CFG = {"dpo_beta": 0.5}


def _loss(rows=slice(None), info=None):
    log_prob = LOG_PROB.clone()[rows].requires_grad_()
    config = core_algos.with_global_batch_info(CFG, info) if info else CFG
    loss, metrics = compute_policy_loss_spin(torch.zeros_like(log_prob), log_prob, LABEL[rows], MASK[rows],
                                             config=config, ref_log_prob=REF[rows], index=INDEX[rows])
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def test_the_loss_its_gradient_and_metrics_match_the_hand_derivation():
    loss, grad, metrics = _loss()
    assert float(loss) == pytest.approx((_softplus(-1.0) + _softplus(0.5)) / 2) == pytest.approx(0.643669, abs=1e-6)
    # d loss / d log pi_t = (1/2 pairs) (-beta sigma(-beta z)) (+1 chosen / -1 rejected) m_t:
    #   pair 0: 0.5 * 0.5 * sigma(-1) = 0.25 * 0.268941 = 0.067235
    #   pair 1: 0.25 * sigma(0.5) = 0.25 * 0.622459 = 0.155615
    a, b = 0.25 / (1 + math.exp(1.0)), 0.25 / (1 + math.exp(-0.5))
    torch.testing.assert_close(grad, torch.tensor([[-a, -a], [a, a], [b, b], [-b, 0.0]]))
    assert a == pytest.approx(0.067235, abs=1e-6) and b == pytest.approx(0.155615, abs=1e-6)
    # per-pair means: z (2, -1) -> 0.5; rewards_chosen beta (S_c - R_c) = (0.5, -0.5) -> 0; rejected (-0.5, 0)
    # -> -0.25; margins 0.25; accuracy (z > 0) 1/2; policy chosen S (-2, -3) -> -2.5; reference rejected (-3, -2)
    want = {"actor/dpo_logits": 0.5, "actor/rewards_chosen": 0.0, "actor/rewards_rejected": -0.25,
            "actor/rewards_margins": 0.25, "actor/rewards_accuracies": 0.5, "actor/policy_chosen_logps": -2.5,
            "actor/policy_rejected_logps": -3.0, "actor/reference_chosen_logps": -2.5,
            "actor/reference_rejected_logps": -2.5, "actor/dpo_loss": float(loss)}
    assert {k: pytest.approx(float(metrics[k]), abs=1e-6) for k in want} == want


def test_micro_batches_of_whole_pairs_give_the_mini_batchs_loss_and_gradient():
    loss, grad, metrics = _loss()
    info = {"global_batch_size": 4, "dp_size": 1}  # the mini-batch's 4 rows, as the actor passes them
    parts = [_loss(slice(0, 2), info), _loss(slice(2, 4), info)]
    assert float(parts[0][0] + parts[1][0]) == pytest.approx(float(loss))
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), grad)
    assert float(parts[0][2]["actor/dpo_logits"] + parts[1][2]["actor/dpo_logits"]) == pytest.approx(0.5)
    # ipo, beta 0.5: (2 - 1)^2 = 1 and (-1 - 1)^2 = 4 -> mean 2.5; smoothing reaches the loss through config
    ipo, _ = compute_policy_loss_spin(LOG_PROB, LOG_PROB, LABEL, MASK, config={**CFG, "dpo_loss_type": "ipo"},
                                      ref_log_prob=REF, index=INDEX)
    assert float(ipo) == pytest.approx(2.5)


def test_the_recipe_config_loads_with_verls_defaults_and_both_halves_are_registered():
    cfg = load_config(spin_overrides([]), config_name=ENTRY.config_name)
    actor = cfg.actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, cfg.algorithm.adv_estimator, actor.dpo_beta) == ("spin", "spin", 0.1)
    assert (cfg.algorithm.dpo_loss_type, cfg.algorithm.dpo_label_smoothing, cfg.trainer.ref_update_freq) == (
        "sigmoid", 0.0, 1)
    assert cfg.actor_rollout_ref.rollout.n == 2 and actor.optim.lr_warmup_steps == 15
    assert need_reference_policy(cfg) and not actor.use_kl_loss  # the DPO loss needs the reference by itself
    plain = load_config([])
    assert plain.trainer.ref_update_freq == -1 and not need_reference_policy(plain)  # the schema's: a fixed one
    assert core_algos.get_policy_loss_fn("spin") is compute_policy_loss_spin
    # verl's recipe yaml has adv_estimator: null; with SPIN's loss null means SPIN's pairing, as in verl
    bare = load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=spin", "actor_rollout_ref.rollout.n=2",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"])
    assert adv_estimator(bare) == "spin"


@pytest.mark.parametrize("overrides, named", [
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.dpo_beta=0", "algorithm.dpo_label_smoothing=0.5",
      "actor_rollout_ref.actor.shuffle=true"],
     ["rollout.n=4 with policy_loss.loss_mode=spin", "dpo_beta=0.0 must be > 0", "dpo_label_smoothing=0.5 must lie",
      "shuffle=True"]),
    (["algorithm.adv_estimator=grpo"],
     ["algorithm.adv_estimator=grpo with actor_rollout_ref.actor.policy_loss.loss_mode=spin"]),
    (["actor_rollout_ref.model.lora_rank=8"], ["trainer.ref_update_freq=1 with actor_rollout_ref.model.lora_rank=8"]),
    (["actor_rollout_ref.actor.strategy=megatron"],
     ["actor_rollout_ref.actor.strategy=megatron with policy_loss.loss_mode=spin"]),
    (["algorithm.dpo_loss_type=hinge"], ["dpo_loss_type"]),
])
def test_configs_spin_cannot_run_are_refused_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(spin_overrides(overrides), config_name=ENTRY.config_name)
    for text in named:
        assert text in str(err.value), (text, str(err.value))


def test_the_pairing_without_the_dpo_loss_is_refused():
    with pytest.raises(ConfigError, match="adv_estimator=spin writes SPIN's pair labels.*loss_mode=spin"):
        load_config(["algorithm.adv_estimator=spin", "actor_rollout_ref.rollout.n=2",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"])


@pytest.mark.parametrize("freq, refreshed, saved", [
    # steps 1..7; saved: the checkpoint after that step holds the reference (refreshed, and step + 1 does not)
    (-1, [], []),
    (1, [1, 2, 3, 4, 5, 6, 7], []),  # every step starts by refreshing: the saved one would never be read
    (2, [2, 4, 6], [2, 4, 6]),  # after 3: step 4 refreshes; after 1: still the model path's
    (3, [3, 6], [3, 4, 6, 7]),  # after 5: step 6 refreshes
])
def test_the_reference_is_refreshed_and_checkpointed_only_when_a_resume_needs_it(freq, refreshed, saved):
    steps = range(1, 8)
    assert [s for s in steps if refreshes_reference(s, freq)] == refreshed
    assert [s for s in steps if reference_to_checkpoint(s, freq)] == saved


def test_the_trainers_pair_ordering_keeps_generation_order_so_a_tie_goes_to_the_first_sample():
    """``order_groups`` (the trainer's SPIN row order) with balancing over 2 ranks moves whole pairs;
    each pair's rows stay in generation order, so with tied scores the first generated sample wins."""
    from rlfoundry.protocol import DataProto
    from rlfoundry.trainer.ppo.ray_trainer import order_groups

    # 4 prompts x 2 samples, generated interleaved (prompt-major, sample index 0 then 1); lengths make
    # Karmarkar-Karp pair prompts 0+3 and 1+2, so the balanced order is not the generation order
    uid = np.array(["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"], dtype=object)
    lengths = [9, 8, 6, 6, 5, 5, 2, 3]
    attention = torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])
    sample = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    data = DataProto.from_dict(tensors={"attention_mask": attention, "sample": sample},
                               non_tensors={"uid": uid})
    data, stats = order_groups(data, world_size=2, balance=True)
    assert stats["training/seqlen_max_rank_tokens"] == stats["training/seqlen_min_rank_tokens"] == 22  # 17 + 5, 12 + 10
    assert list(data.non_tensor_batch["uid"]) != list(uid)  # the balancer did move pairs
    assert data.batch["sample"].tolist() == [0, 1] * 4
    mask = torch.ones(8, 3)
    label, _ = compute_spin_preference(torch.zeros(8, 3), mask, data.non_tensor_batch["uid"])
    chosen = data.batch["sample"][label[:, 0] > 0]
    assert chosen.tolist() == [0, 0, 0, 0]
