"""Checkpoints that survive a crash at any instant, and load without running code.

Layout (``D = trainer.default_local_dir``)::

    D/latest_checkpointed_iteration.txt      "N" — written last, atomically (temp + fsync + rename)
    D/global_step_N/
        actor/                                one per worker role, written by save_checkpoint
            dcp/                              torch.distributed.checkpoint: sharded model + optimizer
            lr_scheduler.pt                   scheduler.state_dict()            (rank 0)
            extra_state.pt                    caller's dict of primitives/tensors (rank 0)
            rng/rank_<r>.pt                   python/numpy/torch/cuda RNG        (every rank)
            huggingface/                      config.json (+ tokenizer): enough to export alone
            checkpoint_complete.json          component marker, written last
        critic/ ...
        data.pt                               trainer state (save_trainer_state)
        step_complete.json                    step marker: lists the components; written by
                                              write_latest_checkpointed_iteration

Atomicity protocol:

1. ``save_checkpoint`` writes a component into ``<path>.tmp``; after a barrier rank 0 writes the
   component marker, fsyncs, and renames the directory into place. A crash leaves only a ``.tmp``.
2. ``save_trainer_state`` writes ``data.pt`` through a temp file and ``os.replace``.
3. ``write_latest_checkpointed_iteration`` checks every component of the step is complete,
   writes ``step_complete.json`` and then the pointer file, each atomically.
4. ``find_latest_ckpt_path`` only returns a step directory whose step marker lists components
   that all exist and are complete; a missing/garbled pointer falls back to the newest such step.
5. ``remove_old_checkpoints`` only counts complete steps, and renames a directory to ``*.tmp``
   before deleting it, so a crash mid-delete never leaves a half-deleted "complete" checkpoint.
6. ``cleanup_partial_checkpoints`` (call at start-up, before any save) removes ``*.tmp`` debris
   and step directories that never got their step marker.

Safety: loading never unpickles arbitrary objects. ``.pt`` files go through
``torch.load(weights_only=True)``; DCP's pickled metadata is read with an allow-listed unpickler
and its byte items with ``weights_only=True``. HF exports are safetensors + JSON.

All ranks of a worker group must call ``save_checkpoint`` / ``load_checkpoint`` /
``save_hf_model`` together (they are collectives), on a filesystem every rank can see.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from rlfoundry.utils import faults
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

logger = logging.getLogger(__name__)

__all__ = [
    "LATEST_FILE",
    "COMPONENT_MARKER",
    "STEP_MARKER",
    "save_checkpoint",
    "load_checkpoint",
    "save_hf_model",
    "export_hf_from_checkpoint",
    "save_trainer_state",
    "load_trainer_state",
    "is_complete_checkpoint",
    "is_complete_step_dir",
    "write_latest_checkpointed_iteration",
    "find_latest_ckpt_path",
    "remove_old_checkpoints",
    "cleanup_partial_checkpoints",
    "get_rng_state",
    "set_rng_state",
]

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPONENT_MARKER = "checkpoint_complete.json"
STEP_MARKER = "step_complete.json"
TMP_SUFFIX = ".tmp"
STEP_DIR_FORMAT = "global_step_{}"
HF_CONFIG_DIR = "huggingface"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_FORMAT_VERSION = 1


# ---- small filesystem helpers -------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (POSIX needs the directory fsynced too)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows cannot open directories; rename is still atomic there
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers see the old content or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    _atomic_write_bytes(path, buf.getvalue())


def _safe_torch_load(path: Path) -> Any:
    """``torch.load`` that refuses anything but tensors and plain containers/primitives."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} holds objects other than tensors and plain Python values; refusing to unpickle it "
            f"(checkpoints must stay loadable with weights_only=True). Original error: {e}"
        ) from e


