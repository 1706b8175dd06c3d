"""Auto routes a chain only where it could win (issue 41): its bounds never exceed its score, the deliveries it picks
are the ones found by routing every chain, and a state dict's tensors of one layout share their unit tasks."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from reshard import Mesh, Sharding, Topology
from reshard import box as boxes
from reshard.strategies import (
    MAX_STRIPES,
    STEP_S,
    Loads,
    _best_delivery,
    _chain_bound,
    _chain_floor,
    _chain_order,
    _emit_chain,
    _emit_star,
    _emit_stripes,
    _forwarding,
    _long_route,
    _long_routes,
    _stripes_worth,
)
from reshard.tasks import decompose


def _random_loads(rng: random.Random, hosts: list[str]) -> Loads:
    """Loads with send, receive and hop figures drawn from few values (ties) or many (one best)."""
    loads = Loads(Topology(nic_gbps=10.0))
    few = rng.random() < 0.5
    pick = (lambda: rng.choice([0.0, 1e-3, 2e-3])) if few else (lambda: rng.random() * 1e-2)
    for h in hosts:
        if rng.random() < 0.8:
            loads.send[h] = pick()
        if rng.random() < 0.5:
            loads.recv[h] = pick()
    loads.peak = max([*loads.send.values(), *loads.recv.values(), 0.0])
    for _ in range(rng.randint(0, 3 * len(hosts))):
        a, b = rng.sample(hosts, 2)
        loads.add_path(a, (b,), rng.choice([1e6, 2e6]) if few else rng.randint(1, 10**7))
    return loads


def _small_best(box, nbytes, holders, wanting, remote, loads, whole, candidates, order):
    """A small box's choice (`STEP_S`), plainly: every candidate's chain (routed as `_long_routes` routes) and star,
    ranked by (peak, steps, sum of squares), the first of the least."""
    options = []
    for hs in candidates[:MAX_STRIPES]:
        route = _long_route(hs, _long_routes(order, loads), loads)
        delta = {hs: loads.seconds(hs, nbytes), **{h: whole[h] for h in route[:-1]}}
        peak, sq = loads.score(delta)
        options.append(((peak, 1, sq), lambda hs=hs, route=route, delta=delta: _emit_chain(
            box, hs, holders[hs][0], route, nbytes, wanting, loads, delta)))
        star = {hs: loads.seconds(hs, nbytes * len(remote))}
        peak, sq = loads.score(star)
        options.append(((peak, len(remote), sq), lambda hs=hs, star=star: _emit_star(
            box, hs, holders[hs][0], remote, nbytes, wanting, loads, star)))
    return min(options, key=lambda o: o[0])[1]()


def _eager_best(box, num_elements, nbytes, holders, wanting, remote, loads, whole):
    """`_best_delivery` as it was before issue 41: every candidate's chain routed and scored; a small box's as
    `_small_best` chooses."""
    send = loads.send
    candidates = sorted(holders, key=lambda h: (send[h], h))
    order = sorted(remote, key=lambda h: (send[h], h))
    if len(remote) > 1 and loads.seconds(candidates[0], nbytes) < STEP_S:
        return _small_best(box, nbytes, holders, wanting, remote, loads, whole, candidates, order)
    options = []
    for hs in candidates[:MAX_STRIPES]:
        route = _chain_order(hs, order, loads)
        delta = {hs: loads.seconds(hs, nbytes)}
        for h in route[:-1]:
            delta[h] = whole[h]
        options.append((loads.score(delta), lambda hs=hs, route=route, delta=delta: _emit_chain(
            box, hs, holders[hs][0], route, nbytes, wanting, loads, delta)))
        if len(remote) > 1:
            star = {hs: loads.seconds(hs, nbytes * len(remote))}
            options.append((loads.score(star), lambda hs=hs, star=star: _emit_star(
                box, hs, holders[hs][0], remote, nbytes, wanting, loads, star)))
    k = min(len(candidates), MAX_STRIPES, _stripes_worth(nbytes, candidates, loads))
    pieces = [p for p in (boxes.split(box, k) if k > 1 else []) if boxes.volume(p)]
    if len(pieces) > 1:
        parts, delta = [], {}
        for j, piece in enumerate(pieces):
            hs = candidates[j]
            route = order[j % len(order):] + order[:j % len(order)] if len(order) > 1 else order
            share = boxes.volume(piece) * nbytes / num_elements
            delta[hs] = delta.get(hs, 0.0) + loads.seconds(hs, share)
            for h in route[:-1]:
                delta[h] = delta.get(h, 0.0) + loads.seconds(h, share)
            parts.append((piece, hs, holders[hs][0], route, share))
        options.append((loads.score(delta), lambda: _emit_stripes(parts, wanting, loads, delta)))
    return min(options, key=lambda o: o[0])[1]()


@pytest.mark.parametrize("seed", range(4))
def test_a_chains_bounds_never_exceed_its_score(seed):
    rng = random.Random(seed)
    for _ in range(300):
        hosts = [f"h{i}" for i in range(rng.randint(2, 17))]
        loads = _random_loads(rng, hosts)
        sender, remote = hosts[0], hosts[1:]
        order = sorted(remote, key=lambda h: (loads.send[h], h))
        nbytes = rng.choice([1, 4096, 10**6, 3 * 10**8])
        whole = {h: loads.seconds(h, nbytes) for h in remote}
        mine = loads.seconds(sender, nbytes)
        route = _chain_order(sender, order, loads)
        delta = {sender: mine, **{h: whole[h] for h in route[:-1]}}
        score = loads.score(delta)
        was = loads.send[sender]
        bound = _chain_bound(loads.peak, was, mine, _forwarding(order, loads.send, whole))
        floor = _chain_floor(loads.peak, was, mine, len(order), loads.send[order[0]], loads.send[order[-1]],
                             min(whole.values()), max(whole.values()))
        assert floor <= score and bound <= score, (floor, bound, score, route)


@pytest.mark.parametrize("seed", range(4))
def test_auto_picks_the_delivery_that_routing_every_chain_picks(seed):
    rng = random.Random(seed)
    picked = {"p2p": 0, "broadcast": 0}
    for _ in range(400):
        hosts = [f"h{i}" for i in range(rng.randint(2, 14))]
        loads = _random_loads(rng, hosts)
        num_holders = rng.randint(1, min(4, len(hosts) - 1))
        holders = {h: tuple(f"{h}/{d}" for d in range(rng.randint(1, 2))) for h in hosts[:num_holders]}
        remote = tuple(rng.sample(hosts[num_holders:], rng.randint(1, len(hosts) - num_holders)))
        wanting = {h: tuple(f"{h}/{d}" for d in range(rng.randint(1, 3))) for h in remote}
        if len(holders) == 1 and len(remote) == 1:
            continue  # auto chooses nothing there
        box = ((0, rng.choice([1, 64, 4096, 1 << 20])), (0, rng.choice([1, 8, 128])))
        num = boxes.volume(box)
        nbytes = num * 2
        whole = {h: loads.seconds(h, nbytes) for h in remote}
        other = copy.deepcopy(loads)
        got = list(_best_delivery(box, num, nbytes, holders, wanting, remote, loads, dict(whole)))
        want = list(_eager_best(box, num, nbytes, holders, wanting, remote, other, dict(whole)))
        assert got == want
        assert (dict(loads.send), dict(loads.pairs), loads.peak) == (dict(other.send), dict(other.pairs), other.peak)
        for t in got:
            picked[t.method] = picked.get(t.method, 0) + 1
    assert picked["broadcast"] and picked["p2p"]  # stars' legs, chains and stripes all came up


def test_the_tensors_of_one_layout_share_read_only_unit_tasks():
    mesh = Mesh.grid({"host": 2, "gpu": 2}, 2, "m")
    src, dst = Sharding(mesh, ("host", None)), Sharding(mesh, (None, "gpu"))
    loads = Loads(Topology())
    tasks = loads.unit_tasks((8, 6), src, dst)
    assert loads.unit_tasks((8, 6), src, dst) is tasks
    assert loads.unit_tasks((8, 4), src, dst) is not tasks
    plain = decompose((8, 6), src, dst)
    assert [(t.box, t.senders, t.receivers) for t in tasks] == [(t.box, t.senders, t.receivers) for t in plain]
    with pytest.raises(ValueError, match="read-only"):
        tasks.lo[0, 0] = 1
    assert np.array_equal(plain.num_elements, tasks.num_elements)
