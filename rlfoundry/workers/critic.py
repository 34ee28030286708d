"""The PPO critic (value model): per-token values and the clipped value-loss update.

Two classes, one role:

- :class:`DataParallelPPOCritic` — the clipped value loss, brought to a training engine
  (``engines/``) that runs the forward passes, micro-batches and optimiser steps.
- :class:`CriticWorker` — the ``Worker`` that builds the engine (FSDP2, or Megatron with
  ``critic.strategy=megatron``) from the ``critic`` config subtree and exposes ``init_model``,
  ``compute_values``, ``update_critic``, ``save_checkpoint``, ``load_checkpoint`` and
  ``save_hf_model`` to the driver.

Value model. The Hugging Face backbone with a one-label token-classification head
(``AutoModelForTokenClassification``, ``num_labels=1``), loaded from ``critic.model.path``. That
directory may hold a causal LM (e.g. the actor's weights): its backbone is reused, the LM head is
dropped and the value head is created fresh — we then set it to **zero**, so every value starts
at 0 instead of random noise of the hidden-state scale, and the first GAE advantages are the plain
discounted rewards (the backbone starts learning one step later, once the head is non-zero).
The Megatron engine builds the same model (its value head on the last pipeline stage, ``score.*``
in its HF exports), so a critic moves between the engines through its HF directory.
Classifier dropout is forced to 0 (as verl does): dropout would make values, and hence GAE,
random, and break the micro-batch invariance of the update.

Value alignment (verl's). For a row laid out as ``[prompt (Tp) | response (Tr)]``, the value of
response token t (0-based) is the head output at position ``Tp - 1 + t``: the state after the
prompt and t response tokens, i.e. V(s_t) *before* token t is generated. So values come from
positions ``[Tp-1, Tp+Tr-2]`` — ``logits[:, -Tr-1:-1]`` — and the last position's output (after
the final token) is never used; GAE bootstraps with 0 after the last response token.

Batch semantics match the actor's (see ``workers/actor.py``): ``ppo_mini_batch_size`` counts
prompts, so a rank's mini-batch is ``ppo_mini_batch_size × rollout_n / dp`` rows; every micro-batch
loss uses the whole mini-batch's token/sequence counts (``agg_loss`` contract), so an update does
not depend on the micro-batch size or the number of ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlfoundry.algos import core_algos
from rlfoundry.config.batch import per_gpu, role_batch
from rlfoundry.config.schema import CriticConfig
from rlfoundry.config.typed import to_typed
from rlfoundry.engines import oom
from rlfoundry.config.training_engines import engine_plugin
from rlfoundry.engines.base import EngineRequest, GlobalBatchInfo, LossOutput, MicroBatching, TrainingEngine, Values
from rlfoundry.models.lora import LoraSpec
from rlfoundry.engines.fsdp.forward import MODEL_INPUTS
from rlfoundry.protocol import DataProto
from rlfoundry.single_controller.base import Dispatch, Worker, register
from rlfoundry.single_controller.base.worker import WorkerRuntime
from rlfoundry.utils import faults
from rlfoundry.utils.torch_functional import masked_mean
from rlfoundry.workers.utils.device import on_device
from rlfoundry.workers.utils.plan import ppo_update_plan

logger = logging.getLogger(__name__)

__all__ = [
    "CriticBatchSizes",
    "DataParallelPPOCritic",
    "CriticWorker",
    "resolve_critic_batch_sizes",
    "zero_init_new_value_head",
]

_UPDATE_KEYS = (*MODEL_INPUTS, "response_mask", "values", "returns")


@dataclass(frozen=True)
class CriticBatchSizes:
    """Per-rank row counts, resolved once by the worker from the global config (never mutated)."""

    mini_batch_size: int = 0  # rows per optimiser step on this rank (0: the whole batch)
    micro_batch_size: int = 1  # rows per forward/backward in update_critic
    forward_micro_batch_size: int = 1  # rows per forward in compute_values
    max_token_len: int = 32768  # token budget per update micro-batch (use_dynamic_bsz)
    forward_max_token_len: int = 32768  # token budget per compute_values micro-batch


class DataParallelPPOCritic:
    """Values and clipped value-loss updates of one value model on one data-parallel rank.

    Args:
        config: the ``critic`` config subtree (``cliprange_value``, ``loss_agg_mode``,
            ``ppo_epochs``, ``shuffle``, ``use_dynamic_bsz``).
        engine: the training engine holding the value model and its optimiser.
        sizes: per-rank batch sizes.
        seed: base seed of the mini-batch shuffling.
    """

    def __init__(self, config: Any, engine: TrainingEngine, sizes: CriticBatchSizes | None = None, seed: int = 0):
        self.config = config
        self.engine = engine
        self.sizes = sizes or CriticBatchSizes()
        self.seed = seed

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values (B, Tr) for the response positions, zero after the response ends.

        Needs ``input_ids``, ``attention_mask``, ``position_ids`` (B, Tp+Tr), ``responses`` and
        ``response_mask`` (B, Tr). Micro-batches follow ``forward_micro_batch_size_per_gpu`` or,
        with ``use_dynamic_bsz``, ``forward_max_token_len_per_gpu`` (rows back in input order).
        """
        dynamic = self.config.use_dynamic_bsz
        micro = MicroBatching(self.sizes.forward_micro_batch_size, self.sizes.forward_max_token_len if dynamic else None)
        values = self.engine.infer_batch(data.select(batch_keys=list(MODEL_INPUTS)), Values(), micro)["values"]
        # Values past the end of a response belong to no state; keep them out of GAE and metrics.
        return values * _response_mask(data).to(values.dtype)

    def value_loss(self, outputs: dict[str, torch.Tensor], batch: Any, info: GlobalBatchInfo) -> LossOutput:
        """PPO's clipped value loss of one micro-batch; ``critic/vf_loss`` summed, clip fraction and
        mean prediction token-weighted."""
        mask, vpreds = batch["response_mask"], outputs["values"]
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds, returns=batch["returns"], values=batch["values"], response_mask=mask,
            cliprange_value=self.config.cliprange_value, loss_agg_mode=self.config.loss_agg_mode,
            **info,
        )
        # 0-d tensors, summed on the device and read once per mini-batch with the grad norm (MiniBatchStats)
        ratios = {"critic/vf_clipfrac": vf_clipfrac.detach(), "critic/vpred_mean": masked_mean(vpreds.detach(), mask)}
        return LossOutput(vf_loss, {"critic/vf_loss": vf_loss.detach()}, ratios)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """``ppo_epochs`` passes of mini-batch value-loss steps over ``data``; metrics per step.

        Needs the forward keys plus ``response_mask``, ``values`` (rollout-time critic) and
        ``returns``. Returns ``{metric: [one value per optimiser step]}``: ``critic/vf_loss``,
        ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, and
        ``critic/nan_skipped`` (steps skipped in this call).
        """
        plan = ppo_update_plan(
            self.config, self.sizes, self.seed,
            "(critic.ppo_mini_batch_size × rollout_n / dp size); make data.train_batch_size a multiple "
            "of critic.ppo_mini_batch_size",
        )
        return self.engine.train_batch(data.select(batch_keys=list(_UPDATE_KEYS)), Values(), self.value_loss, plan)


