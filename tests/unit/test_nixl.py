"""What is the nixl transport's own: memory registered once and reused across jobs, a strided box written run by run
into the middle of a destination tile, chains and buckets over one-sided WRITEs, a corrupting middle hop caught at
the chain's end, a peer that never takes its stream named within the timeout, and agents that cost nothing idle.

NIXL agents in this process write into each other's memory (UCX, no GPU needed); the tests the other transports
run (chains, reduces, uneven tiles, many jobs at once) run on nixl too, through tests/unit/test_runtime.py's
``hosts`` and ``group`` fixtures."""

from __future__ import annotations

import mmap
import signal
import subprocess
import sys
import time
from concurrent.futures import Future

import numpy as np
import pytest
import xxhash

from reshard import Mesh, Sharding
from reshard.many import plan_many
from reshard.proto.errors import DataLossError, UnavailableError
from reshard.server.transport.faults import CorruptRelay
from reshard.server.transport.nixl import TCP_MIN_RUN_BYTES, NixlTransport, nixl_missing
from reshard.server.transport import nixl_runs
from reshard.server.transport.nixl_runs import pair_descs, pair_runs, place_runs, segment_runs
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Piece, Segments, StreamKey, Trailer, in_thread
from reshard.strategies import plan as make_plan
from tests.unit.test_many_runtime import _move_bucket_by_bucket, _start, row_split_state_dict
from tests.unit.test_runtime import Hosts, nixl_agents

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))

@pytest.fixture()
def pair():
    """Two agents, a and b, introduced to each other; streams wait 0.5 s for a peer."""
    a, b = (NixlTransport(h, chunk_bytes=64 << 10, timeout_s=0.5, stall_timeout_s=0.5) for h in ("a", "b"))
    a.add_peer("b", b.metadata())
    b.add_peer("a", a.metadata())
    yield a, b
    a.close()
    b.close()


def _placing(device: str, tile: np.ndarray):
    """A `Sink.place` of one tile that holds the whole array: the region of a sub-box where it is contiguous."""
    def place(sub):
        view = tile[tuple(slice(lo, hi) for lo, hi in sub)]
        return (device, view) if view.flags.c_contiguous else None
    return place


def _move(a: NixlTransport, b: NixlTransport, job: str, src: np.ndarray, box, place) -> tuple[list[Piece], Trailer]:
    """Stream ``box`` of ``src`` (the whole array) from a to b; b's pieces and trailer."""
    s = Session(job, "p", {0: src.dtype.name}, {})
    key = StreamKey(job, 0, 0)
    sent = in_thread("send", a.send, s, key, "b", src, tuple((0, n) for n in src.shape), box)
    items = list(b.arrivals(s, key, "a", box, place))
    sent.result(5)
    return items[:-1], items[-1]


def test_each_buffer_is_registered_once_and_reused_by_the_next_job(pair):
    a, b = pair
    src = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)  # 512 KiB: 8 chunks
    dst = np.zeros_like(src)
    full = ((0, 256), (0, 512))
    for job in ("job-1", "job-2"):
        src += 1  # the second job moves other bytes into the same buffers
        pieces, trailer = _move(a, b, job, src, full, _placing("b/0", dst))
        assert len(pieces) == 8 and all(p.landed == "b/0" for p in pieces)  # written in place, no scratch
        assert trailer == (src.nbytes, xxhash.xxh3_64_intdigest(src.tobytes()), False)
        assert np.array_equal(dst, src)
    # the source tile (written from directly, not staged) and the destination tile, once each for both jobs
    assert (a.registered, b.registered) == (1, 1)
    del pieces, dst
    assert b.registrations == 0  # a buffer that is freed is deregistered first


def test_the_trailer_rides_on_the_chunk_that_fills_the_box_and_goes_alone_after_a_frame_shorter_than_its_post(pair,
                                                                                                            monkeypatch):
    """A box in one chunk (most streams of a bucketed sync) costs one notification, not two: its trailer goes with
    the chunk that fills the posted runs. Where the stream ends short of its post (a delta frame, posted at the most
    it may take), the trailer goes alone."""
    from reshard.server.transport.nixl_memory import decode

    a, b = pair
    kinds = []
    notify = a._notify

    def counted(peer: str, msg: bytes) -> None:
        kinds.append(decode(msg)[0])
        notify(peer, msg)

    monkeypatch.setattr(a, "_notify", counted)
    src = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)  # 16 KiB: one chunk
    pieces, trailer = _move(a, b, "one-chunk", src, ((0, 64), (0, 64)), lambda sub: None)
    assert len(pieces) == 1 and bytes(memoryview(pieces[0].data)) == src.tobytes()
    assert trailer == (src.nbytes, xxhash.xxh3_64_intdigest(src.tobytes()), False)
    assert b"T" not in kinds  # a WRITE's own notification, or an "s" for a copy into a shared tile
    s = Session("short", "p", {0: "uint8"}, {})
    key = StreamKey("short", 0, 0)
    out = in_thread("send", lambda: (o := a.open(s, key, "b"), o.put(((0, 100),), np.ones(100, np.uint8)),
                                     o.end(100, xxhash.xxh3_64_intdigest(b"\x01" * 100)), o.wait(5)))
    items = list(b.arrivals(s, key, "a", ((0, 256),), lambda sub: None))  # posted for 256 bytes, sent 100
    out.result(5)
    assert kinds[-1] == b"T" and items[-1].nbytes == 100 and bytes(items[0].data) == b"\x01" * 100


