"""verl's own command lines, module name changed, validate here (issue 46, item 5): a representative
set taken from verl's example and recipe scripts (``verl_command_lines.json``: the source script at its
commit, the module, the arguments as the script ran them with its own defaults, ``$HOME`` written
``{home}``), one per kind of run — dense FSDP GRPO and PPO with a critic, Megatron (January's config
name and August's ``model_engine=megatron``), LoRA, multi-turn tools with an interaction, a classifier
reward model, a vision-language model, Ulysses, DAPO, SPPO, GSPO, GDPO, rollout correction, one-step-off (and its
delta weight sync) and fully-async (the retool line's tool agent loop with partial rollout too), both SFT entry
points (FSDP and Megatron), and August's ``model_engine=veomni`` (with its expert parallelism).

Each runs as ``python -m rlfoundry.X ARGS --cfg job`` through ``scripts/verl_compat_check.py``'s
in-process check (the module's own ``__main__``, from the script's directory), so a line that a change
breaks fails here, not only in the harness's measurement; and the printed config shows the keys that
matter for the line took effect.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.scripts import load_compat_harness

HERE = Path(__file__).resolve().parent
LINES = json.loads((HERE / "verl_command_lines.json").read_text())

# Files the lines name inside verl's tree, written in verl's layout with verl's class names (the suite runs
# without a verl checkout: rlfoundry answers the verl imports, rlfoundry/utils/verl_imports.py).
TREE_FILES = {
    "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml": """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
""",
    "examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml": """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
""",
    # recipe/retool (a submodule of verl's tree): its tool config and module, with verl's imports and names
    "recipe/retool/sandbox_fusion_tool_config.yaml": """\
