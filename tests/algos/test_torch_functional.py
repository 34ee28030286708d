"""rlfoundry.utils.torch_functional: chunked log-probs/entropy against the naive formulas (values and
gradients), and the masked statistics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfoundry.utils import torch_functional as F_


def _naive_entropy(logits):
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 4, 100])
@pytest.mark.numerics
def test_logprobs_match_naive_values_and_grads_on_noncontiguous_slice(chunk_rows):
    torch.manual_seed(0)
    full = torch.randn(3, 6, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 4))
    weights = torch.randn(3, 4, dtype=torch.float64)

    logits = full[:, 1:5]  # the usual causal-LM slice: not viewable as (-1, V)
    ours = F_.logprobs_from_logits(logits, labels, chunk_rows=chunk_rows)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), full)
    ref = F_.logprobs_from_logits_naive(full[:, 1:5], labels)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), full)

    # float64, the same math in another op order: ~1e-16 x a few hundred terms
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_rows", [None, 2, 5])
@pytest.mark.numerics
def test_entropy_matches_naive_values_and_grads(chunk_rows):
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 5, dtype=torch.float64)
    ours = F_.entropy_from_logits(logits, chunk_rows=chunk_rows)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    ref = _naive_entropy(logits)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    # float64, the same math in another op order: ~1e-16 x a few hundred terms
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-12)


def test_entropy_hand_values():
    # uniform over 4 -> log 4; one-hot-ish (logit 100 vs 0) -> ~0; 2-d input works too
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    h = F_.entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.tensor([math.log(4.0), 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(F_.entropy_from_logits_with_chunking(logits, chunk_size=1), h)


@pytest.mark.numerics
def test_logprob_and_entropy_share_logits_in_backward():
    # the logits are not overwritten in backward (inplace_backward is ignored), so both terms are right
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    loss = F_.logprobs_from_logits(logits, labels, inplace_backward=True).sum() + F_.entropy_from_logits(logits).sum()
    (g,) = torch.autograd.grad(loss, logits)
    ref = F_.logprobs_from_logits_naive(logits, labels).sum() + _naive_entropy(logits).sum()
    (g_ref,) = torch.autograd.grad(ref, logits)
    # float64, the same math in another op order: ~1e-16 x a few hundred terms
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


@pytest.mark.numerics
def test_bf16_logits_reduce_in_fp32_and_grad_keeps_dtype():
    torch.manual_seed(3)
    logits = (torch.randn(2, 3, 50) * 5).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 50, (2, 3))
    out = F_.logprobs_from_logits(logits, labels, chunk_rows=2)
    assert out.dtype == torch.float32
    ref = F_.logprobs_from_logits_naive(logits.detach().float(), labels)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)  # exact up to fp32 rounding of bf16 inputs
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_logits = logits.detach().float().requires_grad_(True)
    F_.logprobs_from_logits_naive(ref_logits, labels).sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, atol=1e-2, rtol=0)  # bf16 rounding of grad


def test_masked_sum_mean_ignore_nan_outside_mask():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert F_.masked_sum(values, mask).item() == 13.0
    assert F_.masked_mean(values, mask).item() == pytest.approx(13.0 / 4)
    torch.testing.assert_close(F_.masked_mean(values, mask, axis=-1), torch.tensor([1.5, 5.0]))


def test_masked_var_hand_value_and_errors():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, squared deviations 1 + 0 + 1 = 2; biased 2/3, unbiased 2/2 = 1
    assert F_.masked_var(values, mask).item() == pytest.approx(1.0)
    assert F_.masked_var(values, mask, unbiased=False).item() == pytest.approx(2.0 / 3)
    with pytest.raises(ValueError, match="single element"):
        F_.masked_var(values, torch.tensor([1.0, 0, 0, 0]))
    with pytest.raises(ValueError, match="no element"):
        F_.masked_var(values, torch.zeros(4))


def test_masked_whiten_hand_value_and_shift_mean():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8)
    w = F_.masked_whiten(values, mask)
    torch.testing.assert_close(w[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(F_.masked_whiten(values, mask, shift_mean=False)[:3], torch.tensor([1.0, 2.0, 3.0]))


@settings(max_examples=50, deadline=None)
@given(
    data=st.lists(st.floats(-100, 100, allow_nan=False), min_size=12, max_size=12),
    bits=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_masked_whiten_gives_mean_0_var_1_over_mask(data, bits):
    values = torch.tensor(data, dtype=torch.float64).view(3, 4)
    mask = torch.tensor(bits, dtype=torch.float64).view(3, 4)
    if mask.sum() < 2 or F_.masked_var(values, mask) < 1e-3:
        return  # whitening needs two distinct valid values (the 1e-8 guard dominates below that)
    w = F_.masked_whiten(values, mask)
    assert F_.masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-7)
    assert F_.masked_var(w, mask).item() == pytest.approx(1.0, rel=1e-5)
