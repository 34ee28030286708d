"""verl compatibility in one place: how a verl command line maps onto rlfoundry's config.

- ``NO_EFFECT_KEYS`` / ``VLLM_ONLY_KEYS``: verl keys accepted so verl command lines run unchanged, each
  with the reason it changes nothing here (docs/verl_keys.md lists them); ``warn_no_effect`` names the
  ones a run sets in one warning;
- ``VERL_REWARD_KEYS`` / ``VERL_OLD_NAMES`` / ``VERL_OTHER_NAMES``: verl's newer, older and other spellings
  of one setting, copied onto the key rlfoundry reads by ``adopt_verl_spellings`` (two spellings given
  different values is an error), which also turns Megatron's schedule keys, ``global_profiler`` and an
  adapter's own LoRA settings into the keys read;
- ``prefer_user_deprecated_keys``: verl's deprecated global micro-batch keys and ``checkpoint.contents``.

The loader (``trainer/config.py`` ``load_config``) calls these once, after the overrides are applied.
"""

from __future__ import annotations

import fnmatch
import json
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlfoundry.config.schema import LR_SCHEDULES, TORCH_PROFILER_TOOLS
from rlfoundry.config.typed import ConfigError, quoted_list
from rlfoundry.utils.tracking import VERL_ONLY_BACKENDS

__all__ = [
    "CHECKPOINT_ROLES",
    "IGNORED_LOGGERS",
    "NO_EFFECT_KEYS",
    "NoEffectKeyWarning",
    "VERL_OLD_NAMES",
    "VERL_OTHER_NAMES",
    "VERL_REWARD_KEYS",
    "VLLM_ONLY_KEYS",
    "adopt_verl_spellings",
    "loggers",
    "no_effect_keys_set",
    "prefer_user_deprecated_keys",
    "warn_no_effect",
]

# verl's trainer.logger back ends that we recognise but drop (with the no-effect warning); the ones we
# ship are utils/tracking.py's SUPPORTED_BACKENDS.
IGNORED_LOGGERS = VERL_ONLY_BACKENDS
CHECKPOINT_ROLES = ("actor_rollout_ref.actor", "critic")  # the roles with verl's checkpoint.* keys


class NoEffectKeyWarning(UserWarning):
    """A verl key that rlfoundry accepts for compatibility but does not act on."""


# ───────────────────────────── keys with no effect ─────────────────────────────

