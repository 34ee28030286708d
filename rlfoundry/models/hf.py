"""Hugging Face models from local directories: paths, dtypes, loading, and importing their code.

Every engine and the driver load models the same way: ``rlfoundry://NAME`` names a model shipped in
``rlfoundry/assets``, anything else is a local directory (no hub downloads), SDPA attention, and a
message naming the key and the fix when the path is not a model.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlfoundry.config.schema import DTYPE_SPELLINGS

__all__ = ["TRAINER_ONLY_ATTR", "check_model_dir", "generation_eos_ids", "import_model_code", "kv_cache_kwargs",
           "load_hf_model", "resolve_dtype", "resolve_model_path", "trainer_only_prefixes"]

# A model attribute naming its submodules that train with it but are no part of the HF model (FlowRL's log Z
# head): checkpointed with the module, never streamed to a rollout engine nor written to an HF export
TRAINER_ONLY_ATTR = "_rlf_trainer_only"


def trainer_only_prefixes(module: Any) -> tuple[str, ...]:
    """The parameter-name prefixes (``"proj_z."``) of ``module``'s trainer-only submodules."""
    return tuple(f"{name}." for name in getattr(module, TRAINER_ONLY_ATTR, ()))

_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_SPELLINGS.items()}


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """Map verl's dtype spellings (``bf16``, ``fp32``, ``bfloat16`` …) to a ``torch.dtype``."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


PACKAGED_SCHEME = "rlfoundry://"


def resolve_model_path(path: str | Path) -> Path:
    """A local directory for ``path``; ``rlfoundry://NAME`` names a model shipped in ``rlfoundry/assets``."""
    text = str(path)
    if text.startswith(PACKAGED_SCHEME):
        return Path(__file__).resolve().parents[1] / "assets" / text[len(PACKAGED_SCHEME):]
    return Path(text).expanduser()


def check_model_dir(path: str | Path) -> Path:
    """The resolved directory of ``path``; a message naming the path and the fix if it is no HF model."""
    p = resolve_model_path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist. Set actor_rollout_ref.model.path (or "
            f"critic.model.path) to a local Hugging Face model directory containing config.json; "
            f"no hub downloads happen here (build a tiny one with `python -m rlfoundry.models.tiny --out DIR`)."
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a Hugging Face model directory (no config.json in it). "
            f"Point the model path at the directory written by `save_pretrained` (config.json + "
            f"*.safetensors), or build one with `python -m rlfoundry.models.tiny --out DIR`."
        )
    return p


