"""The packaged overlay configs parse, validate and resolve to what their headers promise.

``arithmetic_ppo`` also trains end to end in ``test_e2e_algorithms.py`` (PPO + critic); the GSM8K GPU
recipe cannot run here (no GPU, no Qwen weights), so it is checked up to the point where a GPU run
would start loading models: config, start-up file checks with a placeholder model directory, and
resolution as on a CUDA machine.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from rlfoundry.trainer.config import (
    CONFIG_DIR,
    ConfigError,
    check_startup_paths,
    load_config,
    need_reference_policy,
    resolve_config,
)
from tests.trainer import _e2e as E


def test_arithmetic_ppo_is_the_demo_with_gae_and_a_critic():
    default, ppo = load_config([]), load_config([], config_name="arithmetic_ppo")
    resolved = resolve_config(ppo, steps_per_epoch=40, cuda_available=False)
    assert resolved.algorithm.adv_estimator == "gae" and resolved.critic.enable is True
    assert resolved.critic.model.path.endswith("assets/arithmetic-policy")  # the policy's own backbone
    # everything else is the default run: same task, data, policy, batch sizes
    for key in ("data", "actor_rollout_ref", "reward_model"):
        assert OmegaConf.to_container(ppo[key]) == OmegaConf.to_container(default[key]), key
    assert ppo.trainer.experiment_name == "arithmetic-ppo"


@pytest.fixture()
def gsm8k_gpu(tiny_model_dir, tmp_path):
    """The GPU recipe with a placeholder local model dir and data paths, as a user would override them."""
    return load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.default_local_dir={tmp_path}"],
                       config_name="gsm8k_grpo_gpu")


def test_gsm8k_gpu_recipe_validates_and_resolves_for_cuda(gsm8k_gpu, tiny_model_dir):
    # start-up file checks: model dir exists and is an HF directory; no critic needed. The vLLM
    # engine is checked there too: without it installed, the header's rollout.name=hf variant passes.
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="needs the 'vllm' package"):
            check_startup_paths(gsm8k_gpu)
        check_startup_paths(load_config([f"actor_rollout_ref.model.path={tiny_model_dir}",
                                         "actor_rollout_ref.rollout.name=hf"], config_name="gsm8k_grpo_gpu"))
    else:
        check_startup_paths(gsm8k_gpu)
    resolved = resolve_config(gsm8k_gpu, steps_per_epoch=29, cuda_available=True)
    arr = resolved.actor_rollout_ref
    assert resolved.trainer.device == "cuda" and resolved.trainer.worker_backend == "local"
    assert resolved.algorithm.adv_estimator == "grpo" and resolved.critic.enable is False
    assert arr.rollout.name == "vllm" and arr.actor.strategy == "fsdp2" and arr.ref.strategy == "fsdp2"
    assert need_reference_policy(resolved) and arr.actor.use_kl_loss and not resolved.algorithm.use_kl_in_reward
    assert resolved.trainer.total_training_steps == 29 * 15
    assert resolved.data.train_files == "~/data/gsm8k/train.parquet"  # the data loader expands ~


@pytest.mark.parametrize("gpus, ok", [(1, True), (2, True), (4, True), (8, False)])
def test_gsm8k_gpu_recipe_batch_arithmetic_per_gpu_count(tiny_model_dir, gpus, ok):
    # 64 prompts × n=5 = 320 samples per mini-batch; micro-batches of 16 per GPU need 320/gpus % 16 == 0
    args = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.n_gpus_per_node={gpus}"]
    if ok:
        load_config(args, config_name="gsm8k_grpo_gpu")
        return
    with pytest.raises(ConfigError, match="does not divide the 40 samples"):
        load_config(args, config_name="gsm8k_grpo_gpu")
    load_config([*args, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"], config_name="gsm8k_grpo_gpu")


def test_config_name_on_the_command_line_selects_the_overlay(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlfoundry", "train", "--config-name", "gsm8k_grpo_gpu",
                           "--cfg", "job"], capture_output=True, text=True, env=E.subprocess_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = OmegaConf.create(proc.stdout)
    assert printed.algorithm.adv_estimator == "grpo" and printed.actor_rollout_ref.rollout.n == 5
    assert printed.actor_rollout_ref.model.path == "~/models/Qwen2.5-0.5B-Instruct"


def test_every_packaged_overlay_loads():
    overlays = sorted(CONFIG_DIR.glob("*.yaml"))  # every packaged YAML is an overlay: the defaults are the schema
    assert {p.stem for p in overlays} >= {"arithmetic_ppo", "gsm8k_grpo_gpu"}
    for path in overlays:
        load_config([], config_name=path.stem)
