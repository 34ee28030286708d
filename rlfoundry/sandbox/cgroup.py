"""A memory cgroup per sandbox run: the one limit that counts every kind of memory a program can hold.

``RLIMIT_AS`` counts only what is mapped. A program can also hold pages it never maps: ``memfd``
files (each within ``RLIMIT_FSIZE``, but a thousand of them), tmpfs files, System V segments, pipe
buffers (socket buffers too, but cgroup v1 charges those only for TCP, and only when asked to). The
kernel charges them to the cgroup of the process that made them, so a
child cgroup with a limit at the run's memory limit caps them all at once, and its OOM killer ends the
run (``status="memory"``).

cgroup v2 where the caller's cgroup can give its children the memory controller (its
``cgroup.subtree_control`` has ``memory``, or accepts ``+memory``); else cgroup v1's memory hierarchy
where the caller may make a directory in it (root, usually); else none, and the run keeps the other
limits (``namespace.caps_in_force`` says which). Swap is limited to nothing beside it (v2
``memory.swap.max``, v1 ``memory.memsw.limit_in_bytes``), so pages cannot be pushed out to make room.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["MemoryCgroups", "RunCgroup", "memory_cgroups", "remove_stale"]

_ROOT = "/sys/fs/cgroup"
_names = itertools.count()
# cgroups whose last processes had not been reaped when their run ended (a killed sandbox's orphans are
# reaped by the machine's init, in its own time): removed when the next run starts
_pending: list[str] = []
_pending_lock = threading.Lock()


@dataclass(frozen=True)
class MemoryCgroups:
    """Where this process makes its runs' memory cgroups: ``parent`` (a directory) of cgroup ``version``
    2 or 1; ``parent`` None when neither works here, and ``reason`` says why."""

    version: int | None
    parent: str | None
    reason: str


@functools.lru_cache(maxsize=1)
def memory_cgroups() -> MemoryCgroups:
    """The first of cgroup v2, then v1, in which this process may make a memory-limited child cgroup."""
    own = _own_cgroups()
    tried = []
    for version, parent in _candidates(own):
        why = _usable(version, parent)
        if why is None:
            remove_stale(parent)
            return MemoryCgroups(version, parent, f"cgroup v{version} memory limit ({parent})")
        tried.append(f"v{version} {parent}: {why}")
    if not tried:
        tried.append(f"no cgroup filesystem with a memory controller under {_ROOT}")
    return MemoryCgroups(None, None, "; ".join(tried))


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy, from /proc/self/cgroup: ``""`` for v2, else the v1 controllers."""
    own = {}
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return own
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own


def _candidates(own: dict[str, str]) -> list[tuple[int, str]]:
    """(version, the caller's own cgroup directory) for the v2 hierarchy and v1's memory hierarchy."""
    found = []
    if "" in own:
        for mount in (_ROOT, os.path.join(_ROOT, "unified")):  # v2 alone, or v2 beside v1 (the hybrid layout)
            if os.path.exists(os.path.join(mount, "cgroup.controllers")):
                found.append((2, os.path.normpath(mount + own[""])))
                break
    if "memory" in own and os.path.isdir(os.path.join(_ROOT, "memory")):
        found.append((1, os.path.normpath(os.path.join(_ROOT, "memory") + own["memory"])))
    return found


def _usable(version: int, parent: str) -> str | None:
    """None when a child of ``parent`` can have a memory limit and take a process, else why not."""
    if version == 2:
        try:
            if "memory" not in open(os.path.join(parent, "cgroup.controllers")).read().split():
                return "the memory controller is not given to this cgroup"
            if "memory" not in open(os.path.join(parent, "cgroup.subtree_control")).read().split():
                _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
        except OSError as e:  # EBUSY: processes in this cgroup (v2 allows controllers only to leaves' parents)
            return f"cannot enable memory for child cgroups: {e.strerror}"
    try:
        probe = RunCgroup(version, parent, 64 << 20)
    except OSError as e:
        return f"cannot make a limited child cgroup: {e.strerror}"
    probe.close()
    return None


def _write(path: str, value: str) -> None:
    """One write(2), as the cgroup files want (no buffering: the error belongs to this write)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class RunCgroup:
    """One run's memory cgroup under ``parent``, limited to ``limit_bytes`` of memory and no swap.
    :meth:`joiner` is what the sandbox's first process runs before it execs (all it starts inherits the
    cgroup); :meth:`close` after the run says whether the OOM killer acted and removes the cgroup."""

    def __init__(self, version: int, parent: str, limit_bytes: int):
        _sweep()
        self.version = version
        self.path = os.path.join(parent, f"rlfoundry-sandbox-{os.getpid()}-{next(_names)}")
        os.mkdir(self.path)
        try:
            self._limit(limit_bytes)
        except OSError:
            os.rmdir(self.path)
            raise

    def _limit(self, limit: int) -> None:
        if self.version == 2:
            _write(os.path.join(self.path, "memory.max"), str(limit))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                _write(os.path.join(self.path, "memory.swap.max"), "0")
            return
        _write(os.path.join(self.path, "memory.limit_in_bytes"), str(limit))
        if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):  # only with swap accounting
            _write(os.path.join(self.path, "memory.memsw.limit_in_bytes"), str(limit))

    def joiner(self) -> Callable[[], None]:
        """In the child before exec: move itself ("0": the writing process) into this cgroup. The path is
        encoded here, so the child only makes system calls."""
        procs = os.path.join(self.path, "cgroup.procs").encode()

        def join() -> None:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return join

    def oom_kills(self) -> int:
        """How many processes the OOM killer ended in this cgroup (v1 kernels before 4.13 do not count: 0)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in open(os.path.join(self.path, name)):
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def close(self) -> None:
        """Remove the cgroup once the run's processes are gone (a PID namespace's last ones may still be
        exiting for a moment; past a second it is left to the next run). The pages still charged to it (a
        tmpfs not yet unmounted) go to the parent."""
        for _ in range(100):
            if _removed(self.path):
                return
            time.sleep(0.01)
        with _pending_lock:
            _pending.append(self.path)


def _removed(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:  # EBUSY: a process in it has not been reaped yet
        return False
    return True


def remove_stale(parent: str) -> None:
    """The runs' cgroups left under ``parent`` by processes that have ended (killed mid-run, or before
    their last cgroup emptied): empty ones are removed, any still holding a process stay."""
    for name in os.listdir(parent):
        owner = name.split("-")[2] if name.startswith("rlfoundry-sandbox-") and name.count("-") == 3 else ""
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _removed(os.path.join(parent, name))


def _sweep() -> None:
    with _pending_lock:
        _pending[:] = [p for p in _pending if not _removed(p)]
