"""Static-shape decoding for the HF rollout: a preallocated KV cache, bucketed batch sizes, sampling
and stop detection on the device, for CUDA graphs (``torch.compile(mode="reduce-overhead")``).

Why: on a GPU a one-token step of a small model is bound by kernel launches and Python, not by the
weights it reads (issue 34: 27 ms a step eager, 4.5 ms with transformers' compiled static cache on
an H100). A CUDA graph replays the whole step in one launch, but only if every tensor the step reads
or writes keeps its shape and address from one step to the next. So, unlike ``hf_rollout``'s
dynamic loop (which drops finished rows from its cache and asks the host how many rows are live
after every token):

- the KV cache is transformers' ``StaticCache``, allocated once per (bucket, cache length) and kept
  for the next call (a compiled graph is captured once per run, not per step); the prefill runs in one
  HF call as before and its keys/values are copied in;
- the batch is padded to a bucket (a power of two); finished rows stay in their slot, fed the pad
  token, until the live rows fit a smaller bucket, where they are packed (the step then runs the
  smaller graph); on a GPU a dead row in a decode step costs next to nothing (the step reads the
  weights once whatever the rows);
- sampling, EOS detection and the bookkeeping of lengths run as tensor ops; the host reads the live
  count once every ``sync_every`` steps (to stop early and to shrink the bucket), never per token;
- each row's uniform for inverse-CDF sampling is drawn for its *output row* (``draw_uniforms``),
  whatever slot it sits in, so seeded sampling gives the tokens of the dynamic loop exactly.

The same code runs on the CPU without compilation: the tests prove it equal to the dynamic loop
(tokens, log-probs, lengths) for greedy and seeded sampling, stop tokens, rows ending at different
steps and several buckets, and that the step traces as one graph (``fullgraph=True``).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import torch
from torch import nn

from rlfoundry.models.hf import kv_cache_kwargs

__all__ = ["KeyedDraws", "StaticDecoder", "bucket_for", "draw_uniforms", "static_unsupported_reason", "SYNC_EVERY"]

# Steps between the host's reads of the live-row count: the only host syncs of a decode. Larger
# means fewer syncs but up to this many steps decoded after the last row finished.
SYNC_EVERY = 16
# Cache lengths are rounded up to this, so prompts a few tokens longer or shorter reuse a graph.
_CACHE_LEN_MULTIPLE = 64


def _graph_trees_on_this_thread() -> None:
    """Give the calling thread CUDA graph trees' per-thread state when it has none.

    inductor sets that state up only on the thread that imports ``cudagraph_trees`` (and copies it
    into the threads autograd starts); a compiled step replayed from any other thread fails the
    assertion in ``cudagraph_trees.get_obj`` (pytorch issue 123177) — on the H100 the agent loop's
    engine thread, the fully asynchronous rollouter and pytest-xdist's test thread did (issue 33).
    ``get_obj`` looks at the module's ``threading.local`` first, in every torch this project
    supports, so the thread gets a container and lock table of its own there (graphs of its own),
    also stashed where autograd's threads started from it look."""
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


def bucket_for(rows: int) -> int:
    """The smallest power of two >= rows: the batch sizes a graph is captured for."""
    return 1 << max(0, (rows - 1).bit_length())


class KeyedDraws:
    """Each output row's uniforms from a stream of its own, seeded by the row's key, one per decode step:
    a row's samples then depend on its key alone, not on which call or batch slot it was sampled in (an
    agent loop's server batches requests as they arrive; ``server.py``). ``seeds``: one 63-bit seed per
    output row; ``steps``: the call's response length."""

    def __init__(self, seeds: list[int], steps: int, device: torch.device):
        table = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in seeds])
        self.table, self.step = table.to(device), 0

    def next(self, rows: torch.Tensor) -> torch.Tensor:
        """The next step's uniforms (N, 1) for the batch's rows (``rows``: output row of each batch row)."""
        u = self.table[:, self.step: self.step + 1]
        self.step += 1
        return u[rows.clamp(max=u.shape[0] - 1)]


