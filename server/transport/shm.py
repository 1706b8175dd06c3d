"""Shared host memory between the agents of one machine: host tiles in memfd segments, a segment's descriptor handed
to a peer it was offered to, and the peer's mappings of them: the NIXL transport's single-copy path on one kernel.

================ ===========================================================================
``Exporter``     this process's segments (one per process, `exporter`): while a transport
                 shares host memory (``share``, counted), host buffers of `MIN_BYTES` or more
                 (``empty``, which `buffers.empty` asks) are segments, each a ``memfd``
                 (mode 0600, in no directory: the kernel frees it with its last holder, also
                 when an agent dies) mapped shared, freed with the array that owns it
offer            a receiver offers a peer the segments a box lands in for one stream, each
                 with a fresh 128-bit secret, withdrawn when the stream ends; the post carries
                 the kernel's boot id, the process's socket (an abstract Unix socket with a
                 random name: reachable only in this network namespace), and per segment its
                 id, address, size and secret (`encode_offer`), and the ids of segments that
                 peer mapped and that were freed since (``gone``)
serving          the socket's thread hands a segment's descriptor (SCM_RIGHTS) to a process of
                 this user (SO_PEERCRED) that names a live secret, and nothing else
``Mappings``     a sender's mappings of its peers' segments: fetched once (`fetch`), mapped
                 and populated (`_populated`), reused across jobs like NIXL registrations; unmapped when
                 the owner's post names them gone, when the peer is dropped or the transport
                 closes (a mapping keeps the segment's memory alive after its owner freed it)
``copy``         runs copied into a mapped segment (``ctypes.memmove``, which releases the
                 GIL), a large chunk on several threads on a machine with cores to spare
``Sharing``      one transport's side of it all: the offers it posts, its mappings of its
                 peers' segments, and its counts (bytes copied each way, segments mapped)
================ ===========================================================================

Nothing here decides when to use it: `nixl` offers and maps, and neither side does where UCX is kept off shared
memory (``UCX_TLS``: `allowed`), which ``--nixl-tcp-only`` does.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import uuid
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

__all__ = ["MIN_BYTES", "SHM_TRANSPORTS", "Exporter", "Segment", "Entry", "Offer", "Mappings", "Sharing", "NotShared",
           "exporter",
           "address_of", "allowed", "boot_id", "empty", "segment_of", "encode_offer", "decode_offer", "fetch", "copy"]

log = logging.getLogger(__name__)

MIN_BYTES = 1 << 20  # smaller host buffers are plain memory: their WRITEs cost little, and a segment holds a descriptor
# UCX's names for its shared-memory transports: where UCX_TLS leaves all of them out, so does this path
SHM_TRANSPORTS = frozenset({"all", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"})
_SECRET_BYTES = 16
_REPLY = struct.Struct("<QQ")  # segment id (0: refused), bytes; the descriptor rides beside it
HEAD = struct.Struct("<16sHII?")  # boot id, len(socket address), entries, gone ids, only (no NIXL registration)
ENTRY = struct.Struct("<QQQ16s")  # segment id, address in the owner's process, bytes, secret
GONE = struct.Struct("<Q")
_GONE_KEPT = 4096  # freed segment ids kept per peer until a post carries them
_FD_SHARE = 4  # segments may hold at most 1/_FD_SHARE of the process's descriptors
_CONNECT_S = 5.0  # a descriptor request and its answer: both ends are processes of this machine
_COPY_SPLIT = 4 << 20  # a chunk this large is copied on `_COPY_THREADS` threads
# one copying thread moves less than a large machine's memory can; on a small one (2 cores here) the other cores
# are busy digesting the bytes at both ends, and one thread copies fastest
_COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))


def allowed(environ: Mapping[str, str]) -> bool:
    """Whether UCX's environment leaves shared memory on: ``UCX_TLS`` unset, naming a shared-memory transport, or
    excluding (``^...``) neither ``sm`` nor both of its mapped-memory transports (``posix``, ``sysv``): ``^cma``
    leaves them on. ``--nixl-tcp-only`` sets ``UCX_TLS=tcp``: the lab's hosts share one kernel, but their bytes
    must cross their shaped links."""
    tls = environ.get("UCX_TLS")
    if tls is None:
        return True
    names = {n.strip().lower() for n in tls.lstrip("^").split(",") if n.strip()}
    if tls.startswith("^"):
        return not (names & {"sm", "shm"} or {"posix", "sysv"} <= names)
    return bool(names & SHM_TRANSPORTS)


def boot_id() -> bytes:
    """This kernel's boot id as 16 bytes; zeros where there is none to read (no peer then matches it)."""
    from reshard.proto.devices import machine_id

    try:
        return uuid.UUID(machine_id()).bytes
    except ValueError:
        return bytes(16)


