"""Delta moves on the agents (issue 40): the frame a delta stream carries (`server.transport.deltas`), and moves of
tensors named in ``delta_bases`` over the agents' runtimes in one process: the in-memory transport, a real gloo
group and NIXL agents. The senders hold the base version in the source sharding, the receivers its copy in the
destination sharding; every result is bit-exact, the wire carries only the frame, and a base that differs or a
frame that was changed fails the job naming the rule, with nothing committed."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from reshard import Mesh, Sharding, TensorDecl
from reshard import delta as delta_codec
from reshard.cost import network_copies
from reshard.delta import hasher as running_digest
from reshard.many import plan_many
from reshard.program import MOVE
from reshard.proto import layout
from reshard.proto.errors import DataLossError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from reshard.proto.layout import digest, np_dtype
from reshard.routes import hops
from reshard.server.agent.buckets import bucket_moves
from reshard.server.common.contract import DELTA_BASE_MISMATCH
from reshard.server.transport import deltas
from reshard.server.transport.deltas import (HEAD, DeltaStream, Segment, apply_frame, encode_frame, frame_ranges,
                                             read_head)
from reshard.server.transport.faults import CorruptFrame, DeltaBaseDiffers
from reshard.server.transport.streams import Segments
from reshard.strategies import plan as make_plan
from tests.unit.test_runtime import _SEQ, HOSTS, Hosts, nixl_agents

SRC_BASE, DST_BASE, NEW = 1, 7, 2  # the base pair's versions, and the version moved (which commits as NEW + 1)


# -- the frame ----------------------------------------------------------------------------------------------------


def _stream(pairs: list[tuple[np.ndarray | None, np.ndarray]], held: list[np.ndarray | None] | None = None):
    """A `DeltaStream` of one segment per (old, new) pair (old None: no base), the receiver's bases ``held``
    (default: the sender's), and the new box's packed bytes."""
    segments, at = [], 0
    for k, (old, new) in enumerate(pairs):
        n = new.nbytes
        segments.append(Segment(f"t{k}", f"store{k}", ((0, new.size),), at, at + n, new.dtype.itemsize,
                                None if old is None else (SRC_BASE, DST_BASE)))
        at += n
    olds = [None if o is None else np.frombuffer(o.tobytes(), np.uint8) for o, _ in pairs]
    held = olds if held is None else [None if h is None else np.frombuffer(h.tobytes(), np.uint8) for h in held]
    d = DeltaStream(3, "host0/0", tuple(segments), at, lambda k: olds[k], lambda device, k: held[k])
    new = np.frombuffer(b"".join(n.tobytes() for _, n in pairs), np.uint8)
    return d, new


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _changed(a: np.ndarray, rng, share: float) -> np.ndarray:
    out = a.copy()
    flat = out.reshape(-1).view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")
    idx = rng.choice(flat.size, max(1, int(flat.size * share)), replace=False)
    flat[idx] ^= 1
    return out


@pytest.fixture(params=["compiled", "numpy"])
def codec(request, monkeypatch):
    """A frame test on both codecs: the compiled passes (`reshard._delta_kernel`, built wherever `make test` runs)
    and numpy's, which an install without a C compiler runs; their frames must be the same bytes."""
    if request.param == "numpy":
        monkeypatch.setattr(delta_codec, "_kernel", None)
        monkeypatch.setattr(layout, "_kernel", None)
    elif delta_codec._kernel is None:
        pytest.fail("reshard._delta_kernel is not built: pip compiles it at install time where gcc or cc is on the "
                    "PATH (pip install -e . again, and see the build log for the compiler's error)")
    return request.param


@pytest.mark.usefixtures("codec")
def test_a_frame_of_a_one_percent_change_is_small_and_applies_bit_exact():
    rng = np.random.default_rng(0)
    old = rng.standard_normal((64, 48)).astype(np.float32)
    new = _changed(old, rng, 0.01)
    d, packed = _stream([(old, new)])
    frame = encode_frame("j", d, packed)
    assert frame.nbytes < new.nbytes / 10
    assert frame.wire == {"t0": frame.nbytes} and frame.full == {"t0": new.nbytes}
    assert bytes(frame.data[:4]) == b"RSDF" and HEAD.unpack_from(frame.data)[3] == new.nbytes
    out = apply_frame("j", d, frame.data, "host1/0")
    assert out.tobytes() == new.tobytes()
    # the head goes alone, the rest in pieces of chunk_bytes
    ranges = list(frame_ranges(frame.nbytes, 100))
    assert ranges[0] == (0, HEAD.size) and ranges[-1][1] == frame.nbytes
    assert all(b - a <= 100 for a, b in ranges) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.usefixtures("codec")
def test_a_frame_where_everything_changed_is_at_most_the_box_and_its_headers():
    rng = np.random.default_rng(1)
    old = rng.integers(0, 255, (1000,), dtype=np.uint8)
    new = (old + 1).astype(np.uint8)
    d, packed = _stream([(old, new)])
    frame = encode_frame("j", d, packed)
    assert new.nbytes < frame.nbytes <= d.limit == new.nbytes + HEAD.size + 16 + 24
    assert apply_frame("j", d, frame.data, "host1/0").tobytes() == new.tobytes()


@pytest.mark.usefixtures("codec")
def test_a_bucket_frame_diffs_each_member_at_its_own_itemsize():
    """bf16 as uint16 bits, fp8 as uint8, float32 with NaN payloads and -0.0, int64, and a member without a base
    (sent whole): one segment each, applied bit-exact."""
    rng = np.random.default_rng(2)
    bf = _bf16_bits(rng.standard_normal(301))
    fp8 = rng.integers(0, 256, 77, dtype=np.uint8)
    f32 = rng.standard_normal(50).astype(np.float32)
    f32[3] = -0.0
    f32[4:6] = np.array([0x7FC00001, 0x7F800002], dtype=np.uint32).view(np.float32)
    i64 = rng.integers(-2**62, 2**62, 13, dtype=np.int64)
    plain = rng.standard_normal(9).astype(np.float16)
    new_f32 = f32.copy()
    new_f32.view(np.uint32)[[4, 7]] ^= 0x10
    pairs = [(bf, _changed(bf, rng, 0.02)), (fp8, _changed(fp8, rng, 0.05)), (f32, new_f32), (i64, i64.copy()),
             (None, plain)]
    d, packed = _stream(pairs)
    frame = encode_frame("j", d, packed)
    out = apply_frame("j", d, frame.data, "host2/1")
    assert out.tobytes() == packed.tobytes()
    assert set(frame.wire) == {"t0", "t1", "t2", "t3"} and frame.full["t0"] == bf.nbytes
    assert sum(frame.wire.values()) == frame.nbytes - 16 - 24 - plain.nbytes  # the whole member isn't a delta's
    # straight into the destination: one region for the box, or one per member (a bucket's tiles), nothing else
    # allocated for the result; the new box's digest may come from the agent's early digest of it
    frame = encode_frame("j", d, packed, digest(packed))
    region = np.zeros(d.nbytes + 8, np.uint8)[8:]
    assert apply_frame("j", d, frame.data, "host2/1", out=region) is region
    assert region.tobytes() == packed.tobytes()
    members = Segments(np.zeros(seg.hi - seg.lo, np.uint8) for seg in d.segments)
    assert apply_frame("j", d, frame.data, "host2/1", out=members) is members
    assert all(m.tobytes() == packed[seg.lo:seg.hi].tobytes() for m, seg in zip(members, d.segments))
    with pytest.raises(AssertionError, match="C-contiguous"):
        apply_frame("j", d, frame.data, "host2/1", out=np.zeros(d.nbytes * 2, np.uint8)[::2])
    wrong = encode_frame("j", d, packed, digest(packed) ^ 1)  # an early digest that is not the box's
    with pytest.raises(DataLossError, match="the delta does not rebuild it"):
        apply_frame("j", d, wrong.data, "host2/1")
    # a sender's bucket as its members where they lie (one part per segment): the very frame of the packed box
    parts = Segments(np.frombuffer(n.tobytes(), np.uint8) for _, n in pairs)
    assert encode_frame("j", d, parts).data.tobytes() == encode_frame("j", d, packed).data.tobytes()
    with pytest.raises(AssertionError, match="one part per segment"):
        encode_frame("j", d, Segments([packed]))


@pytest.mark.usefixtures("codec")
def test_a_sender_reads_strided_regions_where_they_lie_and_frames_the_same_bytes():
    """A bucket whose members are strided regions of their tiles (a row-parallel weight's columns), new and base:
    the frame from the regions where they lie is the frame from their packed bytes, and it rebuilds every member."""
    rng = np.random.default_rng(5)
    tiles = [rng.integers(0, 2**16, (40, 96), dtype=np.uint16), rng.standard_normal((30, 50)).astype(np.float32),
             rng.integers(0, 256, (12, 70), dtype=np.uint8)]
    cuts = [np.s_[:, 16:64], np.s_[5:25, ::2], np.s_[:, :]]
    news = [_changed(t, rng, 0.03) for t in tiles]
    pairs = [(np.ascontiguousarray(t[c]), np.ascontiguousarray(n[c])) for t, n, c in zip(tiles, news, cuts)]
    d, packed = _stream(pairs)
    in_place = DeltaStream(d.step, d.sender, d.segments, d.nbytes, lambda k: tiles[k][cuts[k]], d.receiver_base)
    strided = encode_frame("j", in_place, tuple(n[c] for n, c in zip(news, cuts)))
    assert strided.data.tobytes() == encode_frame("j", d, packed).data.tobytes()
    assert apply_frame("j", d, strided.data, "host1/0").tobytes() == packed.tobytes()


@pytest.mark.usefixtures("codec")
def test_a_base_that_differs_or_is_not_held_names_each_tensor():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(40).astype(np.float32), rng.integers(0, 9, 30).astype(np.int16)
    stale = a.copy()
    stale[5] += 1
    d, packed = _stream([(a, _changed(a, rng, 0.1)), (b, _changed(b, rng, 0.1))], held=[stale, None])
    frame = encode_frame("job9", d, packed)
    with pytest.raises(FailedPreconditionError) as e:
        apply_frame("job9", d, frame.data, "host3/0")
    text = str(e.value)
    assert text.startswith(f"{DELTA_BASE_MISMATCH}: tensor 'store0': version {DST_BASE} on device host3/0 has "
                           f"XXH3-64 {digest(stale):016x}"), text
    assert f"tensor 'store1': device host3/0 holds no version {DST_BASE}" in text and "step 3 of job job9" in text


@pytest.mark.usefixtures("codec")
def test_a_receiver_hashes_its_bases_only_where_the_result_does_not_match(monkeypatch):
    """The result's digest proves the new box; the bases are hashed only to name a mismatch. A base that differs
    only where the delta overwrites it rebuilds the box exactly, so it passes."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal(4000).astype(np.float32)
    new = _changed(a, rng, 0.02)
    moved = np.flatnonzero(new.view(np.uint32) != a.view(np.uint32))
    overwritten = a.copy()
    overwritten[moved[:5]] = 7.0  # differs from the sender's base only at elements the delta writes
    d, packed = _stream([(a, new)], held=[overwritten])
    frame = encode_frame("j", d, packed)
    hashed = []
    real = deltas.digest
    monkeypatch.setattr(deltas, "digest", lambda data: hashed.append(len(data)) or real(data))
    assert apply_frame("j", d, frame.data, "host1/0").tobytes() == packed.tobytes()
    # The table's base digests (8 bytes) and the result, never the base: the result as it is made where the
    # compiled kernel is built (its running digest, `reshard.delta.hasher`), else hashed whole afterwards
    assert sorted(hashed) == ([8] if running_digest() is not None else [8, packed.nbytes])
    stale = a.copy()
    stale[np.setdiff1d(np.arange(a.size), moved)[0]] += 1  # a difference the delta leaves in place
    d, packed = _stream([(a, new)], held=[stale])
    with pytest.raises(FailedPreconditionError, match=rf"^{DELTA_BASE_MISMATCH}: tensor 'store0': version "
                                                      rf"{DST_BASE} on device host1/0 has XXH3-64"):
        apply_frame("j", d, encode_frame("j", d, packed).data, "host1/0")


@pytest.mark.usefixtures("codec")
def test_a_sender_without_its_base_refuses_to_encode():
    a = np.arange(10, dtype=np.float32)
    d, packed = _stream([(a, a + 1)])
    d = DeltaStream(d.step, d.sender, d.segments, d.nbytes, lambda k: None, d.receiver_base)
    with pytest.raises(FailedPreconditionError, match=rf"^{DELTA_BASE_MISMATCH}: tensor 'store0': the sending "
                                                      rf"device host0/0 holds no version {SRC_BASE}"):
        encode_frame("j", d, packed)


@pytest.mark.usefixtures("codec")
def test_a_changed_value_in_a_frame_is_data_loss_and_a_changed_head_is_refused():
    rng = np.random.default_rng(4)
    a = rng.standard_normal(500).astype(np.float32)
    d, packed = _stream([(a, _changed(a, rng, 0.02))])
    frame = encode_frame("j", d, packed).data.copy()
    frame[-1] ^= 0x40  # a new value's bits
    with pytest.raises(DataLossError, match=r"step 3 applied on device host1/0 gives XXH3-64 [0-9a-f]{16}, but the "
                                            r"sender's box has"):
        apply_frame("j", d, frame, "host1/0")
    frame = encode_frame("j", d, packed).data.copy()
    frame[12] ^= 1  # the box's bytes in the head
    with pytest.raises(InvalidArgumentError, match="this host's program gives 1 segments of 2000 bytes"):
        read_head("j", d, frame[:HEAD.size])


# -- moves on the runtimes ------------------------------------------------------------------------------------------


def _hosts(transport: str, request, wrap=lambda host, t: t) -> Hosts:
    if transport == "nixl":
        return Hosts(group=nixl_agents(), wrap=wrap)
    if transport == "collective":
        return Hosts(group=request.getfixturevalue("gloo"), wrap=wrap)
    return Hosts(wrap=wrap)


@pytest.fixture(scope="module")
def gloo():
    pytest.importorskip("torch", reason="the collective transport needs torch")
    from tests.unit.test_runtime import Gloo

    return Gloo()


def _put(hosts: Hosts, name: str, a: np.ndarray, sharding: Sharding, version: int) -> None:
    tiles = sharding.tiles(a.shape)
    hosts.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()}, version)


def _run(hosts: Hosts, program, tensor: str, delta_bases: dict, reads: dict | None = None,
         src_version: int = NEW) -> tuple[str, dict]:
    job = uuid.uuid4().hex
    extra = (hosts.group.generation, next(_SEQ)) if hosts.kind == "collective" else ()
    runs = {h: r.prepare(job, program.dumps(), tensor, src_version, src_version + 1, {h: h for h in hosts.runtimes},
                         hosts.kind, *extra, reads=reads, delta_bases=delta_bases)
            for h, r in hosts.runtimes.items()}
    for r in hosts.runtimes.values():
        r.execute(job, program.id)
    hosts.finish(job, runs)
    return job, runs


def _traffic(runs: dict) -> tuple[int, dict[str, int], dict[str, int]]:
    wire: dict[str, int] = {}
    full: dict[str, int] = {}
    for run in runs.values():
        for t, n in run.traffic.delta_wire.items():
            wire[t] = wire.get(t, 0) + n
        for t, n in run.traffic.delta_full.items():
            full[t] = full.get(t, 0) + n
    return sum(sum(run.traffic.bytes_out.values()) for run in runs.values()), wire, full


def _full_network_bytes(program) -> int:
    """What full streams of a program (or a single tensor's plan) put on the network."""
    if not hasattr(program, "steps"):
        itemsize = np.dtype(np_dtype(program.dtype)).itemsize
        return sum(int(np.prod([hi - lo for lo, hi in t.box])) * itemsize * network_copies(t)
                   for t in program.transfers)
    size = {t.name: t.itemsize for t in program.tensors}
    return sum(int(np.prod([hi - lo for lo, hi in s.transfer.box])) * size[s.tensor] * network_copies(s.transfer)
               for s in program.steps if s.kind == MOVE)


@pytest.mark.parametrize("transport", ["memory", "collective", "nixl"])
@pytest.mark.parametrize("strategy", ["send_recv", "broadcast"])
def test_a_strided_box_moves_as_a_delta_bit_exact(transport, strategy, request):
    """Rows at the source, columns at the destination: every box is strided in both tiles. A broadcast runs
    its route as a chain through the receiving hosts."""
    hosts = _hosts(transport, request)
    try:
        rng = np.random.default_rng(5)
        base = rng.standard_normal((96, 40)).astype(np.float32)
        new = _changed(base, rng, 0.01)
        src = Sharding(Mesh.from_hosts({"x": 4}, HOSTS[:2], 2), ("x", None))
        dst = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, HOSTS[2:], 2), (None, "y"))
        _put(hosts, "w", base, src, SRC_BASE)
        _put(hosts, "w", base, dst, DST_BASE)
        _put(hosts, "w", new, src, NEW)
        program = make_plan(new.shape, new.dtype, src, dst, strategy=strategy).validate()
        _, runs = _run(hosts, program, "w", {"tensor": (SRC_BASE, DST_BASE)})
        assert hosts.get("w", dst, new.shape, NEW + 1).tobytes() == new.tobytes()
        on_wire, wire, full = _traffic(runs)
        assert full == {"tensor": _full_network_bytes(program)}  # by program tensor
        assert wire == {"tensor": on_wire} and on_wire < full["tensor"] / 5
        for h, run in runs.items():
            done, total, steps_done, steps = run.progress()
            assert done == total and steps_done == steps, h
    finally:
        hosts.close()


