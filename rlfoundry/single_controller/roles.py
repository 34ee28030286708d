"""Worker roles and the mapping of roles onto resource pools (verl's ``Role`` / ``ResourcePoolManager``).

Example: everything colocated on one pool of ``n_gpus_per_node * nnodes`` processes::

    spec = {"global_pool": [n_gpus_per_node] * nnodes}
    mapping = {Role.ActorRollout: "global_pool", Role.Critic: "global_pool", Role.RefPolicy: "global_pool"}
    manager = ResourcePoolManager(spec, mapping, use_gpu=True)
    manager.create_resource_pool()          # checks the cluster first, then reserves placement groups
    pool = manager.get_resource_pool(Role.Critic)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Role(Enum):
    """A role is one kind of worker; roles mapped to the same pool can share its processes."""

    Actor = 0
    Rollout = 1
    ActorRollout = 2
    Critic = 3
    RefPolicy = 4
    RewardModel = 5
    ActorRolloutRef = 6


@dataclass
class ResourcePoolManager:
    """``resource_pool_spec``: pool name -> processes per node (one entry per node).

    ``mapping``: role -> pool name. ``use_gpu``: one GPU per process; ``cpus_per_worker``: logical
    CPUs reserved per process; ``max_colocate_count``: how many separate worker groups (processes)
    may share one bundle — 1 when roles are colocated in one process, verl's recommended setup.
    """

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Role, str]
    use_gpu: bool = False
    cpus_per_worker: float = 1
    max_colocate_count: int = 1
    resource_pool_dict: dict = field(default_factory=dict)

    def __post_init__(self):
        for role, pool in self.mapping.items():
            if pool not in self.resource_pool_spec:
                raise ValueError(
                    f"role {role.name} is mapped to pool {pool!r}, which is not in resource_pool_spec "
                    f"{sorted(self.resource_pool_spec)}"
                )
        for pool, per_node in self.resource_pool_spec.items():
            if not per_node or any(int(n) != n or n < 1 for n in per_node):
                raise ValueError(
                    f"resource pool {pool!r}: processes per node must be positive integers, got {per_node}"
                )

    def create_resource_pool(self) -> None:
        from rlfoundry.single_controller.ray.base import RayResourcePool

        self.check_resources_available()
        for pool, per_node in self.resource_pool_spec.items():
            self.resource_pool_dict[pool] = RayResourcePool(
                process_on_nodes=per_node,
                use_gpu=self.use_gpu,
                max_colocate_count=self.max_colocate_count,
                name_prefix=pool,
                cpus_per_worker=self.cpus_per_worker,
            )

    def get_resource_pool(self, role: Role):
        if role not in self.mapping:
            raise KeyError(f"role {role.name} has no resource pool; mapped roles: {[r.name for r in self.mapping]}")
        if not self.resource_pool_dict:
            raise RuntimeError("call create_resource_pool() before get_resource_pool()")
        return self.resource_pool_dict[self.mapping[role]]

    def get_n_gpus(self) -> int:
        return sum(sum(per_node) for per_node in self.resource_pool_spec.values()) if self.use_gpu else 0

    def check_resources_available(self) -> None:
        """Fail early, with the numbers, when the Ray cluster cannot host every pool."""
        import ray

        unit = {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        free = [{k: node.get(k, 0) for k in unit} for node in nodes]
        # Place the largest per-node demands first, each on the node with most room that the same pool
        # does not use yet (a pool's entries are distinct nodes): first-fit decreasing, exact for one
        # pool and a clear lower bound otherwise.
        for pool, per in self.resource_pool_spec.items():
            if len(per) > len(nodes):
                raise RuntimeError(
                    f"resource pool {pool!r} spans {len(per)} nodes (processes per node {per}), but the Ray "
                    f"cluster has {len(nodes)} live node{'s' if len(nodes) != 1 else ''}; start more nodes (ray start "
                    "--address=...) or lower trainer.nnodes."
                )
        taken: dict[str, set] = {pool: set() for pool in self.resource_pool_spec}
        demands = sorted(((n, pool) for pool, per in self.resource_pool_spec.items() for n in per), reverse=True)
        for n, pool in demands:
            need = {k: v * n for k, v in unit.items()}
            fits = [i for i, f in enumerate(free) if i not in taken[pool] and all(f[k] >= need[k] for k in unit)]
            if not fits:
                raise RuntimeError(
                    f"resource pool {pool!r} needs {n} processes x {unit} on one node ({need}), but no "
                    f"Ray node has that much left; nodes (total resources): "
                    f"{[{k: node.get(k, 0) for k in unit} for node in nodes]}. Lower the processes per "
                    "node (trainer.n_gpus_per_node) or add nodes."
                )
            best = max(fits, key=lambda i: tuple(free[i][k] for k in sorted(unit)))
            taken[pool].add(best)
            for k in unit:
                free[best][k] -= need[k]
