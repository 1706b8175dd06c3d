"""How tensor bytes are laid out on the wire: dtypes, chunk boxes, checksums.

numpy only, so domain code on both sides may use it. A shard or transfer box
travels as a sequence of sub-boxes in C order, each at most ``chunk_bytes``
long, followed by the total byte count and a CRC-32 of all the bytes in order.
numpy has no bfloat16: those elements are held as ``uint16`` of the same bits.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np

from reshard.box import Box, volume
from reshard.dtypes import dtype_name, itemsize

__all__ = ["np_dtype", "chunk_boxes", "Checksum", "tile_shape"]


def np_dtype(dtype) -> np.dtype:
    """The numpy dtype that holds elements of ``dtype`` (bfloat16 as uint16 bits)."""
    name = dtype_name(dtype)
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)


def tile_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def chunk_boxes(box: Box, dtype, chunk_bytes: int) -> Iterator[Box]:
    """Cut ``box`` into C-ordered sub-boxes of at most ``chunk_bytes`` (at least one element each)."""
    size = itemsize(dtype)
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


class Checksum:
    """Running byte count and CRC-32 over a stream's bytes."""

    __slots__ = ("nbytes", "crc32")

    def __init__(self):
        self.nbytes = 0
        self.crc32 = 0

    def update(self, data: bytes) -> None:
        self.nbytes += len(data)
        self.crc32 = zlib.crc32(data, self.crc32)
