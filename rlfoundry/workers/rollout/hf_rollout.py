"""Hugging Face rollout engine: our own KV-cached sampling loop over the actor's module.

Why not ``model.generate``: RL rollouts want per-token log-probs of what was sampled, n samples
per prompt from one prefill, and finished sequences dropped from the batch instead of being decoded
as padding until the longest one ends. A 60-line loop does exactly that and nothing else.

The engine holds no copy of the weights: it calls the (possibly FSDP2-sharded) module the actor
trains, so ``sync_weights`` is a no-op (but for a plain module under autocast, one rank in bf16 over
fp32 weights: it decodes from a bf16 copy that ``sync_weights`` refreshes). Under FSDP2 the
parameters are gathered once per call (``engines/fsdp/utils.unsharded``) rather than once per token.
With the CPU kernels on (``model.cpu_kernels``), FSDP's per-forward hooks are also skipped while
decoding and Llama-family models take a lean one-token step (``cpu/fused_decode.py``); both are
tested against this plain path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from rlfoundry.cpu.fused_decode import FusedDecoder, unsupported_reason
from rlfoundry.models.batch_invariant import exact_log_probs, is_exact
from rlfoundry.models.hf import kv_cache_kwargs
from rlfoundry.models.routing_replay import RolloutRouting
from rlfoundry.models.vision import continued_positions, mask_placeholders, model_multimodal_kwargs, model_position_ids, placeholder_ids
from rlfoundry.protocol import DataProto
from rlfoundry.utils.padding import common_left_padding
from rlfoundry.engines.fsdp.utils import (
    decode_copy,
    inference_unsharded,
    plain_autocast_dtype,
    refresh_decode_copy,
    unsharded,
)
from rlfoundry.workers.rollout.sampling import filter_logits, response_mask_from_lengths
from rlfoundry.workers.rollout.sampling import sample_from_cdf as _sample_from_cdf
from rlfoundry.workers.rollout.token_requests import as_id_list
from rlfoundry.workers.rollout.static_decode import (
    KeyedDraws,
    StaticDecoder,
    bucket_for,
    draw_uniforms,
    static_unsupported_reason,
)
from rlfoundry.workers.rollout.base import (
    KEYED_CALL,
    BaseRollout,
    SamplingParams,
    mixed_seed,
    resolve_sampling_params,
    rollout_config,
)

__all__ = ["HFRollout", "compute_device", "exact_sample_tokens", "sample_tokens", "filter_logits", "response_mask_from_lengths"]

# Finished rows are dropped from the KV cache once they are at least this fraction of the rows
# still in it: dropping copies the whole cache, so on a GPU doing it for every single finished
# row would cost more than decoding a few dead rows for a few steps.
_COMPACT_FRACTION = 0.125


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its log-prob. logits (N, V) -> tokens (N,), log-probs (N,) fp32.
    ``uniforms`` (N, 1): each row's draw (``static_decode.draw_uniforms``); None draws N here.

    The reported log-prob is under softmax(logits / T), *before* top-k/top-p filtering: that is the
    distribution the actor's ``compute_log_prob`` scores (it applies the same temperature and no
    filtering), so the two agree exactly when top_p=1 and top_k is off. With filtering on, the
    true sampling probability is renormalised over the kept set and differs from this value.
    ``params`` is one token's (``SamplingParams.for_token``): FIRE's first token reports its log-prob
    under softmax(logits / 30), the temperature it was drawn at.
    """
    scaled = logits.float()
    if params.logprob_temperature != 1.0:
        scaled = scaled / params.logprob_temperature
    filtered = None if params.greedy else filter_logits(scaled, params.top_k, params.top_p)
    if filtered is None:
        tokens, lse = scaled.argmax(dim=-1), torch.logsumexp(scaled, dim=-1)
    elif filtered is not scaled:
        tokens = _sample_from_cdf(torch.softmax(filtered, dim=-1).cumsum(dim=-1), generator, uniforms)
        lse = torch.logsumexp(scaled, dim=-1)
    else:
        # unfiltered (the RL default): one exponential pass gives both the CDF to sample from and
        # the log-normaliser, logsumexp = max + log(total mass); a decode step is short enough
        # that the kernels saved show
        shift = scaled.amax(dim=-1, keepdim=True)
        cdf = (scaled - shift).exp_().cumsum_(dim=-1)
        tokens = _sample_from_cdf(cdf, generator, uniforms)
        lse = (shift + cdf[:, -1:].log()).squeeze(-1)
    return tokens, scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse


