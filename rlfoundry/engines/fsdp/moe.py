"""The FSDP engine's mixture-of-experts step: grouped experts at build, and on every update micro-batch
the router's load-balancing and z-losses added to the role's loss, with per-layer router metrics.

The numbers come from ``models/moe.py`` (hooks on the routers of the update's own forward). What the
engine adds: the coefficients (the model config's, as transformers applies them: ``router_loss_coefficients``),
the loss's global-batch scaling (per-sequence losses summed and divided by the mini-batch's sequence
count, times the data-parallel size, as ``core_algos.agg_loss``'s seq-mean modes: the update is the same
whatever the micro-batches and ranks), and the metrics ``moe/aux_loss``, ``moe/z_loss`` and
``moe/layer{i}/...`` in the step's metrics (tallied over the whole mini-batch: ``take_metrics``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfoundry.engines.base import GlobalBatchInfo, LogProbs, LossOutput, Output, say_once
from rlfoundry.engines.fsdp.forward import MicroPlan, trim_response_padding
from rlfoundry.engines.loop import collective_device
from rlfoundry.models import moe

__all__ = ["RouterLosses", "recording"]


@dataclass
class RouterLosses:
    """An MoE model's router record and loss coefficients (``of``: None for a dense model)."""

    recorder: moe.RouterRecorder
    aux_coef: float
    z_coef: float
    packed: bool
    _tallies: torch.Tensor | None = None  # the running mini-batch's router_tallies, summed

    @classmethod
    def of(cls, module: nn.Module, packed: bool, sequence_parallel: bool,
           override: dict[str, Any] | None = None) -> RouterLosses | None:
        """``override``: the role's ``model.override_config`` (keys given there that would do nothing are errors)."""
        config = module.config
        aux_coef, z_coef = moe.router_loss_coefficients(config)
        if not moe.moe_layers(module):
            if getattr(config, "output_router_logits", False):
                raise ValueError(f"model.override_config.output_router_logits=true: {config.model_type} has no routed "
                                 "experts (no mixture-of-experts layers), so there is no router loss to add; remove it")
            return None
        if (override or {}).get("router_z_loss_coef") and not config.output_router_logits:
            raise ValueError("model.override_config.router_z_loss_coef is set but output_router_logits is not true: "
                             "the router losses are off; add model.override_config.output_router_logits=true")
        # transformers would also gather the router logits and compute its own balance loss in every
        # forward (rollout included); the engine's hooks take that job, so the model's own switch is off
        config.output_router_logits = False
        if sequence_parallel:
            if aux_coef or z_coef:
                raise ValueError("model.override_config.output_router_logits=true (MoE router losses) with "
                                 "ulysses_sequence_parallel_size > 1 is not built (each rank sees a slice of a "
                                 "sequence); set ulysses_sequence_parallel_size=1 or output_router_logits=false")
            say_once("MoE under Ulysses sequence parallelism: no router losses or router metrics")
            return None
        losses = (f"load balancing × {aux_coef:g}, z-loss × {z_coef:g}" if aux_coef or z_coef else
                  "off (model.override_config.output_router_logits=true turns them on)")
        say_once(f"MoE router losses: {losses}; router metrics moe/layer{{i}}/* from the update's forward")
        return cls(moe.RouterRecorder(module), aux_coef, z_coef, packed)

    def add_to(self, out: LossOutput, records: dict, micro: Any, entry: Any, info: GlobalBatchInfo,
               mask_key: str) -> LossOutput:
        """``out`` with the router losses added to its loss and the router metrics to its metrics."""
        plan = entry if isinstance(entry, MicroPlan) else MicroPlan(None, entry)
        seen, _ = trim_response_padding(micro.batch, plan.trim)  # the attention mask as the model saw it
        mask = seen["attention_mask"]
        if plan.prompt_groups is not None:  # the shared-prompt forward: a prompt call, then a response call
            group = plan.prompt_groups[1]
            records = {i: [moe.shared_prompt_record(*calls, group)] if len(calls) == 2 else calls
                       for i, calls in records.items()}
        layers = self.recorder.layers
        aux, z = moe.router_losses(records, layers, mask, self.packed)
        counted = (micro.batch[mask_key].sum(-1) > 0).to(aux.dtype)  # a stand-in row (zero_loss_row) counts 0
        scale = info["dp_size"] / max(float(info["global_batch_size"]), 1.0)
        aux, z = (aux * counted).sum() * scale, (z * counted).sum() * scale
        loss = out.loss
        if self.aux_coef:
            loss = loss + self.aux_coef * aux
        if self.z_coef:
            loss = loss + self.z_coef * z
        tallies = moe.router_tallies(records, layers, mask, self.packed)
        self._tallies = tallies if self._tallies is None else self._tallies + tallies
        return LossOutput(loss, {**out.summed, "moe/aux_loss": aux.detach(), "moe/z_loss": z.detach()},
                          out.weighted, out.maxed)

    def take_metrics(self, dp_size: int, group: Any) -> dict[str, float]:
        """The mini-batch's router metrics over all its micro-batches and ranks (one all-reduce of a
        (layers, N + 2) tally and one read, per mini-batch); {} when nothing was recorded."""
        tallies, self._tallies = self._tallies, None
        if tallies is None:
            return {}
        if dp_size > 1:
            tallies = tallies.to(collective_device(group))
            dist.all_reduce(tallies, group=group)
        return moe.router_metrics(tallies.cpu(), self.recorder.layers)


@contextlib.contextmanager
def recording(losses: RouterLosses | None, output: Output) -> Iterator[dict | None]:
    """The routers' record of a causal LM's update forward (None: nothing to record)."""
    if losses is None or not isinstance(output, LogProbs):
        yield None
        return
    with losses.recorder.recording() as records:
        yield records
