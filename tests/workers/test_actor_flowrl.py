"""The actor's FlowRL update (``policy_loss.loss_mode=flowrl``): the same step whatever the micro-batch size
(the log Z head and the policy alike), the old log-probs weighing an off-policy step only, and a policy the head
cannot read refused with the key."""

from __future__ import annotations

import pytest

from rlfoundry.protocol import DataProto
from tests.workers import (assert_same_gradients, local_worker, one_thread, reassociation_bound,  # noqa: F401
                           scored_batch, step_gradients, vocab_rows, worker_config)

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
# proj_layer=1: a head without dropout, so micro-batch sizes draw no different masks
FLOWRL = ["actor.policy_loss.loss_mode=flowrl", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.0",
          "actor.proj_layer=1", "actor.optim.eps=1e-4"]


@pytest.fixture(scope="module")
def batch(tiny_model_dir, tokenizer) -> DataProto:
    return scored_batch(tiny_model_dir, tokenizer, TEXTS)


def _update(model_dir, batch, overrides):
    group = local_worker(worker_config(model_dir, FLOWRL + overrides), role="actor")
    grads = step_gradients(group.worker.optimizer, group.worker.actor.module)
    return group.update_actor(batch).meta_info["metrics"], grads


@pytest.mark.numerics
def test_micro_batch_1_vs_4_gives_the_same_step_head_included(tiny_model_dir, batch):
    """Each micro-batch divides by the mini-batch's sequence count: a micro-batch summed twice or dropped moves the
    loss by a quarter of a mini-batch's rows."""
    one, grads_one = _update(tiny_model_dir, batch, ["actor.ppo_micro_batch_size_per_gpu=1"])
    four, grads_four = _update(tiny_model_dir, batch, ["actor.ppo_micro_batch_size_per_gpu=4"])
    assert any(name.startswith("proj_z.") for name in grads_four[0])  # the head takes gradient, through the optimiser
    bound = reassociation_bound(vocab_rows(grads_four[0]), int(batch.batch["input_ids"].numel()))
    assert_same_gradients(grads_one[0], grads_four[0], bound, "first step")
    for key in ("actor/pg_loss", "actor/log_z", "actor/grad_norm"):
        assert one[key] == pytest.approx(four[key], rel=1e-4, abs=1e-6), key


def test_off_policy_steps_weigh_by_the_sequence_ratio(tiny_model_dir, batch):
    """Two mini-batches: not on-policy (verl's rule), so the weight is exp(sum_t (log pi - old)). The first step
    runs at the weights that scored old_log_probs (weight 1, to float rounding); the second after one optimiser
    step, where the ratio has moved off 1."""
    metrics, _ = _update(tiny_model_dir, batch, ["actor.ppo_mini_batch_size=2"])
    first, second = metrics["actor/importance_weight"]
    assert first == pytest.approx(1.0, abs=1e-4)
    assert abs(second - 1.0) > 1e-3


def test_on_policy_step_takes_its_own_log_probs_as_old(tiny_model_dir, batch):
    """One mini-batch, one epoch: old_log_probs are not read (verl's on-policy rule); shifted ones change nothing."""
    shifted = batch.select(deepcopy=True)
    shifted.batch["old_log_probs"] = shifted.batch["old_log_probs"] - 0.5
    plain, _ = _update(tiny_model_dir, batch, ["actor.ppo_mini_batch_size=4"])
    moved, _ = _update(tiny_model_dir, shifted, ["actor.ppo_mini_batch_size=4"])
    assert plain["actor/importance_weight"] == moved["actor/importance_weight"] == [1.0]
    assert plain["actor/pg_loss"] == pytest.approx(moved["actor/pg_loss"], rel=1e-6)


def test_a_vision_language_policy_is_refused_naming_the_key(tiny_vlm_dir):
    from rlfoundry.config.typed import ConfigError

    with pytest.raises(ConfigError, match=r"policy_loss\.loss_mode=flowrl with a vision-language model"):
        local_worker(worker_config(tiny_vlm_dir, FLOWRL), role="actor")
