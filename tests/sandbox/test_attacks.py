"""Hostile programs against the sandbox, through each of the three ways untrusted code runs
(``run_python``, the ``code_interpreter`` tool, the code reward).

Each attack runs in a caller process (``_caller.py``) beside a decoy sibling process and a sentinel
directory holding a secret. After every run the test checks the world: the caller answered and is
alive, not stopped, with its limits, priority and CPU set unchanged; the decoy likewise; the sentinel
directory unchanged; no process carries the attack's marker; the TCP and abstract-socket listeners
got no connection; the host's objects a root caller's sandbox must not reach are unchanged (a
sysctl's value, the /dev nodes' modes, owners and times, free disk); and the program did not report
success. With kernel isolation nothing may get
through; the unisolated mode's escapes must be exactly the documented list.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlfoundry.sandbox import ALLOW_UNISOLATED_ENV, ISOLATION_ENV
from rlfoundry.sandbox.namespace import isolation
from tests.sandbox.attacks import ATTACKS, NAMESPACED_ONLY, ROOT_CALLER_ONLY, UNISOLATED_ESCAPES

# alone (scripts/test.sh's serial pass): each attack diffs the host's files, processes and sockets before and
# after, and another test's files and processes would read as the attack's
pytestmark = pytest.mark.serial

CALLER = Path(__file__).with_name("_caller.py")
ENTRIES = ("run_python", "tool", "reward")
needs_namespaces = pytest.mark.skipif(not isolation().available, reason=f"no kernel isolation: {isolation().reason}")


def _proc_state(pid: int) -> dict | None:
    """What an attack could change about a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        limits = Path(f"/proc/{pid}/limits").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return None
        return {"stopped": state in "Tt", "limits": limits, "nice": os.getpriority(os.PRIO_PROCESS, pid),
                "cpus": sorted(os.sched_getaffinity(pid))}
    except (FileNotFoundError, ProcessLookupError):
        return None


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() and not p.is_symlink() else p.is_symlink())
            for p in sorted(path.rglob("*"))}


SYSCTL = Path("/proc/sys/kernel/printk_ratelimit")  # the one the sysctl_write attack changes
DEV_NODES = ("null", "zero", "urandom", "full")
DISK_SLACK = 256 << 20  # other processes write to this disk too; the fallocate attack asks for 768 MiB


def host_state() -> dict:
    """The host objects an attack on a root caller's sandbox aims at: a sysctl, the /dev nodes (mode,
    owner, mtime), and the free space of the disk holding the sandbox's temporary files."""
    nodes = {n: (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns) for n in DEV_NODES
             for st in [os.stat(f"/dev/{n}")]}
    disk = os.statvfs(tempfile.gettempdir())
    return {"sysctl": SYSCTL.read_text(), "dev": nodes, "free": disk.f_bavail * disk.f_frsize}


def host_harms(before: dict, after: dict) -> list[str]:
    harms = [f"host {what} changed" for what in ("sysctl", "dev") if before[what] != after[what]]
    return harms + ["host disk allocated"] * (before["free"] - after["free"] > DISK_SLACK)


