"""Conversions between the core's values and the generated messages, and shard streams."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Optional

import numpy as np

from reshard.box import Box, to_slices
from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.layout import Checksum, chunk_boxes, digest, np_dtype, tile_shape

__all__ = ["box_to_pb", "box_from_pb", "shard_stream", "shard_streams", "read_shard_stream", "unbatched", "run_start",
           "message_size_options"]

# A message carries one chunk plus its box and framing.
_MESSAGE_SLACK = 2**16


def message_size_options(send_chunk_bytes: int, receive_chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel and server options that admit chunks of these sizes."""
    return [("grpc.max_send_message_length", send_chunk_bytes + _MESSAGE_SLACK),
            ("grpc.max_receive_message_length", receive_chunk_bytes + _MESSAGE_SLACK)]


def box_to_pb(box: Box) -> pb.Box:
    return pb.Box(lo=[lo for lo, _ in box], hi=[hi for _, hi in box])


def box_from_pb(msg: pb.Box) -> Box:
    if len(msg.lo) != len(msg.hi):
        raise InvalidArgumentError(f"box has {len(msg.lo)} lower and {len(msg.hi)} upper bounds; they must match")
    return tuple(zip(msg.lo, msg.hi))


def shard_stream(array: np.ndarray, header: pb.ShardHeader, chunk_bytes: int) -> Iterator[pb.ShardChunk]:
    """Header, the tile's bytes in chunks, and a trailer; ``array`` is the tile ``header.box``."""
    tile = box_from_pb(header.box)
    yield pb.ShardChunk(header=header)
    check = Checksum()
    for sub in chunk_boxes(tile, header.dtype, chunk_bytes):
        data = np.ascontiguousarray(array[to_slices(sub, tile)]).tobytes()
        check.update(data)
        yield pb.ShardChunk(piece=pb.Piece(box=box_to_pb(sub), data=data))
    yield pb.ShardChunk(trailer=pb.Trailer(nbytes=check.nbytes, xxh3_64=check.xxh3_64))


def shard_streams(shards: Iterable[tuple[pb.ShardHeader, np.ndarray]], chunk_bytes: int) -> Iterator[pb.ShardChunk]:
    """Several shards in one stream: each small one whole, as many to a `pb.ShardBatch` message as fit in
    ``chunk_bytes`` (gRPC's Python streams cost each message ~0.2 ms of CPU at each end, which a state dict of
    thousands of tiny tensors paid three times a shard); a larger one as its header, pieces and trailer
    (`shard_stream`). ``array`` is the tile ``header.box``."""
    batch: list[pb.WholeShard] = []
    size = 0
    for header, array in shards:
        nbytes = array.nbytes + header.ByteSize() + 32  # the data, its header, the digest and the fields' framing
        if batch and size + nbytes > chunk_bytes:
            yield pb.ShardChunk(batch=pb.ShardBatch(shards=batch))
            batch, size = [], 0
        if nbytes > chunk_bytes:
            yield from shard_stream(array, header, chunk_bytes)
            continue
        data = np.ascontiguousarray(array).tobytes()
        batch.append(pb.WholeShard(header=header, data=data, xxh3_64=digest(data)))
        size += nbytes
    if batch:
        yield pb.ShardChunk(batch=pb.ShardBatch(shards=batch))


def unbatched(chunks: Iterable[pb.ShardChunk]) -> Iterator[pb.ShardChunk]:
    """``chunks`` with each whole shard of a batch (`shard_streams`) as the header, one piece of its whole tile and
    the trailer it would have gone as, for `read_shard_stream` to check as it checks those."""
    for msg in chunks:
        if msg.WhichOneof("kind") != "batch":
            yield msg
            continue
        for whole in msg.batch.shards:
            yield pb.ShardChunk(header=whole.header)
            if whole.data:  # an empty tile goes as `shard_stream` sends it: no piece (a piece's box holds elements)
                yield pb.ShardChunk(piece=pb.Piece(box=whole.header.box, data=whole.data))
            yield pb.ShardChunk(trailer=pb.Trailer(nbytes=len(whole.data), xxh3_64=whole.xxh3_64))


