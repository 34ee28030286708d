"""The kernel boundary: each program in its own user, PID, mount, network, IPC and UTS namespaces
(bubblewrap), behind a seccomp filter, with a read-only view of the interpreter and nothing else.

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
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["Isolation", "WORKDIR", "bwrap_argv", "isolation", "pipe_with", "seccomp_filter"]

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


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> bytes | None:
    """The compiled BPF program (native architecture; other architectures' system calls are killed),
    or None when libseccomp or its binding is missing."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError):
        return None
    f = sc.SyscallFilter(sc.ALLOW)
    for name in _REFUSED_SYSCALLS:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            continue  # not a system call on this architecture
    # a process, not a thread: clone without CLONE_THREAD. clone3 passes its flags in memory, which a
    # filter cannot read, so it answers ENOSYS and glibc falls back to clone for its threads.
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


def _system_binds() -> list[str]:
    """/usr read-only, and /lib, /lib64, /bin, /sbin as the host has them (symlinks into /usr on
    merged-/usr systems, directories elsewhere); the dynamic loader's cache and the time zone."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("/lib", "/lib64", "/lib32", "/bin", "/sbin"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(f):
            argv += ["--ro-bind", f, f]
    return argv


def bwrap_argv(script: str, seccomp_fd: int | None) -> list[str]:
    """bubblewrap's command line for running ``script`` (a host file) as ``/sandbox/main.py``."""
    argv = [shutil.which("bwrap") or "bwrap",
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--uid", "65534", "--gid", "65534",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--size", str(TMP_BYTES), "--tmpfs", WORKDIR]
    argv += _system_binds()
    for root in _python_roots():
        argv += ["--ro-bind", root, root]
    argv += ["--ro-bind", script, f"{WORKDIR}/main.py", "--chdir", WORKDIR, "--clearenv"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", WORKDIR), ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8")):
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--", sys.executable, "-I", "-B", f"{WORKDIR}/main.py"]


@functools.lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe once per process: run a program that checks its own isolation inside the real sandbox."""
    if shutil.which("bwrap") is None:
        return Isolation(False, "bubblewrap (bwrap) is not installed: on Debian/Ubuntu `apt-get install bubblewrap`",
                         False)
    bpf = seccomp_filter()
    probe = "import os\nassert os.getpid() < 10 and not os.path.exists('/etc/passwd')\nprint('isolated')\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(probe)
        script.flush()
        read_fd = pipe_with(bpf) if bpf is not None else None
        try:
            done = subprocess.run(bwrap_argv(script.name, read_fd), capture_output=True, text=True, timeout=30,
                                  pass_fds=(read_fd,) if read_fd is not None else ())
        except (OSError, subprocess.TimeoutExpired) as e:
            return Isolation(False, f"bubblewrap could not start: {e}", bpf is not None)
        finally:
            if read_fd is not None:
                os.close(read_fd)
    if done.returncode != 0 or done.stdout.strip() != "isolated":
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return Isolation(False, f"bubblewrap cannot create namespaces here ({why}); user namespaces may be "
                                "disabled (sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces)",
                         bpf is not None)
    missing = "" if bpf is not None else " (no seccomp filter: install pyseccomp and libseccomp2)"
    return Isolation(True, "bubblewrap namespaces" + missing, bpf is not None)


def pipe_with(data: bytes) -> int:
    """A pipe's read end holding ``data`` (bubblewrap reads its seccomp program from a descriptor)."""
    r, w = os.pipe()
    try:
        os.write(w, data)  # a filter is a few hundred bytes: well within a pipe's buffer
    finally:
        os.close(w)
    return r
