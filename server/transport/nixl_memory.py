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
``place_runs``   a destination box's runs in the buffers that ``place`` offers: a tile, or a
                 bucket's members' tiles (a receiver posts them)
``parts_runs``   the runs of a bucket's parts from where they lie (one part's: ``part_runs``)
``pair_runs``    a chunk's local runs against the receiver's runs, cut where either ends: the
                 two descriptor lists of one WRITE (``pair_descs``: as NIXL takes them, in C
                 where ``reshard._delta_kernel`` is built)
``Landing``      where one incoming box lands (its runs, and the buffers that hold them), and its
                 bytes as landed
``DevicePool``   GPU buffers (VRAM) registered once and kept: where a box bound for a GPU tile
                 lands (`DeviceLanding`); a tile's own GPU memory is never offered to a peer
                 (torch's allocator hands it out again, which `Registry.usable` would bury
                 for good)
``encode``       a notification: kind byte, step, hop, job, payload in our own layout (NIXL's
                 own descriptor serialisation pickles, and no pickle goes on a wire); the
                 payloads' layouts are ``CHUNK``, ``TRAILER`` and ``POST`` (with its shared-
                 memory offer, `shm`)
================ ===========================================================================
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import mmap
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from reshard.box import Box
from reshard.proto.errors import UnavailableError
from reshard.server.transport.buffers import RECYCLE_MIN_BYTES
from reshard.server.transport.shm import address_of
from reshard.server.transport.streams import Segments, StreamKey

try:  # built by pip where a C compiler is present (`pair_descs`)
    from reshard import _delta_kernel as _kernel
except ImportError:
    _kernel = None

__all__ = ["HEAD", "CHUNK", "TRAILER", "POST", "INCARNATION", "blobs", "unblob", "encode", "decode", "box_bytes",
           "box_of", "Registration", "Registry", "Pool", "DevicePool", "owner_of", "source_runs", "part_runs",
           "parts_runs", "place_runs", "pair_runs", "pair_descs", "Landing", "DeviceLanding", "device_root"]

log = logging.getLogger(__name__)

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value where this Python does not name it

HEAD = struct.Struct("<cIIH")  # kind, step, hop, len(job)
CHUNK = struct.Struct("<QQB")  # offset, nbytes, ndim; then int64 (lo, hi) per dim
TRAILER = struct.Struct("<QQQ")  # nbytes, xxh3_64, chunks
POST = struct.Struct("<IIIB8s")  # device id, len(metadata blobs), len(shared-memory offer: `shm.encode_offer`),
# whether the runs are GPU memory (VRAM: the stream's trailer then holds the GPU digest), and the poster's incarnation
# (`INCARNATION`); then the blobs, the offer, and uint64 (address, length) per run
INCARNATION = 8  # bytes of an agent's incarnation: random, new each time its NIXL agent is made (`NixlTransport`)
BLOB = struct.Struct("<I")  # the length of one partial metadata blob, before its bytes


# -- notifications ----------------------------------------------------------------------------------------


def encode(kind: bytes, key: StreamKey, payload: bytes = b"") -> bytes:
    job = key.job.encode()
    return HEAD.pack(kind, key.step, key.hop, len(job)) + job + payload


def decode(msg: bytes) -> tuple[bytes, StreamKey, memoryview]:
    kind, step, hop, n = HEAD.unpack_from(msg)
    end = HEAD.size + n
    return kind, StreamKey(bytes(msg[HEAD.size:end]).decode(), step, hop), memoryview(msg)[end:]


def blobs(parts: list[bytes]) -> bytes:
    """Partial metadata blobs (one per newly registered buffer a post names) as one length-prefixed run."""
    return b"".join(BLOB.pack(len(p)) + p for p in parts if p)


def unblob(data) -> list[bytes]:
    """The blobs of `blobs`."""
    out, i = [], 0
    while i < len(data):
        (n,) = BLOB.unpack_from(data, i)
        out.append(bytes(data[i + BLOB.size:i + BLOB.size + n]))
        i += BLOB.size + n
    return out


def box_bytes(box: Box) -> bytes:
    return np.asarray(box, dtype=np.int64).reshape(-1).tobytes()


def box_of(data, ndim: int) -> Box:
    flat = np.frombuffer(data, dtype=np.int64, count=2 * ndim).tolist()
    return tuple((flat[2 * i], flat[2 * i + 1]) for i in range(ndim))


