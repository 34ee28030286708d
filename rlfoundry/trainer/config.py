"""Load, validate and resolve the PPO trainer config — once, at start-up.

    cfg = load_config(["data.train_batch_size=64", "trainer.logger=['console','wandb']"])
    resolved = resolve_config(cfg, steps_per_epoch=len(train_loader), cuda_available=...)

Three steps, each a function:

1. ``load_config``: typed schema (``rlfoundry/config/schema.py``, the one source of the defaults)
   ← optional overlay YAML (``--config-name``) ← command-line overrides in Hydra's syntax
   (``key=value``, ``+key=value`` under open dicts, ``++key=value``, lists ``[a,b]``). A wrong type, an unknown key (with the
   closest valid key) or a bad value is a ``ConfigError`` whose message names the key. The loading
   itself is ``load_typed_config``, shared with ``rlfoundry sft`` (``config/sft_schema.py``).
2. ``validate_config``: cross-key rules (batch-size arithmetic, gae needs a critic, choices ...);
   every problem is collected so one run reports them all.
3. ``resolve_config`` (pure): fills what depends on the run — device, worker back end, estimator,
   micro-batch sizes from deprecated keys, model paths, data files, total training steps — and
   returns a resolved, read-only copy. Nothing mutates the config afterwards.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlfoundry.config import typed
from rlfoundry.config.batch import BatchSizeError, per_gpu, role_batch
from rlfoundry.config.compose import Layer, compose, engine_layers, find_config
from rlfoundry.config.distillation import distillation_errors
from rlfoundry.config.sppo import sppo_errors
from rlfoundry.config.flowrl import flowrl_errors, flowrl_warnings
from rlfoundry.config.gvpo import gvpo_errors
from rlfoundry.config.spo import spo_errors
from rlfoundry.config.roles import adv_estimator, need_reference_policy, use_critic
from rlfoundry.config.spin import spin_errors
from rlfoundry.config.schema import (DISTILLATION_TOPK_MODES, STRATEGIES, SUM_PI_SQUARED_ESTIMATORS, PPOConfig, freeze,
                                     qat_problems)
from rlfoundry.config.training_engines import TRAINING_ENGINES, engine_plugin, training_engine
from rlfoundry.config.typed import ConfigError, KeyInfo, ReplacedKeyWarning, apply_setting, keys_of, pick
from rlfoundry.config.fsdp_turbo import adopt_fsdp_turbo
from rlfoundry.config.veomni import adopt_veomni
from rlfoundry.config.verl_compat import (
    CHECKPOINT_ROLES,
    IGNORED_LOGGERS,
    NO_EFFECT_KEYS,
    SDPA_STANDS_IN_FOR,
    NoEffectKeyWarning,
    adopt_verl_spellings,
    loggers,
    prefer_user_deprecated_keys,
    warn_no_effect,
)
from rlfoundry.utils.tracking import SUPPORTED_BACKENDS, missing_packages

__all__ = [
    "CONFIG_DIR",
    "ConfigError",
    "NoEffectKeyWarning",
    "ReplacedKeyWarning",
    "NO_EFFECT_KEYS",
    "Override",
    "check_startup_paths",
    "is_hf_model_dir",
    "load_config",
    "load_typed_config",
    "parse_overrides",
    "resolve_asset_path",
    "resolve_config",
    "schema_keys",
    "use_critic",
    "validate_config",
    "world_size",
]

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
ASSET_SCHEME = "rlfoundry://"
SUPPORTED_LOGGERS = SUPPORTED_BACKENDS  # trainer.logger's values we run; verl's others: verl_compat.IGNORED_LOGGERS
# verl-key translation (no-effect keys, other spellings, deprecated keys): config/verl_compat.py


# Choice lists live beside the fields they constrain (schema.one_of / follows metadata); replaced
# keys (model.cpu_linear ...) in schema.REPLACED_KEYS; config/typed.py checks both.


def schema_keys(cls: type = PPOConfig, prefix: str = "") -> dict[str, KeyInfo]:
    """Every dotted key of the schema (inner nodes too) → its annotation, openness, choices and link."""
    return typed.schema_keys(cls, prefix)


# ───────────────────────────────────── overrides ─────────────────────────────────────


@dataclass(frozen=True)
class Override:
    key: str
    value: Any
    kind: str  # "set" | "add" (+key) | "force_add" (++key) | "delete" (~key)
    text: str  # as the user typed it, for messages


def _parse_one(text: str) -> Override:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        (ov,) = OverridesParser.create().parse_overrides([text])
    except OverrideParseException:
        # A value outside Hydra's grammar (e.g. an unexpanded '~/data/x.parquet'): keep it as a string.
        prefix, sep, raw = text.partition("=")
        if not sep or not prefix.lstrip("+~"):
            raise ConfigError(f"Cannot read the override '{text}': expected key=value, e.g. trainer.total_epochs=2.") from None
        kind = "force_add" if prefix.startswith("++") else "add" if prefix.startswith("+") else "set"
        return Override(prefix.lstrip("+"), raw, kind, text)
    if ov.is_sweep_override():
        raise ConfigError(f"'{text}' looks like a Hydra sweep (comma-separated values); for a list write [a,b].")
    kind = "delete" if ov.is_delete() else "force_add" if ov.is_force_add() else "add" if ov.is_add() else "set"
    value = None if kind == "delete" else ov.value()
    return Override(ov.key_or_group, value, kind, text)


def parse_overrides(args: Sequence[str]) -> list[Override]:
    """Hydra-syntax ``key=value`` strings → ``Override`` records (values typed: 1e-6 → float, null → None)."""
    return [_parse_one(a) for a in args]


def _apply(cfg: DictConfig, ov: Override) -> None:
    """One override, checked against the schema ``cfg`` was built from (config/typed.py: apply_setting)."""
    keys = keys_of(OmegaConf.get_type(cfg))
    apply_setting(cfg, ov.key, ov.value, text=ov.text, keys=keys, kind=ov.kind)


# ───────────────────────────────────── loading ─────────────────────────────────────


def _merge_layers(cfg: DictConfig, layers: Sequence[Layer]) -> list[str]:
    """Merge composed YAML layers (``config/compose.py``) into the typed config key by key, with the
    command line's checks; returns the dotted keys they set."""
    keys = []
    schema_keys_ = keys_of(OmegaConf.get_type(cfg))
    for layer in layers:
        for key, value in typed.leaves(layer.values, schema_keys_).items():
            _apply(cfg, Override(key, value, "set", f"{layer.source}: {key}"))
            keys.append(key)
    return keys


def _find_config_file(name: str, config_path: str | None) -> Path:
    """``--config-name`` lookup, as Hydra does it (``config/compose.py``: ``find_config``)."""
    return find_config(name, config_path)


def _split_engine(overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """verl's August engine group on the command line (``model_engine=megatron``): a choice of config,
    not a key; returns it (None: not given) and the other overrides."""
    engine, rest = None, []
    for text in overrides:
        key, sep, value = text.partition("=")
        if sep and key.lstrip("+") == "model_engine":
            engine = value.strip()
        else:
            rest.append(text)
    return engine, rest


def load_typed_config(
    schema: type, overrides: Sequence[str] = (), overlay: Path | None = None, *,
    config_path: str | None = None, engine: str | None = None,
) -> tuple[DictConfig, list[str]]:
    """Typed ``schema`` (its defaults) ← the engine's layers ← ``overlay`` YAML with its ``defaults:``
    composed ← Hydra-style ``overrides``, key by key.

    Any schema dataclass (``PPOConfig``, ``sft_schema.SFTConfig``): an unknown key names the
    nearest valid one, a wrong type the expected type. ``engine`` is verl's ``model_engine`` choice
    from the command line; it wins over one in the overlay's defaults. Returns the config
    (unvalidated, unresolved) and the keys the user set (overlay and overrides).
    """
    cfg = typed.structured(schema)
    layers, chosen = compose(overlay, config_path) if overlay is not None else ([], None)
    choice = engine or chosen
    if choice is not None:
        layers = engine_layers(choice, "the command line" if engine else str(overlay)) + layers
    user_keys = _merge_layers(cfg, layers)
    parsed = parse_overrides(overrides)
    for ov in parsed:
        _apply(cfg, ov)
    _check_engine_choice(cfg, choice)
    return cfg, user_keys + [ov.key for ov in parsed]


def _check_engine_choice(cfg: DictConfig, engine: str | None) -> None:
    """``model_engine=dp`` with a config that puts the actor on Megatron (or the reverse) would run on an
    engine the command line did not ask for: say which key decides."""
    strategy = OmegaConf.select(cfg, "actor_rollout_ref.actor.strategy")
    if engine is None or strategy not in STRATEGIES:  # an unknown strategy: the choice checks name it
        return
    wanted, runs_on = training_engine(engine), training_engine(strategy)
    if runs_on not in TRAINING_ENGINES or wanted not in TRAINING_ENGINES:
        return
    if engine_plugin(runs_on).name != engine_plugin(wanted).name:
        raise ConfigError(f"model_engine={engine} but actor_rollout_ref.actor.strategy={strategy} (set by the config "
                          "or an override): drop one of them, or make them agree.")


def load_config(
    overrides: Sequence[str] = (), config_name: str | None = None, config_path: str | None = None
) -> DictConfig:
    """PPO: schema defaults ← overlay ``config_name`` (its defaults composed) ← ``overrides``; then
    validate. Unresolved. ``model_engine=fsdp|dp|megatron|veomni`` among the overrides picks the engine."""
    overlay = _find_config_file(config_name, config_path) if config_name else None
    engine, overrides = _split_engine(overrides)
    cfg, user_keys = load_typed_config(PPOConfig, overrides, overlay, config_path=config_path, engine=engine)
    adopt_verl_spellings(cfg, user_keys + adopt_veomni(cfg, user_keys) + adopt_fsdp_turbo(cfg, user_keys))
    adopt_classifier_reward_model(cfg)
    prefer_user_deprecated_keys(cfg, user_keys)
    _adopt_async_keys(cfg, user_keys)
    _fill_fully_async_batch(cfg)
    _adopt_engine_settings(cfg, user_keys)
    warn_no_effect(cfg, user_keys)
    validate_config(cfg)
    return cfg


def _check_checkpoint_contents(cfg: DictConfig) -> list[str]:
    """verl's ``checkpoint.{save,load}_contents``: known entries, and always the model (a role's
    directory without weights cannot be resumed)."""
    from rlfoundry.checkpoint.state import CHECKPOINT_CONTENTS

    errors = []
    for role in CHECKPOINT_ROLES:
        for which in ("save_contents", "load_contents"):
            listed = list(pick(cfg, f"{role}.checkpoint.{which}"))
            unknown = [x for x in listed if x not in CHECKPOINT_CONTENTS]
            if unknown:
                errors.append(f"{role}.checkpoint.{which}={listed}: unknown {unknown}; the entries are "
                              f"{list(CHECKPOINT_CONTENTS)}.")
            elif "model" not in listed:
                errors.append(f"{role}.checkpoint.{which}={listed} must include 'model' (the weights; leave out "
                              "'optimizer' to save or restore the weights alone).")
        if pick(cfg, f"{role}.checkpoint.async_save", False):
            errors.append(f"{role}.checkpoint.async_save=true: checkpoints written in the background while training "
                          "goes on (verl's Megatron async save) are not built here; a checkpoint is written before "
                          "the next step. Set it to false.")
    return errors


# ───────────────────────────────────── validation ─────────────────────────────────────


def world_size(cfg: DictConfig) -> int:
    """Worker ranks of one role: nnodes × n_gpus_per_node (on CPU, processes per node)."""
    return int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)


