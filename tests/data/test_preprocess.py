"""Preprocessing of the real GSM8K / MATH-500 files and the synthetic arithmetic task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlfoundry.data.preprocess import arithmetic
from rlfoundry.data.preprocess.__main__ import main as preprocess_main
from rlfoundry.data.preprocess.gsm8k import INSTRUCTION as GSM8K_INSTRUCTION
from rlfoundry.rewards import arithmetic as arithmetic_scorer
from rlfoundry.rewards.math import last_boxed_only_string, remove_boxed


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_gsm8k_row_counts_and_known_rows(gsm8k_dir: Path, shared_data: Path) -> None:
    train, test = _rows(gsm8k_dir / "train.parquet"), _rows(gsm8k_dir / "test.parquet")
    assert (len(train), len(test)) == (7473, 1319)
    # train row 0: "Natalia sold 48/2 = 24 ... 48+24 = 72 ... #### 72"
    assert train[0]["reward_model"] == {"style": "rule", "ground_truth": "72"}
    # train row 345 ends "#### 1,080": thousands separator dropped
    assert train[345]["reward_model"]["ground_truth"] == "1080"
    # test row 146 ends "#### 2,125"; test row 489 ends "#### -10" (temperature)
    assert test[146]["reward_model"]["ground_truth"] == "2125"
    assert test[489]["reward_model"]["ground_truth"] == "-10"
    raw = json.loads((shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    row = test[0]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": raw["question"] + " " + GSM8K_INSTRUCTION}]
    assert row["extra_info"] == {"split": "test", "index": 0, "answer": raw["answer"], "question": raw["question"]}
    assert row["reward_model"]["ground_truth"] == "18"


def test_gsm8k_single_file_and_hf_parquet_layout(shared_data: Path, tmp_path: Path) -> None:
    # HF layout: main/test-00000-of-00001.parquet with question/answer columns
    hf = tmp_path / "hf" / "main"
    hf.mkdir(parents=True)
    raw = [json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:5]]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(raw), hf / "test-00000-of-00001.parquet")
    assert preprocess_main(["gsm8k", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "o1")]) == 0
    assert [r["reward_model"]["ground_truth"] for r in _rows(tmp_path / "o1" / "test.parquet")] == [
        "18", "3", "70000", "540", "20"
    ]
    assert not (tmp_path / "o1" / "train.parquet").exists()
    # a single file whose name says nothing about the split needs --split
    single = tmp_path / "gsm.jsonl"
    single.write_text("\n".join(json.dumps(r) for r in raw))
    assert preprocess_main(["gsm8k", "--input", str(single), "--output", str(tmp_path / "o2")]) == 2
    assert preprocess_main(["gsm8k", "--input", str(single), "--split", "train", "--output", str(tmp_path / "o2")]) == 0
    assert len(_rows(tmp_path / "o2" / "train.parquet")) == 5


def test_math500_rows_and_ground_truth(math500_dir: Path, shared_data: Path) -> None:
    rows = _rows(math500_dir / "test.parquet")
    raw = [json.loads(line) for line in (shared_data / "math500" / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 500
    assert rows[0]["data_source"] == "HuggingFaceH4/MATH-500"
    # row 0: polar coordinates of (0,3); the solution ends "\boxed{\left( 3, \frac{\pi}{2} \right)}"
    assert rows[0]["reward_model"]["ground_truth"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert rows[0]["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    assert rows[0]["extra_info"]["unique_id"] == raw[0]["unique_id"]
    # the last boxed answer of every reference solution is the data set's own `answer` field
    assert [r["reward_model"]["ground_truth"] for r in rows] == [r["answer"] for r in raw]


def test_boxed_helpers() -> None:
    text = "so $\\boxed{1}$, then \\boxed{\\frac{a}{b}} and finally \\fbox{x^{2}}."
    assert last_boxed_only_string(text) == "\\fbox{x^{2}}"
    assert remove_boxed(last_boxed_only_string(text)) == "x^{2}"
    assert remove_boxed(last_boxed_only_string("a \\boxed{\\dfrac{3}{56}} b")) == "\\dfrac{3}{56}"
    assert remove_boxed(last_boxed_only_string("answer: \\boxed 7$")) == "7"
    assert last_boxed_only_string("no box here") is None
    assert last_boxed_only_string("cut off \\boxed{\\frac{1}{") is None  # unbalanced


def test_hub_fallback_fails_clearly_offline(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "-m", "rlfoundry.data.preprocess", "gsm8k", "--output", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode != 0
    assert "--input" in proc.stderr and "openai/gsm8k" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- synthetic arithmetic ---------------------------------------------------------------------


def test_arithmetic_evaluate_precedence() -> None:
    assert arithmetic.evaluate("37+48") == 85
    assert arithmetic.evaluate("3+4*5") == 23  # * first
    assert arithmetic.evaluate("10-2-3") == 5  # left to right
    assert arithmetic.evaluate("2*3*4-5") == 19
    assert arithmetic.evaluate("7-8*0+1") == 8


def test_arithmetic_generation_is_seeded_disjoint_and_self_consistent() -> None:
    spec = arithmetic.ArithmeticSpec(digits=2, ops="+-*", num_operands=3)
    splits = arithmetic.generate_splits(300, 50, seed=3, spec=spec)
    assert splits == arithmetic.generate_splits(300, 50, seed=3, spec=spec)
    assert splits != arithmetic.generate_splits(300, 50, seed=4, spec=spec)
    train_prompts = {p for p, _ in splits["train"]}
    assert len(train_prompts) == 300 and not train_prompts & {p for p, _ in splits["test"]}
    for prompt, answer in splits["train"] + splits["test"]:
        assert prompt.endswith("=") and len(prompt) <= 9  # "dd*dd+dd=": short for a byte-level model
        assert arithmetic.evaluate(prompt[:-1]) == int(answer)
        assert arithmetic_scorer.compute_score(answer, answer) == 1.0
    # the test set depends on (seed, spec, test_size) only, not on the train size
    assert arithmetic.generate_splits(10, 50, seed=3, spec=spec)["test"] == splits["test"]
    messages, response = arithmetic.sft_pairs(1, seed=0)[0]
    assert messages[0]["role"] == "user" and messages[0]["content"].endswith("=")
    assert int(response) == arithmetic.evaluate(messages[0]["content"][:-1])


def test_arithmetic_space_too_small_is_an_error() -> None:
    spec = arithmetic.ArithmeticSpec(digits=1, ops="+", num_operands=2)  # 100 distinct problems
    assert spec.num_distinct == 100
    assert len(arithmetic.generate_problems(100, seed=0, spec=spec)) == 100
    with pytest.raises(arithmetic.PreprocessError, match="only 100 distinct"):
        arithmetic.generate_problems(101, seed=0, spec=spec)
    with pytest.raises(ValueError, match="ops"):
        arithmetic.ArithmeticSpec(ops="/")


def test_arithmetic_cli_writes_verl_rows(tmp_path: Path) -> None:
    args = ["arithmetic", "--output", str(tmp_path), "--seed", "5", "--train-size", "40", "--test-size", "10",
            "--digits", "1", "--ops", "*"]
    assert preprocess_main(args) == 0
    train, test = _rows(tmp_path / "train.parquet"), _rows(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (40, 10)
    row = test[0]
    a, b = row["extra_info"]["expression"].split("*")
    assert row["data_source"] == "rlfoundry/arithmetic"
    assert row["prompt"] == [{"role": "user", "content": f"{a}*{b}="}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(int(a) * int(b))}
    assert preprocess_main(["arithmetic", "--input", "x", "--output", str(tmp_path)]) == 2


@pytest.mark.parametrize("multiturn", ["tool", "interaction"])
def test_gsm8k_multiturn_rows_carry_the_ground_truth_where_the_tool_or_user_reads_it(shared_data: Path, tmp_path: Path,
                                                                                      multiturn: str) -> None:
    single = tmp_path / "test.jsonl"
    single.write_text((shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[0] + "\n")
    assert preprocess_main(["gsm8k", "--input", str(single), "--output", str(tmp_path / "o"),
                            "--multiturn", multiturn]) == 0
    [row] = _rows(tmp_path / "o" / "test.parquet")
    assert row["agent_name"] == "tool_agent" and [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["reward_model"]["ground_truth"] == "18"
    extra = row["extra_info"]
    if multiturn == "tool":  # the name in rlfoundry/config/tools/gsm8k.yaml
        assert extra["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "18"}}}
    else:  # the name in rlfoundry/config/interactions/gsm8k.yaml
        assert extra["interaction_kwargs"]["name"] == "gsm8k" and extra["interaction_kwargs"]["ground_truth"] == "18"
