"""Checkpoints: exact round trip, crash-safety of every write, retention, safe loading, HF export."""

from __future__ import annotations

import json
import os
import pickle
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from rlfoundry.config.schema import OptimConfig
from rlfoundry.engines import checkpoint as ckpt
from rlfoundry.engines.fsdp import utils as fsdp_utils
from rlfoundry.models.hf import load_hf_model
from rlfoundry.utils import checkpoint as ckpt_dirs


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo group (FSDP2 needs one). Left up: later in-process worker groups reuse it."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _fsdp_policy(model_dir: Path):
    model = load_hf_model(model_dir, "causal_lm")
    fsdp_utils.apply_fsdp2(model, "cpu")
    optim = fsdp_utils.build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    sched = fsdp_utils.build_lr_scheduler(optim, OptimConfig(lr_warmup_steps=4, warmup_style="cosine"),
                                          total_training_steps=20)
    return model, optim, sched


def _train_step(model, optim, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (2, 10), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(5, 25).view(2, 10)
    with torch.no_grad():
        return model(input_ids=ids).logits


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


# ---- crash safety -----------------------------------------------------------------------------


def _save_step(root: Path, step: int, model: nn.Module, optim) -> None:
    """What the trainer does at a save: each role, then trainer state, then the pointer."""
    ckpt.save_checkpoint(root / f"global_step_{step}" / "critic", model, optim, extra_state={"step": step})
    ckpt_dirs.save_trainer_state(root / f"global_step_{step}" / "data.pt", {"global_step": step})
    ckpt_dirs.write_latest_checkpointed_iteration(root, step)


def _linear(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    return model, optim


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


def _shard(path: Path) -> Path:
    return next((path / "dcp").glob("*.distcp"))


def _flip_byte(file: Path, offset: int = -5) -> None:
    raw = bytearray(file.read_bytes())
    raw[offset] ^= 0xFF
    file.write_bytes(bytes(raw))


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


# ---- Hugging Face export ---------------------------------------------------------------------


def test_save_hf_model_loads_with_from_pretrained(process_group, tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, optim, sched = _fsdp_policy(tiny_model_dir)
    _train_step(model, optim, sched, seed=3)  # exported weights must be the trained ones
    out = ckpt.save_hf_model(model, tokenizer, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert any(out.glob("*.safetensors")) and not (tmp_path / "hf.tmp").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model), atol=1e-6, rtol=1e-6)
    assert AutoTokenizer.from_pretrained(out).encode("12+3") == tokenizer.encode("12+3")


def test_a_checkpoint_alone_exports_to_hf(process_group, tiny_critic_dir, tokenizer, tmp_path):
    from transformers import AutoModelForTokenClassification

    model = load_hf_model(tiny_critic_dir, "token_classification")
    fsdp_utils.apply_fsdp2(model, "cpu")
    path = ckpt.save_checkpoint(tmp_path / "global_step_1" / "critic", model, tokenizer=tokenizer)
    out = ckpt.export_hf_from_checkpoint(path, tmp_path / "exported")
    reloaded = AutoModelForTokenClassification.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model.eval()), atol=1e-6, rtol=1e-6)
    assert (out / "tokenizer.json").is_file()
