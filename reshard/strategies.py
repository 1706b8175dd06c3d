"""The cross-mesh resharding planner.

Strategies (all available; the first three are also the baselines we measure against):

================= ==============================================================
send_recv         every receiver device is sent its box by the first replica
                  (Alpa's naive send/recv)
local_allgather   one copy per destination host, cut over that host's receivers
                  and sent by the least-loaded replica, then an intra-host
                  all-gather in a second phase (Alpa's default)
broadcast         the paper's method: one sender per unit task, the least-loaded
                  replica host, and a pipelined chain broadcast over the receiving
                  hosts, fanned out inside each host
auto              ours, the default: local copies where a receiver's host holds a
                  replica, a greedy choice per unit task (largest first) among
                  chain, star and striped deliveries that keeps the busiest NIC as
                  idle as possible, point-to-point where a broadcast buys nothing;
                  and never worse on the cost model than any other strategy
================= ==============================================================
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from itertools import permutations
from typing import Callable, Optional

from reshard import box as boxes
from reshard.cost import HostCache, estimate_seconds, lower_bound_seconds
from reshard.dtypes import dtype_name, itemsize
from reshard.errors import InvalidShardingError
from reshard.plan import Plan, Transfer
from reshard.sharding import Sharding
from reshard.tasks import UnitTask, decompose
from reshard.topology import Topology

__all__ = ["plan", "STRATEGIES", "BASELINES"]

BASELINES = ("send_recv", "local_allgather", "broadcast")
STRATEGIES = (*BASELINES, "auto")

# Stripe one unit task over at most this many replica hosts.
_MAX_STRIPES = 4
# Order a chain's forwarding hosts by trying every order up to this many of them, greedily beyond.
_EXHAUSTIVE_ROUTE = 4


def _group_by_host(devices: Sequence[str], hosts: HostCache) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for d in devices:
        out[hosts[d]].append(d)
    return out


def _deliver(box, sender: str, receivers: list[str], hosts: HostCache, phase: int = 0) -> Transfer:
    """A transfer of ``box`` to ``receivers``: local, point-to-point or a chain broadcast."""
    hs = hosts[sender]
    route = tuple(dict.fromkeys(h for h in (hosts[r] for r in receivers) if h != hs))
    if not route:
        return Transfer(box, sender, tuple(receivers), "local", phase)
    if len(receivers) == 1:
        return Transfer(box, sender, tuple(receivers), "p2p", phase)
    return Transfer(box, sender, tuple(receivers), "broadcast", phase, route)


# -- baselines ----------------------------------------------------------------------


def _send_recv(tasks: list[UnitTask], hosts: HostCache, topology: Topology, size: int) -> list[Transfer]:
    out = []
    for t in tasks:
        s = t.senders[0]
        for r in t.receivers:
            out.append(Transfer(t.box, s, (r,), "local" if hosts[r] == hosts[s] else "p2p"))
    return out


def _local_allgather(tasks: list[UnitTask], hosts: HostCache, topology: Topology, size: int) -> list[Transfer]:
    load: dict[str, int] = defaultdict(int)
    out = []
    gathers = []
    for t in tasks:
        for h, group in _group_by_host(t.receivers, hosts).items():
            pieces = boxes.split(t.box, len(group)) if len(group) > 1 else [t.box]
            for r, piece in zip(group, pieces):
                if boxes.volume(piece) == 0:
                    continue
                s = min(t.senders, key=lambda d: load[d])
                load[s] += boxes.volume(piece)
                out.append(Transfer(piece, s, (r,), "local" if hosts[s] == h else "p2p"))
                if len(group) > 1:
                    gathers.append(Transfer(piece, r, tuple(x for x in group if x != r), "local", 1))
    return out + gathers


def _broadcast(tasks: list[UnitTask], hosts: HostCache, topology: Topology, size: int) -> list[Transfer]:
    load: dict[str, float] = defaultdict(float)
    out = []
    for t in tasks:
        by_host = _group_by_host(t.senders, hosts)
        hs = min(by_host, key=lambda h: load[h])
        s = by_host[hs][0]
        route = tuple(sorted({hosts[r] for r in t.receivers} - {hs}))
        if route:
            load[hs] += t.num_elements * size / topology.nic_bytes_per_s(hs)
            out.append(Transfer(t.box, s, t.receivers, "broadcast", 0, route))
        else:
            out.append(Transfer(t.box, s, t.receivers, "local"))
    return out


# -- auto ---------------------------------------------------------------------------------


class _Loads:
    """NIC seconds per host and direction, and bytes per (from, to) host pair, kept while the greedy assigns
    unit tasks."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.send: dict[str, float] = defaultdict(float)
        self.recv: dict[str, float] = defaultdict(float)
        self.pairs: dict[tuple[str, str], float] = defaultdict(float)
        self.peak = 0.0
        self._bw: dict[str, float] = {}

    def seconds(self, host: str, nbytes: float) -> float:
        bw = self._bw.get(host)
        if bw is None:
            bw = self._bw[host] = self.topology.nic_bytes_per_s(host)
        return nbytes / bw

    def score(self, delta: dict[str, float]) -> tuple[float, float]:
        """(peak NIC load after adding ``delta`` to sends, growth of the sum of squares)."""
        peak, sq = self.peak, 0.0
        for h, d in delta.items():
            old = self.send[h]
            new = old + d
            peak = max(peak, new)
            sq += new * new - old * old
        return peak, sq

    def add_send(self, delta: dict[str, float]) -> None:
        for h, d in delta.items():
            self.send[h] += d
            self.peak = max(self.peak, self.send[h])

    def add_recv(self, host: str, secs: float) -> None:
        self.recv[host] += secs
        self.peak = max(self.peak, self.recv[host])

    def add_path(self, sender: str, route: Sequence[str], nbytes: float) -> None:
        for a, b in zip((sender, *route), route):
            self.pairs[a, b] += nbytes


