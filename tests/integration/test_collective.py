"""The collective transport's own guarantees, against a planner in this process and real agent processes.

A job on a stale process group generation and agents that prepared different plans
each fail with a clean error inside the timeout instead of hanging a recv; the job
records which transport carried each transfer, and the planner totals the bytes. An all-reduce across agent
processes runs as gloo's own all-reduce unless the agents run with ``--no-native-reduce``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from reshard import Mesh, Sharding
from reshard.client import Client, FailedPreconditionError, JobFailedError
from reshard.client.cluster import start_process
from reshard.strategies import plan as make_plan
from reshard.server.common.contract import Staging
from reshard.server.common.config import PlannerConfig
from reshard.server.planner.jobs import Preparation
from reshard.server.planner.service import serve_planner

COLLECTIVE_TIMEOUT_S = 5.0
HOSTS = ("c0", "c1")


def _agent(address, host, tmp_path, transport="collective", *extra):
    cmd = [sys.executable, "-m", "reshard.server.cli", "agent", "--planner", address, "--listen", "127.0.0.1:0",
           "--host", host, "--devices", "2", "--transport", transport,
           "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), *extra]
    return start_process(cmd, tmp_path / f"agent-{host}.log", 60)[0]


def _wait_group(planner, hosts, after=0, timeout=30.0):
    """Block until ``hosts`` formed a generation newer than ``after``; returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = planner.group.view()
        if view.generation > after and set(hosts) <= set(view.members) and all(planner.group.in_group(h)
                                                                                for h in view.members):
            return view.generation
        time.sleep(0.05)
    raise AssertionError(f"process group with {hosts} did not form: {planner.group.view()}")


def _stop(procs, server, planner) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)
        p.stdout.close()
    server.stop(0)
    planner.close()


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collective")
    server, port, planner = serve_planner(PlannerConfig(heartbeat_timeout_s=2.0, group_wait_s=20.0))
    address = f"127.0.0.1:{port}"
    procs = [_agent(address, h, tmp) for h in HOSTS]
    try:
        _wait_group(planner, HOSTS)
        with Client(address) as c:
            yield planner, c, tmp
    finally:
        _stop(procs, server, planner)


SRC = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["c0"], 2), ("y", None))
DST = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["c1"], 2), (None, None))
A = np.arange(300 * 40, dtype=np.float32).reshape(300, 40)


def test_job_records_transport_and_planner_counts_bytes(planned):
    planner, c, _ = planned
    c.put("counted", A, SRC)
    before = planner.bytes_moved()
    plan = c.plan("counted", DST, "broadcast")
    result = c.reshard("counted", DST, "broadcast").result(timeout=60)
    assert result.plan_id == plan.id and result.transport == "collective"
    assert result.transports == ("collective",) * len(plan.transfers)
    assert np.array_equal(c.get("counted"), A)
    moved = planner.bytes_moved()
    assert moved["collective"] - before.get("collective", 0) == result.network_bytes == A.nbytes
    split = Sharding(DST.mesh, ("y", None))
    assert c.reshard("counted", split, "auto").result(timeout=60).transports == ()  # each device keeps its half
    again = c.reshard("counted", DST, "auto").result(timeout=60)  # each device copies the other's half
    assert set(again.transports) == {"local"} and again.network_bytes == 0
    assert planner.bytes_moved()["local"] - moved.get("local", 0) == A.nbytes
    assert np.array_equal(c.get("counted"), A)
    c.delete("counted")


def test_finished_jobs_leave_no_confirmation_keys_in_the_store(planned):
    """The rendezvous store lives as long as the planner: per-job keys must not pile up."""
    planner, c, _ = planned
    _wait_group(planner, HOSTS)
    c.put("keys", A, SRC)
    c.reshard("keys", DST, "broadcast").result(timeout=60)  # the group's own keys are in place after one job
    store = planner.rendezvous.store
    before = store.num_keys()
    for dst in (SRC, DST, SRC):
        job = c.reshard("keys", dst, "broadcast").result(timeout=60)
        assert job.transport == "collective"
        assert not store.check([f"reshard/g{planner.group.view().generation}/confirm/{job.id}/0/c0"])
    # Jobs on one host call no peer: they write no key, and the planner deletes none (a store round trip saved).
    c.reshard("keys", Sharding(SRC.mesh, (None, "y")), "broadcast").result(timeout=60)
    c.apply("scale", "keys", out="keys2", factor=2.0).result(timeout=60)
    assert np.array_equal(c.get("keys2"), 2 * A)
    assert store.num_keys() == before
    c.delete("keys")
    c.delete("keys2")


