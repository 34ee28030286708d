"""Small tensor utilities shared by the algorithms and the workers (verl's ``verl.utils.torch_functional``).

Shapes: ``B`` sequences, ``T`` positions, ``V`` vocabulary.

The log-prob and entropy functions never materialise a full (B, T, V) float32 copy of the logits:
they walk the rows in blocks of at most ``CHUNK_ELEMENTS`` elements, upcast one block at a time,
and keep only per-row statistics (log-sum-exp) for the backward pass, which recomputes the softmax
block by block. The only (B, T, V) tensor they allocate is the gradient itself, in the logits' dtype.
``fused_logprobs_entropy`` (verl's ``use_fused_kernels``) starts one step earlier, from the hidden
states and the LM head's weight, and makes no (B, T, V) tensor at all: one chunk of logits at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "CHUNK_ELEMENTS",
    "calculate_sum_pi_squared_from_logits",
    "entropy_and_sum_pi_squared",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "fused_logprobs_entropy",
    "logprobs_from_logits",
    "logprobs_from_logits_naive",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "left_padded",
    "rollout_layout",
]

# Upper bound on the elements of one upcast block: 2**25 float32 values = 128 MiB.
CHUNK_ELEMENTS = 2**25


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # log-sum-exp in bf16/fp16 loses whole units of log-prob; do the reductions in fp32 (fp64 stays fp64).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_blocks(lead: tuple[int, ...], max_rows: int) -> Iterator[tuple]:
    """Index tuples into the leading dims, each selecting at most ``max_rows`` whole rows.

    Indexing instead of reshaping keeps every block a view, even when the logits are a
    non-contiguous slice such as ``logits[:, -T - 1 : -1]``.
    """
    if not lead:
        yield ()
        return
    inner = math.prod(lead[1:])
    if inner <= max_rows:
        step = max(1, max_rows // max(inner, 1))
        for start in range(0, lead[0], step):
            yield (slice(start, start + step),)
        return
    for i in range(lead[0]):
        for rest in _row_blocks(lead[1:], max_rows):
            yield (i, *rest)


def _blocks_for(logits: torch.Tensor, chunk_rows: int | None) -> Iterator[tuple]:
    vocab = max(logits.shape[-1], 1)
    rows = chunk_rows if chunk_rows is not None else max(1, CHUNK_ELEMENTS // vocab)
    return _row_blocks(tuple(logits.shape[:-1]), rows)


def _blockwise_logsumexp(logits: torch.Tensor, chunk_rows: int | None) -> torch.Tensor:
    """(..., V) -> (...,) log-sum-exp in the compute dtype, one upcast block at a time."""
    ctype = _compute_dtype(logits.dtype)
    lse = torch.empty(logits.shape[:-1], dtype=ctype, device=logits.device)
    for idx in _blocks_for(logits, chunk_rows):
        lse[idx] = torch.logsumexp(logits[idx].to(ctype), dim=-1)
    return lse


class _LogProbsFromLogits(torch.autograd.Function):
    """log p(label) = logit[label] - logsumexp(logits), with a block-wise backward.

    d/dx_j = g * (1[j == label] - softmax(x)_j); the softmax is recomputed per block from the
    saved log-sum-exp so nothing of size (B, T, V) is kept between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits, labels, chunk_rows):
        lse = _blockwise_logsumexp(logits, chunk_rows)
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(lse.dtype)
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_rows = chunk_rows
        return picked - lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for idx in _blocks_for(logits, ctx.chunk_rows):
            g = grad_out[idx].to(lse.dtype).unsqueeze(-1)
            probs = torch.exp(logits[idx].to(lse.dtype) - lse[idx].unsqueeze(-1))
            block = (-g * probs).scatter_add_(-1, labels[idx].unsqueeze(-1), g)
            grad[idx] = block.to(logits.dtype)
        return grad, None, None


