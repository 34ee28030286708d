"""The in-process back end: one rank, the worker object lives in the driver process.

No Ray start-up, and a breakpoint inside a worker method stops the driver right there. It runs the
same worker classes and the same dispatch/collect code as ``RayWorkerGroup`` with world size 1.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from rlfoundry.single_controller.base.decorator import Execute, RankCalls
from rlfoundry.single_controller.base.worker_group import ClassWithInitArgs, WorkerGroup, bind_worker_methods


def set_rank_env(name: str, rank: int = 0, world_size: int = 1) -> None:
    """The torchrun-style variables of a rank hosted by this (driver) process."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ["RLFOUNDRY_WORKER_GROUP"] = name
    # Without a live process group, the worker (rank 0) opens a fresh rendezvous on loopback; a
    # group made by an earlier local worker group stays, with its address.
    if not dist.is_initialized():
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)


class LocalWorkerGroup(WorkerGroup):
    """World size 1, in this process. ``group.worker`` is the worker object itself (for debugging)."""

    def __init__(self, cls_with_init: ClassWithInitArgs, name_prefix: str = "local"):
        self.name = name_prefix
        self.world_size = 1
        self.worker_cls = cls_with_init.cls
        set_rank_env(name_prefix)
        self.worker = cls_with_init()
        bind_worker_methods(self)

    def _execute(self, method: str, calls: RankCalls, execute_mode: Execute) -> list:
        # Runs at once: results are the "handles"; exceptions reach the caller unchanged.
        return [getattr(self.worker, method)(*calls.args[0], **calls.kwargs[0])]

    def _get(self, handles: list, method: str) -> list:
        return handles
