"""Plans: the transfers that move a tensor from one sharding to another, as plain data.

A plan is transport-neutral: boxes, senders, receivers, method, phase and, for
broadcasts, the chain of hosts. It serialises to JSON, has a stable content hash
(its id) and is validated completely before anything moves.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import numpy as np

from reshard import box as boxes
from reshard.cost import HostCache, PhaseLoad, estimate_seconds, lower_bound_seconds, phase_loads
from reshard.dtypes import dtype_name, itemsize
from reshard.errors import PlanValidationError
from reshard.jsonio import brief, describe, field_of, loads, need
from reshard.sharding import Box, Sharding, normalise_shape
from reshard.tasks import decompose
from reshard.topology import Topology

__all__ = [
    "Transfer",
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
        out.update(self._extras())
        out["id"] = self.id
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json())


@dataclass(frozen=True)
class Plan(ContentAddressed):
    """How to move a tensor of ``shape`` and ``dtype`` from ``src`` to ``dst``."""

    shape: tuple[int, ...]
    dtype: str
    src: Sharding
    dst: Sharding
    strategy: str
    transfers: tuple[Transfer, ...]
    topology: Topology = field(default_factory=Topology, compare=False)

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
        return phase_loads(self.transfers, self.itemsize)

    def estimate(self, topology: Optional[Topology] = None) -> float:
        """Seconds on the fluid model: per phase the busiest link, phases added."""
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
            "transfers": [t.to_json() for t in self.transfers],
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
            f"{self.src.spec_str()} -> {self.dst.spec_str()}, {len(self.transfers)} transfers, "
            f"estimate {self.estimate_seconds:.4g}s, lower bound {self.lower_bound_seconds:.4g}s"
        )

    def summary(self, max_transfers: int = 20) -> str:
        """A report a person can read: per-host load, estimate vs bound, the transfers."""
        hosts = HostCache()
        lines = [str(self), f"topology: {self.topology}"]
        for load in phase_loads(self.transfers, self.itemsize, hosts):
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
        shown = self.transfers[:max_transfers]
        lines.append(f"transfers ({len(self.transfers)}):")
        lines.extend(f"  {t}" for t in shown)
        if len(self.transfers) > len(shown):
            lines.append(f"  ... {len(self.transfers) - len(shown)} more (use --json for all)")
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


def box_from_json(raw, what: str) -> Box:
    """A box from JSON ``[[lo, hi], ...]`` (``raw`` already an array); ``what`` names it in errors."""
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
) -> None:
    """Prove ``transfers`` (index, transfer) take a tensor from ``src`` to ``dst`` exactly.

    ``before(i, j)`` says whether transfer ``j`` has delivered when transfer ``i``
    starts: the phase order of a plan, the dependencies of a program. A sender
    holds a box when its source tile or one box delivered before contains it.
    ``where`` names a transfer in a message and ``when`` says when it starts.
    """
    src_tiles = src.tiles(shape)
    dst_tiles = dst.tiles(shape)
    hosts = HostCache()
    received: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    for i, t in transfers:
        place = where(i, t)
        check_transfer(place, t, shape, hosts)
        for r in t.receivers:
            tile = dst_tiles.get(r)
            if tile is None:
                raise PlanValidationError(f"{place}: receiver {r!r} is not a device of the destination mesh")
            if not boxes.contains(tile, t.box):
                raise PlanValidationError(
                    f"{place}: box {boxes.box_str(t.box)} is not inside receiver {r}'s tile {boxes.box_str(tile)}"
                )
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
    for dev, tile in dst_tiles.items():
        missing, excess = _coverage(tile, src_tiles.get(dev), [b for _, b in received.get(dev, ())])
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
    # Count coverage on the grid the piece edges cut the tile into, with an
    # n-dimensional difference array so that many pieces cost one numpy pass.
    raw = np.array(all_pieces, dtype=np.int64).reshape(len(all_pieces), len(tile), 2)
    t = np.array(tile, dtype=np.int64).reshape(len(tile), 2)
    lo = np.clip(raw[:, :, 0], t[:, 0], t[:, 1])
    hi = np.clip(raw[:, :, 1], t[:, 0], t[:, 1])
    outside = int(np.prod(raw[:, :, 1] - raw[:, :, 0], axis=1).sum() - np.prod(hi - lo, axis=1).sum())
    # A dim no piece cuts (each spans the whole tile there) multiplies every count by its width; leaving
    # such dims out keeps the 2**ndim corners below to the dims pieces cut, not every dim of the tensor.
    cut = [d for d in range(len(tile)) if (lo[:, d] != t[d, 0]).any() or (hi[:, d] != t[d, 1]).any()]
    whole = math.prod(hi_ - lo_ for d, (lo_, hi_) in enumerate(tile) if d not in cut)
    if not cut:
        return 0, outside + (len(all_pieces) - 1) * whole
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
