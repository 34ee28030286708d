"""End-to-end: verl 0.9.1's optimal token baselines on the real trainer (one step, tiny model, CPU).

The actor's log-prob pass writes ``sum_pi_squared`` (``actor.calculate_sum_pi_squared``) and the
trainer hands it, with ``old_log_probs``, to the estimator. The recorded batch the actor was updated
on must hold advantages equal to the estimator function applied to that batch's own inputs, and its
``sum_pi_squared`` must be the initial model's sum softmax(logits / T)^2 at the rollout temperature
(the one step's log-prob pass runs before any update), within the float32 bound derived in
``tests/engines/test_sum_pi_squared.py``.
"""

from __future__ import annotations

import pytest
import torch

from rlfoundry.algos import core_algos
from rlfoundry.protocol import DataProto
from tests.engines.test_sum_pi_squared import T, _reference
from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    return E.write_reward_file(tmp_path_factory.mktemp("reward"))


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_one_step_advantages_are_the_estimator_on_the_actor_sum_pi_squared(tiny_model_dir, tmp_path, reward_file,
                                                                           estimator):
    overrides = E.tiny_overrides(tiny_model_dir, tmp_path / "run", f"custom_reward_function.path={reward_file}",
                                 f"algorithm.adv_estimator={estimator}",
                                 "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
                                 f"actor_rollout_ref.rollout.temperature={T}", "trainer.total_training_steps=1")
    run = E.train(overrides)
    (batch,) = run.batches
    mask = batch["response_mask"].bool()
    squares, old = batch["sum_pi_squared"], batch["old_log_probs"]
    assert "timing_s/old_log_prob" in run.step(1)  # the pass ran (the rollout's log-probs were not reused)

    # sum pi^2 >= pi(a)^2 for the sampled token a, and <= 1; what the initial model gives at temperature T
    assert torch.all(squares[mask] >= torch.exp(2 * old[mask]) * (1 - 1e-5)) and torch.all(squares[mask] <= 1 + 1e-6)
    data = DataProto.from_dict(tensors={k: batch[k] for k in ("input_ids", "attention_mask", "position_ids",
                                                               "responses")})
    logits32, _ = _reference(tiny_model_dir, data, torch.float32)
    logits64, ref = _reference(tiny_model_dir, data, torch.float64)
    bound = 8 * float((logits32.double() - logits64)[mask].abs().max()) / T + 4 * 2**-24
    assert float((squares.double() - ref)[mask].abs().max()) <= bound
    at_t1 = torch.softmax(logits64, -1).square().sum(-1)  # the tiny model is near uniform: still far apart
    assert float((at_t1 - ref)[mask].abs().max()) > 10 * bound
    assert torch.all(squares[~mask] == 0)

    fn = core_algos.get_adv_estimator_fn(estimator)
    advantages, returns = fn(batch["token_level_rewards"], batch["response_mask"], batch["uid"],
                             old_log_probs=old, sum_pi_squared=squares)
    torch.testing.assert_close(batch["advantages"], advantages, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(batch["returns"], returns, atol=1e-6, rtol=1e-6)
    # a per-token baseline: within a row the advantage is not one number (as GRPO's would be)
    varies = [(batch["advantages"][i][mask[i]].unique().numel() > 1) for i in range(len(mask)) if mask[i].sum() > 1]
    assert any(varies)
