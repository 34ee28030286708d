"""The Megatron-core training engine: tensor, pipeline (virtual) and data parallelism, the
``TrainingEngine`` contract of ``engines/base.py`` (the same roles and losses as FSDP).

Building: megatron-core's parallel groups over the default process group → the model's chunks from
the HF checkpoint (``bridge.py``) → for a trainable model, megatron-core's DDP (gradient buffers,
data-parallel reduction) and its optimiser (Adam, gradient clipping, optionally the distributed
optimiser that shards its state over the data-parallel ranks), or with ``use_megatron_fsdp`` megatron-core's
Megatron-FSDP sharding the parameters and gradients too (``megatron_fsdp.py``), + the LR schedule the FSDP engine uses.
Updates: the same mini-batch loop and global-batch normalisation as FSDP (``engines/loop.py``);
each mini-batch's micro-batches go through megatron-core's pipeline schedule (``forward.py``) and
one optimiser step follows (skipped when the gradient norm is not finite).

A critic is the same backbone ending in a one-output value head (``bridge.ValueHead``,
``model_kind="token_classification"`` as in the FSDP engine); it answers ``Values``, the actor and
the reference ``LogProbs``.

Every rank of the world calls each method with its data-parallel rank's rows; tensor- and
pipeline-parallel ranks of one data-parallel rank get the same rows. Outputs and metrics are
computed on the last pipeline stage and broadcast to the others, so every rank returns them.

Offload (verl's ``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``,
``offload.py``): each flag's part is released when the engine is built and after each ``offload()``;
``onload()`` (the workers call it before an update) brings back every part, and a method that needs
a part the caller left released (log-probs, the weight sync, checkpoints) brings back what it needs
for its duration and releases it again on return. Offloaded or not, the numbers are the same bits.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfoundry.config.schema import MegatronConfig, OptimConfig
from rlfoundry.engines.base import (LogProbs, LossFn, LossOutput, MicroBatching, Output, TrainingEngine, UpdatePlan, Values,
                                   say_once)
from rlfoundry.engines.fsdp.forward import MODEL_INPUTS, ROUTED_EXPERTS, plain_micro_batches, restore
from rlfoundry.engines.fsdp.fused_head import fused_kernels_wanted
from rlfoundry.engines.fsdp.utils import build_lr_scheduler
from rlfoundry.engines.loop import MiniBatchStats, global_batch_info, run_update
from rlfoundry.engines.megatron import bridge as mb
from rlfoundry.engines.megatron import megatron_fsdp as mfsdp
from rlfoundry.engines.megatron import moe
from rlfoundry.engines.megatron import offload as off
from rlfoundry.engines.megatron.dist_weights import load_dist_weights, model_sharded_state, save_dist_weights
from rlfoundry.engines.megatron.forward import (context_parallel_size, is_filler, local_next_tokens, next_tokens,
                                                response_logits, response_positions, run_schedule,
                                                vocab_parallel_log_probs, vocab_parallel_topk)
from rlfoundry.engines.megatron.fused_head import COLUMNS, MegatronFusedHead, output_layer
from rlfoundry.protocol import DataProto

__all__ = ["MegatronEngine", "MegatronEngineConfig", "torch_dtype"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


# a Megatron-FSDP checkpoint's optimiser: one file per rank (megatron_fsdp.optimizer_shards)
_FSDP_OPTIM = "megatron_fsdp_optim"
# a role's config subtree, for errors that name its keys
_ROLE_KEYS = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"megatron.dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class MegatronEngineConfig:
    """What the Megatron engine needs from a role's typed config: its ``megatron`` and ``optim``
    subtrees (``optim=None``: a frozen model), the gradient clip, and what the model ends in
    (``causal_lm``: the vocabulary head; ``token_classification``: a critic's value head)."""

    path: str
    megatron: MegatronConfig
    optim: OptimConfig | None = None
    grad_clip: float | None = 1.0
    model_kind: str = "causal_lm"
    load_hf_weights: bool = True  # False: a checkpoint will supply every weight (offline export)
    use_fused_kernels: bool = False  # verl's model.use_fused_kernels: log-probs inside the output layer (fused_head.py)
    fused_kernel_options: dict | None = None
    lora: Any = None  # models.lora.LoraSpec: adapters on the frozen model (lora.py)
    mtp: Any = None  # verl's model.mtp (the actor's): the model's multi-token-prediction layers (mtp.py)

    @property
    def value_model(self) -> bool:
        return self.model_kind == "token_classification"

    @property
    def trainable(self) -> bool:
        return self.optim is not None

    @property
    def mtp_built(self) -> bool:
        return bool(self.mtp is not None and self.mtp.enable)

    @property
    def mtp_trained(self) -> bool:
        return self.mtp_built and bool(self.mtp.enable_train) and self.trainable


class MegatronEngine(TrainingEngine):
    """See the module docstring."""

    def __init__(self, config: MegatronEngineConfig, device: torch.device | str = "cpu", role: str = "actor"):
        from megatron.core import parallel_state as ps

        self.config, self.device, self.role = config, torch.device(device), role
        m = config.megatron
        mb.initialize_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                               m.virtual_pipeline_model_parallel_size, m.context_parallel_size, seed=m.seed,
                               ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size)
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.rows_group = _model_copy_group()
        if config.model_kind not in ("causal_lm", "token_classification"):
            raise ValueError(f"{role}: the Megatron engine builds causal LMs and value models, not {config.model_kind!r}")
        self.bridge = mb.build_bridge(config.path, torch_dtype(m.dtype), self._transformer_overrides(),
                                      use_te=self._lora_layers(), value_model=config.value_model, mtp=config.mtp_built)
        problems = moe.layout_problems(f"{_ROLE_KEYS.get(role, role)}.megatron", self.bridge.hf_config, m,
                                       on_cpu=self.device.type != "cuda", trains=config.trainable)
        if problems:
            raise ValueError(" ".join(problems))
        if config.mtp_built:  # the plug-in said so at start-up for the PPO actor; SFT and direct use meet it here
            from rlfoundry.engines.megatron.mtp import layout_problems

            problems = layout_problems("actor_rollout_ref.model" if role == "actor" else "model", config.mtp,
                                       self.bridge.hf_config, m)
            if problems:
                raise ValueError(" ".join(problems))
        chunks = mb.build_model(self.bridge, self.device, value_head=config.value_model)
        self.sequence_parallel = bool(chunks[0].config.sequence_parallel)  # rows padded for it (forward.py)
        if m.use_dist_checkpointing:  # verl's: the weights from a megatron-core dist checkpoint, not model.path's
            load_dist_weights(chunks, m.dist_checkpointing_path, m.dist_checkpointing_prefix, config.value_model,
                              key=f"{_ROLE_KEYS.get(role, role)}.megatron")
        elif config.load_hf_weights:
            mb.load_hf_weights(self.bridge, chunks, config.path)
        # a frozen engine with adapters: the offline export of a LoRA checkpoint (export.py)
        self.lora = self._attach_lora(chunks) if config.lora is not None else None
        self._mtp = self._attach_mtp(chunks) if config.mtp_built else None
        self.optimizer = self.lr_scheduler = None
        # Megatron-FSDP wraps a trained model only (a frozen one keeps whole weights on every rank)
        self._megatron_fsdp = bool(m.use_megatron_fsdp and config.trainable)
        if self._megatron_fsdp:
            world = dist.get_world_size() if dist.is_initialized() else 1
            problems = mfsdp.problems(_ROLE_KEYS.get(role, role), m, world) + mfsdp.combination_problems(
                _ROLE_KEYS.get(role, role), self.lora is not None,
                bool((config.optim.override_optimizer_config or {}).get("optimizer_cpu_offload")))
            if self._mtp is not None:
                problems.append(f"{_ROLE_KEYS.get(role, role)}.megatron.use_megatron_fsdp=true with model.mtp.enable: "
                                "MTP layers under Megatron-FSDP are not built; set use_megatron_fsdp=false.")
            if problems:
                raise ValueError(" ".join(problems))
        if config.trainable:
            chunks, self.optimizer = self._wrap_for_training(chunks)
            self.lr_scheduler = _lr_schedule(self.optimizer, config.optim)
        else:
            for chunk in chunks:
                chunk.requires_grad_(False)
        self.chunks = chunks
        self._routing = self._routing_replay(chunks)
        fused = fused_kernels_wanted(config.use_fused_kernels, config.fused_kernel_options, config.model_kind)
        if fused and self._mtp is not None:  # verl turns them off with MTP too: the MTP loss needs the plain head
            say_once(f"{role}: use_fused_kernels is off with model.mtp.enable (the MTP loss runs the plain output layer)")
            fused = False
        layer = output_layer(chunks[-1]) if fused else None
        self._fused = MegatronFusedHead(layer) if layer is not None else None  # None: not the last stage
        self._offload = off.StorageOffload(self.device)
        # the parts m.*_offload name (a frozen model has no gradients or optimiser to release)
        asked = {"params": m.param_offload, "grads": m.grad_offload and config.trainable,
                 "optimizer": m.optimizer_offload and config.trainable}
        self.offload_parts = tuple(part for part in off.PARTS if asked[part])
        if self.offload_parts and (not dist.is_initialized() or dist.get_rank() == 0):
            where = ("kept in pinned host memory" if self.device.type == "cuda" else "on the CPU the host is the "
                     "device: what is kept stays in host memory, only released gradients save memory")
            print(f"rlfoundry: engine: {role}: megatron offload releases its {', '.join(self.offload_parts)} "
                  f"between uses ({where})", flush=True)
        self.offload()

    def _routing_replay(self, chunks: list[nn.Module]) -> Any:
        """MoE routing replay (R3 / R2, docs/moe.md; ``routing.py``), for the batches that carry or ask for it
        (a dense model's refuses them)."""
        from rlfoundry.engines.megatron.routing import MegatronRouting

        return MegatronRouting(self._bare_chunks_of(chunks))

    def _lora_layers(self) -> bool | None:
        """LoRA: megatron-core's local layers (False), whose qkv and fc1 take the normalised input the
        adapters need (TransformerEngine's fuse the norm into the linear); else the bridge's choice (None)."""
        if self.config.lora is None:
            return None
        if mb.transformer_engine_available():
            say_once(f"{self.role}: LoRA runs megatron-core's local layers (TransformerEngine's fuse the norm "
                     "into the linears the adapters wrap)")
        return False

    def _attach_lora(self, chunks: list[nn.Module]) -> Any:
        """Adapters on the loaded (now frozen) weights: fresh, or ``lora_adapter_path``'s (lora.py)."""
        from rlfoundry.engines.megatron import lora as ml

        spec = self.config.lora
        # a critic's value head trains in full beside the adapters (modules_to_save, as its peft model on FSDP2)
        layout = ml.LoraLayout(spec.rank, spec.alpha, ml.hf_targets(spec.target_modules), task_type=spec.task_type,
                               modules_to_save=tuple(spec.modules_to_save) if self.config.value_model else ())
        adapters = ml.attach(self.bridge, chunks, layout)
        if spec.adapter_path:
            adapters.load_peft(ml.read_peft_adapter(spec.adapter_path))
        return adapters

    def _attach_mtp(self, chunks: list[nn.Module]) -> Any:
        """The MTP block's loss on the last stage (``mtp.py``); without ``enable_train`` its layers frozen."""
        from rlfoundry.engines.megatron.mtp import MtpTraining

        mtp = self.config.mtp
        owner = [c for c in chunks if getattr(c, "mtp_process", False)]
        if not self.config.mtp_trained:
            for chunk in owner:  # no gradient, so no weight decay either: they stay as loaded
                chunk.mtp.requires_grad_(False)
        return MtpTraining(owner, mtp.mtp_loss_scaling_factor, mtp.detach_encoder) if owner else None

    def _transformer_overrides(self) -> dict[str, Any]:
        m = self.config.megatron
        # verl's rule: sequence parallelism with tensor parallelism only (at TP=1 there is nothing to split over);
        # on CPU processes too (gloo runs its reduce-scatter and all-gather; sequence_parallel.py)
        sp = m.sequence_parallel and m.tensor_model_parallel_size > 1
        return {"sequence_parallel": sp, **m.override_transformer_config}

    def _wrap_for_training(self, chunks: list[nn.Module]):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        m, o = self.config.megatron, self.config.optim
        config = chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        if m.use_megatron_fsdp:  # megatron_fsdp.py: parameters, gradients and optimiser state sharded
            wrapped = [mfsdp.wrap(config, chunk, self.device) for chunk in chunks]
        else:
            ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=m.use_distributed_optimizer)
            wrapped = [DistributedDataParallel(config, ddp, chunk) for chunk in chunks]
        dtype = torch_dtype(m.dtype)
        optim = OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
            adam_eps=o.eps, clip_grad=float(self.config.grad_clip or 0.0),
            # Megatron-FSDP's optimiser is the distributed one over its shards (verl sets it so too)
            use_distributed_optimizer=m.use_distributed_optimizer or m.use_megatron_fsdp,
            bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16, params_dtype=dtype,
            # verl's optim.override_optimizer_config: more OptimizerConfig fields, checked at start-up
            # (trainer/config.py _check_optimizer_overrides: none that an rlfoundry key sets; plugin.py: the
            # CPU optimiser's, optimizer_cpu_offload -> megatron-core's HybridDeviceOptimizer, as verl sets them)
            **dict(o.override_optimizer_config or {}),
        )
        # config_overrides={}: one parameter group, weight decay on every parameter as in the FSDP
        # engine's AdamW (megatron-core's default marks biases and norms wd_mult=0, which only its own
        # LR scheduler applies; the schedule here is the FSDP engine's)
        return wrapped, get_megatron_optimizer(optim, wrapped, config_overrides={})

    @property
    def module(self) -> nn.Module:
        return self.chunks[0]

    def trainable_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every model chunk's (virtual pipeline stages), not only ``module``'s; tensor-parallel shards are
        plain tensors here. Not under Megatron-FSDP (its weights live in sharded buffers, gathered copies
        beside them: the plug-in refuses what would call this, the fully-async proximal log-probs)."""
        if self._megatron_fsdp:
            raise NotImplementedError(f"{self.role}: a copy of the trainable parameters under Megatron-FSDP "
                                      "(use_megatron_fsdp=true) is not built")
        for i, chunk in enumerate(self.chunks):
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    yield f"{i}.{name}", param

    def weights_resident(self) -> contextlib.AbstractContextManager:
        return self.resident("params")  # param_offload empties the parameters' storage between uses

    @property
    def moe_layer_count(self) -> int:
        """The whole model's MoE layers (every pipeline stage's; the mismatch audit's evidence)."""
        return self._routing.num_layers

    # ---- forward ------------------------------------------------------------------------------

    def _outputs(self, spec: LogProbs):
        cp_local = context_parallel_size() > 1  # the logits are this CP rank's positions of each row
        if self._fused is not None:
            return partial(_fused_outputs, spec, cp_local)

        def outputs(logits: torch.Tensor, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            responses = micro["responses"]
            if cp_local:
                labels = local_next_tokens(micro["input_ids"], self.sequence_parallel)
            else:
                logits, labels = response_logits(logits, responses.shape[1]), responses
            if spec.temperature != 1.0:
                logits = logits / spec.temperature
            log_probs, entropy, squares = vocab_parallel_log_probs(logits, labels, spec.entropy, spec.entropy_grad,
                                                                   spec.sum_pi_squared)
            padding = micro["attention_mask"][:, -responses.shape[1]:] == 0
            out = {"log_probs": log_probs, "entropy": entropy, "sum_pi_squared": squares}
            if spec.topk or spec.log_probs_at is not None:  # (top-k distillation; not under CP: _output_fn)
                at = None if spec.log_probs_at is None else micro[spec.log_probs_at]
                out |= vocab_parallel_topk(logits, spec.topk, at)
            if cp_local:
                out = {key: response_positions(v, micro, True) for key, v in out.items() if v is not None}
            return {key: values.masked_fill(padding.view(*padding.shape, *(1,) * (values.dim() - 2)), 0)
                    for key, values in out.items() if values is not None}
        return outputs

    def _model_context(self, output: Output, record: bool = False):
        """What each micro-batch's model call runs in: with ``use_fused_kernels`` the output layer labelled with
        the micro-batch's next tokens (its log-prob columns computed there); with MoE routing replay the
        micro-batch's ``routed_experts`` replayed, or with ``record`` its routing recorded (``routing.py``)."""
        fused = self._fused is not None and isinstance(output, LogProbs)

        @contextlib.contextmanager
        def around(micro: dict[str, torch.Tensor]) -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                if fused:
                    labels = next_tokens(micro["input_ids"], self.sequence_parallel)
                    stack.enter_context(self._fused.labelled(labels, output.temperature, output.entropy_grad,
                                                             output.sum_pi_squared))
                stack.enter_context(self._routing.micro_batch(micro, record, keep=not is_filler(micro)))
                yield
        return around

    @staticmethod
    def _values(output: torch.Tensor, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """V(s_t) before each response token t: the head's output one position earlier (as the FSDP critic)."""
        return {"values": response_positions(output[..., 0].float(), micro, context_parallel_size() > 1)}

    def _output_fn(self, output: Output):
        """What the last stage computes from the model's output for ``output``."""
        if isinstance(output, LogProbs) and (output.topk or output.log_probs_at is not None) and \
                (self._fused is not None or context_parallel_size() > 1):
            raise NotImplementedError(f"{self.role}: top-k log-probs (distillation loss_mode=forward_kl_topk) with the "
                                      "fused head or context parallelism are not built; set use_fused_kernels=false "
                                      "and megatron.context_parallel_size=1")
        if isinstance(output, LogProbs) and not self.config.value_model:
            return self._outputs(output)
        if isinstance(output, Values) and self.config.value_model:
            return self._values
        raise NotImplementedError(f"{self.role}: a Megatron {self.config.model_kind} model cannot compute "
                                  f"{type(output).__name__}")

    def infer_batch(self, data: DataProto, output: Output, micro: MicroBatching) -> dict[str, torch.Tensor]:
        outputs_fn = self._output_fn(output)
        extra = output.batch_keys() if isinstance(output, LogProbs) else ()
        inputs = data.select(batch_keys=[k for k in (*MODEL_INPUTS, ROUTED_EXPERTS, *extra) if k in data.batch.keys()])
        # R2: the log-prob pass records the routing the update will replay
        record = isinstance(output, LogProbs) and output.routed_experts and ROUTED_EXPERTS not in inputs.batch.keys()
        parts, order = plain_micro_batches(inputs, self._per_rank_budget(micro), None)
        micros = [dict(m.batch.items()) for m in parts]
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad(), self.resident("params"):
            outs = run_schedule(self.chunks, micros, outputs_fn, loss=None, around=self._model_context(output, record))
        merged = {k: torch.cat([o[k] for o in outs]) for k in outs[0]} if outs else None
        merged = {**mb.from_last_stage(merged), **self._routing.outputs(micros, record)}
        return {k: restore(v, order) for k, v in merged.items()}

    def _per_rank_budget(self, micro: MicroBatching) -> MicroBatching:
        """A dynamic batch's token budget is per GPU: each CP rank holds 1/CP of the tokens (verl multiplies too)."""
        cp = self.config.megatron.context_parallel_size
        if cp == 1 or micro.max_token_len is None:
            return micro
        return MicroBatching(size=micro.size, max_token_len=micro.max_token_len * cp)

    # ---- update -------------------------------------------------------------------------------

    def train_batch(self, data: DataProto, output: Output, loss_fn: LossFn, plan: UpdatePlan) -> dict[str, list[float]]:
        if self.optimizer is None:
            raise RuntimeError(f"{self.role}: train_batch on a model built without an optimiser (a reference?)")
        outputs_fn = self._output_fn(output)
        for chunk in self.chunks:
            chunk.train()
        with self.resident(*off.PARTS):  # the worker's onload() has brought them back already
            return run_update(self, data, plan,
                              lambda mini: self._train_mini_batch(mini, outputs_fn, loss_fn, plan, self._model_context(output)))

    def _train_mini_batch(self, mini: DataProto, outputs_fn, loss_fn: LossFn, plan: UpdatePlan,
                          around=None) -> dict[str, float]:
        info = global_batch_info(mini.batch[plan.mask_key], self.dp_size, self.dp_group)
        micros, _ = plain_micro_batches(mini, self._per_rank_budget(plan.micro), None)
        stats = MiniBatchStats()
        mtp = self._mtp if self.config.mtp_trained and self._mtp is not None else None
        if mtp is not None:
            mtp.begin(dict(mini.batch.items()), plan.mask_key, self.dp_size, self.dp_group)
            around = _with_mtp(around, mtp)

        def loss(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor]):
            out: LossOutput = loss_fn(outputs, micro, info)
            stats.add(out, micro[plan.mask_key].sum())  # a 0-d tensor: read once with the metrics, not per micro-batch
            extra = mtp.take() if mtp is not None else None  # the MTP block's loss of this micro-batch's forward
            return (out.loss if extra is None else out.loss + extra), {}

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        run_schedule(self.chunks, [dict(m.batch.items()) for m in micros], outputs_fn, loss, around=around)
        self._routing.check_recomputed()
        reduced = stats.reduce(self.dp_size, self.dp_group) if self._last_stage() else None
        if reduced is not None and mtp is not None:
            reduced |= mtp.metrics(self.dp_group)
        metrics = mb.from_last_stage(reduced)
        metrics[f"{self.role}/grad_norm"] = self._optimizer_step()
        return metrics

    def _optimizer_step(self) -> float:
        """Clip (megatron-core's norm over every parallel group) and step; a non-finite norm skips
        the step, as the FSDP engine does."""
        # megatron-core's optimizer.step() in its three parts, so that a NaN/inf norm can skip the
        # last one (its own step checks for inf only under fp16 loss scaling)
        opt, clip = self.optimizer, float(self.config.grad_clip or 0.0)
        found_inf = opt.prepare_grads()
        grad_norm = float("inf") if found_inf else _clip_grad_norm(opt, clip)
        if math.isfinite(grad_norm):
            opt.step_with_ready_grads()
        else:
            self.nonfinite_skips += 1
            logger.warning("%s: non-finite gradient norm (%s); optimiser step skipped", self.role, grad_norm)
        return grad_norm

    def step_lr_scheduler(self) -> float:
        lr = float(self.lr_scheduler.get_last_lr()[0])
        self.lr_scheduler.step()
        return lr

    # ---- rows ---------------------------------------------------------------------------------

    def model_parallel_rows(self, data: DataProto) -> tuple[DataProto, slice]:
        """The rows of this rank's data-parallel rank, and where this rank's own rows sit in them.

        The worker group hands each of the world's ranks 1/world of a batch (``DP_COMPUTE_PROTO``);
        the ranks of one model copy (tensor × context × pipeline) pool theirs, so they all compute
        on the same rows, and each returns the part of the results that belongs to its own rows.
        """
        group = self.rows_group
        size = dist.get_world_size(group)
        if size == 1:
            return data, slice(0, len(data))
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, data.to("cpu"), group=group)
        me = dist.get_rank(group)
        start = sum(len(p) for p in parts[:me])
        return DataProto.concat(parts).to(data.batch.device if data.batch is not None else "cpu"), slice(start, start + len(data))

    def data_parallel_rank(self) -> tuple[int, int]:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), self.dp_size

    # ---- pipeline results ------------------------------------------------------------------

    def _last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True)

    # ---- weights ------------------------------------------------------------------------------

    def _bare_chunks(self) -> list[nn.Module]:
        """The model chunks without megatron-core's DDP wrapper (a frozen model has none)."""
        return self._bare_chunks_of(self.chunks)

    @staticmethod
    def _bare_chunks_of(chunks: list[nn.Module]) -> list[nn.Module]:
        return [mfsdp.inner_module(c) for c in chunks]

    def iter_hf_weights(self, mtp: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF tensors; the MTP layers' only with ``mtp`` (the rollout's sync asks for them only when its
        HF engine drafts with them, ``mtp.enable_rollout``: a causal LM class has no place for them)."""
        from rlfoundry.engines.megatron.mtp import is_mtp_weight

        with self.resident("params") as restored, mfsdp.full_parameters(self.chunks):
            # a tensor that is a parameter's own storage (no gather needed: TP-replicated norms, or
            # any at TP=1) is copied when the parameters go back to the host afterwards, so what the
            # caller keeps stays readable; otherwise it is the live parameter (base.py's contract).
            # Megatron-FSDP's gathered parameters are views into buckets freed afterwards: copied too
            own = off.storage_ids(off.param_tensors(self.chunks)) if "params" in restored else set()
            own |= off.storage_ids(mfsdp.gathered_storages(self.chunks))
            for name, tensor in self._hf_stream():
                if not mtp and is_mtp_weight(name):
                    continue
                if tensor.untyped_storage()._cdata in own:
                    tensor = tensor.detach().clone()
                yield name, tensor

    def _hf_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """mbridge's HF tensors; with LoRA the adapters are set aside for it and merged into its stream."""
        chunks = self._bare_chunks()
        if self.lora is None:
            return mb.export_hf_weights(self.bridge, chunks, value_head=self.config.value_model)

        def merged():
            with self.lora.detached(chunks):
                yield from self.lora.merged(mb.export_hf_weights(self.bridge, chunks, value_head=self.config.value_model))
        return merged()

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter (and a critic's value head) in peft's file names, whole tensors on every rank. Collective."""
        if self.lora is None:
            return super().adapter_weights()
        return self.lora.peft_tensors()

    def adapter_config(self) -> dict[str, Any]:
        """The adapter's ``adapter_config.json`` contents (for ``adapter_weights``)."""
        return self.lora.peft_config()

    def adapter_disabled(self) -> Any:
        return self.lora.disabled() if self.lora is not None else contextlib.nullcontext()

    # ---- offload ----------------------------------------------------------------------------

    def _storages(self, part: str) -> list[torch.UntypedStorage]:
        """The storages of ``part`` now (the optimiser's state appears at its first step), each in
        one part only: gradient buffers sharing a parameter buffer's storage (MXFP8) are the
        parameters', and the optimiser's fp32 shards of fp32 weights are the weights."""
        params = off.param_tensors(self.chunks)
        if part == "params":
            return off.storages(params)
        grads = off.grad_tensors(self.chunks)
        if part == "grads":
            return off.storages(grads, exclude=off.storage_ids(params))
        return off.storages(off.optimizer_tensors(self.optimizer), exclude=off.storage_ids(params + grads))

    def _release(self, part: str) -> None:
        if part == "optimizer" and self.optimizer is None or part == "grads" and not self.config.trainable:
            return
        # gradients are zero between updates (each mini-batch zeroes them first): nothing to keep
        self._offload.release(part, self._storages(part), keep=part != "grads")

    def released(self, part: str) -> bool:
        """Whether ``part`` (``params``, ``grads``, ``optimizer``) is released now."""
        return self._offload.released(part)

    def offload(self) -> None:
        """Release the parts ``megatron.*_offload`` name (nothing when none is set)."""
        for part in self.offload_parts:
            self._release(part)

    def onload(self) -> None:
        """Bring back every released part."""
        for part in off.PARTS:
            self._offload.restore(part)

    @contextlib.contextmanager
    def resident(self, *parts: str) -> Iterator[tuple[str, ...]]:
        """``parts`` on the device for the duration; those it brought back are released again after.
        Yields the parts it brought back."""
        restored = tuple(p for p in parts if self._offload.released(p))
        for part in restored:
            self._offload.restore(part)
        try:
            yield restored
        finally:
            for part in restored:
                self._release(part)

    # ---- checkpoints ------------------------------------------------------------------------

    def _layout(self) -> dict[str, Any]:
        m = self.config.megatron
        return {"engine": "megatron", "tensor_model_parallel_size": m.tensor_model_parallel_size,
                "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": m.virtual_pipeline_model_parallel_size,
                "context_parallel_size": m.context_parallel_size,  # the distributed optimiser shards over data × context
                # the experts' optimiser state is sharded over their own (expert data-parallel) ranks
                "expert_model_parallel_size": m.expert_model_parallel_size,
                "expert_tensor_parallel_size": m.expert_tensor_parallel_size or m.tensor_model_parallel_size,
                "use_distributed_optimizer": m.use_distributed_optimizer}

    def _sharded_state(self, is_loading: bool = False, optimizer: bool = True) -> dict[str, Any]:
        """megatron-core's sharded state dict of the model chunks (and, with ``optimizer``, the optimiser):
        tensors keyed by their place in the whole model, so dist-checkpointing can save and reload any layout."""
        model = model_sharded_state(self._bare_chunks())
        state = {"model": model}
        if self.optimizer is not None and optimizer:
            # is_loading: a fresh optimiser has no moments yet; megatron-core creates them to load into.
            # dp_reshardable: the distributed optimiser's shards as they are (parallel, no gathers);
            # resuming needs the same layout anyway
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        return state

    def _rng_state(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        from rlfoundry import checkpoint as ckpt

        return {**ckpt.get_rng_state(), "megatron_tracker": get_cuda_rng_tracker().get_states()}

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        from rlfoundry import checkpoint as ckpt

        ckpt.set_rng_state(state)
        if "megatron_tracker" in state:
            get_cuda_rng_tracker().set_states(state["megatron_tracker"])

    def _init_optimizer_state(self) -> None:
        """Adam's moments and step count for parameters that have none yet (a fresh optimiser about
        to load a checkpoint): the distributed optimiser's state dict needs a step on every
        parameter when neither apex nor TransformerEngine is installed; the loaded values replace these.
        megatron-core's HybridDeviceOptimizer (``optimizer_cpu_offload``) keeps its state in its
        sub-optimisers (and its fp32 master copies beside Adam's moments): it initialises them with its own
        ``dummy_step`` (a step on random gradients, what megatron-core's load calls once the state dict is
        made, too late without apex/TransformerEngine); the load then replaces the model's weights, the
        master copies, the moments and the step count it changed (and the RNG it drew from)."""
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = part.optimizer
            if off.is_hybrid(inner):
                if not inner.state:
                    inner.dummy_step()
                continue
            for group in inner.param_groups:
                for param in group["params"]:
                    if not inner.state[param]:
                        inner.state[param].update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param),
                                                  step=torch.tensor(0.0))

    def _restore_adam_step(self, state: dict[str, Any]) -> None:
        """torch Adam's per-parameter step count after a distributed-optimiser load. megatron-core
        (0.16, without apex/TransformerEngine) restores it from the saved param groups, then copies
        the sharded parameter state over every per-parameter entry, the step included, and the
        step's entry there is the fresh optimiser's placeholder: set it from the param groups again.
        Several chained optimisers (MoE: the experts' apart) save one state each, keyed by their index."""
        parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        states = [state] if len(parts) == 1 else [state[k] for k in sorted(state)]
        for part, part_state in zip(parts, states):
            groups = (part_state.get("optimizer") or {}).get("param_groups") if "param_state" in part_state else None
            steps = {g["step"] for g in groups or [] if "step" in g}
            if len(steps) != 1:
                continue
            step = float(steps.pop())
            for param_state in part.optimizer.state.values():
                if "step" in param_state:
                    param_state["step"] = torch.tensor(step)

    def save_checkpoint(self, path: str, extra: dict[str, Any], tokenizer: Any = None,
                        contents: Any = None) -> str:
        """Model (+ optimiser) with megatron-core's dist-checkpointing under ``mcore/``, inside the
        project's role directory (atomic publish, manifest, scheduler, RNG, counters; ``checkpoint/state.py``).
        ``contents``: verl's ``checkpoint.save_contents`` (None: model, optimizer, extra): without "optimizer"
        the optimiser state is left out, without "extra" the LR schedule and RNG states; "hf_model" adds
        the full HF weights in ``huggingface/`` (``save_hf_model``, collective)."""
        from megatron.core import dist_checkpointing

        from rlfoundry import checkpoint as ckpt

        want = ckpt.Contents.of(contents)

        def write_shards(staging):
            (staging / "mcore").mkdir(exist_ok=True)
            if self._megatron_fsdp:  # the whole weights (any layout reads them), the optimiser rank by rank
                with mfsdp.full_parameters(self.chunks):
                    dist_checkpointing.save(self._sharded_state(optimizer=False), str(staging / "mcore"))
                if self.optimizer is not None and want.optimizer:
                    (staging / _FSDP_OPTIM).mkdir(exist_ok=True)
                    torch.save(mfsdp.optimizer_shards(self.optimizer), staging / _FSDP_OPTIM / f"rank{dist.get_rank()}.pt")
            else:
                dist_checkpointing.save(self._sharded_state(optimizer=want.optimizer), str(staging / "mcore"))
            if want.hf_model:
                self.save_hf_model(str(staging / ckpt.HF_CONFIG_DIR), tokenizer)

        def write_config(out):
            self._hf_config().save_pretrained(out)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)

        meta = {**self._layout(), "dtype": self.config.megatron.dtype,
                "has_optimizer": self.optimizer is not None and want.optimizer, "has_rng": want.extra,
                "has_hf_model": want.hf_model,
                "lora": self.lora.peft_config() if self.lora is not None else None,
                "megatron_fsdp": self._megatron_fsdp, "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        with self.resident("params", "optimizer"):
            ckpt.save_role(path, write_shards, write_config, self.lr_scheduler if want.extra else None,
                           {**extra, "engine": self.counters()}, meta=meta, rng_state=self._rng_state, rng=want.extra)
        return str(path)

    def load_checkpoint(self, path: str, verify: bool = True, contents: Any = None) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; the model may come from another parallel layout
        (dist-checkpointing reshards it), the optimiser state only from the same one. ``contents``: verl's
        ``checkpoint.load_contents``; without "optimizer" the weights alone (the optimiser starts afresh),
        without "extra" neither the LR schedule nor the RNG."""
        from megatron.core import dist_checkpointing

        from rlfoundry import checkpoint as ckpt

        want = ckpt.Contents.of(contents)  # "hf_model" is a save's (the export beside the shards)
        optimizer = self.optimizer if want.optimizer else None

        def read_shards(root, meta):
            if meta.get("engine") != "megatron":
                raise ValueError(f"{root} was not saved by the Megatron engine (strategy=megatron); "
                                 "load it with the engine that saved it")
            if optimizer is not None and not meta.get("has_optimizer", True):
                raise ValueError(f"{root} was saved without its optimizer state (checkpoint.save_contents had no "
                                 "'optimizer'); load the weights alone with checkpoint.load_contents=['model','extra']")
            saved = {"context_parallel_size": 1, "expert_model_parallel_size": 1, **meta}  # from before CP / EP
            saved.setdefault("expert_tensor_parallel_size", saved.get("tensor_model_parallel_size"))  # before ETP
            same = all(saved.get(k) == v for k, v in self._layout().items())
            _check_same_adapter(root, meta.get("lora"), self.lora.peft_config() if self.lora is not None else None)
            if optimizer is not None and not same:
                raise ValueError(f"{root}: saved with {({k: saved.get(k) for k in self._layout()})}, resumed with "
                                 f"{self._layout()}; resuming training needs the same layout (the model alone reshards)")
            if self._megatron_fsdp or meta.get("megatron_fsdp"):
                return self._load_fsdp_shards(root, meta, optimizer, same)
            if optimizer is not None:
                self._init_optimizer_state()
            state = self._sharded_state(is_loading=True, optimizer=optimizer is not None)
            loaded = dist_checkpointing.load(state, str(root / "mcore"))
            chunks = self._bare_chunks()
            models = [loaded["model"]] if len(chunks) == 1 else [loaded["model"][f"model{i}"] for i in range(len(chunks))]
            for chunk, sd in zip(chunks, models):
                chunk.load_state_dict(sd, strict=False)
            if optimizer is not None:
                with torch.no_grad():  # it copies into views of the (grad-requiring) parameters
                    optimizer.load_state_dict(loaded["optimizer"])
                self._restore_adam_step(loaded["optimizer"])

        with self.resident("params", "optimizer"):
            extra = ckpt.load_role(path, read_shards, self.lr_scheduler if want.extra else None, verify=verify,
                                   load_rng=want.extra, set_rng=self._set_rng_state)
        self.load_counters(extra.get("engine", {}))
        return extra

    def _load_fsdp_shards(self, root: Any, meta: dict[str, Any], optimizer: Any, same: bool) -> None:
        """A Megatron-FSDP checkpoint into a Megatron-FSDP engine of the same layout and world: each rank's
        optimiser parameters and Adam state (``_FSDP_OPTIM``), from which the sharded weights are installed.
        The weights alone (into another layout, or without Megatron-FSDP either side) are not built."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not (self._megatron_fsdp and meta.get("megatron_fsdp") and optimizer is not None and same
                and meta.get("world_size") == world and meta.get("has_optimizer")):
            raise ValueError(f"{root}: loading a checkpoint with use_megatron_fsdp (saved: "
                             f"{bool(meta.get('megatron_fsdp'))}, {meta.get('world_size')} ranks; now: {self._megatron_fsdp}, "
                             f"{world} ranks) is built for resuming training with Megatron-FSDP in the same layout, "
                             "optimizer included; the weights alone, or into another layout, are not built: start from "
                             "the checkpoint's huggingface/ export (checkpoint.save_contents with 'hf_model') instead")
        saved = torch.load(root / _FSDP_OPTIM / f"rank{dist.get_rank()}.pt", weights_only=True)
        mfsdp.load_optimizer_shards(optimizer, self.chunks, saved)

    def save_dist_weights(self, path: str) -> None:
        """The model alone as a dist checkpoint in verl's layout (what ``use_dist_checkpointing`` loads):
        ``rlfoundry.scripts.converter_hf_to_mcore``. Every rank takes part."""
        with self.resident("params"):  # an offloaded engine brings its weights back for the save
            save_dist_weights(self._bare_chunks(), path)

    def _save_adapter(self, path: str) -> str:
        """A peft adapter directory (``PeftModel.from_pretrained(base, path)``), written by global rank 0."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        if self.lora is None:
            raise ValueError(f"{self.role}: an adapter export needs a LoRA model (model.lora_rank > 0)")
        tensors, config = self.lora.peft_tensors(), self.lora.peft_config()
        if not dist.is_initialized() or dist.get_rank() == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
            (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": self.config.path}))
        if dist.is_initialized():
            dist.barrier()
        return str(path)

    def _hf_config(self) -> Any:
        """The HF config of what this engine holds: the checkpoint's, or for a value model the
        family's one-label token classifier (the FSDP critic's layout)."""
        from transformers import AutoConfig, AutoModelForTokenClassification

        if not self.config.value_model:
            from rlfoundry.engines.megatron.mtp import without_mtp
            from rlfoundry.models import mimo  # noqa: F401  (model_type "mimo")

            config = AutoConfig.from_pretrained(self.config.path)
            return config if self.config.mtp_built else without_mtp(config)  # the MTP layers written only if built
        config = AutoConfig.from_pretrained(self.config.path, num_labels=1)
        config.architectures = [AutoModelForTokenClassification._model_mapping[type(config)].__name__]
        config.tie_word_embeddings = False
        return config

    def save_hf_model(self, path: str, tokenizer: Any = None, adapter_only: bool = False) -> str:
        """Full weights (gathered tensor by tensor) + config (+ tokenizer), written by global rank 0."""
        if adapter_only:
            return self._save_adapter(path)
        from pathlib import Path

        from safetensors.torch import save_file

        writer = not dist.is_initialized() or dist.get_rank() == 0
        weights = {}
        for name, tensor in self.iter_hf_weights(mtp=True):  # every rank takes part; only the writer keeps a copy
            if writer:
                weights[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if writer:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
            self._hf_config().save_pretrained(out)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
        if dist.is_initialized():
            dist.barrier()
        return str(path)


def _fused_outputs(spec: LogProbs, cp_local: bool, columns: torch.Tensor, micro: dict[str, torch.Tensor],
                   ) -> dict[str, torch.Tensor]:
    """The last stage's outputs from the fused output layer's (batch, positions, columns): the
    response positions' log-probs (entropy, sum p^2 where asked), padding zero."""
    wanted = {"log_probs": True, "entropy": spec.entropy, "sum_pi_squared": spec.sum_pi_squared}
    responses = micro["responses"]
    padding = micro["attention_mask"][:, -responses.shape[1]:] == 0
    return {key: response_positions(columns[..., COLUMNS.index(key)], micro, cp_local).masked_fill(padding, 0.0)
            for key in COLUMNS if wanted[key]}


