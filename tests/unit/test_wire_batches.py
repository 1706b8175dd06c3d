"""Several shards in one stream (`proto.wire.shard_streams`): small ones whole, many to a message; each read back
(`unbatched`, `read_shard_stream`) with the checks a shard sent as header, pieces and trailer gets."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.wire import _MESSAGE_SLACK, box_to_pb, read_shard_stream, shard_streams, unbatched


def _shards(sizes: list[int]) -> list[tuple[pb.ShardHeader, np.ndarray]]:
    out = []
    for k, n in enumerate(sizes):
        tile = np.arange(k * 1000, k * 1000 + n, dtype=np.float32).reshape(n, 1)
        out.append((pb.ShardHeader(tensor=f"t{k}", device="h/0", dtype="float32", box=box_to_pb(((0, n), (0, 1)))),
                    tile))
    return out


def test_small_shards_go_whole_many_to_a_message_and_a_large_one_in_chunks_and_all_read_back_in_order():
    chunk = 64 << 10
    shards = _shards([4, 300, 0, 9000, 17, 40000, 2])  # an empty tile; 9000 and 40000 floats: 36 and 160 KiB
    messages = list(shard_streams(shards, chunk))
    kinds = [m.WhichOneof("kind") for m in messages]
    # the first five fit one message; 40000 (over the chunk) goes as header, 3 pieces and trailer; 2 after it
    assert kinds == ["batch", "header", "piece", "piece", "piece", "trailer", "batch"], kinds
    assert [len(m.batch.shards) for m in messages if m.WhichOneof("kind") == "batch"] == [5, 1]
    # a batch is cut where the next shard would take it past the chunk
    assert [len(m.batch.shards) for m in shard_streams(_shards([9000, 9000]), 64 << 10)] == [1, 1]
    assert all(m.ByteSize() <= chunk + _MESSAGE_SLACK for m in messages)
    stream = unbatched(messages)
    for header, tile in shards:
        got_header, got = read_shard_stream(stream)
        assert got_header == header and np.array_equal(got.reshape(tile.shape), tile)
    assert next(stream, None) is None


def test_a_batched_shard_whose_bytes_do_not_match_its_digest_or_box_is_refused_naming_it():
    (message,) = shard_streams(_shards([8, 8]), 1 << 20)
    # an empty tile's data may not be replaced by bytes, nor a tile's by none
    (empty,) = shard_streams(_shards([0]), 1 << 20)
    empty.batch.shards[0].data = b"\0" * 4
    with pytest.raises(InvalidArgumentError, match=r"piece \[\(0, 0\), \(0, 1\)\] lies outside the tile"):
        read_shard_stream(unbatched([empty]))
    (eight,) = shard_streams(_shards([8]), 1 << 20)
    eight.batch.shards[0].data = b""
    with pytest.raises(InvalidArgumentError, match=r"received 0 bytes, sender sent 0, the box holds 32"):
        read_shard_stream(unbatched([eight]))
    flipped = pb.ShardChunk()
    flipped.CopyFrom(message)
    flipped.batch.shards[1].data = b"\x01" + flipped.batch.shards[1].data[1:]
    stream = unbatched([flipped])
    read_shard_stream(stream)  # the first is whole
    with pytest.raises(InvalidArgumentError, match=r"shard of device 'h/0': XXH3-64 .* differs from the sender's"):
        read_shard_stream(stream)
    short = pb.ShardChunk()
    short.CopyFrom(message)
    short.batch.shards[0].data = short.batch.shards[0].data[:-4]
    with pytest.raises(InvalidArgumentError, match=r"piece \[\(0, 8\), \(0, 1\)\] carries 28 bytes but"):
        read_shard_stream(unbatched([short]))
