"""verl's SFT ``engine=automodel optim=automodel`` (NeMo AutoModel) on the FSDP2 engine: each engine and optim key
becomes the SFT key doing the same, is accepted with a no-effect warning when its value changes no number, or is a
start-up error naming what is not built (config/automodel.py)."""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from rlfoundry.config.automodel import (ENGINE_BUILT, ENGINE_NO_EFFECT, OPTIM_NO_EFFECT, AutomodelEngine,
                                        AutomodelOptim, _dataclass_keys)
from rlfoundry.config.verl_compat import NoEffectKeyWarning
from rlfoundry.trainer.config import ConfigError
from rlfoundry.trainer.sft_trainer import load_sft_config

# verl's examples/sft/gsm8k/run_qwen2_5_0_5b_automodel.sh (its data, model and trainer keys, paths local)
COMMON = ["data.train_files=/d/train.parquet", "data.val_files=/d/test.parquet", "data.train_batch_size=128",
          "data.pad_mode=no_padding", "data.truncation=error", "data.use_dynamic_bsz=True",
          "data.max_token_len_per_gpu=2048", "data.messages_key=messages", "data.ignore_input_ids_mismatch=True",
          "model=hf_model", "model.path=/m", "model.use_remove_padding=True", "trainer.default_local_dir=/save",
          "trainer.project_name=gsm8k-sft", "trainer.experiment_name=e", "trainer.total_epochs=2",
          "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=console", "trainer.seed=1111",
          "trainer.resume_mode=disable"]
LINE = [*COMMON, "engine=automodel", "engine.distributed_strategy=fsdp2", "engine.tp_size=1", "engine.pp_size=1",
        "engine.cp_size=1", "engine.ep_size=1", "engine.use_torch_compile=False", "optim=automodel", "optim.lr=1e-5",
        "optim.lr_warmup_steps_ratio=0.2", "optim.weight_decay=0.1", "optim.betas=[0.9,0.95]", "optim.clip_grad=1.0",
        "optim.init_lr_ratio=0", "optim.min_lr_ratio=0.1", "optim.lr_scheduler_type=cosine"]
# the same run on the FSDP engine in rlfoundry's SFT keys: AutoModel's scheduler warms up from lr x init_lr_ratio
# (0 here) and decays to lr x min_lr_ratio; torch AdamW's eps is the group's 1e-8
FSDP = [*COMMON, "engine=fsdp", "optim=fsdp", "optim.lr=1e-5", "optim.warmup_steps_ratio=0.2",
        "optim.weight_decay=0.1", "optim.betas=[0.9,0.95]", "optim.clip_grad=1.0", "optim.lr_warmup_init=0.0",
        "optim.min_lr_ratio=0.1", "optim.lr_scheduler=cosine", "optim.eps=1e-8"]


def _load(overrides, world_size: int = 1, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_sft_config(overrides)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, NoEffectKeyWarning)]


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_sft_config(["model.path=/m", "engine=automodel", *overrides])
    return str(e.value)


def test_verls_automodel_line_is_the_fsdp_engines_run_in_its_own_keys():
    """The whole config verl's 0.5B automodel line loads equals its FSDP-engine spelling key for key, silently
    (every key it gives is honoured)."""
    automodel, said = _load(LINE)
    plain, _ = _load(FSDP)
    assert said == []
    assert OmegaConf.to_container(automodel, resolve=True) == OmegaConf.to_container(plain, resolve=True)
    assert (automodel.model.strategy, automodel.optim.lr_warmup_init, automodel.optim.min_lr_ratio) == ("fsdp2", 0.0, 0.1)


def test_the_automodel_groups_defaults_are_verls():
    """Not given: optim=automodel's defaults (lr 1e-5, betas 0.9/0.999, warm-up from 0.1 x lr, cosine to 0.01 x lr);
    the engine's own defaults are the FSDP engine's (fp32 weights, no offload, no checkpointing)."""
    cfg, said = _load(["model.path=/m", "engine=automodel"])
    o = cfg.optim
    assert (o.lr, list(o.betas), o.weight_decay, o.eps, o.clip_grad) == (1e-5, [0.9, 0.999], 0.01, 1e-8, 1.0)
    assert (o.warmup_steps_ratio, o.lr_warmup_steps, o.lr_scheduler) == (0.0, -1, "cosine")
    assert (o.lr_warmup_init, o.min_lr_ratio) == (pytest.approx(1e-6), 0.01)
    f = cfg.model.fsdp_config
    assert (f.model_dtype, f.param_dtype, f.offload_params, f.optimizer_offload, f.expert_parallel_size) == \
        ("fp32", None, False, False, 1)
    assert said == []