def _with_mtp(around: Any, mtp: Any):
    """``around`` (the engine's per-micro-batch context) with the micro-batch handed to the MTP loss too."""
    @contextlib.contextmanager
    def both(micro: dict[str, torch.Tensor]) -> Iterator[None]:
        with (around(micro) if around is not None else contextlib.nullcontext()), mtp.micro_batch(micro):
            yield
    return both


def _clip_grad_norm(optimizer: Any, clip: float) -> float:
    """The gradient norm over every parameter, gradients scaled to ``clip`` when above it (0: no clip).
    megatron-core's ChainedOptimizer of several parts (MoE: the experts') has no clip_grad_norm of its
    own; its step() clips each part by the joint norm, as here (megatron-core's function, looked up at
    call time: on the CPU it is cpu_compat's)."""
    from megatron.core.optimizer import optimizer as mp_optimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) == 1:
        return float(parts[0].clip_grad_norm(clip) if clip > 0 else parts[0].get_grad_norm())
    norm = float(optimizer.get_grad_norm())
    for part in parts if clip > 0 else []:
        params = part.get_parameters()
        if params:
            mp_optimizer.clip_grad_by_total_norm_fp32(
                params, max_norm=clip, total_norm=norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return norm


class _ChainedLR:
    """The same LR schedule on each optimiser megatron-core chains (an MoE model's experts have their
    own: their gradients are reduced over the expert data-parallel group), stepped together; its
    state is one schedule's (all are the same), so checkpoints read as a single schedule's."""

    def __init__(self, schedules: list[Any]):
        self.schedules = schedules

    def step(self) -> None:
        for schedule in self.schedules:
            schedule.step()

    def get_last_lr(self) -> list[float]:
        return self.schedules[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.schedules[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for schedule in self.schedules:
            schedule.load_state_dict(state)


def _lr_schedule(optimizer: Any, optim: OptimConfig) -> Any:
    """The FSDP engine's LR schedule on the torch optimiser(s) inside megatron-core's."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) == 1:
        return build_lr_scheduler(parts[0].optimizer, optim)
    return _ChainedLR([build_lr_scheduler(part.optimizer, optim) for part in parts])


def _model_copy_group() -> Any:
    """The ranks that hold this rank's rows: megatron-core's model-parallel group (tensor × pipeline)
    without CP; with CP, every rank of the same data-parallel rank (megatron-core has no such group)."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return ps.get_model_parallel_group()
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, ps.get_data_parallel_rank())
    mine = None
    for dp_rank in sorted(set(ranks)):  # every rank creates every group, in the same order
        group = dist.new_group([r for r, d in enumerate(ranks) if d == dp_rank])
        if dp_rank == ps.get_data_parallel_rank():
            mine = group
    return mine


def _check_same_adapter(root: Any, saved: dict | None, mine: dict | None) -> None:
    """A LoRA checkpoint resumes into an adapter of the same rank, alpha and targets only (and a full
    model's into no adapter): the shapes, or the meaning of the saved moments, would differ."""
    keys = ("r", "lora_alpha", "target_modules")
    if {k: (saved or {}).get(k) for k in keys} != {k: (mine or {}).get(k) for k in keys}:
        raise ValueError(f"{root}: saved with the LoRA adapter {({k: (saved or {}).get(k) for k in keys})}, this run's is "
                         f"{({k: (mine or {}).get(k) for k in keys})}; resume with the run's own model.lora_rank, "
                         "lora_alpha and target_modules")
