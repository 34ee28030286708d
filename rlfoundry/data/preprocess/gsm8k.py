"""GSM8K -> verl parquet: the question plus verl's instruction; ground truth = the number after ``####``.

    python -m rlfoundry.data.preprocess gsm8k --input ../shared/data/gsm8k --output ~/data/gsm8k
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rlfoundry.data.preprocess.common import (
    PreprocessError,
    load_hub_dataset,
    read_split_records,
    require_keys,
    verl_row,
    write_splits,
)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"####\s*(-?[0-9.,]+)")


def extract_ground_truth(answer: str) -> str:
    """``"... #### 1,234"`` -> ``"1234"`` (thousands separators dropped, as verl does)."""
    found = _FINAL.findall(answer)
    if not found:
        raise PreprocessError(f"GSM8K answer has no '#### <number>' line: {answer[-120:]!r}")
    return found[-1].replace(",", "").rstrip(".")


def make_row(record: dict, split: str, index: int) -> dict:
    require_keys(record, ("question", "answer"), f"gsm8k {split} row {index}")
    question, answer = record["question"], record["answer"]
    extra = {"split": split, "index": index, "answer": answer, "question": question}
    return verl_row(DATA_SOURCE, f"{question} {INSTRUCTION}", "math", extract_ground_truth(answer), extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=["train", "test"], help="split of a single --input file")


def run(args: argparse.Namespace) -> dict[str, Path]:
    if args.input:
        records = read_split_records(Path(args.input), args.split)
    else:
        records = load_hub_dataset(DATA_SOURCE, "main")
    return write_splits(records, Path(args.output), make_row)
