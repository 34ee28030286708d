"""``rlfoundry sft [key=value ...]``: supervised fine-tuning on prompt/response pairs (verl's
``fsdp_sft_trainer`` keys; typed defaults in ``rlfoundry/config/sft_schema.py``).

SFT is a role on the training engine, like the PPO actor: it brings a loss (``sft_loss``) and the
engine (``engines/fsdp``; ``engines/megatron`` with verl's ``engine=megatron optim=megatron``; any engine
registered in ``config/training_engines.py``, built by its plug-in as the RL roles' are) runs the
micro-batches, the global-batch normalisation, clipping, the optimiser step, checkpoints and HF export.
The pairs (``data/sft_dataset.py``) are chat-templated prompts and responses with EOS appended, each
batch laid out as verl's RL batch (left-padded prompt | right-padded response, ``response_mask`` over
the response), so the loss is the token-mean negative log-likelihood of the response tokens over the
whole global batch: the update does not depend on the micro-batch size or rank count.

    rlfoundry sft model.partial_pretrain=DIR data.train_files=train.parquet data.val_files=test.parquet
    torchrun --nproc_per_node=2 -m rlfoundry.trainer.sft_trainer model.partial_pretrain=DIR ...

Checkpoints (``trainer.default_local_dir``): ``global_step_N/`` is a Hugging Face model directory
(weights, config, tokenizer) with the resumable training state in ``global_step_N/sft/``; the step
protocol, retention and ``resume_mode=auto`` are PPO's (``checkpoint/layout.py``). With
``data.train_files`` null the pairs come from the built-in arithmetic task (``data.synthetic``).
"""

from __future__ import annotations

import dataclasses
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
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from rlfoundry import checkpoint as ckpt
from rlfoundry.algos import core_algos
from rlfoundry.config.schema import MegatronConfig, qat_problems
from rlfoundry.config.sft_schema import SFTConfig, SFTFSDPConfig, SFTModelConfig, choice_errors
from rlfoundry.config.training_engines import TRAINING_ENGINES, engine_plugin
from rlfoundry.data.rl_dataset import max_samples_drawn
from rlfoundry.data.sft_dataset import Pair, SFTDataError, SFTDataset, collate_sft, load_pairs, synthetic_pairs
from rlfoundry.engines.base import GlobalBatchInfo, LogProbs, LossOutput, MicroBatching, UpdatePlan, say_once
from rlfoundry.protocol import DataProto
from rlfoundry.trainer.config import ConfigError, load_typed_config, parse_overrides
from rlfoundry.utils.errors import EXIT_RUN_ABORTED, CheckpointCorruptError
from rlfoundry.utils.fs import fsync_dir
from rlfoundry.utils.tracking import SUPPORTED_BACKENDS, missing_packages

__all__ = ["ROLE", "SFTTrainer", "load_sft_config", "main", "run_sft", "sft_loss", "validate_sft_config"]

ROLE = "sft"  # the engine's role: metric prefix of its own metrics, checkpoint directory name
# the engine group's keys that the Megatron engine reads
_MEGATRON_KEYS = {f.name for f in dataclasses.fields(MegatronConfig)}
_FSDP_DEFAULTS = SFTFSDPConfig()


# =========================================================================== configuration

# verl's August engine group (engine=...): fsdp and dp are the FSDP2 engine here, megatron the Megatron engine;
# automodel (NeMo AutoModel, FSDP2 too) is the FSDP2 engine with its keys translated (config/automodel.py)
SFT_ENGINES = ("fsdp", "dp", "megatron", "automodel")