def _rename_then_delete(path: Path, fault_point: str | None = None) -> None:
    """Delete a directory so that a crash midway leaves only ``*.tmp`` debris (cleaned later)."""
    doomed = path.with_name(f"{path.name}.deleting{TMP_SUFFIX}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    _fsync_dir(path.parent)
    if fault_point:
        faults.inject(fault_point)  # tests: a crash mid-delete (utils/faults.py)
    shutil.rmtree(doomed, ignore_errors=True)


# ---- distributed helpers ------------------------------------------------------------------


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if _dist_on() else 0


def _world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if _dist_on() else 1


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if _dist_on():
        dist.barrier(group=group)


def _broadcast_error(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if rank 0 failed, instead of leaving the others stuck in a barrier."""
    if not _dist_on():
        if error is not None:
            raise error
        return
    msg = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(msg, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if error is not None:
        raise error
    if msg[0] is not None:
        raise RuntimeError(f"rank 0 failed while writing the checkpoint: {msg[0]}")


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


def _model_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _prepare_staging(path: Path, group: dist.ProcessGroup | None) -> Path:
    staging = path.with_name(path.name + TMP_SUFFIX)
    error = None
    if _rank(group) == 0:
        try:
            if staging.exists():
                shutil.rmtree(staging)  # debris of an earlier crash
            (staging / "rng").mkdir(parents=True)
        except OSError as e:
            error = OSError(f"cannot create checkpoint directory {staging}: {e}")
    _broadcast_error(error, group)
    return staging


def _write_hf_config(model: nn.Module, tokenizer: Any, out: Path) -> None:
    """config.json (+ tokenizer) beside the shards, so the checkpoint alone can be exported."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
        _fix_architectures(out / "config.json", model)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _write_rank0_files(
    staging: Path, model: nn.Module, tokenizer: Any, lr_scheduler: Any, extra_state: dict | None, meta: dict
) -> None:
    _write_hf_config(model, tokenizer, staging / HF_CONFIG_DIR)
    if lr_scheduler is not None:
        _atomic_torch_save(lr_scheduler.state_dict(), staging / "lr_scheduler.pt")
    _atomic_torch_save(dict(extra_state or {}), staging / "extra_state.pt")
    # Listed in the marker for people inspecting the directory.
    meta["files"] = sorted(p.name for p in staging.iterdir())


def _publish(staging: Path, path: Path, meta: dict) -> None:
    """Rank 0: marker last, then swap the staging directory into place."""
    _atomic_write_bytes(staging / COMPONENT_MARKER, json.dumps(meta, indent=2).encode())
    _fsync_dir(staging)
    step_marker = path.parent / STEP_MARKER
    if step_marker.exists():
        # Re-saving a component of a finished step: the step is no longer the one the marker
        # described, so it stops counting as complete until the trainer finalises it again.
        step_marker.unlink()
    if path.exists():
        _rename_then_delete(path)
    os.replace(staging, path)
    _fsync_dir(path.parent)


def save_checkpoint(
    local_path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    extra_state: dict | None = None,
    process_group: dist.ProcessGroup | None = None,
    tokenizer: Any = None,
) -> Path:
    """Save one worker role's state to ``local_path`` (e.g. ``D/global_step_N/critic``). Collective.

    Writes model + optimizer shards with ``torch.distributed.checkpoint`` (each rank its own
    shards; ``get_state_dict`` makes FSDP2 and plain modules look the same), the scheduler state
    and ``extra_state`` (tensors / primitives / containers only) from rank 0, and every rank's RNG
    state, plus the model's HF ``config.json`` (and ``tokenizer`` if given) under ``huggingface/``
    so that :func:`export_hf_from_checkpoint` needs nothing else. Everything goes to
    ``<local_path>.tmp``; the directory is renamed to ``local_path`` only after all ranks finished
    and the completion marker is written. Returns ``local_path``.
    """
    path = Path(local_path)
    staging = _prepare_staging(path, process_group)
    state = _model_optim_state(model, optimizer)
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes one process, which is the intent.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state, storage_writer=FileSystemWriter(str(staging / "dcp")), process_group=process_group)
    _atomic_torch_save(get_rng_state(), staging / "rng" / f"rank_{_rank(process_group)}.pt")
    _barrier(process_group)
    faults.inject("save.staged")  # tests: a crash before the role directory is published
    error = None
    if _rank(process_group) == 0:
        meta = {
            "format_version": _FORMAT_VERSION,
            "world_size": _world_size(process_group),
            "has_optimizer": optimizer is not None,
            "has_lr_scheduler": lr_scheduler is not None,
            "saved_at": time.time(),
        }
        try:
            _write_rank0_files(staging, model, tokenizer, lr_scheduler, extra_state, meta)
            _publish(staging, path, meta)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    _broadcast_error(error, process_group)
    faults.inject("save.published")  # tests: a crash after this role, before the others
    return path


def _check_loadable(path: Path) -> dict:
    marker = path / COMPONENT_MARKER
    if not marker.is_file():
        why = "it does not exist" if not path.exists() else f"it has no {COMPONENT_MARKER} (an interrupted save?)"
        raise FileNotFoundError(
            f"no complete checkpoint at {path}: {why}. Use find_latest_ckpt_path(default_local_dir) to pick "
            "the newest complete one."
        )
    return json.loads(marker.read_text())


def load_checkpoint(
    local_path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
    load_rng: bool = True,
) -> dict:
    """Restore what :func:`save_checkpoint` wrote into an already built model/optimizer/scheduler.

    Collective. DCP reshards on load, so the world size may differ from the save (RNG state is
    then restored only for ranks that existed at save time). Returns the saved ``extra_state``.
    Raises FileNotFoundError if ``local_path`` is not a complete checkpoint.
    """
    path = Path(local_path)
    meta = _check_loadable(path)
    if optimizer is not None and not meta.get("has_optimizer", True):
        raise ValueError(f"{path} was saved without an optimizer; pass optimizer=None to load only the model")
    # DCP swallows a metadata read error and retries with per-rank files, which would hide the
    # reason; read it once here so a refused file says why.
    reader = _SafeFileSystemReader(str(path / "dcp"))
    reader.read_metadata()
    state = _model_optim_state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(),
                 process_group=process_group)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if lr_scheduler is not None and (path / "lr_scheduler.pt").is_file():
        lr_scheduler.load_state_dict(_safe_torch_load(path / "lr_scheduler.pt"))
    if load_rng:
        _load_rng(path, process_group)
    extra = path / "extra_state.pt"
    return _safe_torch_load(extra) if extra.is_file() else {}


