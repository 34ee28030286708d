"""glibc malloc settings for training processes (``trainer.tune_malloc``, default on): one of the
CPU kernels (``rlfoundry/cpu``), applied per process by the worker runtime and the SFT trainer.

Why: torch's CPU allocator takes every tensor from ``malloc``. glibc serves a request of more than
its mmap threshold (128 KB at start, raised as such blocks are freed) with a fresh ``mmap``, and
gives the top of its heap back to the OS whenever more than the trim threshold lies free there.
A training step frees and reallocates the same activation-sized blocks hundreds of times, so
their pages go back to the kernel and fault in again, zeroed, on the next allocation, which the
settings here avoid (figures in benchmarks/README.md, "CPU kernels").

The settings: blocks under ``MMAP_THRESHOLD`` come from the heap, and the heap's free top is kept
up to ``TRIM_THRESHOLD``. Setting either one turns glibc's adaptive thresholds off, so both are
set together (only one is worse than none). The cost is memory: a process keeps up to
``TRIM_THRESHOLD`` of freed memory between steps, and heap blocks fragment where separate
mappings would have been returned. ``trainer.tune_malloc=false`` keeps glibc's defaults.
Other C libraries (musl, macOS) are left alone. Set once per process, before the work starts:
forked children inherit it.
"""

from __future__ import annotations

import ctypes
import os
import sys

from rlfoundry.cpu.tuning import MALLOC_MMAP_THRESHOLD as MMAP_THRESHOLD
from rlfoundry.cpu.tuning import MALLOC_TRIM_THRESHOLD as TRIM_THRESHOLD

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)
_done = False


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):  # the name is unknown where the C library is not glibc
        return None
    try:
        return ctypes.CDLL(None)  # this process's own C library
    except OSError:
        return None


def tune_malloc() -> bool:
    """Apply the settings above to this process; True when glibc took both (idempotent)."""
    global _done
    if _done:
        return True
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    _done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _done
