"""``--config-name`` / ``--config-path`` and a YAML's ``defaults:`` list, as Hydra resolves them
(``rlfoundry/config/compose.py``), verl's config names and engine group, and verl's async entry
modules' keys (``rlfoundry/experimental``)."""

from __future__ import annotations

import warnings

import pytest

from rlfoundry.config.verl_compat import NoEffectKeyWarning
from rlfoundry.trainer.config import ConfigError, load_config, resolve_config
from tests.trainer import _e2e as E

ASYNC = ["trainer.worker_backend=process"]  # two pools: the in-process back end cannot hold them


def _strategies(cfg) -> tuple[str, str, str]:
    return cfg.actor_rollout_ref.actor.strategy, cfg.actor_rollout_ref.ref.strategy, cfg.critic.strategy


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ───────────────────────────── lookup: suffix, relative path, fallback ─────────────────────────────


def test_a_name_with_or_without_yaml_is_the_same_config():
    with_suffix = load_config([], config_name="ppo_megatron_trainer.yaml", config_path="config")
    without = load_config([], config_name="ppo_megatron_trainer")
    assert _strategies(with_suffix) == _strategies(without) == ("megatron", "megatron", "megatron")


def test_config_path_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    _write(tmp_path / "work" / "conf" / "mine.yaml", "data:\n  train_batch_size: 8\n")
    monkeypatch.chdir(tmp_path / "work")
    assert load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=8"], "mine", "conf").data.train_batch_size == 8
    monkeypatch.chdir(tmp_path)  # from elsewhere the same relative path is not there
    with pytest.raises(ConfigError, match="no such directory"):
        load_config([], "mine", "conf")


def test_a_missing_user_directory_falls_back_to_the_packaged_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # verl's scripts pass verl's own `config` dir, absent here
    cfg = load_config([], config_name="ppo_megatron_trainer.yaml", config_path="recipe/dapo/config")
    assert _strategies(cfg) == ("megatron",) * 3


def test_the_users_file_wins_over_the_packaged_one_of_that_name(tmp_path):
    _write(tmp_path / "ppo_megatron_trainer.yaml", "data:\n  train_batch_size: 16\n")
    cfg = load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=8"], "ppo_megatron_trainer", str(tmp_path))
    assert cfg.data.train_batch_size == 16 and cfg.actor_rollout_ref.actor.strategy == "fsdp"


def test_verls_own_trainer_config_directory_is_stood_in_for_by_the_packaged_configs(tmp_path):
    # verl's dir holds its full defaults (hundreds of keys composed from group files); ours replace them
    _write(tmp_path / "_generated_ppo_trainer.yaml", "{}\n")
    _write(tmp_path / "ppo_megatron_trainer.yaml", "defaults:\n  - actor@actor_rollout_ref.actor: megatron_actor\n"
                                                   "verl_only_key: 1\n")
    assert _strategies(load_config([], "ppo_megatron_trainer", str(tmp_path))) == ("megatron",) * 3


# ───────────────────────────── the defaults list ─────────────────────────────


def test_a_defaults_list_is_composed_not_ignored(tmp_path):
    # before: the overlay's defaults were dropped and this ran with strategy fsdp
    _write(tmp_path / "mine.yaml", "defaults:\n  - ppo_megatron_trainer\n  - _self_\ndata:\n  train_batch_size: 32\n")
    cfg = load_config([], "mine", str(tmp_path))
    assert _strategies(cfg) == ("megatron",) * 3 and cfg.data.train_batch_size == 32


@pytest.mark.parametrize(("defaults", "want"), [
    ("[base, _self_]", 16),  # the file's own keys over its defaults
    ("[_self_, base]", 32),  # its defaults over its own keys
    ("[base]", 16),  # no _self_: at the end (Hydra 1.1)
])
def test_self_places_the_files_own_keys(tmp_path, defaults, want):
    _write(tmp_path / "base.yaml", "defaults: [ppo_trainer, _self_]\ndata:\n  train_batch_size: 32\n")
    _write(tmp_path / "mine.yaml", f"defaults: {defaults}\ndata:\n  train_batch_size: 16\n")
    assert load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=16"], "mine.yaml", str(tmp_path)) \
        .data.train_batch_size == want


