"""Device placement of the engine loop's collectives (issue 33): the counts and metrics it all-reduces
go where the group's back end takes them (the host for gloo or the worker groups' ``cpu:gloo,cuda:nccl``,
the GPU for an NCCL-only group such as megatron-core may make), and the counts are computed on the
mask's device with a single host read. Without a GPU the device flow is checked on ``meta``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlfoundry.engines.loop import MiniBatchStats, batch_counts, collective_device, device_for_backend, global_batch_info
from rlfoundry.engines.base import LossOutput

META = torch.device("meta")


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl", "GLOO", "mpi"])
def test_groups_with_a_cpu_back_end_reduce_on_the_host(backend):
    assert device_for_backend(backend) == torch.device("cpu")


def test_an_nccl_only_group_reduces_on_the_current_gpu(monkeypatch):
    """NCCL takes only CUDA tensors: the current device (a CPU-only build has none to name, so the
    current-device lookup is the one thing replaced here)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_for_backend("nccl") == torch.device("cuda", 3)
    assert device_for_backend("cuda:nccl") == torch.device("cuda", 3)


def test_collective_device_reads_a_real_gloo_group(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    assert collective_device(group) == torch.device("cpu")


def test_batch_counts_stay_on_the_masks_device():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    # hand-derived: 3 counted tokens, 2 rows with at least one
    assert batch_counts(mask).tolist() == [3.0, 2.0]
    on_meta = batch_counts(mask.to(META))
    assert on_meta.device == META and on_meta.dtype == torch.float64 and on_meta.shape == (2,)


def test_global_batch_info_on_one_rank_needs_no_group():
    info = global_batch_info(torch.tensor([[1, 1, 0], [0, 0, 0]]), dp_size=1)
    assert info == {"dp_size": 1, "batch_num_tokens": 2.0, "global_batch_size": 1.0}
    assert all(type(v) in (int, float) for v in info.values())  # host numbers, not tensors


def test_mini_batch_stats_over_a_gloo_group_come_back_as_host_floats(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    stats = MiniBatchStats()
    stats.add(LossOutput(loss=torch.zeros(()), summed={"actor/pg_loss": 0.5}, weighted={"actor/entropy": 2.0}), 4.0)
    stats.add(LossOutput(loss=torch.zeros(()), summed={"actor/pg_loss": 0.25}, weighted={"actor/entropy": 1.0}), 2.0)
    # dp_size 2 on a 1-rank group exercises the reduce path: summed / dp_size; weighted by tokens
    stats.add(LossOutput(loss=torch.zeros(()), summed={"actor/pg_loss": 0.0}, weighted={"actor/entropy": 0.0},
                         maxed={"actor/log_ratio_abs_max": 0.5}), 0.0)
    out = stats.reduce(2, dist.group.WORLD)
    assert out == {"actor/pg_loss": pytest.approx(0.375), "actor/entropy": pytest.approx((8.0 + 2.0) / 6.0),
                   "actor/log_ratio_abs_max": 0.5}
