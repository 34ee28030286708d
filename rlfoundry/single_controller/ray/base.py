"""The Ray back end: resource pools of placement groups, and one Ray actor per rank.

    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, name_prefix="global_pool")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(MyWorker, cfg), name_prefix="actor")
    group.init_model()                      # any @register'ed method of MyWorker

Calls go through the same dispatch → execute → collect core as the local back end
(``base/worker_group.py``); this file only places actors and waits for their results, turning a
dead actor into ``WorkerDiedError`` (naming group and rank), a lost node — Ray's node death, or
the reset connection a surviving rank's collective sees first — into ``NodeDiedError`` (naming the
node, the group's roles and the ranks on it) and a slow call into ``WorkerCallTimeout``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter

import numpy as np
import torch

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlfoundry.protocol import DataProto
from rlfoundry.single_controller.base.colocate import create_colocated_worker_cls
from rlfoundry.single_controller.base.decorator import Execute, RankCalls
from rlfoundry.single_controller.base.worker import Worker
from rlfoundry.single_controller.base.worker_group import (
    ClassWithInitArgs,
    NodeDiedError,
    PeerLostError,
    WorkerCallTimeout,
    WorkerDiedError,
    WorkerGroup,
    bind_worker_methods,
)

_BULKY = (DataProto, torch.Tensor, np.ndarray)
NODE_LABEL = "ray.io/node-id"  # the label every Ray node carries (a placement group can exclude nodes by it)
# What a rank's collective (gloo, NCCL, the TCP store) raises when a peer's process or node went away.
_PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|ECONNRESET|"
                        r"NCCL communicator was aborted|remote process exited|DistNetworkError")

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "create_colocated_worker_cls"]


def _peer_lost_line(error: BaseException) -> str | None:
    """The line of a worker's error that says its collective lost a peer (None: some other error)."""
    text = str(getattr(error, "cause", None) or error)
    for line in reversed(text.splitlines()):
        found = _PEER_LOST.search(line)
        if found:  # up to the match, without gloo's source location: "Read error [10.0.0.2]:2996: Connection reset by peer"
            return re.sub(r"^\s*\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line[:found.end()])[-300:]
    return None


def _node_death_wait(error: BaseException) -> float:
    """Seconds to wait for ray.nodes() to show a node death that Ray's actor error already mentions."""
    return 5.0 if re.search(r"node.{0,40}(died|dead)", str(error), re.IGNORECASE) else 0.0


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
    first use; Ray picks each one's node (STRICT_PACK keeps a group on one node), excluding the nodes
    the pool's earlier groups took, so ``[n] * nnodes`` is ``nnodes`` distinct nodes as configured
    (Ray alone may pack two small groups onto one big node). ``node_ids``: where each group landed.
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
        self.node_ids: list[str] = []

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
            tag, deadline = uuid.uuid4().hex[:8], time.monotonic() + self.ready_timeout_s
            pgs, nodes = [], []
            for i, n in enumerate(self.process_on_nodes):
                # One at a time: each group must know the nodes taken before it (pg.wait asks the GCS, no task).
                exclude = {"bundle_label_selector": [{NODE_LABEL: f"!in({','.join(nodes)})"}] * n} if nodes else {}
                pgs.append(placement_group([self.bundle] * n, strategy="STRICT_PACK",
                                           name=f"{self.name_prefix}_{tag}_{i}", **exclude))
                if not pgs[-1].wait(max(0.0, deadline - time.monotonic())):
                    for pg in pgs:
                        remove_placement_group(pg)
                    raise RuntimeError(
                        f"resource pool {self.name_prefix!r} could not reserve {self.process_on_nodes} processes per "
                        f"node x {self.bundle}, each entry on its own node, within {self.ready_timeout_s:g} s; "
                        f"cluster has {ray.cluster_resources()} in total, {ray.available_resources()} free, on "
                        f"{sum(node['Alive'] for node in ray.nodes())} live nodes."
                    )
                nodes.append(placement_group_table(pgs[-1])["bundles_to_node_id"][0])
            self._pgs, self.node_ids = pgs, nodes
        return self._pgs

    def placements(self) -> list[tuple]:
        """(placement group, bundle index = local rank, processes on that node) for each global rank."""
        return [(pg, i, n) for pg, n in zip(self.get_placement_groups(), self.process_on_nodes) for i in range(n)]

    def rank_nodes(self) -> list[str]:
        """The Ray node id of each global rank."""
        self.get_placement_groups()
        return [node for node, n in zip(self.node_ids, self.process_on_nodes) for _ in range(n)]

    def remove(self) -> None:
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs, self.node_ids = None, []


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per rank of ``resource_pool``, each an instance of the worker class.

    ``call_timeout_s``: how long any call may take before ``WorkerCallTimeout`` (None: no limit;
    a dead worker is still reported as soon as Ray notices, usually within a second or two).
    ``peer_loss_wait_s``: when a rank's collective reports a lost peer, how long to wait for Ray to
    say which node or worker died (a killed raylet is declared dead after its missed health checks,
    about 15 s with Ray's defaults) before reporting the lost connection alone (``PeerLostError``).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: ClassWithInitArgs,
        name_prefix: str | None = None,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300,
        peer_loss_wait_s: float = 60,
    ):
        if not issubclass(ray_cls_with_init.cls, Worker):
            raise TypeError(f"{ray_cls_with_init.cls.__name__} must subclass rlfoundry.single_controller.Worker")
        self.name = name_prefix or resource_pool.name_prefix
        self.world_size = resource_pool.world_size
        self.worker_cls = ray_cls_with_init.cls
        self.resource_pool = resource_pool
        self.call_timeout_s, self.peer_loss_wait_s = call_timeout_s, peer_loss_wait_s
        self.roles = sorted(getattr(self.worker_cls, "colocated_roles", None) or [self.name])  # all of a rank's roles
        self.rank_nodes = resource_pool.rank_nodes()  # reserves the pool's nodes if not done yet
        self.workers = self._start_workers(resource_pool, ray_cls_with_init, start_timeout_s)
        bind_worker_methods(self)

    def placement_summary(self) -> str:
        """One line: which node each rank runs on (the trainer prints it at start-up)."""
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        where = ", ".join(f"rank {r} on node {ips.get(node, '?')} ({node})" for r, node in enumerate(self.rank_nodes))
        return f"worker group {self.name!r} ({', '.join(self.roles)}): {where}"

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
                results[rank_of[ref]] = self._get_one(ref, rank_of[ref], method, [(rank_of[r], r) for r in pending])
        return results

    def _get_one(self, ref, rank: int, method: str, others: list):
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise self._actor_lost(method, rank, e) from e
        except ray.exceptions.RayTaskError as e:
            seen = _peer_lost_line(e)
            if seen is not None:  # a peer's process or node went away mid-collective: find out which
                raise self._lost_peer(method, rank, seen, others) from e
            e.add_note(f"raised in worker group {self.name!r} rank {rank}, method {method!r}")
            raise

    def _dead_node(self, method: str, seen: str | None = None, wait_s: float = 0) -> NodeDiedError | None:
        """``NodeDiedError`` for the first node of this group that Ray reports dead (polled up to ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if not n["Alive"]}
            for node in dict.fromkeys(self.rank_nodes):
                if node in dead:
                    ranks = [r for r, n in enumerate(self.rank_nodes) if n == node]
                    return NodeDiedError(self.name, ranks, method, dead[node], node, self.roles, seen)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.25)

    def _actor_lost(self, method: str, rank: int, error: BaseException, seen: str | None = None,
                    wait_s: float | None = None) -> WorkerDiedError:
        """A rank's actor died, or is unreachable (its raylet was killed: Ray says "unavailable" at once
        and "dead" only after the node's health checks fail): the dead node once Ray reports it, else
        that worker."""
        unavailable = isinstance(error, getattr(ray.exceptions, "ActorUnavailableError", ()))
        if wait_s is None:
            wait_s = self.peer_loss_wait_s if unavailable else _node_death_wait(error)
        return self._dead_node(method, seen, wait_s) or WorkerDiedError(self.name, rank, method, error)

    def _lost_peer(self, method: str, rank: int, seen: str, others: list) -> Exception:
        """Wait (up to ``peer_loss_wait_s``) until Ray reports the node or the worker that went away."""
        deadline = time.monotonic() + self.peer_loss_wait_s
        while time.monotonic() < deadline:
            node_error = self._dead_node(method, seen)
            if node_error is not None:
                return node_error
            for other, ref in others:
                if ray.wait([ref], timeout=0)[0]:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        return self._actor_lost(method, other, e, seen, max(0.0, deadline - time.monotonic()))
                    except Exception:
                        pass
            time.sleep(0.5)
        node = self.rank_nodes[rank] if rank < len(self.rank_nodes) else "?"
        return PeerLostError(self.name, rank, node, method, seen, self.peer_loss_wait_s)

    def shutdown(self) -> None:
        """Kill this group's actors (the resource pool stays reserved; ``pool.remove()`` frees it)."""
        for w in self.workers:
            ray.kill(w)
