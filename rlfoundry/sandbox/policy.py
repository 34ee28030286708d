"""The unisolated mode's only defence: a PEP 578 audit hook installed before the program runs.

It refuses new processes, sockets, ``ctypes``, and file access outside the working directory (reads
also inside the Python installation), raising ``PermissionError`` in the program. This stops a
program that loops, forks or wanders by mistake. It does **not** stop a hostile one: the hook is
Python code in the program's own interpreter, and the attack suite (``tests/sandbox``) lists the
ways around it. Used only when the user opts in to running code without kernel isolation.
"""

from __future__ import annotations

__all__ = ["BOOTSTRAP"]

# Runs in the child before the code: the audit-hook policy, then the code as __main__.
BOOTSTRAP = r"""
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
