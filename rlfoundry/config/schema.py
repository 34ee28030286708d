"""Typed schema of the PPO trainer config: verl's key layout (FSDP path), one dataclass per subtree.

This file is the one source of the defaults. Every key has a type (OmegaConf checks it on every
override) and rlfoundry's default, and the defaults ARE the demo run: ``rlfoundry train`` with no
arguments trains the shipped tiny policy (``rlfoundry://arithmetic-policy``) with GRPO on the
built-in synthetic arithmetic task, on CPU, in a few minutes (with ``data.train_files`` null the
trainer writes the task's parquet files, seeded by ``data.synthetic.seed``, into
``<run_dir>/data/``). Any verl command line overrides them::

    rlfoundry train data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=... \\
        actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct trainer.device=cuda ...

Where a default differs from verl's, a trailing ``# verl: <value>`` says verl's. Why they differ:

- ``algorithm.adv_estimator`` null: gae when ``critic.model.path`` is set (verl's default, and what
  verl's PPO scripts mean), grpo otherwise (the demo); ``critic.model.path`` null: no critic unless
  asked for.
- ``rollout.name`` hf: runs everywhere; vllm where installed.
- ``rollout.n`` 8, batch sizes, lengths, learning rates, epochs, save/test frequencies: sized for
  the demo on 2 CPU cores.
- ``trainer.device`` auto: cuda when available, else cpu.
- ``trainer.logger`` console + file: every run leaves ``<run_dir>/metrics.jsonl``.
- ``data.dataloader_num_workers`` 0: prompt batches are tiny; loader processes only cost start-up.

Field metadata, read by ``config/typed.py``: ``one_of`` lists the values a field accepts (checked at
start-up and by ``to_typed``); ``follows`` makes a default follow another key, as verl's YAML does
with ``${...}`` (``critic.ppo_epochs`` is ``actor_rollout_ref.actor.ppo_epochs`` unless set). The
value given to ``follows`` is the field's default where that key does not exist, i.e. when the
subtree is used on its own (``to_typed(RolloutConfig, {...})``); it equals what the link gives under
these defaults, except the two tokenizer paths (null alone: the model's own tokenizer).

Open ``Dict[str, Any]`` fields are the places where verl itself accepts arbitrary sub-keys
(``override_config``, ``engine_kwargs``, ``reward_kwargs`` ...): ``+key.sub=value`` works there.
Keys added by rlfoundry (not in verl) are marked ``# rlfoundry``. ``rlfoundry train --cfg job``
prints the resolved config, ``--help-keys`` every key with its type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional

from rlfoundry.config.rollout_engines import ROLLOUT_ENGINES
from rlfoundry.config.training_engines import TRAINING_ENGINES

# Value lists that code outside the config also checks against (one list each).
CPU_KERNELS = ("auto", "off")  # model.cpu_kernels; rlfoundry/cpu
LORA_SYNCS = ("adapter", "merged")  # rollout.lora_sync; models/lora.py
START_METHODS = ("auto", "fork", "spawn")  # trainer.process_start_method; single_controller/process.py
WORKER_BACKENDS = ("local", "process", "ray")  # trainer.worker_backend (+ auto); single_controller/factory.py
# the training engines a role's strategy can name; verl's veomni and fsdp_turbo are the FSDP2 engine here
# (config/veomni.py, config/fsdp_turbo.py)
STRATEGIES = (*TRAINING_ENGINES, "veomni", "fsdp_turbo")
# verl's dtype spellings -> torch's names (models/hf.py resolve_dtype maps them to torch dtypes; the config layer
# checks them without torch)
DTYPE_SPELLINGS = {"fp32": "float32", "float32": "float32", "float": "float32", "bf16": "bfloat16",
                   "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16"}
MEGATRON_INSTALL = "pip install 'rlfoundry[megatron]'  (megatron-core, mbridge, einops)"
from rlfoundry.utils.profile_tools import TORCH_PROFILER_TOOLS  # noqa: E402  (global_profiler.tool values the trace serves)
TOOL_CALL_FORMATS = ("hermes", "qwen", "gpt-oss", "qwen3_coder")  # multi_turn.format; tools/parser.py (tested equal)
SPO_FORMAT = "spo"  # multi_turn.format of verl's SPO scripts: code in <code> tags, for the spo_tool_agent loop only
LR_SCHEDULES = ("constant", "cosine")  # optim.lr_scheduler_type / warmup_style; engines/fsdp/utils.py
# algos/core_algos.py (AGG_LOSS_MODES, kl_penalty) implements these; tests/trainer/test_config.py checks they agree
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_KL_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# "+": the estimator's value with k2's gradient (core_algos.kl_penalty); "full" is a clear error there
KL_ESTIMATORS = (*_KL_BASE, *(k + "+" for k in _KL_BASE), "full")
ROLLOUT_NAMES = tuple(name for name, engine in ROLLOUT_ENGINES.items() if engine.module is not None)
# the estimators that read the actor's sum_pi_squared (verl 0.9.1's optimal token baselines; trainer/config.py)
SUM_PI_SQUARED_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")


class Node:
    """Base of every config dataclass: the resolved config reads as the DictConfig verl code expects
    (``cfg.get("key", default)``, ``cfg["key"]``, ``"key" in cfg``) besides attribute access, so user
    code written against verl's DictConfig (datasets, reward functions) takes the typed config as is."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __contains__(self, key: str) -> bool:
        return key in self.__dataclass_fields__  # type: ignore[attr-defined]

    def check(self) -> list[str]:
        """This section's own rules, one message per problem naming the key and the fix (none by default)."""
        return []

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"the resolved config is read-only: '{name}' cannot change after start-up")
        object.__setattr__(self, name, value)


def freeze(node: Any) -> Any:
    """Make ``node`` and every section under it read-only (the resolved config); returns ``node``."""
    for name in getattr(node, "__dataclass_fields__", {}):
        child = getattr(node, name)
        if isinstance(child, Node):
            freeze(child)
    object.__setattr__(node, "_frozen", True)
    return node


def section_errors(node: Any) -> list[str]:
    """The errors of every section under ``node`` that has a ``check`` (children before parents)."""
    errors: list[str] = []
    for name in getattr(node, "__dataclass_fields__", {}):
        child = getattr(node, name)
        if isinstance(child, Node):
            errors += section_errors(child)
            if type(child).check is not Node.check:
                errors += child.check()
    return errors


def one_of(choices: tuple, default: Any) -> Any:
    """A field that accepts only ``choices``."""
    assert default is None or default in choices, (default, choices)
    return field(default=default, metadata={"choices": tuple(choices)})


def follows(key: str, default: Any, choices: tuple | None = None) -> Any:
    """A field whose default is the value of ``key`` (a dotted key from the PPOConfig root), or
    ``default`` where the schema in use has no such key."""
    metadata = {"follows": key} if choices is None else {"follows": key, "choices": tuple(choices)}
    return field(default=default, metadata=metadata)


def _sub(cls: type) -> Any:
    return field(default_factory=cls)


def _dict(**defaults: Any) -> Any:
    return field(default_factory=lambda: dict(defaults))


def _list(*items: Any) -> Any:
    return field(default_factory=lambda: list(items))


# ───────────────────────────────────────── data ─────────────────────────────────────────


@dataclass
class CustomClsConfig(Node):
    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class SamplerConfig(Node):
    class_path: Optional[str] = None
    class_name: Optional[str] = None


@dataclass
class SyntheticDataConfig:  # rlfoundry: the built-in task used when data.train_files is null
    task: str = one_of(("arithmetic", "shape_colour"), "arithmetic")  # shape_colour: image rows (the vision demo)
    train_size: int = 640
    val_size: int = 128
    seed: int = 0
    digits: int = 2  # operands in [0, 10**digits)
    ops: str = "+-"
    num_operands: int = 2


@dataclass
class DataConfig(Node):
    tokenizer: Optional[str] = None
    use_shm: bool = False
    train_files: Any = None  # str | list[str]; null -> the synthetic task below, generated into <run_dir>/data (rlfoundry)
    val_files: Any = None
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 64  # verl: 512
    max_response_length: int = 16  # verl: 512
    # a DAPO recipe script adds it (+data.min_response_length); nothing in verl reads it (verl_compat.NO_EFFECT_KEYS)
    min_response_length: Optional[int] = None
    train_batch_size: int = 16  # verl: 1024
    # fully async (async_training.mode=fully_async): prompts per rollouter engine call; null: train_batch_size
    gen_batch_size: Optional[int] = None
    val_batch_size: Optional[int] = None  # deprecated in verl: validation runs as one batch
    return_raw_input_ids: bool = False
    return_raw_chat: bool = False
    return_full_prompt: bool = False
    shuffle: bool = True
    validation_shuffle: bool = False
    seed: int = 1
    # verl's subsets: at most this many rows of the train / validation files (-1: all; data/rl_dataset.py sample_rows)
    train_max_samples: int = -1
    val_max_samples: int = -1
    dataloader_num_workers: int = 0  # verl: 8
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = one_of(("error", "left", "right", "middle"), "error")
    image_key: str = "images"
    video_key: str = "videos"
    # verl's image resize grid (qwen_vl_utils' patch size); null: the processor's own, the only one built
    # (another value is a start-up error: data/rl_dataset.py RLHFDataset._check_patch_size)
    image_patch_size: Optional[int] = None
    return_multi_modal_inputs: bool = True  # no effect: image rows always carry their pixel inputs
    trust_remote_code: bool = False
    apply_chat_template: bool = True  # rlfoundry: False joins the messages with newlines (no chat template)
    apply_chat_template_kwargs: Dict[str, Any] = _dict()
    custom_cls: CustomClsConfig = _sub(CustomClsConfig)
    sampler: SamplerConfig = _sub(SamplerConfig)
    synthetic: SyntheticDataConfig = _sub(SyntheticDataConfig)  # rlfoundry

    def check(self) -> list[str]:
        return [f"data.{k}={getattr(self, k)} must be positive." for k in ("max_prompt_length", "max_response_length")
                if getattr(self, k) <= 0]


# ───────────────────────────────────── shared pieces ─────────────────────────────────────