def rollout_world_size(cfg: DictConfig) -> int:
    """Ranks of the rollout's own pool (``rollout.nnodes × rollout.n_gpus_per_node``); 0: colocated."""
    return int(cfg.rollout.nnodes) * int(cfg.rollout.n_gpus_per_node)


def reward_pool_owner(cfg: DictConfig) -> DictConfig:
    """Whose ``enable_resource_pool`` / ``nnodes`` / ``n_gpus_per_node`` place the reward pool: the judge's
    (``reward.reward_model``), or ``reward_model``'s when verl's reward loop serves that model to the custom
    function (the classifier always runs beside the actor)."""
    from rlfoundry.config.verl_compat import serves_reward_model

    return cfg.reward_model if serves_reward_model(cfg) else cfg.reward.reward_model


def judge_world_size(cfg: DictConfig) -> int:
    """Ranks of the generative reward model's own pool (``enable_resource_pool`` of ``reward_pool_owner``);
    0: colocated with the actor (or no generative reward model)."""
    owner = reward_pool_owner(cfg)
    return int(owner.nnodes) * int(owner.n_gpus_per_node) if owner.enable and owner.enable_resource_pool else 0


def pool_config(cfg: DictConfig, pool: str) -> DictConfig:
    """The node holding ``nnodes`` / ``n_gpus_per_node`` of a worker pool."""
    if pool == "reward_pool":
        return reward_pool_owner(cfg)
    return cfg.rollout if pool == "rollout_pool" else cfg.trainer


def _adopt_async_keys(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    """verl's January fully-async spellings onto the keys the trainer reads: ``rollout.total_epochs`` is
    ``trainer.total_epochs`` (the rollouter's passes over the data are the trainer's: it trains every
    sample once, in order) and ``rollout.test_freq`` counts weight syncs, each
    ``trigger_parameter_sync_step`` training steps. A verl key given beside ours with another value is an
    error (which would win is not obvious)."""
    pool, steps = cfg.rollout, int(cfg.async_training.trigger_parameter_sync_step)
    for verl_key, ours, value in (("rollout.total_epochs", "trainer.total_epochs", pool.total_epochs),
                                  ("rollout.test_freq", "trainer.test_freq",
                                   None if pool.test_freq is None else int(pool.test_freq) * steps
                                   if int(pool.test_freq) > 0 else int(pool.test_freq))):
        if value is None:
            continue
        if ours in user_keys and OmegaConf.select(cfg, ours) != value:
            raise ConfigError(f"{verl_key}={OmegaConf.select(cfg, verl_key)} (verl's fully-async spelling) and "
                              f"{ours}={OmegaConf.select(cfg, ours)} disagree: give one of them.")
        OmegaConf.update(cfg, ours, value)
    _adopt_async_rollout_log_probs(cfg)


def _adopt_async_rollout_log_probs(cfg: DictConfig) -> None:
    """verl's January fully-async ``async_training.use_rollout_log_probs`` is the actor's
    ``use_rollout_log_probs`` (verl's config interpolates one from the other; August keeps only the
    actor's): the rollout's log-probs are the old log-probs. Both given and different is an error."""
    async_value, actor = cfg.async_training.use_rollout_log_probs, cfg.actor_rollout_ref.actor
    if async_value is None:
        return
    if actor.use_rollout_log_probs is not None and bool(actor.use_rollout_log_probs) != bool(async_value):
        raise ConfigError(f"async_training.use_rollout_log_probs={async_value} (verl's January fully-async spelling) "
                          f"and actor_rollout_ref.actor.use_rollout_log_probs={actor.use_rollout_log_probs} disagree: "
                          "give one of them.")
    actor.use_rollout_log_probs = bool(async_value)


def _fill_fully_async_batch(cfg: DictConfig) -> None:
    """verl's fully-async scripts set ``data.train_batch_size=0``: a training step is
    ``async_training.require_batches`` mini-batches of ``actor.ppo_mini_batch_size`` prompts."""
    if cfg.async_training.mode == "fully_async" and cfg.data.train_batch_size == 0:
        cfg.data.train_batch_size = int(cfg.async_training.require_batches) * int(
            cfg.actor_rollout_ref.actor.ppo_mini_batch_size)


def _check_choices(cfg: DictConfig) -> list[str]:
    errors = typed.choice_errors(cfg, keys_of(PPOConfig))
    for name in loggers(cfg):
        if name not in SUPPORTED_LOGGERS + IGNORED_LOGGERS:
            errors.append(f"trainer.logger entry {name!r} is not one of {list(SUPPORTED_LOGGERS)}.")
    return errors + missing_packages(loggers(cfg))


def _check_estimator(cfg: DictConfig) -> list[str]:
    from rlfoundry.algos import core_algos

    est = adv_estimator(cfg)
    known = sorted(core_algos.ADV_ESTIMATOR_REGISTRY)
    errors = []
    if est not in known:
        hint = difflib.get_close_matches(est, known, n=1)
        extra = f" Did you mean '{hint[0]}'?" if hint else ""
        errors.append(f"algorithm.adv_estimator={est!r} is not a registered estimator ({known}).{extra}")
    if est == "gae" and cfg.critic.enable is False:
        errors.append("algorithm.adv_estimator=gae needs the critic, but critic.enable=False.")
    if use_critic(cfg) and cfg.critic.model.path is None:
        errors.append(
            f"algorithm.adv_estimator={est} needs a critic model: set critic.model.path to an HF model "
            "directory (often the actor's, e.g. critic.model.path=rlfoundry://arithmetic-policy), "
            "or choose a critic-free estimator such as algorithm.adv_estimator=grpo."
        )
    return errors + _check_sum_pi_squared(cfg, est)


def _check_sum_pi_squared(cfg: DictConfig, est: str) -> list[str]:
    """The optimal token baselines read ``sum_pi_squared``, which the actor's log-prob pass writes only with
    ``actor.calculate_sum_pi_squared``: required for them, as verl's trainer requires it (it asserts the
    key), and that pass must run (bypass mode takes the rollout's log-probs instead and skips it)."""
    key = "actor_rollout_ref.actor.calculate_sum_pi_squared"
    if est in SUM_PI_SQUARED_ESTIMATORS and not cfg.actor_rollout_ref.actor.calculate_sum_pi_squared:
        return [f"algorithm.adv_estimator={est} reads the actor's per-token sum_v pi_v^2: set {key}=true "
                "(verl requires it too)."]
    if cfg.actor_rollout_ref.actor.calculate_sum_pi_squared and cfg.algorithm.rollout_correction.bypass_mode:
        return [f"{key}=true with algorithm.rollout_correction.bypass_mode=true: bypass mode skips the actor's "
                "log-prob pass, which computes sum_pi_squared; set bypass_mode=false (old log-probs recomputed)."]
    return []


def _check_batch_sizes(cfg: DictConfig) -> list[str]:
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, n, ws = arr.actor, int(arr.rollout.n), world_size(cfg)
    errors = []
    if data.train_batch_size <= 0 or n <= 0 or ws <= 0:
        return [f"data.train_batch_size={data.train_batch_size}, rollout.n={n} and nnodes × n_gpus_per_node={ws} must be positive."]
    # no rule for the world size: a call pads the batch to it and drops the padding's rows (generation,
    # log-probs), an update trains its data-parallel share of the unpadded rows (engines' update_rows),
    # so only the data-parallel split of a mini-batch (role_batch) constrains the samples per step
    roles = [("actor_rollout_ref.actor", actor)] + ([("critic", cfg.critic)] if use_critic(cfg) else [])
    for role, node in roles:
        mini = int(node.ppo_mini_batch_size)
        if mini <= 0 or data.train_batch_size % mini:
            errors.append(f"data.train_batch_size={data.train_batch_size} is not a multiple of {role}.ppo_mini_batch_size="
                          f"{mini}; every optimizer step should see the same number of prompts.")
            continue
        for old in ("ppo_micro_batch_size",):
            if node[old] is not None and node[old + "_per_gpu"] is not None:
                errors.append(f"Set only one of {role}.{old} (deprecated, global) and {role}.{old}_per_gpu.")
        dp = _data_parallel_size(node, ws)
        try:
            role_batch(role, mini, n, dp, per_gpu(node.ppo_micro_batch_size_per_gpu, node.ppo_micro_batch_size, dp),
                       bool(node.use_dynamic_bsz))
        except BatchSizeError as e:
            errors.append(str(e))
    return errors


def _data_parallel_size(role: DictConfig, ws: int) -> int:
    """The ranks a role's mini-batch is split over, as its engine splits them (a layout that does not
    divide the ranks is reported by the engine's own check, ``_check_engines``). A strategy no engine
    is registered under (reported by the choice check) splits over all ranks."""
    strategy = role.get("strategy", "fsdp")
    if strategy not in TRAINING_ENGINES:
        return ws
    return engine_plugin(strategy).data_parallel_size(
        ws, role.get("megatron"), int(role.get("ulysses_sequence_parallel_size", 1) or 1))


def _check_lengths(cfg: PPOConfig) -> list[str]:
    """A dynamic micro-batch of the actor's update must hold one full sequence. The budget is per GPU:
    under Ulysses sequence parallelism each rank of a group holds 1/sp of a sequence, so the group's
    budget is sp × the key (the FSDP engine's ``_micro_batches`` multiplies, as verl's dp_actor does;
    the Megatron engine multiplies by its context-parallel size, as verl's megatron_actor does)."""
    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    seq = data.max_prompt_length + data.max_response_length
    if actor.strategy not in TRAINING_ENGINES:  # the choice check names it
        return []
    sp, key = engine_plugin(actor.strategy).sequence_split(actor)
    name = f"actor.{key}"
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu * max(1, sp) < seq:
        times = f" × {name} {sp}" if sp > 1 else ""
        return [f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu}{times} is below "
                f"one full sequence (data.max_prompt_length + data.max_response_length = {seq})."]
    return []