@pytest.mark.parametrize("transport", ["memory", "collective", "nixl"])
def test_a_chain_of_three_hosts_forwards_the_frame(transport, request):
    """host0 broadcasts to a tensor replicated on host1..host3: one origin hop, two forwarded; each hop applies
    the frame to its own base, and each forwarding host counts the frame it sent."""
    hosts = _hosts(transport, request)
    try:
        rng = np.random.default_rng(6)
        base = rng.integers(0, 1 << 16, (33, 17), dtype=np.uint16)  # bfloat16 bits
        new = _changed(base, rng, 0.03)
        src = Sharding(Mesh({"x": 1}, ["host0/0"]), (None, None))
        dst = Sharding(Mesh({"x": 3}, ["host1/0", "host2/0", "host3/0"]), (None, None))
        _put(hosts, "b", base, src, SRC_BASE)
        _put(hosts, "b", base, dst, DST_BASE)
        _put(hosts, "b", new, src, NEW)
        program = make_plan(new.shape, "bfloat16", src, dst, strategy="broadcast").validate()
        (t,) = program.transfers
        assert [h.origin for h in hops(t)] == [True, False, False]
        _, runs = _run(hosts, program, "b", {"tensor": (SRC_BASE, DST_BASE)})
        assert hosts.get("b", dst, new.shape, NEW + 1).tobytes() == new.tobytes()
        frames = [runs[h].traffic.delta_wire.get("tensor", 0) for h in HOSTS]
        assert frames[0] == frames[1] == frames[2] > 0 and frames[3] == 0
        assert [runs[h].traffic.delta_full.get("tensor", 0) for h in HOSTS] == [new.nbytes] * 3 + [0]
        assert frames[0] < new.nbytes / 4
    finally:
        hosts.close()


