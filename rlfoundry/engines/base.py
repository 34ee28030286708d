"""The training-engine interface: what a role (actor, critic, reference, reward model, SFT) asks of a
training back end, and nothing about how the back end shards, schedules or stores the model.

A role brings a *loss* (``LossFn``) or asks for an *output* (``LogProbs``, ``Values``, or its own
forward function); the engine owns the model, optimiser and LR schedule, the mini-batch /
micro-batch loop with gradient accumulation and the global-batch loss normalisation, the optimiser
step with clipping and non-finite skip, offload, the checkpoint contract and the stream of
HF-named full weights for rollout sync. FSDP2 (``engines/fsdp``) is one engine; a Megatron-core
engine implements the same methods.

Global-batch contract (why an update does not depend on micro-batch size or rank count): before a
mini-batch, the engine all-reduces its token and sequence counts (``GlobalBatchInfo``); a loss
function divides by those mini-batch-wide counts (``core_algos.agg_loss``), micro-batch gradients
are summed and ranks averaged, so one optimiser step is the same whatever the split.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlfoundry.protocol import DataProto

__all__ = [
    "GlobalBatchInfo",
    "LogProbs",
    "LossFn",
    "LossOutput",
    "MicroBatching",
    "Output",
    "TrainingEngine",
    "UpdatePlan",
    "Values",
]


@dataclass(frozen=True)
class LogProbs:
    """Ask a causal LM for ``log_probs`` (B, Tr) of ``responses`` (and ``entropy`` (B, Tr)).

    Logits are divided by ``temperature`` (the rollout's sampling temperature). ``entropy_grad``
    False: the entropy is only a metric, computed without a graph.
    """

    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = True


@dataclass(frozen=True)
class Values:
    """Ask a one-label token classifier (the critic) for ``values`` (B, Tr): V(s_t) before token t."""


# A role's own forward: (module, micro-batch tensors) -> named outputs with the batch as first dim.
ForwardFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]
Output = LogProbs | Values | ForwardFn


@dataclass(frozen=True)
class MicroBatching:
    """How a batch is cut for one forward(/backward) pass on one rank."""

    size: int | None = None  # rows per micro-batch; None: the whole batch at once
    max_token_len: int | None = None  # token budget per micro-batch (verl's use_dynamic_bsz); wins over size


@dataclass(frozen=True)
class UpdatePlan:
    """How ``train_batch`` walks a rank's rows: verl's ppo_epochs / mini-batch / micro-batch keys."""

    mini_batch_size: int = 0  # rows per optimiser step on this rank; 0: all rows in one step
    micro: MicroBatching = field(default_factory=MicroBatching)
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0  # mixed with the engine's update counter, so a resumed run draws the same order
    mask_key: str = "response_mask"  # which tokens count (loss normalisation, metric weights)
    fix_hint: str = ""  # completes the error when rows do not divide into mini-batches (names the role's keys)


class GlobalBatchInfo(dict):
    """``dp_size``, ``batch_num_tokens``, ``global_batch_size`` of a whole mini-batch over all ranks
    (``core_algos.agg_loss``'s keyword arguments), plus ``loss_scale_factor`` when the role sets it."""


class LossOutput(NamedTuple):
    """One micro-batch's loss (backpropagated as is) and its metrics.

    ``summed``: values already divided by the global counts (losses): summed over micro-batches and
    over ranks, then divided by the rank count. ``weighted``: micro-batch means (clip fractions,
    ratios): weighted by the micro-batch's counted tokens. Either way the reported number is the
    mini-batch-wide one, the same on every rank.
    """

    loss: torch.Tensor
    summed: dict[str, float]
    weighted: dict[str, float]


# (forward outputs of one micro-batch, its tensors, the mini-batch-wide counts) -> LossOutput
LossFn = Callable[[dict[str, torch.Tensor], Any, GlobalBatchInfo], LossOutput]


class TrainingEngine(abc.ABC):
    """One model (trainable or frozen) on one data-parallel group of ranks. Collective methods must
    be called by every rank of the group, in the same order."""

    role: str  # "actor", "critic", ... : names in logs and errors
    dp_size: int
    update_calls: int = 0  # train_batch calls so far: seeds the shuffle; kept in checkpoints
    nonfinite_skips: int = 0  # optimiser steps skipped for a non-finite gradient norm, ever

    @property
    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """The (possibly sharded) model, for rollouts that run on the same weights."""

    @abc.abstractmethod
    def infer_batch(self, data: DataProto, output: Output, micro: MicroBatching) -> dict[str, torch.Tensor]:
        """Forward-only ``output`` for every row of ``data``, in the input order. Collective."""

    @abc.abstractmethod
    def train_batch(self, data: DataProto, output: Output, loss_fn: LossFn, plan: UpdatePlan) -> dict[str, list[float]]:
        """``plan.epochs`` passes of optimiser steps over ``data``: ``{metric: [one value per step]}``
        with ``<role>/grad_norm`` and ``<role>/nan_skipped`` added. Collective."""

    @abc.abstractmethod
    def step_lr_scheduler(self) -> float:
        """Advance the LR schedule one training step; returns the lr the step just taken used."""

    @abc.abstractmethod
    def offload(self) -> None:
        """Free accelerator memory between uses (what ``*_offload`` asked for); no-op otherwise."""

    @abc.abstractmethod
    def onload(self) -> None:
        """Undo ``offload`` before the next use."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str, extra: dict[str, Any], tokenizer: Any = None) -> str:
        """Model, optimiser, schedule, RNG, the engine's counters and ``extra`` to ``path``. Collective."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str, verify: bool = True) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns its ``extra``. Collective. ``verify``:
        check the files against their recorded sizes and checksums first (skip only when the
        caller already did)."""

    @abc.abstractmethod
    def save_hf_model(self, path: str, tokenizer: Any = None) -> str:
        """Full weights + config (+ tokenizer) loadable with ``from_pretrained``. Collective."""

    @abc.abstractmethod
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) per parameter, one at a time (rollout weight sync). Collective."""

    def counters(self) -> dict[str, int]:
        return {"update_calls": self.update_calls, "nonfinite_skips": self.nonfinite_skips}

    def load_counters(self, state: dict[str, int]) -> None:
        self.update_calls = int(state.get("update_calls", 0))
        self.nonfinite_skips = int(state.get("nonfinite_skips", 0))