# -- the owner's side ------------------------------------------------------------------------------------------


class Segment:
    """One shared host buffer: its memfd, where this process maps it, and who was offered it."""

    __slots__ = ("id", "fd", "nbytes", "addr", "peers")

    def __init__(self, ident: int, fd: int, nbytes: int, addr: int):
        self.id, self.fd, self.nbytes, self.addr = ident, fd, nbytes, addr
        self.peers: set[tuple[str, str]] = set()  # (offering host, peer host)


class Exporter:
    """This process's shared segments, their offers and the socket that hands them out (see the module table)."""

    def __init__(self):
        self._lock = threading.RLock()  # a segment freed on a thread that holds it is forgotten under it
        self._users = 0
        self._by_addr: dict[int, tuple[weakref.ref, Segment]] = {}
        self._offers: dict[bytes, Segment] = {}
        self._gone: dict[tuple[str, str], list[int]] = {}
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        # abstract (no file to leave behind), random (no process guesses it), the same for the process's life
        self.address = b"\0reshard-shm-" + secrets.token_hex(16).encode()
        self.boot_id = boot_id()

    @property
    def sharing(self) -> bool:
        return self._users > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_addr)

    def share(self) -> None:
        """A transport of this process shares host memory from now on (`unshare` ends it; counted)."""
        with self._lock:
            self._users += 1
            if self._sock is not None:
                return
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(self.address)
            sock.listen(16)
            self._sock = sock
            self._thread = threading.Thread(target=self._serve, args=(sock,), name="reshard-shm", daemon=True)
            self._thread.start()

    def unshare(self) -> None:
        """A transport stopped sharing; the last one closes the socket. Segments live on until their arrays go."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self._sock is None:
                return
            sock, thread, self._sock, self._thread = self._sock, self._thread, None, None
            self._offers.clear()
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        sock.close()
        thread.join(5)

    def empty(self, nbytes: int) -> np.ndarray | None:
        """A uint8 buffer of ``nbytes`` in a new segment, or None: nothing shares host memory, the buffer is under
        `MIN_BYTES`, the segments hold their share of the process's descriptors, or the kernel refused."""
        if not self._users or nbytes < MIN_BYTES:
            return None
        with self._lock:
            if len(self._by_addr) >= _fd_budget():
                return None
        try:
            fd = os.memfd_create(f"reshard-{os.getpid()}", os.MFD_CLOEXEC)
        except OSError as e:
            log.debug("no shared segment of %d bytes: %s", nbytes, e)
            return None
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, nbytes)
            array = np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED), dtype=np.uint8)
        except OSError as e:
            os.close(fd)
            log.debug("no shared segment of %d bytes: %s", nbytes, e)
            return None
        seg = Segment(next(self._ids), fd, nbytes, array.ctypes.data)
        with self._lock:
            self._by_addr[seg.addr] = (weakref.ref(array), seg)
        weakref.finalize(array, self._freed, seg)
        return array

    def segment_of(self, array: np.ndarray) -> Segment | None:
        """The segment ``array`` is (an array `empty` made, alive), else None."""
        with self._lock:
            held = self._by_addr.get(address_of(array))
        return held[1] if held is not None and held[0]() is array and held[1].nbytes == array.nbytes else None

    def offer(self, seg: Segment, host: str, peer: str) -> bytes:
        """A fresh secret for ``peer`` to fetch ``seg`` by, until it is withdrawn (``host``: the offering agent)."""
        secret = secrets.token_bytes(_SECRET_BYTES)
        with self._lock:
            self._offers[secret] = seg
            seg.peers.add((host, peer))
        return secret

    def withdraw(self, offered: list[bytes]) -> None:
        with self._lock:
            for secret in offered:
                self._offers.pop(secret, None)

    def gone(self, host: str, peer: str) -> list[int]:
        """The segments offered to ``peer`` by ``host`` that were freed since the last call: its next post says so."""
        with self._lock:
            return self._gone.pop((host, peer), [])

    def forget_peer(self, host: str, peer: str) -> None:
        """``peer`` (of agent ``host``) maps none of these segments any more: it is new, or gone."""
        with self._lock:
            self._gone.pop((host, peer), None)
            for _, seg in self._by_addr.values():
                seg.peers.discard((host, peer))

    def _freed(self, seg: Segment) -> None:
        with self._lock:
            if self._by_addr.get(seg.addr, (None, None))[1] is seg:
                del self._by_addr[seg.addr]
            for secret in [k for k, v in self._offers.items() if v is seg]:
                del self._offers[secret]
            for key in seg.peers:
                ids = self._gone.setdefault(key, [])
                ids.append(seg.id)
                del ids[:-_GONE_KEPT]
            os.close(seg.fd)

    def _serve(self, sock: socket.socket) -> None:
        """Hand out offered segments' descriptors, one request after another, until the socket closes."""
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._answer(conn)
                except OSError as e:
                    log.debug("a shared-memory request ended early: %s", e)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(_CONNECT_S)
        if _peer_uid(conn) != os.getuid():
            log.warning("a process of another user asked for this agent's shared memory; refused")
            return
        while True:
            secret = _recv_exact(conn, _SECRET_BYTES)
            if secret is None:
                return
            with self._lock:
                seg = self._offers.get(secret)
                fd = os.dup(seg.fd) if seg is not None else -1  # the segment may be freed as the answer goes
            if fd < 0:
                conn.sendall(_REPLY.pack(0, 0))
                continue
            try:
                socket.send_fds(conn, [_REPLY.pack(seg.id, seg.nbytes)], [fd])
            finally:
                os.close(fd)