def _chain_order(sender: str, remote: list[str], loads: _Loads) -> list[str]:
    """Route order: a host with the most send load goes last, as the last host forwards nothing; the others
    in the order whose hops carry the fewest bytes already planned between the same two hosts.

    Agents send all streams between two hosts over one connection (gloo's pair of the two ranks), and the
    kernel shares a NIC fairly between connections, not streams: two chains that cross the same pair of hosts
    at once get half a fair share each while the NIC's other connections take more, and a chain runs at the
    rate of its slowest hop. Spreading the hops over distinct pairs keeps every stream at its fair share (an
    all-gather over n hosts then uses each ordered pair once).
    """
    order = sorted(remote, key=lambda h: (loads.send[h], h))
    if len(order) < 2:
        return order
    top = loads.send[order[-1]]
    lasts = [h for h in order if loads.send[h] >= top * (1 - 1e-9)]
    rank = {h: i for i, h in enumerate(order)}

    def cost(route: Sequence[str]) -> float:
        return sum(loads.pairs.get((a, b), 0.0) for a, b in zip((sender, *route), route))

    best: tuple | None = None
    for last in lasts:
        rest = [h for h in order if h != last]
        if len(rest) <= _EXHAUSTIVE_ROUTE:
            tries = [list(p) for p in permutations(rest)]
        else:
            route, left, at = [], list(rest), sender
            while left:
                nxt = min(left, key=lambda h: (loads.pairs.get((at, h), 0.0), rank[h]))
                route.append(nxt)
                left.remove(nxt)
                at = nxt
            tries = [route]
        for route in tries:
            route = [*route, last]
            key = (cost(route), [rank[h] for h in route])
            if best is None or key < best[0]:
                best = (key, route)
    return best[1]


