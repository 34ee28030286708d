"""The data-parallel PPO actor: log-probs of responses and the policy update, for one rank.

No worker, Ray or config-tree code: the caller hands in a (possibly FSDP2-sharded) module, its
optimiser, the ``actor`` config subtree and the per-rank batch sizes it already resolved.

Batch semantics (verl's). The rows a rank receives are split into mini-batches of
``mini_batch_size`` rows (``ppo_mini_batch_size`` prompts × ``rollout.n`` / dp size); each
mini-batch is one optimiser step, taken ``ppo_epochs`` times over the data (reshuffled each epoch
when ``shuffle``). A mini-batch is cut into micro-batches of ``ppo_micro_batch_size_per_gpu`` rows
(or by token budget with ``use_dynamic_bsz``) whose gradients are accumulated.

Invariance. Every micro-batch loss is aggregated with the *mini-batch-wide* token and sequence
counts, summed over all dp ranks (``agg_loss``'s global-batch contract), and the gradients are
summed over micro-batches and averaged over ranks by FSDP. One step is therefore the same,
to float rounding, whatever the micro-batch size and however many ranks share the mini-batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlfoundry.algos import core_algos
from rlfoundry.models import fused_forward
from rlfoundry.protocol import DataProto
from rlfoundry.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from rlfoundry.workers.fsdp_utils import accumulate_unsharded, cfg_get, clip_grad_norm_, continued_forward
from rlfoundry.workers.utils.padding import pack_padded_batch
from rlfoundry.workers.utils.seqlen_balancing import (
    all_reduce_ints,
    length_sorted_micro_batches,
    rearrange_micro_batches,
    restore_order,
)
from rlfoundry.workers.utils.update import UpdateCounters, global_batch_info, iter_mini_batches

__all__ = ["DataParallelPPOActor", "ActorBatchSizes"]

logger = logging.getLogger(__name__)

_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


@dataclass(frozen=True)
class ActorBatchSizes:
    """Per-rank row counts, resolved once by the worker from the global config (never mutated)."""

    mini_batch_size: int = 0  # rows per optimiser step on this rank (0: whole batch)
    micro_batch_size: int = 1  # rows per forward/backward (ignored with use_dynamic_bsz)
    max_token_len: int = 16384  # token budget per micro-batch with use_dynamic_bsz


class _MiniBatchStats:
    """Accumulates one mini-batch's metrics so they come out split- and rank-independent.

    Loss-like values (already scaled by the global counts) are summed; ratio-like metrics from the
    policy loss (clip fractions, ppo_kl, ...) are token-weighted. One all-reduce per mini-batch
    turns both into mini-batch-wide numbers, identical on every rank.
    """

    SUMMED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")

    def __init__(self):
        self.sums = {k: 0.0 for k in self.SUMMED}
        self.weighted: dict[str, float] = {}
        self.tokens = 0.0
        self.seen: set[str] = set()

    def add(self, losses: dict[str, float], ratios: dict[str, float], tokens: float) -> None:
        for k, v in losses.items():
            self.sums[k] += v
            self.seen.add(k)
        for k, v in ratios.items():
            self.weighted[k] = self.weighted.get(k, 0.0) + float(v) * tokens
        self.tokens += tokens

    def reduce(self, dp_size: int, group: Any) -> dict[str, float]:
        weighted_keys = sorted(self.weighted)  # same loss function on every rank: same keys
        values = torch.tensor(
            [*self.sums.values(), *(self.weighted[k] for k in weighted_keys), self.tokens], dtype=torch.float64
        )
        if dp_size > 1:
            dist.all_reduce(values, group=group)
        # each rank's micro losses carry a factor dp_size (agg_loss contract); the rank sum undoes it
        out = {k: float(values[i]) / dp_size for i, k in enumerate(self.SUMMED) if k in self.seen}
        total, offset = max(float(values[-1]), 1.0), len(self.SUMMED)
        out.update({k: float(values[offset + i]) / total for i, k in enumerate(weighted_keys)})
        return out


class DataParallelPPOActor(UpdateCounters):
    """Log-probs and PPO updates for one data-parallel rank.

    Args:
        config: the ``actor`` (or ``ref``) config subtree: clip ratios, ``entropy_coeff``,
            ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``, ``loss_agg_mode``, ``grad_clip``,
            ``policy_loss.loss_mode``, ``ppo_epochs``, ``shuffle``, ``use_dynamic_bsz``.
        module: the causal LM (plain or FSDP2).
        optimizer: None for a frozen reference policy.
        sizes: per-rank batch sizes (see ``ActorBatchSizes``).
        dp_group: the data-parallel process group (None: the default group when initialised).
        seed: base seed of the mini-batch shuffling.
        use_remove_padding: run forwards on the real tokens only, packed into one row
            (``model.use_remove_padding``; see ``workers/utils/padding.py``).
        use_shared_prompt: rows with the same prompt (the n samples of a GRPO group) run that prompt
            once and attend to its shared KV cache (``model.use_shared_prompt``); taken per
            micro-batch only when it computes fewer tokens than the padded/packed forward.
        use_fused_forward: run that shared-prompt forward as one pass of our own over the model's
            weights where it reproduces the model (``model.fused_forward``; see
            ``rlfoundry/models/fused_forward.py``), else through the HF forward.
    """

    def __init__(
        self,
        config: Any,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        sizes: ActorBatchSizes | None = None,
        dp_group: Any = None,
        seed: int = 0,
        use_remove_padding: bool = False,
        use_shared_prompt: bool = False,
        use_fused_forward: bool = False,
    ):
        self.config = config
        self.module = module
        self.optimizer = optimizer
        self.sizes = sizes or ActorBatchSizes()
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.seed = seed
        self.use_remove_padding = use_remove_padding
        self.use_shared_prompt = use_shared_prompt
        self.use_fused_forward = use_fused_forward
        self.update_calls = 0  # update_policy calls so far: seeds the shuffle, kept in checkpoints
        self.nonfinite_skips = 0  # optimiser steps skipped for a non-finite grad norm, ever

    # ---- forward --------------------------------------------------------------------------

    def _forward_micro_batch(
        self, micro: DataProto, temperature: float, calculate_entropy: bool, entropy_grad: bool = True,
        prompt_groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Response log-probs (b, Tr) and optionally entropies (b, Tr) of one micro-batch.

        Only positions that predict a response token go through the LM head (``logits_to_keep``):
        prompt logits are never computed, nor any column after the micro-batch's longest response.
        Outputs are 0 wherever the response is padding, so they do not depend on micro-batching.
        Logits are divided by the sampling temperature, as the rollout did. With
        ``use_remove_padding`` the padding is not computed either.
        ``entropy_grad=False``: the entropy is only a metric, computed without a graph.
        ``prompt_groups``: this micro-batch's entry of ``_shared_prompt_plan`` (None: no sharing).
        """
        batch, full_width = _trim_response_padding(micro.batch)
        if prompt_groups is not None:
            logits, labels, scatter = self._shared_prompt_response_logits(batch, *prompt_groups)
        elif self.use_remove_padding:
            logits, labels, scatter = self._packed_response_logits(batch)
        else:
            logits, labels, scatter = self._padded_response_logits(batch)
        if temperature != 1.0:
            logits = logits / temperature
        padding = _response_padding(micro.batch)
        log_probs = _pad_width(scatter(logprobs_from_logits(logits, labels)), full_width).masked_fill(padding, 0.0)
        entropy = None
        if calculate_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = _pad_width(scatter(entropy_from_logits(logits)), full_width).masked_fill(padding, 0.0)
        return entropy, log_probs

    def _padded_response_logits(self, batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        responses = batch["responses"]
        width = responses.shape[-1]
        out = self.module(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"], use_cache=False, logits_to_keep=width + 1,
        )
        # position t predicts token t+1: the response logits are the ones just before each token
        return out.logits[:, :-1, :], responses, lambda values: values

    def _shared_prompt_plan(self, micros: list[DataProto]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per micro-batch, its prompt groups (``_prompt_groups``) when it takes the shared-prompt
        path, else None; the path is the same on every rank.

        The shared path runs the model twice before a backward: ranks on different paths would
        pair FSDP's gathers and reductions wrongly and hang. One all-reduce (MIN) settles all the
        micro-batches of a call, before any compute, so no rank waits on another there.
        """
        if not self.use_shared_prompt:
            return [None] * len(micros)
        groups = [self._prompt_groups(_trim_response_padding(m.batch)[0]) if len(m) > 0 else None for m in micros]
        if self.dp_size > 1:
            agreed = all_reduce_ints([int(g is not None) for g in groups], dist.ReduceOp.MIN, self._group_if_dist())
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
        batch, _ = _trim_response_padding(batch)
        unshared = self._unshared_tokens(batch)
        if not self.use_shared_prompt:
            return unshared
        return min(unshared, self._shared_tokens(batch, self._distinct_prompts(batch)[0].shape[0]))

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

    def _shared_prompt_response_logits(self, batch, first: torch.Tensor, group: torch.Tensor):
        """Each distinct prompt runs once; its rows continue from its KV cache (with gradients).

        The prompt forward's last logits predict every row's first response token; the response
        forward gives the rest. Same math as one forward over prompt + response per row.
        """
        from transformers import DynamicCache

        width = batch["responses"].shape[1]
        tp = batch["input_ids"].shape[1] - width
        ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        if self.use_fused_forward and fused_forward.unsupported_reason(self.module, ids.shape[1]) is None:
            logits = fused_forward.shared_prompt_logits(self.module, ids[first, :tp], mask[first, :tp],
                                                        pos[first, :tp], batch["responses"], pos[:, tp:], group)
            return logits, batch["responses"], lambda values: values
        cache = DynamicCache(config=getattr(self.module, "config", None))
        head = self.module(input_ids=ids[first, :tp], attention_mask=mask[first, :tp], position_ids=pos[first, :tp],
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.batch_select_indices(group)  # differentiable gather: each row gets its prompt's keys/values
        with continued_forward(self.module):  # one gather and one reduction per unit, not two
            tail = self.module(input_ids=batch["responses"], attention_mask=mask, position_ids=pos[:, tp:],
                               past_key_values=cache, use_cache=True, logits_to_keep=width)
        logits = torch.cat([head.logits[group], tail.logits[:, :-1]], dim=1)
        return logits, batch["responses"], lambda values: values

    def _packed_response_logits(self, batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Real tokens only, packed into one row; logits only where a real token predicts a response.

        From the second slot after EOS on, a response slot's predictor is itself padding and not in
        the pack: its log-prob (and entropy) come back as 0. Those slots are masked out anyway.
        """
        input_ids, responses = batch["input_ids"], batch["responses"]
        rows, seqlen = input_ids.shape
        width = responses.shape[-1]
        packed = pack_padded_batch(input_ids, batch["attention_mask"], batch["position_ids"])
        grid_to_packed = torch.full((rows * seqlen,), -1, dtype=torch.long, device=input_ids.device)
        grid_to_packed[packed.indices] = torch.arange(packed.indices.numel(), device=input_ids.device)
        predictors = (torch.arange(rows, device=input_ids.device) * seqlen).unsqueeze(1) + (
            seqlen - width - 1 + torch.arange(width, device=input_ids.device)
        )
        where = grid_to_packed[predictors]  # (rows, Tr) packed index of each response predictor, -1 if padding
        valid = where >= 0
        out = self.module(
            input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
            use_cache=False, logits_to_keep=where[valid],
        )

        def scatter(values: torch.Tensor) -> torch.Tensor:
            full = values.new_zeros((rows, width))
            full[valid] = values
            return full

        return out.logits[0], responses[valid], scatter

    def _micro_batches(
        self, data: DataProto, micro_batch_size: int | None, max_token_len: int | None
    ) -> tuple[list[DataProto], list[list[int]] | None]:
        """Fixed-size micro-batches, or token-budget ones (same count on every rank) plus their order.

        Every micro-batch is cut after its own longest response. When the forward pads, a token
        budget groups rows of similar length and counts the padding (``length_sorted_micro_batches``);
        fixed-size micro-batches take the rows longest response first when that computes fewer tokens
        than the given order (which keeps a prompt's n samples together for the shared-prompt
        forward). Packed forwards compute no padding: rows keep their order, budgets count real tokens.
        """
        group = self._group_if_dist()
        if max_token_len is not None and self.use_remove_padding:
            return rearrange_micro_batches(data, max_token_len=max_token_len, dp_group=group)
        if max_token_len is not None:
            width = data.batch["input_ids"].shape[-1] - data.batch["responses"].shape[-1]
            parts = length_sorted_micro_batches(_response_lengths(data.batch).tolist(), width, max_token_len, group)
        else:
            size = micro_batch_size or len(data)
            if size >= len(data) or self.use_remove_padding:
                return data.split(size), None
            order = _longest_response_first(data.batch)
            parts = [order[i: i + size] for i in range(0, len(order), size)]
            in_order = data.split(size)
            by_length = [data.select_idxs(part) for part in parts]
            if sum(map(self._forward_tokens, (m.batch for m in by_length))) >= \
                    sum(map(self._forward_tokens, (m.batch for m in in_order))):
                return in_order, None
            return by_length, parts
        return [data.select_idxs(part) for part in parts], parts

    def _group_if_dist(self) -> Any:
        return (self.dp_group if self.dp_group is not None else dist.group.WORLD) if self.dp_size > 1 else None

    def compute_log_prob(
        self,
        data: DataProto,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        temperature: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, Tr) of ``responses`` under the current module, and entropies if asked.

        Needs ``input_ids``, ``attention_mask``, ``position_ids`` (B, Tp+Tr), ``responses`` (B, Tr).
        The arguments default to verl's ``meta_info`` keys ``micro_batch_size``, ``max_token_len``
        (only with ``use_dynamic_bsz``) and ``temperature`` (required: the sampling temperature).
        """
        meta = data.meta_info
        temperature = float(temperature if temperature is not None else meta["temperature"])
        micro_batch_size = micro_batch_size or meta.get("micro_batch_size")
        if max_token_len is None and meta.get("use_dynamic_bsz", False):
            max_token_len = meta["max_token_len"]
        micros, order = self._micro_batches(data.select(batch_keys=list(_MODEL_INPUTS)), micro_batch_size, max_token_len)
        log_probs, entropies = [], []
        was_training = self.module.training
        self.module.eval()
        plan = self._shared_prompt_plan(micros)
        with torch.no_grad():
            for micro, groups in zip(micros, plan):
                entropy, lp = self._forward_micro_batch(_nonempty(micro, data), temperature, calculate_entropy,
                                                        prompt_groups=groups)
                log_probs.append(lp[: len(micro)])
                entropies.append(entropy[: len(micro)] if entropy is not None else None)
        self.module.train(was_training)
        log_prob = _restore(torch.cat(log_probs), order)
        entropy = _restore(torch.cat(entropies), order) if calculate_entropy else None
        return log_prob, entropy

    # ---- update ---------------------------------------------------------------------------

    def _select_keys(self, data: DataProto) -> list[str]:
        keys = [*_MODEL_INPUTS, "response_mask", "old_log_probs", "advantages"]
        if cfg_get(self.config, "use_kl_loss", False):
            keys.append("ref_log_prob")
        if data.batch is not None and "rollout_is_weights" in data.batch.keys():
            keys.append("rollout_is_weights")
        return keys

    def _mini_batches(self, data: DataProto) -> Iterator[DataProto]:
        return iter_mini_batches(
            data, self.sizes.mini_batch_size or len(data), int(cfg_get(self.config, "ppo_epochs", 1)),
            bool(cfg_get(self.config, "shuffle", False)), _mix_seed(self.seed, self.update_calls),
            "(ppo_mini_batch_size × rollout.n / dp size); make train_batch_size a multiple of ppo_mini_batch_size",
        )

    def _global_batch_info(self, mini: DataProto) -> dict[str, Any]:
        """Token and sequence counts of the whole mini-batch over all dp ranks (agg_loss contract)."""
        info = global_batch_info(mini.batch["response_mask"], self.dp_size, self.dp_group)
        scale = cfg_get(self.config, "loss_scale_factor")
        if scale is not None:
            info["loss_scale_factor"] = float(scale)
        return info

    def _micro_loss(self, micro: DataProto, temperature: float, info: dict[str, Any], entropy_metric: bool = False,
                    prompt_groups: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Total loss of one micro-batch (to backpropagate as is), its loss metrics and ratio metrics.

        ``entropy_metric``: report ``actor/entropy`` even when it is not in the loss (the trainer
        skipped the old-log-prob pass that normally measures it); computed without a graph then.
        """
        cfg = self.config
        batch = micro.batch
        mask = batch["response_mask"]
        mode = str(cfg_get(cfg, "loss_agg_mode", "token-mean"))
        entropy_coeff = float(cfg_get(cfg, "entropy_coeff", 0.0))
        in_loss = entropy_coeff != 0
        entropy, log_prob = self._forward_micro_batch(micro, temperature, calculate_entropy=in_loss or entropy_metric,
                                                      entropy_grad=in_loss, prompt_groups=prompt_groups)
        loss_fn = core_algos.get_policy_loss_fn(str(cfg_get(cfg_get(cfg, "policy_loss", {}), "loss_mode", "vanilla")))
        weights = batch["rollout_is_weights"] if "rollout_is_weights" in batch.keys() else None
        pg_loss, ratios = loss_fn(
            old_log_prob=batch["old_log_probs"], log_prob=log_prob, advantages=batch["advantages"],
            response_mask=mask, loss_agg_mode=mode,
            config=core_algos.with_global_batch_info(cfg, info), rollout_is_weights=weights,
        )
        agg = {k: v for k, v in info.items() if k != "dp_size"}
        loss, losses = pg_loss, {"actor/pg_loss": float(pg_loss.detach())}
        if entropy is not None:
            entropy_agg = core_algos.agg_loss(entropy, mask, mode, dp_size=self.dp_size, **agg)
            if in_loss:
                loss = loss - entropy_coeff * entropy_agg
            losses["actor/entropy"] = float(entropy_agg.detach())
        if cfg_get(cfg, "use_kl_loss", False):
            kld = core_algos.kl_penalty(log_prob, batch["ref_log_prob"], str(cfg_get(cfg, "kl_loss_type", "low_var_kl")))
            kl_loss = core_algos.agg_loss(kld, mask, mode, dp_size=self.dp_size, **agg)
            loss = loss + float(cfg_get(cfg, "kl_loss_coef", 0.001)) * kl_loss
            losses["actor/kl_loss"] = float(kl_loss.detach())
        return loss, losses, ratios

    def _optimizer_step(self) -> float:
        """Clip and step; a non-finite grad norm skips the step (weights and moments untouched)."""
        grad_norm = clip_grad_norm_(self.module.parameters(), cfg_get(self.config, "grad_clip", 1.0))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.nonfinite_skips += 1
            logger.warning("actor: non-finite gradient norm (%s); optimiser step skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _update_mini_batch(self, mini: DataProto, temperature: float, use_dynamic_bsz: bool,
                           entropy_metric: bool = False) -> dict[str, float]:
        info = self._global_batch_info(mini)
        stats = _MiniBatchStats()
        max_len = self.sizes.max_token_len if use_dynamic_bsz else None
        micros, _ = self._micro_batches(mini, self.sizes.micro_batch_size, max_len)
        plan = self._shared_prompt_plan(micros)
        with accumulate_unsharded(self.module) as before_backward:
            for i, (micro, groups) in enumerate(zip(micros, plan)):
                empty = len(micro) == 0  # token budgeting may leave a rank one short; FSDP still needs the pass
                micro = _zero_loss_row(mini) if empty else micro
                loss, losses, ratios = self._micro_loss(micro, temperature, info, entropy_metric, groups)
                before_backward(i == len(micros) - 1)
                loss.backward()  # summed over micro-batches: agg_loss already divided by the global count
                stats.add(losses, ratios, 0.0 if empty else float(micro.batch["response_mask"].sum()))
        metrics = stats.reduce(self.dp_size, self.dp_group)
        metrics["actor/grad_norm"] = self._optimizer_step()
        return metrics

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """Run ``ppo_epochs`` passes of mini-batch PPO steps over ``data``; metrics per mini-batch.

        Needs the forward keys plus ``response_mask``, ``old_log_probs``, ``advantages`` (and
        ``ref_log_prob`` with ``use_kl_loss``); ``meta_info["temperature"]`` as in
        ``compute_log_prob``. Returns ``{metric: [one value per optimiser step]}`` with verl's names:
        ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``,
        ``actor/grad_norm``, ``actor/entropy`` (when ``entropy_coeff`` ≠ 0 or
        ``meta_info["calculate_entropy"]``; otherwise the trainer takes it from
        ``compute_log_prob``), ``actor/kl_loss`` (with ``use_kl_loss``), and
        ``actor/nan_skipped`` (steps skipped in this call). Every value is the
        mini-batch-wide number, all-reduced, so it is the same on every rank.
        """
        if self.optimizer is None:
            raise RuntimeError("update_policy called on an actor without an optimiser (a reference policy?)")
        temperature = float(data.meta_info["temperature"])
        use_dynamic_bsz = bool(cfg_get(self.config, "use_dynamic_bsz", False))
        entropy_metric = bool(data.meta_info.get("calculate_entropy", False))
        data = data.select(batch_keys=self._select_keys(data))
        self.module.train()
        return self._run_mini_batches(
            self._mini_batches(data),
            lambda mini: self._update_mini_batch(mini, temperature, use_dynamic_bsz, entropy_metric), "actor",
        )


def _mix_seed(seed: int, call: int) -> int:
    return int(np.random.SeedSequence([seed, call]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _nonempty(micro: DataProto, data: DataProto) -> DataProto:
    """An empty micro-batch replaced by the first row of ``data`` (its outputs are then discarded)."""
    return micro if len(micro) > 0 else data.select(batch_keys=list(_MODEL_INPUTS))[:1]


def _zero_loss_row(mini: DataProto) -> DataProto:
    """One row of ``mini`` with its response mask zeroed: a forward/backward that adds no gradient."""
    row = mini[:1].select(deepcopy=True)  # a copy: the mini-batch itself must keep its mask
    row.batch["response_mask"] = torch.zeros_like(row.batch["response_mask"])
    return row


def _response_lengths(batch) -> torch.Tensor:
    """Real tokens per response (B,): responses are right-padded, so the mask is a prefix of ones."""
    tp = batch["input_ids"].shape[-1] - batch["responses"].shape[-1]
    return batch["attention_mask"][:, tp:].sum(-1)


def _response_padding(batch) -> torch.Tensor:
    """(B, Tr) True where the response is padding."""
    return batch["attention_mask"][:, batch["input_ids"].shape[-1] - batch["responses"].shape[-1]:] == 0


def _longest_response_first(batch) -> list[int]:
    return torch.argsort(_response_lengths(batch), descending=True, stable=True).tolist()


def _trim_response_padding(batch) -> tuple[Any, int]:
    """The model inputs cut after the longest response in ``batch``, and the uncut width.

    The columns cut only hold padding, and the logits they would produce only predict padding:
    no log-prob the loss reads changes.
    """
    full = batch["responses"].shape[-1]
    width = max(1, int(_response_lengths(batch).max())) if batch["responses"].shape[0] else full
    if width >= full:
        return batch, full
    cut = full - width
    trimmed = {k: batch[k][..., :-cut] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    return trimmed, full


def _pad_width(values: torch.Tensor, width: int) -> torch.Tensor:
    """(b, w) -> (b, width), zeros after column w."""
    return values if values.shape[-1] == width else torch.nn.functional.pad(values, (0, width - values.shape[-1]))


def _restore(values: torch.Tensor, order: list[list[int]] | None) -> torch.Tensor:
    return values if order is None else restore_order(values, order)
