"""Reshards of Partial tensors: reduce steps that complete the sum, then the moves of a cross-mesh plan.

A Partial source (``Sharding(mesh, spec, partial=("y",))``) holds addends: the
tensor is the sum over its partial axes of what the devices hold. `reshard_program`
turns a reshard into a `Program`; without a Partial source it is the plan's
program (`Program.from_plan`), with one it completes the sum:

================ ==============================================================================
group            the source devices that differ only in the axes summed, in mesh order; they
                 hold addends of one tile
kept axes        axes partial in ``src`` and ``dst`` (same mesh) are not summed: the devices at
                 each coordinate along them reshard their own addends, as if on a mesh of their own
in place         when every destination tile lies in its own device's source tile, nothing
                 moves: each group reduces the box its members need, by a reduce-scatter
                 (result ``shard``) when their tiles are the chunks `box.chunk` cuts of that box
                 along one dim, else by an all-reduce (ring) written straight into the
                 destination tiles, or into role ``reduced`` and then copied where they differ
moved            otherwise every group reduces its tile into role ``reduced``, by an all-reduce
                 or by a reduce-scatter along a dim (when its chunks are the tiles of the source
                 spec with the summed axes added to that dim as minor axes); then the moves of
                 `reshard.plan` from that layout to ``dst``, each after its sender's reduce, reading
                 role ``reduced`` (or ``dst``, where the plan forwards a box delivered earlier); a
                 destination device that also held addends copies the part of its tile that its
                 source tile covers. The cost model (`Program.estimate`) picks the all-reduce or
                 the dim of the reduce-scatter
================ ==============================================================================

Roles of the one tensor: ``src`` holds addends, ``reduced`` what a reduce completed,
``dst`` the destination tile. A move after a reduce carries completed sums: it names
the role it reads (``reduced``, or ``dst`` to forward), never ``src``, which holds
addends; only where ``dst`` keeps every partial axis do the addends move, from ``src``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from reshard import box as boxes
from reshard.dtypes import check_computable, dtype_name
from reshard.errors import InvalidShardingError
from reshard.mesh import Mesh
from reshard.plans import Transfer
from reshard.program import DST, RESHARD_TENSOR, SRC, Program, Step, TensorDecl, TileRef
from reshard.sharding import Box, Sharding
from reshard.strategies import STRATEGIES, plan
from reshard.topology import Topology

__all__ = ["reshard_program", "REDUCED"]

REDUCED = "reduced"


def reshard_program(shape, dtype, src: Sharding, dst: Sharding, topology: Optional[Topology] = None,
                    strategy: str = "auto") -> Program:
    """The program that takes a tensor of ``shape`` and ``dtype`` from ``src`` to ``dst``.

    Without a Partial ``src`` it is ``Program.from_plan(plan(...))``. With one, the
    sum over ``src``'s partial axes is completed (see the module docstring);
    ``dst`` may stay partial over some of those axes on the same mesh. ``strategy``
    plans the moves, as in `reshard.plan`.
    """
    for name, s in (("src", src), ("dst", dst)):
        if not isinstance(s, Sharding):
            raise InvalidShardingError(f"{name} must be a reshard.Sharding, got {type(s).__name__}")
    if not src.is_partial:
        if dst.is_partial:
            raise InvalidShardingError(
                f"dst {dst.spec_str()} is a pending sum over axes {list(dst.partial)}, but src {src.spec_str()} "
                f"holds values, not addends; a reshard may complete a sum but not start one (give dst without "
                f"partial, or make src partial)"
            )
        return Program.from_plan(plan(shape, dtype, src, dst, topology, strategy))
    if strategy not in STRATEGIES:
        raise InvalidShardingError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    for s in (src, dst):
        s.mesh.require_devices()
    shape = dst.check_shape(src.check_shape(shape))
    dtype = dtype_name(dtype)
    topology = topology or Topology()
    kept = _kept_axes(src, dst)
    summed = tuple(a for a in src.partial if a not in kept)
    if summed:
        check_computable(dtype, f"completing the sum of a Partial tensor over axes {list(summed)}")
    parts = [(Sharding(mesh, src.spec, summed), Sharding(mesh if kept else dst.mesh, dst.spec))
             for mesh in _coordinates(src.mesh, kept)]
    decl = TensorDecl(RESHARD_TENSOR, shape, dtype, src, dst)
    if not summed:  # each coordinate's addends move as they are
        return _program(decl, [_moves(shape, dtype, s, d, topology, strategy) for s, d in parts], strategy, topology)
    if all(_in_place(shape, s, d) for s, d in parts):
        return _program(decl, [_reduce_in_place(shape, s, d) for s, d in parts], strategy, topology)
    candidates = []
    for dim in (None, *range(len(shape))):
        built = [_reduce_then_move(shape, dtype, s, d, dim, topology, strategy) for s, d in parts]
        if all(b is not None for b in built):
            candidates.append(_program(decl, built, strategy, topology))
    # The all-reduce is always possible and comes first, so ties keep it.
    return min(candidates, key=lambda p: p.estimate_seconds)


def _kept_axes(src: Sharding, dst: Sharding) -> tuple[str, ...]:
    if not dst.is_partial:
        return ()
    extra = [a for a in dst.partial if a not in src.partial]
    if extra:
        raise InvalidShardingError(
            f"dst {dst.spec_str()} is partial over {extra}, along which src {src.spec_str()} holds no addends; dst "
            f"may stay partial over some of src's partial axes {list(src.partial)}, or over none"
        )
    if dst.mesh != src.mesh:
        raise InvalidShardingError(
            f"dst {dst.spec_str()} stays partial over {list(dst.partial)} but lies on {dst.mesh}, not on src's "
            f"{src.mesh}; a sum that stays pending stays on the devices that hold its addends, so give dst on "
            f"src's mesh, or without partial to complete the sum first"
        )
    return dst.partial


def _coordinates(mesh: Mesh, kept: Sequence[str]) -> list[Mesh]:
    """Per coordinate along the ``kept`` axes, the mesh of the other axes over the devices there."""
    if not kept:
        return [mesh]
    at = [mesh.axis_index(a) for a in kept]
    by_coord: dict[tuple[int, ...], list[str]] = {}
    for p, dev in enumerate(mesh.require_devices()):
        c = mesh.coords(p)
        by_coord.setdefault(tuple(c[i] for i in at), []).append(dev)
    axes = [(n, s) for n, s in mesh.axes if n not in kept] or [("_", 1)]
    return [Mesh(axes, devs) for _, devs in sorted(by_coord.items())]


def _groups(src: Sharding) -> list[tuple[str, ...]]:
    """The devices that differ only in ``src``'s partial axes, each group in mesh order."""
    mesh = src.mesh
    free = [i for i, n in enumerate(mesh.axis_names) if n not in src.partial]
    out: dict[tuple[int, ...], list[str]] = {}
    for p, dev in enumerate(mesh.require_devices()):
        c = mesh.coords(p)
        out.setdefault(tuple(c[i] for i in free), []).append(dev)
    return [tuple(g) for g in out.values()]