def draw_uniforms(generator: "torch.Generator | KeyedDraws | None", total: int, rows: torch.Tensor) -> torch.Tensor:
    """One uniform per output row (``total`` of them, a fixed number per step), picked for the rows the
    batch holds now (``rows``: output row of each batch row; values >= total are padding slots).

    Drawing per output row rather than per batch row makes the samples independent of how the
    batch is laid out (which rows were dropped, packed or padded): the dynamic and static loops
    draw the same numbers for the same row. ``KeyedDraws``: each row's next uniform from its own stream."""
    if isinstance(generator, KeyedDraws):
        return generator.next(rows)
    u = torch.rand((total, 1), generator=generator, device=rows.device)
    return u[rows.clamp(max=total - 1)]


def static_unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot decode with a static cache exactly as with the dynamic one (or None)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = getattr(base, "config", None)
    if config is None:
        return "the module has no Hugging Face config"
    if not getattr(base, "_can_compile_fullgraph", False):
        return f"{type(base).__name__} does not support a compiled static cache (transformers' _can_compile_fullgraph)"
    text = config.get_text_config(decoder=True)
    if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or ["full_attention"])):
        return "sliding-window layers (a static cache rolls their window differently from the dynamic one)"
    return None


class _Slots:
    """The static batch: which output row each slot holds, which are live, and their inputs."""

    def __init__(self, rows: torch.Tensor, alive: torch.Tensor, mask: torch.Tensor, next_pos: torch.Tensor):
        self.rows, self.alive, self.mask, self.next_pos = rows, alive, mask, next_pos

    def take(self, keep: torch.Tensor, size: int, total: int) -> "_Slots":
        """Slots ``keep`` packed first into a batch of ``size`` (the rest padding slots)."""
        pad = size - keep.numel()
        rows = torch.cat([self.rows[keep], torch.arange(pad, device=keep.device) + total])
        alive = torch.cat([self.alive[keep], self.alive.new_zeros(pad)])
        mask = torch.cat([self.mask[keep], self.mask.new_zeros(pad, self.mask.shape[1])])
        next_pos = torch.cat([self.next_pos[keep], self.next_pos.new_zeros(pad)])
        return _Slots(rows, alive, mask, next_pos)