def _fd_budget() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] // _FD_SHARE


def _peer_uid(conn: socket.socket) -> int:
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            return None
        out += got
    return out


_EXPORTER: list[Exporter] = []
_EXPORTER_LOCK = threading.Lock()


def exporter() -> Exporter:
    """This process's `Exporter`, made at first use (nothing is shared until a transport calls ``share``)."""
    with _EXPORTER_LOCK:
        if not _EXPORTER:
            _EXPORTER.append(Exporter())
        return _EXPORTER[0]


_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def address_of(array: np.ndarray) -> int:
    """``array.ctypes.data``, in a third of its time where ``array`` is writable, C-contiguous and not empty (the
    common case: a tile or a region of one): ``.ctypes`` makes an object each time, 4.4 us here, and posting or
    sending a bucket asks it several times per member; anything else costs a failed try more (1 to 2 us)."""
    try:
        return _addressof(_from_buffer(array))
    except (TypeError, ValueError, BufferError):  # read-only, strided or empty
        return array.ctypes.data


def empty(nbytes: int) -> np.ndarray | None:
    """A shared uint8 buffer of ``nbytes`` while a transport of this process shares host memory, else None."""
    return _EXPORTER[0].empty(nbytes) if _EXPORTER and _EXPORTER[0].sharing else None


