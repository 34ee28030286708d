"""verl's model merger command line on rlfoundry's exporters.

``merge`` writes one role's checkpoint (``--local_dir .../global_step_N/actor`` or ``.../critic``) as a
Hugging Face directory at ``--target_dir``: weights (safetensors), config and tokenizer. ``test`` exports
the same way into a scratch directory and compares it tensor for tensor with ``--test_hf_dir``; the first
difference (a missing or extra tensor, a shape, a value) is named and the exit code is 1.

Flags, as verl's:

- ``--backend fsdp|megatron`` must be the engine that saved the role (its ``checkpoint_complete.json``
  says); otherwise an error names both.
- ``--is-value-model``: the role must be a critic (a token-classification head); a critic merges without it.
- ``--tie-word-embedding``: the checkpoint's ``config.json`` must tie them (the config decides here).
- ``--use_cpu_initialization``: always so (the export runs on the CPU, one process); no effect.
- ``--trust-remote-code``: accepted; the model is rebuilt from the checkpoint's own ``config.json``.
- ``--hf_model_path`` (verl's older merger): the config it names must be the checkpoint's model type; the
  checkpoint's own ``huggingface/`` directory supplies config and tokenizer.
- ``--hf_upload_path`` / ``--private``: no Hugging Face Hub here; an upload path is an error.

A LoRA actor checkpoint merges into ``--target_dir`` (the adapter folded in) with the adapter alone beside it
in ``--target_dir/lora_adapter`` (verl's place for it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

BACKENDS = ("fsdp", "megatron")


class MergeError(ValueError):
    """A flag or a checkpoint this merger cannot take; the message names it and the fix."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlfoundry.model_merger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = parser.add_subparsers(dest="operation", required=True, help="merge or test")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", required=True, choices=BACKENDS, help="the engine that saved the checkpoint")
    common.add_argument("--local_dir", required=True, help="a role's checkpoint: .../global_step_N/actor (or critic)")
    common.add_argument("--tie-word-embedding", action="store_true", help="the model ties its word embeddings")
    common.add_argument("--trust-remote-code", action="store_true", help="accepted (the checkpoint's config rebuilds it)")
    common.add_argument("--is-value-model", action="store_true", help="the checkpoint is a critic (value head)")
    common.add_argument("--use_cpu_initialization", action="store_true", help="no effect: the export runs on the CPU")
    common.add_argument("--hf_model_path", default=None, help="verl's older flag: the model's HF directory")
    merge = ops.add_parser("merge", parents=[common], help="write the checkpoint as an HF directory")
    merge.add_argument("--target_dir", default="tmp", help="the HF directory to write")
    merge.add_argument("--hf_upload_path", default=None, help="not available: there is no Hub access here")
    merge.add_argument("--private", action="store_true", help="with --hf_upload_path only")
    test = ops.add_parser("test", parents=[common], help="compare the checkpoint with an HF directory")
    test.add_argument("--test_hf_dir", required=True, help="the reference HF directory")
    return parser


def _role_dir(local_dir: str) -> tuple[Path, dict]:
    from rlfoundry import checkpoint as ckpt

    path = Path(local_dir).expanduser()
    try:
        return path, ckpt.read_component_marker(path)
    except FileNotFoundError as e:
        raise MergeError(f"--local_dir {local_dir}: {e}") from None


