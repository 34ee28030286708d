"""agg_loss: every mode by hand, and the global-batch contract: micro-batch / data-parallel invariance."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfoundry.algos import core_algos as ca
from rlfoundry.utils import torch_functional as F_

# loss_mat rows [1, 2, 3], [4, 5, 6], [7, 8, 9]; mask keeps 1, 2 | 4 | nothing (an empty sequence)
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 valid tokens
        ("token-sum", 7.0),  # 1 + 2 + 4
        ("seq-mean-token-sum", 3.5),  # sequence sums [3, 4], the empty sequence does not count: 7 / 2
        ("seq-mean-token-mean", 2.75),  # sequence means [1.5, 4] -> 5.5 / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / T (= 3, the padded width)
    ],
)
def test_agg_modes_by_hand(mode, expected):
    assert ca.agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_with_global_arguments_by_hand():
    # token-mean, 2 ranks, 14 tokens in the mini-batch: 7 * 2 / 14 = 1
    assert ca.agg_loss(LOSS, MASK, "token-mean", dp_size=2, batch_num_tokens=14).item() == pytest.approx(1.0)
    # token-sum, 2 ranks: 7 * 2 = 14 (the DP mean then halves it back to a plain sum)
    assert ca.agg_loss(LOSS, MASK, "token-sum", dp_size=2).item() == pytest.approx(14.0)
    # seq-mean-token-mean, 4 ranks, 8 sequences: (1.5 + 4) * 4 / 8 = 2.75
    assert ca.agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=4, global_batch_size=8).item() == pytest.approx(2.75)
    # seq-mean-token-sum-norm with a constant budget L = 7: (3 + 4) / 2 / 7 = .5
    assert ca.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)


def test_token_mean_ignores_nan_at_masked_positions_and_empty_batch_is_zero():
    junk = torch.where(MASK.bool(), LOSS, torch.full_like(LOSS, float("nan")))
    assert ca.agg_loss(junk, MASK, "token-mean").item() == pytest.approx(7 / 3)
    for mode in ca.AGG_LOSS_MODES:
        assert ca.agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def test_agg_errors_name_the_problem():
    with pytest.raises(ValueError, match="batch_num_tokens"):
        ca.agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        ca.agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        ca.agg_loss(LOSS, MASK, "token_mean")


def test_global_batch_info_counts():
    # 3 valid tokens; 2 sequences with at least one (the all-masked third does not count)
    expected = {"dp_size": 2, "batch_num_tokens": 3, "global_batch_size": 2}
    assert ca.compute_global_batch_info(MASK, dp_size=2) == expected


@settings(max_examples=50, deadline=None)
@given(
    bits=st.lists(st.booleans(), min_size=8 * 5, max_size=8 * 5),
    seed=st.integers(0, 2**16),
    rows=st.lists(st.integers(1, 4), min_size=1, max_size=8),
)
def test_token_mean_equals_masked_mean(bits, seed, rows):
    loss = torch.randn(8, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = torch.tensor(bits, dtype=torch.float64).view(8, 5)
    expected = F_.masked_mean(loss, mask) if mask.sum() > 0 else torch.tensor(0.0)
    torch.testing.assert_close(ca.agg_loss(loss, mask, "token-mean"), expected.double(), atol=1e-7, rtol=0)


def _split(n, sizes):
    """Consecutive chunks of range(n) with the given sizes (cycled), as index lists."""
    out, start, k = [], 0, 0
    while start < n:
        size = sizes[k % len(sizes)]
        out.append(list(range(start, min(n, start + size))))
        start, k = start + size, k + 1
    return out


def _micro_batch_grad(params, mask, mode, dp_size, micro_sizes, trim_padding):
    """Simulate dp_size ranks x micro-batches: grads summed over micro-batches, averaged over ranks."""
    info = ca.compute_global_batch_info(mask, dp_size=dp_size)
    total = torch.zeros_like(params)
    ranks = torch.arange(params.shape[0]).chunk(dp_size)
    for rank_rows in ranks:
        for local in _split(len(rank_rows), micro_sizes):
            rows = rank_rows[local]
            p = params.detach()[rows].requires_grad_(True)
            m = mask[rows]
            width = int(m.nonzero()[:, 1].max()) + 1 if trim_padding and m.any() else m.shape[1]
            loss_mat = p[:, :width].square() * torch.arange(1, width + 1, dtype=p.dtype)  # any per-token loss
            loss = ca.agg_loss(loss_mat, m[:, :width], mode, loss_scale_factor=params.shape[1], **info)
            (g,) = torch.autograd.grad(loss, p)
            total[rows] += g
    return total / dp_size  # FSDP/DDP all-reduce mean over ranks


@pytest.mark.parametrize("mode", ca.AGG_LOSS_MODES)
@settings(max_examples=50, deadline=None)
@given(
    bits=st.lists(st.booleans(), min_size=8 * 6, max_size=8 * 6),
    seed=st.integers(0, 2**16),
    micro_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    dp_size=st.sampled_from([1, 2]),
    trim_padding=st.booleans(),
)
def test_micro_batch_and_dp_invariance(mode, bits, seed, micro_sizes, dp_size, trim_padding):
    params = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = torch.tensor(bits, dtype=torch.float64).view(8, 6)

    whole = params.clone().requires_grad_(True)
    loss_mat = whole.square() * torch.arange(1, 7, dtype=whole.dtype)
    # the whole mini-batch in one call, local statistics (the definition of the mode)
    (g_whole,) = torch.autograd.grad(ca.agg_loss(loss_mat, mask, mode, loss_scale_factor=6), whole)

    g_split = _micro_batch_grad(params, mask, mode, dp_size, micro_sizes, trim_padding)
    torch.testing.assert_close(g_split, g_whole, atol=1e-6, rtol=0)
