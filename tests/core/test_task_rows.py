"""Auto walks the unit tasks of one layout from rows kept with its `Loads` (issue 41): the tensors of a state dict
that share a layout reuse them and hold the same box objects, and a box held by one host goes by the choice of
`_best_delivery`'s option list, made without the list."""

from __future__ import annotations

import copy
import random

from reshard import Mesh, Sharding, Topology
from reshard.cost import HostCache
from reshard.strategies import (
    _BULK_FROM,
    STEP_S,
    Loads,
    _chain_order,
    _emit_chain,
    _emit_star,
    _long_route,
    _long_routes,
    plan,
)
from reshard.tasks import decompose


def _meshes():
    src = Mesh.grid({"host": 2, "gpu": 2}, 2, "a")
    dst = Mesh.grid({"host": 3, "gpu": 2}, 2, "b")
    return src, dst


def test_the_tensors_of_one_layout_walk_the_same_rows():
    src, dst = _meshes()
    a, b = Sharding(src, ("host", "gpu")), Sharding(dst, (None, "gpu"))  # each tile wanted on every host of b
    loads = Loads(Topology())
    tasks = loads.unit_tasks((12, 8), a, b)
    hosts = HostCache()
    order, cut, rows = loads.task_rows(tasks, hosts)
    assert loads.task_rows(tasks, hosts)[2] is rows
    assert len(order) - cut < _BULK_FROM and len(rows) == len(tasks)  # a short one-to-one run is walked too
    plain = decompose((12, 8), a, b)
    assert [(box, num, senders, receivers) for box, num, senders, receivers, *_ in rows] == \
           [(plain[i].box, plain[i].num_elements, plain[i].senders, plain[i].receivers) for i in order.tolist()]


def test_the_rows_of_a_large_layout_are_not_kept(monkeypatch):
    from reshard import strategies

    src, dst = _meshes()
    a, b = Sharding(src, ("host", "gpu")), Sharding(dst, (None, "gpu"))
    loads = Loads(Topology())
    tasks = loads.unit_tasks((12, 8), a, b)
    monkeypatch.setattr(strategies, "_KEEP_ROWS", len(tasks) - 1)
    rows = loads.task_rows(tasks, HostCache())[2]
    again = loads.task_rows(tasks, HostCache())[2]
    assert again is not rows and again == rows


def test_plans_of_one_layout_hold_the_same_boxes_and_the_plans_of_fresh_loads():
    src, dst = _meshes()
    for a, b, methods in ((Sharding(src, ("host", "gpu")), Sharding(src, ("host", None)), {"local"}),
                          (Sharding(src, ("host", "gpu")), Sharding(dst, ("host", "gpu")), {"p2p"}),
                          (Sharding(src, ("host", "gpu")), Sharding(dst, (None, "gpu")), {"broadcast"})):
        loads = Loads(Topology())
        first = plan((12, 8), "float32", a, b, loads=loads)
        second = plan((12, 8), "float32", a, b, loads=loads)
        assert {t.method for t in first.transfers} == methods
        # The second may choose otherwise (the first's loads are in), but its boxes are the first's objects.
        assert {id(t.box) for t in second.transfers} <= {id(t.box) for t in first.transfers}
        # The rows change no choice: the first is what the same tensor planned through new loads sends.
        assert first.transfers == plan((12, 8), "float32", a, b, loads=Loads(Topology())).transfers


def _plain_best_of_one(box, nbytes, holders, wanting, remote, loads):
    """One holder's choice as `_best_delivery` makes it: the chain routed and scored, the star scored, and the chain
    on a tie (it comes first in the option order); a small box (`STEP_S`) goes as the chain, routed as
    `_long_routes` routes, unless the star leaves a lower peak."""
    (hs, group), = holders.items()
    send = loads.send
    order = sorted(remote, key=lambda h: (send[h], h))
    if len(remote) > 1 and loads.seconds(hs, nbytes) < STEP_S:
        route = _long_route(hs, _long_routes(order, loads), loads)
        delta = {hs: loads.seconds(hs, nbytes), **{h: loads.seconds(h, nbytes) for h in route[:-1]}}
        star = {hs: loads.seconds(hs, nbytes * len(remote))}
        if loads.score(star)[0] < loads.score(delta)[0]:
            return _emit_star(box, hs, group[0], remote, nbytes, wanting, loads, star)
        return _emit_chain(box, hs, group[0], route, nbytes, wanting, loads, delta)
    route = _chain_order(hs, order, loads)
    delta = {hs: loads.seconds(hs, nbytes), **{h: loads.seconds(h, nbytes) for h in route[:-1]}}
    if len(remote) > 1:
        star = {hs: loads.seconds(hs, nbytes * len(remote))}
        if loads.score(star) < loads.score(delta):
            return _emit_star(box, hs, group[0], remote, nbytes, wanting, loads, star)
    return _emit_chain(box, hs, group[0], route, nbytes, wanting, loads, delta)


def test_a_box_on_one_host_goes_as_the_option_list_sends_it():
    from reshard.strategies import _best_of_one

    rng = random.Random(41)
    picked = {"p2p": 0, "broadcast": 0}
    for _ in range(600):
        hosts = [f"h{i}" for i in range(rng.randint(3, 17))]
        loads = Loads(Topology(nic_gbps=10.0))
        few = rng.random() < 0.5
        for h in hosts:
            loads.send[h] = rng.choice([0.0, 1e-3]) if few else rng.random() * 1e-2
        loads.peak = max(loads.send.values())
        for _ in range(rng.randint(0, 3 * len(hosts))):
            x, y = rng.sample(hosts, 2)
            loads.add_path(x, (y,), rng.randint(1, 10**7))
        remote = tuple(rng.sample(hosts[1:], rng.randint(2, len(hosts) - 1)))
        holders = {hosts[0]: (f"{hosts[0]}/0",)}
        wanting = {h: tuple(f"{h}/{d}" for d in range(rng.randint(1, 2))) for h in remote}
        box = ((0, rng.choice([1, 64, 1 << 20])), (0, 8))
        nbytes = 2 * box[0][1] * 8
        whole = {h: loads.seconds(h, nbytes) for h in remote}
        other = copy.deepcopy(loads)
        got = list(_best_of_one(box, nbytes, holders, wanting, remote, loads, whole))
        assert got == list(_plain_best_of_one(box, nbytes, holders, wanting, remote, other))
        assert (dict(loads.send), dict(loads.pairs), loads.peak) == (dict(other.send), dict(other.pairs), other.peak)
        for t in got:
            picked[t.method] += 1
    assert picked["p2p"] and picked["broadcast"]