def _check_multi_turn(cfg: DictConfig) -> list[str]:
    """``rollout.multi_turn``: tool and interaction configs that load."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return []
    errors = []
    if multi_turn.tool_config_path:
        from rlfoundry.tools.registry import ToolConfigError, initialize_tools_from_config

        try:
            initialize_tools_from_config(resolve_asset_path(multi_turn.tool_config_path))
        except ToolConfigError as e:
            errors.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path: {e}")
    if multi_turn.interaction_config_path:
        from rlfoundry.interactions import InteractionConfigError, initialize_interactions_from_config

        try:
            initialize_interactions_from_config(resolve_asset_path(multi_turn.interaction_config_path))
        except InteractionConfigError as e:
            errors.append(f"actor_rollout_ref.rollout.multi_turn.interaction_config_path: {e}")
    return errors


def _check_judge(cfg: DictConfig) -> list[str]:
    """``reward.reward_model`` (the generative reward model): what it needs to start."""
    judge, key = cfg.reward.reward_model, "reward.reward_model"
    if not judge.enable:
        return []
    from rlfoundry.config import to_typed
    from rlfoundry.config.schema import GenerativeRewardModelConfig
    from rlfoundry.rewards.judge import check_judge_config

    errors = [] if judge.model_path else [f"{key}.enable=true needs {key}.model_path (the judge's HF directory)."]
    if cfg.reward_model.enable:
        errors.append(f"reward_model.enable=true (a classifier reward model) and {key}.enable=true (a judge): "
                      "enable one of them.")
    if int(judge.rollout.n) != 1:
        errors.append(f"{key}.rollout.n={judge.rollout.n}: the judge writes one judgement per response (n=1).")
    errors += _check_pool(key, judge, cfg)
    return errors + check_judge_config(to_typed(GenerativeRewardModelConfig, judge, name=key))


def _check_pool(key: str, owner: DictConfig, cfg: DictConfig) -> list[str]:
    """A generative reward model's own pool (``enable_resource_pool``) must have ranks the back end can place."""
    if not owner.enable_resource_pool:
        return []
    errors = []
    if int(owner.nnodes) < 1 or int(owner.n_gpus_per_node) < 1:
        errors.append(f"{key}.enable_resource_pool=true needs nnodes >= 1 and n_gpus_per_node >= 1 (CPU: processes).")
    if cfg.trainer.worker_backend == "process" and int(owner.nnodes) != 1:
        errors.append(f"trainer.worker_backend=process is single-node (processes on this machine), but {key}.nnodes={owner.nnodes}; use ray.")
    return errors


def _check_unsupported(cfg: PPOConfig) -> list[str]:
    return (_check_lora(cfg) + _check_multi_turn(cfg) + _check_judge(cfg) + _check_engines(cfg)
            + _check_routing_replay(cfg) + _check_unbuilt_model_features(cfg))


def _check_mtp(cfg: PPOConfig) -> list[str]:
    """verl's multi-token prediction (``model.mtp``): trained by the engines whose plug-in says so (Megatron:
    engines/megatron/mtp.py, whose plug-in checks the model and the layout); drafted with by the rollout
    engines whose entry says so (HF: workers/rollout/mtp_speculative.py)."""
    mtp, errors = cfg.actor_rollout_ref.model.mtp, []
    if mtp.enable_rollout:
        errors += _mtp_rollout_problems(cfg)
    strategy = cfg.actor_rollout_ref.actor.strategy
    if mtp.enable and not engine_plugin(strategy).supports_mtp:
        errors.append(f"actor_rollout_ref.model.mtp.enable=true with actor.strategy={strategy}: multi-token prediction "
                      "(the model's MTP layers, trained beside the policy) is built on the Megatron engine; set "
                      "actor_rollout_ref.actor.strategy=megatron, or mtp.enable=false.")
    return errors


def _check_qat(cfg: PPOConfig) -> list[str]:
    """verl's quantisation-aware training (``qat.enable`` under a role's engine keys or the actor): not built."""
    arr = cfg.actor_rollout_ref
    return qat_problems({"actor_rollout_ref.actor": arr.actor.qat,
                         "actor_rollout_ref.actor.fsdp_config": arr.actor.fsdp_config.qat,
                         "actor_rollout_ref.actor.megatron": arr.actor.megatron.qat,
                         "actor_rollout_ref.ref.fsdp_config": arr.ref.fsdp_config.qat,
                         "actor_rollout_ref.ref.megatron": arr.ref.megatron.qat,
                         "critic.model.fsdp_config": cfg.critic.model.fsdp_config.qat,
                         "critic.megatron": cfg.critic.megatron.qat})


def _mtp_rollout_problems(cfg: PPOConfig) -> list[str]:
    """``mtp.enable_rollout``: the HF engine drafts ``num_speculative_tokens`` tokens a round with the MTP layers
    (verl's vLLM keys; the SGLang ones are SGLang's server arguments, which verl's vLLM rollout ignores too); what
    that loop is not combined with."""
    from rlfoundry.config.rollout_engines import mtp_draft_problem

    arr, key = cfg.actor_rollout_ref, "actor_rollout_ref.model.mtp.enable_rollout=true"
    mtp, rollout = arr.model.mtp, arr.rollout
    problem = mtp_draft_problem(rollout.name)
    if problem is not None:
        return [problem]
    from rlfoundry.models.hf import resolve_model_path
    from rlfoundry.models.mimo import draft_problem

    errors = []
    try:
        model = draft_problem(resolve_model_path(arr.model.path))
    except (OSError, ValueError):  # the model's own checks say what is wrong with the path
        model = None
    if model is not None:
        errors.append(f"{key} with actor_rollout_ref.model.path={arr.model.path}: {model}; use a MiMo model or "
                      "enable_rollout=false.")
    if mtp.method != "mtp":
        errors.append(f"{key} with mtp.method={mtp.method!r}: the HF rollout drafts with the MTP layers only (method=mtp).")
    if int(mtp.num_speculative_tokens) < 1:
        errors.append(f"{key} with mtp.num_speculative_tokens={mtp.num_speculative_tokens}: draft at least 1 token.")
    not_combined = {
        "rollout.exact_log_probs=true": rollout.exact_log_probs,
        "rollout.use_torch_compile=true (the static-shape, CUDA-graph decode)": rollout.use_torch_compile is True,
        "rollout.enable_rollout_routing_replay=true": rollout.enable_rollout_routing_replay,
    }
    errors += [f"{key} with {what}: the speculative loop runs on the dynamic KV cache and is not built with it; "
               f"turn one off." for what, on in not_combined.items() if on]
    return errors


def _check_unbuilt_model_features(cfg: PPOConfig) -> list[str]:
    """verl features with keys here but no implementation: a quantised rollout, an
    attention kernel other than SDPA (Megatron-FSDP: the Megatron plug-in's check)."""
    arr, errors = cfg.actor_rollout_ref, []
    for name in ("quantization", "quantization_config_file"):
        if getattr(arr.rollout, name) is not None:
            errors.append(f"actor_rollout_ref.rollout.{name}={getattr(arr.rollout, name)}: a quantised rollout (verl's "
                          "fp8 / torchao weights in the engine, synced from the trainer's) is not built; the rollout runs "
                          "in rollout.dtype. Remove the key.")
    errors += _check_mtp(cfg) + _check_qat(cfg)
    for key, model in (("actor_rollout_ref.model", arr.model), ("critic.model", cfg.critic.model)):
        attention = (model.override_config or {}).get("attn_implementation")
        if attention is not None and attention not in SDPA_STANDS_IN_FOR:
            errors.append(f"{key}.override_config.attn_implementation={attention}: the engines here compute attention with "
                          f"transformers' SDPA; one of {list(SDPA_STANDS_IN_FOR)} runs as SDPA (the same exact attention). "
                          "Remove the key or use sdpa.")
    if cfg.critic.megatron.router_replay.mode != "disabled":
        errors.append(f"critic.megatron.router_replay.mode={cfg.critic.megatron.router_replay.mode}: routing replay is "
                      "the actor's (actor_rollout_ref.actor.router_replay.mode); the critic routes by its own router.")
    return errors