def read_shard_stream(chunks: Iterable[pb.ShardChunk], check_header=None, *, or_end: bool = False,
                      with_digest: bool = False) -> Optional[tuple]:
    """Assemble a shard from a stream, checking every piece lies in the tile and the trailer matches; returns
    (header, array), and with ``with_digest`` a third item: the XXH3-64 of the tile's bytes in C order where its
    pieces came in that order (as `shard_stream` sends them), else None.

    ``check_header(header)`` may reject the stream before any bytes are read. A stream may carry several shards
    in a row, each a header, its pieces and a trailer: called again on the same iterator, this reads the next one;
    with ``or_end`` the stream may end instead (None), as it does after its last shard.
    """
    it = iter(chunks)
    first = next(it, None)
    if first is None and or_end:
        return None
    if first is None or first.WhichOneof("kind") != "header":
        raise InvalidArgumentError("a shard stream must open with a header naming tensor, device, dtype and box")
    header = first.header
    if check_header is not None:
        check_header(header)
    tile = box_from_pb(header.box)
    dtype = np_dtype(header.dtype)
    out = np.empty(tile_shape(tile), dtype=dtype)
    check = Checksum()
    in_order = True
    for msg in it:
        kind = msg.WhichOneof("kind")
        if kind == "piece":
            sub = write_piece(out, tile, msg.piece, dtype)
            in_order = in_order and run_start(tile, sub) * dtype.itemsize == check.nbytes
            check.update(msg.piece.data)
        elif kind == "trailer":
            verify_trailer(check, msg.trailer, out.nbytes, f"shard of device {header.device!r}")
            if not with_digest:
                return header, out
            return header, out, check.xxh3_64 if in_order else None
        else:
            raise InvalidArgumentError("a shard stream carries, per shard, one header, then pieces, then one trailer")
    raise InvalidArgumentError(
        f"shard stream for device {header.device!r} ended after {check.nbytes} bytes without a trailer; "
        f"the upload was cut off"
    )


def run_start(tile: Box, box: Box) -> int:
    """The element at which ``box`` starts in ``tile``'s C order, where its elements are one run there (every dim
    before its first of more than one element holds one, every dim after it the tile's whole extent), else -1."""
    lens = [hi - lo for lo, hi in box]
    first = next((d for d, n in enumerate(lens) if n != 1), len(lens))
    if any(lens[d] != hi - lo for d, (lo, hi) in enumerate(tile) if d > first):
        return -1
    start = 0
    for (lo, _), (t_lo, t_hi) in zip(box, tile):
        start = start * (t_hi - t_lo) + lo - t_lo
    return start


def write_piece(out: np.ndarray, tile: Box, piece: pb.Piece, dtype: np.dtype) -> Box:
    """Write a piece into ``out`` (which holds ``tile``), checking it fits; return its box."""
    sub = box_from_pb(piece.box)
    if len(sub) != len(tile) or any(s0 < t0 or s1 > t1 or s0 >= s1 for (s0, s1), (t0, t1) in zip(sub, tile)):
        raise InvalidArgumentError(f"piece {list(sub)} lies outside the tile {list(tile)}")
    shape = tile_shape(sub)
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(piece.data) != expected:
        raise InvalidArgumentError(
            f"piece {list(sub)} carries {len(piece.data)} bytes but {shape} elements of {dtype} need {expected}"
        )
    out[to_slices(sub, tile)] = np.frombuffer(piece.data, dtype=dtype).reshape(shape)
    return sub


def verify_trailer(check: Checksum, trailer: pb.Trailer, expected_nbytes: int, what: str) -> None:
    if check.nbytes != trailer.nbytes or check.nbytes != expected_nbytes:
        raise InvalidArgumentError(
            f"{what}: received {check.nbytes} bytes, sender sent {trailer.nbytes}, the box holds {expected_nbytes}"
        )
    if check.xxh3_64 != trailer.xxh3_64:
        raise InvalidArgumentError(
            f"{what}: XXH3-64 {check.xxh3_64:016x} of the received bytes differs from the sender's "
            f"{trailer.xxh3_64:016x}"
        )
