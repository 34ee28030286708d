"""verl's Megatron LoRA keys (``model.lora.*``) onto the typed ``model.lora_*`` keys
(config/verl_compat.py ``_adopt_megatron_lora``), and the start-up errors for what is not built."""

from __future__ import annotations

import pytest

from rlfoundry.trainer.config import ConfigError, load_config

MEGATRON = ["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron"]
LORA = "actor_rollout_ref.model.lora"


def test_verl_keys_set_the_typed_ones():
    cfg = load_config(MEGATRON + [f"{LORA}.rank=8", f"{LORA}.alpha=16", f"{LORA}.merge=true", f"{LORA}.dropout=0.0",
                                  f"{LORA}.type=canonical_lora", f"{LORA}.lora_A_init_method=kaiming",
                                  f"{LORA}.target_modules=[linear_qkv,linear_fc1_gate,linear_fc1_up,linear_fc2]"])
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, cfg.actor_rollout_ref.rollout.lora_sync) == (8, 16, "merged")
    # Megatron's fused names stand for the HF projections they hold
    assert list(model.target_modules) == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def test_one_source_of_defaults():
    """Only the given keys move: verl's Megatron alpha default (32) is not ours (16), the rank alone is copied."""
    model = load_config(MEGATRON + [f"{LORA}.rank=8"]).actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (8, 16, "all-linear")


@pytest.mark.parametrize("given, named", [
    ([f"{LORA}.type=lora"], "lora.type=lora"),  # the fused layout: one A for q, k and v
    ([f"{LORA}.dropout=0.05"], "lora.dropout=0.05"),
    ([f"{LORA}.lora_A_init_method=xavier"], "lora_A_init_method=xavier"),
    ([f"{LORA}.dtype=bf16"], "lora.dtype=bf16"),
    (["actor_rollout_ref.model.lora_rank=4"], "lora_rank"),  # one setting spelled twice, two values
    (["actor_rollout_ref.rollout.lora_sync=merged", f"{LORA}.merge=false"], "lora_sync"),
])
def test_unbuilt_or_conflicting_keys_stop_at_start_up(given, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(MEGATRON + [f"{LORA}.rank=8"] + given)


def test_verl_yaml_defaults_without_a_rank_are_inert():
    """verl's yaml sets type=lora and xavier with rank 0: no LoRA, nothing refused."""
    cfg = load_config(MEGATRON + [f"{LORA}.rank=0", f"{LORA}.type=lora", f"{LORA}.lora_A_init_method=xavier"])
    assert cfg.actor_rollout_ref.model.lora_rank == 0


@pytest.mark.parametrize("given, named", [
    (["actor_rollout_ref.model.target_modules=[q_proj,k_proj]"], "without \\['v_proj'\\]"),
    (["actor_rollout_ref.model.target_modules=[lm_head]"], "lm_head"),
    (["actor_rollout_ref.model.exclude_modules=[o_proj]"], "exclude_modules"),
])
def test_megatron_targets_checked_at_start_up(given, named):
    with pytest.raises(ConfigError, match=named):
        load_config(MEGATRON + ["actor_rollout_ref.model.lora_rank=8"] + given)


def test_megatron_critic_lora_loads_and_its_targets_are_checked():
    """LoRA on a Megatron critic is built (engines/megatron/lora.py); its target modules are checked as the
    actor's, naming the critic's key."""
    critic = MEGATRON + ["critic.strategy=megatron", "algorithm.adv_estimator=gae", "critic.model.path=x"]
    cfg = load_config(critic + ["critic.model.lora.rank=8"])
    assert (cfg.critic.model.lora_rank, cfg.critic.model.target_modules) == (8, "all-linear")
    with pytest.raises(ConfigError, match=r"critic\.model\.target_modules \['lm_head'\]"):
        load_config(critic + ["critic.model.lora_rank=8", "critic.model.target_modules=[lm_head]"])
    with pytest.raises(ConfigError, match=r"critic\.model\.exclude_modules with strategy=megatron"):
        load_config(critic + ["critic.model.lora_rank=8", "critic.model.exclude_modules=[o_proj]"])