@pytest.mark.slow  # a process group of its own (7 s): make bench runs it
def test_one_lane_per_host_still_moves_a_state_dict_whole(tmp_path):
    """The deadlock argument of reshard.server.agent.task_graph at its tightest: with one lane (and one for small
    routes) on every host, every route of a state dict waits for the one before it, and the move still completes,
    bit for bit on every replica."""
    from .every_device import assert_every_device

    server, port, planner = serve_planner(PlannerConfig(heartbeat_timeout_s=2.0, group_wait_s=20.0))
    address = f"127.0.0.1:{port}"
    hosts = ("l0", "l1", "l2")
    procs = [_agent(address, h, tmp_path, "collective", "--collective-lanes", "1", "--collective-chunk-mib", "0.25")
             for h in hosts]
    try:
        _wait_group(planner, hosts)
        train = Mesh.from_hosts({"tp": 2}, ["l0"], 2)
        infer = Mesh.from_hosts({"dp": 2, "tp": 2}, ["l1", "l2"], 2)
        rng = np.random.default_rng(7)
        arrays = {f"w{i}": rng.integers(-99, 99, (64 * (1 + i % 3), 4096 if i % 4 == 0 else 96)).astype(np.float32)
                  for i in range(12)}  # routes over and under 1 MiB, rows and columns split
        specs = {n: ("tp", None) if i % 2 else (None, "tp") for i, n in enumerate(arrays)}
        with Client(address) as c:
            c.put_many({n: (a, Sharding(train, specs[n])) for n, a in arrays.items()})
            result = c.reshard_many({n: Sharding(infer, specs[n]) for n in arrays}, bucket_mib=0.5).result(timeout=120)
            assert result.transport == "collective" and result.network_bytes > 2**20
            for n, a in arrays.items():
                assert_every_device(c, n, a, Sharding(infer, specs[n]))
    finally:
        _stop(procs, server, planner)


# Without the native path (8 s more of a process group) in the slow suite: make bench runs it.
@pytest.mark.parametrize("native", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["native-reduce", "no-native-reduce"])
def test_an_all_reduce_across_agent_processes_runs_natively_unless_the_agents_say_not(tmp_path, native):
    """A contracting dim split over three agent processes: its all-reduce sums exactly either way. By default the
    agents claim their hosts' group for gloo's own all-reduce (the claim key is left free afterwards) and the job's
    traffic says each host ran it so; with ``--no-native-reduce`` none of them proposes it, so the key never exists
    and every host ran the ring."""
    server, port, planner = serve_planner(PlannerConfig(heartbeat_timeout_s=2.0, group_wait_s=20.0))
    address = f"127.0.0.1:{port}"
    hosts = ("n0", "n1", "n2")
    procs = [_agent(address, h, tmp_path, "collective", *(() if native else ("--no-native-reduce",))) for h in hosts]
    try:
        generation = _wait_group(planner, hosts)
        mesh = Mesh.from_hosts({"x": 3}, list(hosts), 1)
        rng = np.random.default_rng(11)
        a, b = rng.integers(-4, 5, (24, 96)).astype(np.float64), rng.integers(-4, 5, (96, 40)).astype(np.float64)
        with Client(address) as c:
            c.put("na", a, Sharding(mesh, (None, "x")))
            c.put("nb", b, Sharding(mesh, ("x", None)))
            result = c.einsum("ij,jk->ik", "na", "nb", out="nc").result(timeout=60)
            assert result.transport == "collective"
            assert {h: t["native_reduces"] for h, t in result.traffic.items()} == {h: int(native) for h in hosts}
            np.testing.assert_array_equal(c.get("nc"), a @ b)
        key = f"reshard/g{generation}/native/{','.join(hosts)}"
        store = planner.rendezvous.store
        if native:
            assert store.check([key]) and store.get(key) == b""  # claimed for the reduce, then freed
        else:
            assert not store.check([key])
    finally:
        _stop(procs, server, planner)


def _prepare_both(planner, c, job, plans, generation, seq):
    rec = planner.catalog.get("shared")
    peers = {h: planner.registry.get(h).address for h in HOSTS}
    for h, plan in zip(HOSTS, plans):
        planner.agents.prepare(h, peers[h], Preparation(job, plan.dumps(), "shared", rec.version, rec.version + 1,
                                                        peers, "collective", generation, seq), 10)
    return peers


