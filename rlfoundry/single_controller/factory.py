"""Pick the back end by name (e.g. from ``trainer.worker_backend``): same worker classes either way."""

from __future__ import annotations

from rlfoundry.config.schema import WORKER_BACKENDS
from rlfoundry.single_controller.base.worker_group import ClassWithInitArgs, WorkerGroup
from rlfoundry.single_controller.local import LocalWorkerGroup


def create_worker_group(
    backend: str,
    cls_with_init: ClassWithInitArgs,
    resource_pool=None,
    name_prefix: str = "worker",
    call_timeout_s: float | None = None,
) -> WorkerGroup:
    """``"local"``: one rank in this process (``resource_pool`` unused, no Ray).
    ``"process"``: ``resource_pool.world_size`` ranks on this machine without Ray (rank 0 in this
    process; ``resource_pool`` may also be a plain rank count).
    ``"ray"``: one Ray actor per process of ``resource_pool`` (a ``RayResourcePool``)."""
    if backend == "local":
        return LocalWorkerGroup(cls_with_init, name_prefix=name_prefix)
    if backend == "process":
        from rlfoundry.single_controller.process import ProcessWorkerGroup

        ranks = resource_pool if isinstance(resource_pool, int) else getattr(resource_pool, "world_size", 1)
        return ProcessWorkerGroup(cls_with_init, ranks, name_prefix=name_prefix, call_timeout_s=call_timeout_s)
    if backend == "ray":
        if resource_pool is None:
            raise ValueError(
                "the ray worker backend needs a resource pool (ResourcePoolManager.get_resource_pool(role))"
            )
        from rlfoundry.single_controller.ray.base import RayWorkerGroup

        return RayWorkerGroup(resource_pool, cls_with_init, name_prefix=name_prefix, call_timeout_s=call_timeout_s)
    raise ValueError(f"worker backend must be one of {WORKER_BACKENDS}, got {backend!r}")
