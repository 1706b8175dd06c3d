"""Who sends which box to whom in a transfer: each move method's copies and hops, stated once.

A transfer (``reshard.plans.Transfer``) of ``box`` from ``sender`` on host ``hs`` is, by method:

=========== ==========================================================================
p2p         the sender copies the box into each receiver on ``hs``; hop ``i`` streams it
            from ``hs`` to receiver ``i`` when that receiver is on another host
local       the sender copies the box into every receiver (all on ``hs``); no hop
broadcast   the sender copies the box into the receivers on ``hs``; hop ``i`` streams it
            from the route's previous host (``hs`` for hop 0) to ``route[i]``, whose
            receivers keep it and which forwards it to ``route[i + 1]``
=========== ==========================================================================

A hop is one stream over the network, numbered within its transfer: hop numbers run
over the receivers (p2p) or the route (broadcast), and agents key the hop's stream by
its number. `home_receivers` and `hops` are that table as code; everything else here
is read from them, and so are the cost model (``reshard.cost.transfer_flows``,
``sender_bytes``, ``network_copies``), the agents' task graph and every transport.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from reshard.mesh import host_of

if TYPE_CHECKING:
    from reshard.plans import Transfer

__all__ = [
    "HostCache", "Hop", "home_receivers", "hops", "find_hop", "first_peer", "receiving_hops", "hop_targets",
    "sending_peers", "stream_count", "PairStreams", "interleaved",
]


class HostCache(dict):
    """Device id -> host, parsed once per device."""

    def __missing__(self, device: str) -> str:
        h = self[device] = host_of(device)
        return h


class Hop(NamedTuple):
    """One stream of a transfer's box over the network, as the module docstring's table defines it."""

    index: int  # its number within the transfer: the receiver's index (p2p) or the route's (broadcast)
    src: str  # the host that sends it
    dst: str  # the host it arrives at
    receivers: tuple[str, ...]  # the devices of ``dst`` that keep the box
    forward_to: str | None  # the host ``dst`` forwards the box to, None where the chain ends
    origin: bool  # the transfer's sender streams it itself; False: a route host forwards what it received


def home_receivers(t: Transfer, hosts: HostCache | None = None) -> tuple[str, ...]:
    """The receivers the sender copies the box into on its own host."""
    if t.method == "local":
        return t.receivers
    host = hosts.__getitem__ if hosts is not None else host_of
    hs = host(t.sender)
    return tuple([r for r in t.receivers if host(r) == hs])


def hops(t: Transfer, hosts: HostCache | None = None) -> Sequence[Hop]:
    """The hops of ``t`` in the order of their numbers (none for a local transfer), worked out once per distinct
    (sender, method, receivers, route): an agent asks for the hops of each of its moves several times over (its
    tasks, their peers, the streams), and a state dict's moves share a few thousand routes."""
    key = (t.sender, t.method, t.receivers, t.route)
    try:
        known = _HOPS.get(key)
    except TypeError:  # a transfer built with lists: worked out each time
        return _hops(t, hosts)
    if known is None:
        if len(_HOPS) >= _HOPS_KEPT:
            _HOPS.clear()
        known = _HOPS[key] = tuple(_hops(t, hosts))
    return known


_HOPS: dict[tuple, tuple[Hop, ...]] = {}
_HOPS_KEPT = 1 << 16


def _hops(t: Transfer, hosts: HostCache | None) -> list[Hop]:
    host = hosts.__getitem__ if hosts is not None else host_of
    hs = host(t.sender)
    if t.method == "p2p":
        return [Hop(i, hs, h, (r,), None, True) for i, r in enumerate(t.receivers) if (h := host(r)) != hs]
    route = t.route
    if t.method != "broadcast" or not route:
        return []
    if len(route) == 1:  # most broadcasts (one host's receivers): no grouping needed
        h = route[0]
        return [Hop(0, hs, h, tuple([r for r in t.receivers if host(r) == h]), None, True)]
    by_host: dict[str, list[str]] = defaultdict(list)
    for r in t.receivers:
        by_host[host(r)].append(r)
    last = len(route) - 1
    out = []
    prev = hs
    for i, h in enumerate(route):
        out.append(Hop(i, prev, h, tuple(by_host.get(h, ())), route[i + 1] if i < last else None, i == 0))
        prev = h
    return out


def find_hop(t: Transfer, index: int) -> Hop | None:
    """Hop number ``index`` of ``t``, or None where ``t`` has none of that number."""
    return next((h for h in hops(t) if h.index == index), None)


def first_peer(t: Transfer) -> str:
    """The host a transfer's sender streams to first ('' when it stays on the sender's host)."""
    first = hops(t)
    return first[0].dst if first else ""


def receiving_hops(t: Transfer, host: str) -> list[int]:
    """The numbers of the hops of ``t`` that deliver to ``host`` over the network."""
    return [h.index for h in hops(t) if h.dst == host]


def hop_targets(t: Transfer, index: int, host: str) -> tuple[list[str], str | None, str] | None:
    """For hop ``index`` of ``t`` arriving at ``host``: (its receivers on ``host``, the host it forwards to or None,
    the host it comes from); None when that hop does not deliver to ``host``."""
    h = find_hop(t, index)
    if h is None or h.dst != host:
        return None
    return list(h.receivers), h.forward_to, h.src


