"""Code rewards from unit tests (``rewards/code.py``): every kind of program gets its score and reason,
nothing a program does reaches the caller, and a training run scored this way is untouched by it."""

from __future__ import annotations

import json

import pytest

from rlfoundry.rewards import code
from rlfoundry.rewards.default import default_compute_score
from rlfoundry.sandbox.fusion import executor as code_executor

SUM_TESTS = json.dumps({"inputs": ["1 2\n", "5 7\n", "10 -3\n"], "outputs": ["3\n", "12\n", "7\n"]})


def _fenced(body: str) -> str:
    return f"Here is my solution.\n```python\n{body}\n```\nIt reads two numbers."


PROGRAMS = {  # kind -> (response, score, reason); the tests are SUM_TESTS
    "correct": (_fenced("a, b = map(int, input().split())\nprint(a + b)"), 1.0, "passed"),
    "wrong": (_fenced("a, b = map(int, input().split())\nprint(a - b)"), 0.0, "wrong_answer"),
    "one_right": (_fenced("a, b = map(int, input().split())\nprint(3)"), 1 / 3, "wrong_answer"),
    "crashing": (_fenced("raise ValueError('boom')"), 0.0, "error"),
    "syntax_error": (_fenced("print(1 +"), 0.0, "error"),
    "looping": (_fenced("while True:\n    pass"), 0.0, "timeout"),
    "forking": (_fenced("import os\nos.fork()\nprint(3)"), 0.0, "error"),
    "subprocess": (_fenced("import subprocess\nprint(subprocess.run(['echo', '3']))"), 0.0, "error"),
    "memory_hungry": (_fenced("x = bytearray(8 << 30)\nprint(len(x))"), 0.0, "memory"),
    "printing_megabytes": (_fenced("print('x' * (8 << 20))"), 0.0, "output_limit"),
    "no_code": ("", 0.0, "no_code"),
}
LIMITS = code.SandboxLimits(wall_time_s=3.0, cpu_time_s=1, memory_bytes=512 << 20, max_output_bytes=64 << 10)


@pytest.mark.parametrize("kind", list(PROGRAMS))
def test_each_kind_of_program_gets_its_score_and_reason(kind, monkeypatch):
    runs = []

    def counting_executor(*args, **kwargs):
        execute = code_executor(*args, **kwargs)
        return lambda program, limits: runs.append(1) or execute(program, limits)

    monkeypatch.setattr(code, "executor", counting_executor)
    response, score, reason = PROGRAMS[kind]
    result = code.compute_score(response, SUM_TESTS, limits=LIMITS)
    assert result["score"] == pytest.approx(score) and result["reason"] == reason, result
    assert result["acc"] == (score == 1.0) and result["total"] == 3
    # a program that hits a limit is not run again on the other tests: one limit's time, not three
    assert len(runs) == {"no_code": 0, "looping": 1, "memory_hungry": 1, "printing_megabytes": 1}.get(kind, 3)


def test_all_or_nothing_stops_at_the_first_failure_and_call_based_tests_call_the_function():
    assert code.compute_score(PROGRAMS["one_right"][0], SUM_TESTS, mode="all", limits=LIMITS)["score"] == 0.0
    assert code.compute_score(PROGRAMS["correct"][0], SUM_TESTS, mode="all", limits=LIMITS)["score"] == 1.0
    calls = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]})  # APPS wraps outputs
    assert code.compute_score(_fenced("def add(a, b):\n    return a + b"), calls, limits=LIMITS)["score"] == 1.0
    leetcode = _fenced("class Solution:\n    def add(self, a, b):\n        return a + b")
    assert code.compute_score(leetcode, calls, limits=LIMITS)["score"] == 1.0
    assert code.compute_score(_fenced("def plus(a, b):\n    return a + b"), calls, limits=LIMITS)["reason"] == "error"


def test_the_last_fenced_block_is_the_program_and_numbers_compare_as_numbers():
    text = "```python\nprint('draft')\n```\nbetter:\n```\nprint(0.30000000000000004)\n```"
    assert code.extract_code(text) == "print(0.30000000000000004)"
    tests = json.dumps({"inputs": [""], "outputs": ["0.3"]})
    assert code.compute_score(text, tests, limits=LIMITS)["score"] == 1.0
    assert code.compute_score("print(1)", json.dumps({"inputs": [""], "outputs": ["1"]}), limits=LIMITS)["score"] == 1.0


@pytest.mark.parametrize("ground_truth", ["not json", json.dumps({"inputs": ["1"]}), json.dumps([1, 2]),
                                          json.dumps({"inputs": [], "outputs": []})])
