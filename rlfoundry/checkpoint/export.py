"""Hugging Face directories: an engine's live export (``save_hf_model``) and the offline export of
a saved role (``export_hf_from_checkpoint``), which picks the exporter of the engine that saved it.

Every HF directory is written by rank 0 into ``<path>.tmp`` and renamed into place, with the real
architecture name in ``config.json`` and the tokenizer beside the weights; it loads with
``AutoModel*.from_pretrained(path)``.

The one export dispatch is :func:`engine_exporter`: a role's marker names the engine that wrote it
(the FSDP engine's names none: its DCP shards are read here), and ``ENGINE_EXPORTERS`` names the
exporter of each engine with a shard format of its own. ``rlfoundry export`` and
:func:`export_hf_from_checkpoint` both go through it.
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rlfoundry.checkpoint import collective
from rlfoundry.checkpoint.layout import HF_CONFIG_DIR, read_component_marker, staging_dir, verify_files
from rlfoundry.checkpoint.state import fix_architectures, load_checkpoint
from rlfoundry.models.hf import trainer_only_prefixes
from rlfoundry.utils.fs import fsync_dir, rename_then_delete

__all__ = ["ENGINE_EXPORTERS", "engine_exporter", "export_hf_from_checkpoint", "publish_hf_dir", "save_hf_model"]

# The marker's "engine" -> "module:function" turning one such role directory into an HF directory on
# one CPU process. Named, not imported: the engines import this package, and the CLI may not import
# them (tests/test_import_direction.py); config/rollout_engines.py names rollout engines the same way.
ENGINE_EXPORTERS = {"megatron": "rlfoundry.engines.megatron.export:export_megatron_checkpoint"}


def save_hf_model(
    model: nn.Module, tokenizer: Any, path: str | os.PathLike, process_group: dist.ProcessGroup | None = None
) -> Path:
    """Export full weights as a Hugging Face directory (safetensors + config + tokenizer). Collective.

    Every rank takes part in gathering the unsharded weights (moved to the CPU as they arrive, so
    the accelerator never holds a full copy); rank 0 writes them into ``<path>.tmp`` and renames it
    to ``path`` when done. The result loads with ``AutoModel*.from_pretrained(path)``.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_sd = get_model_state_dict(model, options=options)
    skip = trainer_only_prefixes(model)  # FlowRL's log Z head: no part of the HF model
    full_sd = {k: v for k, v in full_sd.items() if not (skip and k.startswith(skip))}
    return publish_hf_dir(path, lambda out: model.save_pretrained(out, state_dict=full_sd), tokenizer, model,
                          process_group)


def publish_hf_dir(path: str | os.PathLike, write: Callable[[Path], Any], tokenizer: Any, model: nn.Module,
                   process_group: dist.ProcessGroup | None = None) -> Path:
    """Rank 0: ``write(staging)``, the tokenizer, the real architecture name, then rename into place;
    every rank returns (or raises rank 0's error) together. Gather before: nothing collective here."""
    out = Path(path)
    error = None
    if collective.rank(process_group) == 0:
        try:
            staging = staging_dir(out)
            if staging.exists():
                shutil.rmtree(staging)
            write(staging)
            if (staging / "config.json").is_file():
                fix_architectures(staging / "config.json", model)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            if out.exists():
                rename_then_delete(out)
            os.replace(staging, out)
            fsync_dir(out.parent)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    collective.broadcast_error(error, process_group)
    return out


def engine_exporter(marker: dict) -> Callable[[Path, Path], Path] | None:
    """The exporter of the engine that wrote the role ``marker`` describes, or None for DCP shards
    (the FSDP engine's), which :func:`export_hf_from_checkpoint` reads itself and ``rlfoundry
    export`` loads into the run's own worker (a LoRA adapter needs the run's base model)."""
    target = ENGINE_EXPORTERS.get(marker.get("engine"))
    if target is None:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def export_hf_from_checkpoint(local_path: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Turn one role's sharded checkpoint (``.../global_step_N/actor``) into an HF directory.

    Single process, no GPU. An engine with a shard format of its own exports with its exporter
    (:func:`engine_exporter`; Megatron: ``engines/megatron/export.py``). DCP shards: the model is
    rebuilt from the checkpoint's ``huggingface/config.json`` (the Auto class chosen by its
    architecture suffix), the shards are loaded into it (DCP reshards any world size to one), and
    :func:`save_hf_model` writes safetensors + config + tokenizer.
    """
    path = Path(local_path)
    meta = read_component_marker(path)
    exporter = engine_exporter(meta)
    if exporter is not None:
        return exporter(path, Path(out_path))
    if meta.get("trainable_only"):
        raise ValueError(f"{path} holds a LoRA adapter without its base model: export it with `rlfoundry export` "
                         "(the run's config names the base; --format merged or adapter)")
    return _export_dcp(path, meta, out_path)


_AUTO_CLASS_BY_SUFFIX = {
    "ForCausalLM": "AutoModelForCausalLM",
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
}


def _export_dcp(path: Path, meta: dict, out_path: str | os.PathLike) -> Path:
    import transformers

    if meta.get("manifest") is not None:
        verify_files(path, meta["manifest"])
    config = transformers.AutoConfig.from_pretrained(path / HF_CONFIG_DIR)
    arch = (getattr(config, "architectures", None) or ["ForCausalLM"])[0]
    auto_name = next((auto for suffix, auto in _AUTO_CLASS_BY_SUFFIX.items() if arch.endswith(suffix)), None)
    if auto_name is None:
        raise ValueError(f"cannot export {path}: architecture {arch!r} is not a causal LM, token or sequence classifier")
    model = getattr(transformers, auto_name).from_config(config)
    load_checkpoint(path, model, load_rng=False)
    tokenizer = None
    if (path / HF_CONFIG_DIR / "tokenizer_config.json").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path / HF_CONFIG_DIR)
    return save_hf_model(model, tokenizer, out_path)
