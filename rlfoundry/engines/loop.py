"""Back-end-independent pieces of the update loop, shared by every engine.

- ``iter_mini_batches``: epochs × mini-batches of a rank's rows, seeded per update call;
- ``run_update``: one ``train_batch`` call's walk over them, metrics per optimiser step;
- ``global_batch_info``: the mini-batch-wide token / sequence counts (one all-reduce);
- ``MiniBatchStats``: a mini-batch's metrics made split- and rank-independent (one all-reduce);
- ``zero_loss_row``: a stand-in micro-batch that adds no gradient, for a rank left one short.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlfoundry.engines.base import GlobalBatchInfo, LossOutput, TrainingEngine, UpdatePlan
from rlfoundry.protocol import DataProto

__all__ = ["MiniBatchStats", "batch_counts", "collective_device", "device_for_backend", "global_batch_info",
           "iter_mini_batches", "mix_seed", "run_update", "zero_loss_row"]


def mix_seed(seed: int, call: int) -> int:
    """A shuffle seed per update call: resumed runs (same ``call``) draw the same mini-batches."""
    return int(np.random.SeedSequence([seed, call]).generate_state(1, dtype=np.uint64)[0] >> 1)


def iter_mini_batches(data: DataProto, mini: int, epochs: int, shuffle: bool, seed: int, fix_hint: str) -> Iterator[DataProto]:
    """``epochs`` passes over ``data`` in mini-batches of ``mini`` rows, shuffled with ``seed``.

    ``fix_hint`` completes the error for a rank whose rows do not divide into mini-batches (it names
    the config keys of the role).
    """
    if len(data) % mini != 0:
        raise ValueError(f"this rank received {len(data)} rows, not a multiple of its mini-batch of {mini} rows {fix_hint}")
    return data.make_iterator(mini, epochs, seed=seed, dataloader_kwargs={"shuffle": shuffle})


def run_update(engine: TrainingEngine, data: DataProto, plan: UpdatePlan,
               step: Callable[[DataProto], dict[str, float]]) -> dict[str, list[float]]:
    """``plan.epochs`` × mini-batches of ``data``, ``step`` (one optimiser step) on each:
    ``{metric: [one value per step]}`` plus ``<role>/nan_skipped``; counts the call."""
    minis = iter_mini_batches(data, plan.mini_batch_size or len(data), plan.epochs, plan.shuffle,
                              mix_seed(plan.seed, engine.update_calls), plan.fix_hint)
    skips_before = engine.nonfinite_skips
    metrics: dict[str, list[float]] = {}
    for mini in minis:
        for k, v in step(mini).items():
            metrics.setdefault(k, []).append(v)
    engine.update_calls += 1
    metrics[f"{engine.role}/nan_skipped"] = [float(engine.nonfinite_skips - skips_before)]
    return metrics


def global_batch_info(mask: torch.Tensor, dp_size: int, dp_group: Any = None) -> GlobalBatchInfo:
    """Counted tokens and sequences of the whole mini-batch over all dp ranks (``agg_loss``'s contract).

    Every micro-batch normalises by these mini-batch-wide counts, so the summed gradient does not
    depend on the micro-batch size or on how many ranks share the mini-batch.
    """
    counts = batch_counts(mask)
    if dp_size > 1:
        counts = counts.to(collective_device(dp_group))
        dist.all_reduce(counts, group=dp_group)
    tokens, sequences = counts.tolist()  # one host read
    return GlobalBatchInfo(dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=sequences)


def batch_counts(mask: torch.Tensor) -> torch.Tensor:
    """(tokens, sequences with a token) of ``mask`` (B, T) as float64, on ``mask``'s device (no host sync)."""
    return torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).to(torch.float64)


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor must be to go through a collective on ``group``: see ``device_for_backend``."""
    return device_for_backend(str(dist.get_backend(group)))


def device_for_backend(backend: str) -> torch.device:
    """The host for a group that has a CPU back end (gloo; the worker groups' ``cpu:gloo,cuda:nccl``),
    else the current accelerator: megatron-core may make its data-parallel groups NCCL-only, and NCCL
    takes no host tensors (issue 33: the loop all-reduced host float64 counts over such a group)."""
    parts = {p.split(":")[0]: p.split(":")[-1] for p in backend.lower().split(",")}
    if "gloo" in parts.values() or "cpu" in parts:
        return torch.device("cpu")
    if "nccl" in parts.values():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MiniBatchStats:
    """Accumulates one mini-batch's ``LossOutput`` metrics (see its docstring for the three kinds).

    Values stay tensors where the losses made them (0-d, on the compute device) and are summed there;
    ``gather`` all-reduces them in one vector and ``read`` turns the host copy of that vector into
    numbers, so a mini-batch's metrics cost one device-to-host read, not one per value and micro-batch
    (issue 34). ``reduce`` is both.
    """

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.weighted: dict[str, Any] = {}
        self.maxed: dict[str, Any] = {}
        self.tokens: Any = 0.0

    def add(self, out: LossOutput, tokens: Any) -> None:
        """``tokens``: the micro-batch's counted tokens (a number or a 0-d tensor)."""
        for k, v in out.summed.items():
            self.sums[k] = self.sums.get(k, 0.0) + _detached(v)
        for k, v in out.weighted.items():
            self.weighted[k] = self.weighted.get(k, 0.0) + _detached(v) * tokens
        for k, v in out.maxed.items():
            self.maxed[k] = _detached(v) if k not in self.maxed else _maximum(self.maxed[k], _detached(v))
        self.tokens = self.tokens + tokens

    def _keys(self) -> tuple[list[str], list[str], list[str]]:
        return sorted(self.sums), sorted(self.weighted), sorted(self.maxed)  # same loss on every rank: same keys

    def gather(self, dp_size: int, group: Any) -> torch.Tensor:
        """[sums..., weighted sums..., tokens, maxima...] as one float64 vector, summed (maxima: maxed)
        over the ranks; on the metrics' device, nothing read."""
        summed, weighted, maxed = self._keys()
        parts = [*(self.sums[k] for k in summed), *(self.weighted[k] for k in weighted), self.tokens,
                 *(self.maxed[k] for k in maxed)]
        device = next((p.device for p in parts if isinstance(p, torch.Tensor)), torch.device("cpu"))
        values = torch.stack([torch.as_tensor(p, dtype=torch.float64, device=device).reshape(()) for p in parts])
        if dp_size > 1:
            values = values.to(collective_device(group))
            split = len(parts) - len(maxed)
            dist.all_reduce(values[:split], group=group)
            if maxed:
                dist.all_reduce(values[split:], op=dist.ReduceOp.MAX, group=group)
        return values

    def read(self, values: list[float], dp_size: int) -> dict[str, float]:
        """The metrics from the host copy of ``gather``'s vector."""
        summed, weighted, maxed = self._keys()
        # each rank's losses carry a factor dp_size (agg_loss contract); the rank sum undoes it
        out = {k: values[i] / dp_size for i, k in enumerate(summed)}
        offset = len(summed)
        total = max(values[offset + len(weighted)], 1.0)
        out.update({k: values[offset + i] / total for i, k in enumerate(weighted)})
        offset += len(weighted) + 1
        out.update({k: values[offset + i] for i, k in enumerate(maxed)})
        return out

    def reduce(self, dp_size: int, group: Any) -> dict[str, float]:
        return self.read(self.gather(dp_size, group).tolist(), dp_size)  # one read


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else float(value)


def _maximum(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        device = a.device if isinstance(a, torch.Tensor) else b.device
        return torch.maximum(torch.as_tensor(a, device=device), torch.as_tensor(b, device=device))
    return max(a, b)


def zero_loss_row(mini: DataProto, mask_key: str) -> DataProto:
    """One row of ``mini`` with its mask zeroed: a forward/backward that adds no gradient.

    Token budgets may leave a rank one micro-batch short; FSDP (and any collective back end) still
    needs that rank to run the pass.
    """
    row = mini[:1].select(deepcopy=True)  # a copy: the mini-batch itself must keep its mask
    row.batch[mask_key] = torch.zeros_like(row.batch[mask_key])
    return row
