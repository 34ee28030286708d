"""``compute_prox_log_prob`` (verl's fully-async ``async_training.compute_prox_log_prob``): old log-probs under
the weights the sync period started with, from a CPU copy, without disturbing the training state."""

from __future__ import annotations

import torch

from rlfoundry.protocol import DataProto
from tests.workers import _one_thread, full_params, local_worker, make_prompts, worker_config

one_thread = _one_thread()  # tiny-model math on one thread (a shared 2-core machine)

TEXTS = ["hello world", "the quick brown fox"]


def _prox(group, data: DataProto, version: int) -> torch.Tensor:
    asked = DataProto(batch=data.batch, non_tensor_batch=data.non_tensor_batch,
                      meta_info={**data.meta_info, "prox_version": version})
    out = group.compute_prox_log_prob(asked)
    assert out.meta_info["param_version"] == version  # what scored the rows, for the mismatch audit
    return out.batch["old_log_probs"]


def _optimizer_state(worker) -> dict[str, torch.Tensor]:
    state = worker.optimizer.state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}


def test_a_later_step_of_the_sync_period_scores_under_the_periods_first_weights(tiny_model_dir, tokenizer):
    """trigger_parameter_sync_step=2: step 1 (update count 0) keeps a copy and scores with the current
    weights; step 2 (update count 1, same period) scores the same rows under that copy, so its log-probs
    equal the ones computed before step 1's update, bitwise (same kernels, same rows, same micro-batches),
    and differ from the current weights'. The weights and Adam's state after the call are the ones before it."""
    # single_rank=fsdp: real FSDP2 DTensors, so the copy and the swap go through their local shards
    overrides = ["actor.ppo_mini_batch_size=2", "actor.fsdp_config.single_rank=fsdp"]
    group = local_worker(worker_config(tiny_model_dir, overrides), role="actor_rollout")
    worker = group.worker
    assert hasattr(next(worker.actor.module.parameters()), "to_local")
    data = group.generate_sequences(make_prompts(tokenizer, TEXTS))
    # fully async: the rows come from the rollout pool, sampled with the period's first weights, whatever
    # the actor's version now (the hybrid engine's own staleness check does not apply to them)
    data.non_tensor_batch.pop("param_version")
    data.meta_info = {"temperature": 1.0}
    before_update = group.compute_log_prob(data).batch["old_log_probs"]  # the expectation, before any copy exists

    assert torch.equal(_prox(group, data, 0), before_update)  # step 1: the current weights are the period's
    mask = data.batch["response_mask"]
    data = data.union(group.compute_log_prob(data))
    data.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    group.update_actor(data)  # update count 1: the weights moved (lr 1e-3)

    weights, adam = full_params(worker.actor.module), _optimizer_state(worker)
    step2 = _prox(group, data, 0)
    assert torch.equal(step2, before_update)
    current = group.compute_log_prob(data).batch["old_log_probs"]
    assert (current - step2)[mask.bool()].abs().max() > 1e-4  # a real move, far above float rounding (~1e-6)
    after = full_params(worker.actor.module)
    assert all(torch.equal(after[name], weights[name]) for name in weights)
    assert all(torch.equal(v, adam[k]) for k, v in _optimizer_state(worker).items())

    group.update_actor(data)  # update count 2: a weight sync starts the next period
    assert torch.equal(_prox(group, data, 2), group.compute_log_prob(data).batch["old_log_probs"])
    assert worker._prox_snapshot.period == 2  # the last period's copy was replaced, not kept beside it
