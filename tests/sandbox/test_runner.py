"""The sandbox a tool call or a generated program runs in: every way code can misbehave ends as a
result with a status and a message, in bounded time, with nothing left behind."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest

from rlfoundry.sandbox import ALLOW_UNISOLATED_ENV, ISOLATION_ENV, SandboxLimits, SandboxUnavailable, run_python
from rlfoundry.sandbox.cgroup import memory_cgroups
from rlfoundry.sandbox.namespace import isolation


LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=1, memory_bytes=512 << 20, max_output_bytes=4096)


@pytest.fixture(autouse=True, params=["bwrap", "unshare"])
def backend(request, monkeypatch):
    """Every test on both kernel backends (bubblewrap; the project's own namespaces where it is missing)."""
    monkeypatch.setenv(ISOLATION_ENV, request.param)
    if not isolation().available:
        pytest.skip(f"the {request.param} backend does not work here: {isolation().reason}")
    return request.param


def _run(code: str, limits: SandboxLimits = LIMITS):
    return run_python(code, limits)


def test_a_program_runs_and_its_output_comes_back():
    r = _run("import math\nprint(math.factorial(20))\nopen('a.txt', 'w').write('kept?')\nprint(open('a.txt').read())")
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "2432902008176640000\nkept?\n")


def test_nothing_carries_over_between_calls():
    _run("open('state.txt', 'w').write('1')")
    r = _run("import os\nprint(os.path.exists('state.txt'))")
    assert r.stdout == "False\n"


def test_an_exception_is_an_error_with_its_traceback():
    r = _run("raise ValueError('boom')")
    assert r.status == "error" and r.exit_code == 1 and "ValueError: boom" in r.stderr


def test_a_busy_loop_stops_at_the_cpu_limit():
    # a wall-clock limit it cannot reach first, however loaded the machine: only the CPU limit can stop it
    r = _run("while True:\n    pass", SandboxLimits(wall_time_s=600.0, cpu_time_s=1))
    # SIGXCPU at the soft limit, SIGKILL at the hard one a second later; the wall clock would take 600 s
    assert r.status == "timeout" and r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)


def test_a_sleeping_program_stops_at_the_wall_clock_limit():
    r = _run("import time\ntime.sleep(60)", SandboxLimits(wall_time_s=1.0, cpu_time_s=1))
    assert r.status == "timeout" and r.exit_code == -signal.SIGKILL  # the sleeper, uninterrupted, would exit 0


def test_megabytes_of_output_are_cut_at_the_limit():
    r = _run("print('x' * 10_000_000)")
    assert r.status == "output_limit" and len(r.stdout) <= LIMITS.max_output_bytes


def test_output_up_to_the_limit_is_kept_whole():
    r = _run(f"import sys\nsys.stdout.write('y' * {LIMITS.max_output_bytes})")
    assert (r.status, len(r.stdout)) == ("ok", LIMITS.max_output_bytes)


def test_standard_input_larger_than_a_pipe_buffer_arrives_whole():
    # 1 MiB: sixteen times a pipe's buffer, so it is fed while the program reads
    data = "".join(f"{i}\n" for i in range(150_000))
    r = run_python("import sys, hashlib\nprint(hashlib.sha256(sys.stdin.read().encode()).hexdigest())", LIMITS, stdin=data)
    assert r.status == "ok" and r.stdout.strip() == hashlib.sha256(data.encode()).hexdigest()


def test_the_program_is_nobody_with_no_groups_and_sees_only_fresh_devices():
    r = _run("import os\nprint(os.getuid(), os.getgid(), os.getgroups(), sorted(os.listdir('/dev')), "
             "os.path.exists('/sys'), os.access('/proc/sys/kernel/shmmax', os.W_OK))")
    assert r.stdout.split("\n")[0] == "65534 65534 [] ['full', 'null', 'random', 'urandom', 'zero'] False False"


def test_non_text_output_is_decoded_with_replacement():
    r = _run("import sys\nsys.stdout.buffer.write(bytes(range(256)))")
    assert r.status == "ok" and "\ufffd" in r.stdout and r.stdout.startswith("\x00\x01")


def test_unbounded_allocation_is_a_memory_error():
    r = _run("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))")
    assert r.status == "memory"


_MEMFD_HOG = """import os
chunk = b'x' * (1 << 20)
fds = []
for n in range(768):  # 1 MiB each, within RLIMIT_FSIZE; never mapped, so RLIMIT_AS does not see them
    fd = os.memfd_create('hold')
    os.write(fd, chunk)
    fds.append(fd)
    if n % 64 == 63:
        print(n + 1, flush=True)
"""


