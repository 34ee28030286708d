"""DataProto: round-trips, indexing, union conflicts, safe save/load, padding, iteration."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tensordict import TensorDict

from rlfoundry.protocol import (
    DataProto,
    DataProtoItem,
    collate_fn,
    data_parallel_share,
    pad_dataproto_to_divisor,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


def make_batch(n: int = 4, meta_info: dict | None = None) -> DataProto:
    """Row i carries i everywhere, so every test can see which rows it got back."""
    rows = torch.arange(n)
    return DataProto.from_dict(
        tensors={
            "row": rows,
            "input_ids": rows[:, None] * 10 + torch.arange(3),
            "response_mask": torch.ones(n, 2, dtype=torch.bool),
            "old_log_probs": -rows[:, None].float().repeat(1, 2) / 10,
        },
        non_tensors={
            "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
            "reward_model": [{"ground_truth": str(i)} for i in range(n)],
            "extra_info": [{"index": i, "tags": ["a", i]} for i in range(n)],
        },
        meta_info={"temperature": 1.0} if meta_info is None else meta_info,
    )


def rows_of(data: DataProto) -> list[int]:
    return data.batch["row"].tolist()


def assert_same(a: DataProto, b: DataProto) -> None:
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert sorted(a.batch.keys()) == sorted(b.batch.keys())
        for key in a.batch.keys():
            assert a.batch[key].dtype == b.batch[key].dtype, key
            assert torch.equal(a.batch[key], b.batch[key]), key
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        other = b.non_tensor_batch[key]
        assert value.dtype == other.dtype and value.shape == other.shape, key
        assert all(map(deep_equal, value.tolist(), other.tolist())), key
    assert deep_equal(a.meta_info, b.meta_info)


def deep_equal(x, y) -> bool:
    """Equal values of the same types, recursing into containers and numpy arrays."""
    if type(x) is not type(y):
        return False
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and all(map(deep_equal, x.ravel(), y.ravel()))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(deep_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(map(deep_equal, x, y))
    return x == y


# ---- construction and consistency errors ------------------------------------------------------


def test_from_single_dict_splits_tensors_and_columns():
    data = DataProto.from_single_dict(
        {
            "input_ids": torch.zeros(3, 2),
            "uid": np.array(["a", "b", "c"], dtype=object),
            "raw": ["x", [1], {}],
        },
        meta_info={"k": 1},
    )
    assert len(data) == 3 and list(data.batch.keys()) == ["input_ids"]
    assert sorted(data.non_tensor_batch) == ["raw", "uid"]
    # a list of lists stays one element per row (not a 2-D array)
    assert data.non_tensor_batch["raw"].shape == (3,) and data.non_tensor_batch["raw"][1] == [1]
    assert data.meta_info == {"k": 1}


def test_from_single_dict_rejects_scalar_and_names_key():
    with pytest.raises(TypeError, match="'temperature'"):
        DataProto.from_single_dict({"input_ids": torch.zeros(2, 1), "temperature": 0.7})


def test_length_mismatch_messages_name_key_and_both_sizes():
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has 6 rows but batch has 8 rows"):
        DataProto.from_dict({"input_ids": torch.zeros(8, 2)}, {"uid": np.arange(6)})
    message = r"batch\['responses'\] has 6 rows but batch\['input_ids'\] has 8 rows"
    with pytest.raises(ValueError, match=message):
        DataProto.from_dict({"input_ids": torch.zeros(8, 2), "responses": torch.zeros(6, 2)})
    message = r"non_tensor_batch\['b'\] has 2 rows but non_tensor_batch\['a'\] has 3 rows"
    with pytest.raises(ValueError, match=message):
        DataProto.from_dict(non_tensors={"a": np.arange(3), "b": np.arange(2)})


def test_bad_types_name_the_key():
    with pytest.raises(TypeError, match="'input_ids'"):
        DataProto.from_dict({"input_ids": [1, 2]})
    with pytest.raises(TypeError, match="'uid'"):
        DataProto(batch=TensorDict({}, batch_size=[2]), non_tensor_batch={"uid": "ab"})
    with pytest.raises(ValueError, match="one batch dimension"):
        DataProto(batch=TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]))


def test_check_consistency_catches_later_mutation():
    data = make_batch(4)
    data.non_tensor_batch["uid"] = data.non_tensor_batch["uid"][:3]
    with pytest.raises(ValueError, match=r"'uid'\] has 3 rows but batch has 4 rows"):
        data.check_consistency()


def test_len_without_tensors_uses_columns():
    assert len(DataProto.from_dict(non_tensors={"uid": ["a", "b"]})) == 2
    assert len(DataProto()) == 0


# ---- indexing ---------------------------------------------------------------------------------


def test_getitem_int_returns_row_view():
    data = make_batch(4)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["row"].item() == 2 and item.batch["input_ids"].tolist() == [20, 21, 22]
    assert item.non_tensor_batch["uid"] == "u2" and item.meta_info == {"temperature": 1.0}
    assert data[-1].non_tensor_batch["reward_model"] == {"ground_truth": "3"}
    assert data[np.int64(1)].batch["row"].item() == 1
    with pytest.raises(IndexError, match="index 4 is out of range for DataProto with 4 rows"):
        data[4]


@pytest.mark.parametrize(
    "index, expected",
    [
        (slice(1, 3), [1, 2]),
        (slice(None, None, 2), [0, 2, 4]),
        ([4, 0, 0], [4, 0, 0]),
        ([-1], [4]),
        (np.array([3, 1]), [3, 1]),
        (torch.tensor([2, 4]), [2, 4]),
        (torch.tensor([True, False, False, True, True]), [0, 3, 4]),
        (np.array([False, True, False, False, False]), [1]),
        ([], []),
    ],
)
def test_getitem_selects_rows_in_all_columns(index, expected):
    out = make_batch(5)[index]
    assert isinstance(out, DataProto)
    assert rows_of(out) == expected
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in expected]
    assert [e["index"] for e in out.non_tensor_batch["extra_info"]] == expected
    assert out.meta_info == {"temperature": 1.0}


def test_getitem_errors():
    data = make_batch(5)
    with pytest.raises(IndexError, match="boolean mask has 3 entries but DataProto has 5 rows"):
        data[torch.tensor([True, False, True])]
    with pytest.raises(IndexError, match="index 7 is out of range for DataProto with 5 rows"):
        data[[0, 7]]
    with pytest.raises(TypeError, match="str"):
        data["uid"]


def test_select_idxs_and_slice_match_getitem():
    data = make_batch(6)
    assert rows_of(data.select_idxs([5, 1])) == [5, 1]
    assert rows_of(data.slice(1, 6, 2)) == [1, 3, 5]


# ---- select / pop / rename --------------------------------------------------------------------


def test_select_keeps_only_named_keys():
    data = make_batch(3, meta_info={"temperature": 1.0, "eos": 2})
    out = data.select(batch_keys=["row"], non_tensor_batch_keys=["uid"], meta_info_keys=["eos"])
    assert list(out.batch.keys()) == ["row"] and list(out.non_tensor_batch) == ["uid"]
    assert out.meta_info == {"eos": 2}
    # None keeps everything of that kind; self is untouched
    assert sorted(data.select(batch_keys=["row"]).non_tensor_batch) == sorted(data.non_tensor_batch)
    assert len(list(data.batch.keys())) == 4


def test_select_deepcopy_shares_nothing_and_default_shares_tensors():
    data = make_batch(3)
    shallow, deep = data.select(batch_keys=["row"]), data.select(batch_keys=["row"], deepcopy=True)
    data.batch["row"][0] = 100
    data.non_tensor_batch["extra_info"][0]["index"] = 100
    assert shallow.batch["row"][0].item() == 100
    assert deep.batch["row"][0].item() == 0 and deep.non_tensor_batch["extra_info"][0]["index"] == 0


def test_select_missing_key_names_it():
    with pytest.raises(KeyError, match="'values'"):
        make_batch(2).select(batch_keys=["values"])


def test_pop_moves_keys_out():
    data = make_batch(3)
    popped = data.pop(
        batch_keys=["old_log_probs"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"]
    )
    assert list(popped.batch.keys()) == ["old_log_probs"] and list(popped.non_tensor_batch) == ["uid"]
    assert popped.meta_info == {"temperature": 1.0} and len(popped) == 3
    assert "old_log_probs" not in data.batch.keys() and "uid" not in data.non_tensor_batch
    assert data.meta_info == {} and len(data) == 3


def test_pop_missing_key_leaves_data_unchanged():
    data = make_batch(3)
    with pytest.raises(KeyError, match="'nope'"):
        data.pop(batch_keys=["row", "nope"])
    assert "row" in data.batch.keys()


def test_rename():
    data = make_batch(2)
    assert data.rename("old_log_probs", "log_prob") is data
    assert "log_prob" in data.batch.keys() and "old_log_probs" not in data.batch.keys()
    data.rename(["row", "log_prob"], ["r", "lp"])
    assert sorted(data.batch.keys()) == ["input_ids", "lp", "r", "response_mask"]
    with pytest.raises(ValueError, match="2 old keys but 1 new keys"):
        data.rename(["r", "lp"], ["x"])
    with pytest.raises(KeyError, match="'missing'"):
        data.rename("missing", "x")


# ---- union ------------------------------------------------------------------------------------


def test_union_adds_new_keys_and_accepts_equal_values():
    data = make_batch(3)
    other = DataProto.from_dict(
        {"row": torch.arange(3), "values": torch.ones(3, 2)},
        {"uid": np.array(["u0", "u1", "u2"], dtype=object), "score": np.array([0.5, 1.0, 0.0])},
        {"temperature": 1.0, "step": 7},
    )
    assert data.union(other) is data
    assert "values" in data.batch.keys() and data.non_tensor_batch["score"].tolist() == [0.5, 1.0, 0.0]
    assert data.meta_info == {"temperature": 1.0, "step": 7}


def test_union_into_columns_only_takes_tensors_without_aliasing():
    columns = DataProto.from_dict(non_tensors={"uid": ["u0", "u1"]})
    tensors = DataProto.from_dict({"row": torch.arange(2)})
    columns.union(tensors)
    assert rows_of(columns) == [0, 1]
    columns.batch["extra"] = torch.zeros(2)
    assert "extra" not in tensors.batch.keys()


def test_union_with_itself_is_fine_even_with_nan():
    data = make_batch(2)
    data.batch["old_log_probs"][0, 0] = float("nan")
    data.non_tensor_batch["s"] = np.array([float("nan"), 1.0])
    data.union(data.select(deepcopy=True))


@pytest.mark.parametrize(
    "other, key",
    [
        (DataProto.from_dict({"row": torch.tensor([0, 1, 9])}), r"batch\['row'\]"),
        (DataProto.from_dict(non_tensors={"uid": np.array(["u0", "u1", "x"], dtype=object)}), r"\['uid'\]"),
        (
            DataProto.from_dict(non_tensors={"extra_info": [{"index": 0}, {"index": 1}, {"index": 2}]}),
            r"\['extra_info'\]",
        ),
        (DataProto(meta_info={"temperature": 0.7}), r"meta_info\['temperature'\]"),
    ],
)
def test_union_conflict_names_key(other, key):
    with pytest.raises(ValueError, match=key):
        make_batch(3).union(other)


def test_union_length_mismatch_and_helpers():
    with pytest.raises(ValueError, match="2 rows into one with 3 rows"):
        make_batch(3).union(make_batch(2))
    with pytest.raises(ValueError, match=r"batch sizes \(3,\) and \(2,\)"):
        union_tensor_dict(make_batch(3).batch, make_batch(2).batch)
    merged = union_numpy_dict({"a": np.array([1, 2])}, {"a": np.array([1, 2]), "b": np.array(["x", "y"])})
    assert sorted(merged) == ["a", "b"]
    with pytest.raises(ValueError, match="'a'"):
        union_numpy_dict({"a": np.array([1, 2])}, {"a": np.array([1, 3])})


# ---- chunk / split / concat / repeat / reorder ------------------------------------------------


def test_chunk_then_concat_is_identity():
    data = make_batch(6)
    parts = data.chunk(3)
    assert [rows_of(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p.meta_info == data.meta_info for p in parts)
    assert_same(DataProto.concat(parts), data)


def test_chunk_requires_divisibility():
    with pytest.raises(ValueError, match="10 rows into 3 equal chunks.*pad_dataproto_to_divisor"):
        make_batch(10).chunk(3)


def test_split_then_concat_is_identity():
    data = make_batch(7)
    parts = data.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert_same(DataProto.concat(parts), data)


def test_concat_merges_meta_info_and_gathers_metrics():
    a = make_batch(2, {"t": 1, "metrics": {"loss": 0.5}})
    b = make_batch(2, {"t": 1, "metrics": {"loss": [0.1, 0.2]}})
    assert DataProto.concat([a, b]).meta_info == {"t": 1, "metrics": {"loss": [0.5, 0.1, 0.2]}}
    with pytest.raises(ValueError, match=r"meta_info\['t'\]"):
        DataProto.concat([make_batch(2, {"t": 1}), make_batch(2, {"t": 2})])


def test_concat_key_mismatch_is_an_error():
    with pytest.raises(ValueError, match="part 1"):
        DataProto.concat([make_batch(2), make_batch(2).select(batch_keys=["row"])])


def test_repeat_interleaved_and_tiled():
    data = make_batch(2)  # rows [a, b] = [0, 1]
    inter, tiled = data.repeat(2, interleave=True), data.repeat(2, interleave=False)
    assert rows_of(inter) == [0, 0, 1, 1] and rows_of(tiled) == [0, 1, 0, 1]
    assert inter.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert tiled.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert inter.batch["input_ids"][:, 0].tolist() == [0, 0, 10, 10]


def test_reorder_in_place():
    data = make_batch(4)
    assert data.reorder(torch.tensor([3, 0, 2, 1])) is None
    assert rows_of(data) == [3, 0, 2, 1] and data.non_tensor_batch["uid"].tolist() == ["u3", "u0", "u2", "u1"]


def test_to_device_returns_self():
    data = make_batch(2)
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")


def test_collate_fn_inverts_int_indexing():
    data = make_batch(3)
    assert_same(collate_fn([data[i] for i in range(3)]), data)


# ---- make_iterator ----------------------------------------------------------------------------


def _epochs(data, seed, epochs=2, mbs=3, **kw):
    return [rows_of(mb) for mb in data.make_iterator(mini_batch_size=mbs, epochs=epochs, seed=seed, **kw)]


def test_make_iterator_is_seeded_and_covers_every_row_once_per_epoch():
    data = make_batch(12)
    first = _epochs(data, seed=1)
    assert first == _epochs(data, seed=1) and first != _epochs(data, seed=2)
    assert len(first) == 8 and all(len(mb) == 3 for mb in first)
    for epoch in (first[:4], first[4:]):
        assert sorted(sum(epoch, [])) == list(range(12))
    assert first[:4] != first[4:]  # a fresh permutation each epoch
    assert first[0] != [0, 1, 2] or first[1] != [3, 4, 5]  # actually shuffled


def test_make_iterator_keeps_columns_aligned_and_can_skip_shuffle():
    data = make_batch(4)
    for mb in data.make_iterator(2, epochs=1, seed=0):
        assert mb.non_tensor_batch["uid"].tolist() == [f"u{r}" for r in rows_of(mb)]
        assert mb.meta_info == data.meta_info
    assert _epochs(data, seed=0, epochs=1, mbs=2, dataloader_kwargs={"shuffle": False}) == [[0, 1], [2, 3]]


def test_make_iterator_seed_none_follows_torch_manual_seed():
    data = make_batch(8)
    torch.manual_seed(0)
    a = _epochs(data, seed=None, mbs=4)
    torch.manual_seed(0)
    assert _epochs(data, seed=None, mbs=4) == a


def test_make_iterator_errors():
    with pytest.raises(ValueError, match="mini_batch_size 3 does not divide the batch of 4 rows"):
        make_batch(4).make_iterator(3, epochs=1)
    with pytest.raises(TypeError, match="num_workers"):
        make_batch(4).make_iterator(2, epochs=1, dataloader_kwargs={"num_workers": 2})


# ---- pad / unpad ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, divisor, pad_size, padded_rows",
    [
        (5, 4, 3, [0, 1, 2, 3, 4, 0, 1, 2]),  # 5 -> 8: repeat the first 3 rows
        (8, 4, 0, list(range(8))),  # already divisible
        (1, 3, 2, [0, 0, 0]),  # fewer rows than padding: start repeated again
        (2, 7, 5, [0, 1, 0, 1, 0, 1, 0]),
        (3, 1, 0, [0, 1, 2]),
    ],
)
def test_pad_and_unpad_by_hand(n, divisor, pad_size, padded_rows):
    data = make_batch(n)
    padded, got_pad = pad_dataproto_to_divisor(data, divisor)
    assert got_pad == pad_size and rows_of(padded) == padded_rows
    assert padded.non_tensor_batch["uid"].tolist() == [f"u{r}" for r in padded_rows]
    assert_same(unpad_dataproto(padded, got_pad), data)


def test_pad_then_chunk_across_ranks():
    padded, pad_size = pad_dataproto_to_divisor(make_batch(5), 2)
    assert [rows_of(c) for c in padded.chunk(2)] == [[0, 1, 2], [3, 4, 0]] and pad_size == 1


@pytest.mark.parametrize(
    "n, world, dp_size, shares",
    [
        (3, 2, 1, [[0, 1, 2]]),  # tensor parallel 2: [0 1 | 2 0] -> the one data-parallel rank trains 0-2
        (6, 4, 2, [[0, 1, 2], [3, 4, 5]]),  # [0 1 | 2 3 | 4 5 | 0 1]: each row once, in order
        (4, 4, 2, [[0, 1], [2, 3]]),  # nothing padded
    ],
)
def test_data_parallel_share_trains_every_row_once(n, world, dp_size, shares):
    padded, pad = pad_dataproto_to_divisor(make_batch(n), world)
    parts = padded.chunk(world)
    assert [rows_of(data_parallel_share(parts, pad, r, dp_size)) for r in range(dp_size)] == shares


def test_data_parallel_share_refuses_rows_that_do_not_split():
    padded, pad = pad_dataproto_to_divisor(make_batch(3), 4)
    with pytest.raises(ValueError, match="3 rows cannot be split evenly over 2 data-parallel ranks"):
        data_parallel_share(padded.chunk(4), pad, 0, 2)


# ---- save / load ------------------------------------------------------------------------------


def _assert_safe_file(path):
    """One safetensors file (8-byte length + JSON header, the DataProto's JSON in its metadata); no pickle."""
    assert path.is_file()
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])  # a pickle would not parse as length + JSON header
    header = json.loads(raw[8 : 8 + header_len])
    assert json.loads(header["__metadata__"]["rlfoundry.DataProto"])["format"] == "rlfoundry.DataProto"
    with safe_open(str(path), framework="pt") as f:  # the tensors parse as plain safetensors
        assert set(f.keys()) == {k for k in header if k != "__metadata__"}


