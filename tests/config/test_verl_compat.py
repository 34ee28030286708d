"""verl's other spellings (config/verl_compat.py and the start-up checks in trainer/config.py): each key
reaches the place that reads it, two spellings of one setting must agree, and what is not built is a
start-up error naming it (issue 46)."""

from __future__ import annotations

import datetime
import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlfoundry.config.training_engines import engine_plugin
from rlfoundry.trainer.config import ConfigError, NoEffectKeyWarning, load_config, resolve_config


def _load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(list(overrides))


def _resolved(*overrides: str):
    return resolve_config(_load(*overrides), steps_per_epoch=10, cuda_available=False)


def _no_effect_warning(*overrides: str) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(list(overrides))
    texts = [str(w.message) for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    return texts[0] if texts else ""


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(list(overrides))
    return str(e.value)


# ───────────────────────────── optim.clip_grad ─────────────────────────────


def _actor_request(resolved, monkeypatch):
    """The EngineRequest the actor worker builds its engine from (workers/actor_rollout_ref.py)."""
    from rlfoundry.workers.actor_rollout_ref import ActorRolloutRefWorker

    seen = {}
    plugin = engine_plugin("fsdp")
    monkeypatch.setattr(type(plugin), "build", lambda self, request, device, role: seen.setdefault("r", request))
    arr = resolved.actor_rollout_ref
    fake = SimpleNamespace(config=arr, lora=None, device="cpu")
    ActorRolloutRefWorker._build_engine(fake, arr.actor, True, "actor")
    return seen["r"]


def test_optim_clip_grad_is_the_grad_clip_the_engines_apply(monkeypatch):
    from rlfoundry.engines.fsdp.engine import FSDPEngineConfig
    from rlfoundry.workers.critic import CriticWorker

    r = _resolved("actor_rollout_ref.actor.optim.clip_grad=0.5", "critic.optim.clip_grad=0.25",
                  "critic.model.path=/some/critic", "algorithm.adv_estimator=gae")
    assert (r.actor_rollout_ref.actor.grad_clip, r.critic.grad_clip) == (0.5, 0.25)
    request = _actor_request(r, monkeypatch)
    assert request.grad_clip == 0.5
    # the FSDP engine's clip (engine.py: clip_grad_norm_(..., self.config.grad_clip)) is the request's
    assert FSDPEngineConfig.for_model(request.model, request.fsdp, request.optim, request.grad_clip).grad_clip == 0.5
    fake = SimpleNamespace(config=r.critic, _model_path=lambda: "/some/critic", _zero_new_head=None)
    assert CriticWorker._engine_request(fake).grad_clip == 0.25


def test_clip_grad_and_grad_clip_given_different_values_is_an_error():
    assert "optim.clip_grad (verl) and actor_rollout_ref.actor.grad_clip" in _error(
        "actor_rollout_ref.actor.optim.clip_grad=0.5", "actor_rollout_ref.actor.grad_clip=0.3")
    r = _resolved("actor_rollout_ref.actor.optim.clip_grad=0.5", "actor_rollout_ref.actor.grad_clip=0.5")
    assert r.actor_rollout_ref.actor.grad_clip == 0.5


# ───────────────────────────── actor_rollout_ref.nccl_timeout ─────────────────────────────


def test_nccl_timeout_is_the_timeout_of_init_process_group(monkeypatch):
    from rlfoundry.single_controller.base import worker as worker_mod
    from rlfoundry.trainer.main_ppo import _runtime

    r = _resolved("actor_rollout_ref.nccl_timeout=1800")
    assert r.trainer.dist_timeout_s == 1800
    seen = {}
    monkeypatch.setattr(worker_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(worker_mod.dist, "TCPStore", lambda *a, **k: "store")
    monkeypatch.setattr(worker_mod.dist, "init_process_group", lambda **k: seen.update(k))
    monkeypatch.setattr(worker_mod, "_close_at_exit", lambda: None)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    worker_mod.Worker(_runtime(r)).init_distributed()
    assert seen["timeout"] == datetime.timedelta(seconds=1800)
    assert "trainer.dist_timeout_s" in _error("actor_rollout_ref.nccl_timeout=1800", "trainer.dist_timeout_s=600")


# ───────────────────────────── Megatron's schedule keys ─────────────────────────────


def _lrs(optim, steps: int) -> list[float]:
    """The learning rate after each of ``steps`` optimiser steps, from the engines' scheduler."""
    from rlfoundry.engines.fsdp.utils import build_lr_scheduler

    sched = build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr), optim)
    return [optim.lr * sched.lr_lambdas[0](step) for step in range(steps)]


