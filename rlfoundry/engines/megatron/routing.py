"""MoE routing replay on the Megatron engine (verl's ``router_replay`` R3 / R2; docs/moe.md), through
megatron-core's own ``RouterReplay``: ``TransformerConfig.moe_enable_routing_replay`` gives each
``TopKRouter`` one, and its ``get_replay_topk`` stands in for the router's top-k inside
``topk_routing_with_score_function``, before the token dispatcher sends anything to another rank.

The semantics are those of the FSDP engine's hooks (``models/routing_replay.py``): only the indices are
replayed; the gate weights are the router's own scores taken at them (megatron-core's arithmetic: with
``moe_router_pre_softmax=False`` the softmax over the k gathered logits, which is HF's renormalised
softmax); a token whose record is ``NO_EXPERT`` (-1) keeps the router's own choice (megatron-core's
replay would gather at -1). In a log-prob pass (no gradient) each layer also notes the tokens whose own
top-k set differs from the replayed one: ``routing_{changed,counted}_tokens`` per row, as FSDP's.

Where the tokens are: a router sees its stage's hidden states (sequence, batch) flattened sequence-major,
this context-parallel rank's two chunks of each row and, with sequence parallelism, this tensor-parallel
rank's slice of them; an expert-parallel rank routes its own rows (dispatch comes after). ``local`` cuts a
(batch, sequence, ...) field to that order, ``_grid`` puts router-ordered values back. A pipeline stage
holds only its layers: the batch's layer ``l`` is the model's ``l``-th MoE layer (``TopKRouter.layer_number``
counts the layers of the whole model), and a record or a tally made on several stages is joined over the
pipeline group.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from rlfoundry.engines.megatron import context_parallel as cpl
from rlfoundry.engines.megatron.forward import model_length
from rlfoundry.models.routing_replay import NO_EXPERT, response_token_mask

__all__ = ["ROUTED_EXPERTS", "MegatronRouting", "moe_layer_pattern"]

ROUTED_EXPERTS = "routed_experts"  # (B, Tp+Tr, layers, top_k), the batch field (engines/fsdp/forward.py's name)
FLAG = "moe_enable_routing_replay"  # megatron-core's TransformerConfig field


class _LayerReplay(RouterReplay):
    """One router's replay: megatron-core's, with ``NO_EXPERT`` keeping the router's own choice; without a
    gradient outside an update, ``changed`` (N,): the tokens with a record whose own top-k set is another (OR
    over the calls); in an update, ``recompute``: what each activation-checkpointed call routed to, for the
    backward's second run of the layer."""

    def __init__(self) -> None:
        super().__init__()
        # megatron-core keeps every instance in one process-wide list; the engine owns its routers' instead
        # (a process holds several models: actor, reference, a test's engines)
        RouterReplay.global_router_replay_instances.remove(self)
        self.changed: torch.Tensor | None = None
        self.training = False  # set per micro-batch: the call belongs to an update's forward
        self.recompute: deque[torch.Tensor] = deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action is None and self.recompute and torch.is_grad_enabled():
            # the backward's run of a recomputed layer (after the micro-batch's forward has ended): the experts
            # its forward used. Backwards run in the order of their forwards on a stage (1F1B and the
            # interleaved schedule alike; each virtual chunk has its own routers), hence first in, first out.
            chosen = self.recompute.popleft().to(scores.device)
            return scores.gather(1, chosen), chosen
        if self.router_replay_action is not RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        given = self.target_topk_idx.to(device=scores.device, dtype=torch.long)
        if given.shape != (scores.shape[0], topk):
            raise ValueError(f"routing replay: routed_experts gives {tuple(given.shape)} (tokens, top_k) to a router "
                             f"call of {scores.shape[0]} tokens with top-{topk} (the batch was laid out differently)")
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = torch.where(given >= 0, given, own)
        if self.training and not torch.is_grad_enabled():
            # an update's forward without a gradient is megatron-core's checkpointed forward (full or selective
            # recompute): the backward runs this layer again, and must route as this call did
            self.recompute.append(chosen)
        elif not torch.is_grad_enabled():
            differs = (own.sort(-1).values != given.sort(-1).values).any(-1) & (given >= 0).all(-1)
            self.changed = differs if self.changed is None else self.changed | differs
        return scores.gather(1, chosen), chosen