class _EntropyFromLogits(torch.autograd.Function):
    """H = logsumexp(x) - sum_j p_j x_j, with dH/dx_j = -p_j (x_j - E_p[x]) computed block-wise.

    With ``sum_pi_squared`` the same blocks also give sum_j p_j^2 (the optimal token baseline's input,
    verl's ``calculate_sum_pi_squared``) from the probabilities already there: one dot product per row,
    no second pass over the logits. It carries no gradient (the estimators read it as data).
    """

    @staticmethod
    def forward(ctx, logits, chunk_rows, sum_pi_squared=False):
        ctype = _compute_dtype(logits.dtype)
        lse = torch.empty(logits.shape[:-1], dtype=ctype, device=logits.device)
        entropy = torch.empty_like(lse)
        squares = torch.empty_like(lse) if sum_pi_squared else None
        for idx in _blocks_for(logits, chunk_rows):
            x = logits[idx].to(ctype)
            lse[idx] = torch.logsumexp(x, dim=-1)
            probs = torch.exp(x - lse[idx].unsqueeze(-1))
            entropy[idx] = lse[idx] - (probs * x).sum(-1)
            if squares is not None:
                squares[idx] = torch.linalg.vecdot(probs, probs)
        ctx.save_for_backward(logits, lse, entropy)
        ctx.chunk_rows = chunk_rows
        if squares is not None:
            ctx.mark_non_differentiable(squares)
        return entropy, squares

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_squares):
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for idx in _blocks_for(logits, ctx.chunk_rows):
            x = logits[idx].to(lse.dtype)
            probs = torch.exp(x - lse[idx].unsqueeze(-1))
            mean_x = (lse[idx] - entropy[idx]).unsqueeze(-1)  # E_p[x] = lse - H
            grad[idx] = (-grad_out[idx].to(lse.dtype).unsqueeze(-1) * probs * (x - mean_x)).to(logits.dtype)
        return grad, None, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True, chunk_rows: int | None = None
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``.

    Args:
        logits: (..., V), any float dtype, may be a non-contiguous view.
        labels: (...,) int64 token ids.
        inplace_backward: accepted for verl compatibility (its flash-attn path writes the gradient
            into the logits buffer). Ignored: the logits are never overwritten, since other terms
            (e.g. the entropy bonus) may still need them in backward.
        chunk_rows: rows per upcast block; default keeps a block under ``CHUNK_ELEMENTS`` values.

    Returns:
        (...,) log-probs in float32 (float64 for float64 logits), whatever the logits' dtype.
    """
    del inplace_backward
    return _LogProbsFromLogits.apply(logits, labels, chunk_rows)


def logprobs_from_logits_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference implementation: full log_softmax then gather. (..., V), (...,) -> (...,)."""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per row. (..., V) -> (...,) in float32 (float64 for float64)."""
    return _EntropyFromLogits.apply(logits, chunk_rows)[0]


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl's name for the chunked entropy: ``chunk_size`` rows per block. (..., V) -> (...,)."""
    return _EntropyFromLogits.apply(logits, chunk_size)[0]


def entropy_and_sum_pi_squared(logits: torch.Tensor, chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy, sum_v p_v^2) of ``softmax(logits)`` per row from one block-wise pass; the entropy keeps its
    gradient, the sum of squares has none. (..., V) -> (...,), (...,) in float32 (float64 for float64)."""
    return _EntropyFromLogits.apply(logits, chunk_rows, True)


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 per row (verl's name), block-wise, without gradient. (..., V) -> (...,)."""
    with torch.no_grad():
        return entropy_and_sum_pi_squared(logits, chunk_rows)[1]


