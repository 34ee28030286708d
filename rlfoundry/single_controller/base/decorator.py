"""How a worker method's call is split across ranks and how the per-rank results come back.

A worker class marks each method the driver may call with ``@register(dispatch_mode=...)``.
The worker group (local or Ray) then runs every call as

    calls   = dispatch_fn(group, *args, **kwargs)   # one (args, kwargs) per rank
    outputs = <run the method on each rank>          # one result per rank
    result  = collect_fn(group, outputs, calls.pad_size)

``DISPATCH_TABLE`` below is the whole mapping; grep for ``@register`` to find every remote method.

Modes (W = world size):

| mode | driver passes | rank r receives | driver gets back |
|---|---|---|---|
| ONE_TO_ALL | anything | the same args | list of W results |
| ALL_TO_ALL / DP_COMPUTE | every arg a list of W items | item r of each arg | list of W results |
| RANK_ZERO | anything | the same args | rank 0's result |
| DP_COMPUTE_PROTO | DataProto args (+ others) | chunk r of each DataProto, others as is | one DataProto, rows in input order |
| DP_COMPUTE_PROTO_WITH_FUNC | fn, then as DP_COMPUTE_PROTO | fn, chunk r, ... | as DP_COMPUTE_PROTO |
| DP_COMPUTE_METRIC | as DP_COMPUTE_PROTO | as DP_COMPUTE_PROTO | list of W results |

DataProto splitting pads the batch to a multiple of W by repeating its first rows
(``pad_dataproto_to_divisor``) and the concatenated output drops what the padding rows produced, so
callers never see the padding: a rank that returns k rows per row it got (a rollout's n samples per
prompt) has k rows dropped per padding row it held. Each padded chunk's ``meta_info[protocol.PAD_KEY]`` says how
many rows the whole call was padded by, for a method that must not compute on them (an update:
``TrainingEngine.update_rows``). Merging of ``meta_info`` is described in
``merge_meta_info``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

REGISTER_ATTR = "__rlfoundry_register__"


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    DP_COMPUTE_METRIC = "dp_compute_metric"


class Execute(Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` records on a worker method."""

    dispatch_mode: Dispatch
    execute_mode: Execute
    blocking: bool


def register(
    dispatch_mode: Dispatch = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
):
    """Mark a worker method as callable from the driver through a worker group.

    ``blocking=False`` makes the group method return a ``WorkerFuture`` (``.get()`` collects).
    The function itself is returned unchanged: calling it on a worker instance is a plain call.
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch member, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}")
    spec = MethodSpec(dispatch_mode, execute_mode, blocking)

    def tag(fn):
        setattr(fn, REGISTER_ATTR, spec)
        return fn

    return tag


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> spec for every ``@register``ed method of ``cls`` (inherited ones included)."""
    found = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), REGISTER_ATTR, None)
        if isinstance(spec, MethodSpec):
            found[name] = spec
    return found


@dataclass
class RankCalls:
    """The output of a dispatch function: one (args, kwargs) per rank."""

    args: list[tuple]
    kwargs: list[dict]
    pad_size: int = 0  # rows added to every split DataProto; the collect step removes them
    chunk_rows: int = 0  # rows of each rank's chunk of a padded DataProto (0: nothing was padded)


# ---------------------------------------------------------------------------------------------
# dispatch functions: (group, *args, **kwargs) -> RankCalls


def dispatch_one_to_all(group, *args, **kwargs) -> RankCalls:
    n = group.world_size
    return RankCalls([args] * n, [kwargs] * n)


def dispatch_all_to_all(group, *args, **kwargs) -> RankCalls:
    # Every argument must already be split by the caller: a list/tuple with one item per rank.
    n = group.world_size
    for where, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = type(value).__name__ + (f" of length {len(value)}" if hasattr(value, "__len__") else "")
            name = f"positional argument {where}" if isinstance(where, int) else f"argument {where!r}"
            raise ValueError(f"{name} must be a list with one item per rank ({n}), got {got}")
    return RankCalls(
        [tuple(a[r] for a in args) for r in range(n)],
        [{k: v[r] for k, v in kwargs.items()} for r in range(n)],
    )


def dispatch_dp_compute_proto(group, *args, **kwargs) -> RankCalls:
    from rlfoundry.protocol import PAD_KEY, DataProto, pad_dataproto_to_divisor

    n = group.world_size
    sizes = {len(v) for v in [*args, *kwargs.values()] if isinstance(v, DataProto)}
    if len(sizes) > 1:
        raise ValueError(f"DataProto arguments of one call must have the same batch size, got {sorted(sizes)}")
    pad_size = 0

    def split(value):
        nonlocal pad_size
        if not isinstance(value, DataProto):
            return [value] * n  # non-DataProto arguments (flags, step numbers) go to every rank
        padded, pad_size = pad_dataproto_to_divisor(value, n)
        if pad_size:
            padded.meta_info = {**padded.meta_info, PAD_KEY: pad_size}
        return padded.chunk(n)

    per_arg = [split(a) for a in args]
    per_kwarg = {k: split(v) for k, v in kwargs.items()}
    padded_rows = (sizes.pop() + pad_size) if sizes else 0
    return RankCalls(
        [tuple(a[r] for a in per_arg) for r in range(n)],
        [{k: v[r] for k, v in per_kwarg.items()} for r in range(n)],
        pad_size,
        padded_rows // n if pad_size else 0,
    )


