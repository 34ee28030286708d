"""Base class of every worker role: rank, world size, device and the torch.distributed group.

A worker group starts each rank with these environment variables (torchrun's names, so FSDP2 and
torch.distributed read them too):

| variable | meaning |
|---|---|
| ``RANK``, ``WORLD_SIZE`` | global rank of this process and number of ranks in its group |
| ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` | rank among this group's processes on this node, and their count |
| ``MASTER_ADDR``, ``MASTER_PORT`` | rank 0's node address and a free port, for the rendezvous |
| ``RLFOUNDRY_WORKER_GROUP`` | the group's name (the role), used in log and error messages |

The run's settings for the process (device, collective timeout, malloc tuning) arrive as a
``WorkerRuntime`` init argument, not through the environment. Several roles colocated in one
process (see ``create_colocated_worker_cls``) are several ``Worker`` instances: the roles inherit
the colocated worker's runtime, and they share one process group (``init_distributed`` only
creates it once per process).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlfoundry.cpu.malloc import tune_malloc

DEFAULT_DIST_TIMEOUT_S = 600.0
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class WorkerRuntime:
    """Process-wide settings a worker group hands its ranks (from ``trainer.*``)."""

    device: str = "auto"  # trainer.device: auto (cuda when available) | cpu | cuda
    dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S  # trainer.dist_timeout_s: limit of every collective
    tune_malloc: bool = False  # trainer.tune_malloc: glibc keeps freed memory (cpu/malloc.py)


_inherited: WorkerRuntime | None = None  # set while a colocated worker builds its roles


@contextlib.contextmanager
def roles_inherit(runtime: WorkerRuntime) -> Iterator[None]:
    """Workers built inside the block without a runtime of their own take ``runtime``."""
    global _inherited
    saved, _inherited = _inherited, runtime
    try:
        yield
    finally:
        _inherited = saved


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free right now. Someone else may take it before you bind it: for the worker groups'
    own rendezvous, rank 0 binds its store at construction instead (see _serve_rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Rank 0's rendezvous store, opened when the worker is built (see _serve_rendezvous). One per
# process: roles colocated in the process share it, as they share the process group.
_STORE: dist.TCPStore | None = None


def _serve_rendezvous(addr: str, timeout_s: float) -> int:
    """Open the torch.distributed store on ``addr`` now and return its port.

    Picking a free port and binding it later (at init_process_group) loses races: Ray starts worker
    processes that grab ephemeral ports in between. So rank 0 binds at construction and keeps the
    socket; binding to ``addr`` (not every interface) keeps a local run on loopback.
    """
    global _STORE
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    _STORE = dist.TCPStore(
        addr, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return port


def close_process_group() -> None:
    """Leave this process's process group and close rank 0's store, where this process has them.

    ``init_distributed`` arranges for it to run at exit: a process that ends with its group open
    leaves gloo's and the store's threads to the C++ runtime's teardown, which can abort a finished
    run ("terminate called without an active exception", exit -6) after its work is on disk.
    """
    global _STORE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STORE = None


def _close_at_exit() -> None:
    """Exit finalizers run newest first: one made now (on this module, which lives until exit) runs
    after those of engines built on the group later (vLLM's tears down its subgroups of it) and
    before the interpreter's teardown."""
    weakref.finalize(sys.modules[__name__], close_process_group)


def _node_ip() -> str:
    """This node's address as Ray sees it (other nodes reach rank 0 through it); loopback otherwise.

    A process in a Ray cluster has imported Ray already; importing it only to ask would cost every
    other process ~60 MB of modules (the process back end's driver hosts rank 0).
    """
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def _pick_device(local_rank: int, wanted: str = "auto") -> torch.device:
    if wanted not in DEVICES:
        raise ValueError(f"trainer.device must be one of {list(DEVICES)}, got {wanted!r}")
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but CUDA is not available in this worker process")
    # Ray shows each GPU actor only its own GPU (index 0); torchrun-style launches show all of them.
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank if local_rank < count else 0)


class Worker:
    """Subclasses call ``super().__init__()`` first, then ``self.init_distributed()`` before FSDP2.

    ``runtime``: given by the worker group (``create_colocated_worker_cls``); None: the process's.
    """

    def __init__(self, runtime: WorkerRuntime | None = None):
        self.runtime = runtime or _inherited or WorkerRuntime()
        env = os.environ
        self.rank = int(env.get("RANK", "0"))
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        self.group_name = env.get("RLFOUNDRY_WORKER_GROUP", "worker")
        if self.runtime.tune_malloc:
            tune_malloc()
        if self.rank == 0 and not env.get("MASTER_ADDR"):
            # Rank 0 opens the rendezvous point; the group reads it back and gives it to the others.
            env["MASTER_ADDR"] = _node_ip()
            env["MASTER_PORT"] = str(_serve_rendezvous(env["MASTER_ADDR"], self.runtime.dist_timeout_s))
        self.device = _pick_device(self.local_rank, self.runtime.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def init_distributed(self, timeout_s: float | None = None) -> None:
        """Join the process group of this worker group (once per process; gloo on CPU, NCCL on CUDA).

        Every collective on the group fails after ``timeout_s`` instead of hanging when a peer died.
        """
        if dist.is_initialized():
            return
        timeout = datetime.timedelta(seconds=self.runtime.dist_timeout_s if timeout_s is None else timeout_s)
        # On CUDA keep a gloo backend for CPU tensors too (offloaded state, object collectives).
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        if self.rank == 0 and _STORE is not None:
            _STORE.set_timeout(timeout)
            store = _STORE
        else:  # other ranks (or a torchrun-style launch) connect to rank 0's store by address
            addr, port = self.get_master_addr_port()
            # torchrun's agent may host the store already (then binding it again fails, loudly)
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(addr, int(port), is_master=self.rank == 0 and not agent_store, timeout=timeout)
        dist.init_process_group(
            backend=backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        _close_at_exit()

    def get_master_addr_port(self) -> tuple[str, str]:
        return os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]

    def get_worker_info(self) -> dict:
        """Where this rank runs; used by tests and for debugging placement."""
        info = {"rank": self.rank, "pid": os.getpid(), "hostname": socket.gethostname(), "device": str(self.device)}
        try:
            import ray

            if ray.is_initialized():
                info["node_id"] = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return info
