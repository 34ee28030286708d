"""SPPO's math (algos/sppo.py): the batch soft mean, the centred rewards and the squared regression loss,
against numbers derived by hand; and its registration in the registries the trainer reads."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlfoundry.algos import core_algos
from rlfoundry.algos.sppo import (compute_policy_loss_sppo, compute_sppo_outcome_advantage, sequence_values, softmean,
                                  sppo_sequence_losses)

LN2, LN3, LN1_5 = math.log(2.0), math.log(3.0), math.log(1.5)


@pytest.mark.parametrize(("beta", "expected"), [
    (1.0, LN2),                  # exp(x) = [1, 3]: mean 2, log 2
    (0.0, LN3 / 2),              # the arithmetic mean
    (2.0, math.log(5.0) / 2),    # exp(2x) = [1, 9]: mean 5, (log 5) / 2
    (-1.0, LN1_5),               # exp(-x) = [1, 1/3]: mean 2/3, log(2/3) / -1 = log 1.5 (towards the minimum)
])
def test_softmean_by_hand(beta, expected):
    x = torch.tensor([0.0, LN3], dtype=torch.float64)
    assert softmean(x, beta).item() == pytest.approx(expected, abs=1e-12)


def test_softmean_stays_finite_for_large_values():
    # exp(1000) overflows; the logsumexp form gives 1000 + (log((1 + 1)/2)) = 1000 for two equal values
    assert softmean(torch.tensor([1000.0, 1000.0], dtype=torch.float64), 1.0).item() == pytest.approx(1000.0)


def test_advantage_is_the_reward_centred_by_the_soft_mean_over_the_whole_batch():
    # sequence rewards R = [0, log 3] (token sums); with eta = 1 the soft mean is log 2 (above), so
    # A = [-log 2, log 3 - log 2 = log 1.5], broadcast over each row's mask, 0 elsewhere.
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, LN3, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # each row its own prompt group: a per-group centring would give 0 everywhere; verl's recipe centres
    # over the batch and ignores the groups
    adv, returns = compute_sppo_outcome_advantage(rewards, mask, index=["a", "b"], config={"sppo_eta": 1.0})
    expected = torch.tensor([[-LN2, -LN2, 0.0], [LN1_5, LN1_5, LN1_5]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)
    # eta = 0: the plain mean log(3)/2, so A = [-log(3)/2, +log(3)/2]; the argument wins over the config
    adv0, _ = compute_sppo_outcome_advantage(rewards, mask, sppo_eta=0.0, config={"sppo_eta": 1.0})
    assert adv0[0, 0].item() == pytest.approx(-LN3 / 2) and adv0[1, 2].item() == pytest.approx(LN3 / 2)


# Three rows, T = 3. Row 0: two valid tokens; the masked third would change the log-ratio if it counted
# (-9 vs -7). Row 1: three valid tokens. Row 2: no valid token (left out of the mean).
#   log r_0 = (-1 - 2) - (-1.5 - 2) = 0.5           log r_1 = (-0.5 - 0.5 - 1) - (-1 - 1 - 1) = 1.0
# advantages broadcast A = [0.25, -0.5, 0] (9.0 sits at row 0's masked position and must be ignored).
LOG_PROB = [[-1.0, -2.0, -9.0], [-0.5, -0.5, -1.0], [-3.0, -3.0, -3.0]]
OLD_LOG_PROB = [[-1.5, -2.0, -7.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
ADVANTAGES = [[0.25, 0.25, 9.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]]
MASK = [[1, 1, 0], [1, 1, 1], [0, 0, 0]]


def _inputs():
    log_prob = torch.tensor(LOG_PROB, dtype=torch.float64, requires_grad=True)
    return (torch.tensor(OLD_LOG_PROB, dtype=torch.float64), log_prob, torch.tensor(ADVANTAGES, dtype=torch.float64),
            torch.tensor(MASK))


def test_sequence_values_read_a_broadcast_advantage_on_the_mask():
    _, _, adv, mask = _inputs()
    torch.testing.assert_close(sequence_values(adv, mask), torch.tensor([0.25, -0.5, 0.0], dtype=torch.float64))


def test_sequence_losses_by_hand():
    old, log_prob, _, mask = _inputs()
    # eta = 2: targets [0.5, -1, 0]; losses (0.5 - 0.5)^2 = 0, (1 - (-1))^2 = 4, row 2: (0 - 0)^2 = 0
    losses, log_ratios, targets = sppo_sequence_losses(old, log_prob, torch.tensor([0.25, -0.5, 0.0]), mask, eta=2.0)
    torch.testing.assert_close(log_ratios.detach(), torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(targets, torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(losses.detach(), torch.tensor([0.0, 4.0, 0.0], dtype=torch.float64))


def test_policy_loss_value_gradient_and_metrics_by_hand():
    old, log_prob, adv, mask = _inputs()
    # eta = 1: targets [0.25, -0.5]; losses (0.5 - 0.25)^2 = 0.0625 and (1 + 0.5)^2 = 2.25 over the two
    # valid rows: mean 1.15625. d/d log pi_{i,t} = (2/2) (log r_i - target_i) m_{i,t}: 0.25 on row 0's two
    # valid tokens, 1.5 on row 1's three, 0 elsewhere (row 0's masked token and the empty row included).
    loss, metrics = core_algos.get_policy_loss_fn("sppo")(old, log_prob, adv, mask, "token-mean",
                                                         SimpleNamespace(sppo_eta=1.0))
    assert loss.item() == pytest.approx(1.15625)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.25, 0.25, 0.0], [1.5, 1.5, 1.5], [0.0, 0.0, 0.0]],
                                                           dtype=torch.float64))
    assert metrics["actor/log_ratio_mean"].item() == pytest.approx(0.75)  # (0.5 + 1) / 2
    assert metrics["actor/preference_mean"].item() == pytest.approx(-0.125)  # (0.25 - 0.5) / 2
    # ppo_kl = mean over the 5 valid tokens of log pi_old - log pi = (-0.5 + 0 - 0.5 - 0.5 + 0) / 5 = -0.3
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-0.3)


def test_policy_loss_uses_the_mini_batch_sequence_count_so_micro_batches_add_up():
    old, log_prob, adv, mask = _inputs()
    cfg = core_algos.with_global_batch_info(SimpleNamespace(sppo_eta=1.0), {"dp_size": 1, "global_batch_size": 2})
    fn = core_algos.get_policy_loss_fn("sppo")
    # micro-batches [row 0] and [rows 1, 2], each divided by the mini-batch's 2 valid rows: 0.0625/2 + 2.25/2
    parts = [fn(old[s], log_prob[s], adv[s], mask[s], "token-mean", cfg)[0] for s in (slice(0, 1), slice(1, 3))]
    assert parts[0].item() == pytest.approx(0.03125) and sum(parts).item() == pytest.approx(1.15625)
    # two data-parallel ranks, gradients averaged: each rank's loss is scaled by dp_size = 2
    cfg2 = core_algos.with_global_batch_info(SimpleNamespace(sppo_eta=1.0), {"dp_size": 2, "global_batch_size": 2})
    assert fn(old[:1], log_prob[:1], adv[:1], mask[:1], "token-mean", cfg2)[0].item() == pytest.approx(0.0625)


def test_policy_loss_refuses_what_verls_recipe_does_not_define():
    old, log_prob, adv, mask = _inputs()
    fn = core_algos.get_policy_loss_fn("sppo")
    with pytest.raises(ValueError, match="loss_agg_mode=token-mean only"):
        fn(old, log_prob, adv, mask, "seq-mean-token-mean", SimpleNamespace(sppo_eta=1.0))
    with pytest.raises(ValueError, match="no rollout importance weights"):
        fn(old, log_prob, adv, mask, "token-mean", SimpleNamespace(sppo_eta=1.0), torch.ones_like(old))


def test_both_halves_are_registered_wherever_the_algorithms_load():
    # a fresh interpreter that imports only verl's path to the algorithms, as a plain main_ppo run does
    # (never rlfoundry.algos.sppo by name): both names must be there
    code = ("import sys; from rlfoundry.trainer.ppo import core_algos as c; "
            "sys.exit(0 if 'sppo' in c.ADV_ESTIMATOR_REGISTRY and 'sppo' in c.POLICY_LOSS_REGISTRY else 3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert core_algos.get_adv_estimator_fn("sppo") is compute_sppo_outcome_advantage
    assert core_algos.get_policy_loss_fn("sppo") is compute_policy_loss_sppo
