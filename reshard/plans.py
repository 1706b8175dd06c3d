"""Plans: the transfers that move a tensor from one sharding to another, as plain data.

A plan is transport-neutral: boxes, senders, receivers, method, phase and, for
broadcasts, the chain of hosts. It serialises to JSON, has a stable content hash
(its id) and is validated completely before anything moves.

A plan of many transfers (a million, for an all-to-all over a thousand devices)
holds them as columns, a `TransferTable`, and costs, validates and serialises
them with numpy; `Plan.transfers` builds the tuple of `Transfer` objects from the
columns on first use. A small plan holds the tuple and takes the plain path.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import chain
from typing import Optional

import numpy as np

from reshard import box as boxes
from reshard.cost import (
    COLUMNS_FROM,
    HostCache,
    PhaseLoad,
    estimate_seconds,
    lower_bound_seconds,
    phase_loads,
    phase_seconds,
    table_phase_loads,
)
from reshard.dtypes import dtype_name, itemsize
from reshard.errors import PlanValidationError
from reshard.jsonio import brief, describe, field_of, loads, need
from reshard.mesh import Mesh, host_of
from reshard.sharding import Box, Sharding, normalise_shape
from reshard.tasks import decompose, tile_arrays
from reshard.topology import Topology

__all__ = [
    "Transfer",
    "TransferTable",
    "DeviceSpace",
    "device_space",
    "Plan",
    "METHODS",
    "PLAN_VERSION",
    "check_transfer",
    "check_delivery",
    "content_id",
    "ContentAddressed",
    "check_version",
    "check_claimed_id",
    "box_from_json",
    "strings",
]

PLAN_VERSION = 1
METHODS = ("p2p", "broadcast", "local")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box from one sender to one or more receivers."""

    box: Box
    sender: str
    receivers: tuple[str, ...]
    method: str
    phase: int = 0
    route: tuple[str, ...] = ()

    @property
    def num_elements(self) -> int:
        return boxes.volume(self.box)

    @classmethod
    def star(cls, box: Box, sender: str, groups: Iterable[tuple[str, tuple[str, ...]]]) -> list["Transfer"]:
        """One transfer of ``box`` from ``sender`` to each (host, receivers there) of ``groups``, hosts other than
        the sender's: point-to-point to a lone receiver, else a broadcast whose route is that host.

        The same transfers as the constructor makes, set field by field: the dataclass's ``__init__`` takes
        twice as long, and a state dict's plan makes hundreds of thousands of them.
        """
        new = object.__new__
        set_box, set_sender, set_receivers, set_method, set_phase, set_route = _TRANSFER_SETTERS
        out = []
        for host, receivers in groups:
            t = new(cls)
            set_box(t, box)
            set_sender(t, sender)
            set_receivers(t, receivers)
            set_phase(t, 0)
            if len(receivers) == 1:
                set_method(t, "p2p")
                set_route(t, ())
            else:
                set_method(t, "broadcast")
                set_route(t, (host,))
            out.append(t)
        return out

    def to_json(self) -> dict:
        out = {
            "box": [[lo, hi] for lo, hi in self.box],
            "sender": self.sender,
            "receivers": list(self.receivers),
            "method": self.method,
            "phase": self.phase,
        }
        if self.method == "broadcast":
            out["route"] = list(self.route)
        return out

    @classmethod
    def from_json(cls, data, what: str = "transfer JSON") -> "Transfer":
        """Read what `to_json` writes (``phase`` 0 and ``route`` empty when left out); ``what`` names
        ``data`` in errors."""
        need(data, "object", what, PlanValidationError)
        return cls(
            box=box_from_json(field_of(data, "box", "array", what, PlanValidationError), f"{what} field 'box'"),
            sender=field_of(data, "sender", "string", what, PlanValidationError),
            receivers=strings(field_of(data, "receivers", "array", what, PlanValidationError),
                              f"{what} field 'receivers'"),
            method=field_of(data, "method", "string", what, PlanValidationError),
            phase=field_of(data, "phase", "integer", what, PlanValidationError, default=0),
            route=strings(field_of(data, "route", "array", what, PlanValidationError, default=()),
                          f"{what} field 'route'"),
        )

    def __str__(self) -> str:
        via = f" via {'->'.join(self.route)}" if self.route else ""
        recv = ",".join(self.receivers)
        return f"[{self.phase}] {self.method} {boxes.box_str(self.box)} {self.sender} -> {recv}{via}"


# The slots of a Transfer, written by `Transfer.star` without the frozen dataclass's checks.
_TRANSFER_SETTERS = tuple(getattr(Transfer, f).__set__ for f in ("box", "sender", "receivers", "method", "phase", "route"))

# Method codes of a TransferTable: positions in METHODS.
P2P, BROADCAST, LOCAL = range(len(METHODS))