def _hf_config(path: Path) -> dict:
    from rlfoundry.checkpoint.layout import HF_CONFIG_DIR

    config = path / HF_CONFIG_DIR / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def check_flags(args: argparse.Namespace, path: Path, marker: dict) -> None:
    """Each verl flag either holds for this checkpoint or is an error naming it."""
    saved = marker.get("engine") or "fsdp"  # the FSDP engine's marker names none (checkpoint/export.py)
    if args.backend != saved:
        raise MergeError(f"--backend {args.backend}, but {path} was saved by the {saved} engine (its "
                         f"checkpoint_complete.json); give --backend {saved}.")
    config = _hf_config(path)
    arch = (config.get("architectures") or [""])[0]
    if args.is_value_model and not arch.endswith("ForTokenClassification"):
        raise MergeError(f"--is-value-model, but {path} holds {arch or 'a model'} (not a critic's value head); "
                         "drop the flag, or point --local_dir at .../critic.")
    if args.tie_word_embedding and config and not config.get("tie_word_embeddings", False):
        raise MergeError(f"--tie-word-embedding, but {path}'s config.json has tie_word_embeddings=false; drop the flag "
                         "(the checkpoint's config decides).")
    if args.hf_model_path:
        theirs = Path(args.hf_model_path).expanduser() / "config.json"
        if not theirs.is_file():
            raise MergeError(f"--hf_model_path {args.hf_model_path}: no config.json there; give the model's HF directory "
                             "or drop the flag (the checkpoint carries its own).")
        kind = json.loads(theirs.read_text()).get("model_type")
        if config and kind != config.get("model_type"):
            raise MergeError(f"--hf_model_path {args.hf_model_path} is a {kind} model but {path} holds a "
                             f"{config.get('model_type')} model; give the checkpoint's own model or drop the flag.")
    if getattr(args, "hf_upload_path", None):
        raise MergeError(f"--hf_upload_path {args.hf_upload_path}: this machine has no Hugging Face Hub access; merge "
                         "without it and upload --target_dir yourself (huggingface-cli upload REPO DIR).")


def export_role(path: Path, marker: dict, target: Path) -> Path:
    """The role as an HF directory at ``target`` (a LoRA actor: merged, its adapter in ``target/lora_adapter``)."""
    from rlfoundry import checkpoint as ckpt

    if (marker.get("trainable_only") or marker.get("lora")) and path.name == "actor":
        from rlfoundry.cli import export

        export(path, target, "merged")
        export(path, target / "lora_adapter", "adapter")
        return target
    try:
        return ckpt.export_hf_from_checkpoint(path, target)
    except ValueError as e:
        raise MergeError(str(e)) from e


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise MergeError(f"{directory} holds no *.safetensors weights; give an HF model directory.")
    out: dict = {}
    for file in files:
        out.update(load_file(file))
    return out


def compare(merged_dir: Path, reference_dir: Path) -> list[str]:
    """Differences between two HF directories' weights, tensor by tensor (the reference's dtype; 1e-6)."""
    import torch

    mine, ref = _tensors(merged_dir), _tensors(reference_dir)
    tied = json.loads((merged_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    only = {"lm_head.weight"} if tied else set()  # a tied head may be written or left out
    problems = [f"missing in the merge: {k}" for k in sorted(ref.keys() - mine.keys() - only)]
    problems += [f"not in {reference_dir}: {k}" for k in sorted(mine.keys() - ref.keys() - only)]
    for key in sorted(ref.keys() & mine.keys()):
        a, b = mine[key].to(ref[key].dtype), ref[key]
        if a.shape != b.shape:
            problems.append(f"{key}: shape {tuple(a.shape)} in the merge, {tuple(b.shape)} in {reference_dir}")
        elif not torch.allclose(a.float(), b.float(), atol=1e-6, rtol=1e-6):
            diff = (a.float() - b.float()).abs().max().item()
            problems.append(f"{key}: values differ (largest difference {diff:.3g})")
    return problems


def run(args: argparse.Namespace) -> int:
    path, marker = _role_dir(args.local_dir)
    check_flags(args, path, marker)
    if args.operation == "merge":
        out = export_role(path, marker, Path(args.target_dir).expanduser())
        print(f"rlfoundry.model_merger: merged {path} -> {out}")
        return 0
    reference = Path(args.test_hf_dir).expanduser()
    if not reference.is_dir():
        raise MergeError(f"--test_hf_dir {args.test_hf_dir}: no such directory; give the reference HF directory.")
    with tempfile.TemporaryDirectory(prefix="model_merger_test_") as scratch:
        merged = export_role(path, marker, Path(scratch) / "merged")
        problems = compare(merged, reference)
    if problems:
        print(f"rlfoundry.model_merger: test FAILED, {path} differs from {reference}:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    print(f"rlfoundry.model_merger: test passed, {path} equals {reference} tensor for tensor")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from rlfoundry.cli import ExportError
    from rlfoundry.utils.errors import CheckpointCorruptError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (MergeError, ExportError, CheckpointCorruptError) as e:
        if os.environ.get("RLFOUNDRY_DEBUG"):
            raise
        print(f"rlfoundry.model_merger: {e}", file=sys.stderr)
        return 2
