"""Saving and loading one role's training state with ``torch.distributed.checkpoint`` (DCP).

A role directory (e.g. ``D/global_step_N/actor``, see ``checkpoint/layout.py`` for the layout and
the step protocol) holds the sharded model + optimiser (``dcp/``, each rank its own shards), the LR
schedule and the caller's extra state (rank 0), every rank's RNG state, the model's HF config (+
tokenizer) so it can be exported alone, and the marker with the manifest: every file's size and
SHA-256. Ranks hash their share of the files in parallel, and on load each rank verifies its share
before anything is read, so a damaged shard is an error naming the file, never a half-loaded model.

Everything is written to ``<path>.tmp`` and renamed into place after all ranks finished. Loading
never unpickles arbitrary objects: DCP's pickled metadata is read with an allow-listed unpickler
and its byte items with ``weights_only=True``; HF exports are safetensors + JSON.

All ranks of a worker group call ``save_checkpoint`` / ``load_checkpoint`` together (they are
collectives), on a filesystem every rank can see. ``save_role`` / ``load_role`` are the
engine-independent part (the Megatron engine writes its own shards through them).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlfoundry.checkpoint import collective
from rlfoundry.checkpoint.layout import (
    COMPONENT_MARKER,
    HF_CONFIG_DIR,
    atomic_torch_save,
    file_manifest,
    files_under,
    read_component_marker,
    safe_torch_load,
    staging_dir,
    unfinalise_step,
    verify_files,
)
from rlfoundry.utils import faults
from rlfoundry.utils.errors import CheckpointCorruptError, CheckpointMismatchError
from rlfoundry.utils.fs import atomic_write_bytes, fsync_dir, rename_then_delete

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_CONTENTS",
    "Contents",
    "fix_architectures",
    "get_rng_state",
    "load_checkpoint",
    "load_role",
    "save_checkpoint",
    "save_role",
    "set_rng_state",
    "write_hf_config",
]

_FORMAT_VERSION = 2  # 2: the marker carries a manifest of every file

# verl's checkpoint.save_contents / load_contents entries; "model" is required (a role's directory
# without weights cannot be resumed), "hf_model" is meaningful for saving only.
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass(frozen=True)
class Contents:
    """What a save writes or a load restores, as verl's ``checkpoint.{save,load}_contents`` lists say:
    ``optimizer`` (its state), ``extra`` (LR schedule + RNG states), ``hf_model`` (on save: full
    weights in ``huggingface/`` beside the config, a ``from_pretrained`` directory). The model's
    shards and the caller's extra state (step, counters) are always part of a role's directory."""

    optimizer: bool = True
    extra: bool = True
    hf_model: bool = False

    @classmethod
    def of(cls, names: Sequence[str] | None) -> Contents:
        """From a contents list (None: verl's default, model + optimizer + extra)."""
        if names is None:
            return cls()
        names = set(names)
        return cls(optimizer="optimizer" in names, extra="extra" in names, hf_model="hf_model" in names)


# ---- RNG state ----------------------------------------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) generator states as tensors and primitives only.

    numpy's state holds an ndarray, which ``weights_only`` loading rejects, so it is stored as a
    tensor; Python's as a list of ints.
    """
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`get_rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    keys = npst["keys"].numpy().astype(np.uint32)
    np.random.set_state((npst["name"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- safe DCP reading ---------------------------------------------------------------------

# Exactly the globals DCP's metadata pickle refers to: its own plain data classes (which have no
# side effects when constructed), torch dtypes/sizes, and the paths FileSystemWriter records.
_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}
_TORCH_ENUM_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` but only the globals above (and torch dtypes).

    DCP stores its index with plain ``pickle``; a crafted file could otherwise run code on load.
    """

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUM_TYPES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata references {module}.{name}, which is not allowed")


class _SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that reads ``.metadata`` with the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(str(self.path)) / name, "rb") as f:
            metadata = _DcpMetadataUnpickler(f).load()
        # Mirror FileSystemReader.read_metadata's bookkeeping (absent in older torch: skipped).
        try:
            from torch.distributed.checkpoint.metadata import StorageMeta
        except ImportError:
            return metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but non-tensor items (lr, betas, step counts) load with weights_only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # Validate with weights_only first; the parent's own load then re-reads the same bytes,
        # which can only reference the globals just allowed. (Avoids copying DCP's private
        # nested-dict plumbing.) Byte items are tiny: lr, betas, step counters.
        torch.load(value, map_location="cpu", weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


# ---- component save / load ----------------------------------------------------------------


def _state_options(trainable_only: bool) -> StateDictOptions:
    # trainable_only: a LoRA model's frozen base is the model directory's, never a checkpoint's
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _model_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                       trainable_only: bool = False) -> dict[str, Any]:
    options = _state_options(trainable_only)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd}


