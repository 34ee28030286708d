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


_MISSING = object()


@contextlib.contextmanager
def count_host_reads(monkeypatch=None) -> Iterator[list[tuple[str, str]]]:
    """Yields a list that fills with (method, caller file:line) for each read in the block.

    The wrappers are removed on exit exactly as they were found: a method ``torch.Tensor`` inherits
    (``__index__``, ``__bool__`` ...) is deleted again rather than set to the inherited one, which
    would leave a Python-level slot on the class and change how later code converts tensors (e.g.
    ``torch.tensor`` of a list of 0-d tensors). ``monkeypatch`` is not used (the caller's own patches
    stay theirs to undo)."""
    reads: list[tuple[str, str]] = []
    saved: list[tuple[object, str, object]] = []
    depth: list[str] = []  # the wrapped calls under way

    def patch(owner, name, value):
        saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def caller() -> str:
        frame = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("host_reads.py")][-1]
        return f"{frame.filename.rsplit('/rlfoundry/', 1)[-1]}:{frame.lineno}"

    def wrap(owner, name, counts=lambda *a, **k: True):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            first = args[0] if args else None
            if not depth and counts(*args, **kwargs) and not (isinstance(first, torch.Tensor) and _host_made(first)):
                reads.append((name, caller()))
            depth.append(name)  # the original re-enters through the mode below: one read, counted once
            try:
                return original(*args, **kwargs)
            finally:
                depth.pop()
        patch(owner, name, counted)

    def tag(name):
        original = getattr(torch, name)

        def made(*args, **kwargs):
            out = original(*args, **kwargs)
            if kwargs.get("device") in (None, "cpu", torch.device("cpu")):
                out._rlf_host_made = True
            return out
        patch(torch, name, made)

    for name in _METHODS:
        wrap(torch.Tensor, name)
    for name in _FUNCTIONS:
        wrap(torch, name)
    for name in _HOST_MADE:
        tag(name)

    class BoolMaskReads(torch.overrides.TorchFunctionMode):
        """Indexing with a boolean mask (its output size depends on the data). Seen through a mode, not
        by wrapping ``Tensor.__getitem__``: replacing that slot, even for a while, leaves tensors looking
        like sequences to CPython for the rest of the process."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not depth and func is torch.Tensor.__getitem__ and len(args) > 1 and _is_bool_mask(args[1]) \
                    and not _host_made(args[0]):
                reads.append(("__getitem__", caller()))
            return func(*args, **(kwargs or {}))

    try:
        with BoolMaskReads():
            yield reads
    finally:
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
