"""Token-budget micro-batching and sequence-length balancing.

Two users:

- workers (``use_dynamic_bsz``): with packed forwards (``use_remove_padding``),
  :func:`rearrange_micro_batches` packs the rows of a batch into micro-batches whose *real* token
  count (``attention_mask.sum(-1)``) stays within ``max_token_len``, so a forward pass costs about
  the same whatever the response lengths; with padded forwards, :func:`length_sorted_micro_batches`
  groups rows of similar response length so that little padding is computed;
  :func:`restore_order` puts per-row outputs back in the caller's row order.
- the trainer (``trainer.balance_batch``): :func:`get_seqlen_balanced_partitions` splits a batch
  into ``dp`` equal-sized groups with similar token totals, so no rank waits on a straggler.

Partitioning uses the Karmarkar-Karp largest-differencing method (Karmarkar & Karp 1982; the
k-way form is in Korf, "Multi-way number partitioning", IJCAI 2009), which is near-optimal for
this problem and runs in O(n log n · k).

Usage in a worker::

    micro_batches, idx_lists = rearrange_micro_batches(data, max_token_len=4096, dp_group=group)
    outputs = torch.cat([forward(mb) for mb in micro_batches])
    outputs = restore_order(outputs, idx_lists)        # row i is again row i of ``data``
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Sequence, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

if TYPE_CHECKING:
    from rlfoundry.protocol import DataProto

Batch = TypeVar("Batch", "DataProto", TensorDict)

__all__ = [
    "get_seqlen_balanced_partitions",
    "rearrange_micro_batches",
    "get_reverse_idx",
    "restore_order",
    "num_micro_batches_for_budget",
    "length_sorted_micro_batches",
    "all_reduce_int",
    "all_reduce_ints",
]


# ---- Karmarkar-Karp -----------------------------------------------------------------------


class _KKState:
    """A candidate k-way split: ``k`` (sum, items) partitions kept sorted by sum, descending."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[int, list[int]]]) -> None:
        self.parts = sorted(parts, key=lambda p: -p[0])

    @property
    def spread(self) -> int:
        return self.parts[0][0] - self.parts[-1][0]

    def merge(self, other: _KKState) -> _KKState:
        # Pair the heaviest part of one with the lightest of the other: the differencing step
        # that cancels as much of the two spreads as possible.
        paired = zip(self.parts, reversed(other.parts))
        return _KKState([(a[0] + b[0], a[1] + b[1]) for a, b in paired])


def _initial_states(seqlens: Sequence[int], k: int, equal_size: bool) -> list[_KKState]:
    empty = [(0, [])] * (k - 1)
    if not equal_size:
        return [_KKState([(seqlens[i], [i])] + empty) for i in range(len(seqlens))]
    # Equal sizes: start from groups of k consecutive (by length) items, one item per part; each
    # merge then adds exactly one item to every part, so all parts end with len/k items.
    order = sorted(range(len(seqlens)), key=lambda i: seqlens[i])
    groups = [order[s : s + k] for s in range(0, len(order), k)]
    return [_KKState([(seqlens[i], [i]) for i in g]) for g in groups]


def _karmarkar_karp(seqlens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    counter = itertools.count()  # tie-breaker: deterministic, and never compares states
    heap = [(-s.spread, next(counter), s) for s in _initial_states(seqlens, k, equal_size)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, next(counter), merged))
    return [sorted(items) for _, items in heap[0][2].parts]