def test_save_load_round_trip(tmp_path):
    data = make_batch(4, meta_info={"temperature": 0.7, "eos_token_id": [1, 2], "cfg": {"n": 4, "x": None}})
    data.batch["bf16"] = torch.arange(4, dtype=torch.bfloat16)
    data.non_tensor_batch.update(
        mixed=np.array([None, 1.5, True, ("t", 1)], dtype=object),
        ints=np.arange(4, dtype=np.int32),
        strs=np.array(["a", "bb", "c", "d"]),
        nested=np.array([np.array([1, 2]), np.float32(0.5), np.int64(3), "x"], dtype=object),
    )
    data.save_to_disk(tmp_path / "batch.pt")
    _assert_safe_file(tmp_path / "batch.pt")
    loaded = DataProto.load_from_disk(tmp_path / "batch.pt")
    assert_same(loaded, data)
    nested = loaded.non_tensor_batch["nested"]
    assert nested[0].dtype == np.int64 and type(nested[1]) is np.float32 and type(nested[2]) is np.int64
    assert loaded.non_tensor_batch["mixed"][3] == ("t", 1)


def test_save_load_view_and_no_tensors(tmp_path):
    view = make_batch(6).chunk(2)[1]  # tensors share storage with the parent
    view.save_to_disk(tmp_path / "view.pt")
    assert_same(DataProto.load_from_disk(tmp_path / "view.pt"), view)
    columns_only = DataProto.from_dict(non_tensors={"uid": ["a", "b"]}, meta_info={"k": "v"})
    columns_only.save_to_disk(tmp_path / "cols.pt")
    assert_same(DataProto.load_from_disk(tmp_path / "cols.pt"), columns_only)


