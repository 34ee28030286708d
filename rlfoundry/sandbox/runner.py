"""Run untrusted Python (a policy's tool call, a generated solution) in a child process with limits.

What one call guarantees:

- **Isolation by the kernel** (``namespace.py``, the default wherever user namespaces work): the
  program runs in its own user, PID, mount, network and IPC namespaces behind a seccomp filter,
  sees only a read-only interpreter and a private tmpfs working directory, cannot start processes,
  reach the network, or see or signal the caller, its files or its siblings.
- **Limits, enforced by the kernel**: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  the size of any file it writes (``RLIMIT_FSIZE``), tmpfs sizes (``disk_bytes``), all the memory the
  run holds of every kind (a memory cgroup, where the machine gives one: ``cgroup.py``), System V
  shared memory (a root caller's sandbox: ``namespace.host_side``), and wall-clock time (the sandbox is killed). stdin,
  stdout and stderr are pipes; output past ``max_output_bytes`` on either ends the run.
- **Nothing carries over**: a fresh interpreter (``-I``) in a fresh working directory per call.

Where namespaces are unavailable (user namespaces disabled, or a mount the kernel refuses),
:func:`run_python`
raises :class:`SandboxUnavailable` with the fix, unless the user opted in to the **unisolated** mode
(``sandbox.allow_unisolated=true``, carried to every process as ``RLFOUNDRY_SANDBOX_ALLOW_UNISOLATED=1``):
a plain child process with the same limits and a PEP 578 audit-hook policy (``policy.py``), which
stops honest mistakes but not a hostile program; it warns once per process.

:func:`run_python` never raises for anything the code does; the result says what happened.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlfoundry.sandbox import cgroup as cgroup_
from rlfoundry.sandbox import namespace, policy

__all__ = ["ALLOW_UNISOLATED_ENV", "ISOLATION_ENV", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "caps_in_force", "exit_status", "mode", "out_of_memory", "run_job", "run_python"]

logger = logging.getLogger(__name__)
ALLOW_UNISOLATED_ENV = "RLFOUNDRY_SANDBOX_ALLOW_UNISOLATED"
# namespace.ISOLATION_ENV=none skips the namespaces even where they work (inside a container that is
# already the boundary, or to measure what the unisolated mode stops); it still needs ALLOW_UNISOLATED_ENV.
ISOLATION_ENV = namespace.ISOLATION_ENV


class SandboxUnavailable(RuntimeError):
    """No kernel isolation here and the unisolated mode was not chosen; the message says how to fix it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. Output beyond ``max_output_bytes`` per stream ends the run (``output_limit``)."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_bytes: int = 1 << 30
    max_output_bytes: int = 64 * 1024
    disk_bytes: int = namespace.TMP_BYTES  # each tmpfs it writes (/tmp, /sandbox; a job's folder: past its inputs)