@dataclass(frozen=True, eq=False)
class DeviceSpace:
    """Numbers for the devices and hosts of a plan: device ``i`` is ``devices[i]`` on host
    ``hosts[device_host[i]]``."""

    devices: tuple[str, ...]
    hosts: tuple[str, ...]
    device_host: np.ndarray

    @cached_property
    def position(self) -> dict[str, int]:
        return {d: i for i, d in enumerate(self.devices)}

    @cached_property
    def host_position(self) -> dict[str, int]:
        return {h: i for i, h in enumerate(self.hosts)}

    @cached_property
    def host_of(self) -> HostCache:
        """Device id -> host for every device of the space, ready for code that takes a `HostCache`."""
        out = HostCache()
        hosts = self.hosts
        out.update(zip(self.devices, (hosts[h] for h in self.device_host.tolist())))
        return out

    @classmethod
    def of(cls, devices, extra_hosts=()) -> "DeviceSpace":
        """The space of ``devices`` (distinct ids) and of hosts named only in ``extra_hosts``."""
        devices = tuple(devices)
        host_position: dict[str, int] = {}
        device_host = [host_position.setdefault(host_of(d), len(host_position)) for d in devices]
        for h in extra_hosts:
            host_position.setdefault(h, len(host_position))
        return cls(devices, tuple(host_position), np.array(device_host, dtype=np.int64))


@lru_cache(maxsize=64)
def device_space(*meshes: Mesh) -> DeviceSpace:
    """The devices of ``meshes`` in mesh order, each once (cached: a planner plans between the same meshes often)."""
    return DeviceSpace.of(dict.fromkeys(d for m in meshes for d in m.require_devices()))


class TransferTable:
    """A plan's transfers as columns, for plans of many transfers.

    Transfer ``i`` sends the box ``lo[i]:hi[i]`` (per dim) from device ``devices[sender[i]]``
    to the devices ``devices[recv[recv_ptr[i]:recv_ptr[i + 1]]]`` by method
    ``METHODS[method[i]]`` in phase ``phase[i]``; a broadcast runs along the hosts
    ``hosts[route[route_ptr[i]:route_ptr[i + 1]]]``. Devices and hosts are numbered by
    ``space``. Indexing gives a `Transfer`; `transfers` gives them all.
    """

    __slots__ = ("space", "lo", "hi", "sender", "method", "phase", "recv_ptr", "recv", "route_ptr", "route")

    def __init__(self, space: DeviceSpace, lo, hi, sender, method, phase, recv_ptr, recv, route_ptr, route):
        self.space = space
        self.lo, self.hi, self.sender, self.method, self.phase = lo, hi, sender, method, phase
        self.recv_ptr, self.recv, self.route_ptr, self.route = recv_ptr, recv, route_ptr, route

    def __len__(self) -> int:
        return len(self.sender)

    def __getitem__(self, i: int) -> Transfer:
        devices, hosts = self.space.devices, self.space.hosts
        a, b = self.recv_ptr[i:i + 2].tolist()
        c, d = self.route_ptr[i:i + 2].tolist()
        return Transfer(tuple(zip(self.lo[i].tolist(), self.hi[i].tolist())), devices[self.sender[i]],
                        tuple(devices[r] for r in self.recv[a:b].tolist()), METHODS[self.method[i]],
                        int(self.phase[i]), tuple(hosts[h] for h in self.route[c:d].tolist()))

    def _columns(self) -> tuple[list, list, list, list, list, list]:
        """Per transfer, as Python values: its box as ``[[lo, hi], ...]``, sender, receivers (a list), method,
        phase and route (a list)."""
        devices, hosts = self.space.devices, self.space.hosts
        n = len(self)
        box_lists = np.stack([self.lo, self.hi], axis=2).tolist()
        senders = [devices[s] for s in self.sender.tolist()]
        recv = [devices[r] for r in self.recv.tolist()]
        if len(recv) == n and (np.diff(self.recv_ptr) == 1).all():
            receivers = [[r] for r in recv]
        else:
            rp = self.recv_ptr.tolist()
            receivers = [recv[a:b] for a, b in zip(rp, rp[1:])]
        if len(self.route):
            route, qp = [hosts[h] for h in self.route.tolist()], self.route_ptr.tolist()
            routes = [route[a:b] for a, b in zip(qp, qp[1:])]
        else:
            routes = [[]] * n
        methods = [METHODS[m] for m in self.method.tolist()]
        return box_lists, senders, receivers, methods, self.phase.tolist(), routes

    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(Transfer(tuple(map(tuple, box)), s, tuple(r), m, p, tuple(q))
                     for box, s, r, m, p, q in zip(*self._columns()))

    def to_json(self) -> list[dict]:
        """What ``[t.to_json() for t in self.transfers()]`` gives, without making the transfers."""
        box_lists, senders, receivers, methods, phases, routes = self._columns()
        out = [{"box": b, "sender": s, "receivers": r, "method": m, "phase": p}
               for b, s, r, m, p in zip(box_lists, senders, receivers, methods, phases)]
        for i in np.flatnonzero(self.method == BROADCAST).tolist():
            out[i]["route"] = routes[i]
        return out

    @property
    def num_elements(self) -> np.ndarray:
        return boxes.volumes(self.lo, self.hi)

    @classmethod
    def from_transfers(cls, transfers: Sequence[Transfer], ndim: int,
                       space: Optional[DeviceSpace] = None) -> "TransferTable":
        """The columns of ``transfers`` (boxes of ``ndim`` dims), numbered by ``space`` and then by each device or
        host it lacks, in order of appearance. Raises `PlanValidationError` for a transfer that has no columns: a
        box of another number of dims, or a method not in `METHODS`."""
        space = space or DeviceSpace((), (), np.zeros(0, dtype=np.int64))
        dev_pos, host_pos = space.position, space.host_position
        flat = [d for t in transfers for d in (t.sender, *t.receivers)]
        route_hosts = [h for t in transfers for h in t.route]
        if not (dev_pos.keys() >= set(flat) and host_pos.keys() >= set(route_hosts)):
            space = DeviceSpace.of((*space.devices, *dict.fromkeys(d for d in flat if d not in dev_pos)),
                                   (*space.hosts, *route_hosts))
            dev_pos, host_pos = space.position, space.host_position
        index = [dev_pos[d] for d in flat]
        n = len(transfers)
        counts = [len(t.receivers) for t in transfers]
        ptr = _pointers([c + 1 for c in counts])
        senders = np.array(index, dtype=np.int64)
        first = np.zeros(len(index), dtype=bool)
        first[ptr[:-1]] = True
        code = {m: i for i, m in enumerate(METHODS)}
        try:
            box = np.array([b for t in transfers for b in t.box], dtype=np.int64).reshape(n, ndim, 2)
            methods = np.array([code[t.method] for t in transfers], dtype=np.int8)
        except (KeyError, ValueError, TypeError):
            raise PlanValidationError(
                f"transfers with boxes of other than {ndim} dims (lo, hi) or methods other than {list(METHODS)} "
                f"have no columns; check the plan with validate()") from None
        return cls(space, box[:, :, 0], box[:, :, 1], senders[first],
                   methods, np.array([t.phase for t in transfers], dtype=np.int64),
                   _pointers(counts), senders[~first],
                   _pointers([len(t.route) for t in transfers]),
                   np.array([host_pos[h] for h in route_hosts], dtype=np.int64))

    @classmethod
    def concat(cls, first: "TransferTable", second: "TransferTable") -> "TransferTable":
        """``first``'s transfers, then ``second``'s; ``second``'s space must be a prefix of ``first``'s."""
        head, whole = second.space, first.space
        assert whole.devices[:len(head.devices)] == head.devices and whole.hosts[:len(head.hosts)] == head.hosts
        return cls(first.space, np.concatenate([first.lo, second.lo]), np.concatenate([first.hi, second.hi]),
                   np.concatenate([first.sender, second.sender]), np.concatenate([first.method, second.method]),
                   np.concatenate([first.phase, second.phase]),
                   np.concatenate([first.recv_ptr, second.recv_ptr[1:] + first.recv_ptr[-1]]),
                   np.concatenate([first.recv, second.recv]),
                   np.concatenate([first.route_ptr, second.route_ptr[1:] + first.route_ptr[-1]]),
                   np.concatenate([first.route, second.route]))


