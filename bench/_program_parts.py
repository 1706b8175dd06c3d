"""What the MoE benches measure of a many-tensor program that the core does not yet say: each host's slice of its
text (`host_slice_text`, `host_slice_bytes`) and a lower bound over all its tensors (`many_lower_bound`).

A host's slice is what an agent would need if the planner cut the program per host (issue 41, not built yet): the
steps the host takes part in (as sender, as a receiving or forwarding hop of a move, as a compute or reduce device),
the declarations of the tensors those steps name, and the buckets of its moves, written as the program's own JSON
writes them (``json.dumps`` of each value's ``to_json``; steps keep their ids and ``after`` as in the whole program).

The lower bound is `reshard.cost.lower_bound_seconds`' argument over every tensor at once: a host receives every
byte its devices need and none of them holds; a byte held by one host leaves it at least once; all leaving bytes
pass the holders' NICs together. Each tensor is counted at the itemsize it travels in (fp8 where it is quantized on
the way, which the senders do before the moves), from the hosts that hold it in its source layout.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping

from reshard import Topology
from reshard.mesh import host_of
from reshard.program import MOVE, Program, Step, TensorDecl
from reshard.routes import HostCache, hops
from reshard.tasks import decompose

__all__ = ["step_hosts", "host_slice_text", "host_slice_bytes", "many_lower_bound"]


def step_hosts(step: Step, hosts: HostCache | None = None) -> set[str]:
    """The hosts that take part in ``step``: a move's sender host and every host a hop of it reaches (receivers'
    hosts, and route hosts that only forward), a compute's or reduce's devices' hosts."""
    hosts = hosts if hosts is not None else HostCache()
    if step.kind == MOVE:
        t = step.transfer
        return {hosts[t.sender], *(hosts[r] for r in t.receivers), *(h.dst for h in hops(t, hosts))}
    return {hosts[d] for d in step.participants()}


def _step_tensors(step: Step) -> list[str]:
    if step.kind == MOVE:
        return [step.tensor]
    return [r.tensor for r in (*step.inputs, *((step.output,) if step.output is not None else ()))]


def _buckets(program: Program) -> tuple[tuple[int, ...], ...]:
    return getattr(program, "buckets", ())


def host_slice_text(program: Program, host: str) -> str:
    """``host``'s slice of ``program`` as JSON text: {"tensors": [...], "steps": [...], "buckets": [...]}, each
    value as the program's text writes it, in the program's order."""
    hosts = HostCache()
    steps = [s for s in program.steps if host in step_hosts(s, hosts)]
    ids = {s.id for s in steps}
    names = {n for s in steps for n in _step_tensors(s)}
    tensors = [t.to_json() for t in program.tensors if t.name in names]
    buckets = [list(b) for b in _buckets(program) if b[0] in ids]
    return json.dumps({"tensors": tensors, "steps": [s.to_json() for s in steps], "buckets": buckets})


def host_slice_bytes(program: Program) -> dict[str, int]:
    """Per host that takes part in any step, the length of its `host_slice_text`, worked out with one JSON text per
    step and per distinct tensor layout rather than a text per host (a program of a million steps)."""
    hosts = HostCache()
    empty = len(json.dumps({"tensors": [], "steps": [], "buckets": []}))
    # per host: [steps' text, steps, tensor names, buckets' text, buckets]
    acc: dict[str, list] = defaultdict(lambda: [0, 0, set(), 0, 0])
    step_hosts_of: dict[int, set[str]] = {}
    for s in program.steps:
        where = step_hosts(s, hosts)
        step_hosts_of[s.id] = where
        n = len(json.dumps(s.to_json()))
        names = _step_tensors(s)
        for h in where:
            a = acc[h]
            a[0] += n
            a[1] += 1
            a[2].update(names)
    for b in _buckets(program):
        n = len(json.dumps(list(b)))
        for h in step_hosts_of[b[0]]:
            acc[h][3] += n
            acc[h][4] += 1
    # A state dict repeats a few layouts over many tensors: a declaration's text less its name is made once each.
    # (Keyed by the shardings' ids: the program holds them, so the ids stay theirs while this runs.)
    decl_len: dict[str, int] = {}
    rest: dict[tuple, int] = {}
    for t in program.tensors:
        key = (id(t.src), id(t.dst), t.shape, t.dtype)
        if key not in rest:
            rest[key] = len(json.dumps(t.to_json())) - len(json.dumps(t.name))
        decl_len[t.name] = rest[key] + len(json.dumps(t.name))
    sep = len(", ")
    out = {}
    for h, (step_text, num_steps, names, bucket_text, num_buckets) in acc.items():
        tensor_text = sum(decl_len[n] for n in names)
        out[h] = (empty + step_text + sep * max(num_steps - 1, 0) + tensor_text + sep * max(len(names) - 1, 0)
                  + bucket_text + sep * max(num_buckets - 1, 0))
    return out


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
