"""Who sends which box to whom, stated once in `reshard.routes` and read by the cost model and the agents.

Table tests pin each method's copies and hops; property tests check, on random plans
of every strategy, that the flows (`transfer_flows`), the senders' byte counts
(`sender_bytes`) and the network copies are exactly those hops, that every receiver is
delivered once, and that the agents' questions (`first_peer`, `receiving_hops`,
`hop_targets`, `sending_peers`, `stream_count`) are answered from the same hops as
references written here from the module docstring's table answer them.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import STRATEGIES, Transfer, plan
from reshard.cost import INTRA, NIC, network_copies, sender_bytes, transfer_flows
from reshard.mesh import host_of
from reshard.routes import (
    Hop,
    find_hop,
    first_peer,
    home_receivers,
    hop_targets,
    hops,
    interleaved,
    receiving_hops,
    sending_peers,
    stream_count,
)

from tests.core.test_planner_properties import problems

BOX = ((0, 4), (0, 8))

# (transfer, the receivers its sender copies into on its host, its hops)
TABLE = {
    "p2p: a hop per receiver on another host, numbered by the receiver": (
        Transfer(BOX, "a/0", ("b/0", "a/1", "c/2"), "p2p"),
        ("a/1",),
        [Hop(0, "a", "b", ("b/0",), None, True), Hop(2, "a", "c", ("c/2",), None, True)],
    ),
    "local: copies only": (
        Transfer(BOX, "a/0", ("a/1", "a/2"), "local"),
        ("a/1", "a/2"),
        [],
    ),
    "broadcast: a chain over the route, the sender streaming its first hop only": (
        Transfer(BOX, "a/0", ("a/1", "b/0", "c/0", "b/1"), "broadcast", route=("b", "c")),
        ("a/1",),
        [Hop(0, "a", "b", ("b/0", "b/1"), "c", True), Hop(1, "b", "c", ("c/0",), None, False)],
    ),
}


@pytest.mark.parametrize("case", TABLE)
def test_copies_and_hops_of_each_method(case):
    t, home, expected = TABLE[case]
    assert home_receivers(t) == home
    assert list(hops(t)) == expected
    assert [find_hop(t, h.index) for h in expected] == expected
    assert find_hop(t, 1 if t.method == "p2p" else 5) is None


def test_the_agents_questions_of_a_broadcast():
    t = TABLE["broadcast: a chain over the route, the sender streaming its first hop only"][0]
    assert first_peer(t) == "b"
    assert receiving_hops(t, "b") == [0] and receiving_hops(t, "c") == [1] and receiving_hops(t, "a") == []
    assert hop_targets(t, 0, "b") == (["b/0", "b/1"], "c", "a")
    assert hop_targets(t, 1, "c") == (["c/0"], None, "b")
    assert hop_targets(t, 1, "b") is None and hop_targets(t, 2, "c") is None and hop_targets(t, -1, "b") is None
    assert sending_peers(t, "a") == {"b"}
    assert stream_count("move", t) == 2


def test_interleaving_takes_one_transfer_per_host_pair_in_turn():
    ab1, ab2 = (Transfer(((i, i + 1),), "a/0", ("b/0",), "p2p") for i in range(2))
    ac = Transfer(((2, 3),), "a/0", ("c/0",), "p2p")
    stays = Transfer(((3, 4),), "a/0", ("a/1",), "local")
    order = interleaved([(0, ab1), (1, ab2), (2, ac), (3, stays)])
    assert [i for i, _ in order] == [0, 2, 3, 1]


def _reference_answers(t: Transfer, host: str) -> tuple:
    """(first peer, receiving hops, their targets, sending peers, stream count) of ``t`` for ``host``, written
    straight from the module docstring's table, method by method."""
    hs = host_of(t.sender)
    if t.method == "broadcast":
        chain = (hs, *t.route)
        first = t.route[0] if t.route else ""
        mine = [i for i, h in enumerate(t.route) if h == host]
        targets = [([r for r in t.receivers if host_of(r) == host], t.route[i + 1] if i + 1 < len(t.route) else None,
                    chain[i]) for i in mine]
        peers = {t.route[0]} if t.route and host == hs else set()
        count = len(t.route)
    elif t.method == "p2p":
        first = next((host_of(r) for r in t.receivers if host_of(r) != hs), "")
        mine = [i for i, r in enumerate(t.receivers) if host_of(r) == host != hs]
        targets = [([t.receivers[i]], None, hs) for i in mine]
        peers = {host_of(r) for r in t.receivers} - {hs} if host == hs else set()
        count = len(t.receivers)
    else:
        first, mine, targets, peers, count = "", [], [], set(), 0
    return first, mine, targets, peers, count


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(STRATEGIES), st.sampled_from([1, 4]))
def test_the_flows_and_the_agents_read_the_same_hops(problem, strategy, size):
    shape, src, dst, topology = problem
    p = plan(shape, {1: "int8", 4: "float32"}[size], src, dst, topology, strategy=strategy)
    hosts = {host_of(d) for t in p.transfers for d in (t.sender, *t.receivers)}
    sent = dict.fromkeys(hosts, 0)
    for t in p.transfers:
        n = t.num_elements * size
        hs = host_of(t.sender)
        home, route = home_receivers(t), hops(t)
        flows = transfer_flows(t, size)
        assert [(f.src, f.dst, f.origin) for f in flows if f.link == NIC] == [(h.src, h.dst, h.origin) for h in route]
        assert {f.dst for f in flows if f.link == INTRA} <= set(t.receivers)
        assert network_copies(t) == len(route)
        sent[hs] += n * (len(home) + sum(h.origin for h in route))
        # every receiver gets the box once: from the sender's copies or from one hop
        delivered = [*home, *(r for h in route for r in h.receivers)]
        assert sorted(delivered) == sorted(t.receivers)
        assert all(host_of(r) == h.dst for h in route for r in h.receivers)
        assert len({h.index for h in route}) == len(route)
        assert all(0 <= h.index < stream_count("move", t) for h in route)
        for host in hosts:
            first, mine, targets, peers, count = _reference_answers(t, host)
            assert first_peer(t) == first
            assert receiving_hops(t, host) == mine
            assert [hop_targets(t, i, host) for i in mine] == targets
            assert sending_peers(t, host) == peers
            assert stream_count("move", t) == count
    for h in hosts:
        assert sender_bytes(p.transfers, size, h) == sent[h]
