"""The NIXL transport's memory: host buffers registered once with a NIXL agent, the contiguous runs a box occupies in
them, and the byte layout of the notifications that name those runs.

================ ===========================================================================
``Registry``     a NIXL agent's registered host buffers, one `Registration` each, cached by
                 (address, size) and reused across jobs; held weakly and deregistered as the
                 buffer is freed (before its memory can be handed out again): a strong
                 reference would keep the shard store's released tiles and the ring's
                 scratch from their recyclers, which hand out only buffers nothing else holds
``source_runs``  a source region's contiguous runs in its tile, in C order (a sender WRITEs
                 from them: a strided box is a descriptor list, not a packed copy)
``place_runs``   a destination box's runs in the tile that ``place`` offers (a receiver posts
                 them)
``pair_runs``    a chunk's local runs against the receiver's runs, cut where either ends: the
                 two descriptor lists of one WRITE
``Landing``      where one incoming box lands, and its bytes as landed
``encode``       a notification: kind byte, step, hop, job, payload in our own layout (NIXL's
                 own descriptor serialisation pickles, and no pickle goes on a wire); the
                 payloads' layouts are ``CHUNK``, ``TRAILER`` and ``POST``
================ ===========================================================================
"""

from __future__ import annotations

import bisect
import itertools
import logging
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from reshard.box import Box
from reshard.server.transport.streams import StreamKey

__all__ = ["HEAD", "CHUNK", "TRAILER", "POST", "encode", "decode", "box_bytes", "box_of", "Registration", "Registry",
           "owner_of", "source_runs", "place_runs", "pair_runs", "Landing"]

log = logging.getLogger(__name__)

HEAD = struct.Struct("<cIIH")  # kind, step, hop, len(job)
CHUNK = struct.Struct("<QQB")  # offset, nbytes, ndim; then int64 (lo, hi) per dim
TRAILER = struct.Struct("<QQQ")  # nbytes, xxh3_64, chunks
POST = struct.Struct("<II")  # device id, len(partial metadata); then uint64 (address, length) per run


# -- notifications ----------------------------------------------------------------------------------------


def encode(kind: bytes, key: StreamKey, payload: bytes = b"") -> bytes:
    job = key.job.encode()
    return HEAD.pack(kind, key.step, key.hop, len(job)) + job + payload


def decode(msg: bytes) -> tuple[bytes, StreamKey, memoryview]:
    kind, step, hop, n = HEAD.unpack_from(msg)
    end = HEAD.size + n
    return kind, StreamKey(bytes(msg[HEAD.size:end]).decode(), step, hop), memoryview(msg)[end:]


def box_bytes(box: Box) -> bytes:
    return np.asarray(box, dtype=np.int64).reshape(-1).tobytes()


def box_of(data, ndim: int) -> Box:
    flat = np.frombuffer(data, dtype=np.int64, count=2 * ndim).tolist()
    return tuple((flat[2 * i], flat[2 * i + 1]) for i in range(ndim))


# -- registration -----------------------------------------------------------------------------------------


class Registration:
    """One registered host buffer: its NIXL descriptors, and the peers that loaded its partial metadata."""

    def __init__(self, ident: int, descs, metadata: bytes):
        self.ident = ident
        self.descs = descs
        self.metadata = metadata
        self.peers: set[str] = set()


