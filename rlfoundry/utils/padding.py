"""Padding removal for forward passes (``model.use_remove_padding``).

A rollout batch is mostly padding once response lengths vary. Instead of running the model on
(B, T), we pack the real tokens of all rows into one row of ``nnz`` tokens and give it
``position_ids`` that restart at 0 at every sequence. Hugging Face ``transformers`` (>= 4.54,
checked on 5.23) recognises that packed layout when ``attention_mask`` is None:

- ``sdpa`` / ``eager``: ``masking_utils.find_packed_sequence_indices`` turns the position resets
  into a block-diagonal causal mask, so no token attends across sequences;
- ``flash_attention_2`` / ``_3`` (GPU): ``_is_packed_sequence`` derives ``cu_seqlens`` from the
  position resets and calls the varlen kernel — no padding is computed at all.

The outputs are then scattered back to (B, T, ...) with zeros at padded positions. With fp32 this
matches the padded forward to float rounding (tests: ~1e-5).

Requirements: ``position_ids`` count 0, 1, 2, ... over each row's real tokens (what the dataset and
the rollout produce, ``cumsum(attention_mask) - 1``), and real tokens are contiguous in a row
(left or right padding, not holes). Both are checked. Models with 3-D position ids (Qwen2-VL
mrope) are not supported here; keep ``use_remove_padding=False`` for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["PackedBatch", "PackLayout", "common_left_padding", "pack_layout", "pack_padded_batch", "unpack_to_padded",
           "packed_next_token_ids", "forward_logits", "packed_causal_mask"]


def common_left_padding(attention_mask: torch.Tensor) -> int:
    """How many leading columns of a (B, T) mask are padding in every row, leaving at least one
    column. Prompts are padded to ``data.max_prompt_length``, usually far above a batch's longest
    prompt; those columns are masked out of every query and positions are explicit, so a forward
    may skip them."""
    if not attention_mask.numel() or not bool(attention_mask.any()):
        return max(0, attention_mask.shape[-1] - 1)
    return int(attention_mask.any(0).int().argmax())


@dataclass
class PackedBatch:
    """The real tokens of a padded (B, T) batch laid end to end.

    Attributes:
        input_ids: (1, nnz) token ids.
        position_ids: (1, nnz) positions, restarting at 0 at each sequence.
        indices: (nnz,) flat indices into the (B*T) grid where each packed token came from.
        cu_seqlens: (B+1,) int32 cumulative sequence lengths (flash-attention varlen convention;
            rows with no real token have length 0).
        batch_size, seqlen: the padded shape (B, T).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    batch_size: int
    seqlen: int


def _check_packable(position_ids: torch.Tensor, lengths: torch.Tensor) -> None:
    """One host sync: every non-empty row must start at position 0 and count up by one.

    Otherwise transformers would find a different number of sequences than we packed and
    silently let tokens attend across rows (or split a row in two).
    """
    prev = torch.cat([position_ids.new_full((1,), -2), position_ids[:-1]])
    starts = (position_ids - prev != 1) | (position_ids == 0)
    expected = int((lengths > 0).sum())
    ok = bool(position_ids.numel() == 0 or (int(starts.sum()) == expected and int((position_ids == 0).sum()) == expected))
    if not ok:
        raise ValueError(
            "use_remove_padding needs position_ids that start at 0 at each row's first real token and "
            "increase by 1 over its real tokens (cumsum(attention_mask) - 1), with no holes in "
            "attention_mask; got a layout that does not. Set model.use_remove_padding=False for this data."
        )


def pack_padded_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> PackedBatch:
    """Drop padding: (B, T) tensors -> :class:`PackedBatch` with one (1, nnz) row."""
    if position_ids.dim() != 2:
        raise ValueError(f"padding removal supports (B, T) position_ids only, got shape {tuple(position_ids.shape)}")
    batch_size, seqlen = input_ids.shape
    mask = attention_mask.reshape(-1).bool()
    indices = mask.nonzero(as_tuple=True)[0]
    lengths = attention_mask.sum(-1)
    flat_pos = position_ids.reshape(-1)[indices]
    _check_packable(flat_pos, lengths)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return PackedBatch(
        input_ids=input_ids.reshape(-1)[indices].unsqueeze(0),
        position_ids=flat_pos.unsqueeze(0),
        indices=indices,
        cu_seqlens=cu_seqlens,
        batch_size=batch_size,
        seqlen=seqlen,
    )


