"""Where a box lies in memory as contiguous runs, for the NIXL transport's WRITEs: a sender's runs in its source tile,
a receiver's in its destination tiles, and the two paired into one WRITE's descriptor lists.

================ ===========================================================================
``source_runs``  a source region's contiguous runs in its tile, in C order (a sender WRITEs
                 from them: a strided box is a descriptor list, not a packed copy)
``place_runs``   a destination box's runs in the buffers that ``place`` offers: a tile, or a
                 bucket's members' tiles (a receiver posts them)
``segment_runs`` a bucket's members' regions (`Segments`) as runs, their buffers and a view of
                 each run, in one pass (`place_runs` of a whole bucket, for its post)
``parts_runs``   the runs of a bucket's parts from where they lie (one part's: ``part_runs``)
``pair_runs``    a chunk's local runs against the receiver's runs, cut where either ends: the
                 two descriptor lists of one WRITE (``pair_descs``: as NIXL takes them, in C
                 where ``reshard._delta_kernel`` is built)
================ ===========================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from reshard.box import Box
from reshard.server.transport.shm import address_of
from reshard.server.transport.streams import Segments

try:  # built by pip where a C compiler is present (`pair_descs`)
    from reshard import _delta_kernel as _kernel
except ImportError:
    _kernel = None

__all__ = ["buffer_root", "owner_of", "source_runs", "part_runs", "parts_runs", "place_runs", "segment_runs",
           "pair_runs", "pair_descs"]

def buffer_root(array: np.ndarray) -> np.ndarray:
    """The array whose memory ``array`` views (``array`` itself where it is no view), through every view between."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _owns(array: np.ndarray) -> bool:
    """Whether ``array`` is a buffer of its own: it allocated its memory, or is the array over memory that no
    other array holds (a `Pool` buffer over its mapping)."""
    return array.flags.owndata or not isinstance(array.base, np.ndarray)


def owner_of(data) -> tuple[np.ndarray | None, np.ndarray]:
    """The C-contiguous numpy buffer that owns ``data``'s memory (None where it is not one), and ``data``'s bytes
    as a uint8 array (a view); ``data`` is C-contiguous."""
    flat = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    obj = data.obj if isinstance(data, memoryview) else data
    if isinstance(obj, np.ndarray):
        obj = buffer_root(obj)
    if isinstance(obj, np.ndarray) and _is_buffer(obj):
        lo, at = address_of(obj), address_of(flat)  # (each `.ctypes` makes an object: `shm.address_of`)
        if lo <= at and at + flat.nbytes <= lo + obj.nbytes:
            return obj, flat
    return None, flat


def _span_of(part: np.ndarray, spans: dict[int, tuple[int, int]],
             owners: list[np.ndarray]) -> tuple[int, int] | None:
    """Where C-contiguous array ``part`` lies, (address, bytes), inside the buffer that owns its memory, as
    `owner_of` finds it: None where it lies in no such buffer. ``spans`` keeps each owner's (start, end) by id, and
    ``owners`` lists each owner once as it is first met: a bucket's members lie in a few hundred tiles, and a
    post asks this per member (`owner_of` made three ``.ctypes`` objects and two views per member, about a third
    of a receiver's CPU in posting a weight sync's receives)."""
    owner = buffer_root(part)
    span = spans.get(id(owner))
    if span is None:
        if not _is_buffer(owner):
            return None
        span = _note_owner(owner, spans, owners)
    addr, n = address_of(part), part.nbytes
    if addr < span[0] or addr + n > span[1]:
        return None
    return addr, n


def _is_buffer(array: np.ndarray) -> bool:
    """Whether ``array`` is a C-contiguous, non-empty buffer of its own (`_owns`): one a registration may name."""
    return _owns(array) and array.flags.c_contiguous and bool(array.nbytes)


def _note_owner(owner: np.ndarray, spans: dict[int, tuple[int, int]], owners: list[np.ndarray]) -> tuple[int, int]:
    """Add ``owner`` to a `place_runs` walk's owners, once, and return its (start, end)."""
    span = spans.get(id(owner))
    if span is None:
        start = address_of(owner)
        span = spans[id(owner)] = (start, start + owner.nbytes)
        owners.append(owner)
    return span