def test_the_saved_file_can_be_copied_and_loaded_under_another_name(tmp_path):
    """verl's scripts save to batch.pt and copy the file; a directory would break shutil.copy."""
    data = make_batch(3, meta_info={"step": 7})
    data.save_to_disk(tmp_path / "out" / "batch.pt")  # the parent directory is created
    shutil.copy(tmp_path / "out" / "batch.pt", tmp_path / "elsewhere.pt")
    assert_same(DataProto.load_from_disk(tmp_path / "elsewhere.pt"), data)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["batch.pt"]  # no temp file left


def test_the_directory_format_of_earlier_versions_still_loads(tmp_path):
    """Before one-file saves, save_to_disk(path) made a directory: batch.safetensors (the tensors,
    no metadata) and data.json (format tag, version, batch size, tagged-JSON columns and meta)."""
    old = tmp_path / "batch"
    old.mkdir()
    tensors = {"input_ids": torch.arange(6).view(3, 2), "bf16": torch.tensor([0.5, 1.0, 1.5], dtype=torch.bfloat16),
               "mask": torch.tensor([True, False, True])}
    save_file(tensors, str(old / "batch.safetensors"))
    (old / "data.json").write_text(json.dumps({
        "format": "rlfoundry.DataProto", "version": 1, "batch_size": 3,
        "non_tensor_batch": {
            "uid": {"__rlfoundry_type__": "ndarray", "dtype": "|O", "shape": [3], "items": ["a", "b", "c"]},
            "extra_info": {"__rlfoundry_type__": "ndarray", "dtype": "|O", "shape": [3], "items": [
                {"ground_truth": "1"}, {"__rlfoundry_type__": "tuple", "items": ["t", 1]},
                {"__rlfoundry_type__": "scalar", "dtype": "<f4", "value": 0.5}]},
            "index": {"__rlfoundry_type__": "ndarray", "dtype": "<i4", "shape": [3], "items": [0, 1, 2]},
        },
        "meta_info": {"temperature": 0.5, "eos": {"__rlfoundry_type__": "tuple", "items": [1, 2]}},
    }))
    expected = DataProto.from_dict(
        tensors,
        {"uid": np.array(["a", "b", "c"], dtype=object),
         "extra_info": np.array([{"ground_truth": "1"}, ("t", 1), np.float32(0.5)], dtype=object),
         "index": np.arange(3, dtype=np.int32)},
        {"temperature": 0.5, "eos": (1, 2)},
    )
    loaded = DataProto.load_from_disk(old)
    assert_same(loaded, expected)
    assert type(loaded.non_tensor_batch["extra_info"][2]) is np.float32 and loaded.meta_info["eos"] == (1, 2)
    # Saved again, it becomes one file whose header holds the same JSON the directory held.
    loaded.save_to_disk(tmp_path / "batch.pt")
    with safe_open(str(tmp_path / "batch.pt"), framework="pt") as f:
        assert json.loads(f.metadata()["rlfoundry.DataProto"]) == json.loads((old / "data.json").read_text())


