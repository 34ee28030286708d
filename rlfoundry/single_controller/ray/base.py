"""The Ray back end: resource pools of placement groups, and one Ray actor per rank.

    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, name_prefix="global_pool")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(MyWorker, cfg), name_prefix="actor")
    group.init_model()                      # any @register'ed method of MyWorker

Calls go through the same dispatch → execute → collect core as the local back end
(``base/worker_group.py``); this file only places actors and waits for their results, turning a
dead actor into ``WorkerDiedError`` (naming group and rank) and a slow call into ``WorkerCallTimeout``.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import numpy as np
import torch

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlfoundry.protocol import DataProto
from rlfoundry.single_controller.base.colocate import create_colocated_worker_cls
from rlfoundry.single_controller.base.decorator import Execute, RankCalls
from rlfoundry.single_controller.base.worker import Worker
from rlfoundry.single_controller.base.worker_group import (
    ClassWithInitArgs,
    WorkerCallTimeout,
    WorkerDiedError,
    WorkerGroup,
    bind_worker_methods,
)

_BULKY = (DataProto, torch.Tensor, np.ndarray)

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "create_colocated_worker_cls"]


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class, its init args, and extra Ray actor options (e.g. ``runtime_env``)."""

    def __init__(self, cls: type, *args, **kwargs):
        super().__init__(cls, *args, **kwargs)
        self.options: dict = {}

    def update_options(self, options: dict) -> None:
        self.options = {**self.options, **options}  # a new dict: copies made by colocation stay independent


