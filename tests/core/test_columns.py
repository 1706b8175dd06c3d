"""The planner at scale: unit tasks, transfers, loads and validation as columns.

Each columnar path is checked against the plain one it replaces, on random problems:
`decompose` against a reference that intersects every pair of tiles, the columns' loads
against `phase_loads` of the same transfers, the columns' proof of delivery against
`check_delivery` on good plans and on plans with one transfer broken, and `auto`'s
one-to-one columns against its loop (the same plan and the same loads). Small problems
reach the columnar code by calling it directly or by lowering the size it starts at.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard.strategies as strategies
from reshard import STRATEGIES, Mesh, Plan, PlanValidationError, Sharding, Topology, Transfer, plan
from reshard.box import intersect
from reshard.cost import phase_loads, table_phase_loads
from reshard.errors import InvalidShardingError, InvalidTopologyError
from reshard.plans import TransferTable, _delivers, check_delivery, device_space
from reshard.strategies import Loads
from reshard.tasks import decompose

from tests.core.test_planner_properties import problems, simulate

HEALTH = [HealthCheck.too_slow]


def _reference_tasks(shape, src: Sharding, dst: Sharding) -> list[tuple]:
    """(box, senders, receivers) of every distinct destination tile (in order of its first device) met with every
    distinct source tile (in box order), receivers less the devices holding the source tile."""
    src_tiles, dst_tiles = src.tiles(shape), dst.tiles(shape)
    holders, wanting = defaultdict(list), defaultdict(list)
    for dev, tile in src_tiles.items():
        holders[tile].append(dev)
    for dev, tile in dst_tiles.items():
        wanting[tile].append(dev)
    out = []
    for tile, receivers in wanting.items():
        meets = sorted((box, tuple(devs)) for s, devs in holders.items() if (box := intersect(tile, s)) is not None)
        for box, senders in meets:
            need = tuple(r for r in receivers if r not in senders)
            if need and all(lo < hi for lo, hi in tile):
                out.append((box, senders, need))
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=HEALTH)
@given(problems())
def test_decompose_is_every_pair_of_tiles_in_order(problem):
    shape, src, dst, _ = problem
    tasks = decompose(shape, src, dst)
    assert [(t.box, t.senders, t.receivers) for t in tasks] == _reference_tasks(shape, src, dst)
    assert [t.num_elements for t in tasks] == [math.prod(hi - lo for lo, hi in t.box) for t in tasks]
    assert [tasks[i] for i in range(len(tasks))] == list(tasks)


def _as_dicts(loads) -> dict:
    return {load.phase: tuple({k: v for k, v in d.items() if v} for d in (load.send, load.recv, load.dev_out,
                                                                        load.dev_in)) for load in loads}


# Transfers whose flows are odd but defined (`transfer_flows` counts a route host twice, and a receiver whose host
# the route misses not at all), and boxes whose byte counts pass int64.
ODD = {
    "a route naming a host twice": [Transfer(((0, 4),), "a/0", ("b/0", "b/1", "c/0"), "broadcast", 0, ("b", "c", "b"))],
    "a route missing a receiver's host": [Transfer(((0, 4),), "a/0", ("a/1", "b/0", "c/0"), "broadcast", 0, ("b",))],
    "a route through the sender's host": [Transfer(((0, 4),), "a/0", ("a/1", "a/2", "b/0"), "broadcast", 0,
                                                   ("a", "b"))],
    "a local chain over other hosts": [Transfer(((0, 4),), "a/0", ("b/0", "c/1", "b/2"), "local", 2)],
    "bytes past int64": [Transfer(((0, 2**40), (0, 2**40)), "a/0", ("b/0", "b/1"), "broadcast", 0, ("b",)),
                         Transfer(((0, 2**40), (0, 2**40)), "a/1", ("c/0",), "p2p", 1)],
}


@pytest.mark.parametrize("case", ODD)
def test_the_columns_load_links_as_the_flows_do_for_odd_transfers(case):
    transfers = ODD[case]
    table = TransferTable.from_transfers(transfers, len(transfers[0].box))
    assert _as_dicts(table_phase_loads(table, 8)) == _as_dicts(phase_loads(transfers, 8))


@settings(max_examples=80, deadline=None, suppress_health_check=HEALTH)
@given(problems(), st.sampled_from(STRATEGIES), st.sampled_from([1, 2, 8]))
def test_the_columns_load_links_as_the_flows_do(problem, strategy, size):
    shape, src, dst, topology = problem
    p = plan(shape, "float32", src, dst, topology, strategy=strategy)
    table = TransferTable.from_transfers(p.transfers, len(shape), device_space(src.mesh, dst.mesh))
    assert table.transfers() == p.transfers
    assert table.to_json() == [t.to_json() for t in p.transfers]
    assert _as_dicts(table_phase_loads(table, size)) == _as_dicts(phase_loads(p.transfers, size))


def _plainly_delivers(p: Plan) -> bool:
    transfers = p.transfers
    try:
        check_delivery(p.shape, p.src, p.dst, list(enumerate(transfers)),
                       before=lambda i, j: transfers[j].phase < transfers[i].phase, where=lambda i, t: i,
                       when=lambda i, t: "")
    except PlanValidationError:
        return False
    return True


def _columns_deliver(p: Plan) -> bool:
    try:
        table = TransferTable.from_transfers(p.transfers, len(p.shape), device_space(p.src.mesh, p.dst.mesh))
    except PlanValidationError:
        return False
    return _delivers(p.shape, p.src, p.dst, table)


@st.composite
def broken(draw, p: Plan) -> tuple[Transfer, ...]:
    """``p``'s transfers with one changed: its sender, receivers, box, phase, method or route, or its place."""
    transfers = list(p.transfers)
    i = draw(st.integers(0, len(transfers) - 1))
    t = transfers[i]
    devices = list(dict.fromkeys((*p.src.mesh.devices, *p.dst.mesh.devices)))
    hosts = list(dict.fromkeys(d.rpartition("/")[0] for d in devices))
    kind = draw(st.sampled_from(["sender", "drop", "add", "repeat", "box", "phase", "method", "route", "move"]))
    if kind == "sender":
        t = dataclasses.replace(t, sender=draw(st.sampled_from(devices)))
    elif kind == "drop":
        t = dataclasses.replace(t, receivers=t.receivers[1:])
    elif kind == "add":
        t = dataclasses.replace(t, receivers=(*t.receivers, draw(st.sampled_from(devices))))
    elif kind == "repeat":
        t = dataclasses.replace(t, receivers=(*t.receivers, t.receivers[0]))
    elif kind == "box":
        d = draw(st.integers(0, len(t.box) - 1))
        lo, hi = t.box[d]
        bounds = (lo + draw(st.integers(-1, 1)), hi + draw(st.integers(-1, 1)))
        t = dataclasses.replace(t, box=t.box[:d] + (bounds,) + t.box[d + 1:])
    elif kind == "phase":
        t = dataclasses.replace(t, phase=t.phase + draw(st.sampled_from([-1, 1])))
    elif kind == "method":
        t = dataclasses.replace(t, method=draw(st.sampled_from(["p2p", "local", "broadcast"])))
    elif kind == "route":
        t = dataclasses.replace(t, route=tuple(draw(st.lists(st.sampled_from(hosts), max_size=3))))
    else:
        transfers.insert(draw(st.integers(0, len(transfers) - 1)), transfers.pop(i))
        return tuple(transfers)
    transfers[i] = t
    return tuple(transfers)


