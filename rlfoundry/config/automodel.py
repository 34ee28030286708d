"""verl's SFT ``engine=automodel optim=automodel`` (NVIDIA NeMo AutoModel) on the FSDP2 engine.

AutoModel trains the HF model with FSDP2 (its ``distributed_strategy=fsdp2``), the mixed precision, offload
and activation checkpointing the FSDP engine here has, expert parallelism over an expert mesh (the FSDP
engine's ``expert_parallel_size``), torch's AdamW and Megatron's warm-up/cosine schedule. So each of its
``engine.*`` and ``optim.*`` keys either becomes the SFT key doing the same, is accepted with a
``NoEffectKeyWarning`` when its value changes no number (a kernel computing the same math, a choice of FSDP
units), or stops the run at start-up naming it. Nothing past the config knows which engine was named.

    extra = adopt_automodel(cfg, automodel_overrides, user_keys, world_size)  # trainer/sft_trainer.py

Semantics from verl's ``workers/engine/automodel`` (``utils.py`` builds AutoModel's FSDP2Config, device mesh
and backend; ``transformer_impl.py`` its optimizer and ``OptimizerParamScheduler``) and the defaults of its
``config/engine/automodel.yaml`` and ``config/optim/automodel.yaml``; docs/verl_keys.md lists the keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from rlfoundry.config.schema import DTYPE_SPELLINGS
from rlfoundry.config.typed import ConfigError, dtype_problems, to_typed
from rlfoundry.config.verl_compat import NoEffectKeyWarning, _plain, _set_by_user

__all__ = ["AutomodelEngine", "AutomodelOptim", "adopt_automodel"]


# ───────────────────────────── verl's two groups, its defaults ─────────────────────────────

@dataclass
class AutomodelBackend:  # AutoModel's BackendConfig: which kernels its own model classes use
    attn: str = "sdpa"
    linear: str = "te"
    rms_norm: str = "torch_fp32"
    rope_fusion: bool = True
    dispatcher: str = "torch"
    experts: str = "gmm"
    gate_precision: Optional[str] = None
    enable_hf_state_dict_adapter: bool = True
    enable_fsdp_optimizations: bool = False
    fake_balanced_gate: bool = False
    fake_gate_noise: float = 0.0


@dataclass
class AutomodelMoE:  # AutoModel's MoEParallelizerConfig (read with ep_size > 1)
    ignore_router_for_ac: bool = False
    reshard_after_forward: bool = False
    lm_head_precision: Optional[str] = None
    wrap_outer_model: bool = True


@dataclass
class AutomodelEngine:
    strategy: str = "automodel"
    distributed_strategy: str = "fsdp2"
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    dp_replicate_size: int = 1
    sequence_parallel: bool = False
    defer_fsdp_grad_sync: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    activation_checkpointing: bool = False
    enable_fp8: bool = False
    enable_compile: bool = False
    model_dtype: str = "fp32"
    attn_implementation: str = "flash_attention_2"
    backend_config: AutomodelBackend = field(default_factory=AutomodelBackend)
    moe_config: AutomodelMoE = field(default_factory=AutomodelMoE)
    mp_param_dtype: str = "bf16"
    mp_reduce_dtype: str = "fp32"
    mp_output_dtype: str = "bf16"
    seed: int = 42
    full_determinism: bool = False
    forward_only: bool = False
    use_torch_compile: bool = False
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    entropy_checkpointing: bool = False


@dataclass
class AutomodelOptim:
    optimizer: str = "AdamW"
    optimizer_impl: str = "torch.optim"
    lr: float = 1e-5
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int = -1
    weight_decay: float = 0.01
    lr_warmup_steps: int = -1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    clip_grad: float = 1.0
    init_lr_ratio: Optional[float] = 0.1
    min_lr_ratio: Optional[float] = 0.01
    lr_scheduler_type: str = "cosine"
    wd_incr_style: str = "constant"
    num_cycles: float = 0.5
    zero_indexed_step: bool = True
    eps: float = 1e-8
    master_weights: bool = False
    store_param_remainders: bool = False
    exp_avg_dtype: Optional[str] = None
    exp_avg_sq_dtype: Optional[str] = None
    master_weight_dtype: Optional[str] = None
    override_optimizer_config: Dict[str, Any] = field(default_factory=dict)


# ───────────────────────────── what each key does here ─────────────────────────────

_MEGATRON = "it is the Megatron engine's (engine=megatron optim=megatron, engine.{})"
# engine key -> (values the FSDP engine computes identically, why / what to use instead)
ENGINE_BUILT: dict[str, tuple[tuple, str]] = {
    "strategy": (("automodel",), "the engine is the engine group's choice"),
    # megatron_fsdp shards by Megatron-FSDP's buffers, ddp replicates without a mixed-precision policy: neither
    # is the FSDP2 engine's update in its dtypes
    "distributed_strategy": (("fsdp2",), "the FSDP2 engine runs AutoModel's fsdp2; Megatron-FSDP and DDP are not "
                                         "built"),
    "tp_size": ((1,), "tensor parallelism on the FSDP2 engine is not built; " + _MEGATRON.format(
        "tensor_model_parallel_size")),
    "pp_size": ((1,), "pipeline parallelism on the FSDP2 engine is not built; " + _MEGATRON.format(
        "pipeline_model_parallel_size")),
    # AutoModel's cp is torch's ring context parallelism; the FSDP engine splits sequences by Ulysses instead
    # (ulysses_sequence_parallel_size), the Megatron engine by context parallelism
    "cp_size": ((1,), "context parallelism on the FSDP2 engine is not built (its sequence split is Ulysses, "
                      "ulysses_sequence_parallel_size with packed rows); " + _MEGATRON.format("context_parallel_size")),
    "sequence_parallel": ((False,), "tensor-parallel sequence parallelism needs tp_size > 1; " + _MEGATRON.format(
        "sequence_parallel")),
    "enable_fp8": ((False,), "FP8 training is not built (bf16 / fp32 are)"),
    "enable_compile": ((False,), "torch.compile of the SFT model is not built"),
    "full_determinism": ((False,), "deterministic kernels are not built as an engine switch"),
    "forward_only": ((False,), "an SFT run trains; a forward-only engine is the reference's"),
    "attn_implementation": (("flash_attention_2", "sdpa", "te"), "exact attention: the FSDP engine attends with "
                            "PyTorch SDPA; eager is not built"),
    "backend_config.attn": (("sdpa", "te"), "exact attention by PyTorch SDPA"),
    "backend_config.linear": (("torch", "te"), "plain GEMMs"),
    "backend_config.rms_norm": (("torch_fp32",), "the HF model's RMSNorm computes in fp32; torch's and TE's in the "
                                "compute dtype (other numbers) are not built"),
    "backend_config.dispatcher": (("torch",), "tokens reach their experts' ranks by transformers' all-to-all "
                                  "(docs/moe.md); DeepEP's kernels are not built"),
    "backend_config.experts": (("gmm", "torch_mm"), "the experts run as grouped matrix products (grouped_mm, "
                               "docs/moe.md); the per-expert loop and TE's GroupedLinear are not choices here"),
    "backend_config.gate_precision": ((None,), "the router computes in the model's dtype; another gate precision "
                                      "is not built"),
    "backend_config.enable_hf_state_dict_adapter": ((True,), "checkpoints and exports are the HF model's own keys"),
    "backend_config.fake_balanced_gate": ((False,), "the router routes; a fake balanced gate (a benchmark's) is "
                                          "not built"),
    "backend_config.fake_gate_noise": ((0, 0.0), "the fake gate is not built"),
    "moe_config.lm_head_precision": ((None,), "the LM head computes in the model's dtype; an fp32 head is not "
                                     "built"),
}
# given, these change which kernel or which FSDP unit computes the same numbers: said, nothing else
ENGINE_NO_EFFECT: dict[str, str] = {
    "attn_implementation": "exact attention; the FSDP engine's is PyTorch SDPA",
    "backend_config.attn": "exact attention; PyTorch SDPA here",
    "backend_config.linear": "TE's linear is the same GEMM; torch's here",
    "backend_config.rope_fusion": "a fused rotary embedding rotates by the same angles",
    "backend_config.enable_fsdp_optimizations": "AutoModel's FSDP prefetch and reshard tuning moves memory and "
                                                "overlap, not numbers",
    "defer_fsdp_grad_sync": "when gradients are reduced across micro-batches, not their sum",
    "moe_config.ignore_router_for_ac": "which modules activation checkpointing recomputes: the same numbers",
    "moe_config.reshard_after_forward": "when the experts' shards are freed: memory, not numbers",
    "moe_config.wrap_outer_model": "which modules are FSDP units: the engine makes each decoder layer one",
    "seed": "the run is seeded by trainer.seed here (a fine-tuning step draws nothing from the engine's seed)",
    "use_torch_compile": "verl's automodel engine compiles its entropy function; SFT's loss reads no entropy",
    "entropy_from_logits_with_chunking": "SFT's loss reads no entropy",
    "entropy_from_logits_chunk_size": "SFT's loss reads no entropy",
    "entropy_checkpointing": "SFT's loss reads no entropy",
}
# values the FSDP engine takes literally: given at these, the key is honoured, not merely accepted
ENGINE_HONOURED = {"attn_implementation": "sdpa", "backend_config.attn": "sdpa", "backend_config.linear": "torch",
                   "backend_config.rope_fusion": False, "backend_config.enable_fsdp_optimizations": False,
                   "use_torch_compile": False, "entropy_from_logits_with_chunking": False,
                   "entropy_checkpointing": False}

_SCHEDULES = ("constant", "cosine")  # engines/fsdp/utils.py lr_lambda: Megatron's warm-up, then these
_TE_ADAM = ("transformer_engine.pytorch.optimizers.fused_adam", "transformer_engine.pytorch.optimizers")
OPTIM_NO_EFFECT: dict[str, str] = {
    "num_cycles": "AutoModel's scheduler does not read it (verl keeps it for compatibility)",
    "zero_indexed_step": "AutoModel's scheduler does not read it (verl keeps it for compatibility)",
    "total_training_steps": "verl writes the run's step count there; the schedule spans the run's steps here too",
}


def adopt_automodel(cfg: DictConfig, overrides: Sequence[Any], user_keys: Sequence[str], world_size: int) -> list[str]:
    """verl's ``engine.*`` / ``optim.*`` overrides (parsed) under ``engine=automodel optim=automodel`` put onto the SFT
    keys of the FSDP2 engine (``ConfigError`` for a value not built and for two spellings that disagree).
    Returns the SFT keys it set, to be treated as the user's."""
    given = _given(overrides)
    engine = to_typed(AutomodelEngine, given["engine"], name="engine")
    optim = to_typed(AutomodelOptim, given["optim"], name="optim")
    engine_keys, optim_keys = list(given["engine"]), list(given["optim"])
    problems = _engine_problems(engine, world_size) + _optim_problems(optim, engine)
    if problems:
        bullet = "\n  - "
        raise ConfigError("verl's automodel engine runs on the FSDP2 engine here, which does not build:" + bullet
                          + bullet.join(problems) + "\nSet each to a built value or remove it (docs/verl_keys.md).")
    set_keys: list[str] = []
    for ours, value in _engine_settings(engine, engine_keys, world_size).items():
        _put(cfg, user_keys, set_keys, ours, value)
    for ours, value in _optim_settings(optim).items():  # the group's defaults too, as verl's optim group sets them
        _put(cfg, user_keys, set_keys, ours, value)
    said = [f"engine.{k}={_value(engine, k)} ({why})" for k, why in ENGINE_NO_EFFECT.items()
            if k in engine_keys and ENGINE_HONOURED.get(k, object()) != _value(engine, k)]
    said += [f"optim.{k}={_value(optim, k)} ({why})" for k, why in OPTIM_NO_EFFECT.items() if k in optim_keys]
    if optim.optimizer == "FusedAdam":
        said.append("optim.optimizer=FusedAdam (with fp32 moments and no master weights TE's FusedAdam is AdamW's "
                    "update; torch's AdamW runs it here)")
    if said:
        warnings.warn("These verl settings are accepted but have no effect in rlfoundry (verl's automodel engine on "
                      "the FSDP2 engine): " + "; ".join(said) + ".", NoEffectKeyWarning, stacklevel=2)
    return set_keys


