"""Reshard programs of Partial tensors, run by the agents' runtimes in this process.

Every source device holds small-integer addends in float32 (so every sum is exact);
after the program every destination tile must equal the summed tensor's tile, and
the reduces must put on the network what a bandwidth-optimal ring does: 2(n-1)/n of
the box per member for an all-reduce, (n-1)/n for a reduce-scatter, as the runtime's
traffic counts it and as the program's cost model says.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from reshard import MOVE, REDUCE, Mesh, Sharding, reshard_program
from tests.core.test_partial import addends, expected

from .test_runtime import HOSTS, STEP_TIMEOUT_S, Hosts, gloo, hosts  # noqa: F401 - fixtures: each transport

_NAMES = iter(range(10**9))


@pytest.fixture(scope="module")
def agents():
    """The in-memory transport's runtimes, shared by this module's tests (each job's tensor has its own name)."""
    h = Hosts()
    yield h
    h.close()


def _run(hosts: Hosts, shape, src: Sharding, dst: Sharding, seed: int = 0, strategy: str = "auto"):
    """Put random addends under a fresh name, run the program, and check every destination tile; returns the
    program and each host's traffic."""
    program = reshard_program(shape, "float32", src, dst, strategy=strategy).validate()
    rng = np.random.default_rng(seed)
    tiles, whole = addends(src, shape, rng)
    name = f"t{next(_NAMES)}"
    hosts.put(name, {dev: (a, src.tile(shape, dev)) for dev, a in tiles.items()})
    job, runs = hosts.start(program.dumps(), name)
    hosts.finish(job, runs, STEP_TIMEOUT_S)
    for dev, want in expected(src, dst, shape, whole).items():
        got = hosts.stores[dev.split("/")[0]].get(name, 2, dev).array
        assert got.dtype == np.float32 and np.array_equal(got, want), f"{dev}: {got} != {want}"
    return program, {h: r.traffic(job) for h, r in hosts.runtimes.items()}


def _mesh(axes: dict, per_host: int) -> Mesh:
    return Mesh.from_hosts(axes, list(HOSTS[: math.prod(axes.values()) // per_host]), per_host)


# -- bytes a ring puts on the network ----------------------------------------------------------------------


@pytest.mark.parametrize("result", ["replicate", "shard"])
def test_a_ring_over_n_hosts_sends_what_a_bandwidth_optimal_ring_does(hosts, result):
    n = len(HOSTS)
    shape = (4 * n, 5)  # the ring cuts the box into n equal parts
    mesh = _mesh({"x": n}, 1)
    dst = Sharding(mesh, ("x", None) if result == "shard" else (None, None))
    program, traffic = _run(hosts, shape, Sharding(mesh, (None, None), ("x",)), dst)
    assert [s.result for s in program.steps] == [result]
    tile = math.prod(shape) * 4
    share = 2 * (n - 1) if result == "replicate" else n - 1
    model = program.host_bytes()
    for h, t in traffic.items():
        assert sum(t.bytes_out.values()) == sum(t.bytes_in.values()) == share * tile // n, h
        assert model[h]["bytes_out"] == model[h]["bytes_in"] == share * tile // n, h
        assert t.local_bytes == 0


def test_a_reduce_inside_one_host_crosses_no_nic(agents):
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[:2]), 2)  # y: the two devices of one host
    program, traffic = _run(agents, (6, 4), Sharding(mesh, (None, None), ("y",)), Sharding(mesh, ("y", None)))
    assert [s.result for s in program.steps] == ["shard", "shard"]
    assert all(not t.bytes_out and not t.bytes_in for t in traffic.values())
    assert traffic["host0"].local_bytes == traffic["host1"].local_bytes == 2 * 1 * 6 * 4 * 4 // 2


# -- examples --------------------------------------------------------------------------------------------

M22 = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[:2]), 2)
M8 = Mesh.from_hosts({"x": 4, "y": 2}, list(HOSTS), 2)