def exact_sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens`` in exact mode: the same draw, and the log-prob reported by ``exact_log_probs``, the
    function the trainer's forward scores the token with (same logits bits in, same reductions)."""
    tokens, _ = sample_tokens(logits, params, generator, uniforms)
    return tokens, exact_log_probs(logits, tokens, params.logprob_temperature)


def compute_device(module: nn.Module) -> torch.device:
    """The device ``module``'s forward runs on: its parameters', except that FSDP2's CPU offload keeps the
    shards (DTensors) in host memory while the forward runs on their mesh's device, the current one of
    its type (as ``fully_shard`` picks it)."""
    param = next(module.parameters(), None)
    if param is None:
        return torch.device("cpu")
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or mesh.device_type == param.device.type:
        return param.device
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def _seed_for_call(seed: int, rank: int, call: int) -> int:
    """A well-mixed 63-bit seed per (config seed, dp rank, call number): resumable from the counter."""
    return mixed_seed(seed, rank, call)


def _preallocated_layer_class():
    """A KV-cache layer with room for the whole rollout allocated once (None if HF's API differs).

    HF's ``DynamicLayer`` concatenates every step, copying the whole cache each time: O(T²)
    memory traffic over a rollout. Here a step writes its column in place and the layer exposes
    views of the filled prefix. Built lazily so an older transformers simply keeps DynamicCache.
    """
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.length = capacity, 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args) -> None:
            super().lazy_initialization(key_states, value_states)
            b, h = key_states.shape[:2]
            self.key_buf = key_states.new_empty(b, h, self.capacity, key_states.shape[-1])
            self.value_buf = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])

        def _refresh_views(self) -> None:
            self.keys = self.key_buf[:, :, : self.length]
            self.values = self.value_buf[:, :, : self.length]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self.key_buf[:, :, self.length : end] = key_states
            self.value_buf[:, :, self.length : end] = value_states
            self.length = end
            self._refresh_views()
            return self.keys, self.values

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buf = self.key_buf.repeat_interleave(repeats, dim=0)
                self.value_buf = self.value_buf.repeat_interleave(repeats, dim=0)
                self._refresh_views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.key_buf, self.value_buf = self.key_buf[indices], self.value_buf[indices]
                self._refresh_views()

    return PreallocatedLayer


_PreallocatedLayer = _preallocated_layer_class()


