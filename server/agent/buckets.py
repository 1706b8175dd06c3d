"""Buckets on an agent: move steps that travel as one stream (`reshard.many.ManyProgram.buckets`).

A bucket runs as one move of a one-dim box of bytes, under its first step's id (its stream key, its dtype
``uint8`` for the transport), once every step its members wait for is done: the sender packs its members' boxes,
in step order and each in C order, into one buffer (`Bucket.pack`); every host it reaches writes the bytes into a
buffer per receiving device and unpacks each member into that device's destination as soon as the device has all
of that member's bytes (`Bucket.sink`). A chain forwards the
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

import bisect
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.host_slice import ProgramSlice
from reshard.mesh import host_of
from reshard.plans import Transfer
from reshard.program import MOVE, MoveView, Program, Step
from reshard.proto.layout import np_dtype, tile_shape
from reshard.routes import receiving_hops
from reshard.server.transport import buffers
from reshard.server.transport.streams import Gather, Segments

__all__ = ["Bucket", "bucket_moves", "BYTES", "BUCKETS_KEY"]

BYTES = "uint8"  # the dtype a bucket's stream carries
BUCKETS_KEY = "bucket buffers"  # what a job's reservation for its bucket buffers is held under in the store
# A member smaller than this lands in the bucket's buffer and is copied into place, even where the transport
# scatters: its destination tile is too small for the recycler to keep (`buffers.RECYCLE_MIN_BYTES`), so every
# run's would be fresh memory to register and announce, which costs more than the copy (measured on the
# weight-sync bench: landing 2 KiB members in place made the sync slower)
IN_PLACE_BYTES = buffers.RECYCLE_MIN_BYTES


_EMPTY = np.empty(0, np.uint8)  # the region of a member of no bytes


def _new(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _drop(buffer: np.ndarray) -> None:
    pass


class Bucket:
    """Move steps ``members`` of ``program`` (steps, or `MoveView`s of them) sent as one stream; ``step`` is the
    move that stands for them."""

    def __init__(self, program: Program, members: Sequence[Step | MoveView], known: dict | None = None):
        self.members = members
        # Per member, worked out once per program (a weight sync packs and unpacks the same buckets every step):
        # (tensor, box, its bytes' range in the bucket, numpy dtype, shape). ``known`` keeps, for the buckets of
        # one program, each tensor's (numpy dtype, whether it has a source) and each (box object, dtype)'s shape
        # and bytes: a state dict's million members share a few thousand of each.
        known = {} if known is None else known
        self.parts: list[tuple[str, Box, int, int, np.dtype, tuple[int, ...]]] = []
        n = 0
        sourced = True
        for s in members:
            tensor, box = s.tensor, s.transfer.box
            of_tensor = known.get(tensor)
            if of_tensor is None:
                decl = program.tensor(tensor)
                of_tensor = known[tensor] = (np_dtype(decl.dtype), decl.src is not None)
            kind = of_tensor[0]
            sourced = sourced and of_tensor[1]
            sized = known.get((id(box), kind))
            if sized is None:
                shape = tile_shape(box)
                sized = known[id(box), kind] = (shape, math.prod(shape) * kind.itemsize, box)  # box: its id stays
            shape, size = sized[0], sized[1]
            self.parts.append((tensor, box, n, n + size, kind, shape))
            n += size
        self.nbytes = n
        self.tensors = [s.tensor for s in members]
        # where each member starts in the bucket, and the end; the members large enough to land in place, by index
        self.starts = [p[2] for p in self.parts] + [n]
        self.large = [k for k, p in enumerate(self.parts) if p[3] - p[2] >= IN_PLACE_BYTES]
        # Whether every member's tensor has source shards, which the sender then packs from (`pack`); and, filled
        # as runs pack, (member index, the tile of its shard) -> the member's slices in that shard, or None where
        # the shard lacks the member's box: a weight sync packs the same boxes from the same tiles every run.
        self.sourced = sourced
        self._regions: dict[tuple[int, Box], tuple | None] = {}
        t = members[0].transfer
        # It waits for all its members wait for (the quantize steps that made them, in a quantizing sync): members of
        # one depth never wait for one another (`reshard.many.ManyProgram.validate`).
        ids = {s.id for s in members}
        self.step = Step.move(members[0].id, Transfer(((0, n),), t.sender, t.receivers, t.method, 0, t.route),
                              after=sorted({a for s in members for a in s.after} - ids), tensor=members[0].tensor)

    @property
    def ids(self) -> list[int]:
        return [s.id for s in self.members]

    def _views(self, read: Callable[[str, str, Box], tuple[Any, Box]],
               shards: Callable[[str, list[str]], list[Any]] | None) -> Iterator[tuple[int, Any]]:
        """(member index, the member's region of the sender's buffer that holds it): from its source shard where
        ``shards`` has it, else through ``read`` (see `pack`)."""
        sender = self.step.transfer.sender
        held = shards(sender, self.tensors) if shards is not None and self.sourced else [None] * len(self.parts)
        regions = self._regions
        for k, ((tensor, box, _, _, _, _), shard) in enumerate(zip(self.parts, held)):
            where = None
            if shard is not None:
                key = (k, shard.tile)
                where = regions.get(key, False)
                if where is False:  # not worked out yet
                    where = regions[key] = boxes.to_slices(box, shard.tile) if boxes.contains(shard.tile, box) \
                        else None
            if where is not None:
                yield k, shard.array[where]
            else:
                array, origin = read(sender, tensor, box)
                yield k, buffers.region(array, box, origin)

    def pack(self, read: Callable[[str, str, Box], tuple[Any, Box]], take: Callable[[int], np.ndarray] = _new,
             shards: Callable[[str, list[str]], list[Any]] | None = None) -> tuple[np.ndarray, Box]:
        """The members' bytes in one host buffer, and the byte box it holds; ``read(device, tensor, box)`` is the
        sender's buffer holding a member's box and the box that buffer holds, ``take(n)`` a buffer of ``n``
        bytes. ``shards(device, tensors)``, when given, is the sender's source shard (a `TileBuffer`, or None)
        of each of ``tensors``, looked up at once: a member its shard holds is read from there, the others
        through ``read``."""
        out = take(self.nbytes)
        for k, view in self._views(read, shards):
            _, _, lo, hi, kind, shape = self.parts[k]
            if isinstance(view, np.ndarray):  # one copy, strided where the box is not contiguous in the shard
                out[lo:hi].view(kind).reshape(shape)[...] = view
            else:
                out[lo:hi] = np.frombuffer(buffers.host_bytes(view), dtype=np.uint8)
        return out, self.step.transfer.box

    def gather(self, read: Callable[[str, str, Box], tuple[Any, Box]],
               shards: Callable[[str, list[str]], list[Any]] | None = None) -> Gather | None:
        """The members' regions where they lie, not packed, for a transport that `scatters` (``read`` and
        ``shards`` as in `pack`); None where one is not a host numpy view (a torch or CUDA tensor)."""
        parts = []
        for _, view in self._views(read, shards):
            if not isinstance(view, np.ndarray):
                return None
            parts.append(view)
        return Gather(tuple(parts), (*(p[2] for p in self.parts), self.nbytes))

    def sink(self, destination: Callable[[str, Box], Any], take: Callable[[int], np.ndarray] = _new,
             give: Callable[[np.ndarray], None] = _drop, scatter: bool = False) -> "_Unpack":
        """Where the bucket's bytes land on this host; ``destination(tensor, box)`` is the `Sink` of a member,
        ``take(n)`` a buffer of ``n`` bytes and ``give(buffer)`` hands one back once it is unpacked. ``scatter``:
        the transport lands a whole bucket in its members' destination tiles where it can (`_Unpack.place`)."""
        return _Unpack(self, destination, take, give, scatter)