def load_sft_config(overrides: Sequence[str] = (), config_name: str | None = None,
                    config_path: str | None = None) -> DictConfig:
    """Typed defaults <- overlay ``config_name`` (its ``defaults:`` composed) <- ``key=value`` overrides
    (the PPO config's loader), verl's spellings adopted, validated, read-only."""
    overrides, automodel = _engine_choice(overrides)
    cfg, user_keys = load_typed_config(SFTConfig, overrides, _sft_overlay(config_name, config_path),
                                       config_path=config_path)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if automodel is not None:  # verl's automodel engine: its keys onto the FSDP2 engine's (config/automodel.py)
        from rlfoundry.config.automodel import adopt_automodel

        user_keys = list(user_keys) + adopt_automodel(cfg, parse_overrides(automodel), user_keys, world_size)
    _adopt_verl_spellings(cfg, user_keys, world_size)
    OmegaConf.resolve(cfg)
    validate_sft_config(cfg, world_size=world_size)
    OmegaConf.set_readonly(cfg, True)  # validated once; nothing changes it afterwards
    return cfg


def _sft_overlay(name: str | None, config_path: str | None) -> Path | None:
    """``--config-name`` looked up as for PPO (``config/compose.py``); verl's SFT names are packaged."""
    from rlfoundry.config.compose import find_config

    return find_config(name, config_path) if name else None


# verl's newer SFT layout picks its parts by Hydra groups (not keys): the engine (and its optimiser's key set),
# the HF model; any other choice names a part that is not built
SFT_GROUPS = {"engine": SFT_ENGINES, "optim": SFT_ENGINES, "model": ("hf_model",)}


def _engine_choice(overrides: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """verl's ``engine=fsdp|megatron|automodel`` / ``optim=…`` / ``model=hf_model`` group choices:
    ``engine=megatron`` becomes ``model.strategy=megatron`` (the FSDP engine otherwise); ``optim`` names the
    optimiser keys' layout, which both engines read, and must be the engine's; another choice is an error naming
    it. Returns the overrides and, for ``engine=automodel``, its ``engine.*`` / ``optim.*`` overrides apart (its
    groups' keys, translated after loading: config/automodel.py), else None."""
    rest, chosen = [], {}
    for text in overrides:
        key, sep, value = text.partition("=")
        group = key.lstrip("+")
        if sep and group in SFT_GROUPS:
            if value.strip() not in SFT_GROUPS[group]:
                raise ConfigError(f"{group}={value}: rlfoundry sft trains on the FSDP2 engine (engine=fsdp, or verl's "
                                  f"engine=automodel on it) or the Megatron engine (engine=megatron) with an HF model "
                                  f"(model=hf_model); verl's {value} {group} is not built here.")
            if group != "model":
                chosen[group] = value.strip() if value.strip() in ("megatron", "automodel") else "fsdp"
            continue
        rest.append(text)
    engine = chosen.get("engine", "fsdp")  # verl's default group
    if chosen.get("optim", engine) != engine:
        raise ConfigError(f"optim={chosen['optim']} with engine={engine}: the optimiser's keys are the engine's; "
                          f"give engine={chosen['optim']} (or optim={engine}).")
    if engine == "automodel":
        mine = [t for t in rest if t.lstrip("+").split("=", 1)[0].split(".", 1)[0] in ("engine", "optim")]
        return [t for t in rest if t not in mine], mine
    return rest + (["model.strategy=megatron"] if engine == "megatron" else []), None


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
                           ("optim.lr_decay_style", "optim.lr_scheduler"),
                           ("engine.ulysses_sequence_parallel_size", "ulysses_sequence_parallel_size"),
                           ("engine.strategy", "model.strategy"), ("engine.fsdp_size", "model.fsdp_config.fsdp_size")):
        value = OmegaConf.select(cfg, verl_key)
        if value is not None:
            _adopt(cfg, user_keys, verl_key, ours, value)
    if cfg.optim.min_lr is not None:  # Megatron's cosine floor as an lr: the ratio to optim.lr here
        if not cfg.optim.lr and cfg.optim.min_lr:
            raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} with optim.lr=0: the floor is a fraction of lr here "
                              "(optim.min_lr_ratio); set optim.lr, or optim.min_lr=0.")
        _adopt(cfg, user_keys, "optim.min_lr", "optim.min_lr_ratio",
               float(cfg.optim.min_lr) / float(cfg.optim.lr) if cfg.optim.lr else 0.0)
    _warn_no_effect(cfg, user_keys)


