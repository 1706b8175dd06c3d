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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from reshard.mesh import host_of
from reshard.topology import Topology

__all__ = ["HostCache", "PhaseLoad", "phase_loads", "estimate_seconds", "lower_bound_seconds"]


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

    @property
    def network_bytes(self) -> int:
        return sum(self.recv.values())


def _chain(load: PhaseLoad, devices: list[str], nbytes: int) -> None:
    for a, b in zip(devices, devices[1:]):
        load.dev_out[a] += nbytes
        load.dev_in[b] += nbytes


def phase_loads(transfers: Iterable, itemsize: int, hosts: HostCache | None = None) -> list[PhaseLoad]:
    """Per phase, the bytes each NIC direction and each intra-host link carries."""
    hosts = hosts if hosts is not None else HostCache()
    phases: dict[int, PhaseLoad] = {}
    for t in transfers:
        load = phases.get(t.phase)
        if load is None:
            load = phases[t.phase] = PhaseLoad(t.phase)
        n = itemsize
        for lo, hi in t.box:
            n *= hi - lo
        hs = hosts[t.sender]
        if t.method == "p2p":
            for r in t.receivers:
                hr = hosts[r]
                if hr == hs:
                    load.dev_out[t.sender] += n
                    load.dev_in[r] += n
                else:
                    load.send[hs] += n
                    load.recv[hr] += n
        elif t.method == "local":
            _chain(load, [t.sender, *t.receivers], n)
        else:
            by_host: dict[str, list[str]] = defaultdict(list)
            for r in t.receivers:
                by_host[hosts[r]].append(r)
            if by_host.get(hs):
                _chain(load, [t.sender, *by_host[hs]], n)
            if t.route:
                load.send[hs] += n
                for i, h in enumerate(t.route):
                    load.recv[h] += n
                    if i + 1 < len(t.route):
                        load.send[h] += n
                    _chain(load, by_host.get(h, []), n)
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
