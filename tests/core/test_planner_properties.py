"""Property tests of the planner: every strategy, random shapes, meshes, specs and placements.

Besides `Plan.validate`, each plan is run on an ``arange`` tensor by a small
numpy simulator written here, independently of the core: every device starts
with its source tile, transfers run phase by phase (a sender reads what it held
when the phase began), and each destination device must end up with exactly
the values of its tile, having never been sent an element it already had.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reshard import STRATEGIES, Mesh, Plan, Sharding, Topology, plan
from reshard.box import to_slices

AXIS_NAMES = ("x", "y", "z")
REL = 1e-9


@st.composite
def axes_of(draw, size=None):
    """1-3 named axes of sizes 1..4 (whose product is ``size`` when given)."""
    names = draw(st.permutations(AXIS_NAMES))[: draw(st.integers(1, 3))]
    if size is None:
        return [(n, draw(st.integers(1, 4))) for n in names]
    sizes = []
    left = size
    for _ in names[:-1]:
        choices = [d for d in range(1, min(left, 4) + 1) if left % d == 0]
        d = draw(st.sampled_from(choices))
        sizes.append(d)
        left //= d
    sizes.append(left)
    return list(zip(names, sizes))


@st.composite
def specs_for(draw, axes, ndim):
    """A valid spec: each axis on at most one dim, in a random order; tuples included."""
    names = [n for n, _ in axes]
    order = draw(st.permutations(names))
    owners = [draw(st.integers(-1, ndim - 1)) for _ in order]
    spec: list = [[] for _ in range(ndim)]
    for name, dim in zip(order, owners):
        if dim >= 0:
            spec[dim].append(name)
    out = [None if not e else e[0] if len(e) == 1 and draw(st.booleans()) else tuple(e) for e in spec]
    return tuple(out[: draw(st.integers(0, ndim))]) if draw(st.integers(0, 4)) == 0 else tuple(out)


@st.composite
def problems(draw):
    """(shape, src, dst, topology) with disjoint, identical or partly shared devices."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    src_axes = draw(axes_of())
    n_src = math.prod(s for _, s in src_axes)
    placement = draw(st.sampled_from(["disjoint", "identical", "overlap"]))
    if placement == "identical" or draw(st.booleans()):
        dst_axes = draw(axes_of(size=n_src))
    else:
        dst_axes = draw(axes_of())
    n_dst = math.prod(s for _, s in dst_axes)
    if placement == "identical" and n_dst == n_src:
        shared = n_src
    elif placement == "overlap" and min(n_src, n_dst) > 1:
        shared = draw(st.integers(1, min(n_src, n_dst) - 1))
    else:
        shared = 0
    per_host = draw(st.integers(1, 4))
    pool_size = n_src + n_dst - shared
    pool = [f"h{i // per_host}/{i % per_host}" for i in range(pool_size)]
    pool = draw(st.permutations(pool))
    src_devices = pool[:n_src]
    dst_devices = pool[n_src - shared: n_src - shared + n_dst]
    if shared == n_src == n_dst:
        dst_devices = draw(st.permutations(src_devices))
    src = Sharding(Mesh(src_axes, src_devices), draw(specs_for(src_axes, ndim)))
    dst = Sharding(Mesh(dst_axes, dst_devices), draw(specs_for(dst_axes, ndim)))
    hosts = sorted({d.rpartition("/")[0] for d in pool})
    slow = draw(st.lists(st.sampled_from(hosts), max_size=2, unique=True))
    topology = Topology(nic_gbps=10.0, host_nic_gbps={h: draw(st.sampled_from([2.5, 25.0])) for h in slow})
    return shape, src, dst, topology


def simulate(p: Plan) -> None:
    """Run ``p`` on an arange tensor; assert every destination gets exactly its tile."""
    full = np.arange(math.prod(p.shape), dtype=np.int64).reshape(p.shape)
    src_tiles, dst_tiles = p.src.tiles(p.shape), p.dst.tiles(p.shape)
    held: dict[str, np.ndarray] = defaultdict(lambda: np.full(p.shape, -1, dtype=np.int64))
    for dev, tile in src_tiles.items():
        held[dev][to_slices(tile)] = full[to_slices(tile)]
    by_phase = defaultdict(list)
    for t in p.transfers:
        by_phase[t.phase].append(t)
    for phase in sorted(by_phase):
        start = {dev: buf.copy() for dev, buf in held.items()}
        for t in by_phase[phase]:
            sl = to_slices(t.box)
            assert t.sender in start and (start[t.sender][sl] >= 0).all(), (
                f"{t}: sender lacks part of its box at the start of phase {phase}")
            for r in t.receivers:
                tile = dst_tiles[r]
                assert all(t0 <= b0 and b1 <= t1 for (t0, t1), (b0, b1) in zip(tile, t.box)), (
                    f"{t}: box outside receiver {r}'s tile {tile}")
                assert (held[r][sl] < 0).all(), f"{t}: receiver {r} already holds part of the box"
                held[r][sl] = start[t.sender][sl]
    for dev, tile in dst_tiles.items():
        assert np.array_equal(held[dev][to_slices(tile)], full[to_slices(tile)]), f"{dev} does not get its tile {tile}"


