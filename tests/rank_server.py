"""Start a test's ranks as forks of one warm server process instead of fresh interpreters.

``torch.multiprocessing.spawn`` starts every rank as a new interpreter that imports torch,
transformers and megatron-core again (~7 s of CPU per rank for megatron-core), in each of the ~70
multi-rank calls of a CI run (~60 megatron_ranks.run_ranks, the 2-rank FSDP, Ulysses, SFT and critic
tests). The server is spawned once per pytest process, imports those modules once and forks the ranks
of every call from there.

What a rank is does not change: a new process running the same function with the same arguments, its
own process group and the caller's environment of the moment; it inherits only imported modules (the
server is single-threaded and never runs torch: no thread pool, no process group, no CUDA to fork). As
with ``spawn``, a rank that fails has the others killed (they would wait in a collective for ever) and
the caller gets every rank's exit code.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import signal
import traceback
from multiprocessing import util
from multiprocessing.connection import Connection, wait
from typing import Callable

# what the ranks of the engine tests import; a module that is not installed is left out
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "transformers", "peft", "megatron.core",
           "mbridge", "rlfoundry.engines.megatron.bridge", "rlfoundry.engines.megatron.engine",
           "rlfoundry.engines.fsdp", "rlfoundry.workers.fsdp_workers", "rlfoundry.workers.critic")

_server: tuple[mp.process.BaseProcess, Connection] | None = None


def _run_ranks(fn: Callable, args: tuple, nprocs: int) -> list[int]:
    fork = mp.get_context("fork")
    procs = [fork.Process(target=fn, args=(rank, *args)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        for p in [p for p in running if p.exitcode is not None]:
            running.remove(p)
            if p.exitcode != 0:  # as mp.spawn: the others may wait for the failed one in a collective
                for other in running:
                    other.kill()
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def _serve(conn: Connection, preload: tuple[str, ...]) -> None:
    os.setsid()  # its own process group: a caller that gives up kills the server and its ranks at once
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that is missing only costs the ranks its import
            pass
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:
            return
        try:
            fn, args, nprocs, environ = pickle.loads(request)
            os.environ.clear()
            os.environ.update(environ)
            conn.send(("ok", _run_ranks(fn, args, nprocs)))
        except Exception:  # noqa: BLE001 - the caller reports it
            conn.send(("error", traceback.format_exc()))


def _stop() -> None:
    global _server
    if _server is None:
        return
    proc, conn = _server
    _server = None
    conn.close()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.join(10)


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1) -> list[int]:
    """Run ``fn(rank, *args)`` for each rank in a process forked from the warm server; wait for all of
    them and return their exit codes (a rank that raises exits 1, and the other ranks are killed)."""
    global _server
    if _server is None or not _server[0].is_alive():
        _stop()
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, PRELOAD), name="rank-server")
        proc.start()
        child.close()
        _server = (proc, conn)
    proc, conn = _server
    try:
        # pickled here (plain pickle: tensors by value), so a function or argument that cannot be sent
        # fails in the caller with its own error
        conn.send_bytes(pickle.dumps((fn, args, nprocs, dict(os.environ))))
        status, reply = conn.recv()
    except BaseException:  # a timeout or an interrupt while ranks run: do not leave them behind
        _stop()
        raise
    if status != "ok":
        raise RuntimeError(f"the rank server could not start the ranks:\n{reply}")
    return reply


# multiprocessing's exit hook runs its finalizers before it joins the children still alive (the server
# would be joined for ever)
util.Finalize(None, _stop, exitpriority=10)


def run(fn: Callable, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` from the warm server: fails if a rank failed."""
    codes = spawn(fn, args, nprocs)
    if any(codes):
        raise AssertionError(f"ranks exited with codes {codes} (a failed rank's traceback is in the captured stderr)")