def _pointers(counts) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


class ContentAddressed:
    """Plain data whose id is the sha256 of its canonical JSON; estimates and topology are extras, not hashed."""

    def _canonical(self) -> dict:
        raise NotImplementedError

    def _extras(self) -> dict:
        return {}

    @cached_property
    def id(self) -> str:
        """sha256 of the canonical JSON; every agent confirms it before it joins the work."""
        return content_id(self._canonical())

    def to_json(self) -> dict:
        out = self._canonical()
        if "id" not in self.__dict__:  # hash the canonical JSON made here: a 30,000-step program's took 0.3 s
            self.__dict__["id"] = content_id(out)  # where `id` (a cached_property) keeps it
        out.update(self._extras())
        out["id"] = self.id
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json())


@dataclass(frozen=True)
class Plan(ContentAddressed):
    """How to move a tensor of ``shape`` and ``dtype`` from ``src`` to ``dst``.

    ``transfers`` may be given as a `TransferTable`: the plan then keeps the columns
    and makes the tuple of `Transfer` objects only when ``transfers`` is first read.
    """

    shape: tuple[int, ...]
    dtype: str
    src: Sharding
    dst: Sharding
    strategy: str
    transfers: tuple[Transfer, ...]
    topology: Topology = field(default_factory=Topology, compare=False)

    def __post_init__(self):
        if isinstance(self.transfers, TransferTable):
            # Leave the attribute unset: __getattr__ makes it from the columns when it is first read.
            self.__dict__["_table"] = self.__dict__.pop("transfers")

    def __getattr__(self, name: str):
        table = self.__dict__.get("_table")
        if name != "transfers" or table is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        out = self.__dict__["transfers"] = table.transfers()
        return out

    @property
    def table(self) -> TransferTable:
        """The transfers as columns (made from ``transfers`` on first use if the plan was given a tuple)."""
        table = self.__dict__.get("_table")
        if table is None:
            table = TransferTable.from_transfers(self.transfers, len(self.shape),
                                                 device_space(self.src.mesh, self.dst.mesh))
            self.__dict__["_table"] = table
        return table

    @property
    def num_transfers(self) -> int:
        table = self.__dict__.get("_table")
        return len(table) if table is not None else len(self.transfers)

    @property
    def _columnar(self) -> bool:
        """Whether to cost and check the plan on its columns: it has them, or enough transfers to pay for them
        (and transfers that have columns: a plan that fails validation may not)."""
        if "_table" in self.__dict__:
            return True
        if len(self.transfers) < COLUMNS_FROM:
            return False
        try:
            self.table
        except PlanValidationError:
            return False
        return True

    # -- derived figures ------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Size of the whole tensor."""
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    @cached_property
    def unit_tasks(self):
        return decompose(self.shape, self.src, self.dst)

    def loads(self) -> list[PhaseLoad]:
        if self._columnar:
            return table_phase_loads(self.table, self.itemsize)
        return phase_loads(self.transfers, self.itemsize)

    def estimate(self, topology: Optional[Topology] = None) -> float:
        """Seconds on the fluid model: per phase the busiest link, phases added."""
        if self._columnar:
            return phase_seconds(self.loads(), topology or self.topology)
        return estimate_seconds(self.transfers, self.itemsize, topology or self.topology)

    def lower_bound(self, topology: Optional[Topology] = None) -> float:
        """Seconds no plan can beat on ``topology``."""
        return lower_bound_seconds(self.unit_tasks, self.itemsize, topology or self.topology)

    @cached_property
    def estimate_seconds(self) -> float:
        return self.estimate()

    @cached_property
    def lower_bound_seconds(self) -> float:
        return self.lower_bound()

    def network_bytes(self) -> int:
        """Bytes that cross a NIC (counted once, at the receiving host)."""
        return sum(p.network_bytes for p in self.loads())

    # -- identity and serialisation --------------------------------------------------

    def _canonical(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "src": self.src.to_json(),
            "dst": self.dst.to_json(),
            "strategy": self.strategy,
            "transfers": ([t.to_json() for t in self.transfers] if "transfers" in self.__dict__
                          else self.table.to_json()),
        }

    def _extras(self) -> dict:
        return {
            "estimate_seconds": self.estimate_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "topology": self.topology.to_json(),
        }

    @classmethod
    def from_json(cls, data) -> "Plan":
        """Read what `to_json` writes, as a mapping or as JSON text. Text is read at any size (a service reading
        untrusted text decodes it first, with `reshard.jsonio.loads` and its limits), within the depth limit."""
        if isinstance(data, (str, bytes, bytearray)):
            data = loads(data, "plan JSON", max_bytes=None)
        need(data, "object", "plan JSON", PlanValidationError)
        check_version(data, "plan", PLAN_VERSION)
        transfers = field_of(data, "transfers", "array", "plan JSON", PlanValidationError)
        plan = cls(
            shape=normalise_shape(field_of(data, "shape", "array", "plan JSON", PlanValidationError)),
            dtype=dtype_name(field_of(data, "dtype", "string", "plan JSON", PlanValidationError)),
            src=Sharding.from_json(field_of(data, "src", "object", "plan JSON", PlanValidationError)),
            dst=Sharding.from_json(field_of(data, "dst", "object", "plan JSON", PlanValidationError)),
            strategy=field_of(data, "strategy", "string", "plan JSON", PlanValidationError),
            transfers=tuple(Transfer.from_json(t, f"plan JSON transfer {i}") for i, t in enumerate(transfers)),
            topology=Topology.from_json(field_of(data, "topology", "object", "plan JSON", PlanValidationError,
                                              default={})),
        )
        return check_claimed_id(data, plan, "plan")

    # -- validation ----------------------------------------------------------------------

    def validate(self) -> "Plan":
        """Prove the plan delivers every destination tile exactly, phase by phase.

        Checks that every sender holds its box when its phase starts (from its
        source tile or from an earlier phase), that every box a device receives
        lies in its destination tile, and that each destination device ends up
        with its whole tile, every element exactly once (held or received).
        Raises `PlanValidationError` naming the first problem; returns the plan.
        """
        if self._columnar and _delivers(self.shape, self.src, self.dst, self.table):
            return self
        # Not proven on the columns (or too few transfers to bother): the plain check names the first problem.
        transfers = self.transfers
        check_delivery(
            self.shape, self.src, self.dst, list(enumerate(transfers)),
            before=lambda i, j: transfers[j].phase < transfers[i].phase,
            where=_Where,
            when=lambda i, t: f"at the start of phase {t.phase}",
        )
        return self

    def wasted_bytes(self) -> int:
        """Bytes delivered to devices that already held them, or delivered twice."""
        src_tiles = self.src.tiles(self.shape)
        received: dict[str, list[Box]] = defaultdict(list)
        for t in self.transfers:
            for r in t.receivers:
                received[r].append(t.box)
        total = 0
        for dev, tile in self.dst.tiles(self.shape).items():
            total += _coverage(tile, src_tiles.get(dev), received.get(dev, []))[1]
        return total * self.itemsize

    # -- presentation --------------------------------------------------------------------

    def __str__(self) -> str:
        shape = ",".join(map(str, self.shape))
        return (
            f"Plan {self.id[:12]} {self.strategy}: {self.dtype}[{shape}] "
            f"{self.src.spec_str()} -> {self.dst.spec_str()}, {self.num_transfers} transfers, "
            f"estimate {self.estimate_seconds:.4g}s, lower bound {self.lower_bound_seconds:.4g}s"
        )

    def summary(self, max_transfers: int = 20) -> str:
        """A report a person can read: per-host load, estimate vs bound, the transfers."""
        hosts = HostCache()
        lines = [str(self), f"topology: {self.topology}"]
        for load in self.loads():
            secs, what = load.seconds(self.topology, hosts)
            lines.append(f"phase {load.phase}: {secs:.4g}s, bottleneck {what}")
            all_hosts = sorted(set(load.send) | set(load.recv))
            if all_hosts:
                lines.append(f"  {'host':<16} {'send MiB':>10} {'recv MiB':>10} {'send s':>9} {'recv s':>9}")
            for h in all_hosts:
                bw = self.topology.nic_bytes_per_s(h)
                s, r = load.send.get(h, 0), load.recv.get(h, 0)
                lines.append(f"  {h:<16} {s / 2**20:>10.2f} {r / 2**20:>10.2f} {s / bw:>9.4f} {r / bw:>9.4f}")
        ratio = self.estimate_seconds / self.lower_bound_seconds if self.lower_bound_seconds else 1.0
        lines.append(
            f"estimate {self.estimate_seconds:.4g}s vs lower bound {self.lower_bound_seconds:.4g}s "
            f"(ratio {ratio:.3f}); {self.network_bytes() / 2**20:.2f} MiB over the network"
        )
        total = self.num_transfers
        if "transfers" in self.__dict__ or "_table" not in self.__dict__:
            shown = self.transfers[:max_transfers]
        else:
            shown = [self.table[i] for i in range(min(total, max_transfers))]
        lines.append(f"transfers ({total}):")
        lines.extend(f"  {t}" for t in shown)
        if total > len(shown):
            lines.append(f"  ... {total - len(shown)} more (use --json for all)")
        return "\n".join(lines)


