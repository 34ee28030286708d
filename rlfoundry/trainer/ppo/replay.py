"""Any step replayable from its checkpoint (docs/on_policy.md, "Replay"): the records and the comparisons;
the replay itself is ``rlfoundry/trainer/replay.py``.

With ``trainer.replay_records=true`` each step writes ``<run_dir>/replay/<step>.pt``: the batch exactly as
the step's training phases received it (token ids, masks, rollout log-probs, rewards, versions, group ids,
its metadata) and what each phase computed from it (old and reference log-probs, values, token rewards,
advantages, returns). ``rlfoundry replay <run_dir> --step N`` rebuilds the trainer from the checkpoint
before step N (the model's initial weights for step 1), runs the same phases on that batch, and compares:
each phase's tensors with the recorded ones, then every tensor of the checkpoint the replay writes with the
run's ``global_step_N`` (weights and optimiser state, every role). Equal bit for bit is the CPU's promise
(resume is exact there); a difference names the first phase and tensor that diverged, so a user learns
whether a step's update is explained by its batch and its starting state, or something else moved it.

The record holds the batch before the phases and not the prompts: the replay checks the trainer, not the
sampling (a rollout is replayed by the mismatch audit and exact mode, not here).
"""

from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["PHASES", "Divergence", "StepRecorder", "compare_checkpoints", "compare_phases", "load_checkpoint_tensors",
           "load_record", "record_path", "save_record"]

RECORD_DIR = "replay"
# (phase, the batch key it writes), in the order the step computes them: the first that differs is named
PHASES = (("old log-probs", "old_log_probs"), ("reference log-probs", "ref_log_prob"), ("values", "values"),
          ("rewards", "token_level_rewards"), ("advantages", "advantages"), ("returns", "returns"))


def record_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / RECORD_DIR / f"{step}.pt"


def _snapshot(batch: Any) -> Any:
    """The batch as the phases receive it: its own tensor dict (phases replace entries, never the recorded
    ones: a phase that wrote into a tensor in place would make the replay differ, which it would report),
    copied per-row arrays and metadata."""
    from rlfoundry.protocol import DataProto

    return DataProto(batch=batch.batch.copy() if batch.batch is not None else None,
                     non_tensor_batch={k: np.array(v, copy=True) for k, v in batch.non_tensor_batch.items()},
                     meta_info=copy.deepcopy(batch.meta_info))


@dataclass
class StepRecorder:
    """One step's record: ``start`` before the phases, ``scored`` once the rewards are in (a reward computed
    in the background arrives during the phases), ``save`` after the updates."""

    run_dir: Path
    step: int
    batch: Any = None
    reward_keys: dict[str, torch.Tensor] = field(default_factory=dict)

    def start(self, batch: Any) -> None:
        self.batch = _snapshot(batch)

    def scored(self, batch: Any) -> None:
        """The reward tensors that arrived after ``start`` join the recorded input."""
        known = set(self.batch.batch.keys())
        self.reward_keys = {k: v for k, v in batch.batch.items() if k not in known and k.startswith(("token_level_scores", "gdpo"))}

    def save(self, batch: Any, config_yaml: str) -> Path:
        for key, value in self.reward_keys.items():
            self.batch.batch[key] = value
        phases = {key: batch.batch[key] for _, key in PHASES if key in batch.batch.keys()}
        path = record_path(self.run_dir, self.step)
        save_record(path, {"step": self.step, "input": self.batch, "phases": phases, "config": config_yaml})
        return path


# A record loads with torch.load(weights_only=True), as every file this project reads (no code runs on load):
# tensors stay tensors; the per-row values (strings, numbers, dicts of them) and the metadata go as JSON.


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    raise TypeError(f"a replay record keeps per-row values and metadata as JSON; {type(value).__name__} is not")


def _column(spec: dict[str, Any]) -> np.ndarray:
    if spec["dtype"] != "object":
        return np.array(spec["values"], dtype=spec["dtype"]).reshape(spec["shape"])
    column = np.empty(len(spec["values"]), dtype=object)  # row by row: lists stay one value per row
    column[:] = [None] * len(column)
    for i, value in enumerate(spec["values"]):
        column[i] = value
    return column