class StaticDecoder:
    """Decodes a prefilled batch with static shapes (see the module docstring).

    Args:
        module: the causal LM (gathered: the caller holds its parameters unsharded).
        compile: wrap the step in ``torch.compile`` (``mode`` on CUDA: ``reduce-overhead``, CUDA graphs).
        sync_every: steps between the host's reads of the live count.
    """

    def __init__(self, module: nn.Module, compile: bool = False, sync_every: int = SYNC_EVERY,
                 mode: str | None = "reduce-overhead"):
        self.module = module
        self.sync_every = max(1, sync_every)
        self.host_reads = 0  # live-count reads so far (the decode's host syncs), for tests and reports
        self._caches: dict[tuple, Any] = {}
        self._cache_keyword = next(iter(kv_cache_kwargs(module, None)))  # looked up here, not in a traced step
        self._step: Callable = self._forward
        self._graphs = compile and mode == "reduce-overhead"
        if compile:
            # one graph per (bucket, cache length): more than dynamo's default 8 recompiles of a function
            limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
            self._step = torch.compile(self._forward, mode=mode, dynamic=False)

    def _forward(self, tokens: torch.Tensor, position: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.module(input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=position.unsqueeze(1),
                          **{self._cache_keyword: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    # ---- the cache ------------------------------------------------------------------------

    def _cache(self, size: int, length: int, like: torch.Tensor, values_like: torch.Tensor):
        """The static cache for ``size`` rows and ``length`` positions (allocated once, then reused)."""
        from transformers import StaticCache

        key = (size, length, like.dtype, like.device, like.shape[1], like.shape[-1], values_like.shape[-1])
        cache = self._caches.get(key)
        if cache is None:
            cache = StaticCache(config=self.module.config, max_cache_len=length)
            for layer in cache.layers:
                layer.lazy_initialization(like.new_zeros(size, like.shape[1], 1, like.shape[-1]),
                                          values_like.new_zeros(size, values_like.shape[1], 1, values_like.shape[-1]))
            self._caches[key] = cache
        return cache

    def _load(self, prefilled: Any, size: int, length: int, filled: int):
        """A static cache of ``size`` rows holding the prefill's keys/values (its rows first)."""
        layers = prefilled.layers
        cache = self._cache(size, length, layers[0].keys, layers[0].values)
        for src, dst in zip(layers, cache.layers):
            rows = src.keys.shape[0]
            dst.keys[:rows, :, :filled].copy_(src.keys[:, :, :filled])
            dst.values[:rows, :, :filled].copy_(src.values[:, :, :filled])
            dst.cumulative_length.fill_(filled)
        return cache

    def _repack(self, cache: Any, keep: torch.Tensor, size: int, filled: int):
        """The live rows' keys/values moved into the cache of the smaller bucket ``size``."""
        small = self._cache(size, cache.layers[0].max_cache_len, cache.layers[0].keys, cache.layers[0].values)
        for src, dst in zip(cache.layers, small.layers):
            dst.keys[: keep.numel(), :, :filled].copy_(src.keys[keep, :, :filled])
            dst.values[: keep.numel(), :, :filled].copy_(src.values[keep, :, :filled])
            dst.cumulative_length.fill_(filled)
        return small

    # ---- the loop -------------------------------------------------------------------------

    def decode(self, logits: torch.Tensor, prefilled: Any, mask: torch.Tensor, next_pos: torch.Tensor, params: Any,
               generator: torch.Generator | None, pad_id: int, eos: torch.Tensor,
               sample: Callable, on_step: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample until every row ended or ``params.response_length`` tokens.

        ``logits`` (N, V): the prefill's last position per row; ``prefilled``: its KV cache (N rows);
        ``mask`` (N, Tp) and ``next_pos`` (N,): the rows' prompt mask and next position. Returns
        responses (N, Tr) (unmasked past each row's end), log-probs (N, Tr), lengths (N,) —
        ``hf_rollout`` masks them as it masks its own. ``on_step(rows, t)``: called after the forward of
        response token ``t`` with each slot's output row (padding slots: ``total`` and up), as the
        MoE routing recorder (``routing_replay.RolloutRouting``) reads that forward's routing."""
        total, width, device = logits.shape[0], params.response_length, logits.device
        filled = mask.shape[1]
        length = -(-(filled + width) // _CACHE_LEN_MULTIPLE) * _CACHE_LEN_MULTIPLE
        size = bucket_for(total)
        cache = self._load(prefilled, size, length, filled)
        full = torch.cat([mask, mask.new_ones(total, length - filled)], dim=1)
        slots = _Slots(torch.arange(total, device=device), torch.ones(total, dtype=torch.bool, device=device),
                       full, next_pos).take(torch.arange(total, device=device), size, total)
        logits = torch.cat([logits, logits.new_zeros(size - total, logits.shape[1])])
        # one extra output row per padding slot: they write there and are dropped at the end
        responses = torch.full((total + size, width), pad_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((total + size, width), dtype=torch.float32, device=device)
        lengths = torch.full((total + size,), width, dtype=torch.long, device=device)
        if self._graphs:
            _graph_trees_on_this_thread()
        for t in range(width):
            uniforms = None if params.greedy else draw_uniforms(generator, total, slots.rows)
            tokens, token_lp = sample(logits, params.for_token(t), generator, uniforms)
            responses[:, t].index_copy_(0, slots.rows, tokens)
            log_probs[:, t].index_copy_(0, slots.rows, token_lp)
            finished = torch.isin(tokens, eos).logical_and_(slots.alive)
            lengths.index_copy_(0, slots.rows, torch.where(finished, t + 1, lengths[slots.rows]))
            slots.alive = slots.alive & ~finished
            if t == width - 1:
                break
            if (t + 1) % self.sync_every == 0:
                live = int(slots.alive.sum())  # the host's only read: stop, or shrink the bucket
                self.host_reads += 1
                if live == 0:
                    break
                if bucket_for(live) < size:
                    keep = slots.alive.nonzero().squeeze(1)
                    size = bucket_for(live)
                    cache = self._repack(cache, keep, size, filled + t)
                    slots, tokens = slots.take(keep, size, total), torch.cat([tokens[keep], tokens.new_zeros(size - live)])
            tokens = torch.where(slots.alive, tokens, pad_id)
            if self._graphs:  # a new decode step: the last replay's logits were consumed (CUDA graph trees)
                torch.compiler.cudagraph_mark_step_begin()
            logits = self._step(tokens, slots.next_pos, slots.mask, cache)
            if on_step is not None:  # before the next replay overwrites the step's outputs (CUDA graphs)
                on_step(slots.rows, t)
            slots.next_pos = slots.next_pos + 1
        return responses[:total], log_probs[:total], lengths[:total]