def content_id(canonical: Mapping) -> str:
    """sha256 of canonical JSON (sorted keys, no spaces): the id of a plan or a program."""
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_version(data: Mapping, what: str, version: int) -> None:
    found = data.get("version")
    if isinstance(found, bool) or found != version:
        raise PlanValidationError(
            f"{what} JSON version {brief(found)} is not supported; this reshard reads version {version}"
        )


def check_claimed_id(data: Mapping, made, what: str):
    """``made``, read from ``data``, if the id ``data`` claims (if any) is ``made``'s own."""
    claimed = data.get("id", made.id)
    if claimed != made.id:
        shown = claimed[:80] if isinstance(claimed, str) else brief(claimed)
        raise PlanValidationError(f"{what} JSON claims id {shown} but its content hashes to {made.id}; it was altered")
    return made


_LIST, _PAIR, _INT, _STR = frozenset({list}), frozenset({2}), frozenset({int}), frozenset({str})


def box_from_json(raw, what: str) -> Box:
    """A box from JSON ``[[lo, hi], ...]`` (``raw`` already an array); ``what`` names it in errors."""
    # Well-formed bounds (the usual case: a program holds one box per step) skip the checks that name each part:
    # pairs of ints, found by loops that run in C (a program holds a box per step, and its reader a million steps).
    if set(map(type, raw)) <= _LIST and set(map(len, raw)) <= _PAIR:
        box = tuple(map(tuple, raw))
        if set(map(type, chain.from_iterable(box))) <= _INT:
            return box
    out = []
    for d, bounds in enumerate(raw):
        need(bounds, "array", f"{what} dim {d}", PlanValidationError)
        if len(bounds) != 2:
            raise PlanValidationError(f"{what} dim {d} must be a [lo, hi] pair; got {describe(bounds)}")
        out.append((need(bounds[0], "integer", f"{what} dim {d} lo", PlanValidationError),
                    need(bounds[1], "integer", f"{what} dim {d} hi", PlanValidationError)))
    return tuple(out)


