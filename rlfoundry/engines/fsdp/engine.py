"""The FSDP2 training engine: one Hugging Face model, sharded with ``fully_shard``, on the ranks of
one worker group (see ``engines/base.py`` for the contract).

Building: ``load_hf_model`` → Liger's kernels when ``use_liger`` (``models/liger.py``) → a peft LoRA
adapter when ``lora`` is set (``models/lora.py``) → CPU kernels when on (``rlfoundry/cpu``; not with
``use_torch_compile``, whose compiled decoder layers run inside the engine's forwards:
``compile.py``) → ``apply_fsdp2`` (or, alone on one rank with nothing to
shard, the plain module: see "One rank" below) → AdamW over the trainable parameters + LR schedule
(trainable models only). Updates: mini-batches from ``engines/loop.py``, each
cut into micro-batches whose gradients accumulate (with one gather and one reduction per
mini-batch where the units keep their parameters gathered), then clip + step, or skip the step
when the gradient norm is not finite. Checkpoints: ``torch.distributed.checkpoint`` shards with an
atomic publish and a manifest of sizes and checksums (``checkpoint/state.py``).

One rank (``fsdp_config.single_rank=auto``; ``=fsdp`` wraps anyway): a model with nothing to shard or
offload is not wrapped. Computing in its weights' dtype it runs as it is; computing in bf16 over
fp32 weights (CUDA's default ``mixed_precision``) it runs every forward (training, log-probs,
values, the reference's and the reward model's) under ``torch.autocast(dtype=bf16)``: fp32 master
weights, fp32 gradients on them, no ``reduce_dtype`` (nothing is reduced). Both that and FSDP2's
policy are bf16 mixed precision, not the same arithmetic: FSDP2 casts the weights to bf16 and every
op runs in bf16 (the residual stream included) except where the model upcasts (RMSNorm, attention's
softmax); autocast runs matmuls and convolutions in bf16 and keeps the residual stream, norms,
softmax and log-softmax in fp32 — at least as accurate, and what TRL/accelerate's ``bf16`` does.
Log-probs of the two agree within bf16 rounding (tests/engines/test_fsdp_single_rank.py). The
reference keeps fp32 weights under the same autocast, so it computes what the actor computes from
the same weights (KL 0 at the first step, as under FSDP2). The HF rollout decodes from a bf16 copy
of the weights (``utils.decode_copy``), refreshed on every ``on_actor_update``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import (
    LogProbs,
    LossFn,
    MicroBatching,
    Output,
    TrainingEngine,
    UpdatePlan,
    Values,
    say_once,
)
from rlfoundry.engines.fsdp import expert_parallel as ep
from rlfoundry.engines.fsdp import ulysses
from rlfoundry.engines.fsdp.compile import CompiledLayers, compile_problems, is_vision_model
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.engines.fsdp import moe as fsdp_moe
from rlfoundry.engines.fsdp.forward import (
    MODEL_INPUTS,
    ROUTED_EXPERTS,
    CausalLMForward,
    model_batch,
    plain_context,
    plain_micro_batches,
    restore,
    summary_entries,
    value_forward,
    value_micro_batches,
)
from rlfoundry.engines.fsdp.fused_head import fused_kernels_wanted
from rlfoundry.models.batch_invariant import apply_exact
from rlfoundry.engines.loop import MiniBatchStats, global_batch_info, run_update, zero_loss_row
from rlfoundry import cpu as cpu_kernels
from rlfoundry.models import lora as lora_lib
from rlfoundry.models import moe as moe_lib
from rlfoundry.models.hf import load_hf_model
from rlfoundry.models.liger import apply_liger
from rlfoundry.models.routing_replay import routing_replay_of
from rlfoundry.models.vision import freeze_vision_tower
from rlfoundry.protocol import DataProto

__all__ = ["FSDPEngine", "FSDPEngineConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FSDPEngineConfig:
    """What the FSDP engine needs from a role's typed config (``config/schema.py`` holds the defaults).

    ``fsdp`` and ``optim`` are the role's ``fsdp_config`` and ``optim`` subtrees as they are;
    ``optim=None`` builds a frozen model (reference, reward model, rollout-only worker). The other
    fields are the role's ``model`` keys; the ones a role's schema lacks stay off.
    """

    path: str
    fsdp: FSDPConfig
    optim: OptimConfig | None
    grad_clip: float | None
    cpu_kernels: str
    model_kind: str = "causal_lm"  # causal_lm | token_classification (critic) | sequence_classification
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    use_shared_prompt: bool = False
    lora: lora_lib.LoraSpec | None = None  # an adapter on the frozen model (trainable models only)
    # verl's model.use_fused_kernels / fused_kernel_options: causal-LM log-probs from hidden states in
    # chunks (fused_head.py); a reward model or critic has no vocabulary head, so there it does nothing
    use_fused_kernels: bool = False
    fused_kernel_options: dict[str, Any] = field(default_factory=dict)
    activation_offload: bool = False  # verl's model.enable_activation_offload (fu.activation_offload)
    # Ulysses: groups of this many ranks split each packed sequence (engines/fsdp/ulysses.py)
    ulysses_sequence_parallel_size: int = 1
    freeze_vision_tower: bool = False  # verl's model.freeze_vision_tower (vision-language models)
    # verl's actor/ref use_torch_compile: each decoder layer's forward compiled (engines/fsdp/compile.py);
    # the CPU kernels (model.cpu_kernels=auto) then stay off for this model: dynamo cannot trace them
    use_torch_compile: bool = False
    use_liger: bool = False  # verl's model.use_liger: Liger's Triton kernels patched in (CUDA only; models/liger.py)
    # rollout.exact_log_probs: batch-invariant ops installed in the model (models/batch_invariant.py); the CPU
    # kernels stay off (their oneDNN linears would take the exact ones' place)
    exact: bool = False

    @property
    def trainable(self) -> bool:
        return self.optim is not None

    @classmethod
    def for_model(cls, model: Any, fsdp: FSDPConfig, optim: OptimConfig | None = None, grad_clip: float | None = None,
                  **fields: Any) -> FSDPEngineConfig:
        """From a role's typed ``model`` subtree (its path, trust_remote_code, cpu_kernels and
        use_remove_padding, which every role's schema has, and enable_activation_offload and use_liger
        where it has them); ``fields`` sets (or replaces) the rest."""
        base = dict(path=str(model.path), cpu_kernels=model.cpu_kernels, trust_remote_code=model.trust_remote_code,
                    use_remove_padding=model.use_remove_padding,
                    activation_offload=bool(getattr(model, "enable_activation_offload", False)),
                    freeze_vision_tower=bool(getattr(model, "freeze_vision_tower", False)),
                    use_fused_kernels=bool(getattr(model, "use_fused_kernels", False)),
                    fused_kernel_options=dict(getattr(model, "fused_kernel_options", None) or {}),
                    use_liger=bool(getattr(model, "use_liger", False)))
        return cls(fsdp=fsdp, optim=optim, grad_clip=grad_clip, **{**base, **fields})


class FSDPEngine(TrainingEngine):
    """See the module docstring. ``role`` names the model in metrics (``<role>/grad_norm``) and logs."""

    def __init__(self, module: nn.Module, config: FSDPEngineConfig, device: torch.device | str, role: str = "actor",
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None, dp_group: Any = None):
        """Wrap an already built (and sharded) ``module``; ``FSDPEngine.build`` makes one from an HF path."""
        self.config, self.device, self.role = config, torch.device(device), role
        self.lora = lora_lib.is_lora(module)
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        # Under Ulysses the ranks of an SP group share rows: batch counts and metrics are reduced
        # over the data-parallel group (one rank per SP group); FSDP still spans every rank.
        self.sp = _sequence_parallel(config, dp_group)
        self.batch_group = self.sp.dp_group if self.sp else dp_group
        self.dp_size = self.sp.dp_size if self.sp else self.dp_size
        self.cpu_kernels = _cpu_kernels_on(config, self.device)
        self.compiled = CompiledLayers(fu.get_decoder_layers(module)) if config.use_torch_compile else None
        self._module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        self.moe = fsdp_moe.RouterLosses.of(module, config.use_remove_padding, self.sp is not None,
                                            config.override_config)
        self.lm = CausalLMForward(
            module, self.dp_size, self.batch_group, config.use_remove_padding,
            # the shared-prompt forward is not split by sequence, nor compiled (its KV cache: compile.py)
            config.use_shared_prompt and self.sp is None and self.compiled is None,
            cpu_kernels.fused_shared_prompt_logits if self.cpu_kernels else None,
            fu.continued_forward if self.cpu_kernels else plain_context, sp=self.sp,
            fused_kernels=_fused_kernels(config),
        )

    @classmethod
    def build(cls, config: FSDPEngineConfig, device: torch.device | str, role: str = "actor", dp_group: Any = None,
              prepare: Callable[[nn.Module], None] | None = None) -> FSDPEngine:
        """Load ``config.path``, shard it, and give it AdamW + its LR schedule when trainable.

        ``prepare`` runs on the loaded model before sharding (the critic zeroes a fresh value head).
        """
        device = torch.device(device)
        _fused_kernels(config)  # its start-up errors before the model loads
        module = _build_module(config, device, prepare)
        optimizer = lr_scheduler = None
        if config.trainable:
            optimizer = fu.build_optimizer(module, config.optim)
            lr_scheduler = fu.build_lr_scheduler(optimizer, config.optim)
        engine = cls(module, config, device, role, optimizer, lr_scheduler, dp_group)
        engine.offload()
        return engine

    @property
    def module(self) -> nn.Module:
        return self._module

    # ---- forward ------------------------------------------------------------------------------

    def _micro_batches(self, data: DataProto, output: Output, micro: MicroBatching):
        if self.sp is not None and micro.max_token_len is not None:
            # a per-GPU budget: each rank of an SP group holds 1/sp of the tokens (verl multiplies too)
            micro = MicroBatching(size=micro.size, max_token_len=micro.max_token_len * self.sp.size)
        if isinstance(output, LogProbs):
            return self.lm.micro_batches(data, micro)
        if isinstance(output, Values):
            return value_micro_batches(data, micro, self.lm.group_if_dist(), self.config.use_remove_padding)
        return plain_micro_batches(data, micro, self.lm.group_if_dist())

    def _plan(self, micros: list[DataProto], output: Output) -> list[Any]:
        if isinstance(output, LogProbs):
            return self.lm.plan_entries(micros)
        if isinstance(output, Values):
            return summary_entries(micros)
        return [None] * len(micros)

    def _compiled(self) -> contextlib.AbstractContextManager:
        """The compiled layers for the engine's own forwards and backwards (gradient checkpointing
        recomputes the forward in backward); the rollout, outside, samples with the eager ones."""
        return self.compiled.active() if self.compiled is not None else contextlib.nullcontext()

    def _forward(self, micro: Any, output: Output, plan_entry: Any) -> dict[str, torch.Tensor]:
        with fu.compute_precision(self._module, self.device):  # autocast on the one-rank bf16 path
            return self._forward_in_precision(micro, output, plan_entry)

    def _forward_in_precision(self, micro: Any, output: Output, plan_entry: Any) -> dict[str, torch.Tensor]:
        if isinstance(output, LogProbs):
            return self.lm(micro, output, plan_entry)
        if isinstance(output, Values):
            return value_forward(self._module, micro, self.config.use_remove_padding, self.sp, plan_entry)
        if self.sp is not None:
            raise NotImplementedError(f"{self.role}: a role's own forward function under Ulysses sequence "
                                      "parallelism is not built; use ulysses_sequence_parallel_size=1")
        return output(self._module, micro)

    def model_parallel_rows(self, data: DataProto) -> tuple[DataProto, slice]:
        """Under Ulysses the ranks of one SP group pool their rows and all compute on them."""
        return ulysses.pool_rows(data, self.sp) if self.sp is not None else (data, slice(0, len(data)))

    def data_parallel_rank(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.batch_group), dist.get_world_size(self.batch_group)

    def infer_batch(self, data: DataProto, output: Output, micro: MicroBatching) -> dict[str, torch.Tensor]:
        with self._routing_cleared():
            return self._infer_batch(data, output, micro)

    @contextlib.contextmanager
    def _routing_cleared(self) -> Iterator[None]:
        """A batch's MoE routing replay (set per micro-batch by the forward, ``forward.py``, and kept for the
        recomputation of gradient checkpointing) ends with the call."""
        try:
            yield
        finally:
            state = routing_replay_of(self._module)
            if state is not None:
                state.off()

    def _infer_batch(self, data: DataProto, output: Output, micro: MicroBatching) -> dict[str, torch.Tensor]:
        extra = output.batch_keys() if isinstance(output, LogProbs) else ()
        inputs = data.select(batch_keys=[k for k in (*MODEL_INPUTS, ROUTED_EXPERTS, *extra) if k in data.batch.keys()])
        micros, order = self._micro_batches(inputs, output, micro)
        plan = self._plan(micros, output)
        was_training = self._module.training
        self._module.eval()
        outs: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad(), self._compiled():
            for m, entry in zip(micros, plan):
                # An empty micro-batch (token budgets across ranks) still runs a forward on a
                # stand-in row so FSDP's collectives line up; its output is dropped.
                for k, v in self._forward(model_batch(m if len(m) else inputs[:1]), output, entry).items():
                    outs.setdefault(k, []).append(v[: len(m)])
        self._module.train(was_training)
        return {k: restore(torch.cat(v), order) for k, v in outs.items()}

    # ---- update -------------------------------------------------------------------------------

    def train_batch(self, data: DataProto, output: Output, loss_fn: LossFn, plan: UpdatePlan) -> dict[str, list[float]]:
        if self.optimizer is None:
            raise RuntimeError(f"{self.role}: train_batch on a model built without an optimiser (a reference?)")
        self._module.train()
        with self._routing_cleared():
            return run_update(self, data, plan, lambda mini: self._train_mini_batch(mini, output, loss_fn, plan))

    def _train_mini_batch(self, mini: DataProto, output: Output, loss_fn: LossFn, plan: UpdatePlan) -> dict[str, float]:
        info = global_batch_info(mini.batch[plan.mask_key], self.dp_size, self.batch_group)
        stats = MiniBatchStats()
        micros, _ = self._micro_batches(mini, output, plan.micro)
        entries = self._plan(micros, output)
        with fu.accumulate_unsharded(self._module) as before_backward, self._compiled():
            for i, (micro, entry) in enumerate(zip(micros, entries)):
                empty = len(micro) == 0
                micro = zero_loss_row(mini, plan.mask_key) if empty else micro
                offload = fu.activation_offload(self.device) if self.config.activation_offload else contextlib.nullcontext()
                with offload, fsdp_moe.recording(self.moe, output) as routed:
                    out = loss_fn(self._forward(model_batch(micro), output, entry), micro.batch, info)
                out = self.moe.add_to(out, routed, micro, entry, info, plan.mask_key) if routed is not None else out
                before_backward(i == len(micros) - 1)
                out.loss.backward()  # summed over micro-batches: the loss already divided by the global count
                stats.add(out, 0.0 if empty else micro.batch[plan.mask_key].sum())
        values = stats.gather(self.dp_size, self.batch_group)
        norm = fu.clip_grad_norm_tensor_(self._module.parameters(), self.config.grad_clip)
        # the mini-batch's one read of its numbers: the grad norm (to decide the step) and every metric
        host = torch.cat([norm.reshape(1).to(values), values]).tolist()
        metrics = stats.read(host[1:], self.dp_size)
        metrics[f"{self.role}/grad_norm"] = self._optimizer_step(host[0])
        return {**metrics, **self.moe.take_metrics(self.dp_size, self.batch_group)} if self.moe else metrics

    def _optimizer_step(self, grad_norm: float | None = None) -> float:
        """Clip (unless ``grad_norm`` says the gradients were clipped already) and step; a non-finite grad
        norm skips the step (weights and moments untouched; the gradients are dropped)."""
        if grad_norm is None:
            grad_norm = fu.clip_grad_norm_(self._module.parameters(), self.config.grad_clip)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.nonfinite_skips += 1
            logger.warning("%s: non-finite gradient norm (%s); optimiser step skipped", self.role, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def step_lr_scheduler(self) -> float:
        lr = float(self.lr_scheduler.get_last_lr()[0])
        with warnings.catch_warnings():
            # The schedule counts training steps, also ones whose optimiser step was skipped for a
            # non-finite gradient; torch warns about exactly that order, which is intended here.
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step.*")
            self.lr_scheduler.step()
        return lr

    # ---- offload ------------------------------------------------------------------------------

    def _optimizer_offload_on(self) -> bool:
        return self.optimizer is not None and self.device.type == "cuda" and self.config.fsdp.optimizer_offload

    def offload(self) -> None:
        if self._optimizer_offload_on():
            fu.offload_optimizer(self.optimizer)

    def onload(self) -> None:
        if self._optimizer_offload_on():
            fu.load_optimizer(self.optimizer)

    # ---- checkpoints and weights --------------------------------------------------------------

    def save_checkpoint(self, path: str, extra: dict[str, Any], tokenizer: Any = None,
                        contents: Sequence[str] | None = None) -> str:
        """``contents``: verl's ``checkpoint.save_contents`` (None: model, optimizer, extra)."""
        from rlfoundry import checkpoint as ckpt

        want = ckpt.Contents.of(contents)
        hf_model = (lambda out: self.save_hf_model(str(out), tokenizer)) if want.hf_model else None
        self.onload()
        try:
            # LoRA: the adapter and its optimiser state only (the base is the model directory's)
            meta = {"lora": lora_lib.peft_config_dict(self._module)} if self.lora else {}
            out = ckpt.save_checkpoint(path, self._module, self.optimizer if want.optimizer else None,
                                       self.lr_scheduler if want.extra else None,
                                       extra_state={**extra, "engine": self.counters()}, tokenizer=tokenizer,
                                       trainable_only=self.lora, meta=meta, rng=want.extra, write_hf_model=hf_model)
        finally:
            self.offload()
        return str(out)

    def load_checkpoint(self, path: str, verify: bool = True, contents: Sequence[str] | None = None) -> dict[str, Any]:
        """``contents``: verl's ``checkpoint.load_contents``; without "optimizer" only the weights are
        restored (the optimiser starts afresh), without "extra" neither the LR schedule nor the RNG."""
        from rlfoundry import checkpoint as ckpt

        want = ckpt.Contents.of(contents)
        if self.lora:
            _check_same_adapter(path, lora_lib.peft_config_dict(self._module))
        self.onload()
        try:
            extra = ckpt.load_checkpoint(path, self._module, self.optimizer if want.optimizer else None,
                                         self.lr_scheduler if want.extra else None, verify=verify,
                                         load_rng=want.extra, trainable_only=self.lora)
        finally:
            self.offload()
        self.load_counters(extra.get("engine") or extra.get(self.role, {}))  # older checkpoints: under the role
        return extra

    def save_hf_model(self, path: str, tokenizer: Any = None, adapter_only: bool = False) -> str:
        """A ``from_pretrained`` directory; with LoRA the merged model, or with ``adapter_only`` the
        peft adapter directory (``PeftModel.from_pretrained``)."""
        from rlfoundry import checkpoint as ckpt

        if adapter_only and not self.lora:
            raise ValueError(f"{self.role}: an adapter export needs a LoRA model (model.lora_rank > 0)")
        if not self.lora:
            return str(ckpt.save_hf_model(self._module, tokenizer, path))
        named = self.iter_trainable_weights() if adapter_only else self.iter_hf_weights()
        rank0 = not dist.is_initialized() or dist.get_rank(self.dp_group) == 0
        state = [(k, v.cpu()) if rank0 else None for k, v in named]  # the gather is collective: every rank
        save = lora_lib.save_adapter if adapter_only else lora_lib.save_merged
        return str(ckpt.publish_hf_dir(path, lambda out: save(self._module, state, out), tokenizer, self._module,
                                       self.dp_group))

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors; a LoRA model's adapted weights arrive merged (W + scaling · B A)."""
        named = fu.iter_full_parameters(self._module)
        return lora_lib.merged_hf_weights(self._module, named) if self.lora else named

    def iter_trainable_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(module name, full tensor) of the parameters that train: a LoRA adapter is a few MB. Collective."""
        return fu.iter_full_parameters(self._module, trainable_only=True)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter in peft's file names (``adapter_model.safetensors``'s keys). Collective."""
        return lora_lib.adapter_weights(self._module, self.iter_trainable_weights())

    def adapter_config(self) -> dict[str, Any]:
        return lora_lib.peft_config_dict(self._module)

    def adapter_disabled(self) -> Any:
        """A context in which the module is its base model (a LoRA run's reference policy)."""
        return lora_lib.adapter_disabled(self._module)

    def full_precision(self) -> contextlib.AbstractContextManager | None:
        """fp32 where the weights are fp32: a plain module as it is, or with its autocast off; FSDP2's mixed
        precision casts the weights for every forward (no switch per call), so None there."""
        if any(p.dtype != torch.float32 for p in self._module.parameters()):
            return None
        wrapped = isinstance(self._module, FSDPModule)
        cast = fu.compute_dtype(self.device, (self.config.fsdp.mixed_precision or {}).get("param_dtype"))
        if wrapped and cast != torch.float32:
            return None
        return fu.autocast_off(self._module)

    def rollout_module(self) -> nn.Module:
        """The HF rollout samples from the actor's own (sharded) module: no copy, no sync; from a plain
        module under autocast it decodes from a bf16 copy it refreshes on ``on_actor_update``
        (``fu.plain_autocast_dtype``, ``hf_rollout.HFRollout``)."""
        return self._module


