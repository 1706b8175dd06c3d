"""The delta encoding of one box between two versions: which elements changed, their new bits, and its wire layout.

A weight sync repeats every step and between two RL steps about 99% of a bf16 box is bit-identical (issue 40), so
a sender can put on the wire only what changed and the receiver rebuild the new version from its copy of the old.
Elements are compared as their bits (unsigned integers of the itemsize), never as numbers: bfloat16 and float8
held as uint16 / uint8 bits, NaN payloads and -0.0 come through exact, and any dtype works.

Three encodings; `encode` picks the one with the fewest bytes (ties go to the one cheapest to apply, in the order
full, bitmap, sparse) and records which:

=========== ================================================ ===================================================
kind        payload                                          bytes (n elements of b bytes, k of them changed)
=========== ================================================ ===================================================
``sparse``  gaps between changed indices as LEB128 varints,  sum of the gaps' varint lengths + k * b: one or two
            then the k new values                            bytes a gap at RL change rates (a gap of 0 to 127 is
                                                             one byte)
``bitmap``  one bit per element (little-endian bit order),   ceil(n / 8) + k * b: smaller than sparse above about
            then the k new values                            one change in eight
``full``    the n new values                                 n * b: smaller only where most elements changed
=========== ================================================ ===================================================

The gap before the i-th changed index is ``index[i] - index[i-1] - 1`` (with ``index[-1] = -1``), so neighbours
cost a byte of zero. On the wire a delta is a 24-byte header, then the payload:

======= ====== ==========================================================
offset  bytes  field (little-endian)
======= ====== ==========================================================
0       4      magic ``b"RSDL"``
4       1      layout version (1)
5       1      kind: 1 sparse, 2 bitmap, 3 full
6       2      itemsize in bytes
8       8      number of elements of the box
16      8      number of changed elements (a full delta records it too)
24      ...    payload
======= ====== ==========================================================

`estimate` prices a delta from a change count alone, for the cost model, assuming the changes fall at random.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from reshard.errors import ReshardError

try:  # the sparse passes in C, built by pip where a C compiler is present; numpy does the same work everywhere else
    from reshard import _delta_kernel as _kernel
except ImportError:
    _kernel = None

# Whether this process encodes and applies with the compiled passes (reshard/_delta_kernel.c): a few times less CPU
# a delta at RL change rates (bench/delta_codec.py); the bytes on the wire are the same either way.
COMPILED: bool = _kernel is not None

__all__ = ["SPARSE", "BITMAP", "FULL", "KINDS", "HEADER_NBYTES", "SENDER_PASSES", "RECEIVER_PASSES", "COMPILED",
           "DeltaError",
           "Delta", "DeltaEstimate", "encode", "encode_into", "apply", "apply_into", "hasher", "sparse_header",
           "estimate", "unit_dtype"]

SPARSE = "sparse"
BITMAP = "bitmap"
FULL = "full"
# Also the preference on a tie of sizes: a full delta applies as one copy, a bitmap as a masked scatter, and a
# sparse delta must first decode its varints.
KINDS: tuple[str, ...] = (FULL, BITMAP, SPARSE)

_MAGIC = b"RSDL"
_VERSION = 1
_HEADER = struct.Struct("<4sBBHQQ")
HEADER_NBYTES = _HEADER.size
_KIND_CODES = {SPARSE: 1, BITMAP: 2, FULL: 3}
_CODE_KINDS = {code: kind for kind, code in _KIND_CODES.items()}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_MAX_VARINT_NBYTES = 9  # 63 bits: a gap is below the element count, which indexes memory
# What a delta costs its hosts beyond the wire, as passes over a box's bytes at the host's memory rate (the
# agents' probe: a copy's bytes read plus written per second): a sender's diff of the box against its base
# (both digests, the comparison, the indices, the values, the frame) and a receiver's apply (its base's copy into
# the new tile, the values scattered, the result's digest; its base's digest only where that does not match).
# `bench/delta_codec.py` measures both against the probe in one process: at RL change rates (1-4%), 9-28 and 6-16
# passes on this project's shared 2-core machine, the higher figures when it was busiest, the receiver's while it
# still hashed its base too (a pass more); these are near the top, so a delta is chosen where it pays even then.
# The planner prices a delta with them (`delta=None`: a delta where it pays).
SENDER_PASSES = 20.0
RECEIVER_PASSES = 12.0


class DeltaError(ReshardError, ValueError):
    """Arrays a delta cannot be taken between or applied to, or bytes that are not a well-formed delta; a caller's
    mistake (or a corrupted message), so the service answers INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Delta:
    """The change of one box from one version to the next: its ``kind`` (`KINDS`), the box's element count and
    itemsize, how many elements changed, and the ``payload`` laid out as the module's table says.

    Prints as ``sparse delta: 1,024 of 1,048,576 elements of 2 B changed, 3,123 B on the wire (0.1% of full)``.
    """

    kind: str
    num_elements: int
    itemsize: int
    num_changed: int
    payload: bytes = field(repr=False)

    def __post_init__(self):
        if self.kind not in _KIND_CODES:
            raise DeltaError(f"a delta's kind must be one of {list(KINDS)}; got {self.kind!r}")
        for name in ("num_elements", "itemsize", "num_changed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DeltaError(f"a delta's {name} must be a non-negative integer; got {value!r}")
        if not 1 <= self.itemsize < 2**16:
            raise DeltaError(f"a delta's itemsize must be 1 to 65535 bytes; got {self.itemsize}")
        if self.num_changed > self.num_elements:
            raise DeltaError(f"a delta cannot change more elements than its box holds; got {self.num_changed:,} "
                             f"changed of {self.num_elements:,}")
        if not isinstance(self.payload, bytes):
            raise DeltaError(f"a delta's payload must be bytes; got {type(self.payload).__name__} "
                             f"(convert with bytes(...))")
        values = self.num_changed * self.itemsize
        want = {FULL: self.num_elements * self.itemsize, BITMAP: _bitmap_nbytes(self.num_elements) + values}
        if self.kind in want and len(self.payload) != want[self.kind]:
            raise DeltaError(f"a {self.kind} delta of {self.num_changed:,} changed of {self.num_elements:,} elements "
                             f"of {self.itemsize} B carries {want[self.kind]:,} payload bytes; got "
                             f"{len(self.payload):,}: the message is truncated or corrupted")
        if self.kind == SPARSE and len(self.payload) < values + self.num_changed:
            raise DeltaError(f"a sparse delta of {self.num_changed:,} changed elements of {self.itemsize} B carries "
                             f"at least {values + self.num_changed:,} payload bytes (a varint gap and a value each); "
                             f"got {len(self.payload):,}: the message is truncated or corrupted")

    @property
    def nbytes(self) -> int:
        """What the delta puts on the wire: header and payload."""
        return HEADER_NBYTES + len(self.payload)

    @property
    def full_nbytes(self) -> int:
        """What a full move of the box puts on the wire, to compare a delta against."""
        return self.num_elements * self.itemsize

    def __str__(self) -> str:
        share = f" ({self.nbytes / self.full_nbytes:.1%} of full)" if self.full_nbytes else ""
        return (f"{self.kind} delta: {self.num_changed:,} of {self.num_elements:,} elements of {self.itemsize} B "
                f"changed, {self.nbytes:,} B on the wire{share}")

    def to_bytes(self) -> bytes:
        header = _HEADER.pack(_MAGIC, _VERSION, _KIND_CODES[self.kind], self.itemsize, self.num_elements,
                              self.num_changed)
        return header + self.payload

    @classmethod
    def from_bytes(cls, data) -> "Delta":
        """The delta ``to_bytes`` wrote; ``data`` is any bytes-like object. Raises `DeltaError` on anything else."""
        view = memoryview(data).cast("B")
        if len(view) < HEADER_NBYTES:
            raise DeltaError(f"a delta starts with a {HEADER_NBYTES}-byte header; got {len(view)} bytes in all")
        magic, version, code, size, num_elements, num_changed = _HEADER.unpack_from(view)
        if magic != _MAGIC:
            raise DeltaError(f"a delta starts with the magic {_MAGIC!r}; got {magic!r}: these bytes are not a delta")
        if version != _VERSION:
            raise DeltaError(f"this reshard reads delta layout version {_VERSION}; got version {version}: the sender "
                             f"runs another reshard release, so upgrade the older side")
        if code not in _CODE_KINDS:
            raise DeltaError(f"a delta's kind code must be one of {sorted(_CODE_KINDS)} "
                             f"({', '.join(f'{c} {k}' for c, k in sorted(_CODE_KINDS.items()))}); got {code}")
        return cls(_CODE_KINDS[code], num_elements, size, num_changed, bytes(view[HEADER_NBYTES:]))


@dataclass(frozen=True)
class DeltaEstimate:
    """What `estimate` expects a delta to be: the kind `encode` would pick and its bytes on the wire."""

    kind: str
    nbytes: int


def encode(old: np.ndarray, new: np.ndarray, kind: str | None = None) -> Delta:
    """The delta that turns ``old`` into ``new``: two C-contiguous arrays of one box, same shape and dtype.

    ``kind`` forces an encoding (a receiver that must see the whole box asks for ``"full"``); by default the
    smallest of the three.
    """
    old_units, new_units = _units(old, "old"), _units(new, "new")
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaError(f"a delta is taken between two versions of one box, of one shape and dtype; got old "
                         f"{old.shape} {old.dtype} and new {new.shape} {new.dtype}")
    if kind is not None and kind not in _KIND_CODES:
        raise DeltaError(f"a delta's kind must be one of {list(KINDS)}, or None for the smallest; got {kind!r}")
    n, size = new_units.size, new.dtype.itemsize
    compiled = kind is None and _kernel is not None and size in _UNSIGNED
    if compiled:
        sparse = _kernel_sparse(old_units, new_units, n, size)
        if sparse is not None:
            return sparse
    changed = _changed(old_units, new_units, size)
    if compiled:  # the kernel found sparse no smaller, or most elements changed: the indices only where sparse may win
        k = int(np.count_nonzero(changed))
        index = np.flatnonzero(changed) if k < _bitmap_nbytes(n) else None
    else:  # the indices at once where a sparse delta may be asked for (their count is k: one pass, not two)
        index = np.flatnonzero(changed) if kind in (None, SPARSE) else None
        k = index.size if index is not None else int(np.count_nonzero(changed))
    nbytes = {FULL: n * size, BITMAP: _bitmap_nbytes(n) + k * size}
    gaps = None
    # Every gap costs at least a byte, so from one change in eight on no sparse delta can undercut the bitmap.
    if kind == SPARSE or (kind is None and k < _bitmap_nbytes(n)):
        gaps = np.empty(k, dtype=np.int64)
        gaps[:1] = index[:1]
        np.subtract(index[1:], index[:-1], out=gaps[1:])
        gaps[1:] -= 1
        gaps = gaps.view(np.uint64)
        lengths = _varint_lengths(gaps)
        nbytes[SPARSE] = int(lengths.sum()) + k * size
    if kind is None:
        kind = min(nbytes, key=lambda name: (nbytes[name], KINDS.index(name)))
    if kind == FULL:
        payload = new_units.tobytes()
    elif kind == BITMAP:
        payload = np.packbits(changed, bitorder="little").tobytes() + new_units[changed].tobytes()
    else:
        payload = _varint_encode(gaps, lengths).tobytes() + new_units[index].tobytes()
    return Delta(kind, n, size, k, payload)


def apply(old: np.ndarray, delta: Delta, out: np.ndarray | None = None) -> np.ndarray:
    """The new version: ``old`` with ``delta`` applied, written into ``out`` and returned, bit-exact.

    ``out`` defaults to a new array like ``old``; ``old`` itself is never written (it stays readable until the new
    version commits), so an ``out`` that overlaps it is refused.
    """
    old_units = _units(old, "old")
    if old_units.size != delta.num_elements or old.dtype.itemsize != delta.itemsize:
        raise DeltaError(f"a delta applies to the box it was taken from: {delta.num_elements:,} elements of "
                         f"{delta.itemsize} B; got old {old.shape} {old.dtype} ({old_units.size:,} elements of "
                         f"{old.dtype.itemsize} B)")
    if out is None:
        out = np.empty_like(old, order="C")
    else:
        if not isinstance(out, np.ndarray) or out.shape != old.shape or out.dtype != old.dtype:
            got = f"{out.shape} {out.dtype}" if isinstance(out, np.ndarray) else type(out).__name__
            raise DeltaError(f"a delta's out must be an array of old's shape and dtype {old.shape} {old.dtype}; "
                             f"got {got}")
        if not out.flags.writeable:
            raise DeltaError("a delta's out must be writeable; got a read-only array (pass a fresh buffer)")
        if np.may_share_memory(out, old):
            raise DeltaError("a delta's out must not overlap old, which stays readable until the new version "
                             "commits; pass a separate buffer (or none, for a new one)")
    out_units = _units(out, "out")
    payload = np.frombuffer(delta.payload, dtype=np.uint8)
    k, size = delta.num_changed, delta.itemsize
    values = payload[len(payload) - k * size:].view(out_units.dtype)
    if delta.kind == FULL:
        out_units[...] = payload.view(out_units.dtype)
        return out
    if delta.kind == SPARSE and _kernel is not None and size in _UNSIGNED and _kernel.apply_sparse(
            old_units, out_units, payload[:len(payload) - k * size], values, k, size):
        return out  # else the stream is malformed: the numpy path below finds how, and says so
    out_units[...] = old_units
    if delta.kind == BITMAP:
        changed = np.unpackbits(payload[:_bitmap_nbytes(delta.num_elements)], count=delta.num_elements,
                                bitorder="little").view(bool)
        found = int(np.count_nonzero(changed))
        if found != k:
            raise DeltaError(f"a bitmap delta's bitmap marks as many elements as it carries values ({k:,}); it marks "
                             f"{found:,}: the message is corrupted")
        out_units[changed] = values
    else:
        out_units[_sparse_index(payload[:len(payload) - k * size], k, delta.num_elements)] = values
    return out


def encode_into(old: np.ndarray, new: np.ndarray, itemsize: int, out: np.ndarray) -> int:
    """`encode` of one box's two versions, each an array of the box's elements of ``itemsize`` bytes (any strides:
    a region of a tile, read where it lies) or its packed bytes (C-contiguous uint8), written as `Delta.to_bytes`
    would into ``out`` (uint8, room for a full delta: `HEADER_NBYTES` and the box); returns its bytes. A frame's
    sender calls it per segment: the compiled pass reads the regions and writes straight into the frame, with no
    packed copy, no `Delta` and none of its copies."""
    n = old.nbytes // itemsize
    room = _bitmap_nbytes(n) * (1 + itemsize)
    pair = _aligned(old, new)
    if (_kernel is not None and itemsize in _UNSIGNED and pair is not None and old.nbytes == new.nbytes
            and out.nbytes >= HEADER_NBYTES + room):
        got = _kernel.encode_sparse(*pair, itemsize, out[HEADER_NBYTES:HEADER_NBYTES + room])
        if got is not None and got[1] + got[0] * itemsize < n * itemsize:
            k, nvarint = got
            _HEADER.pack_into(out, 0, _MAGIC, _VERSION, _KIND_CODES[SPARSE], itemsize, n, k)
            return HEADER_NBYTES + nvarint + k * itemsize
    unit = unit_dtype(itemsize)
    packed = [np.ascontiguousarray(a).reshape(-1).view(np.uint8).view(unit) for a in (old, new)]
    wire = encode(*packed).to_bytes()
    out[:len(wire)] = np.frombuffer(wire, dtype=np.uint8)
    return len(wire)


def _aligned(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``old`` and ``new`` as the compiled encode reads them: both C-contiguous, or of one shape and itemsize (a
    packed one given the other's shape); None where neither fits (numpy packs them)."""
    if not (isinstance(old, np.ndarray) and isinstance(new, np.ndarray)):
        return None
    if (old.flags.c_contiguous and new.flags.c_contiguous) or (
            old.shape == new.shape and old.dtype.itemsize == new.dtype.itemsize):
        return old, new
    for packed, other in ((old, new), (new, old)):
        if packed.flags.c_contiguous and packed.nbytes == other.nbytes and other.dtype.itemsize:
            shaped = packed.reshape(-1).view(np.uint8).view(other.dtype).reshape(other.shape)
            return (shaped, other) if packed is old else (other, shaped)
    return None


def sparse_header(encoded: np.ndarray) -> tuple[int, int] | None:
    """(elements, itemsize) of a well-headed sparse delta's bytes (uint8); None for any other bytes (a delta of
    another kind, or no delta: `Delta.from_bytes` says which)."""
    if len(encoded) < HEADER_NBYTES:
        return None
    magic, version, code, size, n, _ = _HEADER.unpack_from(encoded)
    return (n, size) if magic == _MAGIC and version == _VERSION and code == _KIND_CODES[SPARSE] else None


def apply_into(old: np.ndarray, encoded: np.ndarray, out: np.ndarray, itemsize: int, hasher=None) -> None:
    """`apply` of an encoded delta (``encoded``: `Delta.to_bytes`'s bytes, uint8) to a box given as its packed
    bytes (``old``, C-contiguous uint8 of elements of ``itemsize``) into ``out`` (the same, not overlapping ``old``),
    and ``out``'s bytes fed to ``hasher`` (`hasher`'s, or None). A sparse delta that fits goes straight to the
    compiled pass, which hashes each part of the result while it is in cache; anything else, a malformed one
    included, through `Delta.from_bytes` and `apply`, which name what is wrong (`DeltaError`)."""
    if _kernel is not None and itemsize in _UNSIGNED and len(encoded) >= HEADER_NBYTES:
        magic, version, code, size, n, k = _HEADER.unpack_from(encoded)
        values = k * size
        if (magic == _MAGIC and version == _VERSION and code == _KIND_CODES[SPARSE] and size == itemsize
                and n * size == old.nbytes == out.nbytes and values <= len(encoded) - HEADER_NBYTES
                and out.flags.writeable and not np.may_share_memory(out, old)
                and _kernel.apply_sparse(old, out, encoded[HEADER_NBYTES:len(encoded) - values],
                                         encoded[len(encoded) - values:], k, size, hasher)):
            return
    unit = unit_dtype(itemsize)
    apply(old.view(unit), Delta.from_bytes(encoded), out=out.view(unit))
    if hasher is not None:
        hasher.update(out)


def hasher():
    """A running XXH3-64 that `apply_into` feeds what it writes (``update(*buffers)``, ``intdigest()``): the
    compiled kernel's, or None where it is not built (the caller then digests the result itself)."""
    return _kernel.Hasher() if _kernel is not None else None


def estimate(num_elements: int, itemsize: int, num_changed: int) -> DeltaEstimate:
    """The delta `encode` would most likely make of a box of ``num_elements`` of ``itemsize`` bytes where
    ``num_changed`` elements changed at random places; clustered changes (a whole row) encode smaller still.

    The sparse size uses the spacings of ``k`` random points among ``n``: a gap is at least ``m`` with
    probability ``(1 - m/n) ** k``, so the expected varint bytes a gap are ``1 + sum_j (1 - 128**j / n) ** k``.
    """
    for name, value in (("num_elements", num_elements), ("itemsize", itemsize), ("num_changed", num_changed)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DeltaError(f"estimate's {name} must be a non-negative integer; got {value!r}")
    if not itemsize:
        raise DeltaError("estimate's itemsize must be at least 1 byte; got 0")
    if num_changed > num_elements:
        raise DeltaError(f"estimate's num_changed must be at most num_elements ({num_elements:,}); "
                         f"got {num_changed:,}")
    n, k = num_elements, num_changed
    nbytes = {FULL: n * itemsize, BITMAP: _bitmap_nbytes(n) + k * itemsize}
    if k:
        per_gap, j = 1.0, 1
        while 128**j < n:
            per_gap += math.exp(k * math.log1p(-(128**j) / n))
            j += 1
        nbytes[SPARSE] = math.ceil(k * per_gap) + k * itemsize
    else:
        nbytes[SPARSE] = 0
    kind = min(nbytes, key=lambda name: (nbytes[name], KINDS.index(name)))
    return DeltaEstimate(kind, HEADER_NBYTES + nbytes[kind])


def _bitmap_nbytes(num_elements: int) -> int:
    return (num_elements + 7) // 8


def _kernel_sparse(old_units: np.ndarray, new_units: np.ndarray, n: int, size: int) -> Delta | None:
    """The sparse delta `encode` would pick, by the compiled pass (`_kernel`), where sparse is the smallest: its
    gaps must take fewer bytes than a bitmap (one bit an element), which also bounds the values, one a gap."""
    vcap = _bitmap_nbytes(n)
    out = np.empty(vcap * (1 + size), dtype=np.uint8)
    got = _kernel.encode_sparse(old_units, new_units, size, out)
    if got is None:
        return None
    k, nvarint = got
    if nvarint + k * size >= n * size:  # a box of a few elements: full is no larger
        return None
    return Delta(SPARSE, n, size, k, out[:nvarint + k * size].tobytes())


def _units(a, name: str) -> np.ndarray:
    """``a`` as a flat view of one unsigned integer (or, for odd itemsizes, one opaque item) per element."""
    if not isinstance(a, np.ndarray):
        raise DeltaError(f"a delta works on numpy arrays; {name} is a {type(a).__name__} (convert with np.asarray)")
    if not a.flags.c_contiguous:
        raise DeltaError(f"a delta reads and writes an array's bytes in order, so {name} must be C-contiguous; got "
                         f"strides {a.strides} for shape {a.shape} (copy it with np.ascontiguousarray)")
    if a.dtype.hasobject:
        raise DeltaError(f"a delta compares elements as their bytes, which an array of Python objects does not "
                         f"hold; {name} has dtype {a.dtype} (use a numeric dtype)")
    return a.reshape(-1).view(unit_dtype(a.dtype.itemsize))


def unit_dtype(itemsize: int) -> np.dtype:
    """The dtype a delta compares elements of ``itemsize`` bytes as: the unsigned integer of that size, or an opaque
    item for other sizes."""
    return np.dtype(_UNSIGNED[itemsize]) if itemsize in _UNSIGNED else np.dtype((np.void, itemsize))


def _changed(old_units: np.ndarray, new_units: np.ndarray, itemsize: int) -> np.ndarray:
    """One bool per element: do its bits differ."""
    if itemsize in _UNSIGNED:
        return old_units != new_units
    # Opaque items (complex128, structured records) compare as rows of the widest unsigned word that divides them.
    word = next(w for w in (8, 4, 2, 1) if itemsize % w == 0)
    shape = (old_units.size, itemsize // word)
    return (old_units.view(_UNSIGNED[word]).reshape(shape) != new_units.view(_UNSIGNED[word]).reshape(shape)).any(1)


def _varint_lengths(gaps: np.ndarray) -> np.ndarray:
    """How many LEB128 bytes each gap takes: one per 7 bits."""
    lengths = np.ones(gaps.size, dtype=np.int64)
    top = int(gaps.max()) if gaps.size else 0
    j = 1
    while top >> (7 * j):
        lengths += gaps >= np.uint64(1 << (7 * j))
        j += 1
    return lengths


def _varint_encode(gaps: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The gaps as LEB128: 7 bits a byte, least significant first, the high bit set on all but a gap's last byte.

    Written one byte position at a time over the gaps still that long, so the loop runs per byte, not per gap.
    """
    ends = np.cumsum(lengths)
    if not ends.size or ends[-1] == gaps.size:  # every gap under 128, the common case at RL change rates
        return gaps.astype(np.uint8)
    starts = ends - lengths
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    more = lengths > 1
    out[starts] = (gaps & np.uint64(0x7F)).astype(np.uint8) | (more.view(np.uint8) << 7)
    live = np.flatnonzero(more)
    j = 1
    while live.size:
        more = lengths[live] > j + 1
        byte = (gaps[live] >> np.uint64(7 * j)) & np.uint64(0x7F)
        out[starts[live] + j] = byte.astype(np.uint8) | (more.astype(np.uint8) << 7)
        live = live[more]
        j += 1
    return out


def _sparse_index(stream: np.ndarray, k: int, num_elements: int) -> np.ndarray:
    """The changed indices a sparse delta's varint ``stream`` of ``k`` gaps names, checked to lie in the box."""
    # Every gap one byte (the common case at RL change rates): one pass finds it, and the stream is the gaps.
    single = bool(k) and stream.size == k and int(stream.max()) < 0x80
    if not single:
        ends = np.flatnonzero(stream < 0x80)  # the last byte of each varint has its high bit clear
        if ends.size != k or (stream.size and (not k or ends[-1] != stream.size - 1)):
            raise DeltaError(f"a sparse delta's index holds one varint per changed element ({k:,}); its "
                             f"{stream.size:,} bytes hold {ends.size:,} and end "
                             f"{'on a varint' if not stream.size or stream[-1] < 0x80 else 'midway'}: "
                             f"the message is corrupted")
        if not k:
            return np.empty(0, dtype=np.intp)
    if single:
        index = np.cumsum(stream, dtype=np.intp)
        index += np.arange(k, dtype=np.intp)
        if int(index[-1]) >= num_elements:
            raise DeltaError(f"a sparse delta's changed indices lie within its box of {num_elements:,} elements; "
                             f"its gaps reach past the end: the message is corrupted")
        return index
    # In place where a temporary can be spared: each fresh array of k elements is memory the kernel faults in (about
    # 40% of this function's time at RL change rates, in bench/delta_codec.py's apply)
    starts = np.empty_like(ends)
    starts[0] = 0
    np.add(ends[:-1], 1, out=starts[1:])
    lengths = np.subtract(ends, starts)
    lengths += 1
    longest = int(lengths.max())
    if longest > _MAX_VARINT_NBYTES:
        raise DeltaError(f"a sparse delta's gaps take at most {_MAX_VARINT_NBYTES} varint bytes; one takes "
                         f"{longest}: the message is corrupted")
    gaps = (stream[starts] & 0x7F).astype(np.uint64)
    live = np.flatnonzero(lengths > 1)
    j = 1
    while live.size:
        gaps[live] |= (stream[starts[live] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
        live = live[lengths[live] > j + 1]
        j += 1
    if int(gaps.max()) >= num_elements:
        raise DeltaError(f"a sparse delta's gaps lie within its box of {num_elements:,} elements; one is "
                         f"{int(gaps.max()):,}: the message is corrupted")
    gaps += np.uint64(1)
    index = np.cumsum(gaps, out=gaps)
    index -= np.uint64(1)
    # Each step adds at most num_elements, so a sum that wrapped past 2**64 shows as a step down.
    wrapped = k * num_elements >= 2**64 and bool(np.any(index[1:] <= index[:-1]))
    if wrapped or int(index[-1]) >= num_elements:
        raise DeltaError(f"a sparse delta's changed indices lie within its box of {num_elements:,} elements; its "
                         f"gaps reach past the end: the message is corrupted")
    return index.view(np.intp)  # every index is below num_elements, which indexes memory: no sign to lose
