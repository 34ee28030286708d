"""Advantage estimators: hand-worked examples, loop references for the vectorised code, invariants."""

import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfoundry.algos import core_algos as ca
from rlfoundry.utils import torch_functional as F_

EPS = 1e-6


def _close(a, b, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               atol=atol, rtol=0)


def _outcome(scores, length=3):
    """Rewards with each score on the last token, full masks. (B,) -> (B, length) x 2."""
    scores = torch.tensor(scores, dtype=torch.float32)
    rewards = torch.zeros(len(scores), length)
    rewards[:, -1] = scores
    return rewards, torch.ones(len(scores), length)


# ───────────── GAE ─────────────


def test_gae_2x3_by_hand():
    # gamma = lam = 0.5.  delta_t = r_t + gamma V_next - V_t ;  A_t = delta_t + gamma lam A_next (gamma lam = 0.25)
    # row 0: r = [0, 0, 1], V = [.5, .5, .5], all valid
    #   t=2: delta = 1 - .5 = .5                     A2 = .5
    #   t=1: delta = 0 + .5*.5 - .5 = -.25           A1 = -.25 + .25*.5   = -.125
    #   t=0: delta = -.25                            A0 = -.25 + .25*-.125 = -.28125
    #   returns = A + V = [.21875, .375, 1.0]
    # row 1: r = [0, 2, 9], V = [1, 1, 7], position 2 masked: its 9 and 7 must not enter
    #   t=1: delta = 2 + 0 - 1 = 1                   A1 = 1
    #   t=0: delta = 0 + .5*1 - 1 = -.5              A0 = -.5 + .25*1 = -.25
    #   returns = [.75, 2.0, 0 (masked)]
    # whitening over the 5 valid A's [-.28125, -.125, .5, -.25, 1]: mean .16875,
    #   deviations [-.45, -.29375, .33125, -.41875, .83125], sum of squares 1.26484375, unbiased var .3162109375
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.5)
    _close(ret, [[0.21875, 0.375, 1.0], [0.75, 2.0, 0.0]])
    sd = math.sqrt(0.3162109375 + 1e-8)
    _close(adv, [[-0.45 / sd, -0.29375 / sd, 0.33125 / sd], [-0.41875 / sd, 0.83125 / sd, 0.0]])


def test_gae_skips_masked_middle_position():
    # gamma = 1, lam = 1: A_t = sum of future valid rewards - V_t; the masked middle token (observation)
    # is skipped: r = [0, 5, 1], V = [0, 100, 0], mask [1, 0, 1] -> A2 = 1, A0 = 0 + 1*V2 - V0 + A2 = 1
    # (before whitening), returns = [1, 0, 1]
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.0, 100.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    _, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    _close(ret, [[1.0, 0.0, 1.0]])


def test_gae_reads_gamma_lam_from_config():
    rewards, mask = _outcome([1.0, 0.0])
    values = torch.zeros_like(rewards)
    a1, r1 = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    a2, r2 = ca.compute_gae_advantage_return(rewards, values, mask, config=SimpleNamespace(gamma=0.9, lam=0.8))
    _close(a1, a2)
    _close(r1, r2)


def _gae_reference(rewards, values, mask, gamma, lam):
    """Straight per-sequence loop over the valid positions only (independent of the vectorised code)."""
    raw = torch.zeros_like(rewards, dtype=torch.float64)
    for i in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        next_v, next_a = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[i, t].item() + gamma * next_v - values[i, t].item()
            next_a = delta + gamma * lam * next_a
            next_v = values[i, t].item()
            raw[i, t] = next_a
    return raw


masks_2x5 = st.lists(st.booleans(), min_size=10, max_size=10).filter(lambda b: sum(b) >= 2)