class RayResourcePool:
    """Processes reserved per node: one STRICT_PACK placement group per node, one bundle per process.

    A bundle is ``{"CPU": cpus_per_worker}`` plus ``{"GPU": 1}`` with ``use_gpu``. Up to
    ``max_colocate_count`` worker groups (separate processes) may share a bundle; roles colocated
    in one process (``create_colocated_worker_cls``) count as one. Placement groups are created on
    first use; Ray decides which node each one lands on (STRICT_PACK keeps a group on one node).
    """

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        name_prefix: str = "pool",
        cpus_per_worker: float = 1,
        ready_timeout_s: float = 120,
    ):
        if not process_on_nodes or any(n < 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must list a positive process count per node, got {process_on_nodes}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu, self.max_colocate_count = use_gpu, max_colocate_count
        self.name_prefix, self.cpus_per_worker, self.ready_timeout_s = name_prefix, cpus_per_worker, ready_timeout_s
        self._pgs = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict:
        return {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}

    def actor_resources(self) -> dict:
        """What one worker process asks for: its share of a bundle."""
        share = {"num_cpus": self.cpus_per_worker / self.max_colocate_count}
        if self.use_gpu:
            share["num_gpus"] = 1 / self.max_colocate_count
        return share

    def get_placement_groups(self) -> list:
        if self._pgs is None:
            tag = uuid.uuid4().hex[:8]
            pgs = [
                placement_group([self.bundle] * n, strategy="STRICT_PACK", name=f"{self.name_prefix}_{tag}_{i}")
                for i, n in enumerate(self.process_on_nodes)
            ]
            ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s)
            if len(ready) < len(pgs):
                for pg in pgs:
                    remove_placement_group(pg)
                raise RuntimeError(
                    f"resource pool {self.name_prefix!r} could not reserve {self.process_on_nodes} processes per "
                    f"node x {self.bundle} within {self.ready_timeout_s:g} s; cluster has "
                    f"{ray.cluster_resources()} in total, {ray.available_resources()} free."
                )
            self._pgs = pgs
        return self._pgs

    def placements(self) -> list[tuple]:
        """(placement group, bundle index = local rank, processes on that node) for each global rank."""
        return [(pg, i, n) for pg, n in zip(self.get_placement_groups(), self.process_on_nodes) for i in range(n)]

    def remove(self) -> None:
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per rank of ``resource_pool``, each an instance of the worker class.

    ``call_timeout_s``: how long any call may take before ``WorkerCallTimeout`` (None: no limit;
    a dead worker is still reported as soon as Ray notices, usually within a second or two).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: ClassWithInitArgs,
        name_prefix: str | None = None,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300,
    ):
        if not issubclass(ray_cls_with_init.cls, Worker):
            raise TypeError(f"{ray_cls_with_init.cls.__name__} must subclass rlfoundry.single_controller.Worker")
        self.name = name_prefix or resource_pool.name_prefix
        self.world_size = resource_pool.world_size
        self.worker_cls = ray_cls_with_init.cls
        self.resource_pool = resource_pool
        self.call_timeout_s = call_timeout_s
        self.workers = self._start_workers(resource_pool, ray_cls_with_init, start_timeout_s)
        bind_worker_methods(self)

    def _start_workers(self, pool: RayResourcePool, cls_init: ClassWithInitArgs, start_timeout_s: float) -> list:
        remote_cls = ray.remote(cls_init.cls)
        options = dict(getattr(cls_init, "options", {}))
        runtime_env = options.pop("runtime_env", {})
        # Rank 0 opens the rendezvous itself; blank values hide any MASTER_* that Ray's processes
        # inherited from the driver's environment.
        workers, master = [], {"MASTER_ADDR": "", "MASTER_PORT": ""}
        for rank, (pg, bundle, on_node) in enumerate(pool.placements()):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(bundle),
                "LOCAL_WORLD_SIZE": str(on_node),
                "RLFOUNDRY_WORKER_GROUP": self.name,
                **master,
            }
            actor = remote_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
                runtime_env={**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), **env}},
                **pool.actor_resources(),
                **options,
            ).remote(*cls_init.args, **cls_init.kwargs)
            workers.append(actor)
            if rank == 0:
                # Rank 0 chose the rendezvous address on its own node; the other ranks get it by env.
                addr, port = self._get([actor.get_master_addr_port.remote()], "__init__", start_timeout_s)[0]
                master = {"MASTER_ADDR": addr, "MASTER_PORT": port}
        # Wait until every rank is built, so a constructor error surfaces here, naming its rank.
        self._get([w.get_master_addr_port.remote() for w in workers], "__init__", start_timeout_s)
        return workers

    def _execute(self, method: str, calls: RankCalls, execute_mode: Execute) -> list:
        workers = self.workers if execute_mode is Execute.ALL else self.workers[:1]
        args, kwargs = self._put_shared(calls, len(workers))
        return [getattr(w, method).remote(*a, **k) for w, a, k in zip(workers, args, kwargs)]

    @staticmethod
    def _put_shared(calls: RankCalls, n: int) -> tuple[list, list]:
        """Serialise a batch that goes to several ranks (ONE_TO_ALL) once, not once per rank."""
        args, kwargs = calls.args[:n], calls.kwargs[:n]
        values = [v for a, kw in zip(args, kwargs) for v in (*a, *kw.values()) if isinstance(v, _BULKY)]
        seen = Counter(id(v) for v in values)
        refs = {id(v): ray.put(v) for v in values if seen[id(v)] > 1}
        if not refs:
            return args, kwargs
        share = lambda v: refs.get(id(v), v) if isinstance(v, _BULKY) else v  # noqa: E731
        return [tuple(map(share, a)) for a in args], [{k: share(v) for k, v in kw.items()} for kw in kwargs]

    def _get(self, handles: list, method: str, timeout_s: float | None = None) -> list:
        """Results in rank order; fails fast with the rank of the first worker that died or raised."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(handles)}
        results, pending = [None] * len(handles), list(handles)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise WorkerCallTimeout(self.name, sorted(rank_of[r] for r in pending), method, timeout_s)
            for ref in ready:
                results[rank_of[ref]] = self._get_one(ref, rank_of[ref], method)
        return results

    def _get_one(self, ref, rank: int, method: str):
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(self.name, rank, method, e) from e
        except ray.exceptions.RayTaskError as e:
            e.add_note(f"raised in worker group {self.name!r} rank {rank}, method {method!r}")
            raise

    def shutdown(self) -> None:
        """Kill this group's actors (the resource pool stays reserved; ``pool.remove()`` frees it)."""
        for w in self.workers:
            ray.kill(w)
