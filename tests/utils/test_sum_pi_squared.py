"""sum_v softmax(z)_v^2 from the entropy's blocks (``entropy_and_sum_pi_squared``, verl's
``calculate_sum_pi_squared_from_logits``) and from the fused head's chunks (``fused_logprobs_entropy``):
equal to a float64 softmax for every block size, 1 for a one-hot distribution and 1/V for a flat one,
without gradient, and leaving the entropy and its gradient as they were."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.utils import torch_functional as F_

# every path's sum against a float64 softmax, within float32 bounds: a comparison across numerics (#51)
pytestmark = pytest.mark.numerics


def _direct(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), -1).square().sum(-1)


@pytest.mark.parametrize("chunk_rows", [None, 1, 3])
def test_blockwise_sum_pi_squared_equals_the_softmax(chunk_rows):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 40, generator=g) * 4).requires_grad_()
    entropy, squares = F_.entropy_and_sum_pi_squared(logits, chunk_rows)
    torch.testing.assert_close(squares.double(), _direct(logits), atol=1e-6, rtol=0)
    assert not squares.requires_grad and entropy.requires_grad
    torch.testing.assert_close(entropy, F_.entropy_from_logits(logits, chunk_rows), atol=0, rtol=0)
    (grad_with,) = torch.autograd.grad(entropy.sum(), logits)
    (grad_alone,) = torch.autograd.grad(F_.entropy_from_logits(logits, chunk_rows).sum(), logits)
    torch.testing.assert_close(grad_with, grad_alone, atol=0, rtol=0)
    torch.testing.assert_close(F_.calculate_sum_pi_squared_from_logits(logits, chunk_rows), squares)


def test_one_hot_and_flat_limits():
    flat = torch.zeros(3, 50)
    peaked = torch.full((3, 50), -1e4)
    peaked[:, 7] = 0.0
    assert torch.allclose(F_.calculate_sum_pi_squared_from_logits(flat), torch.full((3,), 1 / 50))
    assert torch.allclose(F_.calculate_sum_pi_squared_from_logits(peaked), torch.ones(3))


@pytest.mark.parametrize("chunk_rows", [1, 4, 64])
def test_the_fused_head_gives_the_same_sum_and_excludes_ids(chunk_rows):
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(30, 8, generator=g) * 2
    labels = torch.randint(0, 28, (10,), generator=g)
    logp, entropy, squares = F_.fused_logprobs_entropy(hidden, weight, labels, temperature=0.7, excluded_ids=[28, 29],
                                                       chunk_rows=chunk_rows, sum_pi_squared=True)
    logits = (hidden @ weight.t()) / 0.7
    logits[:, 28:] = float("-inf")  # excluded ids: probability 0
    torch.testing.assert_close(squares.double(), _direct(logits), atol=1e-6, rtol=0)
    plain_logp, plain_entropy = F_.fused_logprobs_entropy(hidden, weight, labels, temperature=0.7,
                                                          excluded_ids=[28, 29], chunk_rows=chunk_rows)
    assert torch.equal(logp, plain_logp) and torch.equal(entropy, plain_entropy)
