"""Dispatch/collect worked out by hand, and the in-process back end (no Ray)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from rlfoundry.protocol import DataProto
from rlfoundry.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    Execute,
    LocalWorkerGroup,
    ResourcePoolManager,
    Role,
    Worker,
    WorkerFuture,
    create_colocated_worker_cls,
    register,
    registered_methods,
)
from rlfoundry.single_controller.base.decorator import DISPATCH_TABLE, merge_meta_info


class FakeGroup:
    def __init__(self, world_size):
        self.world_size = world_size


def rows(x: list[int]) -> DataProto:
    return DataProto.from_single_dict({"x": torch.tensor(x)}, meta_info={"temperature": 1.0})


def test_every_dispatch_mode_has_a_dispatch_and_a_collect_function():
    assert set(DISPATCH_TABLE) == set(Dispatch)


def test_register_tags_the_function_and_leaves_it_callable():
    class W:
        @register(Dispatch.RANK_ZERO, Execute.RANK_ZERO, blocking=False)
        def f(self, a):
            return a + 1

        def plain(self):
            pass

    specs = registered_methods(W)
    assert list(specs) == ["f"]  # unregistered methods are not exposed
    assert (specs["f"].dispatch_mode, specs["f"].execute_mode, specs["f"].blocking) == (
        Dispatch.RANK_ZERO,
        Execute.RANK_ZERO,
        False,
    )
    assert W().f(1) == 2
    with pytest.raises(TypeError, match="Dispatch member"):
        register("one_to_all")


def test_one_to_all_gives_every_rank_the_same_args():
    dispatch, collect = DISPATCH_TABLE[Dispatch.ONE_TO_ALL]
    calls = dispatch(FakeGroup(3), 1, b="x")
    assert calls.args == [(1,)] * 3 and calls.kwargs == [{"b": "x"}] * 3
    assert collect(None, ["r0", "r1", "r2"]) == ["r0", "r1", "r2"]


def test_all_to_all_gives_rank_r_item_r_and_checks_lengths():
    dispatch, _ = DISPATCH_TABLE[Dispatch.ALL_TO_ALL]
    calls = dispatch(FakeGroup(2), [1, 2], b=["p", "q"])
    assert calls.args == [(1,), (2,)] and calls.kwargs == [{"b": "p"}, {"b": "q"}]
    with pytest.raises(ValueError, match="argument 'b' must be a list with one item per rank \\(2\\)"):
        dispatch(FakeGroup(2), [1, 2], b=["p"])


def test_rank_zero_returns_rank_zero_result():
    dispatch, collect = DISPATCH_TABLE[Dispatch.RANK_ZERO]
    assert dispatch(FakeGroup(2), 5).args == [(5,), (5,)]
    assert collect(None, ["rank0", "rank1"]) == "rank0"


def test_dp_compute_proto_pads_five_rows_to_six_and_unpads_in_order():
    dispatch, collect = DISPATCH_TABLE[Dispatch.DP_COMPUTE_PROTO]
    calls = dispatch(FakeGroup(2), rows([10, 11, 12, 13, 14]), 7)
    # 5 rows, 2 ranks: pad to 6 by repeating row 0 -> [10 11 12 | 13 14 10]; the scalar 7 is broadcast.
    assert calls.pad_size == 1
    assert [a[0].batch["x"].tolist() for a in calls.args] == [[10, 11, 12], [13, 14, 10]]
    assert [a[1] for a in calls.args] == [7, 7]
    outs = [DataProto.from_single_dict({"y": a[0].batch["x"] * 2}) for a in calls.args]
    merged = collect(None, outs, calls.pad_size)
    assert merged.batch["y"].tolist() == [20, 22, 24, 26, 28]


def test_dp_compute_proto_drops_every_row_the_padding_produced():
    # 3 prompts, 2 ranks, n=2 samples per prompt: [10 11 | 12 10]; rank 1's second prompt is padding,
    # so its 2 samples go, and the 6 real samples come back in order
    dispatch, collect = DISPATCH_TABLE[Dispatch.DP_COMPUTE_PROTO]
    calls = dispatch(FakeGroup(2), rows([10, 11, 12]))
    assert (calls.pad_size, calls.chunk_rows) == (1, 2)
    assert [a[0].meta_info["dispatch_pad_size"] for a in calls.args] == [1, 1]  # what an update reads
    outs = [DataProto.from_single_dict({"y": a[0].batch["x"].repeat_interleave(2)}, meta_info=a[0].meta_info)
            for a in calls.args]
    merged = collect(None, outs, calls.pad_size, calls.chunk_rows)
    assert merged.batch["y"].tolist() == [10, 10, 11, 11, 12, 12]
    assert "dispatch_pad_size" not in merged.meta_info


def test_dp_compute_proto_padding_can_fill_whole_ranks():
    # 1 row over 4 ranks: [5 | 5 | 5 | 5], ranks 1-3 all padding
    dispatch, collect = DISPATCH_TABLE[Dispatch.DP_COMPUTE_PROTO]
    calls = dispatch(FakeGroup(4), rows([5]))
    outs = [DataProto.from_single_dict({"y": a[0].batch["x"].repeat(3)}) for a in calls.args]
    assert collect(None, outs, calls.pad_size, calls.chunk_rows).batch["y"].tolist() == [5, 5, 5]


def test_dp_compute_proto_rejects_different_batch_sizes():
    dispatch, _ = DISPATCH_TABLE[Dispatch.DP_COMPUTE_PROTO]
    with pytest.raises(ValueError, match="same batch size"):
        dispatch(FakeGroup(2), rows([1, 2]), other=rows([1, 2, 3]))


def test_dp_compute_proto_with_func_passes_the_function_first():
    dispatch, _ = DISPATCH_TABLE[Dispatch.DP_COMPUTE_PROTO_WITH_FUNC]
    calls = dispatch(FakeGroup(2), len, rows([1, 2, 3, 4]))
    assert [a[0] for a in calls.args] == [len, len]
    assert [a[1].batch["x"].tolist() for a in calls.args] == [[1, 2], [3, 4]]


def test_dp_compute_metric_splits_like_proto_and_returns_one_result_per_rank():
    dispatch, collect = DISPATCH_TABLE[Dispatch.DP_COMPUTE_METRIC]
    calls = dispatch(FakeGroup(2), rows([1, 2, 3]))
    assert calls.pad_size == 1
    assert collect(None, [{"loss": 1.0}, {"loss": 3.0}], calls.pad_size) == [{"loss": 1.0}, {"loss": 3.0}]


def test_meta_info_keeps_rank_zero_and_gathers_metrics():
    metas = [
        {"temperature": 1.0, "timing": 0.5, "metrics": {"actor/pg_loss": [0.1, 0.2], "actor/lr": 1e-6}},
        {"temperature": 1.0, "timing": 0.9, "metrics": {"actor/pg_loss": [0.3], "actor/lr": 1e-6}},
    ]
    # Lists are appended in rank order, scalars become one item each: mean over the list = mean over ranks.
    assert merge_meta_info(metas) == {
        "temperature": 1.0,
        "timing": 0.5,
        "metrics": {"actor/pg_loss": [0.1, 0.2, 0.3], "actor/lr": [1e-6, 1e-6]},
    }


# --------------------------------------------------------------------------------------------
# LocalWorkerGroup


class Doubler(Worker):
    def __init__(self, factor: int = 2):
        super().__init__()
        self.factor = factor

    @register(Dispatch.DP_COMPUTE_PROTO)
    def scale(self, data: DataProto) -> DataProto:
        return DataProto.from_single_dict({"y": data.batch["x"] * self.factor}, meta_info={"metrics": {"n": len(data)}})

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def env(self):
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}

    @register(Dispatch.RANK_ZERO)
    def world(self):
        self.init_distributed(timeout_s=30)
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        return self.rank, self.world_size, self.device.type, t.item(), dist.get_backend()


def test_local_group_runs_registered_methods_in_process():
    group = LocalWorkerGroup(ClassWithInitArgs(Doubler, factor=3), name_prefix="actor")
    out = group.scale(rows([1, 2, 3]))
    assert out.batch["y"].tolist() == [3, 6, 9] and out.meta_info["metrics"] == {"n": [3]}
    future = group.env()
    assert isinstance(future, WorkerFuture)
    assert future.get() == [{"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}]
    assert group.world() == (0, 1, "cpu", 3.0, "gloo")  # world size 1: all_reduce is the identity
    assert group.worker.factor == 3  # the worker object is right here (breakpoints work)
    assert group.execute_all("env") == [future.get()[0]]


class RoleA(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def hello(self, name):
        return f"A:{name}"


class RoleB(Worker):
    def __init__(self, suffix):
        super().__init__()
        self.suffix = suffix

    @register(Dispatch.RANK_ZERO)
    def hello(self, name):
        return f"B:{name}{self.suffix}"


def test_local_colocated_roles_share_the_process_and_keep_their_dispatch():
    fused = create_colocated_worker_cls({"actor": ClassWithInitArgs(RoleA), "critic": ClassWithInitArgs(RoleB, "!")})
    group = LocalWorkerGroup(fused)
    assert group.actor_hello("x") == ["A:x"] and group.critic_hello("x") == "B:x!"
    views = group.spawn({"actor", "critic"})
    assert views["actor"].hello("y") == ["A:y"]  # ONE_TO_ALL: a list
    assert views["critic"].hello("y") == "B:y!"  # RANK_ZERO: rank 0's value
    assert views["critic"].name == "local/critic"
    with pytest.raises(KeyError, match="'ref' is not in the colocated class"):
        group.spawn({"ref"})


def test_resource_pool_manager_validates_its_mapping():
    with pytest.raises(ValueError, match="mapped to pool 'gpu_pool'"):
        ResourcePoolManager({"global_pool": [2]}, {Role.Critic: "gpu_pool"})
    manager = ResourcePoolManager({"global_pool": [2, 2]}, {Role.ActorRollout: "global_pool"}, use_gpu=True)
    assert manager.get_n_gpus() == 4
    with pytest.raises(KeyError, match="role RewardModel has no resource pool"):
        manager.get_resource_pool(Role.RewardModel)


def test_cluster_choice_follows_address_then_ray_address(monkeypatch):
    from rlfoundry.single_controller.ray.cluster import _existing_cluster

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert _existing_cluster(None) == "10.0.0.1:6379"
    assert _existing_cluster("local") is None  # tests force a private local instance
    assert _existing_cluster("auto") == "auto"


def test_a_recorded_ray_start_cluster_is_joined_only_while_it_runs(monkeypatch):
    import ray._private.services as services

    from rlfoundry.single_controller.ray.cluster import _existing_cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: "127.0.0.1:6379")
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: {"127.0.0.1:6379"})
    assert _existing_cluster(None) == "127.0.0.1:6379"
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: set())  # stale record: start a local one
    assert _existing_cluster(None) is None


def test_device_follows_trainer_device():
    from rlfoundry.single_controller.base.worker import _pick_device

    assert _pick_device(0, "cpu") == torch.device("cpu")
    assert _pick_device(0, "auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    with pytest.raises(ValueError, match=r"trainer.device must be one of \['auto', 'cpu', 'cuda'\], got 'tpu'"):
        _pick_device(0, "tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            _pick_device(0, "cuda")


def test_backend_is_chosen_by_name():
    from rlfoundry.single_controller import create_worker_group

    group = create_worker_group("local", ClassWithInitArgs(Doubler), name_prefix="critic")
    assert isinstance(group, LocalWorkerGroup) and group.name == "critic"
    with pytest.raises(ValueError, match="needs a resource pool"):
        create_worker_group("ray", ClassWithInitArgs(Doubler))
    with pytest.raises(ValueError, match="must be one of \\('local', 'process', 'ray'\\), got 'mpi'"):
        create_worker_group("mpi", ClassWithInitArgs(Doubler))
