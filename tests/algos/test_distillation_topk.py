"""The top-k distillation loss (``forward_kl_topk``, algos/distillation.py; the student's side from
``engines/fsdp/forward.py``'s ``topk_log_probs``) against numbers worked by hand.

Vocabulary of 4. Position 1: teacher p = (1/2, 1/4, 1/8, 1/8), top-2 = tokens (0, 1); student uniform 1/4.
  KL over the top-2 = 1/2 ln(1/2 / 1/4) + 1/4 ln(1/4 / 1/4) = ln(2)/2 = 0.346574; not renormalised
  (renormalising to (2/3, 1/3) against (1/2, 1/2) would give 2/3 ln(4/3) + 1/3 ln(2/3) = 0.056633).
  teacher mass 3/4, student mass 1/2.
Position 2: teacher top-2 (tokens 2, 3) with p = (0.3, 0.2); student there (0.6, 0.3):
  0.3 ln(0.3/0.6) + 0.2 ln(0.2/0.3) = -0.288946 < 0: floored at 0 (both sums miss the rest of the mass).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlfoundry.algos.distillation import forward_kl_topk, topk_distillation_loss
from rlfoundry.engines.fsdp.forward import topk_log_probs

LN2 = math.log(2.0)
TEACHER_IDS = torch.tensor([[[0, 1], [2, 3]]])
TEACHER = torch.tensor([[[0.5, 0.25], [0.3, 0.2]]], dtype=torch.float64).log()
STUDENT_PROBS = torch.tensor([[[0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.6, 0.3]]], dtype=torch.float64)


def _cfg(**kw):
    base = dict(loss_mode="forward_kl_topk", loss_max_clamp=None, log_prob_min_clamp=None, use_policy_gradient=False,
                policy_loss_mode="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2)
    return SimpleNamespace(**(base | kw))


def _student_at_teacher_ids(logits: torch.Tensor) -> torch.Tensor:
    return topk_log_probs(logits, 0, TEACHER_IDS)["log_probs_at"]


def test_forward_kl_over_the_teacher_top_k_by_hand():
    student = _student_at_teacher_ids(STUDENT_PROBS.log())
    losses, parts = forward_kl_topk(student, TEACHER)
    torch.testing.assert_close(losses, torch.tensor([[LN2 / 2, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(parts["teacher_mass"], torch.tensor([[0.75, 0.5]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(parts["student_mass"], torch.tensor([[0.5, 0.9]]), atol=1e-6, rtol=0)
    # the second position's sum before the floor
    torch.testing.assert_close(parts["token_kl"][0, 1].sum(), torch.tensor(0.3 * math.log(0.5) + 0.2 * math.log(2 / 3)),
                               atol=1e-6, rtol=0)


def test_log_prob_min_clamp_floors_both_sides():
    # student puts e^-12 on the teacher's first token: 1/2 (ln 1/2 + 12) unclamped, 1/2 (ln 1/2 + 10) floored at -10
    student = torch.tensor([[[-12.0, math.log(0.25)]]], dtype=torch.float64)
    teacher = TEACHER[:, :1]
    unclamped, _ = forward_kl_topk(student, teacher)
    clamped, parts = forward_kl_topk(student, teacher, log_prob_min_clamp=-10.0)
    assert float(unclamped) == pytest.approx(0.5 * (12 - LN2), abs=1e-6)
    assert float(clamped) == pytest.approx(0.5 * (10 - LN2), abs=1e-6)
    assert float(parts["student_mass"]) == pytest.approx(math.exp(-12) + 0.25, abs=1e-7)  # the mass before the clamp


def test_top_k_and_log_probs_at_ids_are_the_log_softmax():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 11, (3, 5, 4), generator=torch.Generator().manual_seed(1))
    out = topk_log_probs(logits, 4, ids)
    reference = torch.log_softmax(logits, -1)
    top = reference.topk(4, -1)
    torch.testing.assert_close(out["topk_log_probs"], top.values)
    assert torch.equal(out["topk_ids"], top.indices)
    torch.testing.assert_close(out["log_probs_at"], reference.gather(-1, ids))


@pytest.mark.parametrize("clamp", [None, -3.0])
def test_the_gradient_on_the_logits_is_the_closed_form(clamp):
    """d/dz_j of sum_i q_i (log q_i - log softmax(z)_i) over the teacher's ids i in A is m_A p_j - q_j [j in A],
    with m_A the teacher's mass on A (verl's Megatron backward writes it out); under a clamp, A keeps only the
    ids whose student log-prob is above it. token-mean over 2 valid tokens of 3 divides by 2."""
    g = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(1, 3, 7, generator=g, dtype=torch.float64)).requires_grad_(True)
    ids = torch.tensor([[[0, 3, 5], [1, 2, 6], [4, 0, 1]]])
    teacher = torch.log(torch.tensor([[[0.5, 0.2, 0.1], [0.3, 0.3, 0.2], [0.6, 0.1, 0.1]]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    student = topk_log_probs(logits, 0, ids)["log_probs_at"]
    loss, _ = topk_distillation_loss(student, student, student, teacher, ids, ids, mask,
                                     _cfg(log_prob_min_clamp=clamp))
    loss.backward()
    p = torch.softmax(logits.detach(), -1)
    q = teacher.exp()
    active = torch.ones_like(q, dtype=torch.bool) if clamp is None else student.detach() > clamp
    if clamp is not None:
        assert not active.all() and active.any()  # the clamp bites somewhere and not everywhere
    q_active = q * active
    expected = q_active.sum(-1, keepdim=True) * p - torch.zeros_like(p).scatter_add(-1, ids, q_active)
    expected = expected * mask[..., None] / 2
    # the per-token KLs are positive here, so the floor at 0 passes the gradient; the KL sums in fp32 (as verl's)
    assert float(expected.abs().max()) > 0.05
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=0)


def test_metrics_and_aggregation():
    """token-mean of (ln2/2, 0) = ln2/4; loss_max over valid tokens; masses averaged over valid tokens; the
    student's own top-2 at position 1 is a tie broken by index (tokens 0, 1 = the teacher's): overlap 2/2;
    at position 2 it is (2, 3) = the teacher's: overlap 1. overlap_token_advantage: position 1's -e^q (q - s)
    averaged over its 2 shared tokens = -(ln2/2 + 0)/2; position 2's = -(-0.288946)/2; mean of the two."""
    student_ids = torch.tensor([[[0, 1], [2, 3]]])
    student = _student_at_teacher_ids(STUDENT_PROBS.log())
    loss, m = topk_distillation_loss(student, student, student, TEACHER, TEACHER_IDS, student_ids,
                                     torch.ones(1, 2), _cfg())
    assert float(loss) == pytest.approx(LN2 / 4, abs=1e-6)
    assert float(m["distillation/loss_max"]) == pytest.approx(LN2 / 2, abs=1e-6)
    assert float(m["distillation/teacher_mass"]) == pytest.approx(0.625, abs=1e-6)
    assert float(m["distillation/student_mass"]) == pytest.approx(0.7, abs=1e-6)
    assert float(m["distillation/student_mass_max"]) == pytest.approx(0.9, abs=1e-6)
    assert float(m["distillation/overlap_ratio"]) == pytest.approx(1.0, abs=1e-6)
    second = 0.3 * math.log(0.5) + 0.2 * math.log(2 / 3)
    assert float(m["distillation/overlap_token_advantage"]) == pytest.approx((-LN2 / 4 - second / 2) / 2, abs=1e-6)
    # no overlap at either position: ratio 0 and advantage 0 (not NaN); a padded second token is left out
    disjoint = torch.tensor([[[2, 3], [0, 1]]])
    loss, m = topk_distillation_loss(student, student, student, TEACHER, TEACHER_IDS, disjoint,
                                     torch.tensor([[1.0, 0.0]]), _cfg())
    assert float(m["distillation/overlap_ratio"]) == 0.0 and float(m["distillation/overlap_token_advantage"]) == 0.0
    assert float(loss) == pytest.approx(LN2 / 2, abs=1e-6)
    assert float(m["distillation/teacher_mass"]) == pytest.approx(0.75, abs=1e-6)