def test_rows_without_usable_tests_score_zero_with_a_reason(ground_truth):
    assert code.compute_score(PROGRAMS["correct"][0], ground_truth) == {
        "score": 0.0, "acc": False, "passed": 0, "total": 0, "reason": "bad_tests"}


@pytest.mark.parametrize("source", code.CODE_DATA_SOURCES)
def test_verl_code_data_sources_reach_the_code_reward(source):
    assert default_compute_score(source, PROGRAMS["correct"][0], SUM_TESTS)["score"] == 1.0


# ---- the data set and a training run --------------------------------------------------------------

PROBLEMS = [  # CodeContests' row layout, written here (no hub): name, description, test sets
    {"name": "sum", "description": "Read two integers and print their sum.",
     "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
     "private_tests": {"input": ["5 7\n", "10 -3\n"], "output": ["12\n", "7\n"]},
     "generated_tests": {"input": ["0 0\n"], "output": ["0\n"]}},
    {"name": "no tests", "description": "Nothing to check.", "public_tests": {"input": [], "output": []},
     "private_tests": {"input": [], "output": []}, "generated_tests": {"input": [], "output": []}},
]


def _preprocess(tmp_path, tests: str = "public+private"):
    import pyarrow.parquet as pq

    from rlfoundry.data.preprocess.__main__ import main as preprocess_main

    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    for split in ("train", "test"):
        (raw / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS * 6))
    out = tmp_path / f"rows-{tests}"
    assert preprocess_main(["codecontests", "--input", str(raw), "--output", str(out), "--tests", tests]) == 0
    return out, pq.read_table(out / "train.parquet").to_pylist()


def test_codecontests_rows_carry_the_chosen_tests_and_drop_problems_without_any(tmp_path):
    _, rows = _preprocess(tmp_path)
    assert len(rows) == 6 and {r["data_source"] for r in rows} == {"codecontests"}  # "no tests" dropped
    truth = json.loads(rows[0]["reward_model"]["ground_truth"])
    assert truth == {"inputs": ["1 2\n", "5 7\n", "10 -3\n"], "outputs": ["3\n", "12\n", "7\n"]}
    assert rows[0]["prompt"][0]["content"].startswith("Read two integers") and rows[0]["ability"] == "code"
    _, every = _preprocess(tmp_path, "all")
    assert len(json.loads(every[0]["reward_model"]["ground_truth"])["inputs"]) == 4


# The policy cannot write programs, so this reward file swaps each response for a program of the kind
# its prompt's row index picks and scores it with the real code reward, in the real reward pool.
_REWARD_FILE = '''
import json
from rlfoundry.rewards.code import SandboxLimits, compute_score as code_score
from tests.rewards.test_code import PROGRAMS

KINDS = ["correct", "one_right", "looping", "forking", "memory_hungry", "crashing"]
LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=1, memory_bytes=512 << 20, max_output_bytes=64 << 10)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = KINDS[int(extra_info["index"]) // 2 % len(KINDS)]  # the kept rows are the even ones: one kind each
    return {**code_score(PROGRAMS[kind][0], ground_truth, limits=LIMITS), "kind": KINDS.index(kind)}
'''


@pytest.mark.slow
def test_a_grpo_run_scored_by_programs_that_crash_loop_fork_and_hog_memory_goes_on(tiny_model_dir, tmp_path):
    from tests.trainer import _e2e as E

    data, _ = _preprocess(tmp_path)
    (tmp_path / "reward.py").write_text(_REWARD_FILE)
    run = E.train(E.tiny_overrides(tiny_model_dir, tmp_path / "run", f"data.train_files={data}/train.parquet",
                                   f"data.val_files={data}/test.parquet", "data.max_prompt_length=256",
                                   f"custom_reward_function.path={tmp_path / 'reward.py'}",
                                   "reward_model.reward_kwargs.num_workers=2", "reward_model.reward_kwargs.timeout_s=30",
                                   "data.train_batch_size=3", "actor_rollout_ref.rollout.n=2",
                                   "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"))
    assert [r["step"] for r in run.records if "actor/pg_loss" in r] == [1, 2]
    expected = {kind: PROGRAMS[kind][1] for kind in PROGRAMS}
    kinds = ["correct", "one_right", "looping", "forking", "memory_hungry", "crashing"]
    seen = set()
    for batch in run.batches:
        scores = E.sequence_scores(batch).tolist()
        for score, info in zip(scores, batch["extra_info"]):
            kind = kinds[int(info["index"]) // 2 % len(kinds)]
            assert score == pytest.approx(expected[kind]), (kind, score)
            seen.add(kind)
    assert seen == set(kinds)  # the 6 problems, one kind each, all trained on in the epoch's 2 steps
    assert all(r.get("reward/errors", 0) == 0 for r in run.records if "actor/pg_loss" in r)
