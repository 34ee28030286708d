"""Two simulated nodes (ray.cluster_utils.Cluster, 1 CPU each): placement across nodes and pool checks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster

from rlfoundry.single_controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayWorkerGroup,
    ResourcePoolManager,
    Role,
    Worker,
    init_ray,
    register,
)
from rlfoundry.single_controller.ray.cluster import _loopback_node

pytestmark = pytest.mark.ray


class NodeWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def placement(self):
        info = self.get_worker_info()
        return self.rank, self.local_rank, info["node_id"]

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank_plus_one(self):
        self.init_distributed(timeout_s=60)
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return t.item()


def _forget_marker(address: str) -> None:
    # Cluster records itself as "the cluster `ray start` ran" (/tmp/ray/ray_current_cluster), so
    # another process on this shared machine calling init_ray() would join it; hide it at once.
    marker = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if marker.exists() and marker.read_text().strip() == address:
        marker.unlink()


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    with _loopback_node():  # both simulated nodes on 127.0.0.1, like init_ray's local instance
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        _forget_marker(cluster.address)
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    assert init_ray(address=cluster.address) is False  # joined, not started
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    _forget_marker(cluster.address)


def test_pool_over_two_nodes_places_one_rank_per_node_and_reduces_across(two_nodes):
    mapping = {Role.ActorRollout: "global_pool", Role.Critic: "global_pool"}
    manager = ResourcePoolManager({"global_pool": [1, 1]}, mapping)
    manager.create_resource_pool()
    pool = manager.get_resource_pool(Role.Critic)
    assert pool is manager.get_resource_pool(Role.ActorRollout)  # both roles share the pool
    group = RayWorkerGroup(pool, RayClassWithInitArgs(NodeWorker), name_prefix="actor_rollout")
    try:
        (r0, local0, node0), (r1, local1, node1) = group.placement()
        assert (r0, r1) == (0, 1) and (local0, local1) == (0, 0)  # each node has one process
        assert node0 != node1
        assert {node0, node1} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert group.all_reduce_rank_plus_one() == [3.0, 3.0]  # 1 + 2, across the two nodes
    finally:
        group.shutdown()
        pool.remove()


def test_pool_larger_than_any_node_is_a_clear_error(two_nodes):
    manager = ResourcePoolManager({"global_pool": [2]}, {Role.ActorRollout: "global_pool"})
    with pytest.raises(RuntimeError, match=r"resource pool 'global_pool' needs 2 processes x \{'CPU': 1\} on one node"):
        manager.create_resource_pool()
