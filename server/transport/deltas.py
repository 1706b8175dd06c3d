"""A delta stream (issue 40): the frame a move sends in place of a box's bytes where both ends hold an earlier version
of the box, and its two ends: the sender's encode and chunk loop, the receiver's relay, checks and apply.

A transfer of a program tensor named in ``PrepareRequest.delta_bases`` (program tensor -> (src_version,
dst_version)) is still one stream per hop under its usual `StreamKey`, but the stream carries a *frame*: the sender
diffs the box of the source tile against the same box of ``src_version`` on the same device (`reshard.delta`), one
encoding per *segment* (a plain box is one segment of the tensor's itemsize; a bucket one per member, each of its
member's itemsize, so bfloat16 diffs element-wise); the receiver applies each to the same box of ``dst_version`` on
its own device, whose content the planner knows equals ``src_version``'s. The frame, little-endian:

========== ========================= ==================================================================
offset     bytes                     field
========== ========================= ==================================================================
0          4                         magic ``b"RSDF"``
4          1                         layout version (1)
5          3                         zero
8          4                         number of segments ``m``
12         8                         the box's bytes (what a full move carries)
20         8                         payload bytes ``p`` (everything after this head)
28         8                         XXH3-64 of the table's base digests (its second column, in order)
36         8                         XXH3-64 of the new box's packed bytes
44         16 * m                    per segment: its encoding's bytes, the XXH3-64 of its base box (0:
                                     a bucket member without a base, sent as a ``full`` encoding)
44 + 16m   p - 16m                   the segments' `reshard.delta` encodings (``Delta.to_bytes``)
========== ========================= ==================================================================

The head goes as a piece of its own, the rest in pieces of ``chunk_bytes`` (`frame_ranges`): pieces carry byte boxes
``((lo, hi),)`` of the frame, and the trailer is ``(frame bytes, XXH3-64 of the frame)``. A receiver that posts its
receives (collective, nixl) reads the head's payload length, or posts a landing of `DeltaStream.limit` bytes, the
most a frame of the box can take: each segment falls back to ``full`` where a delta would be larger, so a frame is at
most the box's bytes plus ``44 + 40 m``.

Checks at the receiver: the trailer (DATA_LOSS), before anything is written into a destination; each segment's base
held on each receiving device (else FAILED_PRECONDITION beginning `DELTA_BASE_MISMATCH`, naming the tensor: the
planner then moves it whole); the applied box against the new digest. That last check is what proves the new
version, so a receiver hashes its bases only where it fails: a base whose digest differs from the sender's is then
`DELTA_BASE_MISMATCH`, naming each such tensor, and a box rebuilt from bases that all match is DATA_LOSS. (A base
that differs only where the delta overwrites it rebuilds the new box exactly, and passes.) Hashing every base
first cost a receiver a pass over every box it holds, a third of a delta's hashing, to learn nothing the result's
digest does not. The result is applied straight into the destination where the sink offers its region (a staged
tile's, or a bucket's members'), else into a buffer written into the sink whole; either way only staged buffers,
which a failed job never commits.

The work, with the compiled codec (`reshard.delta.COMPILED`): a sender reads each segment's new and base regions where
they lie, strided ones included (`reshard.delta.encode_into`: compare, gaps and values in one pass, written straight
into the frame; the digests by `digest_views`); a receiver copies its base into the destination 64 KiB at a time,
patches the changes in and feeds each piece to a running XXH3-64 while it is in cache (`reshard.delta.apply_into`
with `reshard.delta.hasher`), so the new box's digest costs no second read. The numpy codec packs strided regions
first and hashes the result after.

Memory, per delta stream in flight: the sender holds the frame (at most the box plus the headers above) and, with the
numpy codec only, the new box and its base packed where their regions are strided (a bucket: each member where it
lies; packed whole, as for a full move, where the bucket also has receivers on the sender's host); a receiver holds
the frame and the applied box, and with the numpy codec one segment's decoded encoding at a time. Both are bounded by
about twice the box (a bucket: ``bucket_mib``) per stream.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.delta import (FULL, HEADER_NBYTES, Delta, DeltaError, apply, apply_into, encode_into, sparse_header,
                           unit_dtype)
from reshard.delta import hasher as new_hasher
from reshard.proto.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from reshard.proto.layout import Checksum, digest, digest_views
from reshard.server.common.contract import DELTA_BASE_MISMATCH
from reshard.server.transport.session import Session
from reshard.server.transport.streams import IpcRegion, Piece, Segments, StreamKey, Trailer

__all__ = ["HEAD", "SEGMENT", "Segment", "DeltaStream", "Frame", "encode_frame", "read_head", "frame_ranges",
           "send_frame", "relay_frame", "apply_frame", "take_first"]

HEAD = struct.Struct("<4sB3xIQQQQ")
SEGMENT = struct.Struct("<QQ")
_MAGIC = b"RSDF"
_VERSION = 1


@dataclass(frozen=True)
class Segment:
    """One encoding of a delta stream: program tensor ``tensor`` (stored as ``name``), its ``box``, its bytes
    ``[lo, hi)`` in the stream's box, its itemsize, and ``versions`` (src_version, dst_version) of its base, None
    where it has none (a bucket member that goes whole)."""

    tensor: str
    name: str
    box: Box
    lo: int
    hi: int
    itemsize: int
    versions: tuple[int, int] | None


@dataclass(frozen=True)
class DeltaStream:
    """What both ends of a move step that travels as deltas know of it: its segments, its box's bytes, the sender
    device, and where the bases are read: ``sender_base(k)`` is segment k's base box on the sender's device, as its
    elements where they lie (a region of the base's tile, any strides: `encode_frame` reads it in place) or packed
    bytes, and ``receiver_base(device, k)`` on a receiving device as its packed bytes (uint8, C order); either None
    where that version is not held there (the agent's `Run` reads them from its store)."""

    step: int
    sender: str
    segments: tuple[Segment, ...]
    nbytes: int
    sender_base: Callable[[int], np.ndarray | None]
    receiver_base: Callable[[str, int], np.ndarray | None]

    @property
    def limit(self) -> int:
        """The most bytes a frame of this box takes: every segment ``full``."""
        return self.nbytes + HEAD.size + len(self.segments) * (SEGMENT.size + HEADER_NBYTES)

    def tensors(self, lengths: list[int]) -> tuple[dict[str, int], dict[str, int]]:
        """Per program tensor with a base: the frame bytes it accounts for (its table rows and encodings, the head
        counted to the first), and what a full move of its boxes carries; ``lengths`` are the encodings' bytes."""
        wire: dict[str, int] = defaultdict(int)
        full: dict[str, int] = defaultdict(int)
        head = HEAD.size
        for seg, n in zip(self.segments, lengths):
            if seg.versions is None:
                continue
            wire[seg.tensor] += head + SEGMENT.size + n
            full[seg.tensor] += seg.hi - seg.lo
            head = 0
        return dict(wire), dict(full)


@dataclass(frozen=True)
class Frame:
    """An encoded frame (``data``: uint8) and its per-tensor accounting (`DeltaStream.tensors`)."""

    data: np.ndarray
    wire: dict[str, int]
    full: dict[str, int]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _items(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Packed bytes as one unsigned integer (or opaque item) per element, what `reshard.delta` compares."""
    return data.view(unit_dtype(itemsize))


def _where(job: str, d: DeltaStream, seg: Segment) -> str:
    return f"box {boxes.box_str(seg.box)} (step {d.step} of job {job})"


def encode_frame(job: str, d: DeltaStream, new: np.ndarray | tuple, new_digest: int | None = None) -> Frame:
    """The frame of ``new``: the box's packed bytes (uint8), or a tuple of one array per segment, each that
    segment's elements where they lie (a box's region of its tile, or a bucket's members': any strides, read in
    place, so nothing packs them), against the sender's bases; ``new_digest`` is its XXH3-64 where the agent
    digested the box already. A base the sender does not hold is a `DELTA_BASE_MISMATCH` (the planner then moves
    the tensor whole)."""
    parts = new if isinstance(new, tuple) else tuple(new[seg.lo:seg.hi] for seg in d.segments)
    if sum(p.nbytes for p in parts) != d.nbytes:
        raise AssertionError(f"step {d.step}: the new box has {sum(p.nbytes for p in parts)} bytes, its segments "
                             f"{d.nbytes}")
    if [p.nbytes for p in parts] != [seg.hi - seg.lo for seg in d.segments]:
        raise AssertionError(f"step {d.step}: a box in parts has one part per segment")
    m = len(d.segments)
    out = np.empty(d.limit, dtype=np.uint8)  # trimmed to what the encodings take
    at = HEAD.size + m * SEGMENT.size
    table = out[HEAD.size:at].view(np.uint64).reshape(m, 2) if m else np.empty((0, 2), np.uint64)
    lengths = []
    for k, seg in enumerate(d.segments):
        cur = parts[k]
        base_digest = 0
        if seg.versions is None:
            n = (seg.hi - seg.lo) // seg.itemsize
            enc = Delta(FULL, n, seg.itemsize, n, cur.tobytes()).to_bytes()
            out[at:at + len(enc)] = np.frombuffer(enc, dtype=np.uint8)
            length = len(enc)
        else:
            old = d.sender_base(k)
            if old is None:
                raise FailedPreconditionError(
                    f"{DELTA_BASE_MISMATCH}: tensor '{seg.name}': the sending device {d.sender} holds no version "
                    f"{seg.versions[0]} with {_where(job, d, seg)} to diff against; the planner moves it whole")
            base_digest = digest_views(old)
            length = encode_into(old, cur, seg.itemsize, out[at:])
        table[k] = (length, base_digest)
        lengths.append(length)
        at += length
    if new_digest is None:
        new_digest = digest_views(*parts)
    HEAD.pack_into(out, 0, _MAGIC, _VERSION, m, d.nbytes, at - HEAD.size, _table_digest(table), new_digest)
    wire, full = d.tensors(lengths)
    return Frame(out[:at], wire, full)


def read_head(job: str, d: DeltaStream, head) -> tuple[int, int, int]:
    """The frame's total bytes, base digest and new digest from its ``head`` bytes, checked against what the
    receiver knows of the stream (its segments and box)."""
    data = memoryview(head).cast("B")
    if len(data) < HEAD.size:
        raise InvalidArgumentError(f"job {job}: the delta frame of step {d.step} starts with a {HEAD.size}-byte "
                                   f"head; its first piece has {len(data)} bytes")
    magic, version, m, nbytes, payload, base, new = HEAD.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise InvalidArgumentError(f"job {job}: step {d.step} moves as a delta, but its stream starts with "
                                   f"{bytes(magic)!r} version {version}, not a delta frame {_MAGIC!r} version "
                                   f"{_VERSION}: both agents must run the same reshard release")
    total = HEAD.size + payload
    if m != len(d.segments) or nbytes != d.nbytes or total > d.limit or payload < m * SEGMENT.size:
        raise InvalidArgumentError(
            f"job {job}: the delta frame of step {d.step} describes {m} segments of {nbytes} bytes in {total} "
            f"frame bytes; this host's program gives {len(d.segments)} segments of {d.nbytes} bytes, in at most "
            f"{d.limit} frame bytes")
    return total, base, new


def frame_ranges(total: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """The byte ranges a frame of ``total`` bytes goes in: the head alone, then pieces of ``chunk_bytes``."""
    yield 0, HEAD.size
    step = max(1, chunk_bytes)
    for lo in range(HEAD.size, total, step):
        yield lo, min(total, lo + step)


def send_frame(transport, s: Session, key: StreamKey, peer: str, frame: Frame, progress: int):
    """Stream ``frame`` to ``peer`` (`frame_ranges`), then its trailer; returns who verified it. Every byte counts as
    network bytes; the frame's per-tensor accounting goes to `Traffic.add_delta`, and ``progress`` (the box's
    bytes) to the host's progress, which counts full moves."""
    out = transport.open(s, key, peer)
    data = frame.data
    try:
        for lo, hi in frame_ranges(frame.nbytes, transport.chunk_bytes):
            s.check()
            transport.throttle.wait(hi - lo)
            # A copy the piece owns, not a view: a one-sided transport registers the buffer a piece is a view of
            # (NIXL pins all of it), and the frame's is fresh every transfer and the box's size; a piece of its own
            # goes through the transport's recycled staging instead. The frame is a few percent of the box.
            out.put(((lo, hi),), bytearray(data[lo:hi]))
            s.traffic.add_out(peer, hi - lo, origin=False)
        confirmed = out.finish(frame.nbytes, digest(data), transport.timeout_s)
    except BaseException:
        out.cancel()
        raise
    s.traffic.add_delta(frame.wire, frame.full, progress)
    return confirmed


def relay_frame(transport, s: Session, key: StreamKey, peer: str, d: DeltaStream, items: Iterable,
                forward_to: str | None):
    """Take one incoming delta stream: forward every piece to ``forward_to`` as it arrives (under the next hop's
    key), collect the frame and check it against the trailer. Returns (the frame, uint8; the forward stream, whose
    trailer is handed over, or None)."""
    forward = transport.open(s, StreamKey(key.job, key.step, key.hop + 1), forward_to) if forward_to else None
    frame: np.ndarray | None = None
    got = 0
    try:
        for item in items:
            if isinstance(item, Trailer):
                if item.device or frame is None or item.nbytes != got or got != len(frame):
                    raise DataLossError(
                        f"job {key.job}: the delta frame of step {key.step} from {peer} arrived with {got} bytes; the "
                        f"sender sent {item.nbytes}"
                        + (f" and its head announced {len(frame)}" if frame is not None else ""))
                if digest(frame) != item.digest:
                    raise DataLossError(
                        f"job {key.job}: the delta frame of step {key.step} arrived with XXH3-64 {digest(frame):016x}, "
                        f"but the sender sent {item.digest:016x}: the bytes changed between {peer} and "
                        f"{transport.host}, so the job fails and no host commits them")
                if forward is not None:
                    forward.end(item.nbytes, item.digest)
                    s.traffic.add_delta(*d.tensors(_lengths(frame)))
                return frame, forward
            s.check()
            sub, data = item.box, item.data
            if isinstance(data, IpcRegion) or isinstance(data, Segments):
                raise InvalidArgumentError(f"job {key.job}: step {key.step} moves as a delta frame of bytes, but "
                                           f"{peer} sent a {type(data).__name__} piece")
            raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
            if len(sub) != 1 or sub[0] != (got, got + len(raw)):
                raise InvalidArgumentError(f"job {key.job}: piece {boxes.box_str(sub)} of {len(raw)} bytes of the "
                                           f"delta frame of step {key.step} from {peer} does not follow byte {got}")
            if frame is None:
                total = read_head(key.job, d, raw)[0]
                frame = np.empty(total, dtype=np.uint8)
            if got + len(raw) > len(frame):
                raise InvalidArgumentError(f"job {key.job}: the delta frame of step {key.step} from {peer} runs past "
                                           f"the {len(frame)} bytes its head announced")
            frame[got:got + len(raw)] = raw
            got += len(raw)
            if forward is not None:
                forward.put(sub, data, item.wire)
                s.traffic.add_out(forward_to, len(raw), origin=False)
            s.traffic.add_in(peer, len(raw))
        raise InvalidArgumentError(f"job {key.job}: the delta stream {key.hop} of step {key.step} from {peer} ended "
                                   f"after {got} bytes without a trailer; the sender stopped")
    except BaseException:
        if forward is not None:
            forward.cancel()
        raise


def _parts_digest(parts) -> int:
    """The XXH3-64 of bytes in several C-contiguous buffers, in order: streamed over them, it is the digest of the
    bytes packed."""
    check = Checksum()
    for p in parts:
        check.update(p)
    return check.xxh3_64


def _table_digest(table: np.ndarray) -> int:
    """What the head says of the bases: the XXH3-64 of the table's base digests, so that neither end hashes a base
    twice (each segment's own digest is checked against the receiver's base)."""
    return digest(np.ascontiguousarray(table[:, 1]).view(np.uint8))


def _lengths(frame: np.ndarray) -> list[int]:
    m = HEAD.unpack_from(frame)[2]
    return [int(n) for n in frame[HEAD.size:HEAD.size + m * SEGMENT.size].view(np.uint64)[0::2]]


def apply_frame(job: str, d: DeltaStream, frame: np.ndarray, device: str, out=None):
    """The new box on ``device``: each segment's encoding applied to ``device``'s base, and the result checked
    against the new box's digest; where it differs, or a base is not held, `DELTA_BASE_MISMATCH` names each tensor
    whose base is missing or differs from the sender's digest, and a result rebuilt from matching bases is DATA_LOSS
    (the module's checks). Written into ``out`` where given (a C-contiguous array of the box's bytes, such as
    the destination tile's region, or `Segments`, one per segment: a bucket's members in their tiles), which is
    returned; else into new packed bytes (uint8)."""
    _, _, m, _, _, base_sent, new_sent = HEAD.unpack_from(frame)
    table = frame[HEAD.size:HEAD.size + m * SEGMENT.size].view(np.uint64).reshape(m, 2)
    at = HEAD.size + m * SEGMENT.size
    if out is None:
        out = np.empty(d.nbytes, dtype=np.uint8)
    if isinstance(out, Segments):
        targets = [np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in out]
        if len(targets) != len(d.segments) or any(
                t.nbytes != seg.hi - seg.lo or not p.flags.c_contiguous for t, seg, p in zip(targets, d.segments, out)):
            raise AssertionError(f"step {d.step}: a delta lands in one C-contiguous region per segment")
    else:
        flat = out.reshape(-1).view(np.uint8) if out.flags.c_contiguous else out
        if flat.nbytes != d.nbytes or not out.flags.c_contiguous:
            raise AssertionError(f"step {d.step}: a delta lands in {d.nbytes} C-contiguous bytes")
        targets = [flat[seg.lo:seg.hi] for seg in d.segments]
    missing = []  # segments whose base this device does not hold
    hashed = new_hasher()  # fed each segment's result as it is made, in order (None: the result is hashed at the end)
    for k, seg in enumerate(d.segments):
        length = int(table[k, 0])
        if at + length > len(frame):
            raise InvalidArgumentError(f"job {job}: segment {k} of the delta frame of step {d.step} runs past the "
                                       f"frame's {len(frame)} bytes")
        encoded = frame[at:at + length]
        at += length
        n = (seg.hi - seg.lo) // seg.itemsize
        if seg.versions is not None and not missing and sparse_header(encoded) == (n, seg.itemsize):
            # The common case, kept short: a sparse delta of this segment's box, applied by `apply_into`
            old = d.receiver_base(device, k)
            if old is None:
                missing.append(k)
                continue
            try:
                apply_into(old, encoded, targets[k], seg.itemsize, hashed)
            except DeltaError as e:
                raise InvalidArgumentError(f"job {job}: segment {k} of the delta frame of step {d.step}: {e}") from None
            continue
        try:
            delta = Delta.from_bytes(encoded)
        except DeltaError as e:
            raise InvalidArgumentError(f"job {job}: segment {k} of the delta frame of step {d.step}: {e}") from None
        if delta.num_elements != n or delta.itemsize != seg.itemsize:
            raise InvalidArgumentError(
                f"job {job}: segment {k} of the delta frame of step {d.step} encodes {delta.num_elements} elements of "
                f"{delta.itemsize} B; tensor '{seg.name}' {boxes.box_str(seg.box)} has {n} of {seg.itemsize} B")
        into = targets[k]
        if seg.versions is None or delta.kind == FULL:
            if delta.kind != FULL:
                raise InvalidArgumentError(f"job {job}: tensor '{seg.name}' has no delta base in step {d.step}, so "
                                           f"its segment goes whole; the frame carries a {delta.kind} delta")
            if seg.versions is None:
                into[...] = np.frombuffer(delta.payload, dtype=np.uint8)
                if hashed is not None:
                    hashed.update(into)
                continue
        old = d.receiver_base(device, k)
        if old is None:
            missing.append(k)
        if missing:
            continue  # the job fails anyway: find every tensor that differs, apply nothing more
        try:
            apply(_items(old, seg.itemsize), delta, out=_items(into, seg.itemsize))
        except DeltaError as e:
            raise InvalidArgumentError(f"job {job}: segment {k} of the delta frame of step {d.step}: {e}") from None
        if hashed is not None:
            hashed.update(into)
    if missing:
        _bases_differ(job, d, table, device, missing)
    if at != len(frame) or _table_digest(table) != base_sent:
        raise DataLossError(f"job {job}: the delta frame of step {d.step} is inconsistent: its segments take "
                            f"{at} of its {len(frame)} bytes, their base digests XXH3-64 {_table_digest(table):016x} "
                            f"where the head says {base_sent:016x}")
    if hashed is not None:
        got = hashed.intdigest()
    elif isinstance(out, Segments):
        got = _parts_digest(targets)
    else:
        got = digest(flat)
    if got != new_sent:
        _bases_differ(job, d, table, device, [])  # the bases are hashed only now, to name the cause
        raise DataLossError(f"job {job}: step {d.step} applied on device {device} gives XXH3-64 {got:016x}, but the "
                            f"sender's box has {new_sent:016x}: the delta does not rebuild it, so the job fails and no "
                            f"host commits it")
    return out


def _bases_differ(job: str, d: DeltaStream, table: np.ndarray, device: str, missing: list[int]) -> None:
    """Raise `DELTA_BASE_MISMATCH` naming every segment of ``d`` whose base ``device`` does not hold (``missing``)
    or holds with a digest other than the sender's (the table's second column); return where there is none."""
    differ = []
    for k, seg in enumerate(d.segments):
        if seg.versions is None:
            continue
        src_v, dst_v = seg.versions
        old = None if k in missing else d.receiver_base(device, k)
        if old is None:
            differ.append(f"tensor '{seg.name}': device {device} holds no version {dst_v} with "
                          f"{_where(job, d, seg)} (the sender diffed against version {src_v})")
            continue
        held, base_digest = digest(old), int(table[k, 1])
        if held != base_digest:
            differ.append(f"tensor '{seg.name}': version {dst_v} on device {device} has XXH3-64 {held:016x} in "
                          f"{_where(job, d, seg)}, the sender's base (version {src_v} on {d.sender}) "
                          f"{base_digest:016x}")
    if differ:
        raise FailedPreconditionError(f"{DELTA_BASE_MISMATCH}: " + "; ".join(differ)
                                      + ": the planner moves these tensors whole")


def take_first(items: Iterable) -> tuple[Piece | Trailer | None, Iterator]:
    """The first item of ``items`` and an iterator of them all (a passive stream, peeked at to tell a CUDA IPC
    stream, which goes whole, from a frame)."""
    it = iter(items)
    first = next(it, None)

    def again() -> Iterator:
        if first is not None:
            yield first
        yield from it

    return first, again()
