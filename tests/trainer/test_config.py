"""Config loading, validation and resolution (rlfoundry.trainer.config): every user-facing error
names the key (and the closest key / the numbers), verl command lines parse, resolution is exact."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlfoundry.config import schema, typed
from rlfoundry.config.schema import PPOConfig
from rlfoundry.trainer.config import (
    CONFIG_DIR,
    ConfigError,
    NoEffectKeyWarning,
    ReplacedKeyWarning,
    check_startup_paths,
    load_config,
    resolve_config,
    schema_keys,
    validate_config,
)


def _load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(list(overrides))


# ───────────────────────────── the schema is the defaults ─────────────────────────────


def test_the_schema_is_the_only_source_of_defaults():
    # overlays sit on the schema; verl's name for its defaults file is packaged and sets nothing
    assert OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml")) == {}
    plain = OmegaConf.to_container(OmegaConf.structured(PPOConfig), resolve=True)  # no links applied
    assert OmegaConf.to_container(_load(), resolve=True) == OmegaConf.to_container(
        typed.structured(PPOConfig), resolve=True)
    # a linked default's own value (what a subtree used alone gets) is what the link gives under the
    # defaults, except the tokenizer paths, which alone are null: the model's own tokenizer
    linked = OmegaConf.to_container(_load(), resolve=True)
    links = {k for k, info in schema_keys().items() if info.follows}
    assert len(links) == 25  # the 25th: ref.pad_to_length follows the actor's (verl's veomni_ref.yaml)
    differ = {k for k in links if OmegaConf.select(OmegaConf.create(plain), k) != OmegaConf.select(OmegaConf.create(linked), k)}
    assert differ == {"critic.model.tokenizer_path", "reward_model.model.input_tokenizer"}
    assert all(info.follows in schema_keys() for info in schema_keys().values() if info.follows)


def test_a_linked_default_follows_its_key_until_set_itself():
    cfg = _load("actor_rollout_ref.actor.ppo_epochs=3", "data.max_response_length=8", "critic.shuffle=true")
    assert cfg.critic.ppo_epochs == 3 and cfg.actor_rollout_ref.rollout.response_length == 8
    assert cfg.critic.shuffle is True and cfg.actor_rollout_ref.actor.shuffle is False


def test_choice_lists_are_those_the_code_implements():
    from rlfoundry.algos import core_algos
    from rlfoundry.single_controller import factory, process

    assert schema.LOSS_AGG_MODES == core_algos.AGG_LOSS_MODES
    base = set(core_algos._KL_ESTIMATORS)  # "+": value of the estimator, gradient of k2; full: a clear NotImplementedError
    assert set(schema.KL_ESTIMATORS) == base | {k + "+" for k in base} | {"full"}
    assert process.START_METHODS is schema.START_METHODS
    assert factory.WORKER_BACKENDS is schema.WORKER_BACKENDS
    assert set(schema.ROLLOUT_NAMES) == {"hf", "vllm", "sglang"}  # every engine with an adapter
    choices = {k: info.choices for k, info in schema_keys().items() if info.choices}
    assert choices["critic.optim.warmup_style"] == ("constant", "cosine")
    # megatron: engines/megatron (the critic's value head on the last pipeline stage); veomni and fsdp_turbo: verl's
    # VeOmni and FSDP-Turbo engines, which the config layer turns into the FSDP engine key by key (config/veomni.py,
    # config/fsdp_turbo.py)
    assert choices["actor_rollout_ref.ref.strategy"] == choices["critic.strategy"] == ("fsdp", "fsdp2", "megatron",
                                                                                      "veomni", "fsdp_turbo")
    from rlfoundry.config.training_engines import TRAINING_ENGINES
    assert not {"veomni", "fsdp_turbo"} & set(TRAINING_ENGINES)  # no such engines: the strategies never reach workers


def test_defaults_are_the_demo_run():
    cfg = _load()
    assert cfg.data.train_files is None and cfg.data.synthetic.task == "arithmetic"
    assert cfg.actor_rollout_ref.model.path == "rlfoundry://arithmetic-policy"
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.trainer.device == "auto"
    r = resolve_config(cfg, steps_per_epoch=40, cuda_available=False)
    assert r.algorithm.adv_estimator == "grpo" and r.critic.enable is False
    assert r.trainer.device == "cpu" and r.trainer.worker_backend == "local"
    assert r.actor_rollout_ref.model.path.endswith("rlfoundry/assets/arithmetic-policy")


# ───────────────────────────── overrides ─────────────────────────────


def test_overrides_are_typed_like_verl_users_type_them():
    cfg = _load(
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "trainer.logger=['console','wandb']",
        "+actor_rollout_ref.model.override_config.attention_dropout=0.1",
        "data.max_response_length=32",
        "trainer.total_training_steps=null",
        "data.truncation='left'",
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.actor_rollout_ref.model.override_config.attention_dropout == 0.1
    assert cfg.trainer.total_training_steps is None and cfg.data.truncation == "left"
    # interpolated defaults follow the override (rollout.response_length: ${data.max_response_length})
    assert cfg.actor_rollout_ref.rollout.response_length == 32


def test_logger_may_be_a_single_name():
    r = resolve_config(_load("trainer.logger=console"), steps_per_epoch=1, cuda_available=False)
    assert list(r.trainer.logger) == ["console"]


def test_unexpanded_tilde_path_is_kept_as_a_string():
    cfg = _load("data.train_files=~/data/gsm8k/train.parquet")
    assert cfg.data.train_files == "~/data/gsm8k/train.parquet"


# ───────────────────────────── errors that name the key ─────────────────────────────


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(ConfigError) as e:
        load_config(["data.train_batch_size=abc"])
    msg = str(e.value)
    assert "data.train_batch_size" in msg and "'abc'" in msg and "integer" in msg


@pytest.mark.parametrize(
    "override, closest",
    [
        ("actor_rollout_ref.actor.ppo_mini_batchsize=4", "actor_rollout_ref.actor.ppo_mini_batch_size"),
        ("actor_rollout_ref.rollout.temprature=0.7", "actor_rollout_ref.rollout.temperature"),
        ("algorithm.kl_ctrl.kl_coeff=0.01", "algorithm.kl_ctrl.kl_coef"),
        ("trainer.total_epoch=3", "trainer.total_epochs"),
    ],
)
def test_unknown_key_names_the_closest_valid_key(override, closest):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert override.split("=")[0] in str(e.value)
    assert f"Did you mean '{closest}'" in str(e.value)


def test_plus_cannot_add_keys_outside_open_dicts():
    with pytest.raises(ConfigError, match="Unknown config key 'trainer.my_flag'"):
        load_config(["+trainer.my_flag=1"])


def test_bad_choice_is_named_with_the_options():
    with pytest.raises(ConfigError, match=r"trainer.resume_mode='autoo'.*did you mean 'auto'"):
        load_config(["trainer.resume_mode=autoo"])


def test_cpu_kernels_is_checked_with_its_options():
    with pytest.raises(ConfigError, match=r"critic.model.cpu_kernels='fast' is not one of \['auto', 'off'\]"):
        validate_config(load_config(["critic.model.cpu_kernels=fast"]))
    assert load_config(["actor_rollout_ref.model.cpu_kernels=off"]).actor_rollout_ref.model.cpu_kernels == "off"


@pytest.mark.parametrize("old, new", [
    ("actor_rollout_ref.model.cpu_linear=aten", "actor_rollout_ref.model.cpu_kernels=off"),
    ("critic.model.cpu_linear=aten", "critic.model.cpu_kernels=off"),
    ("actor_rollout_ref.model.fused_forward=false", "actor_rollout_ref.model.cpu_kernels=off"),
    ("actor_rollout_ref.rollout.fused_decode=false", "actor_rollout_ref.model.cpu_kernels=off"),
])
def test_a_replaced_key_turning_one_speed_up_off_is_an_error_naming_cpu_kernels(old, new):
    # cpu_kernels switches all the CPU speed-ups together: "only this one off" cannot be kept
    with pytest.raises(ConfigError, match=rf"was replaced by {new[:-4]} .*use {new}"):
        load_config([old])


def test_a_replaced_key_asking_for_what_the_default_gives_is_dropped_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(["reward_model.model.cpu_linear=onednn", "actor_rollout_ref.rollout.fused_decode=true"])
    ours = [str(w.message) for w in caught if issubclass(w.category, ReplacedKeyWarning)]
    assert len(ours) == 2 and "cpu_linear was replaced by reward_model.model.cpu_kernels" in ours[0]
    assert "fused_decode was replaced by actor_rollout_ref.model.cpu_kernels" in ours[1]
    assert cfg.reward_model.model.cpu_kernels == "auto" and "fused_decode" not in cfg.actor_rollout_ref.rollout


def test_unregistered_estimator_suggests_the_nearest():
    with pytest.raises(ConfigError, match="Did you mean 'grpo'"):
        load_config(["algorithm.adv_estimator=gpro"])


def test_gae_without_a_critic_model_is_an_error():
    with pytest.raises(ConfigError, match="adv_estimator=gae needs a critic model: set critic.model.path"):
        load_config(["algorithm.adv_estimator=gae"])


def test_null_estimator_means_gae_when_a_critic_is_given():
    # verl's default estimator is gae, and verl's PPO scripts set critic.model.path without naming it
    r = resolve_config(_load("critic.model.path=/some/critic"), steps_per_epoch=1, cuda_available=False)
    assert r.algorithm.adv_estimator == "gae" and r.critic.enable is True


# ───────────────────────────── batch-size arithmetic ─────────────────────────────


def test_micro_batch_that_does_not_divide_shows_the_numbers():
    # 8 prompts x n=8 = 64 samples per mini-batch over 2 ranks = 32 per rank; 5 does not divide 32
    with pytest.raises(ConfigError) as e:
        load_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
                     "trainer.worker_backend=ray"])
    msg = str(e.value)
    assert "ppo_micro_batch_size_per_gpu=5" in msg and "32 samples each rank" in msg
    assert "ppo_mini_batch_size=8" in msg and "rollout.n=8" in msg and "2 ranks" in msg


def test_samples_per_step_need_divide_only_the_data_parallel_ranks():
    # 3 prompts x n=1 = 3 samples on 2 ranks: with FSDP both ranks are data-parallel and the mini-batch of
    # 3 cannot split over them; with Megatron at tensor parallel 2 there is one data-parallel rank, and the
    # dispatch pads the 3 rows to 4 (generation, log-probs drop the padding; the update trains rows 0-2)
    sizes = ["data.train_batch_size=3", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.n_gpus_per_node=2",
             "trainer.worker_backend=ray"]
    with pytest.raises(ConfigError) as e:
        load_config(sizes)
    assert "3 samples per mini-batch cannot be split evenly over 2 data-parallel ranks" in str(e.value)
    assert "samples per step" not in str(e.value)
    megatron = [f"actor_rollout_ref.{role}.{key}" for role in ("actor", "ref")
                for key in ("strategy=megatron", "megatron.tensor_model_parallel_size=2")]
    cfg = load_config([*sizes, *megatron])
    assert cfg.data.train_batch_size == 3


def test_mini_batch_must_divide_train_batch():
    with pytest.raises(ConfigError, match=r"data.train_batch_size=16 is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=6"):
        load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=6"])


def test_critic_batch_sizes_are_checked_too():
    with pytest.raises(ConfigError, match=r"critic.ppo_micro_batch_size_per_gpu=7"):
        load_config(["critic.model.path=/x", "critic.ppo_micro_batch_size_per_gpu=7"])


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError, match=r"2 config problem"):
        load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=6", "trainer.resume_mode=resume_path"])


def test_local_backend_with_several_ranks_is_an_error():
    with pytest.raises(ConfigError, match="worker_backend=local runs one in-process rank"):
        load_config(["trainer.worker_backend=local", "trainer.n_gpus_per_node=2"])


# ───────────────────────────── no-effect keys ─────────────────────────────


def test_no_effect_keys_give_exactly_one_warning_naming_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config([
            "actor_rollout_ref.model.use_shm=true",
            "actor_rollout_ref.rollout.enable_chunked_prefill=False",
            "trainer.default_hdfs_dir=hdfs://x",
            "actor_rollout_ref.model.use_shm=false",  # set twice: still named once
        ])
    ours = [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert text.count("actor_rollout_ref.model.use_shm") == 1
    assert "actor_rollout_ref.rollout.enable_chunked_prefill" in text
    assert "trainer.default_hdfs_dir" in text


def test_fused_kernels_take_effect_and_what_is_not_built_is_a_start_up_error():
    """actor_rollout_ref.model.use_fused_kernels (+ impl_backend) is off the no-effect list; the reward
    model's stays there (a 1-label head); an unknown backend or strategy=megatron with it is a ConfigError."""
    fused = ["actor_rollout_ref.model.use_fused_kernels=true",
             "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(fused)
        load_config(["reward_model.model.use_fused_kernels=true"])
    texts = [str(w.message) for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert len(texts) == 1 and "reward_model.model.use_fused_kernels" in texts[0]
    assert "actor_rollout_ref.model.use_fused_kernels" not in texts[0] and "fused_kernel_options" not in texts[0]
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.fused_kernel_options.impl_backend='cuda'"):
        validate_config(_load(fused[0], "actor_rollout_ref.model.fused_kernel_options.impl_backend=cuda"))
    validate_config(_load(fused[0], "trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=true",
                          "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"))  # with Ulysses: valid
    with pytest.raises(ConfigError, match=r"fused_kernel_options.impl_backnd: not an option; verl's fused kernels "
                                          r"take impl_backend only"):
        validate_config(_load(fused[0], "actor_rollout_ref.model.fused_kernel_options.impl_backnd=torch"))
    # the Megatron engine has its fused output layer (engines/megatron/fused_head.py): the same options
    validate_config(_load(fused[0], "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron"))
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.fused_kernel_options.impl_backend='cuda'"):
        validate_config(_load(fused[0], "actor_rollout_ref.actor.strategy=megatron",
                              "actor_rollout_ref.model.fused_kernel_options.impl_backend=cuda"))


def test_torch_compile_and_liger_keys_take_effect_without_the_no_effect_warning(monkeypatch):
    """actor/ref use_torch_compile and model.use_liger are off the no-effect list (engines/fsdp/compile.py,
    models/liger.py); use_liger where Liger cannot run is a ConfigError naming the key, through load_config."""
    import importlib.util

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(["actor_rollout_ref.actor.use_torch_compile=true", "actor_rollout_ref.ref.use_torch_compile=false"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert cfg.actor_rollout_ref.actor.use_torch_compile and not cfg.actor_rollout_ref.ref.use_torch_compile
    assert _load("actor_rollout_ref.actor.use_torch_compile=true").actor_rollout_ref.ref.use_torch_compile  # follows
    liger = "actor_rollout_ref.model.use_liger=true"
    with pytest.raises(ConfigError, match=r"use_liger=true: Liger's kernels are Triton GPU kernels and the training "
                                          r"device is cpu; set actor_rollout_ref.model.use_liger=false"):
        load_config([liger, "trainer.device=cpu"])
    # on CUDA without liger-kernel installed (this machine has neither: both stand-ins)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.use_liger=true needs liger-kernel, which is not "
                                          r"installed: pip install liger-kernel"):
        load_config([liger])  # trainer.device=auto: CUDA


def test_ulysses_takes_effect_and_bad_layouts_are_start_up_errors():
    sp2 = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.model.use_remove_padding=true",
           "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_config(load_config(sp2))  # 4 ranks, SP 2: valid
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    with pytest.raises(ConfigError, match=r"actor.ulysses_sequence_parallel_size=3 does not divide the 4 ranks"):
        validate_config(_load(*sp2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"))
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=2 needs actor_rollout_ref.model."
                       r"use_remove_padding=true"):
        validate_config(_load(*sp2, "actor_rollout_ref.model.use_remove_padding=false"))
    with pytest.raises(ConfigError, match=r"reward_model.ulysses_sequence_parallel_size > 1: .* not built"):
        validate_config(_load(*sp2, "reward_model.ulysses_sequence_parallel_size=2"))


def test_generation_outputs_take_effect_and_bad_values_are_start_up_errors(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(["trainer.log_val_generations=5", f"trainer.validation_data_dir={tmp_path}"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    with pytest.raises(ConfigError, match=r"trainer.log_val_generations=-1 must be >= 0"):
        _load("trainer.log_val_generations=-1")
    (tmp_path / "f.txt").write_text("")
    with pytest.raises(ConfigError, match=r"trainer.validation_data_dir=.*f.txt is a file; it must be a directory"):
        _load(f"trainer.validation_data_dir={tmp_path / 'f.txt'}")


def test_pf_ppo_keys_take_effect_and_bad_values_are_start_up_errors(tiny_critic_dir):
    gae = ["algorithm.adv_estimator=gae", f"critic.model.path={tiny_critic_dir}", "algorithm.use_pf_ppo=true"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config([*gae, "algorithm.pf_ppo.reweight_method=max_random", "algorithm.pf_ppo.weight_pow=1"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    with pytest.raises(ConfigError, match=r"algorithm.pf_ppo.reweight_method='best' is not one of \['pow', 'max_min'"):
        _load(*gae, "algorithm.pf_ppo.reweight_method=best")
    with pytest.raises(ConfigError, match=r"algorithm.pf_ppo.weight_pow=-1 must be a number >= 0"):
        _load(*gae, "algorithm.pf_ppo.weight_pow=-1")
    # verl resamples after GAE only: with another estimator the key is named as having no effect
    with pytest.warns(NoEffectKeyWarning, match="use_pf_ppo has no effect with algorithm.adv_estimator=grpo"):
        load_config(["algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true"])


def test_data_classes_take_effect_and_missing_files_are_start_up_errors(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config([f"data.custom_cls.path={tmp_path / 'ds.py'}", "data.custom_cls.name=MyDataset",
                           f"data.sampler.class_path={tmp_path / 's.py'}"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    with pytest.raises(ConfigError) as err:
        check_startup_paths(cfg)
    assert f"data.custom_cls.path={tmp_path / 'ds.py'} does not exist" in str(err.value)
    assert f"data.sampler.class_path={tmp_path / 's.py'} does not exist" in str(err.value)
    assert "data.sampler.class_path is set but data.sampler.class_name is not" in str(err.value)


def test_checkpoint_contents_take_effect_and_bad_lists_are_start_up_errors():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(["actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
                           "critic.checkpoint.load_contents=[model]"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert list(cfg.actor_rollout_ref.actor.checkpoint.save_contents) == ["model", "hf_model"]
    with pytest.raises(ConfigError, match=r"actor.checkpoint.save_contents=\['model', 'weights'\]: unknown \['weights'\]"):
        _load("actor_rollout_ref.actor.checkpoint.save_contents=[model,weights]")
    with pytest.raises(ConfigError, match=r"critic.checkpoint.load_contents=\['optimizer'\] must include 'model'"):
        _load("critic.checkpoint.load_contents=[optimizer]")
    # verl's async_save: false is what runs here; true names what is not built
    assert not _load("actor_rollout_ref.actor.checkpoint.async_save=False").actor_rollout_ref.actor.checkpoint.async_save
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.checkpoint.async_save=true: checkpoints written in "
                                          r"the background .* are not built here"):
        _load("actor_rollout_ref.actor.checkpoint.async_save=true")
    # verl's "HF exports only" save: the export and, beside it, the whole resumable state (warned)
    with pytest.warns(UserWarning, match=r"save_contents=\['hf_model'\]: each saved step gets the HF export"):
        hf_only = load_config(["actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]"])
    assert list(hf_only.actor_rollout_ref.actor.checkpoint.save_contents) == ["model", "optimizer", "extra", "hf_model"]
    # verl <= 0.3's single list is both, unless the newer key is given too
    old = load_config(["actor_rollout_ref.actor.checkpoint.contents=[model]",
                       "actor_rollout_ref.actor.checkpoint.load_contents=[model,extra]"]).actor_rollout_ref.actor.checkpoint
    assert (list(old.save_contents), list(old.load_contents)) == (["model"], ["model", "extra"])
    # the Megatron engine takes the same lists (verl's Megatron scripts save the model alone)
    for listed in ("[model]", "[model,hf_model,extra]"):
        megatron = _load("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
                         f"actor_rollout_ref.actor.checkpoint.save_contents={listed}")
        assert list(megatron.actor_rollout_ref.actor.checkpoint.save_contents) == listed.strip("[]").split(",")


def test_calculate_log_probs_is_on_exactly_where_asked_or_read():
    from rlfoundry.trainer.config import auto_choices

    def on(*overrides):
        cfg = _load(*overrides)
        return resolve_config(cfg, steps_per_epoch=1, cuda_available=False).actor_rollout_ref.rollout.calculate_log_probs

    recompute = "actor_rollout_ref.actor.use_rollout_log_probs=false"
    no_audit = "trainer.mismatch_audit=false"
    assert on(recompute, no_audit) is False  # verl's default: the rollout returns none
    assert on(recompute, no_audit, "actor_rollout_ref.rollout.calculate_log_probs=true") is True
    assert on(no_audit) is False  # two mini-batches a step: the old log-probs are recomputed
    assert on() is True  # ... and the mismatch audit (on by default) compares them with the rollout's
    assert on(recompute) is True
    assert on("actor_rollout_ref.actor.ppo_mini_batch_size=16") is True  # reused as the old log-probs
    assert on(recompute, "algorithm.rollout_correction.rollout_is=token") is True
    cfg = _load(recompute, no_audit, "algorithm.rollout_correction.rollout_is=token")
    lines = auto_choices(cfg, resolve_config(cfg, steps_per_epoch=1, cuda_available=False))
    assert "actor_rollout_ref.rollout.calculate_log_probs=true: algorithm.rollout_correction reads" in "\n".join(lines)


def test_fsdp_memory_keys_take_effect_and_min_num_params_is_named_as_fsdp1_only():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(["actor_rollout_ref.model.enable_activation_offload=true",
                     "critic.model.enable_activation_offload=true",
                     "actor_rollout_ref.actor.fsdp_config.forward_prefetch=true",
                     "actor_rollout_ref.ref.fsdp_config.offload_policy=true",
                     "+actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    with pytest.warns(NoEffectKeyWarning, match=r"critic.model.fsdp_config.wrap_policy.min_num_params"):
        load_config(["critic.model.fsdp_config.wrap_policy.min_num_params=1000000"])


def test_verls_old_name_val_generations_to_log_to_wandb_is_log_val_generations():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(["trainer.val_generations_to_log_to_wandb=10"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert cfg.trainer.log_val_generations == 10
    same = load_config(["trainer.val_generations_to_log_to_wandb=3", "trainer.log_val_generations=3"])
    assert same.trainer.log_val_generations == 3
    with pytest.raises(ConfigError, match=r"trainer.val_generations_to_log_to_wandb \(verl <= 0.2\) and "
                                          r"trainer.log_val_generations .* different values \(3 vs 5\)"):
        _load("trainer.val_generations_to_log_to_wandb=3", "trainer.log_val_generations=5")


def test_effective_keys_give_no_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # rollout.ignore_eos is read by the HF rollout as well as by vLLM
        load_config(["actor_rollout_ref.actor.optim.lr=1e-6", "trainer.total_epochs=2",
                     "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
                     "critic.model.fsdp_config.fsdp_size=1"])
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]


def test_vllm_engine_keys_have_effect_only_with_vllm():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(["actor_rollout_ref.rollout.gpu_memory_utilization=0.4"])
        load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4"])
    ours = [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert len(ours) == 1 and "gpu_memory_utilization" in str(ours[0].message)


# ───────────────────────────── resolution ─────────────────────────────


def test_total_steps_are_loader_length_times_epochs_in_every_copy():
    # 7 batches per epoch x 3 epochs = 21 steps, written where the workers' schedulers read it
    r = resolve_config(_load("trainer.total_epochs=3"), steps_per_epoch=7, cuda_available=False)
    assert r.trainer.total_training_steps == 21
    assert r.actor_rollout_ref.actor.optim.total_training_steps == 21
    assert r.critic.optim.total_training_steps == 21


def test_explicit_total_steps_win():
    r = resolve_config(_load("trainer.total_training_steps=5", "trainer.total_epochs=3"), steps_per_epoch=7,
                       cuda_available=False)
    assert r.actor_rollout_ref.actor.optim.total_training_steps == 5


def test_resolution_is_pure_and_read_only():
    cfg = _load()
    r = resolve_config(cfg, steps_per_epoch=4, cuda_available=False, train_files="/d/train.parquet")
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps == -1  # input untouched
    assert cfg.data.train_files is None and r.data.train_files == "/d/train.parquet"
    with pytest.raises(Exception):
        r.trainer.total_epochs = 9


def test_deprecated_global_micro_batch_sizes_become_per_rank():
    # verl's old ppo_micro_batch_size=64 is global: 64 / (1 node x 8 ranks) = 8 per rank
    cfg = _load("trainer.n_gpus_per_node=8", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size=128")
    r = resolve_config(cfg, steps_per_epoch=1, cuda_available=True)
    assert r.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8
    assert r.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 16
    assert r.trainer.worker_backend == "ray" and r.trainer.device == "cuda"


def test_cuda_requested_without_cuda_is_an_error():
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA device"):
        resolve_config(_load("trainer.device=cuda"), steps_per_epoch=1, cuda_available=False)


def test_too_little_data_for_one_batch_is_an_error():
    with pytest.raises(ConfigError, match="fewer prompts than data.train_batch_size=16"):
        resolve_config(_load(), steps_per_epoch=0, cuda_available=False)


# ───────────────────────────── start-up file checks ─────────────────────────────


def test_model_path_that_is_not_an_hf_dir_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.path=.*empty is not a Hugging Face model directory"):
        check_startup_paths(_load(f"actor_rollout_ref.model.path={tmp_path / 'empty'}"))
    with pytest.raises(ConfigError, match=r"does not exist"):
        check_startup_paths(_load(f"actor_rollout_ref.model.path={tmp_path / 'nope'}"))


def test_resume_path_without_checkpoint_is_an_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.resume_from_path=.* holds no checkpoint"):
        check_startup_paths(_load(f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.resume_mode=resume_path",
                                  f"trainer.resume_from_path={tmp_path}"))


def test_missing_custom_reward_file_is_named(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"custom_reward_function.path=.*reward.py does not exist"):
        check_startup_paths(_load(f"actor_rollout_ref.model.path={tiny_model_dir}",
                                  f"custom_reward_function.path={tmp_path / 'reward.py'}"))


# ───────────────────────────── verl command lines ─────────────────────────────

# verl docs/start/quickstart.rst (PPO on GSM8K, Qwen2.5-0.5B-Instruct), with local paths.
VERL_QUICKSTART = """
data.train_files={data}/train.parquet
data.val_files={data}/test.parquet
data.train_batch_size=256
data.max_prompt_length=512
data.max_response_length=512
actor_rollout_ref.model.path={model}
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
critic.optim.lr=1e-5
critic.model.path={model}
critic.ppo_micro_batch_size_per_gpu=4
algorithm.kl_ctrl.kl_coef=0.001
trainer.logger=console
trainer.val_before_train=False
trainer.n_gpus_per_node=1
trainer.nnodes=1
trainer.save_freq=10
trainer.test_freq=10
trainer.total_epochs=15
"""

# The older quickstart (verl <= 0.2 keys: global micro-batch sizes, grad_offload).
VERL_LEGACY_QUICKSTART = """
data.train_files={data}/train.parquet
data.val_files={data}/test.parquet
data.train_batch_size=1024
data.val_batch_size=1312
data.max_prompt_length=512
data.max_response_length=512
actor_rollout_ref.model.path={model}
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size=64
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.grad_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.micro_batch_size=256
actor_rollout_ref.rollout.log_prob_micro_batch_size=128
actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size=128
actor_rollout_ref.ref.fsdp_config.param_offload=True
critic.optim.lr=1e-5
critic.model.path={model}
critic.model.enable_gradient_checkpointing=False
critic.ppo_micro_batch_size=64
critic.model.fsdp_config.param_offload=False
critic.model.fsdp_config.grad_offload=False
critic.model.fsdp_config.optimizer_offload=False
algorithm.kl_ctrl.kl_coef=0.001
trainer.critic_warmup=0
trainer.logger=['console','wandb']
trainer.project_name='verl_example_gsm8k'
trainer.experiment_name='deepseek_llm_7b_function_rm'
trainer.n_gpus_per_node=8
trainer.nnodes=1
trainer.save_freq=-1
trainer.total_epochs=15
"""


def _cmdline(text: str, model: Path) -> list[str]:
    return [line.format(data="/data/gsm8k", model=model) for line in text.split()]


def test_verl_quickstart_command_line_parses_with_verl_meaning(tiny_model_dir):
    cfg = _load(*_cmdline(VERL_QUICKSTART, tiny_model_dir), "actor_rollout_ref.rollout.n=1")
    r = resolve_config(cfg, steps_per_epoch=29, cuda_available=False)
    assert r.algorithm.adv_estimator == "gae" and r.critic.enable  # verl's default algorithm: PPO + critic
    assert r.trainer.total_training_steps == 29 * 15
    assert r.critic.ppo_mini_batch_size == 64 and r.critic.rollout_n == 1
    assert r.actor_rollout_ref.rollout.response_length == 512


def test_verl_legacy_quickstart_command_line_parses(tiny_model_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(_cmdline(VERL_LEGACY_QUICKSTART, tiny_model_dir) + ["actor_rollout_ref.rollout.n=1"])
    no_effect = [str(w.message) for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert len(no_effect) == 1 and "grad_offload" in no_effect[0] and "micro_batch_size" in no_effect[0]
    # rollout TP 2 on vLLM: one engine per rank instead (the planner plans it so: tests/plan/test_cli.py)
    [tp] = [str(w.message) for w in caught if "tensor_model_parallel_size=2 with rollout.name=vllm" in str(w.message)]
    assert "the engine runs one replica per rank with tensor, data and expert parallel size 1" in tp
    r = resolve_config(cfg, steps_per_epoch=7, cuda_available=True)
    assert r.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8  # 64 global / 8 ranks
    assert r.critic.ppo_micro_batch_size_per_gpu == 8
    assert list(r.trainer.logger) == ["console", "wandb"]


# verl >= 0.7 spells the rule-reward keys under a top-level reward (its DAPO recipe's REWARD block),
# older verl under reward_model / custom_reward_function: the same run either way.
VERL07_REWARD = """
reward.reward_manager.name=dapo
+reward.reward_kwargs.overlong_buffer_cfg.enable=True
+reward.reward_kwargs.overlong_buffer_cfg.len=64
+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
+reward.reward_kwargs.overlong_buffer_cfg.log=False
+reward.reward_kwargs.max_resp_len=256
reward.num_workers=2
+reward.compute_score_kwargs.method=flexible
reward.custom_reward_function.name=my_score
"""
OLDER_REWARD = VERL07_REWARD.replace("reward.reward_manager.name", "reward_model.reward_manager").replace(
    "+reward.reward_kwargs", "+reward_model.reward_kwargs").replace(
    "reward.num_workers", "+reward_model.reward_kwargs.num_workers").replace(
    "+reward.compute_score_kwargs", "+reward_model.reward_kwargs.compute_score_kwargs").replace(
    "reward.custom_reward_function", "custom_reward_function")


def _without_reward(cfg) -> dict:
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("reward")
    return plain


def test_verl_07_reward_keys_are_the_older_keys_spelled_anew():
    new, old = _load(*VERL07_REWARD.split()), _load(*OLDER_REWARD.split())
    assert _without_reward(new) == _without_reward(old)
    rm = new.reward_model
    assert rm.reward_manager == "dapo" and new.custom_reward_function.name == "my_score"
    assert rm.reward_kwargs == {"overlong_buffer_cfg": {"enable": True, "len": 64, "penalty_factor": 1.0, "log": False},
                                "max_resp_len": 256, "num_workers": 2, "compute_score_kwargs": {"method": "flexible"}}
    # spelled both ways alike is one setting; differently, an error naming both spellings
    assert _load("reward.reward_manager.name=batch", "reward_model.reward_manager=batch").reward_model.reward_manager == "batch"
    with pytest.raises(ConfigError, match=r"reward.num_workers \(verl >= 0.7\) and reward_model.reward_kwargs.num_workers"):
        _load("reward.num_workers=2", "+reward_model.reward_kwargs.num_workers=3")


def test_reward_key_mistakes_are_start_up_errors(tmp_path, capsys):
    from rlfoundry.trainer.main_ppo import main

    assert main(["reward.reward_manager.name=dapo", "reward_model.reward_manager=naive"]) == 2
    assert "reward.reward_manager.name (verl >= 0.7) and reward_model.reward_manager" in capsys.readouterr().err
    (tmp_path / "score.py").write_text("def compute_score(**kw):\n    return 1.0\n")
    with pytest.raises(ConfigError) as err:
        _load(f"reward.custom_reward_function.path={tmp_path / 'score.py'}", "+reward.compute_score_kwargs.method=flexible",
              "reward.reward_manager.source=importlib")
    assert "custom_reward_function.reward_kwargs" in str(err.value) and "module.path" in str(err.value)


# ───────────────────────────── the entry point ─────────────────────────────


def test_main_exits_2_with_a_paragraph_not_a_traceback(capsys):
    from rlfoundry.trainer.main_ppo import main

    assert main(["trainer.totl_epochs=2"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'trainer.total_epochs'" in err and "Traceback" not in err


def test_main_reports_a_model_path_that_is_not_a_model(capsys, tmp_path):
    from rlfoundry.trainer.main_ppo import main

    assert main([f"actor_rollout_ref.model.path={tmp_path}", f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    assert "is not a Hugging Face model directory" in capsys.readouterr().err


def test_megatron_keys_and_what_it_cannot_do_yet_are_start_up_errors():
    """verl's megatron keys are accepted; a layout that does not divide the ranks and a critic with another
    layout than the actor's are each named; a reference with another layout runs in the actor's, as verl's
    does, and says so."""
    ok = load_config(["actor_rollout_ref.actor.strategy=megatron", "trainer.save_freq=-1", "trainer.n_gpus_per_node=4",
                      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                      "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
                      "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null"])
    assert ok.actor_rollout_ref.ref.strategy == "megatron"  # follows the actor's
    with pytest.raises(ConfigError) as e:
        load_config(["actor_rollout_ref.actor.strategy=megatron", "trainer.n_gpus_per_node=2", "trainer.worker_backend=process",
                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                     "critic.enable=true", "critic.strategy=megatron", "critic.model.path=x",
                     "critic.megatron.pipeline_model_parallel_size=2"])
    text = str(e.value)
    for expected in ("tensor × pipeline × context parallel = 4 does not divide the 2 ranks",
                     "critic.megatron: every role runs in the same processes, and megatron-core has one parallel layout"):
        assert expected in text, expected
    assert "actor_rollout_ref.ref.megatron: every role" not in text
    with pytest.warns(UserWarning, match=r"ref.megatron: tensor_model_parallel_size=4, context_parallel_size=2 differs "
                                         r"from actor_rollout_ref.actor.megatron \(tensor_model_parallel_size=2, "
                                         r"context_parallel_size=1\); the reference runs in the actor's layout"):
        ref = load_config(["actor_rollout_ref.actor.strategy=megatron", "trainer.n_gpus_per_node=4",
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                           "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4",
                           "actor_rollout_ref.ref.megatron.context_parallel_size=2"])
    assert (ref.actor_rollout_ref.ref.megatron.tensor_model_parallel_size,
            ref.actor_rollout_ref.ref.megatron.context_parallel_size) == (2, 1)


def test_megatron_offload_keys_are_accepted_and_reach_the_roles_configs():
    """verl's ``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload`` (25 of verl's example
    command lines set them) on the actor, the reference and the critic validate: the old "not built yet"
    error is gone, and the typed subtrees the workers hand the engines carry them
    (tests/engines/test_megatron_offload.py follows them into the engines)."""
    flags = ("param_offload", "grad_offload", "optimizer_offload")
    roles = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
    cfg = load_config(["actor_rollout_ref.actor.strategy=megatron", "trainer.n_gpus_per_node=2",
                       "critic.enable=true", "critic.strategy=megatron", "critic.model.path=x",
                       *(f"{role}.megatron.{flag}=true" for role in roles for flag in flags)])
    for role in roles:
        node = cfg.critic if role == "critic" else getattr(cfg.actor_rollout_ref, role.split(".")[1])
        assert all(getattr(node.megatron, flag) is True for flag in flags), role


def test_megatron_context_parallelism_is_accepted_and_expert_parallelism_is_its_own_error():
    """CP is built (a model copy spans tensor × pipeline × context ranks); EP's span (expert × expert
    tensor × pipeline) is checked on its own, and EP on a dense model (the packaged policy) is refused."""
    cp = ["actor_rollout_ref.actor.strategy=megatron", "trainer.save_freq=-1", "trainer.n_gpus_per_node=4",
          "actor_rollout_ref.actor.megatron.context_parallel_size=2",
          "actor_rollout_ref.ref.megatron.context_parallel_size=2"]
    assert load_config(cp).actor_rollout_ref.actor.megatron.context_parallel_size == 2
    with pytest.raises(ConfigError) as e:
        load_config([*cp, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                     "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4",
                     "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                     "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"])
    text = str(e.value)
    assert "tensor × pipeline × context parallel = 8 does not divide the 4 ranks" in text
    assert "actor_rollout_ref.actor.megatron: expert × expert tensor × pipeline parallel = 8 does not divide" in text
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron: expert_model_parallel_size=2 .* "
                                          r"has no experts; set expert_model_parallel_size=1"):
        load_config([*cp, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                     "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"])


def test_packaged_tool_and_interaction_configs_resolve_from_any_directory(tmp_path, monkeypatch):
    from rlfoundry.trainer.config import resolve_asset_path

    monkeypatch.chdir(tmp_path)
    for name in ("tools/calculator.yaml", "tools/gsm8k.yaml", "interactions/gsm8k.yaml"):
        assert Path(resolve_asset_path(f"rlfoundry://config/{name}")).is_file()
    cfg = load_config([], config_name="calculator_grpo")
    validate_config(cfg)  # raises unless the overlay's rlfoundry://config/tools/calculator.yaml loads from here


def test_process_backend_over_several_nodes_says_it_is_single_node():
    with pytest.raises(ConfigError, match=r"trainer.worker_backend=process is single-node \(processes on this machine\), "
                       r"but trainer.nnodes=2; use trainer.worker_backend=ray for several nodes"):
        load_config(["trainer.worker_backend=process", "trainer.nnodes=2", "trainer.n_gpus_per_node=1"])


def test_rollout_log_probs_are_exact_only_where_the_actor_computes_in_fp32():
    """``actor.use_rollout_log_probs=auto`` decides from the device in use (issue 33): the HF engine's
    one-token decode and the actor's full forward agree to fp32 rounding only in fp32; in bf16 (the CUDA
    default of FSDP2, and Megatron's default) they differ by ~1e-2."""
    from rlfoundry.trainer.config import rollout_log_probs_inexact as inexact

    assert inexact("cpu", "fsdp", None, "bfloat16") is None  # FSDP on the CPU computes in fp32
    assert "bf16 on cuda" in inexact("cuda", "fsdp", None, "bfloat16")  # its CUDA default: bf16
    assert inexact("cuda", "fsdp2", "fp32", "bfloat16") is None  # fp32 asked for on CUDA: exact
    assert "bf16 on cpu" in inexact("cpu", "fsdp", "bf16", "float32")  # bf16 asked for on the CPU: not
    assert inexact("cpu", "megatron", None, "float32") is None  # Megatron: its own dtype, either device
    assert "actor.megatron.dtype" in inexact("cuda", "megatron", "fp32", "bfloat16")


@pytest.mark.parametrize("device,overrides,reuses", [
    ("cpu", [], True), ("cuda", [], False),
    ("cuda", ["+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"], True)])
def test_auto_reuses_rollout_log_probs_only_where_exact_on_the_device(device, overrides, reuses):
    from rlfoundry.trainer.config import auto_choices, resolve_config

    cfg = load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=16", f"trainer.device={device}", *overrides])
    out = resolve_config(cfg, steps_per_epoch=4, cuda_available=device == "cuda")
    assert out.actor_rollout_ref.actor.use_rollout_log_probs is reuses
    said = auto_choices(cfg, out)[0]
    assert ("bf16 on cuda" in said) is (not reuses)


def test_a_verl_async_server_class_is_a_start_up_error_not_ignored():
    """``rollout.agent.custom_async_server`` names a class that drives verl's own engine workers; a run
    that ignored it would generate with another engine than its command line names."""
    key = "actor_rollout_ref.rollout.agent.custom_async_server"
    with pytest.raises(ConfigError, match=r"custom_async_server=.*my_server.*rollout engine plug-in"):
        validate_config(_load(f"+{key}.path=my_server.py", f"+{key}.name=MyServer"))
    validate_config(_load())  # unset (verl's default: null path and name) stays valid
    validate_config(_load(f"+{key}.path=null", f"+{key}.name=null"))


def test_verl_091_algorithms_validate_and_their_missing_inputs_are_start_up_errors():
    # every verl 0.9.1 loss and GDPO load with verl's keys, which reach the typed config
    arr = "actor_rollout_ref.actor"
    for mode in ("sapo", "geo_mean", "dppo_tv", "dppo_kl", "gspo"):
        assert _load(f"{arr}.policy_loss.loss_mode={mode}").actor_rollout_ref.actor.policy_loss.loss_mode == mode
    cfg = _load(f"{arr}.policy_loss.loss_mode=dro", f"{arr}.policy_loss.dro_beta=0.1", f"{arr}.tau_pos=2.0",
                "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]",
                "algorithm.gdpo_reward_weights=[1.0,0.5]")
    assert cfg.actor_rollout_ref.actor.policy_loss.dro_beta == 0.1 and cfg.actor_rollout_ref.actor.tau_pos == 2.0
    assert list(cfg.algorithm.gdpo_reward_keys) == ["fmt", "acc"]
    with pytest.raises(ConfigError, match=r"loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta > 0"):
        _load(f"{arr}.policy_loss.loss_mode=dro")
    with pytest.raises(ConfigError, match=r"tau_pos=0.0 and tau_neg=1.05 \(SAPO's gate temperatures\) must be > 0"):
        _load(f"{arr}.policy_loss.loss_mode=sapo", f"{arr}.tau_pos=0")
    with pytest.raises(ConfigError, match=r"adv_estimator=gdpo needs algorithm.gdpo_reward_keys"):
        _load("algorithm.adv_estimator=gdpo")
    with pytest.raises(ConfigError, match=r"gdpo_reward_weights has 1 entries for 2 gdpo_reward_keys"):
        _load("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]")
    # the optimal token baselines read the actor's sum_v pi_v^2: verl requires calculate_sum_pi_squared for them;
    # the pass that computes it must run, so the rollout's log-probs are not reused for the old ones (auto: off)
    one_mini_batch = f"{arr}.ppo_mini_batch_size=16"  # = data.train_batch_size: reuse is on by default here
    assert resolve_config(_load(one_mini_batch), steps_per_epoch=1,
                          cuda_available=False).actor_rollout_ref.actor.use_rollout_log_probs
    for est in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises(ConfigError, match=rf"adv_estimator={est} reads the actor's per-token sum_v pi_v\^2: "
                                              rf"set {arr}.calculate_sum_pi_squared=true"):
            _load(f"algorithm.adv_estimator={est}")
        cfg = _load(f"algorithm.adv_estimator={est}", f"{arr}.calculate_sum_pi_squared=true", one_mini_batch)
        resolved = resolve_config(cfg, steps_per_epoch=1, cuda_available=False)
        assert resolved.actor_rollout_ref.actor.calculate_sum_pi_squared
        assert resolved.actor_rollout_ref.actor.use_rollout_log_probs is False
    with pytest.raises(ConfigError, match=r"use_rollout_log_probs=true: actor_rollout_ref.actor.calculate_sum_pi_squared"
                                          r"=true needs the actor's log-prob pass"):
        _load(f"{arr}.calculate_sum_pi_squared=true", f"{arr}.use_rollout_log_probs=true")
    with pytest.raises(ConfigError, match=r"calculate_sum_pi_squared=true with algorithm.rollout_correction.bypass_mode"):
        _load(f"{arr}.calculate_sum_pi_squared=true", "algorithm.rollout_correction.bypass_mode=true")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_packaged_megatron_config_is_verls_bf16_and_the_cpu_trains_in_fp32_saying_so(device):
    """Issue 54 item 3: ppo_megatron_trainer asks for bf16 as verl's does; a CPU run resolves every Megatron
    role in use to float32 and its start-up lines say which (a GPU run keeps bf16 and says nothing)."""
    from rlfoundry.trainer.config import auto_choices

    cfg = load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=16", f"trainer.device={device}",
                       "actor_rollout_ref.actor.use_kl_loss=true"], config_name="ppo_megatron_trainer")
    assert {cfg.actor_rollout_ref.actor.megatron.dtype, cfg.actor_rollout_ref.ref.megatron.dtype,
            cfg.critic.megatron.dtype} == {"bfloat16"}
    out = resolve_config(cfg, steps_per_epoch=4, cuda_available=device == "cuda")
    want = "float32" if device == "cpu" else "bfloat16"
    assert out.actor_rollout_ref.actor.megatron.dtype == out.actor_rollout_ref.ref.megatron.dtype == want
    said = [line for line in auto_choices(cfg, out) if "(asked: " in line]
    if device == "cpu":  # the critic is not in use (GRPO): not named
        assert said == ["actor_rollout_ref.actor.megatron.dtype, actor_rollout_ref.ref.megatron.dtype=float32 "
                        "(asked: bfloat16): the CPU trains in float32, as the FSDP engine does there; bf16 is the "
                        "GPU precision"]
    else:
        assert said == []


def test_the_delta_checkpoint_engine_keys_validate_and_a_bad_argument_is_named():
    """verl's delta_sharded weight sync (workers/checkpoint_engine.py): its two keys take effect; another
    encoding, an unknown argument, or arguments for gloo are start-up errors naming the key."""
    pool = ["rollout.n_gpus_per_node=1", "trainer.worker_backend=process"]
    ce = "actor_rollout_ref.rollout.checkpoint_engine"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config([*pool, f"{ce}.backend=delta_sharded", f"+{ce}.engine_kwargs.delta_sharded.encoding=indices"],
                          config_name="one_step_off_ppo_trainer")
    assert not [w for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "delta_sharded"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs == {"delta_sharded": {"encoding": "indices"}}
    with pytest.raises(ConfigError, match=rf"{ce}.engine_kwargs.delta_sharded.encoding=deltas: the one encoding "
                                          r"built .* is indices"):
        load_config([*pool, f"{ce}.backend=delta_sharded", f"+{ce}.engine_kwargs.delta_sharded.encoding=deltas"],
                    config_name="one_step_off_ppo_trainer")
    with pytest.raises(ConfigError, match=rf"{ce}.engine_kwargs.delta_sharded.encodng is not an argument"):
        load_config([*pool, f"{ce}.backend=delta_sharded", f"+{ce}.engine_kwargs.delta_sharded.encodng=indices"],
                    config_name="one_step_off_ppo_trainer")
    with pytest.raises(ConfigError, match=rf"{ce}.engine_kwargs.gloo=.* takes no arguments"):
        load_config([*pool, f"{ce}.backend=gloo", f"+{ce}.engine_kwargs.gloo.x=1"], config_name="one_step_off_ppo_trainer")
    with pytest.raises(ConfigError, match=r"checkpoint_engine.backend='nccl' is not one of \['auto', 'gloo', 'delta_sharded'\]"):
        load_config([*pool, f"{ce}.backend=nccl"], config_name="one_step_off_ppo_trainer")
    with warnings.catch_warnings(record=True) as caught:  # colocated: no bridge to send deltas over
        warnings.simplefilter("always")
        load_config([f"{ce}.backend=delta_sharded"])
    texts = [str(w.message) for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert len(texts) == 1 and f"{ce}.backend=delta_sharded has no effect: the colocated hybrid engine" in texts[0]
