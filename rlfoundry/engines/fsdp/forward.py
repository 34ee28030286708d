"""Forward passes of the FSDP engine: response log-probs of a causal LM and values of a critic, and
how a batch is cut into micro-batches for them.

Causal-LM log-probs take one of three forwards per micro-batch, all the same math:

- padded: the (b, Tp+Tr) rows as they are;
- packed (``model.use_remove_padding``): real tokens only, laid end to end (``utils/padding.py``);
  under Ulysses sequence parallelism each rank of a group runs a slice of the pack (``ulysses.py``);
- shared prompt (``model.use_shared_prompt``): each distinct prompt (the n samples of a GRPO group)
  runs once and its rows continue from its KV cache; taken per micro-batch only when it computes
  fewer tokens, and agreed across ranks first (ranks on different paths would pair FSDP's
  collectives wrongly).

Only positions that predict a response token go through the LM head (``logits_to_keep``), and each
micro-batch is cut after its own longest response: the columns cut hold padding only, and the
outputs come back zero there, so nothing depends on micro-batching. With ``model.use_fused_kernels``
the head's log-probs and entropies come out of the model call itself, chunk by chunk
(``fused_head.py``); the shared-prompt path's first call (one position per prompt) keeps its logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlfoundry.cpu.tuning import call_cost_tokens
from rlfoundry.engines.base import LogProbs, MicroBatching
from rlfoundry.engines.fsdp import ulysses
from rlfoundry.engines.fsdp.fused_head import COLUMNS, FusedHead
from rlfoundry.models import routing_replay
from rlfoundry.models.batch_invariant import ATTENTION as EXACT_ATTENTION, exact_log_probs, is_exact
from rlfoundry.models.hf import kv_cache_kwargs
from rlfoundry.models.vision import (
    idle_vision_tower,
    mask_placeholders,
    model_multimodal_kwargs,
    model_position_ids,
    placeholder_ids,
)
from rlfoundry.protocol import DataProto
from rlfoundry.utils.padding import (
    common_left_padding,
    forward_logits,
    pack_layout,
    pack_padded_batch,
    packed_causal_mask,
    unpack_to_padded,
)
from rlfoundry.utils.seqlen_balancing import (
    all_reduce_ints,
    length_sorted_micro_batches,
    num_micro_batches_for_budget,
    rearrange_micro_batches,
    restore_order,
)
from rlfoundry.utils.torch_functional import entropy_and_sum_pi_squared, entropy_from_logits, logprobs_from_logits

__all__ = ["CausalLMForward", "MODEL_INPUTS", "MicroPlan", "RowSummary", "model_batch", "restore", "row_summary",
           "value_forward", "plain_micro_batches"]

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
# (B, Tp+Tr, layers, top_k) experts to replay in an MoE forward (models/routing_replay.py), where the batch has them
ROUTED_EXPERTS = "routed_experts"

# The pixel inputs of image rows (verl's name): one dict per row, a non-tensor column of the batch
MULTI_MODAL_INPUTS = "multi_modal_inputs"

# (module, prompt ids, prompt mask, prompt positions, responses, response positions, group of each row)
SharedPromptLogits = Callable[..., torch.Tensor]


class CausalLMForward:
    """Response log-probs (and entropies) of one causal LM, and its micro-batch plan.

    ``shared_prompt_logits``: the one-pass shared-prompt forward chosen when the model was built
    (``cpu/fused_forward.py`` with CPU kernels on), or None for the HF two-call forward.
    ``continued_forward``: the context that runs the HF second call inside the first one's FSDP
    scope (``engines/fsdp/utils.py``), or a plain one. ``sp``: this rank's Ulysses groups
    (``engines/fsdp/ulysses.py``) when the packed forward is split over a sequence-parallel group.
    ``fused_kernels``: verl's ``model.use_fused_kernels`` (``fused_head.py``; the one-pass CPU
    shared-prompt forward, which returns logits, then gives way to the HF two-call one).
    """

    def __init__(self, module: nn.Module, dp_size: int, dp_group: Any, use_remove_padding: bool,
                 use_shared_prompt: bool, shared_prompt_logits: SharedPromptLogits | None = None,
                 continued_forward: Any = None, sp: ulysses.SequenceParallel | None = None,
                 fused_kernels: bool = False):
        self.module = module
        self.sp = sp
        self.dp_size, self.dp_group = dp_size, dp_group
        # what one more forward + backward call costs beyond its tokens, in tokens of this model: where
        # splitting a micro-batch by length would cost more calls than it saves tokens (cpu/tuning.py)
        self.call_cost_tokens = call_cost_tokens(sum(p.numel() for p in module.parameters()))
        self.use_remove_padding = use_remove_padding
        self.use_shared_prompt = use_shared_prompt
        self.shared_prompt_logits = None if fused_kernels else shared_prompt_logits
        self.continued_forward = continued_forward or plain_context
        self.placeholder_ids = placeholder_ids(module)  # a vision-language policy never samples them
        self.fused = FusedHead(module, self.placeholder_ids) if fused_kernels else None
        # exact mode (models/batch_invariant.py): log-probs through the function the rollout reports with
        self.exact = is_exact(module)
        self._spec = LogProbs()  # the running call's (temperature, entropy): the fused head reads them
        # a vision-language model sharded over ranks runs its tower on every micro-batch, where the model
        # would (idle_vision_tower): inside its forward, before the language model, so every rank's
        # gathers and gradient reductions come in one order
        self.idle_tower = bool(self.placeholder_ids) and dist.is_initialized() and dist.get_world_size() > 1
        self._idle_next = False
        if self.idle_tower:
            language = getattr(getattr(module, "model", module), "language_model")
            language.register_forward_pre_hook(self._add_idle_tower, with_kwargs=True)

    def _add_idle_tower(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The language model's pre-forward hook: a text-only micro-batch's embeddings + 0 × the tower's output."""
        if not self._idle_next or kwargs.get("inputs_embeds") is None:
            return None
        self._idle_next = False
        embeds = kwargs["inputs_embeds"]
        return args, {**kwargs, "inputs_embeds": embeds + idle_vision_tower(self.module).to(embeds.dtype)}

    def group_if_dist(self) -> Any:
        return (self.dp_group if self.dp_group is not None else dist.group.WORLD) if self.dp_size > 1 else None

    # ---- one micro-batch ------------------------------------------------------------------

    def __call__(self, micro: Any, spec: LogProbs, entry: "MicroPlan | tuple | None" = None) -> dict[str, torch.Tensor]:
        """``log_probs`` (b, Tr) and, if asked, ``entropy`` (b, Tr); zero wherever the response is padding.
        ``entry``: the micro-batch's plan (``plan_entries``: its trim, known without reading the device, and
        its prompt groups), or just the prompt groups, or None."""
        plan = entry if isinstance(entry, MicroPlan) else MicroPlan(None, entry)
        prompt_groups = plan.prompt_groups
        self._spec = spec
        batch, full_width = trim_response_padding(micro, plan.trim)
        pixels = _pixel_inputs(micro)
        record = spec.routed_experts and ROUTED_EXPERTS not in batch.keys()
        if ROUTED_EXPERTS in batch.keys() or record:
            self._route(batch, bool(pixels), record)
            prompt_groups = None  # a prompt run once per group has no per-row routing to replay or record
        if pixels or self.idle_tower:
            # image rows: the padded forward (rows packed or sharing a prompt would need their pixels cut too);
            # text rows of a sharded vision-language model too: one model call per micro-batch on every rank
            self._idle_next = not pixels
            logits, labels, scatter, select = self._padded_response_logits(batch, pixels)
        elif prompt_groups is not None:
            logits, labels, scatter, select = self._shared_prompt_response_logits(batch, *prompt_groups)
        elif self.use_remove_padding:
            logits, labels, scatter, select = self._packed_response_logits(batch, plan.rows)
        else:
            logits, labels, scatter, select = self._padded_response_logits(batch)
        # token ids (b, Tr, k) to score (LogProbs.log_probs_at), taken at the kept positions as the labels are
        at = None if spec.log_probs_at is None else select(micro[spec.log_probs_at][:, :batch["responses"].shape[-1]])
        padding = _response_padding(micro)
        out = {key: _to_grid(scatter(values), full_width, padding)
               for key, values in self._per_token(logits, labels, spec, at).items()}
        if ROUTED_EXPERTS in batch.keys():  # (b,) routing-change counts of a log-prob pass
            out |= routing_replay.attach(self.module).row_stats()
        if record:
            out[ROUTED_EXPERTS] = _recorded_routing(self.module, batch, micro["input_ids"].shape[-1], full_width)
        return out

    def _route(self, batch: Any, pixels: bool, record: bool) -> None:
        """Record the routing of the forward that follows, or route the micro-batch's tokens to its
        ``routed_experts`` there (and in its recomputation under gradient checkpointing: the state stays
        set until the engine clears it), counting response tokens in ``RoutingReplay.row_stats``."""
        if pixels or self.sp is not None:
            raise NotImplementedError("routing replay (actor.router_replay.mode) with image inputs or Ulysses sequence "
                                      "parallelism is not built; use text rows and ulysses_sequence_parallel_size=1")
        state = routing_replay.attach(self.module)
        if record:
            state.record()
            return
        width = batch["responses"].shape[-1]
        state.replay(batch[ROUTED_EXPERTS], routing_replay.response_token_mask(batch["attention_mask"], width))

    def _per_token(self, logits: torch.Tensor, labels: torch.Tensor, spec: LogProbs,
                   at: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``log_probs`` and what ``spec`` asks besides (``entropy``, ``sum_pi_squared``, top-k) per kept
        position, from a path's output: logits (..., V), or under the fused head its columns
        (``fused_head.COLUMNS``), already computed in the model's forward. ``at`` (..., k): the token ids
        of ``LogProbs.log_probs_at`` at the kept positions."""
        if self.fused is None:
            return self._unfused(logits, labels, spec, at)
        if spec.topk or at is not None:
            raise NotImplementedError("top-k log-probs (distillation loss_mode=forward_kl_topk) need the logits, which "
                                      "the fused head never holds; set actor_rollout_ref.model.use_fused_kernels=false")
        out = dict(zip(COLUMNS, logits.unbind(-1)))
        if not spec.entropy:
            del out["entropy"]
        elif not (spec.entropy_grad and torch.is_grad_enabled()):
            out["entropy"] = out["entropy"].detach()
        return out

    def _unfused(self, logits: torch.Tensor, labels: torch.Tensor, spec: LogProbs,
                 at: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``_per_token`` from logits (..., V): temperature, placeholders, chunked ops. The entropy's blocks
        give sum pi^2 too (``entropy_and_sum_pi_squared``): no pass over the logits of its own."""
        # exact mode: from the raw logits and T, as the rollout's sampler hands them to the same function
        exact = exact_log_probs(mask_placeholders(logits, self.placeholder_ids), labels, spec.temperature) \
            if self.exact else None
        if spec.temperature != 1.0:
            logits = logits / spec.temperature
        logits = mask_placeholders(logits, self.placeholder_ids)
        out = {"log_probs": exact if exact is not None else logprobs_from_logits(logits, labels)}
        if spec.topk or at is not None:
            out |= topk_log_probs(logits, spec.topk, at)
        if not (spec.entropy or spec.sum_pi_squared):
            return out
        with torch.set_grad_enabled(spec.entropy and spec.entropy_grad and torch.is_grad_enabled()):
            if spec.sum_pi_squared:
                entropy, squares = entropy_and_sum_pi_squared(logits)
            else:
                entropy, squares = entropy_from_logits(logits), None
        if spec.entropy:
            out["entropy"] = entropy
        if squares is not None:
            out["sum_pi_squared"] = squares
        return out

    def _lm(self, labels: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """The model's ``logits`` at the kept positions; under the fused head, given ``labels`` (the next
        token of each kept position, (b, kept)), their (log-prob, entropy) pairs (b, kept, 2) instead."""
        if self.fused is None or labels is None:
            return self.module(**inputs).logits
        spec = self._spec
        with self.fused.labelled(labels, spec.temperature, spec.entropy_grad and torch.is_grad_enabled(),
                                 spec.sum_pi_squared):
            return self.module(**inputs).logits

    def _padded_response_logits(self, batch, pixels: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        responses = batch["responses"]
        width = responses.shape[-1]
        mask = batch["attention_mask"] if pixels else _prepared_causal_mask(self.module, batch["attention_mask"],
                                                                             batch["position_ids"])
        logits = self._lm(
            F.pad(responses, (0, 1)),  # the last kept position predicts past the end: dropped below
            input_ids=batch["input_ids"], attention_mask=mask,
            position_ids=model_position_ids(batch["position_ids"]), use_cache=False, logits_to_keep=width + 1,
            **(pixels or {}),
        )
        # position t predicts token t+1: the response logits are the ones just before each token
        return logits[:, :-1, :], responses, _identity, _identity

    def _shared_prompt_response_logits(self, batch, first: torch.Tensor, group: torch.Tensor):
        """Each distinct prompt runs once; its rows continue from its KV cache (with gradients).

        The prompt forward's last logits predict every row's first response token; the response
        forward gives the rest. Same math as one forward over prompt + response per row.
        """
        from transformers import DynamicCache

        width = batch["responses"].shape[1]
        tp = batch["input_ids"].shape[1] - width
        ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        if self.shared_prompt_logits is not None:
            logits = self.shared_prompt_logits(self.module, ids[first, :tp], mask[first, :tp], pos[first, :tp],
                                               batch["responses"], pos[:, tp:], group)
            if logits is not None:
                return logits, batch["responses"], _identity, _identity
        cache = DynamicCache(config=getattr(self.module, "config", None))
        head_mask = _prepared_causal_mask(self.module, mask[first, :tp], pos[first, :tp], cache)
        head = self.module(input_ids=ids[first, :tp], attention_mask=head_mask, position_ids=pos[first, :tp],
                           **kv_cache_kwargs(self.module, cache), use_cache=True, logits_to_keep=1)
        _gather_rows(cache, group)  # differentiable gather: each row gets its prompt's keys/values
        tail_mask = _prepared_causal_mask(self.module, mask, pos[:, tp:], cache)
        with self.continued_forward(self.module):
            tail = self._lm(F.pad(batch["responses"][:, 1:], (0, 1)), input_ids=batch["responses"],
                            attention_mask=tail_mask, position_ids=pos[:, tp:], **kv_cache_kwargs(self.module, cache),
                            use_cache=True, logits_to_keep=width)
        first_logits = head.logits.index_select(0, group)  # index_select: see _gather_rows
        if self.fused is not None:  # the first response token's columns from the head call's logits
            first = self._unfused(first_logits, batch["responses"][:, :1], dataclasses.replace(self._spec, entropy=True))
            first_logits = torch.stack([first[key] for key in COLUMNS if key in first], dim=-1)
        return torch.cat([first_logits, tail[:, :-1]], dim=1), batch["responses"], _identity, _identity

    def _packed_response_logits(self, batch, rows: "RowSummary | None" = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Real tokens only, packed into one row; logits only where a real token predicts a response.

        From the second slot after EOS on, a response slot's predictor is itself padding and not in
        the pack: its log-prob (and entropy) come back as 0. Those slots are masked out anyway.
        ``rows``: the micro-batch's summary; where every row is one run of counted positions the pack is
        laid out on the host (``_planned_pack``), else here, reading the device (and checking the layout).
        """
        if rows is not None and rows.packs:
            return self._planned_pack(batch, rows)
        input_ids, responses = batch["input_ids"], batch["responses"]
        rows, seqlen = input_ids.shape
        width = responses.shape[-1]
        packed = pack_padded_batch(input_ids, batch["attention_mask"], batch["position_ids"])
        _replay_packed(self.module, batch, packed.indices)
        grid_to_packed = torch.full((rows * seqlen,), -1, dtype=torch.long, device=input_ids.device)
        grid_to_packed[packed.indices] = torch.arange(packed.indices.numel(), device=input_ids.device)
        predictors = (torch.arange(rows, device=input_ids.device) * seqlen).unsqueeze(1) + (
            seqlen - width - 1 + torch.arange(width, device=input_ids.device)
        )
        where = grid_to_packed[predictors]  # (rows, Tr) packed index of each response predictor, -1 if padding
        valid = where >= 0
        gather, select = _identity, (lambda grid: grid[valid])
        if self.sp is not None:  # this rank's slice of the pack; per-token results gathered over the group
            logits, labels, gather, pick = ulysses.packed_logits_at(self.module, packed.input_ids, packed.position_ids,
                                                                    where[valid], responses[valid], self.sp, lm=self._lm)
            select = lambda grid: pick(grid[valid])  # noqa: E731
        else:
            labels = responses[valid]
            logits = self._lm(labels[None], input_ids=packed.input_ids, attention_mask=None,
                              position_ids=packed.position_ids, use_cache=False, logits_to_keep=where[valid])[0]

        def scatter(values: torch.Tensor) -> torch.Tensor:
            full = values.new_zeros((rows, width, *values.shape[1:]))
            full[valid] = gather(values)
            return full

        return logits, labels, scatter, select

    def _planned_pack(self, batch, rows: "RowSummary") -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``_packed_response_logits`` from the rows' summary: every index of the pack made on the host and
        copied over without waiting, the sdpa mask built from them, so nothing is read from the device
        (a packed micro-batch made ~10 reads: the pack's size, its layout check, transformers' look for
        position resets, the trim)."""
        pack = planned_pack(self.module, batch, rows, mask=self.sp is None)
        _replay_packed(self.module, batch, pack.indices)
        labels = batch["responses"].reshape(-1)[pack.slots]
        gather, select = _identity, (lambda grid: grid.flatten(0, 1)[pack.slots])
        if self.sp is not None:
            logits, labels, gather, pick = ulysses.packed_logits_at(self.module, pack.input_ids, pack.position_ids,
                                                                    pack.keep, labels, self.sp, lm=self._lm)
            select = lambda grid: pick(grid.flatten(0, 1)[pack.slots])  # noqa: E731
        else:
            logits = self._lm(labels[None], input_ids=pack.input_ids, attention_mask=pack.mask,
                              position_ids=pack.position_ids, use_cache=False, logits_to_keep=pack.keep)[0]
        return logits, labels, lambda values: pack.scatter(gather(values)), select

    # ---- the micro-batch plan ----------------------------------------------------------------

    def micro_batches(self, data: DataProto, micro: MicroBatching) -> tuple[list[DataProto], list[list[int]] | None]:
        """Fixed-size micro-batches, or token-budget ones (same count on every rank) plus their order.

        When the forward pads, a token budget groups rows of similar length and counts the padding
        (``length_sorted_micro_batches``); fixed-size micro-batches take the rows longest response
        first when that computes fewer tokens than the given order (which keeps a prompt's n
        samples together for the shared-prompt forward). Packed forwards compute no padding: rows
        keep their order, budgets count real tokens. ``micro.in_order``: fixed sizes in row order, padded too.
        """
        group = self.group_if_dist()
        summary = row_summary(data.batch)  # the plan's one read of the device
        if self.use_remove_padding or micro.in_order:
            return summarised_micro_batches(data, summary, micro, group)
        if micro.max_token_len is not None:
            parts = length_sorted_micro_batches(list(summary.lengths), summary.prompt_width, micro.max_token_len, group)
            return _with_summaries(data, summary, parts), parts
        return self._cheapest_fixed_size_plan(data, micro.size or len(data), group, summary)

    def _cheapest_fixed_size_plan(self, data: DataProto, size: int, group: Any, summary: "RowSummary | None" = None):
        """Rows in the given order, or longest response first cut into 1, 2, 4 or 8 times as many
        (smaller) micro-batches: whichever computes the fewest tokens, counting each call's fixed cost.

        Padding after a micro-batch's longest response is cut (``trim_response_padding``), so rows
        of similar length together compute less; gradients accumulate with mini-batch-wide
        normalisers, so the update is the same (to float rounding) however the rows are cut. The
        given order keeps a prompt's n samples together for the shared-prompt forward. The ranks
        sum their costs and take the same plan, so they make the same number of calls.
        """
        summary = summary if summary is not None else row_summary(data.batch)
        order = sorted(range(len(data)), key=lambda i: -summary.lengths[i])  # stable: longest response first
        plans: list[list[list[int]] | None] = [None]
        for k in (1, 2, 4, 8):
            chunk = min(size, -(-len(order) // k))
            plan = [order[i: i + chunk] for i in range(0, len(order), chunk)]
            if k == 1 or len(plan) > len(plans[-1] or []):
                plans.append(plan)
        in_order = [list(range(i, min(i + size, len(data)))) for i in range(0, len(data), size)]
        costs = [self._plan_cost(summary, in_order if plan is None else plan) for plan in plans]
        if group is not None:
            costs = all_reduce_ints(costs, dist.ReduceOp.SUM, group)
        best = plans[min(range(len(plans)), key=lambda i: (costs[i], i))]
        if best is None:
            return [_summarised(m, summary.select(p)) for m, p in zip(data.split(size), in_order)], None
        return _with_summaries(data, summary, best), best

    def _plan_cost(self, summary: "RowSummary", parts: list[list[int]]) -> int:
        """Tokens the plan's forwards compute plus its calls' fixed cost, from the rows' summary (no
        micro-batch is built, and the device is not read, for a plan that is not taken)."""
        return sum(self._summary_tokens(summary.select(part)) + self.call_cost_tokens for part in parts)

    def _summary_tokens(self, s: "RowSummary") -> int:
        """``_forward_tokens`` of the micro-batch ``s`` summarises."""
        if not s.rows:
            return 0
        width, lead = s.trim()
        prompt = s.prompt_width - lead
        unshared = sum(s.prompt_tokens) + sum(s.lengths) if self.use_remove_padding else s.rows * (prompt + width)
        if not self.use_shared_prompt:
            return unshared
        return min(unshared, len(set(s.group)) * prompt + s.rows * width)

    def plan_entries(self, micros: list[DataProto]) -> list["MicroPlan"]:
        """Per micro-batch, what its forward needs to know beforehand: its trim (from the row summary
        ``micro_batches`` attached, so the forward reads nothing from the device) and its prompt groups."""
        groups = self.shared_prompt_plan(micros)
        summaries = summary_entries(micros)
        return [MicroPlan(rows.trim() if rows is not None else None, g, rows) for rows, g in zip(summaries, groups)]

    def shared_prompt_plan(self, micros: list[DataProto]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per micro-batch, its prompt groups when it takes the shared-prompt path, else None.

        The shared path runs the model twice before a backward: ranks on different paths would
        pair FSDP's gathers and reductions wrongly and hang. One all-reduce (MIN) settles all the
        micro-batches of a call, before any compute, so no rank waits on another there.
        """
        if not self.use_shared_prompt or any(MULTI_MODAL_INPUTS in m.non_tensor_batch for m in micros):
            return [None] * len(micros)  # equal prompt ids may hold different images
        groups = [self._micro_prompt_groups(m) if len(m) > 0 else None for m in micros]
        if self.dp_size > 1:
            agreed = all_reduce_ints([int(g is not None) for g in groups], dist.ReduceOp.MIN, self.group_if_dist())
            groups = [g if ok else None for g, ok in zip(groups, agreed)]
        return groups

    @staticmethod
    def _distinct_prompts(batch) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        tp = ids.shape[1] - batch["responses"].shape[1]
        # the mask too: a pad id may also be a real token (pad = eos in many tokenizers)
        return torch.unique(torch.cat([ids[:, :tp], mask[:, :tp]], dim=1), dim=0, return_inverse=True)

    @staticmethod
    def _shared_tokens(batch, distinct: int) -> int:
        rows, width = batch["responses"].shape
        return distinct * (batch["input_ids"].shape[1] - width) + rows * width

    def _unshared_tokens(self, batch) -> int:
        mask = batch["attention_mask"]
        return int(mask.sum()) if self.use_remove_padding else mask.numel()

    def _forward_tokens(self, batch) -> int:
        """Tokens one micro-batch's forward computes (after trimming, on its cheaper path)."""
        if len(batch["input_ids"]) == 0:
            return 0
        batch, _ = trim_response_padding(batch)
        unshared = self._unshared_tokens(batch)
        if not self.use_shared_prompt:
            return unshared
        return min(unshared, self._shared_tokens(batch, self._distinct_prompts(batch)[0].shape[0]))

    def _micro_prompt_groups(self, micro: DataProto) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``_prompt_groups`` of a micro-batch: from its row summary where it has one (no device read)."""
        s = _summary_of(micro)
        if s is None:
            return self._prompt_groups(trim_response_padding(micro.batch)[0])
        width, lead = s.trim()
        prompt = s.prompt_width - lead
        unshared = sum(s.prompt_tokens) + sum(s.lengths) if self.use_remove_padding else s.rows * (prompt + width)
        distinct = list(dict.fromkeys(s.group))  # each prompt's first row in the mini-batch, in order
        if len(distinct) * prompt + s.rows * width >= unshared:
            return None
        index = {g: k for k, g in enumerate(distinct)}
        first_row: dict[int, int] = {}
        for row, g in enumerate(s.group):
            first_row.setdefault(g, row)
        device = micro.batch["input_ids"].device
        return (_host_to(torch.tensor([first_row[g] for g in distinct]), device),
                _host_to(torch.tensor([index[g] for g in s.group]), device))

    def _prompt_groups(self, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(one row per distinct prompt, group of each row), or None when sharing saves no tokens.

        Tokens computed: shared = distinct prompts x Tp + rows x Tr; otherwise rows x (Tp + Tr)
        padded, or the real tokens only when packing.
        """
        ids, rows = batch["input_ids"], batch["input_ids"].shape[0]
        uniq, group = self._distinct_prompts(batch)
        if self._shared_tokens(batch, uniq.shape[0]) >= self._unshared_tokens(batch):
            return None
        first = torch.empty(uniq.shape[0], dtype=torch.long, device=ids.device)
        first[group] = torch.arange(rows, device=ids.device)  # any row of each group
        return first, group


class PlannedPack(NamedTuple):
    """A micro-batch packed from its rows' summary (``planned_pack``): model inputs on the device, the
    packed index of each response slot's predictor (``keep``) and the slot's flat index (``slots``)."""

    input_ids: torch.Tensor  # (1, nnz)
    position_ids: torch.Tensor  # (1, nnz)
    mask: torch.Tensor | None  # (1, 1, nnz, nnz) for sdpa models, else None (HF finds the position resets)
    keep: torch.Tensor  # (K,)
    slots: torch.Tensor  # (K,) into the (b * Tr) response grid
    shape: tuple[int, int]  # (b, Tr)
    indices: torch.Tensor  # (nnz,) into the (b * T) grid: where each packed token came from

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(K, ...) per-slot values -> (b, Tr, ...), zero where no real token predicts the slot."""
        full = values.new_zeros((self.shape[0] * self.shape[1], *values.shape[1:]))
        full[self.slots] = values  # integer indices: no read of a count
        return full.view(*self.shape, *values.shape[1:])


def planned_pack(module: nn.Module, batch: Any, rows: "RowSummary", mask: bool = True) -> PlannedPack:
    """The padding-removed inputs of a (b, Tp+Tr) batch whose rows are all ``packable``, from their
    summary: laid out on the host (``pack_layout``) and copied over without waiting, so packing reads
    nothing from the device (a packed micro-batch used to read it ~10 times: the pack's size, its layout
    check, transformers' look for position resets, the trim). ``batch`` may be trimmed (fewer leading
    prompt columns, a narrower response) after ``rows`` were read. ``mask``: build the sdpa mask."""
    input_ids = batch["input_ids"]
    n_rows, seqlen = input_ids.shape
    width = batch["responses"].shape[-1]
    cut = rows.prompt_width - (seqlen - width)  # leading columns a trim took off
    starts = [(lead if prompt else rows.prompt_width) - cut for lead, prompt in zip(rows.lead, rows.prompt_tokens)]
    layout = pack_layout(starts, list(rows.real_tokens), seqlen, width)
    dev = input_ids.device
    indices = _host_to(layout.indices, dev)
    attention = packed_causal_mask(_host_to(layout.sequence_ids, dev)) if mask and _sdpa_full_attention(module) else None
    return PlannedPack(input_ids.reshape(-1)[indices][None], _host_to(layout.position_ids, dev)[None], attention,
                       _host_to(layout.keep, dev), _host_to(layout.slots, dev), (n_rows, width), indices)


def _replay_packed(module: nn.Module, batch: Any, indices: torch.Tensor) -> None:
    """A packed forward replays its tokens' routing in pack order (gathered as its ``input_ids`` are),
    and a recording one says where its tokens sit in the grid."""
    state = routing_replay.routing_replay_of(module)
    if state is not None and state.mode is not None:
        state.select_tokens(indices)


def _recorded_routing(module: nn.Module, batch: Any, full_seq: int, full_width: int) -> torch.Tensor:
    """The routing the micro-batch's forward recorded, on its (b, T) grid before the trim (``full_seq``
    columns, ``full_width`` of them responses): (b, full_seq, layers, top_k), NO_EXPERT at padding."""
    grid = routing_replay.attach(module).recorded_grid(batch["input_ids"].shape)
    grid = grid.masked_fill(~batch["attention_mask"].bool()[..., None, None], routing_replay.NO_EXPERT)
    right = full_width - batch["responses"].shape[-1]
    left = full_seq - grid.shape[1] - right
    return F.pad(grid, (0, 0, 0, 0, left, right), value=routing_replay.NO_EXPERT)


def value_forward(module: nn.Module, micro: Any, use_remove_padding: bool,
                  sp: ulysses.SequenceParallel | None = None, rows: "RowSummary | None" = None) -> dict[str, torch.Tensor]:
    """``values`` (b, Tr) of a one-label token classifier (``sp``: split over a Ulysses group, packed;
    image rows: padded, with their pixel inputs).

    For a row ``[prompt (Tp) | response (Tr)]`` the value of response token t is the head output at
    position ``Tp - 1 + t``: the state after the prompt and t response tokens, before token t — the
    position that predicts token t, so a pack planned from the rows' summary (``rows``) has them at its
    ``keep`` (slots no real token predicts are 0: padding, masked out).
    """
    width = micro["responses"].shape[-1]
    pixels = _pixel_inputs(micro)
    if use_remove_padding and sp is None and not pixels and rows is not None and rows.packs:
        pack = planned_pack(module, micro, rows)
        out = module(input_ids=pack.input_ids, attention_mask=pack.mask, position_ids=pack.position_ids,
                     use_cache=False).logits
        return {"values": pack.scatter(out[0, pack.keep, 0].float())}
    if pixels or micro["position_ids"].dim() == 3:
        # a vision-language critic (models/vision_value.py): the padded forward with the rows' pixel inputs
        # and (3, B, T) positions, as the actor's image rows take it (packing would need the pixels cut too)
        logits = module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                        position_ids=model_position_ids(micro["position_ids"]), use_cache=False, **pixels).logits
    elif sp is not None:
        packed = pack_padded_batch(micro["input_ids"], micro["attention_mask"], micro["position_ids"])
        logits = unpack_to_padded(ulysses.packed_outputs(module, packed.input_ids, packed.position_ids, sp), packed)
    elif use_remove_padding:
        logits = forward_logits(module, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                                use_remove_padding=True)
    else:  # transformers' own 4-D mask prepared here: its all-ones check of the 2-D one reads the device
        logits = module(input_ids=micro["input_ids"], position_ids=micro["position_ids"], use_cache=False,
                        attention_mask=_prepared_causal_mask(module, micro["attention_mask"], micro["position_ids"])).logits
    return {"values": logits[:, -width - 1: -1, 0].float()}


def summarised_micro_batches(data: DataProto, summary: "RowSummary", micro: MicroBatching,
                             group: Any) -> tuple[list[DataProto], list[list[int]] | None]:
    """Micro-batches of packed rows in row order, each with its rows' summary: fixed-size, or token
    budgets counting real tokens only (padding is not computed), the same count on every rank."""
    if micro.max_token_len is not None:
        _, parts = num_micro_batches_for_budget(list(summary.real_tokens), micro.max_token_len, group)
        parts.sort(key=lambda p: (p[0] if p else float("inf")))
        return _with_summaries(data, summary, parts), parts
    size = micro.size or len(data)
    parts = [list(range(i, min(i + size, len(data)))) for i in range(0, len(data), size)]
    return [_summarised(m, summary.select(p)) for m, p in zip(data.split(size), parts)], None


def value_micro_batches(data: DataProto, micro: MicroBatching, group: Any,
                        packed: bool) -> tuple[list[DataProto], list[list[int]] | None]:
    """The critic's micro-batches: packed ones from one read of the rows' summary (the forward lays the
    pack out from it), else ``plain_micro_batches``."""
    if packed and len(data) and data.batch["position_ids"].dim() == 2:
        return summarised_micro_batches(data, row_summary(data.batch), micro, group)
    return plain_micro_batches(data, micro, group)


def summary_entries(micros: list[DataProto]) -> list["RowSummary | None"]:
    """Each micro-batch's rows' summary, for its forward (None: empty or not summarised)."""
    return [_summary_of(m) if len(m) else None for m in micros]


def plain_micro_batches(data: DataProto, micro: MicroBatching, group: Any) -> tuple[list[DataProto], list[list[int]] | None]:
    """Fixed-size micro-batches in row order, or token-budget ones (same count on every rank) and their order."""
    if micro.max_token_len is not None:
        return rearrange_micro_batches(data, max_token_len=micro.max_token_len, dp_group=group)
    return data.split(micro.size or len(data)), None


def model_batch(micro: DataProto) -> Any:
    """What a forward reads of a micro-batch: its tensors, and the rows' pixel inputs where it has them."""
    if MULTI_MODAL_INPUTS not in micro.non_tensor_batch:
        return micro.batch
    return {**{k: micro.batch[k] for k in micro.batch.keys()}, MULTI_MODAL_INPUTS: micro.non_tensor_batch[MULTI_MODAL_INPUTS]}


def _pixel_inputs(micro: Any) -> dict[str, torch.Tensor]:
    """The micro-batch's pixel inputs as model keyword arguments ({} for text rows)."""
    if not isinstance(micro, dict) or MULTI_MODAL_INPUTS not in micro:
        return {}
    return model_multimodal_kwargs(micro[MULTI_MODAL_INPUTS], micro["input_ids"].device)


def restore(values: torch.Tensor, order: list[list[int]] | None) -> torch.Tensor:
    """Rows back in the input order after a reordering micro-batch plan."""
    return values if order is None else restore_order(values, order)


@contextlib.contextmanager
def plain_context(module: nn.Module) -> Iterator[None]:
    """The HF second call with FSDP2's hooks as they are (the reference path)."""
    yield


def _gather_rows(cache: Any, rows: torch.Tensor) -> None:
    """Each cache layer's keys/values: row i becomes row ``rows[i]`` (HF's ``batch_select_indices``).

    With index_select, not HF's indexing: indexing's backward (index_put_ with accumulate) adds the rows
    that share a prompt with parallel atomic adds on the CPU (float, >= 32,768 elements, 2+ threads), in
    an order that changes from run to run; index_select's (index_add_) adds them in row order, and is
    faster (docs/on_policy.md, "Replay")."""
    for layer in cache.layers:
        if layer.get_seq_length() > 0:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def _identity(values: torch.Tensor) -> torch.Tensor:
    return values


def _response_lengths(batch) -> torch.Tensor:
    """Real tokens per response (B,): responses are right-padded, so the mask is a prefix of ones."""
    tp = batch["input_ids"].shape[-1] - batch["responses"].shape[-1]
    return batch["attention_mask"][:, tp:].sum(-1)


def _response_padding(batch) -> torch.Tensor:
    """(B, Tr) True where the response is padding."""
    return batch["attention_mask"][:, batch["input_ids"].shape[-1] - batch["responses"].shape[-1]:] == 0


# ---- the rows' summary: everything the micro-batch plan reads, in one copy from the device ----------

_SUMMARY = "_rlf_row_summary"  # meta_info key of a micro-batch's RowSummary (set by micro_batches)


class MicroPlan(NamedTuple):
    """A micro-batch's forward plan: its (width, lead) trim when known, its prompt groups, and its rows'
    summary (a packed forward lays the pack out from it)."""

    trim: tuple[int, int] | None
    prompt_groups: tuple[torch.Tensor, torch.Tensor] | None
    rows: "RowSummary | None" = None


@dataclass(frozen=True)
class RowSummary:
    """Per row: real response tokens, leading prompt columns that are padding, real prompt tokens, the
    first row (of the summarised batch) with the same prompt, and whether its real tokens are one run
    holding positions 0, 1, ... (what padding removal needs) — host integers, read once."""

    lengths: tuple[int, ...]
    lead: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    group: tuple[int, ...]
    prompt_width: int
    packable: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def select(self, rows: Sequence[int]) -> "RowSummary":
        pick = lambda values: tuple(values[i] for i in rows)  # noqa: E731
        return RowSummary(pick(self.lengths), pick(self.lead), pick(self.prompt_tokens), pick(self.group),
                          self.prompt_width, pick(self.packable) if self.packable else ())

    @property
    def packs(self) -> bool:
        """Whether a packed forward can be laid out from this summary: rows, each one run of counted positions."""
        return bool(self.rows) and all(self.packable)

    @property
    def real_tokens(self) -> tuple[int, ...]:
        """Per row, its real tokens (prompt and response): the cost of a packed forward."""
        return tuple(p + r for p, r in zip(self.prompt_tokens, self.lengths))

    def trim(self) -> tuple[int, int]:
        """(response width, leading prompt columns) ``trim_response_padding`` cuts to."""
        return max(1, max(self.lengths, default=0)), min(self.lead, default=0)


def row_summary(batch) -> RowSummary:
    """The ``RowSummary`` of a (B, Tp+Tr) batch: computed on its device, copied to the host in one read.

    A row without prompt tokens counts ``Tp - 1`` leading pad columns (``common_left_padding`` leaves
    one column). Prompts are equal when their real tokens are (ids under a zero mask are ignored)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tp = ids.shape[-1] - batch["responses"].shape[-1]
    if ids.shape[0] == 0:
        return RowSummary((), (), (), (), tp)
    prompt_mask = mask[:, :tp]
    lead = torch.where(prompt_mask.any(-1), prompt_mask.int().argmax(-1), max(tp - 1, 0))
    group = _first_equal_rows(ids[:, :tp].masked_fill(prompt_mask == 0, -1))
    packable = _packable_rows(mask, batch.get("position_ids", None))
    lengths, lead, prompt_tokens, group, packable = torch.stack(
        [mask[:, tp:].sum(-1), lead, prompt_mask.sum(-1), group, packable]).tolist()  # one read
    return RowSummary(tuple(lengths), tuple(lead), tuple(prompt_tokens), tuple(group), tp, tuple(packable))


def _packable_rows(mask: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """(B,) 1 where a row's real tokens are one run holding positions 0, 1, ... (``cumsum(mask) - 1``):
    the layout padding removal packs; 0 for 3-D (vision) positions, which are never packed."""
    if position_ids is None or position_ids.dim() != 2:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    real = mask.bool()
    runs = (real & ~F.pad(real, (1, 0))[:, :-1]).sum(-1)  # columns where a run of real tokens starts
    counted = (position_ids == real.long().cumsum(-1) - 1) | ~real
    return ((runs <= 1) & counted.all(-1)).long()


def _first_equal_rows(keys: torch.Tensor) -> torch.Tensor:
    """(B,) index of the first row equal to each row of ``keys`` (B, T), on the device (no sort, no read:
    ``torch.unique`` must read its output size). Compared in chunks of rows to bound the B x B x T memory."""
    rows = keys.shape[0]
    chunk = max(1, 2**24 // max(1, rows * keys.shape[1]))
    return torch.cat([(keys[i:i + chunk, None, :] == keys[None, :, :]).all(-1).int().argmax(-1)
                      for i in range(0, rows, chunk)])


def _summarised(micro: DataProto, summary: RowSummary) -> DataProto:
    micro.meta_info[_SUMMARY] = summary
    return micro


def _with_summaries(data: DataProto, summary: RowSummary, parts: list[list[int]]) -> list[DataProto]:
    return [_summarised(data.select_idxs(part), summary.select(part)) for part in parts]


def _summary_of(micro: DataProto) -> RowSummary | None:
    return micro.meta_info.get(_SUMMARY)


def _host_to(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def _sdpa_full_attention(module: nn.Module) -> Any:
    """The model's config where it is a text model on sdpa with full attention in every layer (a 4-D
    boolean mask built here is the one transformers would build), else None."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = getattr(base, "config", None)
    layer_types = getattr(config, "layer_types", None)
    windowed = any(t != "full_attention" for t in layer_types) if layer_types else \
        getattr(config, "sliding_window", None) is not None
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", EXACT_ATTENTION) or windowed or \
            getattr(config, "vision_config", None) is not None:
        return None
    return config


def _prepared_causal_mask(module: nn.Module, mask: torch.Tensor, position_ids: torch.Tensor, cache: Any = None) -> Any:
    """A forward's attention mask, built here with transformers' own ``create_causal_mask`` for sdpa
    models with full attention only: HF would otherwise test the 2-D padding mask for an all-ones fast
    path (``fast_all``), a device read in every forward. The 4-D mask is the one HF builds itself (and
    takes as prepared); same math. Other models get the 2-D mask. ``mask`` (b, past + new tokens); ``position_ids`` (b, new tokens); ``cache``: the KV cache
    the forward continues (None: no past)."""
    config = _sdpa_full_attention(module)
    if config is None:
        return mask
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError:
        return mask
    position_ids = model_position_ids(position_ids)
    stub = torch.empty((mask.shape[0], position_ids.shape[-1], 0), device=mask.device)  # only its shape and device count
    # the cache goes by position: transformers < 5.2x names it past_key_values, later ones cache
    return create_causal_mask(config, stub, mask, cache, position_ids=position_ids, allow_is_causal_skip=False)


def trim_response_padding(batch, known: tuple[int, int] | None = None) -> tuple[Any, int]:
    """The model inputs without the columns that are padding in every row, and the uncut response width.

    Cut: the responses' right padding after the longest response, and the prompts' left padding
    before the longest prompt (``data.max_prompt_length`` is usually far above the batch's longest
    prompt). The columns cut hold padding only: a right-cut logit would only predict padding, and a
    left-cut key is masked out of every query, while positions are explicit (``position_ids``), so
    no log-prob the loss reads changes. ``known``: (width, lead) from the rows' summary
    (``RowSummary.trim``), so nothing is read from the device here.
    """
    full = batch["responses"].shape[-1]
    if not batch["responses"].shape[0]:
        return batch, full
    if known is not None:
        width, lead = known
    else:
        width = max(1, int(_response_lengths(batch).max()))
        prompt_mask = batch["attention_mask"][:, : batch["input_ids"].shape[-1] - full]
        lead = common_left_padding(prompt_mask)
    if width >= full and lead == 0:
        return batch, full
    end = batch["input_ids"].shape[-1] - (full - width)
    trimmed = {k: batch[k][..., lead:end] for k in MODEL_INPUTS if k != "responses"}
    trimmed["responses"] = batch["responses"][..., :width]
    if ROUTED_EXPERTS in batch.keys():  # (b, T, layers, top_k): its token columns cut as the inputs'
        trimmed[ROUTED_EXPERTS] = batch[ROUTED_EXPERTS][:, lead:end]
    return trimmed, full


def _to_grid(values: torch.Tensor, width: int, padding: torch.Tensor) -> torch.Tensor:
    """(b, w, ...) -> (b, width, ...): zeros after column w and wherever ``padding`` (b, width) holds."""
    if values.shape[1] != width:
        values = F.pad(values, (0, 0) * (values.dim() - 2) + (0, width - values.shape[1]))
    return values.masked_fill(padding.view(*padding.shape, *(1,) * (values.dim() - 2)), 0)


def topk_log_probs(logits: torch.Tensor, k: int, ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """From logits (..., V) already at the temperature: with k > 0 the k likeliest tokens ``topk_ids`` and
    their ``topk_log_probs`` (..., k), without gradient; with ``ids`` (..., k) ``log_probs_at`` (..., k),
    their log-probs, with gradient. log_softmax(x)[i] = x[i] - logsumexp(x), in fp32 whatever the logits'
    dtype, so no (..., V) log-softmax is kept for the backward (verl's chunked top-k identity)."""
    log_z = logits.float().logsumexp(-1, keepdim=True)
    out = {}
    if k:
        with torch.no_grad():
            top = logits.detach().topk(k, dim=-1)  # log-softmax is monotone: the logits' top-k
            out |= {"topk_log_probs": top.values.float() - log_z.detach(), "topk_ids": top.indices}
    if ids is not None:
        out["log_probs_at"] = logits.float().gather(-1, ids.long()) - log_z
    return out
