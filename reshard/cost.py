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

Who sends the box to whom is `reshard.routes` (its copies and hops); the move table
turns them into flows once, as code, in `transfer_flows`: the cost model here, the
agents' progress accounting (`sender_bytes`), the planner's statistics
(`network_copies`, `host_traffic`) and the dashboard all read it. Plans of many
transfers keep them as columns (`reshard.plans.TransferTable`); `table_phase_loads`
adds up the same flows on the columns with numpy, and `lower_bound_seconds` reads
columnar unit tasks (`reshard.tasks.UnitTasks`) the same way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from reshard import box as boxes
from reshard.mesh import host_of
from reshard.routes import HostCache, home_receivers, hops
from reshard.tasks import UnitTasks
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
    "move_phase_loads",
    "table_phase_loads",
    "phase_seconds",
    "estimate_seconds",
    "lower_bound_seconds",
    "host_needs",
    "COLUMNS_FROM",
]

NIC, INTRA = "nic", "intra"

# From this many transfers or unit tasks, figures are computed on columns; below, the fixed cost of the numpy
# calls is more than the per-item loop they save.
COLUMNS_FROM = 2048

# Method codes of `reshard.plans.TransferTable`: positions in `reshard.plans.METHODS`.
_P2P, _BROADCAST, _LOCAL = range(3)


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
        nic: dict[str, float] = {}
        for direction, loads in (("send", self.send), ("receive", self.recv)):
            for h, b in loads.items():
                bw = nic.get(h)
                if bw is None:
                    bw = nic[h] = topology.nic_bytes_per_s(h)
                t = b / bw
                if t > best:
                    best, what = t, f"NIC {direction} of {h}"
        intra: dict[str, float] = {}
        for direction, loads in (("in", self.dev_in), ("out", self.dev_out)):
            for d, b in loads.items():
                h = hosts[d]
                bw = intra.get(h)
                if bw is None:
                    bw = intra[h] = topology.intra_bytes_per_s(h)
                t = b / bw
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


def _chain_links(out: list[tuple], devices: list[str], origin: bool) -> None:
    # Only the chain's first link leaves the device that started it; later links are forwarded.
    for i, (a, b) in enumerate(zip(devices, devices[1:])):
        out.append((a, b, INTRA, origin and i == 0))


def _links(t, hosts: HostCache) -> list[tuple[str, str, str, bool]]:
    """The flows of one transfer but their bytes, as (src, dst, link, origin): `transfer_flows` less a `Flow`
    each, for `move_phase_loads`, which gives a group of like transfers' flows their bytes at once."""
    out: list[tuple[str, str, str, bool]] = []
    home = home_receivers(t, hosts)
    if t.method == "p2p":  # every copy straight from the sender
        out += [(t.sender, r, INTRA, True) for r in home]
    elif home:
        _chain_links(out, [t.sender, *home], True)
    for h in hops(t, hosts):
        out.append((h.src, h.dst, NIC, h.origin))
        if len(h.receivers) > 1:
            _chain_links(out, h.receivers, False)
    return out


def transfer_flows(t, itemsize: int, hosts: HostCache | None = None) -> list[Flow]:
    """The flows of one transfer, as the module docstring's table defines them: its copies on the sender's host
    and its hops (`reshard.routes`), a hop's receivers fanned out along a chain on the host it reaches."""
    n = _box_bytes(t.box, itemsize)
    links = _links(t, hosts if hosts is not None else HostCache())
    return [Flow(src, dst, n, link, origin) for src, dst, link, origin in links]