# verl's Megatron engine keys that change nothing here: mbridge converts the weights whichever converter is
# named, and the engine pads and masks rows where verl packs them (the same numbers)
_NO_EFFECT_ENGINE_KEYS = ("engine.vanilla_mbridge", "engine.use_remove_padding")


def _warn_no_effect(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    given = [k for k in _NO_EFFECT_ENGINE_KEYS if k in user_keys or f"+{k}" in user_keys]
    if given:
        from rlfoundry.config.verl_compat import NoEffectKeyWarning

        warnings.warn("These verl settings are accepted but have no effect in rlfoundry: "
                      + ", ".join(f"{k}={OmegaConf.select(cfg, k)}" for k in given)
                      + " (mbridge converts the weights; the Megatron engine pads rows: the same numbers).",
                      NoEffectKeyWarning, stacklevel=3)


def _adopt(cfg: DictConfig, user_keys: Sequence[str], verl_key: str, ours: str, value: Any) -> None:
    if ours in user_keys and OmegaConf.select(cfg, ours) != value:
        raise ConfigError(f"{verl_key}={OmegaConf.select(cfg, verl_key)} and {ours}={OmegaConf.select(cfg, ours)} "
                          "are two spellings of one setting with different values: give one of them.")
    OmegaConf.update(cfg, ours, value)


def _plugin(cfg: DictConfig) -> Any:
    """The engine plug-in ``model.strategy`` names; the checks ask it, as the RL roles' do, so an engine is
    checked by what it says it does, not by its name. An unregistered name (the choice check reports it) is
    checked as the default engine."""
    strategy = cfg.model.strategy
    return engine_plugin(strategy if strategy in TRAINING_ENGINES else SFTModelConfig.strategy)


def _as_role(cfg: DictConfig, plugin: Any) -> DictConfig:
    """The SFT config as an RL role's subtree under ``ROLE``, for the plug-in's questions: verl's SFT engine
    group is the plug-in's own layout subtree (``layout_key``; checkpoints without hf_model, which SFT adds)."""
    contents = {w: None if cfg.checkpoint[w] is None else [x for x in cfg.checkpoint[w] if x != "hf_model"]
                for w in ("save_contents", "load_contents")}
    role = {"model": {"path": cfg.model.partial_pretrain}, "checkpoint": contents,
            "ulysses_sequence_parallel_size": cfg.ulysses_sequence_parallel_size}
    if plugin.layout_key:
        engine = OmegaConf.to_container(cfg.engine, resolve=True)
        role[plugin.layout_key] = {k: v for k, v in engine.items() if k in _MEGATRON_KEYS}
    return OmegaConf.create({ROLE: role})


def _sft_keys(text: str, plugin: Any) -> str:
    """The plug-in's role keys in ``text`` as SFT spells them: its layout subtree is the ``engine`` group, the
    role's other keys are top-level."""
    if plugin.layout_key:
        text = text.replace(f"{ROLE}.{plugin.layout_key}", "engine")
    return text.replace(f"{ROLE}.", "")


def _split(cfg: DictConfig, question: str) -> tuple[int, str]:
    """The plug-in's answer to ``question`` (``model_copy`` or ``sequence_split``) for this config: a number of
    ranks and the SFT keys that set it."""
    plugin = _plugin(cfg)
    ranks, key = getattr(plugin, question)(_as_role(cfg, plugin)[ROLE])
    return int(ranks), _sft_keys(f"{ROLE}.{key}", plugin)


def _model_copy(cfg: DictConfig) -> tuple[int, str]:
    """How many consecutive ranks hold the same rows (a Ulysses group, or one Megatron model copy) and the
    keys that say so."""
    return _split(cfg, "model_copy")


def _batch_errors(cfg: DictConfig, world_size: int) -> list[str]:
    """The global batch must split evenly over the data-parallel ranks (the ranks of one Ulysses group or
    Megatron model copy share their rows, as in verl), and each one's share into micro-batches."""
    batch, micro = cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu
    share, name = _model_copy(cfg)
    if batch <= 0 or micro <= 0 or share <= 0:
        return [f"data.train_batch_size ({batch}), data.micro_batch_size_per_gpu ({micro}) and "
                f"{name} ({share}) must be positive"]
    if world_size % share:  # (an engine with its own layout keys names them in its check: _layout_errors)
        return [] if _plugin(cfg).layout_key else \
            [f"{name}={share} does not divide the {world_size} ranks; use a divisor of it"]
    dp = world_size // share
    if batch % dp:
        return [f"data.train_batch_size ({batch}) is not divisible by the data-parallel ranks ({world_size} ranks / "
                f"{name} {share} = {dp})"]
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
    mtp = cfg.model.mtp
    if mtp.enable_rollout:
        errors.append("model.mtp.enable_rollout=true: SFT samples nothing, so there is no rollout to draft for (the "
                      "PPO trainer's HF rollout drafts with the MTP layers); set it false.")
    elif (mtp.enable or mtp.enable_train) and not _plugin(cfg).supports_mtp:
        on, strategy = "enable" if mtp.enable else "enable_train", cfg.model.strategy
        errors.append(f"model.mtp.{on}=true: multi-token prediction (verl's MTP layers trained beside the model) is "
                      f"not built on the {strategy} engine (model.strategy={strategy}; its plug-in has no "
                      "supports_mtp); set engine=megatron (engines/megatron/mtp.py builds it) or model.mtp.enable=false.")
    if cfg.model.lora_rank and importlib.util.find_spec("peft") is None:
        from rlfoundry.models.lora import PEFT_INSTALL

        errors.append(f"model.lora_rank={cfg.model.lora_rank} needs peft: {PEFT_INSTALL}")
    sp = cfg.ulysses_sequence_parallel_size
    if sp > 1 and not cfg.use_remove_padding:
        errors.append(f"ulysses_sequence_parallel_size={sp} splits packed rows only: set use_remove_padding=true "
                      "(verl: model.use_remove_padding=true or data.pad_mode=no_padding)")
    split, split_key = _sequence_split(cfg)
    if cfg.data.use_dynamic_bsz and cfg.data.max_token_len_per_gpu * split < cfg.data.max_length:
        errors.append(f"data.max_token_len_per_gpu ({cfg.data.max_token_len_per_gpu}) x {split_key} ({split}) < "
                      f"data.max_length ({cfg.data.max_length}): a micro-batch's token budget must hold the longest row")
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
    errors += _checkpoint_contents_errors(cfg.checkpoint) + _optimizer_errors(cfg.optim, _plugin(cfg))
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N directory)")
    return errors


