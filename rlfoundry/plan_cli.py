"""``rlfoundry plan [--gpu NAME ...] [--entry MODULE] [--config-name NAME] [key=value ...]``: per-rank memory
and step time of a run before it starts, from the model's config.json alone (docs/plan.md).

The arguments are main_ppo's (the same config composition and validation), or, with ``--entry``, those
of another entry module (``python -m MODULE``: its default config, pipeline and spellings); the hardware is
``--gpu`` (a preset, or ``cpu`` for this host) with ``trainer.nnodes`` × ``trainer.n_gpus_per_node``
ranks. Exit status: 0 fits, 1 does not fit, 2 a bad config.
"""
# Here, beside cli, not in rlfoundry/plan: composing the config is the trainer's, and the trainer imports the
# planner for its start-up check; ``python -m rlfoundry.plan`` runs this module (runpy, no import edge).

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlfoundry.plan.hardware import PRESETS, Hardware, resolve_hardware

if TYPE_CHECKING:
    from rlfoundry.plan.build import Plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfoundry plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="h100-80g", help=f"device preset: {', '.join(PRESETS)}, or cpu (this host)")
    p.add_argument("--gpu-memory-gib", type=float, help="device memory per GPU, replacing the preset's")
    p.add_argument("--hbm-gbps", type=float, help="device memory bandwidth, GB/s")
    p.add_argument("--tflops", type=float, help="dense bf16 peak, TFLOP/s")
    p.add_argument("--mfu", type=float, default=None, help="fraction of peak FLOP/s the matmuls reach (default 0.4)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--no-fixes", action="store_true", help="do not search for changes that would fit")
    p.add_argument("--entry", metavar="MODULE",
                   help="the entry module the arguments are for, verl's name or ours (e.g. "
                        "verl.experimental.fully_async_policy.fully_async_main); default main_ppo")
    p.add_argument("--config-name")
    p.add_argument("--config-path")
    p.add_argument("overrides", nargs="*", help="main_ppo's key=value overrides")
    return p


def plan_args(overrides: list[str], hw: Hardware, config_name: str | None = None, config_path: str | None = None,
              mfu: float | None = None) -> Plan:
    """Compose and validate the run's config exactly as ``main_ppo`` does (``trainer/config.py``), then plan it."""
    from rlfoundry.plan.build import plan_config
    from rlfoundry.trainer.config import load_config, resolve_config

    cfg = load_config(overrides, config_name=config_name, config_path=config_path)
    return plan_config(resolve_config(cfg, steps_per_epoch=1, cuda_available=hw.device == "cuda"), hw, mfu=mfu)


def main(argv: Sequence[str] | None = None) -> int:
    from rlfoundry.plan.model import PlanInputError
    from rlfoundry.plan.report import find_fixes, render, to_json
    from rlfoundry.trainer.config import ConfigError, load_config

    args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))  # flags anywhere
    try:
        hw = resolve_hardware(args.gpu, args.gpu_memory_gib, args.hbm_gbps, args.tflops)
        entry = entry_of(args.entry)
        overrides, config_name = entry.overrides(args.overrides), args.config_name or entry.config_name
        plan = plan_args(overrides, hw, config_name, args.config_path, mfu=args.mfu)
    except (ConfigError, PlanInputError, ValueError) as e:
        if os.environ.get("RLFOUNDRY_DEBUG"):
            raise
        print(f"rlfoundry plan: {e}", file=sys.stderr)
        return 2
    fixes = None
    if not plan.fits and not args.no_fixes:
        cfg = load_config(overrides, config_name=config_name, config_path=args.config_path)

        def replan(extra: list[str]):
            try:
                return plan_args([*overrides, *extra], hw, config_name, args.config_path, mfu=args.mfu)
            except (ConfigError, PlanInputError, ValueError):
                return None  # a change this run's config does not accept is not offered

        fixes = find_fixes(cfg, replan)
    print(json.dumps(to_json(plan, fixes), indent=1) if args.json else render(plan, fixes))
    return 0 if plan.fits else 1


def entry_of(module: str | None):
    """The ``Entry`` of an entry module (``ENTRY``; main_ppo's when None), named as verl or rlfoundry
    names it: ``verl.X`` is ``rlfoundry.X``, ``recipe.X`` ``rlfoundry.recipe.X``."""
    import importlib

    from rlfoundry.trainer.main_ppo import Entry

    if module is None:
        return Entry()
    head = module.split(".", 1)[0]
    ours = {"verl": "rlfoundry" + module[4:], "recipe": "rlfoundry." + module}.get(head, module)
    try:
        found = importlib.import_module(ours)
    except ModuleNotFoundError as e:
        if not ours.startswith(str(e.name)):  # the module is there; something it imports is not
            raise
        raise ValueError(f"--entry {module}: no module {ours} here; give the module of `python -m MODULE`, "
                         "e.g. verl.experimental.fully_async_policy.fully_async_main") from None
    return getattr(found, "ENTRY", Entry())


if __name__ == "__main__":
    sys.exit(main())
