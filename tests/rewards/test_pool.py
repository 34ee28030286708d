"""ScoringPool: hung workers are killed and replaced; a worker that died while idle is replaced too."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rlfoundry.rewards.custom import FileRewardFunction
from rlfoundry.rewards.pool import RewardPoolError, ScoringPool

SCORER = '''
import os, time
def compute_score(solution_str, **kwargs):
    if solution_str == "hang":
        time.sleep(600)
    return {"score": 1.0, "pid": os.getpid()}
'''


@pytest.fixture()
def scorer(tmp_path: Path) -> FileRewardFunction:
    path = tmp_path / "scorer.py"
    path.write_text(SCORER)
    return FileRewardFunction(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hung_worker_is_killed_and_replaced(scorer: FileRewardFunction) -> None:
    with ScoringPool(scorer, num_workers=1, timeout_s=0.5) as pool:
        first_pid = pool.map([{"solution_str": "ok"}])[0].value["pid"]
        hung, after = pool.map([{"solution_str": "hang"}, {"solution_str": "ok"}])
        assert hung.error == "timeout" and "0.5 s timeout" in hung.detail
        assert not _alive(first_pid)  # the hung process is gone, not left sleeping
        assert after.error is None and after.value["pid"] != first_pid  # served by the replacement
        assert pool.restarts == 1


def test_worker_killed_while_idle_is_replaced_transparently(scorer: FileRewardFunction) -> None:
    with ScoringPool(scorer, num_workers=1, timeout_s=5) as pool:
        victim = pool.workers[0].process
        os.kill(victim.pid, signal.SIGKILL)  # e.g. the OOM killer, between two batches
        victim.join()
        (out,) = pool.map([{"solution_str": "ok"}])
        assert out.error is None and out.value["pid"] != victim.pid


def test_scorer_that_cannot_load_in_a_worker_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardPoolError, match="could not load the scorer.*num_workers=0"):
        ScoringPool(FileRewardFunction(tmp_path / "broken.py"), num_workers=1, timeout_s=1)
