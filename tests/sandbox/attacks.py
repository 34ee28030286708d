"""Hostile programs, one per attack class. Each prints ``ESCAPED`` when its action worked from where it
stands; the harness also checks the world outside (sentinel directory, decoy process, the caller)
after every run, so an attack that succeeds silently is caught too.

Tokens filled in by the harness: ``SENTINEL`` (a directory outside the sandbox), ``SECRET_PATH``
(a file in it), ``SECRET`` (its content), ``PARENT_PID`` (the caller running the program), ``DECOY_PID``
(a sibling process), ``MARKER`` (a word a stray process would carry), ``PORT`` (a TCP listener on the
caller's loopback), ``ABSTRACT`` (an abstract Unix socket the caller listens on).
"""

from __future__ import annotations

# subprocess's own call to sys.audit answered by a stand-in: no audit event, so no hook sees the Popen
_AUDIT_SILENCED = """
import subprocess, sys, types
class _Sys(types.ModuleType):
    def __getattr__(self, name):
        return getattr(sys, name)
fake = _Sys('sys'); fake.audit = lambda *a: None
subprocess.sys = fake
"""
_READ_SECRET = "print('ESCAPED' if 'SECRET' in open('SECRET_PATH').read() else '')"

ATTACKS: dict[str, str] = {
    # ---- files outside ------------------------------------------------------------------------
    "read_outside_file": _READ_SECRET,
    "write_outside_file": "open('SENTINEL/pwned', 'w').write('x'); print('ESCAPED')",
    "delete_outside_file": "import os; os.remove('SECRET_PATH'); print('ESCAPED')",
    "list_caller_home": "import os; print('ESCAPED' if os.listdir('SENTINEL') else '')",
    "rename_into_outside": "import os; open('a', 'w').write('x'); os.rename('a', 'SENTINEL/pwned'); print('ESCAPED')",
    "replace_into_outside": "import os; open('a', 'w').write('x'); os.replace('a', 'SENTINEL/pwned'); print('ESCAPED')",
    "hardlink_into_outside": "import os; open('a', 'w').write('x'); os.link('a', 'SENTINEL/pwned'); print('ESCAPED')",
    "symlink_into_outside": "import os; os.symlink('x', 'SENTINEL/pwned'); print('ESCAPED')",
    "mkfifo_outside": "import os; os.mkfifo('SENTINEL/pwned'); print('ESCAPED')",
    "dir_fd_traversal": """
import os, sys
base = os.path.realpath(sys.prefix)
up = '../' * len([p for p in base.split('/') if p])
rel = up + 'SECRET_PATH'.lstrip('/')
deep = '/'.join(['d'] * (rel.count('/') + 2))
os.makedirs(deep); os.chdir(deep)  # from here the relative path resolves inside the work directory
fd = os.open(base, os.O_RDONLY)
data = os.read(os.open(rel, os.O_RDONLY, dir_fd=fd), 100)
print('ESCAPED' if b'SECRET' in data else '')
""",
    "caller_environ": "print('ESCAPED' if b'SECRET' in open('/proc/PARENT_PID/environ', 'rb').read() else '')",
    "own_environ": "import os; print('ESCAPED' if any('SECRET' in v for v in os.environ.values()) else '')",
    "harness_logs_deleted": "import os; os.remove(os.readlink('/proc/self/fd/1')); print('ESCAPED')",
    # ---- switching a Python-level policy off ------------------------------------------------------
    "builtins_any_replaced": "import builtins; builtins.any = lambda it: True\n" + _READ_SECRET,
    "hook_globals_through_frames": """
import sys
f = sys._getframe()
while f is not None:
    if '_work' in f.f_globals:
        f.f_globals['_work'] = '/'
    f = f.f_back
open('SENTINEL/pwned', 'w').write('x'); print('ESCAPED')
""",
    "hook_globals_through_gc": """
import gc
for o in gc.get_objects():
    if callable(o) and getattr(o, '__name__', '') == '_hook':
        o.__globals__['_work'] = '/'
open('SENTINEL/pwned', 'w').write('x'); print('ESCAPED')
""",
    # ---- new processes ------------------------------------------------------------------------
    "fork": "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nprint('ESCAPED')",
    "subprocess_with_audit_silenced": _AUDIT_SILENCED + """
subprocess.run(['/bin/sh', '-c', 'echo x > SENTINEL/pwned'])
print('ESCAPED')
""",
    "spawn_without_hook": """
import multiprocessing.util as u, sys
u.spawnv_passfds(sys.executable, [sys.executable, '-c', "open('SENTINEL/pwned', 'w').write('x')"], [])
print('ESCAPED')
""",
    "setsid_child_outlives_call": _AUDIT_SILENCED + """
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', 'MARKER'], start_new_session=True)
print('ESCAPED')
""",
    "fork_bomb": "import os\nfor _ in range(200):\n    os.fork()\nprint('ESCAPED')",
    # ---- the caller and its siblings ---------------------------------------------------------
    "pidfd_kill_caller": "import os, signal; signal.pidfd_send_signal(os.pidfd_open(PARENT_PID), signal.SIGKILL); print('ESCAPED')",
    "pidfd_stop_caller": "import os, signal; signal.pidfd_send_signal(os.pidfd_open(PARENT_PID), signal.SIGSTOP); print('ESCAPED')",
    "pidfd_kill_sibling": "import os, signal; signal.pidfd_send_signal(os.pidfd_open(DECOY_PID), signal.SIGKILL); print('ESCAPED')",
    "kill_sibling": "import os, signal; os.kill(DECOY_PID, signal.SIGKILL); print('ESCAPED')",
    "prlimit_caller_cpu": "import resource; resource.prlimit(PARENT_PID, resource.RLIMIT_CPU, (0, 0)); print('ESCAPED')",
    "prlimit_caller_nofile": "import resource; resource.prlimit(PARENT_PID, resource.RLIMIT_NOFILE, (3, 3)); print('ESCAPED')",
    "renice_caller": "import os; os.setpriority(os.PRIO_PROCESS, PARENT_PID, 19); print('ESCAPED')",
    "pin_caller": "import os; os.sched_setaffinity(PARENT_PID, {0}); print('ESCAPED')",
    "ctypes_signal_probe": "import ctypes; print('ESCAPED' if ctypes.CDLL(None).kill(PARENT_PID, 0) == 0 else '')",
    "ctypes_ptrace_caller": """
import ctypes
libc = ctypes.CDLL(None)
if libc.ptrace(16, PARENT_PID, 0, 0) == 0:  # PTRACE_ATTACH
    libc.ptrace(17, PARENT_PID, 0, 0)  # PTRACE_DETACH
    print('ESCAPED')
""",
    "raise_own_limits": "import resource; resource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6)); print('ESCAPED')",
    # ---- network ------------------------------------------------------------------------------
    "tcp_to_caller": "import socket; socket.create_connection(('127.0.0.1', PORT), timeout=1).send(b'MARKER'); print('ESCAPED')",
    "abstract_unix_socket": """
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(1)
s.connect('\\0ABSTRACT'); s.send(b'MARKER'); print('ESCAPED')
""",
}

