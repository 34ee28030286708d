"""Geometry3K (``hiyouga/geometry3k``) -> verl's image rows, as verl's ``examples/data_preprocess/geo3k.py``.

Each record's ``problem`` (which holds the ``<image>`` marker) plus verl's instruction (reason in
``<think>``, answer in ``\\boxed{}``) is the user message; its ``images`` column goes through as
given (the hub's ``[{"bytes", "path"}]``, or paths); ground truth = ``answer``. Scored by
``rewards/geo3k.py`` (verl's rule: 0.9 x boxed answer right + 0.1 x format).

    python -m rlfoundry.data.preprocess geo3k --input DIR_OR_FILE --output ~/data/geo3k
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfoundry.data.preprocess import common

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)


def make_row(record: dict, split: str, index: int) -> dict:
    where = f"geo3k {split} row {index}"
    common.require_keys(record, ("problem", "answer", "images"), where)
    images = record["images"]
    if not images:
        raise common.PreprocessError(f"{where}: no images (every Geometry3K problem has its diagram)")
    problem, answer = record["problem"], str(record["answer"])
    extra = {"split": split, "index": index, "answer": answer, "question": problem}
    row = common.verl_row(DATA_SOURCE, f"{problem} {INSTRUCTION}", "math", answer, extra)
    row["images"] = list(images)
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=["train", "test"], help="split of a single --input file")


def run(args: argparse.Namespace) -> dict[str, Path]:
    records = common.input_records(args, DATA_SOURCE, hub_splits=("train", "test"))
    return common.write_splits(records, Path(args.output), make_row)
