"""The agent runtime: several hosts' runtimes in one process, each with its own store.

Over the in-memory transport (real threads and queues, no gRPC) the tests check
the runtime's scheduling (dependencies, overlap, cancellation, deadlines, many
programs at once) and the transport base class's moves, chains, reduces and
checks. The tests that end well run again over the collective transport on a
real gloo group formed in this process, where receives block and every host runs
its tasks in the one order the runtime derives, and over the nixl transport (NIXL
agents in this process writing into each other's registered memory), whose
receivers post their receives as the collective transport's do.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import replace

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.plans import Transfer
from reshard.program import DST, SRC, Program, Step, TensorDecl, TileRef
from reshard.proto.errors import DataLossError, DeadlineExceededError, UnavailableError
from reshard.proto.layout import digest
from reshard.server.agent.runtime import COPIES_WAIT_S, Runtime
from reshard.server.agent.store import ShardStore, TileBuffer
from reshard.server.common.contract import GroupView
from reshard.server.transport.faults import Fail, Stall, Wrapped
from reshard.server.transport.memory import MemoryNetwork, MemoryTransport
from reshard.server.transport.nixl import nixl_missing
from reshard.strategies import plan as make_plan

HOSTS = ("host0", "host1", "host2", "host3")
STEP_TIMEOUT_S = 10.0
_SEQ = itertools.count(1)  # collective jobs need distinct numbers: they tag the messages


class Hosts:
    """One runtime and store per host, on one in-memory network or (``group``) on a gloo group or on NIXL agents;
    ``wrap(host, transport)`` adds faults. On the gloo group every reduce runs as the ring of streams unless
    ``native_reduce`` (gloo's own all-reduce where it can: tests/unit/test_native_reduce.py)."""

    def __init__(self, hosts=HOSTS, wrap=lambda host, transport: transport, step_timeout_s=STEP_TIMEOUT_S,
                 group: "Gloo | Nixl | None" = None, native_reduce: bool = False):
        net = MemoryNetwork()
        self.group = group
        self.kind = group.kind if group else "memory"
        self.stores = {h: ShardStore() for h in hosts}
        self.transports = {h: wrap(h, group.transport(h, native_reduce) if group else
                                   MemoryTransport(h, net, chunk_bytes=4096, timeout_s=step_timeout_s))
                           for h in hosts}
        self.runtimes = {h: Runtime(h, self.stores[h], {self.kind: self.transports[h]}, workers=8,
                                    step_timeout_s=step_timeout_s) for h in hosts}

    def close(self):
        for r in self.runtimes.values():
            r.close()

    def put(self, name: str, shards: dict[str, tuple[np.ndarray, tuple]], version: int = 1) -> None:
        """Commit ``shards`` (device -> (array, tile)) as ``name`` at ``version``."""
        upload = f"upload-{name}-{version}"  # one transaction per put: an ended one takes nothing more
        for dev, (array, tile) in shards.items():
            host = dev.split("/")[0]
            self.stores[host].stage(upload, dev, TileBuffer(array, tile, array.dtype.name))
        for h, store in self.stores.items():
            devs = [d for d in shards if d.split("/")[0] == h]
            if devs:
                store.commit(upload, name, version, devs)

    def put_tensor(self, name: str, a: np.ndarray, sharding: Sharding) -> None:
        tiles = sharding.tiles(a.shape)
        self.put(name, {d: (a[tuple(slice(lo, hi) for lo, hi in b)].copy(), b) for d, b in tiles.items()})

    def start(self, program_json: str, tensor: str, job: str | None = None, src_version: int = 1,
              program_id: str | None = None) -> tuple[str, dict]:
        """Prepare on every host, then execute on every host; returns (job, {host: run})."""
        job = job or uuid.uuid4().hex
        peers = {h: h for h in self.runtimes}
        extra = (self.group.generation, next(_SEQ)) if self.kind == "collective" else ()
        runs = {h: r.prepare(job, program_json, tensor, src_version, src_version + 1, peers, self.kind, *extra)
                for h, r in self.runtimes.items()}
        ident = program_id or next(iter(runs.values())).program_id
        for h, r in self.runtimes.items():
            r.execute(job, ident)
        return job, runs

    def finish(self, job: str, runs: dict, timeout: float = STEP_TIMEOUT_S) -> None:
        """Wait for every host, then commit everywhere (as the planner does), or abort everywhere and raise."""
        try:
            for run in runs.values():
                run.result(timeout)
        except BaseException as e:
            # the first host waited on often reports only that a peer gave up: name every host's own failure (taken
            # before the abort, which fails the rest as aborted)
            others = [f"{h}: {run.failed}" for h, run in runs.items() if run.failed not in (None, e)]
            for r in self.runtimes.values():
                r.abort(job)
            if others:
                e.add_note("every host's failure: " + "; ".join(others))
            raise
        for r in self.runtimes.values():
            r.commit(job)

    def get(self, name: str, sharding: Sharding, shape, version: int = 2) -> np.ndarray:
        """The committed tensor, read from every device: each tile must have its box's shape, and every copy of a
        tile (its replicas) must hold the same dtype and values, else one bad copy could hide behind a good one."""
        assert not sharding.partial, f"{sharding} is partial: its copies are addends, not replicas"
        out = None
        first: dict[tuple, tuple[str, np.ndarray]] = {}
        for dev, box in sharding.tiles(shape).items():
            tile = self.stores[dev.split("/")[0]].get(name, version, dev).array
            assert tile.shape == tuple(hi - lo for lo, hi in box), f"{dev}'s tile of {name} is {tile.shape}, box {box}"
            held_by, held = first.setdefault(box, (dev, tile))
            assert tile.dtype == held.dtype and np.array_equal(tile, held, equal_nan=tile.dtype.kind in "fc"), \
                f"{dev}'s copy of {name} {box} differs from {held_by}'s"
            if out is None:
                out = np.empty(shape, dtype=tile.dtype)
            out[tuple(slice(lo, hi) for lo, hi in box)] = tile
        return out


class Gloo:
    """A gloo process group of ``HOSTS`` formed in this process, as the agents' `GroupMember`s form it."""

    generation = 1
    kind = "collective"

    def __init__(self, op_timeout_s: float = STEP_TIMEOUT_S):
        import torch.distributed as dist

        from reshard.server.transport.collective import GroupMember

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.members = {h: GroupMember(h, "127.0.0.1", "127.0.0.1", "gloo", "cpu", 30.0, op_timeout_s)
                        for h in HOSTS}
        for m in self.members.values():
            m.update(GroupView(self.store.port, self.generation, HOSTS, "gloo"))
        deadline = time.monotonic() + 60
        while any(m.status()[0] != self.generation for m in self.members.values()):
            assert time.monotonic() < deadline, "the in-process gloo group did not form"
            time.sleep(0.05)

    def transport(self, host: str, native_reduce: bool = False):
        from reshard.server.transport.collective import CollectiveTransport

        return CollectiveTransport(host, self.members[host], lanes=4, window=4, chunk_bytes=4096,
                                   confirm_timeout_s=STEP_TIMEOUT_S, timeout_s=STEP_TIMEOUT_S,
                                   native_reduce=native_reduce)


class Nixl:
    """A NIXL agent per host of ``HOSTS`` in this process, each introduced to the others as the planner does."""

    kind = "nixl"
    generation = 0  # no process group: what a prepare passes where the collective transport passes its own

    def __init__(self, hosts=HOSTS):
        from reshard.server.transport.nixl import NixlTransport

        self.agents = {h: NixlTransport(h, chunk_bytes=4096, timeout_s=STEP_TIMEOUT_S) for h in hosts}
        for h, t in self.agents.items():
            for peer, other in self.agents.items():
                if peer != h:
                    t.add_peer(peer, other.metadata())

    def transport(self, host: str, native_reduce: bool = False):
        return _Kept(self.agents[host])


class _Kept(Wrapped):
    """A NIXL agent a runtime uses but does not close: one set serves every test (an agent takes a fifth of a
    second to make, and costs nothing idle)."""

    def close(self) -> None:
        pass


_NIXL: list[Nixl] = []


def nixl_agents() -> Nixl:
    """The session's NIXL agents, made at first use; the test skips where NIXL is not installed."""
    missing = nixl_missing()
    if missing:
        pytest.skip(missing)
    if not _NIXL:
        _NIXL.append(Nixl())
    return _NIXL[0]


@pytest.fixture(scope="module")
def gloo():
    pytest.importorskip("torch", reason="the collective transport needs torch")
    return Gloo()


def _group(request):
    return (request.getfixturevalue("gloo") if request.param == "collective"
            else nixl_agents() if request.param == "nixl" else None)


@pytest.fixture(params=["memory", "collective", "nixl"])
def hosts(request):
    h = Hosts(group=_group(request))
    yield h
    h.close()


@pytest.fixture(params=["memory", "collective", "nixl"])
def group(request):
    """None for the in-memory transport, else the gloo group or the NIXL agents."""
    return _group(request)


@pytest.fixture()
def memory_hosts():
    h = Hosts()
    yield h
    h.close()


def _sharding(axes: dict, hosts, per_host: int, spec) -> Sharding:
    return Sharding(Mesh.from_hosts(axes, list(hosts), per_host), spec)


def _full(shape) -> tuple:
    return tuple((0, n) for n in shape)


# -- moves ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["send_recv", "local_allgather", "broadcast", "auto"])
def test_a_reshard_program_delivers_every_tile(hosts, strategy):
    a = np.arange(37 * 11, dtype=np.int32).reshape(37, 11)
    src = _sharding({"x": 2, "y": 2}, HOSTS[:2], 2, ("x", None))
    dst = _sharding({"x": 2, "y": 2}, HOSTS[2:], 2, (None, ("x", "y")))
    hosts.put_tensor("a", a, src)
    plan = make_plan(a.shape, a.dtype, src, dst, strategy=strategy).validate()
    job, runs = hosts.start(plan.dumps(), "a")
    assert all(r.program_id == plan.id for r in runs.values())  # plan JSON runs under the plan's id
    hosts.finish(job, runs)
    assert np.array_equal(hosts.get("a", dst, a.shape), a)
    for h, run in runs.items():
        done, total, steps_done, steps = run.progress()
        assert done == total and steps_done == steps, h


def test_a_tile_that_arrived_whole_is_sent_on_under_the_digest_it_arrived_with(hosts):
    # A tile one stream filled keeps its sender's XXH3-64 (`TileBuffer.digest`), which the next job's trailer
    # reuses instead of a pass over the bytes: noted wrong, it fails that job at its receiver, so it is the one sent.
    a = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    on = {h: _sharding({"x": 1}, [h], 1, (None, None)) for h in HOSTS}
    hosts.put_tensor("a", a, on["host0"])
    for version, (frm, to) in enumerate([("host0", "host1"), ("host1", "host2")], start=1):
        plan = make_plan(a.shape, a.dtype, on[frm], on[to], strategy="send_recv").validate()
        job, runs = hosts.start(plan.dumps(), "a", src_version=version)
        hosts.finish(job, runs)
        assert np.array_equal(hosts.get("a", on[to], a.shape, version + 1), a)
        (device, _), = on[to].tiles(a.shape).items()
        shard = hosts.stores[to].get("a", version + 1, device)
        assert shard.digest == digest(a), (frm, to)
    store = hosts.stores["host2"]
    store._committed[("a", 3, device)] = replace(shard, digest=shard.digest ^ 1)
    plan = make_plan(a.shape, a.dtype, on["host2"], on["host3"], strategy="send_recv").validate()
    job, runs = hosts.start(plan.dumps(), "a", src_version=3)
    with pytest.raises(DataLossError, match="XXH3-64"):
        hosts.finish(job, runs)


@pytest.mark.parametrize("strategy, deferred", [("auto", True), ("broadcast", True), ("local_allgather", False)])
def test_the_part_of_a_tile_its_own_device_held_is_copied_while_the_streams_run(hosts, strategy, deferred):
    # An all-gather on the same hosts: every destination tile starts with the part its device held. A program of
    # moves that wait for nothing copies that part once it executes, beside its streams; one whose steps read
    # what earlier steps delivered (local_allgather's second phase) copies it at prepare, before any step runs.
    a = np.arange((4 * 13 + 1) * 5, dtype=np.float32).reshape(4 * 13 + 1, 5)
    src = _sharding({"x": 4, "y": 2}, HOSTS, 2, ("x", None))
    dst = _sharding({"x": 4, "y": 2}, HOSTS, 2, (None, None))
    hosts.put_tensor("a", a, src)
    plan = make_plan(a.shape, a.dtype, src, dst, strategy=strategy).validate()
    job, runs = hosts.start(plan.dumps(), "a")
    assert all(bool(run.fills) == deferred for run in runs.values())
    hosts.finish(job, runs)
    assert np.array_equal(hosts.get("a", dst, a.shape), a)


@pytest.mark.parametrize("group", ["collective", "nixl"], indirect=True)
def test_an_active_transport_copies_the_held_parts_once_the_first_streams_began(group):
    # The copies need only be done by the job's end; made as the run begins they would take the cores from the
    # hosts' first posts and WRITEs (`Runtime._copies_after_streams`): each host copies once its first depth's
    # units have begun on their lanes.
    hosts = Hosts(group=group)
    try:
        a = np.arange((4 * 13 + 1) * 5, dtype=np.float32).reshape(4 * 13 + 1, 5)
        src = _sharding({"x": 4, "y": 2}, HOSTS, 2, ("x", None))
        dst = _sharding({"x": 4, "y": 2}, HOSTS, 2, (None, None))
        hosts.put_tensor("a", a, src)
        plan = make_plan(a.shape, a.dtype, src, dst, strategy="auto").validate()
        job, peers = uuid.uuid4().hex, {h: h for h in hosts.runtimes}
        extra = (group.generation, next(_SEQ)) if hosts.kind == "collective" else ()
        runs = {h: r.prepare(job, plan.dumps(), "a", 1, 2, peers, hosts.kind, *extra)
                for h, r in hosts.runtimes.items()}
        seen = {}
        for h, run in runs.items():
            assert run.fills, h
            # at the copy: whether the first units had begun, or the longest wait for them had passed (a loaded
            # machine's lanes may take longer to wake)
            run.fill = lambda h=h, run=run, fill=run.fill: (seen.__setitem__(
                h, run.underway.is_set() or time.monotonic() - run.started >= COPIES_WAIT_S), fill())
        for r in hosts.runtimes.values():
            r.execute(job, plan.id)
        hosts.finish(job, runs)
        assert seen == {h: True for h in HOSTS}
        assert np.array_equal(hosts.get("a", dst, a.shape), a)
    finally:
        hosts.close()


@pytest.mark.parametrize("run_bytes", [2048, 16384])
def test_a_box_its_send_packs_is_digested_from_the_packed_chunks_not_in_a_pass_ahead(hosts, run_bytes):
    # A strided source box whose send packs it chunk by chunk (every strided box on the streaming transports;
    # on nixl, runs under 8 KiB) is digested from those chunks as it goes: a pass ahead would copy it once more.
    # Runs nixl writes as they lie are digested ahead, so that the send reads no byte.
    a = np.arange(64 * run_bytes // 2, dtype=np.float32).reshape(64, run_bytes // 2)
    src = _sharding({"x": 1}, ["host0"], 1, (None, None))
    dst = _sharding({"x": 2}, ["host1"], 2, (None, "x"))  # each device's box: 64 runs of run_bytes
    hosts.put_tensor("a", a, src)
    plan = make_plan(a.shape, a.dtype, src, dst, strategy="send_recv").validate()
    job, runs = hosts.start(plan.dumps(), "a")
    hosts.finish(job, runs)
    assert np.array_equal(hosts.get("a", dst, a.shape), a)
    ahead = hosts.kind == "nixl" and run_bytes >= 8192  # the session's agents know no NIC rate: no hashing in stream
    assert len(runs["host0"].digests) == (2 if ahead else 0), runs["host0"].digests


def _chain_program(shape=(64, 32), dtype="float32"):
    """Step 0: host0/0 -> host1/0; step 1 (after 0): host1/0 -> host2/0 of the box step 0 delivered;
    step 2, independent: host3/0 -> host2/1 of another tensor... of the same tensor, from its own tile."""
    src = Sharding(Mesh({"x": 2}, ["host0/0", "host3/0"]), (None, None))
    dst = Sharding(Mesh({"x": 3}, ["host1/0", "host2/0", "host2/1"]), (None, None))
    full = _full(shape)
    steps = [
        Step.move(0, Transfer(full, "host0/0", ("host1/0",), "p2p")),
        Step.move(1, Transfer(full, "host1/0", ("host2/0",), "p2p"), after=[0]),
        Step.move(2, Transfer(full, "host3/0", ("host2/1",), "p2p")),
    ]
    return Program((TensorDecl("tensor", shape, dtype, src, dst),), tuple(steps)).validate(), src, dst


def _stalled_chain(group) -> dict[int, tuple[float, float]]:
    """Run `_chain_program` with every move stalled 0.3 s; returns step -> (start, end) of its move."""
    stalls = {}
    h = Hosts(wrap=lambda host, t: stalls.setdefault(host, Stall(t, 0.3)), group=group)
    try:
        program, src, dst = _chain_program()
        a = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
        h.put_tensor("t", a, src)
        job, runs = h.start(program.dumps(), "t")
        h.finish(job, runs)
        assert np.array_equal(h.get("t", dst, a.shape), a)
        return {step: iv for s in stalls.values() for (j, step), iv in s.intervals.items() if j == job}
    finally:
        h.close()


def test_a_step_starts_only_after_the_steps_it_depends_on(group):
    spans = _stalled_chain(group)
    # step 1's sender holds the box only once step 0, stalled 0.3 s, delivered it
    assert spans[1][0] >= spans[0][0] + 0.3


def test_two_slow_independent_steps_overlap_in_time(group):
    spans = _stalled_chain(group)
    (s0, e0), (s2, e2) = spans[0], spans[2]
    assert max(s0, s2) < min(e0, e2), "steps 0 and 2 depend on nothing and must run at once"


def test_a_failing_step_cancels_the_rest_and_leaves_every_source_intact():
    stalls = {}

    def wrap(host, t):
        if host == "host0":
            return Fail(t, steps=[0])
        return stalls.setdefault(host, Stall(t, 0.5))  # step 2 (host3) is still stalling when step 0 fails

    h = Hosts(wrap=wrap)
    try:
        program, src, dst = _chain_program()
        a = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
        h.put_tensor("t", a, src)
        job, runs = h.start(program.dumps(), "t")
        with pytest.raises(UnavailableError, match="step 0 failed on host host0"):
            runs["host0"].result(STEP_TIMEOUT_S)
        for r in h.runtimes.values():  # what the planner does when one host fails
            r.abort(job)
        for run in runs.values():
            assert run.failed is not None
        assert not any(iv for s in stalls.values() for iv in s.intervals), "no other step may complete"
        for d in ("host1/0", "host2/0", "host2/1"):
            assert h.stores[d.split("/")[0]].find("t", 2, d) is None, d
        for d in ("host0/0", "host3/0"):
            assert np.array_equal(h.stores[d.split("/")[0]].get("t", 1, d).array, a), d
    finally:
        h.close()


def test_sixteen_programs_in_flight_at_once_all_complete_correct(group):
    stalls = {}
    h = Hosts(wrap=lambda host, t: stalls.setdefault(host, Stall(t, 0.05)), group=group)
    try:
        src = _sharding({"x": 2, "y": 2}, HOSTS[:2], 2, ("x", None))
        dst = _sharding({"x": 2, "y": 2}, HOSTS[2:], 2, (None, "y"))
        tensors = {f"t{i}": np.random.default_rng(i).integers(0, 1 << 30, (40 + i, 24), dtype=np.int64)
                   for i in range(16)}
        started = []
        for name, a in tensors.items():
            h.put_tensor(name, a, src)
            plan = make_plan(a.shape, a.dtype, src, dst, strategy="broadcast" if len(started) % 2 else "auto")
            started.append(h.start(plan.dumps(), name))
        for job, runs in started:
            h.finish(job, runs)
        for name, a in tensors.items():
            assert np.array_equal(h.get(name, dst, a.shape), a), name
        spans = sorted(iv for s in stalls.values() for iv in s.intervals.values())
        most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
        assert len({job for s in stalls.values() for job, _ in s.intervals}) == 16 and most > 4
    finally:
        h.close()


def test_a_step_past_its_deadline_fails_the_program_naming_the_step_and_host():
    h = Hosts(wrap=lambda host, t: Stall(t, 30.0) if host == "host3" else t, step_timeout_s=0.5)
    try:
        program, src, _ = _chain_program()
        a = np.ones((64, 32), np.float32)
        h.put_tensor("t", a, src)
        job, runs = h.start(program.dumps(), "t")
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=r"step 2 \(#2 move .*\) on host host3 did not finish "
                                                        r"within 0.5s"):
            runs["host3"].result(0.5)
        assert time.monotonic() - t0 < 2.0
        for r in h.runtimes.values():
            r.abort(job)
        assert np.array_equal(h.stores["host3"].get("t", 1, "host3/0").array, a)
    finally:
        h.close()


# -- reduce and compute ---------------------------------------------------------------------------------


GROUP = ("host0/0", "host0/1", "host1/0", "host2/0")  # two devices share host0: one ring hop is a copy


@pytest.mark.parametrize("op, fn", [("sum", np.sum), ("max", np.max)])
@pytest.mark.parametrize("result", ["replicate", "shard"])
def test_reduce_gives_numpys_answer(hosts, op, fn, result):
    shape = (13, 6)  # 13 rows over 4 members: chunks of 4, 4, 4, 1
    mesh = Mesh({"x": len(GROUP)}, GROUP)
    src = Sharding(mesh, (None, None))
    dst = Sharding(mesh, ("x", None) if result == "shard" else (None, None))
    rng = np.random.default_rng(7)
    addends = {d: rng.integers(-1000, 1000, shape, dtype=np.int64) for d in GROUP}
    hosts.put("r", {d: (a, _full(shape)) for d, a in addends.items()})
    full = _full(shape)
    step = Step.reduce(0, op, GROUP, TileRef("tensor", SRC, full), TileRef("tensor", DST, full), result=result,
                       dim=0 if result == "shard" else None)
    program = Program((TensorDecl("tensor", shape, "int64", src, dst),), (step,)).validate()
    job, runs = hosts.start(program.dumps(), "r")
    hosts.finish(job, runs)
    want = fn(np.stack(list(addends.values())), axis=0)
    assert np.array_equal(hosts.get("r", dst, shape), want)
    assert runs["host3"].steps_total == 0  # not in the group: nothing to do


def test_a_compute_copy_feeds_a_move_that_waits_for_it(hosts):
    shape = (6, 4)
    a = np.arange(24, dtype=np.float32).reshape(shape)
    src = Sharding(Mesh({"x": 1}, ["host0/0"]), (None, None))
    dst = Sharding(Mesh({"x": 1}, ["host1/0"]), (None, None))
    full, top = _full(shape), ((0, 3), (0, 4))
    steps = (
        Step.compute(0, "copy", "host0/0", [TileRef("tensor", SRC, top)], TileRef("copy", "out", top)),
        # to host1, which stages a destination tile, so its run (and the copy it received) lasts until the commit:
        # a host that stages none ends the job as its run ends, and gives back what the run made
        Step.move(1, Transfer(top, "host0/0", ("host1/0",), "p2p"), after=[0], tensor="copy"),
        Step.move(2, Transfer(full, "host0/0", ("host1/0",), "p2p")),
    )
    program = Program((TensorDecl("tensor", shape, "float32", src, dst), TensorDecl("copy", shape, "float32")),
                      steps).validate()
    hosts.put_tensor("t", a, src)
    job, runs = hosts.start(program.dumps(), "t")
    for run in runs.values():
        run.result(STEP_TIMEOUT_S)
    array, origin = runs["host1"].read("host1/0", "copy", top, DST)
    assert origin == top and np.array_equal(array, a[:3])
    for r in hosts.runtimes.values():
        r.commit(job)
    assert np.array_equal(hosts.get("t", dst, shape), a)


def test_a_push_for_an_unknown_job_or_step_is_refused(memory_hosts):
    hosts = memory_hosts
    from reshard.proto.errors import InvalidArgumentError, NotFoundError
    from reshard.server.transport.streams import PushHeader

    hosts.runtimes["host1"].prepare_wait_s = 0.3  # a push that came first waits this long for its prepare
    with pytest.raises(NotFoundError, match=r"agent host1 has no prepared job 'nope' \(none came within 0.3s of its "
                                            r"first push\)"):
        hosts.runtimes["host1"].accept(PushHeader("nope", "x", 0, 0, "host0"), [])
    program, src, _ = _chain_program()
    hosts.put_tensor("t", np.ones((64, 32), np.float32), src)
    job, runs = hosts.start(program.dumps(), "t")
    with pytest.raises(InvalidArgumentError, match="step 7 is not in the program"):
        hosts.runtimes["host1"].accept(PushHeader(job, runs["host1"].program_id, 7, 0, "host0"), [])
    hosts.finish(job, runs)


def test_runtimes_handed_their_hosts_slices_deliver_and_refuse_a_push_of_another_hosts_step(memory_hosts):
    """Each host prepares its own slice of the program (`reshard.host_slice`, as a planner hands a large one): the
    job runs as with the whole program, and a push naming a step of another host is refused, naming both hosts."""
    from reshard.host_slice import HostCut
    from reshard.proto.errors import InvalidArgumentError
    from reshard.server.transport.streams import PushHeader

    hosts = memory_hosts
    program, src, dst = _chain_program()
    a = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    hosts.put_tensor("t", a, src)
    cut, job, peers = HostCut(program), uuid.uuid4().hex, {h: h for h in hosts.runtimes}
    runs = {h: r.prepare(job, cut.text(h), "t", 1, 2, peers, hosts.kind) for h, r in hosts.runtimes.items()}
    assert {run.program_id for run in runs.values()} == {program.id}
    with pytest.raises(InvalidArgumentError, match="step 2 is not one of host host1's steps of the program; it was "
                                                   "pushed from host3"):
        hosts.runtimes["host1"].accept(PushHeader(job, program.id, 2, 0, "host3"), [])
    for r in hosts.runtimes.values():
        r.execute(job, program.id)
    hosts.finish(job, runs)
    assert np.array_equal(hosts.get("t", dst, a.shape), a)


def test_a_prepare_that_arrives_after_its_jobs_abort_or_end_is_refused(memory_hosts):
    """A paused agent can get its job's abort and its prepare in either order when it resumes; a prepare after
    the abort (or a replayed one after the job ended) would stage buffers no one ever frees."""
    from reshard.proto.errors import FailedPreconditionError

    hosts = memory_hosts
    program, src, _ = _chain_program()
    hosts.put_tensor("t", np.ones((64, 32), np.float32), src)
    runtime = hosts.runtimes["host1"]
    runtime.abort("overtaken")
    with pytest.raises(FailedPreconditionError, match="job overtaken has already ended on agent host1"):
        runtime.prepare("overtaken", program.dumps(), "t", 1, 2, {h: h for h in hosts.runtimes}, hosts.kind)
    job, runs = hosts.start(program.dumps(), "t")
    hosts.finish(job, runs)
    used = runtime.store.used_bytes()
    with pytest.raises(FailedPreconditionError, match=f"job {job} has already ended on agent host1"):
        runtime.prepare(job, program.dumps(), "t", 1, 2, {h: h for h in hosts.runtimes}, hosts.kind)
    assert runtime.store.used_bytes() == used


def test_a_host_that_calls_no_peer_announces_nothing_on_the_collective_transport(gloo):
    """Only hosts with a peer to call write their plan-id key: one whose part is local (a copy between its own
    devices, a compute) would cost every job a store round trip for a key no host waits for."""
    from reshard.server.common.contract import confirm_prefix

    hosts = Hosts(group=gloo)
    try:
        a = np.arange(12, dtype=np.int32).reshape(3, 4)
        two = Mesh.from_hosts({"x": 2}, ["host2"], 2)  # host2's two devices
        src, dst = Sharding(two, ("x", None)), Sharding(two, (None, "x"))
        hosts.put_tensor("local", a, src)
        job, runs = hosts.start(Program.from_plan(make_plan((3, 4), "int32", src, dst)).dumps(), "local")
        hosts.finish(job, runs)
        assert np.array_equal(hosts.get("local", dst, (3, 4)), a) and runs["host2"].tasks  # it did local work
        assert not gloo.store.check([confirm_prefix(gloo.generation, job, 0) + "host2"])

        near, far = (Sharding(Mesh.from_hosts({"x": 1}, [h], 1), (None, None)) for h in ("host0", "host3"))
        hosts.put_tensor("m", a, near)
        job, runs = hosts.start(Program.from_plan(make_plan((3, 4), "int32", near, far)).dumps(), "m")
        hosts.finish(job, runs)
        assert np.array_equal(hosts.get("m", far, (3, 4)), a)
        prefix = confirm_prefix(gloo.generation, job, 0)
        assert gloo.store.check([prefix + "host0", prefix + "host3"])  # the two that call each other
    finally:
        hosts.close()
