"""``rlfoundry sft [key=value ...]``: supervised fine-tuning on prompt/response pairs (verl's
``fsdp_sft_trainer`` keys; typed defaults in ``rlfoundry/config/sft_schema.py``).

SFT is a role on the training engine, like the PPO actor: it brings a loss (``sft_loss``) and the
engine (``engines/fsdp``) runs the micro-batches, the global-batch normalisation, clipping, the
optimiser step, checkpoints and HF export. The pairs (``data/sft_dataset.py``) are chat-templated
prompts and responses with EOS appended, each batch laid out as verl's RL batch (left-padded
prompt | right-padded response, ``response_mask`` over the response), so the loss is the
token-mean negative log-likelihood of the response tokens over the whole global batch: the update
does not depend on the micro-batch size or rank count.

    rlfoundry sft model.partial_pretrain=DIR data.train_files=train.parquet data.val_files=test.parquet
    torchrun --nproc_per_node=2 -m rlfoundry.trainer.sft_trainer model.partial_pretrain=DIR ...

Checkpoints (``trainer.default_local_dir``): ``global_step_N/`` is a Hugging Face model directory
(weights, config, tokenizer) with the resumable training state in ``global_step_N/sft/``; the step
protocol, retention and ``resume_mode=auto`` are PPO's (``checkpoint/layout.py``). With
``data.train_files`` null the pairs come from the built-in arithmetic task (``data.synthetic``).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import random
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from rlfoundry import checkpoint as ckpt
from rlfoundry.algos import core_algos
from rlfoundry.config.sft_schema import SFTConfig, choice_errors
from rlfoundry.data.sft_dataset import Pair, SFTDataError, SFTDataset, collate_sft, load_pairs, synthetic_pairs
from rlfoundry.engines.base import GlobalBatchInfo, LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.protocol import DataProto
from rlfoundry.trainer.config import ConfigError, load_typed_config
from rlfoundry.utils.errors import EXIT_RUN_ABORTED, CheckpointCorruptError
from rlfoundry.utils.fs import fsync_dir
from rlfoundry.utils.tracking import SUPPORTED_BACKENDS, missing_packages

__all__ = ["ROLE", "SFTTrainer", "load_sft_config", "main", "run_sft", "sft_loss", "validate_sft_config"]

ROLE = "sft"  # the engine's role: metric prefix of its own metrics, checkpoint directory name


# =========================================================================== configuration

SFT_ENGINES = ("fsdp", "dp")  # verl's August engine group (engine=...); both are the FSDP2 engine here


def load_sft_config(overrides: Sequence[str] = (), config_name: str | None = None,
                    config_path: str | None = None) -> DictConfig:
    """Typed defaults <- overlay ``config_name`` (its ``defaults:`` composed) <- ``key=value`` overrides
    (the PPO config's loader), verl's spellings adopted, validated, read-only."""
    overrides = _engine_choice(overrides)
    cfg, user_keys = load_typed_config(SFTConfig, overrides, _sft_overlay(config_name, config_path),
                                       config_path=config_path)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _adopt_verl_spellings(cfg, user_keys, world_size)
    OmegaConf.resolve(cfg)
    validate_sft_config(cfg, world_size=world_size)
    OmegaConf.set_readonly(cfg, True)  # validated once; nothing changes it afterwards
    return cfg


def _sft_overlay(name: str | None, config_path: str | None) -> Path | None:
    """``--config-name`` looked up as for PPO (``config/compose.py``); verl's SFT names are packaged."""
    from rlfoundry.config.compose import find_config

    return find_config(name, config_path) if name else None


# verl's newer SFT layout picks its parts by Hydra groups (not keys): the choices that are the FSDP2
# engine and the HF model here; any other names a part that is not built
SFT_GROUPS = {"engine": SFT_ENGINES, "optim": SFT_ENGINES, "model": ("hf_model",)}


def _engine_choice(overrides: Sequence[str]) -> list[str]:
    """verl's ``engine=fsdp|megatron`` / ``optim=…`` / ``model=hf_model`` group choices: the FSDP engine,
    its optimiser and the HF model are what runs here; another choice is an error naming it."""
    rest = []
    for text in overrides:
        key, sep, value = text.partition("=")
        group = key.lstrip("+")
        if sep and group in SFT_GROUPS:
            if value.strip() not in SFT_GROUPS[group]:
                raise ConfigError(f"{group}={value}: rlfoundry sft trains on the FSDP2 engine with an HF model "
                                  f"({group}={SFT_GROUPS[group][0]}); verl's {value} {group} is not built here.")
            continue
        rest.append(text)
    return rest


def _adopt_verl_spellings(cfg: DictConfig, user_keys: Sequence[str], world_size: int) -> None:
    """verl's other SFT spellings onto the keys the trainer reads; two spellings given with different
    values are an error (which would win is not obvious)."""
    data = cfg.data
    if data.micro_batch_size is not None:
        from rlfoundry.config.verl_compat import NoEffectKeyWarning

        warnings.warn(f"These verl settings are accepted but have no effect in rlfoundry: data.micro_batch_size="
                      f"{data.micro_batch_size} (verl's trainer does not read it either; "
                      f"data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu} sets the micro-batch, which "
                      "does not change the update).", NoEffectKeyWarning, stacklevel=2)
    if data.pad_mode is not None:
        _adopt(cfg, user_keys, "data.pad_mode", "use_remove_padding", data.pad_mode == "no_padding")
    for verl_key, ours in (("model.path", "model.partial_pretrain"), ("model.use_remove_padding", "use_remove_padding"),
                           ("optim.lr_warmup_steps_ratio", "optim.warmup_steps_ratio"),
                           ("optim.lr_scheduler_type", "optim.lr_scheduler"), ("optim.warmup_style", "optim.lr_scheduler"),
                           ("engine.ulysses_sequence_parallel_size", "ulysses_sequence_parallel_size"),
                           ("engine.strategy", "model.strategy"), ("engine.fsdp_size", "model.fsdp_config.fsdp_size")):
        value = OmegaConf.select(cfg, verl_key)
        if value is not None:
            _adopt(cfg, user_keys, verl_key, ours, value)


def _adopt(cfg: DictConfig, user_keys: Sequence[str], verl_key: str, ours: str, value: Any) -> None:
    if ours in user_keys and OmegaConf.select(cfg, ours) != value:
        raise ConfigError(f"{verl_key}={OmegaConf.select(cfg, verl_key)} and {ours}={OmegaConf.select(cfg, ours)} "
                          "are two spellings of one setting with different values: give one of them.")
    OmegaConf.update(cfg, ours, value)


def _batch_errors(cfg: DictConfig, world_size: int) -> list[str]:
    """The global batch must split evenly over the data-parallel ranks (the ranks of one Ulysses group
    share their rows, as in verl), and each one's share into micro-batches."""
    batch, micro, sp = cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu, cfg.ulysses_sequence_parallel_size
    if batch <= 0 or micro <= 0 or sp <= 0:
        return [f"data.train_batch_size ({batch}), data.micro_batch_size_per_gpu ({micro}) and "
                f"ulysses_sequence_parallel_size ({sp}) must be positive"]
    if world_size % sp:
        return [f"ulysses_sequence_parallel_size={sp} does not divide the {world_size} ranks; use a divisor of it"]
    dp = world_size // sp
    if batch % dp:
        return [f"data.train_batch_size ({batch}) is not divisible by the data-parallel ranks ({world_size} ranks / "
                f"ulysses_sequence_parallel_size {sp} = {dp})"]
    per_rank = batch // dp
    if per_rank % micro:
        return [f"data.train_batch_size / data-parallel ranks = {batch} / {dp} = {per_rank} sequences per rank, "
                f"not divisible by data.micro_batch_size_per_gpu ({micro})"]
    return []


def _setting_errors(cfg: DictConfig) -> list[str]:
    t, errors = cfg.trainer, []
    if cfg.model.partial_pretrain is None:
        errors.append("model.partial_pretrain is required: a local Hugging Face model directory "
                      "(make a tiny one with `python -m rlfoundry.models.tiny --out DIR`)")
    if cfg.model.lora_rank and importlib.util.find_spec("peft") is None:
        from rlfoundry.models.lora import PEFT_INSTALL

        errors.append(f"model.lora_rank={cfg.model.lora_rank} needs peft: {PEFT_INSTALL}")
    sp = cfg.ulysses_sequence_parallel_size
    if sp > 1 and not cfg.use_remove_padding:
        errors.append(f"ulysses_sequence_parallel_size={sp} splits packed rows only: set use_remove_padding=true "
                      "(verl: model.use_remove_padding=true or data.pad_mode=no_padding)")
    if cfg.data.use_dynamic_bsz and cfg.data.max_token_len_per_gpu * sp < cfg.data.max_length:
        errors.append(f"data.max_token_len_per_gpu ({cfg.data.max_token_len_per_gpu}) x ulysses_sequence_parallel_size "
                      f"({sp}) < data.max_length ({cfg.data.max_length}): a micro-batch's token budget must hold the "
                      "longest row")
    if cfg.model.use_liger:
        from rlfoundry.models.liger import liger_problems

        device = t.device if t.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        errors += [p.replace("actor_rollout_ref.model.use_liger", "model.use_liger") for p in liger_problems(device)]
    if cfg.data.max_length < 2:
        errors.append(f"data.max_length ({cfg.data.max_length}) must be at least 2")
    if t.device == "cuda" and not torch.cuda.is_available():
        errors.append("trainer.device=cuda but CUDA is not available; use trainer.device=cpu or auto")
    if t.dist_timeout_s <= 0:
        errors.append(f"trainer.dist_timeout_s ({t.dist_timeout_s}) must be positive")
    unknown = [x for x in ([t.logger] if isinstance(t.logger, str) else t.logger or []) if x not in SUPPORTED_BACKENDS]
    if unknown:
        errors.append(f"trainer.logger entries {unknown} are not among {list(SUPPORTED_BACKENDS)}")
    errors += missing_packages([t.logger] if isinstance(t.logger, str) else list(t.logger or []))
    errors += _checkpoint_contents_errors(cfg.checkpoint)
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N directory)")
    return errors


