"""Weight transfer from the trainer's ranks to a separate rollout pool, in memory (verl's
``actor_rollout_ref.rollout.checkpoint_engine``): the foundation of disaggregated rollout.

The trainer and the rollout each run their own ``torch.distributed`` world; a bridge group joins the
trainer's sending rank (rank 0 of the bridge) to every rollout rank. It is a gloo process group of
its own (``ProcessGroupGloo`` over a ``TCPStore`` the sender hosts), so it needs no change to either
world and works between processes started separately (two process back ends, two Ray pools).

A sync streams the trainer's HF-named tensors (``engine.iter_hf_weights()``) in buckets of at most
``update_weights_bucket_megabytes``: each bucket is one broadcast of a header (sizes), one of its
metadata (names, dtypes, shapes, byte offsets; JSON — nothing is unpickled) and one of its bytes. A
tensor larger than a bucket travels alone. The receivers get the same stream back, tensor by tensor,
for the rollout engine's weight loader; no disk round trip, and at most one bucket in flight.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["CheckpointEngine", "SyncStats"]

_END, _BUCKET = 0, 1


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0


class CheckpointEngine:
    """One end of the bridge. ``connect`` on every member (same host/port/world size); then the
    sender calls ``send(named_tensors)`` while each receiver iterates ``receive()``."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, bucket_megabytes: float = 512):
        if bucket_megabytes <= 0:
            raise ValueError(f"update_weights_bucket_megabytes={bucket_megabytes} must be > 0")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.bucket_bytes = int(bucket_megabytes * 2**20)

    @classmethod
    def connect(cls, host: str, port: int, rank: int, world_size: int, bucket_megabytes: float = 512,
                timeout_s: float = 600.0, store: dist.Store | None = None) -> CheckpointEngine:
        """Rank 0 (the trainer's sender) hosts the store (``store``: one ``open_store`` opened
        already); ``world_size`` = 1 + rollout ranks. Blocks until every member has connected."""
        if store is None:
            store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0,
                                  timeout=timedelta(seconds=timeout_s))
        group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
        return cls(group, rank, world_size, bucket_megabytes)

    @staticmethod
    def open_store(host: str, timeout_s: float = 600.0) -> tuple[dist.TCPStore, int]:
        """The sender's store, listening now on a port of its own choosing (no free-port race)."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                              timeout=timedelta(seconds=timeout_s))
        return store, port

    # ---- the sender -----------------------------------------------------------------------

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        if self.rank != 0:
            raise RuntimeError("only the bridge's rank 0 (the trainer's sender) sends")
        stats, bucket, size = SyncStats(), [], 0
        for name, tensor in named_tensors:
            tensor = tensor.detach().to("cpu").contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                self._send_bucket(bucket, stats)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            self._send_bucket(bucket, stats)
        self._broadcast(torch.tensor([_END, 0, 0], dtype=torch.int64))
        return stats

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], stats: SyncStats) -> None:
        entries, chunks, offset = [], [], 0
        for name, tensor in bucket:
            raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
            entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                            "shape": list(tensor.shape), "offset": offset, "nbytes": raw.numel()})
            chunks.append(raw)
            offset += raw.numel()
        meta = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([_BUCKET, meta.numel(), offset], dtype=torch.int64))
        self._broadcast(meta)
        self._broadcast(torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8))
        stats.tensors += len(bucket)
        stats.bytes += offset
        stats.buckets += 1

    # ---- a receiver ------------------------------------------------------------------------

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The sender's tensors, in its order, as CPU tensors of its dtypes and shapes."""
        if self.rank == 0:
            raise RuntimeError("the bridge's rank 0 sends; receivers have rank >= 1")
        while True:
            header = self._broadcast(torch.zeros(3, dtype=torch.int64))
            kind, meta_bytes, data_bytes = (int(x) for x in header)
            if kind == _END:
                return
            meta = self._broadcast(torch.zeros(meta_bytes, dtype=torch.uint8))
            data = self._broadcast(torch.zeros(data_bytes, dtype=torch.uint8))
            for entry in json.loads(bytes(meta.numpy()).decode()):
                dtype = getattr(torch, entry["dtype"])
                raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
                yield entry["name"], raw.view(dtype).reshape(entry["shape"]).clone()

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel():
            self.group.broadcast([tensor], dist.BroadcastOptions()).wait()
        return tensor
