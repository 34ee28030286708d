"""``rlfoundry plan`` on packaged configs and on a model that does not fit; the trainer's start-up check."""

from __future__ import annotations

import json

import pytest

from rlfoundry.cli import main as cli
from rlfoundry.plan.model import load_shape, param_counts
from rlfoundry.trainer.config import resolve_asset_path
from tests.plan.configs import QWEN25_7B, QWEN25_32B, QWEN25_72B, write_config


def _plan_json(capsys, *args: str) -> tuple[int, dict]:
    code = cli(["plan", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_packaged_config_fits_on_one_h100(capsys):
    code, out = _plan_json(capsys, "--config-name", "ppo_trainer", "--gpu", "h100-80g")
    assert code == 0 and out["fits"] is True
    # the model figures are the packaged policy's config.json, counted by the same formula
    shape = load_shape(resolve_asset_path("rlfoundry://arithmetic-policy"))
    assert out["model"]["params_total"] == param_counts(shape)[0]
    pool = out["pools"][0]
    peak = max(pool["phases"], key=lambda p: p["bytes"])
    assert out["worst"]["bytes"] == peak["bytes"] == sum(peak["device"].values())
    assert out["headroom_bytes"] == out["capacity_bytes"] - peak["bytes"]


def test_ppo_with_critic_plans_the_critic_phases(capsys):
    code, out = _plan_json(capsys, "--config-name", "arithmetic_ppo", "--gpu", "a100-80g")
    names = [p["name"] for p in out["pools"][0]["phases"]]
    assert code == 0 and {"critic values", "critic update", "actor update"} <= set(names)
    assert out["times_s"]["update_critic"] > 0


def test_a_7b_that_does_not_fit_gets_fixes_that_fit(tmp_path, capsys):
    model = write_config(tmp_path / "qwen7b", QWEN25_7B)
    args = ["--gpu", "h100-80g", f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=8",
            "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_prompt_length=1024",
            "data.max_response_length=4096", "actor_rollout_ref.rollout.name=vllm"]
    code, out = _plan_json(capsys, *args)
    # 8 × 5120 tokens × 28 layers × 196,608 bytes of activations alone = 210 GiB > 79.6 GiB
    assert code == 1 and out["fits"] is False and out["worst"]["phase"] == "actor update"
    fixes = {tuple(f["overrides"]): f for f in out["fixes"]}
    assert fixes and all(f["fits"] and f["peak_bytes"] <= out["capacity_bytes"] for f in fixes.values())
    # each fix re-plans to the same answer as the command line with its overrides
    first = next(iter(fixes))
    code2, again = _plan_json(capsys, *args, *first)
    assert code2 == 0 and again["worst"]["bytes"] == fixes[first]["peak_bytes"]


def test_vllm_rollout_is_planned_at_tensor_parallel_size_1(tmp_path, capsys):
    """The hybrid vLLM engine runs one TP-1 engine per rank whatever rollout.tensor_model_parallel_size says
    (workers/rollout/vllm_rollout.py): a 32B's bf16 weights (65.5 GB) exceed 0.6 × 79.6 GiB on every GPU, at
    TP 4 as at TP 1, and the fix offered is the HF engine on the actor's own sharded weights."""
    model = write_config(tmp_path / "qwen32b", QWEN25_32B)
    args = ["--gpu", "h100-80g", f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=8",
            "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]
    code1, tp1 = _plan_json(capsys, *args, "actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    code4, tp4 = _plan_json(capsys, *args, "actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    assert code1 == code4 == 1 and tp1["worst"] == tp4["worst"]
    assert any("tensor_parallel_size=1 here" in p for p in tp4["problems"]), tp4["problems"]
    assert [f["overrides"] for f in tp4["fixes"]] == [["actor_rollout_ref.rollout.name=hf"]] and tp4["fixes"][0]["fits"]


def test_unknown_gpu_is_a_message(capsys):
    assert cli(["plan", "--gpu", "h1000"]) == 2
    err = capsys.readouterr().err
    assert "--gpu h1000" in err and "h100-80g" in err and "Traceback" not in err


def test_startup_refuses_a_72b_config_only_directory_by_the_plan(tmp_path, capsys):
    model = write_config(tmp_path / "qwen72b", QWEN25_72B)
    args = ["train", f"actor_rollout_ref.model.path={model}", "trainer.device=cpu", f"trainer.run_dir={tmp_path}/run"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    # 72.7e9 parameters × 16 bytes of fp32 weights, gradients and moments = 1083 GiB: no host holds it
    assert "does not fit" in err and "rank 0" in err and "trainer.plan_check=false" in err
    assert "enable_gradient_checkpointing=true" in err and "actor optimizer" in err
    assert "safetensors" not in err and "Traceback" not in err
    # switched off, the run goes on to the weights check, which refuses for the missing weights
    assert cli([*args, "trainer.plan_check=false"]) == 2
    assert "safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["trainer.plan_check"])
def test_plan_check_key_is_documented(key):
    from pathlib import Path

    assert key in (Path(__file__).parents[2] / "docs" / "plan.md").read_text()


@pytest.mark.parametrize("name", ["ppo_megatron_trainer", "one_step_off_ppo_trainer", "vision_grpo", "gsm8k_multiturn_grpo"])
def test_packaged_configs_are_planned(capsys, name):
    code, out = _plan_json(capsys, "--config-name", name, "--no-fixes")
    assert code == 0 and out["fits"] is True
    for pool in out["pools"]:  # every phase's total is its items' sum, and the worst is the largest phase
        assert all(p["bytes"] == sum(p["device"].values()) for p in pool["phases"])
    assert out["worst"]["bytes"] == max(p["bytes"] for pool in out["pools"] for p in pool["phases"])
