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
                  idle as possible (a star over a chain where neither takes a NIC
                  past the floor of the whole, `Loads.set_floor`, and the star's
                  sender is on another machine, `Topology.apart`), point-to-point
                  where a broadcast buys nothing; and never worse on the cost model
                  than any other strategy
================= ==============================================================

Unit tasks come as columns (`reshard.tasks.UnitTasks`). `auto` assigns them one by
one, largest first, except the run of tasks at the end of that order that have one
sender and one receiver each: nothing is chosen for those, so they become transfer
columns in one numpy pass (the all-to-all of a large reshard is all such tasks).

`Loads` is the greedy's record of what the transfers chosen so far put on each
NIC. `plan(..., loads=...)` plans against a given record and adds to it, so that
the reshards of a whole state dict planned one after another balance each other.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import lru_cache, reduce
from itertools import chain, permutations, repeat
from operator import add
from typing import Callable, Optional, Union

import numpy as np

from reshard import box as boxes
from reshard.cost import (
    COLUMNS_FROM,
    HostCache,
    estimate_seconds,
    host_needs,
    lower_bound_seconds,
    phase_seconds,
    table_phase_loads,
)
from reshard.dtypes import dtype_name, itemsize
from reshard.errors import InvalidShardingError, InvalidTopologyError
from reshard.plans import LOCAL, P2P, DeviceSpace, Plan, Transfer, TransferTable, device_space
from reshard.sharding import Sharding
from reshard.tasks import UnitTask, UnitTasks, decompose
from reshard.topology import Topology

__all__ = ["plan", "Loads", "STRATEGIES", "BASELINES", "MAX_STRIPES", "STRIPE_MIN_S", "chain_route_steps"]

BASELINES = ("send_recv", "local_allgather", "broadcast")
STRATEGIES = (*BASELINES, "auto")

# Stripe one unit task over at most this many replica hosts,
MAX_STRIPES = 4
# A step's fixed cost: one more step in the program, to plan, check, write out, read on every agent it names,
# pack into a bucket and run (tens of microseconds of CPU in all), which a box of a few kilobytes does not win back
# in NIC time. A box its least loaded holder moves in less than this is small: its options are ranked by the peak
# NIC load they leave, then by their steps (a chain is one, a star one per receiving host), then by the sum of
# squares, so it goes as a chain wherever a chain keeps the busiest NIC where a star would. On 10 Gbit/s NICs,
# boxes under 62.5 KB; on a GPU host's 8 x 400 Gbit/s, under 20 MB. A small box's chain takes `_long_routes`'
# route, found in time linear in its hosts (`_chain_order`'s search costs more than the box's NIC time is worth).
STEP_S = 50e-6
# Stripe only where each stripe keeps its sender's NIC busy at least a step's cost. On 10 Gbit/s NICs, stripes
# of 62.5 KB and up.
STRIPE_MIN_S = STEP_S
# Order a chain's forwarding hosts by trying every order up to this many of them, greedily beyond.
_EXHAUSTIVE_ROUTE = 4
# Chains over more than this many hosts are routed by `_long_routes`, in time linear in their hosts: the search of
# `_chain_order` grows with the cube of them (a nearest-neighbour walk for each host tied for last).
_GREEDY_ROUTE = 16
# `_long_routes` tries this many strides.
_STRIDES = 4
# A shorter run of one-to-one tasks at the end of auto's order is cheaper in the loop than in numpy.
_BULK_FROM = 256
# `Loads.task_rows` keeps the rows of a layout of at most this many tasks walked one by one: a row is a few hundred
# bytes, and a large reshard (a million deliveries) would hold them all while its state dict is planned.
_KEEP_ROWS = 16384


def chain_route_steps(num_hosts: int, exactly: bool = False) -> int:
    """The most route steps ``auto`` takes to route one chain, for one sender, over ``num_hosts`` receiving
    hosts: `_chain_order`'s greedy walk from each candidate last host for up to `_GREEDY_ROUTE` of them (the cube
    of their number), `_long_routes`' strided routes beyond (linear). Hosts that hold the tile already are not
    routed to, so where two meshes share hosts a chain may be shorter than ``num_hosts``: unless ``exactly``, the
    bound covers every length up to it (`reshard.plan_size` bounds a plan's work with it)."""
    if exactly:
        return num_hosts ** 3 if num_hosts <= _GREEDY_ROUTE else _STRIDES * num_hosts
    return max(min(num_hosts, _GREEDY_ROUTE) ** 3, _STRIDES * num_hosts)


def _group_by_host(devices: Sequence[str], hosts: HostCache) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for d in devices:
        out[hosts[d]].append(d)
    return out