def _given(overrides: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """The overrides by group, dotted key -> typed value, parsed by the loader as it parses any override (Hydra's
    syntax, trainer/config.py ``parse_overrides``; verl's ``+engine.x`` adds a key its group lacks: the same key
    here)."""
    out: dict[str, dict[str, Any]] = {"engine": {}, "optim": {}}
    for ov in overrides:
        group, _, key = ov.key.partition(".")
        if ov.kind not in ("set", "add", "force_add"):
            raise ConfigError(f"{ov.text}: verl's automodel keys are set, not deleted")
        out[group][key] = ov.value
    return out


def _value(node: Any, key: str) -> Any:
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _engine_problems(e: AutomodelEngine, world_size: int) -> list[str]:
    problems = [f"engine.{k}={_value(e, k)} ({why})" for k, (built, why) in ENGINE_BUILT.items()
                if _value(e, k) not in built]
    if e.dp_replicate_size < 1 or world_size % e.dp_replicate_size:
        problems.append(f"engine.dp_replicate_size={e.dp_replicate_size} (the replicas must divide the {world_size} "
                        "ranks: each shards the model over world / dp_replicate_size ranks)")
    for name in ("model_dtype", "mp_param_dtype", "mp_reduce_dtype", "mp_output_dtype"):
        problems += dtype_problems(f"engine.{name}", getattr(e, name))
    if problems:
        return problems
    if DTYPE_SPELLINGS[str(e.mp_output_dtype).lower()] != DTYPE_SPELLINGS[str(e.mp_param_dtype).lower()]:
        problems.append(f"engine.mp_output_dtype={e.mp_output_dtype} (an FSDP unit's outputs are in its compute "
                        f"dtype, engine.mp_param_dtype={e.mp_param_dtype}; casting them apart is not built)")
    return problems


def _optim_problems(o: AutomodelOptim, e: AutomodelEngine) -> list[str]:
    problems = []
    fused = o.optimizer == "FusedAdam" and o.optimizer_impl in _TE_ADAM
    if not fused and (o.optimizer, o.optimizer_impl) != ("AdamW", "torch.optim"):
        problems.append(f"optim.optimizer={o.optimizer} optim.optimizer_impl={o.optimizer_impl} (torch.optim's "
                        "AdamW is built)")
    # TE's FusedAdam keeps its moments and a master copy in the dtypes named: with bf16 moments, remainders or
    # master weights the update's numbers are not AdamW's over fp32 state, which is what the engine runs
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "master_weight_dtype"):
        value = getattr(o, name)
        if value is not None and (value not in ("fp32", "float32") or e.model_dtype not in ("fp32", "float32")):
            problems.append(f"optim.{name}={value} (AdamW's state is kept in the parameters' dtype, "
                            f"engine.model_dtype={e.model_dtype}; TE FusedAdam's reduced-precision state is not built)")
    for name in ("master_weights", "store_param_remainders"):
        if getattr(o, name):
            problems.append(f"optim.{name}=true (TE FusedAdam's master weights over low-precision parameters are "
                            "not built; engine.model_dtype=fp32 trains fp32 parameters under bf16 compute, which "
                            "are their own master weights)")
    if o.lr_scheduler_type not in _SCHEDULES:
        problems.append(f"optim.lr_scheduler_type={o.lr_scheduler_type} (the schedules built are warm-up then "
                        f"{' or '.join(_SCHEDULES)})")
    if o.wd_incr_style != "constant":
        problems.append(f"optim.wd_incr_style={o.wd_incr_style} (weight-decay schedules are not built)")
    return problems