@settings(max_examples=80, deadline=None, suppress_health_check=HEALTH)  # 4.8 s of make test's at 150
@given(st.data(), problems(), st.sampled_from(STRATEGIES))
def test_the_columns_prove_delivery_exactly_when_the_plain_check_does(data, problem, strategy):
    shape, src, dst, topology = problem
    p = plan(shape, "float32", src, dst, topology, strategy=strategy)
    assert _columns_deliver(p) and _plainly_delivers(p)
    if p.transfers:
        bad = dataclasses.replace(p, transfers=data.draw(broken(p)))
        assert _columns_deliver(bad) == _plainly_delivers(bad)


def _all_to_all(devices_per_side: int, rows: int = 1024) -> tuple:
    a = Mesh.grid({"x": devices_per_side}, 4, "a")
    b = Mesh.grid({"x": devices_per_side}, 4, "b")
    return (rows, rows), Sharding(a, ("x", None)), Sharding(b, (None, "x"))


def test_a_large_plan_is_columns_and_reads_as_transfers():
    shape, src, dst = _all_to_all(64)
    p = plan(shape, "float32", src, dst)
    assert "_table" in p.__dict__ and "transfers" not in p.__dict__  # the transfers are not made yet
    assert p.num_transfers == 64 * 64 and len(p.unit_tasks) == 64 * 64
    p.validate()
    assert "transfers" not in p.__dict__  # validating on columns makes none either
    text = p.dumps()
    same = Plan(p.shape, p.dtype, p.src, p.dst, p.strategy, tuple(p.transfers), p.topology)
    assert same.id == p.id and same.dumps() == text and same == p
    again = Plan.from_json(text)
    assert again.transfers == p.transfers and again.estimate() == p.estimate()
    assert p.estimate_seconds == p.lower_bound_seconds == pytest.approx(same.estimate())
    assert p.summary(max_transfers=3).splitlines()[-4:] == same.summary(max_transfers=3).splitlines()[-4:]