@dataclass
class OptimConfig(Node):
    lr: float = 5e-5  # verl: 1e-6 (actor); the critic's is set in CriticConfig
    lr_warmup_steps: int = -1  # takes priority; negative -> lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: Optional[float] = None
    num_cycles: float = 0.5
    warmup_style: str = one_of(LR_SCHEDULES, "constant")  # verl <= 0.4; lr_scheduler_type wins when set
    lr_scheduler_type: Optional[str] = one_of(LR_SCHEDULES, None)  # verl >= 0.5; null: warmup_style
    total_training_steps: int = -1  # written by the trainer's resolution step, never by hand
    weight_decay: float = 0.01
    betas: List[float] = _list(0.9, 0.999)
    eps: float = 1e-8  # rlfoundry: AdamW's eps (verl fixes it at torch's default, the same value)
    clip_grad: Optional[float] = None  # verl >= 0.5's name of the role's grad_clip (verl_compat copies it there)
    # Megatron's spellings of the schedule (verl's optim/megatron.yaml), honoured on every engine:
    lr_decay_style: Optional[str] = None  # constant | cosine: = lr_scheduler_type (verl_compat copies it there)
    lr_warmup_init: float = 0.0  # the warm-up rises linearly from this lr to lr (engines/fsdp/utils.py lr_lambda)
    min_lr: Optional[float] = None  # cosine's floor as an lr: = min_lr_ratio × lr (verl_compat converts it)
    lr_decay_steps: Optional[int] = None  # the schedule's length (warm-up ratio and cosine); null: the run's steps
    weight_decay_incr_style: str = "constant"  # Megatron's weight-decay schedule; only constant is built
    # verl's optimizer class (FSDP: optimizer_impl.optimizer): AdamW here; Megatron's "adam" is its AdamW
    optimizer: str = "AdamW"
    optimizer_impl: str = "torch.optim"
    # more optimizer settings: megatron-core OptimizerConfig fields (strategy=megatron) or AdamW keyword
    # arguments (fsdp); checked at start-up (trainer/config.py _check_optimizers). verl: null (fsdp)
    override_optimizer_config: Dict[str, Any] = _dict()


