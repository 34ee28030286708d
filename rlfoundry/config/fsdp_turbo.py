"""verl's FSDP-Turbo engine (``<role>.strategy=fsdp_turbo``, ``<role>.fsdp_config.turbo_config.*``) on the FSDP2 engine.

verl (August 2026) runs Huawei's ``fsdp_turbo`` package as an FSDP engine whose sharding, expert and Ulysses
layouts come from ``fsdp_config.turbo_config``: FSDP2 units named by module patterns, the experts sharded by
expert with an all-to-all dispatch, activation recompute by module pattern. The FSDP2 engine here does each of
those on its own terms (each decoder layer and vision block a unit, the routed experts found per layer,
per-layer checkpointing), so each turbo key either becomes the FSDP engine key doing the same, changes only
which modules are units (said, no effect on a result), or, for a value not built, stops the run at start-up
naming it. The role's strategy then reads ``fsdp``.

    extra_keys = adopt_fsdp_turbo(cfg, user_keys)   # trainer/config.py load_config, beside adopt_veomni

Semantics from verl's ``workers/engine/fsdp/fsdp_turbo_impl.py`` and the defaults of its ``engine/fsdp.yaml``
(the package itself is not public); docs/verl_keys.md lists the keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from rlfoundry.config.typed import ConfigError, dtype_problems
from rlfoundry.config.veomni import ROLES, _same, _translate
from rlfoundry.config.verl_compat import NoEffectKeyWarning, _plain, _set_by_user

__all__ = ["TURBO_DEFAULTS", "adopt_fsdp_turbo"]

# verl's engine/fsdp.yaml turbo_config, the values a key not given takes
TURBO_DEFAULTS: dict[str, Any] = {
    "distributed.fully_shard_parallel_size": 16, "distributed.tensor_parallel_size": 1,
    "distributed.expert_parallel_size": 1, "distributed.expert_fully_shard_parallel_size": 1,
    "distributed.ulysses_parallel_size": 1,
    "distributed.fsdp_plan.param_dtype": "bf16", "distributed.fsdp_plan.reduce_dtype": "fp32",
    "distributed.fsdp_plan.output_dtype": "bf16", "distributed.fsdp_plan.fsdp_implementation": "native",
    "distributed.fsdp_plan.num_to_forward_prefetch": 1, "distributed.fsdp_plan.num_to_backward_prefetch": 1,
}
# keys that name which modules are FSDP units, expert units or prefetch hooks: the engine picks the same
# kinds of module itself, and the choice of units moves memory and overlap, never a number
_UNIT_KEYS = ("distributed.fsdp_plan.apply_modules", "distributed.fsdp_plan.hook_modules",
              "distributed.ep_plan.apply_modules", "memory.recompute_plan")
_BUILT: dict[str, tuple[tuple, str]] = {
    "distributed.tensor_parallel_size": ((1,), "tensor parallelism on the FSDP2 engine is not built; it is the "
                                               "Megatron engine's (strategy=megatron, megatron.tensor_model_parallel_size)"),
    "distributed.fsdp_plan.fsdp_implementation": (("native",), "the engine is torch's FSDP2 (fully_shard)"),
    "distributed.fsdp_plan.num_to_forward_prefetch": ((1,), "FSDP2 prefetches one unit ahead on its own; a deeper "
                                                            "prefetch is not built"),
    "distributed.fsdp_plan.num_to_backward_prefetch": ((1,), "FSDP2 prefetches one unit ahead on its own; a deeper "
                                                             "prefetch is not built"),
    "distributed.ep_plan.dispatcher": ((None, "eager"), "tokens go to their experts' ranks by transformers' all-to-all "
                                                   "(docs/moe.md); the fused dispatch kernels (NPU) are not built"),
    "distributed.cp_plan": ((None,), "fsdp_turbo's Ulysses function patches are not built; the FSDP engine's own "
                                     "Ulysses runs with distributed.ulysses_parallel_size alone"),
    "module_patches": ((None,), "fsdp_turbo's replacement model forwards are not built; transformers' modeling "
                                "code runs"),
}
_KNOWN = {*TURBO_DEFAULTS, *_UNIT_KEYS, *_BUILT, "memory.recompute"}


def adopt_fsdp_turbo(cfg: DictConfig, user_keys: Sequence[str]) -> list[str]:
    """Each role with ``strategy=fsdp_turbo``: its ``turbo_config`` put onto the FSDP engine's keys, its strategy
    ``fsdp`` (``ConfigError`` for a value not built, a key fsdp_turbo has not, turbo keys on a role on another
    engine, two spellings that disagree). Returns the keys it set, to be treated as the user's."""
    on_turbo = [role for role in ROLES if OmegaConf.select(cfg, f"{role}.strategy") == "fsdp_turbo"]
    given = {role: _given(role, user_keys) for role in ROLES}
    stray = [f"{ROLES[r]}.turbo_config.{k}" for r in ROLES if r not in on_turbo for k in given[r]]
    if stray:
        raise ConfigError(f"{', '.join(stray)}: verl's FSDP-Turbo engine keys on a role whose strategy is not "
                          "fsdp_turbo; they would do nothing. Set that role's strategy=fsdp_turbo, or remove them.")
    set_keys, notes = list(user_keys), []
    for role in on_turbo:
        turbo = {**TURBO_DEFAULTS, **{k: _plain(OmegaConf.select(cfg, _path(role, k))) for k in given[role]}}
        _refuse(role, turbo, _world(cfg))
        notes += _adopt_role(cfg, role, turbo, given[role], set_keys)
        OmegaConf.update(cfg, f"{role}.strategy", "fsdp")
    if notes:
        warnings.warn("verl's FSDP-Turbo engine runs on the FSDP2 engine here: " + "; ".join(notes) + ".",
                      NoEffectKeyWarning, stacklevel=3)
    return set_keys[len(user_keys):]