def _prepare_staging(path: Path, group: dist.ProcessGroup | None) -> Path:
    staging = staging_dir(path)
    error = None
    if collective.rank(group) == 0:
        try:
            if staging.exists():
                shutil.rmtree(staging)  # debris of an earlier crash
            (staging / "rng").mkdir(parents=True)
        except OSError as e:
            error = OSError(f"cannot create checkpoint directory {staging}: {e}")
    collective.broadcast_error(error, group)
    return staging


def write_hf_config(model: nn.Module, tokenizer: Any, out: Path) -> None:
    """config.json (+ tokenizer) beside the shards, so the checkpoint alone can be exported."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
        fix_architectures(out / "config.json", model)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _publish(staging: Path, path: Path, meta: dict) -> None:
    """Rank 0: marker last, then swap the staging directory into place."""
    atomic_write_bytes(staging / COMPONENT_MARKER, json.dumps(meta, indent=2).encode())
    fsync_dir(staging)
    unfinalise_step(path.parent)  # re-saving a role of a finished step
    if path.exists():
        rename_then_delete(path)
    os.replace(staging, path)
    fsync_dir(path.parent)


def save_checkpoint(
    local_path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    extra_state: dict | None = None,
    process_group: dist.ProcessGroup | None = None,
    tokenizer: Any = None,
    trainable_only: bool = False,
    meta: dict | None = None,
    rng: bool = True,
    write_hf_model: Callable[[Path], None] | None = None,
) -> Path:
    """Save one worker role's state to ``local_path`` (e.g. ``D/global_step_N/critic``). Collective.

    Writes model + optimizer shards with ``torch.distributed.checkpoint`` (each rank its own
    shards; ``get_state_dict`` makes FSDP2 and plain modules look the same), the scheduler state
    and ``extra_state`` (tensors / primitives / containers only) from rank 0, and every rank's RNG
    state, plus the model's HF ``config.json`` (and ``tokenizer`` if given) under ``huggingface/``
    so that ``export_hf_from_checkpoint`` (``checkpoint/export.py``) needs nothing else. Everything goes to
    ``<local_path>.tmp``; the directory is renamed to ``local_path`` only after all ranks finished
    and the completion marker is written. Returns ``local_path``. ``trainable_only``: only the
    parameters that train (a LoRA adapter) and their optimiser state; ``meta`` joins the marker.
    verl's ``checkpoint.save_contents`` (the engine's choice): ``optimizer=None`` leaves its state
    out, ``lr_scheduler=None`` and ``rng=False`` the "extra" state, and ``write_hf_model(dir)``,
    called on every rank (its gather is collective), writes full HF weights into ``huggingface/``.
    """
    def write_shards(staging: Path) -> None:
        state = _model_optim_state(model, optimizer, trainable_only)
        with warnings.catch_warnings():
            # Without a process group DCP warns that it assumes one process, which is the intent.
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
            dcp.save(state, storage_writer=FileSystemWriter(str(staging / "dcp")), process_group=process_group)
        if write_hf_model is not None:
            write_hf_model(staging / HF_CONFIG_DIR)

    def write_config(out: Path) -> None:
        write_hf_config(model, tokenizer, out)

    return save_role(local_path, write_shards, write_config, lr_scheduler, extra_state, process_group,
                     {"has_optimizer": optimizer is not None, "has_rng": rng, "has_hf_model": write_hf_model is not None,
                      "trainable_only": trainable_only, **(meta or {})}, rng=rng)


def save_role(
    local_path: str | os.PathLike,
    write_shards: Callable[[Path], None],
    write_hf_config: Callable[[Path], None],
    lr_scheduler: Any = None,
    extra_state: dict | None = None,
    process_group: dist.ProcessGroup | None = None,
    meta: dict | None = None,
    rng_state: Callable[[], dict[str, Any]] | None = None,
    rng: bool = True,
) -> Path:
    """The engine-independent part of a save: staging, RNG, scheduler + extra state, HF config,
    manifest, atomic publish. ``write_shards(staging)`` writes the model (+ optimiser) shards on
    every rank; ``write_hf_config(dir)`` the HF config (+ tokenizer) on rank 0; ``meta`` goes into
    the marker; ``rng_state`` (default :func:`get_rng_state`) is each rank's RNG file (none with ``rng=False``)."""
    path = Path(local_path)
    staging = _prepare_staging(path, process_group)
    write_shards(staging)
    if rng:
        atomic_torch_save((rng_state or get_rng_state)(), staging / "rng" / f"rank_{collective.rank(process_group)}.pt")
    collective.barrier(process_group)
    faults.inject("save.staged")  # tests: a crash before the role directory is published
    meta = {
        "format_version": _FORMAT_VERSION,
        "world_size": collective.world_size(process_group),
        "has_lr_scheduler": lr_scheduler is not None,
        "saved_at": time.time(),
        **(meta or {}),
    }
    error = None
    if collective.rank(process_group) == 0:
        try:
            write_hf_config(staging / HF_CONFIG_DIR)
            if lr_scheduler is not None:
                atomic_torch_save(lr_scheduler.state_dict(), staging / "lr_scheduler.pt")
            atomic_torch_save(dict(extra_state or {}), staging / "extra_state.pt")
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    collective.broadcast_error(error, process_group)
    manifest = _hash_shares(staging, process_group)
    error = None
    if collective.rank(process_group) == 0:
        try:
            _publish(staging, path, {**meta, "manifest": manifest})
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    collective.broadcast_error(error, process_group)
    faults.inject("save.published")  # tests: a crash after this role, before the others
    return path