def _execute_both(planner, job, plans, peers):
    """Run Execute on both agents at once; returns {host: (error or None, seconds)}."""
    out = {}

    def run(h, plan):
        t0 = time.monotonic()
        try:
            planner.agents.execute(h, peers[h], job, plan.id, lambda *_: None, 60)
            out[h] = (None, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[h] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=(h, p)) for h, p in zip(HOSTS, plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for h, p in zip(HOSTS, plans):
        planner.agents.abort(h, peers[h], Staging(job=job), 10)
    return out


@pytest.fixture()
def shared(planned):
    planner, c, _ = planned
    c.put("shared", A, SRC)
    yield planner, c
    c.delete("shared")


def test_plan_id_mismatch_raises_instead_of_hanging(shared):
    planner, c = shared
    rec = planner.catalog.get("shared")
    plans = [make_plan(A.shape, "float32", rec.sharding, DST, strategy=s).validate()
             for s in ("broadcast", "send_recv")]
    assert plans[0].id != plans[1].id
    generation = _wait_group(planner, HOSTS)
    peers = _prepare_both(planner, c, "mismatch", plans, generation, 900)
    out = _execute_both(planner, "mismatch", plans, peers)
    for h in HOSTS:
        err, seconds = out[h]
        assert isinstance(err, FailedPreconditionError), (h, err)
        assert "every agent must run the same plan, so no collective call was made" in str(err)
        assert seconds < COLLECTIVE_TIMEOUT_S
    assert f"confirmed plan {plans[1].id[:12]}" in str(out["c0"][0])
    # no call was made, so the group is intact and the next job runs on it
    assert c.reshard("shared", DST).result(timeout=60).transport == "collective"


def test_stale_generation_fails_cleanly(shared):
    planner, c = shared
    rec = planner.catalog.get("shared")
    plan = make_plan(A.shape, "float32", rec.sharding, DST, strategy="broadcast").validate()
    generation = _wait_group(planner, HOSTS)
    peers = _prepare_both(planner, c, "stale", [plan, plan], generation, 901)
    planner.group.reform("the test re-forms the group")  # as when an agent joins or leaves
    newer = _wait_group(planner, HOSTS, after=generation)
    out = _execute_both(planner, "stale", [plan, plan], peers)
    for h in HOSTS:
        err, seconds = out[h]
        assert isinstance(err, FailedPreconditionError), (h, err)
        assert f"runs on process group generation {generation}" in str(err) or "cannot run phase 0" in str(err)
        assert seconds < COLLECTIVE_TIMEOUT_S
    # a job prepared on the old generation is refused outright, alone or inside its first Execute
    late = Preparation("late", plan.dumps(), "shared", rec.version, rec.version + 1, peers, "collective", generation,
                       902)
    stale = rf"generation {generation}, but agent c0 has generation {newer}"
    with pytest.raises(FailedPreconditionError, match=stale):
        planner.agents.prepare("c0", peers["c0"], late, 10)
    t0 = time.monotonic()
    with pytest.raises(FailedPreconditionError, match=stale):
        planner.agents.execute("c0", peers["c0"], "late", plan.id, lambda *_: None, 60, late)
    assert time.monotonic() - t0 < COLLECTIVE_TIMEOUT_S
    assert c.reshard("shared", DST).result(timeout=60).transport == "collective"
    assert np.array_equal(c.get("shared"), A)


def test_hosts_on_different_transports_fail_the_job_naming_them(planned):
    planner, c, tmp = planned
    proc = _agent(c.address, "g0", tmp, "grpc")
    try:
        deadline = time.monotonic() + 20
        while "g0/0" not in c.devices() and time.monotonic() < deadline:
            time.sleep(0.05)
        c.put("mixed", A, SRC)
        job = c.reshard("mixed", Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["g0"], 2), (None, None)))
        with pytest.raises(JobFailedError, match=r"hosts \['c0'\] run --transport collective but hosts \['g0'\] "
                                                 r"run --transport grpc"):
            job.result(timeout=30)
        assert np.array_equal(c.get("mixed"), A)
        c.delete("mixed")
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def test_collective_without_torch_is_an_error_naming_the_install():
    code = ("import sys; sys.modules['torch'] = None; from reshard.server.cli import main; "
            "sys.exit(main(['agent', '--planner', '127.0.0.1:9', '--host', 'h', '--devices', '1', "
            "'--transport', 'collective']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install 'reshard[torch]'" in proc.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="the NCCL backend needs a CUDA device per agent (two here); this machine has "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
def test_nccl_backend_moves_bytes(tmp_path):
    server, port, planner = serve_planner(PlannerConfig(heartbeat_timeout_s=2.0, group_wait_s=30.0))
    address = f"127.0.0.1:{port}"
    procs = [_agent(address, h, tmp_path, "collective", "--device", f"cuda:{i}") for i, h in enumerate(HOSTS)]
    try:
        _wait_group(planner, HOSTS)
        with Client(address) as c:
            c.put("nccl", A, SRC)
            result = c.reshard("nccl", DST, "broadcast").result(timeout=60)
            assert result.transport == "collective" and planner.group.view().backend == "nccl"
            assert np.array_equal(c.get("nccl"), A)
            # jobs in flight at once take turns on the communicator instead of interleaving their calls
            B = A[::-1].copy()
            c.put("nccl2", B, DST)
            jobs = [c.reshard("nccl", SRC, "send_recv"), c.reshard("nccl2", SRC, "send_recv")]
            assert [j.result(timeout=60).transport for j in jobs] == ["collective"] * 2
            assert np.array_equal(c.get("nccl"), A) and np.array_equal(c.get("nccl2"), B)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        server.stop(0)



def test_lanes_run_an_all_to_all_round_robin_over_host_pairs_in_one_order_on_every_host():
    from reshard import Topology
    from reshard.cases import n_to_m_cases
    from reshard.mesh import host_of
    from reshard.program import Program
    from reshard.server.agent.task_graph import host_tasks

    def _tasks(plan, depth, host):  # one host's tasks of one depth, in the order it runs them
        return [task for task in host_tasks(Program.from_plan(plan), host) if task.depth == depth]

    hosts = [f"h{i}" for i in range(5)]
    case = next(c for c in n_to_m_cases(hosts, 2**20) if c.name == "case4")
    p = make_plan(case.shape, case.dtype, case.src, case.dst, Topology(nic_gbps=1.0), "auto")
    pairs = {(host_of(t.sender), host_of(t.receivers[0])) for t in p.transfers}
    assert len(p.transfers) > len(pairs) > 1  # several transfers per host pair, listed grouped by destination
    seqs = {h: list(dict.fromkeys(task.index for task in _tasks(p, 0, h))) for h in hosts}
    # Any two transfers that two hosts share run in the same order on both: the first unfinished
    # transfer of that one order runs on all its hosts, so the lanes cannot deadlock ...
    for h1 in hosts:
        for h2 in hosts:
            shared = set(seqs[h1]) & set(seqs[h2])
            assert [i for i in seqs[h1] if i in shared] == [i for i in seqs[h2] if i in shared], (h1, h2)
    # ... and a host's first sends go to different hosts, not all to the first destination in the plan.
    for h in hosts:
        sends = [host_of(task.transfer.receivers[0]) for task in _tasks(p, 0, h) if task.role == "send"]
        firsts = sends[:len(set(sends))]
        assert len(set(firsts)) == len(firsts), (h, firsts)


def test_lane_units_of_a_state_dict_run_in_one_order_on_every_host_route_by_route_largest_first():
    from reshard import TensorDecl
    from reshard.many import plan_many
    from reshard.mesh import host_of
    from reshard.program import MOVE
    from reshard.server.agent.buckets import bucket_moves
    from reshard.server.agent.task_graph import _route, _task_peers, host_tasks, lane_units

    train = Mesh.from_hosts({"tp": 4}, [f"t{i}" for i in range(4)], 1)
    infer = Mesh.from_hosts({"dp": 2, "tp": 2}, [f"i{i}" for i in range(4)], 1)
    decls = []
    for i in range(30):  # row and column splits, replicated norms, small and large tensors of several dtypes
        decls += [TensorDecl(f"w{i}", (256, 128), "float16", Sharding(train, ("tp", None)),
                             Sharding(infer, ("tp", None))),
                  TensorDecl(f"v{i}", (64, 4096 if i % 5 == 0 else 256), "uint8", Sharding(train, (None, "tp")),
                             Sharding(infer, (None, "tp"))),
                  TensorDecl(f"n{i}", (128,), "float32", Sharding(train, (None,)), Sharding(infer, (None,)))]
    program = plan_many(decls, bucket_bytes=64 * 1024)
    buckets = bucket_moves(program)
    assert buckets  # small moves travel packed, large ones on their own

    def nbytes(step):
        return buckets[step.id].nbytes if step.id in buckets else \
            int(np.prod([hi - lo for lo, hi in step.transfer.box])) * program.tensor(step.tensor).itemsize

    hosts = sorted({host_of(d) for d in train.devices + infer.devices})
    units, tasks = {}, {}
    for h in hosts:
        mine = [t for t in host_tasks(program, h, buckets) if t.depth == 0]
        calling = [t for t in mine if _task_peers(t, h)]
        units[h] = lane_units(calling, nbytes)
        tasks[h] = calling
        assert sorted(id(t) for u in units[h] for t in u) == sorted(id(t) for t in calling)  # each task once
        for unit in units[h]:  # a unit is the moves of one route, in the order every host derives
            assert len({_route(t.step.transfer) for t in unit}) == 1
            assert [t.step.id for t in unit] == [t.step.id for t in calling if t in unit]
        sizes = [sum(nbytes(t.step) for t in u if t.step.kind == MOVE) for u in units[h]]
        assert sizes == sorted(sizes, reverse=True)  # largest first
        # one unit per route: lanes no longer queue a route's small moves one by one behind other routes' ...
        assert len(units[h]) == len({_route(t.step.transfer) for t in calling}) < len(calling)
    # ... and any two hosts hold the units they share as the same steps, in the same order (the deadlock argument
    # of reshard.server.agent.task_graph's docstring).
    seqs = {h: [tuple(t.step.id for t in u) for u in units[h]] for h in hosts}
    for h1 in hosts:
        for h2 in hosts:
            shared = set(seqs[h1]) & set(seqs[h2])
            assert [u for u in seqs[h1] if u in shared] == [u for u in seqs[h2] if u in shared], (h1, h2)
            ids1 = {i for u in seqs[h1] for i in u}
            assert not [u for u in seqs[h2] if set(u) & ids1 and u not in shared], (h1, h2)  # no unit split apart
    # The runtime runs those units, worked out once per program (`HostLayout.depths`, by index into its tasks),
    # and the memory a job holds for bucket buffers counts the lanes for small routes apart from the others: a
    # bucket task counts on the lanes its unit runs on, and only there.
    from reshard.server.agent.programs import HostLayout
    from reshard.server.agent.task_graph import SMALL_UNIT_BYTES

    for h in hosts:
        layout = HostLayout(program, h)
        assert layout.calls_peers
        peers, local, kept = layout.depths[0]
        assert peers == frozenset(set().union(*(_task_peers(t, h) for t in tasks[h])))
        assert not local  # a pure move: every task of depth 0 calls a peer
        assert [[layout.tasks[i].step.id for i in unit] for _, unit in kept] == \
            [[t.step.id for t in u] for u in units[h]]
        on_small = [small for small, _ in kept]
        assert on_small == [all(t.step.kind == MOVE for t in u) and sum(nbytes(t.step) for t in u) < SMALL_UNIT_BYTES
                            for u in units[h]]
        held = {i: n for i, n in zip(*_bucket_tasks(layout, h))}
        small_tasks = {i for small, unit in kept if small for i in unit}
        assert layout.small_bucket_buffers == sorted((n for i, n in held.items() if i in small_tasks), reverse=True)
        assert layout.large_bucket_buffers == sorted((n for i, n in held.items() if i not in small_tasks),
                                                     reverse=True)
        assert layout.bucket_buffers == sorted(held.values(), reverse=True)
        assert layout.bucket_peak(2) == sum(layout.bucket_buffers[:2])
        assert layout.bucket_peak(2, 2) == sum(layout.large_bucket_buffers[:2]) + sum(layout.small_bucket_buffers[:2])
        assert layout.buckets_at_once(2, 2) == min(2, len(layout.large_bucket_buffers)) + \
            min(2, len(layout.small_bucket_buffers))
    # Here every route of buckets is under SMALL_UNIT_BYTES (the large moves travel alone): they count on the lanes
    # for small routes only, where they were counted on both before.
    layout = HostLayout(program, "i0")
    assert len(layout.small_bucket_buffers) > 2 and not layout.large_bucket_buffers
    assert layout.bucket_peak(2, 2) == 2 * layout.bucket_peak(2, 1) == layout.bucket_peak(2) > 0
    assert layout.buckets_at_once(2, 2) == layout.buckets_at_once(2) == 2


def _bucket_tasks(layout, host: str) -> tuple[list[int], list[int]]:
    """The indexes of ``layout``'s tasks that send or take a bucket, and the bytes each holds: the bucket once for
    its sender and once per receiving device of ``host``."""
    from reshard.mesh import host_of

    picked = [(i, t) for i, t in enumerate(layout.tasks) if t.step.id in layout.buckets and t.role in ("send", "recv")]
    return ([i for i, _ in picked],
            [layout.buckets[t.step.id].nbytes * ((t.role == "send") + sum(host_of(r) == host
                                                                         for r in t.step.transfer.receivers))
             for _, t in picked])
