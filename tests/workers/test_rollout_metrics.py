"""compute_rollout_actor_probs_diff against numbers worked out by hand (main environment, no vLLM)."""

from __future__ import annotations

import math

import pytest
import torch

from rlfoundry.workers.rollout.metrics import compute_rollout_actor_probs_diff

PREFIX = "training/rollout_actor_probs_"


def _logs(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


def test_hand_numbers_with_masked_tokens_ignored():
    # Kept tokens (mask=1): rollout p = [0.5, 0.25, 0.8], actor p = [0.4, 0.25, 0.6].
    # The masked ones (0.9 vs 0.1, 0.1 vs 0.7, 0.3 vs 0.2) would dominate every statistic if counted.
    rollout = _logs([[0.5, 0.25, 0.9], [0.8, 0.1, 0.3]])
    actor = _logs([[0.4, 0.25, 0.1], [0.6, 0.7, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = compute_rollout_actor_probs_diff(rollout, actor, mask)
    # |diff| = [0.1, 0.0, 0.2]: mean 0.1, max 0.2; deviations [0, -0.1, 0.1] -> var (0.02 / 2) -> std 0.1.
    assert m[PREFIX + "diff_mean"] == pytest.approx(0.1)
    assert m[PREFIX + "diff_max"] == pytest.approx(0.2)
    assert m[PREFIX + "diff_std"] == pytest.approx(0.1)
    # In units of 1/60: x = [30, 15, 48] (mean 31), y = [24, 15, 36] (mean 25);
    # centred x = [-1, -16, 17], y = [-1, -10, 11]; r = 348 / sqrt(546 * 222).
    assert m[PREFIX + "pearson"] == pytest.approx(348 / math.sqrt(546 * 222))
    assert set(m) == {PREFIX + k for k in ("diff_mean", "diff_max", "diff_std", "pearson")}


def test_identical_scorings_give_zero_diff_and_unit_correlation():
    logp = torch.log(torch.tensor([[0.9, 0.3, 0.05], [0.6, 0.2, 0.7]]))
    m = compute_rollout_actor_probs_diff(logp, logp.clone(), torch.ones(2, 3))
    assert m[PREFIX + "diff_mean"] == 0.0 and m[PREFIX + "diff_max"] == 0.0 and m[PREFIX + "diff_std"] == 0.0
    assert m[PREFIX + "pearson"] == pytest.approx(1.0)


def test_single_token_std_is_zero_and_constant_side_gives_nan_correlation():
    m = compute_rollout_actor_probs_diff(_logs([[0.5]]), _logs([[0.25]]), torch.ones(1, 1))
    assert m[PREFIX + "diff_mean"] == pytest.approx(0.25) and m[PREFIX + "diff_std"] == 0.0
    assert math.isnan(m[PREFIX + "pearson"])  # one point: correlation undefined


def test_no_response_tokens_and_bad_shapes():
    assert compute_rollout_actor_probs_diff(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)) == {}
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_rollout_actor_probs_diff(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