def _share(names: list[str], group: dist.ProcessGroup | None) -> list[str]:
    """This rank's part of ``names`` (round robin), so ranks hash or verify in parallel."""
    return names[collective.rank(group)::collective.world_size(group)]


def _hash_shares(staging: Path, group: dist.ProcessGroup | None) -> dict[str, dict[str, Any]]:
    """The manifest of every staged file; each rank hashes its share, rank 0 gets the union."""
    mine = file_manifest(staging, _share(files_under(staging), group))
    if not collective.dist_on():
        return mine
    parts: list[Any] = [None] * collective.world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return {name: entry for part in parts for name, entry in part.items()}


def _verify_shares(path: Path, meta: dict, group: dist.ProcessGroup | None) -> None:
    """Each rank checks its share of the manifest; a damaged file is an error on every rank."""
    manifest = meta.get("manifest")
    if manifest is None:  # saved before manifests existed
        return
    error = None
    try:
        verify_files(path, manifest, _share(sorted(manifest), group))
    except CheckpointCorruptError as e:
        error = str(e)
    if collective.dist_on():
        found: list[Any] = [None] * collective.world_size(group)
        dist.all_gather_object(found, error, group=group)
        error = next((e for e in found if e is not None), None)
    if error is not None:
        raise CheckpointCorruptError(error)


