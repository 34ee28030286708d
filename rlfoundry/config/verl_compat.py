"""verl compatibility in one place: how a verl command line maps onto rlfoundry's config.

- ``NO_EFFECT_KEYS`` / ``VLLM_ONLY_KEYS``: verl keys accepted so verl command lines run unchanged, each
  with the reason it changes nothing here (docs/verl_keys.md lists them); ``warn_no_effect`` names the
  ones a run sets in one warning;
- ``VERL_REWARD_KEYS`` / ``VERL_OLD_NAMES``: verl's newer and older spellings of one setting, copied onto
  the key rlfoundry reads by ``adopt_verl_reward_keys`` (two spellings given different values is an error);
- ``prefer_user_deprecated_keys``: verl's deprecated global micro-batch keys and ``checkpoint.contents``.

The loader (``trainer/config.py`` ``load_config``) calls these once, after the overrides are applied.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from rlfoundry.config.typed import ConfigError
from rlfoundry.utils.tracking import VERL_ONLY_BACKENDS

__all__ = [
    "CHECKPOINT_ROLES",
    "IGNORED_LOGGERS",
    "NO_EFFECT_KEYS",
    "NoEffectKeyWarning",
    "VERL_OLD_NAMES",
    "VERL_REWARD_KEYS",
    "VLLM_ONLY_KEYS",
    "adopt_verl_reward_keys",
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
    "ray_init.timeline_json_file",  # a Ray timeline dump: observability only
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
)

# Engine knobs that only the vLLM and SGLang rollouts read: no effect (and a warning) with rollout.name=hf.
VLLM_ONLY_KEYS: tuple[str, ...] = tuple(
    f"actor_rollout_ref.rollout.{k}"
    for k in ("dtype", "gpu_memory_utilization", "enforce_eager", "free_cache_engine", "load_format",
              "layered_summon", "tensor_model_parallel_size", "max_num_batched_tokens", "max_model_len",
              "max_num_seqs", "disable_log_stats", "enable_chunked_prefill", "engine_kwargs*",
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


def adopt_verl_reward_keys(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    """Copy each ``reward.*`` key the user set onto its older place, and each of verl <= 0.2's old
    names onto the key read; one setting spelled both ways must agree (else a ConfigError naming both)."""
    spellings = [(new, old, "verl >= 0.7", "older verl") for new, old in VERL_REWARD_KEYS.items()]
    spellings += [(old, new, "verl <= 0.2", "verl's current name") for old, new in VERL_OLD_NAMES.items()]
    for given, read, given_by, read_by in spellings:
        if not _set_by_user(user_keys, given):
            continue
        value, before = OmegaConf.select(cfg, given), OmegaConf.select(cfg, read)
        if _set_by_user(user_keys, read) and not _agree(_plain(value), _plain(before)):
            raise ConfigError(f"{given} ({given_by}) and {read} ({read_by}) are one setting and were given "
                              f"different values ({_plain(value)} vs {_plain(before)}); set one of them.")
        with open_dict(cfg):  # the older dicts take the new keys (struct mode would refuse them)
            OmegaConf.update(cfg, read, value, merge=isinstance(value, DictConfig))


# verl's deprecated global micro-batch keys and the per-rank keys that replaced them.
_DEPRECATED_MICRO = {
    f"{role}.{old}": f"{role}.{old}_per_gpu"
    for role, old in (("actor_rollout_ref.actor", "ppo_micro_batch_size"), ("critic", "ppo_micro_batch_size"),
                      ("actor_rollout_ref.rollout", "log_prob_micro_batch_size"),
                      ("actor_rollout_ref.ref", "log_prob_micro_batch_size"), ("reward_model", "micro_batch_size"))
}


def prefer_user_deprecated_keys(cfg: DictConfig, user_keys: Sequence[str]) -> None:
    """An old script's global micro-batch key replaces our per-rank *default* (not a per-rank key it also set);
    verl <= 0.3's ``checkpoint.contents`` is both lists unless the newer key is set too."""
    for old, new in _DEPRECATED_MICRO.items():
        if old in user_keys and new not in user_keys:
            OmegaConf.update(cfg, new, None, merge=False)
    for role in CHECKPOINT_ROLES:
        contents = OmegaConf.select(cfg, f"{role}.checkpoint.contents")
        for new in ("save_contents", "load_contents"):
            if contents is not None and f"{role}.checkpoint.{new}" not in user_keys:
                OmegaConf.update(cfg, f"{role}.checkpoint.{new}", list(contents), merge=False)


def _no_effect_patterns(cfg: DictConfig) -> tuple[str, ...]:
    engine = OmegaConf.select(cfg, "actor_rollout_ref.rollout.name") in ("vllm", "sglang")
    return NO_EFFECT_KEYS if engine else NO_EFFECT_KEYS + VLLM_ONLY_KEYS


def no_effect_keys_set(cfg: DictConfig, keys: Sequence[str]) -> list[str]:
    """The keys among ``keys`` (as the user set them) that have no effect here, in first-seen order."""
    patterns = _no_effect_patterns(cfg)
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
