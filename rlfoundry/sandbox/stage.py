"""A job's working folder as a size-capped tmpfs, so that a program (``rlfoundry sandbox serve``'s
``files``, a compiler's outputs) can never fill the host's disk: ``RLIMIT_FSIZE`` caps each file,
not how many there are.

The stager is a fresh interpreter between the caller and the sandbox (bubblewrap or ``unshare.py``).
In a private mount namespace (with a user namespace mapping the caller's own ids for a caller that is
not root, who may mount only there) it mounts a tmpfs of ``disk_bytes`` plus what goes in, copies the
job's host folder into it, and runs the sandbox with the tmpfs as the job's folder. When the sandbox
has ended (its PID namespace with it: nothing in it runs any more) it copies the regular files and
folders back out (at most ``MAX_DEPTH`` deep), never following a link, into a fresh host folder that :func:`namespace.command`
puts in place of the job's. A run killed at its time limit brings nothing back. The tmpfs goes with
the stager's mount namespace; its pages are charged to the run's memory cgroup where there is one.
"""

from __future__ import annotations

import json
import os
import sys

from rlfoundry.sandbox.unshare import SETUP_PRELUDE

__all__ = ["STAGER", "stager_argv"]

INODES = 16384  # files and folders a job's tmpfs may hold: each costs kernel memory outside the size
MAX_DEPTH = 64  # folders deeper than this in a job's folder are not copied back

STAGER = SETUP_PRELUDE + r"""
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18

def private_mounts():
    if os.geteuid() != 0:  # the caller's own ids inside: a user namespace lets it mount, and changes nobody's ids
        uid, gid = os.getuid(), os.getgid()
        ok(libc.unshare(0x10000000 | 0x00020000), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    else:
        ok(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)

def tree_bytes(top):
    # what the inputs take on a tmpfs: whole pages, and a page for each entry
    total = 4096
    for base, dirs, files in os.walk(top):
        total += 4096 * len(dirs)
        for name in files:
            total += 4096 + -(-os.lstat(os.path.join(base, name)).st_size // 4096) * 4096
    return total

def copy_in(src, dst, owner):
    for base, dirs, files in os.walk(src):
        rel = os.path.relpath(base, src)
        for name in dirs:
            os.mkdir(os.path.join(dst, rel, name), 0o700)
        for name in files:
            copy_file(os.path.join(base, name), os.path.join(dst, rel, name))
    if owner is not None:  # a root caller's program is nobody on the host: its folder is nobody's
        for base, dirs, files in os.walk(dst):
            for name in [base] + [os.path.join(base, n) for n in dirs + files]:
                os.chown(name, owner, owner, follow_symlinks=False)

def copy_file(src, dst):
    # O_NOFOLLOW and a regular file only: a link or a FIFO the program left is not copied
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            while chunk := os.read(fd, 1 << 20):
                os.write(out, chunk)
            os.fchmod(out, mode & 0o777)  # a compiled program stays executable; set-id bits never travel
        finally:
            os.close(out)
    finally:
        os.close(fd)

def copy_out(src, dst):
    os.mkdir(dst, 0o700)
    for base, dirs, files in os.walk(src):  # links to folders are listed in dirs, never entered: skipped
        rel = os.path.relpath(base, src)
        if rel.count("/") + 1 >= spec["max_depth"]:
            dirs[:] = []  # deeper folders stay behind: the host's recursive tools (rmtree) must manage what comes back
        for name in dirs:
            if not os.path.islink(os.path.join(base, name)):
                os.mkdir(os.path.join(dst, rel, name), 0o700)
        for name in files:
            try:
                copy_file(os.path.join(base, name), os.path.join(dst, rel, name))
            except OSError:
                continue  # a link (ELOOP) or a file it left unreadable: not returned

def become_nobody(sid):
    os.setgroups([])
    os.setresgid(sid, sid, sid)
    os.setresuid(sid, sid, sid)

def run_sandbox():
    pid = os.fork()
    if pid == 0:
        die_with_parent()
        if spec["nobody"] is not None:
            become_nobody(spec["nobody"])
        for res, soft, hard in spec["rlimits"]:
            resource.setrlimit(res, (soft, hard))
        os.execv(spec["argv"][0], spec["argv"])
    _, status = os.waitpid(pid, 0)
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

die_with_parent()
private_mounts()
for src, dst in spec["relayed"].items():  # what bubblewrap, run as nobody, binds from (namespace.relays)
    mount(src, dst, None, MS_BIND | MS_REC)
options = f"size={spec['disk_bytes'] + tree_bytes(spec['workdir'])},nr_inodes={spec['inodes']},mode=0700"
mount("tmpfs", spec["tmpfs"], "tmpfs", MS_NOSUID | MS_NODEV, options)
copy_in(spec["workdir"], spec["tmpfs"], spec["owner"])
code = run_sandbox()
try:
    copy_out(spec["tmpfs"], spec["out"] + ".part")
    os.rename(spec["out"] + ".part", spec["out"])
except (OSError, RecursionError) as e:  # a tree too deep or names too long: the run's result still stands
    print(f"sandbox staging: the working folder could not be copied back: {e}", file=sys.stderr)
sys.exit(code)
"""


def stager_argv(spec: dict, scratch: str) -> list[str]:
    """The stager's command line. ``spec``: ``argv`` (the sandbox's launch), ``workdir`` (the job's host
    folder), ``tmpfs`` (an empty folder to mount it on), ``out`` (where the folder comes back: a path
    that does not exist yet), ``disk_bytes``, ``owner`` (uid/gid to give what goes in, or None: the
    caller's), ``nobody`` (uid/gid to run the launch as, or None),
    ``relayed`` (paths to bind first), ``rlimits`` ((resource, soft, hard) for the launch)."""
    path = os.path.join(scratch, "stage.json")
    with open(path, "w") as f:
        json.dump({**spec, "inodes": INODES, "max_depth": MAX_DEPTH}, f)
    return [sys.executable, "-I", "-B", "-c", STAGER, path]
