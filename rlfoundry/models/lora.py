"""LoRA adapters with peft: building them, the adapter-off reference, and the weights a rollout or
an export needs.

``model.lora_rank > 0`` wraps the loaded Hugging Face model in a ``peft`` ``PeftModel`` before
sharding: every targeted linear layer becomes ``base_layer`` (frozen) + ``lora_A``/``lora_B``
(trainable, B = 0 at start, so the model is unchanged until the first update). The engine's
optimiser then sees only adapter parameters (``build_optimizer`` keeps ``requires_grad`` ones).

Parameter names gain peft's prefixes (``base_model.model.`` and ``.base_layer.``); a rollout engine
and ``from_pretrained`` want the original checkpoint names. Two streams, both one tensor at a time
from any (FSDP2-sharded) module:

- ``merged_hf_weights``: HF names, each adapted weight merged (W + scaling · B A): for a rollout
  that holds the plain model (HF rollout pool, vLLM with ``rollout.lora_sync=merged``) and for the
  merged export;
- ``adapter_weights``: the adapter alone in peft's file names (what ``PeftModel.from_pretrained``
  and vLLM's LoRA requests read): for ``rollout.lora_sync=adapter`` and the adapter export.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["LoraSpec", "adapter_disabled", "adapter_weights", "apply_lora", "base_of", "config_json", "effective_weight",
           "hf_weight_name", "is_lora", "merged_hf_weights", "peft_config_dict", "save_adapter", "save_merged",
           "unfusable_reason"]

PEFT_INSTALL = "pip install 'peft>=0.17'"  # the `lora` extra of pyproject.toml
ADAPTER = "default"  # peft's name for the one adapter a run trains
_PREFIX = "base_model.model."
_INIT_SEED = 0
VISION_TOWER = r"(?:.*\.)?visual\..*"  # a Qwen2-VL-style tower's modules (models/vision.py freeze_vision_tower)


@dataclass(frozen=True)
class LoraSpec:
    """verl's LoRA keys of a ``model`` subtree (``lora_rank``, ``lora_alpha``, ``target_modules``,
    ``exclude_modules``, ``lora_adapter_path``), plus what the role adds (the critic's value head)."""

    rank: int
    alpha: float = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    adapter_path: str | None = None
    task_type: str = "CAUSAL_LM"  # TOKEN_CLS: the critic
    modules_to_save: tuple[str, ...] = ()  # trained in full beside the adapter (the critic's head)
    frozen_vision_tower: bool = False  # model.freeze_vision_tower: no adapter on the tower either

    @classmethod
    def of(cls, model: Any, **fields: Any) -> LoraSpec | None:
        """From a role's typed ``model`` subtree; None when ``lora_rank`` is 0 (full fine-tuning)."""
        if int(getattr(model, "lora_rank", 0) or 0) <= 0:
            return None
        targets = model.target_modules
        return cls(rank=int(model.lora_rank), alpha=float(model.lora_alpha),
                   target_modules=targets if isinstance(targets, str) else list(targets),
                   exclude_modules=_plain(getattr(model, "exclude_modules", None)),
                   adapter_path=getattr(model, "lora_adapter_path", None),
                   frozen_vision_tower=bool(getattr(model, "freeze_vision_tower", False)), **fields)

    def peft_config(self) -> Any:
        from peft import LoraConfig

        # No dropout: the rollout samples and the trainer recomputes log-probs with the same function.
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=self.target_modules,
                          exclude_modules=self._excluded(), lora_dropout=0.0, bias="none",
                          task_type=self.task_type, modules_to_save=list(self.modules_to_save) or None)

    def _excluded(self) -> Any:
        """The user's exclusions plus the modules trained in full (an adapter on them would clash) and,
        with ``freeze_vision_tower``, a vision-language model's tower (``all-linear`` would adapt its
        linear layers too, and the update would move what the key freezes; verl's VLM LoRA scripts
        exclude ``.*visual.*`` by hand)."""
        full = list(self.modules_to_save)
        tower = [VISION_TOWER] if self.frozen_vision_tower else []
        if not full and not tower:
            return self.exclude_modules
        if isinstance(self.exclude_modules, str) or tower:  # peft reads a string as one regular expression
            user = self.exclude_modules
            mine = [f"(?:{user})"] if isinstance(user, str) else [rf"(?:.*\.)?{re.escape(m)}" for m in user or []]
            return "|".join([*mine, *(rf"(?:.*\.)?{re.escape(m)}" for m in full), *tower])
        return [*(self.exclude_modules or []), *full]


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else list(value)


def _import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError(f"model.lora_rank > 0 needs peft: {PEFT_INSTALL}") from None
    return peft