def strings(raw, what: str) -> tuple[str, ...]:
    """The strings of a JSON array (``raw`` already an array); ``what`` names it in errors."""
    if set(map(type, raw)) <= _STR:  # the usual case, checked in C
        return tuple(raw)
    return tuple(need(x, "string", f"{what} item {i}", PlanValidationError) for i, x in enumerate(raw))


def check_transfer(where, t: Transfer, shape: tuple[int, ...], hosts: HostCache) -> None:
    """The rules of one transfer on its own: method, box, receivers, and the route of a broadcast."""
    full = tuple((0, n) for n in shape)
    if t.method not in METHODS:
        raise PlanValidationError(f"{where}: method {t.method!r} is not one of {list(METHODS)}")
    if len(t.box) != len(shape) or not boxes.contains(full, t.box) or any(lo >= hi for lo, hi in t.box):
        raise PlanValidationError(
            f"{where}: box {boxes.box_str(t.box)} is empty or outside the tensor of shape {shape}"
        )
    if not t.receivers or len(set(t.receivers)) != len(t.receivers) or t.sender in t.receivers:
        raise PlanValidationError(f"{where}: receivers must be distinct, non-empty and exclude the sender")
    hs = hosts[t.sender]
    if t.method == "local" and any(hosts[r] != hs for r in t.receivers):
        raise PlanValidationError(f"{where}: a local transfer must stay on host {hs}")
    if t.method == "broadcast":
        remote = {hosts[r] for r in t.receivers} - {hs}
        if len(set(t.route)) != len(t.route) or set(t.route) != remote:
            raise PlanValidationError(
                f"{where}: route {list(t.route)} must list each receiving host other than the "
                f"sender's exactly once; expected the hosts {sorted(remote)}"
            )
    elif t.route:
        raise PlanValidationError(f"{where}: only broadcasts have a route")


