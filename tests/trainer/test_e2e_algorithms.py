"""End-to-end: each algorithm trains 2–3 steps of the real trainer on the tiny model (CPU, in-process).

Every run records the batch the actor was updated on (``_e2e.train``), and each test re-derives
from that batch what the algorithm should have written — advantages, returns, rewards, the KL
coefficient — so a wrong wiring in the trainer (a key not passed, a baseline not computed, the KL
in the wrong place) fails here even when each pure function is right on its own.

Scores come from a dense test scorer (``_e2e.REWARD_FILE``): deterministic in the response text,
spread over [0, 1] for a random policy, with ``acc`` as extra info and a failure for every prompt
whose dataset index is a multiple of 3 (so reward errors and NaN extra info pass through too).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

N = 4  # rollout.n in _e2e.tiny_overrides


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    return E.write_reward_file(tmp_path_factory.mktemp("reward"))


def _train(model, tmp_path, reward_file, *extra, config_name=None):
    overrides = E.tiny_overrides(model, tmp_path / "run", f"custom_reward_function.path={reward_file}", *extra)
    return E.train(overrides, config_name=config_name)


def _outcome(batch) -> torch.Tensor:
    """(B,) sequence scores; the scorer puts them on the last valid token."""
    return E.sequence_scores(batch)


def _assert_broadcast(adv: torch.Tensor, per_row: torch.Tensor, mask: torch.Tensor) -> None:
    """Outcome estimators give every valid response token its row's scalar, and 0 after EOS."""
    expected = per_row.unsqueeze(-1) * mask
    torch.testing.assert_close(adv * mask, expected, atol=1e-5, rtol=1e-5)


def _check_reward_plumbing(run) -> None:
    """Errors counted per step, failed rows scored 0, ``reward/acc`` the NaN-mean over the others."""
    for step, batch in enumerate(run.batches, start=1):
        failed = np.array([E.scorer_fails(x) for x in batch["extra_info"]])
        record = run.step(step)
        assert record["reward/errors"] == failed.sum(), step
        assert record["reward/errors/exception"] == failed.sum(), step
        scores = _outcome(batch).numpy()
        assert np.all(scores[failed] == 0.0)
        if (~failed).any():
            assert record["reward/acc"] == pytest.approx(float(np.mean(scores[~failed] >= 0.5)))
    assert sum(run.step(s)["reward/errors"] for s in range(1, len(run.batches) + 1)) > 0, "no failure exercised"


# ─────────────────────────────────────── PPO with a critic ───────────────────────────────────────


