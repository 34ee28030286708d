"""The multi-process back end without Ray: rank 0 in the driver, ranks 1…W-1 in child processes.

For one machine (a multi-core CPU box, or one GPU node) Ray's own processes — GCS, raylet,
agents, one Python worker per actor, each importing Ray — cost more memory and start-up than the
work needs. Here the driver hosts rank 0 itself (as ``LocalWorkerGroup`` does) and starts W-1
plain child processes, each building the same worker class and answering calls over a pipe.

Start method (``start_method``): ``fork`` children share the driver's already-imported torch and
transformers pages copy-on-write (about 300 MB of private memory per rank otherwise, most of the
cost of a rank on a small model); ``spawn`` children import everything afresh. ``auto`` forks
only where that is safe: Linux, one intra-op thread per rank (GNU OpenMP's thread pool does not
survive a fork: a child that runs a parallel region with more threads hangs), ranks on the CPU
(a child cannot initialise CUDA once its parent asked CUDA anything), and a driver with no CUDA
context, torch.distributed group or Ray runtime yet. Children are started before rank 0's
worker exists, so no model, process group or CUDA state is ever inherited; each receives its
environment (rendezvous address included) as its first message.
The ranks form a torch.distributed group exactly as on Ray, so FSDP2 and every collective run
unchanged; the dispatch → execute → collect core is the shared one in ``base/worker_group.py``.

Messages go over ``multiprocessing`` pipes between this process and its child ranks, never from
files. Tensors of up to ``_INLINE_BYTES`` travel inside the message (``_MessagePickler``); larger
ones in shared memory, as the standard library's connection sends them once torch is imported.
Shared memory costs a file descriptor handed over on a connection of its own per tensor (~0.25 ms
each): a batch of a dozen small tensors took ~3 ms to reach a rank that way; inline, a round trip
of such a batch takes ~0.3 ms.
A call sends each remote rank its arguments first, then runs rank 0 in the driver (so collectives
meet), then collects the replies in rank order. A rank that dies raises ``WorkerDiedError`` (the
group is unusable after it); ``call_timeout_s`` bounds a call (``WorkerCallTimeout``; the group
stays usable, and the late replies of that call are dropped when they arrive). Remote
processes ignore Ctrl-C (the driver handles it) and exit when the driver's end of their pipe closes,
so a killed driver leaves no orphans; at the driver's normal exit the group shuts itself down.
They are not daemonic: a rank may start processes of its own (megatron-core's checkpoint writer
does; a daemonic process may not have children).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import io
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from collections.abc import Callable
from typing import Any

from rlfoundry.config.schema import START_METHODS  # trainer.process_start_method's values
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
from rlfoundry.single_controller.local import set_rank_env

__all__ = ["ProcessWorkerGroup", "START_METHODS", "threads_per_rank"]


_LOCAL = "local"  # the handle of rank 0's call, whose result is already in hand
# CPU tensors up to this size are copied into the message; larger ones go through shared memory
_INLINE_BYTES = 1 << 20


def _tensor_from_bytes(data: bytes, dtype, shape: tuple[int, ...]):
    import torch

    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _MessagePickler(ForkingPickler):
    """``ForkingPickler`` (shared memory for tensors, fds for pipes) with small CPU tensors inline.

    A tensor that does not need grad is sent by value, as its bytes: only its own elements, also
    when it is a view of a larger batch (the shared-memory path moves the whole storage).
    """

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if (torch is None or type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.requires_grad
                or obj.layout is not torch.strided or obj.is_quantized or obj.numel() * obj.element_size() > _INLINE_BYTES):
            return NotImplemented
        plain = obj.resolve_conj().resolve_neg().contiguous()
        data = plain.view(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b""
        return _tensor_from_bytes, (data, obj.dtype, tuple(obj.shape))


def _send_message(conn: Connection, message: Any) -> None:
    """``conn.send(message)`` with ``_MessagePickler``; the other end reads it with ``conn.recv()``."""
    buf = io.BytesIO()
    _MessagePickler(buf, pickle.HIGHEST_PROTOCOL).dump(message)
    conn.send_bytes(buf.getbuffer())


@dataclasses.dataclass(frozen=True)
class _Call:
    """The handle of one remote call: its rank and its place among the calls sent to that rank.

    A rank answers its calls in order on its pipe, so the n-th reply read belongs to the n-th call
    sent; a reply read while waiting for another call (an earlier future not collected yet) is
    kept for its own ``get``, and one of a call that timed out is dropped when it arrives.
    """

    rank: int
    index: int


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads for each rank so that the ranks together use every core once.

    An explicit ``OMP_NUM_THREADS`` wins; otherwise torch would give every process all the cores
    and W processes would fight over them.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // world_size)


def _portable(cls_with_init: ClassWithInitArgs) -> tuple:
    """What a spawned process needs to build the worker: a colocated class is rebuilt from its roles
    there (the fused class is made at run time and cannot be pickled by reference)."""
    roles = getattr(cls_with_init.cls, "colocated_roles", None)
    if roles is None:
        return ("plain", cls_with_init.cls, cls_with_init.args, cls_with_init.kwargs)
    inits, runtime = cls_with_init.args
    return ("colocated", {role: (roles[role], *inits[role]) for role in inits}, runtime)


def _build(spec: tuple):
    if spec[0] == "plain":
        _, cls, args, kwargs = spec
        return cls(*args, **kwargs)
    fused = create_colocated_worker_cls({r: ClassWithInitArgs(c, *a, **k) for r, (c, a, k) in spec[1].items()},
                                        runtime=spec[2])
    return fused()


def _error_reply(err: BaseException) -> tuple:
    """("err", exception, traceback text); an exception that cannot be pickled travels as text."""
    text = traceback.format_exc()
    try:
        pickle.dumps(err)
        return ("err", err, text)
    except Exception:  # noqa: BLE001 - anything unpicklable is described instead
        return ("err", RuntimeError(f"{type(err).__name__}: {err}"), text)


def _rank_main(conn: Connection, spec: tuple, threads: int, inherited: list[Connection]) -> None:
    """A remote rank: take its env, build the worker, then answer (method, args, kwargs) until the
    pipe closes. ``inherited``: pipe ends a forked child holds by accident (the driver's ends of its
    own and earlier ranks' pipes); closed, or a dead driver would never look like EOF to anyone."""
    for other in inherited:
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(threads)
    try:
        message = conn.recv()
    except EOFError:  # the driver gave up before this rank was needed
        return
    if message[0] != "__init__":
        return
    try:
        os.environ.update(message[1][0])
        worker = _build(spec)
        conn.send(("ok", None))
    except BaseException as err:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(_error_reply(err))
        return
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:  # the driver closed the pipe or died
            return
        if method is None:
            return
        try:
            reply = ("ok", getattr(worker, method)(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001
            reply = _error_reply(err)
        try:
            _send_message(conn, reply)
        except Exception as err:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send(_error_reply(err))


def resolve_start_method(requested: str, threads: int, device: str = "cpu") -> str:
    """``fork`` or ``spawn`` for ``requested`` (one of ``START_METHODS``) and ranks on ``device``
    (``trainer.device``); see the module docstring."""
    if requested not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {requested!r}")
    unsafe = _fork_hazards(threads, device)
    if requested == "fork" and unsafe:
        raise RuntimeError(f"cannot fork worker ranks: {unsafe}; use start_method='spawn' (or 'auto')")
    if requested == "auto":
        return "spawn" if unsafe else "fork"
    return requested


def _fork_hazards(threads: int, device: str = "cpu") -> str | None:
    """Why forking this process now for ranks on ``device`` would be unsafe, or None."""
    import torch
    import torch.distributed as dist

    if "fork" not in mp.get_all_start_methods():
        return "this platform has no fork"
    if threads != 1:
        return f"{threads} intra-op threads per rank (GNU OpenMP's pool does not survive a fork)"
    if torch.cuda.is_initialized():
        return "this process already holds a CUDA context"
    # torch marks a process's future children unable to initialise CUDA as soon as it asks the CUDA
    # runtime anything (torch.cuda.is_available() and device_count() included), with no way to ask
    # whether it has: a driver hosting a rank, or one that only checked the device, had done so on
    # the H100 (issue 33: a one-step-off run's rollout rank died at torch.cuda.set_device)
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return "the ranks use CUDA, which a forked child cannot initialise once its parent asked CUDA anything"
    if dist.is_initialized():
        return "this process already belongs to a torch.distributed group"
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return "this process runs a Ray driver"
    return None


def _ranks_device(cls_with_init: ClassWithInitArgs) -> str:
    """The ``trainer.device`` the ranks will use: their ``WorkerRuntime``'s (an argument of the
    colocated class), else a worker's default, ``auto``."""
    from rlfoundry.single_controller.base.worker import WorkerRuntime

    found = [a for a in (*cls_with_init.args, *cls_with_init.kwargs.values()) if isinstance(a, WorkerRuntime)]
    return found[0].device if found else "auto"


def _check_no_other_group(world_size: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise RuntimeError(
            f"this process already belongs to a torch.distributed group of {dist.get_world_size()} rank(s), "
            f"so it cannot host rank 0 of a {world_size}-rank group; pass host_rank_zero=False (every rank in "
            "a child process) or start the run in a fresh process"
        )


class ProcessWorkerGroup(WorkerGroup):
    """``world_size`` ranks on this machine: rank 0 in this process, the others spawned.

    ``group.worker`` is rank 0's worker object (breakpoints in its methods stop the driver).
    A process belongs to at most one torch.distributed group, so a driver that already joined one
    (an earlier group of another size, a test process) passes ``host_rank_zero=False``: then every
    rank is a child process and the driver only dispatches.

    ``start_method``: ``auto`` | ``fork`` | ``spawn`` (module docstring). ``preload``: called in
    this process just before forking, to import what every rank's worker will import (the model's
    code, say), so that the ranks share those pages instead of each importing a private copy.
    ``threads``: intra-op threads per rank (default ``threads_per_rank(world_size)``; several groups
    on one machine share its cores).
    """

    def __init__(
        self,
        cls_with_init: ClassWithInitArgs,
        world_size: int,
        name_prefix: str = "process",
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300,
        host_rank_zero: bool = True,
        start_method: str = "auto",
        preload: Callable[[], None] | None = None,
        threads: int | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not issubclass(cls_with_init.cls, Worker):
            raise TypeError(f"{cls_with_init.cls.__name__} must subclass rlfoundry.single_controller.Worker")
        self.name, self.world_size, self.worker_cls = name_prefix, world_size, cls_with_init.cls
        self.call_timeout_s = call_timeout_s
        self._threads = threads
        self._ranks = _Ranks()  # shared with the role views ``spawn`` copies from this group
        self._procs, self._conns = self._ranks.procs, self._ranks.conns
        self._sent: dict[int, int] = {}  # calls sent to each rank (replies come back in that order)
        self._received: dict[int, int] = {}  # replies read from each rank
        self._early: dict[_Call, tuple] = {}  # replies read before their call was collected
        self._abandoned: set[_Call] = set()  # calls that timed out: their replies are dropped
        self.worker = None
        # runs before multiprocessing's own exit hook, which would wait for the (non-daemonic) ranks
        # forever; a weak reference, so that a dropped group is still collected (its ranks then see
        # their pipes close and exit). It refers to the ranks, not to this object: the trainer keeps
        # only the role views (copies), and a hook on the dropped original left a one-step-off run's
        # rollout rank alive at exit, the driver waiting for it forever (issue 33).
        atexit.register(_shutdown_at_exit, weakref.ref(self._ranks))
        try:
            self._start(cls_with_init, host_rank_zero, start_timeout_s, start_method, preload)
        except BaseException:
            self.shutdown(timeout_s=5)  # no orphaned or zombie ranks when a constructor fails
            raise
        bind_worker_methods(self)

    def _start(self, cls_with_init: ClassWithInitArgs, host_rank_zero: bool, start_timeout_s: float,
               start_method: str, preload: Callable[[], None] | None) -> None:
        world_size = self.world_size
        threads, spec = self._threads or threads_per_rank(world_size), _portable(cls_with_init)
        if host_rank_zero:
            _check_no_other_group(world_size)
        self.start_method = resolve_start_method(start_method, threads, _ranks_device(cls_with_init))
        if self.start_method == "fork":
            if preload is not None:
                preload()
            # Objects alive now are shared copy-on-write; the collector would otherwise write to
            # every one of them in a child (and copy its page) on its first full collection.
            gc.freeze()
        for rank in range(1 if host_rank_zero else 0, world_size):  # before rank 0 exists: nothing of it is forked
            self._start_rank(rank, spec, threads)
        if host_rank_zero:
            import torch

            torch.set_num_threads(threads)
            set_rank_env(self.name, 0, world_size)
            self.worker = cls_with_init()  # rank 0 opens the rendezvous; its address is now in os.environ
            master = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT")}
        else:
            # rank 0 opens the rendezvous in its own process and tells us where
            self._get([self._init_rank(0, {"MASTER_ADDR": "", "MASTER_PORT": ""})], "__init__", start_timeout_s)
            addr, port = self._call_remote(0, "get_master_addr_port", start_timeout_s)
            master = {"MASTER_ADDR": addr, "MASTER_PORT": port}
        inits = [self._init_rank(rank, master) for rank in range(1, world_size)]
        self._get(inits, "__init__", start_timeout_s)  # every constructor ran

    def _start_rank(self, rank: int, spec: tuple, threads: int) -> None:
        """Start one rank's process; it waits for its environment (``_init_rank``) before building."""
        ctx = mp.get_context(self.start_method)
        parent, child = ctx.Pipe()
        # a forked child inherits every open pipe end of this process; it closes the drivers' ones
        inherited = [*self._conns.values(), parent] if self.start_method == "fork" else []
        proc = ctx.Process(target=_rank_main, args=(child, spec, threads, inherited), daemon=False,
                           name=f"{self.name}-rank{rank}")
        proc.start()
        child.close()
        self._procs[rank], self._conns[rank] = proc, parent

    def _init_rank(self, rank: int, master: dict[str, str]) -> _Call:
        env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(self.world_size), "RLFOUNDRY_WORKER_GROUP": self.name, **master}
        return self._send(rank, ("__init__", (env,), {}))

    def _call_remote(self, rank: int, method: str, timeout_s: float | None = None):
        return self._get([self._send(rank, (method, (), {}))], method, timeout_s)[0]

    # --- back-end interface ----------------------------------------------------------------

    def _execute(self, method: str, calls: RankCalls, execute_mode: Execute) -> list:
        ranks = range(self.world_size) if execute_mode is Execute.ALL else range(1)
        remote = [self._send(r, (method, calls.args[r], calls.kwargs[r])) for r in ranks if r in self._conns]
        if self.worker is None:
            return remote
        try:
            local = ("ok", getattr(self.worker, method)(*calls.args[0], **calls.kwargs[0]))
        except Exception as err:  # noqa: BLE001 - raised in _get, after the other ranks answered
            local = ("err", err, None)
        return [(_LOCAL, local), *remote]

    def _get(self, handles: list, method: str, timeout_s: float | None = None) -> list:
        """Results in rank order; raises rank 0's error only after the remote ranks answered."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        remote = [h for h in handles if isinstance(h, _Call)]
        replies = dict(self._receive(remote, method, deadline, timeout_s))
        results = []
        for h in handles:
            rank, reply = (h.rank, replies[h]) if isinstance(h, _Call) else (0, h[1])
            if reply[0] == "err":
                err = reply[1]
                if reply[2]:
                    err.add_note(f"raised in worker group {self.name!r} rank {rank}, method {method!r}:\n{reply[2]}")
                raise err
            results.append(reply[1])
        return results

    def _send(self, rank: int, message: tuple) -> _Call:
        try:
            _send_message(self._conns[rank], message)
        except (BrokenPipeError, ConnectionResetError, OSError) as err:
            raise WorkerDiedError(self.name, rank, message[0], err) from err
        call = _Call(rank, self._sent.get(rank, 0))
        self._sent[rank] = call.index + 1
        return call

    def _receive(self, calls: list[_Call], method: str, deadline: float | None, timeout_s: float | None):
        """(call, reply) for each of ``calls`` as they arrive; a dead process is a WorkerDiedError."""
        pending = {}
        for call in calls:
            if call in self._early:
                yield call, self._early.pop(call)
            else:
                pending[self._conns[call.rank]] = call
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*pending, *(self._procs[c.rank].sentinel for c in pending.values())], timeout=left)
            if not ready:
                self._abandoned.update(pending.values())
                raise WorkerCallTimeout(self.name, sorted(c.rank for c in pending.values()), method, timeout_s)
            for conn, call in list(pending.items()):
                if conn in ready or conn.poll():  # a reply, even from a process that exited since
                    got = _Call(call.rank, self._received.get(call.rank, 0))
                    reply = self._read_reply(conn, call.rank, method)
                    self._received[call.rank] = got.index + 1
                    if got == call:
                        del pending[conn]
                        yield call, reply
                    elif got in self._abandoned:
                        self._abandoned.discard(got)
                    else:
                        self._early[got] = reply
                elif self._procs[call.rank].sentinel in ready:
                    code = self._procs[call.rank].exitcode
                    raise WorkerDiedError(self.name, call.rank, method, RuntimeError(f"process exit code {code}"))

    def _read_reply(self, conn: Connection, rank: int, method: str) -> tuple:
        try:
            return conn.recv()
        except (EOFError, ConnectionResetError, OSError) as err:
            raise WorkerDiedError(self.name, rank, method, err) from err

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the remote ranks to exit, then kill whatever is left (for this group and all its views)."""
        self._ranks.shutdown(timeout_s)
        self._sent, self._received, self._early, self._abandoned = {}, {}, {}, set()


class _Ranks:
    """A group's child processes and the driver's ends of their pipes, by rank: one object shared by
    the group and every role view of it, emptied in place when they are shut down."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Connection] = {}

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for conn in self.conns.values():
            try:
                conn.send((None, (), {}))
            except OSError:
                pass
        for proc in self.procs.values():
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns.values():
            conn.close()
        self.procs.clear()
        self.conns.clear()


def _shutdown_at_exit(ranks_ref: weakref.ref) -> None:
    ranks = ranks_ref()
    if ranks is not None:
        ranks.shutdown()

