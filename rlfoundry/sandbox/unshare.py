"""The same boundary as ``namespace.bwrap_argv`` where bubblewrap is not installed: the project makes
the namespaces itself with ``unshare(2)``, ``mount(2)`` and ``pivot_root(2)`` (through ctypes, in a
fresh interpreter that then becomes the program).

Three processes, as in bubblewrap: the launcher (the caller's child) enters new mount, PID, network,
IPC (unless the caller made one with limits, ``namespace.host_side``) and UTS namespaces, and a user
namespace where uid/gid 65534 maps to the caller's ids; a root caller's launcher needs and makes no
user namespace (the program becomes host uid/gid 65534, nobody, before it execs), and waits; the
namespace's init (PID 1) builds the filesystem (``/proc/sys`` read-only, ``/dev`` of the five host
nodes bound read-only, so their times, modes and owners cannot change; a ``namespace.Job``'s
folder, the stager's tmpfs, bound read-write, nosuid and nodev at the working directory), pivots into it, and reaps;
the program (PID 2) gives up every capability (bounding set, ambient set, and ``SECBIT_NOROOT``
locked, so that no uid grants anything on exec), sets no-new-privs, loads the seccomp filter and
execs the interpreter (or the job's command). Each dies with its parent. The exit status
travels up as bubblewrap reports it (128 + N for a signal N).
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["BOOTSTRAP", "SETUP_PRELUDE", "unshare_argv"]

# What the setup programs run in a fresh interpreter share (this one and stage.STAGER): the spec file
# named on their command line, and system calls that raise with the call's name.
SETUP_PRELUDE = r"""
import ctypes, json, os, platform, resource, signal, stat, sys
spec = json.load(open(sys.argv[1]))
libc = ctypes.CDLL(None, use_errno=True)
def ok(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox setup: {what}: {os.strerror(err)}")
def mount(src, dst, fstype, flags, data=None):
    enc = lambda v: None if v is None else str(v).encode()
    ok(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")
def die_with_parent():
    ok(libc.prctl(1, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")  # PR_SET_PDEATHSIG
"""

BOOTSTRAP = SETUP_PRELUDE + r"""
def wait_and_exit(pid):
    _, status = os.waitpid(pid, 0)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
LOCKABLE = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))

def bind_readonly(src, dst):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    # read-only all the way down: a mount nested in the tree (a volume inside a venv) must not stay writable
    if not readonly_tree(dst):
        for point in [dst] + nested_mounts(dst):
            # a remount may add flags but not drop those the source mount had (the kernel locks them)
            kept = sum(ms for st, ms in LOCKABLE if os.statvfs(point).f_flag & st)
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)

def readonly_tree(dst):
    # mount_setattr(2) with AT_RECURSIVE (Linux >= 5.12): read-only, nosuid, nodev on the whole tree at once
    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]
    attr = MountAttr(0x1 | 0x2 | 0x4, 0, 0, 0)  # MOUNT_ATTR_RDONLY | NOSUID | NODEV
    done = libc.syscall(442, -100, dst.encode(), 0x8000, ctypes.byref(attr), ctypes.sizeof(attr))  # AT_FDCWD
    return done == 0

def nested_mounts(dst):
    # mount points below dst, from this namespace's mount table (octal escapes as the kernel writes them)
    points = []
    for line in open("/proc/self/mountinfo"):
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(dst.rstrip("/") + "/"):
            points.append(point)
    return sorted(points, key=len)

def bind_device(name, root):
    # the host's node, read-only: writing to a device is allowed, changing its times, mode or owner is not
    dst = root + "/dev/" + name
    open(dst, "a").close()
    mount("/dev/" + name, dst, None, MS_BIND)
    kept = sum(ms for st, ms in LOCKABLE if os.statvfs(dst).f_flag & st)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept)

def bind_writable(src, dst):
    # nosuid and nodev, as bubblewrap's --bind: what the program leaves there gains nothing on exec
    mount(src, dst, None, MS_BIND)
    kept = sum(ms for st, ms in LOCKABLE if os.statvfs(dst).f_flag & st)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | kept)