def get_seqlen_balanced_partitions(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split indices ``0..len(seqlen_list)-1`` into ``k_partitions`` groups with similar length sums.

    Args:
        seqlen_list: token count of each item (e.g. ``attention_mask.sum(-1)``).
        k_partitions: number of groups (dp size for ``balance_batch``, micro-batch count for
            dynamic batching).
        equal_size: every group gets exactly ``len / k`` items (needs ``len % k == 0``); the
            trainer needs this so every dp rank receives the same number of rows.

    Returns:
        ``k_partitions`` lists of indices, each sorted ascending, together covering every index
        exactly once. Deterministic for a given input. Without ``equal_size`` no group is empty
        as long as there are at least ``k_partitions`` items.
    """
    n = len(seqlen_list)
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be >= 1, got {k_partitions}")
    if equal_size and n % k_partitions != 0:
        raise ValueError(f"equal_size partitions need len(seqlen_list) ({n}) divisible by k_partitions ({k_partitions})")
    if n == 0:
        return [[] for _ in range(k_partitions)]
    seqlens = [int(s) for s in seqlen_list]
    parts = _karmarkar_karp(seqlens, k_partitions, equal_size)
    if not equal_size:
        _fill_empty_parts(parts, seqlens)
    return parts


def _fill_empty_parts(parts: list[list[int]], seqlens: Sequence[int]) -> None:
    """Give each empty part the shortest item of the fullest part (in place).

    Differencing can leave a part empty when one item dominates; an empty micro-batch would be a
    wasted (or, under FSDP, awkward) forward pass. Moving one item never raises the largest sum.
    """
    for part in parts:
        if part:
            continue
        donor = max(parts, key=len)
        if len(donor) < 2:
            return  # fewer items than parts: some must stay empty
        shortest = min(donor, key=lambda i: (seqlens[i], i))
        donor.remove(shortest)
        part.append(shortest)


# ---- micro-batching by token budget -------------------------------------------------------


def _within_budget(parts: list[list[int]], seqlens: Sequence[int], budget: int) -> bool:
    return all(sum(seqlens[i] for i in p) <= budget for p in parts)


def _partition_within_budget(seqlens: list[int], k: int, budget: int) -> list[list[int]] | None:
    """Balanced k-way split whose every part fits the budget, or None if this k does not do it."""
    if k > len(seqlens):
        return None
    parts = get_seqlen_balanced_partitions(seqlens, k, equal_size=False)
    return parts if _within_budget(parts, seqlens, budget) else None


def all_reduce_int(value: int, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> int:
    """One integer reduced over ``group`` (e.g. MAX of micro-batch counts)."""
    return all_reduce_ints([value], op, group)[0]


def all_reduce_ints(values: Sequence[int], op: dist.ReduceOp, group: dist.ProcessGroup | None) -> list[int]:
    """Integers reduced element-wise over ``group`` in one collective."""
    # On NCCL the tensor must live on the GPU; gloo wants CPU. Pick by the group's backend.
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def num_micro_batches_for_budget(
    seqlens: Sequence[int], max_token_len: int, dp_group: dist.ProcessGroup | None = None
) -> tuple[int, list[list[int]]]:
    """The fewest micro-batches (agreed across ``dp_group``) that keep every one within budget.

    Returns ``(k, parts)`` with this rank's partition into ``k`` parts. Starts from the lower
    bound ``ceil(total / budget)`` and grows ``k`` until a balanced split fits on every rank;
    ``k <= len(seqlens)`` always fits because each row alone is checked against the budget.
    """
    seqlens = [int(s) for s in seqlens]
    too_long = [s for s in seqlens if s > max_token_len]
    if too_long:
        raise ValueError(
            f"a sequence of {max(too_long)} tokens exceeds the micro-batch token budget {max_token_len}; "
            "raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu / forward_max_token_len_per_gpu "
            "to at least max_prompt_length + max_response_length"
        )
    k = max(1, -(-sum(seqlens) // max_token_len))
    synced = dp_group is not None
    while True:
        if dp_group is not None:
            k = all_reduce_int(k, dist.ReduceOp.MAX, dp_group)
        parts = _partition_within_budget(seqlens, k, max_token_len)
        # Rows are never split, so with more micro-batches than rows some stay empty (allowed
        # only when other ranks need that many).
        fits = parts is not None or k >= len(seqlens)
        all_fit = all_reduce_int(int(fits), dist.ReduceOp.MIN, dp_group) if synced else int(fits)
        if all_fit:
            if parts is None:
                parts = [[i] for i in range(len(seqlens))] + [[] for _ in range(k - len(seqlens))]
            return k, parts
        if not fits:
            k += 1


def length_sorted_micro_batches(
    response_lengths: Sequence[int], prompt_width: int, max_token_len: int, dp_group: dist.ProcessGroup | None = None
) -> list[list[int]]:
    """Micro-batches for a padded forward that is cut after each micro-batch's longest response.

    Such a micro-batch costs rows × (prompt_width + its longest response) tokens, padding
    included, so rows of similar length belong together. Rows are taken longest response first
    and each micro-batch takes as many as fit ``max_token_len`` at the width of its first row: in
    that order no split has fewer micro-batches. Ranks of ``dp_group`` agree on the count (the
    largest, since FSDP may run collectives per micro-batch): a rank with fewer splits its
    costliest micro-batch in two until it has as many (empty ones once it runs out of rows).
    Returns lists of row indices, longest responses first.
    """
    lengths = [int(n) for n in response_lengths]
    widest = prompt_width + max(lengths, default=0)
    if widest > max_token_len:
        raise ValueError(
            f"a sequence of {widest} tokens (prompt + response) exceeds the micro-batch token budget {max_token_len}; "
            "raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu to at least "
            "max_prompt_length + max_response_length"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = []
    for i in order:
        if parts and (len(parts[-1]) + 1) * (prompt_width + lengths[parts[-1][0]]) <= max_token_len:
            parts[-1].append(i)
        else:
            parts.append([i])
    k = len(parts) if dp_group is None else all_reduce_int(max(len(parts), 1), dist.ReduceOp.MAX, dp_group)

    def cost(part: list[int]) -> int:
        return len(part) * (prompt_width + lengths[part[0]]) if part else 0

    while len(parts) < k:
        big = max(range(len(parts)), key=lambda j: cost(parts[j]), default=None)
        if big is None or len(parts[big]) < 2:
            parts.append([])
            continue
        half = len(parts[big]) // 2
        parts[big: big + 1] = [parts[big][:half], parts[big][half:]]
    return parts


def _take_rows(batch: Batch, idx: list[int]) -> Batch:
    if isinstance(batch, TensorDict):
        return batch[torch.tensor(idx, dtype=torch.long, device=batch.device)]
    return batch.select_idxs(idx)


def _attention_mask_of(batch: DataProto | TensorDict) -> torch.Tensor:
    td = batch if isinstance(batch, TensorDict) else batch.batch
    if td is None or "attention_mask" not in td.keys():
        raise KeyError("rearrange_micro_batches needs an 'attention_mask' tensor to count real tokens per row")
    return td["attention_mask"]


def rearrange_micro_batches(
    batch: Batch,
    max_token_len: int,
    dp_group: dist.ProcessGroup | None = None,
    same_micro_num_in_dp: bool = True,
) -> tuple[list[Batch], list[list[int]]]:
    """Pack rows into micro-batches of at most ``max_token_len`` real tokens each.

    Args:
        batch: a ``DataProto`` or ``TensorDict`` with ``attention_mask`` (B, T); a row's cost is
            its number of real tokens, ``attention_mask.sum(-1)`` (padding is free when padding
            removal is on, and roughly proportional otherwise).
        max_token_len: per-micro-batch budget (``ppo_max_token_len_per_gpu`` etc.). Every row
            must fit on its own.
        dp_group: when given (and ``same_micro_num_in_dp``), all ranks agree on the *same number*
            of micro-batches (all-reduce MAX), because every FSDP forward/backward is a collective
            and a rank with one extra micro-batch would hang the others.
        same_micro_num_in_dp: set False to let each rank use its own count (only safe when the
            micro-batch loop contains no collectives).

    Returns:
        ``(micro_batches, idx_lists)``: ``micro_batches[j]`` holds rows ``idx_lists[j]`` of
        ``batch`` (same type as ``batch``, ascending row order within it). Micro-batches are ordered
        by their first row. Pass ``idx_lists`` to :func:`restore_order` to undo the permutation.
        With a dp_group, a rank may get an empty micro-batch only if it has fewer rows than
        another rank's count.
    """
    seqlens = _attention_mask_of(batch).sum(-1).tolist()
    group = dp_group if same_micro_num_in_dp else None
    _, parts = num_micro_batches_for_budget(seqlens, max_token_len, group)
    parts.sort(key=lambda p: (p[0] if p else float("inf")))
    return [_take_rows(batch, p) for p in parts], parts


def get_reverse_idx(idx_list: Sequence[int] | Sequence[Sequence[int]]) -> list[int]:
    """Inverse permutation: ``reverse[idx[j]] = j``.

    Accepts the flat concatenation of the micro-batch index lists or the nested lists themselves.
    ``concatenated_outputs[reverse]`` puts outputs back in the original row order.
    """
    flat = _flatten(idx_list)
    reverse = [-1] * len(flat)
    for pos, row in enumerate(flat):
        if not 0 <= row < len(flat) or reverse[row] != -1:
            raise ValueError(f"index lists are not a permutation of 0..{len(flat) - 1} (bad or repeated row {row})")
        reverse[row] = pos
    return reverse


def _flatten(idx_list: Sequence[int] | Sequence[Sequence[int]]) -> list[int]:
    if len(idx_list) and isinstance(idx_list[0], (list, tuple)):
        return [int(i) for part in idx_list for i in part]
    return [int(i) for i in idx_list]


def restore_order(outputs: torch.Tensor | TensorDict, idx_lists: Sequence[Sequence[int]]) -> torch.Tensor | TensorDict:
    """Undo :func:`rearrange_micro_batches`: ``outputs`` is the row-wise concatenation of the
    per-micro-batch outputs (in micro-batch order); returns them in the original row order."""
    reverse = torch.tensor(get_reverse_idx(idx_lists), dtype=torch.long, device=outputs.device)
    if outputs.shape[0] != len(reverse):
        raise ValueError(f"got {outputs.shape[0]} output rows for {len(reverse)} input rows")
    return outputs[reverse]
