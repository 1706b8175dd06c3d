"""The columnar proof that a program's reshard moves deliver: `check_delivery`'s rules for all its tensors at once.

`Program.validate` proves a state dict of a hundred thousand tensors, each moved by tens to thousands of transfers.
Checking them one transfer at a time in Python cost 13 us a move (bench/moe_plan.py); here they are columns and the
rules are numpy passes over all of them together. The proof is one-sided: `delivered` says which tensors it proved,
and `Program.validate` gives every other one to `check_delivery`, which names the first problem (or proves what this
module does not try to: a sender that forwards a box delivered to it earlier).

================ ==================================================================================
link             a transfer's (sender, receivers, method, route): the rules of `check_transfer` but
                 the box's, checked once per distinct link (a state dict has a few thousand)
tile row         a tile of a (sharding, shape) pair, in one table of every pair's tiles, padded with
                 [0, 1) to the most dims of any tensor so that every box is a row of ``D`` bounds
piece            a box a destination device gets: each receiver's copy of a transfer's box, and the
                 part of its destination tile that its own source tile holds
expected piece   a destination tile cut by the distinct source tiles: the dim chunks of a sharding
                 partition each dim, so these partition the tile, and a device whose pieces are
                 exactly them gets every element of its tile once
================ ==================================================================================
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter
from typing import Optional

import numpy as np

from reshard.errors import InvalidMeshError
from reshard.routes import HostCache
from reshard.sharding import Sharding

__all__ = ["delivered", "delivered_in_passes", "delivered_by_pattern", "link_numbers", "link_ids",
           "DELIVERIES_PER_PASS"]

# `delivered_in_passes` proves at most this many deliveries (a receiver's copy of a transfer's box) in one numpy
# pass: a pass holds about 200 bytes a delivery, and a trillion-parameter state dict has 30 million of them.
DELIVERIES_PER_PASS = 2_000_000

_LINK = attrgetter("sender", "receivers", "method", "route")
_BOX = attrgetter("box")


def delivered(decls: Sequence, tensor_of: Sequence[int], transfers: Sequence, methods: Sequence[str],
              hosts: HostCache) -> np.ndarray:
    """Per decl (each with ``shape``, ``src`` and ``dst``), whether ``transfers`` (transfer ``i`` moving
    ``decls[tensor_of[i]]``, every sender reading its source tile) prove every rule `check_delivery` checks.
    False leaves the verdict, and the message, to `check_delivery`."""
    num = len(decls)
    ok = np.ones(num, dtype=bool)
    if not num:
        return ok
    n = len(transfers)
    k = np.asarray(tensor_of, dtype=np.int64).reshape(n)
    ndim = np.fromiter((len(d.shape) for d in decls), dtype=np.int64, count=num)
    D = max(1, int(ndim.max()))
    shape = np.ones((num, D), dtype=np.int64)
    for i, d in enumerate(decls):
        shape[i, :len(d.shape)] = d.shape
    # Boxes read once per distinct box object: a transfer to several hosts shares its box with its siblings.
    raw = list(map(_BOX, transfers))
    first, box = np.unique(np.fromiter(map(id, raw), dtype=np.int64, count=n), return_index=True,
                           return_inverse=True)[1:]
    lo, hi, lens, pairs = _box_columns(list(map(raw.__getitem__, first.tolist())), D)
    box = box.reshape(-1)
    lo, hi, well_formed = lo[box], hi[box], pairs[box] & (lens[box] == ndim[k])
    bad = ~well_formed
    bad |= ~((lo >= 0).all(axis=1) & (lo < hi).all(axis=1) & (hi <= shape[k]).all(axis=1))

    # Links: the transfer's own rules but its box, once per distinct (sender, receivers, method, route). Each part is
    # numbered by value but hashed once per distinct object (the transfers share them): hashing a broadcast's
    # receivers for every transfer cost more than all the rest.
    parts = _parts(transfers)
    first, link = np.unique(_link_codes(parts, n), return_index=True, return_inverse=True)[1:]
    link = link.reshape(-1)
    link_ok = np.array([_link_ok(_LINK(transfers[i]), methods, hosts) for i in first.tolist()], dtype=bool)
    bad |= ~link_ok.reshape(-1)[link]
    # Devices numbered once per distinct sender and per distinct receivers tuple, not once per transfer.
    devices: dict[str, int] = {}
    number, distinct = parts[0]
    sender = np.array([devices.setdefault(d, len(devices)) for d in distinct], dtype=np.int64).reshape(-1)[number]
    rnum, distinct = parts[1]
    rcount = np.fromiter(map(len, distinct), dtype=np.int64, count=len(distinct))
    recv = np.fromiter((devices.setdefault(r, len(devices)) for rs in distinct for r in rs), dtype=np.int64,
                       count=int(rcount.sum()))
    rstart = np.cumsum(rcount) - rcount

    # Tiles of every (sharding, shape) pair, and each device's position in each mesh (-1: not in it).
    tables = _Tiles(devices, D)
    src_row = np.empty(num, dtype=np.int64)
    dst_row = np.empty(num, dtype=np.int64)
    src_mesh = np.empty(num, dtype=np.int64)
    dst_mesh = np.empty(num, dtype=np.int64)
    layout = np.empty(num, dtype=np.int64)
    layouts: dict[tuple[int, int], int] = {}
    for i, d in enumerate(decls):
        a, b = tables.add(d.src, d.shape), tables.add(d.dst, d.shape)
        if a is None or b is None:
            ok[i] = False
            a = b = (0, 0)
        src_row[i], src_mesh[i] = a
        dst_row[i], dst_mesh[i] = b
        layout[i] = layouts.setdefault((a[0], b[0]), len(layouts))
    tile_lo, tile_hi, position = tables.columns()

    # Each receiver is a device of the destination mesh whose tile holds the box; the sender's source tile holds it.
    per = rcount[rnum]
    e_of = np.repeat(np.arange(n), per)
    e_recv = recv[np.repeat(rstart[rnum] - (np.cumsum(per) - per), per) + np.arange(len(e_of))]
    e_k = k[e_of]
    q = position[dst_mesh[e_k], e_recv]
    into = dst_row[e_k] + np.maximum(q, 0)
    e_lo, e_hi = lo[e_of], hi[e_of]
    bad[e_of[q < 0]] = True
    p = position[src_mesh[k], sender]
    held = src_row[k] + np.maximum(p, 0)
    bad |= (p < 0) | ~_inside(lo, hi, tile_lo[held], tile_hi[held])

    # Coverage. A piece that is its destination tile cut by its sender's source tile is one expected piece: the one
    # of (tensor, destination position, distinct source tile). A tensor whose pieces are all expected ones, none
    # twice, as many as it expects, gets exactly its expected pieces, and so every element of every tile once.
    held = held[e_of]
    # A piece that is its destination tile cut by anything lies inside that tile: this is the receiver's check too.
    cut = (e_lo == np.maximum(tile_lo[into], tile_lo[held])).all(axis=1)
    cut &= (e_hi == np.minimum(tile_hi[into], tile_hi[held])).all(axis=1)
    bad[e_of[~cut]] = True
    ok[k[bad]] = False
    num_q, num_s = int(position.max(initial=0)) + 1, tables.num_distinct
    codes = [(e_k * num_q + np.maximum(q, 0)) * num_s + tables.distinct_column()[held]]
    pieces = np.bincount(e_k, minlength=num)
    expected = np.zeros(num, dtype=np.int64)
    order = np.argsort(layout, kind="stable")
    bounds = np.searchsorted(layout[order], np.arange(len(layouts) + 1))
    for (a, b), L in layouts.items():
        of = order[bounds[L]:bounds[L + 1]]
        found = tables.layout(a, b, decls[of[0]].shape)
        if found is None:
            ok[of] = False
            continue
        expected[of], held_q, held_s = found
        if len(held_q):
            # A destination device that is also a source device starts with its tile's piece of its source tile.
            pieces[of] += len(held_q)
            codes.append(((of[:, None] * num_q + held_q) * num_s + held_s).reshape(-1))
    ok &= pieces == expected
    codes = np.sort(np.concatenate(codes))
    twice = codes[1:][codes[1:] == codes[:-1]]
    ok[twice // num_s // num_q] = False
    return ok


def delivered_in_passes(decls: Sequence, tensor_of: Sequence[int], transfers: Sequence, methods: Sequence[str],
                        hosts: HostCache, per_pass: int = DELIVERIES_PER_PASS) -> np.ndarray:
    """`delivered`, in passes over runs of consecutive ``decls`` of at most ``per_pass`` deliveries each (a tensor
    with more has a pass of its own), so that its memory stays bounded whatever the program's size. The verdicts are
    `delivered`'s: every rule it proves is one tensor's."""
    n = len(transfers)
    k = np.asarray(tensor_of, dtype=np.int64).reshape(n)
    receivers = np.fromiter(map(len, map(attrgetter("receivers"), transfers)), dtype=np.int64, count=n)
    per_tensor = np.bincount(k, weights=receivers, minlength=len(decls)).astype(np.int64)
    if int(per_tensor.sum()) <= per_pass:
        return delivered(decls, k, transfers, methods, hosts)
    # Cut the tensors where the running count of deliveries crosses a multiple of per_pass.
    ends = np.cumsum(per_tensor)
    cuts = np.flatnonzero(np.diff(ends // per_pass)) + 1
    bounds = [0, *cuts.tolist(), len(decls)]
    order = np.argsort(k, kind="stable")
    at = np.searchsorted(k[order], bounds)
    ok = np.empty(len(decls), dtype=bool)
    for a, b, lo, hi in zip(bounds, bounds[1:], at, at[1:]):
        if a == b:
            continue
        moves = order[lo:hi]
        ok[a:b] = delivered(decls[a:b], k[moves] - a, list(map(transfers.__getitem__, moves.tolist())), methods,
                            hosts)
    return ok


def delivered_by_pattern(decls: Sequence, tensor_of: Sequence[int], transfers: Sequence, methods: Sequence[str],
                         hosts: HostCache, per_pass: int = DELIVERIES_PER_PASS,
                         link_ids: Optional[np.ndarray] = None) -> np.ndarray:
    """`delivered`, proving each distinct pattern of moves once: a state dict repeats a few layouts over many tensors
    (a Kimi-K2-like one 152 over 139,583), moved alike. Two tensors of one (shape, source, destination) whose moves
    are the same (box, set of receivers, sender) triples get the same verdicts from every per-piece rule: the
    pieces a move makes are its box for each of its receivers, a receiver twice or the sender among them breaks a
    link rule, and every other rule reads only the box, the receivers and the sender's and receivers' tiles. So the
    pieces of one tensor of each pattern are proved (`delivered_in_passes`), and the link rules of every transfer
    (`_link_ok`, once per distinct link); a tensor is proved when its pattern's is and all its links are.
    ``link_ids``, where the caller has them (`link_ids`), are the transfers' parts' ids, not taken again."""
    n = len(transfers)
    k = np.asarray(tensor_of, dtype=np.int64).reshape(n)
    num = len(decls)
    parts = _parts(transfers, link_ids)  # (sender, receivers, method, route), each numbered by value
    # one number per distinct (box, set of receivers, sender), each tensor's sorted: its moves as bytes
    triple = np.zeros(n, dtype=np.int64)
    numbers = (_numbered(list(map(_BOX, transfers)))[0], _receiver_sets(*parts[1]), parts[0][0])
    spans = [int(number.max(initial=0)) + 1 for number in numbers]
    for number, span in zip(numbers, spans):
        triple = triple * span + number
        if math.prod(spans) >= 2**62:  # renumbered part by part, so that a triple's number stays below n squared
            triple = np.unique(triple, return_inverse=True)[1].reshape(-1)
    order = np.lexsort((triple, k))
    moved = triple[order]
    bounds = np.searchsorted(k[order], np.arange(num + 1)).tolist()
    pattern = np.empty(num, dtype=np.int64)
    first: dict = {}
    for i, d in enumerate(decls):
        try:
            key = (d.shape, d.src, d.dst, moved[bounds[i]:bounds[i + 1]].tobytes())
            pattern[i] = first.setdefault(key, i)
        except TypeError:  # an unhashable field (a bad program's): a pattern of its own
            pattern[i] = i
    chosen = np.flatnonzero(pattern == np.arange(num))
    if len(chosen) == num:
        return delivered_in_passes(decls, k, transfers, methods, hosts, per_pass)
    local = np.full(num, -1, dtype=np.int64)
    local[chosen] = np.arange(len(chosen))
    moves = np.flatnonzero(local[k] >= 0)
    proved = delivered_in_passes([decls[i] for i in chosen.tolist()], local[k[moves]],
                                 list(map(transfers.__getitem__, moves.tolist())), methods, hosts, per_pass)
    ok = proved[local[pattern]]
    # every transfer's link rules, once per distinct link
    unique, link = np.unique(_link_codes(parts, n), return_index=True, return_inverse=True)[1:]
    link_ok = np.array([_link_ok(_LINK(transfers[i]), methods, hosts) for i in unique.tolist()], dtype=bool)
    ok[k[~link_ok.reshape(-1)[link.reshape(-1)]]] = False
    return ok


def _receiver_sets(number: np.ndarray, distinct: list) -> np.ndarray:
    """Per transfer, a number that two transfers share exactly when their receivers are the same set, from the
    transfers' receivers numbered by value (`_numbered`; a value that cannot be sorted is its own)."""
    sets: dict = {}
    of_value = []
    for r in distinct:
        try:
            of_value.append(sets.setdefault(tuple(sorted(r)), len(sets)))
        except TypeError:
            of_value.append(sets.setdefault(("unsortable", len(sets)), len(sets)))
    return np.array(of_value, dtype=np.int64).reshape(-1)[number] if len(number) else number


