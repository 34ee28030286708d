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

**Failing fast** (``rollout.checkpoint_engine.timeout_s``; null: ``trainer.dist_timeout_s``): every
member announces itself in the store (host, pid) and ``connect`` waits for all of them at most that
long, then names the ranks that never joined; every broadcast of a sync is bounded by the same limit.
Receivers record their progress (sync, bucket) in the store, so when a sync fails the sender says which
rollout rank died (its pid is gone) or fell behind, and a receiver says the trainer's sender stopped.
Either way a ``WeightSyncError`` ends the run instead of a hang.

**In the engine's dtype**: at ``connect`` each rollout rank announces the dtype its engine stores each
tensor in (``BaseRollout.storage_dtypes``). A tensor the trainer holds in a wider floating dtype (an fp32
actor, a bf16 engine) is cast to it on the trainer's device before anything else (``wire_dtype``), as the
engine's loader would cast it on arrival (``copy_``: the same round-to-nearest-even), so the engine holds
the same bits, and the wire, the digest and (deltas) both ends' copies are in the engine's dtype. A tensor
the ranks disagree on, or that a rank cannot say, travels in the trainer's dtype.

**Proving itself**: each tensor's metadata carries its digest (``weight_sync.tensor_digest``, taken on
the sender's device before the copy to the host, of the tensor as sent) and the end of the stream the
trainer's ``param_version``; the receiving worker compares the engine's weights with them after loading.