def _path(role: str, key: str) -> str:
    return f"{ROLES[role]}.turbo_config.{key}"


def _given(role: str, user_keys: Sequence[str]) -> list[str]:
    """The turbo keys set on ``role``, each as the known key it lies at or under (a plan's dict is one key)."""
    prefix = f"{ROLES[role]}.turbo_config."
    out = []
    for key in (k[len(prefix):] for k in user_keys if k.startswith(prefix)):
        known = next((k for k in sorted(_KNOWN, key=len, reverse=True) if key == k or key.startswith(k + ".")), key)
        if known not in out:
            out.append(known)
    return out


def _world(cfg: DictConfig) -> int:
    return int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)


def _refuse(role: str, turbo: dict[str, Any], world: int) -> None:
    """One ``ConfigError`` for every turbo value, given or verl's default, that is not built here."""
    problems = [f"turbo_config.{k} (fsdp_turbo has no such key)" for k in turbo if k not in _KNOWN]
    for key, (built, instead) in _BUILT.items():
        if turbo.get(key) not in built:
            problems.append(f"turbo_config.{key}={turbo.get(key)} ({instead})")
    ep = int(turbo["distributed.expert_parallel_size"])
    efsdp = int(turbo["distributed.expert_fully_shard_parallel_size"])
    if ep > 1 and world % ep == 0 and (world // ep) % efsdp:
        problems.append(f"turbo_config.distributed.expert_fully_shard_parallel_size={efsdp} (it shards each of "
                        f"the {world // ep} copies of an expert shard that expert parallel size {ep} over {world} "
                        "ranks leaves; it must divide that number)")
    if ep == 1 and efsdp != 1:
        problems.append(f"turbo_config.distributed.expert_fully_shard_parallel_size={efsdp} (without expert "
                        "parallelism the experts shard with the other weights; set it to 1)")
    for name in ("param_dtype", "reduce_dtype"):
        problems += dtype_problems(f"turbo_config.distributed.fsdp_plan.{name}", turbo[f"distributed.fsdp_plan.{name}"])
    if turbo["distributed.fsdp_plan.output_dtype"] != turbo["distributed.fsdp_plan.param_dtype"]:
        problems.append(f"turbo_config.distributed.fsdp_plan.output_dtype={turbo['distributed.fsdp_plan.output_dtype']} "
                        "(a unit's outputs are in its compute dtype, param_dtype; casting them apart is not built)")
    if problems:
        bullet = "\n  - " + ROLES[role] + "."
        raise ConfigError(f"verl's FSDP-Turbo engine ({role}.strategy=fsdp_turbo) runs on the FSDP2 engine here, "
                          f"which does not build:{bullet}{bullet.join(problems)}\nSet each to a built value or remove "
                          "it (docs/verl_keys.md).")


def _adopt_role(cfg: DictConfig, role: str, turbo: dict[str, Any], given: list[str], set_keys: list[str]) -> list[str]:
    fsdp, notes = ROLES[role], []
    _translate(cfg, _path(role, "distributed.fully_shard_parallel_size"), f"{fsdp}.fsdp_size",
               _fsdp_size(turbo, _world(cfg)), set_keys)
    # not given: verl's defaults (1, 1), the FSDP engine's too
    for key, read in (("distributed.expert_parallel_size", f"{fsdp}.expert_parallel_size"),
                      ("distributed.ulysses_parallel_size", f"{role}.ulysses_sequence_parallel_size")):
        if key in given:
            _same(cfg, _path(role, key), read, set_keys)
    for name in ("param_dtype", "reduce_dtype"):  # verl's defaults (bf16 / fp32) are this engine's on GPUs
        if f"distributed.fsdp_plan.{name}" in given:
            with open_dict(cfg):  # the engine's mixed_precision is an open mapping, without the key until set
                _translate(cfg, _path(role, f"distributed.fsdp_plan.{name}"), f"{fsdp}.mixed_precision.{name}",
                           turbo[f"distributed.fsdp_plan.{name}"], set_keys)
    if turbo.get("memory.recompute") and role != "actor_rollout_ref.ref":
        model = "actor_rollout_ref.model" if role == "actor_rollout_ref.actor" else "critic.model"
        if _set_by_user(set_keys, f"{model}.enable_gradient_checkpointing") and \
                not OmegaConf.select(cfg, f"{model}.enable_gradient_checkpointing"):
            notes.append(f"{_path(role, 'memory.recompute')}=true recomputes each layer in backward as verl's turbo "
                         f"engine does whatever {model}.enable_gradient_checkpointing says; that key is read as true")
        OmegaConf.update(cfg, f"{model}.enable_gradient_checkpointing", True)
        set_keys.append(f"{model}.enable_gradient_checkpointing")
    ep, efsdp = int(turbo["distributed.expert_parallel_size"]), int(turbo["distributed.expert_fully_shard_parallel_size"])
    if ep > 1 and efsdp != _world(cfg) // ep:
        # fsdp_turbo keeps world / (ep x efsdp) whole copies of each shard, kept equal by an all-reduce; the
        # engine shards over all of them: the same update, less memory
        notes.append(f"{_path(role, 'distributed.expert_fully_shard_parallel_size')}={efsdp}: each expert shard is "
                     f"FSDP-sharded over all {_world(cfg) // ep} ranks that hold it (the same update)")
    units = [_path(role, k) for k in _UNIT_KEYS if k in given]
    if units:
        notes.append(f"{', '.join(units)} change nothing: the engine makes each decoder layer and vision block an "
                     "FSDP2 unit, finds each layer's routed experts and checkpoints each layer itself (the units "
                     "move memory, not results)")
    return notes


def _fsdp_size(turbo: dict[str, Any], world: int) -> int:
    """The FSDP engine's fsdp_size for turbo's fully_shard_parallel_size: every rank (-1) when it is the world."""
    size = int(turbo["distributed.fully_shard_parallel_size"])
    return -1 if size == world else size
