"""PF-PPO's resampling by score (algos/pf_ppo.py, verl's compute_pf_ppo_reweight_data), by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfoundry.algos.pf_ppo import compute_pf_ppo_reweight_data, pf_ppo_sample_indices, pf_ppo_weights
from rlfoundry.protocol import DataProto

EPS = 1e-8  # added to every weight


def test_weights_of_each_method():
    s = torch.tensor([1.0, -2.0, 0.0, 0.5])
    # pow 2: |s|^2 = 1, 4, 0, 0.25 (a negative score counts by its size)
    torch.testing.assert_close(pf_ppo_weights(s, "pow", 2.0), torch.tensor([1.0, 4.0, 0.0, 0.25]) + EPS)
    # pow 1: |s| = 1, 2, 0, 0.5
    torch.testing.assert_close(pf_ppo_weights(s, "pow", 1.0), torch.tensor([1.0, 2.0, 0.0, 0.5]) + EPS)
    # max_min: the max (1.0) and the min (-2.0) get 1, the rest 0
    torch.testing.assert_close(pf_ppo_weights(s, "max_min", 2.0), torch.tensor([1.0, 1.0, 0.0, 0.0]) + EPS)
    # max_random: 0.4 at the max (ties too), 0.1 elsewhere
    t = torch.tensor([3.0, 1.0, 3.0, 2.0])
    torch.testing.assert_close(pf_ppo_weights(t, "max_random", 2.0), torch.tensor([0.4, 0.1, 0.4, 0.1]) + EPS)
    # all zero: still a distribution (uniform), not all-zero weights that multinomial refuses
    torch.testing.assert_close(pf_ppo_weights(torch.zeros(3), "pow", 2.0), torch.full((3,), EPS))
    with pytest.raises(ValueError, match="reweight_method='best' is not one of"):
        pf_ppo_weights(s, "best", 2.0)


def test_draws_follow_the_weights():
    # pow 1 over |s| = 1, 3, 0, 0 -> p = 1/4, 3/4, 0, 0; B = 4 draws per call, 5000 calls = 20000 draws
    s = torch.tensor([1.0, -3.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    idx = torch.cat([pf_ppo_sample_indices(s, "pow", 1.0, generator=g) for _ in range(5000)])
    freq = torch.bincount(idx, minlength=4).float() / idx.numel()
    torch.testing.assert_close(freq, torch.tensor([0.25, 0.75, 0.0, 0.0]), atol=0.01, rtol=0)  # 4 sigma ~ 0.012
    # the same generator state draws the same rows
    a = pf_ppo_sample_indices(s, "pow", 1.0, generator=torch.Generator().manual_seed(7))
    b = pf_ppo_sample_indices(s, "pow", 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (4,)


def test_the_batch_is_resampled_row_for_row():
    # four rows; the score sits on the last token; max_min keeps only rows 0 (max 2) and 3 (min -1)
    scores = torch.tensor([[0.0, 2.0], [0.0, 0.5], [0.0, 0.0], [0.0, -1.0]])
    data = DataProto.from_dict(
        tensors={"token_level_scores": scores, "responses": torch.arange(8).view(4, 2)},
        non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object)},
        meta_info={"global_token_num": [10, 11, 12, 13], "temperature": 1.0, "pair": [1, 2]},
    )
    out = compute_pf_ppo_reweight_data(data, "max_min", 2.0, generator=torch.Generator().manual_seed(0))
    assert len(out) == 4
    rows = out.batch["responses"][:, 0].div(2).long().tolist()  # responses row r starts at 2r
    assert set(rows) <= {0, 3}
    assert list(out.non_tensor_batch["uid"]) == ["abcd"[r] for r in rows]
    assert torch.equal(out.batch["token_level_scores"], scores[rows])
    assert out.meta_info["global_token_num"] == [10 + r for r in rows]  # a per-row list follows its rows
    assert out.meta_info["temperature"] == 1.0 and out.meta_info["pair"] == [1, 2]  # other values stay
    assert list(data.non_tensor_batch["uid"]) == ["a", "b", "c", "d"]  # the input is not changed