def _engine_settings(e: AutomodelEngine, given: Sequence[str], world_size: int) -> dict[str, Any]:
    """The SFT keys the given engine keys are (only given ones: verl's defaults not given are the FSDP engine's,
    but for mixed precision, whose defaults are bf16 on CUDA there and fp32 on the CPU here)."""
    out: dict[str, Any] = {}
    same = {"param_offload": "model.fsdp_config.offload_params",
            "optimizer_offload": "model.fsdp_config.optimizer_offload",
            "activation_checkpointing": "model.enable_gradient_checkpointing",
            "model_dtype": "model.fsdp_config.model_dtype",
            # AutoModel's moe_mesh shards each routed layer's experts by expert over ep_size ranks, tokens sent
            # by all-to-all: what the FSDP engine's expert_parallel_size does (engines/fsdp/expert_parallel.py)
            "ep_size": "model.fsdp_config.expert_parallel_size",
            "mp_param_dtype": "model.fsdp_config.param_dtype", "mp_reduce_dtype": "model.fsdp_config.reduce_dtype"}
    for key, ours in same.items():
        if key in given:
            out[ours] = getattr(e, key)
    if "mp_output_dtype" in given and "mp_param_dtype" not in given:
        out["model.fsdp_config.param_dtype"] = e.mp_param_dtype  # checked equal to the output dtype above
    if e.dp_replicate_size > 1:
        # HSDP: dp_replicate_size copies, each sharded over world / copies ranks, is the FSDP engine's hybrid
        # sharding with fsdp_size = those ranks
        out["model.fsdp_config.fsdp_size"] = world_size // e.dp_replicate_size
    return out