def sender_bytes(transfers: Iterable, itemsize: int, host: str, phase: int | None = None) -> int:
    """Bytes the agent of ``host`` sends as a transfer's sender: its copies and the hops it streams itself.

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
        copies = len(home_receivers(t, hosts)) + sum(h.origin for h in hops(t, hosts))
        total += _box_bytes(t.box, itemsize) * copies
    return total


def network_copies(t, hosts: HostCache | None = None) -> int:
    """How many times a transfer's box crosses the network (0: it stays on the sender's host): its hops."""
    return len(hops(t, hosts))


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
    return move_phase_loads(((t.phase, t, itemsize) for t in transfers), hosts)


def move_phase_loads(moves: Iterable[tuple[int, object, int]], hosts: HostCache | None = None) -> list[PhaseLoad]:
    """`phase_loads` of (phase, transfer, itemsize) triples, whose itemsizes may differ (a program's tensors).

    A transfer's flows depend on its sender, receivers, method and route, not on its box: transfers alike in
    those share their flows, so their bytes are added up first (Python ints, exact) and the group's flows made
    once, where a state dict's plan would make a `Flow` per link of each of its million transfers. The loads are
    `transfer_flows`' added up, int for int, and each link enters its load's dicts in the same order (a group
    comes in at its first transfer, which is where its links first appear), so ties between links name the same
    busiest one.
    """
    hosts = hosts if hosts is not None else HostCache()
    groups: dict[tuple, list] = {}
    get = groups.get
    for phase, t, itemsize in moves:
        n = itemsize
        for lo, hi in t.box:
            n *= hi - lo
        key = (phase, t.sender, t.receivers, t.method, t.route)
        g = get(key)
        if g is None:
            groups[key] = [t, n]
        else:
            g[1] += n
    phases: dict[int, PhaseLoad] = {}
    for (phase, *_), (t, n) in groups.items():
        load = phases.get(phase)
        if load is None:
            load = phases[phase] = PhaseLoad(phase)
        for src, dst, link, _ in _links(t, hosts):
            if link == NIC:
                load.send[src] += n
                load.recv[dst] += n
            else:
                load.dev_out[src] += n
                load.dev_in[dst] += n
    return [phases[p] for p in sorted(phases)]


def _sums(index: np.ndarray, weights: np.ndarray, size: int) -> np.ndarray:
    """Per index, the sum of its weights, exactly: in int64 where the weights are int64 and their total fits a
    double's 53-bit mantissa (as bincount adds them), else added one by one (Python ints in an object array)."""
    if weights.dtype != object and (not len(weights) or float(weights.sum(dtype=float)) < 2**53):
        return np.bincount(index, weights, minlength=size).astype(np.int64)
    out = np.zeros(size, dtype=object)
    np.add.at(out, index, weights.astype(object))
    return out


def table_phase_loads(table, itemsize: int) -> list[PhaseLoad]:
    """`phase_loads` of a `reshard.plans.TransferTable`, added up on its columns: the flows of `transfer_flows`,
    for any table (a route that misses a receiver's host, or names one twice, counts as `transfer_flows` counts
    it). A flow is numbered by the link end it loads: host ``h``'s NIC is ``h``, device ``d``'s intra-host link
    is ``num_hosts + d``."""
    n = len(table)
    host = table.space.device_host
    num_hosts, num_devices = len(table.space.hosts), len(table.space.devices)
    nbytes = boxes.volumes(table.lo, table.hi, itemsize)
    route_len = np.diff(table.route_ptr)
    if n and nbytes.dtype != object:
        flows = np.diff(table.recv_ptr) + route_len + 1
        if float(nbytes.astype(float) @ flows) * (int(route_len.max()) + 1) >= 2**53:
            nbytes = nbytes.astype(object)  # sums that could pass a double's mantissa are kept as Python ints
    one_each = len(table.recv) == n and bool((np.diff(table.recv_ptr) == 1).all())
    t_of = np.arange(n) if one_each else np.repeat(np.arange(n), np.diff(table.recv_ptr))
    r, s = table.recv, table.sender
    ts = s if one_each else s[t_of]
    rh, ths = host[r], host[ts]
    m = table.method if one_each else table.method[t_of]
    parts = []  # (transfer, out link, in link, bytes)

    # p2p: one copy per receiver, over the NICs or inside the host; local: a chain sender -> r1 -> r2 ...
    plain = m != _BROADCAST
    nic = (m == _P2P) & (rh != ths)
    prev = ts
    if not one_each and (m == _LOCAL).any():
        e = np.arange(len(r))
        chained = (m == _LOCAL) & (e != table.recv_ptr[t_of])
        prev = np.where(chained, r[np.maximum(e - 1, 0)], ts)
    out_link = np.where(nic, ths, num_hosts + prev)
    in_link = np.where(nic, rh, num_hosts + r)
    weight = nbytes if one_each else nbytes[t_of]
    if plain.all():
        parts.append((t_of, out_link, in_link, weight))
    else:
        parts.append((t_of[plain], out_link[plain], in_link[plain], weight[plain]))
        parts.extend(_broadcast_flows(table, t_of, m, rh, ths, nbytes, num_hosts))

    t = np.concatenate([p[0] for p in parts])
    out_link = np.concatenate([p[1] for p in parts])
    in_link = np.concatenate([p[2] for p in parts])
    weight = np.concatenate([p[3] for p in parts])
    links = num_hosts + num_devices
    if n and table.phase.min() == table.phase.max():
        phases = table.phase[:1].tolist()
    else:
        phases, phase_of = np.unique(table.phase, return_inverse=True)
        phases = phases.tolist()
        out_link = out_link + phase_of.reshape(-1)[t] * links
        in_link = in_link + phase_of.reshape(-1)[t] * links
    size = len(phases) * links
    sent, received = _sums(out_link, weight, size), _sums(in_link, weight, size)
    sending, receiving = np.bincount(out_link, minlength=size), np.bincount(in_link, minlength=size)
    hosts, devices = table.space.hosts, table.space.devices
    out = []
    for i, phase in enumerate(phases):
        load = PhaseLoad(phase)
        for values, present, nic_side, intra_side in ((sent, sending, load.send, load.dev_out),
                                                       (received, receiving, load.recv, load.dev_in)):
            base = i * links
            for j in np.flatnonzero(present[base:base + links]).tolist():
                if j < num_hosts:
                    nic_side[hosts[j]] = int(values[base + j])
                else:
                    intra_side[devices[j - num_hosts]] = int(values[base + j])
        out.append(load)
    return out


def _broadcast_flows(table, t_of, m, rh, ths, nbytes, num_hosts) -> list[tuple]:
    """The flows of the broadcasts of a table, as `table_phase_loads` numbers them: each host's receivers chained
    in their order (the sender first on its own host), once for the sender's host and once per time the route
    names the host; the route hop by hop over the NICs."""
    n = len(table)
    r = table.recv
    q_of = np.repeat(np.arange(n), np.diff(table.route_ptr))
    hop = np.flatnonzero(table.method[q_of] == _BROADCAST)
    codes, times = np.unique(q_of[hop] * num_hosts + table.route[hop], return_counts=True)
    e = np.flatnonzero(m == _BROADCAST)
    key = t_of[e] * num_hosts + rh[e]
    order = np.argsort(key, kind="stable")
    e, key = e[order], key[order]
    first = np.ones(len(e), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    routed = np.zeros(len(e), dtype=np.int64)
    if len(codes):
        at = np.minimum(np.searchsorted(codes, key), len(codes) - 1)
        hit = codes[at] == key
        routed[hit] = times[at[hit]]
    home = rh[e] == ths[e]
    times_chained = routed + home
    link = ~first & (times_chained > 0)
    prev = np.empty(len(e), dtype=np.int64)
    prev[1:] = r[e[:-1]]
    start = first & home
    hs = table.space.device_host[table.sender]
    from_host = np.where(hop == table.route_ptr[q_of[hop]], hs[q_of[hop]], table.route[np.maximum(hop - 1, 0)])
    return [
        (t_of[e[link]], num_hosts + prev[link], num_hosts + r[e[link]], nbytes[t_of[e[link]]] * times_chained[link]),
        (t_of[e[start]], num_hosts + table.sender[t_of[e[start]]], num_hosts + r[e[start]], nbytes[t_of[e[start]]]),
        (q_of[hop], from_host, table.route[hop], nbytes[q_of[hop]]),
    ]


def phase_seconds(loads: Iterable[PhaseLoad], topology: Topology, hosts: HostCache | None = None) -> float:
    """Seconds on the fluid model of the given phase loads: per phase the busiest link, phases added."""
    hosts = hosts if hosts is not None else HostCache()
    return sum(p.seconds(topology, hosts)[0] for p in loads)


def estimate_seconds(transfers: Iterable, itemsize: int, topology: Topology, hosts: HostCache | None = None) -> float:
    hosts = hosts if hosts is not None else HostCache()
    return sum(p.seconds(topology, hosts)[0] for p in phase_loads(transfers, itemsize, hosts))


def lower_bound_seconds(tasks: Iterable, itemsize: int, topology: Topology, hosts: HostCache | None = None) -> float:
    """What no plan can beat.

    A host must receive every byte its devices need and no device of it holds;
    a byte that only one host holds must leave that host at least once if any
    other host needs it; and all needed bytes together must leave their holders
    through the holders' NICs combined.
    """
    if isinstance(tasks, UnitTasks) and len(tasks) >= COLUMNS_FROM:
        return _columns_lower_bound(tasks, itemsize, topology)
    need, sole, leaving, sources = _needs(tasks, itemsize, hosts if hosts is not None else HostCache())
    best = 0.0
    rate: dict[str, float] = {}
    for loads in (need, sole):
        for h, b in loads.items():
            if h not in rate:
                rate[h] = topology.nic_bytes_per_s(h)
            best = max(best, b / rate[h])
    if sources:
        # Every needed byte leaves one of its holders at least once, and all holders together
        # send no faster than their NICs added up.
        best = max(best, leaving / sum(rate.get(h) or topology.nic_bytes_per_s(h) for h in sources))
    return best


def host_needs(tasks: Iterable, itemsize: int, hosts: HostCache | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """The bytes each host must receive (its devices need them and none of its devices holds them), and the bytes
    each host must send, the only holder of a box another host needs: by which `lower_bound_seconds` bounds a
    plan, one host at a time."""
    if isinstance(tasks, UnitTasks) and len(tasks) >= COLUMNS_FROM:
        names, need, sole, *_ = _columns_needs(tasks, itemsize)
        return tuple({names[i]: int(loads[i]) for i in np.flatnonzero(loads).tolist()} for loads in (need, sole))
    need, sole, _, _ = _needs(tasks, itemsize, hosts if hosts is not None else HostCache())
    return dict(need), dict(sole)


def _needs(tasks: Iterable, itemsize: int, hosts: HostCache) -> tuple[dict, dict, int, set[str]]:
    """`host_needs`' two tables one task at a time, and the bytes that leave their holders with those holders."""
    need: dict[str, int] = defaultdict(int)
    sole: dict[str, int] = defaultdict(int)
    leaving = 0
    sources: set[str] = set()
    for n, holders, wanting in _host_sets(tasks, hosts):
        n *= itemsize
        for h in wanting:
            need[h] += n
        if wanting:
            leaving += n
            sources |= holders
            if len(holders) == 1:
                sole[next(iter(holders))] += n
    return need, sole, leaving, sources


def _host_sets(tasks: Iterable, hosts: HostCache):
    """Per task: its element count, the hosts holding its box, the other hosts wanting it. Columnar tasks name
    a few groups of devices many times; their host sets are made once per group."""
    if not isinstance(tasks, UnitTasks):
        for task in tasks:
            holders = {hosts[d] for d in task.senders}
            yield task.num_elements, holders, {hosts[d] for d in task.receivers} - holders
        return
    holder_sets = [{hosts[d] for d in g} for g in tasks.senders]
    wanted_sets = [{hosts[d] for d in g} for g in tasks.receivers]
    wanting: dict[tuple[int, int], set[str]] = {}
    for n, g, q in zip(tasks.num_elements.tolist(), tasks.sender_group.tolist(), tasks.receiver_group.tolist()):
        w = wanting.get((g, q))
        if w is None:
            w = wanting[g, q] = wanted_sets[q] - holder_sets[g]
        yield n, holder_sets[g], w


def _columns_lower_bound(tasks: UnitTasks, itemsize: int, topology: Topology) -> float:
    """`lower_bound_seconds` on columns: a task's holder hosts are its sender group's, its wanting hosts its
    receiver group's hosts less those."""
    names, need, sole, leaves, holds, g, nbytes = _columns_needs(tasks, itemsize)
    bw = [topology.nic_bytes_per_s(name) for name in names]
    best = 0.0
    for loads in (need, sole):
        for i in np.flatnonzero(loads).tolist():
            best = max(best, int(loads[i]) / bw[i])
    if leaves.any():
        sources = holds[np.unique(g[leaves])].any(axis=0)
        leaving = int(nbytes[leaves].sum()) if nbytes.dtype != object else sum(nbytes[leaves].tolist())
        best = max(best, leaving / sum(bw[i] for i in np.flatnonzero(sources).tolist()))
    return best


def _columns_needs(tasks: UnitTasks, itemsize: int) -> tuple:
    """`host_needs` on columns, by host number: (host names, bytes each must receive, bytes each must send as the
    only holder), and for `_columns_lower_bound` which tasks leave their holders, the holder hosts of each sender
    group, each task's sender group and its bytes."""
    host_ids: dict[str, int] = {}
    holder_hosts = [{host_ids.setdefault(host_of(d), len(host_ids)) for d in group} for group in tasks.senders]
    wanted = [list(dict.fromkeys(host_ids.setdefault(host_of(d), len(host_ids)) for d in group))
              for group in tasks.receivers]
    num_hosts = len(host_ids)
    holds = np.zeros((len(holder_hosts), num_hosts), dtype=bool)
    for g, hs in enumerate(holder_hosts):
        holds[g, list(hs)] = True
    per_group = np.array([len(w) for w in wanted], dtype=np.int64)
    group_start = np.zeros(len(wanted), dtype=np.int64)
    np.cumsum(per_group[:-1], out=group_start[1:])
    flat = np.array([h for w in wanted for h in w], dtype=np.int64)
    q, g = tasks.receiver_group, tasks.sender_group
    count = per_group[q]
    t_of = np.repeat(np.arange(len(tasks)), count)
    offset = np.arange(len(t_of)) - np.repeat(np.cumsum(count) - count, count)
    h = flat[group_start[q][t_of] + offset]
    wanting = ~holds[g[t_of], h]
    nbytes = tasks.num_elements * itemsize
    if nbytes.dtype != object and float(nbytes.astype(float) @ count) >= 2**61:
        nbytes = nbytes.astype(object)
    need = _sums(h[wanting], nbytes[t_of[wanting]], num_hosts)
    leaves = np.zeros(len(tasks), dtype=bool)
    leaves[t_of[wanting]] = True
    sole_host = np.where(holds.sum(axis=1) == 1, holds.argmax(axis=1), -1)[g]
    alone = leaves & (sole_host >= 0)
    sole = _sums(sole_host[alone], nbytes[alone], num_hosts)
    return list(host_ids), need, sole, leaves, holds, g, nbytes
