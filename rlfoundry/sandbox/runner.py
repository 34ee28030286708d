"""Run untrusted Python (a policy's tool call, a generated solution) in a child process with limits.

What one call guarantees:

- **Isolation by the kernel** (``namespace.py``, the default wherever user namespaces work): the
  program runs in its own user, PID, mount, network and IPC namespaces behind a seccomp filter,
  sees only a read-only interpreter and a private tmpfs working directory, cannot start processes,
  reach the network, or see or signal the caller, its files or its siblings.
- **Limits, enforced by the kernel**: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  the size of any file it writes (``RLIMIT_FSIZE``, which also caps what it can print: stdout and
  stderr go to files the program cannot see), tmpfs sizes, and wall-clock time (the sandbox is killed).
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

import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlfoundry.sandbox import namespace, policy

__all__ = ["ALLOW_UNISOLATED_ENV", "ISOLATION_ENV", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "mode", "run_job",
           "run_python"]

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


@dataclass(frozen=True)
class SandboxResult:
    """``status``: ``ok`` (exit 0), ``error`` (an exception or a non-zero exit), ``timeout`` (wall or
    CPU time), ``memory`` (MemoryError under the address-space limit), ``output_limit`` (printed or
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


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter, ``stdin`` as its standard input;
    see the module docstring."""
    how = mode()
    with tempfile.TemporaryDirectory(prefix="rlfoundry-sandbox-") as tmp:
        script, stdin_path = Path(tmp, "main.py"), Path(tmp, "stdin")
        script.write_text(code, encoding="utf-8", errors="replace")
        stdin_path.write_text(stdin, encoding="utf-8", errors="replace")
        logs = Path(tmp, "logs")  # outside what the program can see in either mode
        logs.mkdir()
        start = time.monotonic()
        proc, timed_out = _launch(how, script, stdin_path, logs, limits, tmp)
        return _result(proc, timed_out, time.monotonic() - start, logs, limits, how)


def run_job(job: namespace.Job, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run ``job`` (``namespace.Job``: a command in a host working directory the caller fills and reads
    back) in the sandbox, with the same limits and result as :func:`run_python`; ``limits.max_output_bytes``
    also caps each file it writes. Unisolated, only a Python ``main.py`` runs (under the audit hook)."""
    how = mode()
    if how != "namespaced" and job.argv[:1] != (sys.executable,):
        raise SandboxUnavailable(f"{job.argv[0]} runs only in the namespaced sandbox (the unisolated mode's "
                                 "audit hook guards Python alone)")
    with tempfile.TemporaryDirectory(prefix="rlfoundry-sandbox-") as tmp:
        stdin_path, logs, scratch = Path(tmp, "stdin"), Path(tmp, "logs"), Path(tmp, "scratch")
        stdin_path.write_text(stdin, encoding="utf-8", errors="replace")
        logs.mkdir()
        scratch.mkdir()
        start = time.monotonic()
        if how == "namespaced":
            with namespace.command(namespace.isolation().backend, None, str(scratch), job) as (argv, fds):
                proc, timed_out = _start_and_wait(argv, tmp, {"PATH": "/usr/bin:/bin"}, fds, stdin_path, logs, limits)
        else:
            argv = [sys.executable, "-I", "-B", "-c", policy.BOOTSTRAP, job.workdir]
            env = {"PATH": "/usr/bin:/bin", "HOME": job.workdir, "TMPDIR": job.workdir, "LANG": "C.UTF-8"}
            proc, timed_out = _start_and_wait(argv, job.workdir, env, (), stdin_path, logs, limits)
        return _result(proc, timed_out, time.monotonic() - start, logs, limits, how)


def _result(proc: subprocess.Popen, timed_out: bool, wall: float, logs: Path, limits: SandboxLimits,
            how: str) -> SandboxResult:
    stdout, stderr = (_read_capped(logs / name, limits.max_output_bytes) for name in ("stdout", "stderr"))
    # Python ignores SIGXFSZ: at the limit its write fails (EFBIG) instead of the signal killing it
    full = any(_size(logs / name) >= limits.max_output_bytes for name in ("stdout", "stderr"))
    code_ = _exit_code(proc.returncode, how)
    status = "output_limit" if full else _status(code_, timed_out, stderr)
    return SandboxResult(status, stdout, stderr, code_, wall, how)


def _launch(how: str, script: Path, stdin_path: Path, logs: Path, limits: SandboxLimits, tmp: str):
    """Start the program the chosen way, wait for it within the wall-clock limit, kill what is left."""
    if how == "namespaced":
        scratch = Path(tmp, "scratch")
        scratch.mkdir()
        with namespace.command(namespace.isolation().backend, str(script), str(scratch)) as (argv, fds):
            return _start_and_wait(argv, tmp, {"PATH": "/usr/bin:/bin"}, fds, stdin_path, logs, limits)
    work = Path(tmp, "work")
    work.mkdir()
    (work / "main.py").write_text(script.read_text(encoding="utf-8"), encoding="utf-8")
    argv = [sys.executable, "-I", "-B", "-c", policy.BOOTSTRAP, str(work)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
    return _start_and_wait(argv, str(work), env, (), stdin_path, logs, limits)


def _start_and_wait(argv, cwd, env, fds, stdin_path: Path, logs: Path, limits: SandboxLimits):
    with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err, open(stdin_path, "rb") as inp:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=inp, stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=lambda: _set_limits(limits), close_fds=True, pass_fds=fds)
        return proc, _wait(proc, limits.wall_time_s)


def _set_limits(limits: SandboxLimits) -> None:
    """In the child, before exec: hard limits it cannot raise again (raising a hard limit needs
    CAP_SYS_RESOURCE in the first user namespace, which nothing in the sandbox has)."""
    cpu = max(1, int(limits.cpu_time_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_output_bytes, limits.max_output_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _wait(proc: subprocess.Popen, wall_time_s: float) -> bool:
    """Wait up to the wall-clock limit; then (or anyway) kill the child's whole process group. In the
    namespaced mode that is bubblewrap, whose death takes the PID namespace and everything in it."""
    try:
        proc.wait(timeout=wall_time_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its session
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return timed_out


def _exit_code(code: int | None, how: str) -> int | None:
    """bubblewrap exits 128 + N when the program died of signal N: report it as -N, as Popen does."""
    if how == "namespaced" and code is not None and 128 < code < 128 + signal.NSIG:
        return -(code - 128)
    return code


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_capped(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:  # an unisolated program may have removed it
        return ""


def _status(code: int | None, timed_out: bool, stderr: str) -> str:
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    if code == -signal.SIGXFSZ:
        return "output_limit"
    if code == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if code is not None and code < 0 else "error"