def test_verls_dataclass_targets_in_a_users_file_are_the_schema_here(tmp_path):
    # verl's recipe configs (qat's dapo_qat_trainer.yaml) name the dataclass a group instantiates into
    _write(tmp_path / "mine.yaml", "defaults: [dapo_trainer, _self_]\nalgorithm:\n  filter_groups:\n"
                                   "    _target_: verl.trainer.config.FilterGroupsConfig\n    enable: true\n"
                                   "    metric: acc\n")
    cfg = load_config([], "mine", str(tmp_path))
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc"
    _write(tmp_path / "other.yaml", "algorithm:\n  filter_groups:\n    _target_: mine.Groups\n")
    with pytest.raises(ConfigError, match="algorithm.filter_groups._target_"):  # not verl's: no silent drop
        load_config([], "other", str(tmp_path))


def test_group_entries_resolve_in_the_users_directory_then_as_verls_components(tmp_path):
    _write(tmp_path / "optim" / "fast.yaml", "lr: 0.25\n")
    _write(tmp_path / "mine.yaml", "defaults:\n  - actor@actor_rollout_ref.actor: megatron_actor\n"
                                   "  - optim@actor_rollout_ref.actor.optim: fast\n  - _self_\n")
    cfg = load_config([], "mine", str(tmp_path))
    assert cfg.actor_rollout_ref.actor.strategy == "megatron" and cfg.actor_rollout_ref.actor.optim.lr == 0.25


def test_an_override_entry_replaces_the_earlier_choice(tmp_path):
    _write(tmp_path / "mine.yaml", "defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\n"
                                   "  - override actor@actor_rollout_ref.actor: megatron_actor\n")
    assert load_config([], "mine", str(tmp_path)).actor_rollout_ref.actor.strategy == "megatron"


def test_an_entry_that_resolves_nowhere_is_an_error_naming_file_entry_and_choices(tmp_path):
    path = _write(tmp_path / "mine.yaml", "defaults:\n  - ppo_megatorn_trainer\n  - _self_\n")
    with pytest.raises(ConfigError) as e:
        load_config([], "mine", str(tmp_path))
    assert str(path) in str(e.value) and "ppo_megatorn_trainer" in str(e.value) and "ppo_megatron_trainer" in str(e.value)
    _write(tmp_path / "grp.yaml", "defaults:\n  - actor@actor_rollout_ref.actor: fancy_actor\n")
    with pytest.raises(ConfigError, match="fancy_actor.*dp_actor"):
        load_config([], "grp", str(tmp_path))


def test_an_optional_entry_that_does_not_exist_adds_nothing(tmp_path):
    _write(tmp_path / "mine.yaml", "defaults:\n  - optional local_settings\n  - _self_\n")
    assert load_config([], "mine", str(tmp_path)).data.train_batch_size == load_config([]).data.train_batch_size


# ───────────────────────────── verl's engine group ─────────────────────────────


@pytest.mark.parametrize(("engine", "want"), [("megatron", "megatron"), ("dp", "fsdp"), ("fsdp", "fsdp"),
                                              ("veomni", "fsdp")])
def test_model_engine_picks_the_strategy(engine, want):
    assert _strategies(load_config([f"model_engine={engine}"])) == (want,) * 3


def test_model_engine_in_a_defaults_list(tmp_path):
    _write(tmp_path / "mine.yaml", "defaults:\n  - ppo_trainer\n  - override model_engine: megatron\n  - _self_\n")
    assert _strategies(load_config([], "mine", str(tmp_path))) == ("megatron",) * 3


def test_engines_not_built_and_contradictions_are_errors():
    with pytest.raises(ConfigError, match="torchtitan"):
        load_config(["model_engine=torchtitan"])
    with pytest.raises(ConfigError, match="model_engine=dp but actor_rollout_ref.actor.strategy=megatron"):
        load_config(["model_engine=dp"], config_name="ppo_megatron_trainer")
    # fsdp_turbo runs on the FSDP2 engine (config/fsdp_turbo.py): with model_engine=megatron a contradiction too
    with pytest.raises(ConfigError, match="model_engine=megatron but actor_rollout_ref.actor.strategy=fsdp_turbo"):
        load_config(["model_engine=megatron", "actor_rollout_ref.actor.strategy=fsdp_turbo"])
    assert _strategies(load_config(["model_engine=dp", "actor_rollout_ref.actor.strategy=fsdp_turbo"]))[0] == "fsdp"


