"""glibc malloc settings: freed activation-sized blocks stay in the process instead of faulting back in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlfoundry.cpu import malloc

glibc = pytest.mark.skipif(malloc._glibc() is None, reason="needs glibc (Linux)")

_PROBE = textwrap.dedent("""
    import ctypes, resource, sys, torch
    from rlfoundry.cpu.malloc import tune_malloc
    tuned = tune_malloc() if sys.argv[1] == "1" else False
    libc = ctypes.CDLL(None)
    libc.sbrk.restype = ctypes.c_void_p
    block = torch.empty(4 << 20)  # 16 MB: an activation of a mid-sized model
    on_heap = block.data_ptr() < libc.sbrk(0)  # below the program break, not a separate mapping
    end = block.data_ptr() + block.nbytes
    del block
    kept = libc.sbrk(0) >= end  # the freed block's pages stay in the process
    x = torch.ones(1 << 20)
    def step():  # what a training step does: fresh activation-sized buffers, filled, then freed
        a = x * 2
        b = a + 1
        c = b * a
        del a, b, c
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(200):
        step()
    print(tuned, on_heap, kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _probe(tune: str) -> tuple[bool, bool, bool, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, tune], capture_output=True, text=True, check=True)
    tuned, on_heap, kept, faults = out.stdout.split()
    return tuned == "True", on_heap == "True", kept == "True", int(faults)


@glibc
def test_tuned_process_keeps_freed_blocks_instead_of_faulting_them_back():
    tuned, on_heap, kept, faults = _probe("1")
    assert tuned and on_heap and kept
    # 600 fresh 4 MB blocks (1024 pages each): after the first steps they reuse the heap's pages
    assert faults < 10 * 1024
    # glibc's defaults: a fresh 16 MB block is a mapping of its own, unmapped when freed
    assert _probe("0")[:3] == (False, False, False)


@glibc
def test_workers_apply_it_from_their_runtime():
    code = textwrap.dedent("""
        import sys
        from rlfoundry.single_controller.base.worker import Worker, WorkerRuntime
        from rlfoundry.cpu import malloc
        Worker(WorkerRuntime(device="cpu", tune_malloc=sys.argv[1] == "1"))
        print(malloc._done)
    """)
    for value, expected in (("1", "True"), ("0", "False")):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        out = subprocess.run([sys.executable, "-c", code, value], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split()[-1] == expected


def test_trainer_hands_its_setting_to_the_workers():
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import _runtime

    assert _runtime(load_config()).tune_malloc is True  # on by default
    assert _runtime(load_config(["trainer.tune_malloc=false"])).tune_malloc is False
