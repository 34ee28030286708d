"""The kernel boundary: each program in its own user, PID, mount, network, IPC and UTS namespaces
(bubblewrap; where it is not installed, the same done by ``unshare.py``), behind a seccomp filter,
with a read-only view of the interpreter and nothing else.

Whoever the caller is, the program is never root on the host: it is uid/gid 65534 inside, mapped to
the caller's own ids, or, when the caller is root, to 65534 (nobody) outside too, so the kernel's
permission checks on host objects (``/proc/sys``, root-only ``/proc`` files, device nodes) see an
unprivileged user. For a root caller ``unshare.py`` sets up as root and then switches the program to
nobody (no user namespace is needed for that); bubblewrap maps its uid to whoever runs it, so it is
run as nobody (:func:`host_side`), binding what nobody cannot reach (a Python under ``/root``) from
mount points the launcher, still root, relays it to (:func:`relays`). Every caller also gives the
sandbox a private IPC namespace whose System V limits are the memory limit (``shmmax``/``shmall``):
SysV shared memory lives outside the address-space limit (a non-root caller sets them as uid 0 of a
user namespace of its own, :func:`_owned_ipc_limits`).

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
command instead, in a host directory that the stager (``stage.py``) copies into a size-capped tmpfs
at ``/sandbox`` and back out after, so the program never writes a host folder; a compiler's job keeps
fork. Every run may also join a memory cgroup (``cgroup.py``, set up by the runner).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator

from rlfoundry.sandbox.stage import stager_argv
from rlfoundry.sandbox.unshare import unshare_argv

__all__ = ["ISOLATION_ENV", "Isolation", "Job", "SANDBOX_ID", "WORKDIR", "bring_back", "bwrap_argv", "command",
           "host_side", "ipc_limits", "isolation", "mount_plan", "pipe_with", "seccomp_filter", "set_rlimits"]

ISOLATION_ENV = "RLFOUNDRY_SANDBOX_ISOLATION"  # auto | bwrap | unshare | none (see isolation())
WORKDIR = "/sandbox"  # the program's working directory inside the sandbox
TMP_BYTES = 64 << 20  # each of /tmp and /sandbox: a tmpfs, so this caps the memory a program can park in files
SANDBOX_ID = 65534  # the program's uid and gid inside; outside too when the caller is root (nobody)
# the device nodes the program gets, (major, minor): fresh per run where the caller may make them
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9)}
_CLONE_NEWIPC, _CLONE_NEWNS, _CLONE_NEWUSER = 0x08000000, 0x00020000, 0x10000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18

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
    host directory copied into a size-capped tmpfs at /sandbox and back out after (``stage.py``); with
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


def bwrap_argv(script: str | None, seccomp_fd: int | None, dev_dir: str | None = None, own_ipc: bool = True,
               relayed: dict[str, str] | None = None, job: Job | None = None, tmp_bytes: int = TMP_BYTES) -> list[str]:
    """bubblewrap's command line for running ``script`` (a host file) as ``/sandbox/main.py``, or ``job``
    (its ``workdir``, the stager's tmpfs, bound read-write at ``/sandbox``). ``dev_dir``: a host directory of fresh device
    nodes for ``/dev`` (else bubblewrap's ``--dev``, which binds the host's own nodes); ``own_ipc``: make
    an IPC namespace (False: the launcher made one already, with limits, see :func:`host_side`);
    ``relayed``: where to bind a mount-plan path or the job's directory from instead of itself (see
    :func:`relays`)."""
    relayed = relayed or {}
    argv = [shutil.which("bwrap") or "bwrap",
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID),
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--proc", "/proc",
            # bubblewrap's own init is PID 1, as the program's uid: an empty read-only cover hides its
            # environment, memory map and descriptors
            "--perms", "0000", "--tmpfs", "/proc/1", "--remount-ro", "/proc/1",
            # bubblewrap covers /proc/sys only where its directory is writable (never): a non-root caller's
            # program owns its IPC namespace's shm* files (_owned_ipc_limits), so they are made read-only here.
            # The files show the reader's own namespaces, whichever /proc they are bound from.
            "--ro-bind", "/proc/sys", "/proc/sys",
            "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    if job is None:
        argv += ["--size", str(tmp_bytes), "--tmpfs", WORKDIR]
    else:
        argv += ["--bind", relayed.get(job.workdir, job.workdir), WORKDIR]
    argv += ["--unshare-ipc"] if own_ipc else []
    if dev_dir is None:
        argv += ["--dev", "/dev"]
    else:
        argv += ["--dir", "/dev"]
        for name in DEVICES:
            argv += ["--dev-bind", os.path.join(dev_dir, name), f"/dev/{name}"]
    for kind, *args in mount_plan():
        argv += ["--ro-bind", relayed.get(args[0], args[0]), args[0]] if kind == "ro" else ["--symlink", *args]
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


Launch = tuple[list[str], tuple[int, ...], Callable[[], None] | None]


@contextlib.contextmanager
def command(backend: str, script: str | None, scratch: str, memory_bytes: int, job: Job | None = None,
            disk_bytes: int = TMP_BYTES, rlimits: tuple[tuple[int, int, int], ...] = ()) -> Iterator[Launch]:
    """The command line, the descriptors to pass and the function to run in the child just before it
    execs for running ``script`` (or ``job``) in the sandbox; ``scratch`` is an empty host directory
    the program never sees, next to ``script`` (a job's may be a directory of its own). ``disk_bytes``
    sizes each tmpfs the program may write (a job's folder: beyond what goes in); ``rlimits``
    ((resource, soft, hard)) are set just before the sandbox starts. A job runs through
    the stager (``stage.py``), whose folder comes back into ``job.workdir`` when the block ends."""
    bpf = seccomp_filter(job is not None and job.processes)
    root = os.geteuid() == 0
    staged = job
    if job is not None:  # the sandbox binds the stager's tmpfs, never the host folder
        job = Job(job.argv, os.path.join(scratch, "work"), job.processes)
        os.mkdir(job.workdir)
    relayed = relays(os.path.join(scratch, "relay")) if root and backend == "bwrap" else {}
    reach = [scratch] + ([os.path.dirname(script)] if script is not None else [])
    nobody_dirs = reach if backend == "bwrap" else None
    if staged is None:
        preexec = _in_order(functools.partial(set_rlimits, rlimits), host_side(memory_bytes, nobody_dirs, relayed))
    else:  # the stager binds, changes user and sets the limits itself, after it has mounted and copied
        preexec = _in_order(host_side(memory_bytes, None))
        for d in (nobody_dirs or []) if root else []:  # bubblewrap, run as nobody, reads its files there
            os.chown(d, SANDBOX_ID, SANDBOX_ID)
    fd = pipe_with(bpf) if bpf is not None and backend == "bwrap" else None
    try:
        argv = _launch_argv(backend, script, scratch, bpf, fd, relayed, job, disk_bytes)
        if staged is not None:
            argv = stager_argv({"argv": argv, "workdir": staged.workdir, "tmpfs": job.workdir,
                                "out": os.path.join(scratch, "out"), "disk_bytes": disk_bytes,
                                "owner": SANDBOX_ID if root else None,
                                "nobody": SANDBOX_ID if root and backend == "bwrap" else None,
                                "relayed": relayed, "rlimits": list(rlimits)}, scratch)
        yield argv, (fd,) if fd is not None else (), preexec
    finally:
        if fd is not None:
            os.close(fd)
    if staged is not None:
        bring_back(os.path.join(scratch, "out"), staged.workdir)


def _launch_argv(backend: str, script: str | None, scratch: str, bpf: bytes | None, fd: int | None,
                 relayed: dict[str, str], job: Job | None, disk_bytes: int) -> list[str]:
    """The sandbox's own command line (bubblewrap's, or the project's launcher's)."""
    root = os.geteuid() == 0
    if backend == "unshare":
        bpf_path = None
        if bpf is not None:
            bpf_path = os.path.join(scratch, "filter.bpf")
            with open(bpf_path, "wb") as f:
                f.write(bpf)
        spec = {"plan": mount_plan(), "script": script, "bpf": bpf_path, "tmp_bytes": disk_bytes, "workdir": WORKDIR,
                "python": sys.executable, "env": SANDBOX_ENV, "own_ipc": False, "id": SANDBOX_ID,
                "as_root": root, "job": None if job is None else {"argv": list(job.argv), "workdir": job.workdir}}
        return unshare_argv(spec, scratch)
    devices_work = not os.statvfs(scratch).f_flag & os.ST_NODEV
    dev_dir = fresh_devices(os.path.join(scratch, "dev")) if root and devices_work else None
    return bwrap_argv(script, fd, dev_dir, own_ipc=False, relayed=relayed, job=job, tmp_bytes=disk_bytes)


def _in_order(*steps: Callable[[], None] | None) -> Callable[[], None]:
    def run() -> None:
        for step in steps:
            if step is not None:
                step()
    return run


def set_rlimits(rlimits: tuple[tuple[int, int, int], ...]) -> None:
    """(resource, soft, hard) limits; the program cannot raise a hard one again (that needs
    CAP_SYS_RESOURCE in the first user namespace, which nothing in the sandbox has)."""
    for res, soft, hard in rlimits:
        resource.setrlimit(res, (soft, hard))


def bring_back(out: str, workdir: str) -> None:
    """What the stager copied out of a job's tmpfs (``out``) in place of ``workdir``'s contents; nothing
    changes when it brought nothing (the run was killed before)."""
    if not os.path.isdir(out):
        return
    for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    for name in os.listdir(out):
        shutil.move(os.path.join(out, name), os.path.join(workdir, name))  # the scratch may be another filesystem


def relays(base: str) -> dict[str, str]:
    """For bubblewrap run as nobody by a root caller: each mount-plan path that nobody cannot reach (a Python under ``/root``, mode 0700), mapped to an empty
    mount point under ``base`` where the launcher, still root, binds it (:func:`host_side`) for
    bubblewrap to bind from."""
    out = {}
    for path in [args[0] for kind, *args in mount_plan() if kind == "ro"]:
        if not _reachable_by_nobody(path):
            out[path] = os.path.join(base, str(len(out)))
            os.makedirs(base, exist_ok=True)
            if os.path.isdir(path):
                os.mkdir(out[path])
            else:
                open(out[path], "w").close()
    return out


def _reachable_by_nobody(path: str) -> bool:
    """Whether every directory above ``path`` lets others through (nobody has no groups and owns nothing)."""
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def host_side(memory_bytes: int, nobody_dirs: list[str] | None,
              relayed: dict[str, str] | None = None) -> Callable[[], None]:
    """What the launcher runs before it execs: a private IPC namespace with System V limits at
    ``memory_bytes``. For a root caller with ``nobody_dirs`` (bubblewrap: the script's and the scratch
    directory, handed to nobody) also, in a private mount namespace, the ``relayed`` paths bound where
    nobody can reach them, then uid/gid 65534 with no supplementary groups. Any other caller's own ids
    are already unprivileged: it only gets the limits (:func:`_owned_ipc_limits`)."""
    if os.geteuid() != 0:
        return functools.partial(_owned_ipc_limits, _libc(), ipc_limits(memory_bytes))
    for d in nobody_dirs or ():
        os.chown(d, SANDBOX_ID, SANDBOX_ID)
    limits = ipc_limits(memory_bytes)
    libc = _libc()  # loaded here: dlopen in a forked child of a threaded parent can deadlock

    def before_exec() -> None:
        _checked(libc.unshare(_CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
        for key, value in limits.items():
            with open(f"/proc/sys/kernel/{key}", "w") as f:
                f.write(value)
        if nobody_dirs is None:
            return
        if relayed:
            _checked(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            _checked(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
            for src, dst in relayed.items():
                _checked(libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None), f"bind {src}")
        os.setgroups([])
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)

    return before_exec


def _owned_ipc_limits(libc: ctypes.CDLL, limits: dict[str, str]) -> None:
    """A non-root caller's IPC namespace with ``limits``: the kernel lets only the uid that is 0 in the
    IPC namespace's user namespace write its ``shm*`` files, so the caller makes a user namespace where
    it is 0, writes them, and then a nested one where it is its own uid again (nothing runs as 0 there:
    on exec it keeps no capability)."""
    uid, gid = os.getuid(), os.getgid()
    _checked(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWIPC), "unshare(CLONE_NEWUSER | CLONE_NEWIPC)")
    _map_ids(0, uid, 0, gid)
    for key, value in limits.items():
        with open(f"/proc/sys/kernel/{key}", "w") as f:
            f.write(value)
    _checked(libc.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    _map_ids(uid, 0, gid, 0)


def _map_ids(uid: int, outer_uid: int, gid: int, outer_gid: int) -> None:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {outer_uid} 1"), ("gid_map", f"{gid} {outer_gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def ipc_limits(memory_bytes: int) -> dict[str, str]:
    """System V IPC limits for a sandbox's own IPC namespace: shared memory at most ``memory_bytes`` in
    all (``shmall`` counts pages), few queues and semaphores (the kernel's defaults allow gigabytes)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return {"shmmax": str(memory_bytes), "shmall": str(max(1, memory_bytes // page)), "shmmni": "64",
            "msgmni": "16", "sem": "250 32000 32 128"}


def fresh_devices(path: str) -> str:
    """``path`` holding new device nodes (``DEVICES``) for one run, so that what a program does to its
    ``/dev`` (times, modes) touches these, not the host's. Needs root and a filesystem allowing devices."""
    os.mkdir(path)
    for name, (major, minor) in DEVICES.items():
        os.mknod(os.path.join(path, name), 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(os.path.join(path, name), 0o666)  # past the umask
    return path


def _checked(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox setup: {what}: {os.strerror(err)}")


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


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
            with command(backend, script, scratch, 1 << 30) as (argv, fds, preexec):
                done = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=fds,
                                      preexec_fn=preexec)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Isolation(False, f"{backend} could not start: {e}", bpf is not None)
    if done.returncode != 0 or done.stdout.strip() != "isolated":
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        as_whom = " by uid 65534 (a root caller's sandbox runs as nobody: it must read the Python installation)" \
            if os.geteuid() == 0 and backend == "bwrap" else ""
        return Isolation(False, f"{backend} cannot create namespaces here{as_whom} ({why}); user namespaces may be "
                                "disabled (sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces)",
                         bpf is not None)
    return Isolation(True, f"{backend} namespaces", True, backend)


def pipe_with(data: bytes) -> int:
    """A pipe's read end holding ``data`` (bubblewrap reads its seccomp program from a descriptor)."""
    r, w = os.pipe()
    try:
        os.write(w, data)  # a filter is a few hundred bytes: well within a pipe's buffer
    finally:
        os.close(w)
    return r
