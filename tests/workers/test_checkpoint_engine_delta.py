"""Delta weight syncs (``checkpoint_engine.backend=delta_sharded``, workers/checkpoint_engine.py): after a
full seed, each sync sends only the positions whose bit patterns changed and their bits; the receivers
rebuild the full tensors bit for bit.

A real gloo bridge of three processes (the trainer's sender and two rollout ranks). The sender changes
hand-chosen positions between syncs (-0.0 for 0.0, one NaN payload for another, a NaN left alone) and
records what it sent; each receiver records what it rebuilt. The test compares them bit for bit and holds
the bytes on the wire to counts derived by hand below. A second bridge has an fp32 sender and bf16 engines:
the sender casts to bf16 first (``wire_dtype``), so the engines hold what their own cast gives.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfoundry.workers.checkpoint_engine import changed_positions, goes_dense, wire_dtype

_SCRIPT = r"""
import json, os, sys
import multiprocessing as mp

def nan(payload):
    import torch
    return torch.tensor([payload], dtype=torch.int32).view(torch.float32)[0]

def syncs():
    # the sender's tensors at each sync (a list of dicts), the hand-chosen changes between them
    import torch
    a = torch.linspace(-1, 1, 64).to(torch.bfloat16)
    b = torch.arange(64, dtype=torch.float32).view(8, 8) / 7
    b.view(-1)[0], b.view(-1)[5], b.view(-1)[9] = 0.0, nan(0x7FC00000), nan(0x7FC00002)
    c, d = torch.arange(8, dtype=torch.float32), torch.ones(16, dtype=torch.bfloat16)
    out = [{"a.bf16": a.clone(), "b.fp32": b.clone(), "c.fp32": c.clone(), "d.bf16": d.clone()}]
    a[[3, 17, 40]] += 0.5                                      # 3 of 64: indices
    b.view(-1)[0], b.view(-1)[5] = -0.0, nan(0x7FC00001)       # equal as floats, other bits; 9 stays NaN
    b.view(-1)[63] = 100.0                                     # 3 of 64: indices
    c[[0, 2, 4, 6, 7]] = -1.0                                  # 5 of 8: 5 x 8 >= 32 bytes, whole
    out.append({"a.bf16": a.clone(), "b.fp32": b.clone(), "c.fp32": c.clone(), "d.bf16": d.clone()})
    a[torch.arange(0, 63, 3)] = 2.0                            # 21 of 64 bf16: 21 x 6 = 126 < 128, indices
    b.view(-1)[0] = 0.0                                        # -0.0 back to 0.0
    c[[1, 3, 5]] = 9.0                                         # 3 of 8: 24 < 32, indices
    d[:6] = 3.0                                                # 6 of 16 bf16: 36 >= 32, whole
    out.append({"a.bf16": a.clone(), "b.fp32": b.clone(), "c.fp32": c.clone(), "d.bf16": d.clone()})
    # a new shape, a new name, a name gone
    out.append({"a.bf16": a.clone(), "b.fp32": b.clone().view(4, 16), "c.fp32": c.clone(),
                "e.fp32": torch.tensor([1.0, 2.0, 3.0])})
    return out

