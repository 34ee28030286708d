"""verl's veomni engine (``model_engine=veomni``, ``<role>.strategy=veomni``) on the FSDP2 engine.

VeOmni trains the HF model with FSDP2 sharding, Ulysses sequence parallelism and offload, as the FSDP
engine here does; each ``<role>.veomni.*`` key a role on it was given is put onto the FSDP engine key
doing the same (two spellings of one setting must agree), or, for a value that is not built, stops the
run at start-up naming it. The role's strategy then reads ``fsdp``: nothing past the config knows.

    extra_keys = adopt_veomni(cfg, user_keys)   # trainer/config.py load_config, before adopt_verl_spellings

verl's reference takes the actor's veomni settings unless its own are given (``ref/veomni_ref.yaml``
interpolates them); so does the reference here. Its semantics: verl's ``workers/engine/veomni`` and
VeOmni's ``torch_parallelize`` / ``parallel_state``; docs/verl_keys.md lists the keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlfoundry.config.typed import ConfigError
from rlfoundry.config.verl_compat import _copy_setting, _plain, _set_by_user

__all__ = ["VEOMNI_BUILT", "adopt_veomni"]

# role -> its FSDP engine config
ROLES = {"actor_rollout_ref.actor": "actor_rollout_ref.actor.fsdp_config",
         "actor_rollout_ref.ref": "actor_rollout_ref.ref.fsdp_config",
         "critic": "critic.model.fsdp_config"}
_ACTOR, _REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"

# veomni key -> the fsdp_config key that is the same setting (VeOmni passes enable_full_shard to FSDP2 as
# reshard_after_forward and enable_fsdp_offload as its CPUOffloadPolicy, the FSDP engine's offload_policy;
# expert_parallel_size shards the experts by expert over that many ranks, as the FSDP engine's key of the
# name does: engines/fsdp/expert_parallel.py). Not forward_prefetch: VeOmni's FSDP2 path sets prefetching by
# hand only with expert parallelism (its expert units next to their layers') or modules kept out of mixed
# precision; FSDP2 prefetches on its own here, under expert parallelism too.
FSDP_KEYS = {"param_offload": "param_offload", "optimizer_offload": "optimizer_offload",
             "enable_full_shard": "reshard_after_forward", "enable_fsdp_offload": "offload_policy",
             "expert_parallel_size": "expert_parallel_size"}

# the reference's keys verl's ref/veomni_ref.yaml takes from the actor's
REF_FOLLOWS = ("seed", "fsdp_size", "ulysses_parallel_size", "expert_parallel_size", "param_offload",
               "attn_implementation", "moe_implementation", "cross_entropy_loss_implementation",
               "rms_norm_implementation", "swiglu_mlp_implementation", "rotary_pos_emb_implementation",
               "load_balancing_loss_implementation", "pad_to_length_bucket")

_LIGER = "Liger's RMSNorm, SwiGLU and RoPE kernels are one switch here, actor_rollout_ref.model.use_liger=true"
_FLA = "flash-linear-attention's kernels (Qwen3.5's linear attention) are not built; the model's own code runs"
# veomni key -> (the values built, what runs here / what to use instead)
VEOMNI_BUILT: dict[str, tuple[tuple, str]] = {
    # exact attention all: VeOmni's FlashAttention-2 (verl swaps flash_attention_2 for its with-SP variant)
    # and PyTorch's SDPA, which is the FSDP engine's attention, as for verl's FSDP engine's flash_attention_2
    "attn_implementation": (("flash_attention_2", "veomni_flash_attention_2_with_sp", "sdpa"),
                            "the FSDP engine attends with PyTorch SDPA (its flash or memory-efficient kernel); "
                            "eager, flash_attention_3 and native-sparse are not built"),
    "moe_implementation": (("fused", "fused_triton"), "the experts run as grouped matrix products (grouped_mm, "
                                                      "docs/moe.md); the per-expert loop is not a choice here"),
    "cross_entropy_loss_implementation": (("eager", "liger_kernel"), "log-probs from hidden states are "
                                          "actor_rollout_ref.model.use_fused_kernels=true"),
    "rms_norm_implementation": (("eager",), _LIGER),
    "swiglu_mlp_implementation": (("eager",), _LIGER),
    "rotary_pos_emb_implementation": (("eager",), _LIGER),
    "rms_norm_gated_implementation": (("eager",), _FLA),
    "causal_conv1d_implementation": (("eager",), _FLA),
    "chunk_gated_delta_rule_implementation": (("eager",), _FLA),
    "load_balancing_loss_implementation": (("eager",), "the router losses are computed in torch (docs/moe.md)"),
    "dsa_indexer_implementation": (("eager",), "DeepSeek-V4's TileLang kernels are not built"),
    "dsa_attention_implementation": (("eager",), "DeepSeek-V4's TileLang kernels are not built"),
    "mhc_implementation": (("eager",), "DeepSeek-V4's TileLang kernels are not built"),
    "full_determinism": ((False,), "deterministic kernels are not built as an engine switch"),
    "init_device": (("meta",), "the engine reads the HF weights and shards them; other initialisations are not "
                               "built"),
    "ckpt_manager": (("dcp",), "checkpoints are torch.distributed.checkpoint's"),
    "load_checkpoint_path": ((None,), "resume with trainer.resume_mode / trainer.resume_from_path"),
    "strategy": (("veomni",), "the role's engine is its strategy key"),
    "use_torch_compile": ((False,), "the role's use_torch_compile compiles its decoder layers here"),
    "enable_reentrant": ((False,), "activation checkpointing is non-reentrant (the reentrant kind does not "
                                   "compose with FSDP2's hooks)"),
    "activation_gpu_limit": ((0, 0.0), "activation offload is all or nothing, model.enable_activation_offload"),
    "basic_modules": (([],), "FSDP2 wraps each decoder layer; other wrap units are not built"),
    "pad_to_length": ((False,), "packed micro-batches keep their own length; bucketed padding is not built"),
}


def adopt_veomni(cfg: DictConfig, user_keys: Sequence[str]) -> list[str]:
    """Each role on verl's veomni engine: its strategy becomes fsdp and its ``veomni.*`` keys the FSDP
    engine's (``ConfigError`` for what is not built, for veomni keys on a role on another engine, and for
    two spellings that disagree). Returns the keys it set, to be treated as the user's."""
    on_veomni = [role for role in ROLES if OmegaConf.select(cfg, f"{role}.strategy") == "veomni"]
    _refuse_stray_keys(cfg, user_keys, on_veomni)
    user_keys = list(user_keys) + _role_pad_to_length(cfg, user_keys, on_veomni)
    given = {role: _given(role, user_keys, on_veomni) for role in on_veomni}
    for name in given.get(_REF, ()):  # the actor's, where verl's reference interpolates them
        if not _set_by_user(user_keys, f"{_REF}.veomni.{name}"):
            OmegaConf.update(cfg, f"{_REF}.veomni.{name}", OmegaConf.select(cfg, f"{_ACTOR}.veomni.{name}"))
    _refuse_unbuilt(cfg, given)
    set_keys = list(user_keys)
    for role in on_veomni:
        _adopt_role(cfg, role, given[role], set_keys)
    for role in on_veomni:  # last: the reference's strategy follows the actor's, read above
        OmegaConf.update(cfg, f"{role}.strategy", "fsdp")
    return set_keys[len(user_keys):]