def check_delivery(
    shape: tuple[int, ...],
    src: Sharding,
    dst: Sharding,
    transfers: Sequence[tuple[int, Transfer]],
    before: Callable[[int, int], bool],
    where: Callable[[int, Transfer], object],
    when: Callable[[int, Transfer], str],
    hosts: Optional[HostCache] = None,
) -> None:
    """Prove ``transfers`` (index, transfer) take a tensor from ``src`` to ``dst`` exactly.

    ``before(i, j)`` says whether transfer ``j`` has delivered when transfer ``i``
    starts: the phase order of a plan, the dependencies of a program. A sender
    holds a box when its source tile or one box delivered before contains it.
    ``where`` names a transfer in a message and ``when`` says when it starts.
    ``hosts`` may be shared by the calls for a program's tensors.
    """
    src_tiles = src.tiles(shape)
    dst_tiles = dst.tiles(shape)
    hosts = hosts if hosts is not None else HostCache()
    received: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    for i, t in transfers:
        place = where(i, t)
        check_transfer(place, t, shape, hosts)
        inside = None  # the last tile the box was found inside: a tile's replicas are often receivers together
        for r in t.receivers:
            tile = dst_tiles.get(r)
            if tile is None:
                raise PlanValidationError(f"{place}: receiver {r!r} is not a device of the destination mesh")
            if tile != inside and not boxes.contains(tile, t.box):
                raise PlanValidationError(
                    f"{place}: box {boxes.box_str(t.box)} is not inside receiver {r}'s tile {boxes.box_str(tile)}"
                )
            inside = tile
        own = src_tiles.get(t.sender)
        if not (own is not None and boxes.contains(own, t.box)) and not any(
            before(i, j) and boxes.contains(b, t.box) for j, b in received.get(t.sender, ())
        ):
            raise PlanValidationError(
                f"{place}: sender {t.sender} does not hold box {boxes.box_str(t.box)} {when(i, t)} "
                f"(its source tile is {boxes.box_str(own) if own is not None else 'none'})"
            )
        for r in t.receivers:
            received[r].append((i, t.box))
    # Replicas of a tile get the same boxes (a broadcast reaches them all): each distinct case is counted once.
    counted: dict[tuple, tuple[int, int]] = {}
    for dev, tile in dst_tiles.items():
        case = (tile, src_tiles.get(dev), tuple(b for _, b in received.get(dev, ())))
        found = counted.get(case)
        if found is None:
            found = counted[case] = _coverage(tile, case[1], case[2])
        missing, excess = found
        if missing or excess:
            problem = []
            if missing:
                problem.append(f"misses {missing} of its {boxes.volume(tile)} elements")
            if excess:
                problem.append(f"gets {excess} elements it already has (held or received twice)")
            raise PlanValidationError(
                f"destination device {dev} (tile {boxes.box_str(tile)}) " + " and ".join(problem)
            )


class _Where:
    """Names a transfer in an error message, formatted only if one is raised."""

    __slots__ = ("index", "transfer")

    def __init__(self, index: int, transfer: Transfer):
        self.index, self.transfer = index, transfer

    def __str__(self) -> str:
        return f"transfer {self.index} ({self.transfer})"


