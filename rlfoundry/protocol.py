"""The batch container that crosses every boundary: driver <-> workers <-> algorithms.

Same names and semantics as verl's ``verl.protocol.DataProto`` so that users' reward managers and
recipes port over. Differences from verl are deliberate and listed in ``DataProto``'s docstring.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "DataProto",
    "DataProtoItem",
    "collate_fn",
    "pad_dataproto_to_divisor",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]

_FORMAT = "rlfoundry.DataProto"
_FORMAT_VERSION = 1
_TENSOR_FILE = "batch.safetensors"  # the directory format of earlier versions (still loaded)
_JSON_FILE = "data.json"
# Marks a JSON object that encodes a non-JSON value (tuple, numpy array or scalar).
_TAG = "__rlfoundry_type__"


# --------------------------------------------------------------------------------------------
# Equality and conversion helpers
# --------------------------------------------------------------------------------------------


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, except that NaN equals NaN: a batch unioned with itself must not conflict."""
    if a is b or torch.equal(a, b):
        return True
    if a.shape != b.shape or not (a.is_floating_point() and b.is_floating_point()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality for non-tensor values (numpy arrays elementwise, dicts, lists, NaN == NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if a.dtype != object and b.dtype != object:
            nan_ok = a.dtype.kind in "fc" and b.dtype.kind in "fc"
            return bool(np.array_equal(a, b, equal_nan=nan_ok))
        return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensors_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_values_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _to_object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array with one element per row.

    np.array(list_of_lists, dtype=object) would build a 2-D array; filling an empty array keeps
    each row's value (a list, a dict) intact as one element.
    """
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _as_column(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        return _to_object_array(value)
    raise TypeError(
        f"non_tensor_batch[{key!r}] must be a numpy array (or a list), got {type(value).__name__}"
    )


def _tensors_to_batch(tensors: dict) -> TensorDict:
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise TypeError(
                f"tensors[{key!r}] must be a torch.Tensor with a batch dimension, got {type(value).__name__}"
            )
    first_key = next(iter(tensors))
    rows = tensors[first_key].shape[0]
    for key, value in tensors.items():
        if value.shape[0] != rows:
            raise ValueError(
                f"batch[{key!r}] has {value.shape[0]} rows but batch[{first_key!r}] has {rows} rows"
            )
    return TensorDict(dict(tensors), batch_size=[rows])


def _index_array(idxs: Any, length: int) -> np.ndarray:
    """Normalise list / numpy / torch indices or boolean masks to a 1-D int64 numpy array.

    Checked on the host: a list or array index never touches a tensor, and a tensor index is read
    to the host once (a device tensor's one device-to-host copy)."""
    if isinstance(idxs, torch.Tensor):
        arr = (idxs.detach() if idxs.requires_grad else idxs).cpu().numpy()
    else:
        arr = np.ascontiguousarray(idxs)
        if arr.size == 0 or arr.dtype == object:  # [] has dtype float64; lists of ints may be object
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise IndexError(f"indices must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype == np.bool_:
        if arr.size != length:
            raise IndexError(f"boolean mask has {arr.size} entries but DataProto has {length} rows")
        return np.flatnonzero(arr)
    if arr.dtype.kind not in "iu":
        raise IndexError(f"indices must be integers or booleans, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < -length) | (arr >= length)
    if bad.any():
        raise IndexError(f"index {int(arr[bad][0])} is out of range for DataProto with {length} rows")
    return arr % max(length, 1)


# --------------------------------------------------------------------------------------------
# Union helpers (verl exposes these; users call them)
# --------------------------------------------------------------------------------------------


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add tensor_dict2's keys to tensor_dict1 (in place); a shared key must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"cannot union TensorDicts with batch sizes {tuple(tensor_dict1.batch_size)} "
            f"and {tuple(tensor_dict2.batch_size)}"
        )
    for key, value in tensor_dict2.items():
        if key in tensor_dict1.keys() and not _tensors_equal(tensor_dict1[key], value):
            raise ValueError(
                f"batch[{key!r}] differs between the two DataProtos; union refuses to overwrite it "
                "(pop or rename one of them first)"
            )
        tensor_dict1[key] = value
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict, tensor_dict2: dict) -> dict:
    """Add tensor_dict2's arrays to tensor_dict1 (in place); a shared key must hold equal arrays."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1 and not _values_equal(tensor_dict1[key], value):
            raise ValueError(
                f"non_tensor_batch[{key!r}] differs between the two DataProtos; union refuses to "
                "overwrite it (pop or rename one of them first)"
            )
        tensor_dict1[key] = value
    return tensor_dict1


def _union_meta_info(meta1: dict, meta2: dict, what: str = "union") -> dict:
    for key, value in meta2.items():
        if key in meta1 and not _values_equal(meta1[key], value):
            raise ValueError(f"meta_info[{key!r}] conflicts in {what}: {meta1[key]!r} vs {value!r}")
        meta1[key] = value
    return meta1


def _concat_meta_info(metas: list[dict]) -> dict:
    """Merge meta_info of concatenated parts, as verl does.

    Ordinary keys must agree across parts. "metrics" is gathered from every part (each worker rank
    reports its own) into one dict of lists, so the driver can reduce them; list values are
    flattened so that two ranks' [a, b] and [c] give [a, b, c].
    """
    merged: dict = {}
    gathered: dict[str, list] = {}
    for meta in metas:
        for key, value in meta.items():
            if key != "metrics":
                _union_meta_info(merged, {key: value}, what="concat")
                continue
            parts = value if isinstance(value, list) else [value]
            for part in (p for p in parts if p is not None):
                for name, val in part.items():
                    gathered.setdefault(name, []).extend(val if isinstance(val, list) else [val])
    if gathered:
        merged["metrics"] = gathered
    return merged


# --------------------------------------------------------------------------------------------
# Safe on-disk format: tensors in safetensors, everything else in JSON (never pickle, so loading
# a file cannot execute code).
# --------------------------------------------------------------------------------------------

_JSON_SCALARS = (str, int, float, bool, type(None))


def _encode(value: Any, where: str) -> Any:
    """Encode a non-tensor value as JSON; tuples and numpy values get a tagged object."""
    if type(value) in _JSON_SCALARS:
        return value
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return _encode_dict(value, where)
    if isinstance(value, np.ndarray):
        return _encode_array(value, where)
    if isinstance(value, np.generic) and value.dtype.kind in "biufU":
        return {_TAG: "scalar", "dtype": value.dtype.str, "value": value.item()}
    raise TypeError(
        f"{where} holds a {type(value).__module__}.{type(value).__name__}, which cannot be saved "
        "safely; save_to_disk stores str, int, float, bool, None, list, tuple, dict with str keys "
        "and numpy arrays/scalars of those (convert it, or pop the key before saving)"
    )


def _encode_dict(value: dict, where: str) -> dict:
    for key in value:
        if type(key) is not str or key == _TAG:
            raise TypeError(f"{where} has dict key {key!r}; save_to_disk needs str keys (not {_TAG!r})")
    return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}


def _encode_array(arr: np.ndarray, where: str) -> dict:
    if arr.dtype == object:
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(arr.ravel())]
    elif arr.dtype.kind in "biufU":
        items = arr.ravel().tolist()
    else:
        raise TypeError(f"{where} is a numpy array of dtype {arr.dtype}, which cannot be saved safely")
    return {_TAG: "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape), "items": items}


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get(_TAG)
    if kind is None:
        return {k: _decode(v) for k, v in obj.items()}
    if kind == "tuple":
        return tuple(_decode(v) for v in obj["items"])
    if kind == "scalar":
        return np.dtype(obj["dtype"]).type(obj["value"])
    if kind == "ndarray":
        return _decode_array(obj)
    raise ValueError(f"unknown encoded type {kind!r} in a saved DataProto")


def _decode_array(obj: dict) -> np.ndarray:
    dtype, shape = np.dtype(obj["dtype"]), tuple(obj["shape"])
    if dtype != object:
        return np.array(obj["items"], dtype=dtype).reshape(shape)
    out = np.empty(shape, dtype=object)
    flat = out.reshape(-1)  # a view: filling it fills `out`
    for i, item in enumerate(obj["items"]):
        flat[i] = _decode(item)
    return out


def _write_atomically(path: str, write) -> None:
    """``write(tmp)`` beside ``path``, then rename: readers see the old file or the new, never half.

    The temporary name is unique, so two writers to one path do not share it, and it is removed
    when ``write`` fails.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# --------------------------------------------------------------------------------------------
# DataProto
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto: ``batch`` is a TensorDict with batch_size [] (views, not copies)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """A batch of B sequences: tensors, per-row Python values and batch-wide metadata.

    - ``batch``: a ``tensordict.TensorDict`` whose first (only) batch dimension is B, or None.
    - ``non_tensor_batch``: ``{key: np.ndarray}`` with B rows each (object arrays for str/dict).
    - ``meta_info``: a plain dict (temperature, micro-batch sizes, "metrics", ...).

    Standard keys (verl names; B = sequences, Tp = prompt length, Tr = response length):

    ================================================  ==========  ====================================
    key                                               shape       written by
    ================================================  ==========  ====================================
    ``input_ids``, ``attention_mask``,                (B, Tp+Tr)  dataset (prompt part), rollout
    ``position_ids``
    ``prompts`` / ``responses``                       (B, Tp) /   rollout
                                                      (B, Tr)
    ``response_mask``                                 (B, Tr)     rollout (1 up to and including EOS)
    ``rollout_log_probs``                             (B, Tr)     rollout engine (optional)
    ``routed_experts``                                (B, Tp+Tr,  HF rollout with
                                                      layers,     ``enable_rollout_routing_replay``
                                                      top_k)      (R3), or actor (R2); -1: no record
                                                                  (docs/moe.md#routing-replay)
    ``mtp_draft_tokens`` / ``mtp_accepted_tokens``    (B,)        HF rollout with ``mtp.enable_rollout``:
                                                                  tokens the MTP draft proposed / the
                                                                  target accepted (docs/rollout.md)
    ``old_log_probs`` / ``ref_log_prob``              (B, Tr)     actor / ref
    ``teacher_logprobs``                              (B, Tr)     teachers (on-policy distillation,
                                                                  docs/distillation.md; temperature 1)
    ``teacher_logprobs`` / ``teacher_ids``            (B, Tr, k)  teachers, for a top-k loss
                                                                  (forward_kl_topk): the teacher's
                                                                  top-k at each response position
    ``entropys``                                      (B, Tr)     actor
    ``sum_pi_squared``                                (B, Tr)     actor, with
                                                                  ``actor.calculate_sum_pi_squared``
                                                                  (sum_v pi(v|s_t)^2; the optimal
                                                                  token baselines read it)
    ``values``                                        (B, Tr)     critic
    ``token_level_scores`` / ``token_level_rewards``  (B, Tr)     reward / KL penalty
    ``reward_baselines``                              (B,)        ReMax (greedy-rollout reward); SPO (tracker mean)
    ``advantages``, ``returns``                       (B, Tr)     advantage estimator
    non-tensor ``data_source``, ``reward_model``      (B,)        dataset
    (``{"ground_truth": ...}``), ``extra_info``,
    ``raw_prompt``
    non-tensor ``uid``                                (B,)        trainer (one id per prompt; its
                                                                  repeats share it)
    ``uid_tensor``                                    (B,)        trainer with loss_mode=gvpo: the
                                                                  group's number (rows ordered by
                                                                  group, ``order_groups``)
    ================================================  ==========  ====================================

    Differences from verl, on purpose: ``save_to_disk`` writes one safetensors file (non-tensor
    columns and ``meta_info`` as JSON in its header) instead of a pickle; ``make_iterator``
    shuffles unless ``dataloader_kwargs={"shuffle": False}`` and keeps non-tensor columns;
    ``select(deepcopy=True)`` also clones tensors; derived DataProtos get a shallow copy of
    ``meta_info`` rather than the same dict object.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check_consistency()

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_single_dict(cls, data: dict, meta_info: dict | None = None) -> DataProto:
        """Split one dict into tensors (torch.Tensor) and non-tensor columns (numpy arrays, lists)."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"data[{key!r}] is a {type(value).__name__}; expected a torch.Tensor or a "
                    "numpy array / list with one entry per row"
                )
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    @classmethod
    def from_dict(
        cls, tensors: dict | None = None, non_tensors: dict | None = None, meta_info: dict | None = None
    ) -> DataProto:
        """Build from ``{key: tensor}`` (all the same first dim) and ``{key: array or list}``."""
        batch = _tensors_to_batch(tensors) if tensors else None
        columns = {key: _as_column(key, value) for key, value in (non_tensors or {}).items()}
        return cls(batch=batch, non_tensor_batch=columns, meta_info=dict(meta_info or {}))

    def check_consistency(self) -> None:
        """Raise if the batch has more than one batch dim or a column's length differs from B."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                got = type(self.batch).__name__
                raise TypeError(f"DataProto.batch must be a TensorDict or None, got {got}")
            if self.batch.batch_dims != 1:
                raise ValueError(
                    f"DataProto.batch must have exactly one batch dimension, got batch_size "
                    f"{tuple(self.batch.batch_size)}"
                )
        if not isinstance(self.non_tensor_batch, dict) or not isinstance(self.meta_info, dict):
            raise TypeError("DataProto.non_tensor_batch and DataProto.meta_info must be dicts")
        ref_name, ref_rows = self._reference_rows()
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray) or value.ndim == 0:
                raise TypeError(
                    f"non_tensor_batch[{key!r}] must be a numpy array with one entry per row, got "
                    f"{type(value).__name__}"
                )
            if len(value) != ref_rows:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has {len(value)} rows but {ref_name} has {ref_rows} rows"
                )

    def _reference_rows(self) -> tuple[str, int]:
        if self.batch is not None:
            return "batch", int(self.batch.batch_size[0])
        for key, value in self.non_tensor_batch.items():
            if isinstance(value, np.ndarray) and value.ndim > 0:
                return f"non_tensor_batch[{key!r}]", len(value)
        return "DataProto", 0

    def __len__(self) -> int:
        return self._reference_rows()[1]

    # ---- indexing --------------------------------------------------------------------------

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """int -> DataProtoItem (a view of one row); slice, list, array, tensor -> DataProto."""
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            return self._item(int(item))
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(
            f"DataProto indices must be int, slice, list, numpy array or tensor, not {type(item).__name__}"
        )

    def _item(self, i: int) -> DataProtoItem:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for DataProto with {n} rows")
        batch = self.batch[i] if self.batch is not None else None
        non_tensors = {key: value[i] for key, value in self.non_tensor_batch.items()}
        return DataProtoItem(batch=batch, non_tensor_batch=non_tensors, meta_info=self.meta_info)

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows at integer indices (list, numpy, tensor; negatives allowed) or a boolean mask."""
        np_idx = _index_array(idxs, len(self))
        idx = torch.from_numpy(np_idx)
        if self.batch is not None and self.batch.device is not None and self.batch.device.type == "cuda":
            idx = idx.pin_memory().to(self.batch.device, non_blocking=True)  # no wait for the GPU's queue
        batch = self.batch[idx.to(self.batch.device)] if self.batch is not None else None
        non_tensors = {key: value[np_idx] for key, value in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step``; tensors and arrays are views of this DataProto's."""
        rows = slice(start, end, step)
        batch = self.batch[rows] if self.batch is not None else None
        non_tensors = {key: value[rows] for key, value in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    # ---- selecting and renaming keys -------------------------------------------------------

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the given keys (None keeps all of that kind).

        deepcopy=True also clones tensors, so the result shares no memory with self.
        """
        batch = self.batch
        if batch is not None and batch_keys is not None:
            self._require_keys("batch", batch_keys, batch.keys())
            batch = batch.select(*batch_keys)
        non_tensors = self._pick("non_tensor_batch", self.non_tensor_batch, non_tensor_batch_keys)
        meta_info = self._pick("meta_info", self.meta_info, meta_info_keys)
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensors, meta_info = copy.deepcopy(non_tensors), copy.deepcopy(meta_info)
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @staticmethod
    def _require_keys(where: str, keys: Sequence[str], available) -> None:
        available = list(available)
        for key in keys:
            if key not in available:
                raise KeyError(f"{where}[{key!r}] not found; available keys: {sorted(available)}")

    @classmethod
    def _pick(cls, where: str, source: dict, keys: Sequence[str] | None) -> dict:
        if keys is None:
            return dict(source)
        cls._require_keys(where, keys, source.keys())
        return {key: source[key] for key in keys}

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto.

        All keys are checked first, so a missing key leaves self unchanged.
        """
        batch_keys, nt_keys, meta_keys = batch_keys or [], non_tensor_batch_keys or [], meta_info_keys or []
        self._require_keys("batch", batch_keys, self.batch.keys() if self.batch is not None else [])
        self._require_keys("non_tensor_batch", nt_keys, self.non_tensor_batch.keys())
        self._require_keys("meta_info", meta_keys, self.meta_info.keys())
        return type(self).from_dict(
            tensors={key: self.batch.pop(key) for key in batch_keys},
            non_tensors={key: self.non_tensor_batch.pop(key) for key in nt_keys},
            meta_info={key: self.meta_info.pop(key) for key in meta_keys},
        )

    def rename(
        self, old_keys: str | Sequence[str] | None = None, new_keys: str | Sequence[str] | None = None
    ) -> DataProto:
        """Rename batch (tensor) keys in place; returns self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise ValueError(f"rename got {len(old)} old keys but {len(new)} new keys")
        self._require_keys("batch", old, self.batch.keys() if self.batch is not None else [])
        for old_key, new_key in zip(old, new):
            self.batch.rename_key_(old_key, new_key)
        return self

    # ---- combining -------------------------------------------------------------------------

    def union(self, other: DataProto) -> DataProto:
        """Add other's keys to self (in place); the same key with a different value is an error."""
        if self._has_rows() and other._has_rows() and len(self) != len(other):
            raise ValueError(
                f"cannot union a DataProto with {len(other)} rows into one with {len(self)} rows"
            )
        if other.batch is not None and self.batch is None:
            # A shallow copy, so keys added to self later do not appear in other.
            self.batch = other.batch.clone(recurse=False)
        elif other.batch is not None:
            union_tensor_dict(self.batch, other.batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        _union_meta_info(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    def _has_rows(self) -> bool:
        return self.batch is not None or bool(self.non_tensor_batch)

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts (views); B must be divisible by ``chunks``."""
        n = len(self)
        if chunks <= 0 or n % chunks != 0:
            raise ValueError(
                f"cannot chunk a DataProto of {n} rows into {chunks} equal chunks; pad it first "
                f"with pad_dataproto_to_divisor(data, {chunks}) and unpad the outputs"
            )
        size = n // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows; the last part may be smaller."""
        if split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Stack DataProtos row-wise; all must have the same keys (meta_info merged, see below).

        meta_info keys must agree across parts, except "metrics", which is gathered from all parts
        into one dict of lists (verl's behaviour: each worker rank reports its own metrics).
        """
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        _check_same_keys(data)
        batches = [d.batch for d in data]
        batch = torch.cat(batches, dim=0) if batches[0] is not None else None
        non_tensors = {
            key: np.concatenate([d.non_tensor_batch[key] for d in data], axis=0)
            for key in data[0].non_tensor_batch
        }
        meta_info = _concat_meta_info([d.meta_info for d in data])
        return type(data[0])(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row: rows [a, b] x 2 -> [a, a, b, b] (interleave) or [a, b, a, b]."""
        rows = torch.arange(len(self))
        idx = rows.repeat_interleave(repeat_times) if interleave else rows.repeat(repeat_times)
        return self.select_idxs(idx)

    def reorder(self, indices: Any) -> None:
        """Permute rows in place (e.g. to balance sequence lengths across ranks)."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to ``device`` (in place, as in verl); returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    # ---- iteration -------------------------------------------------------------------------

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict | None = None,
    ) -> Iterator[DataProto]:
        """Yield mini-batches of ``mini_batch_size`` rows, every row once per epoch.

        Each epoch draws a fresh permutation from one ``torch.Generator`` seeded with ``seed``, so
        the whole sequence is reproducible. With seed=None the generator is seeded from torch's
        global RNG (so ``torch.manual_seed`` still makes runs repeatable). ``dataloader_kwargs``
        accepts only {"shuffle": bool} (verl's actor passes that); B must divide evenly, because a
        short last mini-batch would change the loss normalisation of that update.
        """
        kwargs = dict(dataloader_kwargs or {})
        shuffle = bool(kwargs.pop("shuffle", True))
        if kwargs:
            raise TypeError(
                f"make_iterator: unsupported dataloader_kwargs {sorted(kwargs)}; only 'shuffle' is accepted"
            )
        n = len(self)
        if mini_batch_size <= 0 or n % mini_batch_size != 0:
            raise ValueError(f"mini_batch_size {mini_batch_size} does not divide the batch of {n} rows")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator().manual_seed(seed)
        return self._iterate(mini_batch_size, epochs, shuffle, generator)

    def _iterate(self, mini_batch_size: int, epochs: int, shuffle: bool, generator: torch.Generator):
        n = len(self)
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
            for start in range(0, n, mini_batch_size):
                yield self.select_idxs(order[start : start + mini_batch_size])

    # ---- persistence -----------------------------------------------------------------------

    def save_to_disk(self, path: str | os.PathLike) -> None:
        """Save to one file at ``path`` (verl writes ``batch.pt``; the name is the caller's).

        The file is safetensors: the tensors, with everything else (non-tensor columns, meta_info)
        as JSON in its metadata header. No pickle, so loading cannot run code. Non-tensor values may
        be str, int, float, bool, None, list, tuple, dict with str keys, and numpy arrays/scalars of
        those; anything else is a TypeError naming the key, raised before anything is written.
        """
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        text = json.dumps(self._json_payload())
        tensors = self._flat_tensors()
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            _write_atomically(path, lambda p: save_file(tensors, p, metadata={_FORMAT: text}))
        except SafetensorError as e:  # e.g. "header too large": safetensors caps its header (100 MB)
            raise ValueError(
                f"save_to_disk({path!r}) failed: {e}; the non-tensor columns and meta_info take "
                f"{len(text.encode()) / 1e6:.1f} MB of JSON in the safetensors header"
            ) from e

    def _flat_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for key, value in (self.batch.items() if self.batch is not None else []):
            if not isinstance(value, torch.Tensor) or isinstance(value, TensorDict):
                raise TypeError(f"batch[{key!r}] is a {type(value).__name__}; save_to_disk stores flat tensors only")
            # clone: safetensors refuses tensors that share storage (views from slice/chunk).
            tensors[key] = value.detach().to("cpu").contiguous().clone()
        return tensors

    def _json_payload(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "batch_size": None if self.batch is None else len(self),
            "non_tensor_batch": {
                key: _encode_array(value, f"non_tensor_batch[{key!r}]")
                for key, value in self.non_tensor_batch.items()
            },
            "meta_info": {
                key: _encode(value, f"meta_info[{key!r}]") for key, value in self.meta_info.items()
            },
        }

    @staticmethod
    def load_from_disk(path: str | os.PathLike) -> DataProto:
        """Load what ``save_to_disk`` wrote (tensors come back on the CPU).

        A directory holding ``batch.safetensors`` + ``data.json`` (the format before one-file saves)
        loads too.
        """
        from safetensors import SafetensorError, safe_open

        if os.path.isdir(path):
            return _load_directory(path)
        try:
            with safe_open(os.fspath(path), framework="pt") as f:
                text = (f.metadata() or {}).get(_FORMAT)
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{path} does not hold a DataProto written by save_to_disk ({e})") from None
        if text is None:
            raise ValueError(f"{path} does not hold a DataProto written by save_to_disk (no {_FORMAT} header)")
        return _from_payload(_checked(json.loads(text), path), tensors)

    def print_size(self, prefix: str = "") -> None:
        """Print the memory held by tensors and by non-tensor arrays, in GB."""
        tensors = self.batch.values() if self.batch is not None else []
        tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
        array_bytes = sum(a.nbytes for a in self.non_tensor_batch.values())
        print(f"{prefix}size of batch: {tensor_bytes / 1024**3:.6f} GB, "
              f"size of non_tensor_batch: {array_bytes / 1024**3:.6f} GB")


def _load_directory(path: str | os.PathLike) -> DataProto:
    """The directory format: ``batch.safetensors`` (tensors) and ``data.json`` (the rest)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, _JSON_FILE), encoding="utf-8") as f:
        payload = _checked(json.load(f), path)
    return _from_payload(payload, load_file(os.path.join(path, _TENSOR_FILE)))


def _checked(payload: Any, path: Any) -> dict:
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"{path} does not hold a DataProto written by save_to_disk")
    return payload


def _from_payload(payload: dict, tensors: dict[str, torch.Tensor]) -> DataProto:
    batch = None
    if payload["batch_size"] is not None:
        batch = TensorDict(tensors, batch_size=[payload["batch_size"]])
    non_tensors = {key: _decode_array(value) for key, value in payload["non_tensor_batch"].items()}
    meta_info = {key: _decode(value) for key, value in payload["meta_info"].items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)


def _check_same_keys(data: list[DataProto]) -> None:
    """concat needs every part to carry the same tensor and non-tensor keys."""

    def keys_of(d: DataProto) -> tuple[list | None, list]:
        return (None if d.batch is None else sorted(d.batch.keys()), sorted(d.non_tensor_batch))

    first = keys_of(data[0])
    for i, d in enumerate(data[1:], start=1):
        if keys_of(d) != first:
            raise ValueError(
                f"cannot concat: part {i} has keys (batch, non_tensor_batch) {keys_of(d)} "
                f"but part 0 has {first}"
            )


def collate_fn(x: list[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems back into a DataProto (for a torch DataLoader over items)."""
    batch = torch.stack([item.batch for item in x]) if x and x[0].batch is not None else None
    keys = x[0].non_tensor_batch.keys() if x else []
    non_tensors = {key: _to_object_array([item.non_tensor_batch[key] for item in x]) for key in keys}
    meta_info = dict(x[0].meta_info) if x else {}
    return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)


# --------------------------------------------------------------------------------------------
# Padding for splitting across ranks
# --------------------------------------------------------------------------------------------


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` to a multiple of ``size_divisor`` rows by repeating rows from the start.

    E.g. 5 rows, divisor 4 -> rows [0..4, 0, 1, 2] and pad_size 3; if more padding than rows is
    needed the start is repeated again (1 row, divisor 3 -> [0, 0, 0]). Returns (padded, pad_size);
    undo with unpad_dataproto(output, pad_size).
    """
    if size_divisor <= 0:
        raise ValueError(f"size_divisor must be positive, got {size_divisor}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    if n == 0:
        raise ValueError(f"cannot pad an empty DataProto to a multiple of {size_divisor}")
    idx = torch.cat([torch.arange(n), torch.arange(pad_size) % n])
    return data.select_idxs(idx), pad_size


PAD_KEY = "dispatch_pad_size"  # meta_info of a padded dispatch's chunks: padding rows at the end of the whole batch


def data_parallel_share(parts: list[DataProto], pad_size: int, dp_rank: int, dp_size: int) -> DataProto:
    """Data-parallel rank ``dp_rank``'s contiguous 1/``dp_size`` of a batch that was padded by ``pad_size``
    rows and split over ranks: ``parts`` are every rank's chunk in rank order. The padding goes first, so
    no row is trained twice; e.g. 3 rows padded to 4 over 4 ranks, 1 data-parallel rank: rows [0, 1, 2]."""
    rows = unpad_dataproto(DataProto.concat(parts), pad_size)
    if len(rows) % dp_size:
        raise ValueError(f"{len(rows)} rows cannot be split evenly over {dp_size} data-parallel ranks")
    share = len(rows) // dp_size
    return rows[dp_rank * share: (dp_rank + 1) * share]


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows added by pad_dataproto_to_divisor."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size {pad_size} is invalid for a DataProto with {len(data)} rows")
    return data[: len(data) - pad_size] if pad_size else data