def _role_pad_to_length(cfg: DictConfig, user_keys: Sequence[str], on_veomni: Sequence[str]) -> list[str]:
    """verl's veomni actor and reference spell ``veomni.pad_to_length`` one level up too (the reference's
    follows the actor's): copied down, as the veomni key it is."""
    added = []
    for role in (r for r in (_ACTOR, _REF) if r in on_veomni):
        if _set_by_user(user_keys, f"{role}.veomni.pad_to_length"):
            continue
        source = role if _set_by_user(user_keys, f"{role}.pad_to_length") else _ACTOR
        if _set_by_user(user_keys, f"{source}.pad_to_length"):
            OmegaConf.update(cfg, f"{role}.veomni.pad_to_length", OmegaConf.select(cfg, f"{source}.pad_to_length"))
            added.append(f"{role}.veomni.pad_to_length")
    return added


def _given(role: str, user_keys: Sequence[str], on_veomni: Sequence[str]) -> list[str]:
    """The veomni keys (names under ``<role>.veomni``) in effect for ``role``: set on it, or, for the
    reference, set on the actor (when the actor is on veomni too) for a key verl's reference follows."""
    own = [k[len(f"{role}.veomni."):] for k in user_keys if k.startswith(f"{role}.veomni.")]
    if role != _REF or _ACTOR not in on_veomni:
        return own
    actor = [k[len(f"{_ACTOR}.veomni."):] for k in user_keys if k.startswith(f"{_ACTOR}.veomni.")]
    return own + [k for k in actor if k in REF_FOLLOWS and k not in own]


