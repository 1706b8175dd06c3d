"""Plans as data: validation of broken plans, the JSON contract, and the paper's cases.

Broken plans are made by editing one transfer of a good plan, so each test
shows that `Plan.validate` catches exactly that fault and names it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from reshard import Mesh, Plan, PlanValidationError, Sharding, Topology, plan
from reshard.cases import n_to_m_cases, one_to_m_cases, overlap_cases
from reshard.mesh import host_of
from reshard.strategies import STEP_S, STRIPE_MIN_S, Loads

SHAPE = (8, 6)
SRC = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["s0", "s1"]), ("x", None))
# Dim 1 over y: every tile is wanted on both destination hosts, so broadcasts have a route.
DST_BOTH_HOSTS = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["d0", "d1"]), (None, "y"))
# Dim 0 over x: both devices of a host want the same tile, so local_allgather has a phase 1.
DST_ONE_HOST = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["d0", "d1"]), ("x", None))


def _edit(p: Plan, index: int, **changes) -> Plan:
    transfers = list(p.transfers)
    transfers[index] = dataclasses.replace(transfers[index], **changes)
    return dataclasses.replace(p, transfers=tuple(transfers))


@pytest.fixture
def broadcast_plan() -> Plan:
    p = plan(SHAPE, "float32", SRC, DST_BOTH_HOSTS, strategy="broadcast")
    assert {t.method for t in p.transfers} == {"broadcast"}
    return p.validate()


@pytest.fixture
def p2p_plan() -> Plan:
    p = plan(SHAPE, "float32", SRC, DST_BOTH_HOSTS, strategy="send_recv")
    assert {t.method for t in p.transfers} == {"p2p"}
    return p.validate()


@pytest.fixture
def two_phase_plan() -> Plan:
    p = plan(SHAPE, "float32", SRC, DST_ONE_HOST, strategy="local_allgather")
    assert {t.phase for t in p.transfers} == {0, 1}
    return p.validate()


# -- validation catches broken plans --------------------------------------------------


def _other_sender(p: Plan) -> str:
    """A source device whose tile does not contain transfer 0's box."""
    mine = SRC.tile(SHAPE, p.transfers[0].sender)
    return next(d for d, tile in SRC.tiles(SHAPE).items() if tile != mine)


def _wrong_columns(p: Plan) -> tuple:
    t = p.transfers[0]
    (c0, c1) = DST_BOTH_HOSTS.tile(SHAPE, t.receivers[0])[1]
    return (t.box[0], (SHAPE[1] - c1, SHAPE[1] - c0))


# (name, plan, changes to transfer 0 given the plan, the message expected)
ONE_EDIT = [
    ("sender that does not hold its box", "broadcast",
     lambda p: {"sender": _other_sender(p)}, r"transfer 0 .*sender s1/0 does not hold box \[0:4, 0:3\]"),
    ("sender outside the source mesh", "p2p",
     lambda p: {"sender": "elsewhere/0"}, r"sender elsewhere/0 does not hold box .*source tile is none"),
    ("box outside a receiver's tile", "p2p",
     lambda p: {"box": _wrong_columns(p)}, r"box \[0:4, 3:6\] is not inside receiver d0/0's tile \[0:8, 0:3\]"),
    ("box outside the tensor", "p2p",
     lambda p: {"box": ((0, 4), (0, 7))}, r"box \[0:4, 0:7\] is empty or outside the tensor of shape \(8, 6\)"),
    ("empty box", "p2p",
     lambda p: {"box": ((2, 2), (0, 3))}, r"box \[2:2, 0:3\] is empty or outside the tensor"),
    ("broadcast route that misses a host", "broadcast",
     lambda p: {"route": p.transfers[0].route[:1]},
     r"route \['d0'\] must list each receiving host other than the sender's exactly once; expected the hosts \['d0', 'd1'\]"),
    ("broadcast route that repeats a host", "broadcast",
     lambda p: {"route": p.transfers[0].route + p.transfers[0].route[:1]}, r"route \['d0', 'd1', 'd0'\] must list"),
    ("local transfer that crosses hosts", "p2p",
     lambda p: {"method": "local"}, r"a local transfer must stay on host s0"),
    ("unknown method", "p2p",
     lambda p: {"method": "multicast"}, r"method 'multicast' is not one of \['p2p', 'broadcast', 'local'\]"),
    ("route on a point-to-point transfer", "p2p",
     lambda p: {"route": ("d0",)}, r"only broadcasts have a route"),
    ("receiver outside the destination mesh", "p2p",
     lambda p: {"receivers": ("d9/0",)}, r"receiver 'd9/0' is not a device of the destination mesh"),
    ("sender among its receivers", "p2p",
     lambda p: {"receivers": (p.transfers[0].sender,)}, r"receivers must be distinct, non-empty and exclude the sender"),
    ("no receivers", "p2p",
     lambda p: {"receivers": ()}, r"receivers must be distinct, non-empty"),
]