tools:
  - class_name: "recipe.retool.retool.CustomSandboxFusionTool"
    config:
      sandbox_fusion_url: "https://localhost:8080/run_code"
      num_workers: 128
      default_timeout: 30
      default_language: "python"
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
""",
    "recipe/retool/retool.py": "from verl.tools.sandbox_fusion_tools import SandboxFusionTool\n"
                               "from verl.utils.dataset import RLHFDataset\n\n\n"
                               "class CustomSandboxFusionTool(SandboxFusionTool):\n    pass\n\n\n"
                               "class CustomRLHFDataset(RLHFDataset):\n    pass\n\n\n"
                               "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                               "    return float(solution_str.strip() == ground_truth)\n",
    "verl/utils/reward_score/rlla.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                       "    return float(solution_str.strip() == ground_truth)\n",
}

# What each line's printed config must show (dotted key -> value): the keys that make the run what it is.
EXPECT = {
    "examples/grpo_trainer/run_qwen2-7b.sh": {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 5,
                                              "actor_rollout_ref.actor.kl_loss_type": "low_var_kl"},
    "examples/ppo_trainer/run_gemma.sh": {"algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-5,
                                          "critic.model.path": "google/gemma-2-2b-it"},
    "examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": {
        "actor_rollout_ref.actor.strategy": "megatron", "critic.strategy": "megatron",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2},
    "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh": {"actor_rollout_ref.model.lora_rank": 64},
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_4xgpu.sh": {
        "actor_rollout_ref.rollout.multi_turn.enable": True, "actor_rollout_ref.rollout.name": "sglang",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns": 1},
    "examples/ppo_trainer/run_qwen2-7b_rm.sh": {"reward_model.enable": True},
    "examples/grpo_trainer/run_qwen2_5_vl-7b.sh": {"data.image_key": "images",
                                                   "actor_rollout_ref.model.use_fused_kernels": True},
    "examples/ppo_trainer/run_deepseek7b_llm_sp2.sh": {"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
                                                      "critic.ulysses_sequence_parallel_size": 2},
    "recipe/dapo/test_dapo_7b_math.sh": {"reward_model.reward_kwargs.overlong_buffer_cfg.len": 4096,
                                         "actor_rollout_ref.actor.clip_ratio_high": 0.28},
    "examples/rollout_correction/run_with_rollout_corr.sh": {},
    "verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh": {
        "async_training.mode": "one_step_off", "rollout.n_gpus_per_node": 2},
    # August's delta weight sync (workers/checkpoint_engine.py, docs/async.md)
    "verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_sglang_delta_sharded_2_6.sh": {
        "async_training.mode": "one_step_off", "actor_rollout_ref.rollout.checkpoint_engine.backend": "delta_sharded",
        "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.delta_sharded.encoding": "indices"},
    "examples/grpo_trainer/run_qwen3_8b_megatron.sh": {"actor_rollout_ref.actor.strategy": "megatron"},
    "examples/gspo_trainer/run_qwen3_8b_fsdp.sh": {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
                                                   "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4},
    "verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh": {
        "async_training.mode": "fully_async", "async_training.trigger_parameter_sync_step": 4,
        "data.train_batch_size": 128},  # verl's 0: require_batches x ppo_mini_batch_size
    # the tool agent loop with partial rollout (the agent loops run in the driver: docs/async.md)
    "verl/experimental/fully_async_policy/shell/dapo_7b_async_retool.sh": {
        "async_training.mode": "fully_async", "async_training.partial_rollout": True,
        "actor_rollout_ref.rollout.multi_turn.enable": True, "data.train_batch_size": 16},
    "examples/tuning/lora/run_qwen3_8b_fsdp.sh": {"actor_rollout_ref.model.lora_rank": 64},
    "examples/gdpo_trainer/run_qwen3_8b_fsdp.sh": {"algorithm.adv_estimator": "gdpo"},
    "examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh": {
        "distillation.enabled": True, "distillation.distillation_loss.loss_mode": "k1",
        "distillation.distillation_loss.use_policy_gradient": True,
        "distillation.teacher_models.teacher_model.model_path": "Qwen/Qwen3-32B"},
    # top-k distillation on the Megatron engine at TP=2 (its default DISTILLATION_LOSS_MODE)
    "examples/on_policy_distillation_trainer/run_qwen3_8b_megatron.sh": {
        "actor_rollout_ref.actor.strategy": "megatron", "distillation.distillation_loss.loss_mode": "forward_kl_topk",
        "distillation.distillation_loss.topk": 64, "distillation.distillation_loss.use_policy_gradient": False},
    "examples/on_policy_distillation_trainer/run_qwen3_8b_mopd_fsdp.sh": {
        "distillation.teacher_key": "data_source", "distillation.teacher_models.gsm8k.key": "openai/gsm8k",
        "distillation.teacher_models.geo3k.model_path": "Qwen/Qwen3-VL-32B-Instruct"},
    "examples/sft/gsm8k/run_qwen_05_sp2.sh": {},  # SFT's dry run validates only (the status below)
    "examples/sft/gsm8k/run_qwen3_8b_fsdp.sh": {},
    # verl's veomni engine on the FSDP2 engine, its keys on the FSDP ones (config/veomni.py)
    "examples/grpo_trainer/run_qwen3_5_35b_a3b_veomni.sh": {
        "actor_rollout_ref.actor.strategy": "fsdp", "actor_rollout_ref.actor.fsdp_config.param_offload": True,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": True,
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2},
    # its expert parallelism with Ulysses, the FSDP engine's (engines/fsdp/expert_parallel.py); the reference follows
    "examples/grpo_trainer/run_qwen3_5-122b-a10b_veomni.sh": {
        "actor_rollout_ref.actor.fsdp_config.expert_parallel_size": 8,
        "actor_rollout_ref.ref.fsdp_config.expert_parallel_size": 8,
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2},
    "examples/sft/gsm8k/run_qwen_megatron_fsdp.sh": {"model.strategy": "megatron", "engine.tensor_model_parallel_size": 4,
                                                     "optim.lr_scheduler": "cosine", "optim.warmup_steps_ratio": 0.2},
    # verl's SPPO recipe (recipe submodule e7f88957): both halves, the recipe's warm-up over the script's ratio
    "recipe/sppo/run_qwen2.5-7b_rm.sh": {"algorithm.adv_estimator": "sppo",
                                         "actor_rollout_ref.actor.policy_loss.loss_mode": "sppo",
                                         "actor_rollout_ref.actor.sppo_eta": 1.0, "algorithm.sppo_eta": 1.0,
                                         "actor_rollout_ref.actor.optim.lr_warmup_steps": 15,
                                         "actor_rollout_ref.rollout.n": 1},
}


@pytest.fixture(scope="module")
def harness():
    return load_compat_harness()


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verl_tree")
    for name, text in TREE_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_suite_covers_every_line_it_expects():
    assert sorted(line["source"].split(":", 1)[1] for line in LINES) == sorted(EXPECT)


@pytest.mark.parametrize("line", LINES, ids=[line["source"].split(":", 1)[1] for line in LINES])
def test_verls_command_line_validates_with_the_module_name_changed(line, harness, tree, tmp_path):
    args = [a.replace("{home}", str(tmp_path / "home")) for a in line["args"]]
    captured = harness.Captured(path=line["source"], index=0, module=line["module"], args=args, cwd=line["cwd"],
                                launcher="python", world_size=line.get("world_size"))
    result = harness.check(captured, tree, timeout=120, in_process=True)
    # clean, or keys verl has that change nothing here (the no-effect warning); never rejected
    assert result.status in ("clean", "ignored_keys", "warned"), (result.status, result.message, result.detail)
    expected = EXPECT[line["source"].split(":", 1)[1]]
    if expected:
        printed = OmegaConf.create(result.stdout)
        got = {key: OmegaConf.select(printed, key) for key in expected}
        assert got == expected
