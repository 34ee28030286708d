"""``rlfoundry plan [--gpu NAME ...] [--config-name NAME] [key=value ...]``: per-rank memory and step
time of a run before it starts, from the model's config.json alone (docs/plan.md).

The arguments are main_ppo's (the same config composition and validation); the hardware is
``--gpu`` (a preset, or ``cpu`` for this host) with ``trainer.nnodes`` × ``trainer.n_gpus_per_node``
ranks. Exit status: 0 fits, 1 does not fit, 2 a bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from rlfoundry.plan.hardware import PRESETS, resolve_hardware


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
    p.add_argument("--config-name")
    p.add_argument("--config-path")
    p.add_argument("overrides", nargs="*", help="main_ppo's key=value overrides")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from rlfoundry.plan.build import plan_args
    from rlfoundry.plan.model import PlanInputError
    from rlfoundry.plan.report import find_fixes, render, to_json
    from rlfoundry.trainer.config import ConfigError, load_config

    args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))  # flags anywhere
    try:
        hw = resolve_hardware(args.gpu, args.gpu_memory_gib, args.hbm_gbps, args.tflops)
        plan = plan_args(args.overrides, hw, args.config_name, args.config_path, mfu=args.mfu)
    except (ConfigError, PlanInputError, ValueError) as e:
        if os.environ.get("RLFOUNDRY_DEBUG"):
            raise
        print(f"rlfoundry plan: {e}", file=sys.stderr)
        return 2
    fixes = None
    if not plan.fits and not args.no_fixes:
        cfg = load_config(args.overrides, config_name=args.config_name, config_path=args.config_path)

        def replan(extra: list[str]):
            try:
                return plan_args([*args.overrides, *extra], hw, args.config_name, args.config_path, mfu=args.mfu)
            except (ConfigError, PlanInputError, ValueError):
                return None  # a change this run's config does not accept is not offered

        fixes = find_fixes(cfg, replan)
    print(json.dumps(to_json(plan, fixes), indent=1) if args.json else render(plan, fixes))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