def segment_of(array: np.ndarray) -> Segment | None:
    """The live segment ``array`` is, else None (`Exporter.segment_of`)."""
    return _EXPORTER[0].segment_of(array) if _EXPORTER else None


# -- the offer on the wire ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One offered segment: its id, its address in the owner's process, its size and the secret to fetch it by."""

    id: int
    addr: int
    nbytes: int
    secret: bytes


@dataclass(frozen=True)
class Offer:
    """What a post offers of shared memory (see the module table)."""

    boot_id: bytes
    address: bytes
    entries: tuple[Entry, ...]
    gone: tuple[int, ...]
    only: bool = False  # the box's runs are not registered with NIXL: a peer that cannot map them cannot WRITE either


def encode_offer(offer: Offer) -> bytes:
    return (HEAD.pack(offer.boot_id, len(offer.address), len(offer.entries), len(offer.gone), offer.only)
            + offer.address
            + b"".join(ENTRY.pack(e.id, e.addr, e.nbytes, e.secret) for e in offer.entries)
            + b"".join(GONE.pack(i) for i in offer.gone))


def decode_offer(data) -> Offer:
    boot, n_addr, n_entries, n_gone, only = HEAD.unpack_from(data)
    at = HEAD.size + n_addr
    address = bytes(data[HEAD.size:at])
    entries = tuple(Entry(*ENTRY.unpack_from(data, at + i * ENTRY.size)) for i in range(n_entries))
    at += n_entries * ENTRY.size
    return Offer(boot, address, entries, tuple(GONE.unpack_from(data, at + i * GONE.size)[0] for i in range(n_gone)),
                 only)


# -- the peer's side ----------------------------------------------------------------------------------------------


class Mappings:
    """One transport's mappings of its peers' segments, by (peer, owner's socket, segment id) (see the module
    table)."""

    def __init__(self, host: str):
        self.host = host  # named in logs
        self._lock = threading.Lock()
        self._maps: dict[tuple[str, bytes, int], np.ndarray] = {}
        self.mapped = 0  # segments mapped, for tests and stats

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    def translate(self, peer: str, offer: Offer, addrs: np.ndarray,
                  lens: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]] | None:
        """The runs at ``addrs`` (the peer's addresses, each ``lens`` long) as addresses of this process's mappings
        of the offered segments, mapping those it lacks, and the mappings (which the caller holds while it copies:
        a mapping dropped meanwhile stays mapped until then); None where a run lies in none of them, or a segment
        cannot be had here (another kernel, network namespace or user: the stream then goes over UCX)."""
        self.forget(peer, offer.address, offer.gone)
        if not offer.entries or offer.boot_id != exporter().boot_id or offer.boot_id == bytes(16):
            return None
        with self._lock:
            have = {e.id: self._maps.get((peer, offer.address, e.id)) for e in offer.entries}
        missing = [e for e in offer.entries if have[e.id] is None]
        if missing:
            try:
                fetched = fetch(offer.address, missing)
            except OSError as e:
                log.info("agent %s cannot map host %s's shared memory (%s): its streams go over UCX", self.host,
                         peer, e)
                return None
            with self._lock:
                for e in missing:
                    have[e.id] = self._maps.setdefault((peer, offer.address, e.id), fetched[e.id])
                self.mapped += len(missing)
        bases = sorted((e.addr, e.addr + e.nbytes, address_of(have[e.id])) for e in offer.entries)
        starts = np.array([lo for lo, _, _ in bases], dtype=np.int64)
        i = np.searchsorted(starts, addrs, side="right") - 1
        if (i < 0).any():
            return None
        ends = np.array([hi for _, hi, _ in bases], dtype=np.int64)[i]
        if (addrs + lens > ends).any():
            return None
        return addrs - starts[i] + np.array([local for _, _, local in bases], dtype=np.int64)[i], list(have.values())

    def forget(self, peer: str, address: bytes | None = None, ids=()) -> None:
        """Drop the mappings of ``peer``'s segments ``ids`` of the process at ``address`` (None: every one of the
        peer's). A segment is unmapped as the last reference goes: a copy under way keeps its own (`translate`)."""
        with self._lock:
            drop = [k for k in self._maps if k[0] == peer] if address is None else \
                [k for k in ((peer, address, i) for i in ids) if k in self._maps]
            for k in drop:
                del self._maps[k]

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


