"""The rollout dump's records and its reader on a hand-built batch: every field derivable by hand
(the trained runs' dumps are checked against their batches in tests/trainer/test_e2e_outputs.py and
test_openai_agent_demo.py)."""

from __future__ import annotations

import json

import numpy as np
import torch

from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.utils.trajectories import generation_records, main, read_trajectories, write_generations


def _batch() -> DataProto:
    """Two rows, prompts left-padded to 3, responses right-padded to 4 (pad 0, EOS 2). Row 0: a two-turn
    trajectory, [a b] sampled, [c] a tool's answer, then the end token sampled; row 1: single-turn,
    [a b c d] filling the budget without EOS."""
    prompts = torch.tensor([[0, 7, 8], [9, 8, 7]])
    responses = torch.tensor([[101, 102, 103, 2], [101, 102, 103, 104]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    scores = torch.zeros(2, 4)
    scores[0, 3], scores[1, 3], scores[1, 0] = 1.0, 0.5, -0.25
    turns = np.empty(2, dtype=object)
    turns[:] = [[["assistant", 0, 2], ["tool", 2, 3], ["assistant", 3, 4]], None]
    results = np.empty(2, dtype=object)
    results[:] = [[{"tool": "calculator", "text": "c", "error": None}], None]
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": attention,
                 "input_ids": torch.cat([prompts, responses], -1),
                 "response_mask": torch.tensor([[1, 1, 0, 1], [1] * 4]),
                 "rollout_log_probs": torch.tensor([[-0.5, -0.25, 0.0, -1.0], [-1.0, -2.0, -3.0, -4.0]]),
                 "token_level_scores": scores},
        non_tensors={"turns": turns, "tool_results": results, "param_version": np.array([3, 4], dtype=object),
                     "stop_reason": np.array(["no_call", None], dtype=object),
                     "extra_info": np.array([{"index": 5}, {"index": 6}], dtype=object)})


def test_records_hold_the_tokens_and_the_reader_gives_them_back(tmp_path, capsys):
    tokenizer = build_tokenizer()
    batch = _batch()
    records = generation_records(batch, [1.0, 0.25], tokenizer, step=7)
    write_generations(records, tmp_path, 7)
    row0, row1 = (json.loads(line) for line in (tmp_path / "7.jsonl").read_text().splitlines())
    assert (row0["step"], row0["score"], row0["index"], row0["param_version"]) == (7, 1.0, 5, 3)  # verl's fields kept
    assert row0["output"] == tokenizer.decode([101, 102, 103, 2], skip_special_tokens=True)
    assert row0["prompt_ids"] == [7, 8] and row1["prompt_ids"] == [9, 8, 7]  # padding removed
    assert row0["response_mask"] == [1, 1, 0, 1] and row0["rollout_log_probs"] == [-0.5, -0.25, 0.0, -1.0]
    assert row0["rewards"] == [[3, 1.0]] and row1["rewards"] == [[0, -0.25], [3, 0.5]]
    assert row0["stop_reason"] == "no_call" and row1["stop_reason"] is None  # the loop's, as recorded
    assert row1["turns"] == [["assistant", 0, 4]]  # no loop column: one sampled turn

    t0, t1 = read_trajectories(tmp_path)
    assert t0.input_ids == [7, 8, 101, 102, 103, 2] and t0.trained_ids == [101, 102, 2]
    assert t0.turn_ids("tool") == [[103]] and t0.turn_ids("assistant") == [[101, 102], [2]]
    assert t0.tool_results == [{"tool": "calculator", "text": "c", "error": None}]
    assert t0.rewards == [(3, 1.0)] and t1.param_version == 4
    assert t0.text(tokenizer) == "ab⟦c⟧" + tokenizer.decode([2])
    assert read_trajectories(tmp_path, step=8) == []

    assert main([str(tmp_path / "7.jsonl")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("step 7 stop=no_call param_version=3 score=1 tokens=2+4 trained=3 "
                          "turns: assistant[0:2] tool[2:3] assistant[3:4]")


def test_single_turn_stop_reasons():
    """Without a loop's column: ``length`` when the response fills the budget without EOS, else ``stop``."""
    batch = _batch()
    del batch.non_tensor_batch["stop_reason"]
    records = generation_records(batch, [1.0, 0.25], build_tokenizer(), step=1)
    assert [r["stop_reason"] for r in records] == ["stop", "length"]
