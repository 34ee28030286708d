"""MATH-style jsonl (``problem``, ``solution`` with ``\\boxed{}`` and/or ``answer``) -> verl parquet.

    python -m rlfoundry.data.preprocess math --input ../shared/data/math500 --output ~/data/math500

The ground truth is the last ``\\boxed{}`` of the reference solution (verl's rule), or the
``answer`` field when the solution has no box.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfoundry.data.preprocess.common import (
    PreprocessError,
    input_records,
    require_keys,
    verl_row,
    write_splits,
)
from rlfoundry.rewards.math import last_boxed_only_string, remove_boxed

DEFAULT_DATA_SOURCE = "HuggingFaceH4/MATH-500"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
_PASSTHROUGH = ("subject", "level", "unique_id", "type")


def extract_ground_truth(record: dict, where: str) -> str:
    boxed = last_boxed_only_string(record.get("solution") or "")
    if boxed is not None:
        return remove_boxed(boxed)
    if record.get("answer") not in (None, ""):
        return str(record["answer"])
    raise PreprocessError(f"{where}: the solution has no \\boxed{{}} answer and there is no 'answer' field")


def make_row_fn(data_source: str):
    def make_row(record: dict, split: str, index: int) -> dict:
        where = f"math {split} row {index}"
        require_keys(record, ("problem",), where)
        extra = {"split": split, "index": index, "question": record["problem"]}
        extra["solution"] = record.get("solution") or ""
        extra.update({k: str(record[k]) for k in _PASSTHROUGH if k in record})
        content = f"{record['problem']} {INSTRUCTION}"
        return verl_row(data_source, content, "math", extract_ground_truth(record, where), extra)

    return make_row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=["train", "test"], help="split of a single --input file")
    parser.add_argument(
        "--data-source",
        default=DEFAULT_DATA_SOURCE,
        help="data_source written to each row (and the hub name loaded when --input is omitted); "
        "e.g. DigitalLearningGmbH/MATH-lighteval",
    )


def run(args: argparse.Namespace) -> dict[str, Path]:
    records = input_records(args, args.data_source)
    return write_splits(records, Path(args.output), make_row_fn(args.data_source))