def link_numbers(transfers: Sequence, ids: Optional[np.ndarray] = None,
                 parts: Sequence[int] = range(4)) -> np.ndarray:
    """Per transfer, a number that two transfers share exactly when their (sender, receivers, method, route) are
    equal (``ids``: their `link_ids`, where the caller has them), or only those ``parts`` of them (0 sender, 1
    receivers, 2 method, 3 route) that the caller does not know equal already. ``transfers`` is read at the
    first of each distinct object only."""
    return _link_codes(_parts(transfers, ids, parts), len(transfers))


def link_ids(transfers: Iterable) -> np.ndarray:
    """Per transfer, a row of the ids of its sender, receivers, method and route objects: one pass over the
    transfers that `delivered_by_pattern` and a program's buckets check (`reshard.many`) both number from."""
    flat = np.fromiter(map(id, chain.from_iterable(map(_LINK, transfers))), dtype=np.int64)
    return flat.reshape(-1, 4)


def _parts(transfers: Sequence, ids: Optional[np.ndarray] = None,
           parts: Sequence[int] = range(4)) -> list[tuple[np.ndarray, list]]:
    if ids is None:
        ids = link_ids(transfers)
    return [_numbered_ids(ids[:, j], lambda i, j=j: _LINK(transfers[i])[j]) for j in parts]


