"""Unit tasks: the many-to-many multicast a reshard decomposes into.

A unit task is the non-empty intersection of one distinct destination tile with
one distinct source tile. Its candidate senders are the devices holding that
source tile; its receivers are the devices needing that destination tile that
do not already hold the box.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from reshard.box import Box
from reshard.sharding import Sharding

__all__ = ["UnitTask", "decompose", "tile_groups"]


@dataclass(frozen=True, slots=True)
class UnitTask:
    box: Box
    num_elements: int
    senders: tuple[str, ...]
    receivers: tuple[str, ...]


def tile_groups(sharding: Sharding, shape: tuple[int, ...]) -> tuple[list[list[tuple[int, int]]], dict[tuple[int, ...], list[str]]]:
    """Per-dim chunk intervals, and the devices holding each non-empty tile (by chunk index)."""
    chunks = sharding.dim_chunks(shape)
    groups: dict[tuple[int, ...], list[str]] = {}
    ndim = len(shape)
    for pos, dev in enumerate(sharding.mesh.require_devices()):
        key = sharding.chunk_index(pos, ndim)
        if all(chunks[d][i][0] < chunks[d][i][1] for d, i in enumerate(key)):
            groups.setdefault(key, []).append(dev)
    return chunks, groups


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


def decompose(shape: tuple[int, ...], src: Sharding, dst: Sharding) -> list[UnitTask]:
    """All unit tasks of moving a tensor of ``shape`` from ``src`` to ``dst``."""
    src_chunks, src_groups = tile_groups(src, shape)
    dst_chunks, dst_groups = tile_groups(dst, shape)
    overlaps = [_overlaps(d, s) for d, s in zip(dst_chunks, src_chunks)]
    # When no destination device is also a source device, nobody already holds anything.
    overlap = set(src.mesh.require_devices()) & set(dst.mesh.require_devices())
    holder_sets = {key: frozenset(devs) for key, devs in src_groups.items()} if overlap else {}
    src_senders = {key: tuple(devs) for key, devs in src_groups.items()}
    tasks = []
    append = tasks.append
    for dkey, receivers in dst_groups.items():
        receivers = tuple(receivers)
        per_dim = [overlaps[d][i] for d, i in enumerate(dkey)]
        for combo in itertools.product(*per_dim):
            skey = tuple([c[0] for c in combo])
            senders = src_senders.get(skey)
            if senders is None:
                continue
            need = receivers
            if overlap:
                held = holder_sets[skey]
                need = tuple([r for r in receivers if r not in held])
                if not need:
                    continue
            box = tuple([(c[1], c[2]) for c in combo])
            n = 1
            for c in combo:
                n *= c[2] - c[1]
            append(UnitTask(box, n, senders, need))
    return tasks