def load_checkpoint(
    local_path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
    load_rng: bool = True,
    verify: bool = True,
    trainable_only: bool = False,
) -> dict:
    """Restore what :func:`save_checkpoint` wrote into an already built model/optimizer/scheduler.

    Collective. DCP reshards on load, so the world size may differ from the save (RNG state is
    then restored only for ranks that existed at save time). Returns the saved ``extra_state``.
    Raises FileNotFoundError if ``local_path`` is not a complete checkpoint.
    """
    def read_shards(path: Path, meta: dict) -> None:
        if optimizer is not None and not meta.get("has_optimizer", True):
            raise ValueError(f"{path} was saved without its optimizer state (checkpoint.save_contents had no "
                             "'optimizer'); load the weights alone with checkpoint.load_contents=['model','extra']")
        if bool(meta.get("trainable_only", False)) != trainable_only:
            saved = "a LoRA adapter" if meta.get("trainable_only") else "a whole model"
            raise CheckpointMismatchError(
                f"{path} holds {saved}, but the model it is loaded into {'has' if trainable_only else 'has no'} "
                "LoRA adapter; resume with the run's own model.lora_rank")
        # DCP swallows a metadata read error and retries with per-rank files, which would hide the
        # reason; read it once here so a refused file says why.
        reader = _SafeFileSystemReader(str(path / "dcp"))
        reader.read_metadata()
        state = _model_optim_state(model, optimizer, trainable_only)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(),
                     process_group=process_group)
        options = _state_options(trainable_only)
        if optimizer is None:
            set_model_state_dict(model, state["model"], options=options)
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=options)

    return load_role(local_path, read_shards, lr_scheduler, process_group, load_rng, verify)


def load_role(
    local_path: str | os.PathLike,
    read_shards: Callable[[Path, dict], None],
    lr_scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
    load_rng: bool = True,
    verify: bool = True,
    set_rng: Callable[[dict[str, Any]], None] | None = None,
) -> dict:
    """The engine-independent part of a load: the marker, the manifest check (each rank its share),
    ``read_shards(path, marker)``, the scheduler, the RNG (``set_rng``, default :func:`set_rng_state`);
    returns the saved extra state."""
    path = Path(local_path)
    meta = read_component_marker(path)
    if verify:  # False: the caller checked the whole step already (the trainer's resume)
        _verify_shares(path, meta, process_group)
    read_shards(path, meta)
    if lr_scheduler is not None and (path / "lr_scheduler.pt").is_file():
        lr_scheduler.load_state_dict(safe_torch_load(path / "lr_scheduler.pt"))
    if load_rng:
        _load_rng(path, process_group, set_rng or set_rng_state)
    extra = path / "extra_state.pt"
    return safe_torch_load(extra) if extra.is_file() else {}


def _load_rng(path: Path, group: dist.ProcessGroup | None, set_rng: Callable[[dict[str, Any]], None]) -> None:
    rng_file = path / "rng" / f"rank_{collective.rank(group)}.pt"
    if rng_file.is_file():
        set_rng(safe_torch_load(rng_file))
    else:
        logger.warning("no RNG state for rank %d in %s (saved with fewer ranks); keeping the current one",
                       collective.rank(group), path)


# ---- the HF config beside the shards (and in every HF export): the real architecture name ------


def _unwrapped_class_name(model: nn.Module) -> str:
    """FSDP2 swaps the class for ``FSDP<Name>``; config.architectures must name the real one."""
    from torch.distributed.fsdp import FSDPModule

    from rlfoundry.models.lora import base_of

    model = base_of(model)  # a peft (LoRA) model: name the model it adapts
    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(model).__name__


def fix_architectures(config_file: Path, model: nn.Module) -> None:
    # save_pretrained records type(model).__name__, which FSDP2 changed to FSDP<Name>; and a critic
    # built from a causal-LM directory still carries that directory's architectures.
    config = json.loads(config_file.read_text())
    config["architectures"] = [_unwrapped_class_name(model)]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
