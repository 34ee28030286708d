"""``compute_prox_log_prob`` (verl's fully-async ``async_training.compute_prox_log_prob``): old log-probs under
the weights the sync period started with, from a CPU copy, without disturbing the training state."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.protocol import DataProto
from tests.workers import _one_thread, local_worker, make_prompts, worker_config

one_thread = _one_thread()  # tiny-model math on one thread (a shared 2-core machine)

TEXTS = ["hello world", "the quick brown fox"]
ENGINES = {
    # single_rank=fsdp: real FSDP2 DTensors, so the copy and the swap go through their local shards
    "fsdp2": ["actor.fsdp_config.single_rank=fsdp"],
    # offloaded parameters have empty storage between uses: the call brings them back and releases them again
    "megatron-offload": ["actor.strategy=megatron", "actor.megatron.param_offload=true",
                         "actor.megatron.optimizer_offload=true"],
}


def _prox(group, data: DataProto, version: int) -> torch.Tensor:
    asked = DataProto(batch=data.batch, non_tensor_batch=data.non_tensor_batch,
                      meta_info={**data.meta_info, "prox_version": version})
    out = group.compute_prox_log_prob(asked)
    assert out.meta_info["param_version"] == version  # what scored the rows, for the mismatch audit
    return out.batch["old_log_probs"]


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state dict, by path, copied."""
    if torch.is_tensor(tree):
        return {prefix: tree.detach().clone()}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}.{key}").items()}


def _training_state(worker) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights (all of them, every chunk) and the optimiser's state and parameters, read on-loaded."""
    engine = worker.actor.engine
    engine.onload()
    modules = getattr(engine, "chunks", [engine.module])
    weights = _tensors({i: dict(m.named_parameters()) for i, m in enumerate(modules)})
    # the torch optimisers inside (Megatron wraps them, and keeps its fp32 main weights as their parameters)
    inner = [worker.optimizer]
    while not isinstance(inner[0], torch.optim.Optimizer):
        inner = [sub for o in inner for sub in getattr(o, "chained_optimizers", None) or [o.optimizer]]
    params = [p for o in inner for g in o.param_groups for p in g["params"]]
    state = _tensors([params, [o.state[p] for o in inner for g in o.param_groups for p in g["params"] if p in o.state]])
    engine.offload()
    return weights, state


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_later_step_of_the_sync_period_scores_under_the_periods_first_weights(tiny_model_dir, tokenizer, engine):
    """trigger_parameter_sync_step=2: step 1 (update count 0) keeps a copy and scores with the current
    weights; step 2 (update count 1, same period) scores the same rows under that copy, so its log-probs
    equal the ones computed before step 1's update, bitwise (same kernels, same rows, same micro-batches),
    and differ from the current weights'. The weights and Adam's state after the call are the ones before it."""
    if engine.startswith("megatron"):
        pytest.importorskip("megatron.core")
    group = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=2", *ENGINES[engine]]), role="actor")
    # fully async: the rows come from a rollout pool of its own, sampled with the period's first weights
    rollout = local_worker(worker_config(tiny_model_dir), role="rollout")
    data = rollout.generate_sequences(make_prompts(tokenizer, TEXTS))
    data.meta_info = {"temperature": 1.0}
    before_update = group.compute_log_prob(data).batch["old_log_probs"]  # the expectation, before any copy exists

    assert torch.equal(_prox(group, data, 0), before_update)  # step 1: the current weights are the period's
    mask = data.batch["response_mask"]
    data = data.union(group.compute_log_prob(data))
    data.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    group.update_actor(data)  # update count 1: the weights moved (lr 1e-3)

    weights, adam = _training_state(group.worker)
    step2 = _prox(group, data, 0)
    assert torch.equal(step2, before_update)
    current = group.compute_log_prob(data).batch["old_log_probs"]
    assert (current - step2)[mask.bool()].abs().max() > 1e-4  # a real move, far above float rounding (~1e-6)
    weights_after, adam_after = _training_state(group.worker)
    assert weights_after.keys() == weights.keys() and adam_after.keys() == adam.keys() and adam
    assert all(torch.equal(weights_after[k], weights[k]) for k in weights)
    assert all(torch.equal(adam_after[k], adam[k]) for k in adam)

    group.update_actor(data)  # update count 2: a weight sync starts the next period
    assert torch.equal(_prox(group, data, 2), group.compute_log_prob(data).batch["old_log_probs"])
    assert group.worker._prox_snapshot.period == 2  # the last period's copy was replaced, not kept beside it