def sending_peers(t: Transfer, host: str) -> set[str]:
    """The hosts ``host`` streams to as the sender of ``t``."""
    return {h.dst for h in hops(t) if h.origin and h.src == host}


def stream_count(kind: str, transfer: Transfer | None = None, group_size: int = 0) -> int:
    """How many stream numbers a step may use: a move's hop numbers (its receivers for p2p, its route for a
    broadcast), or a reduce's ring messages (numbered ``round * group_size + sender``, over up to
    ``2 * (group_size - 1)`` rounds)."""
    if kind == "move":
        return len(transfer.receivers) if transfer.method == "p2p" else len(transfer.route)
    if kind == "reduce":
        return 2 * group_size * (group_size - 1)
    return 0


class PairStreams:
    """A job's streams numbered anew between each ordered pair of hosts, from the job-wide numbers (`stream_count`:
    a step's first number plus its hop or ring message): the streams from host a to host b, in the order of their
    job-wide numbers, are 0, 1, 2, ... A transport whose messages carry few bits for the stream (gloo's tags) needs
    them unique only between the two hosts of a call, and a trillion-parameter state dict's program numbers
    millions of streams in all but thousands between any two hosts.

    ``steps`` are the steps ``host`` takes part in (each once or more: an agent's tasks; a bucket is its first
    step, carrying the bucket's transfer), ``first(step id)`` their first job-wide numbers. Both hosts of a pair
    take part in every step that streams between them, so each numbers the pair's streams alike from its own
    steps. Worked out on first use (`number`, `widest`), once per program: an agent keeps it with the program.
    """

    _SHIFT = 40  # a key is pair index << _SHIFT | job-wide number

    def __init__(self, host: str, steps: Iterable, first: Callable[[int], int]):
        self.host = host
        self._steps, self._first = steps, first
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, str], int] | None = None
        self._keys = self._ordinals = np.empty(0, dtype=np.int64)
        self._widest: tuple[int, tuple[str, str] | None] = (0, None)

    def number(self, src: str, dst: str, stream: int) -> int:
        """The number of job-wide stream ``stream`` among the streams from host ``src`` to host ``dst``."""
        self._build()
        k = self._pairs.get((src, dst))
        key = -1 if k is None else (k << self._SHIFT) | stream
        at = int(np.searchsorted(self._keys, key))
        if k is None or at == len(self._keys) or int(self._keys[at]) != key:
            raise KeyError(f"host {self.host} takes part in no stream {stream} from {src} to {dst} of this program")
        return int(self._ordinals[at])

    def widest(self) -> tuple[int, tuple[str, str] | None]:
        """The most streams between one ordered pair of hosts, and that pair (None where there are none)."""
        self._build()
        return self._widest

    def _build(self) -> None:
        with self._lock:
            if self._pairs is not None:
                return
            pairs: dict[tuple[str, str], int] = {}
            keys: list[int] = []
            host, shift, seen = self.host, self._SHIFT, set()
            for step in self._steps:
                if step.id in seen:
                    continue
                seen.add(step.id)
                base = self._first(step.id)
                if step.kind == "move":
                    for h in hops(step.transfer):
                        if h.src == host or h.dst == host:
                            k = pairs.setdefault((h.src, h.dst), len(pairs))
                            keys.append((k << shift) | (base + h.index))
                elif step.kind == "reduce":  # ring message round * n + i goes from member i to member i + 1
                    members = [host_of(d) for d in step.devices]
                    n = len(members)
                    for i, a in enumerate(members):
                        b = members[(i + 1) % n]
                        if a != b and host in (a, b):
                            k = pairs.setdefault((a, b), len(pairs))
                            keys += [(k << shift) | (base + rnd * n + i) for rnd in range(2 * (n - 1))]
            sorted_keys = np.unique(np.array(keys, dtype=np.int64))
            pair = sorted_keys >> shift
            starts = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]]) if len(pair) else np.empty(0, np.int64)
            sizes = np.diff(np.r_[starts, len(pair)])
            self._keys = sorted_keys
            self._ordinals = np.arange(len(pair), dtype=np.int64) - np.repeat(starts, sizes)
            if len(sizes):
                widest = int(np.argmax(sizes))
                names = {k: p for p, k in pairs.items()}
                self._widest = (int(sizes[widest]), names[int(pair[starts[widest]])])
            self._steps = ()  # not kept: the numbering is all a job asks for
            self._pairs = pairs


def interleaved(transfers: list[tuple[int, Transfer]]) -> list[tuple[int, Transfer]]:
    """Round-robin over (sender host, destination host) pairs, so the transfers running at
    once (pools are bounded) share every NIC, as the cost model assumes, instead of all
    going to one host while the others idle. Plans list transfers grouped by destination.
    The order depends on the transfers alone, so every host computes the same one."""
    by_peer: dict[tuple[str, str], list[tuple[int, Transfer]]] = defaultdict(list)
    for it in transfers:
        by_peer[host_of(it[1].sender), first_peer(it[1])].append(it)
    queues = list(by_peer.values())
    out = []
    for k in range(max(map(len, queues), default=0)):
        out += [q[k] for q in queues if k < len(q)]
    return out
