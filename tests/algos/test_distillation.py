"""On-policy distillation losses (algos/distillation.py) against numbers worked by hand.

Two tokens: student probabilities (0.5, 0.25), teacher (0.25, 0.5); s = log student, q = log teacher.
  k1 = s - q = (ln 2, -ln 2)
  k3 = r - 1 - log r with log r = q - s = (-ln 2, ln 2): (0.5 - 1 + ln 2, 2 - 1 - ln 2) = (0.193147, 0.306853)
  k2 = (ln 2)^2 / 2 = 0.240227 each; abs = ln 2 each.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlfoundry.algos.distillation import combine_with_task_loss, distillation_loss, distillation_token_losses

LN2 = math.log(2.0)
S = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
Q = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)
FULL = torch.ones(1, 2)


def _cfg(**kw):
    base = dict(loss_mode="k3", loss_max_clamp=None, use_policy_gradient=False, policy_loss_mode="vanilla",
                clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2)
    return SimpleNamespace(**(base | kw))


@pytest.mark.parametrize("mode,expected", [
    ("k1", [LN2, -LN2]), ("kl", [LN2, -LN2]), ("k3", [0.5 - 1 + LN2, 2 - 1 - LN2]),
    ("low_var_kl", [0.5 - 1 + LN2, 2 - 1 - LN2]), ("k2", [LN2**2 / 2] * 2), ("abs", [LN2, LN2]),
])
def test_per_token_losses_are_the_reverse_kl_estimators(mode, expected):
    got = distillation_token_losses(S, Q, mode)
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64), atol=1e-12, rtol=0)


def test_loss_max_clamp_is_symmetric():
    # k1 = (0.693, -0.693) clamped to [-0.5, 0.5]; k3 = (0.193, 0.307) is inside and unchanged
    torch.testing.assert_close(distillation_token_losses(S, Q, "k1", loss_max_clamp=0.5),
                               torch.tensor([[0.5, -0.5]], dtype=torch.float64))
    torch.testing.assert_close(distillation_token_losses(S, Q, "k3", loss_max_clamp=0.5), distillation_token_losses(S, Q, "k3"))


def test_supervised_k3_value_mask_and_gradient_follow_the_teacher():
    s = S.clone().requires_grad_(True)
    loss, metrics = distillation_loss(s, S, Q, FULL, _cfg(loss_mode="k3"))
    # token-mean of (0.193147, 0.306853) = (0.5 + 2 - 2) / 2 = 0.25 exactly (the log terms cancel)
    assert float(loss.detach()) == pytest.approx(0.25, abs=1e-12)
    loss.backward()
    # d k3 / d s = 1 - r = (0.5, -1); over N = 2 tokens: (0.25, -0.5). The sign says: raise the token the
    # teacher likes more (second), lower the other
    torch.testing.assert_close(s.grad, torch.tensor([[0.25, -0.5]], dtype=torch.float64))
    assert float(metrics["distillation/abs_loss"]) == pytest.approx(0.25, abs=1e-12)
    assert float(metrics["distillation/loss_max"]) == pytest.approx(2 - 1 - LN2, abs=1e-12)
    masked, _ = distillation_loss(S, S, Q, torch.tensor([[1.0, 0.0]]), _cfg(loss_mode="k3"))
    assert float(masked) == pytest.approx(0.5 - 1 + LN2, abs=1e-12)  # the padded second token is left out


def test_policy_gradient_k1_uses_minus_the_detached_loss_as_advantage():
    s = S.clone().requires_grad_(True)
    loss, metrics = distillation_loss(s, S, Q, FULL, _cfg(loss_mode="k1", use_policy_gradient=True))
    # on-policy (ratio 1): per-token -A·r with A = -k1 = (-ln2, ln2): (ln2, -ln2), token-mean 0
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    # d(-A e^(s - old))/ds = -A at ratio 1, / N: (ln2/2, -ln2/2). Were A not detached, k1's own
    # gradient (1 per token) would add 1/2 to both
    torch.testing.assert_close(s.grad, torch.tensor([[LN2 / 2, -LN2 / 2]], dtype=torch.float64))
    assert float(metrics["distillation/pg_clipfrac"]) == 0.0


def test_policy_gradient_clips_the_ratio_and_the_clamp_bounds_the_advantage():
    # second token only: A = -k1 = ln 2 > 0; old log-prob ln(0.25/1.5) -> ratio 1.5 > 1 + 0.2: clipped,
    # loss -A·1.2 and no gradient
    old = S.clone()
    old[0, 1] = math.log(0.25 / 1.5)
    s = S.clone().requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0]])
    loss, metrics = distillation_loss(s, old, Q, mask, _cfg(loss_mode="k1", use_policy_gradient=True))
    assert float(loss.detach()) == pytest.approx(-LN2 * 1.2, abs=1e-9)
    loss.backward()
    assert float(s.grad.abs().sum()) == 0.0 and float(metrics["distillation/pg_clipfrac"]) == 1.0
    # loss_max_clamp = 0.5: A = (-0.5, 0.5) on policy -> per-token loss (0.5, -0.5), gradient (0.25, -0.25)
    s = S.clone().requires_grad_(True)
    loss, _ = distillation_loss(s, S, Q, FULL, _cfg(loss_mode="k1", use_policy_gradient=True, loss_max_clamp=0.5))
    loss.backward()
    torch.testing.assert_close(s.grad, torch.tensor([[0.25, -0.25]], dtype=torch.float64))


def test_global_batch_counts_divide_the_supervised_loss():
    # token-mean with the mini-batch's N = 8 tokens (this micro-batch holds 2 of them): sum / 8
    loss, _ = distillation_loss(S, S, Q, FULL, _cfg(), global_batch_info={"dp_size": 1, "batch_num_tokens": 8})
    assert float(loss.detach()) == pytest.approx(0.5 / 8, abs=1e-12)


def test_task_rewards_combine_with_the_coefficient_or_drop_out():
    task, dist = torch.tensor(2.0), torch.tensor(3.0)
    assert float(combine_with_task_loss(task, dist, True, 0.5)) == 3.5  # 2 + 0.5 · 3
    assert float(combine_with_task_loss(task, dist, False, 0.5)) == 3.0  # the task loss left out, coef 1