**Deltas** (``backend=delta_sharded``, verl's name; ``delta=True`` here): RL updates at small learning
rates leave most bf16 weights bit-identical from one sync to the next (an fp32 actor's too, sent to a bf16
engine in bf16: a change below bf16's resolution changes no bit sent), so after a first full ("seed")
sync the sender sends, per tensor, only the positions whose bit patterns changed (int32) and their new
bits. Both ends keep a host copy of every tensor as of the last sync, in the dtype sent: the sender to
diff against, the receiver to rebuild the full tensor it yields (the rollout engines' loaders take full
tensors), so the digests above prove each reconstruction bit for bit (where the engine stores the dtype
sent: all but a wider engine's, e.g. a bf16 actor into an fp32 copy). A tensor with no base on both ends
(the first sync of a bridge, a new name, a new shape or dtype) and one where indices would cost as many
bytes as its values (``goes_dense``) travel whole.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rlfoundry.utils import faults
from rlfoundry.utils.errors import WeightSyncError
from rlfoundry.workers.weight_sync import tensor_digest

__all__ = ["CheckpointEngine", "SyncStats", "changed_positions", "goes_dense", "member_name", "wire_dtype"]

_END, _BUCKET = 0, 1
_HEADER_BYTES = 3 * 8  # each broadcast header: three int64
_MAX_INDEX = 2**31 - 1  # positions travel as int32; a larger tensor always travels whole
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# what an engine's loader reaches by a plain cast (``copy_``); a quantised dtype needs scales, never a cast here
_CAST_TO = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class SyncStats:
    """One sync as the sender saw it. ``bytes``: tensor payload (values; with deltas, positions too);
    ``meta_bytes``: headers and JSON metadata; ``changed``: elements whose bits (in the dtype sent) differ
    from the previous sync's (every element of a tensor sent without a base), out of ``elements``;
    ``narrowed``: tensors sent in the engine's narrower dtype (``wire_dtype``)."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    meta_bytes: int = 0
    elements: int = 0
    changed: int = 0
    dense: int = 0  # tensors sent whole
    narrowed: int = 0

    @property
    def wire_bytes(self) -> int:
        return self.bytes + self.meta_bytes

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The flat bit patterns of a contiguous tensor as integers (rows of bytes for 16-byte dtypes), so
    that a comparison sees -0.0 vs 0.0 and one NaN payload vs another, which ``==`` on floats does not."""
    flat = tensor.reshape(-1)
    size = tensor.element_size()
    if size in _INT_OF_SIZE:
        return flat.view(_INT_OF_SIZE[size])
    return flat.view(torch.uint8).view(-1, size)


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) where ``new``'s bit patterns differ from ``old``'s (same shape, dtype)."""
    differ = _bits(old) != _bits(new)
    if differ.dim() == 2:
        differ = differ.any(dim=1)
    return differ.nonzero().view(-1)


def goes_dense(changed: int, numel: int, itemsize: int) -> bool:
    """Whether a tensor with ``changed`` of ``numel`` elements changed travels whole: when its int32
    positions and values would be at least its values (a half of fp32, a third of bf16). Past that point
    indices only cost bytes, and the receiver's copy is cheaper than a scatter."""
    return changed * (4 + itemsize) >= numel * itemsize


def wire_dtype(dtype: torch.dtype, stored: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in to an engine that stores it in ``stored`` (None: unknown):
    ``stored`` where that is a narrower float (fp32 -> bf16: the engine's loader would cast it so on
    arrival, and half the bytes go), else ``dtype`` (a wider engine widens exactly on its own)."""
    if stored not in _CAST_TO or not dtype.is_floating_point or stored.itemsize >= dtype.itemsize:
        return dtype
    return stored


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)


def member_name(rank: int) -> str:
    """How a message names bridge rank ``rank``: rank 0 is the trainer's sender, rank r the rollout's rank r − 1."""
    return "the trainer's sender (trainer rank 0)" if rank == 0 else f"rollout rank {rank - 1} (bridge rank {rank})"


def _alive(info: dict) -> bool | None:
    """Whether a member's process still exists; None when it runs on another host (unknown)."""
    if info.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # killed but not yet reaped by its parent (a zombie) is dead too
        with open(f"/proc/{int(info['pid'])}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class CheckpointEngine:
    """One end of the bridge. ``connect`` on every member (same host/port/world size); then the
    sender calls ``send(named_tensors, version)`` while each receiver iterates ``receive()``."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, bucket_megabytes: float = 512,
                 store: dist.Store | None = None, timeout_s: float = 600.0, digests: bool = True,
                 delta: bool = False, stored_dtypes: dict[str, torch.dtype] | None = None):
        if bucket_megabytes <= 0:
            raise ValueError(f"update_weights_bucket_megabytes={bucket_megabytes} must be > 0")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.bucket_bytes = int(bucket_megabytes * 2**20)
        self.store, self.timeout_s, self.digests = store, float(timeout_s), digests
        self.syncs = 0  # syncs started by this member
        self.sent_digests: dict[str, int] = {}  # a receiver: the sender's digest of each tensor of this sync
        self.version: int | None = None  # a receiver: the param_version the last complete sync carried
        self.delta = delta
        # the sender: {name: the dtype every rollout engine stores it in}, the casts of ``wire_dtype``
        self.stored_dtypes = dict(stored_dtypes or {})
        # deltas: each tensor as of the last sync it travelled in, and that sync's number (the sender's
        # snapshot it diffs against; a receiver's copy it rebuilds from). Both ends count syncs alike.
        self._held: dict[str, tuple[torch.Tensor, int]] = {}
        self._bucket = 0

    @classmethod
    def connect(cls, host: str, port: int, rank: int, world_size: int, bucket_megabytes: float = 512,
                timeout_s: float = 600.0, store: dist.Store | None = None, digests: bool = True,
                delta: bool = False, dtypes: dict[str, torch.dtype] | None = None) -> CheckpointEngine:
        """Rank 0 (the trainer's sender) hosts the store (``store``: one ``open_store`` opened
        already); ``world_size`` = 1 + rollout ranks. A rollout rank's ``dtypes``: {name: the dtype its
        engine stores it in} (None: unknown), which the sender casts to (``wire_dtype``). Waits at most
        ``timeout_s`` for every member, then raises ``WeightSyncError`` naming those that never joined."""
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            try:
                store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout,
                                      wait_for_workers=False)
            except (RuntimeError, dist.DistError) as err:
                raise WeightSyncError(
                    f"{member_name(rank)} could not reach the weight bridge's store at {host}:{port} within "
                    f"{timeout_s:g} s (rollout.checkpoint_engine.timeout_s): the trainer's sender is not "
                    f"listening there ({err})") from err
        faults.inject("checkpoint_engine.connect")  # tests: a member that never joins (hang) or dies (kill)
        bridge = dist.PrefixStore("bridge/", store)
        if rank != 0:  # before the announcement: a member the roll call found has said its dtypes
            names = {name: str(dtype).removeprefix("torch.") for name, dtype in (dtypes or {}).items()}
            bridge.set(f"dtypes/{rank}", json.dumps(names if dtypes is not None else None))
        bridge.set(f"member/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        _roll_call(bridge, rank, world_size, timeout_s)
        stored = _agreed_dtypes(bridge, world_size) if rank == 0 else None
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
        except (RuntimeError, dist.DistError) as err:
            raise WeightSyncError(f"{member_name(rank)}: the weight bridge's gloo group did not form within "
                                  f"{timeout_s:g} s: {err}") from err
        return cls(group, rank, world_size, bucket_megabytes, bridge, timeout_s, digests, delta, stored)

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

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> SyncStats:
        """Stream the tensors (each in its ``wire_dtype``); the receivers learn ``version`` (the trainer's
        param_version) at the end."""
        if self.rank != 0:
            raise RuntimeError("only the bridge's rank 0 (the trainer's sender) sends")
        self.syncs += 1
        self._bucket = 0
        try:
            return self._send(named_tensors, int(version))
        except BaseException as err:
            self._held.clear()  # half a sync's snapshots: the next sync (if any) starts from full values
            if isinstance(err, (RuntimeError, dist.DistError)):
                raise self._failure("sending", err) from err
            raise

    def reset(self) -> None:
        """Forget the last sync's tensors: the next sync sends full values (both ends must reset together;
        a new bridge starts so)."""
        self._held.clear()

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        stats, bucket, size, seen = SyncStats(), [], 0, set()
        for name, tensor in named_tensors:
            # the engine's dtype, cast on the trainer's device (a no-op when it is the tensor's own)
            sent = tensor.detach().to(wire_dtype(tensor.dtype, self.stored_dtypes.get(name)))
            digest = tensor_digest(sent) if self.digests else None  # on the trainer's device, before the copy
            host = sent.to("cpu").contiguous()
            stats.narrowed += sent.dtype != tensor.dtype
            entry = {"name": name, "dtype": str(host.dtype).removeprefix("torch."), "shape": list(host.shape),
                     "digest": digest}
            chunks = self._encode(entry, host, tensor, stats) if self.delta else [_raw(host)]
            stats.elements += host.numel()
            if not self.delta:
                stats.changed, stats.dense = stats.changed + host.numel(), stats.dense + 1
            seen.add(name)
            nbytes = sum(c.numel() for c in chunks)
            if bucket and size + nbytes > self.bucket_bytes:
                self._send_bucket(bucket, stats)
                bucket, size = [], 0
            bucket.append((entry, chunks))
            size += nbytes
        if bucket:
            self._send_bucket(bucket, stats)
        self._held = {name: held for name, held in self._held.items() if name in seen}
        self._broadcast(torch.tensor([_END, version, 0], dtype=torch.int64))
        stats.meta_bytes += _HEADER_BYTES
        return stats

    def _encode(self, entry: dict, host: torch.Tensor, source: torch.Tensor, stats: SyncStats) -> list[torch.Tensor]:
        """A tensor's chunks on the wire with deltas: its changed positions (int32) and their bits against
        the snapshot of the last sync, or its values when it has no snapshot or most of it changed. Updates
        the snapshot and ``entry`` (``enc``, ``count``, ``base``)."""
        name, numel = entry["name"], host.numel()
        held = self._held.get(name)
        if held is None or held[0].shape != host.shape or held[0].dtype != host.dtype or numel > _MAX_INDEX:
            shares = host.numel() and host.data_ptr() == source.data_ptr()  # a CPU tensor is the trainer's own
            self._held[name] = (host.clone() if shares else host, self.syncs)
            stats.changed += numel
            stats.dense += 1
            return [_raw(host)]
        snapshot, base = held
        positions = changed_positions(snapshot, host)
        stats.changed += positions.numel()
        self._held[name] = (snapshot, self.syncs)
        if goes_dense(positions.numel(), numel, host.element_size()):
            snapshot.copy_(host)
            stats.dense += 1
            return [_raw(host)]
        values = _bits(host)[positions]
        _bits(snapshot)[positions] = values
        entry.update(enc="indices", count=positions.numel(), base=base)
        return [_raw(positions.to(torch.int32)), _raw(values)]

    def _send_bucket(self, bucket: list[tuple[dict, list[torch.Tensor]]], stats: SyncStats) -> None:
        entries, chunks, offset = [], [], 0
        for entry, pieces in bucket:
            nbytes = sum(c.numel() for c in pieces)
            entries.append({**entry, "offset": offset, "nbytes": nbytes})
            chunks += pieces
            offset += nbytes
        meta = torch.frombuffer(bytearray(json.dumps(entries, separators=(",", ":")).encode()), dtype=torch.uint8)
        faults.inject("checkpoint_engine.send_bucket")  # tests: the sender dies or stalls mid-sync
        self._bucket += 1
        self._broadcast(torch.tensor([_BUCKET, meta.numel(), offset], dtype=torch.int64))
        self._broadcast(meta)
        self._broadcast(torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8))
        stats.tensors += len(bucket)
        stats.bytes += offset
        stats.meta_bytes += _HEADER_BYTES + meta.numel()
        stats.buckets += 1

    # ---- a receiver ------------------------------------------------------------------------

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The sender's tensors, in its order, as CPU tensors of its dtypes and shapes; afterwards
        ``version`` is the param_version the stream carried and ``sent_digests`` the sender's digests."""
        if self.rank == 0:
            raise RuntimeError("the bridge's rank 0 sends; receivers have rank >= 1")
        self.syncs += 1
        self._bucket = 0
        self.sent_digests.clear()  # in place: a caller may hold this dict from before the stream started
        self._progress("started")
        try:
            yield from self._receive()
        except BaseException:  # a stream cut short (or abandoned) leaves no base to rebuild from
            self._held.clear()
            raise

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        while True:
            try:
                header = self._broadcast(torch.zeros(3, dtype=torch.int64))
                kind, meta_bytes, data_bytes = (int(x) for x in header)
                if kind == _END:
                    self.version = meta_bytes  # the END header's second field
                    self._held = {name: held for name, held in self._held.items() if name in seen}
                    self._progress("done")
                    return
                meta = self._broadcast(torch.zeros(meta_bytes, dtype=torch.uint8))
                data = self._broadcast(torch.zeros(data_bytes, dtype=torch.uint8))
            except (RuntimeError, dist.DistError) as err:
                raise self._failure("receiving", err) from err
            self._bucket += 1
            self._progress(f"bucket {self._bucket}")
            faults.inject("checkpoint_engine.receive_bucket")  # tests: a rollout rank dies or stalls mid-sync
            for entry in json.loads(bytes(meta.numpy()).decode()):
                if entry.get("digest") is not None:
                    self.sent_digests[entry["name"]] = int(entry["digest"])
                seen.add(entry["name"])
                yield entry["name"], self._rebuild(entry, data[entry["offset"]:entry["offset"] + entry["nbytes"]])

    def _rebuild(self, entry: dict, raw: torch.Tensor) -> torch.Tensor:
        """A received tensor, whole: its values, or (deltas) this end's copy with the changed bits written
        in. The copy stays this end's own: the caller gets a clone, so a loader cannot alter the base."""
        name, dtype = entry["name"], getattr(torch, entry["dtype"])
        if entry.get("enc", "full") == "full":
            tensor = raw.clone().view(dtype).reshape(entry["shape"])  # the clone: aligned for the dtype's view
            if self.delta:
                self._held[name] = (tensor, self.syncs)
                return tensor.clone()
            return tensor
        held = self._held.get(name)
        if not self.delta or held is None or held[1] != entry["base"] or list(held[0].shape) != entry["shape"] \
                or held[0].dtype != dtype:
            got = "no copy" if held is None else f"its copy from sync {held[1]} ({held[0].dtype}, {list(held[0].shape)})"
            raise WeightSyncError(
                f"{member_name(self.rank)}: weight sync {self.syncs} sent {name!r} as a delta against sync "
                f"{entry['base']} ({entry['dtype']}, {entry['shape']}), but this end holds {got}"
                + ("" if self.delta else " and was not connected with deltas")
                + ": both ends of a bridge must use the same rollout.checkpoint_engine.backend and start together.")
        tensor, count = held[0], int(entry["count"])
        positions = raw[:4 * count].clone().view(torch.int32).long()
        bits = _bits(tensor)
        bits[positions] = raw[4 * count:].clone().view(bits.dtype).view(-1, *bits.shape[1:])
        self._held[name] = (tensor, self.syncs)
        return tensor.clone()

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel():
            self.group.broadcast([tensor], dist.BroadcastOptions()).wait(timedelta(seconds=self.timeout_s))
        return tensor

    # ---- saying who failed -----------------------------------------------------------------

    def _progress(self, what: str) -> None:
        if self.store is not None:
            self.store.set(f"progress/{self.rank}", f"sync {self.syncs}: {what}")

    def _member(self, rank: int) -> tuple[dict, bool | None, str]:
        """(host/pid info, alive, progress) of ``rank`` from the store. A store that cannot be read
        means its host, the sender, is gone."""
        try:
            info = json.loads(self.store.get(f"member/{rank}").decode())
            key = f"progress/{rank}"
            progress = self.store.get(key).decode() if self.store.check([key]) else "no sync started"
        except Exception:  # noqa: BLE001 - a diagnosis must not raise
            return {}, False if self.rank != 0 else None, "unknown"
        return info, _alive(info), progress

    def _failure(self, doing: str, err: BaseException) -> WeightSyncError:
        """The error to raise when a broadcast failed or timed out: which member, and how far it got."""
        where = f"weight sync {self.syncs} ({doing}, after bucket {self._bucket})"
        limit = f"rollout.checkpoint_engine.timeout_s={self.timeout_s:g}"
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if self.store is None:
            return WeightSyncError(f"{member_name(self.rank)}: {where} failed ({limit}): {cause}")
        lines, dead = [], []
        for peer in (range(1, self.world_size) if self.rank == 0 else [0]):
            info, alive, progress = self._member(peer)
            at = f"pid {info['pid']} on {info['host']}" if info else "unreachable"
            state = {False: "has exited", True: "is running but stopped answering", None: "did not answer"}[alive]
            dead += [peer] if alive is False else []
            lines.append(f"{member_name(peer)} ({at}) {state}, last progress: {progress}")
        culprit = f"{member_name(dead[0])} died during the sync. " if dead else ""
        return WeightSyncError(
            f"{culprit}{member_name(self.rank)}: {where} failed within {limit}: " + "; ".join(lines)
            + f". Cause: {cause}. The run stops here; resume_mode=auto continues from the last checkpoint.")


def _agreed_dtypes(store: dist.Store, world_size: int) -> dict[str, torch.dtype]:
    """{name: the dtype every rollout rank's engine stores it in}, from their announcements; a name the
    ranks disagree on is left out, and nothing is agreed when a rank could not say."""
    announced = []
    for rank in range(1, world_size):
        key = f"dtypes/{rank}"
        names = json.loads(store.get(key).decode()) if store.check([key]) else None
        if names is None:
            return {}
        announced.append(names)
    if not announced:
        return {}
    agreed = {name: dtype for name, dtype in announced[0].items() if all(a.get(name) == dtype for a in announced[1:])}
    return {name: getattr(torch, dtype) for name, dtype in agreed.items()
            if isinstance(getattr(torch, dtype, None), torch.dtype)}


def _roll_call(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait for every member's announcement; a ``WeightSyncError`` naming those still missing."""
    keys = [f"member/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        return
    except (RuntimeError, dist.DistError):
        pass
    try:
        missing = [r for r in range(world_size) if not store.check([f"member/{r}"])]
    except Exception:  # noqa: BLE001 - the store's host, the sender, has gone (it gave up, or died)
        missing = [0]
    names = ", ".join(member_name(r) for r in missing) or "a member"
    raise WeightSyncError(
        f"{names} did not join the weight bridge within {timeout_s:g} s (rollout.checkpoint_engine.timeout_s); "
        f"{member_name(rank)} gave up waiting. Check that rank's log: it may have died or hung while starting.")
