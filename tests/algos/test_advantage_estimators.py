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


# ───────────── verl 0.9.1: GDPO, optimal token baselines ─────────────
# Expected values derived by hand from the formulas of verl 0.9.1's verl/trainer/ppo/core_algos.py
# (PyPI wheel verl-0.9.1 = verl-project/verl 1dda039b for these functions).

GDPO_INDEX = np.array(["a", "a", "b", "b"], dtype=object)
GDPO_COMPONENTS = {"fmt": [1.0, 0.0, 1.0, 1.0], "acc": [0.0, 1.0, 3.0, 1.0]}


def test_gdpo_normalises_each_component_in_its_group_by_hand():
    # GRPO per component (unbiased std, eps 1e-6 ~ 0):
    #   fmt: a [1, 0] -> [+1, -1]/sqrt2 ; b [1, 1] -> std 0 -> [0, 0]
    #   acc: a [0, 1] -> [-1, +1]/sqrt2 ; b [3, 1] -> mean 2, std sqrt2 -> [+1, -1]/sqrt2
    # weights [1, .5]: a [1/sqrt2 - .5/sqrt2, ...] = [+.35355, -.35355]; b [+.35355, -.35355]
    # whitened over the 4 valid tokens: mean 0, unbiased var 4 * .125 / 3 = 1/6 -> +-.35355 * sqrt6 = +-sqrt3/2
    rewards, mask = _outcome([9.0, 9.0, 9.0, 9.0], length=1)  # the summed reward is not used
    cfg = SimpleNamespace(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=[1.0, 0.5])
    adv, ret = ca.compute_gdpo_outcome_advantage(rewards, mask, GDPO_INDEX, config=cfg, non_tensor_batch=GDPO_COMPONENTS)
    _close(adv[:, 0], [math.sqrt(3) / 2, -math.sqrt(3) / 2] * 2, atol=1e-5)
    assert ret is adv
    # equal weights: a [0, 0] (the components cancel), b [+1, -1]/sqrt2 -> var 2 * .5 / 3 -> [0, 0, +-sqrt(3/2)]
    adv, _ = ca.compute_gdpo_outcome_advantage(rewards, mask, GDPO_INDEX, config=SimpleNamespace(
        gdpo_reward_keys=["fmt", "acc"]), non_tensor_batch=GDPO_COMPONENTS)
    _close(adv[:, 0], [0.0, 0.0, math.sqrt(1.5), -math.sqrt(1.5)], atol=1e-5)


def test_gdpo_differs_from_grpo_on_the_summed_reward_and_masks():
    # GRPO on fmt + acc = [1, 1, 4, 2] gives group a nothing to learn from; GDPO (weights 1, .5) does.
    # Two tokens per response, the last of row 3 masked: the whitening runs over the 7 valid tokens only
    # and masked positions are exactly 0.
    summed = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 4.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0]] * 3 + [[1.0, 0.0]])
    grpo, _ = ca.compute_grpo_outcome_advantage(summed, mask, GDPO_INDEX)
    _close(grpo[:2], torch.zeros(2, 2))
    cfg = SimpleNamespace(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=[1.0, 0.5])
    adv, _ = ca.compute_gdpo_outcome_advantage(summed, mask, GDPO_INDEX, config=cfg, non_tensor_batch=GDPO_COMPONENTS)
    raw = torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.5 / math.sqrt(2)  # the weighted sums, before whitening
    flat = torch.tensor([raw[0], raw[0], raw[1], raw[1], raw[2], raw[2], raw[3]])
    sd = math.sqrt(flat.var().item() + 1e-8)
    expected = (raw.unsqueeze(-1) - flat.mean()) / sd * mask
    _close(adv, expected, atol=1e-5)
    assert adv[3, 1].item() == 0.0


def test_gdpo_without_components_whitens_grpo_and_names_what_is_missing():
    # no non_tensor_batch (a direct call, as in verl): one component, the summed reward
    rewards, mask = _outcome([1.0, 0.0, 2.0, 2.0], length=1)
    adv, _ = ca.compute_gdpo_outcome_advantage(rewards, mask, GDPO_INDEX)
    grpo, _ = ca.compute_grpo_outcome_advantage(rewards, mask, GDPO_INDEX)
    _close(adv, F_.masked_whiten(grpo, mask) * mask)
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        ca.compute_gdpo_outcome_advantage(rewards, mask, GDPO_INDEX, config=SimpleNamespace(), non_tensor_batch={})
    with pytest.raises(ValueError, match="'acc'.*not a column"):
        ca.compute_gdpo_outcome_advantage(rewards, mask, GDPO_INDEX, config=SimpleNamespace(gdpo_reward_keys=["acc"]),
                                          non_tensor_batch={"fmt": [1, 0, 1, 1]})
    with pytest.raises(ValueError, match="'acc' is missing \\(NaN\\).*1 of 4"):
        ca.compute_gdpo_outcome_advantage(rewards, mask, GDPO_INDEX, config=SimpleNamespace(gdpo_reward_keys=["acc"]),
                                          non_tensor_batch={"acc": [1.0, float("nan"), 0.0, 1.0]})
    with pytest.raises(ValueError, match="2 entries for 1"):
        ca.compute_gdpo_outcome_advantage(rewards, mask, GDPO_INDEX, config=SimpleNamespace(
            gdpo_reward_keys=["acc"], gdpo_reward_weights=[1.0, 2.0]), non_tensor_batch={"acc": [1, 0, 1, 1]})