@pytest.mark.parametrize("transport", ["memory", "collective", "nixl"])
def test_a_bucket_of_mixed_dtypes_moves_as_one_frame(transport, request):
    """A state dict in buckets: bf16 (uint16 bits), fp8 (uint8), float32 and int64 members with delta bases, one
    tensor without (its members go whole inside the same frames), and one with an empty tile (no element: it
    moves as it does today)."""
    hosts = _hosts(transport, request)
    try:
        rng = np.random.default_rng(7)
        train = Mesh.from_hosts({"tp": 4}, HOSTS[:2], 2)
        infer = Mesh.from_hosts({"dp": 2, "tp": 2}, HOSTS[2:], 2)
        tensors = {}
        kinds = [np.uint16, np.uint8, np.float32, np.int64]
        for i in range(12):
            shape = (4 * int(rng.integers(40, 90)) + i % 3, 3 + i % 4)
            a = rng.integers(0, 200, shape).astype(kinds[i % 4])
            tensors[f"m{i}"] = (a, _changed(a, rng, 0.02 if i % 5 else 0.6))
        tensors["tiny"] = (np.arange(3, dtype=np.float32), np.arange(3, dtype=np.float32) * 2)  # 3 rows on tp=4
        names = {"uint16": "bfloat16", "uint8": "float8_e4m3fn"}  # held as their bits
        decls = {n: TensorDecl(n, a.shape, names.get(a.dtype.name, a.dtype.name),
                               Sharding(train, ("tp",) + (None,) * (a.ndim - 1)),
                               Sharding(infer, (None,) * (a.ndim - 1) + ("tp",)))
                 for n, (a, _) in tensors.items()}
        for n, (a, b) in tensors.items():
            _put(hosts, n, a, decls[n].src, SRC_BASE)
            _put(hosts, n, a, decls[n].dst, DST_BASE)
            _put(hosts, n, b, decls[n].src, NEW)
        program = plan_many(list(decls.values()), bucket_bytes=16384).validate()
        assert len(bucket_moves(program)) >= 4
        bases = {n: (SRC_BASE, DST_BASE) for n in tensors if n != "m3"}
        packed = {h: hosts.stores[h].host_bytes for h in HOSTS[:2]}
        _, runs = _run(hosts, program, "", bases, reads={n: (n, NEW) for n in tensors}, src_version=0)
        # the senders diff each bucket member where it lies: no bucket is packed into a buffer first
        assert {h: hosts.stores[h].host_bytes for h in HOSTS[:2]} == packed
        for n, (_, b) in tensors.items():
            assert hosts.get(n, decls[n].dst, b.shape, NEW + 1).tobytes() == b.tobytes(), n
        on_wire, wire, full = _traffic(runs)
        assert set(wire) <= set(bases) and "m3" not in full and wire["m1"] < full["m1"] / 2
        assert on_wire < _full_network_bytes(program)
    finally:
        hosts.close()


