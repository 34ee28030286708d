"""The Megatron-core training engine: tensor, pipeline (virtual) and data parallelism, the
``TrainingEngine`` contract of ``engines/base.py`` (the same roles and losses as FSDP).

Building: megatron-core's parallel groups over the default process group → the model's chunks from
the HF checkpoint (``bridge.py``) → for a trainable model, megatron-core's DDP (gradient buffers,
data-parallel reduction) and its optimiser (Adam, gradient clipping, optionally the distributed
optimiser that shards its state over the data-parallel ranks) + the LR schedule the FSDP engine uses.
Updates: the same mini-batch loop and global-batch normalisation as FSDP (``engines/loop.py``);
each mini-batch's micro-batches go through megatron-core's pipeline schedule (``forward.py``) and
one optimiser step follows (skipped when the gradient norm is not finite).

Every rank of the world calls each method with its data-parallel rank's rows; tensor- and
pipeline-parallel ranks of one data-parallel rank get the same rows. Outputs and metrics are
computed on the last pipeline stage and broadcast to the others, so every rank returns them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfoundry.config.schema import MegatronConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossFn, LossOutput, MicroBatching, Output, TrainingEngine, UpdatePlan
from rlfoundry.engines.fsdp.forward import MODEL_INPUTS, plain_micro_batches, restore
from rlfoundry.engines.fsdp.utils import build_lr_scheduler
from rlfoundry.engines.loop import MiniBatchStats, global_batch_info, run_update
from rlfoundry.engines.megatron import bridge as mb
from rlfoundry.engines.megatron.forward import response_logits, run_schedule, vocab_parallel_log_probs
from rlfoundry.protocol import DataProto

__all__ = ["MegatronEngine", "MegatronEngineConfig", "torch_dtype"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"megatron.dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class MegatronEngineConfig:
    """What the Megatron engine needs from a role's typed config: its ``megatron`` and ``optim``
    subtrees (``optim=None``: a frozen model) and the gradient clip."""

    path: str
    megatron: MegatronConfig
    optim: OptimConfig | None = None
    grad_clip: float | None = 1.0

    @property
    def trainable(self) -> bool:
        return self.optim is not None


class MegatronEngine(TrainingEngine):
    """See the module docstring."""

    def __init__(self, config: MegatronEngineConfig, device: torch.device | str = "cpu", role: str = "actor"):
        from megatron.core import parallel_state as ps

        self.config, self.device, self.role = config, torch.device(device), role
        m = config.megatron
        mb.initialize_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                               m.virtual_pipeline_model_parallel_size, m.context_parallel_size, seed=m.seed)
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.bridge = mb.build_bridge(config.path, torch_dtype(m.dtype), self._transformer_overrides())
        chunks = mb.build_model(self.bridge, self.device)
        mb.load_hf_weights(self.bridge, chunks, config.path)
        self.optimizer = self.lr_scheduler = None
        if config.trainable:
            chunks, self.optimizer = self._wrap_for_training(chunks)
            self.lr_scheduler = build_lr_scheduler(self.optimizer.optimizer, config.optim)
        else:
            for chunk in chunks:
                chunk.requires_grad_(False)
        self.chunks = chunks

    def _transformer_overrides(self) -> dict[str, Any]:
        m = self.config.megatron
        # sequence parallelism reduce-scatters activations, which gloo (the CPU back end) cannot
        sp = m.sequence_parallel and m.tensor_model_parallel_size > 1 and self.device.type == "cuda"
        return {"sequence_parallel": sp, **m.override_transformer_config}

    def _wrap_for_training(self, chunks: list[nn.Module]):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        m, o = self.config.megatron, self.config.optim
        config = chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=m.use_distributed_optimizer)
        wrapped = [DistributedDataParallel(config, ddp, chunk) for chunk in chunks]
        dtype = torch_dtype(m.dtype)
        optim = OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
            adam_eps=o.eps, clip_grad=float(self.config.grad_clip or 0.0),
            use_distributed_optimizer=m.use_distributed_optimizer,
            bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16, params_dtype=dtype,
        )
        return wrapped, get_megatron_optimizer(optim, wrapped)

    @property
    def module(self) -> nn.Module:
        return self.chunks[0]

    # ---- forward ------------------------------------------------------------------------------

    def _outputs(self, spec: LogProbs):
        def outputs(logits: torch.Tensor, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            responses = micro["responses"]
            logits = response_logits(logits, responses.shape[1])
            if spec.temperature != 1.0:
                logits = logits / spec.temperature
            log_probs, entropy = vocab_parallel_log_probs(logits, responses, spec.entropy, spec.entropy_grad)
            padding = micro["attention_mask"][:, -responses.shape[1]:] == 0
            out = {"log_probs": log_probs.masked_fill(padding, 0.0)}
            if entropy is not None:
                out["entropy"] = entropy.masked_fill(padding, 0.0)
            return out
        return outputs

    def _require_log_probs(self, output: Output) -> LogProbs:
        if not isinstance(output, LogProbs):
            raise NotImplementedError(f"{self.role}: the Megatron engine computes causal-LM log-probs only "
                                      f"(asked for {type(output).__name__})")
        return output

    def infer_batch(self, data: DataProto, output: Output, micro: MicroBatching) -> dict[str, torch.Tensor]:
        spec = self._require_log_probs(output)
        inputs = data.select(batch_keys=[k for k in MODEL_INPUTS if k in data.batch.keys()])
        micros, order = plain_micro_batches(inputs, micro, None)
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            outs = run_schedule(self.chunks, [dict(m.batch.items()) for m in micros], self._outputs(spec), loss=None)
        merged = {k: torch.cat([o[k] for o in outs]) for k in outs[0]} if outs else None
        merged = self._from_last_stage(merged)
        return {k: restore(v, order) for k, v in merged.items()}

    # ---- update -------------------------------------------------------------------------------

    def train_batch(self, data: DataProto, output: Output, loss_fn: LossFn, plan: UpdatePlan) -> dict[str, list[float]]:
        if self.optimizer is None:
            raise RuntimeError(f"{self.role}: train_batch on a model built without an optimiser (a reference?)")
        spec = self._require_log_probs(output)
        for chunk in self.chunks:
            chunk.train()
        return run_update(self, data, plan, lambda mini: self._train_mini_batch(mini, spec, loss_fn, plan))

    def _train_mini_batch(self, mini: DataProto, spec: LogProbs, loss_fn: LossFn, plan: UpdatePlan) -> dict[str, float]:
        info = global_batch_info(mini.batch[plan.mask_key], self.dp_size, self.dp_group)
        micros, _ = plain_micro_batches(mini, plan.micro, None)
        stats = MiniBatchStats()

        def loss(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor]):
            out: LossOutput = loss_fn(outputs, micro, info)
            stats.add(out, float(micro[plan.mask_key].sum()))
            return out.loss, {}

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        run_schedule(self.chunks, [dict(m.batch.items()) for m in micros], self._outputs(spec), loss)
        metrics = self._from_last_stage(stats.reduce(self.dp_size, self.dp_group) if self._last_stage() else None)
        metrics[f"{self.role}/grad_norm"] = self._optimizer_step()
        return metrics

    def _optimizer_step(self) -> float:
        """Clip (megatron-core's norm over every parallel group) and step; a non-finite norm skips
        the step, as the FSDP engine does."""
        # megatron-core's optimizer.step() in its three parts, so that a NaN/inf norm can skip the
        # last one (its own step checks for inf only under fp16 loss scaling)
        opt, clip = self.optimizer, float(self.config.grad_clip or 0.0)
        found_inf = opt.prepare_grads()
        grad_norm = float("inf") if found_inf else float(opt.clip_grad_norm(clip) if clip > 0 else opt.get_grad_norm())
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
        the ranks of one model-parallel group (tensor × pipeline) pool theirs, so they all compute
        on the same rows, and each returns the part of the results that belongs to its own rows.
        """
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        size = dist.get_world_size(group)
        if size == 1:
            return data, slice(0, len(data))
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, data.to("cpu"), group=group)
        me = dist.get_rank(group)
        start = sum(len(p) for p in parts[:me])
        return DataProto.concat(parts).to(data.batch.device if data.batch is not None else "cpu"), slice(start, start + len(data))

    # ---- pipeline results ------------------------------------------------------------------

    def _last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True)

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` as the last pipeline stage has it, on every stage."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return value
        box = [value if self._last_stage() else None]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ---- weights ------------------------------------------------------------------------------

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from mb.export_hf_weights(self.bridge, [getattr(c, "module", c) for c in self.chunks])

    def offload(self) -> None:
        pass  # param/grad/optimizer offload: GPU only (not built yet)

    def onload(self) -> None:
        pass

    def save_checkpoint(self, path: str, extra: dict[str, Any], tokenizer: Any = None) -> str:
        raise NotImplementedError("Megatron engine checkpoints are not built yet (issue 19)")

    def load_checkpoint(self, path: str, verify: bool = True) -> dict[str, Any]:
        raise NotImplementedError("Megatron engine checkpoints are not built yet (issue 19)")

    def save_hf_model(self, path: str, tokenizer: Any = None) -> str:
        """Full weights (gathered tensor by tensor) + config (+ tokenizer), written by global rank 0."""
        from pathlib import Path

        from safetensors.torch import save_file
        from transformers import AutoConfig

        weights = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in self.iter_hf_weights()}
        if not dist.is_initialized() or dist.get_rank() == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
            AutoConfig.from_pretrained(self.config.path).save_pretrained(out)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
        if dist.is_initialized():
            dist.barrier()
        return str(path)