def load_hf_model(
    path: str | Path,
    model_kind: str = "causal_lm",
    torch_dtype: str | torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    override_config: Mapping[str, Any] | None = None,
    enable_gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load a model from a local HF directory on the CPU.

    ``model_kind`` is ``causal_lm`` (policy, reference), ``token_classification`` (critic: one
    value per token; ``num_labels`` is forced to 1; a VLM's is ``models/vision_value.py``'s) or ``sequence_classification`` (reward model). ``override_config`` entries replace config
    fields before the weights load (verl's ``model.override_config``). The model stays on the CPU;
    ``apply_fsdp2`` moves it. ``attn_implementation`` defaults to transformers' own choice: SDPA, which
    needs no extra package, or eager attention for a family without SDPA (GPT-OSS: attention sinks).
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    p = check_model_dir(path)
    config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
    override = dict(override_config or {})
    _check_attention_choice(override.pop("attn_implementation", None))
    for key, value in override.items():
        setattr(config, key, value)
    classes = {"causal_lm": AutoModelForCausalLM, "token_classification": AutoModelForTokenClassification,
               "sequence_classification": AutoModelForSequenceClassification}
    if model_kind not in classes:
        raise ValueError(f"model_kind must be one of {sorted(classes)}, got {model_kind!r}")
    if model_kind == "token_classification":
        config.num_labels = 1
    if getattr(config, "vision_config", None) is not None:  # a vision-language model (models/vision.py)
        if model_kind == "sequence_classification":
            raise ValueError(f"{p} is a vision-language model ({config.model_type}); a reward model on one is not "
                             "built (the actor, rollout, reference and critic take one)")
        from transformers import AutoModelForImageTextToText

        from rlfoundry.models.vision_value import register_value_models

        register_value_models()  # the critic: backbone + value head (models/vision_value.py)
        classes["causal_lm"] = AutoModelForImageTextToText
    kwargs = dict(config=config, dtype=resolve_dtype(torch_dtype), trust_remote_code=trust_remote_code,
                  attn_implementation=attn_implementation)
    model, info = classes[model_kind].from_pretrained(p, output_loading_info=True, **kwargs)
    if model_kind == "token_classification" and getattr(config, "vision_config", None) is not None:
        _load_vision_backbone(model, info, p, kwargs)
    if enable_gradient_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2's hooks; the reentrant flavour does not.
        # transformers >= 5.x renamed the switch; older versions only have the first name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # training forwards must not build KV caches; rollout asks explicitly
    return model


def _check_attention_choice(value: Any) -> None:
    from rlfoundry.config.verl_compat import SDPA_STANDS_IN_FOR

    """``model.override_config.attn_implementation``: an FA2/FA3 choice (verl's default is FA2) runs as SDPA;
    eager or another kernel is refused rather than dropped, since the packed and Ulysses forwards here are
    built on SDPA's masks (trainer/config.py refuses it at start-up too)."""
    if value is not None and value not in SDPA_STANDS_IN_FOR:
        raise ValueError(f"model.override_config.attn_implementation={value}: the engines here compute attention with "
                         f"transformers' SDPA (their packed and sequence-parallel forwards are built on it); one of "
                         f"{list(SDPA_STANDS_IN_FOR)} runs as SDPA, the same exact attention. Remove the key or use sdpa.")


def _load_vision_backbone(model: Any, info: dict[str, Any], path: Path, kwargs: dict[str, Any]) -> None:
    """A VLM critic built from a policy directory: transformers renames a Qwen2-VL checkpoint's keys
    (``model.*`` / ``visual.*``) only for the family's own classes, so the value model's backbone came
    up freshly initialised; it takes the backbone the family's class loads. A saved critic (its own
    keys) loads directly and skips this."""
    if not any(k.startswith("model.") for k in info.get("missing_keys", ())):
        return
    from transformers import AutoModelForImageTextToText

    policy = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    model.model.load_state_dict(policy.model.state_dict(), strict=True)


def import_model_code(path: str | Path, model_kind: str = "causal_lm", trust_remote_code: bool = False) -> None:
    """Import, without loading weights, the code ``load_hf_model`` and FSDP2 will run for ``path``.

    An empty model is built on the meta device (no memory), which imports its modeling module and
    whatever transformers pulls in with it. A worker back end that forks its ranks calls this in
    the driver first, so the ranks share those modules' pages with it copy-on-write (about 50 MB a
    rank for a Qwen2) instead of importing private copies. Remote code is not run here.
    """
    import safetensors.torch  # noqa: F401 - the weights loader
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    if trust_remote_code:
        return
    config = AutoConfig.from_pretrained(check_model_dir(path))
    auto = AutoModelForTokenClassification if model_kind == "token_classification" else AutoModelForCausalLM
    with torch.device("meta"):
        auto.from_config(config, attn_implementation="sdpa")


def generation_eos_ids(tokenizer: Any, path: str | Path) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and the model's ``generation_config.json`` ones."""
    from transformers import GenerationConfig

    eos = [tokenizer.eos_token_id]
    try:
        gen_eos = GenerationConfig.from_pretrained(resolve_model_path(path)).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        gen_eos = None
    eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
    return sorted({int(e) for e in eos if e is not None})


def kv_cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for the keyword ``module``'s forward takes its KV cache by: ``cache`` from
    transformers 5.2x on, where ``past_key_values`` is a deprecated alias (removed in 5.40), else
    ``past_key_values``. ``module`` may be wrapped by peft; FSDP2 keeps the model's class."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return {_cache_keyword(type(base)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