@settings(max_examples=50, deadline=None)
@given(bits=masks_2x5, seed=st.integers(0, 2**16), gamma=st.floats(0.5, 1.0), lam=st.floats(0.5, 1.0))
def test_gae_matches_reference_and_masked_junk_does_not_leak(bits, seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(2, 5, generator=g, dtype=torch.float64)
    values = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor(bits, dtype=torch.float64).view(2, 5)
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
    raw = _gae_reference(rewards, values, mask, gamma, lam)
    _close(ret, (raw + values) * mask, atol=1e-9)
    if F_.masked_var(raw, mask) > 1e-6:
        _close(adv, F_.masked_whiten(raw, mask) * mask, atol=1e-6)
    # junk (huge values, NaN) at masked positions changes nothing
    junk_r = torch.where(mask.bool(), rewards, torch.full_like(rewards, float("nan")))
    junk_v = torch.where(mask.bool(), values, torch.full_like(values, 1e6))
    adv2, ret2 = ca.compute_gae_advantage_return(junk_r, junk_v, mask, gamma=gamma, lam=lam)
    _close(adv2, adv, atol=0)
    _close(ret2, ret, atol=0)


# ───────────── GRPO / Dr.GRPO ─────────────


def test_grpo_two_groups_with_a_singleton_by_hand():
    # group a: scores [1, 0, 2] -> mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1 -> A = [0, -1, 1] / (1 + eps)
    # group b: single response, score 5 -> mean 0, std 1 -> A = 5 / (1 + eps) (keeps its raw score)
    rewards, mask = _outcome([1.0, 0.0, 2.0, 5.0])
    mask[3, 2] = 0.0  # the last token of b is padding (its reward is still summed, as verl does)
    index = np.array(["a", "a", "a", "b"], dtype=object)
    adv, ret = ca.compute_grpo_outcome_advantage(rewards, mask, index)
    expected = torch.tensor([0.0, -1.0, 1.0, 5.0]) / (1 + EPS)
    _close(adv, expected.unsqueeze(-1) * mask)
    assert ret is adv


def test_dr_grpo_does_not_divide_by_std():
    # Dr.GRPO: A = score - group mean: a -> [0, -1, 1]; b (singleton) -> 5
    rewards, mask = _outcome([1.0, 0.0, 2.0, 5.0])
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, np.array([7, 7, 7, 9]), norm_adv_by_std_in_grpo=False)
    _close(adv[:, 0], [0.0, -1.0, 1.0, 5.0])


def test_grpo_identical_scores_give_zero_not_nan():
    # std 0 -> (s - mean) / (0 + eps) = 0 / eps = 0
    rewards, mask = _outcome([1.0, 1.0])
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, np.array(["u", "u"]))
    _close(adv, torch.zeros(2, 3), atol=0)


def _grpo_reference(scores, index, eps, norm):
    groups = defaultdict(list)
    for s, i in zip(scores.tolist(), index):
        groups[i].append(s)
    out = []
    for s, i in zip(scores.tolist(), index):
        g = torch.tensor(groups[i], dtype=torch.float64)
        mean, std = (0.0, 1.0) if len(g) == 1 else (g.mean().item(), g.std().item())
        out.append((s - mean) / (std + eps) if norm else s - mean)
    return torch.tensor(out, dtype=torch.float64)


group_index = st.lists(st.integers(0, 3), min_size=2, max_size=12)


@settings(max_examples=50, deadline=None)
@given(index=group_index, seed=st.integers(0, 2**16), norm=st.booleans())
def test_grpo_matches_loop_reference_and_has_zero_group_mean(index, seed, norm):
    scores = torch.randn(len(index), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rewards = torch.zeros(len(index), 2, dtype=torch.float64)
    rewards[:, 1] = scores
    mask = torch.ones_like(rewards)
    idx = np.array(index)
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, idx, norm_adv_by_std_in_grpo=norm)
    _close(adv[:, 0], _grpo_reference(scores, idx, EPS, norm), atol=1e-9)
    for gid in set(index):
        members = idx == gid
        if members.sum() > 1:
            assert adv[torch.from_numpy(members), 0].mean().item() == pytest.approx(0.0, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(bits=st.lists(st.booleans(), min_size=8, max_size=8), pos=st.integers(0, 7))
def test_grpo_masking_a_position_changes_only_that_position(bits, pos):
    rewards = torch.arange(8, dtype=torch.float64).view(4, 2)
    mask = torch.tensor(bits, dtype=torch.float64).view(4, 2)
    index = np.array([0, 0, 1, 1])
    before, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index)
    mask2 = mask.clone().view(-1)
    mask2[pos] = 0.0
    after, _ = ca.compute_grpo_outcome_advantage(rewards, mask2.view(4, 2), index)
    changed = (before != after).view(-1).nonzero().flatten().tolist()
    assert changed in ([], [pos])


