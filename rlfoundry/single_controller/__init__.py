"""Single controller: the driver calls worker groups; worker methods declare how calls are split.

A worker::

    class CriticWorker(Worker):
        def __init__(self, config):
            super().__init__()          # self.rank, world_size, local_rank, device (from env)
            self.config = config

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self):
            self.init_distributed()     # gloo on CPU / NCCL on CUDA, once per process, with a timeout
            ...

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def compute_values(self, data: DataProto) -> DataProto: ...

In process (one rank, no Ray; breakpoints work)::

    critic = LocalWorkerGroup(ClassWithInitArgs(CriticWorker, config), name_prefix="critic")

On Ray (one actor per rank of a pool; several roles colocated in one process per rank)::

    init_ray()
    mapping = {Role.ActorRolloutRef: "global_pool", Role.Critic: "global_pool"}
    manager = ResourcePoolManager({"global_pool": [2]}, mapping)    # 2 processes on 1 node
    manager.create_resource_pool()
    fused = create_colocated_worker_cls({"actor_rollout_ref": RayClassWithInitArgs(ActorRolloutRefWorker, cfg),
                                         "critic": RayClassWithInitArgs(CriticWorker, config)})
    group = RayWorkerGroup(manager.get_resource_pool(Role.Critic), fused, name_prefix="global_pool")
    groups = group.spawn({"actor_rollout_ref", "critic"})
    groups["critic"].init_model(); values = groups["critic"].compute_values(batch)

``create_worker_group("local" | "ray", ...)`` picks the back end by name. A dead worker raises
``WorkerDiedError`` (group and rank), a dead Ray node ``NodeDiedError`` (node, roles and ranks on it);
``call_timeout_s`` bounds every call (``WorkerCallTimeout``).
Ray names are imported on first use so that the local back end does not import Ray.
"""

from rlfoundry.single_controller.base import (
    ClassWithInitArgs,
    Dispatch,
    Execute,
    NodeDiedError,
    PeerLostError,
    Worker,
    WorkerCallTimeout,
    WorkerDiedError,
    WorkerFuture,
    WorkerGroup,
    WorkerGroupError,
    create_colocated_worker_cls,
    register,
    registered_methods,
)
from rlfoundry.single_controller.factory import WORKER_BACKENDS, create_worker_group
from rlfoundry.single_controller.local import LocalWorkerGroup
from rlfoundry.single_controller.roles import ResourcePoolManager, Role

_RAY_NAMES = {
    "RayClassWithInitArgs": "rlfoundry.single_controller.ray.base",
    "RayResourcePool": "rlfoundry.single_controller.ray.base",
    "RayWorkerGroup": "rlfoundry.single_controller.ray.base",
    "init_ray": "rlfoundry.single_controller.ray.cluster",
}


def __getattr__(name):
    if name in _RAY_NAMES:
        import importlib

        return getattr(importlib.import_module(_RAY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ClassWithInitArgs",
    "Dispatch",
    "Execute",
    "LocalWorkerGroup",
    "NodeDiedError",
    "PeerLostError",
    "ResourcePoolManager",
    "Role",
    "WORKER_BACKENDS",
    "Worker",
    "WorkerCallTimeout",
    "WorkerDiedError",
    "WorkerFuture",
    "WorkerGroup",
    "WorkerGroupError",
    "create_colocated_worker_cls",
    "create_worker_group",
    "register",
    "registered_methods",
    *_RAY_NAMES,
]
