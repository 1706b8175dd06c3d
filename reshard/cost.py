"""The fluid cost model.

Within a phase every transfer runs at once and shares links fairly; a phase lasts
as long as its busiest link needs: a host's NIC in either direction (full
duplex), or one device's intra-host link. Phases run one after another.

What each method costs on the links, for a box of ``b`` bytes from a sender on
host ``hs``:

=========== ====================================================================
p2p         one copy per receiver: NIC ``hs`` -> NIC of the receiver's host, or
            the intra-host link when both are on ``hs``
local       a chain inside ``hs``: sender -> r1 -> r2 ... (each link carries b)
broadcast   a chain over the route's hosts: ``hs`` sends b once, every route host
            receives b once and all but the last forward it; inside each host the
            box is fanned out along a chain of that host's receivers
=========== ====================================================================

A group reduce over ``n`` members of a ``b``-byte box (`reduce_rounds`):

=========== ====================================================================
ring        every member sends to the next (the last to the first) at once:
            (n-1) rounds of b/n for ``shard`` (reduce-scatter), 2(n-1) for
            ``replicate`` (reduce-scatter then all-gather); one fluid round
chain       hops one after another, m0 -> m1 -> ... -> m(n-1), each carrying b,
            the last member adds the final addend; ``replicate`` then sends the
            result back down the chain hop by hop; ``shard`` sends each member
            its piece from the last member in one round
=========== ====================================================================

A hop between devices of one host uses the intra-host link, between hosts the NIC.

The move table is written once, as code, in `transfer_flows`: the cost model here,
the agents' progress accounting (`sender_bytes`), the planner's statistics
(`network_copies`, `host_traffic`) and the dashboard all read it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from reshard.mesh import host_of
from reshard.topology import Topology

__all__ = [
    "HostCache",
    "Flow",
    "transfer_flows",
    "sender_bytes",
    "network_copies",
    "host_traffic",
    "flow_totals",
    "reduce_rounds",
    "PhaseLoad",
    "phase_loads",
    "estimate_seconds",
    "lower_bound_seconds",
]

NIC, INTRA = "nic", "intra"


class HostCache(dict):
    """Device id -> host, parsed once per device."""

    def __missing__(self, device: str) -> str:
        h = self[device] = host_of(device)
        return h


@dataclass
class PhaseLoad:
    """Bytes on every link during one phase."""

    phase: int
    send: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recv: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dev_in: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dev_out: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def seconds(self, topology: Topology, hosts: HostCache) -> tuple[float, str]:
        """Duration of the phase and a description of its busiest link."""
        best, what = 0.0, "nothing moves"
        for direction, loads in (("send", self.send), ("receive", self.recv)):
            for h, b in loads.items():
                t = b / topology.nic_bytes_per_s(h)
                if t > best:
                    best, what = t, f"NIC {direction} of {h}"
        for direction, loads in (("in", self.dev_in), ("out", self.dev_out)):
            for d, b in loads.items():
                t = b / topology.intra_bytes_per_s(hosts[d])
                if t > best:
                    best, what = t, f"intra-host link {direction} of {d}"
        return best, what

    def add(self, flows: Iterable[Flow]) -> None:
        for f in flows:
            if f.link == NIC:
                self.send[f.src] += f.nbytes
                self.recv[f.dst] += f.nbytes
            else:
                self.dev_out[f.src] += f.nbytes
                self.dev_in[f.dst] += f.nbytes

    @property
    def network_bytes(self) -> int:
        return sum(self.recv.values())


@dataclass(frozen=True, slots=True)
class Flow:
    """Bytes one transfer puts on one link.

    ``link`` is ``"nic"`` when ``src`` and ``dst`` are hosts and the bytes cross
    the network, ``"intra"`` when they are devices of one host. ``origin`` is True
    when the transfer's sender host sends these bytes itself, False when a chain
    hop (a route host, or a receiver inside a host) forwards what it received.
    """

    src: str
    dst: str
    nbytes: int
    link: str
    origin: bool


def _box_bytes(box, itemsize: int) -> int:
    n = itemsize
    for lo, hi in box:
        n *= hi - lo
    return n


def _chain_flows(out: list[Flow], devices: list[str], nbytes: int, origin: bool) -> None:
    # Only the chain's first link leaves the device that started it; later links are forwarded.
    for i, (a, b) in enumerate(zip(devices, devices[1:])):
        out.append(Flow(a, b, nbytes, INTRA, origin and i == 0))


def transfer_flows(t, itemsize: int, hosts: HostCache | None = None) -> list[Flow]:
    """The flows of one transfer, as the module docstring's table defines them."""
    hosts = hosts if hosts is not None else HostCache()
    n = _box_bytes(t.box, itemsize)
    hs = hosts[t.sender]
    out: list[Flow] = []
    if t.method == "p2p":
        for r in t.receivers:
            hr = hosts[r]
            if hr == hs:
                out.append(Flow(t.sender, r, n, INTRA, True))
            else:
                out.append(Flow(hs, hr, n, NIC, True))
    elif t.method == "local":
        _chain_flows(out, [t.sender, *t.receivers], n, True)
    else:
        by_host: dict[str, list[str]] = defaultdict(list)
        for r in t.receivers:
            by_host[hosts[r]].append(r)
        if by_host.get(hs):
            _chain_flows(out, [t.sender, *by_host[hs]], n, True)
        prev = hs
        for h in t.route:
            out.append(Flow(prev, h, n, NIC, prev == hs))
            _chain_flows(out, by_host.get(h, []), n, False)
            prev = h
    return out


