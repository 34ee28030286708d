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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ContextManager

import torch

from rlfoundry.engines.megatron import context_parallel as cpl

__all__ = ["attention_mask_4d", "context_parallel_size", "is_filler", "local_next_tokens", "next_tokens", "response_logits",
           "response_positions", "run_schedule", "vocab_parallel_log_probs"]

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
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    logits = logits.float()
    part = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * part
    peak = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    shifted = logits - peak
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


def response_logits(output: torch.Tensor, response_width: int) -> torch.Tensor:
    """The logits that predict the response tokens: position t predicts token t + 1."""
    return output[:, -response_width - 1:-1]


def context_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size()


def local_next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """CP > 1: the token each of this rank's positions predicts (position t: token t + 1; the last
    position's is a placeholder that :func:`response_positions` drops)."""
    ids = _pad_to_chunks(input_ids, context_parallel_size())
    return cpl.split(torch.roll(ids, -1, dims=1))


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The token each position the model computes predicts: this rank's positions with CP (as
    :func:`local_next_tokens`), else every position's (the last one's a placeholder, never read)."""
    if context_parallel_size() > 1:
        return local_next_tokens(input_ids)
    return torch.roll(input_ids, -1, dims=1)


def response_positions(values: torch.Tensor, micro: dict[str, torch.Tensor], cp_local: bool) -> torch.Tensor:
    """The positions that predict the response tokens, from per-position ``values`` (batch, seq, ...):
    the whole padded row's when ``cp_local`` (this CP rank's positions, gathered over the group first)."""
    if cp_local:
        values = cpl.gather(values)[:, :micro["input_ids"].shape[1]]
    return response_logits(values, micro["responses"].shape[1])


def _pad_to_chunks(x: torch.Tensor, cp: int) -> torch.Tensor:
    """``x`` (batch, seq) with zeros on the right up to a multiple of 2·CP (zero: a masked token)."""
    return torch.nn.functional.pad(x, (0, cpl.padded_length(x.shape[1], cp) - x.shape[1]))


def _model_inputs(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for one micro-batch: with CP, this rank's chunks of the ids and
    positions and the whole (padded) sequence's mask (the attention keeps its rows)."""
    ids, positions, mask = micro["input_ids"], micro["position_ids"], micro["attention_mask"]
    cp = context_parallel_size()
    if cp > 1:
        ids, positions, mask = (_pad_to_chunks(x, cp) for x in (ids, positions, mask))
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

    The interleaved schedule takes a multiple of the pipeline size of micro-batches: fewer are
    topped up with repeats of the first, whose outputs are dropped and whose loss is zero.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_only = loss is None
    real = len(micros)
    if len(chunks) > 1:
        micros = list(micros) + [{**micros[0], _FILLER: True}] * (-real % ps.get_pipeline_model_parallel_world_size())
    n = len(micros)

    def post(micro, output, non_loss_data: bool = False):
        if _FILLER in micro:
            return None if forward_only else (output.sum() * 0.0, {})
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
            return model(**_model_inputs(micro)), partial(post, micro)

    chunks = list(chunks)
    data = [iter(micros) for _ in chunks] if len(chunks) > 1 else iter(micros)
    seq_length = max(int(m["input_ids"].shape[1]) for m in micros)
    if context_parallel_size() > 1:  # the whole padded sequence; the schedule divides it by CP
        seq_length = cpl.padded_length(seq_length, context_parallel_size())
    results = get_forward_backward_func()(
        forward_step_func=step, data_iterator=data, model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=n, seq_length=seq_length, micro_batch_size=int(micros[0]["input_ids"].shape[0]),
        forward_only=forward_only, collect_non_loss_data=forward_only,
    )
    return results[:real]