class Registry:
    """The host buffers registered with one NIXL agent (see the module table)."""

    def __init__(self, agent, host: str):
        self._agent = agent
        self._host = host
        self._lock = threading.RLock()  # a buffer freed on this thread deregisters under it (`_forget`)
        self._regs: dict[tuple[int, int], Registration] = {}
        self._ids = itertools.count(1)
        self.registered = 0  # registrations made, for tests and stats

    def __len__(self) -> int:
        with self._lock:
            return len(self._regs)

    def register(self, owner: np.ndarray) -> Registration:
        """``owner``'s registration, made at its first use."""
        key = (owner.ctypes.data, owner.nbytes)
        with self._lock:
            reg = self._regs.get(key)
            if reg is None:
                descs = self._agent.register_memory([(key[0], key[1], 0, "")], "DRAM")
                metadata = self._agent.get_partial_agent_metadata(descs, False)
                reg = self._regs[key] = Registration(next(self._ids), descs, metadata)
                self.registered += 1
                weakref.finalize(owner, _forget, weakref.ref(self), key, reg.ident)
            return reg

    def metadata_for(self, reg: Registration, peer: str) -> bytes:
        """The partial metadata ``peer`` needs before it may write into ``reg``: empty where it has it already."""
        with self._lock:
            known = peer in reg.peers
            reg.peers.add(peer)
        return b"" if known else reg.metadata

    def forget_peer(self, host: str) -> None:
        """``host``'s agent knows none of this agent's memory (it is new, or gone)."""
        with self._lock:
            for reg in self._regs.values():
                reg.peers.discard(host)

    def deregister(self, key: tuple[int, int], ident: int) -> None:
        with self._lock:
            reg = self._regs.get(key)
            if reg is None or reg.ident != ident or self._agent is None:
                return
            del self._regs[key]
            self._agent.deregister_memory(reg.descs)

    def close(self) -> None:
        """Deregister every buffer; a buffer freed later has nothing to deregister."""
        with self._lock:
            regs, self._regs = list(self._regs.values()), {}
            agent, self._agent = self._agent, None
        for reg in regs:
            try:
                agent.deregister_memory(reg.descs)
            except Exception as e:  # noqa: BLE001 - the agent goes away with its registrations anyway
                log.debug("host %s: deregistering a buffer at close failed: %s", self._host, e)


def _forget(ref: weakref.ref, key: tuple[int, int], ident: int) -> None:
    registry = ref()
    if registry is not None:
        registry.deregister(key, ident)


# -- runs -------------------------------------------------------------------------------------------------


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def owner_of(data) -> tuple[np.ndarray | None, np.ndarray]:
    """The C-contiguous numpy buffer that owns ``data``'s memory (None where it is not one), and ``data``'s bytes
    as a uint8 array (a view); ``data`` is C-contiguous."""
    flat = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    obj = data.obj if isinstance(data, memoryview) else data
    if isinstance(obj, np.ndarray):
        obj = _root(obj)
    if isinstance(obj, np.ndarray) and obj.flags.owndata and obj.flags.c_contiguous and obj.nbytes:
        lo = obj.ctypes.data
        if lo <= flat.ctypes.data and flat.ctypes.data + flat.nbytes <= lo + obj.nbytes:
            return obj, flat
    return None, flat


