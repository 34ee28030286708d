"""Counting device-to-host reads on the CPU, where no sync debug mode exists (torch's
``set_sync_debug_mode`` is CUDA's): every Tensor method that hands a value to Python, and every op
whose output size depends on the data (which on CUDA waits for the device), is wrapped for the
duration and records its caller.

Index tensors made on the host (``torch.randperm`` / ``torch.arange`` without a device, e.g. a
mini-batch shuffle) stay on the host on a GPU too: reads of them, or of their views, are not counted.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch

_METHODS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "nonzero", "unique")
_FUNCTIONS = ("nonzero", "unique", "masked_select", "argwhere")
_HOST_MADE = ("randperm", "arange")


def _host_made(t: torch.Tensor) -> bool:
    return getattr(t, "_rlf_host_made", False) or getattr(t._base, "_rlf_host_made", False)


def _is_bool_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


@contextlib.contextmanager
def count_host_reads(monkeypatch) -> Iterator[list[tuple[str, str]]]:
    """Yields a list that fills with (method, caller file:line) for each read in the block."""
    reads: list[tuple[str, str]] = []

    def caller() -> str:
        frame = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("host_reads.py")][-1]
        return f"{frame.filename.rsplit('/rlfoundry/', 1)[-1]}:{frame.lineno}"

    def wrap(owner, name, counts=lambda *a, **k: True):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            first = args[0] if args else None
            if counts(*args, **kwargs) and not (isinstance(first, torch.Tensor) and _host_made(first)):
                reads.append((name, caller()))
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)

    def tag(name):
        original = getattr(torch, name)

        def made(*args, **kwargs):
            out = original(*args, **kwargs)
            if kwargs.get("device") in (None, "cpu", torch.device("cpu")):
                out._rlf_host_made = True
            return out
        monkeypatch.setattr(torch, name, made)

    for name in _METHODS:
        wrap(torch.Tensor, name)
    for name in _FUNCTIONS:
        wrap(torch, name)
    wrap(torch.Tensor, "__getitem__", lambda self, index: _is_bool_mask(index))
    for name in _HOST_MADE:
        tag(name)
    try:
        yield reads
    finally:
        monkeypatch.undo()
