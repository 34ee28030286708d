"""Rollout correction (algos/rollout_corr.py) on hand-built log ratios: every weight, mask and metric
below is derived by hand from the definitions (verl 0.9's rollout_corr_helper formulas)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlfoundry.algos import core_algos
from rlfoundry.algos.rollout_corr import (
    importance_weights,
    mismatch_metrics,
    rejection_mask,
    rollout_correction,
    veto_mask,
)


def _log(*values):
    return torch.tensor([list(v) for v in values], dtype=torch.float32).log()


def test_token_level_truncated_weights_and_their_metrics():
    log_ratio, mask = _log([1.0, 3.0, 0.5]), torch.ones(1, 3)
    weights, m = importance_weights(log_ratio, mask, "token", threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 0.5]]))
    assert m["rollout_is_mean"] == pytest.approx(1.5)  # of the ratios before truncation
    assert (m["rollout_is_max"], m["rollout_is_min"]) == (pytest.approx(3.0), pytest.approx(0.5))
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3) and m["rollout_is_ratio_fraction_low"] == 0
    bounded = torch.tensor([1.0, 2.0, 0.5])  # ratios clamped to [1/2, 2] for std and ESS
    assert m["rollout_is_std"] == pytest.approx(bounded.std(unbiased=False).item(), rel=1e-5)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / ((bounded / bounded.mean()) ** 2).mean().item(), rel=1e-5)
    assert not weights.requires_grad


def test_sequence_level_weights_are_the_product_broadcast_and_padding_gets_zero():
    log_ratio = _log([2.0, 2.0], [0.5, 7.0])  # row 1's second token is padding: its ratio is ignored
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights, m = importance_weights(log_ratio, mask, "sequence", threshold=5.0)
    torch.testing.assert_close(weights, torch.tensor([[4.0, 4.0], [0.5, 0.0]]))
    assert m["rollout_is_max"] == pytest.approx(4.0) and m["rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_is_ratio_fraction_high"] == 0.0  # one ratio per sequence: 4 and 0.5 are within [0.2, 5]
    normed, m = importance_weights(log_ratio, mask, "sequence", threshold=5.0, batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(2.25)  # (4 + 0.5) / 2 sequences
    torch.testing.assert_close(normed, weights / 2.25)


def test_rejection_by_token_sequence_and_geometric_mean():
    mask = torch.ones(2, 2)
    log_ratio = _log([1.0, 3.0], [4.0, 1.0])
    kept, m = rejection_mask(log_ratio, mask, "token", upper=2.0)  # lower = 1/2
    torch.testing.assert_close(kept, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.5) and m["rollout_rs_seq_masked_fraction"] == 1.0
    kept, _ = rejection_mask(log_ratio, mask, "sequence", upper=3.5)  # products 3 and 4
    torch.testing.assert_close(kept, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    kept, m = rejection_mask(log_ratio, mask, "geometric", upper=1.9)  # geometric means √3 ≈ 1.73 and 2
    torch.testing.assert_close(kept, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert m["rollout_rs_seq_masked_fraction"] == 0.5
    kept, _ = rejection_mask(log_ratio, mask, "token", upper=5.0, lower=2.0)  # an explicit lower bound
    torch.testing.assert_close(kept, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))


def test_veto_drops_whole_sequences_with_a_catastrophic_token():
    log_ratio, mask = _log([1.0, 1e-5, 1.0], [1.0, 0.9, 1e-5]), torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    kept, m = veto_mask(log_ratio, mask, threshold=1e-4)  # row 1's tiny ratio sits on padding: ignored
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0, 0], [1, 1, 0]]))
    assert m["rollout_is_veto_fraction"] == 0.5 and m["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)


def test_mismatch_metrics_by_hand():
    old, rollout, mask = _log([0.5]), _log([0.25]), torch.ones(1, 1)  # ρ = 2
    m = mismatch_metrics(old, rollout, mask)
    assert m["kl"] == pytest.approx(-math.log(2))  # E[log π_rollout − log π_train]
    assert m["k3_kl"] == pytest.approx(2 - math.log(2) - 1)
    assert (m["training_ppl"], m["rollout_ppl"], m["ppl_ratio"]) == (pytest.approx(2.0), pytest.approx(4.0),
                                                                       pytest.approx(0.5))
    assert m["chi2_token"] == pytest.approx(3.0) and m["chi2_seq"] == pytest.approx(3.0)
    same = mismatch_metrics(old, old, mask)
    assert same["kl"] == 0 and same["k3_kl"] == 0 and same["chi2_token"] == pytest.approx(0.0)


def test_the_combined_call_and_an_on_policy_batch_changes_nothing():
    old = torch.randn(3, 4).clamp(max=-0.1)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    weights, kept, m = rollout_correction(old, old.clone(), mask, rollout_is="token", rollout_rs="sequence",
                                          rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4)
    torch.testing.assert_close(weights, mask)  # ρ = 1 everywhere
    torch.testing.assert_close(kept, mask)
    assert m["rollout_corr/kl"] == 0 and m["rollout_corr/rollout_rs_masked_fraction"] == 0
    assert all(k.startswith("rollout_corr/") for k in m)
    weights, kept, m = rollout_correction(old, old - torch.log(torch.tensor(4.0)), mask, rollout_is="token",
                                          rollout_rs="token", rollout_rs_threshold=2.0)  # ρ = 4 everywhere
    torch.testing.assert_close(weights, 2.0 * mask)  # computed on the mask before rejection
    assert kept.sum() == 0 and m["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    with pytest.raises(ValueError, match="rollout_rs_threshold is null"):
        rollout_correction(old, old, mask, rollout_rs="token")
    with pytest.raises(ValueError, match="rollout_is='tokens'"):
        rollout_correction(old, old, mask, rollout_is="tokens")


def test_the_policy_loss_is_weighted_token_by_token():
    """The weights reach the loss: weighting a token by 2 equals counting its loss twice."""
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, adv, mask = torch.tensor([[-1.1, -1.9]]), torch.tensor([[1.0, -0.5]]), torch.ones(1, 2)
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, policy_loss=None)
    weighted, _ = loss_fn(old, log_prob, adv, mask, "token-mean", cfg, rollout_is_weights=torch.tensor([[2.0, 1.0]]))
    plain, _ = loss_fn(old, log_prob, adv, mask, "token-mean", cfg)
    per_token, _ = loss_fn(old[:, :1], log_prob[:, :1], adv[:, :1], mask[:, :1], "token-mean", cfg)
    torch.testing.assert_close(weighted, plain + per_token / 2)  # (2·l0 + l1)/2 = (l0 + l1)/2 + l0/2


def _bypass_cfg(**correction):
    rc = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None,
          "rollout_rs_threshold_lower": None, "rollout_token_veto_threshold": None,
          "rollout_is_batch_normalize": False, "loss_type": "ppo_clip", **correction}
    return SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                           policy_loss=SimpleNamespace(loss_mode="bypass_mode", rollout_correction=rc))


def test_bypass_reinforce_weights_each_tokens_gradient_by_its_truncated_ratio():
    """loss = token-mean(−A·w·log π_θ), w = min(π_θ / π_rollout, 2) without gradient: d loss / d log π_t = −A_t w_t / N."""
    log_prob = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -3.0, -0.25]])  # ratios 1, e ≈ 2.72 (truncated to 2), e^-0.25 ≈ 0.78
    adv, mask = torch.tensor([[1.0, 2.0, -1.0]]), torch.ones(1, 3)
    loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
    loss, m = loss_fn(rollout, log_prob, adv, mask, "token-mean", _bypass_cfg(loss_type="reinforce", rollout_is="token"))
    (grad,) = torch.autograd.grad(loss, log_prob)
    w = torch.tensor([1.0, 2.0, math.exp(-0.25)])
    torch.testing.assert_close(grad, -(adv * w) / 3)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.e, rel=1e-5)
    loss, _ = loss_fn(rollout, log_prob, adv, mask, "token-mean", _bypass_cfg(loss_type="reinforce"))
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, -adv / 3)  # no rollout_is: plain REINFORCE


def test_bypass_ppo_clip_is_ppo_on_the_rollouts_log_probs_over_the_tokens_rejection_keeps():
    log_prob = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rollout, adv, mask = torch.tensor([[-1.05, -3.0, -0.45]]), torch.tensor([[1.0, 2.0, -1.0]]), torch.ones(1, 3)
    bypass = core_algos.get_policy_loss_fn("bypass_mode")
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    cfg = _bypass_cfg()
    torch.testing.assert_close(bypass(rollout, log_prob, adv, mask, "token-mean", cfg)[0],
                               vanilla(rollout, log_prob, adv, mask, "token-mean", cfg)[0])
    cfg = _bypass_cfg(rollout_rs="token", rollout_rs_threshold=2.0)  # the middle token's ratio e > 2: out
    kept = torch.tensor([[1.0, 0.0, 1.0]])
    torch.testing.assert_close(bypass(rollout, log_prob, adv, mask, "token-mean", cfg)[0],
                               vanilla(rollout, log_prob, adv, kept, "token-mean", cfg)[0])
    with pytest.raises(ValueError, match="needs actor.policy_loss.rollout_correction"):
        bypass(rollout, log_prob, adv, mask, "token-mean", SimpleNamespace(policy_loss=SimpleNamespace()))


# verl >= 0.7's divergence options (k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho).
# Row 0 log ratios 0, 0.1, -0.2; row 1: 0.5, 0 and a padding token whose 3.0 must not count.
_LOG_RATIO = torch.tensor([[0.0, 0.1, -0.2], [0.5, 0.0, 3.0]])
_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_divergence_rejection_by_hand():
    from rlfoundry.algos.rollout_corr import divergence_rejection_mask

    # token_k1 in [log 0.9, log 1.1] = [-0.1054, 0.0953]: k1 = 0, -0.1, 0.2 | -0.5, 0 -> keep 1,1,0 | 0,1
    kept, m = divergence_rejection_mask(_LOG_RATIO, _MASK, ["token_k1"], "0.9_1.1")
    assert kept.tolist() == [[1, 1, 0], [0, 1, 0]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    # seq_max_k2 <= 0.1: row maxima 0.5*0.2^2 = 0.02 (kept), 0.5*0.5^2 = 0.125 (the padding's 4.5 ignored)
    kept, _ = divergence_rejection_mask(_LOG_RATIO, _MASK, ["seq_max_k2"], 0.1)
    assert kept.tolist() == [[1, 1, 1], [0, 0, 0]]
    # both (AND), one spec per option: 3 of 5 tokens dropped, both rows touched
    kept, m = divergence_rejection_mask(_LOG_RATIO, _MASK, ["token_k1", "seq_max_k2"], "0.9_1.1,0.1")
    assert kept.tolist() == [[1, 1, 0], [0, 0, 0]]
    assert (m["rollout_rs_masked_fraction"], m["rollout_rs_seq_masked_fraction"]) == (pytest.approx(0.6), 1.0)
    # seq_mean_k3 <= 0.01: row 0 (0 + 0.0051709 + 0.0187308) / 3 = 0.00797 kept; row 1 0.1487213 / 2 = 0.0744 not
    kept, _ = divergence_rejection_mask(_LOG_RATIO, _MASK, ["seq_mean_k3"], "0.01")
    assert kept.tolist() == [[1, 1, 1], [0, 0, 0]]
    # seq_sum_k1 with a bare upper bound 2: [1/2, 2] in logs; sums of k1 are 0.1 and -0.5: both kept
    kept, _ = divergence_rejection_mask(_LOG_RATIO, _MASK, ["seq_sum_k1"], 2.0)
    assert kept.tolist() == _MASK.tolist()


def test_divergence_threshold_specs_and_the_combined_call():
    from rlfoundry.algos.rollout_corr import parse_rs_thresholds, rs_options

    assert rs_options("token") is None and rs_options("token_k1, seq_max_k2,token_k1") == ["token_k1", "seq_max_k2"]
    assert parse_rs_thresholds(["token_k1", "seq_max_k2"], "0.6_1.6,2.5") == {"token_k1": (0.6, 1.6),
                                                                           "seq_max_k2": (None, 2.5)}
    assert parse_rs_thresholds(["token_k1"], 4) == {"token_k1": (0.25, 4.0)}
    for options, spec, message in ((["seq_max_k2"], "1_2", "one upper bound"), (["token_k1", "token_k2"], "1,2,3", "one per"),
                                   (["token_k1"], "0_1", "> 0")):
        with pytest.raises(ValueError, match=message):
            parse_rs_thresholds(options, spec)
    with pytest.raises(ValueError, match="seq_max_k1"):
        rs_options("seq_max_k1")
    old = torch.zeros_like(_LOG_RATIO)
    _, mask, metrics = rollout_correction(old, old - _LOG_RATIO, _MASK, rollout_rs="token_k1,seq_max_k2",
                                          rollout_rs_threshold="0.9_1.1,0.1")
    assert mask.tolist() == [[1, 1, 0], [0, 0, 0]] and "rollout_corr/rollout_rs_token_k1_masked_fraction" in metrics


def test_icepop_threshold_keeps_ratios_within_bounds_and_zeroes_the_rest():
    from rlfoundry.algos.rollout_corr import importance_weights, parse_is_threshold

    assert parse_is_threshold(2.0) == (None, 2.0) and parse_is_threshold("0.5_4.0") == (0.5, 4.0)
    assert parse_is_threshold("3") == (None, 3.0)
    for bad in ("4_0.5", "0_2", "x", True):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            parse_is_threshold(bad)
    # token ratios e^0 = 1, e^0.1 = 1.105, e^-0.2 = 0.819 | e^0.5 = 1.649, e^0 = 1 (the padding's e^3 dropped)
    weights, m = importance_weights(_LOG_RATIO, _MASK, "token", "0.9_1.5")
    expected = [[1.0, math.exp(0.1), 0.0], [0.0, 1.0, 0.0]]  # 0.819 < 0.9 and 1.649 > 1.5: zero, not truncated
    torch.testing.assert_close(weights, torch.tensor(expected))
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    truncated, _ = importance_weights(_LOG_RATIO, _MASK, "token", 1.5)
    assert truncated[1, 0] == pytest.approx(1.5) and truncated[0, 2] == pytest.approx(math.exp(-0.2))
