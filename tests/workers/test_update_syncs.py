"""Device-to-host reads in one actor update (issue 34: at most 3 per mini-batch, so 3 for the
benchmark's one-mini-batch step): the micro-batch plan reads its row summary once, the loss
normaliser (global_batch_info) once, and the metrics with the grad norm once — counted on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.host_reads import count_host_reads
from tests.workers import local_worker, one_thread, worker_config  # noqa: F401 (fixture)
from tests.workers.test_actor_update import batch  # noqa: F401 (fixture: a scored batch of 8 rows)


def test_the_counter_sees_reads_and_skips_host_made_indices(monkeypatch):
    t = torch.ones(3)
    with count_host_reads(monkeypatch) as reads:
        float(t.sum()), t.tolist(), bool(t.any()), t[t > 0]
        order = torch.randperm(4)
        order[1:3].tolist()  # a shuffle's indices live on the host on a GPU too
    assert [name for name, _ in reads] == ["__float__", "tolist", "__bool__", "__getitem__"]


@pytest.mark.parametrize("overrides", [
    ["actor.ppo_micro_batch_size_per_gpu=2"],
    ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=80"],
    ["actor.ppo_micro_batch_size_per_gpu=2", "model.use_shared_prompt=true"],
    ["actor.ppo_micro_batch_size_per_gpu=2", "actor.use_kl_loss=true", "actor.entropy_coeff=0.01"],
    ["actor.ppo_micro_batch_size_per_gpu=2", "model.use_fused_kernels=true", "actor.entropy_coeff=0.01"],
    ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=80", "model.use_remove_padding=true"],
], ids=["fixed", "token-budget", "shared-prompt", "kl-entropy", "fused-head", "packed"])
def test_one_mini_batch_update_reads_the_device_three_times(tiny_model_dir, batch, overrides, monkeypatch):
    actor = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=4", *overrides]),
                         role="actor").worker.actor
    with count_host_reads(monkeypatch) as reads:
        metrics = actor.update_policy(batch)
    assert len(reads) <= 3, reads
    assert all(len(v) == 1 for v in metrics.values())  # one mini-batch: one optimiser step
    assert metrics["actor/grad_norm"][0] > 0 and "actor/pg_clipfrac" in metrics


def test_reads_grow_with_mini_batches_not_micro_batches(tiny_model_dir, batch, monkeypatch):
    """Two optimiser steps (ppo_mini_batch_size=2 prompts of 4), each cut into 4 micro-batches of 1 row."""
    actor = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=2",
                                                        "actor.ppo_micro_batch_size_per_gpu=1"]),
                         role="actor").worker.actor
    with count_host_reads(monkeypatch) as reads:
        actor.update_policy(batch)
    assert len(reads) <= 6, reads


@pytest.mark.parametrize("overrides", [{}, {"use_dynamic_bsz": True}, {"use_remove_padding": True},
                                       {"use_dynamic_bsz": True, "use_remove_padding": True}],
                         ids=["fixed", "token-budget", "packed", "packed-token-budget"])
def test_a_critic_update_reads_the_device_three_times_per_mini_batch(tiny_critic_dir, overrides):
    """The critic as the actor: its value losses stay on the device, the padded forward gets its 4-D mask
    prepared, a packed one is laid out from the rows' summary (7 reads per mini-batch padded and 10
    packed before)."""
    from tests.workers.test_critic import _config, _critic, _rollout_batch, _with_values

    group = _critic(_config(tiny_critic_dir, **overrides))
    data = _with_values(group, _rollout_batch())  # 8 rows: two mini-batches of 4
    with count_host_reads() as reads:
        metrics = group.update_critic(data).meta_info["metrics"]
    assert len(metrics["critic/grad_norm"]) == 2 and len(reads) <= 6, reads
    assert all(v > 0 for v in metrics["critic/vf_loss"])