def _checkpoint_contents_errors(checkpoint: DictConfig) -> list[str]:
    from rlfoundry.checkpoint.state import CHECKPOINT_CONTENTS

    errors = []
    for which in ("save_contents", "load_contents"):
        listed = checkpoint[which]
        if listed is None:
            continue
        unknown = [x for x in listed if x not in CHECKPOINT_CONTENTS]
        if unknown or "model" not in listed:
            errors.append(f"checkpoint.{which}={list(listed)}: the entries are {list(CHECKPOINT_CONTENTS)} and "
                          "'model' is always one (leave out 'optimizer' to save or restore the weights alone)")
    return errors


def validate_sft_config(cfg: DictConfig, world_size: int = 1) -> None:
    """All cross-key problems at once, so one run reports every mistake."""
    errors = choice_errors(cfg) + _batch_errors(cfg, world_size) + _setting_errors(cfg)
    if errors:
        raise ConfigError("invalid SFT config:\n  - " + "\n  - ".join(errors))
    if cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node != world_size:
        warnings.warn(f"trainer.nnodes x trainer.n_gpus_per_node = {cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node} "
                      f"but this run has {world_size} rank(s) (from torchrun's WORLD_SIZE); using {world_size}")


# =========================================================================== the role: its loss

def sft_loss(outputs: dict[str, torch.Tensor], batch: Any, info: GlobalBatchInfo) -> LossOutput:
    """Token-mean NLL of one micro-batch's response tokens, divided by the whole global batch's token
    count (``agg_loss``'s global-batch contract): the micro-batch losses sum to the global mean."""
    nll = core_algos.agg_loss(-outputs["log_probs"], batch["response_mask"], "token-mean", **info)
    return LossOutput(nll, {"train/loss": float(nll.detach())}, {})


