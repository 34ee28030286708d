"""A short learning test: GRPO raises the synthetic arithmetic score of a briefly SFT'd tiny model.

Recipe (≈ 30 s on 2 busy cores):
1. ``rlfoundry sft`` (the real CLI) for 60 steps on one-digit additions: the random tiny model learns
   the answer format and some sums — about 25 % of sampled answers right, so GRPO has signal and
   headroom (from a random model the score would be all zeros: no gradient at all).
2. 40 GRPO steps on the same task (16 prompts × 8 samples, lr 3e-4, 2 PPO epochs of 2 mini-batches).

Asserted: the mean training score of the last 10 steps beats the first 10 steps by > 0.05 (in
trials it rose ~0.25 → ~0.38–0.45; the noise of a 10-step mean is ~0.015). Validation accuracy is not
asserted: on 20 held-out sums this 64-wide model over-fits the 80 training sums and its *greedy*
accuracy falls while the sampled training accuracy rises — a property of the model, checked
independently of the trainer with ``scripts/make_demo_policy.py``'s evaluator.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

TASK = ["data.synthetic.digits=1", "data.synthetic.ops=+"]


@pytest.fixture(scope="module")
def sft_policy(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    args = [f"model.partial_pretrain={tiny_model_dir}", *TASK, "data.synthetic.train_size=90",
            "data.synthetic.val_size=10", "data.train_batch_size=30", "data.micro_batch_size_per_gpu=30",
            "data.max_length=32", "optim.lr=3e-3", "optim.warmup_steps_ratio=0.0", "optim.lr_scheduler=constant",
            "trainer.total_training_steps=60", "trainer.device=cpu", "trainer.logger=[file]",
            f"trainer.default_local_dir={out}", "trainer.save_freq=-1", "trainer.test_freq=-1"]
    proc = subprocess.run([sys.executable, "-m", "rlfoundry", "sft", *args], capture_output=True, text=True,
                          env=E.subprocess_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "global_step_60"


@pytest.fixture(scope="module")
def one_digit_sums(tmp_path_factory):
    from rlfoundry.data.preprocess.arithmetic import ArithmeticSpec, generate_splits, make_row
    from rlfoundry.data.preprocess.common import write_splits

    out = tmp_path_factory.mktemp("sums")
    write_splits(generate_splits(80, 20, seed=0, spec=ArithmeticSpec(digits=1, ops="+")), out, make_row)
    return out


def test_grpo_raises_the_arithmetic_score(sft_policy, one_digit_sums, tmp_path):
    run = E.train([
        f"actor_rollout_ref.model.path={sft_policy}", f"trainer.default_local_dir={tmp_path / 'rl'}",
        f"data.train_files={one_digit_sums}/train.parquet", f"data.val_files={one_digit_sums}/test.parquet",
        "data.train_batch_size=16", "data.max_prompt_length=32", "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128", "actor_rollout_ref.actor.optim.lr=3e-4",
        "algorithm.adv_estimator=grpo", "reward_model.reward_kwargs.num_workers=0",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=file",
        "trainer.total_training_steps=40",
    ])
    scores = np.array([r["critic/score/mean"] for r in run.records])
    assert len(scores) == 40
    first, last = scores[:10].mean(), scores[-10:].mean()
    assert 0.05 < first < 0.6, f"the SFT'd start should be partly right: {first:.3f}"
    print(f"arithmetic score: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last > first + 0.05, f"score did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}\n{scores.round(3)}"
    # the exact-integer scorer gives 0 or 1: the score mean is the fraction of right answers
    assert set(np.unique(np.concatenate([E.sequence_scores(b).numpy() for b in run.batches]))) <= {0.0, 1.0}


def test_the_calculator_demo_learns_to_call_its_tool(tmp_path):
    """``rlfoundry train --config-name calculator_grpo``, cut to 20 of its 40 steps: the packaged policy
    calls its calculator in ~6 % of samples (never greedily) and cannot multiply 2-digit numbers, so
    greedy validation starts near zero; GRPO with the exact-answer reward raises the share of calls
    until greedy decoding calls too (in trials 0.05 → 0.73 at step 20, 0.95 at step 40). Asserted:
    validation at step 20 beats step 0 by > 0.3, and the tool calls per trajectory rise."""
    run = E.train([f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=20",
                   "trainer.test_freq=20", "trainer.save_freq=-1", "trainer.logger=file",
                   "reward_model.reward_kwargs.num_workers=0"], config_name="calculator_grpo")
    key = "val-core/rlfoundry/arithmetic/reward/mean@1"
    val = {r["step"]: r[key] for r in run.records if key in r}
    calls = [run.step(s)["multi_turn/tool_calls/mean"] for s in range(1, 21)]
    print(f"calculator demo: validation {val}, tool calls per trajectory {np.round(calls, 2)}")
    assert val[0] < 0.15, f"the packaged policy should start near zero: {val}"
    assert val[20] > val[0] + 0.3, f"validation did not rise: {val}"
    assert np.mean(calls[-5:]) > np.mean(calls[:5]) + 0.1, calls
