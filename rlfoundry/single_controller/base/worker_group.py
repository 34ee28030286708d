"""What every worker group back end shares: the bound methods and the dispatch → execute → collect core.

A back end (``LocalWorkerGroup``, ``RayWorkerGroup``) only provides

    world_size                                  number of ranks
    _execute(method, calls, execute_mode)       start the method on the ranks, return handles
    _get(handles)                               wait for handles, return one result per rank

and calls ``bind_worker_methods(self)`` from its constructor.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from rlfoundry.single_controller.base.decorator import DISPATCH_TABLE, Execute, MethodSpec, RankCalls, registered_methods


class WorkerGroupError(RuntimeError):
    """Base class of the errors a worker group raises on the driver."""


RESUME_HINT = "rerun the same command with trainer.resume_mode=auto to continue from the newest intact checkpoint"


class WorkerDiedError(WorkerGroupError):
    """A worker process of the group exited (crash, OOM kill, node loss) before answering."""

    def __init__(self, group: str, rank: int, method: str, cause: BaseException | None = None):
        self.group, self.rank, self.method = group, rank, method
        super().__init__(
            f"worker group {group!r} rank {rank} died while running {method!r}"
            f"{f': {type(cause).__name__}: {cause}' if cause else ''}. The other ranks of the group "
            f"cannot continue; check that worker's log (OOM killer, segfault) and {RESUME_HINT}."
        )


class NodeDiedError(WorkerDiedError):
    """A node of the Ray cluster died (its raylet was killed, the machine went away) holding ranks of the group.

    ``seen``: what the surviving rank that noticed first raised (a collective's reset connection), if any.
    """

    def __init__(self, group: str, ranks: list[int], method: str, node_ip: str, node_id: str, roles: list[str],
                 seen: str | None = None):
        WorkerGroupError.__init__(
            self,
            f"Ray node {node_ip} (node id {node_id}) died while worker group {group!r} ran {method!r}: rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {', '.join(roles)} ran on it"
            f"{f' (a surviving rank saw {seen})' if seen else ''}. The run cannot continue without "
            f"{'them' if len(ranks) > 1 else 'it'}; bring the node back (or give the cluster the same "
            f"resources) and {RESUME_HINT}."
        )
        self.group, self.rank, self.ranks, self.method = group, ranks[0], ranks, method
        self.node_ip, self.node_id, self.roles = node_ip, node_id, roles


class PeerLostError(WorkerGroupError):
    """A rank's collective lost its connection to a peer, and no node or worker was reported dead in time."""

    def __init__(self, group: str, rank: int, node: str, method: str, seen: str, waited_s: float):
        self.group, self.rank, self.method = group, rank, method
        super().__init__(
            f"worker group {group!r} rank {rank} (on node {node}) lost its connection to a peer while running "
            f"{method!r}: {seen}. No node or worker of the group was reported dead within {waited_s:g} s; check "
            f"the network between the nodes and the other ranks' logs, then {RESUME_HINT}."
        )


class WorkerCallTimeout(WorkerGroupError):
    """A remote call did not finish within the group's call timeout."""

    def __init__(self, group: str, ranks: list[int], method: str, timeout_s: float):
        self.group, self.ranks, self.method, self.timeout_s = group, ranks, method, timeout_s
        super().__init__(
            f"worker group {group!r} ranks {ranks} did not finish {method!r} within {timeout_s:g} s "
            "(call_timeout_s). A peer may be stuck in a collective; raise the timeout if the work "
            "is just slow."
        )


class ClassWithInitArgs:
    """A worker class and its constructor arguments, built later on the rank that runs it."""

    def __init__(self, cls: type, *args, **kwargs):
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def __call__(self):
        return self.cls(*self.args, **self.kwargs)


class WorkerFuture:
    """The result of a ``blocking=False`` method (or ``execute_all_async``): ``.get()`` waits and collects.

    Passing a WorkerFuture as an argument to another group method resolves it on the driver first.
    """

    def __init__(self, group: "WorkerGroup", method: str, handles: list, collect: Callable[[list], Any]):
        self._group, self._method, self._handles, self._collect = group, method, handles, collect
        self._done, self._value = False, None

    def get(self):
        if not self._done:
            self._value = self._collect(self._group._get(self._handles, self._method))
            self._done = True
        return self._value


class WorkerGroup:
    name: str
    world_size: int
    worker_cls: type

    # --- back-end interface --------------------------------------------------------------------
    def _execute(self, method: str, calls: RankCalls, execute_mode: Execute) -> list:
        raise NotImplementedError

    def _get(self, handles: list, method: str) -> list:
        raise NotImplementedError

    # --- shared API ----------------------------------------------------------------------------
    def execute_all_async(self, method: str, *args, **kwargs) -> WorkerFuture:
        """Run ``method`` on every rank with the same arguments; ``.get()`` gives the list of results."""
        calls = RankCalls([args] * self.world_size, [kwargs] * self.world_size)
        return WorkerFuture(self, method, self._execute(method, calls, Execute.ALL), list)

    def execute_all(self, method: str, *args, **kwargs) -> list:
        return self.execute_all_async(method, *args, **kwargs).get()

    def execute_rank_zero(self, method: str, *args, **kwargs):
        calls = RankCalls([args] * self.world_size, [kwargs] * self.world_size)
        return self._get(self._execute(method, calls, Execute.RANK_ZERO), method)[0]

    def spawn(self, prefix_set) -> dict[str, "WorkerGroup"]:
        """Views of a colocated group, one per role, whose methods drop the ``<role>_`` prefix.

        The views share this group's processes; only the method names (and error messages) differ.
        """
        roles = getattr(self.worker_cls, "colocated_roles", None)
        if roles is None:
            raise TypeError(
                f"{self.worker_cls.__name__} is not a colocated class; build it with create_colocated_worker_cls"
            )
        views = {}
        for role in prefix_set:
            if role not in roles:
                raise KeyError(f"role {role!r} is not in the colocated class; it has {sorted(roles)}")
            view = copy.copy(self)
            for name in self._bound_names:
                view.__dict__.pop(name, None)
            view.name = f"{self.name}/{role}"
            view.worker_cls = roles[role]
            bind_worker_methods(view, prefix=f"{role}_")
            views[role] = view
        return views


def _resolve_futures(values):
    return [v.get() if isinstance(v, WorkerFuture) else v for v in values]


def make_group_method(group: WorkerGroup, remote_name: str, spec: MethodSpec):
    """The group-side method: dispatch → execute → collect (collect deferred when not blocking)."""
    dispatch_fn, collect_fn = DISPATCH_TABLE[spec.dispatch_mode]

    def start(*args, **kwargs) -> WorkerFuture:
        args, kwargs = _resolve_futures(args), dict(zip(kwargs, _resolve_futures(kwargs.values())))
        calls = dispatch_fn(group, *args, **kwargs)
        handles = group._execute(remote_name, calls, spec.execute_mode)
        return WorkerFuture(group, remote_name, handles, lambda outs: collect_fn(group, outs, calls.pad_size, calls.chunk_rows))

    def call(*args, **kwargs):
        future = start(*args, **kwargs)
        return future.get() if spec.blocking else future

    call.__name__ = remote_name
    # ``group.method.future(...)``: start the call and return its WorkerFuture whatever ``blocking``
    # says (two pools working at once: a rollout generating while the trainer updates)
    call.future = start
    return call


def bind_worker_methods(group: WorkerGroup, prefix: str = "") -> None:
    """Expose each ``@register``ed method of ``group.worker_cls`` as a group method of the same name.

    With ``prefix`` (views from ``spawn``), the worker's method ``<prefix><name>`` is bound as ``<name>``.
    """
    group._bound_names = []
    for name, spec in registered_methods(group.worker_cls).items():
        remote_name = f"{prefix}{name}"
        if hasattr(group, name):
            raise AttributeError(
                f"worker method {name!r} of {group.worker_cls.__name__} would hide the worker group's own attribute"
            )
        method = make_group_method(group, remote_name, spec)
        method.__doc__ = getattr(group.worker_cls, name).__doc__
        setattr(group, name, method)
        group._bound_names.append(name)