def test_a_strided_box_lands_run_by_run_in_the_middle_of_a_destination_tile(pair):
    a, b = pair
    src = np.random.default_rng(1).standard_normal((64, 1024)).astype(np.float32)
    tile = np.full((64, 1024), -1.0, np.float32)
    box = ((16, 48), (256, 768))  # 32 runs of 2 KiB, 2 KiB apart
    pieces, trailer = _move(a, b, "strided", src, box, _placing("b/0", tile))
    inside = (slice(16, 48), slice(256, 768))
    assert np.array_equal(tile[inside], src[inside])
    tile[inside] = -1.0
    assert (tile == -1.0).all()  # not a byte written outside the box
    assert all(p.landed == "b/0" for p in pieces) and b.scratch_bytes == 0  # in place: no scratch buffer
    joined = b"".join(bytes(memoryview(p.data)) for p in pieces)  # pieces in C order of the box
    assert joined == np.ascontiguousarray(src[inside]).tobytes()
    assert trailer.digest == xxhash.xxh3_64_intdigest(joined)


def test_over_tcp_alone_a_box_of_short_runs_lands_through_scratch_and_long_runs_in_place(monkeypatch):
    """Over TCP every run of a WRITE is a message of its own: runs averaging under `TCP_MIN_RUN_BYTES` land in
    scratch and are copied into place; longer ones still land in place."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    a, b = (NixlTransport(h, chunk_bytes=1 << 20, timeout_s=5, stall_timeout_s=5, shared_memory=False) for h in "ab")
    try:
        a.add_peer("b", b.metadata())
        b.add_peer("a", a.metadata())
        assert (a.min_run_bytes, b.min_run_bytes) == (TCP_MIN_RUN_BYTES, TCP_MIN_RUN_BYTES)
        src = np.random.default_rng(2).standard_normal((64, 32768)).astype(np.float32)  # 128 KiB a row
        for job, cols, in_place in (("short", (256, 768), False), ("long", (0, 32768), True)):
            tile = np.full_like(src, -1.0)
            box = ((16, 48), cols)  # 32 runs of 2 KiB, or 32 of 128 KiB (each row whole: one run)
            pieces, trailer = _move(a, b, job, src, box, _placing("b/0", tile))
            inside = tuple(slice(lo, hi) for lo, hi in box)
            joined = b"".join(bytes(memoryview(p.data)) for p in pieces)  # what the sink writes where it landed not
            assert joined == np.ascontiguousarray(src[inside]).tobytes() and trailer.nbytes == len(joined)
            assert all((p.landed == "b/0") == in_place for p in pieces), job
            if in_place:
                assert np.array_equal(tile[inside], src[inside])
                tile[inside] = -1.0
            assert (tile == -1.0).all()  # through scratch, not a byte written into the tile
        assert b.scratch_bytes > 0  # kept from the short runs' stream
    finally:
        a.close()
        b.close()


def test_a_strided_source_box_is_written_from_the_tile_itself_with_no_staging_copy(pair):
    """With the box's digest known (the agent digests held shards early) the sender hands each chunk over as its
    region of the source tile (`Outgoing.put_region`): WRITEs from the tile's runs, no packed or staged copy."""
    a, b = pair
    src = np.random.default_rng(3).standard_normal((8, 8192)).astype(np.float32)
    box = ((0, 8), (2048, 6144))  # 8 runs of 16 KiB in the source tile, 16 KiB apart: two chunks of 64 KiB
    want = np.ascontiguousarray(src[:, 2048:6144])
    digest: Future = Future()
    digest.set_result(xxhash.xxh3_64_intdigest(want.tobytes()))
    s = Session("in-place", "p", {0: "float32"}, {})
    key = StreamKey("in-place", 0, 0)
    sent = in_thread("send", a.send, s, key, "b", src, ((0, 8), (0, 8192)), box, digest)
    items = list(b.arrivals(s, key, "a", box, lambda sub: None))
    sent.result(5)
    pieces, trailer = items[:-1], items[-1]
    assert [p.box for p in pieces] == [((0, 4), (2048, 6144)), ((4, 8), (2048, 6144))]
    assert b"".join(bytes(memoryview(p.data)) for p in pieces) == want.tobytes()
    assert trailer == (want.nbytes, digest.result(), False)
    assert a.scratch_bytes == 0  # nothing staged on the sender
    assert a.registered == 1  # the source tile itself, once


@pytest.mark.parametrize("shared, gbps, ahead", [(False, 1.0, False), (False, 100.0, True), (True, 1.0, True),
                                                  (False, 0.0, True)])
def test_a_box_bound_over_a_nic_hashing_outpaces_is_digested_as_it_goes_not_ahead(shared, gbps, ahead):
    """Where every stream crosses a NIC of at most `HASH_IN_STREAM_GBPS` (no shared memory), each chunk's hash
    costs the stream nothing, and a pass ahead would take the sender's cores as every host starts: no box is
    digested ahead. A faster NIC, shared memory (a peer on this machine takes a stream at memory speed) or no rate
    known: contiguous boxes and long runs are. Short runs never are (the send packs them)."""
    t = NixlTransport("d", chunk_bytes=64 << 10, timeout_s=0.5, shared_memory=shared, nic_gbps=gbps)
    try:
        tile = np.zeros((64, 8192), dtype=np.float32)
        assert t.hash_in_stream == (not ahead)
        assert t.digest_ahead(tile[:8]) == ahead  # contiguous
        assert t.digest_ahead(tile[:, :4096]) == ahead  # 16 KiB runs: written from the tile as they lie
        assert not t.digest_ahead(tile[:, :512])  # 2 KiB runs: packed chunk by chunk as they go
    finally:
        t.close()