# -- registration -----------------------------------------------------------------------------------------


class Registration:
    """One registered host buffer: its NIXL descriptors, and the peers that loaded its partial metadata."""

    def __init__(self, ident: int, descs, metadata: bytes, offerable: bool):
        self.ident = ident
        self.descs = descs
        self.metadata = metadata
        self.peers: set[str] = set()
        self.offerable = offerable  # clear of every buried range when made, so never shadowed at a peer


class Registry:
    """The host buffers registered with one NIXL agent (see the module table)."""

    def __init__(self, agent, host: str):
        self._agent = agent
        self.host = host  # named in errors and logs
        self._lock = threading.RLock()  # a buffer freed on this thread deregisters under it (`_forget`)
        self._regs: dict[tuple[int, int], Registration] = {}
        # Address ranges, merged and sorted, of buffers deregistered after a peer loaded their metadata. NIXL gives
        # no way to make a peer forget one buffer's, and a peer that knows a stale region overlapping a new one
        # may match a WRITE against the stale one (NIXL_ERR_NOT_FOUND, or under RDMA a dead key): memory there
        # is never offered to a peer again (`usable`), and what would land in it lands in scratch instead.
        self._dead: list[tuple[int, int]] = []
        self._ids = itertools.count(1)
        self.registered = 0  # registrations made, for tests and stats

    def __len__(self) -> int:
        with self._lock:
            return len(self._regs)

    def register(self, owner: np.ndarray) -> Registration:
        """The registration of the buffer that owns ``owner``'s memory (``owner`` itself, or the array it views:
        a recycler hands out views of the buffers it keeps, and the registration must live as long as the buffer,
        not the view), made at its first use."""
        owner = _root(owner)
        return self._register(owner, address_of(owner), owner.nbytes, "DRAM", 0)

    def register_device(self, t) -> Registration:
        """The registration (VRAM) of the GPU tensor that owns ``t``'s memory (``t``'s base where it is a view),
        made at its first use and dropped as that tensor is freed, like a host buffer's (`register`)."""
        root = device_root(t)
        return self._register(root, root.data_ptr(), root.numel() * root.element_size(), "VRAM", root.device.index or 0)

    def _register(self, owner, addr: int, nbytes: int, kind: str, device: int) -> Registration:
        """The registration of ``owner``'s memory, [addr, addr + nbytes) of ``kind`` on ``device``: made once, and
        deregistered as ``owner`` is freed (`_forget`)."""
        key = (addr, nbytes)
        with self._lock:
            reg = self._regs.get(key)
            if reg is None:
                descs = self._agent.register_memory([(addr, nbytes, device, "")], kind)
                metadata = self._agent.get_partial_agent_metadata(descs, False)
                reg = self._regs[key] = Registration(next(self._ids), descs, metadata, self._clear(*key))
                self.registered += 1
                weakref.finalize(owner, _forget, weakref.ref(self), key, reg.ident)
            return reg

    def register_usable(self, owners: list[np.ndarray]) -> list[Registration] | None:
        """The registrations of ``owners`` (buffers that own their memory) where every one is `usable`, made where
        not yet; None where one is not. One pass under the lock: a post lands a bucket in a few hundred tiles."""
        keys = [(address_of(o), o.nbytes) for o in owners]
        with self._lock:
            if not all(map(self._usable_locked, keys)):
                return None
            return [self._register(o, addr, n, "DRAM", 0) for o, (addr, n) in zip(owners, keys)]

    def usable(self, owner: np.ndarray) -> bool:
        """Whether ``owner`` may be offered to peers: clear of every buffer a peer knew that is gone (see
        ``_dead``), as it was when registered where it is. A buffer registered to send from was never checked
        (no peer learns of it), and one that overlaps a buried range must not be offered later either: a peer
        looks a WRITE's target up in its sorted list of the regions it loaded, and a stale region that starts
        inside this one hides it from the WRITEs past that start (NIXL's createXferReq: "no specified or potential
        backend had the required registrations")."""
        with self._lock:
            return self._usable_locked((address_of(owner), owner.nbytes))

    def _usable_locked(self, key: tuple[int, int]) -> bool:
        """`usable` of the buffer at ``key`` (address, bytes), under the lock."""
        reg = self._regs.get(key)
        return reg.offerable if reg is not None else self._clear(*key)

    def hole(self, owner: np.ndarray) -> int:
        """The length of the buried ranges ``owner``'s memory overlaps, from the first one's start to the last one's
        end (0: it is clear of them, `usable`)."""
        with self._lock:
            over = self._overlapped(owner.ctypes.data, owner.nbytes)
        return over[-1][1] - over[0][0] if over else 0

    def _overlapped(self, lo: int, n: int) -> list[tuple[int, int]]:
        """The ranges of ``_dead`` that [lo, lo + n) overlaps, in order (under the lock)."""
        i = bisect.bisect_right(self._dead, (lo, lo + n))
        return [(a, b) for a, b in self._dead[max(0, i - 1):i + 1] if a < lo + n and lo < b]

    def _clear(self, lo: int, n: int) -> bool:
        """Whether [lo, lo + n) is clear of ``_dead`` (under the lock)."""
        return not self._overlapped(lo, n)

    def _bury(self, lo: int, hi: int) -> None:
        """Add [lo, hi) to ``_dead``, merged with what it touches."""
        i = bisect.bisect_left(self._dead, (lo, hi))
        j = i
        if i and self._dead[i - 1][1] >= lo:
            i -= 1
        while j < len(self._dead) and self._dead[j][0] <= hi:
            j += 1
        merged = self._dead[i:j]
        self._dead[i:j] = [(min([lo, *(a for a, _ in merged)]), max([hi, *(b for _, b in merged)]))]

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
            if reg.peers:
                self._bury(key[0], key[0] + key[1])
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
                log.debug("host %s: deregistering a buffer at close failed: %s", self.host, e)


