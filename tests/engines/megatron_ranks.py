"""Run a function on N CPU processes joined by gloo, megatron-core's parallel state set up in each.

``run_ranks(fn, world, tmp_path, tp=, pp=, vpp=, args=, cp=, ep=, etp=)``: ``fn(rank, *args)`` runs on every rank
after ``initialize_parallel``; each rank's return value is saved with ``torch.save`` and the list of
them (by rank) is returned. A rank that raises fails the call with its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import rank_server


def _rank_main(rank: int, world: int, store: str, out_dir: str, fn: Callable, tp: int, pp: int,
               vpp: int | None, args: tuple, cp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        from rlfoundry.engines.megatron.bridge import initialize_parallel

        initialize_parallel(tp, pp, vpp, cp=cp, seed=1, ep=ep, etp=etp)
        result = fn(rank, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    # dist-checkpointing starts a multiprocessing manager per process; os._exit would orphan it
    for child in mp.active_children():
        child.terminate()
    # skip the interpreter's teardown: gloo's threads destroyed there can abort the process
    os._exit(0)


def run_ranks(fn: Callable, world: int, tmp_path: Path, tp: int = 1, pp: int = 1, vpp: int | None = None,
              args: tuple = (), cp: int = 1, ep: int = 1, etp: int | None = None) -> list[Any]:
    out = Path(tmp_path) / f"ranks-{tp}-{pp}-{vpp}-{cp}-{ep}-{etp}-{fn.__name__}"
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / "store", *out.glob("rank*")]:  # a file store is single-use
        stale.unlink(missing_ok=True)
    # forks of a warm process (tests/rank_server.py): a fresh interpreter per rank would import megatron-core again
    codes = rank_server.spawn(_rank_main, args=(world, str(out / "store"), str(out), fn, tp, pp, vpp, args, cp, ep, etp),
                              nprocs=world)
    if any(codes):
        errors = "\n".join(p.read_text() for p in sorted(out.glob("*.err")))
        raise AssertionError(f"a rank failed (exit codes {codes}):\n{errors}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