def test_megatron_decay_style_min_lr_and_warmup_init_shape_the_schedule():
    r = _resolved("actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
                  "actor_rollout_ref.actor.optim.min_lr=1e-6", "actor_rollout_ref.actor.optim.lr_warmup_init=2e-6",
                  "actor_rollout_ref.actor.optim.lr_warmup_steps=2", "trainer.total_training_steps=10")
    optim = r.actor_rollout_ref.actor.optim
    assert optim.lr_scheduler_type == "cosine" and optim.min_lr_ratio == pytest.approx(0.1)
    lrs = _lrs(optim, 11)
    # warm-up from 2e-6 to 1e-5 over 2 steps: 2e-6, 6e-6; then cosine from 1e-5 to 1e-6 over steps 2..10:
    # step 6 (half way) = 1e-6 + 9e-6 / 2 = 5.5e-6, step 10 = 1e-6
    assert lrs[:3] == pytest.approx([2e-6, 6e-6, 1e-5])
    assert lrs[6] == pytest.approx(5.5e-6)
    assert lrs[4] == pytest.approx(1e-6 + 9e-6 * (1 + math.cos(math.pi / 4)) / 2)
    assert lrs[10] == pytest.approx(1e-6)


def test_megatron_schedules_not_built_are_errors_naming_them():
    assert "WSD learning-rate decay is not built" in _error("actor_rollout_ref.actor.optim.lr_decay_style=WSD")
    assert "weight-decay schedules are not built" in _error("actor_rollout_ref.actor.optim.weight_decay_incr_style=linear")
    assert "disagree" in _error("actor_rollout_ref.actor.optim.min_lr=1e-7", "actor_rollout_ref.actor.optim.min_lr_ratio=0.5")


# ───────────────────────────── override_optimizer_config ─────────────────────────────


def test_override_optimizer_config_reaches_adamw():
    from rlfoundry.engines.fsdp.utils import build_optimizer

    r = _resolved("+actor_rollout_ref.actor.optim.override_optimizer_config.amsgrad=true")
    optimizer = build_optimizer(torch.nn.Linear(2, 2), r.actor_rollout_ref.actor.optim)
    assert optimizer.param_groups[0]["amsgrad"] is True
    plain = build_optimizer(torch.nn.Linear(2, 2), _resolved().actor_rollout_ref.actor.optim)
    assert plain.param_groups[0]["amsgrad"] is False


def test_override_optimizer_config_offload_on_fsdp_and_unknown_keys_are_errors():
    key = "+actor_rollout_ref.actor.optim.override_optimizer_config"
    text = _error(f"{key}.optimizer_cpu_offload=True", f"{key}.optimizer_offload_fraction=1")
    assert "['optimizer_cpu_offload', 'optimizer_offload_fraction'] are megatron-core's CPU optimizer" in text
    assert "not torch.optim.AdamW arguments (strategy=fsdp)" in text and "fsdp_config.optimizer_offload" in text
    assert "['amsgrd'] are not torch.optim.AdamW arguments" in _error(f"{key}.amsgrd=true")
    assert "set it as optim.lr" in _error(f"{key}.lr=0.1")


# verl's Megatron example scripts (examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh and six more at
# b178a3cd5, recipe/dapo's gpt-oss and qwen3-next at 21892b92): megatron-core's CPU optimizer, as they set it
VERL_OPTIMIZER_OFFLOAD = ("optimizer_offload_fraction=1.", "overlap_cpu_optimizer_d2h_h2d=True",
                          "use_precision_aware_optimizer=True", "optimizer_cpu_offload=True")


def _megatron_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(list(overrides), config_name="ppo_megatron_trainer")
    return str(e.value)