def _forget(ref: weakref.ref, key: tuple[int, int], ident: int) -> None:
    registry = ref()
    if registry is not None:
        registry.deregister(key, ident)


class Pool:
    """The transport's own host buffers (scratch a box lands in and is copied from, staging a chunk is written
    from), by power-of-two size from `RECYCLE_MIN_BYTES`: each mapped once (``mmap``, outside malloc's heap) and
    kept until the transport closes, so a registration made for one stays valid and no buffer a peer knew goes
    back to malloc to become some tile's memory. A mapping that falls where a peer knew a freed buffer
    (`Registry.usable`) is kept aside, unused, and the next one asked for larger than that freed range: the kernel
    places a new mapping in the first gap it fits, so one of the same size would fall in the rest of the same
    range (a freed tile of many megabytes holds hundreds of 64 KiB buffers); the buffer is the start of the
    larger mapping, whose rest is address space never touched."""

    def __init__(self, registry: Registry, tries: int = 8):
        self._registry = registry
        self._tries = tries
        self._free: dict[int, list[np.ndarray]] = {}
        self._maps: list[mmap.mmap] = []  # every mapping, kept until close
        self._held = 0  # the bytes of the buffers handed out (set-aside mappings are address space never touched)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The bytes of the pool's buffers, in use or free."""
        with self._lock:
            return self._held

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer (uint8) of at least ``nbytes``; give it back with `put`."""
        size = _pool_size(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        ask = size
        for _ in range(self._tries):
            # larger than asked: reserve no swap for the part never touched
            m = mmap.mmap(-1, ask, flags=mmap.MAP_SHARED | (MAP_NORESERVE if ask > size else 0))
            with self._lock:
                self._maps.append(m)
            buf = np.frombuffer(m, dtype=np.uint8, count=size)
            hole = self._registry.hole(buf)
            if not hole:
                with self._lock:
                    self._held += size
                return buf
            ask = size + hole
        raise UnavailableError(f"agent {self._registry.host} mapped {self._tries} buffers of {size} bytes and each "
                               f"fell where its NIXL peers knew memory since freed; restart the agent to start afresh")

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(buf.nbytes, []).append(buf)

    def close(self) -> None:
        """Forget the buffers; their mappings go with the last reference to them."""
        with self._lock:
            self._free.clear()
            self._maps.clear()
            self._held = 0


class DevicePool:
    """The transport's own GPU buffers (uint8 torch tensors, VRAM) by device and power-of-two size from
    `RECYCLE_MIN_BYTES`, each registered once and kept until the transport closes: a box bound for a GPU tile lands
    in one (`DeviceLanding`). Kept, not freed: torch's allocator would hand a freed buffer's memory to a tile, where
    a peer that knew it must never write again (`Registry.usable`). What it holds is `nbytes`: a buffer of the
    largest box per stream that was in flight at once (4 GiB boxes: 4 GiB each)."""

    def __init__(self, registry: Registry):
        self._registry = registry
        self._free: dict[tuple[Any, int], list] = {}
        self._all: list = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._all)

    def take(self, nbytes: int, device) -> Any:
        """A registered buffer (uint8, on ``device``) of at least ``nbytes``; give it back with `put`."""
        import torch

        size = _pool_size(nbytes)
        with self._lock:
            free = self._free.get((device, size))
            if free:
                return free.pop()
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        self._registry.register_device(buf)
        with self._lock:
            self._all.append(buf)
        return buf

    def put(self, buf) -> None:
        """Take ``buf`` back once the work queued on its GPU is done (a copy out of it may still be queued)."""
        import torch

        torch.cuda.current_stream(buf.device).synchronize()
        with self._lock:
            self._free.setdefault((buf.device, buf.numel()), []).append(buf)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self._all.clear()


def _pool_size(nbytes: int) -> int:
    """The size of the pool buffer that holds ``nbytes``: the power of two at or above it, at least
    `RECYCLE_MIN_BYTES` (`Pool`, `DevicePool`)."""
    return max(RECYCLE_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())


def device_root(t):
    """The torch tensor whose memory ``t`` views (``t`` itself where it is no view)."""
    return t if t._base is None else t._base


# -- runs -------------------------------------------------------------------------------------------------


def _root(array: np.ndarray) -> np.ndarray:
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
        obj = _root(obj)
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
    owner = _root(part)
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
    owner = _root(view)
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
    owner = _root(view)
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


class Landing:
    """Where one incoming box lands: runs in registered buffers (``owners``), and the device that holds them (None:
    a scratch buffer, handed back by ``release``). ``segments``: a piece over several runs is handed on as
    `Segments` of them (a bucket's sink takes those) rather than copied into one buffer."""

    vram = False  # host memory (`DeviceLanding`: GPU memory)

    def __init__(self, owners: list[np.ndarray], runs: list[tuple[int, int]], device: str | None,
                 registrations: list[Registration], release: Callable[[], None] = lambda: None,
                 segments: bool = False):
        flats = sorted((address_of(o), o.reshape(-1).view(np.uint8)) for o in owners)
        bases = [b for b, _ in flats]
        self.views = []  # per run, its bytes
        for addr, n in runs:
            base, flat = flats[bisect.bisect_right(bases, addr) - 1]
            self.views.append(flat[addr - base:addr - base + n])
        self.owners = owners  # a receiver offers them to a peer of this machine where they are shared segments
        self.addrs = [a for a, _ in runs]
        self.cum = [0, *itertools.accumulate(n for _, n in runs)]
        self.device = device
        self.registrations = registrations
        self.release = release
        self.segments = segments

    def piece(self, off: int, n: int):
        """Bytes ``[off, off + n)`` of the box as landed: a view where they are one run (a chain hop forwards
        and a fault corrupts what is kept), `Segments` of views where the landing hands them on so, else a
        read-only copy of them in C order."""
        parts = []
        i = bisect.bisect_right(self.cum, off) - 1
        while n > 0:
            start = off - self.cum[i]
            take = min(self.cum[i + 1] - self.cum[i] - start, n)
            parts.append(self.views[i][start:start + take])
            off, n, i = off + take, n - take, i + 1
        if len(parts) == 1:
            return parts[0]
        if self.segments:
            return Segments(parts)
        out = np.concatenate(parts)
        out.flags.writeable = False
        return out


class DeviceLanding:
    """Where one incoming box bound for a GPU tile lands: one run at the start of a `DevicePool` buffer (VRAM);
    its pieces are uint8 views of the GPU bytes as landed, which the receiver copies into the tile while
    digesting them (`moves.relay`)."""

    device = None  # not in a tile: every local receiver writes it (`Piece.landed`)
    segments = False
    vram = True

    def __init__(self, buf, nbytes: int, registration: Registration, pool: DevicePool):
        self.buf, self.pool = buf, pool
        self.owners = [buf]
        self.addrs = [buf.data_ptr()]
        self.cum = [0, nbytes]
        self.registrations = [registration]

    def piece(self, off: int, n: int):
        return self.buf[off:off + n]

    def release(self) -> None:
        self.pool.put(self.buf)