def _auto(tasks: list[UnitTask], hosts: HostCache, topology: Topology, size: int) -> list[Transfer]:
    loads = _Loads(topology)
    local_out: dict[str, int] = defaultdict(int)
    out: list[Transfer] = []
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i].num_elements)
    for i in order:
        t = tasks[i]
        nbytes = t.num_elements * size
        if len(t.senders) == 1 and len(t.receivers) == 1:
            # The all-to-all shape of most large reshards: nothing to choose.
            s, r = t.senders[0], t.receivers[0]
            hs, hr = hosts[s], hosts[r]
            if hs == hr:
                local_out[s] += nbytes
                out.append(Transfer(t.box, s, t.receivers, "local"))
            else:
                loads.add_recv(hr, loads.seconds(hr, nbytes))
                loads.add_send({hs: loads.seconds(hs, nbytes)})
                loads.add_path(hs, (hr,), nbytes)
                out.append(Transfer(t.box, s, t.receivers, "p2p"))
            continue
        holders = _group_by_host(t.senders, hosts)
        wanting = _group_by_host(t.receivers, hosts)
        # A receiver whose host holds a replica copies it locally: no NIC involved.
        for h, group in wanting.items():
            if h in holders:
                s = min(holders[h], key=lambda d: local_out[d])
                local_out[s] += nbytes
                out.append(Transfer(t.box, s, tuple(group), "local"))
        remote = [h for h in wanting if h not in holders]
        if not remote:
            continue
        for h in remote:
            loads.add_recv(h, loads.seconds(h, nbytes))
        if len(holders) == 1 and len(remote) == 1:
            # One replica host and one receiving host: nothing to choose.
            (hs, group), = holders.items()
            loads.add_send({hs: loads.seconds(hs, nbytes)})
            loads.add_path(hs, remote, nbytes)
            out.append(_deliver(t.box, group[0], wanting[remote[0]], hosts))
            continue
        out.extend(_best_delivery(t, nbytes, holders, wanting, remote, loads, hosts))
    return out


def _best_delivery(t: UnitTask, nbytes: int, holders, wanting, remote, loads: _Loads, hosts) -> list[Transfer]:
    """Pick, among chain, star and striped deliveries, the one that keeps NIC loads lowest."""
    candidates = sorted(holders, key=lambda h: (loads.send[h], h))
    options: list[tuple[tuple[float, float], Callable[[], list[Transfer]]]] = []

    def chain_delta(hs: str, route: list[str], share: float, delta: dict[str, float]) -> None:
        delta[hs] = delta.get(hs, 0.0) + loads.seconds(hs, share)
        for h in route[:-1]:
            delta[h] = delta.get(h, 0.0) + loads.seconds(h, share)

    for hs in candidates[:_MAX_STRIPES]:
        route = _chain_order(hs, remote, loads)
        delta: dict[str, float] = {}
        chain_delta(hs, route, nbytes, delta)
        options.append((loads.score(delta), lambda hs=hs, route=route, delta=delta: _emit_chain(
            t.box, hs, holders[hs][0], route, nbytes, wanting, loads, delta)))
        if len(remote) > 1:
            star = {hs: loads.seconds(hs, nbytes * len(remote))}
            options.append((loads.score(star), lambda hs=hs, star=star: _emit_star(
                t.box, hs, holders[hs][0], remote, nbytes, wanting, loads, star, hosts)))
    k = min(len(candidates), _MAX_STRIPES)
    pieces = boxes.split(t.box, k) if k > 1 else []
    pieces = [p for p in pieces if boxes.volume(p)]
    if len(pieces) > 1:
        base = sorted(remote, key=lambda h: (loads.send[h], h))
        plan_parts = []
        delta = {}
        for j, piece in enumerate(pieces):
            hs = candidates[j]
            # Rotate the chain so that each stripe ends on a different host.
            route = base[j % len(base):] + base[:j % len(base)] if len(base) > 1 else base
            share = boxes.volume(piece) * nbytes / t.num_elements
            chain_delta(hs, route, share, delta)
            plan_parts.append((piece, hs, holders[hs][0], route, share))
        options.append((loads.score(delta), lambda parts=plan_parts, delta=delta: _emit_stripes(
            parts, wanting, loads, delta)))
    _, emit = min(options, key=lambda o: o[0])
    return emit()