# ───────────── RLOO ─────────────


def test_rloo_by_hand():
    # group a (n = 3): scores [1, 0, 2]: A_i = s_i - mean of the others
    #   1 - (0 + 2)/2 = 0;  0 - (1 + 2)/2 = -1.5;  2 - (1 + 0)/2 = 1.5   (= 3/2 * (s_i - 1))
    # group b (n = 1): keeps its raw score 5
    rewards, mask = _outcome([1.0, 0.0, 2.0, 5.0])
    adv, ret = ca.compute_rloo_outcome_advantage(rewards, mask, np.array(["a", "a", "a", "b"]))
    _close(adv, torch.tensor([0.0, -1.5, 1.5, 5.0]).unsqueeze(-1).expand(4, 3))
    assert ret is adv


# ───────────── REINFORCE++ and its baseline variant ─────────────


def test_reinforce_plus_plus_by_hand():
    # gamma = 0.5, G_t = r_t + gamma G_next over valid positions
    # row 0 r = [1, 0, 2] all valid: G2 = 2, G1 = 0 + 1 = 1, G0 = 1 + .5 = 1.5
    # row 1 r = [0, 4, 100], position 2 masked (its 100 must not enter): G1 = 4, G0 = 0 + 2 = 2
    # whiten the 5 valid returns [1.5, 1, 2, 2, 4]: mean 2.1, deviations [-.6, -1.1, -.1, -.1, 1.9],
    #   sum of squares 5.2, unbiased var 1.3
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=SimpleNamespace(gamma=0.5))
    _close(ret, [[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]])
    sd = math.sqrt(1.3 + 1e-8)
    _close(adv, [[-0.6 / sd, -1.1 / sd, -0.1 / sd], [-0.1 / sd, 1.9 / sd, 0.0]])


def test_reinforce_plus_plus_skips_masked_middle_position():
    # r = [1, 5, 2], mask [1, 0, 1], gamma .5: position 1 is skipped (no reward, no discount, no reset):
    #   G2 = 2, G0 = 1 + .5 * 2 = 2  -> returns [2, 0, 2]
    rewards = torch.tensor([[1.0, 5.0, 2.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    _, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.5})
    _close(ret[0], [2.0, 0.0, 2.0])


def test_reinforce_plus_plus_needs_gamma():
    rewards, mask = _outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="gamma"):
        ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask)


def test_reinforce_plus_plus_baseline_by_hand():
    # group a scores [1, 3] -> mean 2 -> [-1, 1]; group b single score 2 -> baseline 0 -> 2
    # broadcast over 2 valid tokens each: [-1, -1, 1, 1, 2, 2]; mean 2/3,
    #   deviations [-5/3, -5/3, 1/3, 1/3, 4/3, 4/3], sum of squares 84/9, unbiased var (84/9)/5 = 28/15
    rewards, mask = _outcome([1.0, 3.0, 2.0], length=2)
    adv, ret = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, np.array(["a", "a", "b"]))
    sd = math.sqrt(28 / 15 + 1e-8)
    _close(adv, torch.tensor([-5 / 3, 1 / 3, 4 / 3]).unsqueeze(-1).expand(3, 2) / sd)
    assert ret is adv


# ───────────── ReMax, OPO, Pass@k, GPG ─────────────


def test_remax_by_hand():
    # returns = undiscounted reward-to-go over valid tokens; A = G - b on valid tokens
    # row 0: r [0, 0, 1] -> G [1, 1, 1], b .5 -> A [.5, .5, .5]
    # row 1: r [0, 2, 7 (masked)] -> G [2, 2, 0], b 3 -> A [-1, -1, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = ca.compute_remax_outcome_advantage(rewards, torch.tensor([0.5, 3.0]), mask)
    _close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    _close(adv, [[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]])


