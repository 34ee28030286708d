"""GVPO through the real FSDP actor: the update does not depend on the micro-batch size (each micro-batch
holds whole groups, in row order), and the loss it reports is the formula on the batch."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.algos.gvpo import GROUP_KEY
from rlfoundry.protocol import DataProto
from rlfoundry.trainer.ppo.ray_trainer import order_groups
from tests.workers import (_one_thread, assert_same_gradients, full_params, local_worker, reassociation_bound,
                           scored_batch, step_gradients, vocab_rows, worker_config)

one_thread = _one_thread()  # autouse: the tiny model's math on one thread

TEXTS = ["abcd", "efgh", "ijkl", "mnop"]  # one prompt length: micro-batch costs differ by response only
# 4 prompts x n=2 = 8 rows; ppo_mini_batch_size=2 prompts -> 2 optimiser steps of 4 rows (2 groups) each.
# optim.eps=1e-4: see tests/workers/test_actor_update.py (Adam amplifies last-bit gradient differences)
BASE = ["actor.ppo_mini_batch_size=2", "actor.policy_loss.loss_mode=gvpo", "actor.gvpo_beta=0.1",
        "actor.optim.eps=1e-4"]


@pytest.fixture(scope="module")
def batch(tiny_model_dir, tokenizer) -> DataProto:
    """A scored batch with its rows in group order and numbered (what the trainer hands the actor)."""
    data, _ = order_groups(scored_batch(tiny_model_dir, tokenizer, TEXTS, ref=False), world_size=1)
    # each group's second response cut to one token: micro-batches of two rows compute least padding paired
    # longest-first, across groups, which is what the engine does unless told to keep the row order
    width = data.batch["responses"].shape[1]
    for key in ("response_mask", "attention_mask"):
        data.batch[key][1::2, -width + 1:] = 0
    assert data.batch["response_mask"][0::2].sum(-1).min() > 1  # the other one is longer
    return data


def _update(model_dir, batch, micro):
    group = local_worker(worker_config(model_dir, [*BASE, f"actor.ppo_micro_batch_size_per_gpu={micro}"]), role="actor")
    grads = step_gradients(group.worker.optimizer, group.worker.actor.module)
    metrics = group.update_actor(batch).meta_info["metrics"]
    return full_params(group.worker.actor.module), metrics, grads


def _first_mini_batch_loss(batch) -> float:
    """The first mini-batch's loss at the sampling weights (r = 0 there): the mean over its 2 groups of
    sum_i a_i^2 / 2 / (k - 1), k = 2, a_i the token mean of the advantage."""
    mask, adv = batch.batch["response_mask"][:4], batch.batch["advantages"][:4]
    a = (adv * mask).sum(-1) / mask.sum(-1)
    return float((0.5 * a.square() / (2 - 1)).sum() / 2)


@pytest.mark.numerics
def test_micro_batches_of_one_or_two_groups_give_the_same_update_and_the_formulas_loss(tiny_model_dir, batch):
    assert batch.batch[GROUP_KEY].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    one, two = _update(tiny_model_dir, batch, 2), _update(tiny_model_dir, batch, 4)
    (params, metrics_a, grads_a), (_, metrics_b, grads_b) = one, two
    assert len(grads_a) == len(grads_b) == len(metrics_a["actor/grad_norm"]) == 2
    tokens = int(batch.batch["input_ids"].numel())
    assert_same_gradients(grads_b[0], grads_a[0], reassociation_bound(vocab_rows(params), tokens), "first step")
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-4, abs=1e-6), key
    # the first step is taken at the weights that wrote old_log_probs: r = 0 up to float rounding
    assert metrics_a["actor/pg_loss"][0] == pytest.approx(_first_mini_batch_loss(batch), rel=1e-4)
    assert metrics_a["actor/pg_loss"][0] > 0.05  # random advantages: not a vacuous comparison


def test_rows_that_are_not_whole_groups_are_refused(tiny_model_dir, batch):
    shuffled = batch.select_idxs(torch.tensor([0, 2, 1, 3, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match="whole groups in every micro-batch: group 0 is not in consecutive rows"):
        _update(tiny_model_dir, shuffled, 2)
