"""Unit tasks: the many-to-many multicast a reshard decomposes into.

A unit task is the non-empty intersection of one distinct destination tile with
one distinct source tile. Its candidate senders are the devices holding that
source tile; its receivers are the devices needing that destination tile that
do not already hold the box.

Both tilings are grids (each cuts every dim at fixed points), so their
intersection is a grid too: per dim, the pairs of a destination chunk and a
source chunk that overlap, and the unit tasks are the product of those pairs
over the dims. `decompose` computes it with numpy and keeps the result as
columns (`UnitTasks`): a million tasks are a few arrays, not a million objects.

Notation
--------
tile group    the devices that hold one distinct non-empty tile, in mesh order;
              groups are numbered in the order of their first device
chunk index   per dim, which chunk of that dim a tile is (`Sharding.chunk_index`)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from reshard.box import Box, volumes
from reshard.sharding import Sharding

__all__ = ["UnitTask", "UnitTasks", "TileGroups", "decompose", "groups_of", "tile_groups", "tile_arrays"]


@dataclass(frozen=True, slots=True)
class UnitTask:
    box: Box
    num_elements: int
    senders: tuple[str, ...]
    receivers: tuple[str, ...]


class UnitTasks(Sequence):
    """The unit tasks of one reshard as columns; indexing gives a `UnitTask`.

    Task ``i`` is the box ``lo[i]:hi[i]`` with ``num_elements[i]`` elements, sent by
    one of ``senders[sender_group[i]]`` to every device of ``receivers[receiver_group[i]]``.
    Tasks of one tile pair share a group, so most tasks name the same few tuples.
    """

    __slots__ = ("lo", "hi", "num_elements", "sender_group", "senders", "receiver_group", "receivers")

    def __init__(self, lo: np.ndarray, hi: np.ndarray, sender_group: np.ndarray, senders: Sequence[tuple[str, ...]],
                 receiver_group: np.ndarray, receivers: Sequence[tuple[str, ...]]):
        self.lo, self.hi = lo, hi
        self.num_elements = volumes(lo, hi)
        self.sender_group, self.senders = sender_group, tuple(senders)
        self.receiver_group, self.receivers = receiver_group, tuple(receivers)

    def __len__(self) -> int:
        return len(self.num_elements)

    def box(self, i: int) -> Box:
        return tuple(zip(self.lo[i].tolist(), self.hi[i].tolist()))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return UnitTask(self.box(i), int(self.num_elements[i]), self.senders[self.sender_group[i]],
                        self.receivers[self.receiver_group[i]])

    def __iter__(self):
        boxes = [tuple(zip(a, b)) for a, b in zip(self.lo.tolist(), self.hi.tolist())]
        senders, receivers = self.senders, self.receivers
        for box, n, s, r in zip(boxes, self.num_elements.tolist(), self.sender_group.tolist(),
                                self.receiver_group.tolist()):
            yield UnitTask(box, n, senders[s], receivers[r])

    def __repr__(self) -> str:
        return f"UnitTasks({len(self)} tasks, {len(self.senders)} sender groups, {len(self.receivers)} receiver groups)"


@lru_cache(maxsize=256)
def _chunk_indices(sharding: Sharding, ndim: int) -> np.ndarray:
    """(mesh positions, ndim): the chunk index per dim of every device; it depends on the shape only via ndim."""
    mesh = sharding.mesh
    coords = np.indices(mesh.shape, dtype=np.int64).reshape(len(mesh.shape), -1)
    out = np.zeros((mesh.size, ndim), dtype=np.int64)
    for d, axes in enumerate(sharding.dim_axes(ndim)):
        for a in axes:
            out[:, d] = out[:, d] * mesh.axis_size(a) + coords[mesh.axis_index(a)]
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class TileGroups:
    """The distinct non-empty tiles of a sharding for one shape.

    ``chunks[d]`` lists the (lo, hi) interval of every chunk of dim ``d``; group ``g``
    holds the tile of chunk indices ``keys[g]``, on the mesh positions
    ``members[ptr[g]:ptr[g + 1]]``; ``group_of[p]`` is the group of mesh position
    ``p``, -1 where its tile is empty. The arrays are read-only: groups are cached.
    """

    chunks: list[list[tuple[int, int]]]
    keys: np.ndarray
    ptr: np.ndarray
    members: np.ndarray
    group_of: np.ndarray
    mesh_devices: tuple[str, ...]

    @cached_property
    def devices(self) -> tuple[tuple[str, ...], ...]:
        """Per group, its device ids."""
        ptr, members, devices = self.ptr.tolist(), self.members.tolist(), self.mesh_devices
        return tuple(tuple(devices[p] for p in members[a:b]) for a, b in zip(ptr, ptr[1:]))


@lru_cache(maxsize=1024)
def _dim_chunks(sharding: Sharding, shape: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    """`Sharding.dim_chunks`, kept: the tensors of a state dict repeat a few shapes on a few shardings."""
    return sharding.dim_chunks(shape)


def tile_arrays(sharding: Sharding, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Every mesh position's tile as rows of ``lo`` and ``hi`` bounds (`Sharding.tiles` as columns)."""
    index = _chunk_indices(sharding, len(shape))
    lo = np.empty(index.shape, dtype=np.int64)
    hi = np.empty(index.shape, dtype=np.int64)
    for d, cs in enumerate(_dim_chunks(sharding, shape)):
        bounds = np.array(cs, dtype=np.int64).reshape(-1, 2)
        lo[:, d], hi[:, d] = bounds[index[:, d], 0], bounds[index[:, d], 1]
    return lo, hi