def _check_same_adapter(path: str, mine: dict[str, Any]) -> None:
    """A LoRA checkpoint loads only into an adapter of the same rank on the same modules."""
    from rlfoundry import checkpoint as ckpt
    from rlfoundry.utils.errors import CheckpointMismatchError

    saved = ckpt.read_component_marker(Path(path)).get("lora")
    keys = ("r", "target_modules")
    if saved is not None and any(saved.get(k) != mine.get(k) for k in keys):
        raise CheckpointMismatchError(
            f"{path} holds a LoRA adapter with {({k: saved.get(k) for k in keys})}, this run's adapter has "
            f"{({k: mine.get(k) for k in keys})}; resume with the run's own model.lora_rank / target_modules")


def _sequence_parallel(config: FSDPEngineConfig, dp_group: Any) -> ulysses.SequenceParallel | None:
    size = config.ulysses_sequence_parallel_size
    if size == 1:
        return None
    if dp_group is not None or not config.use_remove_padding:
        raise ValueError("ulysses_sequence_parallel_size > 1 needs model.use_remove_padding=true (verl's rule: "
                         "only packed rows are split by sequence) and the engine on the whole worker group")
    return ulysses.SequenceParallel.create(size)


def _fused_kernels(config: FSDPEngineConfig) -> bool:
    """Whether log-probs take the fused head: start-up errors for what it does not build."""
    return fused_kernels_wanted(config.use_fused_kernels, config.fused_kernel_options, config.model_kind)




