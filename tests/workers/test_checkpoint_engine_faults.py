"""Weight syncs that fail fast (workers/checkpoint_engine.py): a bridge member that never joins, dies
mid-sync or stalls ends the sync within ``rollout.checkpoint_engine.timeout_s`` with a ``WeightSyncError``
that names it, instead of a hang.

Real gloo bridges between three processes (the trainer's sender and two rollout ranks); the fault
is injected in one of them with ``RLFOUNDRY_FAULT_INJECT`` (utils/faults.py). Each member writes
what it raised and when; the test reads those records.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = r"""
import json, os, sys, time
import multiprocessing as mp

def member(rank, port, out_dir, fault_rank, fault, timeout_s):
    if rank == fault_rank:
        os.environ["RLFOUNDRY_FAULT_INJECT"] = fault
    import torch
    torch.set_num_threads(1)
    from rlfoundry.workers.checkpoint_engine import CheckpointEngine
    record = {"rank": rank}
    start = time.monotonic()
    try:
        bridge = CheckpointEngine.connect("127.0.0.1", port, rank, 3, bucket_megabytes=0.01, timeout_s=timeout_s)
        record["joined_s"] = time.monotonic() - start
        start = time.monotonic()
        if rank == 0:
            bridge.send([(f"w{i}", torch.full((2048,), float(i))) for i in range(12)], version=7)
            bridge.send([(f"w{i}", torch.full((2048,), i + 0.5)) for i in range(12)], version=8)
        else:
            from rlfoundry.workers.weight_sync import tensor_digest
            record.update(tensors=[], versions=[], digests_match=[])
            for _ in range(2):
                sent = bridge.sent_digests  # taken before the stream starts, as the worker's verify does
                got = {name: tensor_digest(t) for name, t in bridge.receive()}
                record["tensors"].append(len(got))
                record["versions"].append(bridge.version)
                record["digests_match"].append(sent == got)
        record["ok"] = True
    except Exception as err:
        record.update(ok=False, error=f"{type(err).__name__}: {err}")
    record["elapsed_s"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)

if __name__ == "__main__":
    port, out_dir, fault_rank, fault, timeout_s, wait_for = sys.argv[1:]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=member, args=(r, int(port), out_dir, int(fault_rank), fault, float(timeout_s)))
             for r in range(3)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    waited = [int(r) for r in wait_for.split(",")]  # the members expected to finish (the faulty one may hang)
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out_dir, f"rank{r}.json")) for r in waited):
        mp.active_children()  # reaps a killed member, as a worker pool's parent does
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
"""


def _run(tmp_path: Path, fault_rank: int, fault: str, timeout_s: float, wait_for: str) -> dict[int, dict]:
    from rlfoundry.single_controller.base.worker import find_free_port
    from tests.trainer import _e2e as E

    script = tmp_path / "bridge_faults.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(find_free_port()), str(tmp_path), str(fault_rank), fault,
                           str(timeout_s), wait_for], capture_output=True, text=True, env=E.subprocess_env(),
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)
            if (tmp_path / f"rank{r}.json").exists()}


def test_clean_syncs_carry_the_param_version_and_the_senders_digests(tmp_path):
    records = _run(tmp_path, -1, "", 60, "0,1,2")
    assert all(r["ok"] for r in records.values()), records
    for rank in (1, 2):
        assert records[rank]["tensors"] == [12, 12] and records[rank]["versions"] == [7, 8]
        assert records[rank]["digests_match"] == [True, True]  # each sync's own digests, the second's too


def test_a_rollout_rank_that_never_joins_is_named_within_the_timeout(tmp_path):
    records = _run(tmp_path, 2, "checkpoint_engine.connect:hang", 3, "0,1")
    sender = records[0]
    assert not sender["ok"]
    assert "WeightSyncError: rollout rank 1 (bridge rank 2) did not join the weight bridge within 3 s" in sender["error"]
    assert sender["elapsed_s"] < 3 + 10  # the timeout, plus slack for a busy machine
    # the other rollout rank gives up too (naming rank 2, or the sender when it has already gone)
    assert records[1]["error"].startswith("WeightSyncError:") and "did not join the weight bridge" in records[1]["error"]


def test_a_rollout_rank_that_dies_mid_sync_is_named_by_the_sender(tmp_path):
    started = time.monotonic()
    records = _run(tmp_path, 2, "checkpoint_engine.receive_bucket@2:kill", 60, "0,1")
    sender = records[0]
    assert not sender["ok"] and 2 not in records
    assert "rollout rank 1 (bridge rank 2) died during the sync" in sender["error"], sender["error"]
    assert "has exited, last progress: sync 1: bucket 2" in sender["error"]
    assert sender["elapsed_s"] < 30 and time.monotonic() - started < 200  # well within the 60 s limit


def test_a_sender_that_dies_mid_sync_is_named_by_the_rollout_ranks(tmp_path):
    records = _run(tmp_path, 0, "checkpoint_engine.send_bucket@3:kill", 60, "1,2")
    for rank in (1, 2):
        assert not records[rank]["ok"]
        assert "the trainer's sender (trainer rank 0) died during the sync" in records[rank]["error"], records[rank]
        assert records[rank]["elapsed_s"] < 30


def test_a_sender_that_stalls_mid_sync_times_out_on_the_rollout_ranks(tmp_path):
    records = _run(tmp_path, 0, "checkpoint_engine.send_bucket@3:hang", 3, "1,2")
    for rank in (1, 2):
        error = records[rank]["error"]
        assert "weight sync 1 (receiving, after bucket 2) failed within rollout.checkpoint_engine.timeout_s=3" in error
        assert "the trainer's sender (trainer rank 0)" in error and "is running but stopped answering" in error
        assert 3 - 0.5 < records[rank]["elapsed_s"] < 3 + 10