def _coverage(tile: Box, held_tile: Optional[Box], pieces: Sequence[Box]) -> tuple[int, int]:
    """(elements of ``tile`` nobody provides, elements provided more than once)."""
    all_pieces = list(pieces)
    if held_tile is not None:
        held = boxes.intersect(held_tile, tile)
        if held is not None:
            all_pieces.append(held)
    if len(all_pieces) == 1 and all_pieces[0] == tile:
        return 0, 0
    if not all_pieces:
        return boxes.volume(tile), 0
    if _tiles_exactly(tile, all_pieces):
        return 0, 0
    raw = np.array(all_pieces, dtype=np.int64).reshape(len(all_pieces), len(tile), 2)
    return _coverage_columns(tile, raw[:, :, 0], raw[:, :, 1])


# Up to this many pieces, `_tiles_exactly` settles the common case in Python: a few pieces that cut a tile into
# parts (a tensor-parallel tile from two of a finer split). A program checks one tile per destination device and
# tensor, a million for a state dict between 1,024-device meshes, and the numpy pass costs tens of microseconds each.
_FEW_PIECES = 8


def _tiles_exactly(tile: Box, pieces: list[Box]) -> bool:
    """Whether ``pieces`` (at most `_FEW_PIECES`) lie inside ``tile``, overlap nowhere and add up to its volume: then
    they cover it, each element once. False says nothing: `_coverage_columns` counts what is missing or twice."""
    if len(pieces) > _FEW_PIECES:
        return False
    total = 0
    for p in pieces:
        if not boxes.contains(tile, p):
            return False
        total += boxes.volume(p)
    if total != boxes.volume(tile):
        return False
    for i, a in enumerate(pieces):
        for b in pieces[i + 1:]:
            if boxes.intersect(a, b) is not None:
                return False
    return True


def _coverage_columns(tile: Box, lo: np.ndarray, hi: np.ndarray, inside: bool = False) -> tuple[int, int]:
    """`_coverage` of the pieces ``lo:hi`` (rows of bounds, at least one piece); ``inside``: they are known to lie
    in the tile."""
    t = np.array(tile, dtype=np.int64).reshape(len(tile), 2)
    outside = 0
    if not inside:
        raw_volume = boxes.volumes(lo, hi)
        lo = np.clip(lo, t[:, 0], t[:, 1])
        hi = np.clip(hi, t[:, 0], t[:, 1])
        outside = int(raw_volume.sum() - boxes.volumes(lo, hi).sum())
    # Count coverage on the grid the piece edges cut the tile into, with an
    # n-dimensional difference array so that many pieces cost one numpy pass.
    # A dim no piece cuts (each spans the whole tile there) multiplies every count by its width; leaving
    # such dims out keeps the 2**ndim corners below to the dims pieces cut, not every dim of the tensor.
    cut = [d for d in range(len(tile)) if (lo[:, d] != t[d, 0]).any() or (hi[:, d] != t[d, 1]).any()]
    whole = math.prod(hi_ - lo_ for d, (lo_, hi_) in enumerate(tile) if d not in cut)
    if not cut:
        return 0, outside + (len(lo) - 1) * whole
    lo, hi, tile = lo[:, cut], hi[:, cut], tuple(tile[d] for d in cut)
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d], tile[d]])) for d in range(len(tile))]
    lo_idx = [np.searchsorted(c, lo[:, d]) for d, c in enumerate(cuts)]
    hi_idx = [np.searchsorted(c, hi[:, d]) for d, c in enumerate(cuts)]
    diff = np.zeros([len(c) for c in cuts], dtype=np.int64)
    ndim = len(tile)
    for corner in range(1 << ndim):
        index = tuple(hi_idx[d] if corner >> d & 1 else lo_idx[d] for d in range(ndim))
        np.add.at(diff, index, -1 if bin(corner).count("1") % 2 else 1)
    counts = diff
    for d in range(ndim):
        counts = np.cumsum(counts, axis=d)
    counts = counts[tuple(slice(0, len(c) - 1) for c in cuts)]
    widths = np.ones(counts.shape, dtype=np.int64)
    for d, c in enumerate(cuts):
        shape = [1] * ndim
        shape[d] = len(c) - 1
        widths = widths * np.diff(c).reshape(shape)
    missing = int(widths[counts == 0].sum()) * whole
    excess = int((widths * np.maximum(counts - 1, 0)).sum()) * whole
    return missing, outside + excess


def _positions(space: DeviceSpace, mesh: Mesh) -> np.ndarray:
    """Per device of ``space``, its position in ``mesh``, -1 where it is not in the mesh."""
    out = np.full(len(space.devices), -1, dtype=np.int64)
    position = space.position
    at = [position.get(d, -1) for d in mesh.require_devices()]
    for p, i in enumerate(at):
        if i >= 0:
            out[i] = p
    return out


def _inside(lo: np.ndarray, hi: np.ndarray, outer_lo: np.ndarray, outer_hi: np.ndarray) -> np.ndarray:
    """Per row, whether the box ``lo:hi`` lies in the box ``outer_lo:outer_hi``."""
    return (outer_lo <= lo).all(axis=1) & (hi <= outer_hi).all(axis=1)