def _sequence_split(cfg: DictConfig) -> tuple[int, str]:
    """How many ranks split one sequence (a dynamic batch's per-GPU budget holds that many times its tokens)."""
    return _split(cfg, "sequence_split")


def _engine_errors(cfg: DictConfig, world_size: int) -> list[str]:
    return (_strategy_errors(cfg) + qat_problems({"engine": cfg.engine.qat}) + _layout_errors(cfg, world_size)
            + _capability_errors(cfg, _plugin(cfg)))


def _strategy_errors(cfg: DictConfig) -> list[str]:
    """``model.strategy`` names a registered engine (the table is the list, so an engine registered there is one)."""
    if cfg.model.strategy in TRAINING_ENGINES:
        return []
    return [f"model.strategy={cfg.model.strategy!r} must be one of {sorted(TRAINING_ENGINES)} (the training engines "
            "registered in rlfoundry/config/training_engines.py)"]


# the layout subtrees an SFT config carries to an engine (EngineRequest.megatron: the engine group, engine.*)
_SFT_LAYOUTS = (None, "megatron")


def _capability_errors(cfg: DictConfig, plugin: Any) -> list[str]:
    """What SFT needs of an engine that its plug-in does not say it has: a layout subtree SFT's config can fill,
    and LoRA where SFT hands it the LoRA keys (an engine with its own layout: ``_fsdp_keys_unread``)."""
    strategy, errors = cfg.model.strategy, []
    if plugin.layout_key not in _SFT_LAYOUTS:
        errors.append(f"model.strategy={strategy}: its engine is laid out by a '{plugin.layout_key}' subtree, and an "
                      "SFT config carries the engine group (engine.*) as a 'megatron' subtree only (or the FSDP keys, "
                      "model.fsdp_config, to an engine without one); register its plug-in with layout_key='megatron' "
                      "or None, or train with engine=fsdp.")
    if cfg.model.lora_rank and not plugin.layout_key and not plugin.supports_lora:
        errors.append(f"model.lora_rank={cfg.model.lora_rank} with model.strategy={strategy}: its engine builds no "
                      "LoRA adapters (its plug-in has no supports_lora); use engine=fsdp, or lora_rank=0.")
    return errors


