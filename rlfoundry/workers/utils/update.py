"""Plumbing shared by the actor's and the critic's PPO updates (both iterate mini-batches the same way)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlfoundry.protocol import DataProto


def iter_mini_batches(data: DataProto, mini: int, epochs: int, shuffle: bool, seed: int, fix_hint: str) -> Iterator[DataProto]:
    """``epochs`` passes over ``data`` in mini-batches of ``mini`` rows, shuffled with ``seed``.

    ``fix_hint`` completes the error for a rank whose rows do not divide into mini-batches (it names
    the config keys of the role: actor or critic).
    """
    if len(data) % mini != 0:
        raise ValueError(f"this rank received {len(data)} rows, not a multiple of its mini-batch of {mini} rows {fix_hint}")
    return data.make_iterator(mini, epochs, seed=seed, dataloader_kwargs={"shuffle": shuffle})


def global_batch_info(response_mask: torch.Tensor, dp_size: int, dp_group: Any = None) -> dict[str, Any]:
    """Valid tokens and sequences of the whole mini-batch over all dp ranks (``agg_loss``'s contract).

    Every micro-batch normalises by these mini-batch-wide counts, so the summed gradient does not
    depend on the micro-batch size or on how many ranks share the mini-batch.
    """
    counts = torch.tensor([float(response_mask.sum()), float((response_mask.sum(-1) > 0).sum())], dtype=torch.float64)
    if dp_size > 1:
        dist.all_reduce(counts, group=dp_group)
    return {"dp_size": dp_size, "batch_num_tokens": counts[0].item(), "global_batch_size": counts[1].item()}


class UpdateCounters:
    """The update state an actor or critic keeps in checkpoints, and the loop that advances it.

    ``update_calls`` (update calls so far) seeds the next call's mini-batch shuffle, so a resumed
    run draws the same mini-batches; ``nonfinite_skips`` counts optimiser steps skipped for a
    non-finite gradient norm, ever.
    """

    update_calls: int = 0
    nonfinite_skips: int = 0

    def _run_mini_batches(self, minis: Iterable[DataProto], update_one: Callable[[DataProto], dict[str, float]],
                          role: str) -> dict[str, list[float]]:
        """``{metric: [one value per mini-batch]}`` plus ``<role>/nan_skipped`` for this call."""
        skips_before = self.nonfinite_skips
        metrics: dict[str, list[float]] = {}
        for mini in minis:
            for k, v in update_one(mini).items():
                metrics.setdefault(k, []).append(v)
        self.update_calls += 1
        metrics[f"{role}/nan_skipped"] = [float(self.nonfinite_skips - skips_before)]
        return metrics

    def state_dict(self) -> dict[str, int]:
        return {"update_calls": self.update_calls, "nonfinite_skips": self.nonfinite_skips}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.update_calls = int(state.get("update_calls", 0))
        self.nonfinite_skips = int(state.get("nonfinite_skips", 0))
