"""Metric functions against numbers worked out by hand in the comments."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.trainer import metric_utils
from rlfoundry.trainer.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    marked_timer,
    multi_turn_metrics,
    process_validation_metrics,
    reduce_metrics,
)


def _batch(meta_info: dict | None = None) -> DataProto:
    """B=2, Tp=3, Tr=4. Row 0: prompt length 2 (left-padded), response length 2.
    Row 1: prompt length 3 and response length 4, i.e. both hit their budget (clip)."""
    prompt_attn = torch.tensor([[0, 1, 1], [1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    tensors = {
        "responses": torch.zeros(2, 4, dtype=torch.long),
        "attention_mask": torch.cat([prompt_attn, response_mask], dim=1),
        "response_mask": response_mask,
        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]]),
        "token_level_rewards": torch.tensor([[-0.1, 0.9, 0.0, 0.0], [-0.1, -0.1, -0.1, 0.4]]),
        # 99 / 50 / 7 sit under the mask: they must not leak into any statistic.
        "advantages": torch.tensor([[1.0, 2.0, 99.0, 99.0], [-1.0, -1.0, -1.0, -1.0]]),
        "returns": torch.tensor([[1.0, 1.0, 50.0, 50.0], [0.0, 0.0, 0.0, 0.0]]),
        "values": torch.tensor([[1.0, 1.0, 7.0, 7.0], [0.0, 0.0, 0.0, 1.0]]),
    }
    return DataProto.from_dict(tensors=tensors, meta_info=meta_info)


def test_data_metrics_by_hand():
    m = compute_data_metrics(_batch(), use_critic=True)
    # sequence scores: 1.0 and 0.5
    assert m["critic/score/mean"] == pytest.approx(0.75)
    assert (m["critic/score/max"], m["critic/score/min"]) == pytest.approx((1.0, 0.5))
    # sequence rewards: 0.8 and 0.1
    assert m["critic/rewards/mean"] == pytest.approx(0.45)
    assert (m["critic/rewards/max"], m["critic/rewards/min"]) == pytest.approx((0.8, 0.1))
    # valid advantages 1, 2, -1, -1, -1, -1 -> mean -1/6
    assert m["critic/advantages/mean"] == pytest.approx(-1 / 6)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == pytest.approx((2.0, -1.0))
    # valid returns 1, 1, 0, 0, 0, 0; valid values 1, 1, 0, 0, 0, 1
    assert m["critic/returns/mean"] == pytest.approx(1 / 3)
    assert m["critic/values/mean"] == pytest.approx(0.5)
    # residual r - v = 0,0,0,0,0,-1: unbiased var = (5/36 + 25/36)/5 = 1/6
    # var(returns) = (2*(2/3)^2 + 4*(1/3)^2)/5 = 4/15  ->  EV = 1 - (1/6)/(4/15) = 0.375
    assert m["critic/vf_explained_var"] == pytest.approx(0.375, abs=1e-4)
    # response lengths 2, 4 (budget 4); prompt lengths 2, 3 (budget 3)
    assert m["response_length/mean"] == 3.0 and m["response_length/max"] == 4.0 and m["response_length/min"] == 2.0
    assert m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/mean"] == 2.5 and m["prompt_length/clip_ratio"] == 0.5


def test_data_metrics_without_critic_has_no_value_keys():
    batch = _batch()
    batch.batch.pop("values")
    m = compute_data_metrics(batch, use_critic=False)
    assert not any(k.startswith("critic/values") for k in m) and "critic/vf_explained_var" not in m
    assert m["critic/score/mean"] == pytest.approx(0.75)


def test_data_metrics_fall_back_to_attention_mask_for_response():
    batch = _batch()
    batch.batch.pop("response_mask")
    assert compute_data_metrics(batch, use_critic=False)["response_length/mean"] == 3.0


def test_timing_metrics_per_token():
    # 5 prompt + 6 response tokens = 11 overall. gen is charged per response token: 600 ms / 6 = 100;
    # update_actor per overall token: 1100 ms / 11 = 100. "step" has no token count.
    timing = {"gen": 0.6, "update_actor": 1.1, "step": 2.0}
    m = compute_timing_metrics(_batch(), timing)
    assert m["timing_s/gen"] == 0.6 and m["timing_s/step"] == 2.0
    assert m["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(100.0)
    assert "timing_per_token_ms/step" not in m


def test_throughput_per_worker():
    # 11 valid tokens / (2 s * 2 workers) = 2.75 tokens/s/worker
    m = compute_throughout_metrics(_batch(), {"step": 2.0}, n_gpus=2)
    assert m == {"perf/total_num_tokens": 11, "perf/time_per_step": 2.0, "perf/throughput": pytest.approx(2.75)}
    # the rollout's own per-sequence count wins when present: (5 + 7) / 4 = 3
    m = compute_throughout_metrics(_batch({"global_token_num": [5, 7]}), {"step": 2.0}, n_gpus=2)
    assert m["perf/throughput"] == pytest.approx(3.0)


def _validation_inputs():
    sources = ["a", "a", "a", "a", "b", "b"]
    prompts = ["p", "p", "q", "q", "r", "r"]
    reward = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    infos = {"reward": reward, "acc": [bool(r) for r in reward], "pred": ["7", "x", "3", "3", "", ""]}
    return sources, prompts, infos


def test_validation_metrics_by_hand():
    m = process_validation_metrics(*_validation_inputs(), seed=0)
    # source a: prompt p scores (1, 0) -> 0.5, prompt q (1, 1) -> 1; mean over prompts 0.75
    assert m["val-core/a/reward/mean@2"] == pytest.approx(0.75)
    assert m["val-core/a/acc/mean@2"] == pytest.approx(0.75)
    assert m["val-core/b/reward/mean@2"] == 0.0
    # std within p = 0.5, within q = 0
    assert m["val-aux/a/reward/std@2"] == pytest.approx(0.25)
    # best of 2 draws from (1, 0): P(max = 1) = 3/4; from (1, 1): 1. Mean 0.875. Worst: 1/4 and 1 -> 0.625.
    assert m["val-aux/a/reward/best@2/mean"] == pytest.approx(0.875, abs=0.03)
    assert m["val-aux/a/reward/worst@2/mean"] == pytest.approx(0.625, abs=0.03)
    assert not any("/pred/" in k for k in m), "string columns are not metrics"


def test_validation_metrics_seeded_and_single_sample():
    args = _validation_inputs()
    assert process_validation_metrics(*args, seed=3) == process_validation_metrics(*args, seed=3)
    m = process_validation_metrics(["s", "s"], ["x", "y"], {"reward": [1.0, 0.0]})
    assert m == {"val-core/s/reward/mean@1": 0.5}


def test_validation_metrics_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="reward"):
        process_validation_metrics(["a", "a"], ["p", "p"], {"reward": [1.0]})


def test_reduce_metrics():
    assert reduce_metrics({"actor/pg_loss": [1.0, 2.0, 3.0], "actor/lr": 0.5}) == {"actor/pg_loss": 2.0, "actor/lr": 0.5}


def test_marked_timer_accumulates_and_survives_errors(monkeypatch):
    clock = itertools.count(start=10.0, step=0.5)  # each perf_counter() call advances 0.5 s
    monkeypatch.setattr(metric_utils.time, "perf_counter", lambda: next(clock))
    timing: dict[str, float] = {}
    with marked_timer("gen", timing):
        pass
    with pytest.raises(RuntimeError):
        with marked_timer("gen", timing):
            raise RuntimeError("boom")
    assert timing == {"gen": 1.0}


def test_multi_turn_metrics_count_trajectories_and_real_rows_only():
    """Rows in a balanced (shuffled) order: trajectory a, an agent's two kept conversations of three (one
    dropped); b, a lost sample (its row and a padding row, both excluded); c, a tool agent's trajectory.
    Turns average over the three real rows; each trajectory's stop counts once."""
    col = lambda *v: np.array(v, dtype=object)  # noqa: E731
    rows = {"trajectory_id": col("b", "a", "c", "b", "a"), "num_turns": col(0, 3, 5, 0, 1),
            "excluded": col(True, False, False, True, False),
            "stop_reason": col("segment_padding", "agent_done", "no_call", "agent_raised", "agent_done"),
            "segments_dropped": col(0, 1, None, 0, 1)}
    m = multi_turn_metrics(rows)
    assert (m["num_turns/mean"], m["num_turns/min"], m["num_turns/max"]) == (3.0, 1.0, 5.0)  # rows 1, 2, 4
    assert {k: v for k, v in m.items() if k.startswith("multi_turn/stop/")} == {
        "multi_turn/stop/agent_done": 1 / 3, "multi_turn/stop/agent_raised": 1 / 3, "multi_turn/stop/no_call": 1 / 3}
    assert m["multi_turn/lost_samples"] == 1.0 and m["multi_turn/segments_dropped"] == 1.0