def apply_lora(module: nn.Module, spec: LoraSpec) -> nn.Module:
    """``module`` with a trainable adapter (new, or ``spec.adapter_path``'s) and everything else frozen."""
    peft = _import_peft()
    if spec.adapter_path:
        path = Path(spec.adapter_path).expanduser()
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"model.lora_adapter_path {str(path)!r} is not a peft adapter directory (no "
                                    "adapter_config.json); point it at what `rlfoundry export --format adapter` "
                                    "or PeftModel.save_pretrained wrote")
        with _quiet():
            wrapped = peft.PeftModel.from_pretrained(module, str(path), is_trainable=True)
    else:
        # A's random start from a fixed seed, outside the run's RNG stream: every rank (FSDP2 shards
        # what each rank built) and every rebuild (resume, export) starts from the same adapter
        with _quiet(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(_INIT_SEED)
            wrapped = peft.get_peft_model(module, spec.peft_config())
    from peft.tuners.lora import Linear as LoraLinear, LoraLayer

    odd = sorted({type(m).__name__ for m in wrapped.modules() if isinstance(m, LoraLayer)
                  and not isinstance(m, LoraLinear)})
    if odd:
        raise ValueError(f"LoRA on {odd} layers is not supported (only linear layers); narrow "
                         "model.target_modules (default all-linear) to linear projections")
    return wrapped


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        # peft asks transformers the deprecated spelling of is_activation_checkpointing: not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def is_lora(module: nn.Module) -> bool:
    """Whether ``module`` (plain or FSDP2-wrapped) is a peft model. Never imports peft: a run without
    LoRA does not pay its import time and memory in every process (no peft loaded, no peft model)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


@contextlib.contextmanager
def adapter_disabled(module: nn.Module) -> Iterator[nn.Module]:
    """The base model for the block: the reference policy with no second copy of the weights."""
    with module.disable_adapter():
        yield module


def base_of(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft model (its targeted layers carry the adapter); else ``module``."""
    return module.get_base_model() if is_lora(module) else module


def unfusable_reason(module: nn.Module) -> str | None:
    """Why a fused pass cannot fold this peft model's adapters into its weights; None when it can
    (every adapted layer a linear one, one active adapter, no DoRA)."""
    from peft.tuners.lora import Linear as LoraLinear, LoraLayer

    for name, layer in module.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if not isinstance(layer, LoraLinear) or list(layer.active_adapters) != [ADAPTER]:
            return f"{name}: a {type(layer).__name__} adapter layer with adapters {list(layer.active_adapters)}"
        if layer.use_dora.get(ADAPTER):
            return f"{name}: DoRA"
    return None


def effective_weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) a linear layer applies: for a LoRA layer with its adapter on, W + scaling · B A
    (a new tensor, for a pass that copies its weights anyway); else the layer's own."""
    base = getattr(layer, "base_layer", None)
    if base is None:
        return layer.weight, layer.bias
    if layer.disable_adapters or layer.merged:
        return base.weight, base.bias
    parts = {"base": base.weight, "lora_A": layer.lora_A[ADAPTER].weight, "lora_B": layer.lora_B[ADAPTER].weight}
    return _merge(layer, parts), base.bias


def peft_config_dict(module: nn.Module) -> dict[str, Any]:
    """The adapter's peft config as JSON data (``adapter_config.json``; the checkpoint marker records it)."""
    return config_json(module.peft_config[ADAPTER])


def config_json(config: Any) -> dict[str, Any]:
    """A peft ``LoraConfig`` as JSON data (target sets as sorted lists)."""
    import json

    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


_ADAPTER_PART = re.compile(r"\.(lora_[A-Za-z_]+|original_module)\.")


def hf_weight_name(name: str) -> str | None:
    """A peft parameter name -> its name in the plain model's checkpoint; None for adapter-only
    tensors (``lora_A``/``lora_B``) and for a trained head's frozen original."""
    if not name.startswith(_PREFIX):
        return name
    name = name[len(_PREFIX):]
    if _ADAPTER_PART.search(name):
        return None
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")


def _lora_layers(module: nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {prefix: m for prefix, m in module.named_modules() if isinstance(m, LoraLayer)}


def merged_hf_weights(module: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged model from ``named`` (the peft module's full parameters in
    ``named_parameters`` order): a base weight waits for its layer's ``lora_A``/``lora_B`` (they
    follow it), then leaves as W + scaling · B A, transposed for fan-in-fan-out layers."""
    layers = _lora_layers(module)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        prefix, _, leaf = name.rpartition(".base_layer.")
        if leaf == "weight" and prefix in layers:
            pending[prefix] = {"base": tensor}
            continue
        found = re.fullmatch(rf"(.+)\.(lora_A|lora_B)\.{ADAPTER}\.weight", name)
        if found and found.group(1) in pending:
            parts = pending[found.group(1)]
            parts[found.group(2)] = tensor
            if len(parts) == 3:
                del pending[found.group(1)]
                yield hf_weight_name(f"{found.group(1)}.base_layer.weight"), _merge(layers[found.group(1)], parts)
            continue
        hf = hf_weight_name(name)
        if hf is not None:
            yield hf, tensor
    if pending:
        raise RuntimeError(f"LoRA layers without both adapter matrices in the weight stream: {sorted(pending)}")


def _merge(layer: Any, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    base = parts["base"]
    delta = (parts["lora_B"].float() @ parts["lora_A"].float()) * layer.scaling[ADAPTER]
    if layer.fan_in_fan_out:
        delta = delta.T
    return (base.float() + delta).to(base.dtype)


def adapter_weights(module: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter (and trained heads) in peft's file names, from the module's full trainable
    parameters ``named``: what ``adapter_model.safetensors`` holds. Copies: an unsharded parameter on
    the CPU would otherwise be handed out live, and change under the caller at the next update."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(module, state_dict={k: v.detach().to("cpu", copy=True) for k, v in named})


def save_adapter(module: nn.Module, named: Iterable[tuple[str, torch.Tensor]], out: str | Path) -> Path:
    """A peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base, out)`` loads. Rank 0 only: ``named`` already gathered."""
    module.save_pretrained(str(out), state_dict={k: v.detach().cpu() for k, v in named})
    return Path(out)


def save_merged(module: nn.Module, named: Iterable[tuple[str, torch.Tensor]], out: str | Path) -> Path:
    """A plain Hugging Face directory of the merged model (``from_pretrained`` loads it, no peft needed).
    Rank 0 only: ``named`` is the already gathered merged stream."""
    base = module.get_base_model()
    state = {k: v.detach().cpu().contiguous() for k, v in named}
    base.save_pretrained(str(out), state_dict=state)
    return Path(out)