def build_root(root):
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    # the tmpfs first, then the binds: a Python installed under /tmp stays visible, as with bubblewrap
    for d in ("/tmp", spec["workdir"]):
        os.makedirs(root + d)
        if d == spec["workdir"] and spec["job"]:  # the caller's directory, read-write: files in and out
            bind_writable(spec["job"]["workdir"], root + d)
            continue
        mount("tmpfs", root + d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec['tmp_bytes']}")
    for entry in spec["plan"]:
        if entry[0] == "ro":
            bind_readonly(entry[1], root + entry[1])
        else:
            os.symlink(entry[1], root + entry[2])
    os.makedirs(root + "/dev")
    for name in ("null", "zero", "full", "random", "urandom"):
        bind_device(name, root)
    if not spec["job"]:
        bind_readonly(spec["script"], root + spec["workdir"] + "/main.py")
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for covered in ("/proc/sys", "/proc/sysrq-trigger"):  # the host's settings, as bubblewrap covers them
        if not os.path.exists(root + covered):
            continue
        mount(root + covered, root + covered, None, MS_BIND)
        mount(None, root + covered, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    os.mkdir(".old")
    ok(libc.syscall({"x86_64": 155, "aarch64": 41}[platform.machine()], b".", b".old"), "pivot_root")
    ok(libc.umount2(b"/.old", 2), "umount the old root")  # MNT_DETACH
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(spec["workdir"])

def loopback_up():
    # the new network namespace has only a loopback device, down: up, as bubblewrap leaves it
    import fcntl, socket, struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x8 | 0x40, b""))  # SIOCSIFFLAGS: UP|LOOPBACK|RUNNING

def become(sid):
    # host root until here (a root caller's setup): nobody from now on, with no supplementary groups
    os.setgroups([])
    os.setresgid(sid, sid, sid)
    os.setresuid(sid, sid, sid)

def drop_everything(bpf, sid):
    ok(libc.prctl(28, 0b101111, 0, 0, 0), "securebits")  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS off; all locked
    for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
        ok(libc.prctl(24, cap, 0, 0, 0), "drop a bounding capability")  # PR_CAPBSET_DROP
    ok(libc.prctl(47, 4, 0, 0, 0), "clear ambient capabilities")  # PR_CAP_AMBIENT, CLEAR_ALL
    if sid is not None:  # while CAP_SETUID is still held; the capset below clears the rest
        become(sid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    ok(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    ok(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    if bpf:
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        buf = ctypes.create_string_buffer(bpf, len(bpf))
        prog = Prog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
        ok(libc.prctl(22, 2, ctypes.byref(prog), 0, 0), "seccomp")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER

die_with_parent()
uid, gid = os.getuid(), os.getgid()
bpf = open(spec["bpf"], "rb").read() if spec["bpf"] else b""
ipc = 0x08000000 if spec["own_ipc"] else 0  # else the caller made it, with limits
flags = 0x00020000 | 0x20000000 | 0x40000000 | ipc | 0x04000000  # mount, PID, network, (IPC), UTS
sid = spec["id"]
if spec["as_root"]:
    # a root caller: no user namespace, whose uid map would have to name host root for the setup to
    # read a Python installed under /root (0700). The setup runs as root; the program becomes nobody.
    ok(libc.unshare(flags), "unshare")
else:
    ok(libc.unshare(0x10000000 | flags), "unshare")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:  # inside, nobody (never 0): it owns nothing the kernel guards
        f.write(f"{sid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{sid} {gid} 1")
init = os.fork()
if init:
    wait_and_exit(init)
die_with_parent()
build_root(spec["root"])
ok(libc.sethostname(b"sandbox", 7), "sethostname")
loopback_up()
ok(libc.prctl(4, 0, 0, 0, 0), "PR_SET_DUMPABLE")  # the init keeps its capabilities: not even its memory is readable
program = os.fork()
if program:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:  # the init reaps whatever the program leaves, and ends with the program
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
die_with_parent()
os.setsid()
drop_everything(bpf, sid if spec["as_root"] else None)
if spec["job"]:
    os.execvpe(spec["job"]["argv"][0], spec["job"]["argv"], spec["env"])
os.execve(spec["python"], [spec["python"], "-I", "-B", spec["workdir"] + "/main.py"], spec["env"])
"""


def unshare_argv(spec: dict, scratch: str) -> list[str]:
    """The launcher's command line. ``spec``: ``plan`` (``namespace.mount_plan()``), ``script``, ``bpf``
    (a file or None), ``tmp_bytes``, ``workdir``, ``python``, ``env``, ``job`` (None, or ``namespace.Job``'s
    ``argv`` and host ``workdir``), ``own_ipc`` (make an IPC namespace), ``id`` (the uid/gid inside),
    ``as_root`` (the caller is root: no user namespace, the program becomes host uid/gid ``id``);
    ``scratch`` is an empty host
    directory for the spec and the new root."""
    root = os.path.join(scratch, "root")
    os.mkdir(root)
    spec_path = os.path.join(scratch, "spec.json")
    with open(spec_path, "w") as f:
        json.dump({**spec, "root": root}, f)
    return [sys.executable, "-I", "-B", "-c", BOOTSTRAP, spec_path]
