"""verl's FSDP-Turbo engine (``strategy=fsdp_turbo``, ``fsdp_config.turbo_config.*``) on the FSDP2 engine: each turbo
key becomes the FSDP engine key doing the same, changes only which modules are units (warned), or is a start-up
error naming what is not built (config/fsdp_turbo.py)."""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from rlfoundry.trainer.config import ConfigError, NoEffectKeyWarning, load_config

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.ref"
AT, RT = f"{A}.fsdp_config.turbo_config", f"{R}.fsdp_config.turbo_config"
EIGHT = "trainer.n_gpus_per_node=8"  # eight ranks: micro-batches of one row divide every rank's share
MICRO = [f"{A}.ppo_micro_batch_size_per_gpu=1", f"{R}.log_prob_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"]
# verl's run_qwen3_5_35b_fsdp_turbo.sh on a GPU node (its turbo keys; the model and data keys left out)
LINE = [f"{A}.strategy=fsdp_turbo", f"{AT}.distributed.fully_shard_parallel_size=8",
        f"{AT}.distributed.expert_parallel_size=8", f"{AT}.distributed.ulysses_parallel_size=1",
        "+" + AT + ".distributed.fsdp_plan.apply_modules={model.language_model.layers.\\{*\\}:{},lm_head:{}}",
        f"+{AT}.distributed.fsdp_plan.hook_modules=['model.language_model.layers.{{*}}']",
        f"+{AT}.distributed.ep_plan.apply_modules=['model.language_model.layers.{{*}}.mlp.experts']",
        f"+{AT}.distributed.ep_plan.dispatcher=eager", f"+{AT}.memory.recompute=True",
        f"+{AT}.memory.recompute_plan=['model.language_model.layers.{{*}}']",
        f"{R}.strategy=fsdp_turbo", f"{RT}.distributed.fully_shard_parallel_size=8",
        f"{RT}.distributed.expert_parallel_size=8", f"+{RT}.distributed.ep_plan.dispatcher=eager",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.actor.use_kl_loss=True",
        EIGHT]
# the same run in the FSDP engine's own keys
FSDP = [f"{A}.fsdp_config.expert_parallel_size=8", f"{R}.fsdp_config.expert_parallel_size=8",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.use_kl_loss=True",
        EIGHT]


def _load(overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config([*MICRO, *overrides])
    return cfg, [str(w.message) for w in caught]


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config([*MICRO, f"{A}.strategy=fsdp_turbo", EIGHT, *overrides])
    return str(e.value)


def _without_turbo(cfg):
    plain = OmegaConf.to_container(cfg, resolve=True)
    for role in (plain["actor_rollout_ref"]["actor"], plain["actor_rollout_ref"]["ref"]):
        role["fsdp_config"]["turbo_config"] = {}
    return plain


def test_verls_turbo_line_is_the_fsdp_engines_run_in_its_own_keys():
    """The whole config a turbo line loads equals the one its FSDP-engine spelling loads (the turbo subtree aside):
    the run is that run. The recompute plan turns checkpointing on over the line's explicit false, said."""
    turbo, said = _load(LINE)
    plain, _ = _load(FSDP)
    assert (turbo.actor_rollout_ref.actor.strategy, turbo.actor_rollout_ref.ref.strategy) == ("fsdp", "fsdp")
    assert (turbo.actor_rollout_ref.actor.fsdp_config.expert_parallel_size, turbo.actor_rollout_ref.actor.fsdp_config.fsdp_size) == (8, -1)
    assert _without_turbo(turbo) == _without_turbo(plain)
    text = " ".join(said)
    assert "memory.recompute=true recomputes each layer" in text and "read as true" in text
    assert f"{AT}.distributed.fsdp_plan.apply_modules" in text and "change nothing" in text


def test_turbo_defaults_and_translations():
    """Not given: verl's defaults (one expert rank, one Ulysses rank); a fully_shard_parallel_size below the ranks is
    the FSDP engine's fsdp_size; a given param dtype is the engine's mixed precision; a ref on turbo, no recompute."""
    cfg, _ = _load([f"{A}.strategy=fsdp_turbo", f"{AT}.distributed.fully_shard_parallel_size=4",
                    f"+{AT}.distributed.fsdp_plan.param_dtype=fp32", f"+{AT}.distributed.fsdp_plan.output_dtype=fp32",
                    f"{AT}.distributed.ulysses_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true",
                    EIGHT])
    assert (cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size, cfg.actor_rollout_ref.actor.fsdp_config.expert_parallel_size) == (4, 1)
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False
    cfg, _ = _load([f"{A}.strategy=fsdp_turbo", f"{AT}.distributed.fully_shard_parallel_size=16",
                    "trainer.n_gpus_per_node=8", "trainer.nnodes=2"])
    assert cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size == -1  # every rank


@pytest.mark.parametrize("override, named", [
    (f"{AT}.distributed.tensor_parallel_size=2", "tensor parallelism on the FSDP2 engine is not built"),
    (f"+{AT}.distributed.ep_plan.dispatcher=fused", "fused dispatch kernels (NPU) are not built"),
    ("+" + AT + ".module_patches=[{target:a.b,replacement:c.d}]", "replacement model forwards are not built"),
    ("+" + AT + ".distributed.cp_plan.ulysses_function_patches=[{type:full_attention}]", "Ulysses function patches"),
    (f"+{AT}.distributed.fsdp_plan.num_to_forward_prefetch=2", "a deeper prefetch is not built"),
    (f"+{AT}.distributed.fsdp_plan.output_dtype=fp32", "output_dtype=fp32"),
    (f"+{AT}.distributed.fsdp_plan.param_dtype=fp12", "fsdp_plan.param_dtype: unknown dtype"),
    (f"+{AT}.distributed.no_such_plan=1", "turbo_config.distributed.no_such_plan (fsdp_turbo has no such key)"),
    (f"{AT}.distributed.expert_fully_shard_parallel_size=2", "without expert parallelism the experts shard"),
])
def test_turbo_values_not_built_are_start_up_errors_naming_them(override, named):
    text = _error(override)
    assert named in text and "docs/verl_keys.md" in text


def test_an_expert_shard_size_is_checked_against_the_ranks_and_turbo_keys_need_the_engine():
    assert "it must divide that number" in _error(f"{AT}.distributed.expert_parallel_size=2",
                                                   f"{AT}.distributed.expert_fully_shard_parallel_size=3")
    cfg, said = _load([f"{A}.strategy=fsdp_turbo", f"{AT}.distributed.expert_parallel_size=4",
                       f"{AT}.distributed.expert_fully_shard_parallel_size=1", EIGHT])
    assert cfg.actor_rollout_ref.actor.fsdp_config.expert_parallel_size == 4  # 2 copies of each shard in fsdp_turbo, sharded here
    assert any("FSDP-sharded over all 2 ranks that hold it" in s for s in said)
    with pytest.raises(ConfigError, match="strategy is not fsdp_turbo; they would do nothing"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config([f"{AT}.distributed.expert_parallel_size=2"])
    with pytest.raises(ConfigError, match="is not one of"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config([f"{A}.strategy=fsdp_tubro"])  # a typo stays a typo


def test_the_unit_keys_warn_as_accepted_without_effect():
    _, said = _load([f"{A}.strategy=fsdp_turbo", f"+{AT}.distributed.fsdp_plan.hook_modules=[x]",
                     EIGHT])
    assert any("hook_modules change nothing" in s for s in said)
    assert NoEffectKeyWarning  # the category the notes are raised under (checked by the harness's ignored keys)
