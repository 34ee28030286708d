"""Exact mode's kernels: every reduction of a causal LM's forward in an order fixed by the reduced
length alone, so a token's log-prob has the same bits whatever batch, padding, packing or KV-cache
split it was computed in (``actor_rollout_ref.rollout.exact_log_probs``; docs/on_policy.md).

Where a forward's bits can depend on the batch: a matmul's kernel and blocking are chosen by the
whole problem's shape (M rows included), attention sums keys in an order set by the key length
(which differs between a decode step over a KV cache and the trainer's full forward), and a
multi-threaded reduction may split one output's sum across threads. Elementwise ops, gathers and
rotary (a product of length 1) give each element the same bits wherever it sits. So:

- every reduction but the linear's is ``row_sum``: a sum over the innermost contiguous dimension of an
  fp32 tensor. torch's CPU sum gives each output its own serial, vectorised pass whose order depends on
  the reduced length only (``TensorIteratorBase::parallel_reduce`` splits the outputs among threads,
  never one output's sum, except when there is a single output, which ``row_sum`` never leaves);
- a linear layer is a GEMM whose every call has one shape, whatever M is: the rows in blocks of
  ``GEMM_ROWS`` (the last one zero-padded), K and N zero-padded to multiples of ``GEMM_PAD``, aligned
  buffers, MKL on one thread (``_gemm_rows``). That a row's bits then follow its own data alone is a
  property of MKL's kernel on this CPU, measured rather than read off: tests/models/test_batch_invariant.py
  holds it (every slot of a block, other neighbours, other row counts, thread counts 1-4). Without MKL
  the linear is ``row_sum(x[..., None, :] * W)`` (M·N·K memory traffic);
- attention takes, for each query, its valid keys (padding, causality and packing from the mask) in
  position order from the sequence's first key, in blocks of ``KEY_BLOCK`` slots combined one after
  another (a max over all valid scores first: a max is exact in any order). Blocks past the query hold
  exp(-inf) = 0 and add exact zeros, so a decode step over a cache of t + 1 keys and the full forward
  over T keys give the query the same bits; a key block past every row of a query block is not computed at
  all (``_pairs``: a causal forward's upper triangle; a problem of one query block, a decode step's, computes every
  key block instead, one at a time: ``_attend_one_block``). The products are GEMM calls of two fixed shapes, as the
  linear's: (``QUERY_BLOCK``, d) x (d, ``KEY_BLOCK``) for the scores, (``QUERY_BLOCK``, ``KEY_BLOCK``) x
  (``KEY_BLOCK``, d) for a block's values, the queries that share a slot list (a sequence's causal
  positions) stacked as the rows of one problem (``_layout``, ``_attend``);
- RMSNorm's mean and the log-softmax over the vocabulary are ``row_sum`` over a fixed length;
- in bf16 each op computes in fp32 and rounds its output once; under autocast (the trainer's plain
  one-rank module over fp32 weights) the ops round weights and outputs to the autocast dtype, as the
  rollout's bf16 copy of the weights computes them.

``apply_exact(module)`` installs them on an HF model (its ``nn.Linear`` layers, RMSNorms, attention
and embeddings); ``exact_log_probs`` is the one logits -> log-prob function of both the rollout and
the trainer. Nothing changes for a model the conversion was not applied to.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ATTENTION", "KEY", "KEY_BLOCK", "apply_exact", "exact_attention", "exact_linear", "exact_log_probs",
           "exact_rms_norm", "is_exact", "row_sum"]

KEY = "actor_rollout_ref.rollout.exact_log_probs"
ATTENTION = "rlfoundry_exact"  # the attention implementation's name (config._attn_implementation)
KEY_BLOCK = 16  # key slots per attention block
QUERY_BLOCK = 8  # query rows per GEMM call of the exact attention
_EXACT_ATTR = "_rlf_exact"
# elements of one chunk's broadcast product (linear: rows x N x K, attention: queries x keys x head dim)
_CHUNK_ELEMENTS = 1 << 20
GEMM_ROWS = 64  # rows per GEMM block of the exact linear: every MKL call has this many
GEMM_PAD = 16  # K and N of the exact linear's GEMM calls are padded to multiples of this


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension, (..., K) -> (...), fp32, in an order fixed by K alone.

    A single output would let torch split its sum over threads (a two-pass reduction): it is summed
    beside a row of zeros instead, as two outputs, each serial."""
    x = x.float().contiguous()
    if x.numel() == x.shape[-1]:
        return torch.stack([x.reshape(-1), torch.zeros_like(x.reshape(-1))]).sum(-1)[0].reshape(x.shape[:-1])
    return x.sum(-1)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype an op rounds its output to: the autocast dtype inside a CPU/CUDA autocast region (as
    ``F.linear`` there), else the inputs' promoted dtype."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.result_type(*tensors) if len(tensors) > 1 else tensors[0].dtype