def sender_bytes(transfers: Iterable, itemsize: int, host: str, phase: int | None = None) -> int:
    """Bytes the agent of ``host`` sends as a transfer's sender (copies and first hops).

    This is what an agent's progress reports count. It is not the sum of the
    origin flows: for a local fan-out the cost model charges a chain (sender ->
    r1 -> r2 ...), but the agent writes each receiver on its own host directly
    from the sender's buffer, so it counts one copy per local receiver; a
    broadcast's route adds one first hop, whatever the route's length.
    """
    hosts = HostCache()
    total = 0
    for t in transfers:
        if hosts[t.sender] != host or (phase is not None and t.phase != phase):
            continue
        n = _box_bytes(t.box, itemsize)
        if t.method == "broadcast":
            total += n * (sum(hosts[r] == host for r in t.receivers) + (1 if t.route else 0))
        else:
            total += n * len(t.receivers)
    return total


def network_copies(t, hosts: HostCache | None = None) -> int:
    """How many times a transfer's box crosses the network (0: it stays on the sender's host)."""
    hosts = hosts if hosts is not None else HostCache()
    if t.method == "broadcast":
        return len(t.route)
    if t.method == "p2p":
        hs = hosts[t.sender]
        return sum(hosts[r] != hs for r in t.receivers)
    return 0


def flow_totals(flows: Iterable[Flow], hosts: HostCache | None = None) -> dict[str, dict[str, int]]:
    """Per host: ``bytes_out`` and ``bytes_in`` over its NIC, ``local_bytes`` between its devices."""
    hosts = hosts if hosts is not None else HostCache()
    out: dict[str, dict[str, int]] = {}

    def row(h: str) -> dict[str, int]:
        r = out.get(h)
        if r is None:
            r = out[h] = {"bytes_out": 0, "bytes_in": 0, "local_bytes": 0}
        return r

    for f in flows:
        if f.link == NIC:
            row(f.src)["bytes_out"] += f.nbytes
            row(f.dst)["bytes_in"] += f.nbytes
        else:
            row(hosts[f.src])["local_bytes"] += f.nbytes
    return out


