"""A process pool for reward scoring that survives its scorers.

``concurrent.futures`` cannot stop one hung task, and one worker that dies breaks the whole
executor; reward functions written by users do both. So each worker here is a process of its own
with a pipe, runs one sample at a time, and the driver watches each worker's deadline and process
sentinel: a sample that raises, runs past ``timeout_s`` or kills its process comes back as an
``Outcome`` with ``error`` set, the offending worker is killed and replaced, and the batch goes on.

Workers are started with ``forkserver`` (POSIX) or ``spawn``, never plain ``fork``: the driver
holds torch / tokenizer / Ray threads that a fork would copy mid-lock. The scorer is therefore
pickled to each worker, so it must be a module-level function, a ``functools.partial`` of one, or
a ``FileRewardFunction`` (which re-imports its file in the worker).

``LazyScoringPool`` owns a pool's life cycle for the reward managers: it starts the pool on first
use, scores an unpicklable scorer in the driver, replaces a pool that broke, and closes it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing as mp
import pickle
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Modules the forkserver imports once, so each (re)started worker is a cheap fork of a process
# that already has the scorers and sympy loaded.
_FORKSERVER_PRELOAD = ["rlfoundry.rewards.default"]


class RewardPoolError(RuntimeError):
    """The pool's workers could not start (the scorer cannot be loaded in a worker process)."""


@dataclass
class Outcome:
    """What scoring one sample gave: ``value`` on success, else ``error`` kind and ``detail``."""

    value: Any = None
    error: str | None = None  # None | "exception" | "timeout" | "crash"
    detail: str = ""


