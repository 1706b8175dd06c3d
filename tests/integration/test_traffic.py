"""Count what moved: agents report bytes in and out per peer host, and the totals match the plan."""

from __future__ import annotations

import numpy as np
import pytest

import reshard
from reshard import Mesh, Sharding
from reshard.cost import phase_loads

SHAPE = (257, 129)  # uneven, about 130 KiB of float32


def _network_totals(plan):
    send, recv = {}, {}
    for load in phase_loads(plan.transfers, plan.itemsize):
        for h, n in load.send.items():
            send[h] = send.get(h, 0) + n
        for h, n in load.recv.items():
            recv[h] = recv.get(h, 0) + n
    return send, recv


def _check_against_plan(result, plan):
    send, recv = _network_totals(plan)
    for host, t in result.traffic.items():
        assert sum(t["bytes_in"].values()) == recv.get(host, 0), host
        assert sum(t["bytes_out"].values()) == send.get(host, 0), host


def test_chain_broadcast_each_host_receives_the_box_once(client, fresh_name):
    a = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    src = Sharding(Mesh.from_hosts({"x": 1, "y": 1}, ["host0"], 1), (None, None))
    dst = Sharding(Mesh.from_hosts({"x": 3, "y": 2}, ["host1", "host2", "host3"], 2), (None, None))
    client.put(fresh_name, a, src)
    plan = client.plan(fresh_name, dst, "broadcast")
    [t] = plan.transfers
    assert t.method == "broadcast" and len(t.route) == 3
    result = client.reshard(fresh_name, dst, "broadcast").result(timeout=60)
    assert result.plan_id == plan.id
    assert result.transports == (client.cluster.transport,)
    route = [t.sender.split("/")[0], *t.route]
    for prev, host in zip(route, route[1:]):
        # exactly once over the network, from the previous hop of the chain
        assert result.traffic[host]["bytes_in"] == {prev: a.nbytes}
    for host, nxt in zip(route, route[1:]):
        assert result.traffic[host]["bytes_out"] == {nxt: a.nbytes}
    assert result.traffic[route[-1]]["bytes_out"] == {}
    _check_against_plan(result, plan)
    assert result.network_bytes == plan.network_bytes() == 3 * a.nbytes
    assert np.array_equal(client.get(fresh_name), a)
    done, total = result.progress[route[0]]
    assert done == total == a.nbytes
    client.delete(fresh_name)


@pytest.mark.parametrize("strategy", reshard.STRATEGIES)
def test_traffic_matches_plan_for_every_strategy(client, fresh_name, strategy):
    a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
    src = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", None))
    dst = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host2", "host3"], 2), (None, ("x", "y")))
    client.put(fresh_name, a, src)
    plan = client.plan(fresh_name, dst, strategy)
    result = client.reshard(fresh_name, dst, strategy).result(timeout=60)
    assert result.plan_id == plan.id
    _check_against_plan(result, plan)
    assert result.network_bytes == plan.network_bytes()
    for host, (done, total) in result.progress.items():
        assert done == total, host
    assert np.array_equal(client.get(fresh_name), a)
    client.delete(fresh_name)