def _optim_settings(o: AutomodelOptim) -> dict[str, Any]:
    """The SFT optimiser keys for the whole group (verl's optim=automodel sets every key). AutoModel's
    OptimizerParamScheduler is Megatron's: linear warm-up from lr x init_lr_ratio to lr, then constant or a half
    cosine to lr x min_lr_ratio at the run's last step, weight decay constant; the SFT schedule
    (engines/fsdp/utils.py lr_lambda) is that, given the warm-up's start as an lr (lr_warmup_init)."""
    init = 0.1 if o.init_lr_ratio is None else float(o.init_lr_ratio)  # verl's engine: None is 0.1 / 0.01
    floor = 0.01 if o.min_lr_ratio is None else float(o.min_lr_ratio)
    return {"optim.lr": float(o.lr), "optim.betas": [float(b) for b in o.betas], "optim.eps": float(o.eps),
            "optim.weight_decay": float(o.weight_decay), "optim.clip_grad": float(o.clip_grad),
            "optim.warmup_steps_ratio": float(o.lr_warmup_steps_ratio), "optim.lr_warmup_steps": int(o.lr_warmup_steps),
            "optim.lr_warmup_init": float(o.lr) * init, "optim.min_lr_ratio": floor,
            "optim.lr_scheduler": o.lr_scheduler_type,
            "optim.override_optimizer_config": dict(o.override_optimizer_config)}


def _put(cfg: DictConfig, user_keys: Sequence[str], set_keys: list[str], ours: str, value: Any) -> None:
    before = _plain(OmegaConf.select(cfg, ours))
    if _set_by_user(user_keys, ours) and before != value:
        raise ConfigError(f"{ours}={before} and verl's automodel engine key that sets it (= {value}) are one setting "
                          "and were given different values; give one of them.")
    OmegaConf.update(cfg, ours, value, merge=False)
    set_keys.append(ours)


def _dataclass_keys(cls: type, prefix: str = "") -> list[str]:  # for docs and tests: every key of a group
    out = []
    for f in fields(cls):
        sub = f.default_factory if isinstance(f.default_factory, type) and is_dataclass(f.default_factory) else None
        out += _dataclass_keys(sub, f"{prefix}{f.name}.") if sub else [f"{prefix}{f.name}"]
    return out