class _FusedLinearLogProbs(torch.autograd.Function):
    """Log-probs and entropies of ``softmax(hidden @ weight.T / T)`` without the (N, V) logits.

    verl's ``FusedLinearForPPO`` (``model.use_fused_kernels``, torch backend), written anew: the
    forward walks the N rows in chunks, each chunk's logits live only inside its iteration, and only
    the per-row log-sum-exp and entropy are kept. The backward recomputes each chunk's logits and
    accumulates dL/dhidden and dL/dweight (fp32 for a low-precision weight: one rounding at the end,
    as one big matmul would give). With z = logits / T and p = softmax(z):
    d logp(y)/dz = onehot(y) - p and dH/dz = -p (z - E_p[z]), so dL/dlogits = (those) / T.

    ``group``: the vocabulary is split over these ranks (Megatron's vocab-parallel output layer):
    ``weight`` is this rank's rows, from ``rank * V_local``. Each chunk's row statistics (max, sum of
    exponentials, the label's logit, E_p[z], sum p^2) are summed over the group, so every rank gets
    the whole-vocabulary values; the backward needs no communication (its dL/dhidden is this slice's
    part, which the caller's input mapping sums over the group).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, excluded, chunk_rows, entropy_grad, sum_pi_squared=False,
                group=None):
        ctype = _compute_dtype(hidden.dtype)
        rows = hidden.shape[0]
        lse = torch.empty(rows, dtype=ctype, device=hidden.device)
        logp, entropy = torch.empty_like(lse), torch.empty_like(lse)
        squares = torch.empty_like(lse) if sum_pi_squared else None
        local, mine = _local_labels(labels, weight.shape[0], group)
        for start in range(0, rows, chunk_rows):
            sl = slice(start, start + chunk_rows)
            z = _chunk_logits(hidden[sl], weight, temperature, excluded, ctype)
            top = _reduced(z.amax(-1, keepdim=True), group, torch.distributed.ReduceOp.MAX)
            p = (z - top).exp_()  # unnormalised: two chunk-sized tensors in all (z, p), updated in place
            total = _reduced(p.sum(-1, keepdim=True), group)
            lse[sl] = (top + total.log()).squeeze(-1)
            target = z.gather(-1, local[sl].unsqueeze(-1)).squeeze(-1)
            logp[sl] = (target if mine is None else _reduced(target * mine[sl], group)) - lse[sl]
            p.div_(total)
            if squares is not None:  # sum_v p_v^2 from the normalised chunk, before p is reused in place
                squares[sl] = _reduced(torch.linalg.vecdot(p, p), group)
            entropy[sl] = lse[sl] - _reduced(p.mul_(z).sum(-1), group)  # H = lse - E_p[z]
            del z, p  # before the next chunk's product
        ctx.save_for_backward(hidden, weight, local, lse, entropy, excluded, mine)
        ctx.temperature, ctx.chunk_rows, ctx.entropy_grad = temperature, chunk_rows, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        if squares is not None:
            ctx.mark_non_differentiable(squares)
        return logp, entropy, squares

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_squares):
        hidden, weight, labels, lse, entropy, excluded, mine = ctx.saved_tensors
        ctype, t = lse.dtype, ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=ctype, device=weight.device) if ctx.needs_input_grad[1] else None
        use_entropy = ctx.entropy_grad and grad_entropy is not None
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            sl = slice(start, start + ctx.chunk_rows)
            z = _chunk_logits(hidden[sl], weight, t, excluded, ctype)
            p = z.sub(lse[sl].unsqueeze(-1)).exp_()
            g_logp = grad_logp[sl].to(ctype).unsqueeze(-1)
            if use_entropy:  # z becomes the entropy's term in place, then p the gradient: two chunks in all
                mean_z = (lse[sl] - entropy[sl]).unsqueeze(-1)  # E_p[z] = lse - H
                z.sub_(mean_z).mul_(p).mul_(-grad_entropy[sl].to(ctype).unsqueeze(-1))
                g = p.mul_(-g_logp).add_(z)
            else:
                g = p.mul_(-g_logp)
            del z
            g.scatter_add_(-1, labels[sl].unsqueeze(-1), g_logp if mine is None else g_logp * mine[sl].unsqueeze(-1))
            if excluded is not None:
                g.index_fill_(-1, excluded, 0.0)  # constants: no gradient reaches their logits
            if t != 1.0:
                g.div_(t)
            g = g.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[sl] = g @ weight
            if grad_weight is not None and grad_weight.dtype == g.dtype:
                grad_weight.addmm_(g.t(), hidden[sl])
            elif grad_weight is not None:  # a bf16 product (as autograd's), summed over chunks in fp32
                grad_weight += g.t() @ hidden[sl]
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _local_labels(labels: torch.Tensor, part: int, group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The labels as indices into this rank's vocabulary rows, and (with a ``group``) which of them
    this rank holds (a 0/1 mask: the others' label logit counts as 0 in the group's sum)."""
    if group is None:
        return labels, None
    local = labels - torch.distributed.get_rank(group) * part
    mine = (local >= 0) & (local < part)
    return local.clamp(0, part - 1), mine


def _reduced(values: torch.Tensor, group, op=None) -> torch.Tensor:
    """``values`` reduced over the vocabulary's ranks in place (sum unless ``op``); as is without a group."""
    if group is not None:
        torch.distributed.all_reduce(values, op=op or torch.distributed.ReduceOp.SUM, group=group)
    return values


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, excluded: torch.Tensor | None,
                  ctype: torch.dtype) -> torch.Tensor:
    """One chunk's (rows, V) logits / T in the compute dtype, excluded ids at its lowest value (as
    ``models.vision.mask_placeholders``: probability 0 and no NaN in p·z)."""
    z = (hidden @ weight.t()).to(ctype)  # a fresh tensor: the callers update it in place
    if temperature != 1.0:
        z.div_(temperature)
    if excluded is not None:
        z.index_fill_(-1, excluded, torch.finfo(ctype).min)
    return z