def _layout_errors(cfg: DictConfig, world_size: int) -> list[str]:
    """An engine with its own layout keys reads the engine group (its plug-in checks it); another reads the
    FSDP keys, and the engine group's Megatron keys set on it are errors."""
    plugin = _plugin(cfg)
    if not plugin.layout_key:
        megatron_keys = _megatron_keys_set(cfg.engine)
        return [f"engine.{key}={value}: a Megatron engine key, and this run's engine (model.strategy="
                f"{cfg.model.strategy}) reads none of the engine group's; add engine=megatron optim=megatron, or "
                "remove it." for key, value in megatron_keys.items()] \
            + _expert_parallel_errors(cfg, world_size) + _vision_errors(cfg, plugin)
    return _own_layout_errors(cfg, plugin, world_size) + _vision_errors(cfg, plugin) + _fsdp_keys_unread(cfg, plugin)


def _expert_parallel_errors(cfg: DictConfig, world_size: int) -> list[str]:
    """``model.fsdp_config.expert_parallel_size`` (verl's engine.ep_size on the automodel engine): the RL roles'
    layout checks (ranks, the model's experts from its config.json, LoRA, hybrid sharding); the engine checks the
    model itself again."""
    from rlfoundry.engines.fsdp.expert_parallel import check_expert_parallel
    from rlfoundry.engines.fsdp.plugin import EXPERT_COUNT_KEYS, _config_value

    m = cfg.model
    try:
        check_expert_parallel(int(m.fsdp_config.expert_parallel_size), world=world_size,
                              num_experts=_config_value(m.partial_pretrain, EXPERT_COUNT_KEYS), lora=m.lora_rank > 0,
                              fsdp_size=int(m.fsdp_config.fsdp_size), key="model.fsdp_config.expert_parallel_size")
    except ValueError as e:
        return [str(e)]
    return []


def _megatron_keys_set(engine: DictConfig) -> dict[str, Any]:
    """The engine group's Megatron keys whose values are not the defaults."""
    defaults = OmegaConf.to_container(OmegaConf.structured(MegatronConfig))
    mine = OmegaConf.to_container(engine, resolve=True)
    # qat: both of verl's SFT engines have it (_engine_errors checks it)
    return {key: mine[key] for key, value in defaults.items() if key != "qat" and mine[key] != value}


def _own_layout_errors(cfg: DictConfig, plugin: Any, world_size: int) -> list[str]:
    """The engine's own start-up checks (its plug-in's, as for the RL roles) on the engine group, their
    messages naming verl's SFT keys (engine.*), and what SFT does not run on it."""
    errors = [_sft_keys(p, plugin) for p in plugin.check(_as_role(cfg, plugin), [ROLE], world_size)]
    if cfg.engine.router_replay.mode != "disabled":
        errors.append(f"engine.router_replay.mode={cfg.engine.router_replay.mode}: routing replay replays a rollout's "
                      "experts; SFT has no rollout (the model routes by its own router). Set it to disabled.")
    return errors


