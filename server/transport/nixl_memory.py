"""The NIXL transport's memory: host buffers registered once with a NIXL agent, where an incoming box lands in them,
and the byte layout of the notifications that name its runs (which runs a box occupies: `nixl_runs`).

================ ===========================================================================
``Registry``     a NIXL agent's registered host buffers, one `Registration` each, cached by
                 (address, size) and reused across jobs; held weakly and deregistered as the
                 buffer is freed (before its memory can be handed out again): a strong
                 reference would keep the shard store's released tiles and the ring's
                 scratch from their recyclers, which hand out only buffers nothing else holds
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
from reshard.server.transport.nixl_runs import buffer_root
from reshard.server.transport.shm import address_of
from reshard.server.transport.streams import Segments, StreamKey

__all__ = ["HEAD", "CHUNK", "TRAILER", "POST", "INCARNATION", "blobs", "unblob", "encode", "decode", "box_bytes",
           "box_of", "Registration", "Registry", "Pool", "DevicePool", "Landing", "DeviceLanding", "device_root"]

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
        owner = buffer_root(owner)
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

    def register_usable(self, owners: list[np.ndarray], keys: list[tuple[int, int]] | None = None
                        ) -> list[Registration] | None:
        """The registrations of ``owners`` (buffers that own their memory) where every one is `usable`, made where
        not yet; None where one is not. One pass under the lock: a post lands a bucket in a few hundred tiles.
        ``keys``: each owner's (address, bytes), where the caller has them (`nixl_runs.segment_runs`)."""
        if keys is None:
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


class Landing:
    """Where one incoming box lands: runs in registered buffers (``owners``), and the device that holds them (None:
    a scratch buffer, handed back by ``release``). ``segments``: a piece over several runs is handed on as
    `Segments` of them (a bucket's sink takes those) rather than copied into one buffer."""

    vram = False  # host memory (`DeviceLanding`: GPU memory)

    def __init__(self, owners: list[np.ndarray], runs: list[tuple[int, int]], device: str | None,
                 registrations: list[Registration], release: Callable[[], None] = lambda: None,
                 segments: bool = False, views: list[np.ndarray] | None = None):
        """``views``: a uint8 view of each run, where the caller has them (`nixl_runs.segment_runs`)."""
        if views is None:
            flats = sorted((address_of(o), o.reshape(-1).view(np.uint8)) for o in owners)
            bases = [b for b, _ in flats]
            views = []
            for addr, n in runs:
                base, flat = flats[bisect.bisect_right(bases, addr) - 1]
                views.append(flat[addr - base:addr - base + n])
        self.views = views  # per run, its bytes
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