def dispatch_dp_compute_proto_with_func(group, fn, *args, **kwargs) -> RankCalls:
    if not callable(fn):
        raise TypeError(f"DP_COMPUTE_PROTO_WITH_FUNC expects a function as first argument, got {type(fn).__name__}")
    calls = dispatch_dp_compute_proto(group, *args, **kwargs)
    calls.args = [(fn, *a) for a in calls.args]
    return calls


# ---------------------------------------------------------------------------------------------
# collect functions: (group, outputs, pad_size, chunk_rows) -> result


def collect_all(group, outputs: list, pad_size: int = 0, chunk_rows: int = 0) -> list:
    return list(outputs)


def collect_rank_zero(group, outputs: list, pad_size: int = 0, chunk_rows: int = 0):
    return outputs[0]


def padding_rows_of_rank(rank: int, world: int, pad_size: int, chunk_rows: int) -> int:
    """How many of rank ``rank``'s ``chunk_rows`` rows are padding: the padding is the last
    ``pad_size`` rows of the ``world × chunk_rows`` dispatched, so it fills the last ranks' chunks."""
    real = world * chunk_rows - pad_size
    return min(chunk_rows, max(0, (rank + 1) * chunk_rows - real))


def _drop_padding(outputs: list, pad_size: int, chunk_rows: int) -> list:
    """Each rank's output less what its padding rows produced (rows out per row in may be n > 1)."""
    if not pad_size:
        return outputs
    kept = []
    for rank, out in enumerate(outputs):
        pads = padding_rows_of_rank(rank, len(outputs), pad_size, chunk_rows)
        if pads and len(out):
            if len(out) % chunk_rows:
                raise ValueError(f"rank {rank} returned {len(out)} rows for {chunk_rows} padded rows; the padding's "
                                 "rows can only be dropped from an output with the same rows per input row")
            out = out[: len(out) - pads * (len(out) // chunk_rows)]
        kept.append(out)
    return kept


def collect_dp_compute_proto(group, outputs: list, pad_size: int = 0, chunk_rows: int = 0):
    from rlfoundry.protocol import PAD_KEY, DataProto, unpad_dataproto

    for rank, out in enumerate(outputs):
        if not isinstance(out, DataProto):
            raise TypeError(
                f"a DP_COMPUTE_PROTO method must return a DataProto; rank {rank} returned {type(out).__name__}"
            )
    if chunk_rows:
        outputs = _drop_padding(outputs, pad_size, chunk_rows)
    # Rows are concatenated without meta_info: ranks may legitimately disagree on e.g. timings.
    merged = DataProto.concat([dataclasses.replace(o, meta_info={}) for o in outputs])
    merged.meta_info = merge_meta_info([o.meta_info for o in outputs])
    merged.meta_info.pop(PAD_KEY, None)  # an output that copied its input's meta_info
    if pad_size and not chunk_rows and len(merged) > 0:  # a caller without the chunk size: one row per row
        merged = unpad_dataproto(merged, pad_size)
    return merged


def merge_meta_info(metas: list[dict]) -> dict:
    """Rank 0's meta_info, except ``metrics``, which is gathered from every rank.

    Each metric becomes one flat list in rank order: a rank's list (one value per micro-batch, as
    the update loops record them) is appended item by item, a scalar as one item. The trainer's
    mean over the list is then the mean over all ranks (and micro-batches). This is the same
    rule as ``DataProto.concat`` and verl, so ``reduce_metrics`` works unchanged.
    """
    merged = {k: v for k, v in (metas[0] if metas else {}).items() if k != "metrics"}
    gathered: dict[str, list] = {}
    for meta in metas:
        for name, value in (meta.get("metrics") or {}).items():
            gathered.setdefault(name, []).extend(value if isinstance(value, (list, tuple)) else [value])
    if gathered:
        merged["metrics"] = gathered
    return merged


DISPATCH_TABLE: dict[Dispatch, tuple[Callable[..., RankCalls], Callable[..., Any]]] = {
    Dispatch.ONE_TO_ALL: (dispatch_one_to_all, collect_all),
    Dispatch.ALL_TO_ALL: (dispatch_all_to_all, collect_all),
    Dispatch.DP_COMPUTE: (dispatch_all_to_all, collect_all),  # verl's name for the same split
    Dispatch.RANK_ZERO: (dispatch_one_to_all, collect_rank_zero),
    Dispatch.DP_COMPUTE_PROTO: (dispatch_dp_compute_proto, collect_dp_compute_proto),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: (dispatch_dp_compute_proto_with_func, collect_dp_compute_proto),
    Dispatch.DP_COMPUTE_METRIC: (dispatch_dp_compute_proto, collect_all),
}
