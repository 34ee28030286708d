"""``to_typed``: a component's config subtree as a real dataclass, filled from the schema's defaults,
with the command line's checks (unknown key -> nearest key, wrong type -> key and expected type,
choices, replaced keys)."""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from rlfoundry.config import ConfigError, to_typed
from rlfoundry.config.schema import CriticConfig, DataConfig, PPOConfig, RolloutConfig, ValKwargsConfig
from rlfoundry.trainer.config import load_config


def _load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(list(overrides))


def test_a_partial_dict_is_filled_with_the_schema_defaults():
    cfg = to_typed(RolloutConfig, {"n": 2, "val_kwargs": {"n": 3}, "engine_kwargs.vllm.block_size": 32})
    assert isinstance(cfg, RolloutConfig) and isinstance(cfg.val_kwargs, ValKwargsConfig)
    assert (cfg.n, cfg.val_kwargs.n, cfg.val_kwargs.do_sample) == (2, 3, False)
    assert cfg.engine_kwargs == {"vllm": {"block_size": 32}}  # open dict: any sub-key
    # the defaults are the trainer's: what load_config([]) gives for the same subtree
    trainer = OmegaConf.to_object(_load().actor_rollout_ref.rollout)
    assert to_typed(RolloutConfig, None) == trainer
    assert to_typed(DataConfig, {}).max_prompt_length == _load().data.max_prompt_length == 64


def test_a_dictconfig_subtree_resolves_against_its_root_and_a_dataclass_round_trips():
    rollout = _load("data.max_prompt_length=40").actor_rollout_ref.rollout  # prompt_length: ${data.max_prompt_length}
    cfg = to_typed(RolloutConfig, rollout)
    assert cfg.prompt_length == 40
    assert to_typed(RolloutConfig, cfg) == cfg and to_typed(RolloutConfig, cfg) is not cfg


def test_links_apply_inside_the_class_and_keep_their_own_default_outside():
    critic = to_typed(CriticConfig, {"ppo_micro_batch_size_per_gpu": 4}, name="critic")
    assert critic.forward_micro_batch_size_per_gpu == 4  # follows critic.ppo_micro_batch_size_per_gpu
    assert critic.ppo_epochs == 1  # follows actor_rollout_ref.actor.ppo_epochs, absent here: its own default
    # without its name the subtree cannot tell critic.* links from outside ones: each keeps its default
    assert to_typed(CriticConfig, {"ppo_micro_batch_size_per_gpu": 4}).forward_micro_batch_size_per_gpu == 32
    full = to_typed(PPOConfig, {"actor_rollout_ref": {"actor": {"ppo_epochs": 3}}})
    assert full.critic.ppo_epochs == 3


def test_an_unknown_key_names_the_nearest_valid_key_with_its_full_name():
    with pytest.raises(ConfigError, match=r"Unknown config key 'actor_rollout_ref.rollout.temprature'.*"
                                          r"Did you mean 'actor_rollout_ref.rollout.temperature'"):
        to_typed(RolloutConfig, {"temprature": 0.5}, name="actor_rollout_ref.rollout")
    with pytest.raises(ConfigError, match=r"Unknown config key 'shufle'.*Did you mean 'shuffle'"):
        to_typed(DataConfig, {"shufle": False})


def test_a_wrong_type_names_the_key_and_the_expected_type():
    with pytest.raises(ConfigError, match=r"'data.max_prompt_length'.*'many'.*expected an integer"):
        to_typed(DataConfig, {"max_prompt_length": "many"}, name="data")


def test_a_value_outside_the_choices_lists_them():
    with pytest.raises(ConfigError, match=r"data.truncation='sideways' is not one of \['error', 'left', 'right', 'middle'\]"):
        to_typed(DataConfig, {"truncation": "sideways"}, name="data")


def test_a_replaced_key_is_an_error_or_a_warning_as_on_the_command_line():
    with pytest.raises(ConfigError, match=r"fused_decode was replaced by actor_rollout_ref.model.cpu_kernels.*"
                                          r"use actor_rollout_ref.model.cpu_kernels=off"):
        to_typed(RolloutConfig, {"fused_decode": False}, name="actor_rollout_ref.rollout")
    with pytest.warns(UserWarning, match="fused_decode was replaced"):
        cfg = to_typed(RolloutConfig, {"fused_decode": True, "n": 2}, name="actor_rollout_ref.rollout")
    assert cfg.n == 2


def test_a_quoted_list_on_a_list_key_is_read_as_the_list_it_spells():
    """verl's Qwen3.5-397B SFT script passes ``optim.betas='[0.9,0.95]'`` with the quotes: one string. A list key
    takes the list it spells (warned); a string key keeps the string; a malformed list stays the type error."""
    from rlfoundry.config.sft_schema import SFTConfig
    from rlfoundry.trainer.config import load_config, load_typed_config

    def load_sft_config(overrides):
        return load_typed_config(SFTConfig, overrides)[0]

    with pytest.warns(UserWarning, match=r"one quoted string; read as the list \[0.9, 0.95\]"):
        assert list(load_sft_config(["optim.betas='[0.9,0.95]'"]).optim.betas) == [0.9, 0.95]
    with pytest.warns(UserWarning, match=r"read as the list \['model', 'extra'\]"):
        cfg = load_config(["actor_rollout_ref.actor.checkpoint.load_contents='[model, \"extra\"]'"])
    assert list(cfg.actor_rollout_ref.actor.checkpoint.load_contents) == ["model", "extra"]
    assert load_config(["trainer.project_name='[x]'"]).trainer.project_name == "[x]"  # a string key: as given
    with pytest.raises(ConfigError, match=r"optim.betas.*expected a list"):
        load_sft_config(["optim.betas='[0.9,'"])


def test_an_empty_value_on_a_boolean_key_is_false_as_verl_reads_it():
    """verl's multi-turn vLLM script ends with ``actor.use_kl_loss=${use_kl_loss}`` and never sets the variable:
    verl keeps '' and tests it for truth, so its run has the KL loss off. A boolean key reads '' as false
    (warned), even over an earlier true; a key of another type keeps the empty value or its type error."""
    with pytest.warns(UserWarning, match=r"use_kl_loss=': an empty value on a true/false key; read as false"):
        cfg = load_config(["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.use_kl_loss="])
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False
    with pytest.warns(UserWarning, match="read as false"):  # a default-true switch is turned off too
        assert load_config(["actor_rollout_ref.rollout.do_sample="]).actor_rollout_ref.rollout.do_sample is False
    with pytest.raises(ConfigError, match=r"kl_loss_coef.*expected a number"):
        _load("actor_rollout_ref.actor.kl_loss_coef=")
    assert _load("trainer.project_name=").trainer.project_name == ""