def _cpu_kernels_on(cfg: FSDPEngineConfig, device: torch.device) -> bool:
    """``model.cpu_kernels=auto`` on the CPU, unless the layers are compiled (dynamo cannot trace the
    oneDNN linears and the fused forward; the compiled layers take their place)."""
    return cpu_kernels.enabled(cfg.cpu_kernels, device) and not cfg.use_torch_compile and not cfg.exact


def _shard_experts(cfg: FSDPEngineConfig, module: nn.Module, device: torch.device) -> None:
    """Expert parallelism (``fsdp_config.expert_parallel_size``): start-up errors for a layout it cannot take,
    then each rank keeps its experts and dispatches tokens to the others' (``expert_parallel.py``)."""
    size = cfg.fsdp.expert_parallel_size
    ep.check_expert_parallel(size, module, lora=cfg.lora is not None and cfg.trainable, fsdp_size=cfg.fsdp.fsdp_size)
    sharded = ep.ExpertParallel.shard(module, size, device)
    say_once(f"expert parallelism {size}: each rank holds {sharded.experts[0].num_experts} experts of each of "
             f"{len(sharded.experts)} routed layers; tokens reach them by all-to-all")


def _check_compile(cfg: FSDPEngineConfig, module: nn.Module, device: torch.device) -> None:
    problems = compile_problems(ulysses=cfg.ulysses_sequence_parallel_size, vision=is_vision_model(module))
    if problems:
        raise ValueError(f"use_torch_compile=true: {'; '.join(problems)}")
    if cfg.use_shared_prompt:
        say_once("use_torch_compile: rows that share a prompt run the plain forward (the shared-prompt forward "
                  "keeps a KV cache, which the compiled layers do not take)")
    if cpu_kernels.enabled(cfg.cpu_kernels, device):
        say_once("use_torch_compile: decoder layers compiled (torch.compile, dynamic shapes); the CPU kernels "
                  "(model.cpu_kernels) are off for this model, the compiled layers replace them")