def _vision_errors(cfg: DictConfig, plugin: Any) -> list[str]:
    """A vision-language model on an engine that takes text models only."""
    if plugin.supports_vision_language:
        return []
    from rlfoundry.engines.megatron.plugin import _is_vision_language

    if not _is_vision_language(cfg.model.partial_pretrain):
        return []
    return [f"model.partial_pretrain={cfg.model.partial_pretrain} is a vision-language model: the "
            f"{plugin.name.capitalize()} engine takes text models only (docs/vision.md); use engine=fsdp for image "
            "rows."]


def _fsdp_keys_unread(cfg: DictConfig, plugin: Any) -> list[str]:
    """Keys of the FSDP engine (or of the HF model it trains) that an engine with its own layout keys does not
    read."""
    m, errors, engine = cfg.model, [], f"engine={plugin.name}"
    fsdp_set = {k: v for k, v in OmegaConf.to_container(m.fsdp_config).items()
                if v != getattr(_FSDP_DEFAULTS, k)}
    errors += [f"model.fsdp_config.{k}={v} (verl: engine.{k}): an FSDP engine key; with {engine} remove it "
               f"(the {plugin.name} engine's are the engine group's, engine.*: dtype, param_offload, ...)."
               for k, v in fsdp_set.items()]
    unread = {"model.use_liger": m.use_liger, "model.lora_rank": m.lora_rank,
              "model.enable_gradient_checkpointing": m.enable_gradient_checkpointing,
              "model.override_config": dict(m.override_config)}
    fixes = {"model.lora_rank": f"LoRA SFT on the {plugin.name} engine is not built; use engine=fsdp",
             "model.enable_gradient_checkpointing": "set engine.override_transformer_config.recompute_granularity "
                                                    "(the engine group's recompute) instead",
             "model.override_config": "set engine.override_transformer_config (the engine group's model settings) "
                                      "instead",
             "model.use_liger": f"Liger patches HF models, which the {plugin.name} engine does not train"}
    return errors + [f"{k}={v} with {engine}: {fixes[k]}." for k, v in unread.items() if v]


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


def _optimizer_errors(optim: DictConfig, plugin: Any) -> list[str]:
    """verl's ``optim.override_optimizer_config``, checked as the RL roles' (the fields the engine's plug-in
    accepts: AdamW arguments or megatron-core OptimizerConfig fields; what an rlfoundry key sets, and CPU
    optimizer offload, are errors). A plug-in is registered under its name, as the RL checks group engines."""
    from rlfoundry.trainer.config import _check_optimizer_overrides

    return _check_optimizer_overrides("optim", dict(optim.override_optimizer_config or {}), plugin.name)


