"""The PPO actor on a tiny Qwen3-MoE, from a verl-spelled config: rollout, log-probs and an update whose
loss holds the router losses (``model.override_config.output_router_logits=true``), the same update for
micro-batches of 1 and 4 rows, and the router metrics beside verl's."""

from __future__ import annotations

import pytest

from rlfoundry.protocol import DataProto
from tests.workers import assert_same_gradients, local_worker, scored_batch, step_gradients, worker_config

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
LOSSES = ["model.override_config.output_router_logits=true", "model.override_config.router_aux_loss_coef=0.5",
          "model.override_config.router_z_loss_coef=0.1", "actor.optim.eps=1e-4", "actor.ppo_mini_batch_size=4"]


@pytest.fixture(scope="module")
def moe_batch(tiny_moe_dir, tokenizer) -> DataProto:
    return scored_batch(tiny_moe_dir, tokenizer, TEXTS, ref=False)


def _update(model_dir, batch, overrides):
    group = local_worker(worker_config(model_dir, overrides), role="actor")
    grads = step_gradients(group.worker.optimizer, group.worker.actor.module)
    return group.update_actor(batch).meta_info["metrics"], grads[0]


@pytest.mark.numerics
def test_router_losses_join_the_actor_update_the_same_for_any_micro_batch(tiny_moe_dir, moe_batch):
    one, g_one = _update(tiny_moe_dir, moe_batch, LOSSES + ["actor.ppo_micro_batch_size_per_gpu=1"])
    four, g_four = _update(tiny_moe_dir, moe_batch, LOSSES + ["actor.ppo_micro_batch_size_per_gpu=4"])
    for key in ("actor/pg_loss", "moe/aux_loss", "moe/z_loss", "moe/layer0/load_cv", "moe/layer1/routing_entropy"):
        assert one[key] == pytest.approx(four[key], abs=1e-6), key
    assert_same_gradients(g_one, g_four, 3e-5, "micro-batch 1 vs 4")  # fp32 re-association (tests/workers)
    off, g_off = _update(tiny_moe_dir, moe_batch, ["actor.optim.eps=1e-4", "actor.ppo_mini_batch_size=4"])
    assert off["moe/aux_loss"] == pytest.approx(four["moe/aux_loss"], abs=1e-6)  # reported with the losses off too
    router = "model.layers.0.mlp.gate.weight"
    assert (g_four[router] - g_off[router]).norm() > 0.1 * g_off[router].norm()  # and they move the router