def _build_module(cfg: FSDPEngineConfig, device: torch.device, prepare: Callable[[nn.Module], None] | None) -> nn.Module:
    fsdp, mixed = cfg.fsdp, cfg.fsdp.mixed_precision or {}
    module = load_hf_model(
        cfg.path, model_kind=cfg.model_kind, torch_dtype=fsdp.model_dtype, trust_remote_code=cfg.trust_remote_code,
        override_config=cfg.override_config, enable_gradient_checkpointing=cfg.trainable and cfg.gradient_checkpointing,
    )
    grouped = moe_lib.use_grouped_experts(module)
    if grouped:
        say_once(grouped)
    if not cfg.trainable:
        module.requires_grad_(False)
        module.eval()
    elif cfg.freeze_vision_tower:
        say_once(f"model.freeze_vision_tower: {freeze_vision_tower(module):,} vision parameters take no gradient")
    if cfg.use_liger:  # verl patches the HF model before anything wraps it
        say_once(apply_liger(module, device.type))
    if cfg.ulysses_sequence_parallel_size > 1:
        ulysses.install_attention(module, cfg.ulysses_sequence_parallel_size)
    if prepare is not None:
        prepare(module)
    if cfg.lora is not None and cfg.trainable:
        module = lora_lib.apply_lora(module, cfg.lora)
    if cfg.exact:  # after LoRA: its adapters' linears are converted too
        say_once(apply_exact(module.get_base_model() if hasattr(module, "get_base_model") else module))
    if cfg.use_torch_compile:
        _check_compile(cfg, module, device)
    if fsdp.expert_parallel_size > 1:
        _shard_experts(cfg, module, device)
    fast = _cpu_kernels_on(cfg, device)
    if fast:
        say_once(cpu_kernels.apply_cpu_kernels(module, device))
    module_dtype = next(module.parameters()).dtype
    if fsdp.single_rank == "auto" and fu.fsdp_does_nothing(device, mixed.get("param_dtype"),
                                                           fsdp.param_offload or fsdp.offload_policy, module_dtype):
        compute = fu.compute_dtype(device, mixed.get("param_dtype"))
        name = str(compute).removeprefix("torch.")
        if compute != module_dtype:
            setattr(module, fu.AUTOCAST_ATTR, compute)  # every forward autocasts (fu.compute_precision)
            name += f" (torch.autocast over {str(module_dtype).removeprefix('torch.')} weights)"
        say_once(f"one rank computing in {name} with nothing to offload: the model is not wrapped in FSDP2, "
                  "which would only copy and cast weights and gradients (fsdp_config.single_rank=fsdp wraps it)")
        return module.to(device)
    return fu.apply_fsdp2(
        module, device, param_dtype=mixed.get("param_dtype"), reduce_dtype=mixed.get("reduce_dtype"),
        param_offload=fsdp.param_offload, reshard_after_forward=fsdp.reshard_after_forward, fsdp_size=fsdp.fsdp_size,
        layer_units=None if fast else True,  # the plain path keeps FSDP2's per-layer units, as on GPUs
        layer_classes=(fsdp.wrap_policy or {}).get("transformer_layer_cls_to_wrap"),
        forward_prefetch=fsdp.forward_prefetch, offload_policy=fsdp.offload_policy,
    )