# verl keys that are accepted so verl command lines run unchanged, but change nothing here.
# fnmatch patterns over full dotted keys; setting any of them gives ONE warning naming them all.
# docs/verl_keys.md lists them with these reasons. Each is a key that cannot change results, speed or
# memory here; a verl feature not built yet is an error at start-up, not an entry here.
NO_EFFECT_KEYS: tuple[str, ...] = (
    "data.tokenizer",  # unused in verl too: the tokenizer is actor_rollout_ref.model.path's
    "*.use_shm",  # a copy to /dev/shm before loading; files are read where they are
    # the whole file is tokenised in one batch call (the Rust tokenizer's own threads) and filtered with
    # one array comparison: there is no per-row map for worker processes to share
    "data.filter_overlong_prompts_workers",
    "actor_rollout_ref.hybrid_engine",  # verl requires true; actor and rollout always share a worker here
    "actor_rollout_ref.rollout.layered_summon",  # weights always stream to the rollout one tensor at a time
    # always on: entropy is computed in blocks of at most 2**25 values and its backward recomputes the
    # softmax block by block from saved row statistics (utils/torch_functional.py)
    "*.entropy_from_logits_with_chunking", "*.entropy_checkpointing",
    "*.profiler.*", "trainer.controller_nsight_options*", "trainer.worker_nsight_options*",  # profiling only
    "actor_rollout_ref.rollout.trace*",  # rollout tracing: observability only (utils/rollout_trace.py)
    "ray_init.timeline_json_file", "ray_kwargs.timeline_json_file",  # a Ray timeline dump: observability only
    "*.fsdp_config.grad_offload",  # removed in verl >= 0.2: gradients follow param_offload
    # FSDP1's size-based wrapping; FSDP2 (verl's fsdp2 strategy and this engine) wraps by layer class
    "*.fsdp_config.wrap_policy.min_num_params",
    "reward_model.model.fsdp_config.fsdp_size",  # the reward model is not sharded: one copy per rank
    "reward_model.strategy",  # the reward model always runs on the FSDP engine
    # a sequence classifier scores with a 1-label head: no vocabulary head whose logits the fused path avoids
    "reward_model.model.use_fused_kernels",
    # verl's switch between its SPMD and server rollouts and <= 0.3's chat scheduler: each engine here has
    # one path, and agent loops follow rollout.multi_turn / rollout.agent
    "actor_rollout_ref.rollout.mode", "actor_rollout_ref.rollout.chat_scheduler",
    "actor_rollout_ref.rollout.micro_batch_size",  # verl <= 0.2, unused there too
    # verl's agent-loop worker processes: here a batch's trajectories are tasks of one event loop per worker
    "actor_rollout_ref.rollout.agent.num_workers",
    "trainer.esi_redundant_time",  # a save before a cloud instance expires (ESI), which these machines lack
    "trainer.default_hdfs_dir", "trainer.del_local_ckpt_after_load",  # HDFS copies: checkpoints stay local
    "trainer.ray_wait_register_center_timeout",  # verl's register-center actor, which rlfoundry has no need of
    "trainer.use_legacy_worker_impl",  # one worker implementation here
    # always on: the vLLM and SGLang rollouts wake the weights for a sync and the KV cache only to
    # generate (vllm_rollout._wake_up, sglang_rollout._resume); verl's false, all at once, only raises the peak
    "actor_rollout_ref.rollout.multi_stage_wake_up",
    # verl's profiler settings other than a torch trace's (global_profiler.tool=torch: trainer.profile_steps):
    # Nsight / NPU tool options, trace relocation and post-profiling hooks: observability only
    "global_profiler.global_tool_config*", "global_profiler.profile_continuous_steps",
    "global_profiler.relocate_results", "global_profiler.finish_hook*",
    "actor_rollout_ref.rollout.sglang_rollout_mode",  # verl <= 0.4's SGLang switch, which verl's code no longer reads
    # prompts go in and responses come out as token ids: the engines skip their tokenizer wherever the model allows
    "actor_rollout_ref.rollout.skip_tokenizer_init",
    "actor_rollout_ref.rollout.prometheus*",  # verl's Prometheus export of its rollout servers: observability only
    # verl's HTTP-client limits for its SGLang server, which verl declares and never passes to the client (its
    # adapter keeps its own defaults); SGLang runs in-process here, with no HTTP client to limit
    "actor_rollout_ref.rollout.server.*",
    # verl's early stop of a rollout's slowest requests: declared in its RolloutConfig, read by no verl code
    # (b178a3cd5, August HEAD); every request runs to its end, there as here
    "actor_rollout_ref.rollout.over_sample_rate",
    # verl's sapo scripts (August) add these; its sapo loss reads actor.tau_pos / actor.tau_neg instead
    "actor_rollout_ref.actor.policy_loss.tau_pos", "actor_rollout_ref.actor.policy_loss.tau_neg",
    # a DAPO recipe script (run_dapo_qwen2.5_32b_fsdp2_4k_npu.sh) adds it with "+"; no verl or recipe code reads it
    "data.min_response_length",
    "trainer.use_v1",  # verl's newer trainer implementation (its trainer_mode=sync); one trainer here
    "*.fsdp_config.use_orig_params",  # FSDP1's flag: FSDP2 always keeps the original parameters
    "*.fsdp_config.strategy",  # fsdp or fsdp2 (checked): one FSDP2 engine
    # HF <-> Megatron weights convert through mbridge whichever converter verl is told to use: the same weights
    "*.megatron.vanilla_mbridge",
    # packed (thd) or padded micro-batches: the Megatron engine here pads and masks rows, the same numbers
    "*.megatron.use_remove_padding",
    # verl (Aug 2026) passes it to Megatron-Bridge's HF export (may weights be missing?); here an engine's HF
    # export holds every weight of the model, whichever engine wrote it (tests/engines/test_megatron_checkpoint.py
    # counts the exported parameters against the loaded model's)
    "*.checkpoint.strict",
    # image rows always carry their pixel inputs (verl recomputes them in its agent loop when false)
    "data.return_multi_modal_inputs",
    # on-policy distillation: a teacher is a forward pass on the trainer's ranks (trainer/ppo/teachers.py), not an
    # inference engine in a pool of its own, so the engine's name and the pool's and engine's sizes change nothing
    "distillation.n_gpus_per_node", "distillation.nnodes", "distillation.teacher_models.*.num_replicas",
    "distillation.teacher_models.*.inference.name", "distillation.teacher_models.*.inference.*_parallel_size",
    *(f"distillation.teacher_models.*.inference.{key}" for key in (
        "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine", "max_num_seqs",
        "max_num_batched_tokens", "load_format", "engine_kwargs*", "limit_images", "enable_chunked_prefill",
        "enable_prefix_caching", "disable_log_stats", "skip_tokenizer_init",
        "temperature")),  # verl too scores at temperature 1 whatever is set (with a warning)
    # verl's veomni engine keys that change nothing on the FSDP2 engine running it (config/veomni.py):
    "*.veomni.seed",  # VeOmni reads it only with full_determinism, which is not built (an error)
    "*.veomni.pad_to_length_bucket",  # read only with pad_to_length, which is not built (an error)
    "*.veomni.forward_only",  # the role decides: the reference builds no optimizer, the actor one
    "*.veomni.force_use_huggingface",  # transformers' modeling code is the only one here
    # VeOmni's FSDP2 path prefetches by hand only with expert parallelism or modules kept out of mixed
    # precision (neither built); otherwise FSDP2's own prefetching, as here (fsdp_config.forward_prefetch is other)
    "*.veomni.forward_prefetch",
    # eager or liger_kernel (others: errors): verl's veomni engine runs its loss kernel only for log-probs from
    # hidden states (model.use_fused_kernels), which here are the fused head's torch chunks either way (as
    # fused_kernel_options.impl_backend=triton): the same values and memory bound
    "*.veomni.cross_entropy_loss_implementation",
)
# verl's model.override_config.attn_implementation values that are exact attention by a kernel this machine may
# lack (verl's default is flash_attention_2): the engines run transformers' SDPA for them, the same maths; the
# packed and sequence-parallel forwards are built on SDPA's masks, so eager and others are refused (models/hf.py)
SDPA_STANDS_IN_FOR = ("sdpa", "flash_attention_2", "flash_attention_3")
# global_profiler's keys that a torch trace reads (verl_compat._adopt_global_profiler); with another tool
# (nsys, npu) they have no effect
_GLOBAL_PROFILER_TRACE_KEYS = ("global_profiler.tool", "global_profiler.steps", "global_profiler.save_path")

