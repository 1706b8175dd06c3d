"""What the MoE benches measure of a many-tensor program that the core does not yet say: a lower bound over all its
tensors (`many_lower_bound`).

The lower bound is `reshard.cost.lower_bound_seconds`' argument over every tensor at once: a host receives every
byte its devices need and none of them holds; a byte held by one host leaves it at least once; all leaving bytes
pass the holders' NICs together. Each tensor is counted at the itemsize it travels in (fp8 where it is quantized on
the way, which the senders do before the moves), from the hosts that hold it in its source layout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from reshard import Topology
from reshard.mesh import host_of
from reshard.program import TensorDecl
from reshard.tasks import decompose

__all__ = ["many_lower_bound"]


def many_lower_bound(tensors: Iterable[TensorDecl], topology: Topology,
                     itemsizes: Mapping[str, int] | None = None) -> float:
    """Seconds no plan moving every tensor of ``tensors`` (each with ``src`` and ``dst``) can beat on ``topology``'s
    NICs: `reshard.cost.lower_bound_seconds` over all of them at once, each tensor's elements counted at
    ``itemsizes[name]`` (default its own itemsize: pass the wire's where a tensor changes dtype on the way)."""
    need: dict[str, int] = defaultdict(int)
    sole: dict[str, int] = defaultdict(int)
    sources: set[str] = set()
    leaving = 0
    # Per (shape, src, dst): elements each host needs, elements each sole holder must send, elements leaving, and
    # the hosts they leave from; a state dict repeats a few of these over all its tensors.
    seen: dict[tuple, tuple[dict[str, int], dict[str, int], int, frozenset[str]]] = {}
    for t in tensors:
        key = (t.shape, t.src, t.dst)
        counts = seen.get(key)
        if counts is None:
            counts = seen[key] = _element_counts(t)
        size = itemsizes[t.name] if itemsizes is not None and t.name in itemsizes else t.itemsize
        t_need, t_sole, t_leaving, t_sources = counts
        for h, n in t_need.items():
            need[h] += n * size
        for h, n in t_sole.items():
            sole[h] += n * size
        leaving += t_leaving * size
        sources |= t_sources
    best = 0.0
    for loads in (need, sole):
        for h, b in loads.items():
            best = max(best, b / topology.nic_bytes_per_s(h))
    if sources:
        best = max(best, leaving / sum(topology.nic_bytes_per_s(h) for h in sources))
    return best


def _element_counts(t: TensorDecl) -> tuple[dict[str, int], dict[str, int], int, frozenset[str]]:
    tasks = decompose(t.shape, t.src, t.dst)
    holder_hosts = [frozenset(host_of(d) for d in g) for g in tasks.senders]
    receiver_hosts = [frozenset(host_of(d) for d in g) for g in tasks.receivers]
    per_pair: dict[tuple[int, int], int] = defaultdict(int)
    for n, g, q in zip(tasks.num_elements.tolist(), tasks.sender_group.tolist(), tasks.receiver_group.tolist()):
        per_pair[g, q] += n
    need: dict[str, int] = defaultdict(int)
    sole: dict[str, int] = defaultdict(int)
    leaving, sources = 0, set()
    for (g, q), n in per_pair.items():
        wanting = receiver_hosts[q] - holder_hosts[g]
        if not wanting:
            continue
        for h in wanting:
            need[h] += n
        leaving += n
        sources |= holder_hosts[g]
        if len(holder_hosts[g]) == 1:
            sole[next(iter(holder_hosts[g]))] += n
    return dict(need), dict(sole), leaving, frozenset(sources)