def test_a_broken_large_plan_is_named_by_the_plain_check():
    shape, src, dst = _all_to_all(64)
    p = plan(shape, "float32", src, dst)
    transfers = list(p.transfers)
    t = transfers[100]
    transfers[100] = dataclasses.replace(t, box=((t.box[0][0], t.box[0][1] + 1), t.box[1]))
    with pytest.raises(PlanValidationError, match=r"^transfer 100 \(\[0\] p2p \[576:593, 16:32\] a9/0 -> b0/1\): "
                                                  r"sender a9/0 does not hold box \[576:593, 16:32\] at the start of "
                                                  r"phase 0 \(its source tile is \[576:592, 0:1024\]\)$"):
        dataclasses.replace(p, transfers=tuple(transfers)).validate()
    with pytest.raises(PlanValidationError, match=r"^destination device b0/0 \(tile \[0:1024, 0:16\]\) misses 256 of "
                                                  r"its 16384 elements$"):
        dataclasses.replace(p, transfers=p.transfers[1:]).validate()


@settings(max_examples=80, deadline=None, suppress_health_check=HEALTH)
@given(problems())
def test_auto_plans_one_to_one_tasks_as_columns_as_it_would_one_by_one(problem):
    shape, src, dst, topology = problem
    made = {}
    for columns_from in (0, 10**9):
        strategies._BULK_FROM = columns_from
        try:
            loads = Loads(topology)
            made[columns_from] = (plan(shape, "float32", src, dst, loads=loads), loads)
        finally:
            strategies._BULK_FROM = 256
    (columns, by_columns), (loop, by_loop) = made[0], made[10**9]
    assert columns.id == loop.id and columns.transfers == loop.transfers
    for figure in ("send", "recv", "pairs", "local_out", "peak"):
        a, b = getattr(by_columns, figure), getattr(by_loop, figure)
        assert (dict(a) if isinstance(a, dict) else a) == (dict(b) if isinstance(b, dict) else b), figure
    assert {h: set(v) for h, v in by_columns.next_hops.items() if v} == \
           {h: set(v) for h, v in by_loop.next_hops.items() if v}


def test_the_million_piece_shape_plans_as_columns_at_the_lower_bound():
    # The shape of bench/plan_quality.py's all-to-all at a quarter of its side: every piece one-to-one.
    shape, src, dst = _all_to_all(256, 2048)
    p = plan(shape, "float32", src, dst).validate()
    assert p.num_transfers == 256 * 256 and p.estimate_seconds == pytest.approx(p.lower_bound_seconds)
    assert {m for m in p.table.method.tolist()} == {0}  # p2p: the meshes share no host