def _marked_processes(marker: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                continue
    return found


class World:
    """The caller, the decoy, the sentinel and the listeners for one run of the suite."""

    def __init__(self, tmp: Path, isolation_env: str):
        self.secret = "s3cr3t-" + secrets.token_hex(8)
        self.sentinel = tmp / "sentinel"
        self.sentinel.mkdir()
        (self.sentinel / "secret.txt").write_text(self.secret)
        self.env = {**os.environ, "RLF_ATTACK_SECRET": self.secret}
        self.env[ISOLATION_ENV] = isolation_env
        self.env.pop(ALLOW_UNISOLATED_ENV, None)
        if isolation_env == "none":
            self.env[ALLOW_UNISOLATED_ENV] = "1"
        self.decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.tcp.setblocking(False)
        self.abstract_name = "rlf-attack-" + secrets.token_hex(6)
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind("\0" + self.abstract_name)
        self.unix.listen()
        self.unix.setblocking(False)
        self.caller = None
        self._start_caller()

    def _start_caller(self) -> None:
        root = Path(__file__).resolve().parents[2]
        self.caller = subprocess.Popen([sys.executable, str(CALLER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=self.env, cwd=root, text=True)

    def fill(self, code: str, marker: str) -> str:
        for token, value in (("SECRET_PATH", str(self.sentinel / "secret.txt")), ("SENTINEL", str(self.sentinel)),
                             ("SECRET", self.secret), ("PARENT_PID", str(self.caller.pid)),
                             ("DECOY_PID", str(self.decoy.pid)), ("MARKER", marker),
                             ("PORT", str(self.tcp.getsockname()[1])), ("ABSTRACT", self.abstract_name)):
            code = code.replace(token, value)
        return code

    def attack(self, entry: str, code: str) -> list[str]:
        """Run one attack; return the harms it did (empty: contained)."""
        marker = "rlf-marker-" + secrets.token_hex(6)
        before = (_proc_state(self.caller.pid), _proc_state(self.decoy.pid), _tree(self.sentinel))
        self.host_before = host_state()
        self.caller.stdin.write(json.dumps({"entry": entry, "code": self.fill(code, marker)}) + "\n")
        self.caller.stdin.flush()
        harms = self._answer_harms()
        after = (_proc_state(self.caller.pid), _proc_state(self.decoy.pid), _tree(self.sentinel))
        harms += [what for what, b, a in zip(("caller changed", "decoy changed", "sentinel changed"), before, after)
                  if a != b]
        harms += ["a process outlived the call"] * bool(_marked_processes(marker))
        harms += [f"{name} listener was reached" for name, s in (("tcp", self.tcp), ("unix", self.unix))
                  if self._accepted(s)]
        return harms + host_harms(self.host_before, host_state())

    def _answer_harms(self) -> list[str]:
        ready, _, _ = select.select([self.caller.stdout], [], [], 15)  # limits are 3 s
        line = self.caller.stdout.readline() if ready else ""
        if not line:
            return ["the caller died or hung"]
        answer = json.loads(line)
        if "raised" in answer:
            return [f"the entry point raised {answer['raised']}"]
        return ["the program reported success"] if answer["escaped"] else []

    @staticmethod
    def _accepted(s: socket.socket) -> bool:
        try:
            conn, _ = s.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True

    def repair(self) -> None:
        """After a harmful attack: a fresh caller, decoy and sentinel for the next one."""
        for p in (self.caller, self.decoy):
            p.kill()
            p.wait()
        for pid in _marked_processes("rlf-marker-"):
            os.kill(pid, 9)
        self.decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        for p in self.sentinel.iterdir():
            p.unlink()
        if SYSCTL.read_text() != self.host_before["sysctl"]:  # as it was (only an attack by root changes it)
            SYSCTL.write_text(self.host_before["sysctl"])
        for name, (_, _, _, mtime) in self.host_before["dev"].items():
            if os.stat(f"/dev/{name}").st_mtime_ns != mtime:
                os.utime(f"/dev/{name}", ns=(mtime, mtime))
        (self.sentinel / "secret.txt").write_text(self.secret)
        self._start_caller()

    def close(self) -> None:
        for p in (self.caller, self.decoy):
            p.kill()
            p.wait()
        self.tcp.close()
        self.unix.close()


def _backend_available(backend: str) -> bool:
    os.environ[ISOLATION_ENV], saved = backend, os.environ.get(ISOLATION_ENV)
    try:
        return isolation().available
    finally:
        os.environ.pop(ISOLATION_ENV) if saved is None else os.environ.__setitem__(ISOLATION_ENV, saved)


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def namespaced_world(request, tmp_path_factory):
    """Both backends: bubblewrap, and the project's own namespaces where bubblewrap is missing."""
    if not _backend_available(request.param):
        pytest.skip(f"the {request.param} backend does not work here")
    world = World(tmp_path_factory.mktemp("attacks"), isolation_env=request.param)
    yield world
    world.close()


@needs_namespaces
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", sorted({**ATTACKS, **NAMESPACED_ONLY}))
def test_no_attack_gets_out_of_the_namespaced_sandbox(namespaced_world, entry, name):
    if name in ROOT_CALLER_ONLY and os.geteuid() != 0:
        pytest.skip(ROOT_CALLER_ONLY[name])
    harms = namespaced_world.attack(entry, {**ATTACKS, **NAMESPACED_ONLY}[name])
    if harms:
        namespaced_world.repair()
    assert harms == []


def test_the_unisolated_mode_stops_exactly_what_the_docs_say(tmp_path):
    """Documented, not hidden: which attack classes the audit-hook policy lets through."""
    world = World(tmp_path, isolation_env="none")
    escaped = set()
    try:
        for name, code in ATTACKS.items():
            harms = world.attack("run_python", code)
            if harms:
                escaped.add(name)
                world.repair()
    finally:
        world.close()
    assert escaped == set(UNISOLATED_ESCAPES)