def host_traffic(transfers: Iterable, itemsize: int, hosts: HostCache | None = None) -> dict[str, dict[str, int]]:
    """`flow_totals` of every flow of ``transfers``."""
    hosts = hosts if hosts is not None else HostCache()
    return flow_totals((f for t in transfers for f in transfer_flows(t, itemsize, hosts)), hosts)


def _hop(a: str, b: str, nbytes: int, hosts: HostCache, origin: bool) -> Flow:
    ha, hb = hosts[a], hosts[b]
    if ha == hb:
        return Flow(a, b, nbytes, INTRA, origin)
    return Flow(ha, hb, nbytes, NIC, origin)


def reduce_rounds(devices, nbytes: int, result: str, algorithm: str,
                  hosts: HostCache | None = None) -> list[list[Flow]]:
    """The rounds of a group reduce, as the module docstring's table defines them.

    Flows of one round share links at once (the fluid model); rounds run one
    after another. A ring's pieces are b/n bytes rounded down. ``origin`` marks
    the bytes a member sends of its own addend, the first hop of a chain.
    """
    hosts = hosts if hosts is not None else HostCache()
    devices = list(devices)
    n = len(devices)
    if n < 2:
        return []
    if algorithm == "ring":
        steps = (n - 1) * (2 if result == "replicate" else 1)
        per_member = steps * nbytes // n
        return [[_hop(a, b, per_member, hosts, True) for a, b in zip(devices, devices[1:] + devices[:1])]]
    rounds = [[_hop(a, b, nbytes, hosts, i == 0)] for i, (a, b) in enumerate(zip(devices, devices[1:]))]
    last = devices[-1]
    if result == "replicate":
        back = devices[::-1]
        rounds += [[_hop(a, b, nbytes, hosts, False)] for a, b in zip(back, back[1:])]
    else:
        piece = nbytes // n
        rounds.append([_hop(last, d, piece, hosts, False) for d in devices[:-1]])
    return rounds


def phase_loads(transfers: Iterable, itemsize: int, hosts: HostCache | None = None) -> list[PhaseLoad]:
    """Per phase, the bytes each NIC direction and each intra-host link carries (the flows, added up)."""
    hosts = hosts if hosts is not None else HostCache()
    phases: dict[int, PhaseLoad] = {}
    for t in transfers:
        load = phases.get(t.phase)
        if load is None:
            load = phases[t.phase] = PhaseLoad(t.phase)
        load.add(transfer_flows(t, itemsize, hosts))
    return [phases[p] for p in sorted(phases)]


def estimate_seconds(transfers: Iterable, itemsize: int, topology: Topology) -> float:
    hosts = HostCache()
    return sum(p.seconds(topology, hosts)[0] for p in phase_loads(transfers, itemsize, hosts))


def lower_bound_seconds(tasks: Iterable, itemsize: int, topology: Topology) -> float:
    """What no plan can beat.

    A host must receive every byte its devices need and no device of it holds;
    a byte that only one host holds must leave that host at least once if any
    other host needs it; and all needed bytes together must leave their holders
    through the holders' NICs combined.
    """
    hosts = HostCache()
    need: dict[str, int] = defaultdict(int)
    sole: dict[str, int] = defaultdict(int)
    leaving = 0
    sources: set[str] = set()
    for task in tasks:
        n = task.num_elements * itemsize
        holders = {hosts[d] for d in task.senders}
        wanting = {hosts[d] for d in task.receivers} - holders
        for h in wanting:
            need[h] += n
        if wanting:
            leaving += n
            sources |= holders
            if len(holders) == 1:
                sole[next(iter(holders))] += n
    best = 0.0
    for loads in (need, sole):
        for h, b in loads.items():
            best = max(best, b / topology.nic_bytes_per_s(h))
    if sources:
        # Every needed byte leaves one of its holders at least once, and all holders together
        # send no faster than their NICs added up.
        best = max(best, leaving / sum(topology.nic_bytes_per_s(h) for h in sources))
    return best