# Programs that would hurt the whole machine if they got out: never run without kernel isolation. The
# host-object ones (sysctls, /dev, disk, System V memory) matter when the caller is root, as in CI;
# the harness also compares the host's side (test_attacks.World.host_state) before and after.
NAMESPACED_ONLY: dict[str, str] = {
    "kill_everything": "import os, signal; os.kill(-1, signal.SIGKILL); print('ESCAPED')",
    # a host sysctl changed (the harness restores it if this gets out)
    "sysctl_write": """
p = '/proc/sys/kernel/printk_ratelimit'
v = int(open(p).read())
with open(p, 'w') as f:
    f.write(str(v + 1))
print('ESCAPED')
""",
    # opened for writing, nothing written: being able to is the escape
    "sysctl_open_for_write": """
opened = []
for name in ('kernel/core_pattern', 'vm/drop_caches', 'kernel/randomize_va_space', 'kernel/shmmax'):
    try:
        open('/proc/sys/' + name, 'r+').close()
        opened.append(name)
    except OSError:
        pass
print('ESCAPED' if opened else '')
""",
    "root_only_proc_read": """
import os
got = []
for p in ('/proc/kcore', '/proc/kpageflags', '/proc/kpagecount', '/proc/slabinfo', '/proc/vmallocinfo',
          '/proc/timer_list', '/proc/pagetypeinfo'):
    if not os.path.exists(p) or os.stat(p).st_mode & 0o004:  # readable by anyone here: not the point
        continue
    try:
        with open(p, 'rb') as f:
            got.append(len(f.read(1)))
    except OSError:
        pass
print('ESCAPED' if got else '')
""",
    # changing a node's mode, owner or times to what they are: harmless if it got out, refused if held.
    # utime() to now needs only write access, which /dev/null grants everyone: the harness checks
    # the host node's mtime instead of the program's word
    "dev_node_chmod_chown_utime": """
import os
changed = []
for name in ('null', 'zero', 'urandom', 'full'):
    p = '/dev/' + name
    st = os.stat(p)
    for what, act in (('chmod', lambda: os.chmod(p, st.st_mode & 0o7777)),
                      ('chown', lambda: os.chown(p, st.st_uid, st.st_gid)),
                      ('utime', lambda: os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns)))):
        try:
            act()
            changed.append(what)
        except OSError:
            pass
    try:
        os.utime(p)
    except OSError:
        pass
print('ESCAPED' if changed else '')
""",
    # disk the output limit does not see: RLIMIT_FSIZE does not cover FALLOC_FL_KEEP_SIZE
    "fallocate_keep_size_on_output": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
ok = [libc.fallocate(fd, 1, 0, 384 << 20) == 0 for fd in (1, 2)]  # FALLOC_FL_KEEP_SIZE
print('ESCAPED' if any(ok) else '')
""",
    # memory the address-space limit does not see: 768 MiB of System V segments against 512 MiB
    "sysv_shm_over_memory_limit": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_int)
ids = [libc.shmget(0, 256 << 20, 0o1000 | 0o600) for _ in range(3)]  # IPC_PRIVATE, IPC_CREAT
print('ESCAPED' if all(i >= 0 for i in ids) else '')
""",
    # the sandbox's init: its environment, memory map and descriptors (host paths) are not the program's
    "init_proc_entries": """
import os
seen = []
for name in ('environ', 'maps', 'auxv', 'syscall', 'io'):
    try:
        seen.append(open('/proc/1/' + name, 'rb').read(64))
    except OSError:
        pass
try:
    seen += [os.readlink('/proc/1/fd/' + fd) for fd in os.listdir('/proc/1/fd')]
except OSError:
    pass
print('ESCAPED' if any(seen) else '')
""",
}

# What the unisolated (audit-hook) mode does not stop, found by running ATTACKS through it; the
# docs (docs/sandbox.md) print this list. A change in either direction fails the test.
UNISOLATED_ESCAPES = frozenset({
    "rename_into_outside", "replace_into_outside", "hardlink_into_outside", "symlink_into_outside", "mkfifo_outside",
    "dir_fd_traversal", "builtins_any_replaced", "subprocess_with_audit_silenced", "setsid_child_outlives_call",
    "pidfd_kill_caller", "pidfd_stop_caller", "pidfd_kill_sibling", "prlimit_caller_cpu", "prlimit_caller_nofile",
    "renice_caller", "pin_caller",
})

# What only a root caller's sandbox holds against (docs/sandbox.md, "The boundary"): skipped for other
# callers, whose own ids bound the program anyway.
ROOT_CALLER_ONLY = {
    "sysv_shm_over_memory_limit": "the limited IPC namespace needs a root caller",
    "dev_node_chmod_chown_utime": "a non-root caller's bubblewrap binds the host's nodes, whose times the caller "
                                  "may change itself",
}