def _load_rng(path: Path, group: dist.ProcessGroup | None) -> None:
    rng_file = path / "rng" / f"rank_{_rank(group)}.pt"
    if rng_file.is_file():
        set_rng_state(_safe_torch_load(rng_file))
    else:
        logger.warning("no RNG state for rank %d in %s (saved with fewer ranks); keeping the current one",
                       _rank(group), path)


def is_complete_checkpoint(local_path: str | os.PathLike) -> bool:
    """True if ``local_path`` is a component directory whose save finished (marker present)."""
    return (Path(local_path) / COMPONENT_MARKER).is_file()


# ---- Hugging Face export ------------------------------------------------------------------


def _unwrapped_class_name(model: nn.Module) -> str:
    """FSDP2 swaps the class for ``FSDP<Name>``; config.architectures must name the real one."""
    from torch.distributed.fsdp import FSDPModule

    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(model).__name__


def _fix_architectures(config_file: Path, model: nn.Module) -> None:
    # save_pretrained records type(model).__name__, which FSDP2 changed to FSDP<Name>; and a critic
    # built from a causal-LM directory still carries that directory's architectures.
    config = json.loads(config_file.read_text())
    config["architectures"] = [_unwrapped_class_name(model)]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_hf_dir(model: nn.Module, tokenizer: Any, full_sd: dict, out: Path) -> None:
    model.save_pretrained(out, state_dict=full_sd)
    _fix_architectures(out / "config.json", model)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def save_hf_model(
    model: nn.Module, tokenizer: Any, path: str | os.PathLike, process_group: dist.ProcessGroup | None = None
) -> Path:
    """Export full weights as a Hugging Face directory (safetensors + config + tokenizer). Collective.

    Every rank takes part in gathering the unsharded weights (moved to the CPU as they arrive, so
    the accelerator never holds a full copy); rank 0 writes them into ``<path>.tmp`` and renames it
    to ``path`` when done. The result loads with ``AutoModel*.from_pretrained(path)``.
    """
    out = Path(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_sd = get_model_state_dict(model, options=options)
    error = None
    if _rank(process_group) == 0:
        try:
            staging = out.with_name(out.name + TMP_SUFFIX)
            if staging.exists():
                shutil.rmtree(staging)
            _write_hf_dir(model, tokenizer, full_sd, staging)
            if out.exists():
                _rename_then_delete(out)
            os.replace(staging, out)
            _fsync_dir(out.parent)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    _broadcast_error(error, process_group)
    return out


_AUTO_CLASS_BY_SUFFIX = {
    "ForCausalLM": "AutoModelForCausalLM",
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
}


def export_hf_from_checkpoint(local_path: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Turn one role's sharded checkpoint (``.../global_step_N/actor``) into an HF directory.

    Single process, no GPU: the model is rebuilt from the checkpoint's ``huggingface/config.json``
    (the Auto class chosen by its architecture suffix), the DCP shards are loaded into it (DCP
    reshards any world size to one), and :func:`save_hf_model` writes safetensors + config +
    tokenizer. Backs ``rlfoundry export``.
    """
    import transformers

    path = Path(local_path)
    _check_loadable(path)
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


# ---- trainer state ------------------------------------------------------------------------


def save_trainer_state(path: str | os.PathLike, state: dict) -> None:
    """Atomically write the trainer's state (step, data-loader state, KL coefficient, ...).

    ``state`` may hold tensors, numbers, strings, None and lists/tuples/dicts of those — anything
    ``torch.load(weights_only=True)`` can read back. Call on the driver, once.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(state, path)
    try:  # fail now, not at resume time, if something unloadable slipped in
        _safe_torch_load(path)
    except ValueError:
        path.unlink()
        raise
    faults.inject("save.trainer_state")  # tests: a crash before the step is marked complete


def load_trainer_state(path: str | os.PathLike) -> dict:
    """Read what :func:`save_trainer_state` wrote (``weights_only`` loading; no code runs)."""
    return _safe_torch_load(Path(path))


# ---- step directories, the latest pointer, retention --------------------------------------


def _step_of(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(_step_of(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def _read_step_marker(step_dir: Path) -> dict | None:
    try:
        return json.loads((step_dir / STEP_MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete_step_dir(step_dir: str | os.PathLike) -> bool:
    """True if ``global_step_N`` was finalised and every component it lists is still complete."""
    step_dir = Path(step_dir)
    marker = _read_step_marker(step_dir)
    if marker is None:
        return False
    for name in marker.get("components", []):
        if not is_complete_checkpoint(step_dir / name):
            return False
    return all((step_dir / name).is_file() for name in marker.get("files", []))


def _components_of(step_dir: Path) -> tuple[list[str], list[str]]:
    """(component dirs, plain files) of a step directory; raises if a save is unfinished."""
    leftovers = sorted(p.name for p in step_dir.iterdir() if p.name.endswith(TMP_SUFFIX))
    unfinished = sorted(p.name for p in step_dir.iterdir() if p.is_dir() and not is_complete_checkpoint(p))
    if leftovers or unfinished:
        raise RuntimeError(
            f"{step_dir} is not complete (unfinished: {leftovers + unfinished}); every worker's "
            "save_checkpoint must return before write_latest_checkpointed_iteration"
        )
    dirs = sorted(p.name for p in step_dir.iterdir() if p.is_dir())
    files = sorted(p.name for p in step_dir.iterdir() if p.is_file() and p.name != STEP_MARKER)
    return dirs, files


def write_latest_checkpointed_iteration(default_local_dir: str | os.PathLike, step: int) -> Path:
    """Mark ``global_step_<step>`` complete, then point ``latest_checkpointed_iteration.txt`` at it.

    Call on the driver after every worker's ``save_checkpoint`` and ``save_trainer_state`` have
    returned. Both files are written atomically (temp file + fsync + ``os.replace``), the step
    marker first, so the pointer never names an unfinished step and is never half-written.
    """
    root = Path(default_local_dir)
    step_dir = root / STEP_DIR_FORMAT.format(int(step))
    if not step_dir.is_dir():
        raise FileNotFoundError(f"cannot mark step {step} complete: {step_dir} does not exist")
    dirs, files = _components_of(step_dir)
    if not dirs and not files:
        raise RuntimeError(f"cannot mark step {step} complete: {step_dir} is empty")
    marker = {"global_step": int(step), "components": dirs, "files": files, "saved_at": time.time()}
    _atomic_write_bytes(step_dir / STEP_MARKER, json.dumps(marker, indent=2).encode())
    faults.inject("save.step_marked")  # tests: a crash between the step marker and the pointer
    _atomic_write_bytes(root / LATEST_FILE, str(int(step)).encode())
    return step_dir


def _read_latest_pointer(root: Path) -> int | None:
    try:
        return int((root / LATEST_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def find_latest_ckpt_path(default_local_dir: str | os.PathLike | None, directory_format: str = STEP_DIR_FORMAT) -> str | None:
    """The newest complete ``global_step_N`` directory under ``default_local_dir``, or None.

    Follows ``latest_checkpointed_iteration.txt`` when it names a complete step; otherwise (file
    missing or unreadable, or the step it names incomplete) falls back to the newest step
    directory that is complete, with a warning. Partial saves (``*.tmp`` or no step marker) are
    never returned.
    """
    if default_local_dir is None:
        return None
    root = Path(default_local_dir)
    step = _read_latest_pointer(root)
    if step is not None:
        candidate = root / directory_format.format(step)
        if is_complete_step_dir(candidate):
            return str(candidate)
        logger.warning("%s names step %d, which is not a complete checkpoint; looking for an older one",
                       root / LATEST_FILE, step)
    for _, step_dir in reversed(_step_dirs(root)):
        if is_complete_step_dir(step_dir):
            return str(step_dir)
    return None


def remove_old_checkpoints(
    default_local_dir: str | os.PathLike, max_to_keep: int | None, component: str | None = None
) -> list[str]:
    """Delete all but the newest ``max_to_keep`` complete checkpoints; returns what was removed.

    Only finalised steps (with a step marker) count, so call this after
    :func:`write_latest_checkpointed_iteration`: a new checkpoint is complete before an old one
    goes. ``component`` (e.g. ``"actor"``) removes just that role's directory from old steps
    (``max_actor_ckpt_to_keep`` and ``max_critic_ckpt_to_keep`` may differ); the step is then no
    longer resumable but the remaining roles stay exportable. ``None`` or ``<= 0`` keeps everything.
    """
    if max_to_keep is None or max_to_keep <= 0:
        return []
    root = Path(default_local_dir)
    finalised = [p for _, p in _step_dirs(root) if _read_step_marker(p) is not None]
    if component is not None:
        finalised = [p for p in finalised if (p / component).is_dir()]
    removed = []
    for step_dir in finalised[: max(0, len(finalised) - max_to_keep)]:
        target = step_dir if component is None else step_dir / component
        _rename_then_delete(target, fault_point="save.pruning")
        removed.append(str(target))
    return removed


def cleanup_partial_checkpoints(default_local_dir: str | os.PathLike) -> list[str]:
    """Remove debris of interrupted saves/deletes: ``*.tmp`` entries and unfinalised step dirs.

    Call once at start-up (before resuming or saving), never while any save may be running: an
    in-progress save looks exactly like debris.
    """
    root = Path(default_local_dir)
    if not root.is_dir():
        return []
    doomed = [p for p in root.iterdir() if p.name.endswith(TMP_SUFFIX)]
    for _, step_dir in _step_dirs(root):
        if _read_step_marker(step_dir) is None:
            doomed.append(step_dir)
        else:
            doomed.extend(p for p in step_dir.iterdir() if p.name.endswith(TMP_SUFFIX))
    for p in doomed:
        logger.warning("removing partial checkpoint %s (left by an interrupted save)", p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return [str(p) for p in doomed]
