"""The byte flow of each move method, defined once in `reshard.cost`.

Table tests pin what each method puts on which link; property tests check, on
random plans of every strategy, that the per-phase loads, the senders' byte
counts and the network copies all agree with the flows and with references
written here from the cost model's table.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import STRATEGIES, Transfer, plan
from reshard.cost import Flow, host_traffic, network_copies, phase_loads, sender_bytes, transfer_flows
from reshard.mesh import host_of

from tests.core.test_planner_properties import problems

BOX = ((0, 4), (0, 8))  # 32 elements
N = 32 * 4  # float32 bytes of BOX


# (transfer, its flows, network copies, bytes its sender's agent counts)
TABLE = {
    "p2p: one copy per receiver, over the NIC or inside the host": (
        Transfer(BOX, "a/0", ("a/1", "b/0", "c/2"), "p2p"),
        [Flow("a/0", "a/1", N, "intra", True), Flow("a", "b", N, "nic", True), Flow("a", "c", N, "nic", True)],
        2,
        3 * N,
    ),
    # The agent writes each local receiver from the sender's buffer: three copies, though the
    # cost model charges a chain.
    "local: a chain inside the host": (
        Transfer(BOX, "a/0", ("a/1", "a/2", "a/3"), "local"),
        [
            Flow("a/0", "a/1", N, "intra", True),
            Flow("a/1", "a/2", N, "intra", False),
            Flow("a/2", "a/3", N, "intra", False),
        ],
        0,
        3 * N,
    ),
    # One local copy plus the first hop; the route hosts forward the rest.
    "broadcast: a chain over the route, fanned out inside each host": (
        Transfer(BOX, "a/0", ("a/1", "b/0", "b/1", "c/0"), "broadcast", route=("b", "c")),
        [
            Flow("a/0", "a/1", N, "intra", True),
            Flow("a", "b", N, "nic", True),
            Flow("b/0", "b/1", N, "intra", False),
            Flow("b", "c", N, "nic", False),
        ],
        2,
        2 * N,
    ),
}


@pytest.mark.parametrize("case", TABLE)
def test_flows_of_each_method(case):
    t, flows, copies, sent = TABLE[case]
    assert transfer_flows(t, 4) == flows
    assert network_copies(t) == copies
    assert sender_bytes([t], 4, "a") == sent
    assert sender_bytes([t], 4, "b") == 0


def test_host_traffic_adds_up_a_broadcast():
    t = TABLE["broadcast: a chain over the route, fanned out inside each host"][0]
    assert host_traffic([t], 4) == {
        "a": {"bytes_out": N, "bytes_in": 0, "local_bytes": N},
        "b": {"bytes_out": N, "bytes_in": N, "local_bytes": N},
        "c": {"bytes_out": 0, "bytes_in": N, "local_bytes": 0},
    }


def test_sender_bytes_counts_only_the_asked_phase():
    ts = [Transfer(BOX, "a/0", ("b/0",), "p2p", phase=0), Transfer(BOX, "a/0", ("c/0",), "p2p", phase=1)]
    assert sender_bytes(ts, 4, "a") == 2 * N
    assert sender_bytes(ts, 4, "a", phase=1) == N
    assert sender_bytes(ts, 4, "a", phase=2) == 0


def _reference_loads(transfers, itemsize):
    """Per phase (send, recv, dev_out, dev_in), written straight from the module docstring's table."""
    out = defaultdict(lambda: tuple(defaultdict(int) for _ in range(4)))
    for t in transfers:
        send, recv, dev_out, dev_in = out[t.phase]
        n = t.num_elements * itemsize
        hs = host_of(t.sender)

        def chain(devs):
            for a, b in zip(devs, devs[1:]):
                dev_out[a] += n
                dev_in[b] += n

        if t.method == "p2p":
            for r in t.receivers:
                if host_of(r) == hs:
                    chain([t.sender, r])
                else:
                    send[hs] += n
                    recv[host_of(r)] += n
        elif t.method == "local":
            chain([t.sender, *t.receivers])
        else:
            chain([t.sender] + [r for r in t.receivers if host_of(r) == hs])
            for a, b in zip((hs, *t.route), t.route):
                send[a] += n
                recv[b] += n
                chain([r for r in t.receivers if host_of(r) == b])
    return {p: tuple({k: v for k, v in d.items() if v} for d in loads) for p, loads in out.items()}


def _reference_sender_bytes(transfers, itemsize, host):
    total = 0
    for t in transfers:
        if host_of(t.sender) != host:
            continue
        local = [r for r in t.receivers if host_of(r) == host]
        n = t.num_elements * itemsize
        if t.method == "broadcast":
            total += n * (len(local) + bool(t.route))
        else:
            total += n * len(t.receivers)
    return total


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(STRATEGIES), st.sampled_from([1, 4, 8]))
def test_loads_copies_and_sender_bytes_agree_with_the_flows(problem, strategy, size):
    shape, src, dst, topology = problem
    p = plan(shape, {1: "int8", 4: "float32", 8: "float64"}[size], src, dst, topology, strategy=strategy)
    loads = {
        load.phase: tuple({k: v for k, v in d.items() if v} for d in (load.send, load.recv, load.dev_out, load.dev_in))
        for load in phase_loads(p.transfers, size)
    }
    assert loads == _reference_loads(p.transfers, size)
    hosts = {host_of(d) for t in p.transfers for d in (t.sender, *t.receivers)}
    for h in hosts:
        assert sender_bytes(p.transfers, size, h) == _reference_sender_bytes(p.transfers, size, h)
    network = sum(load.network_bytes for load in phase_loads(p.transfers, size))
    assert network == sum(network_copies(t) * t.num_elements * size for t in p.transfers)
    traffic = host_traffic(p.transfers, size)
    assert sum(r["bytes_in"] for r in traffic.values()) == network
    assert sum(r["bytes_out"] for r in traffic.values()) == network
    for t in p.transfers:
        flows = transfer_flows(t, size)
        assert all(f.nbytes == t.num_elements * size for f in flows)
        assert sum(f.link == "nic" for f in flows) == network_copies(t)
        assert all(host_of(f.src) == host_of(f.dst) for f in flows if f.link == "intra")