def test_one_write_pairs_local_and_remote_runs_cut_wherever_either_ends():
    local = (np.array([1000, 2000], np.int64), np.array([0, 6, 10], np.int64))  # runs of 6 and 4 bytes
    remote = (np.array([50, 80, 90], np.int64), np.array([0, 3, 8, 20], np.int64))  # 3, 5, 12 bytes
    mine, theirs = pair_runs(local, remote, 2, 10)  # the chunk is bytes 2..12 of the remote runs
    assert mine.tolist() == [[1000, 1], [1001, 5], [2000, 4]]
    assert theirs.tolist() == [[52, 1], [80, 5], [90, 4]]


def _runs(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    lens = rng.integers(1, 40, size=count)
    return rng.integers(1, 1 << 40, size=count), np.concatenate(([0], np.cumsum(lens)))


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "numpy"])
def test_a_write_s_descriptors_are_the_paired_runs_with_each_side_s_device(compiled, monkeypatch):
    """`pair_descs` cuts as `pair_runs` does, in the compiled kernel or in numpy, for any runs and any chunk of the
    remote side; the kernel refuses runs too short for the chunk instead of reading past them."""
    if compiled and nixl_runs._kernel is None:
        pytest.fail("reshard._delta_kernel is not built: pip compiles it at install time where a C compiler is found")
    if not compiled:
        monkeypatch.setattr(nixl_runs, "_kernel", None)
    rng = np.random.default_rng(7)
    for case in range(300):
        la, lc = _runs(rng, int(rng.integers(1, 9)))
        n = int(lc[-1])
        ra, rc = _runs(rng, int(rng.integers(1, 30)))
        if rc[-1] < n:
            rc[-1] = n + int(rng.integers(0, 50))
        off = int(rng.integers(0, rc[-1] - n + 1))
        mine, theirs = pair_runs((la, lc), (ra, rc), off, n)
        local, remote = pair_descs((la, lc), (ra, rc), off, n, 3, 5)
        assert local.dtype == remote.dtype == np.uint64
        assert local[:, :2].astype(np.int64).tolist() == mine.tolist()
        assert remote[:, :2].astype(np.int64).tolist() == theirs.tolist()
        assert set(local[:, 2].tolist()) <= {3} and set(remote[:, 2].tolist()) <= {5}
        assert int(local[:, 1].sum()) == n
    if compiled:
        short = (np.array([50], np.int64), np.array([0, 8], np.int64))
        with pytest.raises(ValueError, match="remote one of at least off"):
            pair_descs((np.array([1000], np.int64), np.array([0, 10], np.int64)), short, 0, 10)


def test_a_column_split_box_lands_at_its_rows_stride_asking_the_sink_for_two_rows_not_each():
    tile = np.zeros((64, 256), np.float32)
    calls = []

    def place(sub):
        calls.append(sub)
        return _placing("b/0", tile)(sub)

    box = ((0, 64), (64, 128))  # 64 rows of 256 bytes, 1 KiB apart
    device, owners, runs, segments = place_runs(box, place, 1000)
    assert device == "b/0" and len(owners) == 1 and owners[0] is tile and not segments
    assert runs == [(tile[i, 64:].ctypes.data, 256) for i in range(64)]
    assert len(calls) == 3  # the whole box, then its first and last row
    calls.clear()
    assert place_runs(box, place, 63) is None and len(calls) == 3  # more runs than allowed: no call per row either
    assert place_runs(((0, 64), (0, 256)), place, 1) == ("b/0", [tile], [(tile.ctypes.data, tile.nbytes)], False)
    top, bottom = tile[:32], np.zeros((32, 256), np.float32)  # rows in two tiles on two devices: found row by row

    def two(sub):
        (r0, r1), cols = sub
        return (_placing("b/0", top)(sub) if r1 <= 32 else
                _placing("b/1", bottom)(((r0 - 32, r1 - 32), cols)) if r0 >= 32 else None)

    assert place_runs(box, two, 1000) is None
    assert place_runs(((0, 32), (64, 128)), two, 1000)[2] == [(top[i, 64:].ctypes.data, 256) for i in range(32)]


