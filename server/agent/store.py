"""An agent's memory: committed shards per (tensor, version, device) and staged ones per transaction.

Staged shards (an upload in progress, or a reshard's destination buffers) are
invisible to readers until their transaction commits; an aborted transaction
leaves nothing behind. A job's host commits as its run ends, before the planner's
catalog makes the new versions visible; where the job fails on another host, its
abort undoes that (`uncommit`). Uploads whose bytes are streaming in right now are
listed too (`receiving`), so heartbeats can keep them from expiring.

The store holds at most ``limit_bytes`` (``--memory-limit``): committed, staged
and reserved bytes together. A buffer is reserved before it is allocated
(`reserve`, `reserving`), so a request that would go over the limit is refused
with `ResourceExhaustedError` before any memory is touched; staging the buffer
turns its reservation into staged bytes, and aborting its transaction frees both.

Shards live on the agent's device (``--device``): numpy arrays on a ``cpu``
agent, torch tensors on a ``cuda:N`` agent, every device of the host on that one
GPU. `ShardStore.adopt` brings arriving data there; everything else that touches a
buffer's bytes goes through `reshard.server.transport.buffers`.

Host buffers a released version, an aborted transaction or a finished program leaves, and
the buckets a job packs and unpacks (`reshard.server.agent.buckets`), are kept for reuse
(`buffers.Recycler`): the first write to fresh memory pays a page fault per 4 KiB, which costs
several times the write itself (on the machine this was measured on, 60 ms against 8 ms for
64 MiB), and the jobs that repeat (weight sync, training steps) ask for the same sizes every
time. A buffer is handed out again only when nothing else holds it (a reader streaming an old
version keeps it). The recycler keeps at most ``recycle_bytes`` more than the most bytes the store
has held committed (`ShardStore._fit_recycler`): a sync that repeats stages as many bytes as its
last version holds, so one version's buffers and a job's scratch beside them are what it asks for
again, and a sync held the old and the new version at once anyway. The memory stays the agent's
until a job takes it again or the agent exits (deleting tensors does not give it back). An agent
with a memory limit (``--memory-limit``) keeps ``recycle_bytes`` at most, as its container is sized
for: the limit plus that (deploy/k8s's cpu overlay: 6 GiB and 1 GiB in an 8 GiB container). Capped at
``recycle_bytes`` alone (1 GiB), a serving host of the kimi-k2 MoE sync (bench/moe_sync.py: 1.07
GiB of tiles a version, and its buckets) freed part of every released version; on nixl each freed
buffer a peer had written into is never offered to a peer again (`nixl_memory.Registry.usable`),
so the tiles later made where it was landed in the transport's scratch, copied once more, and
that scratch grew with every sync (27, 77, 302, 430 MiB over four syncs on each serving host;
a sync on nixl 14.9 s, median of six, against 13.7 with a recycler of 4 GiB).
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from reshard.box import Box
from reshard.proto.errors import AlreadyExistsError, FailedPreconditionError, NotFoundError, ResourceExhaustedError
from reshard.proto.layout import np_dtype
from reshard.server.common.sizes import format_size
from reshard.server.transport import buffers
from reshard.server.transport.buffers import Recycler

__all__ = ["TileBuffer", "ShardStore", "Recycler"]

_ENDED_KEPT = 4096  # ended transactions remembered; each is an id string
_NOTHING: Mapping[str, TileBuffer] = MappingProxyType({})  # what an owner that staged nothing holds
DEFAULT_RECYCLE_BYTES = 1 << 30


@dataclass(frozen=True)
class TileBuffer:
    """One device's tile of a tensor: ``array`` (numpy, or a torch tensor on a GPU) holds the box ``tile``.

    ``digest`` is the XXH3-64 of the tile's bytes in C order where their arrival proved it (a job's stream whose
    box was the whole tile, an upload read in order against its trailer), else None: a job that sends the whole
    tile on then needs no pass over its bytes for its trailer (`runtime.Runtime._digest_sources`)."""

    array: Any
    tile: Box
    dtype: str
    digest: int | None = None

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def device(self) -> str:
        return buffers.device_of(self.array)


class ShardStore:
    def __init__(self, device: str = "cpu", limit_bytes: int = 0, host: str = "",
                 recycle_bytes: int = DEFAULT_RECYCLE_BYTES):
        self.device = device  # where every shard of this agent lives: "cpu" or "cuda:N"
        self.limit_bytes = limit_bytes  # 0: no limit
        self.host = host  # named in refusals
        # a GPU's caching allocator reuses memory by itself
        self.recycle_bytes = recycle_bytes if device == "cpu" else 0  # the recycler's cap beyond `committed_peak`
        self.recycler = Recycler(self.recycle_bytes)
        self.committed_peak = 0  # the most bytes this store has held committed (`_fit_recycler`)
        self.host_bytes = 0  # bytes of host buffers handed out (`host_buffer`), for tests and stats
        self._lock = threading.Lock()
        self._committed: dict[tuple[str, int, str], TileBuffer] = {}
        # (tensor, version) -> its devices here, and the committed bytes: kept as shards come and go, so a release
        # or a reservation costs the same however many tensors the agent holds (a state dict is hundreds)
        self._devices: dict[tuple[str, int], set[str]] = {}
        self._committed_bytes = 0
        # (tensor, version) -> the job that committed it here (`uncommit`), while it is held
        self._committer: dict[tuple[str, int], str] = {}
        self._staged: dict[str, dict[str, TileBuffer]] = {}
        self._staged_bytes = 0  # kept as shards are staged and leave: a put_many stages thousands per agent
        self._reserved: dict[tuple[str, str], int] = {}  # (owner, device) -> bytes about to be staged there
        # Owners (uploads, jobs) that committed or aborted, newest last: nothing is staged for them again, so a
        # replayed ticket or a stream that outlived its abort cannot leave an orphan behind.
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._receiving: Counter[str] = Counter()  # owner -> shard streams in progress

    @contextmanager
    def receiving(self, owner: str) -> Iterator[None]:
        """Count a shard of upload ``owner`` as streaming in while the block runs."""
        with self._lock:
            self._receiving[owner] += 1
        try:
            yield
        finally:
            with self._lock:
                self._receiving[owner] -= 1
                if not self._receiving[owner]:
                    del self._receiving[owner]

    def receiving_uploads(self) -> list[str]:
        with self._lock:
            return sorted(self._receiving)

    def _staged_nbytes(self, owner: str, device: str) -> int:
        shard = self._staged.get(owner, {}).get(device)
        return shard.nbytes if shard is not None else 0

    def _used_locked(self) -> int:
        """Committed, staged and reserved bytes; a reservation stands for the buffer it will replace. Costs the
        reservations (the streams in flight), not the staged shards."""
        replaced = sum(self._staged_nbytes(owner, d) for owner, d in self._reserved)
        return self._committed_bytes + self._staged_bytes + sum(self._reserved.values()) - replaced

    def used_bytes(self) -> int:
        """Committed, staged and reserved bytes: what counts against the limit."""
        with self._lock:
            return self._used_locked()

    def reserve(self, owner: str, sizes: Mapping[str, int], what: str) -> None:
        """Hold room for the buffers ``owner`` is about to stage (device -> bytes), or refuse naming the sizes.

        Each reservation ends when its buffer is staged, or when ``owner`` commits or aborts.
        """
        need = sum(sizes.values())
        with self._lock:
            self._check_open_locked(owner, what)
            busy = sorted(d for d in sizes if (owner, d) in self._reserved)
            if busy:
                raise FailedPreconditionError(f"{what}: a buffer of transaction {owner[:12]} for devices {busy} is "
                                              f"already being staged on host {self.host}; one stream per device")
            held = self._used_locked() - sum(self._staged_nbytes(owner, d) for d in sizes)  # replaced buffers go
            self._check_room_locked(held, need, what)
            for d, n in sizes.items():
                self._reserved[(owner, d)] = n

    def reserve_more(self, owner: str, key: str, nbytes: int, what: str) -> None:
        """Add ``nbytes`` to ``owner``'s reservation ``key`` (made by the first call), or refuse naming the sizes as
        `reserve` does: buffers made one at a time and all held until ``owner`` ends (a job's working buffers). One
        reservation for them all, where one each made every later check cost them all: a sync quantizing 3,000
        tiny weights spent half its sender's time counting its own reservations."""
        with self._lock:
            self._check_open_locked(owner, what)
            self._check_room_locked(self._used_locked(), nbytes, what)
            self._reserved[(owner, key)] = self._reserved.get((owner, key), 0) + nbytes

    def _check_room_locked(self, held: int, need: int, what: str) -> None:
        """Refuse ``need`` more bytes beside the ``held`` ones where that passes the memory limit, naming both."""
        if self.limit_bytes and held + need > self.limit_bytes:
            beyond = ("more than the whole limit" if need > self.limit_bytes
                      else f"{format_size(self.limit_bytes - held)} ({self.limit_bytes - held:,} bytes) are free")
            raise ResourceExhaustedError(
                f"{what} needs {format_size(need)} ({need:,} bytes), but the agent of host {self.host} holds "
                f"{format_size(held)} ({held:,} bytes) of its memory limit of {format_size(self.limit_bytes)} "
                f"({self.limit_bytes:,} bytes): {beyond}; free memory (delete tensors) or start the agent with a "
                f"larger --memory-limit")

    @contextmanager
    def reserving(self, owner: str, device: str, nbytes: int, what: str) -> Iterator[None]:
        """`reserve` ``nbytes`` for ``device``'s buffer while the block allocates and stages it; a reservation
        the block did not stage (it failed) ends with it."""
        self.reserve(owner, {device: nbytes}, what)
        try:
            yield
        finally:
            with self._lock:
                self._reserved.pop((owner, device), None)

    def empty(self, shape: tuple[int, ...], dtype: str):
        """A buffer for ``shape`` on this store's device: a recycled one when one of that size is free."""
        if self.device != "cpu":
            return buffers.empty(shape, dtype, self.device)
        np_type = np_dtype(dtype)
        nbytes = math.prod(shape) * np_type.itemsize
        free = self.recycler.take(nbytes)
        return free.view(np_type).reshape(shape) if free is not None else buffers.host_empty(shape, dtype, nbytes)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of host memory whatever this store's device (a bucket's, `buckets.Bucket`): a recycled
        buffer when one of that size is free (a cuda store keeps none); `recycle` takes it back."""
        self.host_bytes += nbytes
        free = self.recycler.take(nbytes)
        return free if free is not None else np.empty(nbytes, dtype=np.uint8)

    def recycle(self, array) -> None:
        """``array`` is no longer needed by whoever made it (a program's scratch buffer)."""
        self.recycler.put(array)

    def adopt(self, array, tile: Box, dtype: str, digest: int | None = None) -> TileBuffer:
        """``array`` (numpy, or torch on any device) as a tile buffer on this store's device: moved there if it is
        not; ``digest`` is its bytes' XXH3-64 where known (`TileBuffer.digest`)."""
        return TileBuffer(buffers.to_device(array, dtype, self.device), tile, dtype, digest)

    def _check_open_locked(self, owner: str, what: str) -> None:
        if owner in self._ended:
            raise FailedPreconditionError(f"{what}: transaction {owner[:12]} has already ended (committed or aborted) "
                                          f"on host {self.host}; nothing more is staged for it")

    def ended(self, owner: str) -> bool:
        """Whether ``owner`` committed or aborted here (recently: the record keeps the last few thousand)."""
        with self._lock:
            return owner in self._ended

    def end(self, owner: str) -> None:
        """Record that ``owner`` ended with nothing staged here (a job's host without destination tiles, or a job
        whose tiles its tensors' own transactions committed); what it still had reserved is free again."""
        with self._lock:
            self._drop_reserved(owner)
            self._end_locked(owner)

    def _end_locked(self, *owners: str) -> None:
        ended = self._ended
        for owner in owners:
            ended[owner] = None
            ended.move_to_end(owner)
        while len(ended) > _ENDED_KEPT:
            ended.popitem(last=False)

    def stage(self, owner: str, device: str, shard: TileBuffer) -> None:
        self.stage_many([(owner, device, shard)])

    def stage_many(self, shards: list[tuple[str, str, TileBuffer]], reserved_by: str | None = None) -> None:
        """`stage` of each (owner, device, buffer) of ``shards``, in order, under one hold of the lock: a job's
        tiles of a whole state dict. ``reserved_by``: the transaction whose reservation of each device (`reserve`)
        held their room, which shrinks by each buffer's bytes as it is staged."""
        for _, _, shard in shards:
            assert shard.device == self.device, f"a {shard.device} buffer staged in a store on {self.device}"
        with self._lock:
            # a state dict's hundreds of tiles at once, so the loop asks no method per tile
            ended, staged_of, reserved = self._ended, self._staged, self._reserved
            for owner, device, shard in shards:
                if owner in ended:
                    self._check_open_locked(owner, f"staging device {device}'s buffer")
                staged = staged_of.get(owner)
                if staged is None:
                    staged = staged_of[owner] = {}
                old, nbytes = staged.get(device), shard.array.nbytes
                self._staged_bytes += nbytes - (old.array.nbytes if old is not None else 0)
                staged[device] = shard
                if reserved:
                    reserved.pop((owner, device), None)
                    held = (reserved_by, device)
                    if held in reserved:
                        reserved[held] = max(0, reserved[held] - nbytes)

    def digested(self, owner: str, device: str, array, digest: int) -> None:
        """Note ``digest`` (`TileBuffer.digest`) on ``device``'s buffer staged for ``owner``, if it is still
        ``array``."""
        with self._lock:
            staged = self._staged.get(owner, {})
            shard = staged.get(device)
            if shard is not None and shard.array is array:
                staged[device] = replace(shard, digest=digest)

    def staged(self, owner: str, device: str) -> TileBuffer | None:
        with self._lock:
            return self._staged.get(owner, {}).get(device)

    def commit(self, owner: str, tensor: str, version: int, devices) -> None:
        """Make the staged shards of ``devices`` visible as ``tensor`` at ``version``, all or none."""
        self.commit_many([(owner, tensor, version, devices)])

    def commit_many(self, commits: list[tuple[str, str, int, Any]], by: str = "") -> None:
        """`commit` of each (owner, tensor, version, devices) of ``commits``, all or none: a job that commits a
        state dict, under one hold of the lock. ``by``: the job committing them, which `uncommit` names.

        A version committed here is never written over, whatever this store remembers of ended transactions: a
        replayed upload, whose ticket outlived the record of its end (`_ENDED_KEPT`), would otherwise replace the
        bytes the catalog vouches for. Such a commit is refused with `AlreadyExistsError`, and the transaction,
        which can never commit here, is dropped (its buffers would otherwise stay staged for good)."""
        dropped: dict[str, TileBuffer] = {}
        try:
            with self._lock:
                staged_of, committed = self._staged, self._committed
                coming: set[tuple[str, int, str]] = set()  # and never twice in one call either
                for owner, tensor, version, devices in commits:
                    staged = staged_of.get(owner, _NOTHING)
                    for d in devices:
                        if d not in staged or (tensor, version, d) in committed or (tensor, version, d) in coming:
                            error, dropped = self._refusal_locked(owner, tensor, version, devices, staged, coming)
                            raise error
                    coming.update((tensor, version, d) for d in devices)
                # A state dict's commit: thousands of tensors, each in as few steps as the records allow
                devices_of, committer = self._devices, self._committer
                reserved = bool(self._reserved)
                unstaged = added = 0
                for owner, tensor, version, devices in commits:
                    staged = staged_of.pop(owner, _NOTHING)
                    for shard in staged.values():
                        unstaged += shard.array.nbytes
                    for d in devices:
                        shard = committed[(tensor, version, d)] = staged[d]
                        added += shard.array.nbytes
                    if devices:
                        held = devices_of.get((tensor, version))
                        if held is None:
                            devices_of[(tensor, version)] = set(devices)
                        else:
                            held.update(devices)
                    if by:
                        committer[(tensor, version)] = by
                    if reserved:
                        self._drop_reserved(owner)
                self._end_locked(*(owner for owner, *_ in commits))
                self._staged_bytes -= unstaged
                self._committed_bytes += added
                self._fit_recycler()
        finally:
            self._recycle(dropped)

    def _refusal_locked(self, owner: str, tensor: str, version: int, devices, staged, coming: set
                        ) -> tuple[Exception, dict[str, TileBuffer]]:
        """Why `commit_many` refuses one of its entries, and what it dropped: FailedPreconditionError where
        ``owner`` staged no shard for a device, else AlreadyExistsError, ``owner`` dropped (it can never commit
        here)."""
        missing = [d for d in devices if d not in staged]
        if missing:
            return FailedPreconditionError(f"cannot commit {tensor!r} v{version}: transaction {owner} holds no "
                                           f"shard for devices {missing}"), {}
        taken = sorted(d for d in devices if (tensor, version, d) in self._committed or (tensor, version, d) in coming)
        return AlreadyExistsError(
            f"cannot commit {tensor!r} v{version} for devices {taken}: host {self.host} holds that version already, "
            f"and a committed version is never written over (a replayed commit is refused so); transaction "
            f"{owner[:12]} is dropped. A copy the planner could not free earlier (a delete or a failed job while this "
            f"agent was unreachable) goes with the failed call's cleanup: try the put or job again"
        ), self._drop_locked(owner)

    def abort(self, owner: str) -> None:
        with self._lock:
            staged = self._drop_locked(owner)
        self._recycle(staged)

    def _drop_locked(self, owner: str) -> dict[str, TileBuffer]:
        """End ``owner`` with nothing committed; returns its staged buffers, for `_recycle` once the lock is free."""
        staged = self._unstage_locked(owner)
        self._drop_reserved(owner)
        self._end_locked(owner)
        return staged

    def _recycle(self, staged: dict[str, TileBuffer]) -> None:
        for shard in staged.values():
            self.recycler.put(shard.array)

    def _unstage_locked(self, owner: str) -> dict[str, TileBuffer]:
        staged = self._staged.pop(owner, {})
        self._staged_bytes -= sum(shard.nbytes for shard in staged.values())
        return staged

    def _drop_reserved(self, owner: str) -> None:
        if not self._reserved:
            return
        for key in [k for k in self._reserved if k[0] == owner]:
            del self._reserved[key]

    def get(self, tensor: str, version: int, device: str) -> TileBuffer:
        with self._lock:
            shard = self._committed.get((tensor, version, device))
        if shard is None:
            raise NotFoundError(f"this agent holds no shard of {tensor!r} v{version} for device {device!r}")
        return shard

    def find(self, tensor: str, version: int, device: str) -> TileBuffer | None:
        with self._lock:
            return self._committed.get((tensor, version, device))

    def find_many(self, keys: list[tuple[str, int, str]]) -> list[TileBuffer | None]:
        """`find` of each (tensor, version, device) of ``keys``, under one hold of the lock."""
        with self._lock:
            return [self._committed.get(k) for k in keys]

    def release(self, tensor: str, version: int) -> int:
        """Drop every shard of ``tensor`` at ``version``; returns how many."""
        return self.release_many([(tensor, version)])

    def release_many(self, versions: list[tuple[str, int]]) -> int:
        """`release` of each (tensor, version) of ``versions`` (a state dict's old versions), under one hold of
        the lock; returns how many shards it dropped."""
        with self._lock:
            dropped = self._release_locked(versions)
        for shard in dropped:
            self.recycler.put(shard.array)
        return len(dropped)

    def uncommit(self, job: str) -> int:
        """Drop what ``job`` committed here and this store still holds; returns how many shards. A job's hosts
        commit as their runs end, and the planner aborts a job that failed on any host: the abort undoes the
        commit. Keyed by the job, not by tensor and version: an abort that reaches a paused host late never frees
        the same version a retry committed there since. Looks through every version held, which only a failed
        job's cleanup pays."""
        with self._lock:
            dropped = self._release_locked([key for key, by in self._committer.items() if by == job])
        for shard in dropped:
            self.recycler.put(shard.array)
        return len(dropped)

    def _release_locked(self, versions: list[tuple[str, int]]) -> list[TileBuffer]:
        dropped = [self._committed.pop((tensor, version, d)) for tensor, version in versions
                   for d in self._devices.pop((tensor, version), ())]
        self._committed_bytes -= sum(shard.nbytes for shard in dropped)
        for key in versions:
            self._committer.pop(key, None)
        return dropped

    def _fit_recycler(self) -> None:
        """After a commit (the store's lock held): the recycler keeps ``recycle_bytes`` more than the most this
        store has held committed, where the agent has no memory limit (see the module docstring)."""
        if self.recycle_bytes and not self.limit_bytes and self._committed_bytes > self.committed_peak:
            self.committed_peak = self._committed_bytes
            self.recycler.resize(self.recycle_bytes + self.committed_peak)

    def held(self) -> list[tuple[str, int]]:
        """Every (tensor, version) this store holds committed shards of."""
        with self._lock:
            return sorted(self._devices)

    def nbytes(self) -> int:
        with self._lock:
            return self._committed_bytes
