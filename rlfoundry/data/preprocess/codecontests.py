"""DeepMind CodeContests -> verl parquet: the problem statement plus an instruction; ground truth =
its stdin/stdout tests as JSON (the code reward runs them, ``rewards/code.py``).

    python -m rlfoundry.data.preprocess codecontests --input DIR_OR_FILE --output ~/data/codecontests

Input rows are the hub data set's (``deepmind/code_contests``: ``name``, ``description``,
``public_tests``, ``private_tests``, ``generated_tests``, each ``{"input": [...], "output": [...]}``),
as parquet or JSON lines. ``--tests public|public+private|all`` picks which tests score a response
(default ``public+private``); problems left with no test are dropped and counted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlfoundry.data.preprocess.common import (
    PreprocessError,
    input_records,
    require_keys,
    verl_row,
    write_splits,
)

DATA_SOURCE = "codecontests"
HUB_NAME = "deepmind/code_contests"
INSTRUCTION = ("Write a Python 3 program that reads the input from standard input and prints the answer to "
               "standard output. Put the whole program in one ```python code block.")
_TEST_SETS = {"public": ("public_tests",), "public+private": ("public_tests", "private_tests"),
              "all": ("public_tests", "private_tests", "generated_tests")}


def _tests(record: dict, keys: tuple[str, ...], where: str) -> dict[str, list[str]]:
    inputs: list[str] = []
    outputs: list[str] = []
    for key in keys:
        tests = record.get(key) or {}
        ins, outs = list(tests.get("input") or []), list(tests.get("output") or [])
        if len(ins) != len(outs):
            raise PreprocessError(f"{where}: {key} has {len(ins)} inputs but {len(outs)} outputs")
        inputs += [str(x) for x in ins]
        outputs += [str(x) for x in outs]
    return {"inputs": inputs, "outputs": outputs}


def make_row(record: dict, split: str, index: int, test_set: str = "public+private") -> dict | None:
    """One verl row, or None when the problem has no test in ``test_set``."""
    where = f"codecontests {split} row {index}"
    require_keys(record, ("description",), where)
    tests = _tests(record, _TEST_SETS[test_set], where)
    if not tests["inputs"]:
        return None
    extra = {"split": split, "index": index, "name": str(record.get("name", "")), "num_tests": len(tests["inputs"])}
    return verl_row(DATA_SOURCE, f"{record['description'].strip()}\n\n{INSTRUCTION}", "code", json.dumps(tests), extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=["train", "test", "valid"], help="split of a single --input file")
    parser.add_argument("--tests", choices=list(_TEST_SETS), default="public+private",
                        help="which of the problem's tests score a response")


def run(args: argparse.Namespace) -> dict[str, Path]:
    records = input_records(args, HUB_NAME)
    kept: dict[str, list[dict]] = {}
    for split, rows in records.items():
        made = [make_row(r, split, i, args.tests) for i, r in enumerate(rows)]
        kept[split] = [r for r in made if r is not None]
        if len(kept[split]) < len(rows):
            print(f"codecontests {split}: {len(rows) - len(kept[split])} problem(s) without tests dropped")
    return write_splits(kept, Path(args.output), lambda row, split, i: row)
