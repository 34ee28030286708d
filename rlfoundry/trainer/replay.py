"""``rlfoundry replay <run_dir> --step N``: rebuild a recorded step from the checkpoint before it and compare
(docs/on_policy.md, "Replay"; the records and comparisons: ``trainer/ppo/replay.py``)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from rlfoundry.trainer.ppo.replay import (
    PHASES,
    Divergence,
    compare_checkpoints,
    compare_phases,
    load_checkpoint_tensors,
    load_record,
    record_path,
)

__all__ = ["ReplayError", "ReplayReport", "main", "replay_step"]


@dataclass
class ReplayReport:
    step: int
    phases_compared: list[str]
    tensors_compared: int
    divergence: Divergence | None

    @property
    def exact(self) -> bool:
        return self.divergence is None

    def summary(self) -> str:
        if self.exact:
            return (f"step {self.step} replayed bit for bit: {', '.join(self.phases_compared)} and the "
                    f"{self.tensors_compared} checkpoint entries after the update equal the run's")
        return f"step {self.step} diverged at {self.divergence}"


def _replay_config(record: dict[str, Any], ckpt_root: Path, work: Path) -> Any:
    from omegaconf import OmegaConf

    from rlfoundry.config import typed
    from rlfoundry.config.compose import Layer
    from rlfoundry.config.schema import PPOConfig
    from rlfoundry.trainer.config import _merge_layers

    # the run's resolved config, typed again key by key (resolving it once more changes nothing: every auto
    # is decided in it)
    cfg = typed.structured(PPOConfig)
    _merge_layers(cfg, [Layer(f"the config of step {record['step']}'s record",
                              OmegaConf.to_container(OmegaConf.create(record["config"])))])
    step, trainer = int(record["step"]), cfg.trainer
    trainer.resume_mode = "resume_path" if step > 1 else "disable"
    trainer.resume_from_path = str(ckpt_root / f"global_step_{step - 1}") if step > 1 else None
    trainer.default_local_dir, trainer.run_dir = str(work / "checkpoints"), str(work)
    trainer.replay_records, trainer.rollout_data_dir, trainer.validation_data_dir = False, None, None
    trainer.total_training_steps, trainer.val_before_train, trainer.logger = step, False, ["file"]
    return cfg


class ReplayError(RuntimeError):
    """The run directory lacks what a replay needs (a user mistake: a message, not a traceback)."""


def _inputs(run_dir: Path, step: int) -> tuple[dict[str, Any], Path]:
    from omegaconf import OmegaConf

    path = record_path(run_dir, step)
    if not path.is_file():
        raise ReplayError(f"{path}: no record of step {step}; a run writes one per step with "
                          "trainer.replay_records=true")
    record = load_record(path)
    ckpt_root = Path(OmegaConf.create(record["config"]).trainer.default_local_dir).expanduser()
    for needed in ([step - 1] if step > 1 else []) + [step]:
        if not (ckpt_root / f"global_step_{needed}").is_dir():
            raise ReplayError(f"{ckpt_root / f'global_step_{needed}'} is missing: replaying step {step} needs the "
                              f"checkpoints of steps {step - 1} and {step} (trainer.save_freq=1, and "
                              "max_actor_ckpt_to_keep large enough to keep them)")
    return record, ckpt_root


def replay_step(run_dir: str | Path, step: int, work: str | Path | None = None) -> ReplayReport:
    """Rebuild step ``step`` of the run in ``run_dir`` and compare it with what the run recorded and saved."""
    from rlfoundry.trainer.main_ppo import build_trainer

    record, ckpt_root = _inputs(Path(run_dir).expanduser(), step)
    with tempfile.TemporaryDirectory(prefix="rlfoundry-replay-") as tmp:
        work_dir = Path(work or tmp)
        trainer = build_trainer(_replay_config(record, ckpt_root, work_dir))
        try:
            trainer._load_checkpoint()
            trainer.state.global_steps = step
            batch, _ = trainer.train_on(record["input"], {})
            compared = [phase for phase, key in PHASES if key in record["phases"]]
            divergence = compare_phases(record["phases"], batch)
            trainer._save_checkpoint()
        finally:
            trainer.source.close()
        replayed = work_dir / "checkpoints" / f"global_step_{step}"
        divergence = divergence or compare_checkpoints(ckpt_root / f"global_step_{step}", replayed)
        count = sum(len(load_checkpoint_tensors(replayed / role.name)) for role in replayed.iterdir() if role.is_dir())
    return ReplayReport(step, compared, count, divergence)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="rlfoundry replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's trainer.run_dir (default: its trainer.default_local_dir)")
    parser.add_argument("--step", type=int, required=True, help="the step to replay (its record and the "
                        "checkpoints of steps N-1 and N must exist)")
    parser.add_argument("--work", default=None, help="where the replay's checkpoint goes (default: a temporary dir)")
    args = parser.parse_args(argv)
    try:
        report = replay_step(args.run_dir, args.step, args.work)
    except ReplayError as e:
        print(f"rlfoundry replay: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0 if report.exact else 1