def _link_codes(parts: list[tuple[np.ndarray, list]], n: int) -> np.ndarray:
    link = np.zeros(n, dtype=np.int64)
    if math.prod(len(distinct) for _, distinct in parts) < 2**62:
        for number, distinct in parts:
            link = link * len(distinct) + number
    else:  # numbered part by part, so that a link's number stays below the number of transfers squared
        for number, distinct in parts:
            link = np.unique(link * len(distinct) + number, return_inverse=True)[1].reshape(-1)
    return link


def _numbered(values: list) -> tuple[np.ndarray, list]:
    """Per value, its number among the distinct values, and those distinct values. Hashed once per distinct object;
    an unhashable one (a bad program's) is its own value, left to `check_transfer` to name."""
    return _numbered_ids(np.fromiter(map(id, values), dtype=np.int64, count=len(values)), values.__getitem__)


def _numbered_ids(ids: np.ndarray, value_at) -> tuple[np.ndarray, list]:
    """`_numbered`, from the values' ids and ``value_at(i)``, the value at position ``i`` (read once per distinct
    id)."""
    first, inverse = np.unique(ids, return_index=True, return_inverse=True)[1:]
    numbers: dict = {}
    distinct: list = []

    def number(value) -> int:
        try:
            found = numbers.setdefault(value, len(distinct))
        except TypeError:
            found = len(distinct)
        if found == len(distinct):
            distinct.append(value)
        return found

    of_object = np.fromiter(map(number, map(value_at, first.tolist())), dtype=np.int64, count=len(first))
    return of_object[inverse.reshape(-1)], distinct