def test_a_buckets_regions_give_the_runs_place_runs_finds_with_their_buffers_and_views_in_one_pass():
    # members in tiles of their own, and small members packed into one buffer (adjacent ones are one run), as a
    # bucket's sink offers them (`buckets._Unpack._scattered`)
    tiles = [np.zeros((64, 64), np.float32) for _ in range(3)]
    rest = np.zeros(300, np.uint8)
    flat = [t.reshape(-1).view(np.uint8) for t in tiles]
    parts = Segments([flat[0], rest[:100], rest[100:250], flat[1], rest[250:250], flat[2][:8192], rest[250:]])
    nbytes = parts.nbytes
    device, owners, runs, segments = place_runs(((0, nbytes),), lambda b: ("b/0", parts), 1000)
    got_owners, keys, got_runs, views = segment_runs(parts, 1000)
    python = nixl_runs._segment_runs(parts, 1000)  # where the C kernel is not built: the same
    assert python[1:3] == (keys, got_runs) and [id(o) for o in python[0]] == [id(o) for o in got_owners]
    assert [(v.ctypes.data, v.nbytes) for v in python[3]] == [(v.ctypes.data, v.nbytes) for v in views]
    assert segments and got_runs == runs and [id(o) for o in got_owners] == [id(o) for o in owners]
    assert keys == [(o.ctypes.data, o.nbytes) for o in owners]
    assert [(v.ctypes.data, v.nbytes, v.dtype) for v in views] == [(a, n, np.uint8) for a, n in runs]
    assert runs[1] == (rest.ctypes.data, 250)  # the two packed members, adjacent: one run
    for runs_of in (segment_runs, nixl_runs._segment_runs):
        assert runs_of(parts, len(runs) - 1) is None  # more runs than allowed
        assert runs_of(Segments([tiles[0][:, :32]]), 1000) is None  # not C-contiguous
        assert runs_of(Segments([memoryview(rest)]), 1000) is None  # not a numpy view


def test_a_box_with_no_region_to_land_in_arrives_through_a_scratch_buffer(pair):
    a, b = pair
    src = np.arange(100_000, dtype=np.int64).reshape(1000, 100)
    pieces, trailer = _move(a, b, "scratch", src, ((0, 1000), (0, 100)), lambda sub: None)
    assert all(p.landed is None for p in pieces)
    assert b"".join(bytes(memoryview(p.data)) for p in pieces) == src.tobytes()
    assert trailer == (src.nbytes, xxhash.xxh3_64_intdigest(src.tobytes()), False)
    assert b.scratch_bytes >= src.nbytes  # kept for the next stream


def _broadcast_to_three(hosts: Hosts, shape=(256, 64)):
    """A broadcast from host0 down the chain host1 -> host2 -> host3; returns (array, job, runs, dst)."""
    src = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    dst = Sharding(Mesh.from_hosts({"x": 3}, ["host1", "host2", "host3"], 1), (None, None))
    a = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    hosts.put_tensor("w", a, src)
    plan = make_plan(a.shape, a.dtype, src, dst, strategy="broadcast").validate()
    assert [t.route for t in plan.transfers] == [("host1", "host2", "host3")]
    job, runs = hosts.start(plan.dumps(), "w")
    return a, job, runs, dst


def test_a_chain_of_three_hosts_forwards_every_chunk_and_delivers_bit_exact():
    hosts = Hosts(group=nixl_agents())
    try:
        a, job, runs, dst = _broadcast_to_three(hosts)
        hosts.finish(job, runs)
        assert np.array_equal(hosts.get("w", dst, a.shape), a)
        # each hop forwarded the whole box once (64 KiB in 16 chunks), the sender sent it once
        assert dict(runs["host0"].traffic.bytes_out) == {"host1": a.nbytes}
        assert dict(runs["host1"].traffic.bytes_out) == {"host2": a.nbytes}
        assert dict(runs["host2"].traffic.bytes_out) == {"host3": a.nbytes}
        assert dict(runs["host3"].traffic.bytes_in) == {"host2": a.nbytes}
    finally:
        hosts.close()


def test_a_bucketed_state_dict_moves_over_nixl():
    hosts = Hosts(group=nixl_agents())
    try:
        _move_bucket_by_bucket(hosts)
    finally:
        hosts.close()


def test_memory_a_peer_knew_is_never_offered_to_peers_again_once_freed(pair):
    """A peer that loaded a buffer's metadata keeps it after the buffer is freed (NIXL cannot make it forget one),
    and would match a WRITE into a new buffer overlapping it against the stale one (NIXL_ERR_NOT_FOUND: seen as
    "could not start" when glibc handed a freed 1 KiB tile's memory to a 1.5 KiB one). Such memory is never offered
    again; memory no peer knew is reused freely."""
    import gc
    import mmap

    a, _ = pair
    memory = a._memory
    heap = mmap.mmap(-1, 1 << 20)  # buffers of their own at chosen addresses, as malloc would hand them out

    def buffer(offset_kib: int, kib: int) -> np.ndarray:
        return np.frombuffer(heap, dtype=np.uint8, count=kib << 10, offset=offset_kib << 10)

    known, unknown = buffer(128, 128), buffer(512, 128)
    memory.metadata_for(memory.register(known), "b")
    memory.register(unknown)
    del known, unknown
    gc.collect()
    assert not memory.usable(buffer(192, 128)) and not memory.usable(buffer(128, 128))
    assert not memory.usable(buffer(0, 129))
    assert memory.usable(buffer(0, 128)) and memory.usable(buffer(256, 128)) and memory.usable(buffer(512, 128))
    # what would land there lands in a buffer of the transport's own pool, which no freed buffer ever overlaps
    tile = buffer(160, 128)
    landing = a._landing(((0, 100_000),), 100_000, _placing("b/0", tile[:100_000]), "b")
    assert landing.device is None and memory.usable(landing.views[0]) and a.scratch_bytes >= 100_000
    landing.release()
    # a tile clear of it lands in place
    landing = a._landing(((0, 100_000),), 100_000, _placing("b/0", buffer(256, 128)[:100_000]), "b")
    assert landing.device == "b/0"
    landing.release()


