"""KL estimators (incl. straight-through '+'), KL-penalised rewards and the KL controllers."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfoundry.algos import core_algos as ca

# two tokens: log pi - log pi_ref = d = [1, -1]; log r = log pi_ref - log pi = [-1, 1]
LOGP = torch.tensor([-1.0, -2.0], dtype=torch.float64)
REF = torch.tensor([-2.0, -1.0], dtype=torch.float64)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("kl", [1.0, -1.0]),  # k1 = d
        ("k1", [1.0, -1.0]),
        ("abs", [1.0, 1.0]),  # |d|
        ("mse", [0.5, 0.5]),  # k2 = d^2 / 2
        ("k2", [0.5, 0.5]),
        ("low_var_kl", [math.exp(-1) - 1 + 1, math.exp(1) - 1 - 1]),  # k3 = r - 1 - log r = [e^-1, e - 2]
        ("k3", [math.exp(-1), math.e - 2]),
    ],
)
def test_kl_estimators_by_hand(name, expected):
    torch.testing.assert_close(ca.kl_penalty(LOGP, REF, name), torch.tensor(expected, dtype=torch.float64))


def test_k3_clamps():
    # d = -30: log r = 30 -> clamped to 20 -> e^20 - 21 -> clamped to 10
    # d = +30: log r = -30 -> clamped to -20 -> e^-20 + 19 -> clamped to 10
    out = ca.kl_penalty(torch.tensor([-30.0, 30.0]), torch.tensor([0.0, 0.0]), "k3")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "low_var_kl", "k3", "mse", "k2"])
def test_plus_suffix_has_estimator_value_and_k2_gradient(base):
    # grad of k2 = d^2 / 2 wrt log pi is d = [1, -1]
    logp = LOGP.clone().requires_grad_(True)
    out = ca.kl_penalty(logp, REF, base + "+")
    torch.testing.assert_close(out, ca.kl_penalty(LOGP, REF, base))
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([1.0, -1.0], dtype=torch.float64))


@settings(max_examples=50, deadline=None)
@given(d=st.lists(st.floats(-5, 5), min_size=1, max_size=6))
def test_k3_plus_property(d):
    ref = torch.zeros(len(d), dtype=torch.float64)
    logp = torch.tensor(d, dtype=torch.float64, requires_grad=True)
    out = ca.kl_penalty(logp, ref, "k3+")
    torch.testing.assert_close(out, ca.kl_penalty(logp.detach(), ref, "k3"))
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, logp.detach() - ref)  # k2's gradient
    assert (out >= 0).all()  # k3 is non-negative


def test_full_and_unknown_kl_errors():
    with pytest.raises(NotImplementedError, match="full"):
        ca.kl_penalty(LOGP, REF, "full")
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'"):
        ca.kl_penalty(LOGP, REF, "k4")


def test_compute_rewards_by_hand():
    # r - beta (log pi_old - log pi_ref): [1 - .1 * 1, 0 - .1 * (-1)] = [.9, .1]
    out = ca.compute_rewards(torch.tensor([1.0, 0.0]), torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), 0.1)
    torch.testing.assert_close(out, torch.tensor([0.9, 0.1]))


def test_fixed_kl_controller():
    ctrl = ca.get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.05))
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert isinstance(ctrl, ca.FixedKLController) and ctrl.value == 0.05


def test_adaptive_kl_controller_by_hand():
    # beta = .2, target 6, horizon 10000
    # step 1: KL 9 -> e = clip(9/6 - 1 = .5, -.2, .2) = .2 -> beta *= 1 + .2 * 256 / 10000 = 1.00512 -> .201024
    # step 2: KL 5.4 -> e = 5.4/6 - 1 = -.1 -> beta *= 1 - .1 * 100 / 10000 = .999 -> .200822976
    # step 3: KL 0 -> e = clip(-1) = -.2 -> beta *= 1 - .2 * 50 / 10000 = .999 -> .200622153024
    ctrl = ca.get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0, "horizon": 10000})
    ctrl.update(current_kl=9.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.201024, rel=1e-12)
    ctrl.update(current_kl=5.4, n_steps=100)
    assert ctrl.value == pytest.approx(0.200822976, rel=1e-12)
    ctrl.update(current_kl=0.0, n_steps=50)
    assert ctrl.value == pytest.approx(0.200622153024, rel=1e-12)


def test_kl_controller_config_errors():
    with pytest.raises(ValueError, match="horizon"):
        ca.get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.1, target_kl=1.0, horizon=0))
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        ca.get_kl_controller(SimpleNamespace(type="pid", kl_coef=0.1))