def _mismatch_setup(hosts: Hosts):
    rng = np.random.default_rng(8)
    base = rng.standard_normal((64, 8)).astype(np.float32)
    new = _changed(base, rng, 0.05)
    src = Sharding(Mesh.from_hosts({"x": 2}, HOSTS[:1], 2), ("x", None))
    dst = Sharding(Mesh.from_hosts({"x": 2}, HOSTS[2:], 1), ("x", None))
    _put(hosts, "w", base, src, SRC_BASE)
    _put(hosts, "w", base, dst, DST_BASE)
    _put(hosts, "w", new, src, NEW)
    return new, src, dst, make_plan(new.shape, new.dtype, src, dst, strategy="send_recv").validate()


def _nothing_committed(hosts: Hosts, dst: Sharding) -> None:
    for dev in dst.mesh.devices:
        with pytest.raises(NotFoundError):
            hosts.stores[dev.split("/")[0]].get("w", NEW + 1, dev)


@pytest.mark.parametrize("transport", ["memory", "collective", "nixl"])
def test_a_receiver_whose_base_differs_fails_the_job_naming_the_tensor(transport, request):
    hosts = _hosts(transport, request, wrap=lambda host, t: DeltaBaseDiffers(t) if host == "host3" else t)
    try:
        _, _, dst, program = _mismatch_setup(hosts)
        with pytest.raises(FailedPreconditionError) as e:
            _run(hosts, program, "w", {"tensor": (SRC_BASE, DST_BASE)})
        assert str(e.value).startswith(f"{DELTA_BASE_MISMATCH}: tensor 'w': version {DST_BASE} on device host3/0 "
                                       f"has XXH3-64 "), str(e.value)
        _nothing_committed(hosts, dst)
    finally:
        hosts.close()