def test_a_posts_owners_register_together_only_where_every_one_is_usable(pair):
    """`Registry.register_usable` (one pass for a post's few hundred tiles) answers as `usable` and `register` one
    by one: None where any owner overlaps memory a peer knew, each owner's own registration otherwise, the same one
    `register` makes and keeps."""
    import gc
    import mmap

    a, _ = pair
    memory = a._memory
    heap = mmap.mmap(-1, 1 << 20)

    def buffer(offset_kib: int, kib: int) -> np.ndarray:
        return np.frombuffer(heap, dtype=np.uint8, count=kib << 10, offset=offset_kib << 10)

    known = buffer(128, 128)
    memory.metadata_for(memory.register(known), "b")
    del known
    gc.collect()  # freed after a peer knew it: buried
    clear = [buffer(512, 64), buffer(640, 64)]
    made = memory.registered
    assert memory.register_usable([clear[0], buffer(192, 64), clear[1]]) is None
    assert memory.registered == made  # refused before any registration
    regs = memory.register_usable(clear)
    assert regs is not None and [memory.register(o) for o in clear] == regs and memory.registered == made + 2


def test_a_scratch_buffer_is_mapped_past_a_freed_range_its_peers_knew_however_large(pair):
    """A freed tile a peer knew leaves a range never offered again; the kernel places a new mapping in the first
    gap it fits, so scratch buffers of the same size would fall in that range one after another (a tile of 1 GiB
    holds 16384 of 64 KiB): the pool asks for a mapping larger than the range and takes the start of it."""
    a, _ = pair
    probe = mmap.mmap(-1, 64 << 10)
    at = np.frombuffer(probe, dtype=np.uint8).ctypes.data  # where a 64 KiB mapping goes next
    probe.close()
    a._memory._bury(at - (1 << 30), at + (1 << 20))
    buf = a._scratch(64 << 10)
    first = np.frombuffer(a._pool._maps[0], dtype=np.uint8).ctypes.data
    assert at - (1 << 30) <= first < at + (1 << 20), "the first mapping fell outside the freed range"
    assert a._memory.usable(buf) and len(a._pool._maps) >= 2
    assert a.scratch_bytes == 64 << 10  # the larger mapping's rest is address space, never touched
    buf[:] = 7  # memory of its own
    a._unscratch(buf)


def test_a_buffer_registered_to_send_from_over_memory_a_peer_knew_is_not_offered_to_it_either(pair):
    """A tile registered to be sent from (no peer learns of it, so it was never checked against freed memory)
    and then received into must not be offered where it overlaps memory the sender knew: the sender's NIXL looks
    a WRITE's target up among the regions it loaded, sorted, and the stale one starting inside the tile hides
    the tile from every WRITE past that start ("could not start": the ring of tests/unit/test_ring.py failed so,
    one run in eight, where a ring member sends from its accumulator and receives into it)."""
    import gc
    import mmap

    a, b = pair
    heap = mmap.mmap(-1, 1 << 20)  # buffers of their own at chosen addresses, as malloc would hand them out

    def buffer(offset_kib: int, kib: int) -> np.ndarray:
        return np.frombuffer(heap, dtype=np.uint8, count=kib << 10, offset=offset_kib << 10)

    old = buffer(256, 64)
    src = np.random.default_rng(5).integers(0, 255, 256 << 10, dtype=np.uint8)
    _move(a, b, "first", src[:64 << 10], ((0, 64 << 10),), _placing("b/0", old))  # a loads old's metadata
    assert np.array_equal(old, src[:64 << 10])
    del old
    gc.collect()  # freed: a still knows it
    tile = buffer(128, 256)  # over the freed one, starting below it
    b._memory.register(tile)  # as sending from it does
    assert not b._memory.usable(tile)
    pieces, trailer = _move(a, b, "second", src, ((0, 256 << 10),), _placing("b/0", tile))
    assert all(p.landed is None for p in pieces)  # through scratch: the tile was not offered
    assert trailer.digest == xxhash.xxh3_64_intdigest(src.tobytes())
    assert b"".join(bytes(memoryview(p.data)) for p in pieces) == src.tobytes()


@pytest.mark.parametrize("kind", ["nixl", "memory"])
def test_a_bucket_goes_from_its_members_source_tiles_into_their_destination_tiles(kind):
    """A weight sync's buckets on nixl: every member contiguous at both ends and its tiles large enough to be
    recycled (64 KiB at the source, 128 KiB at the destination), so the sender WRITEs each from its source tile
    into its destination tile and no host takes a bucket buffer (packed bytes, or bytes waiting to be unpacked);
    the memory transport, which packs, takes one per bucket on each end."""
    hosts = Hosts(group=nixl_agents() if kind == "nixl" else None)
    try:
        tensors = row_split_state_dict(12, rows=1024)
        for name, (a, decl, _) in tensors.items():
            hosts.put_tensor(name, a, decl.src)
        program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=512 * 1024).validate()
        assert len(program.buckets) >= 4
        job, runs = _start(hosts, program, {n: 1 for n in tensors})
        hosts.finish(job, runs)
        for name, (a, decl, _) in tensors.items():
            assert np.array_equal(hosts.get(name, decl.dst, a.shape, 2), a), name
        taken = {h: store.host_bytes for h, store in hosts.stores.items()}
        if kind == "nixl":
            assert taken == dict.fromkeys(hosts.stores, 0)
        else:
            assert all(taken.values()), taken
    finally:
        hosts.close()