def _check_routing_replay(cfg: PPOConfig) -> list[str]:
    """MoE routing replay (docs/moe.md): R3 reads what the rollout records; recording is built for the HF engine's
    own sampling loop (why not the others: config/rollout_engines.py), replaying for the engines whose plug-in
    says so (FSDP, Megatron)."""
    from rlfoundry.config.rollout_engines import routed_experts_problem

    arr, errors = cfg.actor_rollout_ref, []
    mode, rollout, key = arr.actor.router_replay.mode, arr.rollout, "actor_rollout_ref"
    if mode == "R3" and not rollout.enable_rollout_routing_replay:
        errors.append(f"{key}.actor.router_replay.mode=R3 replays the experts the rollout chose, but the rollout does not "
                      f"record them: set {key}.rollout.enable_rollout_routing_replay=true (or mode=R2).")
    if mode != "disabled" and not engine_plugin(arr.actor.strategy).supports_routing_replay:
        errors.append(f"{key}.actor.router_replay.mode={mode}: routing replay is built for the FSDP and Megatron engines, "
                      f"not actor.strategy={arr.actor.strategy}; use strategy=fsdp or megatron, or mode=disabled.")
    if arr.ref.router_replay.mode != "disabled":
        errors.append(f"{key}.ref.router_replay.mode={arr.ref.router_replay.mode}: the reference routes by its own router "
                      "(verl reads the actor's router_replay only); set it to disabled.")
    problem = routed_experts_problem(rollout.name) if rollout.enable_rollout_routing_replay else None
    if problem:
        errors.append(problem)
    if rollout.enable_rollout_routing_replay and rollout.multi_turn.enable:
        errors.append(f"{key}.rollout.enable_rollout_routing_replay=true with multi_turn.enable=true: the agent loop does "
                      "not carry routed experts across turns yet; record single-turn rollouts only.")
    if rollout.enable_rollout_routing_replay and cfg.async_training.partial_rollout:
        errors.append(f"{key}.rollout.enable_rollout_routing_replay=true with async_training.partial_rollout=true: the "
                      "chunked generation rebuilds each sample from its tokens and does not carry routed experts yet; "
                      "set partial_rollout=false.")
    return errors


def _check_lora(cfg: DictConfig) -> list[str]:
    """LoRA runs on engines that support it (FSDP; Megatron for the actor: its plug-in's check); an adapter
    to start from must be there."""
    errors, arr = [], cfg.actor_rollout_ref
    roles = (("actor_rollout_ref", arr.model, arr.actor.strategy), ("critic", cfg.critic.model, cfg.critic.strategy))
    users = [(key, strategy) for key, model, strategy in roles
             if int(model.lora_rank or 0) > 0 and (key == "actor_rollout_ref" or use_critic(cfg))]
    for key, strategy in users:
        if not engine_plugin(strategy).supports_lora:
            errors.append(f"{key}.model.lora_rank > 0: LoRA on strategy={strategy} is not built; use strategy=fsdp "
                          "(or megatron for the actor) or lora_rank=0.")
    if users and importlib.util.find_spec("peft") is None:
        from rlfoundry.models.lora import PEFT_INSTALL

        errors.append(f"model.lora_rank > 0 needs peft: {PEFT_INSTALL}")
    return errors


def _check_lora_adapter(model: DictConfig) -> list[str]:
    """``model.lora_adapter_path``: a peft adapter directory (a file check, at start-up as for the model's path;
    its rank, alpha and targets were read from it at load: verl_compat._adopt_adapter_lora)."""
    path = model.lora_adapter_path
    if path and not (Path(str(path)).expanduser() / "adapter_config.json").is_file():
        return [f"actor_rollout_ref.model.lora_adapter_path={path!r} is not a peft adapter directory "
                "(no adapter_config.json); use what `rlfoundry export --format adapter` wrote."]
    if path and int(model.lora_rank or 0) <= 0:
        return ["actor_rollout_ref.model.lora_adapter_path: its adapter_config.json gives no rank `r`; set "
                "model.lora_rank to the adapter's rank."]
    return []


# override_optimizer_config keys that an rlfoundry key sets (one setting, one key): override -> the key
_OPTIMIZER_KEYS_SET_ELSEWHERE = {
    "lr": "optim.lr", "min_lr": "optim.min_lr", "weight_decay": "optim.weight_decay", "clip_grad": "optim.clip_grad",
    "betas": "optim.betas", "adam_beta1": "optim.betas", "adam_beta2": "optim.betas", "eps": "optim.eps",
    "adam_eps": "optim.eps", "use_distributed_optimizer": "megatron.use_distributed_optimizer",
    "bf16": "megatron.dtype", "fp16": "megatron.dtype", "params_dtype": "megatron.dtype", "params": None,
    "optimizer": "optim.optimizer",  # the engine names megatron-core's optimizer itself (AdamW only)
}
# megatron-core's CPU optimiser (HybridDeviceOptimizer: OptimizerConfig fields, strategy=megatron only; the
# Megatron plug-in checks their values: engines/megatron/plugin.py optimizer_problems)
_OPTIMIZER_OFFLOAD_KEYS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "use_torch_optimizer_for_cpu_offload",
                           "overlap_cpu_optimizer_d2h_h2d", "pin_cpu_grads", "pin_cpu_params")


def _check_optimizers(cfg: PPOConfig) -> list[str]:
    """Each trained role's ``optim``: Megatron's weight-decay schedule and ``override_optimizer_config``."""
    roles = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor)] + ([("critic", cfg.critic)] if use_critic(cfg) else [])
    errors = []
    for role, node in roles:
        key = f"{role}.optim"
        if node.optim.weight_decay_incr_style != "constant":
            errors.append(f"{key}.weight_decay_incr_style={node.optim.weight_decay_incr_style}: Megatron's weight-decay "
                          "schedules are not built; weight decay is constant (optim.weight_decay). Set constant.")
        errors += _check_optimizer_overrides(key, dict(node.optim.override_optimizer_config or {}), str(node.strategy),
                                             node)
        if node.optim.optimizer.lower() not in ("adamw", "adam") or node.optim.optimizer_impl != "torch.optim":
            errors.append(f"{key}.optimizer={node.optim.optimizer} ({key}.optimizer_impl={node.optim.optimizer_impl}): "
                          "only AdamW (torch.optim; megatron-core's adam is AdamW) is built; other optimizers are not.")
    return errors


def _check_optimizer_overrides(key: str, overrides: dict, strategy: str, role: Any = None) -> list[str]:
    """verl's ``override_optimizer_config``: megatron-core ``OptimizerConfig`` fields (strategy=megatron) or
    ``torch.optim.AdamW`` arguments (fsdp); keys an rlfoundry key sets are errors naming why, and the engine's
    plug-in checks the values against the role's other keys (``role``: its subtree; None: the defaults)."""
    errors, key = [], f"{key}.override_optimizer_config"
    for name, value in overrides.items():
        if name in _OPTIMIZER_KEYS_SET_ELSEWHERE:
            where = _OPTIMIZER_KEYS_SET_ELSEWHERE[name]
            errors.append(f"{key}.{name}: " + (f"set it as {where} (one key per setting)." if where else
                                               "the optimizer's parameters are the model's, not a setting."))
    if strategy not in TRAINING_ENGINES:  # the choice check names it
        return errors
    plugin = engine_plugin(strategy)
    fields, what = plugin.optimizer_fields()
    accepted = fields - set(_OPTIMIZER_KEYS_SET_ELSEWHERE)
    unknown = sorted(set(overrides) - accepted - set(_OPTIMIZER_KEYS_SET_ELSEWHERE))
    offload = [name for name in unknown if name in _OPTIMIZER_OFFLOAD_KEYS]
    if offload:  # megatron-core's CPU optimiser, asked of another engine
        errors.append(f"{key}: {offload} are megatron-core's CPU optimizer (HybridDeviceOptimizer, strategy=megatron), "
                      f"not {what} (strategy={strategy}); offload this engine's optimizer with its "
                      "fsdp_config.optimizer_offload instead.")
        unknown = [name for name in unknown if name not in offload]
    if unknown:
        errors.append(f"{key}: {unknown} are not {what} (strategy={strategy}); the accepted ones are {sorted(accepted)}.")
    return errors + plugin.optimizer_problems(key, overrides, role)


def _check_liger(cfg: PPOConfig) -> list[str]:
    """``model.use_liger``: Liger's Triton kernels need CUDA and liger-kernel (models/liger.py)."""
    if not cfg.actor_rollout_ref.model.use_liger:
        return []
    device = cfg.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    from rlfoundry.models.liger import liger_problems  # here: rlfoundry.models imports torch (entry modules must not)

    return liger_problems(str(device))


def _check_exact_mode(cfg: PPOConfig) -> list[str]:
    """``rollout.exact_log_probs``: the FSDP engine's forward and the plain HF head are the ones converted."""
    arr = cfg.actor_rollout_ref
    if not arr.rollout.exact_log_probs:
        return []
    key, errors = "actor_rollout_ref.rollout.exact_log_probs=true", []
    for role in ("actor", "ref"):
        policy = getattr(arr, role)
        if policy.strategy in TRAINING_ENGINES and not engine_plugin(policy.strategy).supports_exact_log_probs:
            errors.append(f"{key} converts the FSDP engine's forward only; {role}.strategy={policy.strategy} computes "
                          f"log-probs with its own kernels. Use {role}.strategy=fsdp2 or exact_log_probs=false.")
        if policy.ulysses_sequence_parallel_size > 1:
            errors.append(f"{key}: {role}.ulysses_sequence_parallel_size={policy.ulysses_sequence_parallel_size} splits "
                          "attention over ranks with its own kernel; set it to 1 (or exact_log_probs=false).")
        if policy.use_torch_compile:
            errors.append(f"{key}: {role}.use_torch_compile=true compiles the layers, and inductor fuses and reorders "
                          f"the exact ops' sums; set {role}.use_torch_compile=false.")
    if arr.rollout.use_torch_compile:
        errors.append(f"{key}: rollout.use_torch_compile=true compiles the decode step, and inductor fuses and "
                      "reorders the exact ops' sums; leave it null (exact mode decodes uncompiled) or false.")
    if arr.model.use_fused_kernels:
        errors.append(f"{key}: the fused head (actor_rollout_ref.model.use_fused_kernels) sums the vocabulary in "
                      "chunks of its own; set use_fused_kernels=false (exact mode computes log-probs from logits).")
    return errors


