"""How tensor bytes are laid out on the wire: dtypes, chunk boxes, checksums.

numpy only, so domain code on both sides may use it. A shard or transfer box
travels as a sequence of sub-boxes in C order, each at most ``chunk_bytes``
long, followed by the total byte count and an XXH3-64 digest of all the bytes in
order (the ``xxhash`` package: about 6x the speed of zlib's CRC-32, so the check
every receiver runs before commit costs little next to the bytes' own copy).
numpy has no bfloat16 or float8: their elements are held as unsigned integers of
the same bits (``uint16``, ``uint8``; `reshard.dtypes.BITS_DTYPES`), which is all a
byte stream and its digest need.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import xxhash

from reshard.box import Box, volume
from reshard.dtypes import holder_name, itemsize

try:  # built by pip where a C compiler is present (reshard.delta's sparse passes, and a digest of strided bytes)
    from reshard import _delta_kernel as _kernel
except ImportError:
    _kernel = None

__all__ = ["np_dtype", "chunk_boxes", "Checksum", "digest", "tile_shape"]


_HOLDERS: dict[str, np.dtype] = {}  # dtype name -> np_dtype: an agent asks for it per tile and per piece


def np_dtype(dtype) -> np.dtype:
    """The numpy dtype that holds elements of ``dtype`` (bfloat16 as uint16 bits, float8 as uint8 bits)."""
    held = _HOLDERS.get(dtype) if type(dtype) is str else None
    if held is None:
        held = np.dtype(holder_name(dtype))  # raises for a name reshard does not know: only known ones are kept
        if type(dtype) is str:
            _HOLDERS[dtype] = held
    return held


def tile_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def chunk_boxes(box: Box, dtype, chunk_bytes: int) -> Iterator[Box]:
    """Cut ``box`` into C-ordered sub-boxes of at most ``chunk_bytes`` (at least one element each).

    An empty box (a trailing tile that torch.chunk leaves empty) has no sub-boxes: its
    stream is a header and a trailer of 0 bytes.
    """
    size = itemsize(dtype)
    if box and any(hi <= lo for lo, hi in box):
        return
    if volume(box) * size <= chunk_bytes or not box:
        yield box
        return
    (lo, hi), rest = box[0], box[1:]
    row = volume(rest) * size if rest else size
    if row > chunk_bytes and rest:
        for i in range(lo, hi):
            for sub in chunk_boxes(rest, dtype, chunk_bytes):
                yield ((i, i + 1),) + sub
        return
    step = max(1, chunk_bytes // row)
    for a in range(lo, hi, step):
        yield ((a, min(a + step, hi)),) + rest


def digest(data) -> int:
    """XXH3-64 of one C-contiguous buffer: what a `Checksum` fed the same bytes in pieces reports."""
    return xxhash.xxh3_64_intdigest(data)


def digest_views(*views: np.ndarray) -> int:
    """`digest` of numpy arrays' bytes in C order, one after another, each of any strides. C-contiguous ones go to
    xxhash (its vector code is picked for this CPU: about twice the compiled kernel's baseline build); where one is
    strided, the compiled delta kernel reads them all where they lie (`reshard._delta_kernel.digest`: no packed
    copy), else each is packed first."""
    if len(views) == 1 and views[0].flags.c_contiguous:
        return xxhash.xxh3_64_intdigest(views[0])
    if _kernel is not None and not all(v.flags.c_contiguous for v in views):
        return _kernel.digest(*views)
    check = xxhash.xxh3_64()
    for v in views:
        check.update(np.ascontiguousarray(v))
    return check.intdigest()


class Checksum:
    """Running byte count and XXH3-64 digest over a stream's bytes, however they were cut into pieces.

    ``digest=False`` counts bytes only: a chain hop that forwards every byte it
    keeps leaves the digest to the chain's last hop (the agents' ``verify_arrival``).
    """

    __slots__ = ("nbytes", "_hash")

    def __init__(self, digest: bool = True):
        self.nbytes = 0
        self._hash = xxhash.xxh3_64() if digest else None

    def update(self, data) -> None:
        """Add a C-contiguous bytes-like object (bytes, memoryview, numpy array) to the stream."""
        self.nbytes += memoryview(data).nbytes
        if self._hash is not None:
            self._hash.update(data)

    @property
    def digests(self) -> bool:
        return self._hash is not None

    @property
    def xxh3_64(self) -> int:
        """The digest so far, as an unsigned 64-bit integer."""
        if self._hash is None:
            raise AssertionError("this Checksum counts bytes only")
        return self._hash.intdigest()