def test_a_middle_hop_that_corrupts_a_byte_fails_the_job_with_data_loss_and_nothing_commits():
    hosts = Hosts(group=nixl_agents(), wrap=lambda host, t: CorruptRelay(t) if host == "host2" else t)
    try:
        a, job, runs, dst = _broadcast_to_three(hosts)
        with pytest.raises(DataLossError, match=r"the bytes changed somewhere on the chain host0 -> host1 -> host2 "
                                                r"-> host3, so the job fails and no host commits them"):
            hosts.finish(job, runs)
        for h in ("host1", "host2", "host3"):
            assert hosts.stores[h].find("w", 2, f"{h}/0") is None, h
        assert np.array_equal(hosts.stores["host0"].get("w", 1, "host0/0").array, a)
    finally:
        hosts.close()


def test_a_peer_that_never_takes_its_stream_fails_it_within_the_timeout_naming_the_host(pair):
    a, b = pair
    s = Session("lost", "p", {0: "float32"}, {})
    key = StreamKey("lost", 0, 0)
    data = np.ones(1024, np.float32)
    out = a.open(s, key, "b")
    t0 = time.monotonic()
    with pytest.raises(UnavailableError, match=r"job lost: host b did not post its receive of stream 0 of step 0 "
                                               r"within 0.5s: its agent is down, paused, cut off or behind"):
        out.put(((0, 1024),), data)
    assert time.monotonic() - t0 < 1.5
    out.cancel()
    # and a receiver whose sender never sends
    t0 = time.monotonic()
    with pytest.raises(UnavailableError, match=r"job lost: host a sent nothing of stream 1 of step 0 within 0.5s"):
        list(b.arrivals(s, StreamKey("lost", 0, 1), "a", ((0, 1024),), lambda sub: None))
    assert time.monotonic() - t0 < 1.5


def test_a_sender_that_gives_up_midway_fails_its_receiver_at_once(pair):
    a, b = pair
    s = Session("gone", "p", {0: "float32"}, {})
    key = StreamKey("gone", 0, 0)
    got: list = []

    def receive():
        got.extend(b.arrivals(s, key, "a", ((0, 4096),), lambda sub: None))

    receiving = in_thread("receive", receive)
    out = a.open(s, key, "b")
    out.put(((0, 1024),), np.ones(1024, np.float32))  # the receiver posted; a first chunk, then the job fails
    out.cancel()
    t0 = time.monotonic()
    with pytest.raises(UnavailableError, match="job gone: host a gave up stream 0 of step 0"):
        receiving.result(5)
    assert time.monotonic() - t0 < 0.3  # not the 0.5 s stall limit
    assert not any(isinstance(item, Trailer) for item in got)


