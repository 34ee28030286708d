"""Run untrusted Python (a policy's tool call, a generated solution) in a child process with limits.

What one call guarantees:

- **Its own process and directory.** A fresh interpreter (``-I``: no user site, no PYTHON* env)
  runs the code in a throw-away working directory, deleted afterwards; nothing carries over
  between calls. The child gets a minimal environment and no stdin.
- **Limits, enforced by the kernel**: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  the size of any file it writes (``RLIMIT_FSIZE``, which also caps what it can print: stdout and
  stderr go to files), and wall-clock time (the whole process group is killed). Process counts are
  not left to ``RLIMIT_NPROC``, which the kernel does not apply to root: the policy below forbids
  new processes, and the process group is killed at the end whatever happened.
- **A policy, enforced by an audit hook** installed before the code runs (PEP 578; a hook cannot be
  removed from Python): no new processes (fork, exec, spawn, subprocess, os.system), no sockets,
  no writes outside its directory, no reads outside its directory and the Python installation,
  and no ``ctypes`` (which could step around the rest). A refused call raises ``PermissionError``
  inside the child, which the code may catch; it never reaches the caller.

This is containment for RL training (a model that prints megabytes, loops, forks or pokes around
must cost a sample, not the run), not a security boundary against a determined attacker with native
code: for hostile code use a container or VM sandbox (e.g. verl's SandboxFusion service).

:func:`run_python` never raises for anything the code does; the result says what happened.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]


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
    replacement and cut to the output limit."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# Runs in the child before the code: the audit-hook policy, then the code as __main__.
_BOOTSTRAP = r"""
import os, sys
_work = os.path.realpath(sys.argv[1])
_read_roots = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                     sys.base_exec_prefix, os.path.dirname(os.__file__))})
_read_files = ("/dev/null", "/dev/urandom", "/etc/localtime")
_banned_events = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                  "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn", "socket.__new__",
                  "socket.connect", "socket.bind", "socket.getaddrinfo", "ctypes.dlopen",
                  "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "os.chroot", "os.setuid")
_path_events = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.symlink",
                "os.link", "os.truncate", "os.utime", "shutil.rmtree", "os.chdir", "os.listdir", "os.scandir"}

def _inside(path, roots):
    try:
        real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
    except (TypeError, ValueError):
        return False
    return any(real == r or real.startswith(r + os.sep) for r in roots)

def _hook(event, args):
    if event in _banned_events:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes", "cffi"):
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance(path, int):
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
        if _inside(path, (_work,)):
            return
        if not writing and (_inside(path, _read_roots) or os.path.realpath(os.fsdecode(path)) in _read_files):
            return
        raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {os.fsdecode(path)!r} is not allowed")
    if event in _path_events and args and not isinstance(args[0], int):
        if not _inside(args[0], (_work,)) and not (event in ("os.listdir", "os.scandir") and _inside(args[0], _read_roots)):
            raise PermissionError(f"sandbox: {event} on {args[0]!r} is not allowed")

sys.addaudithook(_hook)
del _hook
sys.argv = ["main.py"]
sys.path.insert(0, _work)
import runpy
runpy.run_path(os.path.join(_work, "main.py"), run_name="__main__")
"""


def _set_limits(limits: SandboxLimits) -> None:
    """In the child, before exec: hard limits it cannot raise again."""
    cpu = max(1, int(limits.cpu_time_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_output_bytes, limits.max_output_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter; see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="rlfoundry-sandbox-") as tmp:
        work, logs = Path(tmp, "work"), Path(tmp, "logs")
        work.mkdir()
        logs.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8", errors="replace")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.monotonic()
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, str(work)], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                    preexec_fn=lambda: _set_limits(limits), close_fds=True)
            timed_out = _wait(proc, limits.wall_time_s)
        wall = time.monotonic() - start
        stdout, stderr = (_read_capped(logs / name, limits.max_output_bytes) for name in ("stdout", "stderr"))
        # Python ignores SIGXFSZ: at the limit its write fails (EFBIG) instead of the signal killing it
        full = any((logs / name).stat().st_size >= limits.max_output_bytes for name in ("stdout", "stderr"))
    status = "output_limit" if full else _status(proc.returncode, timed_out, stderr)
    return SandboxResult(status, stdout, stderr, proc.returncode, wall)


def _wait(proc: subprocess.Popen, wall_time_s: float) -> bool:
    """Wait up to the wall-clock limit; then (or anyway) kill the child's whole process group."""
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


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


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
