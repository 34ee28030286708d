"""Pure phase functions of the trainer, against values derived by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfoundry.algos.core_algos import AdaptiveKLController, FixedKLController
from rlfoundry.protocol import DataProto
from rlfoundry.trainer.ppo.ray_trainer import apply_kl_penalty, balance_batch, compute_advantage


def _kl_batch() -> DataProto:
    # 2 sequences x 3 response tokens; the second has 2 valid tokens.
    return DataProto.from_dict(tensors={
        "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]]),
        "old_log_probs": torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]),
        "ref_log_prob": torch.tensor([[-1.5, -1.5, -1.5], [-2.5, -2.5, -9.0]]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    })


def test_kl_penalty_fixed_controller():
    # kl = old - ref = 0.5 on every valid token (the masked third token of row 2 counts 0, not 7).
    # beta = 0.1 -> rewards = scores - 0.05 on valid tokens; mean sequence KL = mean(0.5, 0.5) = 0.5.
    data, metrics = apply_kl_penalty(_kl_batch(), FixedKLController(0.1), kl_penalty="kl")
    expected = torch.tensor([[-0.05, -0.05, 0.95], [-0.05, 0.45, 0.0]])
    torch.testing.assert_close(data.batch["token_level_rewards"], expected)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)


def test_kl_penalty_updates_the_adaptive_controller_after_using_it():
    # e = clip(0.5 / 0.1 - 1, -0.2, 0.2) = 0.2; beta <- 0.1 * (1 + 0.2 * n_steps(=2) / horizon(=10)) = 0.104.
    # This step's rewards use the old beta (0.1), as reported in the coeff metric.
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    data, metrics = apply_kl_penalty(_kl_batch(), ctrl, kl_penalty="kl")
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert ctrl.value == pytest.approx(0.104)
    assert data.batch["token_level_rewards"][0, 0].item() == pytest.approx(-0.05)


def _outcome_batch(scores, uids, mask=None) -> DataProto:
    # outcome reward on the last valid token of 3-token responses
    rewards = torch.zeros(len(scores), 3)
    rewards[:, -1] = torch.tensor(scores)
    mask = torch.ones(len(scores), 3) if mask is None else mask
    return DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.array(uids, dtype=object)})


def test_grpo_advantage_is_group_normalised():
    # group a: scores (1, 0) -> mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071 -> A = +-0.7071
    # group b: scores (1, 1) -> mean 1, std 0 -> A = 0 / (0 + eps) = 0
    data = compute_advantage(_outcome_batch([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]), "grpo")
    adv = data.batch["advantages"]
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.70710, -0.70710, 0.0, 0.0]), atol=1e-4, rtol=0)
    assert torch.equal(adv[:, 0], adv[:, 2])  # broadcast over the response
    torch.testing.assert_close(data.batch["returns"], adv)


def test_dr_grpo_drops_the_std():
    data = compute_advantage(_outcome_batch([1.0, 0.0], ["a", "a"]), "grpo", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(data.batch["advantages"][:, 0], torch.tensor([0.5, -0.5]))


def test_rloo_uses_leave_one_out_baseline():
    # group of 3, scores (3, 0, 0): A_i = score_i - mean(others) -> (3 - 0, 0 - 1.5, 0 - 1.5)
    data = compute_advantage(_outcome_batch([3.0, 0.0, 0.0], ["g", "g", "g"]), "rloo")
    torch.testing.assert_close(data.batch["advantages"][:, 0], torch.tensor([3.0, -1.5, -1.5]))


def test_remax_subtracts_the_greedy_baseline():
    # undiscounted return-to-go of an outcome reward 1 is 1 at every valid token; baseline 0.25 -> 0.75
    data = _outcome_batch([1.0, 0.0], ["a", "b"])
    data.batch["reward_baselines"] = torch.tensor([0.25, 0.25])
    data = compute_advantage(data, "remax")
    torch.testing.assert_close(data.batch["advantages"], torch.tensor([[0.75] * 3, [-0.25] * 3]))
    torch.testing.assert_close(data.batch["returns"], torch.tensor([[1.0] * 3, [0.0] * 3]))


def test_gae_returns_with_discount():
    # values 0, reward 1 at the last token, gamma 0.5, lam 1: returns = (0.25, 0.5, 1)
    data = _outcome_batch([1.0], ["a"])
    data.batch["values"] = torch.zeros(1, 3)
    data = compute_advantage(data, "gae", gamma=0.5, lam=1.0)
    torch.testing.assert_close(data.batch["returns"], torch.tensor([[0.25, 0.5, 1.0]]))
    # advantages are the returns whitened over the 3 valid tokens: zero mean
    assert data.batch["advantages"].mean().item() == pytest.approx(0.0, abs=1e-6)


def test_pf_ppo_resamples_after_gae_only():
    # scores 2, 0.5, 0, -1 on the last token; max_min: only the rows of 2 (max) and -1 (min) are drawn
    def batch():
        data = _outcome_batch([2.0, 0.5, 0.0, -1.0], ["a", "b", "c", "d"])
        data.batch["token_level_scores"] = data.batch["token_level_rewards"].clone()
        data.batch["values"] = torch.zeros(4, 3)
        return data

    config = {"use_pf_ppo": True, "pf_ppo": {"reweight_method": "max_min", "weight_pow": 2.0}, "gamma": 1.0, "lam": 1.0}
    out = compute_advantage(batch(), "gae", config=config, generator=torch.Generator().manual_seed(0))
    assert len(out) == 4 and set(out.non_tensor_batch["uid"]) <= {"a", "d"}
    # every column moved with its row: a row's advantages are those it had before the draw
    plain = compute_advantage(batch(), "gae")
    rows = ["abcd".index(u) for u in out.non_tensor_batch["uid"]]
    torch.testing.assert_close(out.batch["advantages"], plain.batch["advantages"][rows])
    # verl applies it after GAE only: another estimator leaves the batch as it is
    grpo = compute_advantage(batch(), "grpo", config=config, generator=torch.Generator().manual_seed(0))
    assert list(grpo.non_tensor_batch["uid"]) == ["a", "b", "c", "d"]


def test_every_estimator_is_called_with_the_same_kwargs():
    # the uniform call must not break any registered estimator that our batches can feed
    base = _outcome_batch([1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b"])
    base.batch["values"] = torch.zeros(4, 3)
    base.batch["reward_baselines"] = torch.zeros(4)
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg"):
        data = DataProto.from_dict(tensors=dict(base.batch.items()), non_tensors=dict(base.non_tensor_batch))
        out = compute_advantage(data, name, gamma=1.0, lam=1.0)
        assert out.batch["advantages"].shape == (4, 3), name
        assert torch.isfinite(out.batch["advantages"]).all(), name


def test_balance_batch_gives_ranks_equal_token_counts():
    # token counts 1, 4, 2, 3 over 2 ranks: the balanced split is {4, 1} and {3, 2}, 5 tokens each
    mask = torch.zeros(4, 5, dtype=torch.long)
    for i, n in enumerate([1, 4, 2, 3]):
        mask[i, :n] = 1
    data = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(4)},
                               non_tensors={"uid": np.array(list("abcd"), dtype=object)})
    data, metrics = balance_batch(data, world_size=2)
    per_rank = data.batch["attention_mask"].sum(-1).view(2, 2).sum(-1)
    assert per_rank.tolist() == [5, 5]
    assert metrics["training/seqlen_max_rank_tokens"] == 5
    # rows move with their non-tensor columns
    assert [data.non_tensor_batch["uid"][i] for i in range(4)] == ["abcd"[r] for r in data.batch["row"].tolist()]


def test_balance_batch_over_ranks_that_do_not_divide_the_rows_balances_their_common_divisor():
    # 6 rows on 4 ranks (a data-parallel size of 2 under tensor parallel 2): gcd 2 parts of 3 rows,
    # the contiguous shares an update trains; token counts 1..6 split 21 = 10 + 11 at best
    mask = torch.zeros(6, 6, dtype=torch.long)
    for i in range(6):
        mask[i, : i + 1] = 1
    data, metrics = balance_batch(DataProto.from_dict(tensors={"attention_mask": mask}), world_size=4)
    per_share = data.batch["attention_mask"].sum(-1).view(2, 3).sum(-1)
    assert sorted(per_share.tolist()) == [10, 11]
    assert metrics["training/seqlen_max_rank_tokens"] == 11


def test_reward_metrics_pass_through_and_extra_info_is_nan_averaged():
    from rlfoundry.trainer.ppo.ray_trainer import reward_result_metrics

    # 3 samples, the second one's scorer failed: acc (1, NaN, 0) -> nanmean 0.5, not NaN;
    # strings are not metrics; a column that is NaN everywhere gives no metric at all.
    result = {
        "reward_tensor": torch.zeros(3, 2),
        "reward_extra_info": {"acc": [1.0, float("nan"), 0.0], "pred": ["4", None, "7"], "gone": [float("nan")] * 3},
        "reward_metrics": {"reward/errors": 1, "reward/errors/timeout": 1},
    }
    assert reward_result_metrics(result) == {"reward/errors": 1.0, "reward/errors/timeout": 1.0, "reward/acc": 0.5}


def test_rollout_probs_diff_only_counts_valid_tokens():
    from rlfoundry.trainer.ppo.ray_trainer import rollout_probs_diff_metrics

    # probabilities 0.5 vs 0.25 on the valid token (diff 0.25); the masked token's 1.0 vs 0 is ignored
    rollout = torch.log(torch.tensor([[0.5, 1.0]]))
    actor = torch.log(torch.tensor([[0.25, 1e-30]]))
    m = rollout_probs_diff_metrics(rollout, actor, torch.tensor([[1, 0]]))
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.25)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.25)
    # log scale: |log 0.5 - log 0.25| = log 2 on the one valid token
    assert m["training/rollout_log_probs_diff_max"] == pytest.approx(np.log(2))
    assert m["training/rollout_log_probs_diff_mean"] == pytest.approx(np.log(2))


def test_trim_prompt_padding_drops_only_columns_every_prompt_pads():
    from rlfoundry.trainer.ppo.ray_trainer import trim_prompt_padding

    # two left-padded prompts of lengths 2 and 3 in width 5: the first 2 columns are pad for both
    mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    data = DataProto.from_dict(
        {"input_ids": torch.arange(10).view(2, 5), "attention_mask": mask,
         "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"uid": ["a", "b"]}, meta_info={"k": 1},
    )
    out = trim_prompt_padding(data)
    assert out.batch["input_ids"].tolist() == [[2, 3, 4], [7, 8, 9]]
    assert out.batch["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert out.batch["position_ids"].tolist() == [[0, 0, 1], [0, 1, 2]]
    assert list(out.non_tensor_batch["uid"]) == ["a", "b"] and out.meta_info == {"k": 1}
    # a batch whose longest prompt fills the width is returned as it is
    assert trim_prompt_padding(out) is out


def test_logged_validation_samples_are_verls_choice_whatever_the_order():
    from rlfoundry.trainer.ppo.ray_trainer import val_generation_samples

    # verl sorts by input (a b c d) and shuffles with np.random.RandomState(42), which puts four
    # items in the order [1, 3, 0, 2] (b d a c); the first n are logged
    records = [{"input": p, "output": p.upper(), "score": float(i)} for i, p in enumerate("dcab")]
    assert val_generation_samples(records, 2) == [("b", "B", 3.0), ("d", "D", 0.0)]
    # the next validation (new outputs, other arrival order) logs the same prompts
    again = [{"input": p, "output": p * 2, "score": 1.0} for p in "abcd"]
    assert [s[0] for s in val_generation_samples(again, 2)] == ["b", "d"]
    assert len(val_generation_samples(records, 10)) == 4  # more than there are: all of them