def test_a_receiver_without_its_base_fails_the_job_naming_the_tensor():
    hosts = Hosts()
    try:
        _, _, dst, program = _mismatch_setup(hosts)
        hosts.stores["host2"].release("w", DST_BASE)
        with pytest.raises(FailedPreconditionError, match=rf"^{DELTA_BASE_MISMATCH}: tensor 'w': device host2/0 holds "
                                                          rf"no version {DST_BASE} with box"):
            _run(hosts, program, "w", {"tensor": (SRC_BASE, DST_BASE)})
        _nothing_committed(hosts, dst)
    finally:
        hosts.close()


@pytest.mark.parametrize("transport", ["memory", "collective", "nixl"])
def test_a_frame_changed_on_the_wire_is_data_loss(transport, request):
    hosts = _hosts(transport, request, wrap=lambda host, t: CorruptFrame(t))
    try:
        _, _, dst, program = _mismatch_setup(hosts)
        with pytest.raises(DataLossError, match=r"the delta frame of step \d+ arrived with XXH3-64 [0-9a-f]{16}, but "
                                                r"the sender sent [0-9a-f]{16}: the bytes changed between host0 and"):
            _run(hosts, program, "w", {"tensor": (SRC_BASE, DST_BASE)})
        _nothing_committed(hosts, dst)
    finally:
        hosts.close()