def member(rank, ports, out_dir):
    import torch
    torch.set_num_threads(1)
    from rlfoundry.workers.checkpoint_engine import CheckpointEngine
    from rlfoundry.workers.weight_sync import tensor_digest
    plan = syncs()
    plan = plan + [plan[-1], plan[-1]]  # a new bridge (a reconnect): sync 4's tensors twice
    record = []
    for bridge_no, port in enumerate(ports):
        bridge = CheckpointEngine.connect("127.0.0.1", port, rank, 3, bucket_megabytes=200 / 2**20, timeout_s=60,
                                          delta=True)
        for tensors in (plan[:4] if bridge_no == 0 else plan[4:]):
            if rank == 0:
                stats = bridge.send(list(tensors.items()), version=len(record))
                got = tensors
                record.append({"bytes": stats.bytes, "meta_bytes": stats.meta_bytes, "buckets": stats.buckets,
                               "tensors": stats.tensors, "elements": stats.elements, "changed": stats.changed,
                               "dense": stats.dense})
            else:
                sent = bridge.sent_digests
                got = dict(bridge.receive())
                record.append({"digests_match": sent == {k: tensor_digest(v) for k, v in got.items()},
                               "version": bridge.version})
            torch.save(got, os.path.join(out_dir, f"rank{rank}_sync{len(record)}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
"""


# each script's entry point: the sender and two rollout ranks, over the bridges at the ports in argv[1]
_MAIN = r"""
if __name__ == "__main__":
    ports = [int(p) for p in sys.argv[1].split(",")]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=member, args=(r, ports, sys.argv[2])) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    sys.exit(max(abs(p.exitcode or 0) for p in procs))
"""


def _run_bridges(tmp_path: Path, script: str, bridges: int = 2) -> None:
    """Run a three-member script (``script`` + ``_MAIN``) over ``bridges`` fresh ports; its records land in tmp_path."""
    from rlfoundry.single_controller.base.worker import find_free_port
    from tests.trainer import _e2e as E

    path = tmp_path / "bridge.py"
    path.write_text(script + _MAIN)
    ports = ",".join(str(find_free_port()) for _ in range(bridges))
    proc = subprocess.run([sys.executable, str(path), ports, str(tmp_path)], capture_output=True, text=True,
                          env=E.subprocess_env(), timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def test_the_bit_comparison_sees_signed_zeros_and_nan_payloads_and_the_dense_threshold():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int32)[2] += 1  # another NaN payload
    assert changed_positions(old, old.clone()).tolist() == []  # NaN equals itself bit for bit
    assert changed_positions(old, new).tolist() == [0, 2]
    bf = torch.zeros(16, dtype=torch.bfloat16)
    assert changed_positions(bf, -bf).tolist() == list(range(16))
    # bytes of indices (4 + itemsize per change) against the values (itemsize per element)
    assert not goes_dense(5, 16, 2) and goes_dense(6, 16, 2)  # bf16: 30 < 32, 36 >= 32
    assert not goes_dense(3, 8, 4) and goes_dense(4, 8, 4)  # fp32: half


@pytest.mark.slow
def test_delta_syncs_rebuild_the_senders_tensors_bit_for_bit_with_hand_counted_bytes(tmp_path):
    _run_bridges(tmp_path, _SCRIPT)
    sender = json.loads((tmp_path / "rank0.json").read_text())
    for rank in (1, 2):
        records = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [r["version"] for r in records] == [0, 1, 2, 3, 4, 5]
        assert all(r["digests_match"] for r in records)
        for sync in range(1, 7):
            want = torch.load(tmp_path / f"rank0_sync{sync}.pt")
            got = torch.load(tmp_path / f"rank{rank}_sync{sync}.pt")
            assert list(got) == list(want)
            for name in want:
                assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
                assert torch.equal(_bits(got[name]), _bits(want[name])), (rank, sync, name)
    # payload bytes by hand: a whole tensor is numel x itemsize; a delta is changes x (4 + itemsize)
    seed = 64 * 2 + 64 * 4 + 8 * 4 + 16 * 2  # 448
    sync2 = 3 * (4 + 2) + 3 * (4 + 4) + 8 * 4 + 0  # a: 3 bf16, b: 3 fp32 (signed zero, NaN payload, value), c whole
    sync3 = 21 * (4 + 2) + 1 * (4 + 4) + 3 * (4 + 4) + 16 * 2  # a: 21 bf16, b: -0.0 -> 0.0, c: 3, d whole
    sync4 = 0 + 64 * 4 + 0 + 3 * 4  # a, c unchanged; b reshaped and e new go whole; d gone
    reseed = 64 * 2 + 64 * 4 + 8 * 4 + 3 * 4  # a new bridge starts from full values
    assert [r["bytes"] for r in sender] == [seed, sync2, sync3, sync4, reseed, 0]
    assert [r["changed"] for r in sender] == [152, 3 + 3 + 5, 21 + 1 + 3 + 6, 64 + 3, 139, 0]
    assert [r["elements"] for r in sender] == [152, 152, 152, 139, 139, 139]
    assert [r["dense"] for r in sender] == [4, 1, 1, 2, 4, 0]
    for r in sender:  # headers (3 x int64 per bucket and the end) and at most 200 bytes of JSON per tensor
        headers = 24 * (r["buckets"] + 1)
        assert headers < r["meta_bytes"] <= headers + 200 * r["tensors"], r


_MISMATCH = r"""
import json, os, sys
import multiprocessing as mp

def member(rank, port, out_dir):
    import torch
    torch.set_num_threads(1)
    from rlfoundry.workers.checkpoint_engine import CheckpointEngine
    bridge = CheckpointEngine.connect("127.0.0.1", port, rank, 2, timeout_s=5, delta=rank == 0)  # rank 1 without deltas
    w = torch.zeros(64)
    try:
        for step in range(2):
            if rank == 0:
                bridge.send([("w", w)])
                w[3] = 1.0  # sync 2 carries one change: a delta
            else:
                for _ in bridge.receive():
                    pass
        record = {"ok": True}
    except Exception as err:
        record = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=member, args=(r, int(sys.argv[1]), sys.argv[2])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
"""


@pytest.mark.slow
def test_a_delta_the_receiver_holds_no_base_for_is_an_error_naming_the_tensor(tmp_path):
    from rlfoundry.single_controller.base.worker import find_free_port
    from tests.trainer import _e2e as E

    script = tmp_path / "bridge_mismatch.py"
    script.write_text(_MISMATCH)
    proc = subprocess.run([sys.executable, str(script), str(find_free_port()), str(tmp_path)], capture_output=True,
                          text=True, env=E.subprocess_env(), timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    receiver = json.loads((tmp_path / "rank1.json").read_text())
    assert not receiver["ok"]
    assert receiver["error"].startswith("WeightSyncError: rollout rank 0 (bridge rank 1): weight sync 2 sent 'w' as a "
                                        "delta against sync 1 (float32, [64]), but this end holds no copy and was "
                                        "not connected with deltas"), receiver["error"]


# ---- an fp32 trainer into a bf16 engine: the sender casts to the engine's dtype first --------------------

_NARROW = r"""
import json, os, sys
import multiprocessing as mp

def w_bits(low):
    # 64 fp32 values whose high 16 bits are bf16 values 1 + i/128 (odd i: an odd last mantissa bit) and whose
    # low 16 bits are ``low`` (position: bits): what a cast to bf16 rounds off, to nearest, ties to even
    import torch
    bits = (torch.arange(64, dtype=torch.int32) + 0x3F80) << 16
    for pos, value in low.items():
        bits[pos] |= value
    return bits.view(torch.float32)

def syncs():
    import torch
    v = torch.linspace(-2, 2, 32)
    k = torch.arange(8, dtype=torch.float32) / 3
    h = torch.linspace(0, 1, 16).to(torch.bfloat16)  # the trainer's bf16: never widened to the engines' fp32
    n = torch.arange(8, dtype=torch.float32)
    out = [{"w": w_bits({}), "v": v.clone(), "k": k.clone(), "h": h, "n": n.clone()}]
    # w: 7 fp32 changes, 2 in bf16: 0-2 (+0x0100) and 7 (0x7FFF) round down; 4 (even, a tie) rounds to
    # itself; 5 (odd, a tie) and 6 (0x8001) round up. k: one fp32 change below bf16's resolution
    k[0] = k[0].view(torch.int32).add(1).view(torch.float32)
    out.append({"w": w_bits({0: 0x100, 1: 0x100, 2: 0x100, 4: 0x8000, 5: 0x8000, 6: 0x8001, 7: 0x7FFF}),
                "v": v.clone(), "k": k.clone(), "h": h, "n": n.clone()})
    # w: 5 back down, 10 up by three bf16 steps (2 changes); v: every element (whole); n: one
    w = w_bits({6: 0x8001})
    w[10] = w[10].view(torch.int32).add(3 << 16).view(torch.float32)
    v -= 0.25
    n[3] = 30.0
    out.append({"w": w, "v": v.clone(), "k": k.clone(), "h": h, "n": n.clone()})
    return out

# what each rollout rank's engine stores: k is bf16 on rank 1, fp32 on rank 2 (so it travels fp32); n unsaid
ENGINE = {1: {"w": "bfloat16", "v": "bfloat16", "k": "bfloat16", "h": "float32"},
          2: {"w": "bfloat16", "v": "bfloat16", "k": "float32", "h": "float32"}}

def member(rank, ports, out_dir):
    import torch
    torch.set_num_threads(1)
    from rlfoundry.workers.checkpoint_engine import CheckpointEngine
    from rlfoundry.workers.weight_sync import DigestRecorder, compare_digests, weight_digests
    dtypes = {name: getattr(torch, d) for name, d in ENGINE.get(rank, {}).items()}
    record = []
    for delta, port in zip((True, False), ports):
        bridge = CheckpointEngine.connect("127.0.0.1", port, rank, 3, timeout_s=60, delta=delta,
                                          dtypes=dtypes if rank else None)
        engine = {}
        for tensors in syncs():
            if rank == 0:
                stats = bridge.send(list(tensors.items()), version=len(record))
                got, held = tensors, {}
                record.append({"bytes": stats.bytes, "changed": stats.changed, "elements": stats.elements,
                               "narrowed": stats.narrowed, "dense": stats.dense})
            else:  # the worker's path: the stream into the engine's tensors (copy_, as the HF engine loads)
                recorder, got = DigestRecorder(dtypes, sent=bridge.sent_digests), {}
                for name, tensor in recorder.wrap(bridge.receive()):
                    got[name] = tensor.clone()
                    engine.setdefault(name, torch.empty(tensor.shape, dtype=dtypes.get(name, tensor.dtype)))
                    engine[name].copy_(tensor)
                compare_digests(recorder.expected, weight_digests(engine.items()), where=f"rank {rank}",
                                version=bridge.version)  # raises on any difference
                record.append({"sent_digests_used": all(recorder.expected[n] == bridge.sent_digests[n] for n in got
                                                        if got[n].dtype == engine[n].dtype)})
                held = {name: t.clone() for name, t in engine.items()}
            torch.save({"got": got, "engine": held}, os.path.join(out_dir, f"rank{rank}_sync{len(record)}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
"""


def test_the_senders_cast_is_the_engines_own_on_load_and_only_ever_narrows():
    # the engines load with copy_ into their dtype (HF's sync_weights, vLLM's default loader): the sender's .to
    # must round the same, ties to even, subnormals, overflow to inf and NaN included
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x00018000, 0x7F7FFFFF, 0xFF7F8000 - 2**32,
                         0x7F800000, 0x7FC00001, -0.0], dtype=torch.float64).to(torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(4096)])
    for dtype in (torch.bfloat16, torch.float16):
        loaded = torch.empty(x.shape, dtype=dtype).copy_(x)
        assert torch.equal(_bits(loaded), _bits(x.to(dtype))), dtype
    assert _bits(x.to(torch.bfloat16))[:4].tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80]  # even tie down, odd up
    assert wire_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert wire_dtype(torch.float32, torch.float16) == torch.float16
    assert wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16  # a wider engine widens on its own
    assert wire_dtype(torch.bfloat16, torch.float16) == torch.bfloat16  # as wide: the engine's cast
    assert wire_dtype(torch.float32, None) == torch.float32  # unknown
    assert wire_dtype(torch.int64, torch.bfloat16) == torch.int64  # an integer buffer
    assert wire_dtype(torch.float32, torch.float8_e4m3fn) == torch.float32  # quantised: scales, not a cast


@pytest.mark.slow
def test_an_fp32_sender_sends_a_bf16_engine_bf16_bits_and_deltas_count_bf16_changes(tmp_path):
    _run_bridges(tmp_path, _NARROW)
    sent_as = {"w": torch.bfloat16, "v": torch.bfloat16, "k": torch.float32, "h": torch.bfloat16, "n": torch.float32}
    for rank in (1, 2):
        assert all(r["sent_digests_used"] for r in json.loads((tmp_path / f"rank{rank}.json").read_text()))
        for sync in range(1, 7):  # 1-3: the delta bridge, 4-6: the full one
            want = torch.load(tmp_path / f"rank0_sync{sync}.pt")["got"]
            got, engine = (torch.load(tmp_path / f"rank{rank}_sync{sync}.pt")[k] for k in ("got", "engine"))
            for name, tensor in want.items():
                assert got[name].dtype == sent_as[name], (rank, sync, name)
                assert torch.equal(_bits(got[name]), _bits(tensor.to(sent_as[name]))), (rank, sync, name)
                # what the engine holds: the trainer's tensor cast by the engine itself, bit for bit
                assert torch.equal(_bits(engine[name]), _bits(tensor.to(engine[name].dtype))), (rank, sync, name)
    sender = json.loads((tmp_path / "rank0.json").read_text())
    # by hand: w 64 and v 32 in bf16, k 8 in fp32 (the ranks disagree), h 16 bf16, n 8 fp32
    whole = 64 * 2 + 32 * 2 + 8 * 4 + 16 * 2 + 8 * 4  # 288 (the fp32 tensors in fp32: 480)
    sync2 = 2 * (4 + 2) + 1 * (4 + 4)  # w: 5 and 6 of its 7 fp32 changes; k: one fp32 change
    sync3 = 2 * (4 + 2) + 32 * 2 + 1 * (4 + 4)  # w: 5, 10; v whole (32 x 6 >= 64); n: one
    assert [r["bytes"] for r in sender] == [whole, sync2, sync3] + [whole] * 3
    assert [r["changed"] for r in sender] == [128, 2 + 1, 2 + 32 + 1] + [128] * 3
    assert [r["narrowed"] for r in sender] == [2] * 6  # w and v
    assert [r["dense"] for r in sender] == [5, 0, 1] + [5] * 3