def _new_kv_cache(config: Any, capacity: int):
    """HF's DynamicCache, with its full-attention layers preallocated to ``capacity`` positions."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if _PreallocatedLayer is not None and layers and all(type(l).__name__ == "DynamicLayer" for l in layers):
        cache.layers = [_PreallocatedLayer(capacity) for _ in layers]
    return cache


class _DecodeState:
    """The rows still in the KV cache: their output row, mask, next position, liveness, and what
    they sampled so far.

    Tokens and log-probs are written per cache row, one column a step, and copied to their output
    rows once, when a row leaves the cache (``compact_if_worth_it``) or at the end (``flush``): a
    step writes two columns instead of scattering the live rows into the outputs. The attention
    mask is allocated once at its final width (prompt + response, ones after the prompt); each step
    reads a growing prefix of it instead of concatenating a column.
    """

    def __init__(self, cache, full_mask: torch.Tensor, width: int, next_pos: torch.Tensor, response_length: int):
        n, device = full_mask.shape[0], full_mask.device
        self.cache = cache
        self.rows = torch.arange(n, device=device)  # output row of each cache row
        self.full_mask, self.width = full_mask, width
        self.next_pos = next_pos
        self.alive = torch.ones(n, dtype=torch.bool, device=device)
        # columns past a row's length are never read (``flush`` callers mask them)
        self.tokens = torch.empty((n, response_length), dtype=torch.long, device=device)
        self.log_probs = torch.empty((n, response_length), dtype=torch.float32, device=device)
        self.lengths = torch.full((n,), response_length, dtype=torch.long, device=device)

    def advance(self) -> torch.Tensor:
        """The mask for the next one-token step (cache length + 1)."""
        self.width += 1
        return self.full_mask[:, : self.width]

    def record(self, t: int, tokens: torch.Tensor, token_lp: torch.Tensor, eos: torch.Tensor) -> int:
        """Store step ``t``'s samples; live rows that sampled an EOS id end with length t + 1.
        Returns how many rows are still live."""
        self.tokens[:, t] = tokens
        self.log_probs[:, t] = token_lp
        finished = torch.isin(tokens, eos).logical_and_(self.alive)
        self.lengths.masked_fill_(finished, t + 1)
        self.alive.logical_and_(finished.logical_not_())
        return int(self.alive.sum())

    def flush(self, responses: torch.Tensor, log_probs: torch.Tensor, lengths: torch.Tensor,
              which: torch.Tensor | None = None) -> None:
        """Copy the cache rows ``which`` (all when None) to their output rows."""
        if which is None:
            responses[self.rows], log_probs[self.rows], lengths[self.rows] = self.tokens, self.log_probs, self.lengths
            return
        rows = self.rows[which]
        responses[rows], log_probs[rows], lengths[rows] = self.tokens[which], self.log_probs[which], self.lengths[which]

    def compact_if_worth_it(self, tokens: torch.Tensor, live: int, outputs: tuple) -> torch.Tensor:
        """Drop finished rows (flushed to ``outputs`` first) once there are enough of them; returns
        ``tokens`` for the rows kept."""
        dead = len(self.rows) - live
        if dead < max(1, math.ceil(_COMPACT_FRACTION * len(self.rows))):
            return tokens
        self.flush(*outputs, which=~self.alive)
        keep = self.alive.nonzero().squeeze(1)
        self.cache.batch_select_indices(keep)
        self.rows, self.full_mask, self.next_pos = self.rows[keep], self.full_mask[keep], self.next_pos[keep]
        self.alive, self.tokens, self.log_probs = self.alive[keep], self.tokens[keep], self.log_probs[keep]
        self.lengths = self.lengths[keep]
        return tokens[keep]


class HFRollout(BaseRollout):
    """KV-cached batched sampling with a Hugging Face causal LM (the actor's own module).

    Args:
        module: the causal LM (plain or FSDP2-wrapped) the actor trains. A plain one its engine runs
            under autocast (bf16 over fp32 weights on one rank: ``engines/fsdp/engine.py``) is decoded
            from a bf16 copy (``actor_module`` keeps the original), refreshed by ``sync_weights(None)``
            (``on_actor_update``), as FSDP2 would decode from its gathered bf16 parameters.
        config: the ``actor_rollout_ref.rollout`` subtree: a ``RolloutConfig``, or a DictConfig/dict
            that ``to_typed`` fills with the schema's defaults (this engine reads n, temperature,
            top_p, top_k, do_sample, response_length, val_kwargs, seed, ignore_eos).
        pad_token_id / eos_token_id: from the tokenizer / generation config; ``meta_info`` may
            override both per call (verl's trainer sends them).
        rank: data-parallel rank, mixed into the sampling seed so ranks draw independently.
        cpu_kernels: the resolved ``model.cpu_kernels`` switch (on only on the CPU): the fused decode
            step and FSDP hook skipping; off is the plain HF forward.
        static_decode: decode with static shapes (``static_decode.py``: static KV cache, bucketed
            batch, no per-token host sync). None: wherever ``rollout.use_torch_compile`` compiles it
            (its default, null, means on CUDA only); the CPU keeps the dynamic loop below.
        mtp_draft_path: speculative decoding with the MTP layers of the MiMo checkpoint there as the draft
            (``model.mtp.enable_rollout``; ``mtp_speculative.py``), ``speculative_tokens`` drafted a round
            (``mtp.num_speculative_tokens``); it always takes the dynamic cache (never the static decode).
            ``mtp_draft_synced``: the weight syncs carry the MTP tensors too (a trainer that trains them);
            otherwise the draft keeps the checkpoint's.

    Prompts may arrive on any device: the engine works on its module's (``device``), and its output is there.
    """

    keyed_draws = True  # each row's uniforms from its own stream with sample_keys (KeyedDraws)
    serves_top_logprobs = True  # meta_info["top_logprobs"] = k: each step's k most likely tokens (the OpenAI endpoint)

    def __init__(
        self,
        module: nn.Module,
        config: Any,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        rank: int = 0,
        cpu_kernels: bool = False,
        static_decode: bool | None = None,
        mtp_draft_path: Any = None,
        speculative_tokens: int = 0,
        mtp_draft_synced: bool = False,
    ):
        self.actor_module: nn.Module | None = None
        dtype = plain_autocast_dtype(module)
        if dtype is not None:
            self.actor_module, module = module, decode_copy(module, dtype)
        self.module = module
        # exact mode (models/batch_invariant.py): the fused decode step would replace the exact ops, and the
        # reported log-probs come from the trainer's own function
        self.exact = is_exact(module)
        self.cpu_kernels = cpu_kernels and not self.exact
        self._sample = exact_sample_tokens if self.exact else sample_tokens
        self.static_decode = static_decode
        self._static: StaticDecoder | None = None
        self.config = rollout_config(config)
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = as_id_list(eos_token_id)
        self.rank = rank
        self.seed = self.config.seed
        self.calls = 0  # generate_sequences calls so far; with the seed it fixes the next draws
        self.placeholder_ids = placeholder_ids(module)  # a vision-language policy never samples them
        self.speculator, self.mtp_draft_synced = None, bool(mtp_draft_synced)
        if mtp_draft_path is not None:
            self.speculator = self._speculator(mtp_draft_path, speculative_tokens)

    def _speculator(self, path: Any, k: int):
        """The MTP draft (``models/mimo.py``) and its decode loop; what it cannot be combined with refused."""
        from rlfoundry.models.mimo import load_mtp_draft
        from rlfoundry.workers.rollout.mtp_speculative import MtpSpeculator

        if self.exact:
            raise ValueError("MTP speculative decoding with rollout.exact_log_probs is not built (the verify forward "
                             "scores k+1 tokens at once, not the exact mode's one-token shapes)")
        if self.config.enable_rollout_routing_replay:
            raise ValueError("MTP speculative decoding with rollout.enable_rollout_routing_replay is not built")
        dtype = self.module.get_input_embeddings().weight.dtype
        return MtpSpeculator(self.module, load_mtp_draft(path, self.module.config, dtype, self.device), k, _new_kv_cache)

    @property
    def device(self) -> torch.device:
        """Where the module computes: every tensor of a call is made here (read per call: a module may move)."""
        return compute_device(self.module)

    # ---- weights --------------------------------------------------------------------------

    def sync_weights(self, named_tensors: Any = None) -> None:
        """None: the module is the actor's own (nothing to do, or its decode copy refreshed). Else (HF
        name, full tensor) pairs, e.g. a Megatron actor's export, copied into the module one at a time."""
        if named_tensors is None:
            if self.actor_module is not None:
                refresh_decode_copy(self.module, self.actor_module)
            return
        params = dict(self._named_weights())
        missing = set(params)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"sync_weights: the rollout model has no parameter {name!r}")
                params[name].copy_(tensor)
                missing.discard(name)
        if missing:
            raise KeyError(f"sync_weights: no new value for {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")

    def _named_weights(self):
        """The tensors a sync fills: the module's, and the MTP draft's (MiMo's names) when syncs carry them."""
        yield from self.module.named_parameters()
        if self.speculator is not None and self.mtp_draft_synced:
            draft = self.speculator.draft
            yield from ((draft.hf_name(n), p) for n, p in draft.named_parameters())

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        return {name: p.dtype for name, p in self._named_weights()}

    def weight_digests(self) -> dict[str, int]:
        """Of the module's own tensors: a copy the syncs fill (a sharded module is the actor's, never stale)."""
        from rlfoundry.workers.weight_sync import weight_digests

        return weight_digests(self._named_weights())

    # ---- checkpointable state ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed, self.calls = int(state["seed"]), int(state["calls"])

    def _draws(self, meta: Mapping[str, Any], rows: int, params: "SamplingParams", device: torch.device):
        """The call's source of uniforms: the next call's generator, or with ``meta_info["sample_keys"]``
        (one int per prompt row) each output row's own stream (``KeyedDraws``), the counter left alone
        (None for a greedy keyed call: nothing is drawn)."""
        keys = meta.get("sample_keys")
        if keys is None:
            return self._next_generator(device)
        if len(keys) != rows:
            raise ValueError(f"sample_keys has {len(keys)} keys for {rows} prompt rows")
        if params.greedy:
            return None
        seeds = [mixed_seed(self.seed, self.rank, KEYED_CALL, int(k), j) for k in keys for j in range(params.n)]
        per_token = 1
        if self.speculator is not None:
            from rlfoundry.workers.rollout.mtp_speculative import draws_per_token

            per_token = draws_per_token(self.speculator.k)
        return KeyedDraws(seeds, params.response_length * per_token, device)

    def _next_generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(_seed_for_call(self.seed, self.rank, self.calls))
        self.calls += 1
        return gen

    # ---- public entry point --------------------------------------------------------------

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``n`` responses per prompt.

        Input: one row per prompt; ``input_ids``, ``attention_mask``, ``position_ids`` (B, Tp),
        left-padded; any non-tensor columns (``uid`` …). ``meta_info`` may set ``n``,
        ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``response_length``,
        ``eos_token_id``, ``pad_token_id``, and ``validate=True`` (use ``rollout.val_kwargs``).

        Output: B·n rows, prompt i's samples at rows i·n … i·n+n-1, non-tensor columns repeated
        the same way, ``meta_info`` passed through, and tensors
        ``prompts`` (B·n, Tp); ``responses`` (B·n, Tr) right-padded with the pad id, Tr =
        response_length exactly; ``input_ids``/``attention_mask``/``position_ids`` (B·n, Tp+Tr);
        ``response_mask`` (B·n, Tr) 1 up to and including EOS; ``rollout_log_probs`` (B·n, Tr)
        log-probs of the sampled tokens under softmax(logits / T) (0 after EOS; with
        ``rollout.use_fire_sampling`` the first token's T is FIRE's 30). With ``top_logprobs=k`` > 0 also
        ``rollout_top_ids`` / ``rollout_top_logprobs`` (B·n, Tr, k): each step's k most likely tokens and
        their log-probs under the same distribution (decoded on the dynamic path; 0 after EOS).
        With ``rollout.enable_rollout_routing_replay`` (an MoE policy) also ``routed_experts``
        (B·n, Tp+Tr, layers, top_k): the experts each prompt and response token was routed to,
        ``routing_replay.NO_EXPERT`` (-1) at padding and at each response's last token (never fed back).
        With the MTP draft (``mtp_draft_path``) also ``mtp_draft_tokens`` / ``mtp_accepted_tokens`` (B·n,): the
        tokens the draft proposed for the row and how many of them the target accepted.
        """
        params = resolve_sampling_params(self.config, prompts.meta_info)
        pad_id = int(prompts.meta_info.get("pad_token_id", self.pad_token_id))
        eos_ids = as_id_list(prompts.meta_info.get("eos_token_id")) or self.eos_token_ids
        if self.config.ignore_eos:
            eos_ids = []  # benchmarking mode (verl/vLLM ``ignore_eos``): always response_length tokens
        device = self.device  # not the prompts': an agent loop's server or a judge builds them on the host
        prompts = DataProto(batch=prompts.batch.to(device), non_tensor_batch=prompts.non_tensor_batch,
                            meta_info=prompts.meta_info)
        batch = prompts.batch
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        position_ids = batch["position_ids"] if "position_ids" in batch.keys() else None
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        # image rows (docs/vision.md): pixel inputs go into the prefill; positions are (B, 3, Tp)
        pixels = model_multimodal_kwargs(prompts.non_tensor_batch.get("multi_modal_inputs"), device)
        generator = self._draws(prompts.meta_info, input_ids.shape[0], params, device)
        lead = common_left_padding(attention_mask)  # the prefill skips them; the output keeps them
        k = int(prompts.meta_info.get("top_logprobs") or 0)
        total, width = input_ids.shape[0] * params.n, params.response_length
        tops = None if k <= 0 else (torch.zeros((total, width, k), dtype=torch.long, device=device),
                                    torch.zeros((total, width, k), dtype=torch.float32, device=device))
        routing = self._routing(total, input_ids.shape[1], params, lead, position_ids.dim() == 2 and tops is None)
        counts = None
        try:
            with torch.no_grad(), _eval_mode(self.module), self._gathered(self.module):
                if self.speculator is not None:
                    if pixels:
                        raise ValueError("MTP speculative decoding takes text prompts only")
                    responses, log_probs, lengths, *counts = self.speculator.decode(
                        self, input_ids[:, lead:], attention_mask[:, lead:], position_ids[..., lead:], params, generator,
                        pad_id, eos_ids, tops)
                else:
                    responses, log_probs, lengths = self._decode(
                        input_ids[:, lead:], attention_mask[:, lead:], position_ids[..., lead:], params, generator,
                        pad_id, eos_ids, pixels, tops, routing,
                    )
        finally:
            if routing is not None:
                routing.abandon()
        out = self._assemble(prompts, params, responses, log_probs, lengths, position_ids)
        if counts:  # per row: tokens the MTP draft proposed, and how many the target accepted
            out.batch["mtp_draft_tokens"], out.batch["mtp_accepted_tokens"] = counts
        if routing is not None:
            out.batch["routed_experts"] = routing.finish(lengths)
        if tops is not None:
            valid = response_mask_from_lengths(lengths, width).bool().unsqueeze(-1)
            out.batch["rollout_top_ids"] = tops[0].masked_fill_(~valid, 0)
            out.batch["rollout_top_logprobs"] = tops[1].masked_fill_(~valid, 0.0)
        return out

    # ---- the decode loop -----------------------------------------------------------------

    def _routing(self, rows: int, prompt_width: int, params, lead: int, static_possible: bool) -> RolloutRouting | None:
        """The recorder of the call's MoE routing (``enable_rollout_routing_replay``), else None. A static
        decode's padding slots get rows of their own in it (``static_decode``: no step asks which are real)."""
        if not self.config.enable_rollout_routing_replay:
            return None
        static = static_possible and self._static_decoder(self.device) is not None
        return RolloutRouting(self.module, rows, prompt_width, params.response_length, self.device, lead,
                              slots=bucket_for(rows) if static else 0)

    def _gathered(self, module: nn.Module):
        """Parameters gathered for the whole call; FSDP's per-forward hooks skipped with the CPU
        kernels and on the static path (a captured graph must not run Python hooks)."""
        static = self._static_decoder(compute_device(module)) is not None
        return inference_unsharded(module) if self.cpu_kernels or static else unsharded(module)

    def _static_decoder(self, device: torch.device) -> StaticDecoder | None:
        """The static-shape decoder where this call uses one (``static_decode`` in the class doc)."""
        compile_on = self.config.use_torch_compile
        compile_on = device.type == "cuda" if compile_on is None else compile_on
        wanted = compile_on if self.static_decode is None else self.static_decode
        compile_on = compile_on and not self.exact  # inductor would fuse and reorder the exact ops' sums
        if not wanted or static_unsupported_reason(self.module) is not None:
            return None
        if self._static is None:
            self._static = StaticDecoder(self.module, compile=compile_on,
                                         mode="reduce-overhead" if device.type == "cuda" else None)
        return self._static

    def _decode_static(self, input_ids, attention_mask, position_ids, params, generator, pad_id, eos_ids, static,
                       routing=None):
        """``_decode`` with static shapes (``static_decode.py``): the same prefill, then ``static.decode``."""
        logits, state = self._prefill(input_ids, attention_mask, position_ids, params.n, 0, routing=routing)
        eos = torch.tensor(eos_ids or [-1], device=input_ids.device)
        prefilled, state.cache = state.cache, None  # copied into the static cache, then freed
        responses, log_probs, lengths = static.decode(logits, prefilled, state.full_mask, state.next_pos, params,
                                                      generator, pad_id, eos, self._sample,
                                                      on_step=routing.step if routing is not None else None)
        valid = response_mask_from_lengths(lengths, params.response_length).bool()
        return responses.masked_fill_(~valid, pad_id), log_probs.masked_fill_(~valid, 0.0), lengths

    def _forward(self, input_ids, attention_mask, position_ids, cache, **pixels) -> torch.Tensor:
        """One model call; returns only the last position's logits (N, V)."""
        out = self.module(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=model_position_ids(position_ids),
            **kv_cache_kwargs(self.module, cache),
            use_cache=True,
            logits_to_keep=1,  # never materialise (N, T, V) logits for the prompt
            **pixels,
        )
        return mask_placeholders(out.logits[:, -1, :], self.placeholder_ids)

    def _prefill(self, input_ids, attention_mask, position_ids, n: int, response_length: int, pixels=None,
                 routing: RolloutRouting | None = None):
        """Run each prompt once (with its images' pixel inputs), then repeat its cache and logits for its n samples."""
        cache = _new_kv_cache(getattr(self.module, "config", None), input_ids.shape[1] + response_length)
        logits = self._forward(input_ids, attention_mask, position_ids, cache, **(pixels or {}))
        if routing is not None:
            routing.prefill(attention_mask, n)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
        mask = attention_mask.repeat_interleave(n, dim=0)
        full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], response_length)], dim=1)
        next_pos = position_ids[..., -1].repeat_interleave(n, dim=0) + 1  # (N,) or (N, 3)
        return logits, _DecodeState(cache, full_mask, mask.shape[1], next_pos, response_length)

    def _decode_step(self, state: _DecodeState, max_positions: int):
        """The one-token step: ``FusedDecoder`` where it reproduces the model, else the HF forward."""
        preallocated = all(hasattr(layer, "key_buf") for layer in getattr(state.cache, "layers", []) or [None])
        if self.cpu_kernels and preallocated and state.next_pos.dim() == 1 and \
                unsupported_reason(self.module, state.full_mask.shape[1]) is None:
            return FusedDecoder(self.module, max_positions).step
        return lambda tokens, pos, mask, cache: self._forward(tokens.unsqueeze(1), mask, pos.unsqueeze(-1), cache)

    def _decode(self, input_ids, attention_mask, position_ids, params: SamplingParams, generator, pad_id, eos_ids,
                pixels: dict | None = None, tops: tuple[torch.Tensor, torch.Tensor] | None = None,
                routing: RolloutRouting | None = None):
        """Sample until every row hit EOS or ``response_length``; finished rows leave the batch. ``tops``:
        (N, width, k) ids and log-probs to fill with each step's k most likely tokens (dynamic path only).
        ``routing``: records the MoE routing of every forward (prefill and each step)."""
        total, width, device = input_ids.shape[0] * params.n, params.response_length, input_ids.device
        static = self._static_decoder(device) if position_ids.dim() == 2 and tops is None else None
        if static is not None:
            return self._decode_static(input_ids, attention_mask, position_ids, params, generator, pad_id, eos_ids,
                                       static, routing)
        # every output row is written once, by ``flush``; positions after a row's EOS are masked below
        responses = torch.empty((total, width), dtype=torch.long, device=device)
        log_probs = torch.empty((total, width), dtype=torch.float32, device=device)
        lengths = torch.empty((total,), dtype=torch.long, device=device)
        outputs = (responses, log_probs, lengths)
        eos = torch.tensor(eos_ids or [-1], device=device)
        logits, state = self._prefill(input_ids, attention_mask, position_ids, params.n, width, pixels, routing)
        step = self._decode_step(state, int(position_ids.max()) + width + 1)
        for t in range(width):
            uniforms = None if params.greedy else draw_uniforms(generator, total, state.rows)
            tokens, token_lp = self._sample(logits, params.for_token(t), generator, uniforms)
            if tops is not None:  # under the distribution the log-probs are reported in (sample_tokens)
                scaled = logits.float() / params.for_token(t).logprob_temperature
                values, ids = torch.log_softmax(scaled, dim=-1).topk(tops[0].shape[-1], dim=-1)
                tops[0][state.rows, t], tops[1][state.rows, t] = ids, values
            live = state.record(t, tokens, token_lp, eos)
            if t == width - 1 or live == 0:
                break
            tokens = state.compact_if_worth_it(tokens, live, outputs)
            tokens = torch.where(state.alive, tokens, pad_id)  # finished rows still in the cache
            logits = step(tokens, state.next_pos, state.advance(), state.cache)
            if routing is not None:
                routing.step(state.rows, t)
            state.next_pos = state.next_pos + 1
        state.flush(*outputs)
        valid = response_mask_from_lengths(lengths, width).bool()
        return responses.masked_fill_(~valid, pad_id), log_probs.masked_fill_(~valid, 0.0), lengths

    # ---- output --------------------------------------------------------------------------

    def _assemble(self, prompts: DataProto, params, responses, log_probs, lengths, position_ids) -> DataProto:
        n, width = params.n, params.response_length
        prompt_ids = prompts.batch["input_ids"].repeat_interleave(n, dim=0)
        prompt_mask = prompts.batch["attention_mask"].repeat_interleave(n, dim=0)
        prompt_pos = position_ids.repeat_interleave(n, dim=0)
        response_mask = response_mask_from_lengths(lengths, width)
        tensors = {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1),
            "position_ids": continued_positions(prompt_pos, width),
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
        }
        non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(prompts.meta_info))


class _eval_mode:
    """Put a module in eval mode for the block (no dropout while sampling) and restore it after."""

    def __init__(self, module: nn.Module):
        self.module, self.was_training = module, module.training

    def __enter__(self):
        self.module.eval()
        return self.module

    def __exit__(self, *exc):
        self.module.train(self.was_training)
        return False
