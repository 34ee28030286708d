"""Command line: ``python -m rlfoundry.data.preprocess <task> --output DIR [--input PATH] [...]``."""

from __future__ import annotations

import argparse
import importlib
import sys

from rlfoundry.data.preprocess import TASKS
from rlfoundry.data.preprocess.common import PreprocessError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlfoundry.data.preprocess", description=__doc__)
    tasks = parser.add_subparsers(dest="task", required=True)
    for name in TASKS:
        module = importlib.import_module(f"rlfoundry.data.preprocess.{name}")
        sub = tasks.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        sub.add_argument("--input", help="file, or directory holding train*/test* files; omit to load from the hub")
        sub.add_argument("--output", required=True, help="directory for <split>.parquet")
        sub.add_argument("--seed", type=int, default=0)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = args.run(args)
    except PreprocessError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, path in written.items():
        print(f"{args.task} {split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
