"""Forward passes of the Megatron engine: response log-probs and entropy on vocab-parallel logits,
run through megatron-core's pipeline schedules.

With tensor parallelism the LM head leaves each rank a slice of the vocabulary; the log-softmax and
the entropy are computed from three reductions over the slices (max, sum of exponentials, and the
target's logit / the probability-weighted logit), so no rank ever holds a (tokens x vocab) tensor.
Every tensor-parallel rank ends with the same log-probs, and gradients flow back into each slice.

Rows are padded (prompt left, response right, as in the batch); the attention mask given to the
model is causal and hides padded keys, and position ids are the batch's own.

With context parallelism (CP > 1) each rank feeds the model its two chunks of every row
(``context_parallel.py``), the row first padded on the right to a multiple of 2·CP with masked
tokens; the last stage computes log-probs (entropy, values) at the positions it holds and gathers
them over the CP group into whole rows, so the outputs and the loss are the same on every CP rank.

With sequence parallelism (``megatron.sequence_parallel`` at TP > 1, ``sequence_parallel.py``) each
tensor-parallel rank's part of the sequence (the whole of it, or with CP each of its chunks) must split
evenly over the TP ranks: rows are padded on the right the same way (:func:`model_length`), and the
padded positions dropped from what the model returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ContextManager

import torch

from rlfoundry.engines.megatron import context_parallel as cpl

__all__ = ["attention_mask_4d", "context_parallel_size", "is_filler", "local_next_tokens", "model_length", "next_tokens",
           "padded_length", "response_logits", "response_positions", "run_schedule", "vocab_parallel_log_probs"]

_FILLER = "rlfoundry_filler"  # marks a repeated micro-batch that tops up an interleaved schedule


def is_filler(micro: dict[str, torch.Tensor]) -> bool:
    """Whether ``micro`` is a repeat that only tops up an interleaved schedule (its outputs are dropped)."""
    return _FILLER in micro


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, s) 1 = real token -> (b, 1, s, s) bool, True where a query may NOT attend (megatron-core's
    convention): future positions and padded keys."""
    s = attention_mask.shape[1]
    future = torch.triu(torch.ones(s, s, dtype=torch.bool, device=attention_mask.device), diagonal=1)
    padded_key = ~attention_mask.bool()[:, None, None, :]
    return future[None, None] | padded_key


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, entropy: bool = False,
                             entropy_grad: bool = True, sum_pi_squared: bool = False,
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log p(label), and optionally the entropy and sum_v p_v^2 (no gradient), from this rank's vocabulary
    slice of ``logits`` (..., V / tp); ``labels`` index the whole vocabulary. Same result on every
    tensor-parallel rank."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    shifted, start = _shifted_slice(logits)
    part = logits.shape[-1]
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(dim=-1))
    local = labels - start
    mine = (local >= 0) & (local < part)
    target = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine
    log_z = sum_exp.log()
    log_probs = tp_sum(target) - log_z
    squares = None
    if sum_pi_squared:  # sum_v p_v^2 = sum_v exp(x_v - peak)^2 / (sum_v exp(x_v - peak))^2, one more slice sum
        with torch.no_grad():
            squares = tp_sum(torch.linalg.vecdot(exp, exp)) / sum_exp.square()
    if not entropy:
        return log_probs, None, squares
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        weighted = tp_sum((exp * shifted).sum(dim=-1)) / sum_exp  # E_p[logit - peak]
        return log_probs, log_z - weighted, squares


