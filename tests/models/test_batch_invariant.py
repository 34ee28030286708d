"""Exact mode's ops (models/batch_invariant.py): each output's bits do not depend on the batch around it,
its padding, the packing or the KV-cache split (``torch.equal`` throughout), and they compute the same
function as torch's own ops (to rounding)."""

import pytest
import torch
import torch.nn.functional as F

from rlfoundry.models.batch_invariant import (
    apply_exact,
    exact_attention,
    exact_linear,
    exact_log_probs,
    exact_rms_norm,
    row_sum,
)
from rlfoundry.utils.padding import packed_causal_mask


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_row_sum_of_a_row_does_not_depend_on_the_rows_beside_it():
    # 40,000 elements in one row: torch alone would split that single output's sum over threads
    for width in (7, 64, 40_000):
        x = torch.randn(9, width, generator=_gen(width))
        full = row_sum(x)
        assert torch.allclose(full, x.double().sum(-1).float(), rtol=1e-4, atol=1e-3)
        for rows in (1, 2, 5):
            assert torch.equal(row_sum(x[3: 3 + rows]), full[3: 3 + rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_rows_output_is_the_same_in_any_batch(dtype):
    w = torch.randn(33, 48, generator=_gen(1)).to(dtype)
    bias = torch.randn(33, generator=_gen(2)).to(dtype)
    x = torch.randn(2, 37, 48, generator=_gen(3)).to(dtype)
    full = exact_linear(x, w, bias)
    assert full.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounded once (8 bits of mantissa)
    assert torch.allclose(full.float(), F.linear(x.float(), w.float(), bias.float()), rtol=tol, atol=tol)
    for lo, hi in ((0, 1), (5, 6), (3, 20), (0, 37)):
        assert torch.equal(exact_linear(x[1:, lo:hi], w, bias), full[1:, lo:hi])


# (K, N): the tiny policy's layers and head, odd sizes, and K not a multiple of 4 with N < 12, where MKL's
# kernel gives a row other bits at another slot of its block unless K and N are padded (measured)
_LINEAR_SHAPES = [(128, 128), (128, 64), (256, 128), (128, 260), (48, 33), (7, 5), (129, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", _LINEAR_SHAPES)
def test_a_linear_rows_bits_do_not_depend_on_its_slot_its_neighbours_or_the_row_count(k, n, dtype):
    """Each of 8 rows, computed alone (M = 1), has the same bits at every slot of a GEMM block, beside
    random rows, in M = 63, 64, 65 and 200 (the last block zero-padded or not, 1 to 4 blocks)."""
    from rlfoundry.models.batch_invariant import GEMM_ROWS

    g = _gen(k * 1000 + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    rows = torch.randn(8, k, generator=g).to(dtype)
    alone = torch.stack([exact_linear(rows[i: i + 1], w)[0] for i in range(8)])
    assert torch.allclose(alone.float(), rows.float() @ w.float().t(), rtol=1e-2, atol=1e-2)
    for m in (GEMM_ROWS - 1, GEMM_ROWS, GEMM_ROWS + 1, 200):
        x = torch.randn(m, k, generator=g).to(dtype)
        slots = torch.randperm(m, generator=g)[:8]  # other slots of other blocks each time
        x[slots] = rows
        assert torch.equal(exact_linear(x, w)[slots], alone), m
    for slot in range(GEMM_ROWS):  # every slot of one block, among other neighbours each time
        x = torch.randn(GEMM_ROWS, k, generator=g).to(dtype)
        x[slot] = rows[slot % 8]
        assert torch.equal(exact_linear(x, w)[slot], alone[slot % 8]), slot


@pytest.mark.parametrize("k,n", [(128, 24), (128, 33), (64, 40), (128, 100), (128, 256), (256, 128), (896, 4864)])
def test_a_linear_rows_bits_do_not_depend_on_the_thread_count(k, n):
    """The rollout and the trainer may run in processes with other thread counts. A plain MKL GEMM of these
    shapes gives the last columns other bits with 3 or 4 threads (it splits N among them in a single block); the exact
    linear pins MKL to one thread inside the op. The input an unaligned view, as an activation may be."""
    g = _gen(k + n)
    w = torch.randn(n, k, generator=g)
    for m in (40, 128, 192, 257, 512, 2112):  # 1, 2, 3, 5, 8, 33 GEMM blocks: fewer than the threads, as many, more
        x = torch.randn(m + 1, k, generator=g)[1:]  # storage offset: one element
        threads = torch.get_num_threads()
        try:
            outs = []
            for count in (1, 2, 3, 4):
                torch.set_num_threads(count)
                outs.append(exact_linear(x, w))
        finally:
            torch.set_num_threads(threads)
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), m
        assert torch.equal(outs[0][5:6], exact_linear(x[5:6].clone(), w))


def test_an_attentions_bits_do_not_depend_on_the_thread_count():
    """The attention's batched GEMM calls (one per query block and key block) on 1 to 4 threads: the same bits, for a
    decode step (one query block a problem) and a forward over left-padded rows."""
    g = _gen(77)
    for b, tq, tk in ((128, 1, 40), (8, 37, 37)):
        q = torch.randn(b, 4, tq, 32, generator=g)
        k, v = (torch.randn(b, 2, tk, 32, generator=g) for _ in range(2))
        keep = torch.arange(tk)[None] >= torch.randint(0, tk // 3, (b,), generator=g)[:, None]
        mask = keep[:, None, None, :] & torch.ones(tk, tk, dtype=torch.bool).tril()[-tq:]
        threads = torch.get_num_threads()
        try:
            outs = []
            for count in (1, 2, 3, 4):
                torch.set_num_threads(count)
                outs.append(exact_attention(None, q, k, v, mask)[0])
        finally:
            torch.set_num_threads(threads)
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), (b, tq)


def test_under_autocast_a_linear_rounds_as_a_bf16_copy_of_its_weights_computes():
    w = torch.randn(16, 24, generator=_gen(4))
    x = torch.randn(5, 24, generator=_gen(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = exact_linear(x, w)
    assert auto.dtype == torch.bfloat16
    assert torch.equal(auto, exact_linear(x.bfloat16(), w.bfloat16()))


def test_rms_norm_and_log_probs_of_a_row_are_the_same_in_any_batch():
    x = torch.randn(6, 64, generator=_gen(6))
    weight = torch.randn(64, generator=_gen(7))
    full = exact_rms_norm(x, weight, 1e-6)
    ref = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(full, ref, atol=1e-5)
    assert torch.equal(exact_rms_norm(x[2:3], weight, 1e-6), full[2:3])
    logits = torch.randn(6, 300, generator=_gen(8))
    labels = torch.randint(300, (6,), generator=_gen(9))
    lp = exact_log_probs(logits, labels, temperature=0.7)
    assert torch.allclose(lp, torch.log_softmax(logits / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1), atol=1e-5)
    for lo, hi in ((0, 1), (4, 6)):
        assert torch.equal(exact_log_probs(logits[lo:hi], labels[lo:hi], 0.7), lp[lo:hi])


@pytest.mark.parametrize("op", [torch.exp, torch.log, torch.rsqrt, torch.cos, torch.sin, F.silu, torch.sigmoid])
def test_elementwise_ops_give_an_element_the_same_bits_wherever_it_sits(op):
    """The premise that elementwise ops are exact: torch's vectorised body and its tail give an element
    the same bits, so a slice at any offset and of any length matches the whole tensor's result."""
    x = torch.rand(4099, generator=_gen(10)) * 8 + 0.01
    full = op(x)
    for lo, hi in ((0, 1), (1, 18), (3, 4099), (7, 100), (4090, 4099)):
        assert torch.equal(op(x[lo:hi].clone()), full[lo:hi])


def _qkv(b, h, hkv, t, d, seed=11):
    g = _gen(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)


def test_attention_matches_sdpa_and_a_query_is_the_same_under_padding_decode_and_packing():
    q, k, v = _qkv(1, 4, 2, 40, 8)
    out, _ = exact_attention(None, q, k, v, None, scaling=8 ** -0.5)  # causal (no mask)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)
    # decode: query t over a cache of t + 1 keys, with 5 left-padding keys before them
    for t in (0, 15, 16, 17, 39):
        pad = 5
        kk = torch.cat([torch.randn(1, 2, pad, 8), k[:, :, : t + 1]], 2)
        vv = torch.cat([torch.randn(1, 2, pad, 8), v[:, :, : t + 1]], 2)
        mask = torch.cat([torch.zeros(pad, dtype=torch.bool), torch.ones(t + 1, dtype=torch.bool)])[None, None, None]
        step, _ = exact_attention(None, q[:, :, t: t + 1], kk, vv, mask, scaling=8 ** -0.5)
        assert torch.equal(step[0, 0], out[0, t])
    # packing: the sequence after another one of 9 tokens, block-diagonal mask
    other_q, other_k, other_v = _qkv(1, 4, 2, 9, 8, seed=12)
    seq = torch.cat([torch.zeros(9, dtype=torch.long), torch.ones(40, dtype=torch.long)])
    causal = torch.ones(49, 49, dtype=torch.bool).tril()
    block = (seq[:, None] == seq[None, :]) & causal
    packed, _ = exact_attention(None, torch.cat([other_q, q], 2), torch.cat([other_k, k], 2),
                                torch.cat([other_v, v], 2), block[None, None], scaling=8 ** -0.5)
    assert torch.equal(packed[0, 9:], out[0])


def _exact_model(tiny_model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    apply_exact(model)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_logits_do_not_depend_on_batch_padding_packing_or_the_kv_cache(tiny_model_dir, dtype):
    from transformers import DynamicCache

    model = _exact_model(tiny_model_dir, dtype)
    ids = torch.randint(4, 200, (3, 21), generator=_gen(13))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids[1:2]).logits[0], full[1])
        # left and right padding
        for left in (True, False):
            pad = torch.zeros(1, 6, dtype=torch.long)
            row = torch.cat([pad, ids[1:2]], 1) if left else torch.cat([ids[1:2], pad], 1)
            mask = (torch.arange(27) >= 6 if left else torch.arange(27) < 21).long()[None]
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=row, attention_mask=mask, position_ids=pos).logits[0]
            assert torch.equal(out[6:] if left else out[:21], full[1])
        # packed: two sequences end to end, with the block-diagonal mask the engine's packed forward builds
        sequence = torch.cat([torch.zeros(9, dtype=torch.long), torch.ones(21, dtype=torch.long)])
        packed = model(input_ids=torch.cat([ids[0, :9], ids[1]])[None], attention_mask=packed_causal_mask(sequence),
                       position_ids=torch.cat([torch.arange(9), torch.arange(21)])[None]).logits[0]
        assert torch.equal(packed[9:], full[1])
        # a prefill of 10 tokens, then one token a step from the cache
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :10], past_key_values=cache, use_cache=True).logits]
        for t in range(10, 21):
            steps.append(model(input_ids=ids[:, t: t + 1], past_key_values=cache, use_cache=True,
                               position_ids=torch.full((3, 1), t)).logits)
        assert torch.equal(torch.cat(steps, 1), full)


def test_the_backward_is_the_gradient_of_the_same_function(tiny_model_dir):
    """The exact ops' backward (plain matmuls and a plain masked softmax, recomputed) gives the plain model's
    gradients to fp32 rounding, with left padding (queries with no key must not send NaN back)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    exact = _exact_model(tiny_model_dir)
    ids = torch.randint(4, 200, (3, 14), generator=_gen(14))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    grads = []
    for model in (plain, exact):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits[mask.bool()].logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, want in grads[0].items():
        got = grads[1][name]
        assert torch.isfinite(got).all(), name
        # fp32 re-association over the longest sums (vocabulary 260 + 42 tokens): ~2e-5 normwise
        assert float((got - want).norm() / want.norm()) < 2e-5, name


@pytest.mark.parametrize("width", [16, 32, 64, 128])
def test_an_attention_blocks_rows_have_the_same_bits_at_any_slot_beside_any_rows(width):
    """The exact attention's two GEMM calls, (QUERY_BLOCK, w) x (w, KEY_BLOCK) for the scores and
    (QUERY_BLOCK, KEY_BLOCK) x (KEY_BLOCK, w) for a block's values: a row's bits at every slot of the block,
    beside random rows, in a batch of 1 to 50 calls, equal its bits alone at slot 0 (the decode's place)."""
    from rlfoundry.models.batch_invariant import KEY_BLOCK, QUERY_BLOCK, _block_products

    g = _gen(width)
    for inner, outer in ((width, KEY_BLOCK), (KEY_BLOCK, width)):
        rows = torch.randn(4, inner, generator=g)
        right = torch.randn(outer, inner, generator=g).t()  # (inner, outer), as the callers pass a transposed view
        alone = []
        for r in rows:
            single = torch.zeros(1, QUERY_BLOCK, inner)
            single[0, 0] = r
            alone.append(_block_products(single, right.unsqueeze(0).contiguous())[0, 0])
        alone = torch.stack(alone)
        assert torch.allclose(alone, rows @ right, rtol=1e-4, atol=1e-4)
        for calls in (1, 3, 50):
            left = torch.randn(calls, QUERY_BLOCK, inner, generator=g)
            which = torch.randint(calls, (QUERY_BLOCK,), generator=g)
            for slot in range(QUERY_BLOCK):
                left[which[slot], slot] = rows[slot % 4]
            rights = torch.randn(calls, inner, outer, generator=g)
            rights[which] = right
            out = _block_products(left, rights)
            for slot in range(QUERY_BLOCK):
                assert torch.equal(out[which[slot], slot], alone[slot % 4]), (inner, outer, calls, slot)
            # the score call's keys come as a transposed view of the gathered (KEY_BLOCK, w) blocks: the same bits
            transposed = _block_products(left, rights.transpose(1, 2).contiguous().transpose(1, 2))
            assert torch.equal(transposed, out), (inner, outer, calls)


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 8), (14, 2, 64), (3, 3, 48)])
def test_a_querys_attention_is_the_same_in_any_batch_mask_and_cache_split(heads, kv_heads, d, monkeypatch):
    """One sequence's queries, computed causally alone, keep their bits: beside other rows with other
    left padding; decoded one query at a time over caches of every length, with cache slots past the
    keys (a static cache's tail); after a prompt shared with another response, whose keys the mask skips
    (the shared-prompt forward: the keys of a query not contiguous); in chunks (a small chunk budget); with
    GQA groups (7 heads a KV head) that do not divide the query block, and head widths padded to 16."""
    import rlfoundry.models.batch_invariant as bi

    g = _gen(heads * d)
    t, prompt = 37, 12
    q = torch.randn(1, heads, t, d, generator=g)
    k, v = (torch.randn(1, kv_heads, t, d, generator=g) for _ in range(2))
    alone, _ = exact_attention(None, q, k, v, None)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kv_heads, 1),
                                         v.repeat_interleave(heads // kv_heads, 1), is_causal=True)
    assert torch.allclose(alone, ref.transpose(1, 2), atol=1e-5)

    def padded(x, left, total):
        return torch.cat([torch.randn(1, x.shape[1], left, d, generator=g), x,
                          torch.randn(1, x.shape[1], total - left - x.shape[2], d, generator=g)], 2)

    # a batch of 3 rows, the sequence in the middle with 5 slots of left padding, the others other lengths
    pads, total = (0, 5, 20), t + 20
    qs, ks, vs = [], [], []
    for i, p in enumerate(pads):
        length = total - p
        src = (q, k, v) if i == 1 else [torch.randn(1, x.shape[1], length, d, generator=g) for x in (q, k, v)]
        for into, x in zip((qs, ks, vs), src):
            into.append(padded(x[:, :, :length], p, total))
    keep = torch.stack([torch.arange(total) >= p for p in pads])  # (3, total)
    mask = (keep[:, None, None, :] & torch.ones(total, total, dtype=torch.bool).tril())  # (3, 1, total, total)
    mask[1, :, :, :] &= (torch.arange(total) < 5 + t)[None, None, :]
    for chunk in (1 << 20, 300):
        monkeypatch.setattr(bi, "_CHUNK_ELEMENTS", chunk)
        batch, _ = exact_attention(None, torch.cat(qs), torch.cat(ks), torch.cat(vs), mask)
        assert torch.equal(batch[1, 5: 5 + t], alone[0]), chunk
    # decode: query i over a cache holding 3 slots of left padding, keys 0..i, then 0 to 9 unfilled slots
    for i in range(t):
        for tail in (0, 9):
            cache = padded(k[:, :, : i + 1], 3, 3 + i + 1 + tail), padded(v[:, :, : i + 1], 3, 3 + i + 1 + tail)
            step_mask = torch.zeros(1, 1, 1, 3 + i + 1 + tail, dtype=torch.bool)
            step_mask[..., 3: 3 + i + 1] = True
            got, _ = exact_attention(None, q[:, :, i: i + 1], *cache, step_mask)
            assert torch.equal(got[0, 0], alone[0, i]), (i, tail)
    # the shared-prompt forward: the prompt, another response of 6 tokens, then this sequence's response;
    # the response's queries attend the prompt and their own keys only
    other = [torch.randn(1, x.shape[1], 6, d, generator=g) for x in (q, k, v)]
    pq, pk, pv = (torch.cat([x[:, :, :prompt], o, x[:, :, prompt:]], 2) for x, o in zip((q, k, v), other))
    n = t + 6
    segment = torch.cat([torch.zeros(prompt), torch.ones(6), torch.full((t - prompt,), 2)])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    shared = causal & ((segment[:, None] == segment[None, :]) | (segment[None, :] == 0))
    got, _ = exact_attention(None, pq, pk, pv, shared[None, None])
    assert torch.equal(got[0, :prompt], alone[0, :prompt])
    assert torch.equal(got[0, prompt + 6:], alone[0, prompt:])


def test_without_mkl_the_attention_keeps_its_invariance(monkeypatch):
    """The path of a torch without MKL (and of CUDA tensors): the attention's products as ``row_sum``s of
    broadcast products, with the same batch, mask and cache-split invariance."""
    import rlfoundry.models.batch_invariant as bi

    monkeypatch.setattr(bi, "_SET_MKL_THREADS", None)
    test_a_querys_attention_is_the_same_in_any_batch_mask_and_cache_split(4, 2, 8, monkeypatch)
    test_attention_matches_sdpa_and_a_query_is_the_same_under_padding_decode_and_packing()


@pytest.mark.parametrize("chunk", [1 << 20, 300])
def test_skipping_the_key_blocks_past_a_query_block_keeps_every_rows_bits(chunk, monkeypatch):
    """The attention computes only the (query block, key block) pairs that hold a key of some row of the
    query block (``_pairs``): every row's output has the bits it has with every pair computed (the pairs
    left out give exact zeros), over rows of other lengths and left padding, padding queries (output 0),
    the shared-prompt mask, a decode step, in chunks."""
    import rlfoundry.models.batch_invariant as bi

    monkeypatch.setattr(bi, "_CHUNK_ELEMENTS", chunk)
    g = _gen(chunk % 997)
    heads, kv_heads, d, total = 4, 2, 24, 70
    pads = (0, 9, 33, 69)
    q = torch.randn(len(pads), heads, total, d, generator=g)
    k, v = (torch.randn(len(pads), kv_heads, total, d, generator=g) for _ in range(2))
    keep = torch.stack([torch.arange(total) >= p for p in pads])
    causal = keep[:, None, None, :] & torch.ones(total, total, dtype=torch.bool).tril()
    segment = torch.cat([torch.zeros(20), torch.ones(18), torch.full((total - 38,), 2)])
    shared = torch.ones(total, total, dtype=torch.bool).tril() & (
        (segment[:, None] == segment[None, :]) | (segment[None, :] == 0))
    masks = {"causal, left padding": causal, "shared prompt": shared[None, None].expand(len(pads), 1, total, total),
             "decode step": causal[:, :, -1:]}
    real_pairs = bi._pairs

    def every_pair(place, j, m):  # the reference: every key block for every query block
        need = place.need
        place.need = torch.full_like(need, place.bias.shape[2])
        try:
            place.pairs.clear()
            return real_pairs(place, j, m)
        finally:
            place.need = need
            place.pairs.clear()

    for name, mask in masks.items():
        query = q[:, :, -mask.shape[2]:]
        bi._LAST_LAYOUT = ()
        got, _ = exact_attention(None, query, k, v, mask)
        monkeypatch.setattr(bi, "_pairs", every_pair)
        bi._LAST_LAYOUT = ()
        want, _ = exact_attention(None, query, k, v, mask)
        monkeypatch.setattr(bi, "_pairs", real_pairs)
        assert torch.equal(got, want), name
        # bitwise, sign of zero included
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
        no_key = ~mask[:, 0].any(-1)  # (b, tq): padding queries
        assert no_key.any() or name != "causal, left padding"
        assert torch.equal(got[no_key], torch.zeros_like(got[no_key])), name
