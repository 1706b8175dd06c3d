"""How large a plan a reshard would make, bounded from its two shardings before anything is planned.

Planning costs little per unit task, but a reshard over thousands of devices can
make millions of them (``P('x', None) -> P(None, 'x')`` over 4,096 devices makes
16.7M), or few tasks with thousands of receivers each (an all-gather over 4,096
devices delivers 16.7M boxes). A service refuses such a request before it plans,
from these bounds, each computed from the shardings' chunk intervals in time
linear in the number of devices:

===============  =========================================================================
figure           upper bound on
===============  =========================================================================
unit_tasks       boxes where a source tile meets a destination tile (`reshard.tasks`): per
                 dim the (destination chunk, source chunk) pairs that overlap, multiplied
                 over dims. Tasks whose receivers already hold their box are counted too.
deliveries       (unit task, receiving device) pairs: the transfers a point-to-point plan
                 makes, and what every strategy walks.
route_steps      what strategy ``auto`` weighs to order its chain broadcasts: for a task
                 with ``r`` receiving hosts, up to ``r`` candidate last hosts times ``r**2``
                 hops of a greedy route, for each of up to 4 replica hosts that may send it;
                 past 16 hosts, auto walks each of 4 strided routes once instead: ``r``
                 hops each, for each of those senders (`strategies.chain_route_steps`).
===============  =========================================================================

A route step is a dictionary lookup, some 256 times cheaper than planning a unit
task, so `PlanSize.excess` holds ``route_steps`` to ``ROUTE_STEPS_PER_TASK`` times the
task limit: the same planning time as the largest task count allowed.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from reshard.mesh import host_of
from reshard.sharding import Sharding
from reshard.strategies import MAX_STRIPES, chain_route_steps

__all__ = ["PlanSize", "estimate_plan_size", "layouts_plan_size", "excess_text", "ROUTE_STEPS_PER_TASK"]

ROUTE_STEPS_PER_TASK = 256


@dataclass(frozen=True)
class PlanSize:
    unit_tasks: int
    deliveries: int
    route_steps: int

    def excess(self, max_tasks: int, strategy: str = "auto") -> list[tuple[str, int, int]]:
        """(figure, count, limit) for every figure over its limit under ``max_tasks`` unit tasks per plan;
        ``route_steps`` counts for strategy ``auto`` only."""
        limits = [("unit_tasks", self.unit_tasks, max_tasks), ("deliveries", self.deliveries, max_tasks)]
        if strategy == "auto":
            limits.append(("route_steps", self.route_steps, max_tasks * ROUTE_STEPS_PER_TASK))
        return [(name, n, limit) for name, n, limit in limits if n > limit]

    @classmethod
    def total(cls, sizes) -> "PlanSize":
        """The sum of ``sizes``: one program that moves several tensors."""
        sizes = list(sizes)
        return cls(*(sum(getattr(p, f) for p in sizes) for f in ("unit_tasks", "deliveries", "route_steps")))

    def __str__(self) -> str:
        return f"{self.unit_tasks:,} unit tasks, {self.deliveries:,} deliveries, {self.route_steps:,} route steps"


def excess_text(over: list[tuple[str, int, int]]) -> str:
    """`PlanSize.excess` in words, as a refusal names it: "1,640,448 deliveries where the limit is 1,000,000; ..."."""
    return "; ".join(f"{count:,} {figure.replace('_', ' ')} where the limit is {bound:,}"
                     for figure, count, bound in over)


def _overlap_counts(dst: list[tuple[int, int]], src: list[tuple[int, int]]) -> list[int]:
    """Per destination chunk, how many non-empty source chunks it overlaps.

    Chunks of one dim are disjoint and in order, so their starts and ends are sorted.
    """
    nonempty = [(lo, hi) for lo, hi in src if lo < hi]
    starts = [lo for lo, _ in nonempty]
    ends = [hi for _, hi in nonempty]
    return [bisect.bisect_left(starts, hi) - bisect.bisect_right(ends, lo) if lo < hi else 0 for lo, hi in dst]


def _hosts_per_tile(sharding: Sharding, ndim: int) -> dict[tuple[int, ...], int]:
    """How many hosts hold each tile (by chunk index)."""
    hosts: dict[tuple[int, ...], set[str]] = {}
    for pos, dev in enumerate(sharding.mesh.require_devices()):
        hosts.setdefault(sharding.chunk_index(pos, ndim), set()).add(host_of(dev))
    return {key: len(h) for key, h in hosts.items()}


def estimate_plan_size(shape, src: Sharding, dst: Sharding) -> PlanSize:
    """Upper bounds on the work of planning a move of ``shape`` from ``src`` to ``dst`` (see the module)."""
    shape = dst.check_shape(src.check_shape(shape))
    counts = [_overlap_counts(d, s) for d, s in zip(dst.dim_chunks(shape), src.dim_chunks(shape))]
    unit_tasks = math.prod(sum(c) for c in counts)
    # Every destination tile is held by the same number of devices, one per position of the unused axes.
    deliveries = unit_tasks * dst.num_replicas()
    route_steps = 0
    if dst.num_replicas() > 1 and unit_tasks:
        senders = min(MAX_STRIPES, max(_hosts_per_tile(src, len(shape)).values()))
        # Between meshes on other hosts, every host holding a destination tile is on its chains.
        disjoint = set(src.mesh.hosts).isdisjoint(dst.mesh.hosts)
        for key, num_hosts in _hosts_per_tile(dst, len(shape)).items():
            if num_hosts > 1:
                tasks = math.prod(c[i] for c, i in zip(counts, key))
                route_steps += tasks * senders * chain_route_steps(num_hosts, exactly=disjoint)
    return PlanSize(unit_tasks, deliveries, route_steps)


def layouts_plan_size(decls) -> PlanSize:
    """What planning ``decls`` (each with ``shape``, ``src`` and ``dst``) together costs as `reshard.plan_many`
    plans them: each distinct (shape, src, dst) once, whatever the number of its tensors. A tensor without ``src``
    (a block scale made on the way) is sized from its destination's mesh, unsplit, as its weight's layout moves it."""
    sizes: dict[tuple, PlanSize] = {}
    for d in decls:
        if (d.shape, d.src, d.dst) not in sizes:
            src = d.src if d.src is not None else Sharding(d.dst.mesh, [None] * len(d.shape))
            sizes[d.shape, d.src, d.dst] = estimate_plan_size(d.shape, src, d.dst)
    return PlanSize.total(sizes.values())