def _otb_inputs(w):
    """pi(a_t) = .5 everywhere and sum pi^2 = w, so that the per-token variance proxy 1 - 2 pi + sum pi^2 is w."""
    w = torch.tensor(w, dtype=torch.float64)
    return torch.full_like(w, math.log(0.5)), w


def test_optimal_token_baseline_by_hand():
    # group a: row 0 mask [1,1,1], reward 1 at t2 -> G = [1, 1, 1], w = [1, 1, 1] -> W = [1, 2, 3]
    #          row 1 mask [1,1,0], reward 0       -> G = [0, 0, 0], w = [.5, .5, -] -> W = [.5, 1, -]
    #   b_t = sum_i G W / sum_i W over valid rows: t0 1/1.5 = 2/3, t1 2/3 = 2/3, t2 (row 0 alone) 3/3 = 1
    #   zero tail: row 0 is the unique longest (3 > 2): its baseline from column 2 on is 0
    #   row 0: A = [1/3, 1/3, 1] ; row 1: A = [-2/3, -2/3, 0 (masked)]
    # group b: row 2 alone, reward .7 at t0, mask [1,0,0]: A = G = [.7, 0, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.7, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    old, spi = _otb_inputs([[1.0, 1.0, 1.0], [0.5, 0.5, 9.0], [0.3, 9.0, 9.0]])
    index = np.array(["a", "a", "b"], dtype=object)
    fn = ca.get_adv_estimator_fn("optimal_token_baseline")
    adv, ret = fn(rewards, mask, index, old_log_probs=old, sum_pi_squared=spi)
    _close(adv, [[1 / 3, 1 / 3, 1.0], [-2 / 3, -2 / 3, 0.0], [0.7, 0.0, 0.0]])
    _close(ret, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.7, 0.0, 0.0]])
    # without the zero tail row 0's last baseline is its own return: A = 0 there
    adv, _ = fn(rewards, mask, index, old_log_probs=old, sum_pi_squared=spi, handle_zero_tail=False)
    _close(adv[0], [1 / 3, 1 / 3, 0.0])
    # rollout IS weight 2 on row 1 scales its w by 4: W1 = [2, 4] -> b = [1/3, 1/3]: row 0 [2/3, 2/3, 1], row 1 -1/3
    is_w = torch.tensor([[1.0] * 3, [2.0] * 3, [1.0] * 3], dtype=torch.float64)
    adv, _ = fn(rewards, mask, index, old_log_probs=old, sum_pi_squared=spi, rollout_is_weights=is_w)
    _close(adv[:2], [[2 / 3, 2 / 3, 1.0], [-1 / 3, -1 / 3, 0.0]])
    with pytest.raises(ValueError, match="sum_pi_squared"):
        fn(rewards, mask, index)


def test_tir_optimal_token_baseline_aligns_generated_tokens_by_hand():
    # row 0 mask [1, 0, 1, 1] (t1 is tool output), reward 1 at t3: G = 1 on its 3 tokens; w = 1 -> W = [1, -, 2, 3]
    # row 1 mask [1, 1, 0, 0], reward 0: G = 0; w = .5 -> W = [.5, 1]
    # aligned by generated-token index k: b_k = [1/1.5, 2/3, 3/3] = [2/3, 2/3, 1]; zero tail for row 0 from k = 2:
    #   row 0: k0 (t0) 1/3, k1 (t2) 1/3, k2 (t3) 1 ; row 1: [-2/3, -2/3]
    # column-aligned OTB on the same rows instead compares row 0's 2nd action (t2) with nothing and row 1's
    # 2nd (t1) with row 0's tool output: row 0 [1/3, 0, 1, 1], row 1 [-2/3, 0, 0, 0]
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    old, spi = _otb_inputs([[1.0, 7.0, 1.0, 1.0], [0.5, 0.5, 7.0, 7.0]])
    index = np.array([0, 0])
    adv, ret = ca.get_adv_estimator_fn("tir_optimal_token_baseline")(rewards, mask, index, old_log_probs=old,
                                                                       sum_pi_squared=spi)
    _close(adv, [[1 / 3, 0.0, 1 / 3, 1.0], [-2 / 3, -2 / 3, 0.0, 0.0]])
    _close(ret, [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    column, _ = ca.compute_optimal_token_baseline_advantage(rewards, mask, index, old, spi)
    _close(column, [[1 / 3, 0.0, 1.0, 1.0], [-2 / 3, 0.0, 0.0, 0.0]])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_optimal_token_baselines_agree_without_holes_and_on_singletons(seed):
    # with contiguous masks (no tool output) the two alignments coincide; a group of one keeps A = G
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(-1)).double()
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    spi = torch.rand(B, T, generator=g, dtype=torch.float64)
    index = np.array([0, 0, 1, 1, 1, 2])
    a, ret = ca.compute_optimal_token_baseline_advantage(rewards, mask, index, old, spi)
    b, _ = ca.compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, index, old, spi)
    _close(a, b, atol=1e-9)
    _close(a[5], ret[5], atol=0)


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
        old_log_probs=torch.full_like(rewards, -1.0),  # the optimal token baselines' inputs (verl passes them)
        sum_pi_squared=torch.full_like(rewards, 0.5),
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
