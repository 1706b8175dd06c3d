"""The nixl transport's single copy between agents of one machine: a box that lands in a shared tile is copied straight
into it by the sender (counted), the mapping is kept across jobs and dropped when the tile is freed, nothing is shared
where UCX is kept off shared memory (``--nixl-tcp-only``), a corrupted byte still fails the job with DATA_LOSS, and a
segment goes only to a process of this user that names a live secret the receiver offered.

Agents of this process stand for agents of one machine: the sender maps the receiver's segments through the
receiver's socket as another process would."""

from __future__ import annotations

import gc
import os
import stat
from concurrent.futures import Future

import numpy as np
import pytest
import xxhash

from reshard.proto.errors import DataLossError
from reshard.server.transport import buffers, shm
from reshard.server.transport.faults import CorruptRelay
from reshard.server.transport.nixl import SHARED_CHUNK_BYTES, NixlTransport, nixl_missing
from reshard.server.transport.session import Session
from reshard.server.transport.streams import StreamKey, in_thread
from tests.unit.test_nixl import _broadcast_to_three
from tests.unit.test_runtime import Hosts, nixl_agents

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))

MiB = 1 << 20


def _pair(**kwargs) -> tuple[NixlTransport, NixlTransport]:
    a, b = (NixlTransport(h, chunk_bytes=MiB, timeout_s=5.0, stall_timeout_s=5.0, **kwargs) for h in ("a", "b"))
    a.add_peer("b", b.metadata())
    b.add_peer("a", a.metadata())
    return a, b


@pytest.fixture()
def pair():
    a, b = _pair()
    yield a, b
    a.close()
    b.close()


def _move(a: NixlTransport, b: NixlTransport, job: str, src: np.ndarray, tile: np.ndarray) -> list:
    """``src`` (1-D) from a into b's ``tile`` in place, with the digest known up front as the agent knows it; b's
    items."""
    digest: Future = Future()
    digest.set_result(xxhash.xxh3_64_intdigest(src.tobytes()))
    s = Session(job, "p", {0: src.dtype.name}, {})
    key = StreamKey(job, 0, 0)
    whole = ((0, len(src)),)
    sent = in_thread("send", a.send, s, key, "b", src, whole, whole, digest)
    items = list(b.arrivals(s, key, "a", whole, lambda sub: ("b/0", tile[sub[0][0]:sub[0][1]])))
    sent.result(10)
    return items


def test_a_box_that_lands_in_a_shared_tile_is_copied_straight_into_it_by_its_sender(pair):
    a, b = pair
    # two chunks, the second short: a copy into a shared segment goes in SHARED_CHUNK_BYTES, not the 1 MiB of a WRITE
    src = np.random.default_rng(0).integers(0, 255, SHARED_CHUNK_BYTES + 123, dtype=np.uint8)
    tile = buffers.empty((len(src),), "uint8")  # a host tile while a transport shares memory: a segment
    assert shm.segment_of(tile.base) is not None
    for job in ("job-1", "job-2"):
        src += 1  # other bytes into the same tile
        items = _move(a, b, job, src, tile)
        assert np.array_equal(tile, src)
        assert items[-1] == (src.nbytes, xxhash.xxh3_64_intdigest(src.tobytes()), False)
        assert all(p.landed == "b/0" for p in items[:-1])
        assert [p.data.nbytes for p in items[:-1]] == [SHARED_CHUNK_BYTES, 123]
    assert a.shared.bytes_sent == b.shared.bytes_received == 2 * src.nbytes  # every byte both jobs: no WRITE
    assert a.shared.mapped == 1  # mapped by the first job, kept for the second
    assert a.registered == 0  # nothing registered with NIXL on the sending side


def test_a_tile_the_receiver_frees_is_unmapped_by_its_sender_at_the_next_post(pair):
    a, b = pair
    src = np.ones(2 * MiB, np.uint8)
    tile = buffers.empty((len(src),), "uint8")
    _move(a, b, "first", src, tile)
    assert len(a.shared._maps) == 1
    del tile
    gc.collect()
    other = buffers.empty((len(src),), "uint8")
    _move(a, b, "second", src, other)  # its post names the freed segment gone
    assert len(a.shared._maps) == 1 and a.shared.mapped == 2  # the new tile's, not the freed one's
    assert np.array_equal(other, src)