def validate_sft_config(cfg: DictConfig, world_size: int = 1) -> None:
    """All cross-key problems at once, so one run reports every mistake."""
    errors = (choice_errors(cfg) + _batch_errors(cfg, world_size) + _setting_errors(cfg)
              + _engine_errors(cfg, world_size))
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
    """Builds data, engine (by the plug-in ``model.strategy`` names: FSDP2, Megatron or a registered one) and
    tracker from a validated config; ``fit()`` trains."""

    def __init__(self, config: DictConfig) -> None:
        self.config = config
        worker, self._owns_group = _join_process_group(config.trainer)
        self.rank, self.world_size, self.device = worker.rank, worker.world_size, worker.device
        try:
            self._setup(config)
        except BaseException:  # a bad data file must not leave a process group behind
            self._leave_groups()
            raise

    def _leave_groups(self) -> None:
        _plugin(self.config).teardown()  # the engine's own groups (megatron-core's): a later run builds its own
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _setup(self, config: DictConfig) -> None:
        validate_sft_config(config, self.world_size)
        _seed_everything(config.trainer.seed)
        if config.model.external_lib:
            importlib.import_module(config.model.external_lib)
        self.run_dir = Path(config.trainer.default_local_dir)
        self._copies = _model_copy(config)[0]  # ranks that read the same rows
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
            train, val = self._at_most(load_pairs(data.train_files, data), data.train_max_samples), []
        if data.val_files is not None:
            val = self._at_most(load_pairs(data.val_files, data), data.val_max_samples)
        return train, val

    def _at_most(self, pairs: list[Pair], max_samples: int) -> list[Pair]:
        """verl's ``data.train_max_samples`` / ``val_max_samples`` over a file's rows."""
        data = self.config.data
        seed = data.seed if data.seed is not None else self.config.trainer.seed
        picked = max_samples_drawn(len(pairs), max_samples, data.shuffle, seed)
        return pairs if picked is None else [pairs[i] for i in picked]

    def _build_loaders(self) -> tuple[DataLoader, DataLoader | None]:
        data = self.config.data
        train_pairs, val_pairs = self._pairs()
        dp, dp_rank = self._data_parallel()
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

    def _data_parallel(self) -> tuple[int, int]:
        """How many data-parallel ranks read the data, and which one this rank is, as the engine's plug-in lays them
        out before its engine is built: the ranks of one Ulysses group (consecutive ranks, engines/fsdp/ulysses.py)
        or of one Megatron model copy (megatron-core's groups, joined now) read the same rows."""
        plugin = _plugin(self.config)
        dp_rank, dp = plugin.data_parallel_rank(_as_role(self.config, plugin)[ROLE], self.rank, self.world_size)
        return dp, dp_rank

    def _total_steps(self) -> int:
        per_epoch = len(self.train_loader)
        total = self.config.trainer.total_training_steps
        return int(total) if total is not None else per_epoch * self.config.trainer.total_epochs

    def _optim(self) -> Any:
        """verl's SFT optimiser keys -> the engines' (the RL roles' names)."""
        from rlfoundry.config.schema import OptimConfig

        o = self.config.optim
        return OptimConfig(lr=o.lr, betas=list(o.betas), weight_decay=o.weight_decay, eps=o.eps,
                           lr_warmup_steps_ratio=o.warmup_steps_ratio, lr_warmup_steps=o.lr_warmup_steps,
                           lr_scheduler_type=o.lr_scheduler, min_lr_ratio=o.min_lr_ratio,
                           lr_warmup_init=o.lr_warmup_init, lr_decay_steps=o.lr_decay_steps,
                           override_optimizer_config=dict(o.override_optimizer_config),
                           total_training_steps=self.total_steps)

    def _build_engine(self) -> Any:
        """The engine ``model.strategy`` names, built by its plug-in from the SFT role's request, as the RL roles'
        engines are (``EnginePlugin.build``)."""
        from rlfoundry import cpu as cpu_kernels

        if cpu_kernels.enabled(self.config.model.cpu_kernels, self.device):
            from rlfoundry.cpu.malloc import tune_malloc

            tune_malloc()  # one of the CPU speed-ups: glibc keeps freed activation memory
        plugin = _plugin(self.config)
        return plugin.build(self._engine_request(plugin), self.device, ROLE)

    def _engine_request(self, plugin: Any) -> Any:
        """verl's SFT keys under the RL roles' names: the model keys an engine reads of a role's ``model``, the
        FSDP keys as its ``fsdp_config`` and, for an engine laid out by a subtree of its own (``layout_key``), the
        engine group as its ``megatron`` subtree."""
        from rlfoundry.config.schema import FSDPConfig
        from rlfoundry.engines.base import EngineRequest
        from rlfoundry.models.hf import resolve_model_path
        from rlfoundry.models.lora import LoraSpec

        m, fsdp = self.config.model, self.config.model.fsdp_config
        # model.mtp: the model's MTP layers, their loss on the response tokens beside the SFT loss (an engine that
        # builds them: supports_mtp, checked at start-up)
        model = SimpleNamespace(path=str(resolve_model_path(m.partial_pretrain)), cpu_kernels=m.cpu_kernels,
                                trust_remote_code=m.trust_remote_code, use_remove_padding=self.config.use_remove_padding,
                                use_liger=m.use_liger, mtp=m.mtp)
        mixed = {"param_dtype": fsdp.param_dtype, "reduce_dtype": fsdp.reduce_dtype}
        fsdp_config = FSDPConfig(model_dtype=fsdp.model_dtype, mixed_precision=mixed, param_offload=fsdp.offload_params,
                                 optimizer_offload=fsdp.optimizer_offload, reshard_after_forward=fsdp.reshard_after_forward,
                                 fsdp_size=int(fsdp.fsdp_size), expert_parallel_size=int(fsdp.expert_parallel_size))
        return EngineRequest(model=model, fsdp=fsdp_config, megatron=self._layout(plugin), optim=self._optim(),
                             grad_clip=self.config.optim.clip_grad, override_config=dict(m.override_config),
                             gradient_checkpointing=m.enable_gradient_checkpointing, lora=LoraSpec.of(m),
                             ulysses_sequence_parallel_size=int(self.config.ulysses_sequence_parallel_size))

    def _layout(self, plugin: Any) -> MegatronConfig | None:
        """The engine group as the typed layout subtree of an engine that has one (None: the engine reads the FSDP
        keys). Its compute dtype on the CPU is float32, as for the RL roles (trainer/config.py
        _resolve_megatron_dtypes): the CPU run is the exact reference."""
        if not plugin.layout_key:
            return None
        from rlfoundry.config.typed import to_typed

        engine = OmegaConf.to_container(self.config.engine, resolve=True)
        layout = to_typed(MegatronConfig, {k: v for k, v in engine.items() if k in _MEGATRON_KEYS}, name="engine")
        if plugin.dtype_key and torch.device(self.device).type == "cpu" and layout.dtype not in ("float32", "fp32"):
            key = _sft_keys(f"{ROLE}.{plugin.dtype_key}", plugin)
            say_once(f"{key}=float32 (asked: {layout.dtype}): the CPU trains in float32, as the FSDP engine does "
                     "there; bf16 is the GPU precision")
            layout = dataclasses.replace(layout, dtype="float32")
        return layout

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
        # a Ulysses group's ranks each hold 1/sp of a micro-batch's tokens: its budget is sp GPUs' (verl's rule;
        # the Megatron engine scales it by its context-parallel size itself)
        budget = int(data.max_token_len_per_gpu) * sp if data.use_dynamic_bsz else None  # wins over the row count
        plan = UpdatePlan(micro=MicroBatching(data.micro_batch_size_per_gpu, budget))
        out = self.engine.train_batch(self._on_device(batch), LogProbs(), sft_loss, plan)
        lr = self.engine.step_lr_scheduler()  # the lr this step used
        (tokens,) = self._all_reduce(float(batch["response_mask"].sum()) / self._copies)  # ranks holding each row
        return {"train/loss": out["train/loss"][0], "train/lr": lr, "train/grad_norm": out[f"{ROLE}/grad_norm"][0],
                "train/response_tokens": tokens, **{k: v[0] for k, v in out.items() if k.startswith("mtp_losses/")}}

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
        from transformers import PretrainedConfig

        staging = step_dir / "huggingface"
        # the FSDP engine's HF model trains without a KV cache; the exported model is for inference (the Megatron
        # engine writes the checkpoint's own HF config)
        config = self.engine.module.config if isinstance(self.engine.module.config, PretrainedConfig) else None
        if config is not None:
            config.use_cache = True
        try:
            # a vision-language model's processor writes its tokenizer and image processor: the output takes images
            self.engine.save_hf_model(str(staging), self.processor or self.tokenizer)
        finally:
            if config is not None:
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
        (tokens,) = self._all_reduce(float(batch["attention_mask"].sum()) / self._copies)
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
        self._leave_groups()
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