def test_opo_by_hand():
    # scores [1, 0] with lengths [3, 1]: baseline (3*1 + 1*0) / 4 = .75 -> A [.25, -.75]; singleton keeps 4
    rewards, mask = _outcome([1.0, 0.0, 4.0])
    mask[1, :2] = 0.0
    adv, _ = ca.compute_opo_outcome_advantage(rewards, mask, np.array([0, 0, 1]))
    _close(adv[:, 2], [0.25, -0.75, 4.0])
    _close(adv[1, :2], [0.0, 0.0])


def test_grpo_passk_by_hand():
    # group scores [1, 3, 2]: only the best (index 1) gets r_max - r_second = 3 - 2 = 1,
    #   divided by the group std (mean 2, deviations -1, 1, 0 -> var 2/2 = 1) + eps when normalising
    rewards, mask = _outcome([1.0, 3.0, 2.0])
    cfg = SimpleNamespace(norm_adv_by_std_in_grpo=True)
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, np.array(["q"] * 3), config=cfg)
    _close(adv[:, 0], [0.0, 1 / (1 + EPS), 0.0])
    cfg.norm_adv_by_std_in_grpo = False
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, np.array(["q"] * 3), config=cfg)
    _close(adv[:, 0], [0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="at least 2"):
        ca.compute_grpo_passk_outcome_advantage(rewards, mask, np.array(["q", "q", "r"]), config=cfg)


def test_gpg_by_hand():
    # scores [1, 0 | 2, 0] in groups a | b; alpha = B / #nonzero = 4 / 2 = 2
    # means a .5, b 1 -> A = 2 * [.5, -.5, 1, -1] = [1, -1, 2, -2]
    rewards, mask = _outcome([1.0, 0.0, 2.0, 0.0])
    adv, _ = ca.compute_gpg_outcome_advantage(rewards, mask, np.array(["a", "a", "b", "b"]))
    _close(adv[:, 0], [1.0, -1.0, 2.0, -2.0])


# ───────────── registry ─────────────


def test_every_estimator_accepts_one_uniform_set_of_kwargs():
    rewards, mask = _outcome([1.0, 0.0, 2.0, 3.0])
    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        values=torch.zeros_like(rewards),
        index=np.array(["a", "a", "b", "b"]),
        reward_baselines=torch.zeros(4),
        gamma=1.0,
        lam=0.95,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
        config=SimpleNamespace(gamma=1.0, lam=0.95, norm_adv_by_std_in_grpo=True),
    )
    for name in ca.AdvantageEstimator:
        adv, ret = ca.get_adv_estimator_fn(name)(**kwargs)
        assert adv.shape == ret.shape == rewards.shape and torch.isfinite(adv).all(), name


def test_registry_lookup_errors_and_plugins():
    assert ca.get_adv_estimator_fn("grpo") is ca.get_adv_estimator_fn(ca.AdvantageEstimator.GRPO)
    with pytest.raises(ValueError, match="known: .*'gae'.*register_adv_est"):
        ca.get_adv_estimator_fn("grpoo")

    @ca.register_adv_est("test_plugin_estimator")
    def plugin(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    try:
        assert ca.get_adv_estimator_fn("test_plugin_estimator") is plugin
        with pytest.raises(ValueError, match="already registered"):
            ca.register_adv_est("test_plugin_estimator")(lambda **kw: None)
    finally:
        del ca.ADV_ESTIMATOR_REGISTRY["test_plugin_estimator"]


def test_verl_import_path_is_the_same_module_api():
    from rlfoundry.trainer.ppo import core_algos as verl_path

    assert verl_path.compute_grpo_outcome_advantage is ca.compute_grpo_outcome_advantage
    assert verl_path.ADV_ESTIMATOR_REGISTRY is ca.ADV_ESTIMATOR_REGISTRY
    for name in ca.__all__:
        assert hasattr(verl_path, name), name