def _wide(replicas: int, holders: int = 4) -> tuple:
    """A (64, 64) tensor on ``holders`` source hosts, wanted whole by every one of ``replicas`` other hosts."""
    src = Sharding(Mesh.from_hosts({"x": holders}, [f"s{i}" for i in range(holders)], 1), ("x", None))
    dst = Sharding(Mesh.from_hosts({"r": replicas}, [f"d{i}" for i in range(replicas)], 1), (None, None))
    return (64, 64), src, dst


def test_a_chain_over_many_hosts_is_planned_in_linear_time_at_the_bound():
    shape, src, dst = _wide(40)
    p = plan(shape, "float32", src, dst).validate()
    simulate(p)
    assert p.estimate() == pytest.approx(p.lower_bound())
    assert {t.method for t in p.transfers} == {"broadcast"} and max(len(t.route) for t in p.transfers) == 40


def test_chains_over_the_same_many_hosts_take_other_pairs_of_hosts():
    shape, src, dst = _wide(40, holders=1)
    loads = Loads(Topology())
    plans = [plan(shape, "float32", src, dst, loads=loads).validate() for _ in range(3)]
    hops = [{(a, b) for t in p.transfers for a, b in zip((t.sender.rpartition("/")[0], *t.route), t.route)}
            for p in plans]
    assert [len(h) for h in hops] == [40] * 3  # one chain each, through every host
    assert not hops[0] & hops[1] and not hops[2] & (hops[0] | hops[1])


def test_long_routes_end_on_the_most_loaded_host_and_share_no_hop():
    loads = Loads(Topology())
    order = [f"h{i}" for i in range(20)]
    loads.add_path("s", order, 1)  # history, so that every stride is tried
    routes = strategies._long_routes(order, loads)
    assert len(routes) == strategies._STRIDES
    seen = set()
    for cost, route in routes:
        assert sorted(route) == sorted(order) and route[-1] == order[-1]
        hops = set(zip(route, route[1:-1]))
        assert not hops & seen
        seen |= hops
    assert routes[0][0] == 19 and all(c == 0 for c, _ in routes[1:])


def test_shared_loads_balance_reshards_against_each_other():
    # Two hosts hold the one element; alone each plan sends it from the first, together the second plan uses the
    # other host (one element cannot be striped over both).
    src = Sharding(Mesh.from_hosts({"r": 2}, ["s0", "s1"], 1), (None,))
    dst = Sharding(Mesh.from_hosts({"x": 1}, ["d0"], 1), (None,))
    alone = [plan((1,), "float32", src, dst) for _ in range(2)]
    loads = Loads(Topology())
    together = [plan((1,), "float32", src, dst, loads=loads) for _ in range(2)]
    assert [[t.sender for t in p.transfers] for p in alone + together] == [["s0/0"], ["s0/0"], ["s0/0"], ["s1/0"]]
    assert {h: v for h, v in loads.send.items() if v} == {"s0": 4 / 1.25e9, "s1": 4 / 1.25e9}
    assert {h: v for h, v in loads.recv.items() if v} == {"d0": 8 / 1.25e9}


def test_shared_loads_are_refused_where_they_mean_nothing():
    shape, src, dst = _wide(2)
    loads = Loads(Topology())
    with pytest.raises(InvalidShardingError, match=r"^loads= balances the plans of strategy 'auto' against each "
                                                   r"other; strategy 'broadcast' takes no loads"):
        plan(shape, "float32", src, dst, strategy="broadcast", loads=loads)
    with pytest.raises(InvalidTopologyError, match=r"^the loads were added up on Topology\(NIC 10 Gbit/s, .*\), "
                                                   r"but this plan is for Topology\(NIC 1 Gbit/s, .*\); plan on"):
        plan(shape, "float32", src, dst, Topology(nic_gbps=1.0), loads=loads)
    assert loads.send == {} and loads.peak == 0.0


