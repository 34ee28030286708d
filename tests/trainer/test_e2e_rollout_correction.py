"""``algorithm.rollout_correction`` through the trainer (the functions themselves: tests/algos/test_rollout_corr.py).

On the HF engine the rollout's log-probs are the actor's own, so the measured mismatch is ~0 and the
truncated IS weights are ~1: what the driver hands the update must be exactly the functions' output
on the batch's own log-probs. A veto threshold above every ratio removes every token from the loss:
the update must then leave the weights untouched, which fails if the mask does not reach the actor.
"""

from __future__ import annotations

import pytest
import torch

from rlfoundry.algos.rollout_corr import rollout_correction
from rlfoundry.trainer.config import ConfigError, load_config, validate_config
from tests.trainer import _e2e as E
from tests.trainer.test_e2e_reuse_logprobs import _weights

pytestmark = pytest.mark.slow

RC = "algorithm.rollout_correction"


def _run(model, run_dir, reward, *extra):
    return E.train(E.tiny_overrides(model, run_dir, f"custom_reward_function.path={reward}",
                                    "actor_rollout_ref.actor.use_rollout_log_probs=false", *extra), keep_trainer=True)


def test_the_update_gets_the_weights_and_mask_of_the_batchs_own_log_probs(tiny_model_dir, tmp_path):
    reward = E.write_reward_file(tmp_path)
    run = _run(tiny_model_dir, tmp_path / "run", reward, f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=1.5",
               f"{RC}.rollout_rs=sequence", f"{RC}.rollout_rs_threshold=3.0")
    for step, batch in enumerate(run.batches, start=1):
        record = run.step(step)
        assert abs(record["rollout_corr/kl"]) < 1e-5 and record["rollout_corr/rollout_rs_masked_fraction"] == 0
        rollout_mask = batch["attention_mask"][:, -batch["responses"].shape[1]:]
        weights, mask, _ = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], rollout_mask,
                                              rollout_is="token", rollout_is_threshold=1.5, rollout_rs="sequence",
                                              rollout_rs_threshold=3.0)
        torch.testing.assert_close(batch["rollout_is_weights"], weights, rtol=0, atol=0)
        torch.testing.assert_close(batch["response_mask"], mask.to(batch["response_mask"].dtype))
        torch.testing.assert_close(weights, rollout_mask.float(), rtol=0, atol=1e-5)  # on-policy: ρ ≈ 1


def test_vetoing_every_sequence_leaves_the_weights_untouched(tiny_model_dir, tmp_path):
    """ρ ≈ 1 < 2 on every token: every sequence is vetoed, the loss has no token, Adam moves nothing
    (weight decay off: it would shrink the weights without any gradient)."""
    reward = E.write_reward_file(tmp_path)
    extra = ("actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.optim.lr=1e-2")
    vetoed = _run(tiny_model_dir, tmp_path / "vetoed", reward, f"{RC}.rollout_token_veto_threshold=2.0", *extra)
    assert vetoed.step(1)["rollout_corr/rollout_is_veto_fraction"] == 1.0
    assert all(b["response_mask"].sum() == 0 for b in vetoed.batches)
    plain = _run(tiny_model_dir, tmp_path / "plain", reward, *extra)
    from transformers import AutoModelForCausalLM

    start = {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()}
    after_veto, after_plain = _weights(vetoed.trainer), _weights(plain.trainer)
    assert set(after_veto) == set(start) == set(after_plain)
    assert all(torch.equal(after_veto[k], start[k]) for k in start)
    assert any(not torch.equal(after_plain[k], start[k]) for k in start)  # the test can fail


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_trains_on_the_rollouts_log_probs_without_a_recompute(tiny_model_dir, tmp_path, loss_type):
    reward = E.write_reward_file(tmp_path)
    run = _run(tiny_model_dir, tmp_path / "run", reward, f"{RC}.bypass_mode=true", f"{RC}.loss_type={loss_type}",
               f"{RC}.rollout_is=token", "actor_rollout_ref.actor.ppo_epochs=2")  # 2 epochs: off-policy by the 2nd
    assert run.trainer.config.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    for step, batch in enumerate(run.batches, start=1):
        assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
        record = run.step(step)
        assert "timing_s/old_log_prob" not in record and "rollout_is_weights" not in batch  # computed in the loss
        assert record["rollout_corr/rollout_is_mean"] > 0 and abs(record["rollout_corr/kl"]) < 0.5


@pytest.mark.parametrize("overrides, message", [
    ([f"{RC}.rollout_is=tokens"], "rollout_is='tokens': one of"),
    ([f"{RC}.rollout_rs=token"], "rollout_rs needs rollout_rs_threshold > 0"),
    ([f"{RC}.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], "runs its own policy loss"),
    ([f"{RC}.loss_type=reinforce"], "applies to bypass_mode only"),
    ([f"{RC}.rollout_is=token", "actor_rollout_ref.actor.use_rollout_log_probs=true"],
     "compares the rollout's log-probs with recomputed ones"),
])
def test_bad_rollout_correction_configs_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(overrides))
