"""What a run writes besides metrics and checkpoints (verl's keys): ``trainer.rollout_data_dir`` and
``trainer.validation_data_dir`` (every training / validation sample as JSON lines, one file per step)
and ``trainer.log_val_generations`` (a few validation samples to the loggers, the same prompts every
time)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rlfoundry.utils.trajectories import read_trajectories
from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_validation_dumps_and_logged_generations(tiny_model_dir, tmp_path):
    reward = E.write_reward_file(tmp_path)
    run = E.train(E.tiny_overrides(
        tiny_model_dir, tmp_path / "run", f"custom_reward_function.path={reward}", "trainer.val_before_train=true",
        "trainer.test_freq=1", "trainer.total_training_steps=1", f"trainer.validation_data_dir={tmp_path / 'val'}",
        "trainer.log_val_generations=3", f"trainer.rollout_data_dir={tmp_path / 'train'}"))
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    dumps = {step: _jsonl(tmp_path / "val" / f"{step}.jsonl") for step in (0, 1)}  # before training, after step 1
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl", "1.jsonl"]
    for step, rows in dumps.items():
        assert len(rows) == 4  # data.synthetic.val_size=4 prompts × val_kwargs.n=1
        assert {r["step"] for r in rows} == {step}
        assert all({"input", "output", "gts", "score", "reward", "acc", "index"} <= set(r) for r in rows)
        # the reward function's extra info rides along: acc is its score >= 0.5, where it did not fail
        for r in rows:
            if not (r["index"] % 3 == 0):
                assert r["score"] == E.dense_score(r["output"]) and r["acc"] == float(r["score"] >= 0.5)
        record = next(x for x in run.records if x["step"] == step and any(k.startswith("val-aux/") for k in x))
        (mean,) = [v for k, v in record.items() if k.startswith("val-") and k.endswith("/reward/mean@1")]
        assert mean == pytest.approx(sum(r["reward"] for r in rows) / len(rows))

    # the training dump (the same writer): what step 1 trained on, its scores as the batch's
    trained = _jsonl(tmp_path / "train" / "1.jsonl")
    assert [r["score"] for r in trained] == pytest.approx(E.sequence_scores(run.batches[0]).tolist())
    assert {r["step"] for r in trained} == {1}
    # ... token for token, read back by the documented reader (docs/agents.md, "Auditing trajectories")
    E.assert_dump_is_the_batch(read_trajectories(tmp_path / "train", step=1), run.batches[0])
    for t in read_trajectories(tmp_path / "val"):  # single-turn: one sampled turn, stopped by EOS or the budget
        assert t.turns == ([("assistant", 0, len(t.response_ids))] if t.response_ids else [])
        assert t.response_mask == [1] * len(t.response_ids)
        assert t.stop_reason == ("length" if len(t.response_ids) == 4 and t.response_ids[-1] != eos else "stop")

    logged = _jsonl(tmp_path / "run" / "val_generations.jsonl")
    assert [r["step"] for r in logged] == [0, 0, 0, 1, 1, 1]
    for step in (0, 1):  # each logged sample is one of that validation's, as generated and scored
        # "reward" is the summed reward tensor; "score" is the reward function's own (extra info wins, as in verl)
        dumped = {(r["input"], r["output"], r["reward"]) for r in dumps[step]}
        assert {(r["input"], r["output"], r["score"]) for r in logged if r["step"] == step} <= dumped
    # verl's choice: the same prompts at every validation, so one prompt's answers can be followed
    assert [r["input"] for r in logged[:3]] == [r["input"] for r in logged[3:]]