def test_a_tensor_not_named_moves_whole_and_an_unknown_name_is_refused():
    hosts = Hosts()
    try:
        new, _, dst, program = _mismatch_setup(hosts)
        _, runs = _run(hosts, program, "w", {})
        assert hosts.get("w", dst, new.shape, NEW + 1).tobytes() == new.tobytes()
        assert _traffic(runs)[0] == new.nbytes and not _traffic(runs)[1]
        with pytest.raises(InvalidArgumentError, match=r"delta_bases name tensors \['v'\] that its program does not "
                                                       r"have"):
            hosts.runtimes["host0"].prepare(uuid.uuid4().hex, program.dumps(), "w", NEW, NEW + 1,
                                            {h: h for h in HOSTS}, "memory", delta_bases={"v": (1, 2)})
    finally:
        hosts.close()



def test_an_ended_delta_run_is_freed_at_once_not_by_the_cycle_collector():
    """A run's delta streams read bases through the run: once the job ends nothing may keep the run (and the
    staged tiles it references) alive but Python's cycle collector, which may not run for a long while; a weight
    sync every step would otherwise pile up versions the store already freed."""
    import gc
    import weakref

    hosts = _hosts("memory", None)
    try:
        rng = np.random.default_rng(9)
        base = rng.standard_normal((64, 32)).astype(np.float32)
        src = Sharding(Mesh.from_hosts({"x": 4}, HOSTS[:2], 2), ("x", None))
        dst = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, HOSTS[2:], 2), (None, "y"))
        _put(hosts, "w", base, src, SRC_BASE)
        _put(hosts, "w", base, dst, DST_BASE)
        _put(hosts, "w", _changed(base, rng, 0.05), src, NEW)
        program = make_plan(base.shape, base.dtype, src, dst).validate()
        gc.collect()
        gc.disable()
        try:
            _, runs = _run(hosts, program, "w", {"tensor": (SRC_BASE, DST_BASE)})
            refs = [weakref.ref(run) for run in runs.values()]
            del runs
            alive = [r() for r in refs if r() is not None]
            assert not alive, f"{len(alive)} ended runs are still referenced"
        finally:
            gc.enable()
    finally:
        hosts.close()