class _Unpack:
    """The `Sink` of a bucket's byte box: a buffer per receiving device, unpacked into the members' destinations
    once the device has every byte; or, for a transport that `scatters`, the members' own destination regions
    (`Segments`), each member of at least `IN_PLACE_BYTES` contiguous there landing in place and the others in one
    buffer. Each member is unpacked as soon as the device has all its bytes, not once it has the whole bucket: the
    bucket that lands last on a host is then not unpacked whole after its last byte (on the emulated weight sync
    that was 5-8 ms of a receiver's CPU, 7-20 ms of wall time, between the last byte and the commit)."""

    def __init__(self, bucket: Bucket, destination: Callable[[str, Box], Any], take: Callable[[int], np.ndarray],
                 give: Callable[[np.ndarray], None], scatter: bool = False):
        self.bucket = bucket
        self.destination = destination
        self._take, self._give = take, give
        self.scatter = scatter
        self._lock = threading.Lock()
        self._bytes: dict[str, np.ndarray] = {}
        self._fronts: dict[str, _Front] = {}  # device -> how far its bytes arrived and its members were unpacked
        # device -> (its regions, where each starts in the bucket and the end, the members landing in place)
        self._regions: dict[str, tuple[Segments, list[int], list[bool]]] = {}

    def _buffer(self, device: str, nbytes: int | None = None) -> np.ndarray:
        with self._lock:
            buf = self._bytes.get(device)
            if buf is None:
                buf = self._bytes[device] = self._take(self.bucket.nbytes if nbytes is None else nbytes)
            return buf

    def _scattered(self, device: str) -> Segments | None:
        """``device``'s regions for the whole bucket (made at the first ask); None where no member lands in
        place (the bucket then lands in one buffer)."""
        with self._lock:
            known = self._regions.get(device)
        if known is not None:
            return known[0]
        bucket = self.bucket
        places: list = [None] * len(bucket.parts)  # only the large members are asked (`Bucket.large`)
        in_place = [False] * len(places)
        landed = 0
        for k in bucket.large:
            tensor, box, lo, hi, _, _ = bucket.parts[k]
            got = self.destination(tensor, box).place([device], box)
            view = got[1] if got is not None else None
            if isinstance(view, np.ndarray) and view.flags.c_contiguous and view.nbytes == hi - lo:
                places[k], in_place[k] = view.reshape(-1).view(np.uint8), True
                landed += hi - lo
        if not landed:
            return None
        rest = bucket.nbytes - landed
        buf = self._buffer(device, rest) if rest else None
        at, starts = 0, bucket.starts
        for k, v in enumerate(places):
            if v is None:
                n = starts[k + 1] - starts[k]
                places[k], at = (buf[at:at + n] if n else _EMPTY), at + n
        regions = Segments(places)
        with self._lock:
            self._regions[device] = (regions, starts, in_place)
        return regions

    def write(self, device: str, box: Box, data) -> None:
        (lo, hi), = box
        with self._lock:
            known = self._regions.get(device)
        src = data.packed() if isinstance(data, Segments) else np.frombuffer(buffers.host_bytes(data), dtype=np.uint8)
        if known is None:
            self._buffer(device)[lo:hi] = src
        else:  # into the regions the bytes [lo, hi) fall in
            regions, starts, _ = known
            k = bisect.bisect_right(starts, lo) - 1
            while lo < hi:
                take = min(starts[k + 1], hi) - lo
                at = lo - starts[k]
                regions[k][at:at + take] = src[:take]
                src, lo, k = src[take:], lo + take, k + 1
        self._arrived(device, box[0])

    def place(self, devices: list[str], box: Box):
        (lo, hi), = box
        if self.scatter and (lo, hi) == (0, self.bucket.nbytes):
            regions = self._scattered(devices[0])
            if regions is not None:
                return devices[0], regions
        return devices[0], self._buffer(devices[0])[lo:hi]

    def place_whole(self, devices: list[str], box: Box):
        """`place` of the whole bucket in its members' tile regions whatever the transport: a delta stream rebuilds
        the bucket there in one pass (`moves`), where a landing piece of a two-sided transport goes packed."""
        (lo, hi), = box
        if (lo, hi) == (0, self.bucket.nbytes):
            regions = self._scattered(devices[0])
            if regions is not None:
                return devices[0], regions
        return self.place(devices, box)

    def mark(self, device: str, box: Box) -> None:
        self._arrived(device, box[0])

    def digested(self, device: str, box: Box, digest: int) -> None:
        pass  # the digest of the packed bucket: no member's tile

    def _arrived(self, device: str, piece: tuple[int, int]) -> None:
        """Bytes ``piece`` (start, end) of the bucket arrived on ``device``: unpack the members they complete (those
        wholly before the first byte still missing), and once every byte is in and unpacked, hand the buffer back."""
        lo, hi = piece
        parts = self.bucket.parts
        with self._lock:
            front = self._fronts.get(device)
            if front is None:
                front = self._fronts[device] = _Front()
            end = front.end
            if lo == end:
                end = hi
                while end in front.ahead:
                    end = front.ahead.pop(end)
            else:  # beyond what arrived so far (a transport whose pieces come out of order)
                front.ahead[lo] = hi
            first = last = front.unpacked
            while last < len(parts) and parts[last][3] <= end:
                last += 1
            front.end, front.unpacked = end, last
            if last > first:
                front.busy += 1
                buf, known, done = self._bytes.get(device), self._regions.get(device), None
            else:
                done = self._done_locked(device, front)
        if last > first:
            try:
                self._unpack(device, buf, known, first, last)
            finally:
                with self._lock:
                    front.busy -= 1
                    done = self._done_locked(device, front)
        if done is not None:
            # Views of it a chain hop still forwards keep it from being handed out again until they end.
            self._give(done)

    def _done_locked(self, device: str, front: "_Front") -> np.ndarray | None:
        """``device``'s buffer, taken back, once every byte is in and no unpack still reads it (under the lock)."""
        return self._bytes.pop(device, None) if front.end == self.bucket.nbytes and not front.busy else None

    def _unpack(self, device: str, buf: np.ndarray | None, known, first: int, last: int) -> None:
        """Members ``first`` to ``last`` (not included), whose bytes are all on ``device``, into their
        destinations: copied out of ``buf`` or the bucket's own buffer, or counted where they landed in place."""
        parts = self.bucket.parts
        destination = self.destination
        if known is None:
            for tensor, box, lo, hi, kind, shape in parts[first:last]:
                destination(tensor, box).write(device, box, buf[lo:hi].view(kind).reshape(shape))
            return
        regions, _, in_place = known
        for k in range(first, last):
            tensor, box, _, _, kind, shape = parts[k]
            if in_place[k]:
                destination(tensor, box).mark(device, box)
            else:
                destination(tensor, box).write(device, box, regions[k].view(kind).reshape(shape))


