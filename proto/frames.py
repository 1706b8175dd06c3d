"""Push stream messages encoded and decoded by hand, so tensor bytes are copied as little as possible.

The bytes on the wire are exactly ``PushChunk`` messages of ``reshard.proto``;
only the Python side differs. The generated classes copy a piece's data three
times on the way in (gRPC buffer to ``bytes``, into the parser, out to a new
``bytes`` on access) and three on the way out. Here a received piece's data is a
``memoryview`` into the one ``bytes`` gRPC hands over, the same ``bytes`` is
what a chain hop sends on unchanged, and a sender builds each message with one
copy of the tensor's bytes. Headers and trailers go through the generated code. A small push goes whole, as one
``PushChunk.whole`` (`encode_whole`), whose body is the stream's own messages one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from reshard.box import Box
from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.wire import box_from_pb, box_to_pb

__all__ = ["RawPiece", "encode_piece", "encode_whole", "decode_push_chunk"]

# Field numbers of reshard.proto: PushChunk.piece = 2, PushChunk.whole = 5, Piece.box = 1, Piece.data = 2.
_LEN = 2  # wire type of length-delimited fields
_PUSH_PIECE = 2 << 3 | _LEN
_PUSH_WHOLE = 5 << 3 | _LEN
_PIECE_BOX = 1 << 3 | _LEN
_PIECE_DATA = 2 << 3 | _LEN


@dataclass(frozen=True)
class RawPiece:
    """A decoded piece: its box, its bytes (a view into ``frame``) and the whole message as received."""

    box: Box
    data: memoryview
    frame: bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(buf):
            raise InvalidArgumentError("a push message ends inside a varint; it was cut off")
        if shift > 63:  # else a frame of continuation bytes costs time quadratic in its length, before any check
            raise InvalidArgumentError("a push message holds a varint longer than 10 bytes; protobuf writes at most 10")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def encode_piece(box: Box, data) -> bytes:
    """``PushChunk(piece=Piece(box=box, data=data))`` serialised; ``data`` is any C-contiguous buffer."""
    view = memoryview(data).cast("B")
    box_bytes = box_to_pb(box).SerializeToString()
    head = bytes([_PIECE_BOX]) + _varint(len(box_bytes)) + box_bytes
    if len(view):  # proto3 leaves an empty bytes field out
        head += bytes([_PIECE_DATA]) + _varint(len(view))
    return b"".join((bytes([_PUSH_PIECE]), _varint(len(head) + len(view)), head, view))


def encode_whole(messages: list[bytes]) -> bytes:
    """``PushChunk(whole=PushWhole(...))`` serialised from a push's ``messages`` as they would stream (its header, its
    pieces as `encode_piece` writes them, its trailer, each a ``PushChunk``): `PushWhole` numbers its fields as
    ``PushChunk`` does, so its body is those messages one after the other."""
    size = sum(map(len, messages))
    return b"".join((bytes([_PUSH_WHOLE]), _varint(size), *messages))


def _skip(buf: bytes, i: int, wire: int) -> int:
    if wire == 0:
        return _read_varint(buf, i)[1]
    if wire == 1:
        return i + 8
    if wire == 5:
        return i + 4
    if wire == _LEN:
        n, i = _read_varint(buf, i)
        return i + n
    raise InvalidArgumentError(f"a push message holds a field of wire type {wire}, which reshard.proto never uses")


def decode_push_chunk(frame: bytes):
    """A `RawPiece` for a piece, else the generated ``PushChunk`` (header, trailer)."""
    if not frame or frame[0] != _PUSH_PIECE:
        return pb.PushChunk.FromString(frame)
    n, start = _read_varint(frame, 1)
    end = start + n
    if end > len(frame):
        raise InvalidArgumentError(f"a push piece says it holds {n} bytes, but its message ends after "
                                   f"{len(frame) - start}; it was cut off")
    if end != len(frame):
        # Not the one-field message encode_piece writes (e.g. extra fields): take the general path.
        msg = pb.PushChunk.FromString(frame)
        if msg.WhichOneof("kind") != "piece":
            return msg
        return RawPiece(box_from_pb(msg.piece.box), memoryview(msg.piece.data), frame)
    box, data, i = None, memoryview(b""), start
    view = memoryview(frame)
    while i < end:
        tag, i = _read_varint(frame, i)
        if tag == _PIECE_BOX or tag == _PIECE_DATA:
            size, i = _read_varint(frame, i)
            if i + size > end:
                raise InvalidArgumentError("a push piece field runs past the end of its message")
            if tag == _PIECE_BOX:
                box = pb.Box.FromString(frame[i:i + size])
            else:
                data = view[i:i + size]
            i += size
        else:
            i = _skip(frame, i, tag & 7)
    if i != end:
        raise InvalidArgumentError("a push piece's fields run past the end of its message")
    return RawPiece(box_from_pb(box) if box is not None else (), data, frame)