def _in_place(shape, src: Sharding, dst: Sharding) -> bool:
    """Whether every device with a destination tile holds it inside its own source tile."""
    held = src.tiles(shape)
    return all(not boxes.volume(tile) or (dev in held and boxes.contains(held[dev], tile))
               for dev, tile in dst.tiles(shape).items())


def _bounding(box_list: list[Box]) -> Box:
    return tuple((min(b[d][0] for b in box_list), max(b[d][1] for b in box_list)) for d in range(len(box_list[0])))


def _scatter_dim(group: Sequence[str], need: dict[str, Box], box: Box) -> Optional[int]:
    """A dim along which `box.chunk` cuts ``box`` into exactly the members' needs, in group order."""
    for dim in range(len(box)):
        pieces = boxes.chunk(box, len(group), dim)
        if all(need.get(m) == p if boxes.volume(p) else m not in need for m, p in zip(group, pieces)):
            return dim
    return None


class _Steps:
    """Steps of one coordinate of the program, numbered from 0; `_program` renumbers them."""

    def __init__(self):
        self.reduces: list[Step] = []
        self.copies: list[Step] = []
        self.moves: list[Step] = []
        self.reduce_of: dict[str, int] = {}  # device -> index in ``reduces`` of the reduce that completed its part
        self.copy_of: dict[str, int] = {}  # device -> index in ``copies``

    def reduce(self, group, box: Box, role: str, dim: Optional[int]) -> None:
        ref = TileRef(RESHARD_TENSOR, SRC, box)
        out = TileRef(RESHARD_TENSOR, role, box)
        result = "replicate" if dim is None else "shard"
        self.reduce_of.update((m, len(self.reduces)) for m in group)
        self.reduces.append(Step.reduce(0, "sum", group, ref, out, result=result, dim=dim))

    def copy(self, device: str, box: Box) -> None:
        self.copy_of[device] = len(self.copies)
        self.copies.append(Step.compute(0, "copy", device, [TileRef(RESHARD_TENSOR, REDUCED, box)],
                                        TileRef(RESHARD_TENSOR, DST, box), after=[self.reduce_of[device]]))