def test_memory_the_address_space_limit_does_not_see_is_capped_by_the_runs_cgroup():
    """768 memfd files of 1 MiB against a 512 MiB limit (SandboxFusion's 1 MiB output cap, so each file is
    allowed): the run's memory cgroup counts their pages, and its OOM killer ends the run (or, on kernels
    that fail the write instead, ENOMEM does) before it holds 512 MiB; the cgroup is gone afterwards."""
    where = memory_cgroups()
    if where.parent is None:
        pytest.skip(f"no memory cgroup can be made here: {where.reason}")
    limits = SandboxLimits(wall_time_s=10.0, memory_bytes=512 << 20, max_output_bytes=1 << 20)
    r = _run(_MEMFD_HOG, limits)
    held = int(r.stdout.split()[-1]) if r.stdout.split() else 0
    assert r.status == "memory" and r.exit_code in (-signal.SIGKILL, 1) and held < 512, r
    assert not [p for p in os.listdir(where.parent) if p.startswith(f"rlfoundry-sandbox-{os.getpid()}-")]


@pytest.fixture
def unisolated(monkeypatch):
    """The opt-in mode without kernel isolation, even where namespaces work."""
    monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "1")
    monkeypatch.setenv(ISOLATION_ENV, "none")


@pytest.mark.parametrize("code, refused", [
    ("import os\nfor _ in range(50):\n    os.fork()", "os.fork"),
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import os\nos.system('true')", "os.system"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)", "socket"),
    ("print(open('/etc/hostname').read())", "reading '/etc/hostname'"),
    ("open('/tmp/rlfoundry-sandbox-escape.txt', 'w').write('x')", "writing '/tmp/rlfoundry-sandbox-escape.txt'"),
    ("import os\nos.remove('/tmp/anything')", "os.remove"),
    ("import ctypes", "importing ctypes"),
])
def test_the_unisolated_policy_refuses_processes_sockets_outside_files_and_ctypes(unisolated, code, refused):
    r = _run(code)
    assert r.isolation == "unisolated"
    assert r.status == "error" and "PermissionError: sandbox:" in r.stderr and refused in r.stderr, r.stderr
    assert not Path("/tmp/rlfoundry-sandbox-escape.txt").exists()


def test_an_unisolated_refusal_is_an_exception_the_code_may_handle(unisolated):
    r = _run("try:\n    open('/etc/hostname')\nexcept PermissionError as e:\n    print('caught', e)")
    assert r.status == "ok" and r.stdout.startswith("caught sandbox:")


@pytest.mark.parametrize("code, error", [
    ("import os\nfor _ in range(50):\n    os.fork()", "PermissionError: [Errno 1]"),  # seccomp: no processes
    ("import subprocess\nsubprocess.run(['true'])", "PermissionError: [Errno 1]"),
    ("import os\nos.unshare(os.CLONE_NEWUSER)" if hasattr(os, "unshare") else "import os\nos.fork()",
     "PermissionError: [Errno 1]"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)", "ConnectionRefusedError"),  # own loopback
    ("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)", "OSError: [Errno 101]"),  # no route out
    ("print(open('/etc/hostname').read())", "FileNotFoundError"),  # the host's files are not there at all
    ("open('/usr/pwned', 'w')", "OSError: [Errno 30] Read-only file system"),
])
def test_the_namespaced_sandbox_answers_with_the_kernels_errors(code, error):
    r = _run(code)
    assert (r.isolation, r.status) == ("namespaced", "error") and error in r.stderr, r.stderr


def test_the_namespaced_program_sees_its_own_world():
    name = f"rlfoundry-private-{os.getpid()}"
    r = _run(f"import json, os\nopen('/tmp/{name}', 'w').write('x')\n"
             "print(json.dumps([os.getpid(), os.getcwd(), [p for p in os.listdir('/proc') if p.isdigit()]]))")
    pid, cwd, pids = json.loads(r.stdout)
    assert r.status == "ok" and cwd == "/sandbox"
    assert pid <= 3 and len(pids) <= 2  # bubblewrap's init and itself: no other process exists for it
    assert not Path(f"/tmp/{name}").exists()  # its /tmp is its own


def test_no_isolation_and_no_opt_in_is_an_error_that_says_how_to_fix_it(monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "none")
    monkeypatch.delenv(ALLOW_UNISOLATED_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match="sandbox.allow_unisolated=true"):
        _run("print(1)")


def test_the_working_directory_is_removed_afterwards():
    r = _run("import os\nprint(os.getcwd())")
    assert r.status == "ok" and not os.path.exists(r.stdout.strip())


_NESTED_MOUNT_PROBE = """
import os, subprocess, sys
from rlfoundry.sandbox import SandboxLimits, run_python
nested = os.path.join(sys.prefix, "include")
os.makedirs(nested, exist_ok=True)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", nested], check=True)  # only in this mount namespace
r = run_python(f"open({os.path.join(nested, 'x')!r}, 'w').write('x')", SandboxLimits(wall_time_s=10))
print(r.status, "Read-only file system" in r.stderr, os.path.exists(os.path.join(nested, "x")))
"""