def _gae_returns(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE by the textbook recursion over valid tokens (Schulman et al. 2016), one row at a time."""
    returns = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        adv, next_value = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            adv = delta + gamma * lam * adv
            returns[i, t] = adv + values[i, t]
            next_value = values[i, t]
    return returns


def test_ppo_gae_with_critic_packaged_config(tiny_model_dir, tiny_critic_dir, tmp_path, reward_file):
    # The packaged arithmetic_ppo overlay (gae + critic), pointed at the tiny models, 1 warm-up step.
    run = _train(tiny_model_dir, tmp_path, reward_file, f"critic.model.path={tiny_critic_dir}",
                 "algorithm.gamma=0.9", "algorithm.lam=0.8", "trainer.critic_warmup=1",
                 config_name="arithmetic_ppo")
    first, second = run.step(1), run.step(2)
    for rec in (first, second):
        assert math.isfinite(rec["critic/vf_loss"]) and rec["critic/vf_loss"] > 0
        for key in ("critic/vf_clipfrac", "critic/grad_norm", "critic/lr", "critic/values/mean",
                    "critic/vf_explained_var", "timing_s/values", "timing_s/update_critic"):
            assert key in rec, key
    # critic warm-up: the actor is not updated in step 1, it is in step 2
    assert "actor/pg_loss" not in first and "actor/pg_loss" in second

    batch = run.batches[1]
    mask, values = batch["response_mask"].float(), batch["values"]
    assert values.shape == batch["responses"].shape and values.abs().sum() > 0  # the critic wrote them
    assert torch.equal(batch["token_level_rewards"], batch["token_level_scores"])  # no KL in the reward
    expected = _gae_returns(batch["token_level_rewards"], values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(batch["returns"] * mask, expected * mask, atol=1e-5, rtol=1e-5)
    adv = batch["advantages"][mask.bool()]
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-5)  # whitened over the batch's valid tokens
    assert adv.std().item() == pytest.approx(1.0, abs=0.05)
    assert second["critic/values/mean"] == pytest.approx(values[mask.bool()].mean().item(), abs=1e-5)


# ─────────────────────────────────────── critic-free estimators ───────────────────────────────────────


def test_grpo(tiny_model_dir, tmp_path, reward_file):
    run = _train(tiny_model_dir, tmp_path, reward_file, "algorithm.adv_estimator=grpo",
                 "trainer.val_before_train=true", "trainer.test_freq=2")
    assert [r["step"] for r in run.records] == [0, 1, 2]
    # validation (step 0 and the last step): 4 prompts, greedy; indices 0 and 3 make the scorer fail.
    # Their acc is NaN, which must not make the data source's acc NaN; the failures are counted.
    for rec in (run.records[0], run.step(2)):
        assert rec["val-aux/reward/errors"] == 2
        assert math.isfinite(rec["val-core/rlfoundry/arithmetic/acc/mean@1"])
        assert math.isfinite(rec["val-core/rlfoundry/arithmetic/reward/mean@1"])
    for batch in run.batches:
        scores, mask = _outcome(batch), batch["response_mask"].float()
        expected = torch.empty_like(scores)
        for rows in E.groups(batch).values():
            assert len(rows) == N  # the n samples of a prompt share one uid
            group = scores[rows]
            expected[rows] = (group - group.mean()) / (group.std() + 1e-6)
        _assert_broadcast(batch["advantages"], expected, mask)
        assert "values" not in batch and "ref_log_prob" not in batch  # no critic, no reference
    _check_reward_plumbing(run)
    rec = run.step(1)
    assert "critic/vf_loss" not in rec and math.isfinite(rec["actor/pg_loss"])
    # one epoch in one mini-batch: the HF rollout's log-probs are the old log-probs (use_rollout_log_probs
    # auto), so no old_log_prob pass ran; test_e2e_reuse_logprobs checks they equal a recomputation
    assert "timing_s/old_log_prob" not in rec and "actor/entropy" in rec


def test_rloo(tiny_model_dir, tmp_path, reward_file):
    run = _train(tiny_model_dir, tmp_path, reward_file, "algorithm.adv_estimator=rloo")
    for batch in run.batches:
        scores = _outcome(batch)
        expected = torch.empty_like(scores)
        for rows in E.groups(batch).values():
            group = scores[rows]
            expected[rows] = group - (group.sum() - group) / (len(rows) - 1)  # leave-one-out mean
        _assert_broadcast(batch["advantages"], expected, batch["response_mask"].float())


def test_reinforce_plus_plus(tiny_model_dir, tmp_path, reward_file):
    run = _train(tiny_model_dir, tmp_path, reward_file, "algorithm.adv_estimator=reinforce_plus_plus")
    for batch in run.batches:
        mask = batch["response_mask"].bool()
        # gamma = 1 and one outcome reward: the return-to-go is the score at every valid token
        _assert_broadcast(batch["returns"], _outcome(batch), mask.float())
        # advantages: the returns whitened over the whole batch (no per-prompt baseline)
        ret, adv = batch["returns"][mask], batch["advantages"][mask]
        assert adv.mean().item() == pytest.approx(0.0, abs=1e-5)
        slope, intercept = np.polyfit(ret.numpy(), adv.numpy(), 1)
        assert slope > 0
        torch.testing.assert_close(adv, torch.tensor(slope * ret.numpy() + intercept, dtype=adv.dtype), atol=1e-4, rtol=0)


def _greedy_scores(model_dir, batch) -> torch.Tensor:
    """Each prompt's greedy response (4 tokens) under the *initial* policy, scored by the test scorer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = list(range(0, len(batch["uid"]), N))  # one row per prompt
    with torch.no_grad():
        out = model.generate(input_ids=batch["prompts"][rows], attention_mask=batch["attention_mask"][rows, :-4],
                             max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, -4:], skip_special_tokens=True)
    scores = [0.0 if E.scorer_fails(batch["extra_info"][r]) else E.dense_score(t) for r, t in zip(rows, texts)]
    return torch.tensor(scores).repeat_interleave(N)