def test_engine_keys_land_on_the_fsdp_engines(monkeypatch):
    cfg, said = _load(["model.path=/m", "engine=automodel", "engine.param_offload=true", "engine.optimizer_offload=true",
                       "engine.activation_checkpointing=true", "engine.model_dtype=bf16", "engine.ep_size=2",
                       "engine.mp_param_dtype=fp32", "engine.mp_output_dtype=fp32", "engine.mp_reduce_dtype=fp32",
                       "optim.lr_warmup_steps=3", "optim.override_optimizer_config={foreach:false}"],
                      world_size=4, monkeypatch=monkeypatch)
    f = cfg.model.fsdp_config
    assert (f.offload_params, f.optimizer_offload, f.model_dtype, f.expert_parallel_size) == (True, True, "bf16", 2)
    assert (f.param_dtype, f.reduce_dtype, cfg.model.enable_gradient_checkpointing) == ("fp32", "fp32", True)
    assert cfg.optim.lr_warmup_steps == 3 and cfg.optim.override_optimizer_config == {"foreach": False}
    assert said == []
    # HSDP's replicas: each shards over world / replicas ranks, the FSDP engine's fsdp_size
    cfg, _ = _load(["model.path=/m", "engine=automodel", "engine.dp_replicate_size=2"], 4, monkeypatch)
    assert cfg.model.fsdp_config.fsdp_size == 2


def test_values_with_the_same_numbers_are_accepted_and_said():
    cfg, said = _load(["model.path=/m", "engine=automodel", "engine.backend_config.linear=te",
                       "engine.backend_config.attn=te", "engine.attn_implementation=flash_attention_2",
                       "engine.backend_config.enable_fsdp_optimizations=true", "engine.defer_fsdp_grad_sync=false",
                       "engine.backend_config.experts=torch_mm", "engine.backend_config.rms_norm=torch_fp32",
                       "optim.num_cycles=1.0", "optim=automodel", "optim.optimizer=FusedAdam",
                       "optim.optimizer_impl=transformer_engine.pytorch.optimizers.fused_adam"])
    text = " ".join(said)
    for key in ("engine.backend_config.linear=te", "engine.backend_config.attn=te",
                "engine.attn_implementation=flash_attention_2", "engine.backend_config.enable_fsdp_optimizations=True",
                "engine.defer_fsdp_grad_sync=False", "optim.num_cycles=1.0", "optim.optimizer=FusedAdam"):
        assert key in text, key
    assert "experts" not in text and "rms_norm" not in text  # honoured: the engine's own grouped GEMMs and fp32 norm
    assert cfg.model.fsdp_config == load_sft_config(["model.path=/m"]).model.fsdp_config