def _mkl_threads_local():
    """MKL's per-thread thread count setter (``MKL_Set_Num_Threads_Local``, the C interface; the lower-case
    symbol is the Fortran one, which takes a pointer), or None where torch is not built with MKL."""
    if not torch.backends.mkl.is_available():
        return None
    for lib in (os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"), None):  # static, shared MKL
        try:
            setter = ctypes.CDLL(lib).MKL_Set_Num_Threads_Local
        except (OSError, AttributeError):
            continue
        setter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
        return setter
    return None


_SET_MKL_THREADS = _mkl_threads_local()


@contextlib.contextmanager
def _one_mkl_thread():
    """MKL on one thread for the calling thread only, restored after. With several threads MKL splits
    the N outputs among them and computes a split's last columns with another kernel: the column's
    bits then follow the thread count (measured in one block without the padding: N = 24 or 33 with 3
    threads, N = 100 with 4; with the padding none was seen, but the split stays MKL's choice)."""
    previous = _SET_MKL_THREADS(1)
    try:
        yield
    finally:
        _SET_MKL_THREADS(previous)


def _aligned(t: torch.Tensor, rows: int = 0, cols: int = 0) -> torch.Tensor:
    """``t`` (R, C) fp32 in a fresh 64-byte-aligned buffer (torch's CPU allocator) with ``rows`` zero
    rows and ``cols`` zero columns appended; ``t`` itself where it already is that buffer."""
    if not rows and not cols and t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    out = t.new_zeros(t.shape[0] + rows, t.shape[1] + cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _gemm_rows(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rows (M, K) @ w (N, K)^T in fp32 by GEMM calls of one shape, (GEMM_ROWS, K') x (K', N'), whatever
    M is: rows padded with zero rows to a multiple of ``GEMM_ROWS``, K and N with zeros to multiples of
    ``GEMM_PAD`` (added zero products leave every sum's value as it is), every block 64-byte aligned,
    one MKL thread. MKL's kernel for one shape computes a row with the same k-order at any slot of its
    block, beside any rows, in any number of blocks — except for K not a multiple of 4 with N < 12,
    where a row's bits follow its slot (measured), hence the padding. tests/models/test_batch_invariant.py
    holds these properties against this CPU's MKL."""
    m, k = rows.shape
    n = w.shape[0]
    blocks = -(-m // GEMM_ROWS)
    x = _aligned(rows, blocks * GEMM_ROWS - m, -k % GEMM_PAD)
    wt = _aligned(w, -n % GEMM_PAD, -k % GEMM_PAD).t()
    with _one_mkl_thread():
        out = torch.bmm(x.view(blocks, GEMM_ROWS, x.shape[1]), wt.expand(blocks, *wt.shape))
    return out.reshape(blocks * GEMM_ROWS, -1)[:m, :n]


def _summed_rows(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rows (M, K) @ w (N, K)^T in fp32, each output a length-K ``row_sum`` (rows chunked to bound the
    broadcast product's memory): the path where torch has no MKL, M·N·K memory traffic."""
    step = max(1, _CHUNK_ELEMENTS // max(1, w.numel()))
    return torch.cat([row_sum(rows[i: i + step, None, :] * w) for i in range(0, rows.shape[0], step)])


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on ``tensors`` (else the ops' forwards run without a node)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _RowProducts(torch.autograd.Function):
    """rows (M, K) @ w (N, K)^T in fp32 with each row's bits independent of M and of the other rows
    (``_gemm_rows`` on a CPU with MKL, else ``_summed_rows``). Only the forward's bits are exact mode's business:
    the backward is the same function's gradient by two plain matmuls."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if ctx is not None:  # None: called without autograd (``exact_linear`` under no_grad)
            ctx.save_for_backward(rows, w)
        if not rows.shape[0]:
            return rows.new_zeros((0, w.shape[0]))
        cpu_mkl = rows.device.type == "cpu" and _SET_MKL_THREADS is not None  # what the tests hold
        return _gemm_rows(rows, w) if cpu_mkl else _summed_rows(rows, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, w = ctx.saved_tensors
        return grad @ w, grad.t() @ rows


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with each output a length-K ``row_sum`` in fp32, rounded once to the compute dtype.
    Inputs and weights are first rounded to that dtype (what autocast does before its matmul)."""
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and _SET_MKL_THREADS is not None \
            and (bias is None or bias.dtype == torch.float32) and not torch.is_autocast_enabled("cpu") \
            and not _needs_grad(x, weight, *(() if bias is None else (bias,))) and x.numel():
        # fp32 without autocast or autograd (the rollout's decode steps, the scoring forwards): the same GEMM calls and
        # addition as below, without its conversions (no-ops in fp32), autocast region and autograd checks
        out = _gemm_rows(x.reshape(-1, x.shape[-1]), weight)
        return (out if bias is None else out + bias).reshape(*x.shape[:-1], weight.shape[0])
    dtype = _compute_dtype(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        rows, w = x.reshape(-1, x.shape[-1]).to(dtype).float(), weight.to(dtype).float()
        out = _RowProducts.apply(rows, w) if _needs_grad(rows, w) else _RowProducts.forward(None, rows, w)
        if bias is not None:
            out = out + bias.to(dtype).float()
        return out.to(dtype).reshape(*x.shape[:-1], weight.shape[0])


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2/Llama RMSNorm: fp32 mean of squares by ``row_sum``, output rounded to the compute dtype
    (the weight too, as a bf16 copy of the weights holds it)."""
    dtype = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        h = x.float()
        variance = row_sum(h * h).unsqueeze(-1) / h.shape[-1]
        normed = (h * torch.rsqrt(variance + eps)).to(dtype)
        return weight.to(dtype) * normed


def exact_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[label] in fp32: (..., V), (...) -> (...). The one function of the
    rollout's reported log-probs and the trainer's in exact mode (the vocabulary sum is ``row_sum``)."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    shift = x.amax(-1, keepdim=True)
    lse = shift.squeeze(-1) + row_sum(torch.exp(x - shift)).log()
    return x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse


def _valid_keys(mask: torch.Tensor | None, tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """(b or 1, 1, tq, tk) bool: which keys each query attends. None: causal over the last tq positions."""
    if mask is None:
        q = torch.arange(tq, device=device).unsqueeze(1) + (tk - tq)
        return (torch.arange(tk, device=device).unsqueeze(0) <= q)[None, None]
    mask = mask[..., :tk]
    if mask.dtype != torch.bool:  # an additive mask: 0 where attended, the dtype's minimum elsewhere
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask


def _layout(valid: torch.Tensor) -> types.SimpleNamespace:
    """Where each query of an attention call goes. ``valid`` (b, tq, tk) bool.

    A query takes its valid keys in position order (a stable sort of the "invalid" flag): its slot list.
    Queries whose lists are prefixes of one list share it: a query joins the group of the one before it
    when its list begins with all of that one's and is no shorter (the next causal position of the same
    sequence; a padding query with no key joins any). The group's last query holds the list of all of
    them. Returned: ``rows`` (G,) each group's batch row, ``order`` (G, S) its key positions (S: the longest
    list rounded up to ``KEY_BLOCK``), ``count`` (G,) how many of them are real; ``group``, ``local``
    (b, tq): each query's group and place in it; ``keys`` (b, tq): its number of keys; ``largest``: the
    largest group."""
    b, tq, tk = valid.shape
    count = valid.sum(-1)  # (b, tq)
    order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices  # (b, tq, tk)
    slot = torch.arange(tk, device=valid.device)
    same = (order[:, 1:] == order[:, :-1]) | (slot >= count[:, :-1, None])
    starts = torch.ones(b, tq, dtype=torch.bool, device=valid.device)
    starts[:, 1:] = ~(same.all(-1) & (count[:, 1:] >= count[:, :-1]))
    starts = starts.reshape(-1)
    group = starts.cumsum(0) - 1  # a row's first query starts a group: no group spans two rows
    first = starts.nonzero().squeeze(1)
    sizes = torch.bincount(group, minlength=first.numel())
    last = first + sizes - 1
    rep_count = count.reshape(-1)[last]
    slots = max(1, -(-int(rep_count.max()) // KEY_BLOCK)) * KEY_BLOCK
    rep = order.reshape(b * tq, tk)[last]
    rep = F.pad(rep, (0, slots - tk))[:, :slots] if slots > tk else rep[:, :slots]
    local = torch.arange(b * tq, device=valid.device) - first[group]
    return types.SimpleNamespace(rows=last // tq, order=rep, count=rep_count, group=group.view(b, tq),
                                 local=local.view(b, tq), keys=count, largest=int(sizes.max()), placements={})


_LAST_LAYOUT: tuple = ()  # (mask, its version, b, tq, tk, layout): the layers of one forward share a mask


def _cached_layout(mask: torch.Tensor | None, b: int, tq: int, tk: int, device: torch.device) -> types.SimpleNamespace:
    """``_layout`` of an attention call's mask, computed once for all the layers of a forward (transformers
    hands every layer the same mask object; the entry holds it, so its id cannot be reused)."""
    global _LAST_LAYOUT
    version = mask._version if mask is not None else None
    last = _LAST_LAYOUT  # one read: another thread may replace it
    if last and last[0] is mask and last[1:5] == (version, b, tq, tk) and last[5].rows.device == device:
        return last[5]
    layout = _layout(_valid_keys(mask, tq, tk, device).expand(b, 1, tq, tk)[:, 0])
    _LAST_LAYOUT = (mask, version, b, tq, tk, layout)
    return layout


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with zero columns appended to ``width`` in its last dimension (zero products change no sum)."""
    return F.pad(t, (0, width - t.shape[-1])) if width > t.shape[-1] else t


def _block_products(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n, QUERY_BLOCK, K) @ (n, K, N) in fp32, one MKL call shape for the whole batch, one MKL thread (the
    exact linear's recipe: a row's bits then follow its own data, its slot and neighbours aside;
    tests/models/test_batch_invariant.py holds it for these shapes). ``b`` may be a transposed view (the score
    call's keys as gathered, (KEY_BLOCK, w) per block): MKL reads it through its transpose flag, which saves a
    transposing copy and gives the bits of the contiguous copy (held by the same test). Without MKL (or on
    CUDA) each output is a length-K ``row_sum``."""
    if a.device.type != "cpu" or _SET_MKL_THREADS is None:
        products = row_sum(a.unsqueeze(-2) * b.transpose(-1, -2).unsqueeze(-3))
        return products if out is None else out.copy_(products)
    with _one_mkl_thread():
        return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)`` for a 2-D ``t``: the rows copied whole (a gather is exact), by the
    embedding lookup, which copies a row about three times faster than ``index_select`` on this CPU."""
    return F.embedding(index, t)


def _pairs(place: types.SimpleNamespace, j: int, m: int) -> types.SimpleNamespace:
    """The (problem, query block, key block) pairs of query blocks j .. j + m - 1 that hold a key for some row
    of the query block (``place.need``: a causal query block stops at its last row's key block), key block by
    key block: ``flat`` indices into (n, m, kb), ``rows`` into (n, m) (the query block of the chunk),
    ``queries`` into the query blocks (n * qb), ``keys`` into the key blocks (n * kb), and ``bounds`` each key
    block's slice of them; computed once per placement and chunk, shared by every layer of a forward."""
    cached = place.pairs.get((j, m))
    if cached is not None:
        return cached
    n, qb = place.need.shape
    kb = place.bias.shape[2]
    used = torch.arange(kb, device=place.need.device) < place.need[:, j: j + m, None]  # (n, m, kb)
    index = used.permute(2, 0, 1).reshape(-1).nonzero().squeeze(1)  # key block major
    block, rows = index // (n * m), index % (n * m)
    problem = rows // m
    ends = torch.bincount(block, minlength=kb).cumsum(0).tolist()
    place.pairs[(j, m)] = out = types.SimpleNamespace(
        flat=rows * kb + block, rows=rows, queries=problem * qb + j + rows % m, keys=problem * kb + block,
        bounds=list(zip([0] + ends[:-1], ends)))
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, place: types.SimpleNamespace) -> torch.Tensor:
    """Attention of n independent problems, fp32: query rows q (n, qb, QUERY_BLOCK, w), already scaled,
    over keys k and values v (n, kb, KEY_BLOCK, w) in slot order, both contiguous;
    ``place.bias`` (n, qb, kb, QUERY_BLOCK, KEY_BLOCK) 0 at the slots a row attends, -inf past them. -> (n, qb,
    QUERY_BLOCK, w); a row with no key gets 0.

    Every sum has a shape that the batch, the padding and the cache cannot change: a score is an element
    of one (QUERY_BLOCK, w) x (w, KEY_BLOCK) GEMM call; a block's probability mass is a length-KEY_BLOCK
    ``row_sum`` and its values one (QUERY_BLOCK, KEY_BLOCK) x (KEY_BLOCK, w) call's; the blocks then add
    up one after another in slot order, after one max over the row's scores (exact in any order). Slots
    past a row's keys hold exp(-inf) = 0 and add exact zeros: a longer list (the trainer's row, the cache's
    extra slots) gives a row the bits of its own keys alone. Only the (query block, key block) pairs of
    ``_pairs`` are computed (a causal forward's upper triangle is not: about half its products); the others
    would add exact zeros and add nothing, so a row's sum is the one it was with every pair computed (an
    addition of +0 changes no value; only a sum of -0 would keep its sign), and the one a decode step, whose
    slots end at its own block and which never adds those zeros, gives it."""
    n, qb, _, w = q.shape
    if qb == 1:
        return _attend_one_block(q, k, v, place)
    kb = k.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, n * QUERY_BLOCK * kb * KEY_BLOCK))  # query blocks per chunk
    # blocks as the rows of 2-D views: a 2-D row is copied whole (several times faster than a 3-D index_select)
    q_blocks, k_blocks, v_blocks = q.reshape(n * qb, -1), k.view(n * kb, -1), v.view(n * kb, -1)
    bias = place.bias.view(n * qb * kb, -1)
    outs = []
    for j in range(0, qb, step):
        m = min(step, qb - j)
        pairs = _pairs(place, j, m)
        flat, queries, keys = pairs.flat, pairs.queries, pairs.keys
        # a chunk of one query block with every pair (a decode step's): the pairs are views in (n, 1, kb) order,
        # no copies; else gathered key block by key block (``_pairs``' order) and put back by index
        dense = m == 1 and flat.numel() == n * kb
        if dense:
            left = q[:, j: j + 1].expand(n, kb, QUERY_BLOCK, w).reshape(-1, QUERY_BLOCK, w)
            right, values = k.view(-1, KEY_BLOCK, w).transpose(1, 2), v.view(-1, KEY_BLOCK, w)
            chunk_bias = place.bias[:, j].reshape(-1, QUERY_BLOCK, KEY_BLOCK)
        else:
            left = _rows(q_blocks, queries).view(-1, QUERY_BLOCK, w)
            right = _rows(k_blocks, keys).view(-1, KEY_BLOCK, w).transpose(1, 2)
            values = _rows(v_blocks, keys).view(-1, KEY_BLOCK, w)
            chunk_bias = _rows(bias, queries * kb + keys % kb).view(-1, QUERY_BLOCK, KEY_BLOCK)
        scores = _block_products(left, right).add_(chunk_bias)  # (pairs, QUERY_BLOCK, KEY_BLOCK)
        # one max per row over its pairs' scores (the pairs left out hold -inf only)
        peak = scores.amax(-1)
        if not dense:
            peak = scores.new_full((n * m * kb, QUERY_BLOCK), float("-inf")).index_copy_(0, flat, peak)
        peak = peak.view(n, m, kb, QUERY_BLOCK).amax(2)
        row_peak = peak.unsqueeze(2).expand(n, m, kb, QUERY_BLOCK).reshape(-1, QUERY_BLOCK)
        if not dense:
            row_peak = _rows(row_peak, flat)
        p = scores.sub_(row_peak.unsqueeze(-1)).exp_()  # exact zeros at the slots past the row's keys
        block_mass, block_out = row_sum(p), _block_products(p, values)
        if dense:
            block_mass, block_out = block_mass.view(n, m, kb, QUERY_BLOCK), block_out.view(n, m, kb, QUERY_BLOCK, w)
            mass, out = block_mass[:, :, 0], block_out[:, :, 0]
            for i in range(1, kb):  # a fixed sequential order; blocks past a row add exact zeros
                mass, out = mass + block_mass[:, :, i], out + block_out[:, :, i]
        else:  # the same order, key block by key block, over the query blocks that have the pair (a pair left
            # out would add an exact zero); each query block once a call: index_add_ is then that one addition
            block_out = block_out.view(-1, QUERY_BLOCK * w)
            mass, out = scores.new_zeros(n * m, QUERY_BLOCK), scores.new_zeros(n * m, QUERY_BLOCK * w)
            for i, (start, end) in enumerate(pairs.bounds):
                rows = pairs.rows[start:end]
                add = torch.Tensor.index_copy_ if i == 0 else torch.Tensor.index_add_
                add(mass, 0, rows, block_mass[start:end])
                add(out, 0, rows, block_out[start:end])
            mass, out = mass.view(n, m, QUERY_BLOCK), out.view(n, m, QUERY_BLOCK, w)
        # a row with no key gets 0; its mass is set to 1 first, so that no 0/0 is formed
        empty = place.empty[:, j: j + m]  # a row with no key (a padding query, a padding row)
        outs.append((out / mass.masked_fill(empty, 1.0).unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0))
    return torch.cat(outs, 1) if len(outs) > 1 else outs[0]


def _attend_one_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, place: types.SimpleNamespace) -> torch.Tensor:
    """``_attend`` for problems of one query block (a decode step's; rows of up to ``QUERY_BLOCK`` queries), with
    the same bits: the same GEMM calls, row sums and additions in the same order, over every key block (a pair
    ``_pairs`` leaves out adds exact zeros, as in ``_attend``), one key block at a time (no copies of the
    queries or the pairs). The elementwise ops take only the ``place.real`` rows that hold a query (a decode
    step's 2 of 8 with 2 heads a KV head); the GEMM calls take the zero rows too, whose products leave a row's
    bits as they are."""
    n, _, _, w = q.shape
    kb, real = k.shape[1], place.real
    left = q.view(n, QUERY_BLOCK, w)
    products = q.new_empty(kb, n, QUERY_BLOCK, KEY_BLOCK)  # key block major: each block's call writes in place
    for i in range(kb):
        _block_products(left, k[:, i].transpose(1, 2), out=products[i])
    scores = products[:, :, :real].add_(place.bias[:, 0, :, :real].transpose(0, 1))  # (kb, n, real, KEY_BLOCK)
    peak = scores.amax(-1).amax(0)  # one max per row over all its scores
    p = scores.sub_(peak.unsqueeze(-1)).exp_()  # exact zeros at the slots past the row's keys
    block_mass = row_sum(p)  # (kb, n, real)
    mass, out = block_mass[0], _block_products(products[0], v[:, 0])[:, :real]
    for i in range(1, kb):  # a fixed sequential order; blocks past a row add exact zeros
        mass, out = mass + block_mass[i], out + _block_products(products[i], v[:, i])[:, :real]
    empty = place.empty[:, 0, :real]  # a row with no key (a padding query, a padding row) gets 0
    out = (out / mass.masked_fill(empty, 1.0).unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0)
    return (F.pad(out, (0, 0, 0, QUERY_BLOCK - real)) if real < QUERY_BLOCK else out).view(n, 1, QUERY_BLOCK, w)


def _placement(layout: types.SimpleNamespace, h: int, h_kv: int, tk: int) -> types.SimpleNamespace:
    """Where the queries, keys and values of a call with ``h`` heads, ``h_kv`` KV heads and ``tk`` keys go
    in ``_attend``'s problems (one per group of ``layout`` and KV head; its rows the group's queries of the
    heads that share the KV head, query-major, zero rows up to a multiple of ``QUERY_BLOCK``; its keys the
    group's slot list), computed once per layout and kept in it: every layer of a forward has the same."""
    key = (h, h_kv, tk)
    cached = layout.placements.get(key)
    if cached is not None:
        return cached
    b, tq = layout.group.shape
    groups, slots = layout.order.shape
    per = h // h_kv
    rows = -(-layout.largest * per // QUERY_BLOCK) * QUERY_BLOCK
    dev = layout.order.device
    flat = lambda g, kv, r: (g * h_kv + kv) * rows + r  # noqa: E731 - a problem row's flat index
    kv = torch.arange(h_kv, device=dev).view(1, 1, h_kv, 1)
    a = torch.arange(per, device=dev).view(1, 1, 1, per)
    g, local = layout.group.view(b, tq, 1, 1), layout.local.view(b, tq, 1, 1)
    out_rows = flat(g, kv, local * per + a)  # (b, tq, h_kv, per): where (row, query, head) lands
    rows_keys = layout.keys.new_zeros(groups * h_kv * rows)
    rows_keys[out_rows.reshape(-1)] = layout.keys.view(b, tq, 1).expand(b, tq, h).reshape(-1)
    slot = torch.arange(slots, device=dev)
    bias = torch.zeros(groups * h_kv, rows // QUERY_BLOCK, QUERY_BLOCK, slots // KEY_BLOCK, KEY_BLOCK, device=dev)
    # a row with no key (a padding row of a problem, a padding query) attends every slot: its output is set to 0
    # after, and its scores then stay finite (exp of -inf takes a slow path: 2.5x a finite score's on this CPU)
    row_keys = rows_keys.view(groups * h_kv, -1, QUERY_BLOCK, 1, 1)
    past = (slot.view(1, 1, 1, -1, KEY_BLOCK) >= row_keys) & (row_keys > 0)
    bias = bias.masked_fill_(past, float("-inf")).transpose(2, 3).contiguous()
    # key blocks each query block needs: up to its row with the most keys (none for a block of padding rows)
    need = -(-rows_keys.view(groups * h_kv, -1, QUERY_BLOCK).amax(-1) // KEY_BLOCK)
    # each (group, KV head, slot)'s key in the (b * h_kv * tk) rows of a key tensor; slots past the group's keys
    # read its row's first key (weighted by exp(-inf) = 0)
    order = layout.order.masked_fill(slot >= layout.count[:, None], 0)
    keys = ((layout.rows.view(-1, 1, 1) * h_kv + torch.arange(h_kv, device=dev).view(1, -1, 1)) * tk
            + order.view(groups, 1, slots)).reshape(-1)
    placed = types.SimpleNamespace(rows=rows, problems=groups * h_kv, bias=bias, keys=keys, need=need, pairs={},
                                   real=min(rows, layout.largest * per),  # rows of a problem that hold a query
                                   empty=(rows_keys == 0).view(groups * h_kv, -1, QUERY_BLOCK),
                                   queries=out_rows.permute(0, 2, 3, 1).reshape(-1),  # in q's (b, h, tq) order
                                   out=out_rows.reshape(-1))  # in the output's (b, tq, h) order
    layout.placements[key] = placed
    return placed


def _exact_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: types.SimpleNamespace,
                   scaling: float) -> torch.Tensor:
    """q (b, h, tq, d), k/v (b, h_kv, tk, d) fp32 -> (b, tq, h, d) by ``_attend`` over ``_placement``'s
    problems; the head dimension padded with zeros to a multiple of ``GEMM_PAD`` (zero products change no
    sum), the queries scaled before the products."""
    b, h, tq, d = q.shape
    h_kv, tk = k.shape[1], k.shape[2]
    place = _placement(layout, h, h_kv, tk)
    w = -(-d // GEMM_PAD) * GEMM_PAD
    n, qb, kb = place.problems, place.rows // QUERY_BLOCK, layout.order.shape[1] // KEY_BLOCK
    queries = _padded(q.new_zeros(n * place.rows, d).index_copy_(0, place.queries, q.reshape(-1, d) * scaling), w)
    keys = _padded(_rows(k.reshape(-1, d), place.keys), w).view(n, kb, KEY_BLOCK, w)
    values = _padded(_rows(v.reshape(-1, d), place.keys), w).view(n, kb, KEY_BLOCK, w)
    out = _attend(queries.view(n, qb, QUERY_BLOCK, w), keys, values, place)
    return _rows(out.reshape(-1, w), place.out)[:, :d].reshape(b, tq, h, d)


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """The same function as ``_attend`` by a plain masked softmax (any reduction order): its backward.
    q (b, h, tq, d), k/v (b, h, tk, d), valid (b, 1, tq, tk) -> (b, h, tq, d)."""
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key: 0, as ``_attend``
    return probs @ v


class _ExactAttention(torch.autograd.Function):
    """``_exact_forward`` in the forward; the backward is the gradient of the same function computed
    plainly (``_plain_attention``, recomputed): exactness is the forward's property alone."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scaling: float) -> torch.Tensor:
        b, h, tq, d = q.shape
        tk = k.shape[2]
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.scaling = mask, scaling
        return _exact_forward(q, k, v, _cached_layout(mask, b, tq, tk, q.device), scaling)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = ctx.saved_tensors
        b, h, tq, _ = q.shape
        valid = _valid_keys(ctx.mask, tq, k.shape[2], q.device).expand(b, 1, tq, k.shape[2])
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            per = h // k.shape[1]
            out = _plain_attention(inputs[0], inputs[1].repeat_interleave(per, 1), inputs[2].repeat_interleave(per, 1),
                                   valid, ctx.scaling)
            grads = torch.autograd.grad(out.transpose(1, 2), inputs, grad)
        return (*grads, None, None)


def exact_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``AttentionInterface``): query (b, h, tq, d), key/value
    (b, h_kv, tk, d) -> (b, tq, h, d) in the query's dtype. No dropout (exact mode scores, it does not
    regularise), no sliding window, no sinks: ``apply_exact`` refuses models that have them."""
    d = query.shape[-1]
    scaling = d ** -0.5 if scaling is None else scaling
    with torch.autocast(query.device.type, enabled=False):
        q, k, v = query.float(), key.float(), value.float()
        if _needs_grad(q, k, v):
            out = _ExactAttention.apply(q, k, v, attention_mask, scaling)
        else:  # the rollout's decode and the scoring forwards: no autograd node to build
            b, _, tq, _ = q.shape
            out = _exact_forward(q, k, v, _cached_layout(attention_mask, b, tq, k.shape[2], q.device), scaling)
    return out.to(query.dtype), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, exact_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # a boolean 4-D mask, True where attended


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return exact_linear(x, self.weight, self.bias)


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return exact_rms_norm(x, self.weight, self.variance_epsilon)


def _embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The lookup, rounded to the autocast dtype inside autocast: the residual stream then holds what a
    bf16 copy of the weights holds (a gather is exact either way)."""
    out = nn.Embedding.forward(self, ids)
    return out.to(_compute_dtype(out))


def unsupported_reason(module: nn.Module) -> str | None:
    """Why exact mode cannot convert ``module`` (None: it can)."""
    config = getattr(module, "config", None)
    text = config.get_text_config(decoder=True) if config is not None else None
    if text is None:
        return "the module has no Hugging Face config"
    if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or ["full_attention"])):
        return "sliding-window layers"
    if getattr(config, "vision_config", None) is not None:
        return "a vision tower (its convolutions and attention are not converted)"
    if any(hasattr(m, "experts") for m in module.modules()):
        return "MoE experts (their grouped matmuls are not converted)"
    if not any(type(m).__name__.endswith("RMSNorm") for m in module.modules()):
        return "no RMSNorm layers (LayerNorm models are not converted)"
    return None


def apply_exact(module: nn.Module) -> str:
    """Install exact mode's ops on an HF causal LM in place (before sharding); returns the line for the
    run's first lines. Raises ``ValueError`` naming the key where the model is not covered."""
    reason = unsupported_reason(module)
    if reason is not None:
        raise ValueError(f"{KEY}=true: {type(module).__name__} has {reason}; exact mode covers dense "
                         f"Qwen2/Llama-family text models. Set {KEY}=false.")
    _register_attention()
    counts = {"linear": 0, "rms_norm": 0}
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.forward = types.MethodType(_linear_forward, sub)
            counts["linear"] += 1
        elif type(sub).__name__.endswith("RMSNorm") and hasattr(sub, "variance_epsilon"):
            sub.forward = types.MethodType(_rms_norm_forward, sub)
            counts["rms_norm"] += 1
        elif isinstance(sub, nn.Embedding):
            sub.forward = types.MethodType(_embedding_forward, sub)
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION
    setattr(module, _EXACT_ATTR, True)
    return (f"{KEY}: {counts['linear']} linear layers, {counts['rms_norm']} RMSNorms and the attention "
            "(rlfoundry_exact) replaced by batch-invariant ops (models/batch_invariant.py)")


def is_exact(module: nn.Module) -> bool:
    """Whether ``apply_exact`` converted ``module`` (or the model a wrapper holds)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return bool(getattr(base, _EXACT_ATTR, False) or getattr(module, _EXACT_ATTR, False))