def fetch(address: bytes, entries: list[Entry]) -> dict[int, np.ndarray]:
    """The segments ``entries`` of the process at ``address``, each mapped here (uint8 arrays); `OSError` where the
    socket cannot be reached, belongs to another user, or refuses a secret (withdrawn, or never offered). The
    descriptors are all taken before any is mapped: the exporter answers one process at a time, and mapping a
    segment populates its pages (`_populated`: a second or more for a large one on a loaded machine), which every
    other peer asking this exporter would wait out, up to its `_CONNECT_S`."""
    fds: dict[int, int] = {}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(_CONNECT_S)
            conn.connect(address)
            if _peer_uid(conn) != os.getuid():
                raise PermissionError("the socket belongs to another user")
            for e in entries:
                conn.sendall(e.secret)
                msg, got, _, _ = socket.recv_fds(conn, _REPLY.size, 1)
                if not got:
                    raise PermissionError(f"segment {e.id} was not handed over (its offer was withdrawn)")
                fds[e.id] = got[0]
                ident, nbytes = _REPLY.unpack(msg) if len(msg) == _REPLY.size else (0, 0)
                if ident != e.id or nbytes != e.nbytes or os.fstat(got[0]).st_size < e.nbytes:
                    raise PermissionError(f"segment {e.id} came back as segment {ident} of {nbytes} bytes")
        return {e.id: _populated(fds[e.id], e.nbytes) for e in entries}
    finally:
        for fd in fds.values():
            os.close(fd)


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_libc = ctypes.CDLL(None, use_errno=True)  # its calls release the GIL, as ctypes' foreign calls do


def _populated(fd: int, nbytes: int) -> np.ndarray:
    """A shared mapping of ``nbytes`` of ``fd``, its pages faulted in up front (the mapping is kept across jobs)
    with the GIL released: ``mmap``'s MAP_POPULATE holds it (2 GiB took 1.9 s here, and every thread of the agent
    stood still that long, its heartbeat too: the planner took it for dead). Where the kernel has no
    MADV_POPULATE_WRITE the pages fault in as the first copies touch them."""
    mapped = np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED), dtype=np.uint8)
    _libc.madvise(ctypes.c_void_p(mapped.ctypes.data), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE)
    return mapped


# -- copying ---------------------------------------------------------------------------------------------------------

_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies
_copiers: list[ThreadPoolExecutor] = []
_copiers_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    with _copiers_lock:
        if not _copiers:
            _copiers.append(ThreadPoolExecutor(_COPY_THREADS - 1, thread_name_prefix="reshard-shm-copy"))
        return _copiers[0]