# =========================================================================== trainer

def _join_process_group(trainer_cfg: Any) -> tuple[Any, bool]:
    """Rank, device and process group the way every worker gets them (``single_controller``):
    torchrun's variables when it launched several ranks, else one rank in this process. Returns
    the worker and whether this call created the group (and so should destroy it)."""
    from rlfoundry.single_controller.base.worker import Worker, WorkerRuntime
    from rlfoundry.single_controller.local import set_rank_env

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        set_rank_env(ROLE)  # one rank here: a fresh rendezvous on loopback
    worker = Worker(WorkerRuntime(device=trainer_cfg.device, dist_timeout_s=float(trainer_cfg.dist_timeout_s)))
    owns = not dist.is_initialized()
    worker.init_distributed()
    return worker, owns


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class SFTTrainer:
    """Builds data, engine (FSDP2) and tracker from a validated config; ``fit()`` trains."""

    def __init__(self, config: DictConfig) -> None:
        self.config = config
        worker, self._owns_group = _join_process_group(config.trainer)
        self.rank, self.world_size, self.device = worker.rank, worker.world_size, worker.device
        try:
            self._setup(config)
        except BaseException:  # a bad data file must not leave a process group behind
            if self._owns_group:
                dist.destroy_process_group()
            raise

    def _setup(self, config: DictConfig) -> None:
        validate_sft_config(config, self.world_size)
        _seed_everything(config.trainer.seed)
        if config.model.external_lib:
            importlib.import_module(config.model.external_lib)
        self.run_dir = Path(config.trainer.default_local_dir)
        self.tokenizer = self._build_tokenizer()
        self.train_loader, self.val_loader = self._build_loaders()
        self.total_steps = self._total_steps()
        self.engine = self._build_engine()
        self.resumed_from = self._resume_path()
        self.global_step = self._load_checkpoint(self.resumed_from)
        self.tracking = self._build_tracking()
        from rlfoundry.utils.profiler import StepProfiler

        self.profiler = StepProfiler(config.trainer.profile_steps, self.run_dir / "profile", name=f"sft_rank{self.rank}")

    # ---- builders -------------------------------------------------------------------------

    def _build_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        from rlfoundry.models.hf import resolve_model_path

        path = resolve_model_path(self.config.model.partial_pretrain)
        if not (path / "config.json").is_file():  # else transformers tries the hub and says "repo id"
            raise ConfigError(f"model.partial_pretrain={self.config.model.partial_pretrain!r} is not a local "
                              "Hugging Face model directory (no config.json); no hub downloads happen here "
                              "(make a tiny one with `python -m rlfoundry.models.tiny --out DIR`)")
        from rlfoundry.models.vision import load_processor

        # a vision-language model's processor (None for a text model) encodes image rows (data/sft_dataset.py)
        self.processor = load_processor(path, trust_remote_code=self.config.model.trust_remote_code)
        tokenizer = self.processor.tokenizer if self.processor is not None else \
            AutoTokenizer.from_pretrained(path, trust_remote_code=self.config.model.trust_remote_code)
        if self.config.data.chat_template:
            tokenizer.chat_template = self.config.data.chat_template
            if self.processor is not None:
                self.processor.chat_template = self.config.data.chat_template
        if tokenizer.pad_token_id is None:  # many base models ship without one; padding is masked anyway
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _pairs(self) -> tuple[list[Pair], list[Pair]]:
        data = self.config.data
        if data.train_files is None:
            train, val = synthetic_pairs(data.synthetic)
        else:
            train, val = load_pairs(data.train_files, data), []
        if data.val_files is not None:
            val = load_pairs(data.val_files, data)
        return train, val

    def _build_loaders(self) -> tuple[DataLoader, DataLoader | None]:
        data = self.config.data
        train_pairs, val_pairs = self._pairs()
        # the ranks of one Ulysses group (consecutive ranks, engines/fsdp/ulysses.py) read the same rows
        sp = self.config.ulysses_sequence_parallel_size
        dp, dp_rank = self.world_size // sp, self.rank // sp
        per_rank = data.train_batch_size // dp
        if len(train_pairs) < data.train_batch_size:
            raise SFTDataError(f"{len(train_pairs)} training examples, fewer than data.train_batch_size "
                               f"({data.train_batch_size}); lower the batch size or add data")
        collate = lambda batch: collate_sft(batch, self.tokenizer.pad_token_id)  # noqa: E731
        ignore = bool(data.ignore_input_ids_mismatch)
        train_set = SFTDataset(train_pairs, self.tokenizer, data.max_length, data.truncation, self.processor, ignore)
        sampler = DistributedSampler(train_set, dp, dp_rank, shuffle=data.shuffle,
                                     seed=self.config.trainer.seed, drop_last=True)
        train_loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, collate_fn=collate, drop_last=True)
        if not val_pairs:
            return train_loader, None
        val_set = SFTDataset(val_pairs, self.tokenizer, data.max_length, data.truncation, self.processor, ignore)
        val_sampler = DistributedSampler(val_set, dp, dp_rank, shuffle=False)
        return train_loader, DataLoader(val_set, batch_size=data.micro_batch_size_per_gpu,
                                        sampler=val_sampler, collate_fn=collate)

    def _total_steps(self) -> int:
        per_epoch = len(self.train_loader)
        total = self.config.trainer.total_training_steps
        return int(total) if total is not None else per_epoch * self.config.trainer.total_epochs

    def _build_engine(self) -> Any:
        from rlfoundry.config.schema import FSDPConfig, OptimConfig
        from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
        from rlfoundry import cpu as cpu_kernels
        from rlfoundry.models.lora import LoraSpec

        m, fsdp, o = self.config.model, self.config.model.fsdp_config, self.config.optim
        if cpu_kernels.enabled(m.cpu_kernels, self.device):
            from rlfoundry.cpu.malloc import tune_malloc

            tune_malloc()  # one of the CPU speed-ups: glibc keeps freed activation memory
        # verl's SFT keys -> the engine's (the RL roles' names)
        optim = OptimConfig(lr=o.lr, betas=list(o.betas), weight_decay=o.weight_decay, eps=o.eps,
                            lr_warmup_steps_ratio=o.warmup_steps_ratio, lr_scheduler_type=o.lr_scheduler,
                            min_lr_ratio=o.min_lr_ratio, total_training_steps=self.total_steps)
        mixed = {"param_dtype": fsdp.param_dtype, "reduce_dtype": fsdp.reduce_dtype}
        config = FSDPEngineConfig(
            path=str(m.partial_pretrain), optim=optim, grad_clip=o.clip_grad, cpu_kernels=m.cpu_kernels,
            fsdp=FSDPConfig(model_dtype=fsdp.model_dtype, mixed_precision=mixed, param_offload=fsdp.offload_params,
                            reshard_after_forward=fsdp.reshard_after_forward, fsdp_size=int(fsdp.fsdp_size)),
            trust_remote_code=m.trust_remote_code, override_config=dict(m.override_config),
            gradient_checkpointing=m.enable_gradient_checkpointing, use_remove_padding=self.config.use_remove_padding,
            use_liger=m.use_liger,
            lora=LoraSpec.of(m), ulysses_sequence_parallel_size=int(self.config.ulysses_sequence_parallel_size),
        )
        return FSDPEngine.build(config, self.device, role=ROLE)

    def _build_tracking(self) -> Any:
        if self.rank != 0:
            return None
        from rlfoundry.utils.tracking import Tracking

        t = self.config.trainer
        return Tracking(t.project_name, t.experiment_name, t.logger, config=self.config, run_dir=self.run_dir,
                        total_training_steps=self.total_steps, resume_step=self.global_step or None)

    # ---- one step -------------------------------------------------------------------------

    def _on_device(self, batch: Mapping[str, Any]) -> DataProto:
        """The batch's tensors on the device; image rows' ``multi_modal_inputs`` as a non-tensor column (the
        forward moves the pixels)."""
        tensors = {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        return DataProto.from_dict(tensors, non_tensors={k: v for k, v in batch.items() if k not in tensors})

    def _all_reduce(self, *values: float) -> list[float]:
        """Sums over ranks (float64 on the CPU: gloo carries it on every back end)."""
        total = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(total)
        return total.tolist()

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimiser step on this rank's share of the global batch, in micro-batches."""
        data, sp = self.config.data, int(self.config.ulysses_sequence_parallel_size)
        # a Ulysses group's ranks each hold 1/sp of a micro-batch's tokens: its budget is sp GPUs' (verl's rule)
        budget = int(data.max_token_len_per_gpu) * sp if data.use_dynamic_bsz else None  # wins over the row count
        plan = UpdatePlan(micro=MicroBatching(data.micro_batch_size_per_gpu, budget))
        out = self.engine.train_batch(self._on_device(batch), LogProbs(), sft_loss, plan)
        lr = self.engine.step_lr_scheduler()  # the lr this step used
        (tokens,) = self._all_reduce(float(batch["response_mask"].sum()) / sp)  # sp ranks hold each row
        return {"train/loss": out["train/loss"][0], "train/lr": lr, "train/grad_norm": out[f"{ROLE}/grad_norm"][0],
                "train/response_tokens": tokens}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Token-mean response NLL over the validation set (``val/loss``); {} when there is none."""
        if self.val_loader is None:
            return {}
        nll, tokens = 0.0, 0.0
        for batch in self.val_loader:
            data = self._on_device(batch)
            log_probs = self.engine.infer_batch(data, LogProbs(), MicroBatching(len(data)))["log_probs"]
            mask = data.batch["response_mask"]
            nll, tokens = nll - float((log_probs * mask).sum()), tokens + float(mask.sum())
        nll, tokens = self._all_reduce(nll, tokens)
        return {"val/loss": nll / max(tokens, 1.0)}

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        """``global_step_N/sft`` (the engine's resumable state) and the model as a Hugging Face
        directory in ``global_step_N`` itself; then, on rank 0, the step marker and the
        ``latest_checkpointed_iteration.txt`` pointer, and retention (``trainer.max_ckpt_to_keep``)."""
        step_dir = self.run_dir / ckpt.STEP_DIR_FORMAT.format(step)
        listed = self.config.checkpoint.save_contents  # null: the resumable state and the HF model
        contents = None if listed is None else [x for x in listed if x != "hf_model"]
        self.engine.save_checkpoint(str(step_dir / ROLE), {"global_step": step}, tokenizer=self.tokenizer,
                                    contents=contents)
        if listed is None or "hf_model" in listed:
            self._export_hf(step_dir)
        if self.rank == 0:
            ckpt.write_latest_checkpointed_iteration(self.run_dir, step)
            ckpt.remove_old_checkpoints(self.run_dir, self.config.trainer.max_ckpt_to_keep)
        dist.barrier()
        return step_dir

    def _export_hf(self, step_dir: Path) -> None:
        """Full weights + config + tokenizer into ``step_dir`` (a staging directory whose files move
        up; the step marker written next lists them with their sizes and checksums)."""
        staging = step_dir / "huggingface"
        config = self.engine.module.config
        config.use_cache = True  # training runs without a KV cache; the exported model is for inference
        try:
            # a vision-language model's processor writes its tokenizer and image processor: the output takes images
            self.engine.save_hf_model(str(staging), self.processor or self.tokenizer)
        finally:
            config.use_cache = False
        if self.rank == 0:
            for f in staging.iterdir():
                os.replace(f, step_dir / f.name)
            staging.rmdir()
            fsync_dir(step_dir)

    def _resume_path(self) -> Path | None:
        """The step to resume from (``trainer.resume_mode``), its files checked against the sizes and
        checksums recorded at save time; ``auto`` skips a damaged step for the newest intact one."""
        t = self.config.trainer
        if t.resume_mode == "disable":
            return None
        if self.rank == 0:
            ckpt.cleanup_partial_checkpoints(self.run_dir)  # debris of a save killed half-way
        dist.barrier()
        if t.resume_mode == "auto":
            found = ckpt.find_latest_ckpt_path(self.run_dir, verify=True)
            return Path(found) if found else None
        path = Path(t.resume_from_path).expanduser()
        if not ckpt.is_complete_step_dir(path) or not (path / ROLE).is_dir():
            raise ConfigError(f"trainer.resume_from_path={path} is not a complete rlfoundry sft checkpoint "
                              f"(a global_step_N directory with a step marker and an {ROLE}/ directory)")
        ckpt.verify_step_dir(path)
        return path

    def _load_checkpoint(self, path: Path | None) -> int:
        """Model, optimiser, schedule and RNG from ``path``; returns its step (0: a fresh start)."""
        if path is None:
            return 0
        c = self.config.checkpoint
        listed = c.load_contents if c.load_contents is not None else c.save_contents
        contents = None if listed is None else [x for x in listed if x != "hf_model"]
        # the whole step was verified above
        extra = self.engine.load_checkpoint(str(path / ROLE), verify=False, contents=contents)
        if self.rank == 0:
            print(f"[rlfoundry sft] resuming from {path}")
        return int(extra["global_step"])

    # ---- the loop -------------------------------------------------------------------------

    def _due(self, freq: int, step: int) -> bool:
        return step == self.total_steps or (freq > 0 and step % freq == 0)

    def _step_metrics(self, batch: Mapping[str, torch.Tensor], epoch: int) -> dict[str, float]:
        from rlfoundry.trainer.metric_utils import marked_timer

        timing: dict[str, float] = {}
        with self.profiler.step(self.global_step), marked_timer("step", timing):
            metrics = self.train_step(batch)
        (tokens,) = self._all_reduce(float(batch["attention_mask"].sum()) / self.config.ulysses_sequence_parallel_size)
        metrics |= {"training/global_step": self.global_step, "training/epoch": epoch,
                    "timing_s/step": timing["step"], "perf/total_num_tokens": tokens,
                    "perf/throughput": tokens / (timing["step"] * self.world_size)}
        return metrics

    def fit(self) -> dict[str, Any]:
        """Train for ``total_steps``; returns the last step's metrics and the final checkpoint path."""
        started = time.monotonic()
        try:
            metrics, last_ckpt = self._train_loop()
        finally:  # also on error: close the tracker (flushes the record) and the process group
            summary = self._finish(time.monotonic() - started)
        return summary | {"metrics": metrics, "checkpoint": last_ckpt}

    def _batches(self) -> Any:
        """(epoch, batch) from the step after ``global_step`` on: a resumed run sees the same
        batches as an uninterrupted one (the sampler's order is a function of seed and epoch)."""
        epoch, skip = divmod(self.global_step, len(self.train_loader))
        while True:
            self.train_loader.sampler.set_epoch(epoch)
            for batch in itertools.islice(self.train_loader, skip, None):
                yield epoch, batch
            epoch, skip = epoch + 1, 0

    def _train_loop(self) -> tuple[dict[str, float], Path | None]:
        t, metrics, last_ckpt = self.config.trainer, {}, self.resumed_from
        batches = self._batches()
        while self.global_step < self.total_steps:
            epoch, batch = next(batches)
            self.global_step += 1
            metrics = self._step_metrics(batch, epoch)
            if self._due(t.test_freq, self.global_step):
                metrics |= self.validate()
            if self._due(t.save_freq, self.global_step):
                last_ckpt = self.save_checkpoint(self.global_step)
            if self.tracking is not None:
                self.tracking.log(metrics, self.global_step)
        if self.rank == 0:
            loss = "".join(f"; {k} {metrics[k]:.4f}" for k in ("train/loss", "val/loss") if k in metrics)
            print(f"[rlfoundry sft] {self.global_step} steps{loss}; model: {last_ckpt}; "
                  f"metrics: {self.tracking.metrics_path}")
        return metrics, last_ckpt

    def _finish(self, seconds: float) -> dict[str, Any]:
        if self.tracking is not None:
            self.tracking.finish()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        return {"seconds": seconds, "steps": self.global_step}


def run_sft(overrides: Sequence[str] = (), config_name: str | None = None,
            config_path: str | None = None) -> dict[str, Any]:
    """Load the config from ``overrides``, train, return ``SFTTrainer.fit()``'s summary."""
    return SFTTrainer(load_sft_config(overrides, config_name, config_path)).fit()


def _split_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """verl's Hydra flags (``--config-name``, ``--config-path``, ``--cfg job``) and the overrides."""
    flags, rest, it = {}, [], iter(argv)
    for arg in it:
        name, sep, value = arg[2:].partition("=")
        if arg.startswith("--") and name in ("config-name", "config-path", "cfg"):
            flags[name] = value if sep else next(it, "")
        elif arg.startswith("--"):
            raise ConfigError(f"Unknown option '{arg}'. Config keys are given without dashes: key=value.")
        else:
            rest.append(arg)
    return flags, rest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\nKeys and defaults (rlfoundry/config/sft_schema.py):\n\n"
              + OmegaConf.to_yaml(OmegaConf.structured(SFTConfig)))
        return 0
    try:
        flags, overrides = _split_flags(argv)
        if flags.get("cfg"):  # verl's dry run: the config this command line gives, nothing trained
            cfg = load_sft_config(overrides, flags.get("config-name"), flags.get("config-path"))
            print(OmegaConf.to_yaml(cfg))
            return 0
        run_sft(overrides, flags.get("config-name"), flags.get("config-path"))
    except (ConfigError, SFTDataError) as e:  # people's mistakes: the message, not a traceback
        print(f"rlfoundry sft: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except CheckpointCorruptError as e:  # a damaged checkpoint: which file, and what to do
        print(f"rlfoundry sft: {e}", file=sys.stderr)
        raise SystemExit(EXIT_RUN_ABORTED) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
