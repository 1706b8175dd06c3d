"""Shardings: which mesh axes split which tensor dims, and the tile each device holds.

Notation
--------
spec        one entry per tensor dim: ``None`` (not split), an axis name, or a tuple of
            axis names (the first is major), as in JAX's ``PartitionSpec``. Printed
            ``P('x', None, ('y', 'z'))``. Axes named nowhere replicate the tensor.
partial     mesh axes along which devices hold *addends*: the tensor is the sum over those
            axes of what the devices hold (DTensor's ``Partial()``, JAX's ``unreduced``).
            A partial axis splits no dim; every device along it holds a full tile of
            addends. Printed ``P('x', None) + partial(y)``.
placements  DTensor's per-mesh-axis view: ``Shard(d)``, ``Replicate()`` or ``Partial()``,
            short ``S(0)RP``; torch's own placement objects are read as these.
tile        the box ``((lo, hi), ...)`` of the global tensor a device holds. A dim split
            over axes ``(a1, a2, ...)`` is cut by ``a1`` first, then each piece by ``a2``;
            a piece of length ``m`` cut ``k`` ways has chunks of ``ceil(m / k)``, so
            trailing chunks may be smaller or empty (``torch.chunk`` semantics). This
            is exactly DTensor's local shard, and JAX's shard (JAX splits evenly only).
frameworks  ``from_device_mesh`` (a torch ``DeviceMesh`` and placements) and
            ``from_named_sharding`` (a JAX ``NamedSharding``) read a framework's layout,
            given ``devices``: the reshard device of each framework device, by global
            rank or JAX device id. torch and JAX objects are read by their attributes and
            class names, never imported: the core loads numpy only.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Mapping, Sequence, Set as AbstractSet
from dataclasses import dataclass
from typing import Union

import numpy as np

from reshard.errors import InvalidMeshError, InvalidShapeError, InvalidShardingError
from reshard.jsonio import brief, field_of, need
from reshard.mesh import Mesh

__all__ = ["Sharding", "Shard", "Replicate", "Partial", "Box", "normalise_shape", "chunk_bounds", "MAX_NDIM"]

Box = tuple[tuple[int, int], ...]
SpecEntry = Union[None, str, Sequence[str]]


@dataclass(frozen=True)
class Shard:
    """DTensor placement: this mesh axis splits tensor dim ``dim``."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """DTensor placement: the tensor is replicated along this mesh axis."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """DTensor placement: devices along this mesh axis hold addends; the tensor is their sum."""

    def __repr__(self) -> str:
        return "Partial()"

    def __str__(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]


# numpy arrays have at most 64 dims, and numpy, torch and the wire count elements in int64.
MAX_NDIM = 64
_MAX_SIZE = 2**63 - 1


def normalise_shape(shape) -> tuple[int, ...]:
    # Most callers pass a shape that is normal already (a planner checks a state dict's shapes thousands of times
    # a job): a tuple of plain ints in range comes back as it is.
    if type(shape) is tuple and len(shape) <= MAX_NDIM and all(type(s) is int and 0 < s <= _MAX_SIZE
                                                                for s in shape):
        return shape
    if isinstance(shape, (str, bytes, Mapping)):
        raise InvalidShapeError(f"shape {brief(shape)} is not a sequence of sizes like (1024, 512)")
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidShapeError(f"shape {brief(shape)} is not a sequence of sizes like (1024, 512)") from None
    if len(dims) > MAX_NDIM:
        raise InvalidShapeError(f"shape has {len(dims)} dims; a tensor has at most {MAX_NDIM} (numpy's limit)")
    out = []
    for i, s in enumerate(dims):
        try:  # any integer: numpy's too (a size worked out with np.prod), but not a bool or a float
            n = None if isinstance(s, (bool, np.bool_)) else operator.index(s)
        except TypeError:
            n = None
        if n is None or not 0 < n <= _MAX_SIZE:
            raise InvalidShapeError(
                f"dim {i} of shape {tuple(map(_plain, dims))} has size {_plain(s)!r}; every dim size must be a "
                f"positive integer (below 2**63)"
            )
        out.append(n)
    return tuple(out)


def _plain(value):
    """A numpy scalar as the Python number it holds, for messages: 3, not np.int64(3)."""
    return value.item() if isinstance(value, np.generic) else value


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk`` bounds of chunk ``index`` when ``length`` is cut ``parts`` ways."""
    c = -(-length // parts)
    return min(index * c, length), min((index + 1) * c, length)


def _normalise_spec(mesh: Mesh, spec) -> tuple[tuple[str, ...], ...]:
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise InvalidShardingError(
            f"spec {spec!r} must be a sequence with one entry per tensor dim, "
            f"each None, an axis name or a tuple of axis names, e.g. ('x', None)"
        )
    names = mesh.axis_names
    used: dict[str, int] = {}
    out = []
    for dim, entry in enumerate(spec):
        if entry is None:
            axes: tuple[str, ...] = ()
        elif isinstance(entry, str):
            axes = (entry,)
        elif isinstance(entry, Sequence) and all(isinstance(a, str) for a in entry):
            axes = tuple(entry)
        else:
            raise InvalidShardingError(
                f"spec entry {entry!r} for dim {dim} must be None, an axis name or a tuple of axis names"
            )
        for a in axes:
            if a not in names:
                raise InvalidShardingError(
                    f"dim {dim} is split over unknown axis {a!r}; the mesh's axes are {list(names)}"
                )
            if a in used:
                where = "the same dim" if used[a] == dim else f"dim {used[a]}"
                raise InvalidShardingError(
                    f"axis {a!r} splits dim {dim} but is already used by {where}; "
                    f"a mesh axis may split at most one tensor dim, once"
                )
            used[a] = dim
        out.append(axes)
    return tuple(out)


def _normalise_partial(mesh: Mesh, spec: tuple[tuple[str, ...], ...], partial) -> tuple[str, ...]:
    """The partial axes in mesh order (their order means nothing: a sum is a sum)."""
    if isinstance(partial, str):
        partial = (partial,)
    if (isinstance(partial, bytes) or not isinstance(partial, (Sequence, AbstractSet))
            or not all(isinstance(a, str) for a in partial)):
        raise InvalidShardingError(
            f"partial {partial!r} must be a tuple of mesh axis names, e.g. ('y',); the mesh's axes are "
            f"{list(mesh.axis_names)}"
        )
    partial = tuple(partial)
    names = mesh.axis_names
    splitting = {a: d for d, axes in enumerate(spec) for a in axes}
    for a in partial:
        if a not in names:
            raise InvalidShardingError(
                f"partial axis {a!r} is not an axis of the mesh; the mesh's axes are {list(names)}"
            )
        if partial.count(a) > 1:
            raise InvalidShardingError(
                f"partial axes {partial} name {a!r} {partial.count(a)} times; a tensor is summed over each "
                f"mesh axis at most once, so list each axis once"
            )
        if a in splitting:
            raise InvalidShardingError(
                f"axis {a!r} is partial but also splits dim {splitting[a]}; devices along a partial axis hold "
                f"whole tiles of addends, so an axis is either partial or splits a dim (drop {a!r} from the "
                f"spec or from partial)"
            )
    return tuple(sorted(partial, key=names.index))


def _own_placement(p, axis: str) -> Placement:
    """reshard's placement for ``p``: reshard's own, or torch.distributed.tensor's ``Shard``, ``Replicate`` or
    ``Partial``, recognised by class name (a caller holding one has torch loaded; the core never imports it)."""
    if isinstance(p, (Shard, Replicate, Partial)):
        return p
    kind = type(p)
    if not kind.__module__.startswith("torch.distributed"):
        raise InvalidShardingError(
            f"placement {p!r} on axis {axis!r} is not Shard(d), Replicate() or Partial() (reshard's or "
            f"torch.distributed.tensor's)"
        )
    if kind.__name__ == "Shard":
        return Shard(int(p.dim))
    if kind.__name__ == "Replicate":
        return Replicate()
    if kind.__name__ == "Partial":
        if p.reduce_op != "sum":
            raise InvalidShardingError(
                f"placement {p!r} on axis {axis!r} reduces by {p.reduce_op!r}, but reshard completes a Partial "
                f"tensor by summing its addends; redistribute it to Replicate() or Partial('sum') first"
            )
        return Partial()
    raise InvalidShardingError(
        f"placement {p!r} on axis {axis!r} is torch's {kind.__name__}, not Shard(d), Replicate() or Partial(); "
        f"reshard lays out torch.chunk tiles only, so redistribute the DTensor to those placements first"
    )


def _devices_of(devices, keys: list[int], what: str) -> list[str]:
    """The reshard device of each framework device in ``keys`` (global ranks, JAX device ids), by ``devices[key]``."""
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (Sequence, Mapping)):
        raise InvalidMeshError(
            f"devices must map each {what} to a reshard device: a list indexed by {what} or a dict "
            f"{{{what}: 'host/index'}}; got {type(devices).__name__}"
        )
    out = []
    for key in keys:
        try:
            out.append(devices[key])
        except (KeyError, IndexError):
            raise InvalidMeshError(
                f"devices has no entry for {what} {key}, which the mesh holds (its {what}s are {keys}); give "
                f"devices as a list indexed by {what} or a dict {{{what}: 'host/index'}} covering every one"
            ) from None
    return out


