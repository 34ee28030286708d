"""Two simulated nodes (ray.cluster_utils.Cluster, 1 CPU each): placement across nodes, pool checks, and a
node whose raylet is killed mid-collective reported as ``NodeDiedError`` naming the node, roles and rank."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster

from rlfoundry.single_controller import (
    Dispatch,
    NodeDiedError,
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

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_for(self, seconds: float):
        """Collectives back to back for ``seconds``: a peer that goes away breaks one of them."""
        self.init_distributed(timeout_s=60)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            dist.all_reduce(torch.ones(1))
            time.sleep(0.01)
        return self.rank


# Ray's GCS declares a node dead after `health_check_failure_threshold` missed checks, one every
# `health_check_period_ms` (defaults 5 x 3 s: ~15 s in which the killed-node tests only wait). Checks every
# 0.5 s, 3 missed (~1.5 s), still end in the same "node dead" event these tests wait for; the per-check
# timeout keeps Ray's default (10 s), so a raylet slow to answer on a loaded machine is not declared dead.
HEAD_NODE_ARGS = {"num_cpus": 1, "include_dashboard": False,
                  "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}}


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
        cluster = Cluster(initialize_head=True, head_node_args=HEAD_NODE_ARGS)
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


def test_a_pool_takes_distinct_nodes_even_where_one_node_could_hold_it(two_nodes):
    # Two half-CPU processes fit on one 1-CPU node; nnodes=2 still means two nodes.
    manager = ResourcePoolManager({"global_pool": [1, 1]}, {Role.ActorRollout: "global_pool"}, cpus_per_worker=0.5)
    manager.create_resource_pool()
    pool = manager.get_resource_pool(Role.ActorRollout)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(NodeWorker), name_prefix="actor_rollout")
    try:
        nodes = [node for _, _, node in group.placement()]
        assert nodes == pool.node_ids == group.rank_nodes and len(set(nodes)) == 2
        assert f"rank 1 on node 127.0.0.1 ({nodes[1]})" in group.placement_summary()
    finally:
        group.shutdown()
        pool.remove()


def test_a_pool_over_more_nodes_than_the_cluster_has_is_a_clear_error(two_nodes):
    manager = ResourcePoolManager({"global_pool": [1, 1, 1]}, {Role.ActorRollout: "global_pool"}, cpus_per_worker=0.25)
    with pytest.raises(RuntimeError, match=r"'global_pool' spans 3 nodes .* but the Ray cluster has 2 live nodes"):
        manager.create_resource_pool()


DETECT_S = 60  # from the raylet's death to the error: Ray's health checks (~1.5 s here, HEAD_NODE_ARGS) + our wait


def test_a_killed_raylet_is_reported_naming_the_node_roles_and_rank(two_nodes):
    """Last in the module: the node it adds is killed. The surviving rank's gloo error comes first;
    the driver waits for Ray to declare the node dead and names it."""
    extra = two_nodes.add_node(num_cpus=1)
    two_nodes.wait_for_nodes()
    head = two_nodes.head_node.node_id
    manager = ResourcePoolManager({"global_pool": [1, 1]}, {Role.ActorRollout: "global_pool"})
    manager.create_resource_pool()
    pool = manager.get_resource_pool(Role.ActorRollout)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(NodeWorker), name_prefix="global_pool/actor_rollout")
    try:
        nodes = group.rank_nodes
        victim_rank = next(r for r, node in enumerate(nodes) if node != head)  # never the head: the driver needs it
        victim = next(n for n in [extra, *two_nodes.worker_nodes] if n.node_id == nodes[victim_rank])
        future = group.execute_all_async("all_reduce_for", 120)
        time.sleep(3)  # the collectives are running
        victim.kill_raylet()
        killed = time.monotonic()
        with pytest.raises(NodeDiedError) as info:
            future.get()
        took = time.monotonic() - killed
        err = info.value
        assert (err.node_id, err.ranks, err.node_ip) == (nodes[victim_rank], [victim_rank], "127.0.0.1")
        msg = str(err)
        assert f"Ray node 127.0.0.1 (node id {nodes[victim_rank]}) died" in msg
        assert f"worker group 'global_pool/actor_rollout' ran 'all_reduce_for': rank {victim_rank} of " in msg
        assert "trainer.resume_mode=auto to continue from the newest intact checkpoint" in msg
        assert took < DETECT_S, took
        print(f"node death reported {took:.1f} s after the raylet was killed: {msg}")
    finally:
        group.shutdown()
        pool.remove()
