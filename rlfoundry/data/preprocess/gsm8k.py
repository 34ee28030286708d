"""GSM8K -> verl parquet: the question plus verl's instruction; ground truth = the number after ``####``.

    python -m rlfoundry.data.preprocess gsm8k --input ../shared/data/gsm8k --output ~/data/gsm8k
    ... --multiturn tool          # rows for the answer tool (rlfoundry/config/tools/gsm8k.yaml)
    ... --multiturn interaction   # rows for the retrying user (rlfoundry/config/interactions/gsm8k.yaml)

The multi-turn variants are verl's ``gsm8k_multiturn_w_tool`` / ``_w_interaction`` layouts: a system
message saying how to answer, ``agent_name: tool_agent``, and the ground truth where the tool
(``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs``) or the interaction
(``extra_info.interaction_kwargs``) reads it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rlfoundry.data.preprocess.common import (
    PreprocessError,
    input_records,
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


SYSTEM = {
    "tool": "You are a math expert. Solve the question step by step. Before your final answer, check it at "
            "least once with the calc_gsm8k_reward tool and revise it if needed. Give the final answer as "
            "#### <answer>.",
    "interaction": "You are a math expert. Solve the question step by step and give the final answer as "
                   "#### <answer>. If you are told the answer is wrong, think again and answer again.",
}


def make_row(record: dict, split: str, index: int, multiturn: str = "none") -> dict:
    require_keys(record, ("question", "answer"), f"gsm8k {split} row {index}")
    question, answer = record["question"], record["answer"]
    truth = extract_ground_truth(answer)
    extra = {"split": split, "index": index, "answer": answer, "question": question}
    row = verl_row(DATA_SOURCE, f"{question} {INSTRUCTION}", "math", truth, extra)
    if multiturn == "none":
        return row
    row["prompt"] = [{"role": "system", "content": SYSTEM[multiturn]}, *row["prompt"]]
    row["agent_name"] = "tool_agent"
    if multiturn == "tool":
        extra["need_tools_kwargs"] = True
        extra["tools_kwargs"] = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
    else:
        extra["interaction_kwargs"] = {"name": "gsm8k", "query": question, "ground_truth": truth}
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=["train", "test"], help="split of a single --input file")
    parser.add_argument("--multiturn", choices=["none", "tool", "interaction"], default="none",
                        help="rows for the GSM8K answer tool or the retrying user (see the module docstring)")


def run(args: argparse.Namespace) -> dict[str, Path]:
    records = input_records(args, DATA_SOURCE, "main")
    multiturn = getattr(args, "multiturn", "none")
    return write_splits(records, Path(args.output), lambda r, split, i: make_row(r, split, i, multiturn))