def save_record(path: Path, record: dict[str, Any]) -> None:
    batch = record["input"]
    rows = {k: {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.tolist()}
            for k, v in batch.non_tensor_batch.items()}
    out = {"step": record["step"], "config": record["config"], "phases": dict(record["phases"]),
           "tensors": dict(batch.batch.items()), "rows": json.dumps(rows, default=_jsonable),
           "meta_info": json.dumps(batch.meta_info, default=_jsonable)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(out, tmp)
    tmp.replace(path)  # a reader never sees half a record


def load_record(path: Path) -> dict[str, Any]:
    """``{"step", "config", "phases", "input"}``, ``input`` the batch as a DataProto."""
    from rlfoundry.protocol import DataProto

    raw = torch.load(path, map_location="cpu", weights_only=True)
    rows = {k: _column(spec) for k, spec in json.loads(raw["rows"]).items()}
    batch = DataProto.from_dict(tensors=raw["tensors"], non_tensors=rows, meta_info=json.loads(raw["meta_info"]))
    return {"step": raw["step"], "config": raw["config"], "phases": raw["phases"], "input": batch}


# ───────────────────────────────────── comparing ─────────────────────────────────────


@dataclass
class Divergence:
    where: str  # a phase, or "update" for the checkpoint after the step
    tensor: str
    detail: str

    def __str__(self) -> str:
        return f"{self.where}: {self.tensor} {self.detail}"


def tensor_difference(name: str, want: Any, got: Any) -> str | None:
    """None when equal bit for bit (NaNs in the same places count as equal); else what differs."""
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None if _plain_equal(want, got) else f"{name}: {want!r} != {got!r}"
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"{name}: shape/dtype {tuple(want.shape)} {want.dtype} != {tuple(got.shape)} {got.dtype}"
    if torch.equal(want, got) or (want.is_floating_point() and torch.equal(want.nan_to_num(), got.nan_to_num())
                                  and torch.equal(want.isnan(), got.isnan())):
        return None
    diff = (want.double() - got.double()).abs().nan_to_num(float("inf"))
    first = tuple(int(i) for i in torch.nonzero(diff)[0].tolist()) if diff.ndim else ()
    return f"{name}: max |Δ| {diff.max().item():.3g} over {int((diff > 0).sum())} element(s), first at {first}"


def _plain_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays and the like: compare their reprs
        return repr(a) == repr(b)


def compare_phases(recorded: dict[str, torch.Tensor], batch: Any) -> Divergence | None:
    """The first phase whose tensor differs from the record (or that one computed and the other did not)."""
    keys = set(batch.batch.keys())
    for phase, key in PHASES:
        if (key in recorded) != (key in keys):
            return Divergence(phase, key, "computed by " + ("the run only" if key in recorded else "the replay only"))
        if key in recorded and (why := tensor_difference(key, recorded[key], batch.batch[key])):
            return Divergence(phase, key, why.split(": ", 1)[1])
    return None


def load_checkpoint_tensors(role_dir: Path) -> dict[str, Any]:
    """Every tensor a role's checkpoint holds, by a stable name: its torch.distributed.checkpoint directories
    (any layout, read without a process group) and its ``.pt`` files."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for meta in sorted(role_dir.rglob(".metadata")):
            flat = Path(tmp) / "dcp.pt"
            dcp_to_torch_save(meta.parent, flat)
            prefix = str(meta.parent.relative_to(role_dir))
            out |= {f"{prefix}/{k}": v for k, v in _flatten(torch.load(flat, weights_only=True)).items()}
    for pt in sorted(role_dir.rglob("*.pt")):
        out |= {f"{pt.relative_to(role_dir)}/{k}": v for k, v in _flatten(torch.load(pt, weights_only=True)).items()}
    return out


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flatten(v, f"{prefix}{k}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _flatten(v, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj}


# the sampling side of a checkpoint (random-number states, the rollout's call count): the replay trains on the
# recorded batch and samples nothing, so these stay where the step before left them
_SAMPLING_SIDE = ("rng/", "rollout.")


def compare_checkpoints(run_step: Path, replay_step_dir: Path) -> Divergence | None:
    """The first tensor (in name order, role by role) of the replay's checkpoint that differs from the run's."""
    for role in sorted(p.name for p in run_step.iterdir() if p.is_dir()):
        want, got = load_checkpoint_tensors(run_step / role), load_checkpoint_tensors(replay_step_dir / role)
        for name in sorted(set(want) | set(got)):
            if any(part in name for part in _SAMPLING_SIDE):
                continue
            if name not in want or name not in got:
                return Divergence("update", f"{role}/{name}", "present in " + ("the run only" if name in want else "the replay only"))
            if why := tensor_difference(name, want[name], got[name]):
                return Divergence("update", f"{role}/{why.split(': ', 1)[0]}", why.split(": ", 1)[1])
    return None
