"""Plans made faster stay the plans they were: program and plan ids pinned, and the chain search against its plain
definition.

The ids were taken before the route search of `reshard.strategies._chain_order` read its hops from rows (issue 41:
a Kimi-K2-like state dict spent most of `plan_many` there). A change that makes planning faster must leave every
id here as it is; a change that means to plan differently updates them and says why.

Updated when small boxes (`reshard.strategies.STEP_S`: those their sender moves in under 50 us) began to go as
chains wherever a chain keeps the busiest NIC where a star would (issue 41: a star made a step per receiving host,
nine in ten of the Kimi-K2-like state dict's 13 million steps). The paper suites' plans did not change.

Updated again when `reshard.plan_many` began to plan each layout (shape, dtype, source, destination) once for all
its tensors (`plan(..., copies=)`: a state dict's layers repeat a few layouts, and planning every tensor of the
61-layer Kimi-K2-like one took 36-46 s of issue 41's 5). The tensors of one layout now move alike; the paper suites'
plans, the broadcast strategy's, and the small MoE's did not change.

The small MoE's changed when a small chain's shared route (`reshard.many.SHARED_ROUTE_BYTES`) came to be decided
once per transfer, for every tensor of a layout alike (before, a later tensor found its own path's bucket open and
kept its route): the steps of a layout's tensors stay one another's renamed, which the program's compact text
writes as runs (`reshard.program.Run`).

Updated when `auto` began to take a star over a chain where neither raises the busiest NIC above the floor of the
whole (`reshard.strategies._fewer_hops`; issue 38: on the emulated hosts a weight sync's stars ran 2-4% faster than
its chains, and allgather4's and grow2to4's 2-3%). Of the paper suites, allgather4, allgather8 and grow2to4 changed
(stars, at the same estimate); the tests' small state dict and the one-layer Kimi-K2-like MoE changed (its large
boxes wanted by all 16 serving hosts: 720 more steps); the small MoE's, the long chains' and the 61-layer Kimi-K2-like
state dict's (bench/moe_plan.py: 1,603,405 steps, as before) did not.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from itertools import permutations

import pytest

from reshard import Mesh, Topology, plan
from reshard.cases import n_to_m_cases, one_to_m_cases, overlap_cases
from reshard.many import plan_many
from reshard.moe import KIMI_K2, SMALL_MOE, moe_state_dict
from reshard.strategies import _EXHAUSTIVE_ROUTE, Loads, _chain_order
from tests.core.test_many import _state_dict as small_state_dict
from tests.core.test_plan_speed import _state_dict as long_route_state_dict


def test_the_paper_suites_plan_as_they_did():
    topology = Topology(nic_gbps=10.0)
    ids = [plan(c.shape, c.dtype, c.src, c.dst, topology, strategy).id
           for suite in (n_to_m_cases, one_to_m_cases, overlap_cases) for c in suite()
           for strategy in ("send_recv", "local_allgather", "broadcast", "auto")]
    assert len(ids) == 4 * 21
    assert hashlib.sha256(" ".join(ids).encode()).hexdigest()[:16] == "ee9bcccd7e374695"


@pytest.mark.parametrize("strategy, want", [("auto", "783ff29f0144624e"), ("broadcast", "ef312f101cccf5cf")])
def test_tests_state_dicts_plan_as_they_did(strategy, want):
    assert plan_many(small_state_dict(), strategy=strategy).id[:16] == want


def test_a_state_dict_of_long_chains_plans_as_it_did():
    assert plan_many(long_route_state_dict(), Topology.gpu_hosts(), bucket_bytes=2**20).id[:16] == "b36a9e9a92172391"


def test_moe_state_dicts_plan_as_they_did():
    train, serve = Mesh.grid({"host": 4, "gpu": 2}, 2, "t"), Mesh.grid({"host": 2, "gpu": 2}, 2, "s")
    small = moe_state_dict(SMALL_MOE, train, serve, ep_devices=2)
    assert plan_many(small.tensors, Topology.gpu_hosts(nics=2), scales=small.scales).id[:16] == "5c07d65a8832202e"
    # Kimi K2's shapes, one MoE layer of 16 experts, from 16 training hosts of 2 GPUs to the records' serving mesh:
    # chains over the 16 serving hosts (attention's small boxes, which take `_long_routes`' routes; its large ones go
    # as stars) and over 8 (each expert to its replicas), where the route search takes its greedy walks.
    config = replace(KIMI_K2, num_layers=1, num_dense_layers=0, num_experts=16)
    kimi = moe_state_dict(config, Mesh.grid({"host": 16, "gpu": 2}, 2, "train"),
                          Mesh.grid({"host": 16, "gpu": 8}, 8, "serve"), 16)
    program = plan_many(kimi.tensors, Topology.gpu_hosts(), scales=kimi.scales)
    assert (len(program.steps), len(program.buckets)) == (2_673, 446)
    assert program.id[:16] == "7966b6dc2bf0c253"


def _plain_chain_order(sender: str, order: list[str], loads: Loads) -> list[str]:
    """`_chain_order` as its docstring defines it, written plainly: for each host tied for the most send load as
    the last, every order of the others up to `_EXHAUSTIVE_ROUTE` of them, else the greedy walk from the sender to
    the host of the fewest bytes over the hop (the lower rank on a tie); the route of the fewest bytes over its
    hops wins, then the lower ranks."""
    if len(order) < 2:
        return order
    rank = {h: i for i, h in enumerate(order)}

    def hop(a, b):
        return loads.pairs.get((a, b), 0.0)

    top = loads.send[order[-1]]
    best = None
    for last in [h for h in order if loads.send[h] >= top * (1 - 1e-9)]:
        rest = [h for h in order if h != last]
        if len(rest) <= _EXHAUSTIVE_ROUTE:
            tries = [list(p) for p in permutations(rest)]
        else:
            route, left, at = [], list(rest), sender
            while left:
                at = min(left, key=lambda h: (hop(at, h), rank[h]))
                route.append(at)
                left.remove(at)
            tries = [route]
        for route in tries:
            route = [*route, last]
            key = (sum(hop(a, b) for a, b in zip((sender, *route), route)), [rank[h] for h in route])
            if best is None or key < best[0]:
                best = (key, route)
    return best[1]


@pytest.mark.parametrize("seed", range(6))
def test_the_chain_search_finds_the_route_its_definition_does(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(300):
        n = rng.randint(2, 17)
        hosts = [f"h{i}" for i in range(n + 1)]
        loads = Loads(Topology())
        # Few distinct byte counts make ties, which the search breaks by rank; many make one best route.
        values = [0.0, 1.0, 2.0] if rng.random() < 0.5 else None
        for _ in range(rng.randint(0, 3 * n * n)):
            a, b = rng.sample(hosts, 2)
            loads.add_path(a, (b,), rng.choice(values) if values else rng.randint(1, 10**6) * 1.5)
        for h in hosts[1:]:
            loads.send[h] = rng.choice([0.0, 1.0, 2.0]) if rng.random() < 0.7 else rng.random()
        order = sorted(hosts[1:], key=lambda h: (loads.send[h], h))
        assert _chain_order(hosts[0], list(order), loads) == _plain_chain_order(hosts[0], list(order), loads)
        checked += 1
    assert checked == 300


def test_the_rows_the_chain_search_reads_are_the_bytes_between_hosts():
    loads = Loads(Topology())
    loads.add_path("a", ("b", "c"), 100)
    loads.add_path("a", ("b",), 5)
    assert dict(loads.pairs) == {("a", "b"): 105.0, ("b", "c"): 100.0}
    assert {h: dict(row) for h, row in loads.next_hops.items()} == {"a": {"b": 105.0}, "b": {"c": 100.0}}
