"""The kernel boundary: each program in its own user, PID, mount, network, IPC and UTS namespaces
(bubblewrap; where it is not installed, the same done by ``unshare.py``), behind a seccomp filter,
with a read-only view of the interpreter and nothing else.

What the program sees: ``/usr`` and the Python installation read-only, a private ``/proc`` that shows
only its own processes, a minimal ``/dev``, size-capped tmpfs at ``/tmp`` and at its working directory
``/sandbox`` (where its script lies, read-only), loopback-only networking in an empty network
namespace, no capabilities, and no way to make another user namespace. The caller's files, processes,
environment and sockets do not exist in its world. ``--die-with-parent`` ends it if the caller dies.

The seccomp filter refuses (``EPERM``) what a test program never needs and what widens the attack
surface of the kernel: new processes (fork, vfork, clone without ``CLONE_THREAD``; threads stay
allowed), tracing and other processes' memory, mounts, namespaces, keyrings, BPF, perf, io_uring,
userfaultfd, kernel modules, clocks and reboots. It is built with libseccomp (``pyseccomp``) and
loaded by bubblewrap just before the interpreter starts.

A :class:`Job` (``rlfoundry sandbox serve``'s ``files``, ``fetch_files`` and compiled languages) runs a
command instead, in a host directory bound read-write at ``/sandbox``; a compiler's job keeps fork.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator

from rlfoundry.sandbox.unshare import unshare_argv

__all__ = ["ISOLATION_ENV", "Isolation", "Job", "WORKDIR", "bwrap_argv", "command", "isolation", "mount_plan", "pipe_with",
           "seccomp_filter"]

ISOLATION_ENV = "RLFOUNDRY_SANDBOX_ISOLATION"  # auto | bwrap | unshare | none (see isolation())
WORKDIR = "/sandbox"  # the program's working directory inside the sandbox
TMP_BYTES = 64 << 20  # each of /tmp and /sandbox: a tmpfs, so this caps the memory a program can park in files

# Refused outright (EPERM). Names missing on this architecture are skipped.
_REFUSED_SYSCALLS = (
    "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "fspick", "mount_setattr", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf",
    "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "swapon",
    "swapoff", "reboot", "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "quotactl", "lookup_dcookie", "vhangup", "iopl", "ioperm",
)
_CLONE_THREAD = 0x00010000


@dataclass(frozen=True)
class Isolation:
    """Whether namespaced runs work here; ``reason`` says why not (or what is missing)."""

    available: bool
    reason: str
    seccomp: bool
    backend: str | None = None  # bwrap or unshare


@dataclass(frozen=True)
class Job:
    """A run other than a Python script (``rlfoundry sandbox serve``'s compiled languages, ``files``
    and ``fetch_files``): ``argv`` (paths relative to the working directory) runs in ``workdir``, a
    host directory bound read-write at /sandbox, so files go in before and come out after; with
    ``processes`` the seccomp filter lets it start processes (a compiler runs its passes as processes)."""

    argv: tuple[str, ...]
    workdir: str
    processes: bool = False


@functools.lru_cache(maxsize=2)
def seccomp_filter(processes: bool = False) -> bytes | None:
    """The compiled BPF program (native architecture; other architectures' system calls are killed),
    or None when libseccomp or its binding is missing. ``processes``: fork, vfork and clone stay allowed."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError):
        return None
    f = sc.SyscallFilter(sc.ALLOW)
    for name in _REFUSED_SYSCALLS:
        if processes and name in ("fork", "vfork"):
            continue
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            continue  # not a system call on this architecture
    # a process, not a thread: clone without CLONE_THREAD. clone3 passes its flags in memory, which a
    # filter cannot read, so it answers ENOSYS and glibc falls back to clone for its threads.
    if not processes:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _python_roots() -> list[str]:
    """The interpreter's installation (and a virtual environment's), outside /usr."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    roots |= {p for p in (sys.prefix, sys.exec_prefix) if os.path.isdir(p)}  # a venv reached through a symlink
    return sorted(r for r in roots if not (r == "/usr" or r.startswith("/usr/")))


def mount_plan() -> list[tuple[str, ...]]:
    """What the program's filesystem holds besides /proc, /dev and the two tmpfs: ``("ro", path)``
    read-only binds of /usr, the Python installation, the dynamic loader's cache and the time zone;
    ``("symlink", target, path)`` for /lib, /bin ... where the host has merged /usr."""
    plan: list[tuple[str, ...]] = [("ro", "/usr")]
    for top in ("/lib", "/lib64", "/lib32", "/bin", "/sbin"):
        if os.path.islink(top):
            plan.append(("symlink", os.readlink(top), top))
        elif os.path.isdir(top):
            plan.append(("ro", top))
    plan += [("ro", f) for f in ("/etc/ld.so.cache", "/etc/localtime") if os.path.exists(f)]
    return plan + [("ro", root) for root in _python_roots()]


SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


def bwrap_argv(script: str | None, seccomp_fd: int | None, job: Job | None = None) -> list[str]:
    """bubblewrap's command line for running ``script`` (a host file) as ``/sandbox/main.py``, or ``job``."""
    argv = [shutil.which("bwrap") or "bwrap",
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--uid", "65534", "--gid", "65534",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    argv += ["--size", str(TMP_BYTES), "--tmpfs", WORKDIR] if job is None else ["--bind", job.workdir, WORKDIR]
    for kind, *args in mount_plan():
        argv += ["--ro-bind", args[0], args[0]] if kind == "ro" else ["--symlink", *args]
    if job is None:
        argv += ["--ro-bind", script, f"{WORKDIR}/main.py"]
    argv += ["--chdir", WORKDIR, "--clearenv"]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--", *(job.argv if job else (sys.executable, "-I", "-B", f"{WORKDIR}/main.py"))]


def isolation() -> Isolation:
    """The first backend that works here, from ``RLFOUNDRY_SANDBOX_ISOLATION``: ``auto`` (bubblewrap,
    else the project's own ``unshare``), ``bwrap``, ``unshare`` or ``none`` (no kernel isolation)."""
    wanted = os.environ.get(ISOLATION_ENV, "auto").lower()
    backends = {"auto": ("bwrap", "unshare"), "bwrap": ("bwrap",), "unshare": ("unshare",), "none": ()}.get(wanted)
    if backends is None:
        return Isolation(False, f"{ISOLATION_ENV}={wanted!r} is not one of auto, bwrap, unshare, none", False)
    if not backends:
        return Isolation(False, f"{ISOLATION_ENV}=none", False)
    tried = [_probe(b) for b in backends]
    return next((t for t in tried if t.available), Isolation(False, "; ".join(t.reason for t in tried), tried[0].seccomp))


@contextlib.contextmanager
def command(backend: str, script: str | None, scratch: str,
            job: Job | None = None) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """The command line (and descriptors to pass) running ``script`` (or ``job``) in the sandbox;
    ``scratch`` is an empty host directory the program never sees."""
    bpf = seccomp_filter(job is not None and job.processes)
    if backend == "unshare":
        bpf_path = None
        if bpf is not None:
            bpf_path = os.path.join(scratch, "filter.bpf")
            with open(bpf_path, "wb") as f:
                f.write(bpf)
        spec = {"plan": mount_plan(), "script": script, "bpf": bpf_path, "tmp_bytes": TMP_BYTES, "workdir": WORKDIR,
                "python": sys.executable, "env": SANDBOX_ENV,
                "job": None if job is None else {"argv": list(job.argv), "workdir": job.workdir}}
        yield unshare_argv(spec, scratch), ()
        return
    fd = pipe_with(bpf) if bpf is not None else None
    try:
        yield bwrap_argv(script, fd, job), (fd,) if fd is not None else ()
    finally:
        if fd is not None:
            os.close(fd)


@functools.lru_cache(maxsize=None)
def _probe(backend: str) -> Isolation:
    """Run a program that checks its own isolation inside the real sandbox (once per process)."""
    if backend == "bwrap" and shutil.which("bwrap") is None:
        return Isolation(False, "bubblewrap (bwrap) is not installed: on Debian/Ubuntu `apt-get install bubblewrap`",
                         False)
    bpf = seccomp_filter()
    if bpf is None:  # without the filter a program could fork without bound and make user namespaces
        return Isolation(False, "no seccomp filter: libseccomp (Debian: libseccomp2) or its binding pyseccomp is "
                                "missing", False)
    probe = "import os\nassert os.getpid() < 10 and not os.path.exists('/etc/passwd')\nprint('isolated')\n"
    with tempfile.TemporaryDirectory(prefix="rlfoundry-sandbox-probe-") as scratch:
        script = os.path.join(scratch, "probe.py")
        with open(script, "w") as f:
            f.write(probe)
        try:
            with command(backend, script, scratch) as (argv, fds):
                done = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=fds)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Isolation(False, f"{backend} could not start: {e}", bpf is not None)
    if done.returncode != 0 or done.stdout.strip() != "isolated":
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return Isolation(False, f"{backend} cannot create namespaces here ({why}); user namespaces may be disabled "
                                "(sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces)", bpf is not None)
    return Isolation(True, f"{backend} namespaces", True, backend)


def pipe_with(data: bytes) -> int:
    """A pipe's read end holding ``data`` (bubblewrap reads its seccomp program from a descriptor)."""
    r, w = os.pipe()
    try:
        os.write(w, data)  # a filter is a few hundred bytes: well within a pipe's buffer
    finally:
        os.close(w)
    return r