@pytest.mark.parametrize("name, kind, changes, message", ONE_EDIT, ids=[e[0] for e in ONE_EDIT])
def test_one_edited_transfer_is_caught(name, kind, changes, message, broadcast_plan, p2p_plan):
    good = broadcast_plan if kind == "broadcast" else p2p_plan
    bad = _edit(good, 0, **changes(good))
    with pytest.raises(PlanValidationError, match=message):
        bad.validate()


def test_missing_destination_piece(p2p_plan):
    dropped = p2p_plan.transfers[-1]
    bad = dataclasses.replace(p2p_plan, transfers=p2p_plan.transfers[:-1])
    receiver = dropped.receivers[0]
    n = dropped.num_elements
    with pytest.raises(PlanValidationError, match=rf"destination device {receiver} .* misses {n} of its"):
        bad.validate()


def test_duplicate_delivery(broadcast_plan):
    bad = dataclasses.replace(broadcast_plan, transfers=broadcast_plan.transfers + broadcast_plan.transfers[:1])
    with pytest.raises(PlanValidationError, match=r"gets \d+ elements it already has \(held or received twice\)"):
        bad.validate()
    first = broadcast_plan.transfers[0]
    assert bad.wasted_bytes() == first.num_elements * 4 * len(first.receivers)
    assert broadcast_plan.wasted_bytes() == 0


def test_forwarding_must_wait_for_the_next_phase(two_phase_plan):
    """A device may pass on a box only in a phase after the one it received it in."""
    i = next(i for i, t in enumerate(two_phase_plan.transfers) if t.phase == 1)
    bad = _edit(two_phase_plan, i, phase=0)
    with pytest.raises(PlanValidationError, match=r"does not hold box .* at the start of phase 0"):
        bad.validate()


# -- the JSON contract ------------------------------------------------------------------


def test_json_has_the_documented_shape(broadcast_plan):
    data = json.loads(broadcast_plan.dumps())
    assert {"version", "shape", "dtype", "src", "dst", "strategy", "transfers",
            "estimate_seconds", "lower_bound_seconds"} <= set(data)
    assert data["version"] == 1
    assert data["shape"] == [8, 6]
    assert data["dtype"] == "float32"
    assert data["strategy"] == "broadcast"
    assert data["src"] == {
        "mesh": {"axes": [["x", 2], ["y", 2]], "devices": ["s0/0", "s0/1", "s1/0", "s1/1"]},
        "spec": [["x"], []],
    }
    assert data["dst"]["spec"] == [[], ["y"]]
    assert data["estimate_seconds"] == pytest.approx(broadcast_plan.estimate())
    assert data["lower_bound_seconds"] == pytest.approx(broadcast_plan.lower_bound())
    for t in data["transfers"]:
        assert set(t) == {"box", "sender", "receivers", "method", "phase", "route"}
        assert all(len(b) == 2 and b[0] < b[1] for b in t["box"])
        assert t["method"] == "broadcast" and sorted(t["route"]) == ["d0", "d1"]


def test_json_of_point_to_point_transfers(p2p_plan):
    for t in p2p_plan.to_json()["transfers"]:
        assert {"box", "sender", "receivers", "method", "phase"} <= set(t) <= {
            "box", "sender", "receivers", "method", "phase", "route"}
        assert t.get("route", []) == []


def test_tampered_json_is_rejected(broadcast_plan):
    data = broadcast_plan.to_json()
    data["transfers"][0]["sender"] = "s0/1"
    with pytest.raises(PlanValidationError, match=rf"claims id {broadcast_plan.id} but its content hashes to .*altered"):
        Plan.from_json(data)
    forged = {**broadcast_plan.to_json(), "id": "0" * 64}
    with pytest.raises(PlanValidationError, match="altered"):
        Plan.from_json(forged)


def test_json_of_another_version_is_rejected(broadcast_plan):
    data = {**broadcast_plan.to_json(), "version": 2}
    with pytest.raises(PlanValidationError, match=r"version 2 is not supported; this reshard reads version 1"):
        Plan.from_json(data)


def test_json_without_a_field_is_rejected(broadcast_plan):
    data = broadcast_plan.to_json()
    del data["strategy"], data["id"]
    with pytest.raises(PlanValidationError, match=r"lacks the field 'strategy'"):
        Plan.from_json(data)


def test_id_changes_with_content(broadcast_plan, p2p_plan):
    assert broadcast_plan.id != p2p_plan.id
    assert len(broadcast_plan.id) == 64 and int(broadcast_plan.id, 16) >= 0
    moved = _edit(broadcast_plan, 0, phase=1)
    assert moved.id != broadcast_plan.id