def moe_layer_pattern(config: Any) -> list[int]:
    """megatron-core's layer pattern (1: MoE) from ``moe_layer_freq``: every n-th layer, or a list."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return list(freq)


class MegatronRouting:
    """The routing replay of one engine's model chunks on this rank (see the module docstring)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        config = chunks[0].config
        pattern = moe_layer_pattern(config) if config.num_moe_experts else []
        self.num_layers, self.top_k = sum(pattern), int(config.moe_router_topk or 0)
        self.sequence_parallel = bool(config.sequence_parallel)
        # (the model's MoE layer index, the router's replay), this rank's routers in model order
        self.layers: list[tuple[int, _LayerReplay]] = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter) and module.router_replay is not None:
                    self.layers.append((sum(pattern[:module.layer_number - 1]), self._own(module)))
        self.enabled = bool(getattr(config, FLAG, False)) and self.num_layers > 0
        self._seen: dict[int, dict[str, Any]] = {}

    @staticmethod
    def _own(router: TopKRouter) -> _LayerReplay:
        old = router.router_replay
        if old in RouterReplay.global_router_replay_instances:
            RouterReplay.global_router_replay_instances.remove(old)
        router.router_replay = _LayerReplay()
        return router.router_replay

    def _require(self) -> None:
        if self.num_layers == 0:
            raise ValueError("routing replay: the model has no MoE router; set actor_rollout_ref.actor.router_replay."
                             "mode=disabled and actor_rollout_ref.rollout.enable_rollout_routing_replay=false for a "
                             "dense model")
        if not self.enabled:
            raise ValueError(f"routing replay: megatron.override_transformer_config.{FLAG}=false builds the routers "
                             "without megatron-core's RouterReplay; remove that override")

    # ---- one micro-batch ---------------------------------------------------------------------

    @contextlib.contextmanager
    def micro_batch(self, micro: dict[str, torch.Tensor], record: bool, keep: bool = True) -> Iterator[None]:
        """The model call of ``micro`` routes to its ``routed_experts`` (or records its routing); ``keep``:
        what the call recorded or tallied is kept for ``outputs`` (False: a filler micro-batch)."""
        routed = micro.get(ROUTED_EXPERTS)
        if routed is None and not record:
            yield
            return
        self._require()
        if routed is not None:
            if tuple(routed.shape[2:]) != (self.num_layers, self.top_k):
                raise ValueError(f"routed_experts has (layers, top_k) = {tuple(routed.shape[2:])}, but the model routes "
                                 f"{self.num_layers} MoE layers with top-{self.top_k}: the batch was recorded on another "
                                 "model (check actor_rollout_ref.model.path and the rollout's model)")
            tokens = self.local(routed)
        training = torch.is_grad_enabled()
        for layer, replay in self.layers:
            replay.training = training
            if routed is not None:
                replay.set_target_indices(tokens[:, layer])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD if routed is not None
                                            else RouterReplayAction.RECORD)
        try:
            yield
            if keep:
                self._collect(micro)
        finally:
            self.clear()

    def _collect(self, micro: dict[str, torch.Tensor]) -> None:
        """This call's records and tallies (a virtual-pipeline rank calls once per chunk: they add up)."""
        if all(r.recorded_topk_idx is None and r.changed is None for _, r in self.layers):
            return  # a training forward: nothing to hand back
        seen = self._seen.setdefault(id(micro), {"records": {}, "changed": None})
        for layer, replay in self.layers:
            if replay.recorded_topk_idx is not None:
                seen["records"][layer] = replay.recorded_topk_idx
            if replay.changed is not None:
                seen["changed"] = replay.changed if seen["changed"] is None else seen["changed"] | replay.changed

    def clear(self) -> None:
        """After a micro-batch's model call; what a recomputed layer will route to stays until its backward."""
        for _, replay in self.layers:
            replay.clear_indices()
            replay.clear_router_replay_action()
            replay.changed = None
            replay.training = False

    def check_recomputed(self) -> None:
        """After an update's schedule: every recomputed layer's backward took its routing (none left over,
        which a later step would otherwise replay)."""
        left = sum(len(replay.recompute) for _, replay in self.layers)
        for _, replay in self.layers:
            replay.recompute.clear()
        if left:
            raise RuntimeError(f"routing replay: {left} recorded routings of checkpointed MoE layers were never "
                               "recomputed by the backward (the recompute settings and the schedule disagree)")

    # ---- token layout --------------------------------------------------------------------------

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """(b, T, ...) -> (N, ...): this rank's tokens in its routers' order (sequence-major)."""
        # the model's rows are padded for CP / sequence parallelism (forward.py); no record there
        pad = x.new_full((x.shape[0], model_length(x.shape[1], self.sequence_parallel) - x.shape[1], *x.shape[2:]),
                         NO_EXPERT)
        x = torch.cat([x, pad], dim=1)
        if ps.get_context_parallel_world_size() > 1:
            x = cpl.split(x)
        x = x.transpose(0, 1)
        if self.sequence_parallel:
            x = x.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
        return x.reshape(-1, *x.shape[2:])

    def _grid(self, values: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """``local``'s inverse: (N, ...) in router order -> (rows, width, ...)."""
        x = values.reshape(-1, rows, *values.shape[1:])
        if self.sequence_parallel:
            group = ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x.contiguous(), group=group)
            x = torch.cat(parts)
        x = x.transpose(0, 1)
        if ps.get_context_parallel_world_size() > 1:
            x = cpl.gather(x)
        return x[:, :width]

    # ---- after the schedule ----------------------------------------------------------------------

    def outputs(self, micros: list[dict[str, torch.Tensor]], record: bool) -> dict[str, torch.Tensor]:
        """What the pass adds, rows in the order of ``micros``, on every stage: with ``record``
        ``routed_experts`` (B, T, layers, top_k), NO_EXPERT at padding; after a replay without gradient
        ``routing_changed_tokens`` / ``routing_counted_tokens`` (B,) fp32, over response tokens with a record."""
        seen = [self._seen.pop(id(m), {"records": {}, "changed": None}) for m in micros]
        self._seen.clear()
        out: dict[str, torch.Tensor] = {}
        if record:
            out[ROUTED_EXPERTS] = self._pipeline_max(torch.cat([self._recorded(m, s) for m, s in zip(micros, seen)]))
        if micros and ROUTED_EXPERTS in micros[0]:
            out |= self._tally(micros, seen)
        return out

    def _recorded(self, micro: dict[str, torch.Tensor], seen: dict) -> torch.Tensor:
        rows, width = micro["input_ids"].shape
        grid = torch.full((rows, width, self.num_layers, self.top_k), NO_EXPERT, dtype=torch.long,
                          device=micro["input_ids"].device)
        for layer, indices in seen["records"].items():
            grid[:, :, layer] = self._grid(indices, rows, width)
        return grid.masked_fill(~micro["attention_mask"].bool()[..., None, None], NO_EXPERT)

    def _tally(self, micros: list[dict[str, torch.Tensor]], seen: list[dict]) -> dict[str, torch.Tensor]:
        changed = []
        for micro, s in zip(micros, seen):
            rows, width = micro["input_ids"].shape
            flags = s["changed"]
            changed.append(torch.zeros(rows, width, dtype=torch.long, device=micro["input_ids"].device)
                           if flags is None else self._grid(flags.long(), rows, width))
        changed = self._pipeline_max(torch.cat(changed)).bool()
        mask = torch.cat([m["attention_mask"] for m in micros])
        routed = torch.cat([m[ROUTED_EXPERTS] for m in micros])
        counted = response_token_mask(mask, micros[0]["responses"].shape[1]) & (routed >= 0).flatten(2).all(-1)
        return {"routing_changed_tokens": (changed & counted).sum(-1).float(),
                "routing_counted_tokens": counted.sum(-1).float()}

    @staticmethod
    def _pipeline_max(x: torch.Tensor) -> torch.Tensor:
        """Each stage filled its own layers (NO_EXPERT / 0 elsewhere): the element-wise max is the whole model's."""
        if ps.get_pipeline_model_parallel_world_size() > 1:
            x = x.contiguous()
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
        return x