def _delivers(shape: tuple[int, ...], src: Sharding, dst: Sharding, table: TransferTable) -> bool:
    """Whether the columns prove every rule `check_transfer` and `check_delivery` check (phases ordering
    `before`, as `Plan.validate` has it). False leaves the verdict, and the message, to the plain check."""
    n, ndim = len(table), len(shape)
    space = table.space
    lo, hi, sender, method = table.lo, table.hi, table.sender, table.method
    if lo.shape != (n, ndim) or hi.shape != (n, ndim):
        return False
    if n and not ((lo >= 0).all() and (lo < hi).all() and (hi <= np.array(shape, dtype=np.int64)).all()):
        return False
    count = np.diff(table.recv_ptr)
    if n and count.min() < 1:
        return False
    t_of = np.repeat(np.arange(n), count)
    r = table.recv
    one_each = len(r) == n and bool((count == 1).all())
    if (r == sender[t_of]).any() or not (one_each or _distinct(t_of * len(space.devices) + r)):
        return False
    host = space.device_host
    rh, hs = host[r], host[sender]
    m = method[t_of]
    if ((m == LOCAL) & (rh != hs[t_of])).any():
        return False
    route_len = np.diff(table.route_ptr)
    if ((route_len > 0) & (method != BROADCAST)).any():
        return False
    num_hosts = len(space.hosts)
    route = np.repeat(np.arange(n), route_len) * num_hosts + table.route
    remote = (m == BROADCAST) & (rh != hs[t_of])
    route = np.sort(route)
    if not _distinct(route) or not np.array_equal(route, np.unique(t_of[remote] * num_hosts + rh[remote])):
        return False
    dst_lo, dst_hi = tile_arrays(dst, shape)
    at_dst = _positions(space, dst.mesh)[r]
    if (at_dst < 0).any() or not _inside(lo[t_of], hi[t_of], dst_lo[at_dst], dst_hi[at_dst]).all():
        return False
    src_lo, src_hi = tile_arrays(src, shape)
    src_at = _positions(space, src.mesh)
    at_src = src_at[sender]
    holds = at_src >= 0
    holds[holds] = _inside(lo[holds], hi[holds], src_lo[at_src[holds]], src_hi[at_src[holds]])
    if not holds.all() and not _forwarded(table, t_of, np.flatnonzero(~holds)):
        return False
    return _covers(dst, table, t_of, at_dst, src_at, (src_lo, src_hi), (dst_lo, dst_hi))


def _distinct(values: np.ndarray) -> bool:
    ordered = np.sort(values)
    return not (ordered[1:] == ordered[:-1]).any()


def _forwarded(table: TransferTable, t_of: np.ndarray, lacking: np.ndarray) -> bool:
    """Whether each transfer of ``lacking``, whose sender's source tile lacks its box, has it delivered to its
    sender whole by one transfer listed before it, of an earlier phase."""
    senders = table.sender[lacking]
    to_them = np.flatnonzero(np.isin(table.recv, senders))
    order = np.argsort(table.recv[to_them], kind="stable")
    got_by, got = table.recv[to_them][order], t_of[to_them][order]
    lo, hi, phase = table.lo, table.hi, table.phase
    for i, s in zip(lacking.tolist(), senders.tolist()):
        j = got[np.searchsorted(got_by, s):np.searchsorted(got_by, s, side="right")]
        if not ((j < i) & (phase[j] < phase[i]) & _inside(lo[i], hi[i], lo[j], hi[j])).any():
            return False
    return True


def _covers(dst: Sharding, table: TransferTable, t_of, at_dst, src_at, src_tiles, dst_tiles) -> bool:
    """Whether every destination device gets its whole tile, every element once, held or received."""
    dst_lo, dst_hi = dst_tiles
    order = np.argsort(at_dst, kind="stable")
    start = np.searchsorted(at_dst[order], np.arange(dst.mesh.size + 1))
    pieces = t_of[order]
    dst_devices = dst.mesh.require_devices()
    position = table.space.position
    for q, (a, b) in enumerate(zip(start.tolist(), start[1:].tolist())):
        tile_lo, tile_hi = dst_lo[q], dst_hi[q]
        lo, hi = table.lo[pieces[a:b]], table.hi[pieces[a:b]]
        i = position.get(dst_devices[q], -1)
        p = src_at[i] if i >= 0 else -1
        if p >= 0:
            held_lo, held_hi = np.maximum(src_tiles[0][p], tile_lo), np.minimum(src_tiles[1][p], tile_hi)
            if (held_lo < held_hi).all():
                lo, hi = np.vstack([lo, held_lo]), np.vstack([hi, held_hi])
        tile = tuple(zip(tile_lo.tolist(), tile_hi.tolist()))
        if not len(lo):
            if boxes.volume(tile):
                return False
            continue
        if len(lo) == 1 and (lo[0] == tile_lo).all() and (hi[0] == tile_hi).all():
            continue
        if _coverage_columns(tile, lo, hi, inside=True) != (0, 0):
            return False
    return True
