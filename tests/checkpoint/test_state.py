"""One role's state: exact round trip, safe loading, integrity of the role's files on load."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from rlfoundry.checkpoint import layout as ckpt_dirs
from rlfoundry.checkpoint import state as ckpt
from tests.checkpoint import _flip_byte, _fsdp_policy, _linear, _logits, _shard, _train_step


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}



@pytest.mark.numerics
def test_save_load_gives_identical_outputs_and_next_step(process_group, tiny_model_dir, tmp_path):
    model, optim, sched = _fsdp_policy(tiny_model_dir)
    _train_step(model, optim, sched, seed=1)
    path = ckpt.save_checkpoint(tmp_path / "global_step_1" / "actor", model, optim, sched,
                                extra_state={"global_step": 1, "kl_coef": torch.tensor(0.05)})
    random_after_save = (torch.rand(3), random.random(), np.random.rand())
    logits_before = _logits(model)
    _train_step(model, optim, sched, seed=2)
    expected = _full_params(model)

    fresh, fresh_optim, fresh_sched = _fsdp_policy(tiny_model_dir)
    torch.manual_seed(999), random.seed(999), np.random.seed(999)  # RNG must come from the checkpoint
    extra = ckpt.load_checkpoint(path, fresh, fresh_optim, fresh_sched)
    assert extra["global_step"] == 1 and torch.equal(extra["kl_coef"], torch.tensor(0.05))
    torch_draw, py_draw, np_draw = random_after_save
    assert torch.equal(torch.rand(3), torch_draw) and random.random() == py_draw and np.random.rand() == np_draw
    torch.testing.assert_close(_logits(fresh), logits_before, atol=0, rtol=0)
    _train_step(fresh, fresh_optim, fresh_sched, seed=2)  # needs Adam moments + step count to match
    for name, value in _full_params(fresh).items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)
    assert fresh_sched.get_last_lr() == sched.get_last_lr()


def test_loading_an_incomplete_directory_is_an_error(tmp_path):
    (tmp_path / "critic").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "critic", nn.Linear(2, 2))


# ---- safe loading ----------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs code (creates a directory): what a crafted checkpoint would do."""

    def __init__(self, witness: Path):
        self.witness = witness

    def __reduce__(self):
        return (os.makedirs, (str(self.witness),))


def _rerecord(path: Path) -> None:
    """Rewrite a role's manifest to match its files now: a tampered checkpoint whose manifest was
    forged too, so the safe loaders (not the checksums) are what stops it."""
    marker = json.loads((path / ckpt_dirs.COMPONENT_MARKER).read_text())
    marker["manifest"] = ckpt_dirs.file_manifest(path, ckpt_dirs.files_under(path))
    del marker["manifest"][ckpt_dirs.COMPONENT_MARKER]
    (path / ckpt_dirs.COMPONENT_MARKER).write_text(json.dumps(marker))


def test_loading_never_runs_pickled_code(process_group, tmp_path):
    model, optim = _linear()
    path = ckpt.save_checkpoint(tmp_path / "critic", model, optim)
    witness = tmp_path / "code-ran"

    torch.save({"x": _Payload(witness)}, path / "extra_state.pt")
    _rerecord(path)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        ckpt.load_checkpoint(path, *_linear())

    metadata = path / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(witness)))
    _rerecord(path)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        ckpt.load_checkpoint(path, *_linear())

    with pytest.raises(ValueError, match="refusing to unpickle"):
        ckpt_dirs.save_trainer_state(tmp_path / "data.pt", {"sampler": _Payload(witness)})
    assert not (tmp_path / "data.pt").exists()
    assert not witness.exists()


# ---- integrity: files damaged after publishing --------------------------------------------------


def test_the_marker_records_every_file_with_size_and_checksum(process_group, tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "critic", *_linear(), extra_state={"step": 1})
    manifest = json.loads((path / ckpt_dirs.COMPONENT_MARKER).read_text())["manifest"]
    on_disk = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
    assert sorted(manifest) == sorted(n for n in on_disk if n != ckpt_dirs.COMPONENT_MARKER)
    import hashlib

    shard = _shard(path).relative_to(path).as_posix()
    assert manifest[shard] == {"size": (path / shard).stat().st_size,
                               "sha256": hashlib.sha256((path / shard).read_bytes()).hexdigest()}


def test_a_flipped_byte_in_a_shard_is_an_error_naming_the_file(process_group, tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "critic", *_linear())
    model, optim = _linear(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _flip_byte(_shard(path))
    with pytest.raises(ckpt_dirs.CheckpointCorruptError, match=rf"{_shard(path)} does not match the SHA-256"):
        ckpt.load_checkpoint(path, model, optim)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing half-loaded


def test_a_truncated_file_is_a_size_error(process_group, tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "critic", *_linear(), extra_state={"step": 1})
    (path / "extra_state.pt").write_bytes((path / "extra_state.pt").read_bytes()[:-10])
    with pytest.raises(ckpt_dirs.CheckpointCorruptError, match=r"extra_state.pt has \d+ bytes, \d+ were written"):
        ckpt.load_checkpoint(path, *_linear())


def test_a_checkpoint_saved_before_manifests_still_loads(process_group, tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "critic", *_linear(), extra_state={"step": 7})
    marker = json.loads((path / ckpt_dirs.COMPONENT_MARKER).read_text())
    del marker["manifest"]
    (path / ckpt_dirs.COMPONENT_MARKER).write_text(json.dumps(marker))
    assert ckpt.load_checkpoint(path, *_linear(seed=1))["step"] == 7