def _roles_by_engine(cfg: DictConfig) -> dict[str, list[str]]:
    """The training roles' keys, grouped by the engine their ``strategy`` names (the actor first)."""
    roles = ["actor_rollout_ref.actor", "actor_rollout_ref.ref"] + (["critic"] if use_critic(cfg) else [])
    by_engine: dict[str, list[str]] = {}
    for key in roles:
        strategy = pick(cfg, f"{key}.strategy")
        if strategy in TRAINING_ENGINES:  # an unknown one is the choice check's error, named there
            by_engine.setdefault(engine_plugin(strategy).name, []).append(key)
    return by_engine


def _adopt_engine_settings(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    """Each training engine rewrites what it runs otherwise than written (``EnginePlugin.adopt``)."""
    for name, keys in _roles_by_engine(cfg).items():
        engine_plugin(name).adopt(cfg, keys, list(user_keys))


def _check_engines(cfg: DictConfig) -> list[str]:
    """Each training engine checks the roles that name it (``EnginePlugin.check``)."""
    ws = world_size(cfg)
    return [e for name, keys in _roles_by_engine(cfg).items() for e in engine_plugin(name).check(cfg, keys, ws)]


def _check_rollout_correction(cfg: PPOConfig) -> list[str]:
    """Bypass mode brings its own policy loss (the section's own rules: ``AlgorithmConfig.check``)."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.bypass_mode and mode not in ("vanilla", "bypass_mode"):
        return [f"{key}.bypass_mode=true runs its own policy loss (ppo_clip or reinforce, {key}.loss_type), "
                f"not actor_rollout_ref.actor.policy_loss.loss_mode={mode}; drop one of them."]
    return []


def _verl_async_errors(cfg: DictConfig) -> list[str]:
    """verl's fully-async switches that are not built here, or not for this pipeline: start-up errors naming them."""
    at, errors = cfg.async_training, []
    if at.compute_prox_log_prob and at.mode != "fully_async":  # verl's one-step-off has no such key
        errors.append(f"async_training.compute_prox_log_prob=true is the fully-async pipeline's (old log-probs under "
                      f"a sync period's first weights); async_training.mode={at.mode} has no sync periods. Drop it, "
                      "or run --config-name fully_async_ppo_trainer.")
    if at.use_trainer_do_validate:
        errors.append("async_training.use_trainer_do_validate=true (validation on the trainer's pool) is not built; "
                      "leave it false: the rollout pool generates the validation samples.")
    return errors


def _check_async(cfg: DictConfig) -> list[str]:
    """``async_training.mode`` and the rollout's own pool (``rollout.*``): what each needs."""
    at, pool, mode = cfg.async_training, cfg.rollout, cfg.async_training.mode
    errors: list[str] = []
    if rollout_world_size(cfg) < 0 or int(pool.nnodes) < 1:
        errors.append("rollout.nnodes must be >= 1 and rollout.n_gpus_per_node >= 0.")
    if mode == "sync":
        if rollout_world_size(cfg) > 0:
            errors.append(f"rollout.n_gpus_per_node={pool.n_gpus_per_node} gives the rollout a pool of its own, which "
                          "only the asynchronous pipelines use: add --config-name one_step_off_ppo_trainer (or "
                          "fully_async_ppo_trainer), or set rollout.n_gpus_per_node=0 for the colocated hybrid engine.")
        return errors
    key = f"async_training.mode={mode}"
    if rollout_world_size(cfg) < 1:
        errors.append(f"{key} runs the rollout in a pool of its own: set rollout.n_gpus_per_node >= 1 (on CPU: "
                      "rollout processes; trainer.n_gpus_per_node counts the trainer's).")
    if cfg.trainer.worker_backend == "local":
        errors.append(f"{key} needs two worker pools (two processes at least); use trainer.worker_backend=process "
                      "(one machine) or ray (or auto).")
    if cfg.trainer.worker_backend == "process" and int(pool.nnodes) != 1:
        errors.append(f"trainer.worker_backend=process is single-node (processes on this machine), but rollout.nnodes={pool.nnodes}; use ray.")
    if cfg.algorithm.filter_groups.enable:
        # verl's one-step-off and fully-async trainers (January and August) never read filter_groups: they
        # train every group; its asynchronous DAPO filter lives only in the v1 trainer (trainer.use_v1)
        errors.append(f"algorithm.filter_groups.enable=true is not supported with {key} yet; verl's {mode} trainer "
                      "does not read it either (it trains every group): set algorithm.filter_groups.enable=false to "
                      "run as verl does, or async_training.mode=sync for dynamic sampling.")
    unsupported = {"algorithm.adv_estimator=remax (its greedy baseline)": adv_estimator(cfg) == "remax",
                   "async_training.partial_rollout=true with one-step-off (it has no sync mid-generation)":
                       at.partial_rollout and mode == "one_step_off",
                   # the driver's agent loops chunk token requests; openai_agent's own draws and top log-probs are not
                   "async_training.partial_rollout=true with rollout.agent.default_agent_loop=openai_agent (set "
                   "partial_rollout=false, or use tool_agent)":
                       at.partial_rollout and cfg.actor_rollout_ref.rollout.multi_turn.enable
                       and cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "openai_agent"}
    errors += [f"{what} is not supported with {key} yet." for what, bad in unsupported.items() if bad]
    errors += _verl_async_errors(cfg)
    if mode == "fully_async":
        want = int(at.require_batches) * int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
        if cfg.data.train_batch_size != want:
            errors.append(f"fully async: a step trains async_training.require_batches × actor.ppo_mini_batch_size = "
                          f"{want} prompts, but data.train_batch_size={cfg.data.train_batch_size}; set it to {want} "
                          "(or 0, which means that).")
        gen = cfg.data.gen_batch_size
        if gen is not None and (int(gen) < 1 or want % int(gen)):
            errors.append(f"data.gen_batch_size={gen} must divide the {want} prompts of a step (or be null: all of them).")
    return errors


def _corrects_rollout(cfg: DictConfig) -> bool:
    rc = cfg.algorithm.rollout_correction
    return rc.rollout_is is not None or rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None


def _check_rollout_log_prob_reuse(cfg: DictConfig) -> list[str]:
    """``actor.use_rollout_log_probs``: only where the sampling log-probs *are* the old log-probs.

    Synchronous: they stand in for the actor's recomputation, so they must equal it. The HF engine
    scores samples with the actor's own module (same temperature, before top-p/top-k), so its
    log-probs equal a recomputed ``compute_log_prob`` to float rounding; vLLM's may not. One epoch in
    one mini-batch keeps the update on the sampling policy, so the ``actor/entropy`` the update reports
    in place of the skipped pass is still the sampling distribution's.

    Asynchronous (verl's fully-async default): PPO's old policy *is* the policy that sampled, an
    older version than the trainer's, whatever the engine; only the rows' own tokens at the actor's
    temperature are required.
    """
    arr, key = cfg.actor_rollout_ref, "actor_rollout_ref.actor.use_rollout_log_probs=true"
    if arr.actor.use_rollout_log_probs is not True:  # null (auto) turns it on only where these hold
        return []
    if cfg.async_training.mode != "sync":
        return _behaviour_log_prob_problems(cfg, key)
    return _rollout_log_prob_reuse_problems(cfg, key)


def _behaviour_log_prob_problems(cfg: DictConfig, key: str) -> list[str]:
    """What makes the rollout's log-probs not the sampling policy's log-probs of the row's tokens."""
    arr, errors = cfg.actor_rollout_ref, []
    if arr.rollout.use_fire_sampling:
        errors.append(f"{key}: with actor_rollout_ref.rollout.use_fire_sampling=true the first token's log-prob is "
                      "at FIRE's temperature 30, not the actor's; set use_rollout_log_probs=false.")
    if arr.rollout.multi_turn.enable and arr.rollout.multi_turn.use_inference_chat_template:
        errors.append(f"{key}: with actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true the engine "
                      "scores each turn after the re-rendered chat, not the row's tokens the actor trains on; set "
                      "use_rollout_log_probs=false.")
    if cfg.async_training.compute_prox_log_prob and cfg.async_training.mode == "fully_async":
        return errors  # the actor's log-prob pass runs (under the period's first weights): what follows has it
    if arr.actor.calculate_sum_pi_squared:
        errors.append(f"{key}: actor_rollout_ref.actor.calculate_sum_pi_squared=true needs the actor's log-prob pass "
                      "(it writes sum_pi_squared), which reusing the rollout's log-probs skips; set "
                      "use_rollout_log_probs=false.")
    if arr.actor.router_replay.mode == "R2":
        errors.append(f"{key}: actor_rollout_ref.actor.router_replay.mode=R2 records the routing in the actor's log-prob "
                      "pass, which reusing the rollout's log-probs skips; set use_rollout_log_probs=false (or mode=R3).")
    return errors


def _rollout_log_prob_reuse_problems(cfg: DictConfig, key: str) -> list[str]:
    arr, errors = cfg.actor_rollout_ref, _behaviour_log_prob_problems(cfg, key)
    if _corrects_rollout(cfg) and not cfg.algorithm.rollout_correction.bypass_mode:
        errors.append(f"{key}: algorithm.rollout_correction compares the rollout's log-probs with recomputed ones; "
                      "set use_rollout_log_probs=false (or algorithm.rollout_correction.bypass_mode=true).")
    if arr.rollout.name != "hf":
        errors.append(f"{key} needs actor_rollout_ref.rollout.name=hf (got {arr.rollout.name}): only the HF engine's "
                      "log-probs are the actor's own; set use_rollout_log_probs=false.")
    if arr.actor.ppo_epochs != 1:
        errors.append(f"{key} needs actor_rollout_ref.actor.ppo_epochs=1 (got {arr.actor.ppo_epochs}); "
                      "set ppo_epochs=1 or use_rollout_log_probs=false.")
    mini, batch = arr.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    if mini != batch:
        errors.append(f"{key} needs one mini-batch per step: actor_rollout_ref.actor.ppo_mini_batch_size={mini} "
                      f"!= data.train_batch_size={batch}; set ppo_mini_batch_size={batch} or use_rollout_log_probs=false.")
    return errors


_FP32 = ("fp32", "float32", "torch.float32", "float", "fp64", "float64", "torch.float64")


def rollout_log_probs_inexact(device: str, strategy: str, param_dtype: str | None, megatron_dtype: str) -> str | None:
    """Why the HF engine's sampling log-probs are *not* the old log-probs to fp32 rounding on ``device``
    (None where they are), from the dtype the actor computes in there.

    The engine scores each token in a cached one-token decode step, the actor's recompute in one
    forward over the whole sequence: the same arithmetic in another order, equal to fp32 rounding
    (~1e-6) when the matmuls run in fp32. In bf16 (the FSDP engine's default on CUDA, autocast on one
    GPU and FSDP2's mixed precision on several; Megatron's default everywhere) they differ by ~1e-2
    (issue 33), so PPO's ratio is not 1 at a step's start.
    """
    own = engine_plugin(strategy).dtype_key if strategy in TRAINING_ENGINES else None
    if own is not None:
        compute, key = str(megatron_dtype), f"actor.{own}"
    else:
        compute = str(param_dtype) if param_dtype is not None else ("bf16" if device == "cuda" else "fp32")
        key = "actor.fsdp_config.mixed_precision.param_dtype" + ("" if param_dtype is not None else
                                                                f" (default on {device})")
    if compute.lower() in _FP32:
        return None
    return f"the actor computes in {compute} on {device} ({key}): its log-probs differ from the engine's beyond rounding"


def _inexact_rollout_log_probs(cfg: DictConfig, device: str) -> str | None:
    actor = cfg.actor_rollout_ref.actor
    mixed = getattr(actor.fsdp_config, "mixed_precision", None) or {}
    return rollout_log_probs_inexact(device, str(actor.strategy), mixed.get("param_dtype"), actor.megatron.dtype)


def _warn_prox_without_effect(cfg: DictConfig) -> None:
    """verl reads ``compute_prox_log_prob`` only where the rollout's log-probs would be the old ones."""
    if not cfg.async_training.compute_prox_log_prob or cfg.async_training.mode != "fully_async":
        return
    if cfg.algorithm.rollout_correction.bypass_mode:
        why = "algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probs as the old ones"
    elif not cfg.actor_rollout_ref.actor.use_rollout_log_probs:
        why = "actor.use_rollout_log_probs is off, so the old log-probs are recomputed under the current weights"
    else:
        return
    warnings.warn(f"async_training.compute_prox_log_prob=true has no effect: {why} (verl ignores the key then too). "
                  "Set async_training.use_rollout_log_probs=true for old log-probs under the sync period's first "
                  "weights, or drop the key.", NoEffectKeyWarning, stacklevel=4)


def _soft_warnings(cfg: DictConfig) -> None:
    est, n = adv_estimator(cfg), cfg.actor_rollout_ref.rollout.n
    spo = cfg.trainer.spo.enable  # SPO's tracker replaces the estimator (one sample per prompt is its point)
    if est in ("grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline", "opo") and n < 2 and not spo:
        warnings.warn(f"algorithm.adv_estimator={est} compares the {n} sample(s) of each prompt: with "
                      f"actor_rollout_ref.rollout.n={n} every advantage is zero. Use rollout.n >= 2.", stacklevel=3)
    if cfg.algorithm.use_pf_ppo and est != "gae":
        warnings.warn(f"algorithm.use_pf_ppo has no effect with algorithm.adv_estimator={est}: PF-PPO resamples the "
                      "batch after GAE advantages only (as verl does). Use adv_estimator=gae with a critic, or drop "
                      "use_pf_ppo.", NoEffectKeyWarning, stacklevel=3)
    _warn_prox_without_effect(cfg)
    distill = cfg.distillation.distillation_loss
    if cfg.distillation.enabled and distill.loss_mode in DISTILLATION_TOPK_MODES and distill.use_policy_gradient:
        warnings.warn(f"distillation.distillation_loss.loss_mode={distill.loss_mode} with use_policy_gradient=true: the "
                      "update moves only the sampled token's log-prob (-loss is its advantage), so the teacher's top-k "
                      "distribution is mostly unused (verl warns too). The top-k loss is meant as a supervised loss: "
                      "use_policy_gradient=false.", stacklevel=3)
    if cfg.async_training.mode != "sync" and cfg.actor_rollout_ref.actor.use_rollout_log_probs \
            and not cfg.async_training.compute_prox_log_prob \
            and _corrects_rollout(cfg) and not cfg.algorithm.rollout_correction.bypass_mode:
        warnings.warn("algorithm.rollout_correction (rollout_is / rollout_rs / rollout_token_veto_threshold) has no "
                      "effect with actor.use_rollout_log_probs=true (async_training.use_rollout_log_probs): the old "
                      "log-probs are the rollout's, so there is no lag between them to correct. For the decoupled "
                      "correction, set use_rollout_log_probs=false (old log-probs recomputed under the trainer's "
                      "weights) or, fully async, async_training.compute_prox_log_prob=true (under the weights of the "
                      "sync period's start).", NoEffectKeyWarning, stacklevel=3)
    rollout = cfg.actor_rollout_ref.rollout
    if cfg.async_training.mode != "sync" and cfg.actor_rollout_ref.actor.use_rollout_log_probs \
            and rollout.name == "vllm" and (rollout.top_p < 1.0 or rollout.top_k > 0):
        warnings.warn(f"actor.use_rollout_log_probs=true with rollout.name=vllm and top_p={rollout.top_p} / "
                      f"top_k={rollout.top_k}: vLLM's log-probs are renormalised over the kept tokens while the actor "
                      "scores the whole vocabulary, so the policy ratio starts below 1 even with equal weights (verl "
                      "has the same bias). Sample with top_p=1 and top_k=-1 or recompute the old log-probs "
                      "(use_rollout_log_probs=false).", stacklevel=3)
    _warn_rollout_layout("actor_rollout_ref.rollout", rollout)
    _warn_checkpoint_engine(cfg)
    if cfg.reward.reward_model.enable:
        _warn_rollout_layout("reward.reward_model.rollout", cfg.reward.reward_model.rollout)
    if cfg.algorithm.use_kl_in_reward and cfg.actor_rollout_ref.actor.use_kl_loss:
        warnings.warn("Both algorithm.use_kl_in_reward and actor.use_kl_loss are on: the KL term is applied twice.",
                      stacklevel=3)


def _warn_checkpoint_engine(cfg: DictConfig) -> None:
    """``rollout.checkpoint_engine`` keys that change nothing here (verl ignores the first two as well)."""
    ce, key = cfg.actor_rollout_ref.rollout.checkpoint_engine, "actor_rollout_ref.rollout.checkpoint_engine"
    kwargs, noted = dict(ce.engine_kwargs or {}), []
    if ce.backend == "delta_sharded" and cfg.async_training.mode == "sync":
        noted.append((f"{key}.backend=delta_sharded", "the colocated hybrid engine syncs in memory, not over the "
                      "bridge to a rollout pool of its own (--config-name one_step_off_ppo_trainer)"))
    for other in sorted(set(kwargs) - {ce.backend}):
        noted.append((f"{key}.engine_kwargs.{other}", f"the back end in use is backend={ce.backend}"))
    if ce.backend == "delta_sharded" and "batch_gather" in (kwargs.get("delta_sharded") or {}):
        noted.append((f"{key}.engine_kwargs.delta_sharded.batch_gather", "the trainer's rank 0 diffs each full "
                      "tensor after its gather, so there are no per-shard gathers to batch"))
    for what, why in noted:
        warnings.warn(f"{what} has no effect: {why}. Drop it (docs/async.md, Weights).", NoEffectKeyWarning,
                      stacklevel=4)


ROLLOUT_LAYOUT_KEYS = ("tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size")


def _warn_rollout_layout(key: str, rollout: DictConfig) -> None:
    """verl's replica layout keys: the hybrid vLLM/SGLang engines run one whole-model engine per rank."""
    given = [f"{key}.{k}={getattr(rollout, k)}" for k in ROLLOUT_LAYOUT_KEYS if int(getattr(rollout, k, 1)) > 1]
    if rollout.name in ("vllm", "sglang") and given:
        warnings.warn(f"{', '.join(given)} with rollout.name={rollout.name}: the engine runs one replica per rank with "
                      "tensor, data and expert parallel size 1 (data-parallel generation: the same sampling; each GPU "
                      "holds the whole model while it generates, which trainer.plan_check checks at start-up). "
                      "Parallelism inside a rollout replica is not built (docs/rollout.md).", stacklevel=4)


def validate_config(cfg: DictConfig | PPOConfig) -> None:
    """Every rule, on the typed config: the values each field accepts, each section's own ``check``
    (beside its dataclass in ``config/schema.py``), then the rules between sections and those that load
    registries (here). Raises one ``ConfigError`` that lists every problem found."""
    try:
        errors = _check_choices(cfg)
        typed_cfg = cfg if isinstance(cfg, PPOConfig) else OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # e.g. an interpolation that points nowhere
        raise ConfigError(f"Config cannot be evaluated: {e}") from e
    errors += (typed_cfg.check() + _check_estimator(typed_cfg) + _check_batch_sizes(typed_cfg)
               + _check_lengths(typed_cfg) + distillation_errors(typed_cfg) + sppo_errors(typed_cfg) + _check_unsupported(typed_cfg) + _check_rollout_log_prob_reuse(typed_cfg)
               + _check_rollout_correction(typed_cfg) + _check_async(typed_cfg) + _check_reward_function(typed_cfg)
               + _check_checkpoint_contents(typed_cfg) + _check_liger(typed_cfg) + _check_optimizers(typed_cfg)
               + _check_exact_mode(typed_cfg) + flowrl_errors(typed_cfg)
               + gvpo_errors(typed_cfg) + spin_errors(typed_cfg) + spo_errors(typed_cfg))
    if errors:
        bullet = "\n  - "
        raise ConfigError(f"{len(errors)} config problem(s):{bullet}" + bullet.join(errors))
    _soft_warnings(typed_cfg)
    flowrl_warnings(typed_cfg)


# ───────────────────────────────────── resolution ─────────────────────────────────────


def resolve_asset_path(path: str | None) -> str | None:
    """``rlfoundry://name`` → the packaged asset directory ``rlfoundry/assets/name``, and
    ``rlfoundry://config/...`` → the packaged config file (tool and interaction configs, which then
    work from any directory); others unchanged."""
    if path is None or not str(path).startswith(ASSET_SCHEME):
        return None if path is None else os.path.expanduser(str(path))
    name = str(path)[len(ASSET_SCHEME):]
    if name.startswith("config/"):
        return str(CONFIG_DIR / name[len("config/"):])
    return str(ASSETS_DIR / name)


def resolve_config(
    cfg: DictConfig,
    *,
    steps_per_epoch: int,
    cuda_available: bool,
    train_files: Any = None,
    val_files: Any = None,
    run_dir: str | None = None,
) -> PPOConfig:
    """A resolved copy of ``cfg`` with every run-dependent value filled in, as the typed ``PPOConfig``
    (pure; nothing changes it afterwards).

    Args:
        steps_per_epoch: batches per epoch of the train loader (``len(loader)``).
        cuda_available: whether a CUDA device is visible (for ``trainer.device=auto``).
        train_files / val_files: data files to use when ``data.*_files`` is null (the synthetic task).
        run_dir: the run directory to record when ``trainer.run_dir`` is null.
    """
    if steps_per_epoch <= 0:
        raise ConfigError("The training data yields no full batch: it has fewer prompts than "
                          f"data.train_batch_size={cfg.data.train_batch_size}. Lower the batch size or add data.")
    out = copy.deepcopy(cfg)
    trainer, ws = out.trainer, world_size(cfg)
    trainer.device = _resolve_device(cfg.trainer.device, cuda_available)
    trainer.worker_backend = cfg.trainer.worker_backend if cfg.trainer.worker_backend != "auto" else (
        _auto_backend(cfg))
    trainer.logger = [x for x in loggers(cfg) if x in SUPPORTED_LOGGERS]
    out.algorithm.adv_estimator = adv_estimator(cfg)
    if cfg.algorithm.rollout_correction.bypass_mode:  # the actor's loss needs the settings (verl does this too)
        out.actor_rollout_ref.actor.policy_loss.loss_mode = "bypass_mode"
        out.actor_rollout_ref.actor.policy_loss.rollout_correction = copy.deepcopy(cfg.algorithm.rollout_correction)
    out.critic.enable = use_critic(cfg)
    _resolve_megatron_dtypes(out)
    if cfg.actor_rollout_ref.actor.use_rollout_log_probs is None:
        out.actor_rollout_ref.actor.use_rollout_log_probs = not (_rollout_log_prob_reuse_problems(cfg, "auto")
                                                                 or _inexact_rollout_log_probs(out, trainer.device))
    if cfg.async_training.mode != "sync":  # the sampling policy lags the trainer's: recompute old log-probs
        out.actor_rollout_ref.actor.use_rollout_log_probs = bool(cfg.actor_rollout_ref.actor.use_rollout_log_probs)
    out.actor_rollout_ref.rollout.calculate_log_probs = bool(cfg.actor_rollout_ref.rollout.calculate_log_probs
                                                             or _rollout_log_probs_reader(out))
    if cfg.data.gen_batch_size is None:
        out.data.gen_batch_size = int(cfg.data.train_batch_size)
    if cfg.async_training.partial_rollout_chunk_tokens is None:
        out.async_training.partial_rollout_chunk_tokens = max(1, int(cfg.data.max_response_length) // 4)
    _resolve_micro_batches(out, ws)
    _resolve_paths(out, train_files, val_files, run_dir)
    total = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
    if cfg.async_training.mode == "fully_async" and cfg.rollout.total_rollout_steps:  # prompts to generate
        total = max(1, int(cfg.rollout.total_rollout_steps) // int(cfg.data.train_batch_size))
    trainer.total_training_steps = int(total)
    out.actor_rollout_ref.actor.optim.total_training_steps = int(total)
    out.critic.optim.total_training_steps = int(total)
    OmegaConf.resolve(out)
    return freeze(OmegaConf.to_object(out))  # the typed config the driver and the workers read


def _rollout_log_probs_reader(resolved: DictConfig) -> str | None:
    """What in the run reads the rollout's own log-probs (so the rollout must return them), or None."""
    correction = resolved.algorithm.rollout_correction
    if resolved.actor_rollout_ref.actor.use_rollout_log_probs:
        return "actor.use_rollout_log_probs (they are the old log-probs)"
    if correction.bypass_mode or any(correction[k] is not None for k in
                                     ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")):
        return "algorithm.rollout_correction"
    if resolved.async_training.mode == "fully_async" and resolved.async_training.partial_rollout:
        return "async_training.partial_rollout (chunks are stitched with their log-probs)"
    if resolved.trainer.mismatch_audit:  # compares them with the recomputed old log-probs (docs/on_policy.md)
        return "trainer.mismatch_audit"
    return None


def _auto_backend(cfg: DictConfig) -> str:
    """local for one rank; with a rollout pool of its own, process on one machine; else ray."""
    if cfg.async_training.mode != "sync":
        return "process" if int(cfg.trainer.nnodes) == 1 and int(cfg.rollout.nnodes) == 1 else "ray"
    return "local" if world_size(cfg) == 1 else "ray"


def auto_choices(cfg: DictConfig, resolved: DictConfig) -> list[str]:
    """What the ``auto``/null settings of ``cfg`` became in ``resolved``, and why (the run prints these)."""
    out = []
    if cfg.actor_rollout_ref.actor.use_rollout_log_probs is None:
        on = resolved.actor_rollout_ref.actor.use_rollout_log_probs
        inexact = _inexact_rollout_log_probs(resolved, resolved.trainer.device)
        why = ("the HF engine's sampling log-probs are the old log-probs (one epoch, one mini-batch per step): "
               "no separate old_log_prob pass" if on else
               "old log-probs are recomputed (reuse needs the HF engine computing in fp32, ppo_epochs=1 and one "
               "mini-batch per step" + (f"; {inexact}" if inexact else "") + ")")
        out.append(f"actor_rollout_ref.actor.use_rollout_log_probs={str(on).lower()}: {why}")
    reader = _rollout_log_probs_reader(resolved)
    # (the reuse of use_rollout_log_probs is named by the line above)
    if reader and not reader.startswith("actor.") and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        out.append(f"actor_rollout_ref.rollout.calculate_log_probs=true: {reader} reads the rollout's log-probs")
    return out + _megatron_dtype_choices(cfg, resolved)


def _megatron_roles(cfg: DictConfig, in_use: bool = True):
    """(key, role subtree) of each role (in use, or any) on the Megatron engine."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor, True), ("actor_rollout_ref.ref", arr.ref, need_reference_policy(cfg)),
             ("critic", cfg.critic, use_critic(cfg))]
    return [(key, role) for key, role, used in roles if (used or not in_use) and str(role.strategy) == "megatron"]


def _resolve_megatron_dtypes(out: DictConfig) -> None:
    """verl's Megatron precision is bf16 (its default, for GPUs); on the CPU the Megatron engine trains in
    float32, as the FSDP engine does there: a CPU run is the tested, exact reference (log-probs equal the HF
    rollout's to fp32 rounding), and bf16 there would only make it inexact and, without bf16 units, slower."""
    if out.trainer.device != "cpu":
        return
    for _, role in _megatron_roles(out, in_use=False):
        if str(role.megatron.dtype) not in ("float32", "fp32"):
            role.megatron.dtype = "float32"


def _megatron_dtype_choices(cfg: DictConfig, resolved: DictConfig) -> list[str]:
    """The start-up line naming the Megatron roles whose dtype the CPU changed (``_resolve_megatron_dtypes``)."""
    asked = {key: str(role.megatron.dtype) for key, role in _megatron_roles(cfg)}
    changed = [key for key, role in _megatron_roles(resolved) if asked.get(key, "float32") != str(role.megatron.dtype)]
    if not changed:
        return []
    return [f"{', '.join(k + '.megatron.dtype' for k in changed)}=float32 (asked: {asked[changed[0]]}): the CPU "
            "trains in float32, as the FSDP engine does there; bf16 is the GPU precision"]


def _resolve_device(device: str, cuda_available: bool) -> str:
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu (or auto).")
    return device


def _resolve_micro_batches(out: DictConfig, ws: int) -> None:
    """Deprecated global micro-batch keys → per-rank keys, divided over each role's data-parallel ranks
    (as verl and the start-up check divide them); missing log-prob sizes fall back to the actor's."""
    arr = out.actor_rollout_ref
    actor, dp = arr.actor, _data_parallel_size(arr.actor, ws)
    actor.ppo_micro_batch_size_per_gpu = per_gpu(actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size, dp)
    for node, policy in ((arr.rollout, arr.actor), (arr.ref, arr.ref)):
        size = per_gpu(node.log_prob_micro_batch_size_per_gpu, node.log_prob_micro_batch_size,
                       _data_parallel_size(policy, ws))
        node.log_prob_micro_batch_size_per_gpu = size or actor.ppo_micro_batch_size_per_gpu
    critic = out.critic
    critic.ppo_micro_batch_size_per_gpu = per_gpu(critic.ppo_micro_batch_size_per_gpu, critic.ppo_micro_batch_size,
                                                  _data_parallel_size(critic, ws))
    rm = out.reward_model
    rm.micro_batch_size_per_gpu = per_gpu(rm.micro_batch_size_per_gpu, rm.micro_batch_size, ws)


def _resolve_paths(out: DictConfig, train_files: Any, val_files: Any, run_dir: str | None) -> None:
    arr = out.actor_rollout_ref
    arr.model.path = resolve_asset_path(arr.model.path)
    out.critic.model.path = resolve_asset_path(out.critic.model.path)
    out.reward_model.model.path = resolve_asset_path(out.reward_model.model.path)
    out.reward.reward_model.model_path = resolve_asset_path(out.reward.reward_model.model_path)
    rollout = arr.rollout
    for node, key in ((out.critic.model, "tokenizer_path"), (out.reward_model.model, "input_tokenizer"),
                      (out.data, "tokenizer"), (rollout.multi_turn, "tool_config_path"),
                      (rollout.multi_turn, "interaction_config_path"), (rollout.agent, "agent_loop_config_path")):
        value = OmegaConf.select(node, key)
        if isinstance(value, str):
            node[key] = resolve_asset_path(value)
    if out.data.train_files is None:
        out.data.train_files = train_files
    if out.data.val_files is None:
        out.data.val_files = val_files
    if out.trainer.run_dir is None:
        out.trainer.run_dir = run_dir or out.trainer.default_local_dir


# ───────────────────────────────────── start-up file checks ─────────────────────────────────────


def is_hf_model_dir(path: str | Path) -> bool:
    """An HF model directory has a ``config.json`` and weights (safetensors or a torch bin)."""
    p = Path(path)
    weights = list(p.glob("*.safetensors")) + list(p.glob("pytorch_model*.bin")) + list(p.glob("*.safetensors.index.json"))
    return p.is_dir() and (p / "config.json").is_file() and bool(weights)


def _check_model(key: str, path: str | None) -> list[str]:
    if path is None:
        return []
    resolved = resolve_asset_path(path)
    if is_hf_model_dir(resolved):
        return []
    if str(path).startswith(ASSET_SCHEME):
        return [f"{key}={path}: the packaged model is missing at {resolved}. Reinstall rlfoundry, or build it with "
                f"`rlfoundry sft` (see README), or point {key} at a local Hugging Face model directory."]
    why = "does not exist" if not Path(resolved).exists() else "is not a Hugging Face model directory (needs config.json and *.safetensors)"
    return [f"{key}={path} {why}. Models are loaded from local directories only (no hub downloads): "
            f"save one with `save_pretrained(dir)` or `huggingface-cli download <repo> --local-dir dir`."]


def check_startup_paths(cfg: DictConfig) -> None:
    """File-system checks that need no model loading: model dirs, resume checkpoint, custom reward file."""
    from rlfoundry.config.verl_compat import serves_reward_model

    errors = _check_model("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)
    if use_critic(cfg):
        errors += _check_model("critic.model.path", cfg.critic.model.path)
    if cfg.reward_model.enable:  # served: verl's reward loop, a causal LM on an engine for the custom function
        served = serves_reward_model(cfg)
        errors += _check_reward_model(cfg.reward_model.model.path, served)
        errors += _check_rollout_engine(cfg.reward_model.rollout.name) if served else []
    if cfg.reward.reward_model.enable:
        errors += _check_judge_model(cfg.reward.reward_model.model_path)
        errors += _check_rollout_engine(cfg.reward.reward_model.rollout.name)
    errors += _check_resume(cfg) + _check_lora_adapter(cfg.actor_rollout_ref.model)
    errors += _check_rollout_engine(cfg.actor_rollout_ref.rollout.name)
    crf = cfg.custom_reward_function
    if crf.path is not None and not Path(os.path.expanduser(crf.path)).is_file():
        errors.append(f"custom_reward_function.path={crf.path} does not exist.")
    errors += _check_data_classes(cfg.data)
    if errors:
        bullet = "\n  - "
        raise ConfigError(f"{len(errors)} config problem(s):{bullet}" + bullet.join(errors))


def _check_data_classes(data: DictConfig) -> list[str]:
    """``data.custom_cls`` / ``data.sampler``: a file that exists, and a class name with it."""
    errors = []
    for path_key, name_key in (("custom_cls.path", "custom_cls.name"), ("sampler.class_path", "sampler.class_name")):
        path, name = pick(data, path_key), pick(data, name_key)
        if path is None:
            continue
        if not str(path).startswith("pkg://") and not Path(os.path.expanduser(str(path))).is_file():
            errors.append(f"data.{path_key}={path} does not exist; point it at the Python file that defines the class "
                          f"(or pkg://package.module).")
        if not name:
            errors.append(f"data.{path_key} is set but data.{name_key} is not: name the class.")
    return errors


def _check_reward_function(cfg: DictConfig) -> list[str]:
    errors = []
    crf, manager = cfg.custom_reward_function, cfg.reward.reward_manager
    if crf.path is not None and cfg.reward_model.reward_kwargs.get("compute_score_kwargs"):
        errors.append("reward.compute_score_kwargs go to the built-in scorer, which custom_reward_function.path "
                      "replaces; give your function its arguments in custom_reward_function.reward_kwargs.")
    from rlfoundry.config.verl_compat import serves_reward_model

    if serves_reward_model(cfg):  # verl's reward loop: the served model may have a pool of its own
        errors += _check_pool("reward_model", cfg.reward_model, cfg)
    if manager.source == "importlib" and not manager.module.path:
        errors.append("reward.reward_manager.source=importlib needs reward.reward_manager.module.path (a .py file "
                      "or pkg://package.module) and module.name (the class).")
    return errors


def _check_reward_model(path: str | None, served: bool = False) -> list[str]:
    """The classifier reward model must have a classification head: loaded as a sequence classifier, a
    causal LM would score with a freshly initialised head (random rewards, no error). ``served``: verl's
    reward loop serves the model to the custom function at SGLang's /generate, so a causal LM instead."""
    key = "reward_model.model.path"
    problems = _check_model(key, path)
    head = None if path is None or problems else classifier_head(path)
    if path is None or problems or bool(head) != served:
        return problems
    if served:
        return [f"{key}={path} is a classifier ({head}); verl's reward loop (reward_model.use_reward_loop=true with "
                "custom_reward_function.path) would serve it to your function at /classify or /v1/embeddings, which "
                "is not built here (the server has /generate for a causal LM). Set reward_model.use_reward_loop=false "
                "(verl's legacy path: the classifier's score replaces the function's) or "
                "+reward_model.reward_kwargs.rm_combine=add (rlfoundry: the two scores added)."]
    return [f"{key}={path} is not a sequence classifier (its config.json names no ...ForSequenceClassification "
            "head). A language model that judges in text is reward.reward_model.* (the LLM judge, docs/rewards.md), "
            "or verl's reward loop serving it to your function (custom_reward_function.path with "
            "reward_model.use_reward_loop=true, docs/rewards.md)."]


def _check_judge_model(path: str | None) -> list[str]:
    """The judge must be a causal LM: a classifier head cannot write a judgement."""
    key = "reward.reward_model.model_path"
    problems = _check_model(key, path)
    if path is None or problems:
        return problems
    head = classifier_head(path)
    if head:
        return [f"{key}={path} is a {head}, a reward model that scores without writing text; use it as "
                f"reward_model.enable=true reward_model.model.path={path} (the classifier reward model) instead."]
    return []


def adopt_classifier_reward_model(cfg: DictConfig) -> None:
    """verl >= 0.7's ``reward.reward_model`` with a classifier (and no custom reward function) is verl's
    discriminative reward model: here that is ``reward_model.enable`` with ``reward_model.model.path``
    (the classifier on the RewardModel worker); a causal LM there stays the LLM judge. Decided from the
    model's ``config.json`` where it can be read; otherwise the start-up file check names the fix."""
    judge = cfg.reward.reward_model
    if not judge.enable or cfg.reward_model.enable or cfg.custom_reward_function.path or \
            not (classifier_head(judge.model_path) or "").endswith("ForSequenceClassification"):
        return  # (both enabled: the judge check says to enable one; a token classifier is refused there)
    with open_dict(cfg):
        cfg.reward_model.enable, judge.enable = True, False
        cfg.reward_model.model.path = judge.model_path
        cfg.reward_model.model.trust_remote_code = bool(judge.trust_remote_code)


def classifier_head(path: str | None) -> str | None:
    """The classification architecture of the HF directory at ``path`` (``...ForSequenceClassification``),
    None for another model or where there is no readable ``config.json``."""
    config_file = Path(resolve_asset_path(path) or "") / "config.json" if path else None
    if config_file is None or not config_file.is_file():
        return None
    heads = [a for a in json.loads(config_file.read_text()).get("architectures") or []
             if a.endswith(("ForSequenceClassification", "ForTokenClassification"))]
    return heads[0] if heads else None


def _check_resume(cfg: DictConfig) -> list[str]:
    if cfg.trainer.resume_mode != "resume_path" or not cfg.trainer.resume_from_path:
        return []
    path = Path(os.path.expanduser(cfg.trainer.resume_from_path))
    if path.name.startswith("global_step_") and (path / "actor").is_dir():
        return []
    return [f"trainer.resume_from_path={cfg.trainer.resume_from_path} holds no checkpoint: expected a "
            f".../global_step_N directory with an actor/ folder inside (as written by trainer.save_freq)."]


def _check_rollout_engine(name: str) -> list[str]:
    """An engine that is not installed fails here, not in a worker after the models are loaded."""
    from rlfoundry.config.rollout_engines import engine_problem

    problem = engine_problem(str(name))
    return [problem] if problem else []