def copy(dst: np.ndarray, src: np.ndarray, lens: np.ndarray) -> None:
    """Copy ``lens[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i; a total of `_COPY_SPLIT` or more
    bytes is split over `_COPY_THREADS` threads (one copying thread moves less than the memory can)."""
    total = int(lens.sum())
    if total < _COPY_SPLIT or _COPY_THREADS < 2:
        for d, s, n in zip(dst.tolist(), src.tolist(), lens.tolist()):
            _memmove(d, s, n)
        return
    # the runs cut into _COPY_THREADS parts of about equal bytes, each a list of (dst, src, n)
    share = -(-total // _COPY_THREADS)
    parts: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for d, s, n in zip(dst.tolist(), src.tolist(), lens.tolist()):
        while n:
            if not room:
                parts.append([])
                room = share
            take = min(n, room)
            parts[-1].append((d, s, take))
            d, s, n, room = d + take, s + take, n - take, room - take
    pool = _pool()
    others = [pool.submit(_copy_part, p) for p in parts[1:]]
    _copy_part(parts[0])
    for f in others:
        f.result()


def _copy_part(part: list[tuple[int, int, int]]) -> None:
    for d, s, n in part:
        _memmove(d, s, n)


class NotShared(Exception):
    """A post offered its box in shared memory only, and this agent cannot map it."""


# -- one transport's side ----------------------------------------------------------------------------------------


class Sharing:
    """One transport's shared memory (see the module table): off (``on`` False) it offers, maps and copies nothing."""

    def __init__(self, host: str, on: bool):
        self.host = host
        self.on = on and hasattr(os, "memfd_create")  # Linux
        self._exporter = exporter()
        self._maps = Mappings(host)
        self._lock = threading.Lock()
        self.bytes_sent = 0  # copied straight into peers' segments
        self.bytes_received = 0  # copied straight into this process's segments by peers
        self._copying: set[str] = set()  # peers seen copying into this agent's segments
        if self.on:
            self._exporter.share()

    @property
    def mapped(self) -> int:
        """Peers' segments mapped (once each, kept across jobs)."""
        return self._maps.mapped

    def copied_out(self, nbytes: int) -> None:
        """This agent copied ``nbytes`` into a peer's segments."""
        with self._lock:
            self.bytes_sent += nbytes

    def copies(self, peer: str) -> bool:
        """Whether ``peer`` was seen copying into this agent's segments (since it was last introduced): its boxes
        then land in segments unregistered with NIXL, and freed segments' addresses are never NIXL's problem."""
        with self._lock:
            return peer in self._copying

    def copied_in(self, peer: str, nbytes: int) -> None:
        """``peer`` copied ``nbytes`` into this agent's segments."""
        with self._lock:
            self.bytes_received += nbytes
            self._copying.add(peer)

    def offer(self, peer: str, owners: list[np.ndarray] | None, offered: list[bytes], only: bool = False) -> bytes:
        """A post's offer to ``peer``: the segments ``owners`` (the buffers a box lands in) where every one is a
        segment, each with a fresh secret (appended to ``offered``, for `withdraw`), and the segments the peer was
        offered that were freed since its last post; b"" for none. ``only``: the runs are not registered with NIXL."""
        if not self.on:
            return b""
        entries = []
        segments = [segment_of(o) for o in owners or ()]
        if segments and all(seg is not None for seg in segments):
            for seg in segments:
                offered.append(self._exporter.offer(seg, self.host, peer))
                entries.append(Entry(seg.id, seg.addr, seg.nbytes, offered[-1]))
        gone = self._exporter.gone(self.host, peer)
        if not entries and not gone:
            return b""
        return encode_offer(Offer(self._exporter.boot_id, self._exporter.address, tuple(entries), tuple(gone),
                                  only and bool(entries)))

    def withdraw(self, offered: list[bytes]) -> None:
        """The secrets ``offered`` fetch nothing from now on (and the list is emptied)."""
        self._exporter.withdraw(offered)
        offered.clear()

    def map(self, peer: str, data, addrs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, list] | None:
        """`Mappings.translate` of a post's offer bytes; None when sharing is off or the offer is empty. `NotShared`
        where the offer is all there is (``only``) and it cannot be mapped here."""
        offer = decode_offer(data) if len(data) else None
        got = self._maps.translate(peer, offer, addrs, lens) if self.on and offer is not None else None
        if got is None and offer is not None and offer.only:
            raise NotShared("sharing is off here (UCX_TLS)" if not self.on else "its segments cannot be mapped here")
        return got

    def forget(self, peer: str) -> None:
        """``peer``'s agent is new or gone: its segments are unmapped here, and it maps none of this process's."""
        with self._lock:
            self._copying.discard(peer)
        self._maps.forget(peer)
        self._exporter.forget_peer(self.host, peer)

    def close(self) -> None:
        self._maps.close()
        if self.on:
            self.on = False
            self._exporter.unshare()