def test_verls_megatron_optimizer_offload_keys_validate_on_the_command_line(tmp_path):
    """``python -m rlfoundry.trainer.main_ppo --config-name ppo_megatron_trainer ... --cfg job`` with the
    scripts' keys on the actor (and a critic's, which takes the same), verl's ``megatron.*_offload`` on too."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from tests.trainer import _e2e as E

    pytest.importorskip("megatron.core")
    args = [f"+{role}.optim.override_optimizer_config.{k}" for role in ("actor_rollout_ref.actor", "critic")
            for k in VERL_OPTIMIZER_OFFLOAD]
    args += [f"actor_rollout_ref.actor.megatron.{k}_offload=True" for k in ("param", "grad", "optimizer")]
    proc = subprocess.run([sys.executable, "-m", "rlfoundry.trainer.main_ppo", "--config-name", "ppo_megatron_trainer",
                           "algorithm.adv_estimator=gae", "critic.model.path=Qwen/Qwen3-8B", *args, "--cfg", "job"], capture_output=True, text=True,
                          env=E.subprocess_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = OmegaConf.create(proc.stdout)
    for role in (printed.actor_rollout_ref.actor, printed.critic):
        assert role.strategy == "megatron"
        assert dict(role.optim.override_optimizer_config) == {
            "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
            "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}


def test_megatron_optimizer_offload_combinations_megatron_core_cannot_take_are_errors_naming_the_key():
    pytest.importorskip("megatron.core")
    key = "actor_rollout_ref.actor.optim.override_optimizer_config"
    verl = [f"+{key}.{k}" for k in VERL_OPTIMIZER_OFFLOAD]
    for bad in ("1.5", "-0.1", "half"):
        text = _megatron_error(*verl, f"{key}.optimizer_offload_fraction={bad}")
        assert f"{key}.optimizer_offload_fraction={bad}: " in text and "a number in [0, 1]" in text
    text = _megatron_error(*verl, f"{key}.use_precision_aware_optimizer=False")
    assert f"{key}.optimizer_cpu_offload=True needs {key}.use_precision_aware_optimizer=True, as Megatron-LM" in text
    text = _megatron_error(*verl, "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False")
    assert "use_precision_aware_optimizer=true needs actor_rollout_ref.actor.megatron.use_distributed_optimizer=True" in text
    text = _megatron_error(*verl, "actor_rollout_ref.actor.megatron.dtype=float32")
    assert "optimizer_cpu_offload=True with actor_rollout_ref.actor.megatron.dtype=float32" in text
    assert "torch.optim refuses them" in text
    text = _megatron_error(*verl, f"+{key}.decoupled_weight_decay=False")
    assert f"{key}.decoupled_weight_decay=False with optimizer_cpu_offload=True" in text
    critic = [f"+critic.optim.override_optimizer_config.{k}" for k in VERL_OPTIMIZER_OFFLOAD]
    text = _megatron_error("algorithm.adv_estimator=gae", *critic, "critic.optim.override_optimizer_config."
                           "optimizer_offload_fraction=2")
    assert "critic.optim.override_optimizer_config.optimizer_offload_fraction=2: " in text
    # another optimizer than Adam (megatron-core's CPU optimizer has an SGD too): only AdamW is built here
    assert "only AdamW" in _megatron_error(*verl, "actor_rollout_ref.actor.optim.optimizer=SGD")


def test_megatron_overrides_are_optimizer_config_fields():
    pytest.importorskip("megatron.core")
    from rlfoundry.trainer.config import _check_optimizer_overrides

    key = "actor_rollout_ref.actor.optim"
    assert _check_optimizer_overrides(key, {"barrier_with_L1_time": False, "loss_scale_window": 500.0}, "megatron") == []
    errors = _check_optimizer_overrides(key, {"use_precision_aware_optimizer": True, "nope": 1}, "megatron")
    assert any("['nope'] are not megatron-core OptimizerConfig fields" in e for e in errors)
    if __import__("importlib").util.find_spec("transformer_engine") is None:
        assert any("use_precision_aware_optimizer=true needs TransformerEngine" in e for e in errors)
        # megatron-core's CPU optimizer takes its place and needs none
        assert _check_optimizer_overrides(key, {"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True},
                                          "megatron") == []


# ───────────────────────────── profiler keys ─────────────────────────────


def test_both_profiler_layouts_are_accepted_and_named_as_no_effect():
    text = _no_effect_warning(
        "actor_rollout_ref.actor.profiler.enable=True", "actor_rollout_ref.actor.profiler.tool_config.npu.level=level1",
        "critic.profiler.all_ranks=True", "global_profiler.tool=nsys", "global_profiler.steps=[1,2]",
        "global_profiler.global_tool_config.nsys.discrete=True", "global_profiler.finish_hook_cmd=true")
    for key in ("actor_rollout_ref.actor.profiler.enable", "actor_rollout_ref.actor.profiler.tool_config.npu.level",
                "global_profiler.tool", "global_profiler.steps", "global_profiler.global_tool_config.nsys.discrete",
                "global_profiler.finish_hook_cmd"):
        assert key in text
    assert _resolved("global_profiler.tool=nsys", "global_profiler.steps=[1,2]").trainer.profile_steps is None


def test_global_profiler_torch_is_the_step_profiler(tmp_path):
    from rlfoundry.utils.profiler import profile_dir

    r = _resolved("global_profiler.tool=torch", "global_profiler.steps=[2,3]", f"global_profiler.save_path={tmp_path}")
    assert r.trainer.profile_steps == [2, 3]
    assert profile_dir(r) == tmp_path  # ray_trainer's StepProfiler writes there
    assert profile_dir(_resolved("trainer.profile_steps=[1]")) == Path(_resolved().trainer.run_dir) / "profile"
    assert "global_profiler.steps" not in _no_effect_warning("global_profiler.tool=torch", "global_profiler.steps=[2]")
    assert "trainer.profile_steps" in _error("global_profiler.tool=torch", "global_profiler.steps=[2]",
                                             "trainer.profile_steps=[3]")


# ───────────────────────────── reward loop keys ─────────────────────────────


def test_reward_loop_workers_are_the_scorer_processes_and_its_engine_keys_are_named():
    r = _resolved("reward_model.num_workers=4")
    assert r.reward_model.reward_kwargs["num_workers"] == 4
    assert "reward.num_workers" in _error("reward_model.num_workers=4", "reward.num_workers=8")
    text = _no_effect_warning("reward_model.use_reward_loop=True", "reward_model.rollout.name=vllm",
                              "reward_model.rollout.gpu_memory_utilization=0.8", "reward_model.enable_resource_pool=true")
    for key in ("rollout.gpu_memory_utilization", "enable_resource_pool"):
        assert f"reward_model.{key}" in text
    assert "reward_model.use_reward_loop" not in text  # it decides the reward with a custom function (below)


def test_reward_loop_with_a_custom_function_serves_the_model_and_the_legacy_path_stays(tmp_path):
    from rlfoundry.config.verl_compat import serves_reward_model

    fn = tmp_path / "fn.py"
    fn.write_text("def compute_score(**kw):\n    return 0.0\n")
    keys = ("reward_model.enable=true", "reward_model.model.path=/rm", f"custom_reward_function.path={fn}")
    assert serves_reward_model(_load(*keys))  # verl's default: the model served to the function
    # its engine keys take effect then (the server's engine); with the legacy path they do not
    assert "reward_model.rollout.response_length" not in _no_effect_warning(*keys, "reward_model.rollout.response_length=8")
    assert "reward_model.rollout.response_length" in _no_effect_warning(*keys, "reward_model.use_reward_loop=false",
                                                                         "reward_model.rollout.response_length=8")
    pool = ("reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=1", "reward_model.nnodes=1")
    assert "reward_model.enable_resource_pool" not in _no_effect_warning(*keys, *pool)  # its own pool (trainer)
    assert "reward_model.enable_resource_pool" in _no_effect_warning(*keys, *pool, "reward_model.use_reward_loop=false")
    assert "needs nnodes >= 1" in _error(*keys, "reward_model.enable_resource_pool=true", "reward_model.nnodes=0")
    assert not serves_reward_model(_load(*keys, "reward_model.use_reward_loop=false"))  # the classifier's score replaces it
    assert not serves_reward_model(_load(*keys, "+reward_model.reward_kwargs.rm_combine=add"))  # rlfoundry's sum


# ───────────────────────────── model, rollout and data keys ─────────────────────────────


def test_actor_freeze_vision_tower_is_the_models():
    from rlfoundry.engines.fsdp.engine import FSDPEngineConfig

    model = _resolved("actor_rollout_ref.actor.freeze_vision_tower=True").actor_rollout_ref.model
    assert model.freeze_vision_tower is True
    assert FSDPEngineConfig.for_model(model, None).freeze_vision_tower is True
    assert "freeze_vision_tower" in _error("actor_rollout_ref.actor.freeze_vision_tower=True",
                                           "actor_rollout_ref.model.freeze_vision_tower=False")


def test_prefix_grouper_is_the_shared_prompt_forward(monkeypatch):
    r = _resolved("actor_rollout_ref.actor.use_prefix_grouper=False")
    assert r.actor_rollout_ref.model.use_shared_prompt is False
    assert _actor_request(r, monkeypatch).use_shared_prompt is False  # what the engine is built with
    assert _actor_request(_resolved("actor_rollout_ref.actor.use_prefix_grouper=True"), monkeypatch).use_shared_prompt


def test_rollout_replica_layout_runs_one_engine_per_rank_and_over_sampling_has_no_effect():
    key = "actor_rollout_ref.rollout"
    with pytest.warns(UserWarning, match=rf"{key}.tensor_model_parallel_size=2, {key}.data_parallel_size=2, "
                      rf"{key}.expert_parallel_size=4 with rollout.name=vllm: the engine runs one replica per rank"):
        cfg = load_config([f"{key}.name=vllm", f"{key}.tensor_model_parallel_size=2", f"{key}.data_parallel_size=2",
                           f"{key}.expert_parallel_size=4"])
    assert cfg.actor_rollout_ref.rollout.data_parallel_size == 2  # kept as given; the engine builds TP/DP/EP 1
    # with the HF engine they have no effect at all (the vLLM/SGLang-only keys)
    assert f"{key}.data_parallel_size" in _no_effect_warning(f"{key}.data_parallel_size=2")
    # verl's SAPO scripts add policy_loss.tau_pos/tau_neg, which its sapo loss never reads (it reads actor.tau_*)
    warned = _no_effect_warning("+actor_rollout_ref.actor.policy_loss.tau_pos=2.0",
                                "+actor_rollout_ref.actor.policy_loss.tau_neg=2.5")
    assert "actor_rollout_ref.actor.policy_loss.tau_pos" in warned and "policy_loss.tau_neg" in warned
    assert _resolved("+actor_rollout_ref.actor.policy_loss.tau_pos=2.0").actor_rollout_ref.actor.tau_pos == 1.0
    # verl declares over_sample_rate and reads it nowhere: accepted, with the no-effect warning
    assert f"{key}.over_sample_rate" in _no_effect_warning(f"{key}.over_sample_rate=0.1")
    # a DAPO recipe script adds data.min_response_length, which nothing in verl reads
    assert "data.min_response_length" in _no_effect_warning("+data.min_response_length=4096")
    _load(f"{key}.data_parallel_size=1", f"{key}.expert_parallel_size=1", f"{key}.over_sample_rate=0")


def test_return_multi_modal_inputs_and_prometheus_are_accepted_as_no_effect():
    text = _no_effect_warning("data.return_multi_modal_inputs=False", "actor_rollout_ref.rollout.prometheus.enable=true",
                              "+actor_rollout_ref.rollout.prometheus.port=9090")
    for key in ("data.return_multi_modal_inputs", "rollout.prometheus.enable", "rollout.prometheus.port"):
        assert key in text


def test_rollout_server_limits_are_accepted_as_no_effect():
    # verl's examples/sglang_multiturn server config sets these; no verl code reads them
    text = _no_effect_warning("actor_rollout_ref.rollout.server.timeout=60",
                              "actor_rollout_ref.rollout.server.max_start_wait_time=300.0")
    assert "rollout.server.timeout" in text and "rollout.server.max_start_wait_time" in text


def test_lora_adapter_path_alone_takes_the_adapters_rank_alpha_and_targets(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}))
    model = _resolved(f"actor_rollout_ref.model.lora_adapter_path={tmp_path}").actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, list(model.target_modules)) == (8, 32, ["q_proj", "v_proj"])
    mine = _resolved(f"actor_rollout_ref.model.lora_adapter_path={tmp_path}", "actor_rollout_ref.model.lora_alpha=4")
    assert (mine.actor_rollout_ref.model.lora_rank, mine.actor_rollout_ref.model.lora_alpha) == (8, 4)


def test_dynamic_batch_budget_is_per_gpu_times_the_ulysses_size():
    base = ("data.max_prompt_length=1024", "data.max_response_length=1024", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512", "actor_rollout_ref.model.use_remove_padding=true",
            "trainer.n_gpus_per_node=4", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    _load(*base, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4")  # 512 × 4 = 2048: one sequence fits
    text = _error(*base, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    assert "ppo_max_token_len_per_gpu=512 × actor.ulysses_sequence_parallel_size 2 is below one full sequence" in text



def test_megatron_dynamic_batch_budget_is_per_gpu_times_the_context_parallel_size():
    base = ("data.max_prompt_length=1024", "data.max_response_length=1024", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512", "actor_rollout_ref.actor.strategy=megatron",
            "trainer.n_gpus_per_node=4", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.save_freq=-1")
    cp = "actor_rollout_ref.{}.megatron.context_parallel_size={}"
    _load(*base, cp.format("actor", 4), cp.format("ref", 4))  # 512 × 4 = 2048: one sequence fits
    text = _error(*base, cp.format("actor", 2), cp.format("ref", 2))
    assert "ppo_max_token_len_per_gpu=512 × actor.megatron.context_parallel_size 2 is below one full sequence" in text

# ───────────────────────────── the August 2026 layout ─────────────────────────────


def test_august_fsdp_config_ulysses_size_is_the_roles():
    r = _resolved("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                  "actor_rollout_ref.model.use_remove_padding=true", "trainer.n_gpus_per_node=2")
    assert r.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert r.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2  # follows the actor's, as before


def test_august_fsdp_config_torch_compile_is_the_roles():
    r = _resolved("actor_rollout_ref.actor.fsdp_config.use_torch_compile=true",
                  "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false")
    assert (r.actor_rollout_ref.actor.use_torch_compile, r.actor_rollout_ref.ref.use_torch_compile) == (True, False)
    assert "one setting and were given different values" in _error(
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=true", "actor_rollout_ref.actor.use_torch_compile=false")
    _load("critic.model.fsdp_config.use_torch_compile=false")  # what the critic does: nothing compiled
    assert "built for the actor and the reference only" in _error("critic.model.fsdp_config.use_torch_compile=true")


def test_august_megatron_router_replay_is_the_actors():
    r = _resolved("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
                  "actor_rollout_ref.actor.megatron.router_replay.mode=R2")
    assert r.actor_rollout_ref.actor.router_replay.mode == "R2"
    assert "one setting and were given different values" in _error(
        "actor_rollout_ref.actor.megatron.router_replay.mode=R2", "actor_rollout_ref.actor.router_replay.mode=R3")
    assert "the critic routes by its own router" in _error("critic.megatron.router_replay.mode=R2")


def test_override_attention_runs_as_sdpa_or_is_refused(tiny_model_dir):
    from rlfoundry.models.hf import load_hf_model

    _load("+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2")  # verl's default
    assert "runs as SDPA" in _error("+actor_rollout_ref.model.override_config.attn_implementation=eager")
    model = load_hf_model(tiny_model_dir, override_config={"attn_implementation": "flash_attention_2"})
    assert model.config._attn_implementation == "sdpa"  # before: the key was set on the config and never read
    with pytest.raises(ValueError, match="attn_implementation=eager"):
        load_hf_model(tiny_model_dir, override_config={"attn_implementation": "eager"})


def test_august_mtp_and_megatron_fsdp_beside_offload_are_start_up_errors_naming_the_feature():
    _load("actor_rollout_ref.model.mtp.enable=false", "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.2")
    # MTP trains on the Megatron engine (tests/engines/test_megatron_mtp.py); FSDP names the engine to use
    assert "strategy=megatron" in _error("actor_rollout_ref.model.mtp.enable=true")
    # the HF rollout drafts with a MiMo's MTP layers (tests/workers/test_mtp_speculative.py); this model has none
    assert "built for MiMo's MTP layers" in _error("actor_rollout_ref.model.mtp.enable_rollout=true")
    fsdp = ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.megatron.use_megatron_fsdp={}")
    _load(fsdp[0], fsdp[1].format("false"))
    two = "trainer.n_gpus_per_node=2"
    _load(fsdp[0], fsdp[1].format("true"), two)  # built (tests/engines/test_megatron_fsdp.py); not beside offload
    assert "not built over one" in _error(fsdp[0], fsdp[1].format("true"))  # one data-parallel rank
    assert "Megatron-FSDP" in _error(fsdp[0], fsdp[1].format("true"), two,
                                     "actor_rollout_ref.actor.megatron.param_offload=true")
    assert "no pipeline stages" in _error(*fsdp[:1], fsdp[1].format("true"), *(
        f"actor_rollout_ref.{r}.megatron.pipeline_model_parallel_size=2" for r in ("actor", "ref")),
        "trainer.n_gpus_per_node=2")
    assert "compute_prox_log_prob" in _error(*fsdp[:1], fsdp[1].format("true"), two,
                                             "+async_training.trigger_parameter_sync_step=2")
    assert "a quantised rollout" in _error("+actor_rollout_ref.rollout.quantization=fp8")


def test_verls_qat_keys_load_and_enabling_qat_names_it_per_place():
    """verl (Aug 2026)'s quantisation-aware training keys, as recipe/qat/config/dapo_qat_trainer.yaml sets them."""
    patterns = "'actor_rollout_ref.actor.fsdp_config.qat.ignore_patterns=[\"lm_head\", \"re:.*mlp.gate$\"]'"
    cfg = _load("actor_rollout_ref.actor.fsdp_config.qat.mode=w4a16", patterns.strip("'"))
    assert cfg.actor_rollout_ref.actor.fsdp_config.qat.ignore_patterns == ["lm_head", "re:.*mlp.gate$"]
    for place in ("actor_rollout_ref.actor", "actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.megatron",
                  "critic.model.fsdp_config", "critic.megatron"):
        message = _error(f"{place}.qat.enable=true")
        assert f"{place}.qat.enable=true: quantisation-aware training" in message and "not built" in message