# make test draws fewer problems than the slow suite (make bench): these run on CI's 2 cores, and every run draws
# new ones (not derandomized), so CI's runs add up.
DTYPES = st.sampled_from(["float32", "int8", "float64"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), DTYPES)
def test_every_strategy_delivers_exactly_and_auto_is_never_worse(problem, dtype):
    _every_strategy_delivers_exactly_and_auto_is_never_worse(problem, dtype)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), DTYPES)
def test_every_strategy_delivers_exactly_and_auto_is_never_worse_long(problem, dtype):
    _every_strategy_delivers_exactly_and_auto_is_never_worse(problem, dtype)


def _every_strategy_delivers_exactly_and_auto_is_never_worse(problem, dtype):
    shape, src, dst, topology = problem
    plans = {s: plan(shape, dtype, src, dst, topology, strategy=s) for s in STRATEGIES}
    lower = plans["auto"].lower_bound()
    for name, p in plans.items():
        assert p.strategy == name
        p.validate()
        simulate(p)
        assert p.wasted_bytes() == 0
        assert p.lower_bound() == lower
        assert p.estimate() >= lower * (1 - REL), f"{name} beats the lower bound"
    auto = plans["auto"].estimate()
    for name, p in plans.items():
        assert auto <= p.estimate() * (1 + REL), f"auto {auto} > {name} {p.estimate()}"


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(STRATEGIES))
def test_plan_json_round_trip_and_stable_id(problem, strategy):
    shape, src, dst, topology = problem
    p = plan(shape, "float32", src, dst, topology, strategy=strategy)
    again = plan(shape, "float32", src, dst, topology, strategy=strategy)
    assert again.id == p.id
    for data in (p.to_json(), json.loads(json.dumps(p.to_json())), p.dumps()):
        q = Plan.from_json(data)
        assert q.transfers == p.transfers
        assert q.id == p.id
        assert (q.shape, q.dtype, q.src, q.dst, q.strategy) == (p.shape, p.dtype, p.src, p.dst, p.strategy)
        assert q.estimate() == p.estimate()


@st.composite
def problems_with_empty_tiles(draw):
    """A problem whose tensor is so small that some destination devices get an empty tile."""
    shape, src, dst, topology = draw(problems())
    shape = tuple(draw(st.integers(1, 3)) for _ in shape)
    assume(any(lo == hi for tile in dst.tiles(shape).values() for lo, hi in tile))
    return shape, src, dst, topology


EMPTY_TILES_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much]


@settings(max_examples=50, deadline=None, suppress_health_check=EMPTY_TILES_HEALTH)
@given(problems_with_empty_tiles(), st.sampled_from(STRATEGIES))
def test_empty_destination_tiles_get_no_transfers_and_the_rest_arrive(problem, strategy):
    _empty_destination_tiles_get_no_transfers_and_the_rest_arrive(problem, strategy)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=EMPTY_TILES_HEALTH)
@given(problems_with_empty_tiles(), st.sampled_from(STRATEGIES))
def test_empty_destination_tiles_get_no_transfers_and_the_rest_arrive_long(problem, strategy):
    _empty_destination_tiles_get_no_transfers_and_the_rest_arrive(problem, strategy)


def _empty_destination_tiles_get_no_transfers_and_the_rest_arrive(problem, strategy):
    shape, src, dst, topology = problem
    p = plan(shape, "float32", src, dst, topology, strategy=strategy).validate()
    simulate(p)
    empty = {dev for dev, tile in dst.tiles(shape).items() if any(lo == hi for lo, hi in tile)}
    for t in p.transfers:
        assert all(lo < hi for lo, hi in t.box), f"{t}: an empty box"
        assert not empty & set(t.receivers), f"{t}: sends to a device whose tile is empty"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_issue_10_case_thirteen_rows_over_eight_devices(strategy):
    """(13, 64) from 2 devices of one host to 4x2 devices over 4 hosts: the last tile is empty."""
    src = Sharding(Mesh.from_hosts({"a": 2}, ["h0"], 2), ("a", None))
    dst = Sharding(Mesh.from_hosts({"a": 4, "b": 2}, ["h0", "h1", "h2", "h3"], 2), (("a", "b"), None))
    assert dst.tile((13, 64), "h3/1") == ((13, 13), (0, 64))
    p = plan((13, 64), "float32", src, dst, strategy=strategy).validate()
    simulate(p)
    assert all("h3/1" not in t.receivers for t in p.transfers)
