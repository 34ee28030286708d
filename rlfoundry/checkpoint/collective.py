"""How the ranks of one worker group write a checkpoint together: every rank takes part, rank 0
writes the shared files, and an error on rank 0 is raised on every rank (not left as a hang in the
next barrier). Without a process group (one process) each is the trivial case."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["barrier", "broadcast_error", "dist_on", "rank", "world_size"]


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist_on() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist_on() else 1


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist_on():
        dist.barrier(group=group)


def broadcast_error(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if rank 0 failed, instead of leaving the others stuck in a barrier."""
    if not dist_on():
        if error is not None:
            raise error
        return
    msg = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(msg, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if error is not None:
        raise error
    if msg[0] is not None:
        raise RuntimeError(f"rank 0 failed while writing the checkpoint: {msg[0]}")
