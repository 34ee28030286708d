"""The PPO critic (value model): per-token values and the clipped value-loss update.

Two classes, one role:

- :class:`DataParallelPPOCritic` — the algorithm for one data-parallel rank: a (possibly FSDP2)
  value module and its optimiser in, values and updates out. No worker, Ray or config-tree code.
- :class:`CriticWorker` — the ``Worker`` that builds the model from the ``critic`` config
  subtree and exposes ``init_model``, ``compute_values``, ``update_critic``,
  ``save_checkpoint``, ``load_checkpoint`` and ``save_hf_model`` to the driver.

Value model. The Hugging Face backbone with a one-label token-classification head
(``AutoModelForTokenClassification``, ``num_labels=1``), loaded from ``critic.model.path``. That
directory may hold a causal LM (e.g. the actor's weights): its backbone is reused, the LM head is
dropped and the value head is created fresh — we then set it to **zero**, so every value starts
at 0 instead of random noise of the hidden-state scale, and the first GAE advantages are the plain
discounted rewards (the backbone starts learning one step later, once the head is non-zero).
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
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlfoundry.algos import core_algos
from rlfoundry.models.cpu_linear import use_cpu_linear
from rlfoundry.protocol import DataProto
from rlfoundry.single_controller.base import Dispatch, Worker, register
from rlfoundry.utils import faults
from rlfoundry.utils.torch_functional import masked_mean
from rlfoundry.workers import fsdp_utils
from rlfoundry.workers.fsdp_utils import cfg_get
from rlfoundry.workers.utils import checkpoint as ckpt
from rlfoundry.workers.utils import oom
from rlfoundry.workers.utils.padding import forward_logits
from rlfoundry.workers.utils.seqlen_balancing import rearrange_micro_batches, restore_order
from rlfoundry.workers.utils.update import UpdateCounters, global_batch_info, iter_mini_batches

logger = logging.getLogger(__name__)

__all__ = [
    "CriticBatchSizes",
    "DataParallelPPOCritic",
    "CriticWorker",
    "resolve_critic_batch_sizes",
    "zero_init_new_value_head",
]

_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
_UPDATE_KEYS = (*_MODEL_INPUTS, "response_mask", "values", "returns")


@dataclass(frozen=True)
class CriticBatchSizes:
    """Per-rank row counts, resolved once by the worker from the global config (never mutated)."""

    mini_batch_size: int = 0  # rows per optimiser step on this rank (0: the whole batch)
    micro_batch_size: int = 1  # rows per forward/backward in update_critic
    forward_micro_batch_size: int = 1  # rows per forward in compute_values
    max_token_len: int = 32768  # token budget per update micro-batch (use_dynamic_bsz)
    forward_max_token_len: int = 32768  # token budget per compute_values micro-batch


class _MiniBatchStats:
    """One mini-batch's metrics, made split- and rank-independent by one all-reduce.

    vf_loss pieces are already divided by the global token count, so they are summed;
    clip fraction and mean prediction are weighted by each micro-batch's valid tokens.
    """

    WEIGHTED = ("critic/vf_clipfrac", "critic/vpred_mean")

    def __init__(self) -> None:
        self.vf_loss = 0.0
        self.weighted = dict.fromkeys(self.WEIGHTED, 0.0)
        self.tokens = 0.0

    def add(self, vf_loss: float, ratios: dict[str, float], tokens: float) -> None:
        self.vf_loss += vf_loss
        for k in self.WEIGHTED:
            self.weighted[k] += ratios[k] * tokens
        self.tokens += tokens

    def reduce(self, dp_size: int, group: Any) -> dict[str, float]:
        values = torch.tensor([self.vf_loss, *self.weighted.values(), self.tokens], dtype=torch.float64)
        if dp_size > 1:
            dist.all_reduce(values, group=group)
        # each rank's loss carries a factor dp_size (agg_loss contract); summing over ranks undoes it
        out = {"critic/vf_loss": float(values[0]) / dp_size}
        total = max(float(values[-1]), 1.0)
        out.update({k: float(values[1 + i]) / total for i, k in enumerate(self.WEIGHTED)})
        return out


class DataParallelPPOCritic(UpdateCounters):
    """Values and clipped value-loss updates for one data-parallel rank.

    Args:
        config: the ``critic`` config subtree (``cliprange_value``, ``loss_agg_mode``,
            ``grad_clip``, ``ppo_epochs``, ``shuffle``, ``use_dynamic_bsz``,
            ``model.use_remove_padding``).
        module: the value model (plain or FSDP2), returning ``logits`` of shape (B, T, 1).
        optimizer: its optimiser.
        sizes: per-rank batch sizes.
        dp_group: the data-parallel process group (None: the default group when initialised).
        seed: base seed of the mini-batch shuffling.
    """

    def __init__(
        self,
        config: Any,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        sizes: CriticBatchSizes | None = None,
        dp_group: Any = None,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.module = module
        self.optimizer = optimizer
        self.sizes = sizes or CriticBatchSizes()
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.seed = seed
        self.use_remove_padding = bool(cfg_get(cfg_get(config, "model", {}), "use_remove_padding", False))
        self.update_calls = 0  # seeds the shuffle; saved in checkpoints
        self.nonfinite_skips = 0  # optimiser steps skipped for a non-finite grad norm, ever

    # ---- forward --------------------------------------------------------------------------

    def _forward_micro_batch(self, micro: DataProto) -> torch.Tensor:
        """Values (b, Tr) of one micro-batch; see the module docstring for the alignment."""
        batch = micro.batch
        width = batch["responses"].shape[-1]
        logits = forward_logits(
            self.module, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
            use_remove_padding=self.use_remove_padding,
        )
        return logits[:, -width - 1 : -1, 0].float()

    def _group_if_dist(self) -> Any:
        return (self.dp_group if self.dp_group is not None else dist.group.WORLD) if self.dp_size > 1 else None

    def _micro_batches(
        self, data: DataProto, micro_batch_size: int, max_token_len: int | None
    ) -> tuple[list[DataProto], list[list[int]] | None]:
        """Fixed-size micro-batches, or token-budget ones (same count on every rank) and their order."""
        if max_token_len is not None:
            return rearrange_micro_batches(data, max_token_len=max_token_len, dp_group=self._group_if_dist())
        return data.split(micro_batch_size or len(data)), None

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values (B, Tr) for the response positions, zero after the response ends.

        Needs ``input_ids``, ``attention_mask``, ``position_ids`` (B, Tp+Tr), ``responses`` and
        ``response_mask`` (B, Tr). Micro-batches follow ``forward_micro_batch_size_per_gpu`` or,
        with ``use_dynamic_bsz``, ``forward_max_token_len_per_gpu`` (rows back in input order).
        """
        dynamic = bool(cfg_get(self.config, "use_dynamic_bsz", False))
        max_len = self.sizes.forward_max_token_len if dynamic else None
        inputs = data.select(batch_keys=list(_MODEL_INPUTS))
        micros, order = self._micro_batches(inputs, self.sizes.forward_micro_batch_size, max_len)
        was_training = self.module.training
        self.module.eval()
        with torch.no_grad():
            # An empty micro-batch (possible with token budgets across ranks) still runs a forward
            # on a stand-in row so FSDP's collectives line up; its output is dropped.
            outs = [self._forward_micro_batch(m if len(m) else inputs[:1])[: len(m)] for m in micros]
        self.module.train(was_training)
        values = torch.cat(outs)
        values = values if order is None else restore_order(values, order)
        # Values past the end of a response belong to no state; keep them out of GAE and metrics.
        return values * _response_mask(data).to(values.dtype)

    # ---- update ---------------------------------------------------------------------------

    def _mini_batches(self, data: DataProto) -> Iterator[DataProto]:
        seed = int(np.random.SeedSequence([self.seed, self.update_calls]).generate_state(1)[0])
        return iter_mini_batches(
            data, self.sizes.mini_batch_size or len(data), int(cfg_get(self.config, "ppo_epochs", 1)),
            bool(cfg_get(self.config, "shuffle", False)), seed,
            "(critic.ppo_mini_batch_size × rollout_n / dp size); make data.train_batch_size a multiple "
            "of critic.ppo_mini_batch_size",
        )

    def _global_batch_info(self, mini: DataProto) -> dict[str, Any]:
        """Valid tokens and sequences of the whole mini-batch on all ranks (agg_loss contract)."""
        return global_batch_info(mini.batch["response_mask"], self.dp_size, self.dp_group)

    def _micro_loss(self, micro: DataProto, info: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        batch = micro.batch
        mask = batch["response_mask"]
        vpreds = self._forward_micro_batch(micro)
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds, returns=batch["returns"], values=batch["values"], response_mask=mask,
            cliprange_value=float(cfg_get(self.config, "cliprange_value", 0.5)),
            loss_agg_mode=str(cfg_get(self.config, "loss_agg_mode", "token-mean")),
            **info,
        )
        ratios = {"critic/vf_clipfrac": float(vf_clipfrac), "critic/vpred_mean": float(masked_mean(vpreds.detach(), mask))}
        return vf_loss, ratios

    def _optimizer_step(self) -> float:
        """Clip and step; a non-finite grad norm skips the step so NaN never reaches the weights."""
        grad_norm = fsdp_utils.clip_grad_norm_(self.module.parameters(), cfg_get(self.config, "grad_clip", 1.0))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.nonfinite_skips += 1
            logger.warning("critic: non-finite gradient norm (%s); optimiser step skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _update_mini_batch(self, mini: DataProto, dynamic: bool) -> dict[str, float]:
        info = self._global_batch_info(mini)
        stats = _MiniBatchStats()
        micros, _ = self._micro_batches(mini, self.sizes.micro_batch_size, self.sizes.max_token_len if dynamic else None)
        for micro in micros:
            empty = len(micro) == 0
            micro = _zero_loss_row(mini) if empty else micro  # keeps FSDP collectives in step
            loss, ratios = self._micro_loss(micro, info)
            loss.backward()  # summed over micro-batches: agg_loss already divided by the global count
            stats.add(float(loss.detach()), ratios, 0.0 if empty else float(micro.batch["response_mask"].sum()))
        metrics = stats.reduce(self.dp_size, self.dp_group)
        metrics["critic/grad_norm"] = self._optimizer_step()
        return metrics

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """``ppo_epochs`` passes of mini-batch value-loss steps over ``data``; metrics per step.

        Needs the forward keys plus ``response_mask``, ``values`` (rollout-time critic) and
        ``returns``. Returns ``{metric: [one value per optimiser step]}``: ``critic/vf_loss``,
        ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, and
        ``critic/nan_skipped`` (steps skipped in this call).
        """
        if self.optimizer is None:
            raise RuntimeError("update_critic needs an optimiser")
        dynamic = bool(cfg_get(self.config, "use_dynamic_bsz", False))
        data = data.select(batch_keys=list(_UPDATE_KEYS))
        self.module.train()
        return self._run_mini_batches(self._mini_batches(data), lambda mini: self._update_mini_batch(mini, dynamic),
                                      "critic")


def _response_mask(data: DataProto) -> torch.Tensor:
    """``response_mask`` when the rollout wrote one, else the response part of the attention mask."""
    batch = data.batch
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    return batch["attention_mask"][:, -batch["responses"].shape[-1] :]


def _zero_loss_row(mini: DataProto) -> DataProto:
    """One row of ``mini`` with its response mask zeroed: a forward/backward adding no gradient."""
    row = mini[:1]
    row.batch["response_mask"] = torch.zeros_like(row.batch["response_mask"])
    return row


# ==== the worker ================================================================================


def resolve_critic_batch_sizes(config: Any, rollout_n: int, dp_size: int) -> CriticBatchSizes:
    """Per-rank sizes from verl's keys; errors name the numbers that disagree."""
    mini_rows = int(cfg_get(config, "ppo_mini_batch_size", 0)) * rollout_n
    if mini_rows <= 0 or mini_rows % dp_size != 0:
        raise ValueError(
            f"critic.ppo_mini_batch_size ({cfg_get(config, 'ppo_mini_batch_size')}) × rollout_n ({rollout_n}) = "
            f"{mini_rows} rows must be a positive multiple of the number of critic ranks ({dp_size})"
        )
    micro = cfg_get(config, "ppo_micro_batch_size_per_gpu")
    if micro is None and cfg_get(config, "ppo_micro_batch_size") is not None:
        micro = int(cfg_get(config, "ppo_micro_batch_size")) // dp_size  # deprecated global spelling
    dynamic = bool(cfg_get(config, "use_dynamic_bsz", False))
    if micro is None and not dynamic:
        raise ValueError("set critic.ppo_micro_batch_size_per_gpu (or critic.use_dynamic_bsz=true with "
                         "critic.ppo_max_token_len_per_gpu)")
    micro = max(1, int(micro or 1))
    forward = cfg_get(config, "forward_micro_batch_size_per_gpu")
    if forward is None and cfg_get(config, "forward_micro_batch_size") is not None:
        forward = int(cfg_get(config, "forward_micro_batch_size")) // dp_size
    max_len = int(cfg_get(config, "ppo_max_token_len_per_gpu", 32768))
    return CriticBatchSizes(
        mini_batch_size=mini_rows // dp_size,
        micro_batch_size=micro,
        forward_micro_batch_size=max(1, int(forward or micro)),
        max_token_len=max_len,
        forward_max_token_len=int(cfg_get(config, "forward_max_token_len_per_gpu", max_len)),
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
    """The critic role: one FSDP2 value model per rank (see the module docstring).

    Args:
        config: the ``critic`` config subtree (verl keys).
        rollout_n: samples per prompt; ``ppo_mini_batch_size`` counts prompts, so a mini-batch is
            ``ppo_mini_batch_size × rollout_n`` rows. Defaults to ``config.rollout_n`` (1 if unset).
        seed: base seed of the mini-batch shuffle.
    """

    def __init__(self, config: Any, rollout_n: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.rollout_n = int(rollout_n if rollout_n is not None else cfg_get(config, "rollout_n", 1))
        self.seed = seed
        # Validate now: a bad batch-size combination should fail at start-up, not mid-run.
        self.sizes = resolve_critic_batch_sizes(config, self.rollout_n, self.world_size)
        self.critic: DataParallelPPOCritic | None = None
        self.lr_scheduler: Any = None
        self.tokenizer: Any = None

    # ---- model --------------------------------------------------------------------------------

    def _fsdp_config(self) -> Any:
        model_cfg = cfg_get(self.config, "model", {})
        return cfg_get(model_cfg, "fsdp_config", None) or cfg_get(self.config, "fsdp_config", {})

    def _build_module(self) -> nn.Module:
        model_cfg = cfg_get(self.config, "model", {})
        fsdp_cfg = self._fsdp_config()
        path = str(cfg_get(model_cfg, "path"))
        overrides = {"classifier_dropout": 0.0, **dict(cfg_get(model_cfg, "override_config", {}) or {})}
        module = fsdp_utils.load_hf_model(
            Path(path).expanduser(),
            model_kind="token_classification",
            torch_dtype=cfg_get(fsdp_cfg, "model_dtype", "fp32"),
            trust_remote_code=bool(cfg_get(model_cfg, "trust_remote_code", False)),
            override_config=overrides,
            enable_gradient_checkpointing=bool(cfg_get(model_cfg, "enable_gradient_checkpointing", False)),
        )
        if zero_init_new_value_head(module, Path(path).expanduser()):
            logger.info("critic: %s has no value head; created one initialised to zero", path)
        use_cpu_linear(module, str(cfg_get(model_cfg, "cpu_linear", "onednn")), self.device)
        mp = cfg_get(fsdp_cfg, "mixed_precision", {}) or {}
        return fsdp_utils.apply_fsdp2(
            module, self.device,
            param_dtype=cfg_get(mp, "param_dtype"), reduce_dtype=cfg_get(mp, "reduce_dtype"),
            param_offload=bool(cfg_get(fsdp_cfg, "param_offload", False)),
            reshard_after_forward=bool(cfg_get(fsdp_cfg, "reshard_after_forward", True)),
            fsdp_size=int(cfg_get(fsdp_cfg, "fsdp_size", -1)),
        )

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        model_cfg = cfg_get(self.config, "model", {})
        path = cfg_get(model_cfg, "tokenizer_path") or cfg_get(model_cfg, "path")
        try:
            return AutoTokenizer.from_pretrained(str(Path(str(path)).expanduser()),
                                                 trust_remote_code=bool(cfg_get(model_cfg, "trust_remote_code", False)))
        except (OSError, ValueError) as e:  # exports then carry no tokenizer; say so once
            logger.warning("critic: no tokenizer at %s (%s); HF exports will not include one", path, e)
            return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, load + shard the value model, build AdamW and the lr schedule."""
        self.init_distributed()
        module = self._build_module()
        optim_cfg = cfg_get(self.config, "optim", {})
        optimizer = fsdp_utils.build_optimizer(module, optim_cfg)
        self.lr_scheduler = fsdp_utils.build_lr_scheduler(optimizer, optim_cfg)
        self.critic = DataParallelPPOCritic(self.config, module, optimizer, self.sizes, seed=self.seed)
        self.tokenizer = self._load_tokenizer()
        self._offload_optimizer()

    def _require_model(self) -> DataParallelPPOCritic:
        if self.critic is None:
            raise RuntimeError("CriticWorker.init_model() must be called before using the critic")
        return self.critic

    def _optimizer_offload(self) -> bool:
        return self.device.type == "cuda" and bool(cfg_get(self._fsdp_config(), "optimizer_offload", False))

    def _offload_optimizer(self) -> None:
        if self._optimizer_offload():
            fsdp_utils.offload_optimizer(self._require_model().optimizer)

    def _load_optimizer(self) -> None:
        if self._optimizer_offload():
            fsdp_utils.load_optimizer(self._require_model().optimizer, self.device)

    # ---- driver-facing methods ----------------------------------------------------------------

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """Adds ``values`` (B, Tr) for this rank's rows."""
        critic = self._require_model()
        data = data.to(self.device)
        dynamic = bool(cfg_get(self.config, "use_dynamic_bsz", False))
        field = "forward_max_token_len" if dynamic else "forward_micro_batch_size"
        floor = int(data.batch["attention_mask"].sum(-1).max()) if dynamic else 1

        def run(size: int) -> torch.Tensor:
            critic.sizes = replace(critic.sizes, **{field: size})  # an OOM-lowered size stays lowered
            return critic.compute_values(data)

        values = oom.backoff_of(self).run("compute_values", getattr(critic.sizes, field) or len(data), run, floor=floor,
                                          unit="tokens" if dynamic else "rows")
        return DataProto.from_dict(tensors={"values": values.cpu()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One PPO critic update over this rank's rows; metrics in ``meta_info["metrics"]``."""
        critic = self._require_model()
        self._load_optimizer()
        data = data.to(self.device)

        def update() -> dict[str, list[float]]:
            faults.inject("update_critic", tensors=data.batch, nan_key="returns")  # tests only (utils/faults.py)
            return critic.update_critic(data)

        metrics = oom.update_or_explain_oom("critic", update, micro_batch_size=critic.sizes.micro_batch_size)
        self._offload_optimizer()
        metrics["critic/lr"] = [float(self.lr_scheduler.get_last_lr()[0])]  # the lr this update used
        with warnings.catch_warnings():
            # The schedule follows training steps even when every optimiser step was skipped
            # (non-finite grads); torch would warn that it saw no optimizer.step().
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.lr_scheduler.step()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> str:
        """Sharded save of model, optimiser, scheduler, RNG and counters to ``local_path``.

        ``local_path`` is ``<default_local_dir>/global_step_N/critic``; the write is atomic (see
        ``workers/utils/checkpoint.py``). ``max_ckpt_to_keep`` is accepted for verl's signature
        but retention is the trainer's job: it may only delete old steps once the *whole* new
        step (actor, critic, trainer state) is complete, which a single worker cannot know.
        """
        critic = self._require_model()
        extra = {"global_step": int(global_step), "critic": critic.state_dict()}
        path = ckpt.save_checkpoint(local_path, critic.module, critic.optimizer, self.lr_scheduler, extra,
                                    tokenizer=self.tokenizer)
        return str(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> int:
        """Restore what ``save_checkpoint`` wrote; returns the saved global step."""
        critic = self._require_model()
        self._load_optimizer()
        extra = ckpt.load_checkpoint(local_path, critic.module, critic.optimizer, self.lr_scheduler)
        self._offload_optimizer()
        critic.load_state_dict(extra.get("critic", {}))
        return int(extra.get("global_step", 0))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, path: str) -> str:
        """Export the full value model (+ tokenizer) as a Hugging Face directory."""
        critic = self._require_model()
        return str(ckpt.save_hf_model(critic.module, self.tokenizer, path))