def _box_columns(raw: list, D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Boxes as rows of ``lo`` and ``hi`` bounds padded to ``D`` dims, their numbers of dims, and per box whether it
    is integer (lo, hi) pairs of at most ``D`` dims (a box that is not is left to `check_transfer`, which names what
    is wrong)."""
    n = len(raw)
    lens = np.fromiter(map(len, raw), dtype=np.int64, count=n)
    flat = np.array(list(chain.from_iterable(chain.from_iterable(raw))))
    lo = np.zeros((n, D), dtype=np.int64)
    hi = np.ones((n, D), dtype=np.int64)
    if flat.dtype.kind not in "iub" or len(flat) != 2 * int(lens.sum()) or (lens > D).any():
        # Some bound is not an int or some dim not a pair: find which boxes, one by one (a bad program only).
        good = np.array([all(type(b) is tuple and len(b) == 2 and all(isinstance(x, int) for x in b) for b in box)
                         for box in raw], dtype=bool).reshape(-1) & (lens <= D)
        for i in np.flatnonzero(good).tolist():
            for d, (a, b) in enumerate(raw[i]):
                lo[i, d], hi[i, d] = a, b
        return lo, hi, lens, good
    at = np.cumsum(2 * lens) - 2 * lens
    for d in range(D):
        has = lens > d
        lo[has, d] = flat[at[has] + 2 * d]
        hi[has, d] = flat[at[has] + 2 * d + 1]
    return lo, hi, lens, np.ones(n, dtype=bool)


def _link_ok(key: tuple, methods: Sequence[str], hosts: HostCache) -> bool:
    """`check_transfer`'s rules of a transfer's sender, receivers, method and route."""
    sender, receivers, method, route = key
    if method not in methods or not receivers or len(set(receivers)) != len(receivers) or sender in receivers:
        return False
    try:
        hs = hosts[sender]
        receiving = [hosts[r] for r in receivers]
    except InvalidMeshError:
        return False
    if method == "local":
        return all(h == hs for h in receiving) and not route
    if method == "broadcast":
        remote = set(receiving) - {hs}
        return len(set(route)) == len(route) and set(route) == remote
    return not route


def _inside(lo: np.ndarray, hi: np.ndarray, outer_lo: np.ndarray, outer_hi: np.ndarray) -> np.ndarray:
    return (outer_lo <= lo).all(axis=1) & (hi <= outer_hi).all(axis=1)


class _Tiles:
    """The tile rows of the (sharding, shape) pairs of one check, and each mesh's position of each device."""

    def __init__(self, devices: dict[str, int], D: int):
        self.devices, self.D = devices, D
        self.pairs: dict[tuple, tuple[int, int] | None] = {}
        self.meshes: dict[tuple[str, ...], int] = {}
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []
        self.distinct: list[np.ndarray] = []  # per tile row, which of its pair's distinct tiles it is
        self.size = 0
        self.num_distinct = 0  # the most distinct tiles of any pair
        self.of_row: dict[int, tuple] = {}  # first row -> (lo, hi, distinct lo, distinct hi, distinct, devices)
        self.layouts: dict[tuple[int, int], tuple | None] = {}

    def add(self, sharding: Sharding, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(first tile row, mesh index) of ``sharding`` for ``shape``; None where its tiles cannot be had."""
        key = (sharding, shape)
        found = self.pairs.get(key, False)
        if found is not False:
            return found
        try:
            tiles = sharding.tiles(shape)
            devices = sharding.mesh.require_devices()
        except ValueError:  # an abstract mesh or a shape the sharding cannot split: check_delivery says which
            self.pairs[key] = None
            return None
        lo = np.zeros((len(devices), self.D), dtype=np.int64)
        hi = np.ones((len(devices), self.D), dtype=np.int64)
        for p, dev in enumerate(devices):
            for d, (a, b) in enumerate(tiles[dev]):
                lo[p, d], hi[p, d] = a, b
        mesh = self.meshes.get(devices)
        if mesh is None:
            mesh = self.meshes[devices] = len(self.meshes)
            for dev in devices:
                self.devices.setdefault(dev, len(self.devices))
        distinct, which = np.unique(np.concatenate([lo, hi], axis=1), axis=0, return_inverse=True)
        first = self.size
        self.lo.append(lo)
        self.hi.append(hi)
        self.distinct.append(which.reshape(-1))
        self.size += len(devices)
        self.num_distinct = max(self.num_distinct, len(distinct))
        self.of_row[first] = (lo, hi, distinct[:, :self.D], distinct[:, self.D:], which.reshape(-1), devices)
        self.pairs[key] = (first, mesh)
        return first, mesh

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every tile row's bounds, and per mesh the position of each device (-1 where not in it)."""
        position = np.full((max(1, len(self.meshes)), max(1, len(self.devices))), -1, dtype=np.int64)
        for devices, m in self.meshes.items():
            position[m, [self.devices[d] for d in devices]] = np.arange(len(devices))
        if not self.lo:
            return np.zeros((1, self.D), dtype=np.int64), np.ones((1, self.D), dtype=np.int64), position
        return np.concatenate(self.lo), np.concatenate(self.hi), position

    def distinct_column(self) -> np.ndarray:
        """Per tile row, which of its pair's distinct tiles it is."""
        return np.concatenate(self.distinct) if self.distinct else np.zeros(1, dtype=np.int64)

    def layout(self, src: int, dst: int, shape: tuple[int, ...]) -> tuple | None:
        """For the pairs whose tiles start at rows ``src`` and ``dst`` (of a tensor of ``shape``): how many expected
        pieces, and the (destination position, distinct source tile) of each piece a destination device holds as
        a source device; None where the distinct source tiles do not partition the tensor (no sharding's do not)."""
        if (src, dst) in self.layouts:
            return self.layouts[(src, dst)]
        slo, shi, ulo, uhi, which, src_devices = self.of_row[src]
        dlo, dhi, _, _, _, dst_devices = self.of_row[dst]
        some = (ulo < uhi).all(axis=1)
        # Distinct tiles are disjoint when, in each dim, two of their intervals are equal or do not overlap; then
        # they partition the tensor when their volumes add up to its own.
        found = None
        if int((uhi[some] - ulo[some]).prod(axis=1).sum()) == int(np.prod(shape, dtype=np.int64)) and all(
                _disjoint(np.unique(np.column_stack([ulo[some, d], uhi[some, d]]), axis=0)) for d in range(self.D)):
            cut = (np.maximum(dlo[:, None], ulo[None]) < np.minimum(dhi[:, None], uhi[None])).all(axis=2)
            at = {dev: p for p, dev in enumerate(src_devices)}
            pairs = [(i, at[dev]) for i, dev in enumerate(dst_devices) if dev in at]
            hq = np.array([i for i, _ in pairs], dtype=np.int64)
            hs = which[np.array([p for _, p in pairs], dtype=np.int64)]
            kept = cut[hq, hs]
            found = int(cut.sum()), hq[kept], hs[kept]
        self.layouts[(src, dst)] = found
        return found


def _disjoint(intervals: np.ndarray) -> bool:
    """Whether sorted distinct (lo, hi) rows overlap nowhere."""
    return bool((intervals[1:, 0] >= intervals[:-1, 1]).all())