def test_moe_tensor_parallel_size_keeps_verls_trtllm_rule():
    key = "actor_rollout_ref.rollout.moe_tensor_parallel_size"
    assert _load(f"{key}=1").actor_rollout_ref.rollout.moe_tensor_parallel_size == 1
    message = _error(f"{key}=2", "actor_rollout_ref.rollout.name=vllm")
    assert f"{key}=2" in message and "trtllm" in message and f"{key}=1" in message
    assert "Traceback" not in message


def test_august_trainer_v1_and_distillation():
    assert "trainer.use_v1" in _no_effect_warning("trainer.use_v1=true")
    assert "v1 asynchronous trainer modes are not built" in _error("trainer.v1.trainer_mode=separate_async")
    # on: a teacher is needed (docs/distillation.md); off: the group's keys are read by nobody, as in verl
    assert "distillation.teacher_models: model_path is not set" in _error("distillation.enabled=true")
    _load("distillation.enabled=false", "distillation.distillation_loss.loss_mode=k1")


# ───────────────────────────── loggers ─────────────────────────────


def test_a_quoted_logger_list_is_read_as_the_list_it_spells():
    """verl's geo3k fully-async scripts pass ``trainer.logger='[console,wandb]'`` with the quotes: one string,
    which verl's tracker refuses; here it is the list, with a warning that says how to write it."""
    with pytest.warns(UserWarning, match=r"read as the list \['console', 'file'\].*write trainer.logger=\[console,file\]"):
        cfg = load_config(["trainer.logger='[console, \"file\"]'"])
    assert list(cfg.trainer.logger) == ["console", "file"]
    assert "'[console,nope]'" not in _error("trainer.logger='[console,nope]'")  # each entry is checked by itself
    assert "trainer.logger entry 'nope' is not one of" in _error("trainer.logger='[console,nope]'")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain name is not a quoted list
        assert load_config(["trainer.logger=console"]).trainer.logger == "console"


