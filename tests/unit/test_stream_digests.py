"""A stream's trailer names its digest: XXH3-64 for bytes, the GPU digest for CUDA IPC pieces; a receiver checks
the one its pieces call for and refuses a trailer of the other kind (`reshard.server.transport.moves`)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from reshard.plans import Transfer
from reshard.proto.devices import DeviceChecksum, device_digest
from reshard.proto.errors import DataLossError
from reshard.server.transport import moves
from reshard.server.transport.memory import MemoryNetwork, MemoryTransport
from reshard.server.transport.reduce import _ArraySink
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Piece, StreamKey, Trailer

BOX = ((0, 4), (0, 8))
DATA = np.arange(32, dtype=np.float32).reshape(4, 8)
T = Transfer(BOX, "a/0", ("b/0",), "p2p")


def _relay(trailer: Trailer):
    transport = MemoryTransport("b", MemoryNetwork())
    s = Session("job", "program", {0: "float32"}, {})
    out = np.zeros_like(DATA)
    items = [Piece(BOX, DATA.tobytes()), trailer]

    def verify(check, nbytes, digest):
        moves.verify_arrival(s.job, 0, T, 0, check, nbytes, digest, 4)

    confirmed = moves.relay(transport, s, StreamKey("job", 0, 0), "a", BOX, items, _ArraySink(out, BOX), [""],
                            None, verify)
    return confirmed, out


def test_a_byte_stream_checks_its_xxh3_trailer():
    confirmed, out = _relay(Trailer(DATA.nbytes, xxhash.xxh3_64_intdigest(DATA.tobytes())))
    assert confirmed == ["b"] and np.array_equal(out, DATA)


def test_a_byte_stream_whose_trailer_holds_the_gpu_digest_is_data_loss():
    with pytest.raises(DataLossError, match=r"carried host pieces but its trailer holds the GPU digest, not the "
                                            r"XXH3-64"):
        _relay(Trailer(DATA.nbytes, device_digest(DATA), device=True))


def test_the_gpu_digest_of_an_arrival_is_checked_like_xxh3():
    right = DeviceChecksum().update(DATA)
    moves.verify_arrival("job", 3, T, 0, right, DATA.nbytes, device_digest(DATA), 4)
    with pytest.raises(DataLossError, match=r"transfer 3 arrived with GPU digest [0-9a-f]{16}, but the sender sent "
                                            r"[0-9a-f]{16}"):
        moves.verify_arrival("job", 3, T, 0, right, DATA.nbytes, device_digest(DATA) ^ 1, 4)