def _emit_chain(box, hs, sender, route, nbytes, wanting, loads: _Loads, delta) -> list[Transfer]:
    loads.add_send(delta)
    loads.add_path(hs, route, nbytes)
    receivers = tuple(r for h in route for r in wanting[h])
    if len(receivers) == 1:
        return [Transfer(box, sender, receivers, "p2p")]
    return [Transfer(box, sender, receivers, "broadcast", 0, tuple(route))]


def _emit_star(box, hs, sender, remote, nbytes, wanting, loads: _Loads, delta, hosts) -> list[Transfer]:
    loads.add_send(delta)
    for h in remote:
        loads.add_path(hs, (h,), nbytes)
    return [_deliver(box, sender, wanting[h], hosts) for h in remote]


def _emit_stripes(parts, wanting, loads: _Loads, delta) -> list[Transfer]:
    loads.add_send(delta)
    out = []
    for piece, hs, sender, route, nbytes in parts:
        loads.add_path(hs, route, nbytes)
        receivers = tuple(r for h in route for r in wanting[h])
        if len(receivers) == 1:
            out.append(Transfer(piece, sender, receivers, "p2p"))
        else:
            out.append(Transfer(piece, sender, receivers, "broadcast", 0, tuple(route)))
    return out


_BUILDERS = {
    "send_recv": _send_recv,
    "local_allgather": _local_allgather,
    "broadcast": _broadcast,
    "auto": _auto,
}


def plan(
    shape,
    dtype,
    src: Sharding,
    dst: Sharding,
    topology: Optional[Topology] = None,
    strategy: str = "auto",
) -> Plan:
    """Plan moving a tensor of ``shape`` and ``dtype`` from ``src`` to ``dst``.

    ``strategy`` is one of ``send_recv``, ``local_allgather``, ``broadcast`` or
    ``auto`` (the default, never worse than the others on the cost model).
    """
    if strategy not in _BUILDERS:
        raise InvalidShardingError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    for name, s in (("src", src), ("dst", dst)):
        if not isinstance(s, Sharding):
            raise InvalidShardingError(f"{name} must be a reshard.Sharding, got {type(s).__name__}")
        s.mesh.require_devices()
        if s.is_partial:
            raise InvalidShardingError(
                f"{name} {s.spec_str()} is a pending sum over axes {list(s.partial)}, but a plan only moves values, "
                f"so it would copy addends as if they were the tensor; use reshard.reshard_program, which adds the "
                f"reduce steps"
            )
    shape = dst.check_shape(src.check_shape(shape))
    dtype = dtype_name(dtype)
    topology = topology or Topology()
    size = itemsize(dtype)
    tasks = decompose(shape, src, dst)
    hosts = HostCache()
    transfers = _BUILDERS[strategy](tasks, hosts, topology, size)
    if strategy == "auto":
        transfers = _never_worse(transfers, tasks, hosts, topology, size)
    result = Plan(shape, dtype, src, dst, strategy, tuple(transfers), topology)
    result.__dict__["unit_tasks"] = tasks
    return result


def _never_worse(transfers, tasks, hosts, topology, size) -> list[Transfer]:
    """Keep auto's own plan unless a baseline is cheaper on the cost model."""
    best = estimate_seconds(transfers, size, topology)
    if best <= lower_bound_seconds(tasks, size, topology) * (1 + 1e-9):
        return transfers
    for name in BASELINES:
        other = _BUILDERS[name](tasks, hosts, topology, size)
        cost = estimate_seconds(other, size, topology)
        if cost < best * (1 - 1e-9):
            best, transfers = cost, other
    return transfers