@lru_cache(maxsize=4096)
def _by_host(devices: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """`_group_by_host` of a tile group, as tuples, kept: the reshards of a state dict name the same groups again
    and again. Callers must not change the result."""
    return {h: tuple(group) for h, group in _group_by_host(devices, HostCache()).items()}


@lru_cache(maxsize=256)
def _task_hosts(senders: tuple[str, ...], receivers: tuple[str, ...]) -> tuple:
    """(holders, wanting, local, remote) of a task: its senders and its receivers by host (`_by_host`), the
    (host, receivers) pairs on hosts that hold a replica, and the other receiving hosts, in receiver order; kept,
    as the tasks of a state dict's tensors that share a layout have the same groups. Callers must not change it."""
    holders, wanting = _by_host(senders), _by_host(receivers)
    return (holders, wanting, tuple((h, group) for h, group in wanting.items() if h in holders),
            tuple(h for h in wanting if h not in holders))


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


class Loads:
    """NIC seconds per host and direction, bytes per (from, to) host pair and bytes each device sends as local
    copies, kept while the greedy assigns unit tasks. Give one to `plan` (``loads=``) of many reshards on the same
    ``topology`` to balance them against each other."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.send: dict[str, float] = defaultdict(float)
        self.recv: dict[str, float] = defaultdict(float)
        self.pairs: dict[tuple[str, str], float] = defaultdict(float)
        # The hosts each host has a pair (bytes) to, with those bytes: ``pairs`` again, by sending host, so that
        # `_chain_order` reads a host's row of hops without a tuple key per hop.
        self.next_hops: dict[str, dict[str, float]] = defaultdict(dict)
        self.local_out: dict[str, int] = defaultdict(int)
        self.peak = 0.0
        # What no plan of the whole can beat (`set_floor`): NIC seconds at or below it are free, and a star that
        # stays within it is taken over a chain (`_fewer_hops`)
        self.floor = 0.0
        self.bandwidths: dict[str, float] = {}  # NIC bytes per second of the hosts seen
        self._bandwidth_arrays: dict[tuple[str, ...], np.ndarray] = {}
        self._bandwidth_tuples: dict[tuple[str, ...], tuple[float, ...]] = {}
        # The transfers of the stars planned so far (`_emit_star`), by box, sender and receiving groups.
        self._stars: dict[tuple, tuple] = {}
        # The receivers and route of the chains planned so far (`_emit_chain`), by receiving groups and route.
        self._chains: dict[tuple, tuple] = {}
        self._unit_tasks: dict[tuple, UnitTasks] = {}
        self._task_rows: dict[int, tuple] = {}  # id(tasks) -> (tasks, *task_rows(tasks))

    def unit_tasks(self, shape: tuple[int, ...], src: Sharding, dst: Sharding) -> UnitTasks:
        """`decompose` of (``shape``, ``src``, ``dst``), kept while these loads are: the tensors of a state dict
        repeat a few layouts and shapes (a Kimi-K2-like one has 152 of them in 2,349 tensors). Its arrays are made
        read-only, as every plan of that reshard holds the same ones."""
        key = (shape, src, dst)
        tasks = self._unit_tasks.get(key)
        if tasks is None:
            tasks = self._unit_tasks[key] = decompose(shape, src, dst)
            for a in (tasks.lo, tasks.hi, tasks.num_elements, tasks.sender_group, tasks.receiver_group):
                a.flags.writeable = False
        return tasks

    def task_rows(self, tasks: UnitTasks, hosts: HostCache) -> tuple[np.ndarray, int, list[tuple]]:
        """`_order` of ``tasks`` and the `_rows` `_auto_loop` walks: all of them where the one-to-one run that
        ends the order is too short for columns (`_BULK_FROM`), else those before it. Kept with ``tasks`` (by
        identity, as `unit_tasks` hands out the same ones): the tensors of a state dict that share a layout walk
        the same rows, with the same box objects. Rows of more than `_KEEP_ROWS` tasks are made again each time."""
        kept = self._task_rows.get(id(tasks))
        if kept is None or kept[0] is not tasks:
            order, cut = _order(tasks)
            walked = order if len(order) - cut < _BULK_FROM else order[:cut]
            kept = (tasks, order, cut, _rows(tasks, walked, hosts))
            if len(walked) <= _KEEP_ROWS:
                self._task_rows[id(tasks)] = kept
        return kept[1:]

    def bandwidth(self, host: str) -> float:
        bw = self.bandwidths.get(host)
        if bw is None:
            bw = self.bandwidths[host] = self.topology.nic_bytes_per_s(host)
        return bw

    def bandwidth_tuple(self, hosts: tuple[str, ...]) -> tuple[float, ...]:
        """The `bandwidth` of each of ``hosts``, kept per tuple, as `bandwidth_array` keeps its arrays."""
        out = self._bandwidth_tuples.get(hosts)
        if out is None:
            out = self._bandwidth_tuples[hosts] = tuple(map(self.bandwidth, hosts))
        return out

    def bandwidth_array(self, hosts: tuple[str, ...]) -> np.ndarray:
        """The `bandwidth` of each of ``hosts``, kept per tuple: a state dict's tasks name the same hosts again and
        again. Callers must not change the array."""
        out = self._bandwidth_arrays.get(hosts)
        if out is None:
            out = self._bandwidth_arrays[hosts] = np.array([self.bandwidth(h) for h in hosts])
        return out

    def seconds(self, host: str, nbytes: float) -> float:
        bw = self.bandwidths.get(host)
        if bw is None:
            bw = self.bandwidths[host] = self.topology.nic_bytes_per_s(host)
        return nbytes / bw

    def set_floor(self, tasks: Iterable[tuple[UnitTasks, int]], hosts: HostCache) -> None:
        """The floor of the plans of ``tasks`` (each with the bytes of an element times its copies) on these
        loads, moved together: the busiest host's NIC seconds for the bytes it must receive, or send as the only
        holder (`reshard.cost.host_needs`)."""
        need: dict[str, float] = defaultdict(float)
        sole: dict[str, float] = defaultdict(float)
        for t, size in tasks:
            n, o = host_needs(t, size, hosts)
            for mine, theirs in ((need, n), (sole, o)):
                for h, b in theirs.items():
                    mine[h] += b
        self.floor = max((b / self.bandwidth(h) for got in (need, sole) for h, b in got.items()), default=0.0)

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
        send, peak = self.send, self.peak
        for h, d in delta.items():
            new = send[h] = send[h] + d
            if new > peak:  # as max(peak, new): a chain's delta names every host of a state dict's mesh
                peak = new
        self.peak = peak

    def add_recv(self, host: str, secs: float) -> None:
        self.recv[host] += secs
        self.peak = max(self.peak, self.recv[host])

    def add_recv_all(self, hosts: Sequence[str], nbytes: float) -> None:
        """``add_recv`` of ``nbytes`` on each of ``hosts`` (distinct), in one numpy pass: the same additions."""
        recv = self.recv
        new = np.fromiter(map(recv.__getitem__, hosts), float, len(hosts)) + nbytes / self.bandwidth_array(tuple(hosts))
        recv.update(zip(hosts, new.tolist()))
        self.peak = max(self.peak, float(new.max()))

    def add_path(self, sender: str, route: Sequence[str], nbytes: float) -> None:
        pairs, hops = self.pairs, self.next_hops
        for a, b in zip((sender, *route), route):
            hops[a][b] = pairs[a, b] = pairs[a, b] + nbytes

    def add_columns(self, space: DeviceSpace, sender: np.ndarray, receiver: np.ndarray, nbytes: np.ndarray) -> None:
        """Add one-to-one transfers, device numbers of ``space``, in order: a local copy where both are on one host,
        else a point-to-point send. Each figure ends as one call per transfer would leave it: NIC seconds get the
        same float additions in the same order (``np.add.at`` adds in order), and byte counts are exact sums."""
        hs, hr = space.device_host[sender], space.device_host[receiver]
        local = hs == hr
        devices, names = space.devices, space.hosts
        out = np.bincount(sender[local], minlength=len(devices))
        for d, b in zip(np.flatnonzero(out).tolist(), _exact_sums(sender[local], nbytes[local], len(devices))):
            self.local_out[devices[d]] += b
        hs, hr, nbytes = hs[~local], hr[~local], nbytes[~local]
        bw = np.array([self.topology.nic_bytes_per_s(h) for h in names])
        for figure, host in ((self.send, hs), (self.recv, hr)):
            totals = np.array([figure.get(h, 0.0) for h in names])
            np.add.at(totals, host, nbytes.astype(float) / bw[host])
            touched = np.flatnonzero(np.bincount(host, minlength=len(names))).tolist()
            for h in touched:
                figure[names[h]] = float(totals[h])
            if touched:
                self.peak = max(self.peak, float(totals[touched].max()))
        pair = hs * len(names) + hr
        used, at = np.unique(pair, return_inverse=True)
        for p, b in zip(used.tolist(), _exact_sums(at.reshape(-1), nbytes, len(used))):
            a, z = names[p // len(names)], names[p % len(names)]
            self.next_hops[a][z] = self.pairs[a, z] = self.pairs[a, z] + b


def _exact_sums(index: np.ndarray, values: np.ndarray, size: int) -> list[int]:
    """Per index that occurs, in index order, the exact sum of its values (integers)."""
    present = np.flatnonzero(np.bincount(index, minlength=size))
    if values.dtype != object and (not len(values) or float(values.sum(dtype=float)) < 2**53):
        return np.bincount(index, values, minlength=size)[present].astype(np.int64).tolist()
    out = np.zeros(size, dtype=object)
    np.add.at(out, index, values.astype(object))
    return out[present].tolist()


def _chain_order(sender: str, order: list[str], loads: Loads) -> list[str]:
    """Route order of the hosts ``order`` (sorted by send load, then name): a host with the most send load goes
    last, as the last host forwards nothing; the others in the order whose hops carry the fewest bytes already
    planned between the same two hosts.

    Agents send all streams between two hosts over one connection (gloo's pair of the two ranks), and the
    kernel shares a NIC fairly between connections, not streams: two chains that cross the same pair of hosts
    at once get half a fair share each while the NIC's other connections take more, and a chain runs at the
    rate of its slowest hop. Spreading the hops over distinct pairs keeps every stream at its fair share (an
    all-gather over n hosts then uses each ordered pair once).
    """
    if len(order) < 2:
        return order
    # No bytes planned yet over any hop this chain could take: every order costs nothing, and the first in load
    # order (the search's answer) is the load order itself.
    within = set(order)
    if all(within.isdisjoint(loads.next_hops.get(h, ())) for h in (sender, *order)):
        return order
    lasts = _lasts(order, loads.send)
    # Hosts by their rank in ``order`` (the sender is -1), and the bytes planned over each hop as rows: rows[-1]
    # is the sender's (the last row). A rank stands for the host in every comparison: ties go to the lower rank.
    hops = loads.next_hops
    zeros = repeat(0.0)
    rows = [list(map(hops[h].get, order, zeros)) if h in hops else [0.0] * len(order) for h in (*order, sender)]
    best: tuple | None = None
    if len(order) - 1 <= _EXHAUSTIVE_ROUTE:
        for last in lasts:
            for route in permutations([k for k in range(len(order)) if k != last]):
                route = [*route, last]
                key = (sum([rows[a][b] for a, b in zip((-1, *route), route)]), route)
                if best is None or key < best[0]:
                    best = (key, route)
        return [order[k] for k in best[1]]
    # The greedy walk from the sender: to the host whose hop carries the fewest bytes, the lower rank on a tie (the
    # first of ``left``, which stays in rank order, that ``min`` meets). The walk that leaves out a last host takes
    # the whole walk's steps until that one meets the host it leaves out (each step is the least of a set that still
    # holds it), so each last's walk starts where the whole walk met it.
    whole, left, at = [], list(range(len(order))), -1
    while left:
        nxt = min(left, key=rows[at].__getitem__)
        whole.append(nxt)
        left.remove(nxt)
        at = nxt
    for last in lasts:
        p = whole.index(last)
        route = whole[:p]
        left = sorted(whole[p + 1:])
        at = route[-1] if route else -1
        while left:
            nxt = min(left, key=rows[at].__getitem__)
            route.append(nxt)
            left.remove(nxt)
            at = nxt
        route.append(last)
        # The hops' bytes added in route order from 0, as the search has always summed them.
        key = (sum([rows[a][b] for a, b in zip((-1, *route), route)]), route)
        if best is None or key < best[0]:
            best = (key, route)
    return [order[k] for k in best[1]]


def _long_routes(order: list[str], loads: Loads) -> list[tuple[float, list[str]]]:
    """Routes for a chain over more than `_GREEDY_ROUTE` hosts, or of a small box (``order``: sorted by send load,
    then name), each with the bytes planned so far over its hops: the most loaded host last, as `_chain_order` puts
    it, and the others in load order taken at a stride, for the first `_STRIDES` strides coprime to their number
    (`_strided_routes`). Routes of coprime strides share no hop, so chains over the same hosts spread over distinct
    pairs, as `_chain_order` seeks, in time linear in the hosts where its search grows with their cube. Callers
    must not change the routes."""
    pairs = loads.pairs
    within = set(order)
    if all(within.isdisjoint(loads.next_hops.get(h, ())) for h in order):
        # No bytes planned between these hosts: every stride's hops cost nothing, and all start at order[0].
        return [(0.0, order)]
    out = []
    for route, hops in _strided_routes(tuple(order)):
        if out and out[0][0] == 0.0:
            # Every route starts at order[0], so the cheapest hops win, the smaller stride on a tie: none beats 0.
            break
        # 0.0 plus each hop's bytes in route order, as a loop would add them, without a Python step per hop.
        out.append((reduce(add, map(pairs.get, hops, repeat(0.0)), 0.0), route))
    return out


@lru_cache(maxsize=4096)
def _strided_routes(order: tuple[str, ...]) -> tuple[tuple[list[str], tuple[tuple[str, str], ...]], ...]:
    """The routes `_long_routes` weighs for ``order``, with their hops: the hosts but the last taken at each of the
    first `_STRIDES` strides coprime to their number, then the last. Kept: a state dict's chains go over the same
    hosts in a few orders again and again. Callers must not change the routes."""
    *rest, last = order
    n = len(rest)
    out = []
    for stride in range(1, n + 1):
        if len(out) == _STRIDES:
            break
        if math.gcd(stride, n) == 1:
            route = [rest[i * stride % n] for i in range(n)] + [last]
            out.append((route, tuple(zip(route, route[1:]))))
    return tuple(out)


def _long_route(sender: str, routes: list[tuple[float, list[str]]], loads: Loads) -> list[str]:
    """Of `_long_routes`, the one whose hops from ``sender`` on carry the fewest bytes (the first on a tie)."""
    pairs = loads.pairs
    return min(routes, key=lambda r: pairs.get((sender, r[1][0]), 0.0) + r[0])[1]


def _auto(tasks: UnitTasks, hosts: HostCache, topology: Topology, size: int,
          space: Optional[DeviceSpace] = None, loads: Optional[Loads] = None,
          step_s: float = STEP_S) -> Union[list[Transfer], TransferTable]:
    """Auto's transfers, planned against ``loads`` (new ones if None); columns where a run of one-to-one tasks
    ends the order and ``space`` numbers the devices. ``step_s``: a step's cost (`STEP_S`, times the copies a
    transfer stands for)."""
    loads = loads if loads is not None else Loads(topology)
    order, cut, rows = loads.task_rows(tasks, hosts)
    if len(rows) == len(order):
        return _auto_loop(rows, size, loads, hosts, step_s)
    if space is None:
        return _auto_loop(rows + _rows(tasks, order[cut:], hosts), size, loads, hosts, step_s)
    head = _auto_loop(rows, size, loads, hosts, step_s)
    tail = _one_to_one(tasks, order[cut:], space, size, loads)
    return TransferTable.concat(TransferTable.from_transfers(head, tasks.lo.shape[1], space), tail) if head else tail


def _order(tasks: UnitTasks) -> tuple[np.ndarray, int]:
    """Auto's order of ``tasks`` (largest first) and where in it the run of one-to-one tasks that ends it starts."""
    order = np.argsort(-tasks.num_elements, kind="stable")
    one_sender = np.array([len(g) == 1 for g in tasks.senders], dtype=bool)
    one_receiver = np.array([len(g) == 1 for g in tasks.receivers], dtype=bool)
    chosen = np.flatnonzero(~(one_sender[tasks.sender_group] & one_receiver[tasks.receiver_group])[order])
    # The one-to-one tasks after the last task with a choice affect no choice of this plan: columns for them.
    return order, int(chosen[-1]) + 1 if len(chosen) else 0


def _rows(tasks: UnitTasks, order: np.ndarray, hosts: HostCache) -> list[tuple]:
    """What `_auto_loop` reads of each task ``order`` names: (box, elements, senders, receivers, then the sender's
    and the receiver's host for a one-to-one task and None, else None and `_task_hosts`)."""
    out = []
    hosts_of: dict[tuple[int, int], tuple] = {}  # (g, q) -> _task_hosts of their devices
    for lo, hi, num, g, q in zip(tasks.lo[order].tolist(), tasks.hi[order].tolist(),
                                 tasks.num_elements[order].tolist(), tasks.sender_group[order].tolist(),
                                 tasks.receiver_group[order].tolist()):
        senders, receivers = tasks.senders[g], tasks.receivers[q]
        if len(senders) == 1 and len(receivers) == 1:
            where = ((hosts[senders[0]], hosts[receivers[0]]), None)
        else:
            where = hosts_of.get((g, q))
            if where is None:
                where = hosts_of[g, q] = (None, _task_hosts(senders, receivers))
        out.append((tuple(zip(lo, hi)), num, senders, receivers, *where))
    return out


def _one_to_one(tasks: UnitTasks, order: np.ndarray, space: DeviceSpace, size: int, loads: Loads) -> TransferTable:
    """The transfers of tasks of one sender and one receiver each, taken in ``order``, as columns."""
    position = space.position
    first_sender = np.array([position[g[0]] for g in tasks.senders], dtype=np.int64)
    first_receiver = np.array([position[g[0]] for g in tasks.receivers], dtype=np.int64)
    sender = first_sender[tasks.sender_group[order]]
    receiver = first_receiver[tasks.receiver_group[order]]
    loads.add_columns(space, sender, receiver, tasks.num_elements[order] * size)
    local = space.device_host[sender] == space.device_host[receiver]
    n = len(order)
    return TransferTable(space, tasks.lo[order], tasks.hi[order], sender,
                         np.where(local, LOCAL, P2P).astype(np.int8), np.zeros(n, dtype=np.int64),
                         np.arange(n + 1, dtype=np.int64), receiver, np.zeros(n + 1, dtype=np.int64),
                         np.zeros(0, dtype=np.int64))


def _auto_loop(rows: list[tuple], size: int, loads: Loads, hosts: HostCache,
               step_s: float = STEP_S) -> list[Transfer]:
    """Auto's greedy over the tasks of ``rows`` (`_rows`), one by one."""
    local_out = loads.local_out
    out: list[Transfer] = []
    for box, num, senders, receivers, one_to_one, task_hosts in rows:
        nbytes = num * size
        if one_to_one is not None:
            # The all-to-all shape of most large reshards: nothing to choose.
            s, (hs, hr) = senders[0], one_to_one
            if hs == hr:
                local_out[s] += nbytes
                out.append(Transfer(box, s, receivers, "local"))
            else:
                loads.add_recv(hr, loads.seconds(hr, nbytes))
                loads.add_send({hs: loads.seconds(hs, nbytes)})
                loads.add_path(hs, (hr,), nbytes)
                out.append(Transfer(box, s, receivers, "p2p"))
            continue
        holders, wanting, local, remote = task_hosts
        # A receiver whose host holds a replica copies it locally: no NIC involved.
        for h, group in local:
            s = min(holders[h], key=lambda d: local_out[d])
            local_out[s] += nbytes
            out.append(Transfer(box, s, tuple(group), "local"))
        if not remote:
            continue
        if len(remote) > _GREEDY_ROUTE:
            loads.add_recv_all(remote, nbytes)
            out.extend(_best_long_delivery(box, num, nbytes, holders, wanting, remote, loads, hosts, step_s))
            continue
        # Each receiving host's NIC seconds for the box, worked out once for its receive load and the chain's
        # forwarding; added to the receive loads as add_recv adds them, one host after the other.
        whole = dict(zip(remote, [nbytes / bw for bw in loads.bandwidth_tuple(remote)]))
        recv, peak = loads.recv, loads.peak
        for h, secs in whole.items():
            new = recv[h] = recv[h] + secs
            if new > peak:  # as max(peak, new)
                peak = new
        loads.peak = peak
        if len(holders) == 1 and len(remote) == 1:
            # One replica host and one receiving host: nothing to choose.
            (hs, group), = holders.items()
            loads.add_send({hs: loads.seconds(hs, nbytes)})
            loads.add_path(hs, remote, nbytes)
            out.append(_deliver(box, group[0], wanting[remote[0]], hosts))
            continue
        out.extend(_best_delivery(box, num, nbytes, holders, wanting, remote, loads, whole, step_s))
    return out


def _best_delivery(box, num_elements: int, nbytes: int, holders, wanting, remote, loads: Loads,
                   whole: dict[str, float], step_s: float = STEP_S) -> Sequence[Transfer]:
    """Pick, among chain, star and striped deliveries, the one that keeps NIC loads lowest (the first of the
    lowest, in the order chain and star of each candidate sender, then stripes), or the lowest star where it stays
    within the floor the other does (`_fewer_hops`). ``whole``: each receiving host's NIC seconds for the box.

    A chain's route (`_chain_order`, most of the work) is found only where the chain could win: its score is
    bounded below without the route (`_chain_bound`), and a chain whose bound is above another option's score
    cannot be the first of the lowest."""
    if len(holders) == 1:
        return _best_of_one(box, nbytes, holders, wanting, remote, loads, whole, step_s)
    send = loads.send
    candidates = sorted(holders, key=lambda h: (send[h], h))
    # By name, then stably by load: ordered by (load, name) without a key tuple per host.
    order = sorted(_names(remote), key=send.__getitem__)
    if len(remote) > 1 and loads.seconds(candidates[0], nbytes) < step_s:
        return _best_small(box, nbytes, holders, wanting, remote, loads, whole, candidates, order)
    # (score, position in the option order above, emit or None, and for a chain still to route: hs and delta)
    options: list[tuple] = []
    chains: list[tuple] = []
    stars: list[int] = []  # the stars' positions in ``options``, where their sender is on another machine
    for hs in candidates[:MAX_STRIPES]:
        chains.append((len(options), hs, loads.seconds(hs, nbytes)))
        options.append(None)
        if len(remote) > 1:
            if loads.topology.apart(hs, order):
                stars.append(len(options))
            star = {hs: loads.seconds(hs, nbytes * len(remote))}
            options.append((loads.score(star), len(options), lambda hs=hs, star=star: _emit_star(
                box, hs, holders[hs][0], remote, nbytes, wanting, loads, star)))
    k = min(len(candidates), MAX_STRIPES, _stripes_worth(nbytes, candidates, loads, step_s)) \
        if len(candidates) > 1 else 1
    pieces = boxes.split(box, k) if k > 1 else []
    pieces = [p for p in pieces if boxes.volume(p)]
    if len(pieces) > 1:
        base = order
        plan_parts = []
        delta: dict[str, float] = {}
        for j, piece in enumerate(pieces):
            hs = candidates[j]
            # Rotate the chain so that each stripe ends on a different host.
            route = base[j % len(base):] + base[:j % len(base)] if len(base) > 1 else base
            share = boxes.volume(piece) * nbytes / num_elements
            delta[hs] = delta.get(hs, 0.0) + loads.seconds(hs, share)
            for h in route[:-1]:
                delta[h] = delta.get(h, 0.0) + loads.seconds(h, share)
            plan_parts.append((piece, hs, holders[hs][0], route, share))
        options.append((loads.score(delta), len(options), lambda parts=plan_parts, delta=delta: _emit_stripes(
            parts, wanting, loads, delta)))
    others = [o for o in options if o is not None]
    beaten = min(others)[0] if others else None
    peak, forwarding = loads.peak, None
    floor = (len(order), send[order[0]], send[order[-1]], min(whole.values()), max(whole.values()))
    for at, hs, mine in chains:
        if beaten is not None:
            # A chain's score is at least its bounds: above another option's, it is never the first of the lowest.
            if _chain_floor(peak, send[hs], mine, *floor) > beaten:
                continue
            if forwarding is None:
                forwarding = _forwarding(order, send, whole)
            if _chain_bound(peak, send[hs], mine, forwarding) > beaten:
                continue
        route = _chain_order(hs, order, loads)
        delta = {hs: mine}
        for h in route[:-1]:
            delta[h] = whole[h]
        options[at] = (loads.score(delta), at, lambda hs=hs, route=route, delta=delta: _emit_chain(
            box, hs, holders[hs][0], route, nbytes, wanting, loads, delta))
    best = min(o for o in options if o is not None)
    if stars and best[1] not in stars:
        star = min(options[at] for at in stars)
        if _fewer_hops(star[0], best[0], loads):
            best = star
    return best[2]()


def _fewer_hops(star: tuple[float, float], other: tuple[float, float], loads: Loads) -> bool:
    """Whether a star of score ``star`` (`Loads.score`) is taken over a chain or stripes of score ``other``: where
    neither raises the busiest NIC above the floor of the whole (`Loads.set_floor`), or both raise it alike. The
    cost model then tells them apart by their spread alone, where the chain spreads the sends; but each hop it
    adds is a relay that waits for the chunk before it, shares its receiving link with the streams into that host
    (TCP's share per connection) and spends CPU. bench/weight_sync.py's emulated sync (tensor-parallel 4 to two
    replicas of 2, where each trainer's NIC has room to send its tiles twice), one lab per mode, two of each,
    8 runs: stars 0.931 and 0.933 s (1.10x the bound), chains 0.954 and 0.960 s, half of the layouts each way 0.937
    to 0.949 s. A caller whose senders' NICs carry other traffic meanwhile (a trainer's own collectives), which the
    model cannot see, asks for ``broadcast``.

    Only where the star's sender is on another machine than its receivers (`Topology.apart`; its callers ask):
    between the agents of one machine a stream is a copy through memory on the cores the agents share, which a
    chain spreads over its hops where a star puts every copy on the sender's. The same sync on one machine
    (loopback, nixl through shared memory), 10 runs each taking turns: stars 0.368 s and 0.700 CPU-seconds of
    agents, chains 0.321 s and 0.595."""
    floor = loads.floor
    if not floor:
        return False
    return max(star[0], floor) <= max(other[0], floor) * (1 + 1e-9)


def _best_small(box, nbytes: int, holders, wanting, remote, loads: Loads, whole: dict[str, float],
                candidates: list[str], order: list[str]) -> Sequence[Transfer]:
    """`_best_delivery` of a small box (`STEP_S`) to more than one host: of a chain and a star from each of the
    first `MAX_STRIPES` ``candidates`` (holders by load), the first of those that leave the lowest peak, chains
    (one step) before stars; no stripes (a small box is not worth one). Chains take `_long_routes`' routes."""
    routes = _long_routes(order, loads)
    best = None
    for hs in candidates[:MAX_STRIPES]:
        route = _long_route(hs, routes, loads)
        delta = {hs: loads.seconds(hs, nbytes)}
        for h in route[:-1]:
            delta[h] = whole[h]
        peak, sq = loads.score(delta)
        if best is None or (peak, 1, sq) < best[0]:
            best = ((peak, 1, sq), lambda hs=hs, route=route, delta=delta: _emit_chain(
                box, hs, holders[hs][0], route, nbytes, wanting, loads, delta))
        star = {hs: loads.seconds(hs, nbytes * len(remote))}
        peak, sq = loads.score(star)
        if (peak, len(remote), sq) < best[0]:
            best = ((peak, len(remote), sq), lambda hs=hs, star=star: _emit_star(
                box, hs, holders[hs][0], remote, nbytes, wanting, loads, star))
    return best[1]()


def _best_of_one(box, nbytes: int, holders, wanting, remote, loads: Loads,
                 whole: dict[str, float], step_s: float = STEP_S) -> Sequence[Transfer]:
    """`_best_delivery` where one host holds the box (experts, in a state dict): its options are a chain and, to
    more than one host, a star from that host (no stripes), and the chain wins a tie, unless both stay within
    the floor (`_fewer_hops`). The same choice, without the option list."""
    (hs, group), = holders.items()
    send = loads.send
    # By name, then stably by load: ordered by (load, name) without a key tuple per host.
    order = sorted(_names(remote), key=send.__getitem__)
    mine = loads.seconds(hs, nbytes)
    beaten = None  # the star's score, where the chain must beat it
    if len(remote) > 1 and mine < step_s:
        # A small box (`STEP_S`): the chain, one step, unless it leaves the busiest NIC busier than the star does.
        return _best_small(box, nbytes, holders, wanting, remote, loads, whole, [hs], order)
    if len(remote) > 1:
        star = {hs: loads.seconds(hs, nbytes * len(remote))}
        beaten = loads.score(star)
        peak, was = loads.peak, send[hs]
        seconds = whole.values()
        if _chain_floor(peak, was, mine, len(order), send[order[0]], send[order[-1]], min(seconds),
                        max(seconds)) > beaten or \
                _chain_bound(peak, was, mine, _forwarding(order, send, whole)) > beaten:
            return _emit_star(box, hs, group[0], remote, nbytes, wanting, loads, star)
    route = _chain_order(hs, order, loads)
    delta = {hs: mine}
    for h in route[:-1]:
        delta[h] = whole[h]
    chained = loads.score(delta)
    if beaten is not None and (chained > beaten or (_fewer_hops(beaten, chained, loads)
                                                    and loads.topology.apart(hs, order))):
        return _emit_star(box, hs, group[0], remote, nbytes, wanting, loads, star)
    return _emit_chain(box, hs, group[0], route, nbytes, wanting, loads, delta)


def _forwarding(order: list[str], send, whole: dict[str, float]) -> tuple:
    """What `_chain_bound` needs of a chain over ``order`` (sorted by send load, then name), whichever host ends
    it: the send load each host of ``order`` would have forwarding the box (``whole``), the NIC-seconds-squared
    each would add, and the positions of the hosts that may end the route (`_lasts`)."""
    olds = [send[h] for h in order]
    news = [old + whole[h] for old, h in zip(olds, order)]
    return news, [new * new - old * old for new, old in zip(news, olds)], _lasts(order, send)


def _chain_bound(peak: float, was: float, mine: float, forwarding: tuple) -> tuple[float, float]:
    """A lower bound of `Loads.score` of a chain from a host of send load ``was`` that sends the box in ``mine``
    seconds, over every route `_chain_order` may choose (`_forwarding`): each host forwards but the last.

    The peak is exact (a max does not depend on the order of its terms); the sum of squares is added in another
    order than `Loads.score` adds it, so it is lowered by far more than any rounding of its nonnegative terms."""
    news, grown, lasts = forwarding
    new = was + mine
    own = new * new - was * was
    if len(news) < 2:
        return max(peak, new), own * (1 - 1e-9)
    top = max(news)
    rest = top
    if news.count(top) == 1 and news.index(top) in lasts:
        rest = max(news[:news.index(top)] + news[news.index(top) + 1:])
    total = own + sum(grown)
    sq = total - max([grown[k] for k in lasts])
    return max(peak, new, rest), sq - 1e-9 * total


def _chain_floor(peak: float, was: float, mine: float, n: int, least: float, most: float, low: float,
                 high: float) -> tuple[float, float]:
    """A looser lower bound than `_chain_bound`, without a step per host: of the ``n`` hosts of the chain, ``n - 1``
    forward, each with a send load from ``least`` to ``most`` and forwarding in ``low`` to ``high`` seconds.

    Each forwarding host adds at least ``low * (2 * least + low)`` to the sum of squares; the sum is lowered by far
    more than the rounding of `Loads.score`'s terms (at most a few ulps of each new load squared)."""
    new = was + mine
    own = new * new - was * was
    grown = (n - 1) * low * (2 * least + low)
    return max(peak, new), own + grown - 1e-9 * (own + n * (most + high) ** 2)


def _lasts(order: list[str], send) -> list[int]:
    """The positions in ``order`` (sorted by send load) of the hosts that may end a chain: those with the most send
    load, to a relative 1e-9."""
    top = send[order[-1]]
    return [k for k, h in enumerate(order) if send[h] >= top * (1 - 1e-9)]


def _best_long_delivery(box, num_elements: int, nbytes: int, holders, wanting, remote, loads: Loads,
                        hosts, step_s: float = STEP_S) -> Sequence[Transfer]:
    """`_best_delivery` for more than `_GREEDY_ROUTE` receiving hosts: the same options, routes from
    `_long_routes`, scored over all hosts at once with numpy. Every such route makes all receiving hosts but the
    most loaded forward, so the chains of the candidate senders differ in score only by the sender's own term."""
    send = loads.send
    # Hosts sorted by name (kept), then stably by load: ordered by (load, name) as _best_delivery orders them,
    # without a key tuple per host. Only the first MAX_STRIPES candidates are ever used.
    held = _names(tuple(holders))
    by_load = np.argsort(np.fromiter(map(send.__getitem__, held), float, len(held)), kind="stable")
    candidates = [held[i] for i in by_load[:MAX_STRIPES].tolist()]
    names = _names(tuple(remote))
    load = np.fromiter(map(send.__getitem__, names), float, len(names))
    by_load = np.argsort(load, kind="stable")
    order = list(map(names.__getitem__, by_load.tolist()))
    old = load[by_load]
    bw = loads.bandwidth_array(names)[by_load]
    whole = nbytes / bw
    forward = old[:-1] + whole[:-1]
    forward_peak = float(forward.max())
    forward_sq = float(np.sum(forward * forward - old[:-1] * old[:-1]))
    options: list[tuple[tuple, int, Callable[[], list[Transfer]]]] = []
    # A small box (`STEP_S`) ranks its options by peak, then steps, then the sum of squares.
    small = loads.seconds(candidates[0], nbytes) < step_s

    def option(score, emit, steps: int) -> None:
        options.append(((score[0], steps, score[1]) if small else score, len(options), emit))

    for hs in candidates[:MAX_STRIPES]:
        mine, was = loads.seconds(hs, nbytes), send[hs]
        new = was + mine
        # The route does not change the score (every route makes the same hosts forward): found if chosen.
        option((max(loads.peak, new, forward_peak), new * new - was * was + forward_sq),
               lambda hs=hs, mine=mine: _emit_chain(
                   box, hs, holders[hs][0], _long_route(hs, _long_routes(order, loads), loads), nbytes, wanting, loads,
                   {hs: mine, **{h: float(x) for h, x in zip(order[:-1], whole[:-1].tolist())}}), 1)
        star = {hs: loads.seconds(hs, nbytes * len(remote))}
        new = was + star[hs]
        option((max(loads.peak, new), new * new - was * was), lambda hs=hs, star=star: _emit_star(
            box, hs, holders[hs][0], remote, nbytes, wanting, loads, star), len(remote))
    k = min(len(candidates), MAX_STRIPES, _stripes_worth(nbytes, candidates, loads, step_s))
    pieces = _stripes(box, k) if k > 1 else ()
    if len(pieces) > 1:
        n = len(order)
        added = np.zeros(n)
        parts, delta = [], {}
        for j, (piece, volume) in enumerate(pieces):
            hs = candidates[j]
            # Each stripe's chain is the order rotated by j, so that each ends on a different host, as
            # _best_delivery rotates it.
            share = volume * nbytes / num_elements
            stripe = share / bw
            stripe[(j - 1) % n] = 0.0  # the stripe's last host forwards nothing
            added += stripe
            delta[hs] = loads.seconds(hs, share)
            parts.append((piece, hs, holders[hs][0], share))
        old_hosts = np.array([send[h] for h in delta])
        new_hosts = old_hosts + np.array(list(delta.values()))
        new_order = old + added
        score = (max(loads.peak, float(new_order.max()), float(new_hosts.max())),
                 float(np.sum(new_hosts * new_hosts - old_hosts * old_hosts))
                 + float(np.sum(new_order * new_order - old * old)))
        # The routes and the forwarding hosts' seconds, made only if the stripes win.
        option(score, lambda parts=parts, delta=delta, added=added: _emit_stripes(
            [(piece, hs, sender, order[j % n:] + order[:j % n], share)
             for j, (piece, hs, sender, share) in enumerate(parts)],
            wanting, loads, {**delta, **{h: float(x) for h, x in zip(order, added.tolist()) if x}}), len(parts))
    return min(options, key=lambda o: o[:2])[2]()


@lru_cache(maxsize=1024)
def _names(hosts: tuple[str, ...]) -> tuple[str, ...]:
    """``hosts`` sorted, kept: a state dict's tasks name the same groups of hosts again and again."""
    return tuple(sorted(hosts))


def _stripes_worth(nbytes: int, candidates: Sequence[str], loads: Loads, step_s: float = STRIPE_MIN_S) -> int:
    """How many stripes of ``nbytes`` keep each sender (the first ``candidates``) busy `STRIPE_MIN_S` at least
    (``step_s``: times the copies a transfer stands for)."""
    fastest = min(loads.seconds(h, nbytes) for h in candidates[:MAX_STRIPES])
    return max(1, int(fastest / step_s))


@lru_cache(maxsize=4096)
def _stripes(box, k: int) -> tuple[tuple[tuple, int], ...]:
    """The non-empty pieces of ``box`` cut ``k`` ways (`boxes.split`), with their element counts, kept: the tensors
    of a state dict that share a shape share their boxes."""
    return tuple((p, boxes.volume(p)) for p in boxes.split(box, k) if boxes.volume(p))


def _emit_chain(box, hs, sender, route, nbytes, wanting, loads: Loads, delta) -> list[Transfer]:
    loads.add_send(delta)
    loads.add_path(hs, route, nbytes)
    # The chains of a state dict go over the same hosts in a few routes again and again: each (receivers, route)
    # is made once and shared by every transfer that takes it (a Kimi-K2-like one has a million chains and a
    # thousand distinct receiver tuples, each of up to 128 devices). Keyed by the groups' identity, and kept with
    # them so that it stays theirs.
    key = (id(wanting), tuple(route))
    made = loads._chains.get(key)
    if made is None or made[0] is not wanting:
        made = loads._chains[key] = (wanting, tuple(chain.from_iterable(wanting[h] for h in route)), key[1])
    _, receivers, route = made
    if len(receivers) == 1:
        return [Transfer(box, sender, receivers, "p2p")]
    return [Transfer(box, sender, receivers, "broadcast", 0, route)]


def _emit_star(box, hs, sender, remote, nbytes, wanting, loads: Loads, delta) -> Sequence[Transfer]:
    loads.add_send(delta)
    pairs, row = loads.pairs, loads.next_hops[hs]
    for h in remote:
        row[h] = pairs[hs, h] = pairs[hs, h] + nbytes
    # The tensors of a state dict that share a layout send the same stars again: a transfer is a value, so the
    # steps of both may hold it. Keyed by the groups' identity, and kept with them so that it stays theirs.
    key = (box, sender, id(remote), id(wanting))
    made = loads._stars.get(key)
    if made is None or made[0] is not remote or made[1] is not wanting:
        # As _deliver(box, sender, wanting[h], hosts) for each h: every receiver is on h, another host than the
        # sender's.
        legs = Transfer.star(box, sender, [(h, wanting[h]) for h in remote])
        made = loads._stars[key] = (remote, wanting, tuple(legs))
    return made[2]


def _emit_stripes(parts, wanting, loads: Loads, delta) -> list[Transfer]:
    loads.add_send(delta)
    out = []
    for piece, hs, sender, route, nbytes in parts:
        loads.add_path(hs, route, nbytes)
        receivers = tuple(chain.from_iterable(wanting[h] for h in route))
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
    loads: Optional[Loads] = None,
    copies: int = 1,
) -> Plan:
    """Plan moving a tensor of ``shape`` and ``dtype`` from ``src`` to ``dst``.

    ``strategy`` is one of ``send_recv``, ``local_allgather``, ``broadcast`` or
    ``auto`` (the default, never worse than the others on the cost model).

    ``loads`` (strategy ``auto``): the NIC loads of transfers planned before, on the
    same topology (``topology`` may then be left out). The greedy balances this
    plan's transfers against them and adds them in; as the plan is one part of a
    larger whole, it is not swapped for a baseline that would be cheaper alone.

    ``copies`` (with ``loads``): the plan's transfers stand for that many tensors of
    this shape, dtype and layouts, each moved the same way (`reshard.plan_many` plans a
    state dict's layers so): the loads count every copy's bytes, and a box is small
    (`STEP_S`) or worth striping as one copy of it is, since each copy is a step.
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
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1 or (copies > 1 and loads is None):
        raise InvalidShardingError(f"copies {copies!r} must be a positive integer, and more than 1 only with loads= "
                                   f"(a plan alone is for one tensor)")
    if loads is not None:
        if strategy != "auto":
            raise InvalidShardingError(
                f"loads= balances the plans of strategy 'auto' against each other; strategy {strategy!r} takes no "
                f"loads (leave loads out, or use strategy 'auto')")
        if topology is not None and topology != loads.topology:
            raise InvalidTopologyError(
                f"the loads were added up on {loads.topology}, but this plan is for {topology}; plan on the "
                f"loads' topology (leave topology out) or start new Loads(topology)")
        topology = loads.topology
    shape = dst.check_shape(src.check_shape(shape))
    dtype = dtype_name(dtype)
    topology = topology or Topology()
    size = itemsize(dtype)
    tasks = decompose(shape, src, dst) if loads is None else loads.unit_tasks(shape, src, dst)
    space = device_space(src.mesh, dst.mesh)
    hosts = space.host_of
    alone = loads is None  # a plan of its own, not one of a state dict's (`reshard.many`)
    if strategy == "auto":
        if alone:
            loads = Loads(topology)
            loads.set_floor([(tasks, size)], hosts)
        transfers = _auto(tasks, hosts, topology, size * copies, space, loads, STEP_S * copies)
    else:
        transfers = _BUILDERS[strategy](tasks, hosts, topology, size)
    figures = {}
    if strategy == "auto" and alone:
        transfers, figures = _never_worse(transfers, tasks, hosts, topology, size, space)
    result = Plan(shape, dtype, src, dst, strategy,
                  transfers if isinstance(transfers, TransferTable) else tuple(transfers), topology)
    result.__dict__.update(figures, unit_tasks=tasks)
    return result


def _estimate(transfers: Union[list[Transfer], TransferTable], size: int, topology: Topology, hosts: HostCache,
              space: DeviceSpace, ndim: int) -> float:
    """`Plan.estimate` of ``transfers``: on columns when they deliver to many devices (a flow per receiver)."""
    if not isinstance(transfers, TransferTable) and sum(len(t.receivers) for t in transfers) >= COLUMNS_FROM:
        transfers = TransferTable.from_transfers(transfers, ndim, space)
    if isinstance(transfers, TransferTable):
        return phase_seconds(table_phase_loads(transfers, size), topology, hosts)
    return estimate_seconds(transfers, size, topology, hosts)


def _never_worse(transfers, tasks, hosts, topology, size, space) -> tuple[Union[list[Transfer], TransferTable], dict]:
    """Keep auto's own plan unless a baseline is cheaper on the cost model; with the plan, its estimate and lower
    bound (`Plan.estimate_seconds`, `Plan.lower_bound_seconds`), figured out on the way."""
    best = _estimate(transfers, size, topology, hosts, space, tasks.lo.shape[1])
    bound = lower_bound_seconds(tasks, size, topology, hosts)
    if best > bound * (1 + 1e-9):
        for name in BASELINES:
            other = _BUILDERS[name](tasks, hosts, topology, size)
            cost = _estimate(other, size, topology, hosts, space, tasks.lo.shape[1])
            if cost < best * (1 - 1e-9):
                best, transfers = cost, other
    return transfers, {"estimate_seconds": best, "lower_bound_seconds": bound}
