"""tests/rank_server.py, which the multi-rank engine tests start their ranks with: each rank is a new
process with the caller's environment of the moment, and a rank that fails ends the call with the
others killed (they would wait for it in a collective for ever), as torch.multiprocessing.spawn does."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests import rank_server


def _report(rank: int, out: str) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "env": os.environ.get("RLF_RANK_SERVER_T")}))


def _fail_or_wait(rank: int) -> None:
    if rank == 0:
        raise RuntimeError("rank 0 fails on purpose")
    time.sleep(600)  # a rank waiting for the failed one (pytest's timeout would end the test, not the call)


def test_ranks_are_new_processes_with_the_callers_environment(tmp_path, monkeypatch):
    rank_server.run(_report, args=(str(tmp_path),), nprocs=2)  # the server may have started before this test
    monkeypatch.setenv("RLF_RANK_SERVER_T", "set after the server started")
    rank_server.run(_report, args=(str(tmp_path),), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["env"] for r in ranks] == ["set after the server started"] * 2
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3


def test_a_failed_rank_fails_the_call_and_the_others_are_killed():
    with pytest.raises(AssertionError, match=rf"exited with codes \[1, -{int(signal.SIGKILL)}\]"):
        rank_server.run(_fail_or_wait, nprocs=2)