@dataclass(frozen=True)
class SandboxResult:
    """``status``: ``ok`` (exit 0), ``error`` (an exception or a non-zero exit), ``timeout`` (wall or
    CPU time), ``memory`` (MemoryError under the address-space limit, ENOMEM, or the memory cgroup's
    OOM killer), ``output_limit`` (printed or
    wrote more than allowed), ``killed`` (another signal). ``stdout``/``stderr`` are decoded with
    replacement and cut to the output limit. ``isolation``: ``namespaced`` or ``unisolated``."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    wall_s: float
    isolation: str = "namespaced"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def unisolated_allowed() -> bool:
    return os.environ.get(ALLOW_UNISOLATED_ENV, "").lower() in ("1", "true", "yes")


def mode() -> str:
    """``namespaced`` where the kernel boundary works, else ``unisolated`` if allowed; else raise."""
    iso = namespace.isolation()
    if iso.available:
        return "namespaced"
    if unisolated_allowed():
        _warn_unisolated(iso.reason)
        return "unisolated"
    raise SandboxUnavailable(
        f"untrusted code cannot be isolated on this machine: {iso.reason}. Install bubblewrap, or accept "
        f"running it without a boundary with sandbox.allow_unisolated=true (environment: {ALLOW_UNISOLATED_ENV}=1); "
        "or run code on a SandboxFusion server (reward_model.sandbox_fusion.url, `rlfoundry sandbox serve`)")


_warned = False


def _warn_unisolated(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("running untrusted code WITHOUT kernel isolation (sandbox.allow_unisolated=true): %s. "
                       "A hostile program can read and write your files and signal your processes.", reason)


def caps_in_force() -> str:
    """One line for start-up output: what caps a run's memory and disk on this machine, for this caller."""
    where = cgroup_.memory_cgroups()
    memory = where.reason if where.parent is not None else (
        f"RLIMIT_AS and the IPC and tmpfs limits only, no memory cgroup ({where.reason})")
    return f"memory: {memory}; disk: size-capped tmpfs folders"


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter, ``stdin`` as its standard input;
    see the module docstring."""
    how = mode()
    with tempfile.TemporaryDirectory(prefix="rlfoundry-sandbox-") as tmp:
        script = Path(tmp, "main.py")
        script.write_text(code, encoding="utf-8", errors="replace")
        start = time.monotonic()
        proc, out = _launch(how, script, stdin.encode("utf-8", errors="replace"), limits, tmp)
        return _result(proc, out, time.monotonic() - start, limits, how)


def run_job(job: namespace.Job, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run ``job`` (``namespace.Job``: a command in a host working directory the caller fills and reads
    back) in the sandbox, with the same limits and result as :func:`run_python`; ``limits.max_output_bytes``
    also caps each file it writes, ``limits.disk_bytes`` what it may add to its folder (``stage.py``).
    Unisolated, only a Python ``main.py`` runs (under the audit hook), in the host folder itself."""
    how = mode()
    if how != "namespaced" and job.argv[:1] != (sys.executable,):
        raise SandboxUnavailable(f"{job.argv[0]} runs only in the namespaced sandbox (the unisolated mode's "
                                 "audit hook guards Python alone)")
    data = stdin.encode("utf-8", errors="replace")
    with tempfile.TemporaryDirectory(prefix="rlfoundry-sandbox-") as scratch:  # no script: it is the scratch
        start = time.monotonic()
        if how == "namespaced":
            with namespace.command(namespace.isolation().backend, None, scratch, limits.memory_bytes, job,
                                   limits.disk_bytes, _rlimits(limits)) as (argv, fds, preexec):
                proc, out = _start_and_wait(argv, scratch, {"PATH": "/usr/bin:/bin"}, fds, data, limits, preexec)
        else:
            argv = [sys.executable, "-I", "-B", "-c", policy.BOOTSTRAP, job.workdir]
            env = {"PATH": "/usr/bin:/bin", "HOME": job.workdir, "TMPDIR": job.workdir, "LANG": "C.UTF-8"}
            proc, out = _start_and_wait(argv, job.workdir, env, (), data, limits, _unisolated_limits(limits))
        return _result(proc, out, time.monotonic() - start, limits, how)


def _result(proc: subprocess.Popen, out: _Output, wall: float, limits: SandboxLimits, how: str) -> SandboxResult:
    stdout, stderr = (b[: limits.max_output_bytes].decode("utf-8", errors="replace") for b in (out.stdout, out.stderr))
    code_ = _exit_code(proc.returncode, how)
    status = "output_limit" if out.full else "memory" if out.oom_killed else _status(code_, out.timed_out, stderr)
    return SandboxResult(status, stdout, stderr, code_, wall, how)


def _launch(how: str, script: Path, stdin: bytes, limits: SandboxLimits, tmp: str):
    """Start the program the chosen way, wait for it within the wall-clock limit, kill what is left."""
    if how == "namespaced":
        scratch = Path(tmp, "scratch")
        scratch.mkdir()
        with namespace.command(namespace.isolation().backend, str(script), str(scratch), limits.memory_bytes,
                               disk_bytes=limits.disk_bytes, rlimits=_rlimits(limits)) as (argv, fds, preexec):
            return _start_and_wait(argv, tmp, {"PATH": "/usr/bin:/bin"}, fds, stdin, limits, preexec)
    work = Path(tmp, "work")
    work.mkdir()
    (work / "main.py").write_text(script.read_text(encoding="utf-8"), encoding="utf-8")
    argv = [sys.executable, "-I", "-B", "-c", policy.BOOTSTRAP, str(work)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
    return _start_and_wait(argv, str(work), env, (), stdin, limits, _unisolated_limits(limits))


@dataclass
class _Output:
    stdout: bytes = b""
    stderr: bytes = b""
    full: bool = False  # a stream passed max_output_bytes: the run was ended
    timed_out: bool = False
    oom_killed: bool = False  # the run's memory cgroup reached its limit and its OOM killer ended a process


def _start_and_wait(argv, cwd, env, fds, stdin: bytes, limits: SandboxLimits, preexec):
    """stdin, stdout and stderr are pipes, never host files: nothing the program does to them
    (``fallocate``, ``ftruncate``, ``fchmod``) reaches the host's disk. ``preexec`` sets the limits
    (and a root caller's host side); first, where this machine allows it, the child joins a memory
    cgroup limited to ``limits.memory_bytes`` that everything the sandbox starts inherits."""
    cgroup = _memory_cgroup(limits.memory_bytes)
    join = cgroup.joiner() if cgroup is not None else None

    def before_exec() -> None:
        if join is not None:
            join()  # while still root: the cgroup's files are root's
        preexec()

    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=before_exec,
                                close_fds=True, pass_fds=fds)
        try:
            out = _exchange(proc, stdin, limits)
        finally:
            _kill(proc)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                f.close()
        out.oom_killed = cgroup is not None and cgroup.oom_kills() > 0
    finally:
        if cgroup is not None:
            cgroup.close()
    return proc, out


