"""Buckets on an agent: move steps that travel as one stream (`reshard.many.ManyProgram.buckets`).

A bucket runs as one move of a one-dim box of bytes, under its first step's id (its stream key, its dtype
``uint8`` for the transport): the sender packs its members' boxes, in step order and each in C order, into one
buffer (`Bucket.pack`); every host it reaches writes the bytes into a buffer per receiving device and, once a
device has them all, unpacks each member into that device's destination (`Bucket.sink`). A chain forwards the
packed bytes as they are, and its last hop's digest covers them as it covers any box, so a bucket is checked
exactly as one transfer is.

Those buffers are host memory that a job allocates as it runs. On a cpu agent they count against
``--memory-limit``: at prepare, a run reserves room for the largest of them that can be in flight at once
(``reshard.server.agent.run``'s `Run._reserve_buckets`, under the store key `BUCKETS_KEY`, until the job ends
on that host), so a job whose buckets do not fit is refused before anything moves instead of taking the
process past its limit part way. They come from the store's
recycler and go back to it once sent or unpacked (``take``, ``give``): a weight sync packs the same bucket
sizes every step, and fresh memory pays a page fault per page on its first write.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.plans import Transfer
from reshard.program import Program, Step
from reshard.proto.layout import np_dtype, tile_shape
from reshard.server.transport import buffers

__all__ = ["Bucket", "bucket_moves", "BYTES", "BUCKETS_KEY"]

BYTES = "uint8"  # the dtype a bucket's stream carries
BUCKETS_KEY = "bucket buffers"  # what a job's reservation for its bucket buffers is held under in the store


def _new(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _drop(buffer: np.ndarray) -> None:
    pass


class Bucket:
    """Move steps ``members`` of ``program`` sent as one stream; ``step`` is the move that stands for them."""

    def __init__(self, program: Program, members: list[Step]):
        self.members = members
        # Per member, worked out once per program (a weight sync packs and unpacks the same buckets every step):
        # (tensor, box, its bytes' range in the bucket, numpy dtype, shape).
        self.parts: list[tuple[str, Box, int, int, np.dtype, tuple[int, ...]]] = []
        n = 0
        for s in members:
            kind = np_dtype(program.tensor(s.tensor).dtype)
            shape = tile_shape(s.transfer.box)
            size = math.prod(shape) * kind.itemsize
            self.parts.append((s.tensor, s.transfer.box, n, n + size, kind, shape))
            n += size
        self.nbytes = n
        self.tensors = [s.tensor for s in members]
        # Whether every member's tensor has source shards, which the sender then packs from (`pack`); and, filled
        # as runs pack, (member index, the tile of its shard) -> the member's slices in that shard, or None where
        # the shard lacks the member's box: a weight sync packs the same boxes from the same tiles every run.
        self.sourced = all(program.tensor(t).src is not None for t in self.tensors)
        self._regions: dict[tuple[int, Box], tuple | None] = {}
        t = members[0].transfer
        self.step = Step.move(members[0].id, Transfer(((0, n),), t.sender, t.receivers, t.method, 0, t.route),
                              tensor=members[0].tensor)

    @property
    def ids(self) -> list[int]:
        return [s.id for s in self.members]

    def pack(self, read: Callable[[str, str, Box], tuple[Any, Box]], take: Callable[[int], np.ndarray] = _new,
             shards: Callable[[str, list[str]], list[Any]] | None = None) -> tuple[np.ndarray, Box]:
        """The members' bytes in one host buffer, and the byte box it holds; ``read(device, tensor, box)`` is the
        sender's buffer holding a member's box and the box that buffer holds, ``take(n)`` a buffer of ``n``
        bytes. ``shards(device, tensors)``, when given, is the sender's source shard (a `TileBuffer`, or None)
        of each of ``tensors``, looked up at once: a member its shard holds is read from there, the others
        through ``read``."""
        out = take(self.nbytes)
        sender = self.step.transfer.sender
        held = shards(sender, self.tensors) if shards is not None and self.sourced else [None] * len(self.parts)
        regions = self._regions
        for k, ((tensor, box, lo, hi, kind, shape), shard) in enumerate(zip(self.parts, held)):
            where = None
            if shard is not None:
                key = (k, shard.tile)
                where = regions.get(key, False)
                if where is False:  # not worked out yet
                    where = regions[key] = boxes.to_slices(box, shard.tile) if boxes.contains(shard.tile, box) \
                        else None
            if where is not None:
                view = shard.array[where]
            else:
                array, origin = read(sender, tensor, box)
                view = buffers.region(array, box, origin)
            if isinstance(view, np.ndarray):  # one copy, strided where the box is not contiguous in the shard
                out[lo:hi].view(kind).reshape(shape)[...] = view
            else:
                out[lo:hi] = np.frombuffer(buffers.host_bytes(view), dtype=np.uint8)
        return out, self.step.transfer.box

    def sink(self, destination: Callable[[str, Box], Any], take: Callable[[int], np.ndarray] = _new,
             give: Callable[[np.ndarray], None] = _drop) -> "_Unpack":
        """Where the bucket's bytes land on this host; ``destination(tensor, box)`` is the `Sink` of a member,
        ``take(n)`` a buffer of ``n`` bytes and ``give(buffer)`` hands one back once it is unpacked."""
        return _Unpack(self, destination, take, give)


class _Unpack:
    """The `Sink` of a bucket's byte box: a buffer per receiving device, unpacked into the members' destinations
    once the device has every byte."""

    def __init__(self, bucket: Bucket, destination: Callable[[str, Box], Any], take: Callable[[int], np.ndarray],
                 give: Callable[[np.ndarray], None]):
        self.bucket = bucket
        self.destination = destination
        self._take, self._give = take, give
        self._lock = threading.Lock()
        self._bytes: dict[str, np.ndarray] = {}
        self._got: dict[str, int] = {}

    def _buffer(self, device: str) -> np.ndarray:
        with self._lock:
            buf = self._bytes.get(device)
            if buf is None:
                buf = self._bytes[device] = self._take(self.bucket.nbytes)
            return buf

    def write(self, device: str, box: Box, data) -> None:
        (lo, hi), = box
        self._buffer(device)[lo:hi] = np.frombuffer(buffers.host_bytes(data), dtype=np.uint8)
        self._arrived(device, hi - lo)

    def place(self, devices: list[str], box: Box):
        (lo, hi), = box
        return devices[0], self._buffer(devices[0])[lo:hi]

    def mark(self, device: str, box: Box) -> None:
        (lo, hi), = box
        self._arrived(device, hi - lo)

    def _arrived(self, device: str, n: int) -> None:
        with self._lock:
            self._got[device] = self._got.get(device, 0) + n
            whole = self._got[device] == self.bucket.nbytes
            buf = self._bytes.pop(device) if whole else None
        if whole:
            self._unpack(device, buf)
            # Views of it a chain hop still forwards keep it from being handed out again until they end.
            self._give(buf)

    def _unpack(self, device: str, buf: np.ndarray) -> None:
        for tensor, box, lo, hi, kind, shape in self.bucket.parts:
            self.destination(tensor, box).write(device, box, buf[lo:hi].view(kind).reshape(shape))


def bucket_moves(program: Program) -> dict[int, Bucket]:
    """The program's buckets by the id of the step that stands for each (its first); none for a program
    without buckets."""
    groups = getattr(program, "buckets", ())
    return {g[0]: Bucket(program, [program.steps[i] for i in g]) for g in groups}
