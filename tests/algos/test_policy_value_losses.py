"""Policy losses (vanilla PPO + dual clip, GSPO, GPG, Clip-Cov, KL-Cov, CISPO, and verl 0.9.1's SAPO, GMPO,
DRO, DPPO-TV/KL), value and entropy losses.

Expected values for the verl 0.9.1 losses are derived by hand from the formulas of verl 0.9.1's
``verl/trainer/ppo/core_algos.py`` (PyPI wheel verl-0.9.1; identical to verl-project/verl 1dda039b,
2026-08-22, except that there GSPO still forces seq-mean-token-mean).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfoundry.algos import core_algos as ca


def _cfg(**overrides):
    base = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, policy_loss=None)
    base.update(overrides)
    return SimpleNamespace(**base)


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# ───────────── vanilla PPO ─────────────

# One row, four tokens, eps = .2, c = 3 (log-ratios written as logs of the ratios r):
#   t0: A = +1, r = 1.5 -> -A r = -1.5, -A clip(r) = -1.2 -> max = -1.2   upper clip binds, zero grad
#   t1: A = -1, r = 0.5 -> -A r =  0.5, -A clip(r) =  0.8 -> max =  0.8   lower clip binds, zero grad
#                          dual bound -A c = 3 does not bind (0.8 < 3)
#   t2: A = -1, r = 5.0 -> -A r =  5.0, -A clip(r) =  1.2 -> max =  5.0, dual: min(5, 3) = 3 binds, zero grad
#   t3: A = +1, r = 1.1 -> unclipped -1.1, d/dlogp (-A r) = -A r = -1.1
# token-mean: (-1.2 + 0.8 + 3 - 1.1) / 4 = .375 ; grad wrt log_prob = [0, 0, 0, -1.1 / 4]
# pg_clipfrac: tokens where -A clip(r) > -A r: t0, t1 -> .5 ; pg_clipfrac_lower: t2 -> .25
# ppo_kl = mean(log pi_old - log pi) = -(log 1.5 + log .5 + log 5 + log 1.1) / 4
RATIOS = torch.tensor([[1.5, 0.5, 5.0, 1.1]], dtype=torch.float64)
ADV = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)


def _ppo_inputs():
    old = torch.tensor([[-1.0, -2.0, -3.0, -0.5]], dtype=torch.float64)
    log_prob = (old + RATIOS.log()).requires_grad_(True)
    return old, log_prob, torch.ones_like(old)


def test_vanilla_ppo_clip_and_dual_clip_by_hand():
    old, log_prob, mask = _ppo_inputs()
    loss, metrics = ca.compute_policy_loss_vanilla(old, log_prob, ADV, mask, "token-mean", _cfg())
    assert loss.item() == pytest.approx(0.375)
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[0.0, 0.0, 0.0, -1.1 / 4]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(1.5 * 0.5 * 5.0 * 1.1)) / 4)
    assert ca.get_policy_loss_fn("vanilla") is ca.compute_policy_loss_vanilla


def test_plain_compute_policy_loss_agrees():
    old, log_prob, mask = _ppo_inputs()
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = ca.compute_policy_loss(old, log_prob, ADV, mask, cliprange=0.2)
    assert pg_loss.item() == pytest.approx(0.375)
    assert (clipfrac.item(), clipfrac_lower.item()) == pytest.approx((0.5, 0.25))
    assert ppo_kl.item() == pytest.approx(-(math.log(1.5 * 0.5 * 5.0 * 1.1)) / 4)
    with pytest.raises(ValueError, match="cliprange"):
        ca.compute_policy_loss(old, log_prob, ADV, mask)


def test_asymmetric_clip_higher():
    # A = +1, r = 1.25: with eps_high = .28 the ratio is inside [.8, 1.28] -> loss -1.25, grad -1.25;
    # with symmetric eps = .2 it is clipped at 1.2 -> loss -1.2, grad 0
    old = torch.zeros(1, 1, dtype=torch.float64)
    log_prob = torch.full((1, 1), math.log(1.25), dtype=torch.float64, requires_grad=True)
    adv, mask = torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    loss, _ = ca.compute_policy_loss_vanilla(old, log_prob, adv, mask, config=_cfg(clip_ratio_high=0.28))
    assert loss.item() == pytest.approx(-1.25)
    assert _grad(loss, log_prob).item() == pytest.approx(-1.25)
    loss, _ = ca.compute_policy_loss_vanilla(old, log_prob, adv, mask, config=_cfg())
    assert loss.item() == pytest.approx(-1.2)


def test_log_ratio_clamp_and_bad_dual_clip():
    # log-ratio 100 is clamped to 20 (no overflow); A < 0 so the dual bound -A c = 3 caps the loss
    old = torch.zeros(1, 1)
    log_prob = torch.full((1, 1), 100.0)
    loss, _ = ca.compute_policy_loss_vanilla(old, log_prob, -torch.ones(1, 1), torch.ones(1, 1), config=_cfg())
    assert loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        ca.compute_policy_loss_vanilla(old, log_prob, torch.ones(1, 1), torch.ones(1, 1), config=_cfg(clip_ratio_c=1.0))


def test_rollout_is_weights_scale_token_losses():
    # t3 (unclipped, -1.1) weighted by 2 -> (-1.2 + .8 + 3 - 2.2) / 4 = .1
    old, log_prob, mask = _ppo_inputs()
    w = torch.tensor([[1.0, 1.0, 1.0, 2.0]], dtype=torch.float64)
    loss, _ = ca.compute_policy_loss_vanilla(old, log_prob, ADV, mask, config=_cfg(), rollout_is_weights=w)
    assert loss.item() == pytest.approx(0.1)


def test_global_batch_info_reaches_agg_loss_through_config():
    # same four tokens, but the mini-batch has 8 tokens over 2 ranks: 1.5 * 2 / 8 = .375
    old, log_prob, mask = _ppo_inputs()
    info = {"dp_size": 2, "batch_num_tokens": 8, "global_batch_size": 2}
    for cfg in (
        ca.with_global_batch_info(_cfg(), info),  # a view: the config itself is not mutated
        ca.with_global_batch_info(dict(clip_ratio=0.2, clip_ratio_c=3.0), info),  # mapping configs work too
        _cfg(global_batch_info=info),  # verl's channel: config.global_batch_info
    ):
        loss, _ = ca.compute_policy_loss_vanilla(old, log_prob, ADV, mask, config=cfg)
        assert loss.item() == pytest.approx(0.375)
    view = ca.with_global_batch_info(_cfg(), info)
    assert view.clip_ratio == 0.2 and view.get("clip_ratio_c") == 3.0 and view.get("global_batch_info") == info
    with pytest.raises(ValueError, match="unknown keys"):
        ca.compute_policy_loss_vanilla(old, log_prob, ADV, mask, config=_cfg(global_batch_info={"dp": 2}))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean", "dro",
                                  "dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), micro=st.integers(1, 3))
def test_policy_loss_micro_batch_invariance(name, mode, seed, micro):
    # whole mini-batch (local statistics) vs 2 ranks x micro-batches with the global counts
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
    new = old + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    # ratio thresholds so that Clip-Cov selects nothing and KL-Cov everything: both then act token-locally
    cfg = _cfg(policy_loss=SimpleNamespace(clip_cov_ratio=1e-9, clip_cov_lb=1e9, clip_cov_ub=2e9, kl_cov_ratio=1.0,
                                           dro_beta=0.5))
    fn = ca.get_policy_loss_fn(name)
    whole = new.clone().requires_grad_(True)
    g_whole = _grad(fn(old, whole, adv, mask, mode, cfg)[0], whole)

    info = ca.compute_global_batch_info(mask, dp_size=2)
    total = torch.zeros_like(new)
    for rank_rows in torch.arange(6).chunk(2):
        for rows in rank_rows.split(micro):
            part = new[rows].clone().requires_grad_(True)
            loss, _ = fn(old[rows], part, adv[rows], mask[rows], mode, ca.with_global_batch_info(cfg, info))
            total[rows] += _grad(loss, part)
    torch.testing.assert_close(total / 2, g_whole, atol=1e-6, rtol=0)


# ───────────── GSPO ─────────────


def test_gspo_by_hand():
    # seq 0: log-ratios [log 1.1, log 1.1] -> s = exp(mean) = 1.1 (inside [.8, 1.2]); A = +1 -> token loss -1.1
    # seq 1: log-ratios [log 2, log .5, masked] -> mean 0 -> s = 1; A = -1 -> token loss +1
    # seq-mean-token-mean: (-1.1 + 1) / 2 = -.05; token-mean (-2.2 + 2) / 4 is the same here (equal lengths;
    # test_gspo_honours_loss_agg_mode_as_verl_091 tells them apart)
    # grad of -A s_{i,t} wrt log pi_t is -A s_i, times 1 / (2 sequences x 2 tokens):
    #   seq 0: -1.1 / 4 = -.275 per token; seq 1: +1 / 4 = .25 per valid token, 0 on the masked one
    old = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = torch.tensor([[math.log(1.1)] * 2 + [0.0], [math.log(2), math.log(0.5), 5.0]], dtype=torch.float64)
    log_prob.requires_grad_(True)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, metrics = ca.compute_policy_loss_gspo(old, log_prob, adv, mask, "token-mean", _cfg())
    assert loss.item() == pytest.approx(-0.05)
    expected = torch.tensor([[-0.275, -0.275, 0.0], [0.25, 0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, log_prob), expected)
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_gspo_sequence_clip():
    # s = 1.5 with A = +1 -> clipped at 1.2: loss -1.2, no gradient, clipfrac 1
    old = torch.zeros(1, 2, dtype=torch.float64)
    log_prob = torch.full((1, 2), math.log(1.5), dtype=torch.float64, requires_grad=True)
    loss, metrics = ca.compute_policy_loss_gspo(old, log_prob, torch.ones(1, 2), torch.ones(1, 2), config=_cfg())
    assert loss.item() == pytest.approx(-1.2)
    assert _grad(loss, log_prob).abs().max().item() == 0.0
    assert metrics["actor/pg_clipfrac"] == 1.0


def test_gspo_honours_loss_agg_mode_as_verl_091():
    # verl 0.9.1 aggregates GSPO by the actor's loss_agg_mode (<= 0.9.0 forced seq-mean-token-mean).
    # seq 0: 3 valid tokens, log-ratios log 1.1 -> s = 1.1, A = +1 -> token losses -1.1 x 3
    # seq 1: 1 valid token, log-ratio 0 -> s = 1, A = -1 -> token loss +1
    #   token-mean          (-3.3 + 1) / 4 = -.575   grads -A s_i / 4 = [-.275 x 3], [.25]
    #   seq-mean-token-mean (-1.1 + 1) / 2 = -.05    (the old, forced result: fails the token-mean check)
    #   token-sum           -3.3 + 1 = -2.3
    old = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = torch.tensor([[math.log(1.1)] * 3, [0.0, 7.0, 7.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = ca.compute_policy_loss_gspo(old, log_prob, adv, mask, "token-mean", _cfg())
    assert loss.item() == pytest.approx(-0.575)
    expected = torch.tensor([[-0.275] * 3, [0.25, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, log_prob), expected)
    assert ca.compute_policy_loss_gspo(old, log_prob, adv, mask, "seq-mean-token-mean", _cfg())[0].item() == \
        pytest.approx(-0.05)
    assert ca.compute_policy_loss_gspo(old, log_prob, adv, mask, "token-sum", _cfg())[0].item() == pytest.approx(-2.3)
    # the function's own default stays the paper's seq-mean-token-mean (verl 0.9.1's signature)
    assert ca.compute_policy_loss_gspo(old, log_prob, adv, mask, config=_cfg())[0].item() == pytest.approx(-0.05)


# ───────────── GPG, CISPO ─────────────


def test_gpg_by_hand():
    # l = -A log pi: [-(1)(-1), -(-1)(-2)] = [1, -2] -> token-mean -.5 ; grad = -A / 2 = [-.5, .5]
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, metrics = ca.compute_policy_loss_gpg(log_prob.detach(), log_prob, adv, torch.ones(1, 2), config=_cfg())
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-0.5, 0.5]]))
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


def test_cispo_by_hand():
    # t0: r = 1.5, A = +1 -> weight sg(clip(1.5)) = 1.2, l = -1.2 * log pi, grad -1.2 / 2 = -.6
    # t1: r = 1.0, A = -1 -> weight 1,                l = +log pi,       grad +1 / 2 = .5
    # value: (-1.2 * log pi_0 + log pi_1) / 2 ; clipfrac 1/2
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    log_prob = (old + torch.tensor([[math.log(1.5), 0.0]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, metrics = ca.compute_policy_loss_cispo(old, log_prob, adv, torch.ones(1, 2), config=_cfg())
    lp = log_prob.detach()
    assert loss.item() == pytest.approx((-1.2 * lp[0, 0] + lp[0, 1]).item() / 2)
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-0.6, 0.5]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


# ───────────── Clip-Cov, KL-Cov ─────────────

# 4 valid tokens, ratio 1 (old = new): A = [3, 1, 0, 0] (mean 1 -> deviations [2, 0, -1, -1]),
# log pi = [0, -1, -1, -2] (mean -1 -> deviations [1, 0, 0, -1]): covariance = [2, 0, 0, 1]
COV_ADV = torch.tensor([[3.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
COV_LOGP = torch.tensor([[0.0, -1.0, -1.0, -2.0]], dtype=torch.float64)


def test_clip_cov_by_hand():
    # only t0 has covariance in (lb, ub) = (1, 5) (t3's 1 is not > 1); clip count max(1, int(.0002 * 4)) = 1
    # -> t0 loses its gradient (loss x 0). Per-token -A r = [-3, -1, 0, 0] -> [0, -1, 0, 0]:
    # token-mean -.25, grad [0, -1/4, 0, 0], pg_clipfrac 1/4
    log_prob = COV_LOGP.clone().requires_grad_(True)
    cfg = _cfg(policy_loss=SimpleNamespace(clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0))
    loss, metrics = ca.compute_policy_loss_clip_cov(COV_LOGP, log_prob, COV_ADV, torch.ones(1, 4), config=cfg)
    assert loss.item() == pytest.approx(-0.25)
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[0.0, -0.25, 0.0, 0.0]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)


def test_kl_cov_by_hand():
    # top max(1, int(4 * .0002)) = 1 token by covariance is t0 (cov 2). old = log pi - [.1, 0, 0, 0]:
    # t0: -A r + coef |log r| = -3 e^.1 + .1 ; t1: -1 ; t2, t3: 0   (coef = 1)
    # token-mean: (-3 e^.1 + .1 - 1) / 4 ; grad t0: (-3 e^.1 + 1) / 4, t1: -1/4
    old = COV_LOGP - torch.tensor([[0.1, 0.0, 0.0, 0.0]], dtype=torch.float64)
    log_prob = COV_LOGP.clone().requires_grad_(True)
    cfg = _cfg(policy_loss=SimpleNamespace(kl_cov_ratio=0.0002, ppo_kl_coef=1.0))
    loss, _ = ca.compute_policy_loss_kl_cov(old, log_prob, COV_ADV, torch.ones(1, 4), config=cfg)
    e = math.exp(0.1)
    assert loss.item() == pytest.approx((-3 * e + 0.1 - 1) / 4)
    expected = torch.tensor([[(-3 * e + 1) / 4, -0.25, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, log_prob), expected)


def test_policy_loss_registry_errors():
    assert set(ca.POLICY_LOSS_REGISTRY) >= {"vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo"}
    with pytest.raises(ValueError, match="known: .*'vanilla'"):
        ca.get_policy_loss_fn("vanila")


# ───────────── value and entropy losses ─────────────


def test_value_loss_clipping_by_hand():
    # cliprange .5, returns R = 2:
    #   t0: vpred 1, old value 0 -> clipped pred clamp(1, -.5, .5) = .5: errors (1-2)^2 = 1 vs (.5-2)^2 = 2.25
    #       -> max 2.25 (clipped one larger: counts in clipfrac; constant in vpred: zero grad)
    #   t1: vpred 3, old value 2.8 -> clamp(3, 2.3, 3.3) = 3: both errors 1 -> 1, grad 2 (3 - 2) = 2
    # loss = .5 * mean(2.25, 1) = .8125 ; clipfrac .5 ; grad wrt vpreds = .5 * [0, 2] / 2 = [0, .5]
    vpreds = torch.tensor([[1.0, 3.0]], requires_grad=True)
    loss, clipfrac = ca.compute_value_loss(
        vpreds, torch.tensor([[2.0, 2.0]]), torch.tensor([[0.0, 2.8]]), torch.ones(1, 2), cliprange_value=0.5
    )
    assert loss.item() == pytest.approx(0.8125)
    assert clipfrac.item() == pytest.approx(0.5)
    torch.testing.assert_close(_grad(loss, vpreds), torch.tensor([[0.0, 0.5]]))
    # global-batch arguments are forwarded: 2 ranks, 8 tokens -> .5 * 3.25 * 2 / 8
    loss, _ = ca.compute_value_loss(
        vpreds, torch.tensor([[2.0, 2.0]]), torch.tensor([[0.0, 2.8]]), torch.ones(1, 2), 0.5,
        dp_size=2, batch_num_tokens=8,
    )
    assert loss.item() == pytest.approx(0.5 * 3.25 * 2 / 8)


def test_entropy_loss_by_hand():
    # uniform logits over 4 -> entropy log 4 on each valid token; the masked token (entropy 0) is ignored
    logits = torch.tensor([[[0.0] * 4, [0.0] * 4, [50.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert ca.compute_entropy_loss(logits, mask).item() == pytest.approx(math.log(4))
    assert ca.compute_entropy_loss(logits, mask, "token-sum").item() == pytest.approx(2 * math.log(4))


# ───────────── SAPO ─────────────


def test_sapo_gates_by_hand():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau, l = -A f(r); tau_pos = 1 (A > 0), tau_neg = 2 (A <= 0)
    # row 0 (3 valid): t0 r = 1, A = +1: f = .5 * 4 = 2 -> -2 ; t1 r = 1, A = -1: f = .5 * 4/2 = 1 -> +1
    #                  t2 r = 2, A = +1: f = sigmoid(1) * 4 = 2.9242344 -> -2.9242344
    # row 1 (1 valid): r = 1, A = -1 -> +1
    # seq-mean-token-mean whatever the mode (verl 0.9.1): ((-2 + 1 - 2.9242344) / 3 + 1) / 2 = -.1540391
    # d l / d log pi = -A * 4 r sigmoid'(tau (r - 1)), sigmoid' = s (1 - s):
    #   r = 1: -A (= PPO's on-policy gradient, whatever tau); t2: -4 * 2 * .7310586 * .2689414 = -1.5728954
    #   each times 1 / (2 sequences x its length): row 0 / 6, row 1 / 2
    s1 = 1 / (1 + math.exp(-1))
    old = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = torch.tensor([[0.0, 0.0, math.log(2.0)], [0.0, 3.0, 3.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    cfg = _cfg(tau_pos=1.0, tau_neg=2.0)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, metrics = ca.compute_policy_loss_sapo(old, log_prob, adv, mask, mode, cfg)
        assert loss.item() == pytest.approx(((-2 + 1 - 4 * s1) / 3 + 1) / 2)
    expected = torch.tensor([[-1 / 6, 1 / 6, -8 * s1 * (1 - s1) / 6], [0.5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, log_prob), expected)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0
    with pytest.raises(ValueError, match="tau_pos"):
        ca.compute_policy_loss_sapo(old, log_prob, adv, mask, config=_cfg(tau_pos=0.0))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), tau_pos=st.floats(0.1, 5.0), tau_neg=st.floats(0.1, 5.0))
def test_sapo_on_policy_gradient_is_ppo_gradient(seed, tau_pos, tau_neg):
    # at r = 1 the gate's slope is 4 sigmoid'(0) = 1: SAPO's gradient equals vanilla PPO's for any temperatures
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4)
    a, b = old.clone().requires_grad_(True), old.clone().requires_grad_(True)
    sapo, _ = ca.compute_policy_loss_sapo(old, a, adv, mask, config=_cfg(tau_pos=tau_pos, tau_neg=tau_neg))
    ppo, _ = ca.compute_policy_loss_vanilla(old, b, adv, mask, "seq-mean-token-mean", _cfg())
    torch.testing.assert_close(_grad(sapo, a), _grad(ppo, b))


# ───────────── GMPO (geo_mean) ─────────────


def test_geo_mean_by_hand():
    # eps_low = eps_high = .2; log-ratios clipped the PPO way in log space, then a geometric mean per sequence
    # row 0, A = +1: log r = [.5, -.1] -> min(log r, .2) = [.2 (clipped), -.1] -> s = exp(.05), a = 1 -> -s
    # row 1, A = -2: log r = [-.5, .3] -> max(log r, -.2) = [-.2 (clipped), .3] -> s = exp(.05), a = -2 -> 2s
    # mean over the 2 sequences: s / 2 = .5256355 (loss_agg_mode is not used)
    # grad: clipped tokens 0; d s / d log pi_t = s / 2 for the other: row 0 -s/2 / 2, row 1 +2 s/2 / 2
    # metrics count tokens outside [-.2, .2] (verl: clipped in the loss or not): A > 0: row 0 t0 -> 1/4;
    #   A < 0: row 1 t0 and t1 (.3 is outside but not clipped for A < 0) -> 2/4
    s = math.exp(0.05)
    old = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], dtype=torch.float64)
    log_prob = (old + torch.tensor([[0.5, -0.1], [-0.5, 0.3]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    for mode in ("token-mean", "seq-mean-token-sum"):
        loss, metrics = ca.compute_policy_loss_geo_mean(old, log_prob, adv, mask, mode, _cfg())
        assert loss.item() == pytest.approx(s / 2)
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[0.0, -s / 4], [0.0, s / 2]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.5)
    # rollout IS weights enter as their geometric mean per sequence: row 0 [4, 1] -> 2: (-2s + 2s) / 2 = 0
    w = torch.tensor([[4.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    loss, _ = ca.compute_policy_loss_geo_mean(old, log_prob, adv, mask, config=_cfg(), rollout_is_weights=w)
    assert loss.item() == pytest.approx(0.0, abs=1e-9)


def test_geo_mean_on_policy_is_the_mean_sequence_advantage():
    # r = 1 everywhere: s = 1, l_i = -mean_t A_it; masked tokens do not enter the mean
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[3.0, 3.0, 99.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = ca.compute_policy_loss_geo_mean(old, old.clone(), adv, mask, config=_cfg())
    assert loss.item() == pytest.approx((-3.0 + 1.0) / 2)
    assert metrics["actor/pg_clipfrac"] == 0.0


# ───────────── DRO ─────────────


def test_dro_by_hand():
    # l = -(A log pi - beta/2 (log r)^2), beta = .5
    # t0: log pi = -.5, old -1 (log r = .5), A = +1: -(-.5 - .25 * .25) = .5625 ; t1: log pi = old = -2, A = -1: -2
    # token-mean (.5625 - 2) / 2 = -.71875 ; grad -A + beta log r: [-1 + .25, 1] / 2 = [-.375, .5]
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    cfg = _cfg(policy_loss=SimpleNamespace(dro_beta=0.5))
    loss, metrics = ca.compute_policy_loss_dro(old, log_prob, adv, torch.ones(1, 2), "token-mean", cfg)
    assert loss.item() == pytest.approx(-0.71875)
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-0.375, 0.5]], dtype=torch.float64))
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.25)
    for beta in (None, 0.0):
        with pytest.raises(ValueError, match="dro_beta"):
            ca.compute_policy_loss_dro(old, log_prob, adv, torch.ones(1, 2), config=_cfg(policy_loss=SimpleNamespace(
                dro_beta=beta)))


# ───────────── DPPO ─────────────

# Five tokens (probabilities of the sampled token, old -> new), divergence bounds .2 (clip_ratio), c = 3:
#   t0 A = +1  .5 -> .6    r 1.2   TV change  .1 (keep)   binary KL .0204110 (keep)
#   t1 A = +1  .01 -> .02  r 2     TV change  .01 (keep: PPO would clip r = 2)   KL .0031194 (keep)
#   t2 A = +1  .2 -> .5    r 2.5   TV change  .3 > .2 (drop)                     KL .1927448 <= .2 (keep)
#   t3 A = -1  .9 -> .6    r 2/3   TV change -.3 < -.2 (drop)                    KL .2262892 > .2 (drop)
#   t4 A = -1  .01 -> .05  r 5     TV change +.04 (keep: only falls are bounded for A < 0), weight min(5, 3) = 3
# binary KL = p_old ln(p_old / p) + (1 - p_old) ln((1 - p_old) / (1 - p)); for A < 0 a rising probability
# is kept whatever its KL (t4), for A > 0 a falling one.
# l = -A sg(min(r, 3)) log p on kept tokens; d l / d log p = -A min(r, 3) there.
DPPO_OLD = torch.tensor([[0.5, 0.01, 0.2, 0.9, 0.01]], dtype=torch.float64).log()
DPPO_NEW = torch.tensor([[0.6, 0.02, 0.5, 0.6, 0.05]], dtype=torch.float64).log()
DPPO_ADV = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)


def test_dppo_tv_by_hand():
    # kept t0, t1, t4: (-1.2 ln .6 - 2 ln .02 + 3 ln .05) / 5 ; grads [-1.2, -2, 0, 0, 3] / 5
    # pg_clipfrac = dropped 2/5 ; pg_clipfrac_lower = kept with r > c (t4) 1/5
    log_prob = DPPO_NEW.clone().requires_grad_(True)
    loss, metrics = ca.compute_policy_loss_dppo_tv(DPPO_OLD, log_prob, DPPO_ADV, torch.ones(1, 5), config=_cfg())
    assert loss.item() == pytest.approx((-1.2 * math.log(0.6) - 2 * math.log(0.02) + 3 * math.log(0.05)) / 5)
    expected = torch.tensor([[-1.2, -2.0, 0.0, 0.0, 3.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(_grad(loss, log_prob), expected)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.4)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.2)


def test_dppo_kl_by_hand():
    # kept t0, t1, t2, t4: (-1.2 ln .6 - 2 ln .02 - 2.5 ln .5 + 3 ln .05) / 5 ; grads [-1.2, -2, -2.5, 0, 3] / 5
    log_prob = DPPO_NEW.clone().requires_grad_(True)
    loss, metrics = ca.compute_policy_loss_dppo_kl(DPPO_OLD, log_prob, DPPO_ADV, torch.ones(1, 5), config=_cfg())
    expected_loss = (-1.2 * math.log(0.6) - 2 * math.log(0.02) - 2.5 * math.log(0.5) + 3 * math.log(0.05)) / 5
    assert loss.item() == pytest.approx(expected_loss)
    expected = torch.tensor([[-1.2, -2.0, -2.5, 0.0, 3.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(_grad(loss, log_prob), expected)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.2)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.2)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_on_policy_is_reinforce_and_thresholds_are_read(name):
    # r = 1: no token leaves the region, weight 1: l = -A log pi, GPG's loss; a larger clip_ratio_high keeps
    # t2 under TV too (.3 <= .35), and clip_ratio_c = 20 no longer truncates t4's r = 5
    fn = ca.get_policy_loss_fn(name)
    a, b = DPPO_OLD.clone().requires_grad_(True), DPPO_OLD.clone().requires_grad_(True)
    mask = torch.ones(1, 5)
    torch.testing.assert_close(_grad(fn(DPPO_OLD, a, DPPO_ADV, mask, config=_cfg())[0], a),
                               _grad(ca.compute_policy_loss_gpg(DPPO_OLD, b, DPPO_ADV, mask, config=_cfg())[0], b))
    log_prob = DPPO_NEW.clone().requires_grad_(True)
    loss, _ = fn(DPPO_OLD, log_prob, DPPO_ADV, mask, config=_cfg(clip_ratio_high=0.35, clip_ratio_c=20.0))
    grad = _grad(loss, log_prob)
    assert grad[0, 2].item() == pytest.approx(-2.5 / 5)
    assert grad[0, 4].item() == pytest.approx(5.0 / 5)
