"""The ``rlfoundry`` command: ``train | preprocess | export | report | trajectories | replay | sft | sandbox | plan``.

    rlfoundry train [key=value ...]              PPO/GRPO training (same as python -m rlfoundry.trainer.main_ppo)
    rlfoundry preprocess <task> --output DIR     write a data set as verl-format parquet
    rlfoundry export <checkpoint_dir> <hf_dir>   sharded actor checkpoint -> Hugging Face model directory
                                                 (LoRA: --format merged, the default, or adapter)
    rlfoundry report <run_dir>                   plot a run's metrics.jsonl (PNG + HTML)
    rlfoundry trajectories <dump_dir> [--step N] [--model PATH]
                                                 print trainer.rollout_data_dir's trajectories, token for token
    rlfoundry replay <run_dir> --step N          rebuild step N from the checkpoint before it and its record
                                                 (trainer.replay_records); compare phases and weights
    rlfoundry sft [key=value ...]                supervised fine-tuning
    rlfoundry sandbox serve [--host H --port P]  this project's sandbox behind SandboxFusion's HTTP API
    rlfoundry plan [--gpu h100-80g] [key=value ...]
                                                 per-rank memory and step time before renting (docs/plan.md)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# subcommand -> module whose ``main(argv) -> int`` runs it
_SUBCOMMANDS = {
    "train": "rlfoundry.trainer.main_ppo",
    "preprocess": "rlfoundry.data.preprocess.__main__",
    "report": "rlfoundry.trainer.report",
    "trajectories": "rlfoundry.utils.trajectories",
    "replay": "rlfoundry.trainer.replay",
    "sft": "rlfoundry.trainer.sft_trainer",
    "sandbox": "rlfoundry.sandbox.fusion",
    "plan": "rlfoundry.plan_cli",
}


class ExportError(RuntimeError):
    """The export source is not a checkpoint this tool can read."""


def find_actor_checkpoint(path: str | os.PathLike) -> Path:
    """Accept a run directory (newest complete step), a ``global_step_N`` dir, or its ``actor`` dir."""
    from rlfoundry import checkpoint as ckpt

    p = Path(path).expanduser()
    if p.name == "actor" and p.parent.name.startswith("global_step_"):
        p = p.parent
    if not p.name.startswith("global_step_"):
        latest = ckpt.find_latest_ckpt_path(p)
        if latest is None:
            raise ExportError(f"{p} holds no complete checkpoint (expected global_step_N/ directories "
                              "written by the trainer, or a path to one of them).")
        p = Path(latest)
    if not ckpt.is_complete_step_dir(p) or not (p / "actor").is_dir():
        raise ExportError(f"{p} is not a complete checkpoint with an actor/ directory.")
    return p


def export(checkpoint_dir: str | os.PathLike, hf_dir: str | os.PathLike, fmt: str = "merged") -> Path:
    """Load the actor's sharded checkpoint into one in-process worker and write it with ``save_pretrained``.

    A LoRA run (``model.lora_rank > 0``) exports ``--format merged`` (default: a plain HF directory, the
    adapter folded into the base) or ``--format adapter`` (a peft adapter directory for
    ``PeftModel.from_pretrained`` on the base, which the run's ``model.path`` names).

    The run's resolved config (saved in the step's ``data.pt``) says which base model to build; DCP
    reshards whatever number of ranks saved it onto this single process. An engine with a shard
    format of its own exports with its exporter (``checkpoint.engine_exporter``): a Megatron engine
    checkpoint (``strategy=megatron``) is rebuilt at tensor = pipeline = 1 from any saved layout.
    """
    from omegaconf import OmegaConf

    from rlfoundry import checkpoint as ckpt
    from rlfoundry.single_controller import ClassWithInitArgs, LocalWorkerGroup
    from rlfoundry.single_controller.base.worker import WorkerRuntime
    from rlfoundry.workers.actor_rollout_ref import ActorRolloutRefWorker

    step_dir = find_actor_checkpoint(checkpoint_dir)
    marker = ckpt.read_component_marker(step_dir / "actor")
    if fmt == "adapter" and not (marker.get("trainable_only") or marker.get("lora")):
        raise ExportError(f"{step_dir / 'actor'} holds a whole model, not a LoRA adapter: export it with "
                          "--format merged (the default)")
    exporter = ckpt.engine_exporter(marker)
    if exporter is not None:  # a Megatron LoRA checkpoint holds the base too: merged or the adapter alone
        return exporter(step_dir / "actor", hf_dir, **({"adapter_only": True} if fmt == "adapter" else {}))
    state = ckpt.load_trainer_state(step_dir / "data.pt")
    if "config" not in state:
        raise ExportError(f"{step_dir / 'data.pt'} has no saved config; it was not written by rlfoundry's trainer.")
    cfg = OmegaConf.create(state["config"])
    # the export runs on the CPU: DCP reshards any saved layout onto this one process
    worker = ClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="actor",
                               runtime=WorkerRuntime(device="cpu"))
    group = LocalWorkerGroup(worker, name_prefix="export")
    group.init_model()
    group.load_checkpoint(str(step_dir / "actor"))
    group.save_hf_model(str(hf_dir), adapter_only=fmt == "adapter")
    return Path(hf_dir)


def _export_main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="rlfoundry export", description=export.__doc__)
    parser.add_argument("checkpoint_dir", help="run dir, global_step_N dir, or global_step_N/actor")
    parser.add_argument("hf_dir", help="output Hugging Face model directory")
    parser.add_argument("--format", choices=("merged", "adapter"), default="merged",
                        help="LoRA runs: the merged model (default) or the peft adapter alone")
    args = parser.parse_args(argv)
    from rlfoundry.utils.errors import CheckpointCorruptError

    try:
        out = export(args.checkpoint_dir, args.hf_dir, args.format)
    except (ExportError, CheckpointCorruptError) as e:
        print(f"rlfoundry export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint_dir} -> {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 1
    command, rest = argv[0], argv[1:]
    if command == "export":
        return _export_main(rest)
    if command not in _SUBCOMMANDS:
        import difflib

        hint = difflib.get_close_matches(command, [*_SUBCOMMANDS, "export"], n=1)
        extra = f" Did you mean '{hint[0]}'?" if hint else ""
        print(f"rlfoundry: unknown command '{command}'.{extra}\n{__doc__}", file=sys.stderr)
        return 2
    module = importlib.import_module(_SUBCOMMANDS[command])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
