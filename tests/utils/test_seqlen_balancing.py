"""Token-budget micro-batching and balanced partitions."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlfoundry.protocol import DataProto
from rlfoundry.utils import seqlen_balancing as sb
from rlfoundry.utils.seqlen_balancing import (
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    rearrange_micro_batches,
    restore_order,
)


def _batch(lengths: list[int], width: int | None = None, left_pad: bool = False) -> TensorDict:
    width = width or max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left_pad:
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    return TensorDict({"attention_mask": mask, "row": torch.arange(len(lengths))}, batch_size=[len(lengths)])


def _check_micro_batches(lengths: list[int], budget: int, micros, idx_lists) -> None:
    flat = [i for idx in idx_lists for i in idx]
    assert sorted(flat) == list(range(len(lengths))), "every row exactly once"
    for micro, idx in zip(micros, idx_lists):
        assert micro["row"].tolist() == idx, "micro-batch j holds rows idx_lists[j]"
        assert int(micro["attention_mask"].sum()) <= budget


def test_hand_built_example_packs_perfectly_and_restores_order():
    # lengths sum to 36 with budget 12, so at least 3 micro-batches; 10+2, 5+7, 3+9 is a perfect
    # split, and differencing finds it: pair the longest with the shortest that fills the gap.
    lengths = [10, 2, 5, 7, 3, 9]
    td = _batch(lengths, width=10, left_pad=True)
    micros, idx_lists = rearrange_micro_batches(td, max_token_len=12)
    assert len(micros) == 3
    assert sorted(int(m["attention_mask"].sum()) for m in micros) == [12, 12, 12]
    _check_micro_batches(lengths, 12, micros, idx_lists)
    outputs = torch.cat([m["row"] * 100 for m in micros])  # a per-row "model output"
    assert restore_order(outputs, idx_lists).tolist() == [0, 100, 200, 300, 400, 500]


def test_dataproto_in_dataproto_out():
    lengths = [4, 1, 3, 2]
    td = _batch(lengths)
    data = DataProto(batch=td, non_tensor_batch={"uid": np.array(list("abcd"), dtype=object)})
    micros, idx_lists = rearrange_micro_batches(data, max_token_len=5)
    assert all(isinstance(m, DataProto) for m in micros)
    for m, idx in zip(micros, idx_lists):
        assert list(m.non_tensor_batch["uid"]) == [list("abcd")[i] for i in idx]
        assert int(m.batch["attention_mask"].sum()) <= 5


def test_row_longer_than_budget_is_an_error_that_names_the_key():
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        rearrange_micro_batches(_batch([3, 9]), max_token_len=8)


def test_get_reverse_idx_inverts_and_rejects_non_permutations():
    assert get_reverse_idx([[2, 0], [1]]) == [1, 2, 0]
    assert get_reverse_idx([2, 0, 1]) == [1, 2, 0]
    with pytest.raises(ValueError):
        get_reverse_idx([[0, 0], [1]])


def test_equal_size_partitions_are_balanced():
    # total 39 over 2 ranks, 4 rows each: the best possible split is 19 / 20.
    parts = get_seqlen_balanced_partitions([5, 3, 8, 1, 9, 2, 7, 4], k_partitions=2, equal_size=True)
    seqlens = [5, 3, 8, 1, 9, 2, 7, 4]
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(sum(seqlens[i] for i in p) for p in parts) == [19, 20]
    with pytest.raises(ValueError, match="divisible"):
        get_seqlen_balanced_partitions([1, 2, 3], k_partitions=2, equal_size=True)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=24),
    slack=st.integers(min_value=0, max_value=60),
)
def test_property_micro_batches_fit_cover_and_restore(lengths, slack):
    budget = max(lengths) + slack
    micros, idx_lists = rearrange_micro_batches(_batch(lengths), max_token_len=budget)
    _check_micro_batches(lengths, budget, micros, idx_lists)
    assert all(len(idx) > 0 for idx in idx_lists)
    assert len(micros) >= -(-sum(lengths) // budget)
    restored = restore_order(torch.cat([m["row"] for m in micros]), idx_lists)
    assert restored.tolist() == list(range(len(lengths)))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=24),
    k=st.integers(min_value=1, max_value=4),
)
def test_property_equal_size_partitions(lengths, k):
    lengths = lengths[: len(lengths) - len(lengths) % k] or [1] * k
    parts = get_seqlen_balanced_partitions(lengths, k, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert {len(p) for p in parts} == {len(lengths) // k}
    sums = [sum(lengths[i] for i in p) for p in parts]
    # Differencing leaves at most one item's worth of imbalance between any two parts.
    assert max(sums) - min(sums) <= max(lengths)


# ---- the same number of micro-batches on every dp rank -----------------------------------------


class _ThreadGroup:
    """Stands in for a 2-rank process group: ranks are threads, all-reduce meets at a barrier.

    Exercises the agreement protocol without process start-up; the real gloo path runs in the
    critic's 2-rank test (use_dynamic_bsz).
    """

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size)
        self.slots: dict[int, int] = {}
        self.lock = threading.Lock()

    def all_reduce(self, value: int, op) -> int:
        with self.lock:
            self.slots[threading.get_ident()] = value
        self.barrier.wait()
        result = (max if op == dist.ReduceOp.MAX else min)(self.slots.values())
        self.barrier.wait()  # everyone has read before the next round overwrites
        return result


def test_dp_ranks_agree_on_micro_batch_count(monkeypatch):
    # Rank 0 fits in one micro-batch of 16 tokens, rank 1 needs three (3 rows of 10): both use 3.
    group = _ThreadGroup(2)
    monkeypatch.setattr(sb, "all_reduce_int", lambda value, op, g: g.all_reduce(value, op))
    lengths = {0: [4, 4, 4], 1: [10, 10, 10]}
    results: dict[int, tuple] = {}

    def rank(r: int) -> None:
        micros, idx_lists = rearrange_micro_batches(_batch(lengths[r]), 16, dp_group=group)
        results[r] = (len(micros), idx_lists, [int(m["attention_mask"].sum()) for m in micros])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results[0][0] == results[1][0] == 3
    for r in (0, 1):
        _, idx_lists, sums = results[r]
        assert sorted(i for idx in idx_lists for i in idx) == [0, 1, 2]
        assert max(sums) <= 16
    # Without a group each rank keeps its own count.
    assert len(rearrange_micro_batches(_batch(lengths[0]), 16)[0]) == 1


# ---- length-sorted micro-batches for padded forwards ------------------------------------------


def test_length_sorted_micro_batches_hand_example():
    # prompt width 2; budget 20 padded tokens. Longest first: rows 1 (8), 3 (6), 0 (3), 4 (2), 2 (1).
    # [1, 3]: 2 rows x (2 + 8) = 20 fits, a third would cost 30; [0, 4, 2]: 3 x (2 + 3) = 15.
    parts = sb.length_sorted_micro_batches([3, 8, 1, 6, 2], prompt_width=2, max_token_len=20)
    assert parts == [[1, 3], [0, 4, 2]]
    # padded cost 20 + 15 = 35 tokens; balanced-by-real-tokens parts padded to the batch's longest
    # response (8) would cost 5 x 10 = 50.
    assert sum(len(p) * (2 + [3, 8, 1, 6, 2][p[0]]) for p in parts) == 35


def test_length_sorted_micro_batches_reject_a_row_over_budget():
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget 9.*ppo_max_token_len_per_gpu"):
        sb.length_sorted_micro_batches([3, 8], prompt_width=2, max_token_len=9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=40), st.integers(0, 8), st.integers(0, 60))
def test_property_length_sorted_parts_fit_cover_and_are_fewest(lengths, prompt, slack):
    budget = prompt + max(lengths) + slack
    parts = sb.length_sorted_micro_batches(lengths, prompt, budget)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    for p in parts:
        assert len(p) * (prompt + max(lengths[i] for i in p)) <= budget
    # fewest: no two neighbouring parts (in longest-first order) could have been one
    for a, b in zip(parts, parts[1:]):
        assert (len(a) + len(b)) * (prompt + lengths[a[0]]) > budget


def test_length_sorted_ranks_agree_on_the_count(monkeypatch):
    # rank 0: one part of 4 rows; rank 1: three parts -> rank 0 splits its costliest part until 3
    group = _ThreadGroup(2)
    monkeypatch.setattr(sb, "all_reduce_int", lambda value, op, g: g.all_reduce(value, op))
    lengths = {0: [2, 2, 2, 2], 1: [10, 10, 10]}
    results: dict[int, list] = {}

    def rank(r: int) -> None:
        results[r] = sb.length_sorted_micro_batches(lengths[r], 0, 16, dp_group=group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results[1] == [[0], [1], [2]]
    assert len(results[0]) == 3 and sorted(i for p in results[0] for i in p) == [0, 1, 2, 3]
    assert sorted(len(p) for p in results[0]) == [1, 1, 2]
