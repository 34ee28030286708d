"""ScoringPool: hung workers are killed and replaced; a worker that died while idle is replaced too.
LazyScoringPool: started on first use, dropped when broken, closed."""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

import pytest

from rlfoundry.rewards.custom import FileRewardFunction
from rlfoundry.rewards.pool import LazyScoringPool, RewardPoolError, ScoringPool

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


CRASHER = '''
import os
def compute_score(solution_str, **kwargs):
    if solution_str == "exit":
        os._exit(3)
    return {"score": 1.0, "pid": os.getpid()}
'''


def test_lazy_pool_starts_on_first_use_and_a_copy_starts_its_own(scorer: FileRewardFunction) -> None:
    with LazyScoringPool(scorer, num_workers=1, timeout_s=5) as owner:
        assert owner.running is None  # nothing started until a batch needs it
        (out,) = owner.map([{"solution_str": "ok"}])
        assert out.value["score"] == 1.0 and owner.running is not None
        assert pickle.loads(pickle.dumps(owner)).running is None
    assert owner.running is None  # leaving the block closed it


def test_a_pool_that_broke_is_dropped_and_the_next_batch_gets_a_fresh_one(tmp_path: Path) -> None:
    """A sample kills its worker and the replacement cannot load the (since broken) scorer: the map
    raises, the owner drops the pool, and once the file is fixed the next map starts a new one."""
    path = tmp_path / "crasher.py"
    path.write_text(CRASHER)
    owner = LazyScoringPool(FileRewardFunction(path), num_workers=1, timeout_s=5)
    first_pid = owner.map([{"solution_str": "ok"}])[0].value["pid"]
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardPoolError, match="could not load the scorer"):
        owner.map([{"solution_str": "exit"}])
    assert owner.running is None
    path.write_text(CRASHER)
    (out,) = owner.map([{"solution_str": "ok"}])
    assert out.error is None and out.value["pid"] != first_pid
    owner.close()


def test_an_unpicklable_scorer_is_scored_in_the_driver(caplog) -> None:
    owner = LazyScoringPool(lambda solution_str: len(solution_str), num_workers=2, timeout_s=5)
    assert [o.value for o in owner.map([{"solution_str": "abc"}, {"solution_str": ""}])] == [3, 0]
    owner.map([{"solution_str": "x"}])
    assert owner.running is None and caplog.text.count("cannot be pickled") == 1  # warned once