# Engine knobs that only the vLLM and SGLang rollouts read: no effect (and a warning) with rollout.name=hf.
VLLM_ONLY_KEYS: tuple[str, ...] = tuple(
    f"actor_rollout_ref.rollout.{k}"
    for k in ("dtype", "gpu_memory_utilization", "enforce_eager", "free_cache_engine", "enable_sleep_mode", "load_format",
              "layered_summon", "tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size",
              "max_num_batched_tokens", "max_model_len",
              "max_num_seqs", "disable_log_stats", "enable_chunked_prefill", "enable_prefix_caching", "cudagraph_capture_sizes",
              "engine_kwargs*",
              "update_weights_bucket_megabytes")
)


# ───────────────────────────── verl's other spellings ─────────────────────────────

# verl >= 0.7 spells the rule-reward settings under a top-level ``reward``; the rest of rlfoundry
# reads them where older verl put them. New spelling -> old place (dicts merge into the old dict).
VERL_REWARD_KEYS = {
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_kwargs": "reward_model.reward_kwargs",
    "reward.num_workers": "reward_model.reward_kwargs.num_workers",
    "reward.compute_score_kwargs": "reward_model.reward_kwargs.compute_score_kwargs",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.custom_reward_function.reward_kwargs": "custom_reward_function.reward_kwargs",
    "reward.sandbox_fusion": "reward_model.sandbox_fusion",
}


def _set_by_user(user_keys: Sequence[str], key: str) -> bool:
    return any(k == key or k.startswith(key + ".") for k in user_keys)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _agree(new: Any, old: Any) -> bool:
    """Two spellings of one setting agree: dicts on the keys both have, anything else by value."""
    if isinstance(new, dict) and isinstance(old, dict):
        return all(old[k] == v for k, v in new.items() if k in old)
    return new == old