def _reduce_in_place(shape, src: Sharding, dst: Sharding) -> _Steps:
    """Each group reduces the box its members' destination tiles span, straight into them where it can."""
    out = _Steps()
    tiles = src.tiles(shape)
    dst_tiles = dst.tiles(shape)
    for group in _groups(src):
        need = {m: dst_tiles[m] for m in group if m in dst_tiles and boxes.volume(dst_tiles[m])}
        if not need:
            continue  # replicas elsewhere complete this tile for the devices that want it
        box = _bounding(list(need.values()))
        assert boxes.contains(tiles[group[0]], box)
        dim = _scatter_dim(group, need, box)
        if dim is not None:
            out.reduce(group, box, DST, dim)
        elif len(need) == len(group) and all(b == box for b in need.values()):
            out.reduce(group, box, DST, None)
        else:
            out.reduce(group, box, REDUCED, None)
            for m, b in need.items():
                out.copy(m, b)
    return out


def _reduce_then_move(shape, dtype, src: Sharding, dst: Sharding, dim: Optional[int], topology: Topology,
                      strategy: str) -> Optional[_Steps]:
    """Reduce every group's tile (all-reduce, or reduce-scatter along ``dim``), then plan the moves from there;
    None when the reduce-scatter's chunks are not the tiles of a sharding the planner can start from."""
    values = src.without_partial()
    if dim is not None:
        spec = list(values.dim_axes(len(shape)))
        spec[dim] = spec[dim] + src.partial
        values = Sharding(src.mesh, spec)
    tiles, done = src.tiles(shape), values.tiles(shape)
    out = _Steps()
    for group in _groups(src):
        box = tiles[group[0]]
        if dim is not None and boxes.chunk(box, len(group), dim) != [done[m] for m in group]:
            return None  # several summed axes cut unevenly: the chunks are not the tiles
        if boxes.volume(box):  # an empty tile has nothing to sum
            out.reduce(group, box, REDUCED, dim)
    for dev, tile in dst.tiles(shape).items():
        held = boxes.intersect(tiles[dev], tile) if dev in tiles else None
        if held is None:
            continue
        if not boxes.contains(done[dev], held):
            # The program's check counts the source tile's part of a destination tile as held, so a device
            # must complete all of that part itself; after this reduce-scatter it completed less.
            return None
        out.copy(dev, held)
    out.moves = [replace(s, role=_read_role(s.transfer, done))
                 for s in _moves(shape, dtype, values, dst, topology, strategy).moves]
    return out


def _read_role(t: Transfer, done: dict[str, Box]) -> str:
    """What the sender of a move after the reduces reads: the sums its reduce left it, else (a relay: the plan
    forwards a box delivered earlier) its destination tile."""
    mine = done.get(t.sender)
    return REDUCED if mine is not None and boxes.contains(mine, t.box) else DST


def _moves(shape, dtype, src: Sharding, dst: Sharding, topology: Topology, strategy: str) -> _Steps:
    out = _Steps()
    out.moves = list(Program.from_plan(plan(shape, dtype, src, dst, topology, strategy)).steps)
    return out


def _program(decl: TensorDecl, parts: list[_Steps], strategy: str, topology: Topology) -> Program:
    """All coordinates' reduces, then their copies, then their moves, renumbered; a move waits for its sender's
    reduce and copy, as well as for the moves that brought it its box."""
    num_reduces = sum(len(p.reduces) for p in parts)
    num_copies = sum(len(p.copies) for p in parts)
    first_reduce = list(itertools.accumulate((len(p.reduces) for p in parts), initial=0))
    first_copy = list(itertools.accumulate((len(p.copies) for p in parts), initial=num_reduces))
    first_move = list(itertools.accumulate((len(p.moves) for p in parts), initial=num_reduces + num_copies))
    steps: list[Step] = []
    for p in parts:
        steps += [replace(s, id=len(steps) + i) for i, s in enumerate(p.reduces)]
    for p, r0 in zip(parts, first_reduce):
        steps += [replace(s, id=len(steps) + i, after=[r0 + a for a in s.after]) for i, s in enumerate(p.copies)]
    for p, r0, c0, m0 in zip(parts, first_reduce, first_copy, first_move):
        for s in p.moves:
            after = [m0 + a for a in s.after]
            if s.transfer.sender in p.reduce_of:
                after.append(r0 + p.reduce_of[s.transfer.sender])
            if s.transfer.sender in p.copy_of:
                after.append(c0 + p.copy_of[s.transfer.sender])
            steps.append(replace(s, id=len(steps), after=after))
    return Program((decl,), tuple(steps), strategy, topology)
