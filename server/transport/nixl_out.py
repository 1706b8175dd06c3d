"""The nixl transport's sending end: one stream to a peer as WRITEs into the runs its receiver posted, or copies into
the receiver's shared segments on one machine, then the trailer (`nixl`'s module table says what each message is).

============== ===============================================================================
``Remote``     a receiver's post: its runs, the device and kind of memory they lie in (host
               memory or GPU memory: the trailer then holds the GPU digest), and where they
               are mapped here when they lie in shared segments this agent could map
``Chunk``      a chunk made, to post: its notification, and for a WRITE its descriptors
``NixlOut``    the stream: at most `WINDOW` WRITEs in flight, the chunk that fills the posted
               runs held for the trailer to ride on, then the receiver's confirmation
============== ===============================================================================
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from reshard.box import Box
from reshard.proto.devices import is_cuda
from reshard.proto.errors import InvalidArgumentError, UnavailableError
from reshard.server.transport import shm
from reshard.server.transport.buffers import RECYCLE_MIN_BYTES, host_bytes, synchronize
from reshard.server.transport.nixl_memory import CHUNK, POST, TRAILER, box_bytes, encode
from reshard.server.transport.nixl_runs import owner_of, pair_descs, part_runs, parts_runs, source_runs
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Outgoing, Segments, StreamKey

if TYPE_CHECKING:
    from reshard.server.transport.nixl import NixlTransport

__all__ = ["NixlOut", "Remote", "Chunk", "WINDOW", "SOURCE_RUN_BYTES", "SHARED_CHUNK_BYTES", "DEVICE_CHUNK_BYTES"]

log = logging.getLogger(__name__)

# WRITEs in flight per stream: bounds a stream's staging and keeps the receiver's pieces coming. Two, not more: a
# WRITE's notification leaves as the WRITE completes, behind the WRITEs already posted after it, so a chain hop
# learns of a chunk a window late, and a chain pays that per hop (bench/paper.py --transport nixl: a 4-host chain on
# 1 Gbit/s links 1.25x its estimate with four 2 MiB WRITEs, 1.09x with two of 1 MiB, `AgentConfig.nixl_chunk`). Nor
# do streams whose receiver is the last hop gain from more: four in flight on the emulated weight sync, rounds
# alternating with two, took 0.971 s against 0.969 s (medians of 8)
WINDOW = 2
# A chunk of a source tile whose runs average fewer bytes is packed and staged rather than written run by run: below
# this (measured on loopback, bench/nixl_path.py) UCX's cost per descriptor outweighs the copy it saves
SOURCE_RUN_BYTES = 8192
SHARED_CHUNK_BYTES = 16 << 20  # a stream's chunks into a mapped shared segment (the module table: one machine)
# A stream's chunks into GPU memory (VRAM). On one H200 (UCX's CUDA IPC, agents on one GPU) a 4 GiB move's hosts ran
# a median 15.2 ms in 256 MiB chunks, 11.6 ms in 1 GiB ones and 12.6 ms in one chunk of 4 GiB (the chunk that ends a
# box waits for the trailer's digest, and the receiver copies each chunk as it lands); over one 400 Gbit/s NIC a
# 1 GiB chunk takes about 21 ms, the step by which a chain across GPU hosts forwards
DEVICE_CHUNK_BYTES = 1 << 30


class Remote:
    """A receiver's post: the runs its box lands in, and where they are mapped here when they lie in shared
    segments this agent could map (``local``; None: WRITEs)."""

    def __init__(self, device: int, runs: np.ndarray, vram: bool = False):
        self.device = device
        self.vram = vram  # GPU memory of that device: WRITEs go to VRAM, and the trailer holds the GPU digest
        self.addrs = runs[:, 0].astype(np.int64)
        self.lens = runs[:, 1].astype(np.int64)
        self.cum = np.concatenate(([0], np.cumsum(self.lens)))  # where each run starts, and the end
        self.nbytes = int(self.cum[-1])
        self.local: np.ndarray | None = None
        self.mapped: list[np.ndarray] = []  # the mappings ``local`` lies in, held while the stream copies


class Chunk(NamedTuple):
    """A chunk `NixlOut._write` made, to post: its notification's kind and fields, and for a WRITE its descriptors,
    what keeps its source alive and its staging buffer (None where it was copied into a mapped segment)."""

    kind: bytes
    note: bytes
    local_descs: np.ndarray | None = None
    remote_descs: np.ndarray | None = None
    keep: Any = None
    staged: np.ndarray | None = None
    local_kind: str = "DRAM"  # where the local runs lie: VRAM for a GPU source (the descriptors name its device)


class NixlOut(Outgoing):
    """One stream to a peer: each chunk a WRITE into the runs the peer posted, then the trailer."""

    def __init__(self, transport: NixlTransport, s: Session, key: StreamKey, peer: str):
        self.t, self.s, self.key, self.peer = transport, s, key, peer
        self.remote: Remote | None = None
        self.offset = 0
        self.chunks = 0
        self.pending: deque = deque()  # (handle, what keeps its source alive, staging buffer or None)
        self.held: Chunk | None = None  # the chunk that fills the posted runs, posted with the trailer (`end`)
        self.synced = False  # a GPU source's stream was synchronised (`_put_device`)

    def _posted(self) -> Remote:
        if self.remote is None:
            # The first wait is the stream's: the receiver may still be busy with an earlier unit of its lanes
            kind, msg = self.t._await(self.s, self.peer, "out", self.key, "did not post its receive of",
                                      self.t.timeout_s)
            assert kind == b"D", kind
            device, mdlen, offered, vram, _ = POST.unpack_from(msg)
            at = POST.size + mdlen
            remote = Remote(device, np.frombuffer(msg[at + offered:], dtype=np.uint64).reshape(-1, 2), bool(vram))
            try:
                mapped = self.t.shared.map(self.peer, msg[at:at + offered], remote.addrs, remote.lens)
            except shm.NotShared as e:
                raise UnavailableError(
                    f"job {self.key.job}: host {self.peer} offered stream {self.key.hop} of step {self.key.step} in "
                    f"its shared memory only, and agent {self.t.host} cannot map it ({e}): both agents run with or "
                    f"both without --nixl-tcp-only, and may hold as many open files as they need") from None
            if mapped is not None:
                remote.local, remote.mapped = mapped
            self.remote = remote
        return self.remote

    def chunk_bytes(self, default: int) -> int:  # into a mapped shared segment or GPU memory (known once posted)
        remote = self._posted()
        if remote.vram:
            return max(default, DEVICE_CHUNK_BYTES)
        return max(default, SHARED_CHUNK_BYTES) if remote.local is not None else default

    def device_digest(self) -> bool:
        """The receiver lands the box in GPU memory (its post said VRAM): the trailer holds the GPU digest."""
        return self._posted().vram

    def put(self, box: Box, data, wire=None) -> None:
        if isinstance(data, Segments):  # a chain hop forwards a bucket from where it landed
            self.put_parts(box, list(data))
            return
        if is_cuda(data):  # a chain hop forwards what landed in its GPU memory
            self._put_device(box, data)
            return
        n = memoryview(data).nbytes
        if not n:
            return
        self._ready(n)
        if self.remote.local is not None:  # copied from where it lies: no staging, no registration
            self._write(box, (np.array([shm.address_of(owner_of(data)[1])], np.int64), np.array([0, n], np.int64)), n,
                        data, None)
            return
        addr, keep, staged = self.t._source(data)
        self._write(box, (np.array([addr], np.int64), np.array([0, n], np.int64)), n, keep, staged)

    def put_region(self, box: Box, view) -> None:
        """WRITE ``box`` from the source tile's own runs, registered through the cache, where ``view`` is a numpy
        view of a host buffer whose runs average `SOURCE_RUN_BYTES` or more: no staging copy; else packed."""
        if is_cuda(view):
            self._put_device(box, view)
            return
        found = source_runs(view, max(1, view.nbytes // SOURCE_RUN_BYTES)) if isinstance(view, np.ndarray) else None
        if found is None:
            super().put_region(box, view)
            return
        owner, addrs, lens = found
        self._ready(view.nbytes)
        if self.remote.local is None:  # a copy into a mapped segment needs no registration
            self.t._memory.register(owner)
        self._write(box, (addrs, np.concatenate(([0], np.cumsum(lens)))), view.nbytes, view, None)

    def put_parts(self, box: Box, parts: list) -> None:
        """WRITE byte box ``box`` from ``parts`` in one go: each part of `RECYCLE_MIN_BYTES` or more whose runs
        average `SOURCE_RUN_BYTES` or more from where it lies (its tile, registered through the cache), the others
        packed, in their places, into one registered staging buffer (a smaller tile is not recycled)."""
        n = sum(p.nbytes for p in parts)
        if not n:
            return
        self._ready(n)
        if self.remote.local is not None:  # each part copied from its own runs, one of small runs packed
            addrs, cum, keep = parts_runs(parts, SOURCE_RUN_BYTES)
            self._write(box, (addrs, cum), n, (parts, keep), None)
            return
        addrs, cum, small = [], [0], []  # as `parts_runs`, the small parts packed into one registered buffer
        register = self.t._memory.register
        for p in parts:
            size = p.nbytes
            if not size:
                continue
            found = part_runs(p, SOURCE_RUN_BYTES) if size >= RECYCLE_MIN_BYTES else None
            if found is None:
                small.append((len(addrs), p))
                addrs.append(0)
                cum.append(cum[-1] + size)
                continue
            register(found[0])
            addrs += found[1]
            for length in found[2]:
                cum.append(cum[-1] + length)
        staged = None
        if small:
            staged = self.t._scratch(sum(p.nbytes for _, p in small))
            register(staged)
            at = 0
            for i, p in small:
                out = staged[at:at + p.nbytes]
                out.view(p.dtype).reshape(p.shape)[...] = p
                addrs[i] = shm.address_of(out)
                at += p.nbytes
        self._write(box, (np.array(addrs, dtype=np.int64), np.array(cum, dtype=np.int64)), n, parts, staged)

    def _put_device(self, box: Box, t) -> None:
        """WRITE ``box`` from GPU tensor ``t`` where it lies (VRAM, its tensor registered through the cache; a
        strided one packed on its GPU first) into the receiver's GPU memory; to a receiver that posted host memory,
        through host bytes."""
        if not self._posted().vram:
            self.put(box, host_bytes(t))
            return
        n = t.numel() * t.element_size()
        if not n:
            return
        self._ready(n)
        # NIXL's copy runs on a stream of its own: the bytes as queued on this agent's stream first, once a stream
        # (its later chunks find only their digests queued there, which read them) or wherever packed here
        if not t.is_contiguous():
            t = t.contiguous()
            synchronize(t)
        elif not self.synced:
            synchronize(t)
        self.synced = True
        self.t._memory.register_device(t)
        self._write(box, (np.array([t.data_ptr()], np.int64), np.array([0, n], np.int64)), n, t, None,
                    ("VRAM", t.device.index or 0))

    def _ready(self, n: int) -> None:
        """Wait for the receiver's post and for room in the window for ``n`` more bytes."""
        remote = self._posted()
        if self.offset + n > remote.nbytes:
            raise InvalidArgumentError(
                f"job {self.key.job}: stream {self.key.hop} of step {self.key.step} to host {self.peer} would "
                f"write {self.offset + n} bytes into a receive of {remote.nbytes}")
        while len(self.pending) >= WINDOW:
            self._finish(self.pending.popleft(), self.t.timeout_s)

    def _write(self, box: Box, local: tuple[np.ndarray, np.ndarray], n: int, keep, staged,
               kind: tuple[str, int] = ("DRAM", 0)) -> None:
        """One WRITE of chunk ``box``, ``n`` bytes in the ``local`` runs (addresses, offsets), into the next bytes
        of the receiver's runs; ``keep`` stays referenced until it ends, ``staged`` goes back to scratch then.
        Into a mapped shared segment, a copy here, then the chunk's notification. The chunk that fills the
        posted runs is held for the trailer to ride on (`_post`, from `end`). ``kind``: the memory the local runs
        lie in (DRAM, VRAM), and its device."""
        note = CHUNK.pack(self.offset, n, len(box)) + box_bytes(box)
        if self.remote.local is not None:
            mine, theirs = pair_descs(local, (self.remote.local, self.remote.cum), self.offset, n)
            shm.copy(theirs[:, 0], mine[:, 0], mine[:, 1])
            if staged is not None:
                self.t._unscratch(staged)
            self.t.shared.copied_out(n)
            chunk = Chunk(b"S", note)
        else:
            local_descs, remote_descs = pair_descs(local, (self.remote.addrs, self.remote.cum), self.offset, n,
                                                   kind[1], self.remote.device)
            chunk = Chunk(b"C", note, local_descs, remote_descs, keep, staged, kind[0])
        self.offset += n
        self.chunks += 1
        if self.offset == self.remote.nbytes:
            self.held = chunk
        else:
            self._post(chunk)

    def _post(self, chunk: Chunk, trailer: bytes = b"") -> None:
        """Post a chunk `_write` made: its WRITE (notification ``C``), or, copied into a mapped segment already,
        its notification ``S``; with ``trailer`` riding on it (``c``, ``s``)."""
        kind, note, local_descs, remote_descs, keep, staged, local_kind = chunk
        if trailer:
            kind, note = kind.lower(), trailer + note
        if local_descs is None:
            self.t._notify(self.peer, encode(kind, self.key, note))
            self.t._progress.pump()  # a notification leaves only while its agent makes progress: on its way now
            return
        handle = self.t._write(self.s, self.peer, self.key, (local_kind, local_descs),
                               ("VRAM" if self.remote.vram else "DRAM", remote_descs), encode(kind, self.key, note))
        self.pending.append((handle, keep, staged))

    def end(self, nbytes: int, digest: int) -> None:
        self._posted()  # an empty stream too: the trailer then goes down a connection the post proved
        trailer = TRAILER.pack(nbytes, digest, self.chunks)
        if self.held is not None:
            chunk, self.held = self.held, None
            self._post(chunk, trailer)
        else:
            self.t._notify(self.peer, encode(b"T", self.key, trailer))

    def _finish(self, entry, timeout: float) -> None:
        handle, _, staged = entry
        self.t._complete(self.s, self.peer, self.key, handle, timeout)
        if staged is not None:
            self.t._unscratch(staged)

    def wait(self, timeout: float) -> None:
        """Wait for the WRITEs, then for the receiver's word that every chunk and the trailer arrived: a message
        leaves only while its agent makes progress (a sender that stopped polling could leave its trailer unsent)."""
        while self.pending:
            self._finish(self.pending.popleft(), timeout)
        kind, _ = self.t._await(self.s, self.peer, "out", self.key, "did not confirm", min(timeout, self.t._limit()))
        assert kind == b"K", kind
        return None  # every receiving host reports to the planner itself

    def cancel(self) -> None:
        if self.held is not None:
            staged, self.held = self.held.staged, None
            if staged is not None:
                self.t._unscratch(staged)
        try:
            self.t._notify(self.peer, encode(b"X", self.key))
        except Exception as e:  # noqa: BLE001 - the receiver then fails on its own deadline
            log.debug("host %s could not tell host %s that stream %s ended: %s", self.t.host, self.peer, self.key, e)
        while self.pending:
            handle, _, _ = self.pending.popleft()
            self.t._abandon(handle)
        self.t._progress.linger()
