"""Device meshes: named axes laid over device ids.

Notation
--------
device id   ``"HOST/INDEX"``, e.g. ``"node3/1"``; the host is everything before the last ``/``.
axis        a named mesh dimension with a size, e.g. ``x=2``.
mesh        ``Mesh({"x": 2, "y": 4}, devices)``: devices listed row-major over the axes
            (the last axis changes fastest), so device ``i`` has coordinates
            ``numpy.unravel_index(i, mesh.shape)``.
abstract    a mesh without devices; it can compute tiles but not plans.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from reshard.errors import InvalidMeshError
from reshard.jsonio import field_of, need

__all__ = ["Mesh", "host_of"]


def host_of(device: str) -> str:
    """The host part of a device id (everything before the last ``/``)."""
    host, sep, index = device.rpartition("/")
    if not sep or not host or not index:
        raise InvalidMeshError(
            f"device id {device!r} has no host: a device id is 'HOST/INDEX' "
            f"with a non-empty host and index, e.g. 'node3/1'"
        )
    return host


def _normalise_axes(axes) -> tuple[tuple[str, int], ...]:
    items = list(axes.items()) if isinstance(axes, Mapping) else list(axes)
    if not items:
        raise InvalidMeshError("a mesh needs at least one axis, e.g. {'x': 2}")
    out = []
    seen = set()
    for item in items:
        if not (isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2):
            raise InvalidMeshError(
                f"mesh axis {item!r} is not a (name, size) pair; pass axes as a mapping "
                f"like {{'x': 2, 'y': 4}} or pairs like [('x', 2), ('y', 4)]"
            )
        name, size = item
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidMeshError(
                f"mesh axis name {name!r} is not valid: axis names are identifiers like 'x' or 'rows'"
            )
        if name in seen:
            raise InvalidMeshError(f"mesh axis {name!r} appears twice; each axis name must be unique")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidMeshError(
                f"mesh axis {name!r} has size {size!r}; axis sizes must be positive integers"
            )
        seen.add(name)
        out.append((name, int(size)))
    return tuple(out)


@dataclass(frozen=True)
class Mesh:
    """Named axes over a row-major list of device ids (or none: an abstract mesh)."""

    axes: tuple[tuple[str, int], ...]
    devices: Optional[tuple[str, ...]] = None

    def __init__(self, axes, devices: Optional[Iterable[str]] = None):
        norm = _normalise_axes(axes)
        object.__setattr__(self, "axes", norm)
        if devices is not None:
            devices = tuple(devices)
            size = math.prod(s for _, s in norm)
            if len(devices) != size:
                shape = " x ".join(f"{n}={s}" for n, s in norm)
                raise InvalidMeshError(
                    f"mesh ({shape}) has {size} positions but {len(devices)} devices were given; "
                    f"list exactly {size} device ids, row-major over the axes"
                )
            for d in devices:
                if not isinstance(d, str):
                    raise InvalidMeshError(f"device id {d!r} is not a string like 'node0/1'")
                host_of(d)
            if len(set(devices)) != len(devices):
                dup = sorted(d for d, n in Counter(devices).items() if n > 1)
                raise InvalidMeshError(
                    f"devices {dup} appear more than once in the mesh; each device may hold one position"
                )
        object.__setattr__(self, "devices", devices)

    # -- construction helpers -------------------------------------------------

    @classmethod
    def from_hosts(cls, axes, hosts: Sequence[str], devices_per_host: Optional[int] = None) -> "Mesh":
        """A mesh whose devices fill ``hosts`` in order, ``devices_per_host`` each.

        ``Mesh.from_hosts({"x": 2, "y": 4}, ["a", "b"])`` puts ``a/0..a/3`` on row ``x=0``.
        """
        norm = _normalise_axes(axes)
        size = math.prod(s for _, s in norm)
        hosts = list(hosts)
        if not hosts:
            raise InvalidMeshError("from_hosts needs at least one host name")
        if devices_per_host is None:
            if size % len(hosts):
                raise InvalidMeshError(
                    f"{size} mesh positions do not divide evenly over {len(hosts)} hosts; "
                    f"pass devices_per_host or a host count that divides {size}"
                )
            devices_per_host = size // len(hosts)
        if devices_per_host * len(hosts) != size:
            raise InvalidMeshError(
                f"{len(hosts)} hosts x {devices_per_host} devices = {len(hosts) * devices_per_host} "
                f"devices, but the mesh has {size} positions"
            )
        devices = [f"{h}/{i}" for h in hosts for i in range(devices_per_host)]
        return cls(norm, devices)

    @classmethod
    def grid(cls, axes, devices_per_host: int, host_prefix: str = "node", first_host: int = 0) -> "Mesh":
        """A mesh on hosts ``{prefix}{first_host}``, ``{prefix}{first_host+1}``, ... filled in order."""
        norm = _normalise_axes(axes)
        size = math.prod(s for _, s in norm)
        if devices_per_host <= 0 or size % devices_per_host:
            raise InvalidMeshError(
                f"devices_per_host={devices_per_host} must be positive and divide the mesh size {size}"
            )
        hosts = [f"{host_prefix}{first_host + i}" for i in range(size // devices_per_host)]
        return cls.from_hosts(norm, hosts, devices_per_host)

    # -- queries --------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_abstract(self) -> bool:
        return self.devices is None

    def axis_size(self, name: str) -> int:
        for n, s in self.axes:
            if n == name:
                return s
        raise InvalidMeshError(
            f"mesh has no axis {name!r}; its axes are {list(self.axis_names)}"
        )

    def axis_index(self, name: str) -> int:
        for i, (n, _) in enumerate(self.axes):
            if n == name:
                return i
        raise InvalidMeshError(
            f"mesh has no axis {name!r}; its axes are {list(self.axis_names)}"
        )

    def coords(self, position: int) -> tuple[int, ...]:
        """Coordinates of mesh position ``position`` (row-major, last axis fastest)."""
        out = []
        for s in reversed(self.shape):
            out.append(position % s)
            position //= s
        return tuple(reversed(out))

    def require_devices(self) -> tuple[str, ...]:
        if self.devices is None:
            raise InvalidMeshError(
                f"mesh {self} is abstract (no devices); planning needs device ids: "
                f"use Mesh(axes, devices), Mesh.from_hosts or Mesh.grid"
            )
        return self.devices

    @property
    def hosts(self) -> tuple[str, ...]:
        """Hosts of the mesh's devices, in first-appearance order."""
        hosts = self.__dict__.get("_hosts")
        if hosts is None:
            hosts = tuple(dict.fromkeys(host_of(d) for d in self.require_devices()))
            object.__setattr__(self, "_hosts", hosts)  # not a field: equality, hashing and repr ignore it
        return hosts

    def __hash__(self) -> int:
        # Kept once worked out: meshes (and the shardings that hold them) key the planner's per-tensor tables,
        # a state dict's hundreds of times per job, and hashing the device tuple each time showed.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.axes, self.devices))
            object.__setattr__(self, "_hash", h)
        return h

    def position(self, device: str) -> int:
        try:
            return self.require_devices().index(device)
        except ValueError:
            raise InvalidMeshError(f"device {device!r} is not in mesh {self}") from None

    # -- serialisation ----------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "axes": [[n, s] for n, s in self.axes],
            "devices": None if self.devices is None else list(self.devices),
        }

    @classmethod
    def from_json(cls, data) -> "Mesh":
        """Read what `to_json` writes: ``{"axes": [[name, size], ...], "devices": [id, ...] or null}``."""
        need(data, "object", "mesh JSON", InvalidMeshError)
        axes = field_of(data, "axes", "array", "mesh JSON", InvalidMeshError)
        for i, axis in enumerate(axes):
            need(axis, "array", f"mesh JSON axis {i} (a [name, size] pair)", InvalidMeshError)
        devices = data.get("devices")
        if devices is not None:
            need(devices, "array", "mesh JSON field 'devices' (device ids, or null for an abstract mesh)",
                 InvalidMeshError)
        return cls([tuple(a) for a in axes], devices)

    def __str__(self) -> str:
        inner = ", ".join(f"{n}={s}" for n, s in self.axes)
        if self.devices is None:
            return f"Mesh({inner}, abstract)"
        hosts = self.hosts
        shown = ",".join(hosts[:3]) + (",..." if len(hosts) > 3 else "")
        return f"Mesh({inner} on {len(hosts)} hosts [{shown}])"