def test_a_delta_frame_is_not_registered_with_nixl_job_after_job():
    """A frame is fresh memory of the box's size every transfer: a one-sided transport that registered the buffer a
    piece is a view of would pin a box's worth of memory per transfer and leave its peers knowing memory that is
    freed after (NIXL cannot make them forget it). Pieces go as buffers of their own, through the transport's
    recycled staging, so a weight sync every step registers nothing new after its first."""
    hosts = _hosts("nixl", None)
    try:
        rng = np.random.default_rng(11)
        base = rng.standard_normal((512, 512)).astype(np.float32)  # 1 MiB
        src = Sharding(Mesh.from_hosts({"x": 4}, HOSTS[:2], 2), ("x", None))
        dst = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, HOSTS[2:], 2), ("x", None))
        _put(hosts, "w", base, src, SRC_BASE)
        _put(hosts, "w", base, dst, DST_BASE)
        program = make_plan(base.shape, base.dtype, src, dst).validate()
        counts = []
        for k in range(3):
            _put(hosts, "w", _changed(base, rng, 0.03), src, NEW + 10 * k)
            _run(hosts, program, "w", {"tensor": (SRC_BASE, DST_BASE)}, src_version=NEW + 10 * k)
            counts.append(sum(t.registered for t in hosts.transports.values()))  # registrations made so far
        assert counts[1] == counts[2], f"each job registered buffers anew: {counts} registrations made"
    finally:
        hosts.close()