def test_with_ucx_kept_to_tcp_nothing_is_shared_and_every_byte_goes_as_a_nixl_write(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # what --nixl-tcp-only sets before the agent's NIXL agent is made
    a, b = _pair()
    try:
        assert not a.shared.on and not b.shared.on
        src = np.random.default_rng(1).integers(0, 255, 2 * MiB, dtype=np.uint8)
        tile = np.zeros_like(src)
        _move(a, b, "tcp-only", src, tile)
        assert np.array_equal(tile, src)
        assert (a.shared.bytes_sent, b.shared.bytes_received, a.shared.mapped) == (0, 0, 0)
        assert a.registered == 1 and b.registered == 1  # the source and the tile: WRITEs
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("tls, allowed", [(None, True), ("tcp", False), ("rc,tcp", False), ("tcp,sm", True),
                                          ("posix,tcp", True), ("^sm", False), ("^cma,posix,sysv", False),
                                          ("^cma", True), ("^rc", True), ("all", True)])
def test_shared_memory_follows_what_ucx_may_use(tls, allowed):
    assert shm.allowed({} if tls is None else {"UCX_TLS": tls}) is allowed


def test_a_chain_over_shared_tiles_whose_middle_hop_corrupts_a_byte_fails_with_data_loss():
    agents = nixl_agents().agents
    hosts = Hosts(group=nixl_agents(), wrap=lambda host, t: CorruptRelay(t) if host == "host2" else t)
    before = {h: t.shared.bytes_received for h, t in agents.items()}
    try:
        a, job, runs, dst = _broadcast_to_three(hosts, shape=(1024, 512))  # 2 MiB tiles: shared
        with pytest.raises(DataLossError, match=r"the bytes changed somewhere on the chain host0 -> host1 -> host2 "
                                                r"-> host3, so the job fails and no host commits them"):
            hosts.finish(job, runs)
        assert {h: agents[h].shared.bytes_received - before[h] for h in ("host1", "host2", "host3")} == \
            dict.fromkeys(("host1", "host2", "host3"), a.nbytes)  # every hop copied in by its sender
        for h in ("host1", "host2", "host3"):
            assert hosts.stores[h].find("w", 2, f"{h}/0") is None, h
        assert np.array_equal(hosts.stores["host0"].get("w", 1, "host0/0").array, a)
    finally:
        hosts.close()


def test_a_segment_goes_only_to_who_names_a_secret_offered_for_a_stream_still_open(pair):
    a, b = pair
    tile = buffers.empty((2 * MiB,), "uint8")
    seg = shm.segment_of(tile.base)
    assert stat.S_IMODE(os.fstat(seg.fd).st_mode) == 0o600  # and in no directory: a memfd
    exporter = shm.exporter()
    assert exporter.address.startswith(b"\0reshard-shm-") and len(exporter.address) == 1 + 12 + 32  # 128 bits
    guessed = shm.Entry(seg.id, seg.addr, seg.nbytes, os.urandom(16))
    with pytest.raises(PermissionError, match=f"segment {seg.id} was not handed over"):
        shm.fetch(exporter.address, [guessed])
    offered: list[bytes] = []
    offer = shm.decode_offer(b.shared.offer("a", [tile.base], offered))
    (entry,) = offer.entries
    assert (entry.id, entry.nbytes) == (seg.id, seg.nbytes) and offered == [entry.secret]
    mapped = shm.fetch(exporter.address, [entry])[seg.id]  # while offered: the very memory
    mapped[:3] = (7, 8, 9)
    assert tile[:3].tolist() == [7, 8, 9]
    b.shared.withdraw(offered)  # the stream ended (or its first chunk came)
    with pytest.raises(PermissionError, match="was not handed over"):
        shm.fetch(exporter.address, [entry])


def test_a_peer_mapping_large_segments_does_not_hold_the_exporter_from_the_next(pair, monkeypatch):
    """Mapping a segment populates its pages, which takes a second or more for a large one on a loaded machine: a
    fetch takes every descriptor first and maps after hanging up, so a second peer asking the same exporter meanwhile
    is answered at once. (Mapping inside the conversation held the exporter for every segment of the first fetch,
    and peers behind it timed out and failed their streams: 8 nixl agents of one machine, 16 lanes each.)"""
    import mmap
    import threading
    import time
    import types

    a, b = pair
    tiles = [buffers.empty((2 * MiB,), "uint8") for _ in range(4)]
    offered: list[bytes] = []
    first = shm.decode_offer(b.shared.offer("a", [t.base for t in tiles[:3]], offered)).entries
    (second,) = shm.decode_offer(b.shared.offer("a", [tiles[3].base], offered)).entries
    assert len(first) == 3
    slow = threading.Event()

    def mapping(fd, nbytes, flags):  # the first fetch's maps take 0.8 s each; the second's are instant
        if threading.current_thread().name == "slow-fetch":
            slow.set()
            time.sleep(0.8)
        return mmap.mmap(fd, nbytes, flags)

    monkeypatch.setattr(shm, "mmap", types.SimpleNamespace(mmap=mapping, MAP_SHARED=mmap.MAP_SHARED,
                                                            MAP_POPULATE=mmap.MAP_POPULATE))
    monkeypatch.setattr(shm, "_CONNECT_S", 1.0)
    got: dict = {}
    fetching = threading.Thread(target=lambda: got.update(shm.fetch(shm.exporter().address, list(first))),
                                name="slow-fetch")
    fetching.start()
    assert slow.wait(5)
    t0 = time.monotonic()
    mapped = shm.fetch(shm.exporter().address, [second])[second.id]  # within 1 s, or socket.timeout
    assert time.monotonic() - t0 < 0.5
    fetching.join(10)
    mapped[:2] = (5, 6)
    assert tiles[3][:2].tolist() == [5, 6]
    assert sorted(got) == sorted(e.id for e in first)
    b.shared.withdraw(offered)


def test_a_mapping_is_populated_while_the_agents_other_threads_run():
    """A peer's segment is mapped with its pages faulted in (the mapping is reused across jobs), without the GIL:
    Python's MAP_POPULATE holds it for the whole populate (2 GiB: 1.9 s here, the agent's heartbeat stopped with the
    rest), so a thread that ticks beside it must tick on, and the pages must be there afterwards (RssShmem)."""
    import threading
    import time

    def shared_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))

    nbytes = 256 * MiB
    fd = os.memfd_create("reshard-test")
    try:
        os.ftruncate(fd, nbytes)
        ticks, populating, done = [], threading.Event(), threading.Event()

        def tick():
            populating.wait()
            while not done.is_set():
                ticks.append(1)
                time.sleep(0.001)

        ticker = threading.Thread(target=tick)
        ticker.start()
        before = shared_kib()
        populating.set()
        mapped = shm._populated(fd, nbytes)
        done.set()
        ticker.join()
        assert shared_kib() - before >= 0.9 * nbytes / 1024  # faulted in up front
        assert len(ticks) >= 5, f"the ticking thread ran {len(ticks)} times while {nbytes >> 20} MiB populated"
        mapped[-1] = 3
        assert os.pread(fd, 1, nbytes - 1) == b"\x03"
        del mapped
    finally:
        os.close(fd)
