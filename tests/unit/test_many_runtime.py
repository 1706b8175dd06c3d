"""Programs of many tensors on the agents' runtimes (four hosts in one process, over the in-memory transport and
a real gloo group): each bucket travels as one stream, every tensor commits at the version after the one it was
read at, and a failure anywhere commits none of them."""

from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np
import pytest

from reshard import Mesh, Sharding, TensorDecl
from reshard.cost import network_copies
from reshard.many import plan_many
from reshard.program import MOVE
from reshard.proto.errors import UnavailableError
from reshard.server.agent.buckets import bucket_moves
from reshard.server.transport.buffers import RECYCLE_MIN_BYTES
from reshard.server.transport.faults import Fail, Wrapped
from reshard.server.transport.nixl import nixl_missing
from tests.unit.test_runtime import _SEQ, HOSTS, STEP_TIMEOUT_S, Gloo, Hosts, nixl_agents

TRAIN = Mesh.from_hosts({"tp": 4}, HOSTS[:2], 2)
INFER = Mesh.from_hosts({"dp": 2, "tp": 2}, HOSTS[2:], 2)


def _group(transport: str, request):
    if transport == "nixl":
        if nixl_missing() is not None:
            pytest.skip(nixl_missing())
        return nixl_agents()
    return request.getfixturevalue("gloo_group") if transport == "collective" else None


@pytest.fixture(scope="module")
def gloo_group():
    pytest.importorskip("torch", reason="the collective transport needs torch")
    return Gloo()


def _state_dict(rng) -> dict[str, tuple[np.ndarray, TensorDecl, int]]:
    """name -> (values, declaration, stored version): small tensors of four dtypes, uneven sizes, two large."""
    out = {}
    dtypes = [np.float32, np.int64, np.float16, np.uint8]
    for i in range(24):
        shape = (4 * int(rng.integers(1, 9)) + i % 3, int(rng.integers(1, 6)))
        a = (rng.standard_normal(shape) * 100).astype(dtypes[i % 4])
        src, dst = (("tp", None), (None, "tp")) if i % 2 else ((None,), ("tp",))
        out[f"small{i}"] = (a, TensorDecl(f"small{i}", shape, a.dtype.name, Sharding(TRAIN, src),
                                          Sharding(INFER, dst)), 1 + i % 3)
    for i in range(2):
        a = rng.standard_normal((257, 96)).astype(np.float32)
        out[f"large{i}"] = (a, TensorDecl(f"large{i}", a.shape, "float32", Sharding(TRAIN, ("tp", None)),
                                          Sharding(INFER, (None, "tp"))), 2)
    return out


def row_split_state_dict(n: int, rows: int = 256) -> dict[str, tuple[np.ndarray, TensorDecl, int]]:
    """``n`` float32 tensors of ``rows`` x 64 split by rows at both ends (256 rows: source tiles of 16 KiB,
    destination of 32 KiB), as `_state_dict` gives them."""
    rng = np.random.default_rng(5)
    out = {}
    for i in range(n):
        a = rng.standard_normal((rows, 64)).astype(np.float32)
        out[f"t{i}"] = (a, TensorDecl(f"t{i}", a.shape, "float32", Sharding(TRAIN, ("tp", None)),
                                      Sharding(INFER, ("tp", None))), 1)
    return out


def _start(hosts: Hosts, program, versions: dict[str, int], commit: bool = False):
    """Prepare and execute ``program`` on every host; ``commit``: as the planner's Execute asks of the hosts that
    commit, each may commit a tensor as its last receive ends (`Runtime.execute`)."""
    job = uuid.uuid4().hex
    extra = (hosts.group.generation, next(_SEQ)) if hosts.group else (0, 0)
    reads = {n: (n, v) for n, v in versions.items()}
    runs = {h: r.prepare(job, program.dumps(), "", 0, 0, {h: h for h in hosts.runtimes}, hosts.kind, *extra,
                         reads=reads) for h, r in hosts.runtimes.items()}
    for r in hosts.runtimes.values():
        r.execute(job, program.id, commit=commit)
    return job, runs


