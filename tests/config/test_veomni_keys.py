"""verl's veomni engine (config/veomni.py): ``model_engine=veomni`` and ``strategy=veomni`` run the roles on
the FSDP2 engine, each ``*.veomni.*`` key reaches the FSDP engine key doing the same (resolved values),
two spellings of one setting must agree, and each value not built is a start-up error naming it."""

from __future__ import annotations

import warnings

import pytest

from rlfoundry.config.veomni import VEOMNI_BUILT
from rlfoundry.trainer.config import ConfigError, NoEffectKeyWarning, load_config, resolve_config

ACTOR, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"


def _load(*overrides: str, config_name: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(list(overrides), config_name)


def _resolved(*overrides: str):
    return resolve_config(_load(*overrides), steps_per_epoch=10, cuda_available=False)


def _error(*overrides: str, config_name: str | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        _load(*overrides, config_name=config_name)
    return str(e.value)


def _strategies(r) -> tuple:
    return r.actor_rollout_ref.actor.strategy, r.actor_rollout_ref.ref.strategy, r.critic.strategy


def test_model_engine_veomni_runs_every_role_on_the_fsdp_engine(tmp_path):
    assert _strategies(_resolved("model_engine=veomni")) == ("fsdp",) * 3
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ppo_trainer\n  - override model_engine: veomni\n  - _self_\n")
    assert _strategies(_load(config_name=str(tmp_path / "mine.yaml"))) == ("fsdp",) * 3
    # verl's VL script puts the reference on veomni by its strategy key
    assert _resolved(f"{REF}.strategy=veomni", f"{REF}.veomni.param_offload=true").actor_rollout_ref.ref.strategy == "fsdp"
    assert "model_engine=veomni but actor_rollout_ref.actor.strategy=megatron" in _error(
        "model_engine=veomni", config_name="ppo_megatron_trainer")


def test_each_veomni_key_reaches_the_fsdp_key_read():
    r = _resolved("model_engine=veomni", "actor_rollout_ref.model.use_remove_padding=true",
                  f"{ACTOR}.veomni.param_offload=true", f"{ACTOR}.veomni.optimizer_offload=true",
                  f"{ACTOR}.veomni.enable_full_shard=false", f"{ACTOR}.veomni.enable_fsdp_offload=true",
                  f"{ACTOR}.veomni.ulysses_parallel_size=2",
                  f"{ACTOR}.veomni.fsdp_size=2", f"{ACTOR}.veomni.mixed_precision=false",
                  "critic.veomni.param_offload=true", "critic.veomni.ulysses_parallel_size=2",
                  "trainer.n_gpus_per_node=2")
    actor, critic = r.actor_rollout_ref.actor, r.critic
    fsdp = actor.fsdp_config
    assert (fsdp.param_offload, fsdp.optimizer_offload, fsdp.reshard_after_forward, fsdp.offload_policy,
            fsdp.model_dtype) == (True, True, False, True, "bf16")
    assert actor.ulysses_sequence_parallel_size == 2
    # VeOmni shards over fsdp_size data-parallel ranks x the Ulysses group (its dp_shard_sp mesh)
    assert fsdp.fsdp_size == 4
    assert (critic.model.fsdp_config.param_offload, critic.ulysses_sequence_parallel_size) == (True, 2)
    assert critic.model.fsdp_config.optimizer_offload is False  # the critic's own keys: the actor's are not its


def test_the_reference_takes_the_actors_veomni_keys_unless_given_its_own():
    r = _resolved("model_engine=veomni", "actor_rollout_ref.model.use_remove_padding=true",
                  f"{ACTOR}.veomni.param_offload=true", f"{ACTOR}.veomni.ulysses_parallel_size=2",
                  f"{ACTOR}.veomni.optimizer_offload=true", "trainer.n_gpus_per_node=2")
    ref = r.actor_rollout_ref.ref
    # verl's ref/veomni_ref.yaml interpolates param_offload and the Ulysses size; not optimizer_offload
    assert (ref.fsdp_config.param_offload, ref.ulysses_sequence_parallel_size) == (True, 2)
    assert ref.fsdp_config.optimizer_offload is False
    r = _resolved("model_engine=veomni", f"{ACTOR}.veomni.param_offload=true", f"{REF}.veomni.param_offload=false")
    assert (r.actor_rollout_ref.actor.fsdp_config.param_offload, r.actor_rollout_ref.ref.fsdp_config.param_offload) \
        == (True, False)


def test_router_replay_mode_is_the_actors_router_replay():
    r = _resolved("model_engine=veomni", f"{ACTOR}.veomni.router_replay.mode=R2")
    assert r.actor_rollout_ref.actor.router_replay.mode == "R2"
    assert "the critic routes by its own router" in _error("model_engine=veomni", "critic.veomni.router_replay.mode=R2")


def test_two_spellings_of_one_setting_must_agree():
    for given, other in ((f"{ACTOR}.veomni.param_offload=true", f"{ACTOR}.fsdp_config.param_offload=false"),
                         (f"{ACTOR}.veomni.enable_full_shard=false", f"{ACTOR}.fsdp_config.reshard_after_forward=true"),
                         (f"{ACTOR}.veomni.ulysses_parallel_size=2", f"{ACTOR}.ulysses_sequence_parallel_size=4"),
                         (f"{ACTOR}.veomni.router_replay.mode=R2", f"{ACTOR}.router_replay.mode=R3"),
                         (f"{ACTOR}.veomni.fsdp_size=2", f"{ACTOR}.fsdp_config.fsdp_size=8")):
        message = _error("model_engine=veomni", given, other)
        assert "were given different values" in message and given.split("=")[0] in message
    # the same value both ways is one setting given twice
    r = _resolved("model_engine=veomni", f"{ACTOR}.veomni.param_offload=true", f"{ACTOR}.fsdp_config.param_offload=true")
    assert r.actor_rollout_ref.actor.fsdp_config.param_offload is True


@pytest.mark.parametrize(("key", "value"), [
    ("attn_implementation", "eager"), ("attn_implementation", "flash_attention_3"),
    ("moe_implementation", "eager"), ("cross_entropy_loss_implementation", "npu"),
    ("rms_norm_implementation", "liger_kernel"), ("chunk_gated_delta_rule_implementation", "fla"),
    ("dsa_indexer_implementation", "tilelang"), ("dsa_attention_implementation", "tilelang"),
    ("mhc_implementation", "tilelang"), ("load_balancing_loss_implementation", "triton"),
    ("full_determinism", "true"), ("init_device", "cpu"), ("use_torch_compile", "true"), ("enable_reentrant", "true"),
    ("pad_to_length", "true"), ("basic_modules", "[Qwen2MLP]"), ("load_checkpoint_path", "/ckpt"),
])
def test_what_is_not_built_is_a_start_up_error_naming_it(key, value):
    message = _error("model_engine=veomni", f"{ACTOR}.veomni.{key}={value}")
    assert f"{ACTOR}.veomni.{key}=" in message and "not build" in message
    assert key in VEOMNI_BUILT


def test_the_references_inherited_unbuilt_value_is_named_for_it_too():
    message = _error("model_engine=veomni", f"{ACTOR}.veomni.attn_implementation=eager")
    assert f"{ACTOR}.veomni.attn_implementation=eager" in message and f"{REF}.veomni.attn_implementation=eager" in message


# eight ranks: a mini-batch the default micro-batch of 32 rows divides on each
BATCH = ("data.train_batch_size=32", f"{ACTOR}.ppo_mini_batch_size=32")


def test_expert_parallel_size_is_the_fsdp_engines_and_the_reference_takes_the_actors():
    r = _resolved("model_engine=veomni", "trainer.n_gpus_per_node=8", *BATCH, f"{ACTOR}.veomni.expert_parallel_size=8")
    assert r.actor_rollout_ref.actor.fsdp_config.expert_parallel_size == 8
    assert r.actor_rollout_ref.ref.fsdp_config.expert_parallel_size == 8
    own = _resolved("model_engine=veomni", "trainer.n_gpus_per_node=8", *BATCH, f"{ACTOR}.veomni.expert_parallel_size=8",
                    f"{REF}.veomni.expert_parallel_size=4")
    assert own.actor_rollout_ref.ref.fsdp_config.expert_parallel_size == 4
    message = _error("model_engine=veomni", f"{ACTOR}.veomni.expert_parallel_size=8",
                     f"{ACTOR}.fsdp_config.expert_parallel_size=4")
    assert "were given different values" in message


@pytest.mark.parametrize(("key", "value"), [
    ("attn_implementation", "flash_attention_2"), ("attn_implementation", "veomni_flash_attention_2_with_sp"),
    ("moe_implementation", "fused"), ("moe_implementation", "fused_triton"), ("expert_parallel_size", "1"),
])
def test_values_the_fsdp_engine_runs_are_accepted_without_a_no_effect_warning(key, value):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(["model_engine=veomni", f"{ACTOR}.veomni.{key}={value}"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]


def test_keys_that_change_nothing_here_are_named_in_the_no_effect_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(["model_engine=veomni", f"{ACTOR}.veomni.cross_entropy_loss_implementation=liger_kernel",
                           f"{ACTOR}.veomni.seed=7", f"{ACTOR}.veomni.forward_prefetch=true"])
    text = " ".join(str(w.message) for w in caught if issubclass(w.category, NoEffectKeyWarning))
    for key in ("cross_entropy_loss_implementation", "seed", "forward_prefetch"):
        assert f"{ACTOR}.veomni.{key}" in text
    # VeOmni's forward_prefetch (default true) is not the FSDP engine's explicit prefetch: that stays as set
    assert cfg.actor_rollout_ref.actor.fsdp_config.forward_prefetch is False


def test_veomni_keys_on_a_role_on_another_engine_are_an_error():
    message = _error(f"{ACTOR}.veomni.param_offload=true")
    assert f"{ACTOR}.veomni.param_offload" in message and "model_engine=veomni" in message
    assert "critic.veomni.param_offload" in _error("model_engine=megatron", "critic.veomni.param_offload=true")


def test_an_unknown_veomni_key_is_refused():
    assert "veomni" in _error("model_engine=veomni", f"{ACTOR}.veomni.param_ofload=true")


def test_the_actors_pad_to_length_is_its_veomni_key():
    # verl's veomni actor spells veomni.pad_to_length one level up (DeepSeek-V4's script sets it): not built
    message = _error("model_engine=veomni", f"{ACTOR}.pad_to_length=true")
    assert f"{ACTOR}.veomni.pad_to_length=True" in message and f"{REF}.veomni.pad_to_length=True" in message
    assert f"{ACTOR}.pad_to_length" in _error(f"{ACTOR}.pad_to_length=true")  # not on veomni: nothing reads it


def test_a_grpo_step_with_model_engine_veomni_runs_on_the_fsdp_engine_with_the_mapped_settings(tiny_model_dir, tmp_path):
    from rlfoundry.engines.fsdp.engine import FSDPEngine
    from tests.trainer import _e2e as E

    run = E.train(E.tiny_overrides(tiny_model_dir, tmp_path / "run", "model_engine=veomni", "trainer.total_training_steps=1",
                                   "actor_rollout_ref.actor.use_kl_loss=true", f"{ACTOR}.veomni.enable_full_shard=false",
                                   f"{ACTOR}.veomni.moe_implementation=fused"),
                  keep_trainer=True)
    worker = next(iter(run.trainer.actor_rollout_wg.worker.workers.values()))
    actor, ref = worker.actor.engine, worker.ref_policy.engine
    assert isinstance(actor, FSDPEngine) and isinstance(ref, FSDPEngine)
    assert actor.config.fsdp.reshard_after_forward is False
    assert ref.config.fsdp.reshard_after_forward is True  # enable_full_shard is not among the keys the ref follows
    assert "actor/pg_loss" in run.step(1) and "actor/kl_loss" in run.step(1)  # the update and the reference ran


def test_expert_parallel_layouts_that_cannot_run_are_start_up_errors(tiny_moe_dir):
    """The FSDP plug-in's layout checks at load (the engine checks the built model again): the ranks, the
    model's 8 experts (its config.json) and LoRA, each named with the key."""
    model = f"actor_rollout_ref.model.path={tiny_moe_dir}"
    key = f"{ACTOR}.fsdp_config.expert_parallel_size"
    assert "does not divide the 2 ranks" in _error(model, "trainer.n_gpus_per_node=2", f"{key}=4")
    assert "does not divide the model's 8 experts" in _error(model, "trainer.n_gpus_per_node=3",
                                                             f"{ACTOR}.veomni.expert_parallel_size=3",
                                                             "model_engine=veomni")
    assert "LoRA" in _error(model, "trainer.n_gpus_per_node=2", f"{key}=2", "actor_rollout_ref.model.lora_rank=8")
    _load(model, "trainer.n_gpus_per_node=4", *BATCH, f"{key}=2")  # a layout it takes
