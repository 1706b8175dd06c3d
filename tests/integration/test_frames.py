"""Hand-encoded push messages are byte-for-byte the generated PushChunk, both ways; trailers carry XXH3-64."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.frames import RawPiece, decode_push_chunk, encode_piece, encode_whole
from reshard.proto.layout import Checksum
from reshard.proto.wire import verify_trailer


@pytest.mark.parametrize("box,n", [(((0, 3),), 3), (((2, 4), (0, 1000)), 2000), (((5, 6), (0, 0)), 0)])
def test_encoded_piece_is_the_generated_message(box, n):
    data = np.arange(n, dtype=np.int32)
    frame = encode_piece(box, data)
    generated = pb.PushChunk(piece=pb.Piece(box=pb.Box(lo=[lo for lo, _ in box], hi=[hi for _, hi in box]),
                                            data=data.tobytes()))
    assert frame == generated.SerializeToString()
    piece = decode_push_chunk(frame)
    assert isinstance(piece, RawPiece) and piece.box == box and piece.frame is frame
    assert bytes(piece.data) == data.tobytes()


def test_headers_and_trailers_decode_through_the_generated_classes():
    msg = pb.PushChunk(trailer=pb.Trailer(nbytes=7, xxh3_64=2**64 - 9))
    assert decode_push_chunk(msg.SerializeToString()) == msg
    msg = pb.PushChunk(header=pb.PushHeader(job="j", plan_id="p", transfer=1, hop=2, from_host="h"))
    assert decode_push_chunk(msg.SerializeToString()) == msg


def test_a_whole_push_is_the_generated_message_of_its_streams_messages():
    header = pb.PushChunk(header=pb.PushHeader(job="j", plan_id="p", transfer=1, hop=2, from_host="h"))
    trailer = pb.PushChunk(trailer=pb.Trailer(nbytes=20, xxh3_64=2**64 - 9))
    pieces = [(((0, 3),), np.arange(3, dtype=np.int32)), (((3, 5),), np.arange(2, dtype=np.int32))]
    frame = encode_whole([header.SerializeToString(), *(encode_piece(b, d) for b, d in pieces),
                          trailer.SerializeToString()])
    generated = pb.PushChunk(whole=pb.PushWhole(header=header.header, trailer=trailer.trailer, pieces=[
        pb.Piece(box=pb.Box(lo=[lo for lo, _ in b], hi=[hi for _, hi in b]), data=d.tobytes()) for b, d in pieces]))
    assert frame == generated.SerializeToString()
    assert decode_push_chunk(frame) == generated


def test_a_piece_with_fields_in_another_order_or_unknown_fields_still_decodes():
    box = pb.Box(lo=[1], hi=[3]).SerializeToString()
    unknown = bytes([7 << 3 | 0, 5])  # field 7, varint 5: ignored as proto3 does
    reordered = bytes([0x12, 8]) + b"abcdefgh" + unknown + bytes([0x0A, len(box)]) + box
    frame = bytes([0x12, len(reordered)]) + reordered
    got = decode_push_chunk(frame)
    assert got.box == ((1, 3),) and bytes(got.data) == b"abcdefgh"


def test_a_cut_off_piece_is_rejected_with_the_reason():
    frame = encode_piece(((0, 4),), np.arange(4, dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match="^a push message ends inside a varint; it was cut off$"):
        decode_push_chunk(frame[:1])
    with pytest.raises(InvalidArgumentError, match=r"^a push piece says it holds \d+ bytes, but its message ends after "
                                                   r"\d+; it was cut off$"):
        decode_push_chunk(frame[:-3])
    with pytest.raises(InvalidArgumentError, match="runs past the end"):
        decode_push_chunk(bytes([0x12, 4, 0x12, 10, 0, 0]))


def test_checksum_is_xxh3_64_of_the_bytes_in_order_however_they_were_cut():
    data = np.arange(1000, dtype=np.int32)
    whole, pieces = Checksum(), Checksum()
    whole.update(data)
    for a in range(0, 1000, 333):
        pieces.update(data[a:a + 333])
    assert whole.nbytes == pieces.nbytes == 4000
    assert whole.xxh3_64 == pieces.xxh3_64 == xxhash.xxh3_64_intdigest(data.tobytes())
    verify_trailer(whole, pb.Trailer(nbytes=4000, xxh3_64=whole.xxh3_64), 4000, "shard")
    with pytest.raises(InvalidArgumentError, match=r"shard: XXH3-64 [0-9a-f]{16} of the received bytes differs"):
        verify_trailer(whole, pb.Trailer(nbytes=4000, xxh3_64=whole.xxh3_64 ^ 1), 4000, "shard")