@pytest.mark.parametrize("transport", ["memory", "collective"])
def test_a_state_dict_moves_in_one_program_bucket_by_bucket(transport, request):
    hosts = Hosts(group=request.getfixturevalue("gloo_group") if transport == "collective" else None)
    try:
        _move_bucket_by_bucket(hosts)
    finally:
        hosts.close()


def _move_bucket_by_bucket(hosts: Hosts) -> None:
    tensors = _state_dict(np.random.default_rng(3))
    for name, (a, decl, version) in tensors.items():
        tiles = decl.src.tiles(a.shape)
        hosts.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()}, version)
    program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=2048).validate()
    assert program.buckets and any(s.id not in {i for b in program.buckets for i in b} for s in program.steps)
    job, runs = _start(hosts, program, {n: v for n, (_, _, v) in tensors.items()})
    hosts.finish(job, runs)
    for name, (a, decl, version) in tensors.items():
        assert np.array_equal(hosts.get(name, decl.dst, a.shape, version + 1), a), name
    # one stream per bucket: a host sends one task per bucket and per move outside the buckets
    packed = {i: b for b in program.buckets for i in b}
    for h, run in runs.items():
        moves = [s for s in program.steps if s.kind == MOVE and s.transfer.sender.split("/")[0] == h]
        heads = {packed[s.id][0] if s.id in packed else s.id for s in moves}
        assert sorted(t.step.id for t in run.tasks if t.role == "send") == sorted(heads), h
    # and every byte crossed the network once per copy the plan makes
    size = {t.name: t.itemsize for t in program.tensors}
    want = sum(np.prod([hi - lo for lo, hi in s.transfer.box]) * size[s.tensor] * network_copies(s.transfer)
               for s in program.steps)
    assert sum(sum(run.traffic.bytes_in.values()) for run in runs.values()) == want


@pytest.mark.parametrize("transport", ["memory", "collective", "nixl"])
def test_bucket_members_cut_by_the_pieces_of_their_stream_arrive_whole(transport, request):
    """Buckets of 64 KiB streamed in 4 KiB pieces: members of odd byte sizes (float16 and uint8 of odd lengths,
    float32 and int64 beside them) start at unaligned offsets, and most span two or more pieces; every one lands
    whole, on both replicas (a host's second device takes the same pieces). On nixl the buckets are not packed:
    the members go from their source tiles into their destination tiles, those whose region there is strided
    through the bucket's buffer."""
    hosts = Hosts(group=_group(transport, request))
    try:
        rng = np.random.default_rng(11)
        tensors = {}
        dtypes = [np.float16, np.uint8, np.float32, np.int64]
        for i in range(16):
            shape = (4 * int(rng.integers(20, 160)) + 1 + i % 3, 3 + i % 4)  # odd rows: odd byte counts
            a = (rng.standard_normal(shape) * 100).astype(dtypes[i % 4])
            tensors[f"t{i}"] = (a, TensorDecl(f"t{i}", shape, a.dtype.name, Sharding(TRAIN, ("tp", None)),
                                              Sharding(INFER, (None, "tp") if i % 2 else ("tp", None))), 1)
        for name, (a, decl, version) in tensors.items():
            tiles = decl.src.tiles(a.shape)
            hosts.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()},
                      version)
        program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=64 * 1024).validate()
        packed = bucket_moves(program)
        chunk = 4096
        cut = [p for b in packed.values() for p in b.parts
               if p[2] // chunk != (p[3] - 1) // chunk]  # members whose bytes span two pieces or more
        assert packed and len(cut) > 10 and any(p[2] % p[4].itemsize or p[2] % 2 for b in packed.values()
                                                for p in b.parts)
        job, runs = _start(hosts, program, {n: v for n, (_, _, v) in tensors.items()})
        hosts.finish(job, runs)
        for name, (a, decl, version) in tensors.items():
            assert np.array_equal(hosts.get(name, decl.dst, a.shape, version + 1), a), name
    finally:
        hosts.close()


@pytest.mark.parametrize("transport", ["memory", "collective"])
def test_a_repeated_move_packs_and_unpacks_its_buckets_in_the_last_run_s_buffers(transport, request):
    """The weight-sync pattern: the same program every step. Its bucket buffers (a sender's packed bytes, a
    receiving device's before they are unpacked) go back to the store's recycler once sent or unpacked, and the
    next run takes them from there; tiles of 32 KiB are too small to be kept, so what the recycler hands out
    counts the buckets alone. The second run still delivers every tensor whole."""
    hosts = Hosts(group=request.getfixturevalue("gloo_group") if transport == "collective" else None)
    try:
        tensors = row_split_state_dict(40)
        for name, (a, decl, version) in tensors.items():
            tiles = decl.src.tiles(a.shape)
            hosts.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()},
                      version)
        program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=128 * 1024).validate()
        # a buffer per bucket on its sender, and one per device it reaches; a pair of sender and receivers' last
        # bucket may be too small to be kept
        kept = [b for b in bucket_moves(program).values() if b.nbytes >= RECYCLE_MIN_BYTES]
        assert len(kept) >= 8
        per_run = sum(1 + len(b.step.transfer.receivers) for b in kept)
        reused = [0]
        for k in range(2):
            job, runs = _start(hosts, program, {n: v for n, (_, _, v) in tensors.items()})
            hosts.finish(job, runs)
            del runs
            for name, (a, decl, version) in tensors.items():
                assert np.array_equal(hosts.get(name, decl.dst, a.shape, version + 1), a), (k, name)
                for store in hosts.stores.values():
                    store.release(name, version + 1)
            reused.append(sum(store.recycler.reused for store in hosts.stores.values()))
        # Every buffer the first run made (those it did not take back from its own earlier buckets) was given back
        # and is taken again by the second: it needs as many of each size. (It may need a few more at once, as
        # its streams interleave otherwise, and makes those.)
        made = per_run - reused[1]
        assert reused[2] - reused[1] >= made > 0, (reused, per_run)
    finally:
        hosts.close()