def _response_mask(data: DataProto) -> torch.Tensor:
    """``response_mask`` when the rollout wrote one, else the response part of the attention mask."""
    batch = data.batch
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    return batch["attention_mask"][:, -batch["responses"].shape[-1] :]


# ==== the worker ================================================================================


def resolve_critic_batch_sizes(config: CriticConfig, rollout_n: int, dp_size: int) -> CriticBatchSizes:
    """Per-rank sizes from verl's keys (the typed ``critic`` subtree); errors name the numbers that disagree."""
    sizes = role_batch("critic", config.ppo_mini_batch_size, rollout_n, dp_size,
                       per_gpu(config.ppo_micro_batch_size_per_gpu, config.ppo_micro_batch_size, dp_size),
                       config.use_dynamic_bsz, require_micro=True,
                       # a bare critic has always taken a micro-batch above its mini-batch (the engine cuts
                       # at the mini-batch); the driver's start-up check refuses one that does not divide it
                       micro_divides=False)
    micro = sizes.micro_batch_size or 1
    forward = per_gpu(config.forward_micro_batch_size_per_gpu, config.forward_micro_batch_size, dp_size)
    return CriticBatchSizes(
        mini_batch_size=sizes.mini_batch_size,
        micro_batch_size=micro,
        forward_micro_batch_size=max(1, forward or micro),
        max_token_len=config.ppo_max_token_len_per_gpu,
        forward_max_token_len=config.forward_max_token_len_per_gpu,
    )