def test_a_mount_nested_in_a_read_only_tree_is_read_only_too(backend):
    """A writable mount inside the interpreter's tree (a volume in a venv) stays read-only in the sandbox.
    The tmpfs is mounted in a private mount namespace of a child process: the host never sees it."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and util-linux unshare to make a private mount namespace")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _NESTED_MOUNT_PROBE],
                          capture_output=True, text=True, timeout=120, env={**os.environ, ISOLATION_ENV: backend})
    if done.returncode != 0 and "mount" in done.stderr and "permission" in done.stderr.lower():
        pytest.skip(f"cannot mount here: {done.stderr[-200:]}")
    assert done.stdout.split() == ["error", "True", "False"], done.stdout + done.stderr


_NON_ROOT_SHM = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_int)
ids = [libc.shmget(0, 256 << 20, 0o1000 | 0o600) for _ in range(3)]  # 768 MiB against 512
try:
    open('/proc/sys/kernel/shmmax', 'r+').close()
    refused = False
except OSError:
    refused = True
print(os.getuid(), open('/proc/sys/kernel/shmmax').read().strip(), sum(i >= 0 for i in ids), refused)
"""
_NON_ROOT_PROBE = """
import json, os, sys, tempfile
from rlfoundry.sandbox import SandboxLimits, run_python
from rlfoundry.sandbox.namespace import Job
from rlfoundry.sandbox.runner import run_job
r = run_python(sys.argv[1], SandboxLimits(memory_bytes=512 << 20))
with tempfile.TemporaryDirectory() as work:
    open(os.path.join(work, 'main.py'), 'w').write("import os; open('made', 'w').write(str(os.getuid()))")
    job = run_job(Job((sys.executable, '-I', '-B', 'main.py'), work), SandboxLimits())
    made = open(os.path.join(work, 'made')).read() if os.path.exists(os.path.join(work, 'made')) else None
print(json.dumps([os.getuid(), r.status, r.stdout.split(), job.status, made]))
"""


def test_a_non_root_callers_sandbox_has_the_ipc_limits_and_its_jobs_folder_works(backend):
    """The caller is nobody here (as root: the interpreter bound where nobody reaches it, in a private
    mount namespace). Its sandbox's IPC namespace gets the limits through a user namespace where the
    caller is 0 (the only uid the kernel lets write them), so 768 MiB of SysV segments fail against
    512 MiB, as for a root caller, and the program still cannot write them; a job's folder, a tmpfs the
    stager mounts in the caller's own user namespace, comes back."""
    import shutil
    import site
    import subprocess
    import sys

    from rlfoundry.sandbox.namespace import _reachable_by_nobody

    repo = str(Path(__file__).resolve().parents[2])
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("needs root and util-linux unshare and setpriv to run a caller as nobody")
    if not _reachable_by_nobody(os.path.join(repo, "rlfoundry")):
        pytest.skip(f"nobody cannot read the checkout at {repo}")
    # the interpreter's installation and (in a virtual environment, CI's) the environment's, each bound in /tmp
    # where nobody passes (the originals may sit under /root, mode 0700)
    binds = {p: tempfile.mkdtemp(prefix="rlf-py-") for p in {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}}

    def moved(path: str) -> str:
        for prefix, bound in binds.items():
            if path == prefix or path.startswith(prefix + os.sep):
                return bound + path[len(prefix):]
        return path

    for bound in binds.values():
        os.chmod(bound, 0o755)
    paths = [repo] + [moved(os.path.realpath(p)) for p in site.getsitepackages()]
    python = moved(os.path.realpath(sys.executable))
    mounts = " && ".join(f"mount --bind {prefix} {bound}" for prefix, bound in binds.items())
    script = (f'{mounts} && exec setpriv --reuid 65534 --regid 65534 --clear-groups env '
              f'HOME=/tmp PYTHONPATH={":".join(paths)} {ISOLATION_ENV}={backend} {python} -c "$0" "$1"')
    try:
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                               _NON_ROOT_PROBE, _NON_ROOT_SHM], capture_output=True, text=True, timeout=60, cwd="/tmp")
    finally:
        for bound in binds.values():
            os.rmdir(bound)
    assert done.returncode == 0, done.stderr[-2000:]
    uid, status, (inside, shmmax, segments, refused), job_status, made = json.loads(done.stdout)
    assert (uid, status, inside, shmmax) == (65534, "ok", "65534", str(512 << 20))
    assert (segments, refused) == ("2", "True")  # two 256 MiB segments fit under 512 MiB, the third does not
    assert (job_status, made) == ("ok", "65534")