def _contiguous_run(view: np.ndarray) -> tuple[np.ndarray, int] | None:
    """The C-contiguous numpy buffer that owns C-contiguous, non-empty ``view``, and the address of ``view`` in it:
    `source_runs`' one run, as plain numbers. None where ``view`` does not lie inside such a buffer."""
    owner = buffer_root(view)
    if not _is_buffer(owner):
        return None
    lo, base = address_of(view), address_of(owner)  # (each `.ctypes` makes an object: `shm.address_of`)
    return (owner, lo) if base <= lo <= base + owner.nbytes - view.nbytes else None


def source_runs(view, most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The C-contiguous numpy buffer that owns ``view`` (a region of a tile, strided or not) and its contiguous
    runs there in C order: (owner, addresses, lengths), int64. None where ``view`` is not a numpy view of such a
    buffer (a torch tensor, a CUDA buffer), has negative strides, or has more than ``most`` runs."""
    if not isinstance(view, np.ndarray) or not view.nbytes:
        return None
    if view.flags.c_contiguous:  # one run: the common chunk of a contiguous box, worked out without the offsets
        one = _contiguous_run(view)
        if one is None:
            return None
        return one[0], np.array([one[1]], dtype=np.int64), np.array([view.nbytes], dtype=np.int64)
    owner = buffer_root(view)
    if not _is_buffer(owner) or min(view.strides, default=0) < 0:
        return None
    k, run = view.ndim, view.itemsize
    while k and (view.shape[k - 1] == 1 or view.strides[k - 1] == run):  # the trailing dims that are one block
        run *= view.shape[k - 1]
        k -= 1
    if math.prod(view.shape[:k]) > most:  # (numpy's prod of a tuple took 11 us here, math's 0.5 us)
        return None
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(view.shape[:k], view.strides[:k]):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    addrs = view.ctypes.data + offsets
    lo, base = int(addrs[0]), address_of(owner)
    if lo < base or int(addrs[-1]) + run > base + owner.nbytes:
        return None
    return owner, addrs, np.full(len(addrs), run, dtype=np.int64)


def part_runs(part: np.ndarray, run_bytes: int) -> tuple[np.ndarray, list[int], list[int]] | None:
    """`source_runs` of one non-empty part (a bucket's member) as plain lists, (owner, addresses, lengths): a bucket's
    WRITE makes its arrays once, as numpy calls per member cost more than the member's own work."""
    if part.flags.c_contiguous:  # one run, the common member
        one = _contiguous_run(part)
        return None if one is None else (one[0], [one[1]], [part.nbytes])
    found = source_runs(part, max(1, part.nbytes // run_bytes))
    return None if found is None else (found[0], found[1].tolist(), found[2].tolist())


def parts_runs(parts: list, run_bytes: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The runs of ``parts`` (arrays, in order) in their own buffers where they average ``run_bytes`` or more, else
    packed: (addresses, offsets of their starts and the end, the packed copies to keep while they are read)."""
    addrs, cum, keep = [], [0], []
    for p in parts:
        if not p.nbytes:
            continue
        found = part_runs(p, run_bytes)
        if found is None:
            p = np.ascontiguousarray(p)
            keep.append(p)
            found = (p, [address_of(p)], [p.nbytes])
        addrs += found[1]
        for length in found[2]:
            cum.append(cum[-1] + length)
    return np.array(addrs, dtype=np.int64), np.array(cum, dtype=np.int64), keep


def pair_runs(local: tuple[np.ndarray, np.ndarray], remote: tuple[np.ndarray, np.ndarray], off: int,
              n: int) -> tuple[np.ndarray, np.ndarray]:
    """The (address, length) pieces, int64 arrays of shape (k, 2), of one WRITE: bytes ``[0, n)`` of the ``local``
    runs into bytes ``[off, off + n)`` of the ``remote`` ones, each (addresses, offsets of their starts and the
    end) in C order, cut wherever a run on either side ends."""
    la, lc = local
    ra, rc = remote
    if len(la) == 1:  # one local run (a contiguous chunk): where it falls in one remote run, no cuts to sort
        i = int(np.searchsorted(rc, off, side="right")) - 1
        if off + n <= rc[i + 1]:
            return (np.array([[la[0], n]], dtype=np.int64),
                    np.array([[ra[i] + off - rc[i], n]], dtype=np.int64))
    inner = rc[(rc > off) & (rc < off + n)] - off
    cuts = np.union1d(lc[:-1], inner)
    lens = np.diff(np.append(cuts, n))
    li = np.searchsorted(lc, cuts, side="right") - 1
    ri = np.searchsorted(rc, cuts + off, side="right") - 1
    return (np.stack([la[li] + cuts - lc[li], lens], axis=1),
            np.stack([ra[ri] + cuts + off - rc[ri], lens], axis=1))


def pair_descs(local: tuple[np.ndarray, np.ndarray], remote: tuple[np.ndarray, np.ndarray], off: int, n: int,
               local_device: int = 0, remote_device: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`pair_runs` as the descriptor lists of one WRITE: two uint64 arrays of shape (k, 3), rows (address, length,
    device); cut in one pass by the compiled kernel where it is built, where numpy's way takes about 20 calls (110-280
    us a WRITE here, 6% of the agents' CPU in the weight-sync bench's nixl sync on the emulated hosts)."""
    if _kernel is None:
        mine, theirs = pair_runs(local, remote, off, n)
        local_descs = np.full((len(mine), 3), local_device, dtype=np.uint64)
        local_descs[:, :2] = mine
        remote_descs = np.full((len(theirs), 3), remote_device, dtype=np.uint64)
        remote_descs[:, :2] = theirs
        return local_descs, remote_descs
    room = len(local[0]) + len(remote[0])
    local_descs = np.empty((room, 3), dtype=np.uint64)
    remote_descs = np.empty((room, 3), dtype=np.uint64)
    k = _kernel.pair_runs(local[0], local[1], remote[0], remote[1], off, n, local_descs, remote_descs, local_device,
                          remote_device)
    return local_descs[:k], remote_descs[:k]


def place_runs(box: Box, place: Callable[[Box], tuple[str, Any] | None],
               most: int) -> tuple[str, list[np.ndarray], list[tuple[int, int]], bool] | None:
    """The device, the buffers that own them, and the C-ordered contiguous runs (address, length) that ``place``
    offers for ``box``: one region where the box is contiguous there, or a bucket's members' regions (`Segments`),
    else the regions of its slices along its first dim of more than one index, recursively; and whether the
    place gave `Segments`. None where a part has no region, the parts lie on more than one device, or there would
    be more than ``most`` runs."""
    runs: list[tuple[int, int]] = []
    where: list = []  # [device, owners, scattered, each owner's (start, end) by id]
    if not _visit(box, place, most, runs, where):
        return None
    return where[0], where[1], runs, where[2]


def segment_runs(parts: Segments, most: int) -> tuple[list[np.ndarray], list[tuple[int, int]],
                                                    list[tuple[int, int]], list[np.ndarray]] | None:
    """`place_runs` of a whole bucket that landed as ``parts`` (a bucket's members' regions, `Segments`), with what a
    post asks of them next, in one pass: the buffers that own the parts, each one's (address, bytes), the runs
    (address, length; parts adjacent in one buffer are one run) and a uint8 view of each run. None where a part is
    not C-contiguous in a buffer of its own, or there would be more than ``most`` runs. A post of a bucket asked
    the address of every member's buffer three times, once to find its runs, once to view them and once to
    register them (`nixl.NixlTransport._landing`): about half of the CPU a receiver spent posting a weight sync.
    In C where ``reshard._delta_kernel`` is built: a weight sync's buckets hold about 200 members each, and this
    pass took 0.7 ms of a receiver's CPU per post in Python."""
    if _kernel is None:
        return _segment_runs(parts, most)
    found = _kernel.segment_runs(parts, np.ndarray, most)
    if found is None:
        return None
    owners, keys, runs, firsts = found
    views = []
    for (addr, n), k in zip(runs, firsts):
        if k >= 0:
            part = parts[k]
            views.append(part if part.ndim == 1 and part.dtype == np.uint8 else part.reshape(-1).view(np.uint8))
        else:  # parts merged into one run: a view of their buffer (its index, -1 - k)
            at = addr - keys[-1 - k][0]
            views.append(owners[-1 - k].reshape(-1).view(np.uint8)[at:at + n])
    return owners, keys, runs, views


def _segment_runs(parts: Segments, most: int) -> tuple[list[np.ndarray], list[tuple[int, int]],
                                                      list[tuple[int, int]], list[np.ndarray]] | None:
    """`segment_runs` in Python, where the C kernel is not built."""
    spans: dict[int, tuple[int, int, int]] = {}  # id(owner) -> (start, end, index)
    owners: list[np.ndarray] = []
    keys: list[tuple[int, int]] = []
    runs: list[list[int]] = []  # [address, length, owner index]
    views: list[np.ndarray | None] = []  # a run's view, None where runs merged (made from its owner below)
    for part in parts:
        if type(part) is not np.ndarray or not part.flags.c_contiguous:
            return None
        n = part.nbytes
        if not n:
            continue
        owner = part
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        span = spans.get(id(owner))
        if span is None:
            if not _is_buffer(owner):
                return None
            start = address_of(owner)
            span = spans[id(owner)] = (start, start + owner.nbytes, len(owners))
            owners.append(owner)
            keys.append((start, owner.nbytes))
        addr = address_of(part)
        if addr < span[0] or addr + n > span[1]:
            return None
        if runs and runs[-1][0] + runs[-1][1] == addr and runs[-1][2] == span[2]:
            runs[-1][1] += n
            views[-1] = None
        else:
            if len(runs) == most:
                return None
            runs.append([addr, n, span[2]])
            views.append(part if part.ndim == 1 and part.dtype == np.uint8 else part.reshape(-1).view(np.uint8))
    for k, view in enumerate(views):
        if view is None:
            addr, n, i = runs[k]
            at = addr - keys[i][0]
            views[k] = owners[i].reshape(-1).view(np.uint8)[at:at + n]
    return owners, keys, [(a, n) for a, n, _ in runs], views


def _visit(b: Box, place, most: int, runs: list[tuple[int, int]], where: list) -> bool:
    """`place_runs` of ``b``, appended to ``runs``; False where it has none (a function of its own, not a closure: a
    recursive closure is a reference cycle, which would keep a freed tile registered until the next collection)."""
    got = place(b)
    if got is not None:
        device, view = got
        parts = view if isinstance(view, Segments) else (view,)
        if not where:
            where.extend((device, [], isinstance(view, Segments), {}))
        elif where[0] != device:
            return False
        for part in parts:
            if not isinstance(part, np.ndarray) or not part.flags.c_contiguous:
                return False
            found = _span_of(part, where[3], where[1])
            if found is None:
                return False
            addr, n = found
            if runs and runs[-1][0] + runs[-1][1] == addr:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            elif n:
                runs.append((addr, n))
        return len(runs) <= most
    d = next((i for i, (lo, hi) in enumerate(b) if hi - lo > 1), None)
    if d is None:
        return False
    lo, hi = b[d]
    if hi - lo > 2:  # rows of one tile, each contiguous (a column split's box): placed by their stride
        spaced = _spaced(b, d, place)
        if spaced is not None:
            device, owner, first, nbytes, stride = spaced
            if hi - lo > most or (where and where[0] != device):
                return False
            if not where:
                where.extend((device, [], False, {}))
            _note_owner(owner, where[3], where[1])
            for k in range(hi - lo):
                addr = first + k * stride
                if runs and runs[-1][0] + runs[-1][1] == addr:
                    runs[-1] = (runs[-1][0], runs[-1][1] + nbytes)
                else:
                    runs.append((addr, nbytes))
            return len(runs) <= most
    return all(_visit(b[:d] + ((i, i + 1),) + b[d + 1:], place, most, runs, where) for i in range(lo, hi))


def _spaced(b: Box, d: int, place) -> tuple[str, np.ndarray, int, int, int] | None:
    """Where the first and the last slice of ``b`` along dim ``d`` are each one contiguous region of one buffer on
    one device, ``stride`` bytes a slice apart as that buffer's dim ``d`` is: (device, owner, the first slice's
    address, a slice's bytes, stride). A tile is a box, so every slice between them lies in it too, at its place in
    that stride: `_visit` need not ask ``place`` for each (a call of Python per row of a column split)."""
    lo, hi = b[d]
    ends = [place(b[:d] + ((i, i + 1),) + b[d + 1:]) for i in (lo, hi - 1)]
    if any(got is None or type(got[1]) is not np.ndarray or not got[1].flags.c_contiguous for got in ends):
        return None
    (device, first), (other, last) = ends
    owner, head = owner_of(first)
    if owner is None or other != device or owner_of(last)[0] is not owner or head.nbytes != last.nbytes:
        return None
    stride = first.strides[d] if first.ndim == len(b) else 0
    at = address_of(head)
    if not stride or address_of(last) - at != (hi - 1 - lo) * stride:
        return None
    return device, owner, at, head.nbytes, stride