# ───────────────────────────── verl's config names ─────────────────────────────


@pytest.mark.parametrize(("name", "strategy", "mode"), [
    ("ppo_trainer", "fsdp", "sync"), ("ppo_megatron_trainer", "megatron", "sync"),
    ("one_step_off_ppo_trainer", "fsdp", "one_step_off"), ("one_step_off_ppo_megatron_trainer", "megatron", "one_step_off"),
    ("fully_async_ppo_trainer", "fsdp", "fully_async"), ("fully_async_ppo_megatron_trainer", "megatron", "fully_async"),
    ("fully_async_dapo_trainer", "fsdp", "fully_async"), ("dapo_trainer", "fsdp", "sync"),
    ("dapo_megatron_trainer", "megatron", "sync"), ("gsm8k_multiturn_grpo", "fsdp", "sync"),
    ("gsm8k_multiturn_megatron_grpo", "megatron", "sync"), ("entropy_trainer", "fsdp", "sync"),
    ("flowrl_trainer", "fsdp", "sync"),
    ("gvpo_trainer", "fsdp", "sync"),
    ("spin_trainer", "fsdp", "sync"),
    ("spo_trainer", "fsdp", "sync"),
])
def test_verls_config_names_are_packaged(name, strategy, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(ASYNC if mode != "sync" else [], config_name=f"{name}.yaml", config_path="config")
    assert (cfg.actor_rollout_ref.actor.strategy, cfg.async_training.mode) == (strategy, mode)
    if "dapo" in name or name in ("entropy_trainer", "flowrl_trainer"):
        assert cfg.reward_model.reward_manager == "dapo"


# ───────────────────────────── verl's async entry modules' keys ─────────────────────────────


def test_january_rollout_epochs_and_test_freq_in_syncs():
    from rlfoundry.experimental.fully_async_policy.fully_async_main import verl_spellings

    base = [*ASYNC, "async_training.mode=fully_async", "async_training.trigger_parameter_sync_step=4"]
    cfg = load_config([*base, "rollout.total_epochs=3", "rollout.test_freq=2"], "fully_async_ppo_trainer")
    assert (cfg.trainer.total_epochs, cfg.trainer.test_freq) == (3, 8)  # 2 syncs x 4 steps
    # August's fully-async main spells the same period trainer.test_freq
    cfg = load_config([*base, *verl_spellings(["trainer.test_freq=2"])], "fully_async_ppo_trainer")
    assert cfg.trainer.test_freq == 8
    with pytest.raises(ConfigError, match="rollout.total_epochs=3.*disagree"):
        load_config([*base, "rollout.total_epochs=3", "trainer.total_epochs=2"], "fully_async_ppo_trainer")


def test_verls_async_use_rollout_log_probs_is_the_actors_for_any_sync_period():
    """verl (January: async_training.use_rollout_log_probs, interpolated into the actor's key; August: the
    actor's key) takes the rollout's log-probs as the old log-probs whatever trigger_parameter_sync_step is
    (its period-start weights are only for compute_prox_log_prob)."""
    base = [*ASYNC, "async_training.use_rollout_log_probs=true", "actor_rollout_ref.rollout.name=vllm"]
    for period in (1, 4):
        with pytest.warns(NoEffectKeyWarning, match="rollout_correction.*has no effect"):  # the overlay's token IS
            cfg = load_config([*base, f"async_training.trigger_parameter_sync_step={period}"], "fully_async_ppo_trainer")
        resolved = resolve_config(cfg, steps_per_epoch=4, cuda_available=False)
        assert resolved.actor_rollout_ref.actor.use_rollout_log_probs is True
        assert resolved.actor_rollout_ref.rollout.calculate_log_probs is True  # the engine must return them
    off = load_config([*ASYNC, "async_training.use_rollout_log_probs=false"], "fully_async_ppo_trainer")
    assert resolve_config(off, steps_per_epoch=4, cuda_available=False).actor_rollout_ref.actor.use_rollout_log_probs \
        is False
    with pytest.raises(ConfigError, match="async_training.use_rollout_log_probs=True.*disagree"):
        load_config([*base, "actor_rollout_ref.actor.use_rollout_log_probs=false"], "fully_async_ppo_trainer")
    with pytest.warns(UserWarning, match="renormalised over the kept tokens"):  # vLLM's filtered log-probs
        load_config([*base, "actor_rollout_ref.rollout.top_p=0.9"], "fully_async_ppo_trainer")
    with pytest.raises(ConfigError, match="FIRE's temperature"):  # not the sampling policy's log-probs
        load_config([*base, "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.use_fire_sampling=true"],
                    "fully_async_ppo_trainer")


def test_verls_compute_prox_log_prob_loads_where_verl_reads_it():
    """Fully async with the rollout's log-probs: it loads, and the overlay's rollout_correction is no longer
    without effect (the old log-probs are the trainer's again, the rollout's the behaviour policy's).
    Without them verl ignores the key: a no-effect warning. One-step-off has no such key in verl: an error."""
    prox = "async_training.compute_prox_log_prob=true"
    base = [*ASYNC, "async_training.use_rollout_log_probs=true", "async_training.trigger_parameter_sync_step=2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoEffectKeyWarning)
        cfg = load_config([*base, prox], "fully_async_ppo_trainer")
    resolved = resolve_config(cfg, steps_per_epoch=4, cuda_available=False)
    assert resolved.async_training.compute_prox_log_prob is True
    assert resolved.actor_rollout_ref.actor.use_rollout_log_probs is True
    assert resolved.actor_rollout_ref.rollout.calculate_log_probs is True  # the behaviour policy's, for the IS
    load_config([*base, prox, "actor_rollout_ref.actor.calculate_sum_pi_squared=true"],  # the actor's pass runs
                "fully_async_ppo_trainer")
    with pytest.raises(ConfigError, match="calculate_sum_pi_squared=true needs the actor's log-prob pass"):
        load_config([*base, "actor_rollout_ref.actor.calculate_sum_pi_squared=true"], "fully_async_ppo_trainer")
    with pytest.warns(NoEffectKeyWarning, match="compute_prox_log_prob=true has no effect.*use_rollout_log_probs is off"):
        load_config([*ASYNC, prox], "fully_async_ppo_trainer")
    with pytest.raises(ConfigError, match="compute_prox_log_prob=true is the fully-async pipeline's.*one_step_off"):
        load_config([*ASYNC, prox, "async_training.use_rollout_log_probs=true"], "one_step_off_ppo_trainer")


def test_the_entry_modules_fix_their_pipeline_and_print_it(capsys):
    from omegaconf import OmegaConf

    from rlfoundry.experimental.fully_async_policy.fully_async_main import ENTRY as FULLY
    from rlfoundry.experimental.one_step_off_policy.main_ppo import ENTRY as ONE_STEP
    from rlfoundry.trainer.main_ppo import run

    for entry, argv, mode, strategy in ((ONE_STEP, [], "one_step_off", "fsdp"),
                                        (FULLY, ["--config-name", "fully_async_ppo_megatron_trainer.yaml"],
                                         "fully_async", "megatron"),
                                        (ONE_STEP, ["--config-name", "ppo_trainer"], "one_step_off", "fsdp")):
        assert run([*argv, *ASYNC, "rollout.n_gpus_per_node=1", "--cfg", "job"], entry) == {}
        printed = OmegaConf.create(capsys.readouterr().out)
        assert (printed.async_training.mode, printed.actor_rollout_ref.actor.strategy) == (mode, strategy)


def test_the_recipe_entries_run_their_recipes_configs(capsys):
    from omegaconf import OmegaConf

    from rlfoundry.recipe.dapo.main_dapo import ENTRY as DAPO
    from rlfoundry.recipe.entropy.main_entropy import ENTRY as ENTROPY
    from rlfoundry.recipe.flowrl.main_flowrl import ENTRY as FLOWRL
    from rlfoundry.trainer.main_ppo import run

    for entry, argv, project, strategy in ((DAPO, [], "verl-dapo", "fsdp"),
                                           (DAPO, ["--config-name", "dapo_megatron_trainer.yaml"], "verl-dapo", "megatron"),
                                           (ENTROPY, ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"],
                                            "verl-entropy", "fsdp"), (FLOWRL, [], "verl-flowrl", "fsdp")):
        assert run([*argv, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "--cfg", "job"],
                   entry) == {}
        printed = OmegaConf.create(capsys.readouterr().out)
        assert printed.reward_model.reward_manager == "dapo" and printed.algorithm.filter_groups.enable
        assert (printed.trainer.project_name, printed.actor_rollout_ref.actor.strategy) == (project, strategy)
    from rlfoundry.recipe.gvpo.gvpo_main_ppo import ENTRY as GVPO

    assert run(["actor_rollout_ref.actor.policy_loss.loss_mode=gvpo", "actor_rollout_ref.actor.gvpo_beta=0.2",
                "--cfg", "job"], GVPO) == {}
    printed = OmegaConf.create(capsys.readouterr().out)
    assert (printed.trainer.project_name, printed.actor_rollout_ref.actor.gvpo_beta) == ("gvpo", 0.2)
    from rlfoundry.recipe.spo.spo_main_ppo import ENTRY as SPO

    # verl's SPO script's keys (METHOD=SPO): typed with verl's defaults for those it leaves
    assert run(["trainer.spo.enable=True", "trainer.spo.rho.type=constant", "+data.gen_batch_size=8",
                "trainer.debug=False", "--cfg", "job"], SPO) == {}
    printed = OmegaConf.create(capsys.readouterr().out)
    assert (printed.trainer.project_name, printed.trainer.spo.enable, printed.trainer.spo.rho.type) == ("spo", True, "constant")
    assert (printed.trainer.spo.offline_N, printed.trainer.spo.rho.clip_lower, printed.data.gen_batch_size) == (8, 0.875, 8)


# ───────────────────────────── one real step ─────────────────────────────


def test_a_user_config_over_ppo_trainer_trains_one_step(tiny_model_dir, tmp_path):
    # verl's recipe shape: defaults [ppo_trainer, _self_] plus the recipe's keys; the file's rollout.n reaches the run
    path = _write(tmp_path / "recipe" / "mine.yaml",
                  "defaults:\n  - ppo_trainer\n  - _self_\nactor_rollout_ref:\n  rollout:\n    n: 2\n")
    overrides = [o for o in E.tiny_overrides(tiny_model_dir, tmp_path / "run", "trainer.total_training_steps=1")
                 if o != "actor_rollout_ref.rollout.n=4"]
    run = E.train(overrides, config_name=str(path))
    assert len(run.batches) == 1
    assert run.batches[0]["responses"].shape[0] == 2 * 2  # 2 prompts x the file's n=2 (the default is 4+)


def test_the_entry_modules_import_no_torch():
    # they are __main__ of async runs, whose reward-pool processes re-import the main module
    import subprocess
    import sys

    code = ("import sys, rlfoundry.experimental.one_step_off_policy.main_ppo, "
            "rlfoundry.experimental.fully_async_policy.fully_async_main, rlfoundry.recipe.dapo.main_dapo, "
            "rlfoundry.recipe.entropy.main_entropy, rlfoundry.recipe.sppo.main_sppo, "
            "rlfoundry.recipe.flowrl.main_flowrl, rlfoundry.recipe.gvpo.gvpo_main_ppo, rlfoundry.recipe.spo.spo_main_ppo; "
            "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]; "
            "sys.exit(f'imported at module level: {heavy}' if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=E.subprocess_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_an_override_to_dp_over_a_megatron_config_takes_effect(tmp_path):
    # verl's dp_* components are the FSDP engine: overriding a Megatron file's roles back to them is not a no-op
    _write(tmp_path / "mine.yaml", "defaults:\n  - ppo_megatron_trainer\n"
                                   "  - override actor@actor_rollout_ref.actor: dp_actor\n  - _self_\n")
    assert load_config([], "mine", str(tmp_path)).actor_rollout_ref.actor.strategy == "fsdp"


def test_verls_sft_engine_layout_composes(tmp_path):
    from rlfoundry.trainer.sft_trainer import load_sft_config

    _write(tmp_path / "sft.yaml", "defaults:\n  - model@model: hf_model\n  - engine@engine: fsdp\n"
                                  "  - optim@optim: fsdp\n  - profiler@profiler: profiler\n  - _self_\n"
                                  "model:\n  path: /m\n")
    assert load_sft_config([], "sft", str(tmp_path)).model.partial_pretrain == "/m"