@dataclass
class QatConfig(Node):
    """verl's quantisation-aware training (``fsdp_config.qat`` / ``megatron.qat`` / ``actor.qat``: NVIDIA
    ModelOpt's NVFP4 fake quantisation in training, the rollout's weights quantised on sync). Not built:
    ``enable=true`` is a start-up error (trainer/config.py ``_check_unbuilt_model_features``)."""

    enable: bool = False
    mode: str = "w4a16"
    group_size: int = 16
    ignore_patterns: List[str] = field(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"])
    activation_observer: Optional[str] = "static_minmax"
    quantization_config_path: Optional[str] = None


def qat_problems(places: Dict[str, Any]) -> list[str]:
    """The start-up error of each ``{key: qat section}`` whose QAT is enabled (RL roles and SFT's engine)."""
    return [f"{key}.qat.enable=true: quantisation-aware training (verl's NVFP4 {qat.mode} fake quantisation through "
            "NVIDIA ModelOpt, the rollout's weights quantised on each sync) is not built; the model trains and "
            "samples in its own dtype. Set it false (or remove the qat keys)."
            for key, qat in places.items() if qat.enable]


@dataclass
class FSDPConfig(Node):
    wrap_policy: Dict[str, Any] = _dict(min_num_params=0)
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    # rlfoundry (verl's <role>.veomni.expert_parallel_size lands here): each routed layer's experts sharded by
    # expert over groups of this many ranks, tokens sent to them by all-to-all (engines/fsdp/expert_parallel.py)
    expert_parallel_size: int = 1
    forward_prefetch: bool = False
    model_dtype: str = "fp32"
    mixed_precision: Dict[str, Any] = _dict()
    grad_offload: bool = False  # removed in verl >= 0.2; accepted for old scripts
    # verl (Aug 2026) spells the role's ulysses_sequence_parallel_size here (verl_compat copies it there)
    ulysses_sequence_parallel_size: Optional[int] = None
    # verl (Aug 2026): the entropy keys here too (always on: verl_compat.NO_EFFECT_KEYS); FSDP1's flag
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    use_orig_params: bool = False  # FSDP1 only; FSDP2 always keeps the original parameters (no effect)
    strategy: Optional[str] = None  # verl's fsdp | fsdp2 here: one FSDP2 engine either way (no effect)
    # verl (Aug 2026): the engine's compile switch, the role's use_torch_compile (actor, ref: verl_compat copies
    # it there); the critic and reward model compile nothing, so true there is a start-up error
    use_torch_compile: Optional[bool] = None
    # rlfoundry: auto = a model alone on one rank with nothing to offload, computing in its own dtype or in
    # bf16 over fp32 weights (then under torch.autocast), is not wrapped (FSDP2 would only copy and cast
    # every weight and gradient; engines/fsdp/utils.py fsdp_does_nothing); fsdp = wrap anyway
    single_rank: str = one_of(("auto", "fsdp"), "auto")
    # verl (Aug 2026): the settings of its ``strategy=fsdp_turbo`` engine (Huawei's fsdp_turbo package), put onto
    # the FSDP engine's keys by config/fsdp_turbo.py
    turbo_config: Dict[str, Any] = _dict()
    qat: QatConfig = _sub(QatConfig)  # verl (Aug 2026): quantisation-aware training, not built


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # actor.router_replay.mode; models/routing_replay.py


@dataclass
class RouterReplayConfig(Node):
    """verl's MoE routing replay (models/routing_replay.py, docs/moe.md). R3: the forwards replay the experts
    the rollout recorded (needs rollout.enable_rollout_routing_replay); R2: the update replays the experts
    of the trainer's own old-log-prob forward."""

    mode: str = one_of(ROUTER_REPLAY_MODES, "disabled")
    record_file: Optional[str] = None  # declared by verl and read by none of its code; a path is an error here
    replay_file: Optional[str] = None

    def check(self) -> list[str]:
        files = {k: v for k, v in (("record_file", self.record_file), ("replay_file", self.replay_file)) if v}
        return [f"router_replay.{k}={v}: routing records on disk are not built (verl declares the key and no verl "
                f"code reads it); remove it — the routing travels in the batch (routed_experts)." for k, v in files.items()]


@dataclass
class VeOmniRouterReplayConfig(Node):
    mode: str = one_of(ROUTER_REPLAY_MODES, "disabled")  # verl's EngineRouterReplayConfig: the mode only


@dataclass
class VeOmniConfig(Node):
    """verl's ``*.veomni`` keys (``model_engine=veomni``, ``strategy=veomni``), verl's defaults
    (``engine/veomni.yaml``): the FSDP2 engine runs the role; ``config/veomni.py`` puts each key onto the
    FSDP key doing the same, or names it as not built."""

    param_offload: bool = False
    optimizer_offload: bool = False
    fsdp_size: int = -1
    ulysses_parallel_size: int = 1
    expert_parallel_size: int = 1
    mixed_precision: bool = True
    seed: int = 42
    full_determinism: bool = False
    init_device: str = "meta"
    enable_full_shard: bool = True
    ckpt_manager: str = "dcp"
    load_checkpoint_path: Optional[str] = None
    forward_prefetch: bool = True
    strategy: str = "veomni"
    use_torch_compile: bool = False
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    forward_only: bool = False
    enable_fsdp_offload: bool = False
    enable_reentrant: bool = False
    attn_implementation: str = "flash_attention_2"
    moe_implementation: str = "fused"
    cross_entropy_loss_implementation: str = "eager"
    rms_norm_implementation: str = "eager"
    swiglu_mlp_implementation: str = "eager"
    rotary_pos_emb_implementation: str = "eager"
    rms_norm_gated_implementation: str = "eager"
    causal_conv1d_implementation: str = "eager"
    chunk_gated_delta_rule_implementation: str = "eager"
    load_balancing_loss_implementation: str = "eager"
    dsa_indexer_implementation: str = "eager"
    dsa_attention_implementation: str = "eager"
    mhc_implementation: str = "eager"
    force_use_huggingface: bool = False
    activation_gpu_limit: float = 0.0
    basic_modules: List[str] = _list()
    pad_to_length: bool = False
    pad_to_length_bucket: int = 1024
    router_replay: VeOmniRouterReplayConfig = _sub(VeOmniRouterReplayConfig)


@dataclass
class MegatronConfig(Node):
    """verl's ``*.megatron`` keys (``strategy=megatron``; ``engines/megatron``)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    # MoE models (engines/megatron/moe.py): the experts spread over this many ranks of the data-parallel ones
    expert_model_parallel_size: int = 1
    # the experts' tensor parallelism: null or tensor_model_parallel_size (Megatron's default; the experts split
    # like the dense layers); others are a start-up error (engines/megatron/moe.py layout_problems)
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = True  # with tensor parallelism only (verl turns it off at TP=1 too)
    use_megatron_fsdp: bool = False  # verl (Aug 2026): Megatron-FSDP instead of DDP; not built (a start-up error)
    # verl (Aug 2026) spells the role's router_replay here too (verl_compat copies the actor's and the ref's there)
    router_replay: RouterReplayConfig = _sub(RouterReplayConfig)
    use_distributed_optimizer: bool = True
    # released between uses, brought back for each (engines/megatron/offload.py; docs/engines.md): the
    # parameters, DDP's gradient buffers, Adam's moments and fp32 main copies; the numbers are the same
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 42
    override_transformer_config: Dict[str, Any] = _dict()
    use_mbridge: bool = True  # the only converter here: HF <-> Megatron through mbridge
    # verl (Aug 2026): mbridge (true) or Megatron-Bridge (its default false); mbridge here either way (no effect)
    vanilla_mbridge: bool = True
    # verl (Aug 2026): packed (thd) micro-batches; the engine here pads rows and masks them: the same numbers
    use_remove_padding: bool = True
    dtype: str = "bfloat16"
    # verl's: the initial weights from a megatron-core dist checkpoint (its directory, verl's converter layout;
    # python -m rlfoundry.scripts.converter_hf_to_mcore writes one) instead of model.path's HF weights, which
    # still give the config and tokenizer; the prefix: its keys' (NeMo 2: "module."). engines/megatron/dist_weights.py
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None
    dist_checkpointing_prefix: str = ""
    qat: QatConfig = _sub(QatConfig)  # verl (Aug 2026): quantisation-aware training, not built


def model_parallel_size(megatron: Any) -> int:
    """Ranks one model copy spans (tensor × pipeline × context) for a ``megatron`` subtree, typed or
    not; data parallel size = ranks / this."""
    return (megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size
            * megatron.context_parallel_size)


def starts_from_dist_checkpoint(actor: Any) -> bool:
    """Whether an actor's engine takes its first weights from a Megatron dist checkpoint rather than
    model.path, which the rollout loads: then the rollout needs the actor's weights before it samples."""
    return actor.strategy == "megatron" and bool(actor.megatron.use_dist_checkpointing)


@dataclass
class CheckpointConfig(Node):
    save_contents: List[str] = _list("model", "optimizer", "extra")
    load_contents: List[str] = _list("model", "optimizer", "extra")
    contents: Optional[List[str]] = None  # verl <= 0.3 spelling of save_contents
    # verl (Aug 2026): whether its Megatron HF export may miss weights; the exports here always hold every
    # weight (verl_compat.NO_EFFECT_KEYS), so false has nothing to let through
    strict: bool = True
    async_save: bool = False  # verl: Megatron's dist-checkpoint writes in the background; not built (true: an error)


@dataclass
class ProfilerConfig(Node):
    """verl's per-role ``profiler`` (Nsight / NPU / torch ranges around the role's calls): observability
    only, listed in verl_compat.NO_EFFECT_KEYS; the torch traces here come from ``global_profiler``."""

    tool: Optional[str] = None  # verl: ${global_profiler.tool}
    enable: bool = False
    discrete: bool = False
    all_ranks: bool = False
    ranks: List[int] = _list()
    save_path: Optional[str] = None
    tool_config: Dict[str, Any] = _dict()


@dataclass
class GlobalProfilerConfig(Node):
    """verl's ``global_profiler``. ``tool=torch`` (or ``torch_memory``) with ``steps`` is
    ``trainer.profile_steps`` (utils/profiler.py: torch.profiler traces, and a CUDA memory snapshot on a
    GPU) written into ``save_path``; verl_compat copies them there. nsys and npu: no effect here."""

    tool: Optional[str] = None  # torch | torch_memory | nsys | npu
    steps: Optional[List[int]] = None
    profile_continuous_steps: bool = False
    save_path: str = "outputs/profile"
    global_tool_config: Dict[str, Any] = _dict()
    # verl (Aug 2026): moving the traces and a command run after them: observability only
    relocate_results: bool = False
    finish_hook_cmd: Optional[str] = None
    finish_hook_all_ranks: bool = False
    finish_hook_ranks: List[int] = _list()


@dataclass
class RolloutCorrectionConfig(Node):
    """verl 0.9's ``algorithm.rollout_correction`` (``algos/rollout_corr.py``): correct for the rollout
    engine's distribution differing from the trainer's. Nothing set: no correction, no metrics."""

    rollout_is: Optional[str] = None  # token | sequence: truncated IS weights on the policy loss
    # the truncation C of min(ρ, C); or "lower_upper" (verl >= 0.7's IcePop: ρ kept within the bounds, else 0)
    rollout_is_threshold: Any = 2.0
    rollout_is_batch_normalize: bool = False  # scale the weights to mean 1 over the batch
    # token | sequence | geometric: drop tokens/sequences whose ratio is out of bounds; or verl >= 0.7's comma
    # list of divergence options (token_k1, seq_mean_k3, ...: algos/rollout_corr.py divergence_rejection_mask)
    rollout_rs: Optional[str] = None
    # required with rollout_rs: the ratio's upper bound; for divergence options a spec such as "0.999_1.001"
    # or one per option, "0.6_1.6,2.5" (a number or a string)
    rollout_rs_threshold: Any = None
    rollout_rs_threshold_lower: Optional[float] = None  # null: 1 / rollout_rs_threshold
    rollout_token_veto_threshold: Optional[float] = None  # drop a sequence with any token ρ below this
    # the rollout's log-probs as old_log_probs (no recompute pass); IS / RS are then computed in the
    # loss against the current policy (actor.policy_loss.loss_mode becomes bypass_mode)
    bypass_mode: bool = False
    # bypass mode's loss: ppo_clip (the PPO ratio π_θ / π_rollout, clipped) or reinforce (−w·A·log π_θ)
    loss_type: str = one_of(("ppo_clip", "reinforce"), "ppo_clip")


@dataclass
class PolicyLossConfig(Node):
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None  # loss_mode=dro: weight of its (log r)^2 penalty; no default, must be > 0
    # verl's SAPO scripts add these (+...policy_loss.tau_pos) but verl's sapo loss reads actor.tau_pos /
    # actor.tau_neg: no effect there or here (verl_compat.NO_EFFECT_KEYS)
    tau_pos: Optional[float] = None
    tau_neg: Optional[float] = None
    # a copy of algorithm.rollout_correction when its bypass_mode is on (as verl does at run time)
    rollout_correction: RolloutCorrectionConfig = _sub(RolloutCorrectionConfig)

    def check(self) -> list[str]:
        key = "actor_rollout_ref.actor.policy_loss"
        if self.loss_mode == "dro" and not (self.dro_beta or 0) > 0:
            return [f"{key}.loss_mode=dro needs {key}.dro_beta > 0 (the weight of its squared log-ratio penalty), "
                    f"got {self.dro_beta}."]
        return []


# ─────────────────────────────────── actor / rollout / ref ───────────────────────────────────


@dataclass
class VerlLoraConfig(Node):
    """verl's Megatron ``model.lora.*`` spelling of the LoRA keys. Unset (null) unless given: the
    ``model.lora_*`` keys hold the settings and their defaults (config/verl_compat.py
    ``_adopt_megatron_lora`` copies what is given onto them, and refuses what is not built)."""

    type: Optional[str] = None  # canonical_lora (one adapter per HF projection) is what is built
    merge: Optional[bool] = None  # -> rollout.lora_sync (true: merged, false: adapter)
    rank: Optional[int] = None  # -> model.lora_rank
    alpha: Optional[int] = None  # -> model.lora_alpha (verl's Megatron default 32; ours 16)
    dropout: Optional[float] = None  # 0 only (the rollout and the update must score tokens alike)
    target_modules: Any = None  # -> model.target_modules (Megatron names translated to HF ones)
    exclude_modules: Any = None  # -> model.exclude_modules
    dropout_position: Optional[str] = None  # no effect at dropout 0
    lora_A_init_method: Optional[str] = None  # kaiming only (peft's kaiming-uniform)
    lora_B_init_method: Optional[str] = None  # zero only
    a2a_experimental: Optional[bool] = None  # false only
    dtype: Optional[str] = None  # null only: the adapters take the model's dtype
    adapter_path: Optional[str] = None  # -> model.lora_adapter_path
    freeze_vision_model: Optional[bool] = None  # text models: true only (nothing to freeze)
    freeze_vision_projection: Optional[bool] = None
    freeze_language_model: Optional[bool] = None  # true only: the base is frozen beside the adapters


@dataclass
class MtpConfig(Node):
    """verl's multi-token prediction (``model.mtp``): the model's MTP layers built (``enable``) and trained
    beside the policy (``enable_train``, the loss scaled by ``mtp_loss_scaling_factor``; ``detach_encoder``)
    on the Megatron engine (engines/megatron/mtp.py); ``enable_rollout``: the HF rollout's speculative decoding
    with the MTP layers as the draft (workers/rollout/mtp_speculative.py), ``num_speculative_tokens`` drafts a
    round, ``method`` must be ``mtp``; the ``speculative_*`` keys are SGLang's (read by nobody here, as by verl's
    vLLM rollout); what it is not combined with: trainer/config.py ``_mtp_rollout_problems``."""

    enable: bool = False
    enable_train: bool = False
    enable_rollout: bool = False
    detach_encoder: bool = False
    mtp_loss_scaling_factor: float = 0.1
    speculative_algorithm: str = "EAGLE"
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    method: str = "mtp"
    num_speculative_tokens: int = 1


@dataclass
class ModelConfig(Node):
    path: str = "rlfoundry://arithmetic-policy"  # verl: ~/models/deepseek-llm-7b-chat (ours: rlfoundry/assets/arithmetic-policy)
    custom_chat_template: Optional[str] = None
    use_shm: bool = False
    external_lib: Optional[str] = None
    override_config: Dict[str, Any] = _dict()
    enable_gradient_checkpointing: bool = False  # verl: True
    enable_activation_offload: bool = False
    use_remove_padding: bool = False
    freeze_vision_tower: bool = False  # vision-language models: the vision encoder takes no gradient
    # rlfoundry: a prompt's n samples share one prompt forward (KV cache), when that computes fewer tokens
    use_shared_prompt: bool = True
    # rlfoundry: the CPU speed-ups (oneDNN linears, fused forward and decode, FSDP hook skipping;
    # rlfoundry/cpu): auto = on when the model runs on the CPU, off = the plain HF/FSDP2 path GPUs take
    cpu_kernels: str = one_of(CPU_KERNELS, "auto")
    # LoRA (models/lora.py, peft): rank 0 = full fine-tuning; the reference is the model with the adapter off
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"  # or a list of module names
    exclude_modules: Any = None
    lora_adapter_path: Optional[str] = None  # a peft adapter directory to start from
    lora: VerlLoraConfig = _sub(VerlLoraConfig)  # verl's Megatron spelling of the keys above
    use_liger: bool = False  # Liger's Triton kernels in the actor and reference (CUDA + liger-kernel; models/liger.py)
    use_fused_kernels: bool = False
    fused_kernel_options: Dict[str, Any] = _dict()
    trust_remote_code: bool = False
    mtp: MtpConfig = _sub(MtpConfig)


@dataclass
class ActorConfig(Node):
    strategy: str = one_of(STRATEGIES, "fsdp")
    ppo_mini_batch_size: int = 8  # in prompts; the worker multiplies by rollout.n. verl: 256
    ppo_micro_batch_size: Optional[int] = None  # deprecated: global; use ppo_micro_batch_size_per_gpu
    ppo_micro_batch_size_per_gpu: Optional[int] = 32  # verl: null
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2
    clip_ratio_high: Optional[float] = 0.2
    clip_ratio_c: float = 3.0
    loss_scale_factor: Optional[float] = None  # a fixed divisor of seq-mean-token-sum* losses (verl >= 0.6)
    loss_agg_mode: str = one_of(LOSS_AGG_MODES, "token-mean")
    entropy_coeff: float = 0.0
    tau_pos: float = 1.0  # policy_loss.loss_mode=sapo: gate temperature where A > 0
    tau_neg: float = 1.05  # ... and where A <= 0
    gvpo_beta: float = 0.1  # policy_loss.loss_mode=gvpo: beta, the KL weight of its implicit reward (verl's recipe)
    dpo_beta: float = 0.1  # policy_loss.loss_mode=spin (verl's SPIN recipe key): beta of its DPO loss (algos/spin.py)
    # the log-prob pass also returns sum_pi_squared = sum_v pi_v^2 per token (B, Tr): what the optimal token
    # baselines read (trainer/config.py requires it for them, as verl's trainer does)
    calculate_sum_pi_squared: bool = False
    sppo_eta: float = 1.0  # policy_loss.loss_mode=sppo (verl's SPPO recipe key): the scale of its regression target
    use_kl_loss: bool = False
    proj_layer: int = 3  # policy_loss.loss_mode=flowrl: layers of the log Z head (verl's recipe reads actor.proj_layer)
    # each decoder layer's training forward compiled (engines/fsdp/compile.py; the reference follows).
    # verl: True. Off here: compiling costs ~25 s per graph on a small CPU run (two graphs), more than the
    # update time it saves there; on GPUs it pays back within a run
    use_torch_compile: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = one_of(KL_ESTIMATORS, "low_var_kl")
    ppo_epochs: int = 1
    shuffle: bool = False
    # reuse the HF rollout's log-probs as old_log_probs, skipping compute_log_prob: the same numbers where
    # the update is on the sampling policy (HF engine, one epoch, one mini-batch per step; trainer/config.py).
    # null (auto): on exactly there (the run's first lines say which); true: required (an error elsewhere)
    use_rollout_log_probs: Optional[bool] = None
    ulysses_sequence_parallel_size: int = 1
    data_loader_seed: Optional[int] = None
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    freeze_vision_tower: Optional[bool] = None  # verl's spelling of model.freeze_vision_tower (copied there)
    use_prefix_grouper: Optional[bool] = None  # verl's shared-prefix forward = model.use_shared_prompt (copied there)
    policy_loss: PolicyLossConfig = _sub(PolicyLossConfig)
    router_replay: RouterReplayConfig = _sub(RouterReplayConfig)
    checkpoint: CheckpointConfig = _sub(CheckpointConfig)
    optim: OptimConfig = _sub(OptimConfig)
    fsdp_config: FSDPConfig = _sub(FSDPConfig)
    megatron: MegatronConfig = _sub(MegatronConfig)
    veomni: VeOmniConfig = _sub(VeOmniConfig)  # verl's veomni engine keys (config/veomni.py puts them on the FSDP keys)
    pad_to_length: bool = False  # verl's veomni actor's spelling of veomni.pad_to_length (not built: an error)
    profiler: ProfilerConfig = _sub(ProfilerConfig)
    qat: QatConfig = _sub(QatConfig)  # verl (Aug 2026): quantisation-aware training, not built

    def check(self) -> list[str]:
        key = "actor_rollout_ref.actor.ppo_epochs"
        errors = [f"{key}={self.ppo_epochs} must be positive."] if self.ppo_epochs <= 0 else []
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            errors.append(f"actor_rollout_ref.actor.tau_pos={self.tau_pos} and tau_neg={self.tau_neg} (SAPO's gate "
                          "temperatures) must be > 0.")
        return errors


@dataclass
class RefConfig(Node):
    strategy: str = follows("actor_rollout_ref.actor.strategy", "fsdp", STRATEGIES)
    fsdp_config: FSDPConfig = _sub(FSDPConfig)
    megatron: MegatronConfig = _sub(MegatronConfig)  # the actor's layout (ppo_megatron_trainer interpolates it)
    veomni: VeOmniConfig = _sub(VeOmniConfig)  # verl's: the actor's unless set (config/veomni.py)
    pad_to_length: bool = follows("actor_rollout_ref.actor.pad_to_length", False)  # as the actor's
    use_torch_compile: bool = follows("actor_rollout_ref.actor.use_torch_compile", False)
    log_prob_micro_batch_size: Optional[int] = None  # deprecated: global
    log_prob_micro_batch_size_per_gpu: Optional[int] = 32  # verl: null
    log_prob_use_dynamic_bsz: bool = follows("actor_rollout_ref.actor.use_dynamic_bsz", False)
    log_prob_max_token_len_per_gpu: int = follows("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 16384)
    ulysses_sequence_parallel_size: int = follows("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1)
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    # verl declares it for the reference too and reads the actor's only: the reference routes by its own router
    router_replay: RouterReplayConfig = _sub(RouterReplayConfig)
    profiler: ProfilerConfig = _sub(ProfilerConfig)


@dataclass
class ValKwargsConfig(Node):
    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig(Node):
    """verl's ``rollout.multi_turn`` keys (``workers/rollout/agent_loop/``)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None  # null: until the response budget runs out
    max_user_turns: Optional[int] = None  # tool-response turns; null: no limit
    tool_config_path: Optional[str] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256  # characters of a tool's text; cut on the side below
    tool_response_truncate_side: str = one_of(("left", "middle", "right"), "middle")
    interaction_config_path: Optional[str] = None
    use_inference_chat_template: bool = False  # the engine sees the chat re-rendered each turn; the row keeps its tokens
    tokenization_sanity_check_mode: str = one_of(("strict", "ignore_strippable", "disable"), "strict")
    # the tool-call parser (tools/parser.py), or spo: spo_tool_agent's <code> blocks (config/spo.py)
    format: str = one_of(TOOL_CALL_FORMATS + (SPO_FORMAT,), "hermes")
    tool_timeout_s: float = 30.0  # rlfoundry: a call that takes longer answers with an error
    # verl's: how many conversations a custom agent loop simulates per sample (recipe/collabllm reads it as
    # config.num_repeat_rollouts); the loops rlfoundry ships do not use it, a registered loop reads it here
    num_repeat_rollouts: Optional[int] = None


@dataclass
class OpenAIAgentConfig(Node):
    """rlfoundry: ``agent_name: openai_agent`` — an agent function that talks to a local OpenAI-compatible
    endpoint over the rollout engine (``workers/rollout/agent_loop/openai_agent.py``)."""

    path: Optional[str] = None  # a .py file or a dotted module that defines the agent function
    name: str = "run_agent"  # the function: name(base_url=, api_key=, prompt=, extra_info=) -> answer
    timeout_s: float = 300.0  # per trajectory; later requests are refused and the sample is lost
    host: str = "127.0.0.1"  # bind address (loopback; the node's address or 0.0.0.0 for an agent elsewhere)
    port: int = 0  # 0: any free port
    # the host name agents are given in base_url; null: host, or this node's address when host is 0.0.0.0 / ::
    advertise_host: Optional[str] = None
    max_segments: int = 1  # training rows per trajectory: an agent that rewrites its history makes several


@dataclass
class AgentConfig(Node):
    """verl's ``rollout.agent`` keys."""

    # a row's loop when it has no agent_name: single_turn_agent, tool_agent or a registered name;
    # null (rlfoundry): tool_agent, since only rollout.multi_turn.enable runs agent loops here
    default_agent_loop: Optional[str] = None
    agent_loop_config_path: Optional[str] = None  # YAML list of {name, _target_: module.AgentLoopClass}
    num_workers: int = 8  # concurrent trajectories per worker in verl; here all of a batch run together
    # rlfoundry: how long the engine waits for trajectories still in their tools before generating
    # for those that are ready (a run is reproducible when every tool answers within it)
    max_wait_s: float = 1.0
    custom_async_server: Dict[str, Any] = _dict()
    openai: OpenAIAgentConfig = _sub(OpenAIAgentConfig)  # rlfoundry: the openai_agent loop


@dataclass
class CheckpointEngineConfig(Node):
    """verl 0.9's ``rollout.checkpoint_engine``: how weights reach a rollout pool of its own."""

    # auto: gloo (buckets staged in CPU memory); delta_sharded: the same bridge, sending after the first sync
    # only the changed positions of each tensor and their values (engine_kwargs.delta_sharded.encoding)
    backend: str = one_of(("auto", "gloo", "delta_sharded"), "auto")
    update_weights_bucket_megabytes: int = 512
    # verl's per-back-end arguments, {backend: {key: value}}; read: engine_kwargs.delta_sharded (check below)
    engine_kwargs: Dict[str, Any] = _dict()
    # rlfoundry: the limit of joining the bridge and of each broadcast of a sync; a rank that never
    # joins or stops answering ends the run with its name (workers/checkpoint_engine.py)
    timeout_s: Optional[float] = None  # null: the workers' trainer.dist_timeout_s
    # rlfoundry: after every sync (this bridge's, and the hybrid engine's when the rollout holds a copy)
    # compare per-tensor digests of the engine's weights with the trainer's (workers/weight_sync.py)
    verify: bool = True

    def check(self) -> list[str]:
        """verl's ``engine_kwargs`` of the back end in use: each key honoured or an error naming it."""
        key = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs"
        kwargs, errors = dict(self.engine_kwargs or {}), []
        if self.backend in ("auto", "gloo") and kwargs.get(self.backend):
            errors.append(f"{key}.{self.backend}={dict(kwargs[self.backend])}: the gloo back end takes no arguments; "
                          "remove them.")
        delta = dict(kwargs.get("delta_sharded") or {}) if self.backend == "delta_sharded" else {}
        for name, value in delta.items():
            if name == "encoding" and value != "indices":
                errors.append(f"{key}.delta_sharded.encoding={value}: the one encoding built (verl's only one for "
                              "steady syncs) is indices: int32 positions and their values; set it to indices.")
            elif name == "verify_every" and value and not self.verify:
                errors.append(f"{key}.delta_sharded.verify_every={value} asks for a periodic check of the rollout's "
                              "weights, which rlfoundry does after every sync with checkpoint_engine.verify=true; set "
                              "verify=true (or drop verify_every).")
            elif name not in ("encoding", "verify_every", "batch_gather"):
                errors.append(f"{key}.delta_sharded.{name} is not an argument of the delta back end; it takes "
                              "encoding (indices), verify_every and batch_gather (verl's).")
        return errors


@dataclass
class RolloutConfig(Node):
    name: str = one_of(ROLLOUT_NAMES, "hf")  # verl: vllm
    mode: str = "sync"
    chat_scheduler: Optional[str] = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    # FIRE: the first response token at temperature 30, top-k 16 (SamplingParams.for_token); HF engine only
    use_fire_sampling: bool = False
    prompt_length: int = follows("data.max_prompt_length", 64)
    response_length: int = follows("data.max_response_length", 16)
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    ignore_eos: bool = False
    enforce_eager: bool = True
    free_cache_engine: bool = True
    # verl's switch for the engine's sleep mode (vLLM enable_sleep_mode, SGLang's memory saver): false keeps
    # the engine's memory between rollouts whatever free_cache_engine says (GPU; nothing is released on CPU)
    enable_sleep_mode: bool = True
    load_format: str = "dummy_dtensor"
    layered_summon: bool = False  # no effect: weights always stream one tensor at a time
    # rlfoundry: with model.lora_rank > 0, what vLLM receives after each update: the adapter alone (a
    # LoRA request on the unchanged base) or the merged weights (W + scaling·BA, as without LoRA)
    lora_sync: str = one_of(LORA_SYNCS, "adapter")
    tensor_model_parallel_size: int = 1  # verl: 2
    # vLLM/SGLang tensor, data and expert parallelism inside one rollout replica: the engines run one replica per
    # rank whatever they say (a start-up warning, trainer/config.py _warn_rollout_layout; docs/rollout.md)
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    # verl's TensorRT-LLM MoE tensor parallelism (verl asserts > 1 needs rollout.name=trtllm, an engine not
    # built here): 1 accepted, > 1 a start-up error
    moe_tensor_parallel_size: int = 1
    # verl declares it (stop a rollout once (1 - rate) of its requests are done) and no verl code reads it, in
    # January or August: every request runs to its end there and here (no effect, verl_compat.NO_EFFECT_KEYS)
    over_sample_rate: float = 0.0
    # verl's quantised rollout (vLLM fp8 / torchao): not built, a value is a start-up error
    quantization: Optional[str] = None
    quantization_config_file: Optional[str] = None
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024
    enable_prefix_caching: bool = True  # vLLM's prefix caching, SGLang's radix cache
    sglang_rollout_mode: Optional[str] = None  # verl <= 0.4's SGLang switch, read by no verl code either (no effect)
    # batch sizes the engine captures CUDA graphs for (vLLM compilation_config, SGLang cuda_graph_bs); null: the engine's
    cudagraph_capture_sizes: Optional[List[int]] = None
    skip_tokenizer_init: bool = True  # no effect: token ids in and out; the engine loads a tokenizer only for images
    prometheus: Dict[str, Any] = _dict(enable=False)  # verl's rollout-server metrics export: observability only
    # verl's SGLang HTTP-client settings: declared in its config, passed by no verl code (no effect here either)
    server: Dict[str, Any] = _dict(timeout=60.0, max_attempts=3, retry_delay=2.0, max_connections=1000,
                                   max_start_wait_time=300.0)
    micro_batch_size: Optional[int] = None  # verl <= 0.2; no effect
    log_prob_micro_batch_size: Optional[int] = None  # deprecated: global
    log_prob_micro_batch_size_per_gpu: Optional[int] = 32  # verl: null
    log_prob_use_dynamic_bsz: bool = follows("actor_rollout_ref.actor.use_dynamic_bsz", False)
    log_prob_max_token_len_per_gpu: int = follows("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 16384)
    disable_log_stats: bool = True
    enable_chunked_prefill: bool = True
    do_sample: bool = True
    n: int = 8  # verl: 1
    seed: int = 0
    calculate_log_probs: bool = False
    # exact mode (docs/on_policy.md): the HF engine's decode and the FSDP actor's and reference's forwards run
    # batch-invariant ops (models/batch_invariant.py), so rollout log-probs equal the trainer's bit for bit
    exact_log_probs: bool = False
    # MoE: the rollout records the experts of every token into the batch (routed_experts; docs/moe.md)
    enable_rollout_routing_replay: bool = False
    # the HF engine's static-shape decode compiled with torch.compile (CUDA graphs on CUDA; static_decode.py).
    # null (auto): on on CUDA, off on the CPU (the dynamic loop with the CPU kernels is faster there)
    use_torch_compile: Optional[bool] = None
    multi_stage_wake_up: bool = False
    update_weights_bucket_megabytes: int = 512
    # a separate rollout pool's weight transfer (workers/checkpoint_engine.py)
    checkpoint_engine: CheckpointEngineConfig = _sub(CheckpointEngineConfig)
    engine_kwargs: Dict[str, Any] = _dict()
    val_kwargs: ValKwargsConfig = _sub(ValKwargsConfig)
    multi_turn: MultiTurnConfig = _sub(MultiTurnConfig)
    agent: AgentConfig = _sub(AgentConfig)
    trace: Dict[str, Any] = _dict()
    profiler: ProfilerConfig = _sub(ProfilerConfig)

    def check(self) -> list[str]:
        """Sampling that means something, and the limits of the agent loop and of a weight sync."""
        key, errors = "actor_rollout_ref.rollout", []
        if self.val_kwargs.n <= 0:
            errors.append(f"{key}.val_kwargs.n={self.val_kwargs.n} must be positive.")
        if self.do_sample and self.temperature <= 0:
            errors.append(f"{key}.temperature={self.temperature} must be > 0 when sampling (do_sample=True).")
        if self.use_fire_sampling and self.name != "hf":
            errors.append(f"{key}.use_fire_sampling=true is built for the HF engine only (rollout.name=hf), not "
                          f"rollout.name={self.name}; set {key}.use_fire_sampling=false or {key}.name=hf.")
        if self.multi_turn.enable and self.multi_turn.max_parallel_calls < 1:
            errors.append(f"{key}.multi_turn.max_parallel_calls must be >= 1.")
        server = self.agent.custom_async_server or {}
        if server.get("path") or server.get("name"):
            # verl's AsyncServerBase subclasses drive verl's own engine workers; none would run here, and
            # ignoring the key would train with another engine than the command line names
            errors.append(f"{key}.agent.custom_async_server={dict(server)}: verl's async server classes cannot "
                          "run in rlfoundry; remove the key, and bring an inference engine as a rollout engine "
                          "plug-in (config/rollout_engines.py, docs/rollout.md) or an agent through "
                          f"{key}.agent.default_agent_loop=openai_agent (docs/agents.md).")
        if self.exact_log_probs and self.name != "hf":
            errors.append(f"{key}.exact_log_probs=true is built for the HF engine (rollout.name=hf) only: {self.name}'s "
                          "kernels reduce in orders the trainer's forward does not reproduce (and this install's "
                          f"batch-invariant mode, where it has one, is not wired); set {key}.name=hf or "
                          f"{key}.exact_log_probs=false.")
        if self.moe_tensor_parallel_size > 1:
            errors.append(f"{key}.moe_tensor_parallel_size={self.moe_tensor_parallel_size}: verl accepts it only with "
                          "rollout.name=trtllm (TensorRT-LLM's MoE tensor parallelism), an engine rlfoundry does not "
                          f"have; set {key}.moe_tensor_parallel_size=1 (the rollout engines here run each replica whole).")
        timeout = self.checkpoint_engine.timeout_s
        if timeout is not None and timeout <= 0:
            errors.append(f"{key}.checkpoint_engine.timeout_s={timeout} must be positive (the limit of each "
                          "weight-sync step), or null: trainer.dist_timeout_s.")
        return errors


@dataclass
class ActorRolloutRefConfig(Node):
    hybrid_engine: bool = True
    nccl_timeout: Optional[float] = None  # seconds; verl's name of trainer.dist_timeout_s (copied there). verl: 600
    model: ModelConfig = _sub(ModelConfig)
    actor: ActorConfig = _sub(ActorConfig)
    ref: RefConfig = _sub(RefConfig)
    rollout: RolloutConfig = _sub(RolloutConfig)


# ───────────────────────────────────────── critic ─────────────────────────────────────────


@dataclass
class CriticModelConfig(Node):
    path: Optional[str] = None  # an HF directory; required for gae. verl: ~/models/deepseek-llm-7b-chat
    tokenizer_path: Optional[str] = follows("actor_rollout_ref.model.path", None)
    use_shm: bool = False
    override_config: Dict[str, Any] = _dict()
    external_lib: Optional[str] = follows("actor_rollout_ref.model.external_lib", None)
    enable_gradient_checkpointing: bool = False  # verl: True
    enable_activation_offload: bool = False
    use_remove_padding: bool = False
    cpu_kernels: str = one_of(CPU_KERNELS, "auto")  # rlfoundry: as ModelConfig.cpu_kernels
    trust_remote_code: bool = False
    fsdp_config: FSDPConfig = _sub(FSDPConfig)
    lora_rank: int = 0  # LoRA on the critic: the value head trains in full beside the adapter
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    lora: VerlLoraConfig = _sub(VerlLoraConfig)  # verl's Megatron spelling of the keys above


@dataclass
class CriticConfig(Node):
    enable: Optional[bool] = None  # null -> on exactly when algorithm.adv_estimator is gae
    rollout_n: int = follows("actor_rollout_ref.rollout.n", 8)
    strategy: str = one_of(STRATEGIES, "fsdp")
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))  # verl: lr 1e-5
    model: CriticModelConfig = _sub(CriticModelConfig)
    fsdp: FSDPConfig = _sub(FSDPConfig)  # verl (Aug 2026)'s place of model.fsdp_config (verl_compat copies it there)
    ppo_mini_batch_size: int = follows("actor_rollout_ref.actor.ppo_mini_batch_size", 8)
    ppo_micro_batch_size: Optional[int] = None  # deprecated: global
    ppo_micro_batch_size_per_gpu: Optional[int] = 32  # verl: null
    forward_micro_batch_size: Optional[int] = follows("critic.ppo_micro_batch_size", None)
    forward_micro_batch_size_per_gpu: Optional[int] = follows("critic.ppo_micro_batch_size_per_gpu", 32)
    use_dynamic_bsz: bool = follows("actor_rollout_ref.actor.use_dynamic_bsz", False)
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = follows("critic.ppo_max_token_len_per_gpu", 32768)
    ulysses_sequence_parallel_size: int = 1
    ppo_epochs: int = follows("actor_rollout_ref.actor.ppo_epochs", 1)
    shuffle: bool = follows("actor_rollout_ref.actor.shuffle", False)
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = follows("actor_rollout_ref.actor.loss_agg_mode", "token-mean", LOSS_AGG_MODES)
    checkpoint: CheckpointConfig = _sub(CheckpointConfig)
    megatron: MegatronConfig = _sub(MegatronConfig)
    veomni: VeOmniConfig = _sub(VeOmniConfig)
    profiler: ProfilerConfig = _sub(ProfilerConfig)


# ───────────────────────────────────── reward model / function ─────────────────────────────────────


@dataclass
class RewardModelModelConfig(Node):
    input_tokenizer: Optional[str] = follows("actor_rollout_ref.model.path", None)
    path: Optional[str] = None  # verl: ~/models/FsfairX-LLaMA3-RM-v0.1
    use_shm: bool = False
    external_lib: Optional[str] = follows("actor_rollout_ref.model.external_lib", None)
    use_remove_padding: bool = False
    use_fused_kernels: bool = False
    cpu_kernels: str = one_of(CPU_KERNELS, "auto")  # rlfoundry: as ModelConfig.cpu_kernels
    trust_remote_code: bool = False
    fsdp_config: FSDPConfig = _sub(FSDPConfig)


@dataclass
class RewardModelConfig(Node):
    enable: bool = False
    strategy: str = "fsdp"
    model: RewardModelModelConfig = _sub(RewardModelModelConfig)
    micro_batch_size: Optional[int] = None  # deprecated: global
    micro_batch_size_per_gpu: Optional[int] = 32  # verl: null
    max_length: Optional[int] = None
    ulysses_sequence_parallel_size: int = 1
    use_dynamic_bsz: bool = follows("critic.use_dynamic_bsz", False)
    forward_max_token_len_per_gpu: int = follows("critic.forward_max_token_len_per_gpu", 32768)
    reward_manager: str = "naive"
    launch_reward_fn_async: bool = False
    # verl (Jan 2026): score through the reward loop (true) or the legacy reward-model worker: the classifier's
    # same score, one path here; with custom_reward_function.path the loop scores with the function alone,
    # which calls the model served at SGLang's /generate (rewards/reward_loop.py). verl: true
    use_reward_loop: bool = True
    num_workers: Optional[int] = None  # verl's reward-loop workers = reward_kwargs.num_workers (scorer processes)
    # verl: the reward model in a pool of its own; a model served to the custom function (use_reward_loop)
    # gets one here too; the classifier runs beside the actor (no effect then)
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 0
    nnodes: int = 0
    # the engine verl's reward loop serves the model on: a generative model served to the custom function runs
    # on it; a classifier runs on the FSDP engine (no effect then)
    rollout: "JudgeRolloutConfig" = field(default_factory=lambda: JudgeRolloutConfig())
    reward_kwargs: Dict[str, Any] = _dict()
    overlong_buffer: Dict[str, Any] = _dict(enable=False, len=0, penalty_factor=0.0, log=False)  # DAPO recipe
    sandbox_fusion: Dict[str, Any] = _dict()
    profiler: ProfilerConfig = _sub(ProfilerConfig)


JUDGE_PARSERS = ("verdict", "number")  # reward.reward_model.parser; rewards/judge.py


@dataclass
class JudgeRolloutConfig(Node):
    """verl's ``reward.reward_model.rollout``: the engine the judge generates on. Its weights are
    loaded from ``model_path`` and never change. Keys as ``actor_rollout_ref.rollout``'s."""

    name: str = one_of(ROLLOUT_NAMES, "hf")  # verl: ??? (required)
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    free_cache_engine: bool = True
    tensor_model_parallel_size: int = 1  # verl: 2
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024
    load_format: str = "auto"
    seed: int = 42
    engine_kwargs: Dict[str, Any] = _dict()
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = False  # no effect: prompts are rendered and tokenised by the driver
    ignore_eos: bool = False
    do_sample: bool = False  # rlfoundry: greedy, so one response gets one verdict. verl: true
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1  # one judgement per response
    prompt_length: int = 2048
    response_length: int = 256  # verl: 2048
    update_weights_bucket_megabytes: int = 512


@dataclass
class GenerativeRewardModelConfig(Node):
    """verl's ``reward.reward_model`` (>= 0.7): a language model that judges each response in text.
    The template, parser and failure score are rlfoundry's (verl leaves them to a custom function)."""

    enable: bool = False
    enable_resource_pool: bool = False  # true: the judge's own processes/GPUs; false: colocated with the actor
    n_gpus_per_node: int = 1  # its own pool's ranks per node (CPU: processes). verl: 8
    nnodes: int = 1  # verl: 0
    model_path: Optional[str] = None
    trust_remote_code: bool = False
    rollout: JudgeRolloutConfig = _sub(JudgeRolloutConfig)
    # rlfoundry: a template file, or a packaged one (correctness: [[YES]]/[[NO]] against the ground
    # truth; rating: [[1]]..[[10]]); null: correctness for the verdict parser, rating for number
    prompt_template: Optional[str] = None
    parser: str = one_of(JUDGE_PARSERS, "verdict")  # rlfoundry
    verdicts: Dict[str, Any] = _dict(YES=1.0, NO=0.0)  # rlfoundry: verdict parser: verdict -> score
    score_range: List[float] = _list(1.0, 10.0)  # rlfoundry: number parser: accepted range, mapped to [0, 1]
    failure_score: float = 0.0  # rlfoundry: the judge's score for a judgement that does not parse


@dataclass
class RewardWeightsConfig(Node):
    """rlfoundry: how the reward sources add up per sample: rule × rule score + judge × judge score."""

    rule: Optional[float] = None  # null: 0 when the judge is enabled (it replaces the rule score), else 1
    judge: float = 1.0


@dataclass
class CustomRewardFunctionConfig(Node):
    path: Optional[str] = None
    name: str = "compute_score"
    reward_kwargs: Dict[str, Any] = _dict()


REWARD_MANAGER_SOURCES = ("register", "importlib")  # reward.reward_manager.source


@dataclass
class RewardManagerModuleConfig(Node):
    path: Optional[str] = None  # a .py file, or pkg://package.module
    name: str = "custom_reward_manager"


@dataclass
class RewardManagerConfig(Node):
    """verl's ``reward.reward_manager`` (>= 0.7). ``register``: ``name`` is a registered manager
    (naive, batch, dapo, or one made with ``@register_reward_manager``); ``importlib``: the class
    ``module.name`` in ``module.path``, a subclass of ``rewards.reward_manager.RuleRewardManager``."""

    source: str = one_of(REWARD_MANAGER_SOURCES, "register")
    name: str = "naive"
    module: RewardManagerModuleConfig = _sub(RewardManagerModuleConfig)


@dataclass
class RewardConfig(Node):
    """verl's top-level ``reward`` (>= 0.7). Its rule-reward keys are the older top-level and
    ``reward_model.*`` ones spelled anew: set this way, ``load_config`` copies them to the older
    places (``VERL_REWARD_KEYS`` in config/verl_compat.py), which hold the values in effect."""

    num_workers: Optional[int] = None  # = reward_model.reward_kwargs.num_workers (scorer processes). verl: 8
    custom_reward_function: CustomRewardFunctionConfig = _sub(CustomRewardFunctionConfig)
    compute_score_kwargs: Dict[str, Any] = _dict()  # keyword arguments of the built-in scorer
    reward_kwargs: Dict[str, Any] = _dict()  # = reward_model.reward_kwargs (verl scripts add it with +)
    reward_manager: RewardManagerConfig = _sub(RewardManagerConfig)
    reward_model: GenerativeRewardModelConfig = _sub(GenerativeRewardModelConfig)
    sandbox_fusion: Dict[str, Any] = _dict(url=None, max_concurrent=64, memory_limit_mb=1024)
    weights: RewardWeightsConfig = _sub(RewardWeightsConfig)  # rlfoundry


# ─────────────────────────────────────── algorithm ───────────────────────────────────────


@dataclass
class KLCtrlConfig(Node):
    type: str = one_of(("fixed", "adaptive"), "fixed")
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig(Node):
    """verl's ``algorithm.filter_groups`` (DAPO dynamic sampling, ``algos/filter_groups.py``)."""

    enable: bool = False
    # what must vary within a group: seq_reward / seq_final_reward (the summed score), or a
    # reward_extra_info key of the reward function (acc, score, ...)
    metric: Optional[str] = None
    max_num_gen_batches: int = 0  # batches generated per step at most; 0: no cap


@dataclass
class AlgorithmConfig(Node):
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: Optional[str] = None  # null -> gae when critic.model.path is set, else grpo. verl: gae
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = one_of(KL_ESTIMATORS, "kl")
    kl_ctrl: KLCtrlConfig = _sub(KLCtrlConfig)
    use_pf_ppo: bool = False
    pf_ppo: Dict[str, Any] = _dict(reweight_method="pow", weight_pow=2.0)
    rollout_correction: RolloutCorrectionConfig = _sub(RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = _sub(FilterGroupsConfig)
    # adv_estimator=gdpo: the reward function's reward_extra_info keys normalised one by one, and their weights
    gdpo_reward_keys: Optional[List[str]] = None
    gdpo_reward_weights: Optional[List[float]] = None  # null: all 1
    # adv_estimator=sppo (verl's SPPO recipe key): the temperature of the batch soft mean its rewards are
    # centred by (algos/sppo.py); 0: the plain mean
    sppo_eta: float = 1.0
    # policy_loss.loss_mode=spin (verl's SPIN recipe reads them here): its DPO loss form and label smoothing
    dpo_loss_type: str = one_of(("sigmoid", "ipo"), "sigmoid")
    dpo_label_smoothing: float = 0.0

    def check(self) -> list[str]:
        """Numbers in range and known levels: ``gamma``/``lam``, the adaptive KL controller, PF-PPO,
        rollout correction, dynamic sampling (``filter_groups``) and the estimators' own inputs."""
        errors = [f"algorithm.{k}={getattr(self, k)} must lie in [0, 1]." for k in ("gamma", "lam")
                  if not 0.0 <= getattr(self, k) <= 1.0]
        if self.kl_ctrl.type == "adaptive" and self.kl_ctrl.horizon <= 0:
            errors.append(f"algorithm.kl_ctrl.horizon={self.kl_ctrl.horizon} must be positive for the adaptive controller.")
        return (errors + self._check_pf_ppo() + self._check_rollout_correction() + self._check_filter_groups()
                + self._check_estimator_inputs())

    def _check_estimator_inputs(self) -> list[str]:
        """GDPO's reward components (the optimal token baselines' sum pi^2: trainer/config.py, it is the actor's)."""
        est, keys, weights = self.adv_estimator, self.gdpo_reward_keys, self.gdpo_reward_weights
        if est != "gdpo":
            return []
        if not keys:
            return ["algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward_extra_info keys of "
                    "your reward function to normalise one by one, e.g. algorithm.gdpo_reward_keys=[format,accuracy]."]
        if weights is not None and len(weights) != len(keys):
            return [f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys)} gdpo_reward_keys; give "
                    "one weight per key or leave it null (all 1)."]
        return []

    def _check_pf_ppo(self) -> list[str]:
        from rlfoundry.algos.pf_ppo import PF_PPO_METHODS

        if not self.use_pf_ppo:
            return []
        errors, method, power = [], self.pf_ppo.get("reweight_method", "pow"), self.pf_ppo.get("weight_pow", 2.0)
        if method not in PF_PPO_METHODS:
            errors.append(f"algorithm.pf_ppo.reweight_method={method!r} is not one of {list(PF_PPO_METHODS)}.")
        if isinstance(power, bool) or not isinstance(power, (int, float)) or power < 0:
            errors.append(f"algorithm.pf_ppo.weight_pow={power!r} must be a number >= 0 (weights are |score| ** weight_pow; "
                          "a negative power makes a zero score's weight infinite).")
        return errors

    def _check_rollout_correction(self) -> list[str]:
        from rlfoundry.algos.rollout_corr import IS_LEVELS

        rc, key, errors = self.rollout_correction, "algorithm.rollout_correction", []
        if rc.rollout_is is not None and rc.rollout_is not in IS_LEVELS:
            errors.append(f"{key}.rollout_is={rc.rollout_is!r}: one of {list(IS_LEVELS)} or null.")
        if rc.rollout_is is not None:
            from rlfoundry.algos.rollout_corr import parse_is_threshold

            try:
                parse_is_threshold(rc.rollout_is_threshold)
            except ValueError as e:
                errors.append(f"{key}: {e}.")
        if rc.rollout_rs is not None:
            errors += self._check_rejection(rc, key)
        if rc.rollout_token_veto_threshold is not None and not rc.rollout_token_veto_threshold > 0:
            errors.append(f"{key}.rollout_token_veto_threshold={rc.rollout_token_veto_threshold} must be > 0.")
        if rc.loss_type != "ppo_clip" and not rc.bypass_mode:
            errors.append(f"{key}.loss_type={rc.loss_type} applies to bypass_mode only; set bypass_mode=true or "
                          "loss_type=ppo_clip.")
        return errors

    @staticmethod
    def _check_rejection(rc: RolloutCorrectionConfig, key: str) -> list[str]:
        """``rollout_rs``: a ratio level with a positive bound, or divergence options whose threshold spec parses."""
        from rlfoundry.algos.rollout_corr import parse_rs_thresholds, rs_options

        try:
            options = rs_options(rc.rollout_rs)
            threshold = rc.rollout_rs_threshold
            if options is None and not (isinstance(threshold, (int, float)) and threshold > 0):
                return [f"{key}.rollout_rs needs rollout_rs_threshold > 0 (the upper bound of the ratio) with "
                        f"rollout_rs={rc.rollout_rs}, got {threshold!r}."]
            if options is not None:
                if threshold is None:
                    return [f"{key}.rollout_rs={rc.rollout_rs} needs rollout_rs_threshold (e.g. 0.999_1.001 for k1)."]
                if rc.rollout_rs_threshold_lower is not None:  # the divergence options read their spec only
                    return [f"{key}.rollout_rs_threshold_lower is for the ratio levels; with rollout_rs="
                            f"{rc.rollout_rs} give the lower bound in the spec: rollout_rs_threshold=LOWER_UPPER."]
                parse_rs_thresholds(options, threshold)
        except ValueError as e:
            return [f"{key}: {e}."]
        return []

    def _check_filter_groups(self) -> list[str]:
        """DAPO dynamic sampling."""
        fg, key = self.filter_groups, "algorithm.filter_groups"
        if not fg.enable:
            return []
        errors = []
        if not fg.metric:
            errors.append(f"{key}.enable=true needs {key}.metric: seq_reward, seq_final_reward or a key of the reward "
                          "function's reward_extra_info (acc, score, ...).")
        if fg.metric == "seq_final_reward" and self.use_kl_in_reward:
            errors.append(f"{key}.metric=seq_final_reward with algorithm.use_kl_in_reward=true is not supported: the KL "
                          "penalty is applied after the groups are chosen; use seq_reward.")
        if fg.max_num_gen_batches < 0:
            errors.append(f"{key}.max_num_gen_batches={fg.max_num_gen_batches} must be >= 0 (0: no cap).")
        return errors


# ──────────────────────────────────────── trainer ────────────────────────────────────────


@dataclass
class SPORhoConfig(Node):
    """verl's SPO recipe ``trainer.spo.rho``: how fast a prompt's tracker forgets (``algos/spo.py``)."""

    type: str = one_of(("kl", "constant"), "kl")  # kl: from the policy's move since the prompt's last visit
    value: float = 0.875  # type=constant: the factor
    clip_lower: float = 0.875  # type=kl: rho's floor; also sets the offline prior's weight 1 / (1 - clip_lower)


@dataclass
class SPOConfig(Node):
    """verl's SPO recipe ``trainer.spo`` (Single-stream Policy Optimization, ``trainer/ppo/spo.py``)."""

    enable: bool = False
    offline_values: Optional[str] = None  # JSON {prompt text: [scores]}; null: every prompt starts at Beta(.5, .5)
    offline_N: int = 8  # offline scores kept per prompt (0: ignore them)
    rho: SPORhoConfig = _sub(SPORhoConfig)


@dataclass
class TrainerConfig(Node):
    balance_batch: bool = True
    total_epochs: int = 1  # verl: 30
    total_training_steps: Optional[int] = None
    profile_steps: Optional[List[int]] = None
    controller_nsight_options: Dict[str, Any] = _dict()
    worker_nsight_options: Dict[str, Any] = _dict()
    project_name: str = "rlfoundry"  # verl: verl_examples
    experiment_name: str = "arithmetic-grpo"  # verl: gsm8k
    logger: Any = _list("console", "file")  # a name or a list of names. verl: [console, wandb]
    log_val_generations: int = 0
    log_freq: int = 1  # log the step's metrics every this many steps (verl's SPIN recipe key; its trainer reads it)
    val_generations_to_log_to_wandb: int = 0  # verl <= 0.2 name of log_val_generations
    rollout_data_dir: Optional[str] = None
    validation_data_dir: Optional[str] = None
    nnodes: int = 1
    n_gpus_per_node: int = 1  # on CPU: the number of worker processes per node. verl: 8
    save_freq: int = 20  # verl: -1
    esi_redundant_time: float = 0.0
    resume_mode: str = one_of(("auto", "disable", "resume_path"), "auto")
    resume_from_path: Optional[str] = None
    val_before_train: bool = True
    val_only: bool = False
    test_freq: int = 10  # verl: -1
    critic_warmup: int = 0
    # policy_loss.loss_mode=spin (verl's SPIN recipe key): copy the actor into the reference every this many
    # steps (verl: before the step's ref log-probs when step % freq == 0); <= 0: the reference stays fixed
    ref_update_freq: int = -1
    default_hdfs_dir: Optional[str] = None
    del_local_ckpt_after_load: bool = False
    # relative interpolations (verl writes ${trainer.project_name}): also resolve in a TrainerConfig alone
    default_local_dir: str = "checkpoints/${.project_name}/${.experiment_name}"
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None
    ray_wait_register_center_timeout: int = 300
    device: str = one_of(("auto", "cuda", "cpu"), "auto")  # auto: cuda when available, else cpu. verl: cuda
    use_legacy_worker_impl: str = "auto"
    use_v1: bool = True  # verl (Aug 2026): its newer trainer implementation; one trainer here (no effect)
    v1: Dict[str, Any] = _dict(trainer_mode="sync")  # verl's v1 trainer; trainer_mode other than sync: check()
    # rlfoundry: local (in-process) | process (one machine, no Ray) | ray | auto (local iff one worker, else ray)
    worker_backend: str = one_of(("auto", *WORKER_BACKENDS), "auto")
    # rlfoundry: process back end: fork (ranks share the driver's imported libraries) | spawn | auto (fork where safe)
    process_start_method: str = one_of(START_METHODS, "auto")
    seed: int = 1  # rlfoundry: torch/numpy seed of the driver and of each worker
    run_dir: Optional[str] = None  # rlfoundry: metrics, plots, synthetic data; null -> default_local_dir
    # rlfoundry: a worker call (Ray back end) running longer is reported, not waited on; null: no limit
    worker_call_timeout_s: Optional[float] = 3600.0
    dist_timeout_s: float = 600.0  # rlfoundry: a collective waiting longer (a dead or stuck peer) fails
    tune_malloc: bool = True  # rlfoundry: glibc malloc in worker processes keeps freed memory (cpu/malloc.py)
    max_consecutive_nan_steps: int = 3  # rlfoundry: stop after this many NaN/Inf-skipped steps in a row; 0: never
    # rlfoundry: per-step |Δ log p| rollout vs trainer by position/turn/data source, and a logged diagnosis
    # when the step's mean passes the threshold (trainer/ppo/mismatch.py, docs/on_policy.md)
    mismatch_audit: bool = True
    mismatch_audit_threshold: float = 0.02  # ~2.5x the mean gap of a bf16 decode vs a bf16 forward (H100)
    # rlfoundry: each step's batch as its phases received it and what they computed, in <run_dir>/replay/<step>.pt,
    # for `rlfoundry replay <run_dir> --step N` (trainer/ppo/replay.py, docs/on_policy.md); with save_freq=1
    replay_records: bool = False
    # rlfoundry: before any weight file is opened, the planner's per-rank peak (rlfoundry/plan, docs/plan.md)
    # against the visible device's memory (the host's on a CPU); a run that cannot fit stops with the breakdown
    plan_check: bool = True
    spo: SPOConfig = _sub(SPOConfig)  # verl's SPO recipe (spo_trainer)
    debug: bool = False  # verl's SPO recipe: Ray's legacy debugger (RAY_DEBUG=legacy) in the workers

    def check(self) -> list[str]:
        """Positive numbers, output directories that are directories, what resume and the back end need."""
        import os
        from pathlib import Path

        errors = []
        if self.total_epochs <= 0:
            errors.append(f"trainer.total_epochs={self.total_epochs} must be positive.")
        if self.total_training_steps is not None and self.total_training_steps <= 0:
            errors.append(f"trainer.total_training_steps={self.total_training_steps} must be positive (or null).")
        if self.log_freq < 1:
            errors.append(f"trainer.log_freq={self.log_freq} must be >= 1 (log every this many steps).")
        if self.log_val_generations < 0:
            errors.append(f"trainer.log_val_generations={self.log_val_generations} must be >= 0 (the number of "
                          "validation samples to log; 0: none).")
        for key in ("rollout_data_dir", "validation_data_dir"):
            where = getattr(self, key)
            if where is not None and Path(os.path.expanduser(str(where))).is_file():
                errors.append(f"trainer.{key}={where} is a file; it must be a directory (one <step>.jsonl per step "
                              "is written into it) or null.")
        if self.worker_call_timeout_s is not None and self.worker_call_timeout_s <= 0:
            errors.append(f"trainer.worker_call_timeout_s={self.worker_call_timeout_s} must be positive (or null: no limit).")
        if self.dist_timeout_s <= 0:
            errors.append(f"trainer.dist_timeout_s={self.dist_timeout_s} must be positive.")
        mode = (self.v1 or {}).get("trainer_mode", "sync")
        if mode != "sync":
            errors.append(f"trainer.v1.trainer_mode={mode}: verl's v1 asynchronous trainer modes are not built; for an "
                          "asynchronous run use --config-name one_step_off_ppo_trainer or fully_async_ppo_trainer.")
        if not self.mismatch_audit_threshold > 0:
            errors.append(f"trainer.mismatch_audit_threshold={self.mismatch_audit_threshold} must be positive (a mean "
                          "|Δ log p| per token, e.g. 0.02); to switch the audit off set trainer.mismatch_audit=false.")
        if self.max_consecutive_nan_steps < 0:
            errors.append(f"trainer.max_consecutive_nan_steps={self.max_consecutive_nan_steps} must be >= 0 (0: never stop).")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>.")
        ws = int(self.nnodes) * int(self.n_gpus_per_node)
        if self.worker_backend == "local" and ws != 1:
            errors.append(f"trainer.worker_backend=local runs one in-process rank, but nnodes × n_gpus_per_node = {ws}; "
                          "use trainer.worker_backend=process (one machine) or ray (or auto).")
        if self.worker_backend == "process" and int(self.nnodes) != 1:
            errors.append(f"trainer.worker_backend=process is single-node (processes on this machine), but trainer.nnodes={self.nnodes}; "
                          "use trainer.worker_backend=ray for several nodes.")
        return errors


@dataclass
class RolloutPoolConfig(Node):
    """verl's top-level ``rollout`` of its one-step-off / fully-async recipes: the rollout's own pool."""

    nnodes: int = 1
    n_gpus_per_node: int = 0  # 0: the rollout shares the trainer's processes (hybrid engine). CPU: processes
    total_rollout_steps: Optional[int] = None  # fully async: prompts to generate; null: from the training steps
    # verl's January fully-async spellings: the rollouter's passes over the data (-> trainer.total_epochs) and
    # validation every N weight syncs (-> trainer.test_freq = N × trigger_parameter_sync_step); trainer/config.py
    total_epochs: Optional[int] = None
    test_freq: Optional[int] = None


@dataclass
class SandboxConfig(Node):
    """Where generated code (code rewards, the code_interpreter tool) runs; see docs/sandbox.md."""

    # run it without kernel isolation (an audit-hook policy only) where bubblewrap or user namespaces
    # are missing; off: such a run stops at start-up and says how to get isolation
    allow_unisolated: bool = False


@dataclass
class AsyncTrainingConfig(Node):
    """verl's ``async_training`` keys (``trainer/ppo/fully_async.py``, ``one_step_off.py``)."""

    mode: str = one_of(("sync", "one_step_off", "fully_async"), "sync")  # rlfoundry: --config-name sets it
    # fully async: per weight version the rollouter generates at most (1 + staleness_threshold) × the prompts
    # the trainer uses between two syncs; 0: every sample is trained by the version that sampled it
    staleness_threshold: float = 0.0
    trigger_parameter_sync_step: int = 1  # training steps between weight syncs
    require_batches: int = 1  # mini-batches (ppo_mini_batch_size prompts each) per training step
    # fully async: generate in chunks between which a weight sync may come (trainer/ppo/partial_rollout.py);
    # false: a sync waits for the generation in flight
    partial_rollout: bool = False
    partial_rollout_chunk_tokens: Optional[int] = None  # rlfoundry: null: a quarter of data.max_response_length
    # verl's January spelling of actor.use_rollout_log_probs for the async mains (verl interpolates one from the
    # other): true: the old log-probs are the rollout's, PPO's ratio is against the version that sampled;
    # null: the actor's key decides (null there: recomputed under the trainer's current weights)
    use_rollout_log_probs: Optional[bool] = None
    # fully async, with the rollout's log-probs on: the old log-probs are the trainer's under the weights its
    # sync period started with (a CPU copy on the actor; trainer/ppo/ray_trainer.py _prox_log_prob); the
    # rollout's stay the behaviour policy's for rollout_correction. Off: the rollout's are the old log-probs
    compute_prox_log_prob: bool = False
    use_trainer_do_validate: bool = False  # verl: validate on the trainer's pool; here the rollout pool validates

    def check(self) -> list[str]:
        errors = []
        if self.partial_rollout_chunk_tokens is not None and self.partial_rollout_chunk_tokens < 1:
            errors.append("async_training.partial_rollout_chunk_tokens must be >= 1 (or null: a quarter of the response).")
        if self.staleness_threshold < 0 or self.trigger_parameter_sync_step < 1 or self.require_batches < 1:
            errors.append("async_training.staleness_threshold must be >= 0, trigger_parameter_sync_step and "
                          "require_batches >= 1.")
        return errors



# ─────────────────────────────────────── distillation ───────────────────────────────────────
# verl's on-policy distillation (Aug 2026, docs/distillation.md): per-token losses against teacher models'
# log-probs of the student's own samples. algos/distillation.py computes them; teachers are reference-style
# workers (trainer/ppo/teachers.py) on the teacher checkpoints; config/distillation.py resolves and checks them.

DISTILLATION_ESTIMATOR_MODES = _KL_BASE  # one-sample KL estimators on the sampled token (core_algos.kl_penalty)
DISTILLATION_TOPK_MODES = ("forward_kl_topk",)  # read the teacher's top-k distribution (FSDP engine only)


@dataclass
class DistillationLossConfig(Node):
    loss_mode: str = one_of(DISTILLATION_ESTIMATOR_MODES + DISTILLATION_TOPK_MODES, "k3")
    topk: Optional[int] = 32  # the top-k modes' k
    use_task_rewards: bool = True  # false: the PPO/GRPO loss on the task rewards is left out entirely
    distillation_loss_coef: float = 1.0  # its weight beside the task loss (1 without task rewards, as verl)
    loss_max_clamp: Optional[float] = None  # per-token loss clamped to [-c, c] (k1 can be negative)
    log_prob_min_clamp: Optional[float] = None  # the top-k modes' floor on log-probs
    use_policy_gradient: bool = False  # true: -loss is a per-token advantage of a PPO-clip term
    policy_loss_mode: str = one_of(("vanilla",), "vanilla")  # verl accepts only vanilla too
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2


@dataclass
class TeacherInferenceConfig(Node):
    """verl serves a teacher with an inference engine (``name``); here it is a forward pass of the same
    checkpoint on the trainer's engine (docs/distillation.md says which keys size the engine only)."""

    name: Optional[str] = None  # vllm | sglang in verl; the log-probs are the model's either way
    dtype: str = "bfloat16"  # the teacher's weights (fsdp_config.model_dtype of its worker)
    temperature: Optional[float] = None  # verl scores at 1.0 whatever is set (a forward pass samples nothing)
    max_model_len: Optional[int] = None  # must hold prompt + response + 1 (verl's check)
    prompt_length: Optional[int] = None  # null: data.max_prompt_length
    response_length: Optional[int] = None  # null: data.max_response_length
    # engine sizing only (no effect on the numbers)
    tensor_model_parallel_size: int = 2
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: Optional[List[int]] = None
    free_cache_engine: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    load_format: str = "auto"
    engine_kwargs: Dict[str, Any] = _dict()
    limit_images: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = True

    def replica_size(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


@dataclass
class TeacherModelConfig(Node):
    """One entry of ``distillation.teacher_models`` (resolved and checked by ``config/distillation.py``)."""

    key: Optional[str] = None  # the value of distillation.teacher_key whose rows this teacher scores
    model_path: Optional[str] = None
    num_replicas: int = 0  # verl's engine replicas (pool sizing; no effect here)
    inference: TeacherInferenceConfig = _sub(TeacherInferenceConfig)


@dataclass
class DistillationConfig(Node):
    enabled: bool = False
    n_gpus_per_node: int = 8  # verl's teacher pool; teachers share the trainer's ranks here
    nnodes: int = 0
    # name -> TeacherModelConfig keys (open: verl users add entries with +distillation.teacher_models.<name>.*)
    teacher_models: Dict[str, Any] = field(default_factory=lambda: {
        "teacher_model": {"key": None, "model_path": None, "num_replicas": 0}})
    teacher_key: str = "data_source"  # the non-tensor batch column that routes a row to its teacher
    distillation_loss: DistillationLossConfig = _sub(DistillationLossConfig)


@dataclass
class PPOConfig(Node):
    data: DataConfig = _sub(DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = _sub(ActorRolloutRefConfig)
    critic: CriticConfig = _sub(CriticConfig)
    reward_model: RewardModelConfig = _sub(RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = _sub(CustomRewardFunctionConfig)
    reward: RewardConfig = _sub(RewardConfig)
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig)
    trainer: TrainerConfig = _sub(TrainerConfig)
    rollout: RolloutPoolConfig = _sub(RolloutPoolConfig)
    async_training: AsyncTrainingConfig = _sub(AsyncTrainingConfig)
    sandbox: SandboxConfig = _sub(SandboxConfig)  # rlfoundry
    # ray.init's arguments for the Ray back end: address, num_cpus, num_gpus, runtime_env (py_executable,
    # env_vars, ...); trainer/main_ppo.py passes them to single_controller/ray/cluster.py init_ray
    ray_init: Dict[str, Any] = _dict(num_cpus=None, timeline_json_file=None)
    # verl >= 0.5's place of ray_init: ray_kwargs.ray_init.* is copied there (timeline_json_file: no effect)
    ray_kwargs: Dict[str, Any] = field(default_factory=lambda: {"ray_init": {"num_cpus": None},
                                                               "timeline_json_file": None})
    global_profiler: GlobalProfilerConfig = _sub(GlobalProfilerConfig)
    # verl (Aug 2026): on-policy distillation from teacher models (docs/distillation.md)
    distillation: DistillationConfig = _sub(DistillationConfig)

    def check(self) -> list[str]:
        """Each section's own rules (its ``check``), in schema order; the rules between sections and
        those that load files or registries are ``trainer/config.py``'s ``validate_config``."""
        return section_errors(self)


# ─────────────────────────────────────── replaced keys ───────────────────────────────────────


class Replaced(NamedTuple):
    """An rlfoundry key a newer one replaced. Old command lines still parse: a value that the new
    key's default already gives is dropped with a warning; any other value is an error saying what
    to set instead (the new key cannot express it exactly)."""

    by: str
    meaning: str
    kept: tuple
    instead: str


_CPU_KERNELS_MEANING = ("one switch for all the CPU speed-ups: auto = on when the model runs on the CPU, "
                        "off = the plain path GPUs take")


def _by_cpu_kernels(model: str, kept: Any) -> Replaced:
    return Replaced(f"{model}.cpu_kernels", _CPU_KERNELS_MEANING, (kept,),
                    f"to turn the CPU speed-ups off use {model}.cpu_kernels=off")


REPLACED_KEYS: dict[str, Replaced] = {
    **{f"{m}.cpu_linear": _by_cpu_kernels(m, "onednn")
       for m in ("actor_rollout_ref.model", "critic.model", "reward_model.model")},
    "actor_rollout_ref.model.fused_forward": _by_cpu_kernels("actor_rollout_ref.model", True),
    "actor_rollout_ref.rollout.fused_decode": _by_cpu_kernels("actor_rollout_ref.model", True),
}