def source_runs(view, most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The C-contiguous numpy buffer that owns ``view`` (a region of a tile, strided or not) and its contiguous
    runs there in C order: (owner, addresses, lengths), int64. None where ``view`` is not a numpy view of such a
    buffer (a torch tensor, a CUDA buffer), has negative strides, or has more than ``most`` runs."""
    if not isinstance(view, np.ndarray) or not view.nbytes:
        return None
    owner = _root(view)
    if not (owner.flags.owndata and owner.flags.c_contiguous and owner.nbytes) or min(view.strides, default=0) < 0:
        return None
    k, run = view.ndim, view.itemsize
    while k and (view.shape[k - 1] == 1 or view.strides[k - 1] == run):  # the trailing dims that are one block
        run *= view.shape[k - 1]
        k -= 1
    if int(np.prod(view.shape[:k], dtype=np.int64)) > most:
        return None
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(view.shape[:k], view.strides[:k]):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    addrs = view.ctypes.data + offsets
    lo, base = int(addrs[0]), owner.ctypes.data
    if lo < base or int(addrs[-1]) + run > base + owner.nbytes:
        return None
    return owner, addrs, np.full(len(addrs), run, dtype=np.int64)


def pair_runs(local: tuple[np.ndarray, np.ndarray], remote: tuple[np.ndarray, np.ndarray], off: int,
              n: int) -> tuple[np.ndarray, np.ndarray]:
    """The (address, length) pieces, int64 arrays of shape (k, 2), of one WRITE: bytes ``[0, n)`` of the ``local``
    runs into bytes ``[off, off + n)`` of the ``remote`` ones, each (addresses, offsets of their starts and the
    end) in C order, cut wherever a run on either side ends."""
    la, lc = local
    ra, rc = remote
    inner = rc[(rc > off) & (rc < off + n)] - off
    cuts = np.union1d(lc[:-1], inner)
    lens = np.diff(np.append(cuts, n))
    li = np.searchsorted(lc, cuts, side="right") - 1
    ri = np.searchsorted(rc, cuts + off, side="right") - 1
    return (np.stack([la[li] + cuts - lc[li], lens], axis=1),
            np.stack([ra[ri] + cuts + off - rc[ri], lens], axis=1))


def place_runs(box: Box, place: Callable[[Box], tuple[str, Any] | None],
               most: int) -> tuple[str, np.ndarray, list[tuple[int, int]]] | None:
    """The device, owning buffer and C-ordered contiguous runs (address, length) that ``place`` offers for
    ``box``: one region where the box is contiguous there, else the regions of its slices along its first dim
    of more than one index, recursively. None where a part has no region, the parts lie in more than one
    buffer, or there would be more than ``most`` runs."""
    runs: list[tuple[int, int]] = []
    where: list = []  # [device, owner]
    if not _visit(box, place, most, runs, where):
        return None
    return where[0], where[1], runs


def _visit(b: Box, place, most: int, runs: list[tuple[int, int]], where: list) -> bool:
    """`place_runs` of ``b``, appended to ``runs``; False where it has none (a function of its own, not a closure: a
    recursive closure is a reference cycle, which would keep a freed tile registered until the next collection)."""
    got = place(b)
    if got is not None:
        device, view = got
        if not isinstance(view, np.ndarray) or not view.flags.c_contiguous:
            return False
        owner, flat = owner_of(view)
        if owner is None or (where and (where[0] != device or where[1] is not owner)):
            return False
        if not where:
            where.extend((device, owner))
        addr = flat.ctypes.data
        if runs and runs[-1][0] + runs[-1][1] == addr:
            runs[-1] = (runs[-1][0], runs[-1][1] + flat.nbytes)
        else:
            runs.append((addr, flat.nbytes))
        return len(runs) <= most
    d = next((i for i, (lo, hi) in enumerate(b) if hi - lo > 1), None)
    if d is None:
        return False
    lo, hi = b[d]
    return all(_visit(b[:d] + ((i, i + 1),) + b[d + 1:], place, most, runs, where) for i in range(lo, hi))


def _segments(addrs: list[int], cum: list[int], off: int, n: int) -> list[tuple[int, int]]:
    """The (address, length) pieces of bytes ``[off, off + n)`` of runs at ``addrs`` whose offsets are ``cum``."""
    out = []
    i = bisect.bisect_right(cum, off) - 1
    while n > 0:
        start = off - cum[i]
        take = min(cum[i + 1] - cum[i] - start, n)
        out.append((addrs[i] + start, take))
        off, n, i = off + take, n - take, i + 1
    return out


class Landing:
    """Where one incoming box lands: runs in one registered buffer, and the device that holds it (None: a scratch
    buffer, handed back by ``release``)."""

    def __init__(self, buffer: np.ndarray, runs: list[tuple[int, int]], device: str | None,
                 registration: Registration, release: Callable[[], None] = lambda: None):
        self.buffer = buffer  # uint8, the whole registered buffer
        self.base = buffer.ctypes.data
        self.addrs = [a for a, _ in runs]
        self.cum = [0, *itertools.accumulate(n for _, n in runs)]
        self.device = device
        self.registration = registration
        self.release = release

    def piece(self, off: int, n: int):
        """Bytes ``[off, off + n)`` of the box as landed: a view where they are one run (a chain hop forwards
        and a fault corrupts what is kept), else a read-only copy of them in C order."""
        segs = _segments(self.addrs, self.cum, off, n)
        if len(segs) == 1:
            a = segs[0][0] - self.base
            return self.buffer[a:a + n]
        out = np.concatenate([self.buffer[a - self.base:a - self.base + k] for a, k in segs])
        out.flags.writeable = False
        return out