# ───────────────────────────── mlflow ─────────────────────────────


def test_mlflow_logger_without_mlflow_says_how_to_install():
    if __import__("importlib").util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed")
    assert "pip install mlflow-skinny" in _error("trainer.logger=[console,mlflow]")


def test_august_reward_model_holding_a_classifier_is_the_classifier_reward_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    keys = ("reward.reward_model.enable=true", f"reward.reward_model.model_path={tmp_path}",
            "reward.reward_model.rollout.name=vllm", "reward.reward_model.rollout.gpu_memory_utilization=0.8")
    cfg = _load(*keys)
    assert cfg.reward_model.enable and cfg.reward_model.model.path == str(tmp_path)
    assert not cfg.reward.reward_model.enable  # no judge: the classifier scores on the RewardModel worker
    assert "reward.reward_model.rollout.gpu_memory_utilization" in _no_effect_warning(*keys)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    judge = _load(*keys[:2])
    assert judge.reward.reward_model.enable and not judge.reward_model.enable  # a causal LM stays the judge


def test_prefix_caching_cuda_graph_sizes_and_sleep_mode_reach_both_engines():
    from transformers import Qwen2Config

    from rlfoundry.workers.rollout import sglang_rollout, vllm_rollout

    hf = Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    for value in (True, False):
        rollout = _resolved(f"actor_rollout_ref.rollout.enable_prefix_caching={value}").actor_rollout_ref.rollout
        assert vllm_rollout.build_engine_kwargs(rollout, "/m", hf, "cpu")["enable_prefix_caching"] is value
        assert sglang_rollout.build_engine_kwargs(rollout, "/m", "cpu")["disable_radix_cache"] is (not value)
    sizes = _resolved("actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,2,4]").actor_rollout_ref.rollout
    assert vllm_rollout.build_engine_kwargs(sizes, "/m", hf, "cuda")["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2, 4]}
    assert sglang_rollout.build_engine_kwargs(sizes, "/m", "cuda")["cuda_graph_bs"] == [1, 2, 4]
    assert "compilation_config" not in vllm_rollout.build_engine_kwargs(rollout, "/m", hf, "cuda")
    # rollout.enable_sleep_mode=false keeps the engine's memory between rollouts, free_cache_engine or not
    for sleep in (True, False):
        held = _resolved(f"actor_rollout_ref.rollout.enable_sleep_mode={sleep}").actor_rollout_ref.rollout
        assert held.free_cache_engine is True
        assert vllm_rollout.build_engine_kwargs(held, "/m", hf, "cuda")["enable_sleep_mode"] is sleep
        saver = sglang_rollout.build_engine_kwargs(held, "/m", "cuda")
        assert saver["enable_memory_saver"] is saver["enable_weights_cpu_backup"] is sleep


def test_august_engine_keys_and_optimizer_class():
    text = _no_effect_warning("actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=true",
                              "actor_rollout_ref.actor.fsdp_config.use_orig_params=true",
                              "actor_rollout_ref.actor.megatron.vanilla_mbridge=true",
                              "actor_rollout_ref.actor.megatron.use_remove_padding=true")
    for key in ("fsdp_config.entropy_checkpointing", "fsdp_config.use_orig_params", "megatron.vanilla_mbridge",
                "megatron.use_remove_padding"):
        assert f"actor_rollout_ref.actor.{key}" in text
    _load("actor_rollout_ref.actor.optim.optimizer=AdamW", "actor_rollout_ref.actor.optim.optimizer_impl=torch.optim")
    assert "only AdamW" in _error("actor_rollout_ref.actor.optim.optimizer=Muon")


def test_rollout_rs_threshold_strings_of_verls_divergence_options():
    key = "algorithm.rollout_correction"
    rc = _resolved(f"{key}.rollout_rs='token_k1,seq_max_k2'", f"{key}.rollout_rs_threshold='0.6_1.6,2.5'",
                   "actor_rollout_ref.actor.use_rollout_log_probs=false").algorithm.rollout_correction
    assert (rc.rollout_rs, rc.rollout_rs_threshold) == ("token_k1,seq_max_k2", "0.6_1.6,2.5")
    assert "a k2/k3 option takes one upper bound" in _error(f"{key}.rollout_rs=seq_max_k2",
                                                           f"{key}.rollout_rs_threshold='1_2'")
    assert "rollout_rs needs rollout_rs_threshold > 0" in _error(f"{key}.rollout_rs=token", f"{key}.rollout_rs_threshold='0.9_1.1'")


def test_a_causal_lm_as_the_classifier_reward_model_stops_the_start(tiny_model_dir, tiny_critic_dir):
    from rlfoundry.trainer.config import check_startup_paths

    base = f"actor_rollout_ref.model.path={tiny_model_dir}"
    with pytest.raises(ConfigError, match="is not a sequence classifier"):  # it would score with a random head
        check_startup_paths(_load(base, "reward_model.enable=true", f"reward_model.model.path={tiny_model_dir}"))
    check_startup_paths(_load(base, "reward_model.enable=true", f"reward_model.model.path={tiny_critic_dir}"))


def test_august_critic_fsdp_is_the_critics_fsdp_config_and_fsdp_strategy_is_checked():
    r = _resolved("critic.fsdp.forward_prefetch=true", "critic.fsdp.ulysses_sequence_parallel_size=2",
                  "critic.model.use_remove_padding=true", "trainer.n_gpus_per_node=2")
    assert r.critic.model.fsdp_config.forward_prefetch is True  # what the critic's engine is built from
    assert r.critic.ulysses_sequence_parallel_size == 2  # through the older place's own spelling
    assert "older verl" in _error("critic.fsdp.forward_prefetch=true", "critic.model.fsdp_config.forward_prefetch=false")
    assert "actor_rollout_ref.actor.fsdp_config.strategy" in _no_effect_warning(
        "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2")
    assert "strategy is fsdp or fsdp2" in _error("actor_rollout_ref.actor.fsdp_config.strategy=megatron")


def test_ray_kwargs_ray_init_is_what_init_ray_gets():
    from rlfoundry.trainer.main_ppo import ray_init_args

    # 69 August scripts pass the workers' interpreter (null: Ray's own); ray_init_args is init_ray's call
    assert ray_init_args(_load("ray_kwargs.ray_init.runtime_env.py_executable=null"))["runtime_env"] is None
    args = ray_init_args(_load("ray_kwargs.ray_init.runtime_env.py_executable='uv run --frozen'",
                               "+ray_kwargs.ray_init.runtime_env.env_vars.TRANSFER_QUEUE_ENABLE=1",
                               "ray_kwargs.ray_init.num_cpus=4", "+ray_kwargs.ray_init.num_gpus=0"))
    assert args == {"address": None, "num_cpus": 4, "num_gpus": 0, "runtime_env": {
        "py_executable": "uv run --frozen", "env_vars": {"TRANSFER_QUEUE_ENABLE": "1"}}}
    assert "older verl" in _error("ray_kwargs.ray_init.num_cpus=4", "ray_init.num_cpus=2")
    assert "ray_kwargs.timeline_json_file" in _no_effect_warning("ray_kwargs.timeline_json_file=/tmp/t.json")


def test_rollout_is_threshold_icepop_string():
    key = "algorithm.rollout_correction"
    rc = _resolved(f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=0.5_4.0",
                   "actor_rollout_ref.actor.use_rollout_log_probs=false").algorithm.rollout_correction
    assert rc.rollout_is_threshold == "0.5_4.0"
    assert "bounds must be > 0 (and lower <= upper)" in _error(f"{key}.rollout_is=token", f"{key}.rollout_is_threshold='4_0.5'")


def test_megatron_expert_tensor_parallel_size_dividing_the_tensor_parallelism_is_accepted_other_is_named(tiny_moe_dir):
    base = ("actor_rollout_ref.actor.strategy=megatron", f"actor_rollout_ref.model.path={tiny_moe_dir}",
            "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    _load(*base, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
          "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=null")
    # verl's Qwen3-30B-A3B scripts' layout, in small: TP split dense layers, whole experts
    tp2 = [f"actor_rollout_ref.{r}.megatron.tensor_model_parallel_size=2" for r in ("actor", "ref")]
    _load(*base, *tp2, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
          "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1")
    # each expert over a pair of the four tensor-parallel ranks
    tp4 = [f"actor_rollout_ref.{r}.megatron.tensor_model_parallel_size=4" for r in ("actor", "ref")]
    _load(*base, *tp4, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2",
          "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=2")
    error = _error(*base, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=4")
    assert ("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=4 does not divide "
            "tensor_model_parallel_size=1: each expert is split over a part of a tensor-parallel group here "
            "(one of [1], or null: 1)") in error
    assert "expert_tensor_parallel_size=3 does not divide tensor_model_parallel_size=4" in _error(
        *base, *tp4, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=3")
    # the experts' groups must fit the ranks too
    assert "expert × expert tensor × pipeline parallel = 8 does not divide the 4 ranks" in _error(
        *base, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=4")


# ───────────────────────────── from the review of issue 46's changes ─────────────────────────────


def test_lr_zero_builds_a_flat_schedule_and_min_lr_above_it_is_an_error():
    from rlfoundry.engines.fsdp.utils import build_lr_scheduler, build_optimizer

    optim = _resolved("actor_rollout_ref.actor.optim.lr=0").actor_rollout_ref.actor.optim
    scheduler = build_lr_scheduler(build_optimizer(torch.nn.Linear(2, 2), optim), optim, 10)  # was 0/0
    assert scheduler.get_last_lr() == [0.0]
    _load("actor_rollout_ref.actor.optim.lr=0", "+actor_rollout_ref.actor.optim.min_lr=0")  # was 0/0 too
    assert "a run at lr=0 has no floor" in _error("actor_rollout_ref.actor.optim.lr=0",
                                                  "+actor_rollout_ref.actor.optim.min_lr=1e-7")


def test_the_optimizer_class_is_not_an_override():
    # megatron-core's OptimizerConfig has `optimizer`, which the engine passes itself (a duplicate
    # keyword at build time, and a way round the AdamW-only rule)
    text = _error("+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer=sgd")
    assert "set it as optim.optimizer" in text


def test_divergence_thresholds_take_their_lower_bound_in_the_spec_and_in_order():
    rc = "algorithm.rollout_correction"
    text = _error(f"{rc}.rollout_rs=token_k1", f"{rc}.rollout_rs_threshold=1.5", f"{rc}.rollout_rs_threshold_lower=0.9")
    assert "rollout_rs_threshold_lower is for the ratio levels" in text and "LOWER_UPPER" in text
    assert "the lower bound is above the upper" in _error(f"{rc}.rollout_rs=token_k1", f"{rc}.rollout_rs_threshold='2.0_0.5'")
    _load(f"{rc}.rollout_rs=token_k1", f"{rc}.rollout_rs_threshold='0.5_2.0'")


def test_an_adapter_setting_the_schema_cannot_hold_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16.5, "peft_type": "LORA"}))
    text = _error(f"actor_rollout_ref.model.lora_adapter_path={tmp_path}")
    assert "adapter_config.json: lora_alpha=16.5 cannot be actor_rollout_ref.model.lora_alpha" in text