def test_a_failed_save_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "batch.pt"
    make_batch(2).save_to_disk(path)
    before = path.read_bytes()

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: header too large")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    with pytest.raises(ValueError, match=r"header too large; the non-tensor columns .* MB of JSON"):
        make_batch(3).save_to_disk(path)
    assert [p.name for p in tmp_path.iterdir()] == ["batch.pt"] and path.read_bytes() == before


@pytest.mark.parametrize(
    "where, value, name",
    [
        ("column", {1, 2}, r"non_tensor_batch\['extra_info'\]\[1\]"),
        ("column", {"ok": object()}, r"non_tensor_batch\['extra_info'\]\[1\]\['ok'\]"),
        ("column", {3: "int key"}, r"non_tensor_batch\['extra_info'\]\[1\]"),
        ("meta", torch.zeros(2), r"meta_info\['bad'\]"),
    ],
)
def test_save_refuses_unsafe_values_naming_key_and_writes_nothing(tmp_path, where, value, name):
    data = make_batch(2)
    if where == "column":
        data.non_tensor_batch["extra_info"][1] = value
    else:
        data.meta_info["bad"] = value
    with pytest.raises(TypeError, match=name):
        data.save_to_disk(tmp_path / "batch.pt")
    assert not list(tmp_path.iterdir())


