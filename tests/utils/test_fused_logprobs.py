"""``fused_logprobs_entropy`` (verl's ``use_fused_kernels``, torch backend): the same log-probs,
entropies and gradients as the full logits, while no tensor it makes is as large as (N, V)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlfoundry.models.vision import mask_placeholders
from rlfoundry.utils.torch_functional import entropy_from_logits, fused_logprobs_entropy, logprobs_from_logits


def _inputs(rows: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    return h, w, labels


def _naive(h, w, labels, temperature, excluded):
    """The unfused path as forward.py runs it: full logits, / T, placeholders masked, then the ops."""
    logits = mask_placeholders((h @ w.t()) / temperature, excluded)
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.numerics
def test_values_and_gradients_equal_the_full_logits(dtype, tol, chunk):
    """23 rows in chunks of 1, 7 (not a divisor) and 64 (one chunk); temperature 0.7; ids 5 and 11
    excluded (labels avoid them: their log-prob is -inf-like either way). A loss mixing log-probs and
    entropy with random weights checks dL/dhidden and dL/dweight, each term's backward included."""
    excluded = [5, 11]
    h, w, labels = _inputs(23, 8, 40, dtype)
    labels = torch.where(torch.isin(labels, torch.tensor(excluded)), labels + 1, labels)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(23, generator=gen, dtype=dtype), torch.randn(23, generator=gen, dtype=dtype)

    lp, ent = fused_logprobs_entropy(h, w, labels, temperature=0.7, excluded_ids=excluded, chunk_rows=chunk)
    fused_grads = torch.autograd.grad((a * lp).sum() + (b * ent).sum(), (h, w))
    lp_ref, ent_ref = _naive(h, w, labels, 0.7, excluded)
    ref_grads = torch.autograd.grad((a * lp_ref).sum() + (b * ent_ref).sum(), (h, w))

    assert lp.dtype == ent.dtype == dtype
    torch.testing.assert_close(lp, lp_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(ent, ent_ref, atol=tol, rtol=tol)
    for got, want in zip(fused_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the excluded ids have probability 0: their weight rows get no gradient
    assert torch.all(fused_grads[1][excluded] == 0)


@pytest.mark.numerics
def test_entropy_without_gradient_skips_its_term():
    """entropy_grad=False: the entropy is a constant (no grad_fn), the log-prob gradient is unchanged."""
    h, w, labels = _inputs(9, 6, 30, torch.float64)
    lp, ent = fused_logprobs_entropy(h, w, labels, chunk_rows=4, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    (lp.sum() + ent.sum()).backward()  # the entropy adds nothing to the gradient
    got = h.grad.clone()
    h.grad = None
    logprobs_from_logits(h @ w.t(), labels).sum().backward()
    torch.testing.assert_close(got, h.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.numerics
def test_leading_dims_and_empty_input():
    """(b, n, H) hidden and (b, n) labels come back (b, n); zero rows give empty outputs and gradients."""
    h, w, labels = _inputs(12, 6, 30, torch.float32)
    lp, ent = fused_logprobs_entropy(h.reshape(3, 4, 6), w, labels.reshape(3, 4), chunk_rows=5)
    assert lp.shape == ent.shape == (3, 4)
    torch.testing.assert_close(lp.reshape(-1), logprobs_from_logits(h @ w.t(), labels))
    empty_lp, _ = fused_logprobs_entropy(h[:0], w, labels[:0])
    empty_lp.sum().backward()
    assert empty_lp.shape == (0,) and torch.all(w.grad == 0)


@pytest.mark.numerics
def test_bf16_compute_matches_the_bf16_lm_head():
    """bf16 hidden and weight (FSDP2's mixed precision): the chunk's product is bf16 as the LM head's,
    statistics in fp32 — the unfused path's numbers within bf16 product rounding."""
    h, w, labels = _inputs(50, 32, 300, torch.bfloat16)
    lp, ent = fused_logprobs_entropy(h, w, labels, chunk_rows=16)
    lp.sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = h @ w.t()
    logprobs_from_logits(logits, labels).sum().backward()
    assert lp.dtype == torch.float32
    # the fused head in bf16 vs the bf16 lm_head, accumulating in fp32 both: rounding of the fp32 reductions
    torch.testing.assert_close(lp, logprobs_from_logits(logits.detach(), labels), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, entropy_from_logits(logits.detach()), atol=1e-5, rtol=1e-5)
    # bf16 gradients (u = 2^-8 = 4e-3) rounded at other points: a few bf16 ulps
    torch.testing.assert_close(gh.float(), h.grad.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.float(), w.grad.float(), atol=2e-2, rtol=2e-2)


class _LargestOutput(TorchDispatchMode):
    """Records the element count of every tensor an op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest(fn) -> int:
    with _LargestOutput() as mode:
        fn()
    return mode.largest


def test_the_largest_tensor_is_one_chunk_of_logits_not_all_of_them():
    """N = 300 rows, V = 1000, H = 16, chunks of 32: forward + backward never make a tensor above
    max(32 x V, V x H) = 32,000 elements (a chunk's logits; the weight gradient is V x H = 16,000),
    where the full-logits path makes N x V = 300,000."""
    rows, hidden, vocab, chunk = 300, 16, 1000, 32

    def fused():
        h, w, labels = _inputs(rows, hidden, vocab, torch.float32)
        lp, ent = fused_logprobs_entropy(h, w, labels, chunk_rows=chunk)
        (lp.sum() + ent.sum()).backward()

    def unfused():
        h, w, labels = _inputs(rows, hidden, vocab, torch.float32)
        lp, ent = _naive(h, w, labels, 1.0, [])
        (lp.sum() + ent.sum()).backward()

    assert _largest(fused) <= max(chunk * vocab, vocab * hidden) == 32_000
    assert _largest(unfused) >= rows * vocab


@pytest.mark.numerics
def test_under_autocast_the_product_is_in_the_autocast_dtype_as_the_lm_head():
    """fp32 weights under bf16 autocast (the one-rank mixed-precision path): the fused chunk products are
    bf16 like autocast's ``lm_head``, in forward and backward alike (gradients come back fp32)."""
    h, w, labels = _inputs(40, 32, 300, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = fused_logprobs_entropy(h, w, labels, chunk_rows=16)
        ref = logprobs_from_logits(h @ w.t(), labels)
    # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    exact = logprobs_from_logits(h.detach() @ w.detach().t(), labels)
    assert (lp - exact).abs().max() > 1e-4  # bf16 products, not fp32 ones
    (gh,) = torch.autograd.grad(lp.sum(), h)
    assert gh.dtype == torch.float32