class _Front:
    """How far a bucket's bytes arrived on one device (`_Unpack._arrived`): the end of those in from its start, the
    pieces in beyond it (start -> end), the first member not yet unpacked, and the unpacks under way."""

    __slots__ = ("end", "ahead", "unpacked", "busy")

    def __init__(self):
        self.end, self.ahead, self.unpacked, self.busy = 0, {}, 0, 0


def bucket_moves(program: Program, host: str | None = None) -> dict[int, Bucket]:
    """The program's buckets by the id of the step that stands for each (its first), or only those ``host`` sends,
    receives or forwards (a state dict's program packs a million moves, most of them other hosts'); none for a
    program without buckets."""
    groups = getattr(program, "buckets", ())
    if host is not None and groups and not isinstance(program, ProgramSlice):  # a slice's are the host's
        # a bucket's members share sender, receivers and route: its first says where it goes (a column: a run's
        # moves go as its template's)
        through = program.step_column(lambda s: s.kind == MOVE and _goes_through(s.transfer, host))
        groups = [g for g in groups if through[g[0]]]
    known: dict = {}
    return {g[0]: Bucket(program, program.moves_at(g), known) for g in groups}  # runs' members: not made


def _goes_through(t: Transfer, host: str) -> bool:
    return host_of(t.sender) == host or bool(receiving_hops(t, host))