def test_load_rejects_foreign_files_and_directories(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="does not hold a DataProto"):
        DataProto.load_from_disk(tmp_path)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "weights.safetensors"))  # safetensors, not ours
    with pytest.raises(ValueError, match="does not hold a DataProto.*no rlfoundry.DataProto header"):
        DataProto.load_from_disk(tmp_path / "weights.safetensors")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="does not hold a DataProto"):
        DataProto.load_from_disk(tmp_path / "notes.txt")


# ---- property tests ---------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4).filter(lambda k: not k.startswith("__")), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=40, deadline=None)
@given(n_per_chunk=st.integers(0, 4), chunks=st.integers(1, 5), split_size=st.integers(1, 7))
def test_chunk_and_split_concat_round_trip_property(n_per_chunk, chunks, split_size):
    data = make_batch(n_per_chunk * chunks)
    assert_same(DataProto.concat(data.chunk(chunks)), data)
    if len(data):
        assert_same(DataProto.concat(data.split(split_size)), data)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), divisor=st.integers(1, 9))
def test_pad_property(n, divisor):
    data = make_batch(n)
    padded, pad_size = pad_dataproto_to_divisor(data, divisor)
    assert len(padded) % divisor == 0 and 0 <= pad_size < divisor and len(padded) == n + pad_size
    assert rows_of(padded)[n:] == [i % n for i in range(pad_size)]
    assert_same(unpad_dataproto(padded, pad_size), data)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 6), times=st.integers(1, 4))