def _entry_str(axes: tuple[str, ...]) -> str:
    if not axes:
        return "None"
    if len(axes) == 1:
        return repr(axes[0])
    return "(" + ", ".join(repr(a) for a in axes) + ")"


_TILES_KEPT = 4096
_TILES: dict = {}  # (sharding, shape) -> {device: tile}: `Sharding.tiles`


@dataclass(frozen=True)
class Sharding:
    """A tensor laid out on a mesh: ``Sharding(mesh, ('x', None))``; with ``partial=('y',)`` the tensor is the
    sum over mesh axis ``y`` of what the devices hold."""

    mesh: Mesh
    spec: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    def __init__(self, mesh: Mesh, spec: Sequence[SpecEntry], partial: Sequence[str] = ()):
        if not isinstance(mesh, Mesh):
            raise InvalidShardingError(f"mesh must be a reshard.Mesh, got {type(mesh).__name__}")
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "spec", _normalise_spec(mesh, spec))
        object.__setattr__(self, "partial", _normalise_partial(mesh, self.spec, partial))

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")  # kept once worked out, as `Mesh.__hash__` is
        if h is None:
            h = hash((self.mesh, self.spec, self.partial))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other) -> bool:
        # The planner compares a state dict's layouts tensor by tensor each job (a base pair's against the job's),
        # mostly equal objects parsed apart: the kept hashes settle most unequal pairs without the meshes' devices
        if self is other:
            return True
        if type(other) is not Sharding:
            return NotImplemented
        return hash(self) == hash(other) and (self.mesh, self.spec, self.partial) == (other.mesh, other.spec,
                                                                                       other.partial)

    @property
    def is_partial(self) -> bool:
        """Whether devices hold addends along some axis (the value is pending a sum)."""
        return bool(self.partial)

    def without_partial(self) -> "Sharding":
        """The same layout holding the summed tensor: the partial axes become replicas."""
        return Sharding(self.mesh, self.spec)

    # -- other vocabularies ------------------------------------------------------

    @classmethod
    def from_layout_rules(cls, mesh: Mesh, dim_names: Sequence[str], rules: Mapping[str, SpecEntry]) -> "Sharding":
        """Mesh-TensorFlow layout: ``rules`` maps tensor dim names to mesh axes.

        Rules are global, as in Mesh-TensorFlow: a rule for a dim name this tensor
        does not have is ignored, and an unnamed dim is not split.
        """
        dim_names = list(dim_names)
        if len(set(dim_names)) != len(dim_names):
            raise InvalidShardingError(f"dim names {dim_names} repeat a name; each tensor dim needs its own name")
        return cls(mesh, [rules.get(n) for n in dim_names])

    @classmethod
    def from_placements(cls, mesh: Mesh, placements: Sequence[Placement], ndim: int | None = None) -> "Sharding":
        """DTensor placements, one per mesh axis: ``[Shard(0), Replicate()]``; ``Partial()`` marks a partial axis.

        torch's own ``Shard``, ``Replicate`` and ``Partial()`` (a sum) are read as reshard's. With ``ndim``, a
        negative ``Shard`` dim counts from the last dim, as in torch.
        """
        placements = list(placements)
        if len(placements) != len(mesh.axes):
            raise InvalidShardingError(
                f"{len(placements)} placements given for a mesh with {len(mesh.axes)} axes "
                f"{list(mesh.axis_names)}; give one Shard(d), Replicate() or Partial() per mesh axis"
            )
        dims: dict[int, list[str]] = {}
        partial = []
        for (name, _), p in zip(mesh.axes, placements):
            p = _own_placement(p, name)
            if isinstance(p, Shard):
                dim = p.dim + ndim if ndim is not None and -ndim <= p.dim < 0 else p.dim
                if dim < 0:
                    raise InvalidShardingError(
                        f"Shard({p.dim}) on axis {name!r}: dims must be >= 0"
                        + (f" (or at least -{ndim} for a tensor of {ndim} dims)" if ndim is not None else
                           "; a negative dim counts from the last only when ndim is given")
                    )
                dims.setdefault(dim, []).append(name)
            elif isinstance(p, Partial):
                partial.append(name)
        needed = max(dims, default=-1) + 1
        if ndim is None:
            ndim = needed
        elif ndim < needed:
            raise InvalidShardingError(f"placements shard dim {needed - 1} but ndim is {ndim}")
        return cls(mesh, [tuple(dims.get(d, ())) or None for d in range(ndim)], partial)

    @classmethod
    def from_device_mesh(cls, device_mesh, placements: Sequence, devices, ndim: int | None = None) -> "Sharding":
        """A DTensor's layout: a torch ``DeviceMesh`` and one placement per mesh dim.

        Mesh axes take the ``DeviceMesh``'s ``mesh_dim_names`` (``dim0``, ``dim1``, ... when it has none) and
        sizes. ``devices[r]`` is the reshard device (``"host/index"``) of global rank ``r``: a list indexed by
        rank or a dict ``{rank: device}``, so one table serves every mesh of a job; the reshard mesh lists them
        in row-major order of ``device_mesh.mesh``.
        """
        ranks = getattr(device_mesh, "mesh", None)
        if not (hasattr(ranks, "shape") and hasattr(ranks, "flatten")):
            raise InvalidMeshError(
                f"device_mesh must be a torch.distributed DeviceMesh (its .mesh holds the ranks), got "
                f"{type(device_mesh).__name__}"
            )
        sizes = tuple(int(s) for s in ranks.shape)
        names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(sizes)))
        mesh = Mesh(list(zip(names, sizes)), _devices_of(devices, [int(r) for r in ranks.flatten().tolist()], "rank"))
        return cls.from_placements(mesh, placements, ndim)

    @classmethod
    def from_named_sharding(cls, named_sharding, devices) -> "Sharding":
        """JAX's layout: a ``NamedSharding``, its mesh and ``PartitionSpec`` (``unreduced`` axes are partial).

        ``devices[i]`` is the reshard device (``"host/index"``) of the JAX device whose ``id`` is ``i``: a list
        indexed by id, or a dict keyed by id or by JAX device; the reshard mesh lists them in row-major order of
        the JAX mesh's devices.
        """
        jax_mesh, spec = getattr(named_sharding, "mesh", None), getattr(named_sharding, "spec", None)
        jax_devices = getattr(jax_mesh, "devices", None)
        if spec is None or not (hasattr(jax_devices, "flat") and hasattr(jax_devices, "shape")):
            raise InvalidShardingError(
                f"{named_sharding!r} is not a jax NamedSharding over a concrete Mesh; give "
                f"NamedSharding(Mesh(devices, axis_names), PartitionSpec(...))"
            )
        if getattr(spec, "reduced", None):
            raise InvalidShardingError(
                f"PartitionSpec {spec} has reduced axes {sorted(spec.reduced)}, which reshard does not lay out; "
                f"give a spec without reduced="
            )
        entries = []
        for dim, entry in enumerate(getattr(spec, "partitions", spec)):
            if not (entry is None or isinstance(entry, str)
                    or isinstance(entry, tuple) and all(isinstance(a, str) for a in entry)):
                raise InvalidShardingError(
                    f"PartitionSpec entry {entry!r} for dim {dim} of {spec} is not None, an axis name or a tuple of "
                    f"axis names; reshard needs the layout itself (P.UNCONSTRAINED leaves it to the compiler)"
                )
            entries.append(entry)
        if isinstance(devices, Mapping):
            devices = {getattr(k, "id", k): v for k, v in devices.items()}
        ids = [int(d.id) for d in jax_devices.flat]
        mesh = Mesh(list(zip(jax_mesh.axis_names, jax_devices.shape)), _devices_of(devices, ids, "JAX device id"))
        return cls(mesh, entries, tuple(getattr(spec, "unreduced", None) or ()))

    @property
    def placements(self) -> tuple[Placement, ...]:
        """DTensor placements, one per mesh axis.

        DTensor cuts a dim split over several mesh axes in mesh-axis order, so a
        dim whose major axis comes later in the mesh has no `Shard` form.
        """
        order = {n: i for i, n in enumerate(self.mesh.axis_names)}
        for d, axes in enumerate(self.spec):
            if list(axes) != sorted(axes, key=order.__getitem__):
                raise InvalidShardingError(
                    f"dim {d} is split over {axes}, major axis first, but DTensor's Shard placements cut a dim "
                    f"in mesh-axis order {self.mesh.axis_names}; this layout has no Shard/Replicate form "
                    f"(list the dim's axes in mesh order, or use the spec {self.spec_str()} directly)"
                )
        by_axis = {a: d for d, axes in enumerate(self.spec) for a in axes}
        return tuple(Shard(by_axis[n]) if n in by_axis else Partial() if n in self.partial else Replicate()
                     for n in self.mesh.axis_names)

    # -- tiles ---------------------------------------------------------------------

    def check_shape(self, shape) -> tuple[int, ...]:
        shape = normalise_shape(shape)
        if len(self.spec) > len(shape):
            raise InvalidShardingError(
                f"spec {self.spec_str()} has {len(self.spec)} entries but the tensor has "
                f"{len(shape)} dims {shape}; give at most one entry per dim"
            )
        return shape

    def dim_axes(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        return self.spec + ((),) * (ndim - len(self.spec))

    def dim_chunks(self, shape) -> list[list[tuple[int, int]]]:
        """Per dim, the interval of every chunk index (row-major over the dim's axes)."""
        shape = self.check_shape(shape)
        out = []
        for length, axes in zip(shape, self.dim_axes(len(shape))):
            pieces = [(0, length)]
            for a in axes:
                k = self.mesh.axis_size(a)
                pieces = [
                    (lo + b0, lo + b1)
                    for lo, hi in pieces
                    for b0, b1 in (chunk_bounds(hi - lo, k, i) for i in range(k))
                ]
            out.append(pieces)
        return out

    def chunk_index(self, position: int, ndim: int) -> tuple[int, ...]:
        """Per dim, which chunk the device at mesh ``position`` holds."""
        coords = dict(zip(self.mesh.axis_names, self.mesh.coords(position)))
        index = []
        for axes in self.dim_axes(ndim):
            i = 0
            for a in axes:
                i = i * self.mesh.axis_size(a) + coords[a]
            index.append(i)
        return tuple(index)

    def tile(self, shape, device_or_position) -> Box:
        """The box of the global tensor held by a device (id or mesh position)."""
        shape = self.check_shape(shape)
        pos = device_or_position
        if isinstance(pos, str):
            pos = self.mesh.position(pos)
        chunks = self.dim_chunks(shape)
        return tuple(chunks[d][i] for d, i in enumerate(self.chunk_index(pos, len(shape))))

    def tiles(self, shape) -> dict[str, Box]:
        """Every device's tile, by device id (a new dict each call; the layouts of a state dict repeat, so the
        tiles of the last `_TILES_KEPT` (sharding, shape) pairs are kept)."""
        shape = self.check_shape(shape)
        devices = self.mesh.require_devices()  # first: an abstract mesh's axes may be any size
        key = (self, shape)
        kept = _TILES.get(key)
        if kept is None:
            chunks = self.dim_chunks(shape)
            kept = {
                dev: tuple(chunks[d][i] for d, i in enumerate(self.chunk_index(p, len(shape))))
                for p, dev in enumerate(devices)
            }
            if len(_TILES) >= _TILES_KEPT:
                _TILES.clear()  # simpler than least-recently-used, and a state dict has few layouts
            _TILES[key] = kept
        return dict(kept)

    def num_replicas(self) -> int:
        used = {a for axes in self.spec for a in axes}
        return math.prod(s for n, s in self.mesh.axes if n not in used)

    # -- notation and serialisation ----------------------------------------------

    def spec_str(self) -> str:
        """``P('x', None)``, with `` + partial(y)`` when the tensor is a pending sum; kept once worked out (the
        planner's per-tensor explanations ask for it a state dict's hundreds of times per job)."""
        text = self.__dict__.get("_spec_str")
        if text is None:
            text = "P(" + ", ".join(_entry_str(a) for a in self.spec) + ")"
            if self.partial:
                text = f"{text} + partial({', '.join(self.partial)})"
            object.__setattr__(self, "_spec_str", text)  # not a field: equality, hashing and repr ignore it
        return text

    def placements_str(self) -> str:
        return "".join(str(p) for p in self.placements)

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in self.mesh.axes)
        return f"{self.spec_str()} on ({axes})"

    def to_json(self) -> dict:
        """A new dict each call; its nested lists are worked out once per sharding and shared (a state dict writes
        the same few layouts hundreds of times), so treat them as read-only."""
        kept = self.__dict__.get("_json")
        if kept is None:
            kept = {"mesh": self.mesh.to_json(), "spec": [list(a) for a in self.spec]}
            if self.partial:  # only then: the JSON of every other sharding, and so every plan id, stays as it was
                kept["partial"] = list(self.partial)
            object.__setattr__(self, "_json", kept)  # not a field: equality, hashing and repr ignore it
        return dict(kept)

    def json_text(self) -> str:
        """`to_json` as JSON text (``json.dumps``), worked out once per sharding."""
        kept = self.__dict__.get("_json_text")
        if kept is None:
            kept = json.dumps(self.to_json())
            object.__setattr__(self, "_json_text", kept)  # not a field, as ``_json``
        return kept

    @classmethod
    def from_json(cls, data) -> "Sharding":
        """Read what `to_json` writes: ``{"mesh": <mesh JSON>, "spec": [[axis, ...] per dim]}``, and
        ``"partial": [axis, ...]`` for a pending sum; a spec entry may also be null or one axis name, as in ``P``."""
        need(data, "object", "sharding JSON", InvalidShardingError)
        mesh = Mesh.from_json(field_of(data, "mesh", "object", "sharding JSON", InvalidShardingError))
        spec = []
        for d, axes in enumerate(field_of(data, "spec", "array", "sharding JSON", InvalidShardingError)):
            if axes is not None and not isinstance(axes, str):
                axes = tuple(need(axes, "array", f"sharding JSON spec entry {d} (the axes that split dim {d})",
                                  InvalidShardingError)) or None
            spec.append(axes)
        partial = field_of(data, "partial", "array", "sharding JSON", InvalidShardingError, default=[])
        for i, axis in enumerate(partial):
            need(axis, "string", f"sharding JSON field 'partial' item {i} (a mesh axis the tensor is summed over)",
                 InvalidShardingError)
        return cls(mesh, spec, partial)
