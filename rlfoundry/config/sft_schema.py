"""Typed schema of ``rlfoundry sft``: verl's ``fsdp_sft_trainer`` key layout, rlfoundry's defaults.

The dataclasses are the only source of the defaults (there is no SFT YAML); they load through the
same loader as the PPO config (``trainer/config.py``: ``load_typed_config``), so an unknown or
misspelt key is an error naming the nearest valid key and a wrong type names the expected one.
A field with a fixed set of values lists them next to it (``choices`` in the field's metadata;
``choice_errors`` checks them). Keys added by rlfoundry (not in verl) are marked ``# rlfoundry``.

    rlfoundry sft model.partial_pretrain=/models/tiny data.train_files=train.parquet \\
        data.prompt_key=question data.response_key=answer optim.lr=1e-4 trainer.total_epochs=2

verl's GSM8K SFT command line works as is (nested columns through ``prompt_dict_keys``)::

    data.prompt_key=extra_info data.response_key=extra_info \\
    +data.prompt_dict_keys=['question'] +data.response_dict_keys=['answer']
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

from rlfoundry.config.schema import MegatronConfig, MtpConfig

__all__ = ["SFTConfig", "choice_errors"]


def _sub(cls: type) -> Any:
    return field(default_factory=cls)


def _choice(default: str, *allowed: str) -> Any:
    return field(default=default, metadata={"choices": (default, *allowed)})


@dataclass
class SFTSyntheticConfig:  # rlfoundry: the built-in task used when data.train_files is null
    task: str = _choice("arithmetic")
    train_size: int = 4096
    val_size: int = 128  # drawn first, so seed 0 / 128 is the RL demo's validation set
    seed: int = 0
    digits: int = 2  # operands in [0, 10**digits)
    ops: str = "+-"
    num_operands: int = 2


@dataclass
class SFTMultiturnConfig:
    enable: bool = False  # true: rows are whole conversations (messages_key), every assistant turn trained
    messages_key: str = "messages"
    tools_key: str = "tools"
    enable_thinking_key: str = "enable_thinking"


@dataclass
class SFTDataConfig:
    train_files: Any = None  # parquet / jsonl / json files (str or list); null -> data.synthetic
    val_files: Any = None  # null with synthetic data -> the task's held-out split
    prompt_key: str = "prompt"  # a string (wrapped as one user message) or a list of chat messages
    response_key: str = "response"  # a string; the trainer appends the tokenizer's EOS
    prompt_dict_keys: Optional[List[str]] = None  # e.g. [question]: the prompt is row[prompt_key]['question']
    response_dict_keys: Optional[List[str]] = None
    # the column of each row's images (verl's RL data key; a vision-language model's processor encodes them)
    image_key: str = "images"
    max_length: int = 256  # prompt + response tokens
    # error | left (drop the start of the prompt) | right (drop the end of the response)
    truncation: str = _choice("error", "left", "right")
    chat_template: Optional[str] = None  # a Jinja template replacing the tokenizer's own
    # verl's defaults (January's fsdp_sft_trainer and August's sft_trainer alike): a verl command line that
    # leaves them out trains the same batches here
    train_batch_size: int = 256  # sequences per optimiser step, over all ranks
    micro_batch_size_per_gpu: int = 4  # sequences per forward/backward on one rank (gradient accumulation)
    # verl's token budgets: micro-batches of at most max_token_len_per_gpu tokens instead of
    # micro_batch_size_per_gpu rows (the update is the same; the global batch normalises the loss)
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 8192
    # verl's older key, which its trainer does not read (micro_batch_size_per_gpu sets the micro-batch): no
    # effect, with a warning; the update does not depend on the micro-batch size anyway
    micro_batch_size: Optional[int] = None
    # verl's newer layout: no_padding packs each micro-batch's real tokens (= use_remove_padding=true, the
    # same loss), right and left_right pad (verl's names); null: use_remove_padding decides
    pad_mode: Optional[str] = field(default=None, metadata={"choices": (None, "no_padding", "right", "left_right")})  # verl's DatasetPadMode
    shuffle: bool = True
    # verl's: at most this many rows of data.train_files / val_files (-1: all), drawn as the RL data draws them
    # (data/rl_dataset.py max_samples_drawn) with data.seed; null: trainer.seed (verl's SFT dataset draws
    # unseeded then, which a resumed run could not repeat)
    train_max_samples: int = -1
    val_max_samples: int = -1
    seed: Optional[int] = None
    synthetic: SFTSyntheticConfig = _sub(SFTSyntheticConfig)  # rlfoundry
    # verl's conversation rows, every assistant turn trained (data/sft_dataset.py): data.multiturn.enable=true,
    # or the newer trainer's data.messages_key (its rows are always conversations) with data.tools_key
    multiturn: SFTMultiturnConfig = _sub(SFTMultiturnConfig)
    messages_key: Optional[str] = None
    tools_key: Optional[str] = None
    ignore_input_ids_mismatch: bool = False  # conversation tokens turn by turn != the whole text's: error unless true


@dataclass
class SFTFSDPConfig:
    model_dtype: str = "fp32"
    param_dtype: Optional[str] = None  # null: bf16 on CUDA, fp32 on CPU
    reduce_dtype: Optional[str] = None  # null: fp32
    offload_params: bool = False  # GPU only
    reshard_after_forward: bool = True
    fsdp_size: int = -1  # ranks that shard the model (-1: all); groups of them replicate it (hybrid sharding)
    # rlfoundry: the FSDP engine's keys of the RL roles' fsdp_config (verl's engine=automodel sets them, with
    # engine.optimizer_offload / engine.ep_size): AdamW's moments in host memory between steps (GPU only), and
    # each routed layer's experts sharded by expert over groups of this many ranks (engines/fsdp/expert_parallel.py)
    optimizer_offload: bool = False
    expert_parallel_size: int = 1


@dataclass
class SFTModelConfig:
    partial_pretrain: Optional[str] = None  # local HF directory (or rlfoundry://NAME for a packaged model)
    path: Optional[str] = None  # verl's newer spelling of partial_pretrain
    # the training engine (config/training_engines.py, whose table is the list of choices, checked by the trainer):
    # verl's FSDP versions (both the FSDP2 engine here) or the Megatron engine (verl's engine=megatron sets it;
    # engine=automodel is the FSDP2 engine, config/automodel.py), or an engine registered there
    strategy: str = "fsdp2"
    use_remove_padding: Optional[bool] = None  # verl's newer spelling of the top-level use_remove_padding
    use_liger: bool = False  # Liger's Triton kernels patched in (CUDA and liger-kernel; models/liger.py)
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    external_lib: Optional[str] = None  # a module to import first (registers custom model classes)
    override_config: Dict[str, Any] = field(default_factory=dict)
    # LoRA (models/lora.py, peft): rank 0 = full fine-tuning; the saved model is the merged one
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    lora_adapter_path: Optional[str] = None  # a peft adapter directory to start from
    # rlfoundry: the CPU speed-ups (rlfoundry/cpu); auto: on when training on the CPU
    cpu_kernels: str = _choice("auto", "off")
    fsdp_config: SFTFSDPConfig = _sub(SFTFSDPConfig)
    mtp: MtpConfig = _sub(MtpConfig)  # verl's multi-token prediction: engine=megatron trains the MTP layers (mtp.py)


@dataclass
class SFTOptimConfig:
    lr: float = 1e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.01
    eps: float = 1e-8
    warmup_steps_ratio: float = 0.05
    clip_grad: float = 1.0
    lr_scheduler: str = _choice("cosine", "constant")
    lr_warmup_steps_ratio: Optional[float] = None  # verl's newer spelling of warmup_steps_ratio
    lr_scheduler_type: Optional[str] = None  # verl's newer spelling of lr_scheduler
    warmup_style: Optional[str] = None  # verl's deprecated spelling of lr_scheduler_type
    min_lr_ratio: float = 0.0
    # verl's newer layout (optim=fsdp|megatron), honoured on either engine: warm-up steps (>= 0: wins over the
    # ratio), Megatron's spellings of the schedule (lr_decay_style = lr_scheduler, min_lr = min_lr_ratio x lr)
    lr_warmup_steps: int = -1
    lr_decay_style: Optional[str] = field(default=None, metadata={"choices": (None, "constant", "cosine")})
    lr_warmup_init: float = 0.0  # the warm-up rises linearly from this lr
    min_lr: Optional[float] = None
    lr_decay_steps: Optional[int] = None  # the schedule's length; null: the run's steps
    weight_decay_incr_style: str = _choice("constant")  # Megatron's weight-decay schedules are not built
    # verl's optimizer names (optim/fsdp.yaml: AdamW; optim/megatron.yaml: adam, megatron-core's AdamW): AdamW
    optimizer: str = _choice("AdamW", "adam", "adamw")
    optimizer_impl: str = _choice("torch.optim")
    # more optimizer settings: AdamW arguments (FSDP) or megatron-core OptimizerConfig fields (Megatron),
    # checked at start-up as the RL roles' (trainer/config.py)
    override_optimizer_config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SFTTrainerConfig:
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    project_name: str = "rlfoundry-sft"
    experiment_name: str = "sft"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # null: epochs x steps per epoch; set it to stop earlier (or later)
    logger: Any = field(default_factory=lambda: ["console", "file"])  # a name or a list of names
    seed: int = 1
    save_freq: int = -1  # every N steps (and always at the end); -1: only at the end
    test_freq: int = -1  # validation loss every N steps (and at the end); -1: only at the end
    max_ckpt_to_keep: Optional[int] = None  # null: keep every checkpoint
    # auto: continue from the newest intact checkpoint in default_local_dir, if any
    resume_mode: str = _choice("auto", "disable", "resume_path")
    resume_from_path: Optional[str] = None  # a global_step_N directory (resume_mode=resume_path)
    device: str = _choice("auto", "cpu", "cuda")
    dist_timeout_s: float = 600.0  # rlfoundry: a collective waiting longer (a dead or stuck peer) fails
    profile_steps: Optional[List[int]] = None  # e.g. [2]: torch.profiler trace into <default_local_dir>/profile
    nnodes: int = 1  # ranks come from torchrun (WORLD_SIZE); these two are for verl
    n_gpus_per_node: int = 1  # command lines and must agree with it when given


@dataclass
class SFTEngineConfig(MegatronConfig):
    """verl's newer SFT layout: the engine group's keys. engine=megatron: the Megatron engine's (the RL roles'
    ``*.megatron`` keys, config/schema.py MegatronConfig); engine=fsdp: the three below, the others at their
    defaults (a Megatron key set on the FSDP engine is a start-up error)."""

    ulysses_sequence_parallel_size: Optional[int] = None  # its spelling of the top-level key
    strategy: Optional[str] = None  # its spelling of model.strategy (fsdp | fsdp2: one FSDP2 engine here)
    fsdp_size: Optional[int] = None  # its spelling of model.fsdp_config.fsdp_size


@dataclass
class SFTCheckpointConfig:  # verl's newer SFT layout
    # null: model, optimizer and extra (the resumable state) and the Hugging Face model in global_step_N.
    # A list: verl's entries (model, optimizer, extra, hf_model), 'model' always; hf_model: the HF export
    save_contents: Optional[List[str]] = None
    load_contents: Optional[List[str]] = None  # null: what a save writes


@dataclass
class SFTConfig:
    data: SFTDataConfig = _sub(SFTDataConfig)
    model: SFTModelConfig = _sub(SFTModelConfig)
    optim: SFTOptimConfig = _sub(SFTOptimConfig)
    # verl's Ulysses sequence parallelism: groups of this many ranks split each packed row (use_remove_padding)
    ulysses_sequence_parallel_size: int = 1
    engine: SFTEngineConfig = _sub(SFTEngineConfig)
    checkpoint: SFTCheckpointConfig = _sub(SFTCheckpointConfig)
    use_remove_padding: bool = False  # pack the real tokens of a micro-batch into one row (same loss)
    trainer: SFTTrainerConfig = _sub(SFTTrainerConfig)


def choice_errors(cfg: Any, schema: type = SFTConfig, prefix: str = "") -> list[str]:
    """``key=value must be one of [...]`` for every field whose value is not among its ``choices``."""
    errors = []
    for f in fields(schema):
        value = getattr(cfg, f.name)
        if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):  # a subtree
            errors += choice_errors(value, f.default_factory, f"{prefix}{f.name}.")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            errors.append(f"{prefix}{f.name}={value!r} must be one of {list(f.metadata['choices'])}")
    return errors