# verl <= 0.2's names of keys that verl renamed since: old name -> the key rlfoundry reads.
VERL_OLD_NAMES = {"trainer.val_generations_to_log_to_wandb": "trainer.log_val_generations"}

_ROLES_WITH_OPTIM = ("actor_rollout_ref.actor", "critic")
# verl's subtrees that moved (August 2026): each key the user set under the first is the second's
VERL_MOVED_SUBTREES = {"critic.fsdp.": "critic.model.fsdp_config.", "ray_kwargs.ray_init.": "ray_init."}
# verl's other names (newer layouts, its Megatron config, its worker groups) of settings rlfoundry reads
# elsewhere: given -> read. Each is the same setting: the value read is the value in effect.
VERL_OTHER_NAMES = {
    **{f"{role}.optim.clip_grad": f"{role}.grad_clip" for role in _ROLES_WITH_OPTIM},
    # Megatron's name of the schedule (its linear, inverse-square-root and WSD are not built: _check_decay_style)
    **{f"{role}.optim.lr_decay_style": f"{role}.optim.lr_scheduler_type" for role in _ROLES_WITH_OPTIM},
    # verl sets the actor/rollout/ref workers' process-group timeout; here one limit covers every collective
    "actor_rollout_ref.nccl_timeout": "trainer.dist_timeout_s",
    "actor_rollout_ref.actor.freeze_vision_tower": "actor_rollout_ref.model.freeze_vision_tower",
    # verl's PrefixGrouper: a group's shared prompt computed once in the forward, as the shared-prompt forward
    "actor_rollout_ref.actor.use_prefix_grouper": "actor_rollout_ref.model.use_shared_prompt",
    # verl's reward-loop workers score rule rewards in parallel: the scorer processes here
    "reward_model.num_workers": "reward_model.reward_kwargs.num_workers",
    # verl (Aug 2026) moved sequence parallelism into the engine config
    **{f"{role}.fsdp_config.ulysses_sequence_parallel_size": f"{role}.ulysses_sequence_parallel_size"
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")},
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    **{f"{role}.fsdp_config.use_torch_compile": f"{role}.use_torch_compile"
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")},
    **{f"{role}.megatron.router_replay.{k}": f"{role}.router_replay.{k}"
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref") for k in ("mode", "record_file", "replay_file")},
}
# FSDP engine configs whose role compiles nothing: verl's use_torch_compile there may only say false
_UNCOMPILED_FSDP_CONFIGS = ("critic.model.fsdp_config", "reward_model.model.fsdp_config")


def adopt_verl_spellings(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    """Copy each verl spelling the user set onto the key rlfoundry reads (``reward.*`` onto its older
    place, verl <= 0.2's old names, ``VERL_OTHER_NAMES``); one setting spelled two ways must agree (else
    a ConfigError naming both). Then Megatron's ``min_lr``, ``global_profiler`` and an adapter's LoRA
    settings (``_adopt_*``)."""
    spellings = [(new, old, "verl >= 0.7", "older verl") for new, old in VERL_REWARD_KEYS.items()]
    spellings += [(old, new, "verl <= 0.2", "verl's current name") for old, new in VERL_OLD_NAMES.items()]
    moved = [(k, read + k[len(given):]) for given, read in VERL_MOVED_SUBTREES.items() for k in user_keys
             if k.startswith(given)]
    spellings += [(given, read, "verl (Aug 2026)", "older verl") for given, read in moved]
    spellings += [(given, read, "verl", "the key read here") for given, read in VERL_OTHER_NAMES.items()]
    given_keys = list(user_keys) + [read for _, read in moved]  # a moved key's other names are adopted too
    _check_fsdp_strategy(cfg, given_keys)
    _check_uncompiled_roles(cfg)
    set_keys, set_as = list(user_keys), {}  # set_as: a key read -> the other spelling that set it
    for given, read, given_by, read_by in spellings:
        if _set_by_user(given_keys, given):
            _check_decay_style(given, OmegaConf.select(cfg, given))
            other = f"{set_as[read]} (also {read})" if read in set_as else f"{read} ({read_by})"
            _copy_setting(cfg, given, read, set_keys, f"{given} ({given_by}) and {other}")
            set_keys.append(read)  # a third spelling of the same setting is checked against this one
            set_as.setdefault(read, given)
    _adopt_min_lr(cfg, set_keys)
    _adopt_global_profiler(cfg, set_keys)
    for role in ("actor_rollout_ref.model", "critic.model"):
        _adopt_megatron_lora(cfg, role, set_keys)
    _adopt_adapter_lora(cfg, set_keys)
    _adopt_quoted_logger_list(cfg)


def _adopt_quoted_logger_list(cfg: DictConfig) -> None:
    """``trainer.logger='[console,wandb]'``: a list quoted into one string (the quotes reached Hydra, as in
    three of verl's August fully-async scripts), which verl's tracker refuses as one unknown back end. Read
    as the list it spells, and said, so the run logs where the script meant it to."""
    value = cfg.trainer.logger
    names = quoted_list(value)  # the key takes a name or a list, so typed's list-key reading does not reach it
    if names is None:
        return
    names = [str(x) for x in names]
    warnings.warn(f"trainer.logger={value!r} is one string (the list was quoted); read as the list {names} "
                  f"(verl would refuse it: write trainer.logger=[{','.join(names)}]).", stacklevel=4)
    cfg.trainer.logger = names


def _check_fsdp_strategy(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    """verl's ``fsdp_config.strategy``: fsdp and fsdp2 are the one FSDP2 engine here; anything else is no FSDP."""
    for key in user_keys:
        value = OmegaConf.select(cfg, key) if key.endswith(".fsdp_config.strategy") else None
        if value is not None and value not in ("fsdp", "fsdp2"):
            raise ConfigError(f"{key}={value}: an FSDP engine config's strategy is fsdp or fsdp2 (the FSDP2 engine "
                              "here either way); the role's engine is its strategy key.")


def _check_uncompiled_roles(cfg: DictConfig) -> None:
    for node in _UNCOMPILED_FSDP_CONFIGS:
        if OmegaConf.select(cfg, f"{node}.use_torch_compile"):
            raise ConfigError(f"{node}.use_torch_compile=true: compiled layers are built for the actor and the "
                              "reference only (their use_torch_compile); set it false or leave it unset.")


def _copy_setting(cfg: DictConfig, given: str, read: str, set_keys: Sequence[str], both: str) -> None:
    value, before = OmegaConf.select(cfg, given), OmegaConf.select(cfg, read)
    if _set_by_user(set_keys, read) and not _agree(_plain(value), _plain(before)):
        raise ConfigError(f"{both} are one setting and were given different values ({_plain(value)} vs "
                          f"{_plain(before)}); set one of them.")
    with open_dict(cfg):  # the older dicts take the new keys (struct mode would refuse them)
        OmegaConf.update(cfg, read, value, merge=isinstance(value, DictConfig))


def _check_decay_style(key: str, value: Any) -> None:
    if key.endswith(".lr_decay_style") and value not in LR_SCHEDULES:
        raise ConfigError(f"{key}={value}: Megatron's {value} learning-rate decay is not built here; the schedules "
                          f"built are {list(LR_SCHEDULES)} (warm-up, then constant or cosine down to min_lr).")


def _adopt_min_lr(cfg: DictConfig, set_keys: Sequence[str]) -> None:
    """Megatron's ``optim.min_lr`` (an lr) is ``min_lr_ratio`` × ``lr`` (the floor of the cosine)."""
    for role in _ROLES_WITH_OPTIM:
        optim, key = OmegaConf.select(cfg, f"{role}.optim"), f"{role}.optim"
        if optim.min_lr is None:
            continue
        if float(optim.lr) == 0.0:
            if float(optim.min_lr) != 0.0:
                raise ConfigError(f"{key}.min_lr={optim.min_lr} with {key}.lr=0: Megatron's floor is a fraction of "
                                  f"lr here (min_lr_ratio); a run at lr=0 has no floor above it. Set lr or min_lr=0.")
            continue
        ratio = float(optim.min_lr) / float(optim.lr)
        if _set_by_user(set_keys, f"{key}.min_lr_ratio") and optim.min_lr_ratio is not None and \
                abs(float(optim.min_lr_ratio) - ratio) > 1e-9 * max(1.0, ratio):
            raise ConfigError(f"{key}.min_lr={optim.min_lr} (Megatron's floor, = min_lr_ratio × lr = {ratio:g}) and "
                              f"{key}.min_lr_ratio={optim.min_lr_ratio} disagree; set one of them.")
        optim.min_lr_ratio = ratio


def _adopt_global_profiler(cfg: DictConfig, set_keys: Sequence[str]) -> None:
    """``global_profiler.tool=torch`` (or ``torch_memory``) with ``steps``: ``trainer.profile_steps``."""
    gp = cfg.global_profiler
    if gp.tool not in TORCH_PROFILER_TOOLS or not gp.steps:
        return
    _copy_setting(cfg, "global_profiler.steps", "trainer.profile_steps", set_keys,
                  "global_profiler.steps (verl, with global_profiler.tool=torch) and trainer.profile_steps")


# verl's Megatron model.lora.* -> the key read here (straight copies)
_MEGATRON_LORA_COPIES = {"rank": "lora_rank", "alpha": "lora_alpha", "adapter_path": "lora_adapter_path"}
# the values built for verl's other model.lora.* keys (null: not given); any other is a start-up error
_MEGATRON_LORA_BUILT = {"type": ("canonical_lora",), "dropout": (0, 0.0), "lora_A_init_method": ("kaiming",),
                        "lora_B_init_method": ("zero",), "a2a_experimental": (False,), "dtype": (),
                        "freeze_vision_model": (True,), "freeze_vision_projection": (True,),
                        "freeze_language_model": (True,)}


def _adopt_megatron_lora(cfg: DictConfig, role: str, set_keys: list[str]) -> None:
    """verl's Megatron ``<role>.lora.*`` onto the ``model.lora_*`` keys (one setting, so two spellings
    must agree); with a rank above 0, a value of a key that is not built is a ConfigError naming it."""
    given = [f for f in OmegaConf.select(cfg, f"{role}.lora") if _set_by_user(set_keys, f"{role}.lora.{f}")]
    for name in given:
        if _MEGATRON_LORA_COPIES.get(name) in OmegaConf.select(cfg, role):
            read = f"{role}.{_MEGATRON_LORA_COPIES[name]}"
            _copy_setting(cfg, f"{role}.lora.{name}", read, set_keys, f"{role}.lora.{name} (verl's Megatron) and {read}")
            set_keys.append(read)
    if "target_modules" in given:
        _set_translated(cfg, f"{role}.lora.target_modules", f"{role}.target_modules",
                        _hf_module_names(OmegaConf.select(cfg, f"{role}.lora.target_modules")), set_keys)
    if "exclude_modules" in given and OmegaConf.select(cfg, f"{role}.lora.exclude_modules"):
        _copy_setting(cfg, f"{role}.lora.exclude_modules", f"{role}.exclude_modules", set_keys,
                      f"{role}.lora.exclude_modules (verl's Megatron) and {role}.exclude_modules")
    if "merge" in given and role.startswith("actor_rollout_ref"):
        sync = "merged" if OmegaConf.select(cfg, f"{role}.lora.merge") else "adapter"
        _set_translated(cfg, f"{role}.lora.merge", "actor_rollout_ref.rollout.lora_sync", sync, set_keys)
    if int(OmegaConf.select(cfg, f"{role}.lora_rank") or 0) > 0:
        _refuse_unbuilt_lora(cfg, role, given)


def _set_translated(cfg: DictConfig, given: str, read: str, value: Any, set_keys: list[str]) -> None:
    if _set_by_user(set_keys, read) and not _agree(value, _plain(OmegaConf.select(cfg, read))):
        raise ConfigError(f"{given} (verl's Megatron, = {read}={value}) and {read}={_plain(OmegaConf.select(cfg, read))} "
                          "are one setting and were given different values; set one of them.")
    OmegaConf.update(cfg, read, value)
    set_keys.append(read)


# verl's Megatron LoRA target names (fused and canonical) -> HF module names, the names the typed config holds
MEGATRON_NAMES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_q": ("q_proj",), "linear_k": ("k_proj",),
    "linear_v": ("v_proj",), "linear_proj": ("o_proj",), "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",), "linear_fc2": ("down_proj",),
}


def _hf_module_names(targets: Any) -> Any:
    """verl's Megatron target names (linear_qkv, linear_fc1_up, ...) as the HF modules they hold; other
    names (HF's, all-linear) as given."""
    targets = _plain(targets)
    if isinstance(targets, str):
        return list(MEGATRON_NAMES[targets]) if targets in MEGATRON_NAMES else targets
    return list(dict.fromkeys(m for t in targets for m in MEGATRON_NAMES.get(t, (t,))))


def _refuse_unbuilt_lora(cfg: DictConfig, role: str, given: list[str]) -> None:
    problems = []
    for name in given:
        value = _plain(OmegaConf.select(cfg, f"{role}.lora.{name}"))
        if name in _MEGATRON_LORA_BUILT and value is not None and value not in _MEGATRON_LORA_BUILT[name]:
            built = _MEGATRON_LORA_BUILT[name] or ("null",)
            problems.append(f"{role}.lora.{name}={value} (built: {' or '.join(map(str, built))})")
    if "adapter_path" in given and "lora_adapter_path" not in OmegaConf.select(cfg, role):
        problems.append(f"{role}.lora.adapter_path (starting this role from an adapter is not built)")
    if problems:
        why = (" (type=lora is verl's fused layout, one A shared by q, k and v; canonical_lora is peft's "
               "per-projection layout, what both engines train)") if "type" in given else ""
        raise ConfigError(f"LoRA: {'; '.join(problems)}: not built here{why}; set each key to a built value or "
                          "remove it (docs/lora.md).")


_ADAPTER_FIELDS = {"lora_rank": "r", "lora_alpha": "lora_alpha", "target_modules": "target_modules"}


def _adopt_adapter_lora(cfg: DictConfig, set_keys: Sequence[str]) -> None:
    """``model.lora_adapter_path`` without ``lora_rank``: the adapter's own rank, alpha and target modules
    (its ``adapter_config.json``), as verl does; keys the user set win."""
    model = cfg.actor_rollout_ref.model
    path = model.lora_adapter_path
    config = Path(str(path)).expanduser() / "adapter_config.json" if path else None
    if config is None or not config.is_file() or int(model.lora_rank or 0) > 0:
        return  # a missing adapter is reported by the LoRA check, naming the key
    adapter = json.loads(config.read_text())
    fields = {"lora_rank": adapter.get("r"), "lora_alpha": adapter.get("lora_alpha"),
              "target_modules": adapter.get("target_modules")}
    for name, value in fields.items():
        if value is not None and not _set_by_user(set_keys, f"actor_rollout_ref.model.{name}"):
            try:
                model[name] = value
            except OmegaConfBaseException as e:  # e.g. a fractional lora_alpha: the schema's is an int
                raise ConfigError(f"{config}: {_ADAPTER_FIELDS[name]}={value!r} cannot be "
                                  f"actor_rollout_ref.model.{name} ({e.msg}); set that key yourself.") from None


# verl's deprecated global micro-batch keys and the per-rank keys that replaced them.
_DEPRECATED_MICRO = {
    f"{role}.{old}": f"{role}.{old}_per_gpu"
    for role, old in (("actor_rollout_ref.actor", "ppo_micro_batch_size"), ("critic", "ppo_micro_batch_size"),
                      ("actor_rollout_ref.rollout", "log_prob_micro_batch_size"),
                      ("actor_rollout_ref.ref", "log_prob_micro_batch_size"), ("reward_model", "micro_batch_size"))
}


def prefer_user_deprecated_keys(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    """An old script's global micro-batch key replaces our per-rank *default* (not a per-rank key it also set);
    verl <= 0.3's ``checkpoint.contents`` is both lists unless the newer key is set too; a save list of the HF
    export alone keeps the resumable state beside it (``_save_hf_exports_resumably``)."""
    for old, new in _DEPRECATED_MICRO.items():
        if old in user_keys and new not in user_keys:
            OmegaConf.update(cfg, new, None, merge=False)
    for role in CHECKPOINT_ROLES:
        contents = OmegaConf.select(cfg, f"{role}.checkpoint.contents")
        for new in ("save_contents", "load_contents"):
            if contents is not None and f"{role}.checkpoint.{new}" not in user_keys:
                OmegaConf.update(cfg, f"{role}.checkpoint.{new}", list(contents), merge=False)
        _save_hf_exports_resumably(cfg, role)


def _save_hf_exports_resumably(cfg: DictConfig, role: str) -> None:
    """verl's "HF exports only" save (``save_contents=['hf_model']``, its GMPO example): here every saved step
    stays resumable, so the role's own state is written beside the export (disk, not results)."""
    listed = OmegaConf.select(cfg, f"{role}.checkpoint.save_contents")
    if listed is None or "model" in listed or "hf_model" not in listed:
        return
    whole = ["model", "optimizer", "extra", *[x for x in listed if x not in ("model", "optimizer", "extra")]]
    warnings.warn(f"{role}.checkpoint.save_contents={list(listed)}: each saved step gets the HF export (huggingface/) "
                  f"and, beside it, the role's own model, optimizer and extra state (rlfoundry saves every step "
                  f"resumable): saving {whole}. Set that list to silence this.", stacklevel=4)
    OmegaConf.update(cfg, f"{role}.checkpoint.save_contents", whole, merge=False)


def _no_effect_patterns(cfg: DictConfig) -> tuple[str, ...]:
    engine = OmegaConf.select(cfg, "actor_rollout_ref.rollout.name") in ("vllm", "sglang")
    torch_trace = OmegaConf.select(cfg, "global_profiler.tool") in TORCH_PROFILER_TOOLS
    return (NO_EFFECT_KEYS + (() if engine else VLLM_ONLY_KEYS)
            + (() if torch_trace else _GLOBAL_PROFILER_TRACE_KEYS))


# reward.reward_model's serving engine and pool when it holds a classifier (trainer/config.py adopt_classifier_reward_model):
# the classifier scores on the RewardModel worker, colocated with the actor
_CLASSIFIER_JUDGE_KEYS = ("reward.reward_model.rollout.*", "reward.reward_model.enable_resource_pool",
                          "reward.reward_model.n_gpus_per_node", "reward.reward_model.nnodes")


# verl's reward loop and its legacy reward-model worker give a classifier's same score; here the classifier
# scores on a RewardModel worker on the FSDP engine beside the actor, so the loop's serving engine and its
# pool are not used. With a custom reward function the loop serves a generative model to it
# (rewards/reward_loop.py) on this engine, in this pool.
_REWARD_LOOP_ENGINE_KEYS = ("reward_model.rollout.*", "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node",
                            "reward_model.nnodes")


def serves_reward_model(cfg: Any) -> bool:
    """Whether the run serves ``reward_model.model.path`` to the custom function (verl's reward loop,
    ``rewards/reward_loop.py``); ``rm_combine=add`` keeps rlfoundry's classifier path (its score added to
    the function's). A config rule, so it lives in the config layer."""
    rm = cfg.reward_model
    return bool(rm.enable and rm.use_reward_loop and cfg.custom_reward_function.path
                and (rm.reward_kwargs or {}).get("rm_combine", "replace") == "replace")


def no_effect_keys_set(cfg: DictConfig, keys: Sequence[str]) -> list[str]:
    """The keys among ``keys`` (as the user set them) that have no effect here, in first-seen order."""
    patterns = _no_effect_patterns(cfg)
    if not serves_reward_model(cfg):
        patterns += _REWARD_LOOP_ENGINE_KEYS
    if "reward.reward_model.enable" in keys and not cfg.reward.reward_model.enable and cfg.reward_model.enable:
        patterns += _CLASSIFIER_JUDGE_KEYS
    hits = [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    return list(dict.fromkeys(hits))


def warn_no_effect(cfg: DictConfig, keys: Sequence[str]) -> None:
    hits = no_effect_keys_set(cfg, keys)
    dropped = [x for x in loggers(cfg) if x in IGNORED_LOGGERS]
    if dropped:
        hits.append(f"trainer.logger entries {dropped}")
    if hits:
        warnings.warn(
            "These verl settings are accepted but have no effect in rlfoundry: " + ", ".join(hits) + ".",
            NoEffectKeyWarning,
            stacklevel=3,
        )


def loggers(cfg: DictConfig) -> list[str]:
    """``trainer.logger`` as a list (verl accepts one name or a list)."""
    value = cfg.trainer.logger
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(x) for x in value]