def fused_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           temperature: float = 1.0, excluded_ids: list[int] | None = None,
                           chunk_rows: int | None = None, entropy_grad: bool = True,
                           sum_pi_squared: bool = False, vocab_group=None) -> tuple[torch.Tensor, ...]:
    """Log-probs of ``labels`` and entropies under ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: (..., H) final hidden states (the LM head's input), any float dtype.
        weight: (V, H) the LM head's weight (no bias).
        labels: (...,) int64 token ids.
        excluded_ids: token ids never sampled (vision placeholders): probability 0.
        chunk_rows: rows per chunk; default keeps a chunk's logits under ``CHUNK_ELEMENTS`` values.
        entropy_grad: False: the entropy carries no gradient (and backward skips its term).
        sum_pi_squared: also return sum_v p_v^2 per row (no gradient), from the same chunks.
        vocab_group: the process group a vocab-parallel head's rows are split over (``weight`` is
            this rank's V / size rows); None: ``weight`` is the whole head.

    Returns:
        (log_probs, entropy), or (log_probs, entropy, sum_pi_squared) with ``sum_pi_squared``, each
        (...,) float32 (float64 for float64 inputs). The largest tensor made is one chunk's
        (chunk_rows, V) logits, in forward and backward alike.
    """
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = chunk_rows if chunk_rows is not None else max(1, CHUNK_ELEMENTS // max(weight.shape[0], 1))
    excluded = torch.tensor(excluded_ids, device=hidden.device) if excluded_ids else None
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the LM head's autocast dtype, cast once (backward runs outside autocast)
        dtype = torch.get_autocast_dtype(device)
        flat, weight = flat.to(dtype), weight.to(dtype)
    with torch.autocast(device, enabled=False):
        logp, entropy, squares = _FusedLinearLogProbs.apply(flat, weight, labels.reshape(-1), float(temperature),
                                                            excluded, rows, bool(entropy_grad), bool(sum_pi_squared),
                                                            vocab_group)
    if squares is None:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead), entropy.reshape(lead), squares.reshape(lead)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero (weighted by ``mask``); NaN/inf outside the mask are ignored."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (kept * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Mean of ``values`` over ``mask``; an empty mask gives 0.

    verl adds 1e-8 to the count, which biases every mean by a relative 1e-8 / N; replacing a zero
    count by 1 gives the same 0 for an empty mask and the exact mean otherwise.
    """
    count = mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / torch.where(count == 0, torch.ones_like(count), count)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all masked elements (a scalar), Bessel-corrected when ``unbiased``."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return variance
    count = mask.sum()
    if count == 0:
        raise ValueError("masked_var: the mask selects no element; at least two are needed for an unbiased variance")
    if count == 1:
        raise ValueError(
            "masked_var: the mask selects a single element, so the unbiased variance divides by zero; "
            "use a larger batch (more valid tokens) or unbiased=False"
        )
    return variance * count / (count - 1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with statistics over ``mask``; keeps the mean if not ``shift_mean``.

    Applied element-wise to every position (masked ones included); callers mask the result.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def rollout_layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: list[list[int]],
                   response_masks: list[list[int]], log_probs: list[list[float]], width: int,
                   pad_id: int) -> dict[str, torch.Tensor]:
    """The rollout engines' output tensors from per-row response token lists.

    ``prompt_ids`` / ``prompt_mask`` (B, Tp) left-padded as given; each response is right-padded to
    ``width``: ``prompts``, ``responses``, ``response_mask`` (1 where the policy sampled), ``rollout_log_probs``,
    ``input_ids`` / ``attention_mask`` (B, Tp + width) and ``position_ids`` counted over real tokens. Every
    tensor is on ``prompt_ids``' device (the responses are filled on the host, then copied there once).
    """
    rows = len(responses)
    out_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    out_mask = torch.zeros((rows, width), dtype=torch.long)
    out_lp = torch.zeros((rows, width), dtype=torch.float32)
    attention = torch.zeros((rows, width), dtype=prompt_mask.dtype)
    for i, (ids, mask, lps) in enumerate(zip(responses, response_masks, log_probs)):
        m = len(ids)
        if m > width:
            raise ValueError(f"row {i} has {m} response tokens, more than the budget {width}")
        out_ids[i, :m] = torch.tensor(ids, dtype=torch.long)
        out_mask[i, :m] = torch.tensor(mask, dtype=torch.long)
        out_lp[i, :m] = torch.tensor(lps, dtype=torch.float32)
        attention[i, :m] = 1
    device = prompt_ids.device
    out_ids, out_mask, out_lp = out_ids.to(device), out_mask.to(device), out_lp.to(device)
    attention_mask = torch.cat([prompt_mask.to(device), attention.to(device)], dim=1)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return {"prompts": prompt_ids, "responses": out_ids, "response_mask": out_mask, "rollout_log_probs": out_lp,
            "input_ids": torch.cat([prompt_ids, out_ids], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids}


def left_padded(rows: list[list[int]], pad_id: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Token rows as a rollout engine's prompt input: ``input_ids``, ``attention_mask``, ``position_ids``
    (B, longest row), each row right-aligned, positions counted over its real tokens; on ``device``
    (the engine's; None: the host), filled on the host and copied there once."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