def test_str_is_a_one_line_summary(broadcast_plan):
    text = str(broadcast_plan)
    assert "\n" not in text
    assert broadcast_plan.id[:12] in text
    assert "P('x', None) -> P(None, 'y')" in text
    assert "broadcast" in text and "lower bound" in text


# -- the paper's cases, 10 Gbit/s --------------------------------------------------------

TEN_GBIT = Topology(nic_gbps=10.0)
PAPER_CASES = n_to_m_cases() + one_to_m_cases()


@pytest.mark.parametrize("case", PAPER_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("strategy", ["auto", "broadcast"])
def test_auto_and_broadcast_sit_at_the_lower_bound(case, strategy):
    p = plan(case.shape, case.dtype, case.src, case.dst, TEN_GBIT, strategy).validate()
    assert p.lower_bound() > 0
    assert p.estimate() <= 1.05 * p.lower_bound(), f"{case.name}: {p.estimate()} vs bound {p.lower_bound()}"


def _case(name: str):
    return next(c for c in PAPER_CASES if c.name == name)


def test_send_recv_is_eight_times_the_bound_on_1to4x2():
    case = _case("1to4x2")
    p = plan(case.shape, case.dtype, case.src, case.dst, TEN_GBIT, "send_recv").validate()
    assert p.estimate() / p.lower_bound() == pytest.approx(8.0, rel=1e-6)
    # The bound: 1 GiB leaving the only holder at 10 Gbit/s.
    assert p.lower_bound() == pytest.approx(case.nbytes / (10e9 / 8))


@pytest.mark.parametrize("strategy, times", [("broadcast", 4), ("auto", 4), ("local_allgather", 4), ("send_recv", 8)])
def test_network_bytes_on_1to4x2(strategy, times):
    case = _case("1to4x2")
    p = plan(case.shape, case.dtype, case.src, case.dst, TEN_GBIT, strategy).validate()
    assert p.network_bytes() == times * case.nbytes


def test_broadcast_on_1to4x2_reaches_each_host_once():
    case = _case("1to4x2")
    p = plan(case.shape, case.dtype, case.src, case.dst, TEN_GBIT, "broadcast").validate()
    (load,) = p.loads()
    receiving = set(case.dst.mesh.hosts)
    assert len(receiving) == 4
    assert dict(load.recv) == {h: case.nbytes for h in receiving}
    # The chain: the source host sends once, every route host but the last forwards once.
    assert sorted(load.send.values()) == [case.nbytes] * 4
    assert len(p.transfers) == 1 and p.transfers[0].method == "broadcast"
    assert set(p.transfers[0].receivers) == set(case.dst.mesh.devices)


def test_auto_allgather_sends_each_tile_straight_to_every_host_crossing_each_pair_once():
    # Each host receives three tiles whatever the plan: a star from each holder (three sends of its tile) leaves no
    # NIC busier than that floor, so it is taken over a chain (`_fewer_hops`), and each pair of hosts carries one
    # stream each way (agents stream between two hosts over one connection, which the kernel shares per connection).
    case = next(c for c in overlap_cases() if c.name == "allgather4")
    p = plan(case.shape, case.dtype, case.src, case.dst, TEN_GBIT, "auto").validate()
    hops = [(a, b) for t in p.transfers for a, b in zip((host_of(t.sender), *t.route), t.route)]
    assert {len(t.route) for t in p.transfers} == {1} and len(p.transfers) == 4 * 3
    assert len(hops) == len(set(hops)) == 4 * 3
    assert p.estimate() == pytest.approx(p.lower_bound())


def test_auto_takes_a_star_over_a_chain_only_within_the_floor():
    # Tensor-parallel 4 to two replicas of tensor-parallel 2 (a weight sync): each serving host receives half the
    # tensor, and a training host's star to both replicas of its quarter sends as much: a star each. With the
    # training hosts' NICs at half the rate, the star would take them past the floor and the chain stays; so it does
    # where one host holds the tensor for eight (1to4x2): the star would send it eight times.
    train = Mesh.from_hosts({"tp": 4}, [f"t{i}" for i in range(4)], 1)
    serve = Mesh.from_hosts({"dp": 2, "tp": 2}, [f"s{i}" for i in range(4)], 1)
    src, dst = Sharding(train, ("tp", None)), Sharding(serve, ("tp", None))
    even = plan((4096, 64), "float32", src, dst, TEN_GBIT, "auto").validate()
    assert {(t.method, len(t.receivers)) for t in even.transfers} == {("p2p", 1)} and len(even.transfers) == 8
    slow = Topology(nic_gbps=10.0, host_nic_gbps=tuple((h, 5.0) for h in train.hosts))
    uneven = plan((4096, 64), "float32", src, dst, slow, "auto").validate()
    assert {len(t.route) for t in uneven.transfers} == {2} and len(uneven.transfers) == 4
    one = next(c for c in one_to_m_cases() if c.name == "1to4x2")
    assert [len(t.route) for t in plan(one.shape, one.dtype, one.src, one.dst, TEN_GBIT, "auto").transfers] == [4]
    for p in (even, uneven):
        assert p.estimate() == pytest.approx(p.lower_bound())


def test_auto_keeps_the_chain_between_the_agents_of_one_machine():
    # The weight sync above with every host an agent of one machine (a LocalCluster: its streams are copies through
    # memory, which a chain spreads over the hosts' cores): the chains, as where a star would pass the floor; with
    # the serving hosts on one machine and the training hosts on others, the stars cross NICs and are taken.
    train = Mesh.from_hosts({"tp": 4}, [f"t{i}" for i in range(4)], 1)
    serve = Mesh.from_hosts({"dp": 2, "tp": 2}, [f"s{i}" for i in range(4)], 1)
    src, dst = Sharding(train, ("tp", None)), Sharding(serve, ("tp", None))
    hosts = [*train.hosts, *serve.hosts]
    one = Topology(nic_gbps=10.0, host_machine={h: "m" for h in hosts})
    chained = plan((4096, 64), "float32", src, dst, one, "auto").validate()
    assert {len(t.route) for t in chained.transfers} == {2} and len(chained.transfers) == 4
    apart = Topology(nic_gbps=10.0, host_machine={h: "serving" for h in serve.hosts})
    starred = plan((4096, 64), "float32", src, dst, apart, "auto").validate()
    assert {(t.method, len(t.receivers)) for t in starred.transfers} == {("p2p", 1)} and len(starred.transfers) == 8
    for p in (chained, starred):
        assert p.estimate() == pytest.approx(p.lower_bound())
    # the allgather, each host's own tile to the other three, likewise
    case = next(c for c in overlap_cases() if c.name == "allgather4")
    together = Topology(nic_gbps=10.0, host_machine={h: "m" for h in case.src.mesh.hosts})
    p = plan(case.shape, case.dtype, case.src, case.dst, together, "auto").validate()
    assert [t.method for t in p.transfers] == ["broadcast"] * 4 and p.estimate() == pytest.approx(p.lower_bound())


@pytest.mark.parametrize("elements, steps", [(64, 1), (15_616, 1), (15_632, 16), (312_500, 16)])
def test_a_small_box_goes_as_one_chain_where_a_star_would_take_a_step_a_host(elements, steps):
    # A vector whole on one training host, wanted whole on 16 serving hosts that already receive the most (the
    # busiest NICs) and send half as much. A chain over them or a star from the training host leave the same peak
    # (their receiving); the star keeps the sum of squares lower, the chain takes one step where the star takes 16.
    # At 10 Gbit/s a box is small under 62.5 KB (STEP_S, 50 us): 256 B and 62,464 B go as one chain, 62,528 B and
    # 1.25 MB as a star.
    src = Sharding(Mesh.grid({"host": 1, "gpu": 2}, 2, "t"), (None,))
    dst = Sharding(Mesh.grid({"host": 16, "gpu": 2}, 2, "s"), (None,))
    loads = Loads(TEN_GBIT)
    for h in dst.mesh.hosts:
        loads.recv[h], loads.send[h] = 1.0, 0.5
    loads.peak = 1.0
    p = plan((elements,), "float32", src, dst, loads=loads).validate()
    assert STEP_S == 50e-6
    assert len(p.transfers) == steps
    assert {len(t.route) for t in p.transfers} == ({16} if steps == 1 else {1})


@pytest.mark.parametrize("rows, stripes", [(64, 1), (1024, 1), (4096, 2), (8192, 4), (1 << 20, 4)])
def test_auto_stripes_a_box_over_its_replicas_only_where_each_stripe_is_worth_a_step(rows, stripes):
    # Rows of 8 float32 held by four replica hosts, wanted whole on a fifth: striping them over the replicas cuts
    # the busiest NIC's time, but each stripe is a step more to plan, read and pack. At 10 Gbit/s, 2 KiB (1.6 us)
    # and 32 KiB (26 us) go whole from one replica; 128 KiB (105 us) as two stripes of at least STRIPE_MIN_S (50
    # us) each; 256 KiB and up as four, the most replicas a box is striped over.
    src = Sharding(Mesh.from_hosts({"r": 4}, ["a", "b", "c", "d"], 1), (None, None))
    dst = Sharding(Mesh.from_hosts({"x": 1}, ["e"], 1), (None, None))
    p = plan((rows, 8), "float32", src, dst, TEN_GBIT, "auto").validate()
    assert STRIPE_MIN_S == 50e-6
    assert len(p.transfers) == len({t.sender for t in p.transfers}) == stripes