def _refuse_stray_keys(cfg: DictConfig, user_keys: Sequence[str], on_veomni: Sequence[str]) -> None:
    stray = [k for k in user_keys for role in ROLES if role not in on_veomni
             and (k.startswith(f"{role}.veomni.") or k == f"{role}.pad_to_length")]
    if stray:
        role = next(r for r in ROLES if stray[0].startswith(f"{r}."))
        raise ConfigError(f"{', '.join(stray)}: verl's veomni engine keys, but {role}.strategy="
                          f"{OmegaConf.select(cfg, f'{role}.strategy')}; they would do nothing. Add model_engine=veomni "
                          f"(or {role}.strategy=veomni), or remove them.")


def _refuse_unbuilt(cfg: DictConfig, given: dict[str, list[str]]) -> None:
    """One ``ConfigError`` for every veomni value, set or verl's default, that is not built here."""
    problems = []
    for role in given:
        for name, (built, instead) in VEOMNI_BUILT.items():
            value = _plain(OmegaConf.select(cfg, f"{role}.veomni.{name}"))
            if value not in built:
                problems.append(f"{role}.veomni.{name}={value} (built: {', '.join(map(str, built))}; {instead})")
        mode = OmegaConf.select(cfg, f"{role}.veomni.router_replay.mode")
        if role == "critic" and mode != "disabled":
            problems.append(f"critic.veomni.router_replay.mode={mode} (routing replay is the actor's, "
                            "actor_rollout_ref.actor.veomni.router_replay.mode; the critic routes by its own router)")
    if problems:
        bullet = "\n  - "
        raise ConfigError("verl's veomni engine runs on the FSDP2 engine here, which does not build:" + bullet
                          + bullet.join(problems) + "\nSet each to a built value or remove it (docs/verl_keys.md).")


def _adopt_role(cfg: DictConfig, role: str, given: list[str], set_keys: list[str]) -> None:
    fsdp = ROLES[role]
    for name in given:
        if name in FSDP_KEYS:
            _same(cfg, f"{role}.veomni.{name}", f"{fsdp}.{FSDP_KEYS[name]}", set_keys)
        elif name == "ulysses_parallel_size":
            _same(cfg, f"{role}.veomni.{name}", f"{role}.ulysses_sequence_parallel_size", set_keys)
        elif name == "router_replay.mode" and role != "critic":
            _same(cfg, f"{role}.veomni.{name}", f"{role}.router_replay.mode", set_keys)
    if "fsdp_size" in given:
        _translate(cfg, f"{role}.veomni.fsdp_size", f"{fsdp}.fsdp_size", _fsdp_size(cfg, role), set_keys)
    if not OmegaConf.select(cfg, f"{role}.veomni.mixed_precision"):
        # VeOmni then loads bf16 weights and computes in them, as fsdp_config.model_dtype=bf16 does here
        _translate(cfg, f"{role}.veomni.mixed_precision=false", f"{fsdp}.model_dtype", "bf16", set_keys)


def _fsdp_size(cfg: DictConfig, role: str) -> int:
    """VeOmni counts fsdp_size in data-parallel ranks and shards over it × the Ulysses size (its FSDP mesh is
    ``dp_shard_sp``); the FSDP engine counts ranks: -1 (all) stays, n > 0 is n × SP."""
    size = int(OmegaConf.select(cfg, f"{role}.veomni.fsdp_size"))
    return size if size < 0 else size * int(OmegaConf.select(cfg, f"{role}.veomni.ulysses_parallel_size"))


def _same(cfg: DictConfig, given: str, read: str, set_keys: list[str]) -> None:
    _copy_setting(cfg, given, read, set_keys, f"{given} (verl's veomni engine) and {read}")
    set_keys.append(read)


def _translate(cfg: DictConfig, given: str, read: str, value: Any, set_keys: list[str]) -> None:
    before = _plain(OmegaConf.select(cfg, read))
    if _set_by_user(set_keys, read) and before != value:
        raise ConfigError(f"{given} (verl's veomni engine, = {read}={value}) and {read}={before} are one setting "
                          "and were given different values; set one of them.")
    OmegaConf.update(cfg, read, value)
    set_keys.append(read)
