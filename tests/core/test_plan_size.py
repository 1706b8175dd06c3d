"""The plan-size bounds (`reshard.plan_size`) against what the planner really enumerates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from reshard import Mesh, Sharding, plan
from reshard.mesh import host_of
from reshard.plan_size import ROUTE_STEPS_PER_TASK, PlanSize, estimate_plan_size
from reshard.server.common.config import PlannerConfig
from reshard.strategies import _GREEDY_ROUTE, _STRIDES, chain_route_steps
from reshard.tasks import decompose

from tests.core.test_planner_properties import problems


@settings(max_examples=300, deadline=None)
@given(problems())
def test_the_bounds_hold_and_are_exact_between_disjoint_meshes(problem):
    shape, src, dst, _ = problem
    tasks = decompose(shape, src, dst)
    size = estimate_plan_size(shape, src, dst)
    deliveries = sum(len(t.receivers) for t in tasks)
    assert size.unit_tasks >= len(tasks) and size.deliveries >= deliveries
    route = 0
    for t in tasks:
        remote = {host_of(r) for r in t.receivers} - {host_of(s) for s in t.senders}
        route += chain_route_steps(len(remote), exactly=True) if len(remote) > 1 else 0
    assert size.route_steps >= route
    if not set(src.mesh.devices) & set(dst.mesh.devices):
        assert (size.unit_tasks, size.deliveries) == (len(tasks), deliveries)


def _mesh(num_devices: int, per_host: int = 8) -> Mesh:
    return Mesh.from_hosts({"x": num_devices}, [f"h{i}" for i in range(num_devices // per_host)], per_host)


@pytest.mark.parametrize("n", [4096, 8192])
def test_the_meshes_of_issue_11_are_counted_without_planning(n):
    m = _mesh(n)
    transpose = estimate_plan_size((n * 4, n * 4), Sharding(m, ("x", None)), Sharding(m, (None, "x")))
    assert transpose.unit_tasks == transpose.deliveries == n * n and transpose.route_steps == 0
    # 3n+1 rows in chunks of 4: the last quarter of the devices hold empty tiles.
    gather = estimate_plan_size((n * 3 + 1,), Sharding(m, ("x",)), Sharding(m, (None,)))
    tiles = n * 3 // 4 + 1
    assert gather.unit_tasks == tiles and gather.deliveries == tiles * n
    # Every tile to every host, from one sending host, over strided routes (more than 16 hosts).
    assert gather.route_steps == tiles * chain_route_steps(n // 8) <= tiles * max(_STRIDES * n, 16 ** 3)
    scatter = estimate_plan_size((n,), Sharding(m, (None,)), Sharding(m, ("x",)))
    assert scatter == PlanSize(n, n, 0)


def test_uneven_chunks_and_empty_tiles_count_only_overlaps():
    m4, m3 = _mesh(4, 1), Mesh.from_hosts({"x": 3}, ["a", "b", "c"], 1)
    # 10 rows cut 4 ways (3, 3, 3, 1) and 3 ways (4, 4, 2): boundaries 0 3 4 6 8 9 10 make 6 boxes.
    assert estimate_plan_size((10,), Sharding(m4, ("x",)), Sharding(m3, ("x",))) == PlanSize(6, 6, 0)
    # 2 rows over 4 devices: two tiles are empty and meet nothing.
    assert estimate_plan_size((2,), Sharding(m3, (None,)), Sharding(m4, ("x",))).unit_tasks == 2


def test_excess_names_each_figure_over_its_limit():
    size = PlanSize(unit_tasks=10, deliveries=40, route_steps=30 * ROUTE_STEPS_PER_TASK)
    assert size.excess(40) == []
    assert size.excess(20) == [("deliveries", 40, 20), ("route_steps", 30 * ROUTE_STEPS_PER_TASK,
                                                         20 * ROUTE_STEPS_PER_TASK)]
    assert size.excess(20, "send_recv") == [("deliveries", 40, 20)]  # only auto searches chain routes
    assert str(size) == "10 unit tasks, 40 deliveries, 7,680 route steps"


def test_chains_over_many_hosts_count_the_strided_routes_auto_walks_not_a_cubic_search():
    """A bias from tensor-parallel 8 on 128 training hosts to tensor-parallel 4 with two replicas a host on 128
    inference hosts: 8 tasks, each a broadcast to all 128 hosts, which auto routes by strided chains. Counted as
    the cubic search that only chains of up to 16 hosts get, it came to 67 million route steps, and a planner with
    the default limits refused a reshard it plans in milliseconds."""
    train = Mesh.from_hosts({"dp": 128, "tp": 8}, [f"train{i}" for i in range(128)], 8)
    infer = Mesh.from_hosts({"dp": 256, "tp": 4}, [f"infer{i}" for i in range(128)], 8)
    src, dst = Sharding(train, ("tp",)), Sharding(infer, ("tp",))
    size = estimate_plan_size((16384,), src, dst)
    assert size.unit_tasks == 8 and size.deliveries == 8 * 256
    # Each tile is held on all 128 training hosts, of which auto weighs 4 as its sender; the meshes share no host,
    # so every chain runs over all 128 inference hosts.
    assert size.route_steps == 8 * 4 * _STRIDES * 128
    assert size.excess(PlannerConfig.max_plan_tasks) == []
    p = plan((16384,), "bfloat16", src, dst).validate()
    assert max(len(t.route) for t in p.transfers) == 128 > _GREEDY_ROUTE
    assert size.route_steps >= sum(len(t.route) for t in p.transfers)
    counts = [chain_route_steps(n) for n in range(2, 2000)]
    assert counts == sorted(counts) and counts[_GREEDY_ROUTE - 2] == _GREEDY_ROUTE ** 3  # never less for more hosts
    assert chain_route_steps(1024) == chain_route_steps(1024, exactly=True) == _STRIDES * 1024
    assert chain_route_steps(17, exactly=True) == _STRIDES * 17 < chain_route_steps(17) == _GREEDY_ROUTE ** 3