def _memory_cgroup(memory_bytes: int) -> cgroup_.RunCgroup | None:
    """A fresh memory cgroup for one run, or None where this machine gives none (``cgroup.memory_cgroups``)."""
    where = cgroup_.memory_cgroups()
    return cgroup_.RunCgroup(where.version, where.parent, memory_bytes) if where.parent is not None else None


def _exchange(proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits) -> _Output:
    """Feed stdin and collect stdout/stderr until the program ends, the wall clock runs out, or a
    stream passes the output limit (then at most the limit plus one read is held)."""
    deadline = time.monotonic() + limits.wall_time_s
    got = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    out, pending = _Output(), memoryview(stdin)
    sel = selectors.DefaultSelector()
    for f in got:
        sel.register(f, selectors.EVENT_READ)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    while len(sel.get_map()) and not out.full and not out.timed_out:
        left = deadline - time.monotonic()
        out.timed_out = left <= 0
        for key, _ in sel.select(max(left, 0)):
            if key.fileobj is proc.stdin:
                pending = _feed(sel, proc.stdin, pending)
                continue
            chunk = os.read(key.fd, 1 << 16)
            got[key.fileobj] += chunk
            if not chunk:
                sel.unregister(key.fileobj)
            out.full |= len(got[key.fileobj]) > limits.max_output_bytes
    sel.close()
    if not (out.full or out.timed_out):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:  # it closed its output and went on
            out.timed_out = True
    out.stdout, out.stderr = bytes(got[proc.stdout]), bytes(got[proc.stderr])
    return out


def _feed(sel: selectors.BaseSelector, pipe, pending: memoryview) -> memoryview:
    """Write what the pipe takes now; close it when all is written or the program stopped reading."""
    try:
        pending = pending[os.write(pipe.fileno(), pending[: 1 << 16]):]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        pending = pending[:0]
    if not pending:
        sel.unregister(pipe)
        pipe.close()
    return pending


def _rlimits(limits: SandboxLimits) -> tuple[tuple[int, int, int], ...]:
    """The kernel's per-process limits for a run, (resource, soft, hard): CPU seconds (SIGXCPU, then
    SIGKILL a second later), address space, the size of one file, no core dumps."""
    cpu = max(1, int(limits.cpu_time_s))
    return ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.max_output_bytes, limits.max_output_bytes), (resource.RLIMIT_CORE, 0, 0))


def _unisolated_limits(limits: SandboxLimits):
    return functools.partial(namespace.set_rlimits, _rlimits(limits))


def _kill(proc: subprocess.Popen) -> None:
    """Kill the child's whole process group (anything it left behind in its session). In the
    namespaced mode that is bubblewrap, whose death takes the PID namespace and everything in it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _exit_code(code: int | None, how: str) -> int | None:
    """bubblewrap exits 128 + N when the program died of signal N: report it as -N, as Popen does."""
    if how == "namespaced" and code is not None and 128 < code < 128 + signal.NSIG:
        return -(code - 128)
    return code


def out_of_memory(stderr: str) -> bool:
    """The program died of its memory limit: Python's MemoryError (the address space), or a system call
    that failed with ENOMEM (a memory cgroup's limit reached outside a page fault, e.g. writing a memfd)."""
    return "MemoryError" in stderr or "[Errno 12] Cannot allocate memory" in stderr


def _status(code: int | None, timed_out: bool, stderr: str) -> str:
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    return exit_status(code, stderr)


def exit_status(code: int | None, stderr: str, shell_signals: bool = False) -> str:
    """The status of a program that was not timed out, from its exit code and stderr (the rules the local
    and the SandboxFusion sandbox share). ``shell_signals``: an exit code over 128 is a death by signal too
    (a shell reports signal N as 128 + N)."""
    if code == -signal.SIGXFSZ:
        return "output_limit"
    if code == 0:
        return "ok"
    if out_of_memory(stderr):
        return "memory"
    killed = code is not None and (code < 0 or (shell_signals and code > 128))
    return "killed" if killed else "error"