# (name, shape, src, dst): completed in place, or partial axes kept (the addends move as they are)
EXAMPLES = [
    ("all-reduce to replicate", (7, 3), Sharding(M22, (None, None), ("x",)), Sharding(M22, (None, None))),
    ("reduce-scatter, uneven", (3, 5), Sharding(M8, (None, "y"), ("x",)), Sharding(M8, ("x", "y"))),
    ("over two axes at once", (9,), Sharding(M22, (None,), ("x", "y")), Sharding(M22, (("x", "y"),))),
    ("all-reduce, then each copies its part", (5, 6), Sharding(M22, (None, None), ("x",)),
     Sharding(M22, (("x", "y"), None))),
    ("keep one axis partial", (6, 2), Sharding(M8, (None, None), ("x", "y")), Sharding(M8, ("x", None), ("y",))),
    ("keep every axis partial, move addends", (6, 5), Sharding(M8, ("x", None), ("y",)),
     Sharding(M8, (None, "x"), ("y",))),
]


@pytest.mark.parametrize("name, shape, src, dst", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_partial_examples_complete_the_sum(hosts, name, shape, src, dst):
    _run(hosts, shape, src, dst)


def test_reduce_then_move_to_another_mesh(hosts):
    """The moves read the sums their senders' reduce left (role "reduced"), not the source shards' addends, and
    the trailer's digest is of what they sent: a wrong one would fail the job."""
    mesh = Mesh.from_hosts({"x": 2}, list(HOSTS[:2]), 1)
    other = Mesh.from_hosts({"x": 2}, list(HOSTS[2:]), 1)
    program, _ = _run(hosts, (4, 3), Sharding(mesh, (None, None), ("x",)), Sharding(other, ("x", None)))
    moves = [s for s in program.steps if s.kind == MOVE]
    assert moves and all(s.role == "reduced" for s in moves)


def test_reduce_then_forward_inside_the_receiving_hosts(agents):
    """local_allgather's second phase forwards, from the destination tiles, the sums the first phase delivered."""
    mesh = Mesh.from_hosts({"x": 2}, list(HOSTS[:2]), 1)
    other = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[2:]), 2)
    src, dst = Sharding(mesh, (None, None), ("x",)), Sharding(other, ("x", None))
    program = reshard_program((8, 3), "float32", src, dst, strategy="local_allgather")
    assert {s.role for s in program.steps if s.kind == MOVE} == {"reduced", "dst"}
    _run(agents, (8, 3), src, dst, strategy="local_allgather")


# -- random problems ----------------------------------------------------------------------------------------


@st.composite
def in_place_problems(draw):
    """(shape, src, dst) on one 1- or 2-axis mesh over the four hosts, where the agents finish without moving
    reduced values: dst keeps some partial axes and splits the rest of the tensor as src does, adding axes
    (summed or replicated ones) to its dims as minor axes; or dst keeps every partial axis and lays the tensor
    out anyhow (the addends move)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    names = draw(st.permutations(["x", "y"]))[: draw(st.integers(1, 2))]
    summed = draw(st.sampled_from(names))
    axes = {n: draw(st.integers(2 if n == summed else 1, 4)) for n in names}
    size = math.prod(axes.values())
    assume(size <= 2 * len(HOSTS))
    mesh = _mesh(axes, 2 if size > len(HOSTS) or (size % 2 == 0 and draw(st.booleans())) else 1)
    roles = {n: draw(st.integers(-2, ndim - 1)) for n in names}  # -2 partial, -1 replicated, else the dim split
    roles[summed] = -2
    partial = [n for n in names if roles[n] == -2]
    spec = [[n for n in names if roles[n] == d] for d in range(ndim)]
    src = Sharding(mesh, [tuple(e) or None for e in spec], partial)
    kept = draw(st.lists(st.sampled_from(partial), unique=True))
    if set(kept) == set(partial) and draw(st.booleans()):
        free = [n for n in names if n not in kept]
        dst_spec: list[list[str]] = [[] for _ in range(ndim)]
        for n in free:
            d = draw(st.integers(-1, ndim - 1))
            if d >= 0:
                dst_spec[d].append(n)
    else:
        dst_spec = [list(e) for e in spec]
        for n in draw(st.permutations([n for n in names if roles[n] < 0 and n not in kept])):
            d = draw(st.integers(-1, ndim - 1))
            if d >= 0:
                dst_spec[d].append(n)
    return shape, src, Sharding(mesh, [tuple(e) or None for e in dst_spec], kept)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(in_place_problems(), st.integers(0, 2**32 - 1))
def test_random_partial_reshards_on_the_agents(agents, problem, seed):
    shape, src, dst = problem
    program, _ = _run(agents, shape, src, dst, seed)
    event(" + ".join(sorted({s.result if s.kind == REDUCE else s.kind for s in program.steps})) or "nothing")
