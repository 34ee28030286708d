from rlfoundry.single_controller.base.colocate import create_colocated_worker_cls
from rlfoundry.single_controller.base.decorator import Dispatch, Execute, register, registered_methods
from rlfoundry.single_controller.base.worker import Worker
from rlfoundry.single_controller.base.worker_group import (
    ClassWithInitArgs,
    NodeDiedError,
    PeerLostError,
    WorkerCallTimeout,
    WorkerDiedError,
    WorkerFuture,
    WorkerGroup,
    WorkerGroupError,
)

__all__ = [
    "ClassWithInitArgs",
    "Dispatch",
    "Execute",
    "NodeDiedError",
    "PeerLostError",
    "Worker",
    "WorkerCallTimeout",
    "WorkerDiedError",
    "WorkerFuture",
    "WorkerGroup",
    "WorkerGroupError",
    "create_colocated_worker_cls",
    "register",
    "registered_methods",
]
