"""A run's memory cgroup is removed whatever happens to the run's processes: at once, by the next run
when its last processes were still exiting, or at start-up when the process that made it has ended."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlfoundry.sandbox.cgroup import RunCgroup, memory_cgroups, remove_stale


@pytest.fixture
def where():
    found = memory_cgroups()
    if found.parent is None:
        pytest.skip(f"no memory cgroup can be made here: {found.reason}")
    return found


def test_a_cgroup_whose_processes_outlive_the_run_is_removed_by_the_next_run(where):
    first = RunCgroup(where.version, where.parent, 64 << 20)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=first.joiner())
    try:
        first.close()  # a second of tries, the sleeper still in it: left for later
        assert os.path.isdir(first.path)
    finally:
        sleeper.kill()
        sleeper.wait()
    second = RunCgroup(where.version, where.parent, 64 << 20)
    second.close()
    assert not os.path.exists(first.path) and not os.path.exists(second.path)


def test_the_cgroups_of_a_process_that_ended_are_removed_and_a_busy_one_stays(where):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(where.parent, f"rlfoundry-sandbox-{int(ended.stdout)}-0")
    os.mkdir(stale)
    busy = RunCgroup(where.version, where.parent, 64 << 20)
    busy_as_stale = os.path.join(where.parent, f"rlfoundry-sandbox-{int(ended.stdout)}-1")
    os.rename(busy.path, busy_as_stale)  # as if its maker had ended with a process still inside
    busy.path = busy_as_stale
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=busy.joiner())
    try:
        remove_stale(where.parent)
        assert not os.path.exists(stale) and os.path.isdir(busy_as_stale)
    finally:
        sleeper.kill()
        sleeper.wait()
        remove_stale(where.parent)
    assert not os.path.exists(busy_as_stale)
