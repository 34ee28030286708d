"""verl's routing-replay keys (docs/moe.md#routing-replay): accepted where built, start-up errors naming the key
and the fix elsewhere, and R2's need of the old-log-prob pass resolved."""

from __future__ import annotations

import warnings

import pytest

from rlfoundry.trainer.config import ConfigError, load_config, resolve_config

MODE = "actor_rollout_ref.actor.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"


def _load(*overrides: str, config_name: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(list(overrides), config_name=config_name)


@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_r3_with_a_recording_rollout_loads(engine):
    cfg = _load(f"{MODE}=R3", RECORD, f"actor_rollout_ref.rollout.name={engine}")
    assert cfg.actor_rollout_ref.actor.router_replay.mode == "R3"
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True


@pytest.mark.parametrize("overrides, message", [
    ((f"{MODE}=R3",), r"mode=R3 replays the experts the rollout chose.*enable_rollout_routing_replay=true"),
    ((f"{MODE}=R4",), r"router_replay.mode='R4' is not one of \['disabled', 'R2', 'R3'\]"),
    ((f"{MODE}=R3", RECORD, "actor_rollout_ref.rollout.name=vllm"),
     r"rollout.name=vllm: the engine cannot return .*only from its V2 model runner, which needs Triton.*Use rollout.name=hf"),
    ((RECORD, "actor_rollout_ref.rollout.multi_turn.enable=true"), r"multi_turn.enable=true: the agent loop"),
    ((RECORD, "async_training.partial_rollout=true"), r"partial_rollout=true: the chunked generation"),
    (("actor_rollout_ref.actor.router_replay.record_file=/tmp/r.pt",), r"record_file=/tmp/r.pt: routing records on disk"),
    (("actor_rollout_ref.ref.router_replay.mode=R3",), r"ref.router_replay.mode=R3: the reference routes by its own"),
    ((f"{MODE}=R2", "actor_rollout_ref.actor.use_rollout_log_probs=true"), r"mode=R2 records the routing in the actor's"),
])
def test_what_is_not_built_is_a_start_up_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


def test_r3_on_the_megatron_engine_loads():
    cfg = _load(f"{MODE}=R3", RECORD, config_name="ppo_megatron_trainer")
    assert (cfg.actor_rollout_ref.actor.strategy, cfg.actor_rollout_ref.actor.router_replay.mode) == ("megatron", "R3")


@pytest.mark.parametrize("override, message", [
    ("moe_router_fusion=true", r"moe_router_fusion=true with routing replay: TransformerEngine's fused top-k"),
    ("moe_enable_routing_replay=false", r"moe_enable_routing_replay=false with routing replay"),
    ("moe_router_load_balancing_type=sinkhorn", r"'sinkhorn' with routing replay: sinkhorn routing bypasses"),
])
def test_what_megatron_replay_cannot_run_with_is_a_start_up_error(override, message):
    key = "+actor_rollout_ref.actor.megatron.override_transformer_config."
    with pytest.raises(ConfigError, match=message):
        _load(f"{MODE}=R2", key + override, config_name="ppo_megatron_trainer")


def test_replay_under_megatron_recompute_loads():
    # the recomputed layers route as their forward did (routing.py; test_megatron_routing_replay.py)
    key = "+actor_rollout_ref.actor.megatron.override_transformer_config."
    cfg = _load(f"{MODE}=R3", RECORD, key + "recompute_granularity=full", key + "recompute_method=uniform",
                key + "recompute_num_layers=1", config_name="ppo_megatron_trainer")
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config["recompute_granularity"] == "full"


def test_r2_turns_the_automatic_reuse_of_rollout_log_probs_off():
    # one mini-batch a step: the HF rollout's log-probs stand in for the old-log-prob pass, unless R2 needs that pass
    one = "actor_rollout_ref.actor.ppo_mini_batch_size=16"
    auto = resolve_config(_load(one), steps_per_epoch=1, cuda_available=False)
    r2 = resolve_config(_load(one, f"{MODE}=R2"), steps_per_epoch=1, cuda_available=False)
    assert (auto.actor_rollout_ref.actor.use_rollout_log_probs, r2.actor_rollout_ref.actor.use_rollout_log_probs) == (
        True, False)
