"""Files that survive a crash at any instant: atomic writes, durable renames, two-phase deletes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlfoundry.utils import faults

__all__ = ["TMP_SUFFIX", "atomic_write_bytes", "atomic_write_text", "fsync_dir", "rename_then_delete"]

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers see the old content or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write_bytes`` of UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def rename_then_delete(path: Path, fault_point: str | None = None) -> None:
    """Delete a directory so that a crash midway leaves only ``*.tmp`` debris (cleaned later)."""
    doomed = path.with_name(f"{path.name}.deleting{TMP_SUFFIX}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    fsync_dir(path.parent)
    if fault_point:
        faults.inject(fault_point)  # tests: a crash mid-delete (utils/faults.py)
    shutil.rmtree(doomed, ignore_errors=True)
