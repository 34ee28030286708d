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

# Programs that would hurt the whole machine if they got out: never run without kernel isolation.
NAMESPACED_ONLY: dict[str, str] = {
    "kill_everything": "import os, signal; os.kill(-1, signal.SIGKILL); print('ESCAPED')",
}

# What the unisolated (audit-hook) mode does not stop, found by running ATTACKS through it; the
# docs (docs/sandbox.md) print this list. A change in either direction fails the test.
UNISOLATED_ESCAPES = frozenset({
    "rename_into_outside", "replace_into_outside", "hardlink_into_outside", "symlink_into_outside", "mkfifo_outside",
    "dir_fd_traversal", "builtins_any_replaced", "subprocess_with_audit_silenced", "setsid_child_outlives_call",
    "pidfd_kill_caller", "pidfd_stop_caller", "pidfd_kill_sibling", "prlimit_caller_cpu", "prlimit_caller_nofile",
    "renice_caller", "pin_caller",
})