def test_a_sender_is_confirmed_as_its_chunks_land_while_the_receiver_is_still_busy_with_them(pair):
    """The sender's wait ends once every chunk and the trailer landed, not once the receiver took them in: a reader
    busy with the first piece for three times the stall limit (a chain hop forwarding it, a serving host whose lanes
    are full) fails no sender, and still gets every byte."""
    a, b = pair
    s = Session("busy", "p", {0: "float32"}, {})
    key = StreamKey("busy", 0, 0)
    src = np.random.default_rng(3).standard_normal(4 * (64 << 10) // 4).astype(np.float32)  # four chunks
    got: list = []

    def receive():
        for item in b.arrivals(s, key, "a", ((0, src.size),), lambda sub: None):
            if not got:
                time.sleep(1.5)
            got.append(bytes(memoryview(item.data)) if isinstance(item, Piece) else item)

    receiving = in_thread("receive", receive)
    t0 = time.monotonic()
    a.send(s, key, "b", src, ((0, src.size),), ((0, src.size),))
    assert time.monotonic() - t0 < 1.0  # confirmed before the reader came back
    receiving.result(5)
    assert b"".join(got[:-1]) == src.tobytes() and got[-1].nbytes == src.nbytes
    assert not b._progress._landed and not b._progress._busy()  # nothing left to poll for: the agent idles


# A receiving agent in a process of its own, so that it can die with a WRITE into it under way
_RECEIVER = """
import sys
from reshard.server.transport.nixl import NixlTransport
from reshard.server.transport.session import Session
from reshard.server.transport.streams import StreamKey
c = NixlTransport("c", chunk_bytes=1 << 20, timeout_s=30, stall_timeout_s=30, shared_memory=False)
print("MD", c.metadata().hex(), flush=True)  # NIXL's own log lines go to stdout too
c.add_peer("a", bytes.fromhex(sys.stdin.readline()))
n = int(sys.argv[1])
s = Session("dies", "p", {0: "uint8"}, {})
if sys.argv[2:] == ["post-only"]:  # take a first stream (connected both ways), then post a second into new memory (its
    import threading, time     # registration goes with the post), say so, and wait to be killed
    for item in c.arrivals(s, StreamKey("dies", 0, 0), "a", ((0, 1024),), lambda sub: None):
        pass
    time.sleep(1.0)  # the sender has its confirmation and polls no more: the post waits unread until it does
    items = c.arrivals(s, StreamKey("dies", 0, 1), "a", ((0, n),), lambda sub: None)
    threading.Thread(target=lambda: next(items), daemon=True).start()
    time.sleep(0.5)
    print("POSTED", flush=True)
    time.sleep(60)
for item in c.arrivals(s, StreamKey("dies", 0, 0), "a", ((0, n),), lambda sub: None):
    pass
"""


def _receiver(n: int, *mode: str) -> tuple[subprocess.Popen, bytes]:
    """The receiving agent's process, and its NIXL metadata."""
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(n), *mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    return child, bytes.fromhex(next(line for line in child.stdout if line.startswith("MD "))[3:].strip())


def test_a_write_into_an_agent_that_died_fails_only_its_own_stream_naming_the_host(monkeypatch):
    """Every poll of an agent's notifications polls all its WRITEs under way, another job's too: one into a killed
    agent (NIXL_ERR_REMOTE_DISCONNECT) fails the stream it belongs to, naming the host, and no other."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # over loopback's TCP, 128 MiB are still under way when the receiver dies
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    n = 128 << 20
    child, metadata = _receiver(n)
    a, b = (NixlTransport(h, chunk_bytes=n, timeout_s=5, stall_timeout_s=1, shared_memory=False) for h in "ab")
    try:
        a.add_peer("c", metadata)
        child.stdin.write(a.metadata().hex() + "\n")
        child.stdin.flush()
        a.add_peer("b", b.metadata())
        b.add_peer("a", a.metadata())
        dying = Session("dies", "p", {0: "uint8"}, {})
        out = a.open(dying, StreamKey("dies", 0, 0), "c")
        out.put(((0, n),), np.ones(n, np.uint8))
        out.end(n, 0)  # the chunk that fills the box goes with its trailer
        assert a._agent.check_xfer_state(next(iter(a._progress.inflight))) == "PROC"  # the WRITE is under way
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        # another job's stream, while the dead WRITE is still polled with every notification
        src = np.arange(4096, dtype=np.float32)
        pieces, trailer = _move(a, b, "lives", src, ((0, 4096),), lambda sub: None)
        assert trailer.nbytes == src.nbytes
        assert b"".join(bytes(p.data) for p in pieces) == src.tobytes()
        with pytest.raises(UnavailableError, match="job dies: a WRITE of stream 0 of step 0 to host c failed"):
            out.wait(5)
    finally:
        child.kill()
        a.close()
        b.close()


def test_a_post_from_an_agent_that_died_before_it_was_read_fails_its_stream_naming_the_host(monkeypatch):
    """A post carries the memory the receiver registered since (NIXL partial metadata), loaded as the post is read:
    from an agent that died meanwhile it cannot load, and the stream waiting for it fails naming the host."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    child, metadata = _receiver(4 << 20, "post-only")
    a = NixlTransport("a", chunk_bytes=1 << 20, timeout_s=5, stall_timeout_s=1, shared_memory=False)
    try:
        a.add_peer("c", metadata)
        child.stdin.write(a.metadata().hex() + "\n")
        child.stdin.flush()
        s = Session("dies", "p", {0: "uint8"}, {})
        a.send(s, StreamKey("dies", 0, 0), "c", np.ones(1024, np.uint8), ((0, 1024),), ((0, 1024),))
        next(line for line in child.stdout if line.startswith("POSTED"))
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        out = a.open(s, StreamKey("dies", 0, 1), "c")
        with pytest.raises(UnavailableError, match=r"job dies: host c posted stream 1 of step 0, but the memory it "
                                                   r"named could not be loaded here \(.*\): its agent went away"):
            out.put(((0, 4 << 20),), np.ones(4 << 20, np.uint8))
        out.cancel()
    finally:
        child.kill()
        a.close()


def test_idle_agents_burn_no_cpu(pair):
    a, b = pair
    _move(a, b, "warm", np.ones((64, 64), np.float32), ((0, 64), (0, 64)), lambda sub: None)  # connected
    t0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.1  # no progress thread: nothing runs between transfers


def test_streams_waiting_on_a_silent_peer_leave_the_polling_to_one_thread(pair, monkeypatch):
    """Eight receives posted to a peer that sends nothing: only the agent's progress thread polls NIXL (each
    waiting thread polled for itself before, thousands of wake-ups a sync on 2 shared cores), and every wait still
    gives up on time, naming the host."""
    import threading

    a, b = pair
    callers = set()
    pump = b._progress.pump

    def counted() -> bool:
        callers.add(threading.current_thread().name)
        return pump()

    monkeypatch.setattr(b._progress, "pump", counted)
    s = Session("quiet", "p", {0: "float32"}, {})
    waits = [in_thread(f"recv-{i}", lambda i=i: list(b.arrivals(s, StreamKey("quiet", 0, i), "a", ((0, 64),),
                                                                      lambda sub: None))) for i in range(8)]
    for i, wait in enumerate(waits):
        with pytest.raises(UnavailableError, match=f"job quiet: host a sent nothing of stream {i} of step 0 within "
                                                   f"0.5s"):
            wait.result(10)
    assert callers == {"nixl-progress-b"}


def test_a_job_that_fails_elsewhere_stops_its_streams_waits_at_once(monkeypatch):
    """A receive waiting on a silent peer and a send waiting for a post that never comes give up as soon as their
    job fails elsewhere (another stream, an abort): the failure wakes the agent's waiters (`Progress.wake_all`),
    not their next look at the job (`CHECK_S`, made a minute here), nor their timeout (a minute too)."""
    from reshard.server.transport import nixl_progress

    monkeypatch.setattr(nixl_progress, "CHECK_S", 60.0)
    a, b = (NixlTransport(h, chunk_bytes=64 << 10, timeout_s=60, stall_timeout_s=60) for h in ("a", "b"))
    try:
        a.add_peer("b", b.metadata())
        b.add_peer("a", a.metadata())
        s = Session("doomed", "p", {0: "float32", 1: "float32"}, {})
        a.attach(s)  # as the runtime does when it prepares a job
        b.attach(s)
        src = np.ones(64, np.float32)
        receive = in_thread("recv", lambda: list(b.arrivals(s, StreamKey("doomed", 0, 0), "a", ((0, 64),),
                                                            lambda sub: None)))
        send = in_thread("send", a.send, s, StreamKey("doomed", 1, 0), "b", src, ((0, 64),), ((0, 64),))
        time.sleep(0.3)  # both wait: b for a's chunks, a for b's post
        assert not receive.done() and not send.done()
        s.fail(UnavailableError("job doomed: host c's stream failed"))
        for wait in (receive, send):
            with pytest.raises(UnavailableError, match="host c's stream failed"):
                wait.result(20)
    finally:
        a.close()
        b.close()


def test_the_polls_shortest_pause_is_a_fortieth_of_a_chunks_time_on_the_nic():
    """1 MiB chunks on the emulated hosts' 1 Gbit/s links take 8.4 ms: polls 210 us apart while notifications
    come, not 20 us (CPU the agents sharing cores spend on bytes); a 400 Gbit/s NIC's 16 MiB chunk keeps 20 us."""
    from reshard.server.common.config import AgentConfig
    from reshard.server.transport.nixl_progress import POLL_MAX_S, POLL_MIN_S, Backoff, shortest_pause

    def agent(gbps: float) -> AgentConfig:
        return AgentConfig(host="h", num_devices=1, planner="p:1", nic_gbps=gbps)

    assert shortest_pause(agent(1).nixl_chunk, 1) == pytest.approx((1 << 20) * 8 / 1e9 / 40)
    assert shortest_pause(agent(10).nixl_chunk, 10) == pytest.approx((4 << 20) * 8 / 10e9 / 40)
    assert shortest_pause(agent(400).nixl_chunk, 400) == POLL_MIN_S
    assert shortest_pause(64 << 20, 0.1) == POLL_MAX_S and shortest_pause(1 << 20, 0) == POLL_MIN_S
    backoff = Backoff(200e-6)
    backoff.idle()
    assert backoff.pause == 400e-6
    backoff.busy()
    assert backoff.pause == 200e-6
    t = NixlTransport("p", chunk_bytes=1 << 20, timeout_s=1, poll_pause_s=200e-6)
    try:
        assert t._progress.least_pause_s == 200e-6
    finally:
        t.close()


def test_metadata_nixl_cannot_load_is_refused_naming_the_host(pair):
    """The planner hands out what agents registered; bytes that are no NIXL agent's are a caller's mistake, named
    as such, and the peers already known stay usable."""
    from reshard.proto.errors import InvalidArgumentError

    a, b = pair
    with pytest.raises(InvalidArgumentError, match=r"the NIXL metadata given for host c \(9 bytes\) is not an "
                                                   r"agent's that NIXL can load here"):
        a.add_peer("c", b"not nixl!")
    src = np.arange(128 * 128, dtype=np.float32).reshape(128, 128)  # 64 KiB: a tile that lands in place
    dst = np.zeros_like(src)
    whole = ((0, 128), (0, 128))
    _move(a, b, "after-bad-metadata", src, whole, _placing("b/0", dst))
    assert np.array_equal(dst, src)


def test_a_stream_posted_before_its_lane_runs_lands_there_and_one_no_lane_took_is_released(pair):
    """`prepost` (a run's first receives, posted as it begins): the sender WRITEs into the region posted early, and
    `arrivals` takes that post instead of making another; a post no lane took is released by `detach`."""
    a, b = pair
    src = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)  # 64 KiB: one chunk
    dst = np.zeros_like(src)
    full = ((0, 64), (0, 256))
    s = Session("early", "p", {0: src.dtype.name}, {})
    key = StreamKey("early", 0, 0)
    assert b.prepost(s, key, "a", full, _placing("b/0", dst))
    sent = in_thread("send", a.send, s, key, "b", src, full, full)
    sent.result(5)  # the sender finished on the early post alone: no lane of b's asked for the stream yet
    assert np.array_equal(dst, src)
    items = list(b.arrivals(s, key, "a", full, lambda sub: pytest.fail("posted again")))
    assert items[-1] == (src.nbytes, xxhash.xxh3_64_intdigest(src.tobytes()), False)
    assert not b._preposted and not b._progress._landed

    gone = Session("failed", "p", {0: src.dtype.name}, {})
    assert b.prepost(gone, StreamKey("failed", 0, 0), "a", full, _placing("b/0", np.zeros_like(src)))
    assert b._preposted and b._progress._landed  # posted, and polled for
    b.detach(gone)  # its run failed before a lane took it
    assert not b._preposted and not b._progress._landed