def _checkpoint_tensor_names(model_dir: Path) -> set[str] | None:
    """Parameter names stored in an HF directory's safetensors files (None if it has none)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


def zero_init_new_value_head(model: nn.Module, model_dir: str | Path) -> bool:
    """Zero the value head if ``model_dir`` did not contain it (a causal-LM directory).

    Returns True if it did so. A head that came with the checkpoint is left as trained.
    """
    head = getattr(model, "score", None)
    stored = _checkpoint_tensor_names(Path(model_dir))
    if not isinstance(head, nn.Linear) or stored is None:
        return False
    if any(name.startswith("score.") for name in stored):
        return False
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    return True


class CriticWorker(Worker):
    """The critic role: one value model per rank, on the FSDP2 or the Megatron engine (module docstring).

    Args:
        config: the ``critic`` config subtree (verl keys: a DictConfig, a dict of the keys to change
            or a ``CriticConfig``), kept typed with the schema's defaults filled in.
        rollout_n: samples per prompt; ``ppo_mini_batch_size`` counts prompts, so a mini-batch is
            ``ppo_mini_batch_size × rollout_n`` rows. Defaults to ``config.rollout_n``.
        seed: base seed of the mini-batch shuffle.
    """

    def __init__(self, config: Any, rollout_n: int | None = None, seed: int = 0,
                 runtime: WorkerRuntime | None = None) -> None:
        super().__init__(runtime)
        self.config = to_typed(CriticConfig, config, name="critic")
        self.rollout_n = rollout_n if rollout_n is not None else self.config.rollout_n
        self.seed = seed
        # Validate now: a bad batch-size combination should fail at start-up, not mid-run.
        dp_size = engine_plugin(self.config.strategy).data_parallel_size(self.world_size, self.config.megatron,
                                                                         self.config.ulysses_sequence_parallel_size)
        self.sizes = resolve_critic_batch_sizes(self.config, self.rollout_n, dp_size)
        self.critic: DataParallelPPOCritic | None = None
        self.engine: TrainingEngine | None = None
        self.tokenizer: Any = None

    # ---- model --------------------------------------------------------------------------------

    def _engine_request(self) -> EngineRequest:
        model = replace(self.config.model, path=self._model_path())
        return EngineRequest(
            model=model, fsdp=model.fsdp_config, megatron=self.config.megatron, optim=self.config.optim,
            grad_clip=self.config.grad_clip, model_kind="token_classification",
            # dropout would make values, and hence GAE, random, and break micro-batch invariance
            override_config={"classifier_dropout": 0.0, **model.override_config},
            gradient_checkpointing=model.enable_gradient_checkpointing,
            # LoRA: the value head (``score``) trains in full beside the adapter
            lora=LoraSpec.of(model, task_type="TOKEN_CLS", modules_to_save=("score",)),
            prepare=self._zero_new_head,  # a fresh value head starts at zero
            ulysses_sequence_parallel_size=self.config.ulysses_sequence_parallel_size,
        )

    def _model_path(self) -> str:
        if self.config.model.path is None:
            raise ValueError("critic.model.path is not set: give the value model's HF directory (often the "
                             "actor's model path)")
        return str(Path(self.config.model.path).expanduser())

    def _zero_new_head(self, module: nn.Module) -> None:
        if zero_init_new_value_head(module, self._model_path()):
            logger.info("critic: %s has no value head; created one initialised to zero", self._model_path())

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        model = self.config.model
        path = str(Path(model.tokenizer_path).expanduser()) if model.tokenizer_path else self._model_path()
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError) as e:  # exports then carry no tokenizer; say so once
            logger.warning("critic: no tokenizer at %s (%s); HF exports will not include one", path, e)
            return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, build the value model's engine (model, AdamW, LR schedule)."""
        self.init_distributed()
        self.engine = engine_plugin(self.config.strategy).build(self._engine_request(), self.device, "critic")
        self.critic = DataParallelPPOCritic(self.config, self.engine, self.sizes, seed=self.seed)
        self.tokenizer = self._load_tokenizer()

    def _require_model(self) -> DataParallelPPOCritic:
        if self.critic is None:
            raise RuntimeError("CriticWorker.init_model() must be called before using the critic")
        return self.critic

    # ---- driver-facing methods ----------------------------------------------------------------

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """Adds ``values`` (B, Tr) for this rank's rows."""
        critic = self._require_model()
        data, mine = self.engine.model_parallel_rows(on_device(data, self.device))
        dynamic = self.config.use_dynamic_bsz
        field = "forward_max_token_len" if dynamic else "forward_micro_batch_size"
        floor = int(data.batch["attention_mask"].sum(-1).max()) if dynamic else 1

        def run(size: int) -> torch.Tensor:
            critic.sizes = replace(critic.sizes, **{field: size})  # an OOM-lowered size stays lowered
            return critic.compute_values(data)

        values = oom.backoff_of(self).run("compute_values", getattr(critic.sizes, field) or len(data), run, floor=floor,
                                          unit="tokens" if dynamic else "rows")
        return DataProto.from_dict(tensors={"values": values[mine].cpu()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One PPO critic update over this rank's rows; metrics in ``meta_info["metrics"]``."""
        critic = self._require_model()
        self.engine.onload()
        data = self.engine.update_rows(on_device(data, self.device))

        def update() -> dict[str, list[float]]:
            faults.inject("update_critic", tensors=data.batch, nan_key="returns")  # tests only (utils/faults.py)
            return critic.update_critic(data)

        metrics = oom.update_or_explain_oom("critic", update, micro_batch_size=critic.sizes.micro_batch_size)
        self.engine.offload()
        metrics["critic/lr"] = [self.engine.step_lr_scheduler()]  # the lr this update used
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> str:
        """Sharded save of model, optimiser, scheduler, RNG and counters to ``local_path``, as
        ``critic.checkpoint.save_contents`` lists (``hf_model``: full weights in ``huggingface/`` too).

        ``local_path`` is ``<default_local_dir>/global_step_N/critic``; the write is atomic (see
        ``checkpoint/state.py``). ``max_ckpt_to_keep`` is accepted for verl's signature
        but retention is the trainer's job: it may only delete old steps once the *whole* new
        step (actor, critic, trainer state) is complete, which a single worker cannot know.
        """
        self._require_model()
        return self.engine.save_checkpoint(local_path, {"global_step": int(global_step)}, tokenizer=self.tokenizer,
                                           contents=self.config.checkpoint.save_contents)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, verify: bool = True) -> int:
        """Restore what ``save_checkpoint`` wrote; returns the saved global step."""
        self._require_model()
        extra = self.engine.load_checkpoint(local_path, verify=verify, contents=self.config.checkpoint.load_contents)
        return int(extra.get("global_step", 0))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, path: str) -> str:
        """Export the full value model (+ tokenizer) as a Hugging Face directory."""
        self._require_model()
        return self.engine.save_hf_model(path, self.tokenizer)