def call_safely(fn: Callable, kwargs: dict) -> Outcome:
    """``fn(**kwargs)`` with any exception turned into an Outcome carrying its traceback; an ``async``
    scorer (verl's reward loop awaits them) is run to its end here."""
    try:
        value = fn(**kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return Outcome(value=value)
    except Exception:  # noqa: BLE001 - a user's scorer may raise anything; it must not stop the run
        return Outcome(error="exception", detail=traceback.format_exc())


async def _awaited(value: Any) -> Any:
    return await value


def gather_safely(fn: Callable, kwargs_list: list[dict], timeout_s: float) -> list[Outcome]:
    """An ``async`` scorer's calls run concurrently in this process (as verl's reward loop gathers
    them), each within ``timeout_s``; failures as ``call_safely`` reports them."""

    async def one(kwargs: dict) -> Outcome:
        try:
            value = fn(**kwargs)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(_awaited(value), timeout_s)
            return Outcome(value=value)
        except asyncio.TimeoutError:
            return Outcome(error="timeout", detail=f"the scorer did not finish within {timeout_s:g}s")
        except Exception:  # noqa: BLE001
            return Outcome(error="exception", detail=traceback.format_exc())

    async def run() -> list[Outcome]:
        return list(await asyncio.gather(*(one(kwargs) for kwargs in kwargs_list)))

    return asyncio.run(run())


def _worker_main(conn: Connection, fn: Callable) -> None:
    # Ctrl-C goes to the whole process group; only the driver should react (and then close us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if hasattr(fn, "load"):
            fn.load()  # import a custom reward file now, not inside the first sample's timeout
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001
        conn.send(("failed", traceback.format_exc()))
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:  # driver gone
            return
        if task is None:
            return
        task_id, kwargs = task
        outcome = call_safely(fn, kwargs)
        try:
            conn.send((task_id, outcome))
        except Exception as err:  # noqa: BLE001 - e.g. the scorer returned something unpicklable
            conn.send((task_id, Outcome(error="exception", detail=f"result could not be sent back: {err!r}")))


class _Worker:
    """One worker process, its pipe, and the task it is running (if any)."""

    def __init__(self, ctx: Any, fn: Callable) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, fn), daemon=True, name="reward-worker")
        self.process.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.timeout_s = 0.0
        self.deadline = float("inf")

    def submit(self, task_id: int, kwargs: dict, timeout_s: float) -> None:
        self.conn.send((task_id, kwargs))
        self.task, self.timeout_s, self.deadline = task_id, timeout_s, time.monotonic() + timeout_s

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def default_start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class ScoringPool:
    """``num_workers`` scorer processes; ``map`` scores a list of keyword-argument dicts in order."""

    def __init__(
        self,
        fn: Callable,
        num_workers: int,
        timeout_s: float,
        start_method: str | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.fn, self.num_workers, self.timeout_s = fn, num_workers, float(timeout_s)
        self.startup_timeout_s = startup_timeout_s
        method = start_method or default_start_method()
        self.ctx = mp.get_context(method)
        if method == "forkserver":
            self.ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
        self.workers: list[_Worker] = [_Worker(self.ctx, fn) for _ in range(num_workers)]
        self.restarts = 0
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Block until every worker has loaded the scorer; a worker that cannot is a setup error."""
        deadline = time.monotonic() + self.startup_timeout_s
        for worker in self.workers:
            if worker.ready:
                continue
            ready = wait([worker.conn, worker.process.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            status, detail = ("failed", "worker did not report ready in time")
            if worker.conn in ready:
                try:
                    status, detail = worker.conn.recv()
                except (EOFError, OSError):
                    detail = "worker exited before loading the scorer"
            if status != "ready":
                self.close()
                raise RewardPoolError(
                    f"reward worker could not load the scorer {self.fn!r} (exit code {worker.process.exitcode}). "
                    "A scorer must be importable in a fresh process: a module-level function or "
                    "custom_reward_function.path; set reward_model.reward_kwargs.num_workers=0 to score "
                    f"in the driver instead.\n{detail}"
                )
            worker.ready = True

    def map(self, kwargs_list: list[dict], timeout_s: float | None = None) -> list[Outcome]:
        """One Outcome per kwargs dict, in order; never raises for a scorer's failure."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        for worker in [w for w in self.workers if w.task is not None]:
            self._restart(worker)  # still busy from a call that was interrupted (Ctrl-C): stale result
        results: list[Outcome | None] = [None] * len(kwargs_list)
        todo = deque(range(len(kwargs_list)))
        while todo or any(w.task is not None for w in self.workers):
            for worker in list(self.workers):
                if worker.task is None and todo:
                    self._submit(worker, todo, kwargs_list, timeout)
            if any(w.task is not None for w in self.workers):  # else a submit failed: loop to retry
                self._collect(results)
        return results  # type: ignore[return-value]

    def _submit(self, worker: _Worker, todo: deque, kwargs_list: list[dict], timeout: float) -> None:
        i = todo.popleft()
        try:
            worker.submit(i, kwargs_list[i], timeout)
        except (BrokenPipeError, OSError):  # died while idle (e.g. OOM-killed): retry on a fresh one
            todo.appendleft(i)
            self._restart(worker)

    def _collect(self, results: list) -> None:
        """Wait for the next result, death or deadline among busy workers and record it."""
        busy = [w for w in self.workers if w.task is not None]
        next_deadline = min(w.deadline for w in busy)
        ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy],
                         timeout=max(0.0, next_deadline - time.monotonic())))
        for worker in busy:
            if worker.conn in ready:
                try:
                    task_id, outcome = worker.conn.recv()
                    results[task_id], worker.task = outcome, None
                    continue
                except (EOFError, OSError):
                    pass  # died mid-send: handled as a crash below
            if worker.conn in ready or worker.process.sentinel in ready:
                worker.process.join(timeout=5)
                detail = f"reward worker died (exit code {worker.process.exitcode}) while scoring this sample"
                self._replace(worker, results, Outcome(error="crash", detail=detail))
            elif time.monotonic() >= worker.deadline:
                detail = f"scoring took longer than the {worker.timeout_s:g} s timeout; worker killed and replaced"
                self._replace(worker, results, Outcome(error="timeout", detail=detail))

    def _replace(self, worker: _Worker, results: list, outcome: Outcome) -> None:
        """Record ``outcome`` for the worker's task, then swap in a fresh worker."""
        results[worker.task] = outcome
        self._restart(worker)

    def _restart(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker(self.ctx, self.fn)
        self.restarts += 1
        self._wait_ready()

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for worker in self.workers:
            worker.process.join(timeout=1)
            worker.kill()
        self.workers = []

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LazyScoringPool:
    """The life cycle of one scorer's ``ScoringPool``, so that scoring code only calls ``map``.

    The pool starts on the first ``map`` (a run whose batches never need it starts no process); a
    scorer that cannot be pickled is scored in the driver instead, without timeouts, with one
    warning; a pool whose ``map`` raised (Ctrl-C, or a replacement worker that could not load the
    scorer) is closed and dropped, and the next ``map`` starts a fresh one. A pickled copy (e.g. sent
    to a Ray task) starts its own pool on first use. ``close`` (or leaving a ``with`` block) stops
    the processes; they are daemons, so interpreter exit stops them too.
    """

    def __init__(self, fn: Callable, num_workers: int, timeout_s: float, start_method: str | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.fn, self.num_workers, self.timeout_s, self.start_method = fn, num_workers, timeout_s, start_method
        self.running: ScoringPool | None = None
        self.unpicklable = False

    def map(self, kwargs_list: list[dict], timeout_s: float | None = None) -> list[Outcome]:
        """One Outcome per kwargs dict, in order, from the pool (or the driver, see above)."""
        pool = self._start()
        if pool is None:
            return [call_safely(self.fn, kwargs) for kwargs in kwargs_list]
        try:
            return pool.map(kwargs_list, timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self) -> ScoringPool | None:
        if self.running is None and not self.unpicklable:
            try:
                pickle.dumps(self.fn)
            except Exception as err:  # noqa: BLE001 - any pickling failure means "cannot ship it"
                logger.warning(
                    "reward function %r cannot be pickled (%s); scoring in the driver process without "
                    "timeouts. Use a module-level function or custom_reward_function.path", self.fn, err,
                )
                self.unpicklable = True
                return None
            self.running = ScoringPool(self.fn, self.num_workers, self.timeout_s, self.start_method)
        return self.running

    def close(self) -> None:
        if self.running is not None:
            pool, self.running = self.running, None
            pool.close()

    def __enter__(self) -> LazyScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "running": None}

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down modules
            pass
