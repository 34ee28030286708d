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
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlfoundry.protocol import PAD_KEY, DataProto, data_parallel_share

__all__ = [
    "EnginePlugin",
    "EngineRequest",
    "GlobalBatchInfo",
    "LogProbs",
    "LossFn",
    "LossOutput",
    "MicroBatching",
    "Output",
    "TrainingEngine",
    "UpdatePlan",
    "Values",
    "say_once",
]


@dataclass(frozen=True)
class LogProbs:
    """Ask a causal LM for ``log_probs`` (B, Tr) of ``responses`` (and ``entropy`` (B, Tr)).

    Logits are divided by ``temperature`` (the rollout's sampling temperature). ``entropy_grad``
    False: the entropy is only a metric, computed without a graph. ``sum_pi_squared``: also
    ``sum_pi_squared`` (B, Tr), sum_v pi(v|s_t)^2 at the same temperature, without gradient (the
    optimal token baselines' input, verl's ``actor.calculate_sum_pi_squared``). ``routed_experts``: also
    the experts an MoE model's routers chose, (B, Tp+Tr, layers, top_k), -1 at padding (routing replay
    R2's record, ``models/routing_replay.py``). ``topk`` k > 0: also the k likeliest tokens of each
    position, ``topk_ids`` and their ``topk_log_probs`` (B, Tr, k), without gradient (a distillation
    teacher's top-k, and the student's own for its overlap metric). ``log_probs_at``: the name of a
    batch key holding token ids (B, Tr, k); also ``log_probs_at`` (B, Tr, k), the log-probs of those
    tokens, with gradient (the top-k distillation loss's student side). Both normalise over the whole
    vocabulary at ``temperature``.
    """

    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = True
    sum_pi_squared: bool = False
    routed_experts: bool = False
    topk: int = 0
    log_probs_at: str | None = None

    def batch_keys(self) -> tuple[str, ...]:
        """What a forward reads of the batch besides the model inputs (``log_probs_at``'s ids)."""
        return (self.log_probs_at,) if self.log_probs_at is not None else ()


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
    # rows in their given order, cut every ``size`` rows: a loss over groups of consecutive rows (GVPO) sees
    # whole groups (no longest-first reordering)
    in_order: bool = False


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
    ratios): weighted by the micro-batch's counted tokens. ``maxed``: micro-batch maxima (the
    largest over micro-batches and ranks). Either way the reported number is the mini-batch-wide
    one, the same on every rank.
    """

    loss: torch.Tensor
    summed: dict[str, float]
    weighted: dict[str, float]
    maxed: dict[str, float] = {}


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
    def save_checkpoint(self, path: str, extra: dict[str, Any], tokenizer: Any = None,
                        contents: Sequence[str] | None = None) -> str:
        """Model, optimiser, schedule, RNG, the engine's counters and ``extra`` to ``path``. Collective.
        ``contents``: verl's ``checkpoint.save_contents`` list (``checkpoint.Contents``); None: the default."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str, verify: bool = True, contents: Sequence[str] | None = None) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns its ``extra``. Collective. ``verify``:
        check the files against their recorded sizes and checksums first (skip only when the
        caller already did). ``contents``: verl's ``checkpoint.load_contents`` list."""

    @abc.abstractmethod
    def save_hf_model(self, path: str, tokenizer: Any = None, adapter_only: bool = False) -> str:
        """Full weights + config (+ tokenizer) loadable with ``from_pretrained``; ``adapter_only``: a
        LoRA model's peft adapter directory (engines without adapters raise). Collective."""

    @abc.abstractmethod
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) per parameter, one at a time (rollout weight sync). Collective.
        A tensor that needs no gather (unsharded, or replicated over tensor-parallel ranks: norms) may
        be the parameter itself, not a copy: use it before the next update, or ``.clone()`` it to keep
        the values (a stream for sync and export copies nothing it need not)."""

    # ---- hooks an engine overrides where it has the feature (the defaults say it has not) ------

    def rollout_module(self) -> torch.nn.Module | None:
        """An HF module the HF rollout can sample from directly (FSDP: the actor's own), or None: the
        rollout keeps its own copy, refreshed from ``iter_hf_weights`` after every update."""
        return None

    def full_precision(self) -> contextlib.AbstractContextManager | None:
        """A context in which this engine's forwards compute in fp32 (the mismatch audit's recompute of a
        few rows), or None where it cannot without a second copy of the model (sharded mixed precision,
        weights stored in a lower dtype)."""
        return None

    def model_parallel_rows(self, data: DataProto) -> tuple[DataProto, slice]:
        """The rows this rank computes on and where its own rows sit in them: under model parallelism
        (Megatron) the rows of its whole model-parallel group; else its own."""
        return data, slice(0, len(data))

    def trainable_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's own values) of every parameter the optimiser updates: a sharded parameter's
        local shard, written in place by ``copy_`` (``engines/snapshot.py``). Frozen ones are left out:
        they never change, so a copy of the weights need not hold them."""
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                yield name, local_values(param)

    def weights_resident(self) -> contextlib.AbstractContextManager:
        """A context in which ``trainable_parameters`` hold the weights (offloaded ones brought back and
        released again after), for copying them; the optimiser stays where it is."""
        return contextlib.nullcontext()

    def data_parallel_rank(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size): which share of an update's rows it trains."""
        return 0, 1

    def update_rows(self, data: DataProto) -> DataProto:
        """The rows this rank trains on. A dispatch that padded the batch to the world size (a batch that
        divides the data-parallel ranks but not model-parallel ones) must not train its padding: every
        rank then gathers the whole batch, drops the padding and takes its data-parallel rank's share."""
        pad = int(data.meta_info.get(PAD_KEY, 0))
        if not pad:
            return self.model_parallel_rows(data)[0]
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, data.to("cpu"))
        device = data.batch.device if data.batch is not None else "cpu"
        return data_parallel_share(parts, pad, *self.data_parallel_rank()).to(device)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """A LoRA adapter's tensors in peft's file names, on the CPU, copies (they keep the values of
        the call through later updates). Collective."""
        raise NotImplementedError(f"{type(self).__name__} ({self.role}) has no LoRA adapter")

    def adapter_config(self) -> dict[str, Any]:
        """The LoRA adapter's peft config as JSON data (``adapter_config.json``)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.role}) has no LoRA adapter")

    def adapter_disabled(self) -> Any:
        """A context in which the module is its base model (a LoRA run's reference); no-op without an adapter."""
        return contextlib.nullcontext()

    def counters(self) -> dict[str, int]:
        return {"update_calls": self.update_calls, "nonfinite_skips": self.nonfinite_skips}

    def load_counters(self, state: dict[str, int]) -> None:
        self.update_calls = int(state.get("update_calls", 0))
        self.nonfinite_skips = int(state.get("nonfinite_skips", 0))


@dataclass(frozen=True)
class EngineRequest:
    """What a role asks an engine to build, whichever engine the role's ``strategy`` names. The role's
    engine subtrees travel as they are (``fsdp``: its ``fsdp_config``, ``megatron``: its ``megatron``);
    each engine reads its own and ignores the other."""

    model: Any  # the role's typed ``model`` subtree, ``path`` set to the directory to load
    fsdp: Any
    megatron: Any
    optim: Any = None  # None: a frozen model (reference, reward model, rollout-only worker)
    grad_clip: float | None = None
    model_kind: str = "causal_lm"  # causal_lm | token_classification (critic) | sequence_classification
    override_config: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False
    use_shared_prompt: bool = False
    lora: Any = None  # models.lora.LoraSpec: an adapter on the frozen model (trainable models only)
    prepare: Callable[[torch.nn.Module], None] | None = None  # runs on the loaded model before sharding
    ulysses_sequence_parallel_size: int = 1  # the role's key: ranks that split each sequence (FSDP engine)
    use_torch_compile: bool = False  # the role's key: compile the training forward's layers (FSDP engine)
    # rollout.exact_log_probs: the forward's ops batch-invariant (models/batch_invariant.py; FSDP engine)
    exact: bool = False


class EnginePlugin(abc.ABC):
    """A training engine as the rest of the project sees it: registered by name in
    ``config/training_engines.py`` (the ``strategy`` key), it builds engines, says how a role's ranks
    split the data, and checks the configs that name it at start-up. A new engine is its own package
    with one of these, and one line in the table."""

    name: str
    supports_lora: bool = False
    supports_routing_replay: bool = False  # MoE routing replay (R3/R2) in its log-prob and update forwards
    # multi-token prediction (``model.mtp.enable``): builds the model's MTP layers, trains them beside the policy
    # and streams them with ``iter_hf_weights(mtp=True)``
    supports_mtp: bool = False
    # exact mode (rollout.exact_log_probs): its forward runs models/batch_invariant.py's kernels
    supports_exact_log_probs: bool = False
    # the role's key naming the dtype the engine computes in, for engines with their own (None: FSDP2's
    # mixed-precision policy, bf16 on CUDA and fp32 on the CPU by default)
    dtype_key: str | None = None
    # the role's subtree holding the engine's own parallel layout, which its ``check`` names (verl's SFT engine
    # group is that subtree: trainer/sft_trainer.py); None: the role's common keys lay it out (Ulysses, fsdp_config)
    layout_key: str | None = None
    # image prompts and rows (a vision-language model.path): the SFT checks ask; the RL roles' ``check`` says itself
    supports_vision_language: bool = False

    @abc.abstractmethod
    def build(self, request: EngineRequest, device: torch.device | str, role: str) -> TrainingEngine:
        """The engine for one role on this rank. Collective over the role's ranks."""

    def data_parallel_size(self, world_size: int, megatron: Any, sequence_parallel: int = 1) -> int:
        """How many data-parallel ranks a role's ``world_size`` ranks form (``megatron``: the role's
        ``megatron`` subtree, for engines with model parallelism; ``sequence_parallel``: its
        ``ulysses_sequence_parallel_size``, for engines that split sequences)."""
        return world_size

    def data_parallel_rank(self, role: Any, rank: int, world_size: int) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size) for the role subtree ``role``, before its engine
        is built (which rows a data loader gives this rank): here the consecutive ranks holding one model copy
        (``model_copy``) read the same rows. An engine whose own process groups order the ranks sets them up here."""
        copy = max(1, self.model_copy(role)[0])
        return rank // copy, world_size // copy

    def teardown(self) -> None:
        """Undo what this engine's ``build`` (or ``data_parallel_rank``) set up for the whole process (its own
        process groups), before the caller destroys the default group: a later run in the process lays its ranks
        out afresh. Nothing here."""

    def optimizer_fields(self) -> tuple[set[str], str]:
        """What verl's ``optim.override_optimizer_config`` may set on this engine's optimizer, and what those
        names are (for the error about the others)."""
        import inspect

        return set(inspect.signature(torch.optim.AdamW).parameters), "torch.optim.AdamW arguments"

    def optimizer_problems(self, key: str, overrides: dict, role: Any = None) -> list[str]:
        """Start-up errors for accepted ``override_optimizer_config`` values this engine cannot honour here
        (``key``: the overrides' own key; ``role``: the role's subtree, None where unknown)."""
        return []

    def sequence_split(self, role: Any) -> tuple[int, str]:
        """How many ranks split one sequence for the role subtree ``role`` (a dynamic batch's per-GPU token
        budget holds that many times the key's tokens), and the key that says so."""
        return int(role.ulysses_sequence_parallel_size or 1), "ulysses_sequence_parallel_size"

    def model_copy(self, role: Any) -> tuple[int, str]:
        """How many consecutive ranks hold one copy of the model for the role subtree ``role`` (they read the same
        rows), and the keys that say so: here a Ulysses group (a size below 1 is returned for the caller to report)."""
        return int(role.ulysses_sequence_parallel_size), "ulysses_sequence_parallel_size"

    def adopt(self, cfg: Any, roles: list[str], user_keys: list[str]) -> None:
        """Rewrite settings of the config keys ``roles`` that this engine runs otherwise than written but with
        the same results (as verl runs them), warning where ``user_keys`` (the keys the user gave) set them;
        before ``check``."""

    def check(self, cfg: Any, roles: list[str], world_size: int) -> list[str]:
        """Start-up errors for the config keys ``roles`` (e.g. ``actor_rollout_ref.actor``) that name
        this engine: what it does not support, layouts that cannot work."""
        return []


def local_values(param: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's part of ``param`` (a DTensor's local shard, which shares its storage)."""
    return param.to_local() if hasattr(param, "to_local") else param


def say_once(text: str) -> None:
    """An engine's start-up decision, printed once per process where the run's first lines are read."""
    if text not in _said:
        _said.add(text)
        print(f"rlfoundry: engine: {text}", flush=True)


_said: set[str] = set()
