"""The step protocol: crash safety of every write, the latest pointer, retention, the choice of the
step to resume from, and the trainer's state file. The role module (``ckpt``) writes the roles, the
directory protocol (``ckpt_dirs``) the steps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from rlfoundry.checkpoint import layout as ckpt_dirs
from rlfoundry.checkpoint import state as ckpt
from tests.checkpoint import _flip_byte, _linear, _shard


# ---- crash safety -----------------------------------------------------------------------------


def _save_step(root: Path, step: int, model: nn.Module, optim) -> None:
    """What the trainer does at a save: each role, then trainer state, then the pointer."""
    ckpt.save_checkpoint(root / f"global_step_{step}" / "critic", model, optim, extra_state={"step": step})
    ckpt_dirs.save_trainer_state(root / f"global_step_{step}" / "data.pt", {"global_step": step})
    ckpt_dirs.write_latest_checkpointed_iteration(root, step)


class _Crash(Exception):
    """Stands in for SIGKILL: nothing after the injection point runs, no clean-up either."""


def _crash_when(target, predicate):
    def wrapper(*args, **kwargs):
        if predicate(*args):
            raise _Crash(f"injected crash at {args[0]}")
        return target(*args, **kwargs)

    return wrapper


CRASH_POINTS = {
    # name: (function the checkpoint modules write with, which call of it crashes)
    "writing DCP shards": ("dcp", None),
    "component marker": ("atomic_write_bytes", lambda p, *_: Path(p).name == ckpt_dirs.COMPONENT_MARKER),
    "rename into place": ("replace", lambda src, *_: str(src).endswith("critic.tmp")),
    "trainer state": ("atomic_write_bytes", lambda p, *_: Path(p).name == "data.pt"),
    "step marker": ("atomic_write_bytes", lambda p, *_: Path(p).name == ckpt_dirs.STEP_MARKER),
    "latest pointer": ("atomic_write_bytes", lambda p, *_: Path(p).name == ckpt_dirs.LATEST_FILE),
}


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_crash_anywhere_in_a_save_leaves_the_previous_checkpoint_current(process_group, tmp_path, monkeypatch, point):
    model, optim = _linear()
    _save_step(tmp_path, 1, model, optim)
    name, predicate = CRASH_POINTS[point]
    with monkeypatch.context() as m:
        if name == "dcp":
            m.setattr(ckpt.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(_Crash("in DCP")))
        elif name == "replace":
            m.setattr(ckpt.os, "replace", _crash_when(os.replace, predicate))
        else:  # both modules write through it: a role's marker (engine), the step's files (directory protocol)
            for module in (ckpt, ckpt_dirs):
                m.setattr(module, name, _crash_when(getattr(module, name), predicate))
        with pytest.raises(_Crash):
            _save_step(tmp_path, 2, model, optim)

    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_1")
    assert (tmp_path / ckpt_dirs.LATEST_FILE).read_text() == "1"
    assert ckpt.load_checkpoint(tmp_path / "global_step_1" / "critic", *_linear(seed=1))["step"] == 1
    # Start-up clean-up removes the debris, and the next save succeeds.
    ckpt_dirs.cleanup_partial_checkpoints(tmp_path)
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))
    _save_step(tmp_path, 2, model, optim)
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_2")


def test_partial_step_directories_are_ignored_and_cleaned(process_group, tmp_path):
    model, optim = _linear()
    _save_step(tmp_path, 1, model, optim)
    # step 2: the critic crashed mid-save (only a .tmp dir); step 3: the critic finished but the
    # trainer never finalised the step; step 4: a role directory without its marker.
    (tmp_path / "global_step_2" / "critic.tmp").mkdir(parents=True)
    ckpt.save_checkpoint(tmp_path / "global_step_3" / "critic", model, optim)
    (tmp_path / "global_step_4" / "actor").mkdir(parents=True)
    (tmp_path / ckpt_dirs.LATEST_FILE).write_text("4")  # a pointer that lies (hand-edited, other tool)
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_1")
    (tmp_path / ckpt_dirs.LATEST_FILE).write_text("garbage")
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_1")
    (tmp_path / ckpt_dirs.LATEST_FILE).unlink()
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_1")
    with pytest.raises(RuntimeError, match="not complete"):
        ckpt_dirs.write_latest_checkpointed_iteration(tmp_path, 4)

    removed = ckpt_dirs.cleanup_partial_checkpoints(tmp_path)
    assert sorted(Path(p).name for p in removed) == ["global_step_2", "global_step_3", "global_step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path / "missing") is None


def test_latest_pointer_is_replaced_atomically(tmp_path, monkeypatch):
    (tmp_path / "global_step_7").mkdir()
    ckpt_dirs.save_trainer_state(tmp_path / "global_step_7" / "data.pt", {"global_step": 7})
    ckpt_dirs.write_latest_checkpointed_iteration(tmp_path, 7)
    (tmp_path / "global_step_8").mkdir()
    ckpt_dirs.save_trainer_state(tmp_path / "global_step_8" / "data.pt", {"global_step": 8})
    # Crash between writing the new content and the rename: readers still see the old pointer whole.
    with monkeypatch.context() as m:
        m.setattr(ckpt.os, "replace", _crash_when(os.replace, lambda src, dst: Path(dst).name == ckpt_dirs.LATEST_FILE))
        with pytest.raises(_Crash):
            ckpt_dirs.write_latest_checkpointed_iteration(tmp_path, 8)
    assert (tmp_path / ckpt_dirs.LATEST_FILE).read_text() == "7"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers and all(ckpt_dirs.LATEST_FILE in n for n in leftovers)  # the staged copy, not the file
    ckpt_dirs.write_latest_checkpointed_iteration(tmp_path, 8)
    assert (tmp_path / ckpt_dirs.LATEST_FILE).read_text() == "8"
    marker = json.loads((tmp_path / "global_step_8" / ckpt_dirs.STEP_MARKER).read_text())
    assert marker["files"] == ["data.pt"] and marker["global_step"] == 8


# ---- retention -------------------------------------------------------------------------------


def test_remove_old_checkpoints_keeps_the_newest_complete(process_group, tmp_path):
    model, optim = _linear()
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path / f"global_step_{step}" / "actor", model, optim)
        _save_step(tmp_path, step, model, optim)
    ckpt.save_checkpoint(tmp_path / "global_step_5" / "critic", model, optim)  # not finalised yet

    assert ckpt_dirs.remove_old_checkpoints(tmp_path, None) == []
    removed = ckpt_dirs.remove_old_checkpoints(tmp_path, max_to_keep=1, component="actor")
    assert [Path(p).parent.name for p in removed] == ["global_step_1", "global_step_2", "global_step_3"]
    assert all((tmp_path / f"global_step_{s}" / "critic").is_dir() for s in (1, 2, 3))
    assert not ckpt_dirs.is_complete_step_dir(tmp_path / "global_step_3")  # lost a role: not resumable

    removed = ckpt_dirs.remove_old_checkpoints(tmp_path, max_to_keep=2)
    assert [Path(p).name for p in removed] == ["global_step_1", "global_step_2"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step_3", "global_step_4", "global_step_5"]
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_4")


# ---- resuming: the newest intact step, damaged files named ----------------------------------------


def test_auto_resume_skips_a_damaged_newest_step_and_names_the_file(process_group, tmp_path, caplog):
    model, optim = _linear()
    _save_step(tmp_path, 1, model, optim)
    _save_step(tmp_path, 2, model, optim)
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path, verify=True) == str(tmp_path / "global_step_2")
    damaged = _shard(tmp_path / "global_step_2" / "critic")
    _flip_byte(damaged)
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_2")  # unverified: markers only
    with caplog.at_level("WARNING"):
        assert ckpt_dirs.find_latest_ckpt_path(tmp_path, verify=True) == str(tmp_path / "global_step_1")
    assert str(damaged) in caplog.text
    (tmp_path / "global_step_1" / "data.pt").write_bytes(b"")  # the step's own files are covered too
    with pytest.raises(ckpt_dirs.CheckpointCorruptError, match="data.pt has 0 bytes"):
        ckpt_dirs.verify_step_dir(tmp_path / "global_step_1")


def test_auto_resume_with_every_step_damaged_is_an_error_listing_them(process_group, tmp_path):
    """None would mean "train from scratch" in the same directory, over the damaged steps: refuse."""
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path, verify=True) is None  # nothing saved: a fresh start
    model, optim = _linear()
    _save_step(tmp_path, 1, model, optim)
    _save_step(tmp_path, 2, model, optim)
    _flip_byte(_shard(tmp_path / "global_step_2" / "critic"))
    (tmp_path / "global_step_1" / "data.pt").write_bytes(b"")
    with pytest.raises(ckpt_dirs.CheckpointCorruptError, match="no intact checkpoint") as caught:
        ckpt_dirs.find_latest_ckpt_path(tmp_path, verify=True)
    message = str(caught.value)
    assert f"{_shard(tmp_path / 'global_step_2' / 'critic')} does not match the SHA-256" in message
    assert f"{tmp_path / 'global_step_1' / 'data.pt'} has 0 bytes" in message
    assert "trainer.default_local_dir" in message  # the fix
    # a step whose role retention removed is neither intact nor damaged: the error stays about step 2
    ckpt_dirs.remove_old_checkpoints(tmp_path, max_to_keep=1, component="critic")
    with pytest.raises(ckpt_dirs.CheckpointCorruptError) as caught:
        ckpt_dirs.find_latest_ckpt_path(tmp_path, verify=True)
    assert "global_step_1" not in str(caught.value) and "global_step_2" in str(caught.value)


def test_a_damaged_marker_is_named_and_its_step_is_not_deleted_as_debris(process_group, tmp_path, caplog):
    model, optim = _linear()
    _save_step(tmp_path, 1, model, optim)
    _save_step(tmp_path, 2, model, optim)
    role_marker = tmp_path / "global_step_2" / "critic" / ckpt_dirs.COMPONENT_MARKER
    role_marker.write_bytes(role_marker.read_bytes()[:40])  # truncated JSON
    with pytest.raises(ckpt_dirs.CheckpointCorruptError, match=rf"{role_marker} is not valid JSON"):
        ckpt.load_checkpoint(role_marker.parent, *_linear())
    with caplog.at_level("WARNING"):
        assert ckpt_dirs.find_latest_ckpt_path(tmp_path, verify=True) == str(tmp_path / "global_step_1")
    assert f"{role_marker} is not valid JSON" in caplog.text

    step_marker = tmp_path / "global_step_2" / ckpt_dirs.STEP_MARKER
    step_marker.write_bytes(b"\xff" + step_marker.read_bytes()[1:])
    assert ckpt_dirs.cleanup_partial_checkpoints(tmp_path) == []  # finalised once: damage, not debris
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert ckpt_dirs.find_latest_ckpt_path(tmp_path, verify=True) == str(tmp_path / "global_step_1")
    assert f"{step_marker} is not valid JSON" in caplog.text
    assert ckpt_dirs.find_latest_ckpt_path(tmp_path) == str(tmp_path / "global_step_1")  # markers only: skipped


def test_ppo_resume_selection(process_group, tmp_path, caplog):
    """RayPPOTrainer._resume_path on real checkpoints: what the trainer loads for each resume_mode."""
    from types import SimpleNamespace

    from rlfoundry.trainer.config import ConfigError
    from rlfoundry.trainer.ppo.ray_trainer import RayPPOTrainer

    def choose(mode: str, path: Path | None = None):
        trainer = SimpleNamespace(resume_mode=mode, resume_from_path=str(path) if path else None)
        fake = SimpleNamespace(config=SimpleNamespace(trainer=trainer), _ckpt_root=lambda: tmp_path)
        return RayPPOTrainer._resume_path(fake)

    model, optim = _linear()
    _save_step(tmp_path, 1, model, optim)
    _save_step(tmp_path, 2, model, optim)
    assert choose("auto") == str(tmp_path / "global_step_2")
    damaged = _shard(tmp_path / "global_step_2" / "critic")
    _flip_byte(damaged)
    with caplog.at_level("WARNING"):
        assert choose("auto") == str(tmp_path / "global_step_1")
    assert f"skipping {tmp_path / 'global_step_2'}: checkpoint file {damaged}" in caplog.text
    with pytest.raises(ckpt_dirs.CheckpointCorruptError, match=rf"{damaged} does not match the SHA-256"):
        choose("resume_path", tmp_path / "global_step_2")
    assert choose("resume_path", tmp_path / "global_step_1") == str(tmp_path / "global_step_1")
    (tmp_path / "global_step_3" / "critic").mkdir(parents=True)  # a save that never finished
    with pytest.raises(ConfigError, match="global_step_3 is not a complete checkpoint"):
        choose("resume_path", tmp_path / "global_step_3")
    assert choose("disable") is None


def test_trainer_state_round_trip(tmp_path):
    state = {"global_step": 3, "dataloader": {"epoch": 1, "order": [2, 0, 1]}, "kl": torch.tensor([0.1]), "tag": None}
    ckpt_dirs.save_trainer_state(tmp_path / "data.pt", state)
    loaded = ckpt_dirs.load_trainer_state(tmp_path / "data.pt")
    assert loaded["dataloader"] == state["dataloader"] and torch.equal(loaded["kl"], state["kl"])
