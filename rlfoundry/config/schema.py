"""Typed schema of the PPO trainer config: verl's key layout (FSDP path), one dataclass per subtree.

The dataclasses give every key a type (OmegaConf checks it on every override) and carry **verl's**
defaults, so ``git diff`` against verl's ``ppo_trainer.yaml`` stays readable. The packaged
``ppo_trainer.yaml`` next to this file holds *our* defaults (the demo run) and must list exactly the
same keys: ``tests/trainer/test_config.py`` checks both directions.

Open ``Dict[str, Any]`` fields are the places where verl itself accepts arbitrary sub-keys
(``override_config``, ``engine_kwargs``, ``reward_kwargs`` ...): ``+key.sub=value`` works there.
Keys added by rlfoundry (not in verl) are marked ``# rlfoundry``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


# model.cpu_kernels (models/cpu_kernels.py): the one list of its values; trainer/config.py checks it
CPU_KERNELS = ("auto", "off")


def _sub(cls: type) -> Any:
    return field(default_factory=cls)


def _dict(**defaults: Any) -> Any:
    return field(default_factory=lambda: dict(defaults))


def _list(*items: Any) -> Any:
    return field(default_factory=lambda: list(items))


# ───────────────────────────────────────── data ─────────────────────────────────────────


@dataclass
class CustomClsConfig:
    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class SamplerConfig:
    class_path: Optional[str] = None
    class_name: Optional[str] = None


@dataclass
class SyntheticDataConfig:  # rlfoundry: the built-in task used when data.train_files is null
    task: str = "arithmetic"
    train_size: int = 2048
    val_size: int = 128
    seed: int = 0


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None
    use_shm: bool = False
    train_files: Any = None  # str | list[str]; null -> the synthetic task (rlfoundry)
    val_files: Any = None
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: Optional[int] = None  # deprecated in verl: validation runs as one batch
    return_raw_input_ids: bool = False
    return_raw_chat: bool = False
    return_full_prompt: bool = False
    shuffle: bool = True
    validation_shuffle: bool = False
    seed: int = 1
    dataloader_num_workers: int = 0
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = "error"
    image_key: str = "images"
    video_key: str = "videos"
    trust_remote_code: bool = False
    apply_chat_template: bool = True
    apply_chat_template_kwargs: Dict[str, Any] = _dict()
    custom_cls: CustomClsConfig = _sub(CustomClsConfig)
    sampler: SamplerConfig = _sub(SamplerConfig)
    synthetic: SyntheticDataConfig = _sub(SyntheticDataConfig)  # rlfoundry


# ───────────────────────────────────── shared pieces ─────────────────────────────────────


@dataclass
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = -1  # takes priority; negative -> lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: Optional[float] = None
    num_cycles: float = 0.5
    warmup_style: str = "constant"  # constant | cosine
    total_training_steps: int = -1  # written by the trainer's resolution step, never by hand
    weight_decay: float = 0.01
    betas: List[float] = _list(0.9, 0.999)


@dataclass
class FSDPConfig:
    wrap_policy: Dict[str, Any] = _dict(min_num_params=0)
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    forward_prefetch: bool = False
    model_dtype: str = "fp32"
    mixed_precision: Dict[str, Any] = _dict()
    grad_offload: bool = False  # removed in verl >= 0.2; accepted for old scripts


@dataclass
class CheckpointConfig:
    save_contents: List[str] = _list("model", "optimizer", "extra")
    load_contents: List[str] = _list("model", "optimizer", "extra")
    contents: Optional[List[str]] = None  # verl <= 0.3 spelling of save_contents


@dataclass
class ProfilerConfig:
    discrete: bool = False
    all_ranks: bool = False
    ranks: List[int] = _list()


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


# ─────────────────────────────────── actor / rollout / ref ───────────────────────────────────


@dataclass
class ModelConfig:
    path: str = "~/models/deepseek-llm-7b-chat"
    custom_chat_template: Optional[str] = None
    use_shm: bool = False
    external_lib: Optional[str] = None
    override_config: Dict[str, Any] = _dict()
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = False
    use_shared_prompt: bool = True  # rlfoundry: the n samples of a prompt share one prompt forward
    # rlfoundry: the CPU speed-ups (models/cpu_kernels.py): auto = on when the model runs on the CPU,
    # off = the plain HF/FSDP2 path GPUs take. Values: CPU_KERNELS above.
    cpu_kernels: str = "auto"
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Optional[str] = None
    use_liger: bool = False
    use_fused_kernels: bool = False
    fused_kernel_options: Dict[str, Any] = _dict()
    trust_remote_code: bool = False


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    ppo_mini_batch_size: int = 256  # in prompts; the worker multiplies by rollout.n
    ppo_micro_batch_size: Optional[int] = None  # deprecated: global; use ppo_micro_batch_size_per_gpu
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2
    clip_ratio_high: Optional[float] = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    use_torch_compile: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    # old_log_probs := the HF rollout's sampling log-probs (skips compute_log_prob); see trainer/config.py
    use_rollout_log_probs: bool = False
    ulysses_sequence_parallel_size: int = 1
    data_loader_seed: Optional[int] = None
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    policy_loss: PolicyLossConfig = _sub(PolicyLossConfig)
    checkpoint: CheckpointConfig = _sub(CheckpointConfig)
    optim: OptimConfig = _sub(OptimConfig)
    fsdp_config: FSDPConfig = _sub(FSDPConfig)
    profiler: ProfilerConfig = _sub(ProfilerConfig)


@dataclass
class RefConfig:
    strategy: str = "fsdp"
    fsdp_config: FSDPConfig = _sub(FSDPConfig)
    use_torch_compile: bool = True
    log_prob_micro_batch_size: Optional[int] = None  # deprecated: global
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    profiler: ProfilerConfig = _sub(ProfilerConfig)


@dataclass
class ValKwargsConfig:
    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass
class RolloutConfig:
    name: str = "vllm"  # hf | vllm
    mode: str = "sync"
    chat_scheduler: Optional[str] = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    use_fire_sampling: bool = False
    prompt_length: int = 512
    response_length: int = 512
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    ignore_eos: bool = False
    enforce_eager: bool = True
    free_cache_engine: bool = True
    load_format: str = "dummy_dtensor"
    layered_summon: bool = False
    tensor_model_parallel_size: int = 2
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024
    micro_batch_size: Optional[int] = None  # verl <= 0.2; no effect
    log_prob_micro_batch_size: Optional[int] = None  # deprecated: global
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    disable_log_stats: bool = True
    enable_chunked_prefill: bool = True
    do_sample: bool = True
    n: int = 1
    seed: int = 0
    calculate_log_probs: bool = False
    multi_stage_wake_up: bool = False
    update_weights_bucket_megabytes: int = 512
    engine_kwargs: Dict[str, Any] = _dict()
    val_kwargs: ValKwargsConfig = _sub(ValKwargsConfig)
    multi_turn: Dict[str, Any] = _dict(enable=False)
    agent: Dict[str, Any] = _dict()
    trace: Dict[str, Any] = _dict()
    profiler: ProfilerConfig = _sub(ProfilerConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    model: ModelConfig = _sub(ModelConfig)
    actor: ActorConfig = _sub(ActorConfig)
    ref: RefConfig = _sub(RefConfig)
    rollout: RolloutConfig = _sub(RolloutConfig)


# ───────────────────────────────────────── critic ─────────────────────────────────────────


@dataclass
class CriticModelConfig:
    path: Optional[str] = "~/models/deepseek-llm-7b-chat"
    tokenizer_path: Optional[str] = None
    use_shm: bool = False
    override_config: Dict[str, Any] = _dict()
    external_lib: Optional[str] = None
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = False
    cpu_kernels: str = "auto"  # rlfoundry: see ModelConfig.cpu_kernels
    trust_remote_code: bool = False
    fsdp_config: FSDPConfig = _sub(FSDPConfig)
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # null -> on exactly when algorithm.adv_estimator is gae
    rollout_n: int = 1
    strategy: str = "fsdp"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = _sub(CriticModelConfig)
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: Optional[int] = None  # deprecated: global
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    forward_micro_batch_size: Optional[int] = None
    forward_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ulysses_sequence_parallel_size: int = 1
    ppo_epochs: int = 1
    shuffle: bool = False
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    checkpoint: CheckpointConfig = _sub(CheckpointConfig)
    profiler: ProfilerConfig = _sub(ProfilerConfig)


# ───────────────────────────────────── reward model / function ─────────────────────────────────────


@dataclass
class RewardModelModelConfig:
    input_tokenizer: Optional[str] = None
    path: Optional[str] = "~/models/FsfairX-LLaMA3-RM-v0.1"
    use_shm: bool = False
    external_lib: Optional[str] = None
    use_remove_padding: bool = False
    use_fused_kernels: bool = False
    cpu_kernels: str = "auto"  # rlfoundry: see ModelConfig.cpu_kernels
    trust_remote_code: bool = False
    fsdp_config: FSDPConfig = _sub(FSDPConfig)


@dataclass
class RewardModelConfig:
    enable: bool = False
    strategy: str = "fsdp"
    model: RewardModelModelConfig = _sub(RewardModelModelConfig)
    micro_batch_size: Optional[int] = None  # deprecated: global
    micro_batch_size_per_gpu: Optional[int] = None
    max_length: Optional[int] = None
    ulysses_sequence_parallel_size: int = 1
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int = 32768
    reward_manager: str = "naive"
    launch_reward_fn_async: bool = False
    reward_kwargs: Dict[str, Any] = _dict()
    overlong_buffer: Dict[str, Any] = _dict(enable=False, len=0, penalty_factor=0.0, log=False)  # DAPO recipe
    sandbox_fusion: Dict[str, Any] = _dict()
    profiler: ProfilerConfig = _sub(ProfilerConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"
    reward_kwargs: Dict[str, Any] = _dict()


# ─────────────────────────────────────── algorithm ───────────────────────────────────────


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: Optional[str] = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = _sub(KLCtrlConfig)
    use_pf_ppo: bool = False
    pf_ppo: Dict[str, Any] = _dict(reweight_method="pow", weight_pow=2.0)


# ──────────────────────────────────────── trainer ────────────────────────────────────────


@dataclass
class TrainerConfig:
    balance_batch: bool = True
    total_epochs: int = 30
    total_training_steps: Optional[int] = None
    profile_steps: Optional[List[int]] = None
    controller_nsight_options: Dict[str, Any] = _dict()
    worker_nsight_options: Dict[str, Any] = _dict()
    project_name: str = "verl_examples"
    experiment_name: str = "gsm8k"
    logger: Any = _list("console", "wandb")  # a name or a list of names
    log_val_generations: int = 0
    val_generations_to_log_to_wandb: int = 0  # verl <= 0.2 name of log_val_generations
    rollout_data_dir: Optional[str] = None
    validation_data_dir: Optional[str] = None
    nnodes: int = 1
    n_gpus_per_node: int = 8  # on CPU: the number of worker processes per node
    save_freq: int = -1
    esi_redundant_time: float = 0.0
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None
    val_before_train: bool = True
    val_only: bool = False
    test_freq: int = -1
    critic_warmup: int = 0
    default_hdfs_dir: Optional[str] = None
    del_local_ckpt_after_load: bool = False
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None
    ray_wait_register_center_timeout: int = 300
    device: str = "cuda"  # cuda | cpu | auto
    use_legacy_worker_impl: str = "auto"
    worker_backend: str = "auto"  # rlfoundry: local | process | ray | auto
    process_start_method: str = "auto"  # rlfoundry: process back end: auto | fork | spawn
    seed: int = 1  # rlfoundry: torch/numpy seed of the driver and of each worker
    run_dir: Optional[str] = None  # rlfoundry: metrics, plots, synthetic data; null -> default_local_dir
    worker_call_timeout_s: Optional[float] = None  # rlfoundry: limit of one worker call (Ray back end); null: none
    dist_timeout_s: float = 600.0  # rlfoundry: timeout of every torch.distributed collective
    tune_malloc: bool = True  # rlfoundry: glibc malloc in worker processes keeps freed memory (utils/malloc.py)
    max_consecutive_nan_steps: int = 3  # rlfoundry: stop after this many NaN/Inf-skipped steps in a row; 0: never


@dataclass
class PPOConfig:
    data: DataConfig = _sub(DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = _sub(ActorRolloutRefConfig)
    critic: CriticConfig = _sub(CriticConfig)
    reward_model: RewardModelConfig = _sub(RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = _sub(CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig)
    trainer: TrainerConfig = _sub(TrainerConfig)
    ray_init: Dict[str, Any] = _dict(num_cpus=None, timeline_json_file=None)