def _lane_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("lane-", "small-"))}


def test_a_run_s_lanes_serve_the_next_runs_and_close_ends_them(gloo_group):
    """The lanes a run of the collective transport dispatches its streams on are kept once it ends, idle, and
    serve the next run: their threads are started once, not per job. Closing the runtimes ends them."""
    hosts = Hosts(group=gloo_group)
    try:
        tensors = _state_dict(np.random.default_rng(6))

        def put(version_after: int) -> None:  # every tensor on the training layout, at its version + version_after
            for name, (a, decl, version) in tensors.items():
                hosts.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b)
                                 for d, b in decl.src.tiles(a.shape).items()}, version + version_after)

        put(0)
        program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=2048).validate()
        before = _lane_threads()
        for k in range(3):
            job, runs = _start(hosts, program, {n: v + k for n, (_, _, v) in tensors.items()})
            hosts.finish(job, runs)
            for name, (a, decl, version) in tensors.items():
                assert np.array_equal(hosts.get(name, decl.dst, a.shape, version + k + 1), a), (k, name)
            put(k + 1)  # what the next run reads
            if k == 0:
                first = _lane_threads() - before
        assert first and all(t.is_alive() for t in first)  # still there, serving, after two more runs
    finally:
        hosts.close()
    deadline = time.monotonic() + 10
    while (first & _lane_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not first & _lane_threads()


def test_a_failure_commits_none_of_the_tensors():
    tensors = _state_dict(np.random.default_rng(4))
    program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=2048).validate()
    sender = program.steps[0].transfer.sender.split("/")[0]  # its move (a bucket's, or its own) fails there
    h = Hosts(wrap=lambda host, t: Fail(t, steps=[0]) if host == sender else t)
    try:
        for name, (a, decl, version) in tensors.items():
            tiles = decl.src.tiles(a.shape)
            h.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()}, version)
        used = {host: store.used_bytes() for host, store in h.stores.items()}
        job, runs = _start(h, program, {n: v for n, (_, _, v) in tensors.items()})
        with pytest.raises(UnavailableError, match=f"step 0 failed on host {sender}"):
            runs[sender].result(STEP_TIMEOUT_S)
        for r in h.runtimes.values():  # what the planner does when one host fails
            r.abort(job)
        for name, (a, decl, version) in tensors.items():
            for dev in decl.dst.mesh.require_devices():
                assert h.stores[dev.split("/")[0]].find(name, version + 1, dev) is None, (name, dev)
            assert np.array_equal(h.get(name, decl.src, a.shape, version), a), name
        assert {host: store.used_bytes() for host, store in h.stores.items()} == used  # nothing staged is left
    finally:
        h.close()