def test_remax_subtracts_the_greedy_baseline(tiny_model_dir, tmp_path, reward_file):
    run = _train(tiny_model_dir, tmp_path, reward_file, "algorithm.adv_estimator=remax")
    for batch in run.batches:
        baseline, mask = batch["reward_baselines"], batch["response_mask"].float()
        assert baseline.shape == (len(batch["uid"]),)
        for rows in E.groups(batch).values():
            assert torch.all(baseline[rows] == baseline[rows[0]])  # one greedy answer per prompt
        # ReMax (Li et al. 2023): A = return-to-go − b(prompt); gamma 1, outcome reward -> score − b
        _assert_broadcast(batch["advantages"], _outcome(batch) - baseline, mask)
        _assert_broadcast(batch["returns"], _outcome(batch), mask)
    # step 1's baseline is the score of the initial policy's greedy answer, computed independently
    torch.testing.assert_close(run.batches[0]["reward_baselines"], _greedy_scores(tiny_model_dir, run.batches[0]))


# ─────────────────────────────────────── KL control ───────────────────────────────────────


@pytest.mark.numerics
def test_grpo_with_kl_loss(tiny_model_dir, tmp_path, reward_file):
    run = _train(tiny_model_dir, tmp_path, reward_file, "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
                 "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.optim.lr=1e-3")
    first, second = run.batches
    # step 1: the policy is still the reference, so the two log-probs agree and the KL loss is ~0
    torch.testing.assert_close(first["ref_log_prob"], first["old_log_probs"], atol=1e-5, rtol=1e-5)
    assert run.step(1)["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    # step 2: the actor moved (lr 1e-3), the frozen reference did not
    mask = second["response_mask"].bool()
    assert (second["ref_log_prob"] - second["old_log_probs"])[mask].abs().max() > 1e-3
    assert run.step(2)["actor/kl_loss"] > 1e-6
    assert "timing_s/ref" in run.step(2)
    assert torch.equal(second["token_level_rewards"], second["token_level_scores"])  # KL in the loss only


@pytest.mark.numerics
def test_pf_ppo_trains_on_the_batch_resampled_by_score(tiny_model_dir, tiny_critic_dir, tmp_path, reward_file):
    """algorithm.use_pf_ppo with max_min: the actor and critic learn from a batch of the same size
    drawn only from the rows with the batch's highest and lowest score (verl's PF-PPO, after GAE)."""
    common = ("algorithm.adv_estimator=gae", f"critic.model.path={tiny_critic_dir}", "trainer.total_training_steps=1")
    plain = _train(tiny_model_dir, tmp_path / "plain", reward_file, *common).batches[0]
    pf = _train(tiny_model_dir, tmp_path / "pf", reward_file, *common, "algorithm.use_pf_ppo=true",
                "algorithm.pf_ppo.reweight_method=max_min").batches[0]
    scores = _outcome(plain)
    assert len(set(scores.tolist())) > 2  # else max_min would keep every row and prove nothing
    extremes = {i for i, s in enumerate(scores.tolist()) if s in (scores.max().item(), scores.min().item())}
    # the same seed generates the same rows; each trained row is one of the extremes, whole
    assert len(pf["responses"]) == len(plain["responses"])
    for row in range(len(pf["responses"])):
        (src,) = [i for i in range(len(plain["responses"])) if torch.equal(plain["responses"][i], pf["responses"][row])
                  and torch.equal(plain["prompts"][i], pf["prompts"][row])]
        assert src in extremes
        for key in ("token_level_scores", "values", "advantages", "returns", "old_log_probs"):
            # the same rows scored in another batch composition: fp32 rounding; atol for values ~0
            torch.testing.assert_close(pf[key][row], plain[key][src], atol=1e-6, rtol=1e-5)


def test_ppo_kl_in_reward_with_adaptive_controller(tiny_model_dir, tiny_critic_dir, tmp_path, reward_file):
    target, horizon, init = 0.002, 10, 0.05
    run = _train(tiny_model_dir, tmp_path, reward_file, "algorithm.adv_estimator=gae",
                 f"critic.model.path={tiny_critic_dir}", "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=adaptive", f"algorithm.kl_ctrl.kl_coef={init}",
                 f"algorithm.kl_ctrl.target_kl={target}", f"algorithm.kl_ctrl.horizon={horizon}",
                 "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.total_training_steps=3")
    coeffs = [run.step(s)["actor/reward_kl_penalty_coeff"] for s in (1, 2, 3)]
    kls = [run.step(s)["actor/reward_kl_penalty"] for s in (1, 2, 3)]
    assert coeffs[0] == pytest.approx(init)
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    for s in (0, 1):
        # Ziegler et al. 2019: beta <- beta * (1 + clip(KL / target - 1, ±0.2) * batch / horizon)
        error = float(np.clip(kls[s] / target - 1.0, -0.2, 0.2))
        assert coeffs[s + 1] == pytest.approx(coeffs[s] * (1 + error * 2 * N / horizon), rel=1e-6)
        assert coeffs[s + 1] != pytest.approx(coeffs[s])
    for s, batch in enumerate(run.batches):
        mask = batch["response_mask"].float()
        kl = (batch["old_log_probs"] - batch["ref_log_prob"]) * mask
        expected = batch["token_level_scores"] - coeffs[s] * kl
        torch.testing.assert_close(batch["token_level_rewards"], expected, atol=1e-6, rtol=1e-5)
        seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
        assert kls[s] == pytest.approx(seq_kl, abs=1e-6)
    assert kls[2] > 0 and math.isfinite(run.step(3)["critic/vf_loss"])


def test_gdpo_normalises_the_reward_components_the_function_returned(tiny_model_dir, tmp_path, reward_file):
    # verl 0.9.1's gdpo: the scorer's own `score` and `acc` columns (reward_extra_info) reach the estimator;
    # each is normalised in its prompt group (GRPO), weighted 1 and .5, summed, whitened over valid tokens.
    # A failed sample (NaN in the columns) counts as failure_score = 0 in both, as its score does.
    run = _train(tiny_model_dir, tmp_path, reward_file, "algorithm.adv_estimator=gdpo",
                 "algorithm.gdpo_reward_keys=[score,acc]", "algorithm.gdpo_reward_weights=[1.0,0.5]")
    for batch in run.batches:
        mask = batch["response_mask"].float()
        failed = np.array([E.scorer_fails(x) for x in batch["extra_info"]])
        score = torch.tensor(batch["score"].astype(float), dtype=torch.float32)
        acc = torch.tensor(batch["acc"].astype(float), dtype=torch.float32)
        assert torch.equal(score, _outcome(batch)) and np.all(acc.numpy()[failed] == 0.0)
        total = torch.zeros_like(score)
        for column, weight in ((score, 1.0), (acc, 0.5)):
            for rows in E.groups(batch).values():
                group = column[rows]
                total[rows] += weight * (group - group.mean()) / (group.std() + 1e-6)
        tokens = total.unsqueeze(-1).expand_as(mask)[mask.bool()]
        expected = (total.unsqueeze(-1) - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8) * mask
        torch.testing.assert_close(batch["advantages"], expected, atol=1e-4, rtol=1e-4)
