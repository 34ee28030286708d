"""A CPU copy of a rank's trainable weights at one policy version, and forwards under it.

verl's fully-async ``compute_prox_log_prob`` scores a whole sync period's batches under the weights the
period started with (the version the rollout pool was synced to). Within the period the trainer has
moved on, so those weights live only here: ``swapped_in`` puts them into the engine's own tensors for
one forward and puts the current values back bitwise (``copy_`` of an exact copy), leaving the
optimiser's state, gradients and parameter objects as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

Named = Sequence[tuple[str, torch.Tensor]]


def cpu_copy(params: Named) -> dict[str, torch.Tensor]:
    """name -> a CPU copy of the values (a copy even when they already live on the CPU)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in params}


class WeightSnapshot:
    """This rank's trainable weights at one version: ``period`` (what the caller asked for) and
    ``param_version`` (the update count the values really are; differs only after a resume mid-period)."""

    def __init__(self, params: Named, period: int, param_version: int) -> None:
        self.saved, self.period, self.param_version = cpu_copy(params), period, param_version

    @contextlib.contextmanager
    def swapped_in(self, params: Named) -> Iterator[None]:
        """The saved values in ``params`` for the body; the values they had before, after it (also on error)."""
        if set(self.saved) != {name for name, _ in params}:
            raise RuntimeError("the weight snapshot was taken of other parameters than the engine holds now; "
                               "this is a bug (the trainable set changed within a sync period)")
        current = cpu_copy(params)
        try:
            _write(params, self.saved)
            yield
        finally:
            _write(params, current)


def _write(params: Named, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in params:
            t.copy_(values[name])