class _FailLate(Wrapped):
    """The move of ``step`` fails on this host, ``after_s`` seconds after it starts (the other streams end first)."""

    def __init__(self, inner, step: int, after_s: float):
        super().__init__(inner)
        self.step, self.after_s = step, after_s

    def move(self, s, step: int, *args, **kwargs) -> None:
        if step == self.step:
            time.sleep(self.after_s)
            raise UnavailableError(f"job {s.job}: step {step} failed late on host {self.host} (injected by the test)")
        super().move(s, step, *args, **kwargs)


def _committed(h: Hosts, tensors: dict, version_of) -> set[str]:
    """The tensors that some destination device's store holds at ``version_of(stored version)``."""
    return {name for name, (_, decl, version) in tensors.items() for dev in decl.dst.mesh.require_devices()
            if h.stores[dev.split("/")[0]].find(name, version_of(version), dev) is not None}


@pytest.mark.parametrize("transport", ["collective", "nixl"])
def test_a_run_that_commits_commits_each_tensor_as_its_last_receive_ends(transport, request):
    """Where the Execute asks a host to commit (the hosts that stage new versions), each tensor written here only by
    receives commits as the last of them ends, while the run goes on; the run's end commits the rest (none here)."""
    tensors = _state_dict(np.random.default_rng(6))
    program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=2048).validate()
    h = Hosts(group=_group(transport, request))
    try:
        for name, (a, decl, version) in tensors.items():
            tiles = decl.src.tiles(a.shape)
            h.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()}, version)
        job, runs = _start(h, program, {n: v for n, (_, _, v) in tensors.items()}, commit=True)
        for run in runs.values():
            run.result(STEP_TIMEOUT_S)
        early = {name for run in runs.values() for name in run.committed_early}
        assert early == {n for run in runs.values() for n in run.layout.receives_of} == set(tensors), early
        assert _committed(h, tensors, lambda v: v + 1) == set(tensors)  # before any commit call
        for r in h.runtimes.values():
            r.commit(job)
        for name, (a, decl, version) in tensors.items():
            assert np.array_equal(h.get(name, decl.dst, a.shape, version + 1), a), name
    finally:
        h.close()


@pytest.mark.parametrize("transport", ["collective", "nixl"])
def test_a_job_that_fails_after_early_commits_leaves_none_of_them(transport):
    """A job whose last stream fails after the others' receivers committed their tensors (the run commits as it
    goes): the abort takes every one back, the old versions stay readable, and nothing staged is left."""
    if transport == "nixl":
        if nixl_missing() is not None:
            pytest.skip(nixl_missing())
        group = nixl_agents()
    else:
        pytest.importorskip("torch", reason="the collective transport needs torch")
        group = Gloo()  # its own: a gloo group that a job failed on is formed again before the next job
    tensors = _state_dict(np.random.default_rng(7))
    program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=2048).validate()
    members = {i for bucket in program.buckets for i in bucket}
    leads = {bucket[0] for bucket in program.buckets}
    last = [s for s in program.steps if s.id in leads or s.id not in members][-1]  # a stream of its own
    sender = last.transfer.sender.split("/")[0]
    h = Hosts(wrap=lambda host, t: _FailLate(t, last.id, 1.0) if host == sender else t, group=group)
    try:
        for name, (a, decl, version) in tensors.items():
            tiles = decl.src.tiles(a.shape)
            h.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()}, version)
        used = {host: store.used_bytes() for host, store in h.stores.items()}
        job, runs = _start(h, program, {n: v for n, (_, _, v) in tensors.items()}, commit=True)
        with pytest.raises(UnavailableError, match=f"step {last.id} failed late on host {sender}"):
            runs[sender].result(STEP_TIMEOUT_S)
        assert _committed(h, tensors, lambda v: v + 1), "no receiver committed a tensor before the failure"
        for r in h.runtimes.values():  # what the planner does when one host fails
            r.abort(job)
        assert not _committed(h, tensors, lambda v: v + 1)
        for name, (a, decl, version) in tensors.items():
            assert np.array_equal(h.get(name, decl.src, a.shape, version), a), name
        assert {host: store.used_bytes() for host, store in h.stores.items()} == used
    finally:
        h.close()