def test_huge_tensors_count_bytes_exactly():
    src = Sharding(Mesh.from_hosts({"x": 2}, ["a", "b"], 1), ("x", None))
    dst = Sharding(Mesh.from_hosts({"x": 2}, ["c", "d"], 1), (None, "x"))
    shape = (2**40, 2**40)
    p = plan(shape, "float64", src, dst)
    table = TransferTable.from_transfers(p.transfers, 2)
    assert _as_dicts(table_phase_loads(table, 8)) == _as_dicts(phase_loads(p.transfers, 8))
    assert p.network_bytes() == 2**83
    assert table.num_elements.tolist() == [2**78] * 4


def test_columns_survive_json_with_routes_and_phases():
    shape, src, dst = (64, 64), Sharding(Mesh.grid({"x": 8}, 2, "a"), ("x", None)), \
        Sharding(Mesh.grid({"x": 2, "y": 4}, 2, "b"), ("x", None))
    for strategy in STRATEGIES:
        p = plan(shape, "float32", src, dst, strategy=strategy)
        table = p.table
        q = Plan(p.shape, p.dtype, p.src, p.dst, p.strategy, table, p.topology)
        assert json.loads(q.dumps()) == json.loads(p.dumps())
        assert q.validate().transfers == p.transfers
        assert np.array_equal(table.num_elements, [t.num_elements for t in p.transfers])


@st.composite
def _tile_and_pieces(draw):
    """A small tile, and up to 9 pieces: a random cut of the tile into parts, then some parts dropped, some
    repeated, some shifted (overlapping or leaving the tile) and some empty."""
    ndim = draw(st.integers(1, 3))
    tile = tuple((lo, lo + draw(st.integers(0, 5))) for lo in (draw(st.integers(0, 3)) for _ in range(ndim)))
    parts = [tile]
    for _ in range(draw(st.integers(0, 4))):
        k = draw(st.integers(0, len(parts) - 1))
        part = parts[k]
        d = draw(st.integers(0, ndim - 1))
        lo, hi = part[d]
        if hi - lo < 2:
            continue
        at = draw(st.integers(lo + 1, hi - 1))
        parts[k:k + 1] = [part[:d] + ((lo, at),) + part[d + 1:], part[:d] + ((at, hi),) + part[d + 1:]]
    pieces = []
    for p in parts:
        fate = draw(st.sampled_from(["keep", "keep", "keep", "drop", "twice", "shift", "empty"]))
        if fate in ("keep", "twice"):
            pieces += [p] * (2 if fate == "twice" else 1)
        elif fate == "shift":
            d, by = draw(st.integers(0, ndim - 1)), draw(st.sampled_from([-1, 1]))
            pieces.append(p[:d] + ((p[d][0] + by, p[d][1] + by),) + p[d + 1:])
        elif fate == "empty":
            pieces.append(p[:0] + ((p[0][0], p[0][0]),) + p[1:])
    return tile, pieces


@settings(max_examples=300, deadline=None)
@given(_tile_and_pieces())
def test_coverage_of_a_tile_counts_missing_and_repeated_elements_exactly(case):
    """`_coverage` (whose few-piece exact tilings skip the numpy pass) against counting every element: what no
    piece covers, and every extra cover inside the tile plus every element a piece has outside it."""
    from reshard.plans import _coverage

    tile, pieces = case
    lo = np.array([a for a, _ in tile]) - 2
    grid = np.zeros([hi - a + 4 for a, (_, hi) in zip(lo, tile)], dtype=np.int64)
    for p in pieces:
        grid[tuple(slice(a - o, b - o) for (a, b), o in zip(p, lo))] += 1
    inside = grid[tuple(slice(a - o, b - o) for (a, b), o in zip(tile, lo))]
    missing = int((inside == 0).sum()) if inside.size else 0
    excess = int(np.maximum(inside - 1, 0).sum()) + int(grid.sum() - inside.sum())
    assert _coverage(tile, None, pieces) == (missing, excess)