def test_repeat_property(n, times):
    data = make_batch(n)
    assert rows_of(data.repeat(times, interleave=True)) == [i // times for i in range(n * times)]
    assert rows_of(data.repeat(times, interleave=False)) == [i % n for i in range(n * times)]


@settings(max_examples=60, deadline=None)
@given(values=st.lists(json_values, min_size=1, max_size=4), meta=json_values)
def test_save_load_json_values_property(values, meta):
    data = DataProto.from_dict({"x": torch.arange(len(values))}, {"v": values}, {"m": meta})
    with tempfile.TemporaryDirectory() as tmp:
        data.save_to_disk(os.path.join(tmp, "batch.pt"))
        loaded = DataProto.load_from_disk(os.path.join(tmp, "batch.pt"))
    assert loaded.non_tensor_batch["v"].tolist() == values and loaded.meta_info == {"m": meta}


@pytest.mark.parametrize("op", ["slice", "index", "numpy_index", "repeat", "chunk", "concat", "pad", "split",
                                "select_idxs", "reorder", "iterator"])
def test_row_operations_keep_the_tensors_device(op):
    """Issue 33's audit: every row operation a worker or the driver applies leaves a batch on the device
    it was on (CUDA on a worker); checked on the meta device, which carries the device but no data
    (an index or a pad made on the host must not move, or fail to combine with, device tensors)."""
    from rlfoundry.protocol import pad_dataproto_to_divisor

    meta = torch.device("meta")
    d = DataProto.from_dict(tensors={"x": torch.zeros(4, 3, device=meta), "m": torch.ones(4, 3, dtype=torch.long, device=meta)},
                            non_tensors={"uid": np.array(list("abcd"), dtype=object)})
    ops = {"slice": lambda: d[1:3], "index": lambda: d[[0, 2]], "numpy_index": lambda: d[np.array([0, 2])],
           "repeat": lambda: d.repeat(2, interleave=True), "chunk": lambda: d.chunk(2)[1],
           "concat": lambda: DataProto.concat([d, d]), "pad": lambda: pad_dataproto_to_divisor(d, 3)[0],
           "split": lambda: d.split(3)[1], "select_idxs": lambda: d.select_idxs([1, 3]),
           "reorder": lambda: (d.reorder(torch.tensor([3, 2, 1, 0])), d)[1],
           "iterator": lambda: next(d.make_iterator(2, 1, seed=0))}
    out = ops[op]()
    assert {t.device for t in out.batch.values()} == {meta}