@lru_cache(maxsize=256)
def groups_of(sharding: Sharding, shape: tuple[int, ...]) -> TileGroups:
    """The tile groups of ``sharding`` for a tensor of ``shape`` (kept, as `_dim_chunks`)."""
    chunks = _dim_chunks(sharding, shape)
    index = _chunk_indices(sharding, len(shape))
    keep = np.ones(len(index), dtype=bool)
    for d, cs in enumerate(chunks):
        empty = np.array([lo >= hi for lo, hi in cs], dtype=bool)
        if empty.any():
            keep &= ~empty[index[:, d]]
    positions = np.flatnonzero(keep)
    counts = [len(c) for c in chunks]
    linear = np.ravel_multi_index(tuple(index[positions].T), counts) if len(shape) else np.zeros(len(positions), int)
    _, first, inverse = np.unique(linear, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    group = rank[inverse.reshape(-1)]
    group_of = np.full(len(index), -1, dtype=np.int64)
    group_of[positions] = group
    members = positions[np.argsort(group, kind="stable")]
    ptr = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(np.bincount(group, minlength=len(order)), out=ptr[1:])
    keys = index[positions[first[order]]]
    for a in (keys, ptr, members, group_of):
        a.setflags(write=False)
    return TileGroups(chunks, keys, ptr, members, group_of, sharding.mesh.require_devices())


def tile_groups(sharding: Sharding, shape: tuple[int, ...]) -> tuple[list[list[tuple[int, int]]], dict[tuple[int, ...], list[str]]]:
    """Per-dim chunk intervals, and the devices holding each non-empty tile (by chunk index)."""
    g = groups_of(sharding, shape)
    return g.chunks, {tuple(k): list(d) for k, d in zip(g.keys.tolist(), g.devices)}


def _overlaps(dst: list[tuple[int, int]], src: list[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
    """For each dst chunk, the src chunks it overlaps: (src index, lo, hi)."""
    nonempty = [(lo, hi, i) for i, (lo, hi) in enumerate(src) if lo < hi]
    nonempty.sort()
    starts = [lo for lo, _, _ in nonempty]
    out = []
    for lo, hi in dst:
        hits = []
        if lo < hi:
            k = max(bisect.bisect_right(starts, lo) - 1, 0)
            while k < len(nonempty) and nonempty[k][0] < hi:
                s_lo, s_hi, i = nonempty[k]
                a, b = max(lo, s_lo), min(hi, s_hi)
                if a < b:
                    hits.append((i, a, b))
                k += 1
        out.append(hits)
    return out


def _overlap_columns(dst: list[tuple[int, int]], src: list[tuple[int, int]]):
    """`_overlaps` as columns: per dst chunk its first entry and count; per entry src index, lo, hi."""
    hits = _overlaps(dst, src)
    count = np.array([len(h) for h in hits], dtype=np.int64)
    start = np.zeros(len(hits), dtype=np.int64)
    np.cumsum(count[:-1], out=start[1:])
    flat = np.array([e for h in hits for e in h], dtype=np.int64).reshape(-1, 3)
    return start, count, flat[:, 0], flat[:, 1], flat[:, 2]


def decompose(shape: tuple[int, ...], src: Sharding, dst: Sharding) -> UnitTasks:
    """All unit tasks of moving a tensor of ``shape`` from ``src`` to ``dst``, in a fixed order: destination tile
    groups in the order of their first device, and within one the source chunks it overlaps, last dim fastest."""
    src_devices, dst_devices = src.mesh.require_devices(), dst.mesh.require_devices()
    sg, dg = groups_of(src, shape), groups_of(dst, shape)
    ndim = len(shape)
    cols = [_overlap_columns(d, s) for d, s in zip(dg.chunks, sg.chunks)]
    # The product, per destination group, of its per-dim overlaps: tasks of group k are numbered 0..n_k-1
    # in mixed radix over the dims, the last dim fastest, as itertools.product counts.
    per_group = np.ones(len(dg.keys), dtype=np.int64)
    for d, (_, count, *_) in enumerate(cols):
        per_group *= count[dg.keys[:, d]]
    receiver_group = np.repeat(np.arange(len(dg.keys)), per_group)
    local = np.arange(len(receiver_group), dtype=np.int64) - np.repeat(np.cumsum(per_group) - per_group, per_group)
    lo = np.empty((len(local), ndim), dtype=np.int64)
    hi = np.empty((len(local), ndim), dtype=np.int64)
    src_key = np.zeros(len(local), dtype=np.int64)
    for d in reversed(range(ndim)):
        start, count, s_idx, s_lo, s_hi = cols[d]
        chunk = dg.keys[receiver_group, d]
        radix = count[chunk]
        entry = start[chunk] + local % radix
        local //= radix
        lo[:, d], hi[:, d] = s_lo[entry], s_hi[entry]
        src_key += s_idx[entry] * _stride(sg.chunks, d)
    lookup = np.full(max(_stride(sg.chunks, -1), 1), -1, dtype=np.int64)
    lookup[_linear(sg.keys, sg.chunks)] = np.arange(len(sg.keys))
    sender_group = lookup[src_key]
    receivers = dg.devices
    keep = sender_group >= 0
    shared = _shared_devices(src_devices, dst_devices)
    if shared:
        receiver_group, receivers = _drop_holders(receiver_group, sender_group, receivers, shared, src, sg, dst, dg)
        keep &= receiver_group >= 0
    if not keep.all():
        lo, hi, sender_group, receiver_group = lo[keep], hi[keep], sender_group[keep], receiver_group[keep]
    return UnitTasks(lo, hi, sender_group, sg.devices, receiver_group, receivers)


@lru_cache(maxsize=64)
def _shared_devices(src_devices: tuple[str, ...], dst_devices: tuple[str, ...]) -> frozenset[str]:
    """The devices of both meshes, kept: a state dict's reshards all go between the same two meshes."""
    return frozenset(src_devices).intersection(dst_devices)


def _stride(chunks: list[list[tuple[int, int]]], d: int) -> int:
    """Row-major stride of dim ``d`` over the chunk counts (``d`` = -1: their product)."""
    out = 1
    for c in chunks[d + 1:] if d >= 0 else chunks:
        out *= len(c)
    return out


def _linear(keys: np.ndarray, chunks: list[list[tuple[int, int]]]) -> np.ndarray:
    out = np.zeros(len(keys), dtype=np.int64)
    for d in range(len(chunks)):
        out += keys[:, d] * _stride(chunks, d)
    return out


def _drop_holders(receiver_group, sender_group, receivers, shared, src, sg, dst, dg):
    """Take out of each task's receivers the devices that hold its box already (they hold its source tile):
    such a device's (destination group, source group) pair gets a receiver group without it, or -1 when no
    receiver is left."""
    src_pos = {d: p for p, d in enumerate(src.mesh.devices)}
    dst_pos = {d: p for p, d in enumerate(dst.mesh.devices)}
    holding: dict[tuple[int, int], set[str]] = {}
    for dev in shared:
        pair = (int(dg.group_of[dst_pos[dev]]), int(sg.group_of[src_pos[dev]]))
        if pair[0] >= 0 and pair[1] >= 0:
            holding.setdefault(pair, set()).add(dev)
    if not holding:
        return receiver_group, receivers
    receivers = list(receivers)
    num_src = len(sg.keys)
    codes, new = [], []
    for (g, s), held in sorted(holding.items()):
        need = tuple(r for r in receivers[g] if r not in held)
        codes.append(g * num_src + s)
        new.append(len(receivers) if need else -1)
        if need:
            receivers.append(need)
    codes, new = np.array(codes, dtype=np.int64), np.array(new, dtype=np.int64)
    task_codes = receiver_group * num_src + sender_group
    at = np.minimum(np.searchsorted(codes, task_codes), len(codes) - 1)
    hit = (codes[at] == task_codes) & (sender_group >= 0)
    out = receiver_group.copy()
    out[hit] = new[at[hit]]
    return out, receivers