@pytest.mark.parametrize("transport", ["memory", "collective", "nixl"])
def test_a_receiver_on_nixl_stages_each_tile_as_its_receive_is_posted_and_holds_the_room_of_the_rest(transport,
                                                                                                      request):
    """On nixl (a transport that posts its first receives as the run begins) a receiving host stages at prepare
    only what is not received alone, and the rest as each receive is posted or once the first ones are
    (`Run.stage_for`, `Run.stage_rest`); until then its store holds their room, so what counts against its memory
    limit is every tile's bytes from the prepare on. An abort before the run staged them ends that hold, and a late
    `stage_rest` stages nothing. The other transports stage every tile at prepare."""
    tensors = row_split_state_dict(12)
    receiver = HOSTS[2]  # it holds no source shard: its store holds nothing before the job
    tile_bytes = sum(a.nbytes for a, _, _ in tensors.values())  # its two devices hold half of each tensor each
    # Without buckets its store holds the tiles' room alone; with them (moves of 16 KiB, buckets of 64) also the
    # room of the bucket buffers its run may hold at once, until the job ends.
    for bucket_bytes in (0, 1 << 16):
        program = plan_many([d for _, d, _ in tensors.values()], bucket_bytes=bucket_bytes).validate()
        assert bool(program.buckets) == bool(bucket_bytes)
        h = Hosts(group=_group(transport, request))
        try:
            for name, (a, decl, version) in tensors.items():
                tiles = decl.src.tiles(a.shape)
                h.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()},
                      version)
            for attempt in ("aborted", "run"):
                job = uuid.uuid4().hex
                extra = (h.group.generation, next(_SEQ)) if h.group else (0, 0)
                runs = {x: r.prepare(job, program.dumps(), "", 0, 0, {x: x for x in h.runtimes}, h.kind, *extra,
                                     reads={n: (n, v) for n, (_, _, v) in tensors.items()})
                        for x, r in h.runtimes.items()}
                run = runs[receiver]
                assert run.layout.staged_later == set(tensors)  # every tile here is received alone
                assert set(run.staging) == (set() if transport == "nixl" else set(tensors))
                held = h.stores[receiver].used_bytes()
                assert held > tile_bytes if bucket_bytes else held == tile_bytes, (held, tile_bytes)
                if attempt == "aborted":
                    for r in h.runtimes.values():
                        r.abort(job)
                    run.stage_rest()
                    assert set(run.staging) == (set() if transport == "nixl" else set(tensors))
                    assert h.stores[receiver].used_bytes() == 0
                    continue
                for r in h.runtimes.values():
                    r.execute(job, program.id)
                h.finish(job, runs)
                assert h.stores[receiver].used_bytes() == tile_bytes  # committed, and no room held besides
                for name, (a, decl, version) in tensors.items():
                    assert np.array_equal(h.get(name, decl.dst, a.shape, version + 1), a), name
        finally:
            h.close()


def test_a_reshard_many_job_reads_back_from_the_document_the_planner_saves():
    """A planner that restarts reads every job it saved; a reshard_many keeps its destinations, scales and
    versions (and, in flight when the planner stopped, is failed saying so)."""
    from reshard.server.planner.jobs import Job

    dsts = {"w": Sharding(INFER, ("tp", None)), "w_scale": Sharding(INFER, ("tp", None))}
    job = Job("j" * 32, "w", None, "auto", kind="reshard_many", inputs=["w", "w_scale"], dsts=dsts,
              scales={"w": ["w_scale", [128, 64]]}, bucket_bytes=2**20, versions={"w": 3, "w_scale": 2})
    # The planner saves the job's JSON text, which writes each destination layout once (`Job.json_text`).
    assert json.loads(job.json_text()) == json.loads(json.dumps(job.to_json()))
    back = Job.from_json(json.loads(job.json_text()), None)
    assert (back.kind, back.inputs, back.dsts, back.scales, back.bucket_bytes, back.versions) == \
        ("reshard_many", ["w", "w_scale"], dsts, {"w": ["w_scale", [128, 64]]}, 2**20, {"w": 3, "w_scale": 2})
    assert back.state == "failed" and "restarted" in back.error and back.what == "reshard_many of 2 tensors ('w', " \
                                                                                  "'w_scale')"