def _shifted_slice(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's vocabulary slice of ``logits`` (..., V / tp) in fp32 minus the row's maximum over the whole
    vocabulary (the same shift on every tensor-parallel rank), and the slice's first token id."""
    from megatron.core import parallel_state as ps

    logits = logits.float()
    peak = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    return logits - peak, ps.get_tensor_model_parallel_rank() * logits.shape[-1]


def vocab_parallel_topk(logits: torch.Tensor, k: int, ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The FSDP forward's ``topk_log_probs`` (engines/fsdp/forward.py) from this rank's vocabulary slice of
    ``logits`` (..., V / tp), the same on every tensor-parallel rank: with k > 0 the k likeliest tokens of the
    whole vocabulary (each rank's top-k, gathered, then the top-k of those), ``topk_ids`` / ``topk_log_probs``
    without gradient; with ``ids`` (..., k) (whole-vocabulary ids) ``log_probs_at``, with gradient: each id's
    shifted logit from the rank that holds it, summed over the ranks, minus the log of the summed exp."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    shifted, start = _shifted_slice(logits)
    part = shifted.shape[-1]
    log_z = tp_sum(shifted.exp().sum(dim=-1, keepdim=True)).log()
    out = {}
    if k:
        with torch.no_grad():
            values, index = shifted.topk(min(k, part), dim=-1)
            index = index + start
            world = ps.get_tensor_model_parallel_world_size()
            if world > 1:  # the shift is shared, so the ranks' candidates compare as they are
                group = ps.get_tensor_model_parallel_group()
                values, index = (_gather_last(t, world, group) for t in (values, index))
                values, pick = values.topk(k, dim=-1)
                index = index.gather(-1, pick)
            out |= {"topk_log_probs": values - log_z, "topk_ids": index}
    if ids is not None:
        local = ids.long() - start
        mine = (local >= 0) & (local < part)
        target = shifted.gather(-1, local.clamp(0, part - 1)) * mine
        out["log_probs_at"] = tp_sum(target) - log_z
    return out


def _gather_last(tensor: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """The tensor-parallel ranks' ``tensor`` side by side along the last dimension, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def response_logits(output: torch.Tensor, response_width: int) -> torch.Tensor:
    """The logits that predict the response tokens: position t predicts token t + 1."""
    return output[:, -response_width - 1:-1]


def context_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size()


def padded_length(length: int, cp: int, tp: int = 1) -> int:
    """``length`` rounded up to what the model runs at ``cp`` context-parallel ranks and with sequence
    parallelism over ``tp`` ranks (1: none): with CP a multiple of 2·CP (each rank holds two equal
    chunks), with sequence parallelism a multiple of TP as well (each rank's part splits evenly)."""
    multiple = (2 * cp if cp > 1 else 1) * tp
    return -(-length // multiple) * multiple


def model_length(length: int, sequence_parallel: bool = False) -> int:
    """:func:`padded_length` in this process's layout (``sequence_parallel``: the model's, at TP > 1)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    return padded_length(length, context_parallel_size(), tp)


def local_next_tokens(input_ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
    """CP > 1: the token each of this rank's positions predicts (position t: token t + 1; the last
    position's is a placeholder that :func:`response_positions` drops)."""
    ids = _pad_to_model(input_ids, sequence_parallel)
    return cpl.split(torch.roll(ids, -1, dims=1))


def next_tokens(input_ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
    """The token each position the model computes predicts: this rank's positions with CP (as
    :func:`local_next_tokens`), else every position's, padding included (the last real one's and
    the padding's are placeholders, never read)."""
    if context_parallel_size() > 1:
        return local_next_tokens(input_ids, sequence_parallel)
    return torch.roll(_pad_to_model(input_ids, sequence_parallel), -1, dims=1)


def response_positions(values: torch.Tensor, micro: dict[str, torch.Tensor], cp_local: bool) -> torch.Tensor:
    """The positions that predict the response tokens, from per-position ``values`` (batch, seq, ...):
    the whole padded row's when ``cp_local`` (this CP rank's positions, gathered over the group first)."""
    if cp_local:
        values = cpl.gather(values)
    return response_logits(values[:, :micro["input_ids"].shape[1]], micro["responses"].shape[1])


def _pad_to_model(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """``x`` (batch, seq) with zeros on the right up to :func:`model_length` (zero: a masked token)."""
    return torch.nn.functional.pad(x, (0, model_length(x.shape[1], sequence_parallel) - x.shape[1]))


def _model_inputs(micro: dict[str, torch.Tensor], sequence_parallel: bool = False) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for one micro-batch, padded to :func:`model_length`: with CP, this
    rank's chunks of the ids and positions and the whole sequence's mask (the attention keeps its rows)."""
    ids, positions, mask = (_pad_to_model(micro[k], sequence_parallel)
                            for k in ("input_ids", "position_ids", "attention_mask"))
    if context_parallel_size() > 1:
        ids, positions = cpl.split(ids), cpl.split(positions)
    return {"input_ids": ids, "position_ids": positions, "attention_mask": attention_mask_4d(mask)}


def run_schedule(chunks: Sequence[torch.nn.Module], micros: list[dict[str, torch.Tensor]],
                 outputs: Callable[[torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 loss: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, dict]] | None,
                 around: Callable[[dict[str, torch.Tensor]], ContextManager] | None = None,
                 ) -> list[Any]:
    """Each micro-batch through megatron-core's schedule (1F1B; interleaved with virtual stages).

    ``outputs(logits, micro)`` runs on the last pipeline stage; with ``loss`` None the pass is
    forward-only and the schedule returns the outputs per micro-batch, else ``loss(outputs, micro)``
    gives the micro-batch's loss (already divided by the mini-batch-wide counts) and its metrics,
    gradients accumulate into the chunks, and the metrics come back per micro-batch. Non-last
    stages get an empty list.
    ``around(micro)``: a context each micro-batch's model call runs in (the fused output layer's labels).
    ``outputs`` gets each row's positions as the micro-batch has them: without CP the positions padded
    for sequence parallelism are dropped first (with CP, :func:`response_positions` drops them).

    The interleaved schedule takes a multiple of the pipeline size of micro-batches: fewer are
    topped up with repeats of the first, whose outputs are dropped and whose loss is zero.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    forward_only = loss is None
    sequence_parallel = bool(get_model_config(chunks[0]).sequence_parallel)
    whole_rows = context_parallel_size() == 1
    real = len(micros)
    if len(chunks) > 1:
        micros = list(micros) + [{**micros[0], _FILLER: True}] * (-real % ps.get_pipeline_model_parallel_world_size())
    n = len(micros)

    def post(micro, output, non_loss_data: bool = False):
        if _FILLER in micro:
            return None if forward_only else (output.sum() * 0.0, {})
        if whole_rows:
            output = output[:, :micro["input_ids"].shape[1]]
        out = outputs(output, micro)
        if forward_only:
            return out
        value, metrics = loss(out, micro)
        # the schedule divides a returned loss by the number of micro-batches: ours is already
        # normalised over the whole mini-batch
        return value * n, metrics

    def step(data_iterator, model):
        micro = next(data_iterator)
        with around(micro) if around is not None else contextlib.nullcontext():
            return model(**_model_inputs(micro, sequence_parallel)), partial(post, micro)

    chunks = list(chunks)
    data = [iter(micros) for _ in chunks] if len(chunks) > 1 else iter(micros)
    # the whole padded sequence; the schedule divides it by CP (and by TP under sequence parallelism)
    seq_length = model_length(max(int(m["input_ids"].shape[1]) for m in micros), sequence_parallel)
    results = get_forward_backward_func()(
        forward_step_func=step, data_iterator=data, model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=n, seq_length=seq_length, micro_batch_size=int(micros[0]["input_ids"].shape[0]),
        forward_only=forward_only, collect_non_loss_data=forward_only,
    )
    return results[:real]