@dataclass
class PackLayout:
    """Where a micro-batch's real tokens go in the pack, worked out on the host from per-row counts read
    once for the whole batch (``RowSummary``), so packing reads nothing from the device (issue 34).

    Attributes (host ``long`` tensors):
        indices: (nnz,) flat index into the (B*T) grid of each packed token.
        position_ids: (nnz,) its position, 0, 1, ... within its row.
        sequence_ids: (nnz,) its row.
        keep: (K,) packed index of each real token that predicts a response slot.
        slots: (K,) flat index into the (B*Tr) response grid of the slot it predicts.
    """

    indices: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    keep: torch.Tensor
    slots: torch.Tensor


def pack_layout(starts: list[int], counts: list[int], seqlen: int, response_width: int) -> PackLayout:
    """The pack of rows whose real tokens are one run each: row i's ``counts[i]`` tokens from column
    ``starts[i]`` of a (B, ``seqlen``) batch whose last ``response_width`` columns are the responses.
    The run must hold each row's positions 0, 1, ... (the summary checks both on the device). Computed
    in numpy: host arithmetic that no device ever waits for."""
    rows = len(counts)
    start, count = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    offsets = np.cumsum(count) - count
    sequence_ids = np.repeat(np.arange(rows), count)
    position_ids = np.arange(int(count.sum())) - offsets[sequence_ids]
    indices = sequence_ids * seqlen + start[sequence_ids] + position_ids
    # response slot j of a row is predicted by column seqlen - response_width - 1 + j, if that is a real token
    column = seqlen - response_width - 1 + np.arange(response_width)
    local = column[None, :] - start[:, None]  # (B, Tr) position of the predictor in its row's run
    valid = (local >= 0) & (local < count[:, None])
    keep = (offsets[:, None] + local)[valid]
    slots = (np.arange(rows)[:, None] * response_width + np.arange(response_width))[valid]
    return PackLayout(*(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
                        for a in (indices, position_ids, sequence_ids, keep, slots)))


def packed_causal_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """(1, 1, nnz, nnz) boolean mask of a pack: each token sees the earlier tokens of its own row — the
    mask transformers builds for sdpa from the position resets, built here without reading the device."""
    same = sequence_ids[:, None] == sequence_ids[None, :]
    return (same & torch.ones_like(same).tril())[None, None]


def unpack_to_padded(values: torch.Tensor, packed: PackedBatch, pad_value: float = 0.0) -> torch.Tensor:
    """Scatter per-token outputs back to the padded grid.

    Args:
        values: (1, nnz, *rest) or (nnz, *rest) outputs of the packed forward.
    Returns:
        (B, T, *rest) with ``pad_value`` at padded positions.
    """
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.indices.numel():
        values = values.squeeze(0)
    rest = values.shape[1:]
    out = values.new_full((packed.batch_size * packed.seqlen, *rest), pad_value)
    out[packed.indices] = values
    return out.view(packed.batch_size, packed.seqlen, *rest)


def packed_next_token_ids(packed: PackedBatch) -> torch.Tensor:
    """(1, nnz) next-token labels in packed space (for log-probs without unpacking the logits).

    Rolled by one, so a sequence's last token is paired with the next sequence's first token:
    that position predicts past the end of its sequence and is never a response position.
    """
    return torch.roll(packed.input_ids, shifts=-1, dims=1)


def forward_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    use_remove_padding: bool = False,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Run ``model`` and return its per-token ``logits`` as (B, T, ·), padded or packed alike.

    ``use_remove_padding=False`` is the plain padded forward. With ``True`` only real tokens are
    computed (see the module docstring) and padded positions of the result are 0. Works for causal
    LMs (·=vocab) and token-classification value heads (·=1).
    """
    if not use_remove_padding:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False, **model_kwargs)
        return out.logits
    packed = pack_padded_batch(input_ids, attention_mask, position_ids)
    out = model(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
                use_cache=False, **model_kwargs)
    return unpack_to_padded(out.logits, packed)