# verl's run_qwen3_30b_automodel.sh's values that are not built, and the others
@pytest.mark.parametrize("override, named", [
    ("engine.backend_config.dispatcher=deepep", "engine.backend_config.dispatcher=deepep (tokens reach"),
    ("engine.backend_config.fake_balanced_gate=true", "engine.backend_config.fake_balanced_gate=True"),
    ("engine.enable_fp8=true", "engine.enable_fp8=True (FP8 training is not built"),
    ("engine.tp_size=2", "engine.tp_size=2 (tensor parallelism on the FSDP2 engine is not built; it is the Megatron"),
    ("engine.pp_size=2", "engine.pp_size=2 (pipeline parallelism"),
    ("engine.cp_size=2", "engine.cp_size=2 (context parallelism"),
    ("engine.distributed_strategy=megatron_fsdp", "engine.distributed_strategy=megatron_fsdp"),
    ("engine.dp_replicate_size=3", "engine.dp_replicate_size=3"),
    ("engine.backend_config.rms_norm=te", "engine.backend_config.rms_norm=te"),
    ("engine.backend_config.experts=torch", "engine.backend_config.experts=torch "),
    ("engine.backend_config.gate_precision=fp32", "engine.backend_config.gate_precision=fp32"),
    ("engine.moe_config.lm_head_precision=fp32", "engine.moe_config.lm_head_precision=fp32"),
    ("engine.attn_implementation=eager", "engine.attn_implementation=eager"),
    ("engine.mp_output_dtype=fp32", "engine.mp_output_dtype=fp32 (an FSDP unit's outputs"),
    ("engine.enable_compile=true", "engine.enable_compile=True"),
    ("optim.exp_avg_dtype=bf16", "optim.exp_avg_dtype=bf16 (AdamW's state"),
    ("optim.exp_avg_sq_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"),
    ("optim.master_weights=true", "optim.master_weights=true (TE FusedAdam's master weights"),
    ("optim.store_param_remainders=true", "optim.store_param_remainders=true"),
    ("optim.optimizer=SGD", "optim.optimizer=SGD optim.optimizer_impl=torch.optim"),
    ("optim.lr_scheduler_type=linear", "optim.lr_scheduler_type=linear"),
    ("optim.wd_incr_style=cosine", "optim.wd_incr_style=cosine"),
    ("engine.no_such_key=1", "Unknown config key 'engine.no_such_key'"),
])
def test_automodel_values_not_built_are_start_up_errors_naming_them(override, named):
    assert named in _error(override)


def test_the_30b_line_names_every_value_not_built():
    message = _error("engine.ep_size=8", "engine.backend_config.dispatcher=deepep", "engine.backend_config.attn=te",
                     "engine.backend_config.linear=te", "engine.backend_config.rms_norm=torch_fp32",
                     "engine.backend_config.enable_fsdp_optimizations=True", "engine.backend_config.experts=torch_mm",
                     "engine.activation_checkpointing=True", "engine.model_dtype=bf16", "engine.attn_implementation=te",
                     "optim=automodel", "optim.optimizer=FusedAdam",
                     "optim.optimizer_impl=transformer_engine.pytorch.optimizers.fused_adam", "optim.master_weights=true",
                     "optim.store_param_remainders=true", "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16")
    for named in ("dispatcher=deepep", "exp_avg_dtype=bf16", "exp_avg_sq_dtype=bf16", "master_weights=true",
                  "store_param_remainders=true"):
        assert named in message, named
    assert "linear" not in message and "attn" not in message  # accepted: the same numbers


def test_two_spellings_expert_parallel_checks_and_group_pairing(monkeypatch):
    assert "one setting" in _error("engine.activation_checkpointing=true", "model.enable_gradient_checkpointing=false")
    assert "one setting" in _error("engine.param_offload=true", "model.fsdp_config.offload_params=false")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "model.fsdp_config.expert_parallel_size=4: it does not divide the 2 ranks" in _error("engine.ep_size=4")
    assert "optim=fsdp with engine=automodel" in _error("optim=fsdp")
    assert "optim=automodel with engine=fsdp" in str(pytest.raises(ConfigError, load_sft_config,
                                                                   ["model.path=/m", "optim=automodel"]).value)


def test_every_automodel_key_is_placed():
    """Each key of verl's two groups is translated, honoured at its one built value, or said: none is dropped."""
    translated = {"param_offload", "optimizer_offload", "activation_checkpointing", "model_dtype", "ep_size",
                  "mp_param_dtype", "mp_reduce_dtype", "mp_output_dtype", "dp_replicate_size",
                  "backend_config.rope_fusion"}
    placed = translated | set(ENGINE_BUILT) | set(ENGINE_NO_EFFECT)
    assert set(_dataclass_keys(AutomodelEngine)) - placed == set()
    optim = {"optimizer", "optimizer_impl", "lr", "lr_warmup_steps_ratio", "weight_decay", "lr_warmup_steps", "betas",
             "clip_grad", "init_lr_ratio", "min_lr_ratio", "lr_scheduler_type", "wd_incr_style", "eps",
             "master_weights", "store_param_remainders", "exp_avg_dtype", "exp_avg_sq_dtype", "master_weight_dtype",
             "override_optimizer_config"}
    assert set(_dataclass_keys(AutomodelOptim)) - optim - set(OPTIM_NO_EFFECT) == set()
