"""The transport interface, and what moving a box means, written once for every transport.

A transport moves boxes of a tensor between the agents of a job's hosts. Each one
(`grpc_link.GrpcTransport`, `collective.CollectiveTransport`, `memory.MemoryTransport`)
provides a few primitives; the semantics live here, in `Transport`:

================= ==========================================================================
``move``          a transfer's sender part: copies into the receivers on this host, then the
                  box to every remote receiver (p2p) or to the route's first host (broadcast)
``take``          one receiving hop of a transfer: write the pieces into this host's
                  receivers, forward each piece down the chain before the next arrives,
                  check the bytes against the sender's trailer (`verify_arrival`)
``reduce``        sum or max of one box over an ordered group of devices, ending replicated
                  on every device or cut over them (reduce-scatter): a ring of point-to-point
                  streams keyed (job, step, round), so every transport has it; a transport
                  whose backend has its own all-reduce may run a replicated one there
                  (``all_reduce``: the collective transport's gloo)
``send``          the chunk loop: C-ordered sub-boxes (``chunk_boxes``), the throttle, the
                  running XXH3-64, the trailer ``(nbytes, xxh3_64)``, byte accounting
================= ==========================================================================

and the primitives a transport implements:

================= ==========================================================================
``open``          an `Outgoing` stream of pieces to a peer host under a `StreamKey`
``arrivals``      (active transports) post the receives of a stream and yield its pieces;
                  passive ones (``passive = True``: gRPC, memory) have pushes arrive by
                  themselves, and the agent hands their pieces to ``take``
``serve``         where pushes to this host go (the agent's push handler)
``attach``        a job starts on this host (the collective transport checks its group)
``handshake``     before the first call with some peers (the collective transport confirms
                  that they run the same program on the same group generation)
``all_reduce``    (optional) a replicated reduce as the backend's own all-reduce; False: the ring
================= ==========================================================================

A stream is pieces (a sub-box and its bytes), then one `Trailer`. A chain hop that
forwards hands on the very bytes it keeps, so only the chain's last hop digests
them: its match covers every hop's copy, and a mismatch anywhere fails the job
before any host commits. Transfers are ``reshard.plan.Transfer`` values; byte counts
follow ``reshard.cost``. Tile buffers are touched only through
`reshard.server.transport.buffers`.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.mesh import host_of
from reshard.plan import Transfer
from reshard.proto.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from reshard.proto.layout import Checksum, chunk_boxes, np_dtype, tile_shape
from reshard.server.transport.buffers import Recycler, host_array, host_bytes, region, write

__all__ = [
    "StreamKey", "PushHeader", "Piece", "Trailer", "Session", "Traffic", "Throttle", "Sink", "Outgoing",
    "QueuedOutgoing", "Mailbox", "Transport", "REDUCE_OPS", "REDUCE_RESULTS", "verify_arrival", "interleaved",
    "first_peer", "hop_targets", "receiving_hops", "sending_peers", "stream_count", "in_thread", "dtype_pairs_of",
]

REDUCE_OPS = {"sum": np.add, "max": np.maximum}
REDUCE_RESULTS = ("replicate", "shard")


@dataclass(frozen=True, slots=True)
class StreamKey:
    """Names one stream of a job: the step it belongs to and, within it, the hop (move) or message (reduce).

    Move: ``hop`` is the route index of the receiving host (broadcast) or the receiver's
    index (p2p). Reduce: ``hop = round * group size + index of the sending device``.
    """

    job: str
    step: int
    hop: int


@dataclass(frozen=True)
class PushHeader:
    """What opens a pushed stream (passive transports): whose job and program, which stream, from whom."""

    job: str
    program_id: str
    step: int
    hop: int
    from_host: str

    @property
    def key(self) -> StreamKey:
        return StreamKey(self.job, self.step, self.hop)


class Piece(NamedTuple):
    """A sub-box of a stream and its bytes (C order). ``wire`` is the transport's own form of the piece as it
    arrived (a chain hop hands it on unchanged); ``landed`` the receiver whose buffer it was received into."""

    box: Box
    data: Any  # a C-contiguous bytes-like object
    wire: Any = None
    landed: str | None = None


class Trailer(NamedTuple):
    nbytes: int
    digest: int  # XXH3-64 of all the stream's bytes in order


class Traffic:
    """Bytes a host moved for one job: over the network per peer host, and between its own devices."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_in: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)
        self.local_bytes = 0
        self.sent = 0  # as a transfer's sender: what progress reports (``reshard.cost.sender_bytes``)
        self.native_reduces = 0  # reduces run as the transport's own all-reduce (`Transport.all_reduce`)

    def add_in(self, peer: str, n: int) -> None:
        with self._lock:
            self.bytes_in[peer] += n

    def add_out(self, peer: str, n: int, origin: bool) -> None:
        with self._lock:
            self.bytes_out[peer] += n
            if origin:
                self.sent += n

    def add_native_reduce(self) -> None:
        with self._lock:
            self.native_reduces += 1

    def add_local(self, n: int, origin: bool = True) -> None:
        with self._lock:
            self.local_bytes += n
            if origin:
                self.sent += n


class Throttle:
    """Caps an agent's send rate (tests use it to interrupt a transfer midway); 0 means no cap."""

    def __init__(self, bytes_per_s: float = 0.0):
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def wait(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        time.sleep(max(0.0, start - now))


def dtype_pairs_of(dtypes: dict[int, str]) -> dict[int, tuple[str, np.dtype]]:
    """Each step's dtype name and its numpy dtype, as a `Session` keeps them."""
    return {step: (name, np_dtype(name)) for step, name in dtypes.items()}


class Session:
    """One job on one host, as its transport sees it: ids, dtype, peers, traffic and the first failure.

    ``dtypes`` gives each step's dtype (the dtype of the tensor it moves or reduces).
    ``streams`` numbers every stream of the job (step -> its first stream number, see
    `stream_count`; ``num_streams`` in all) for transports that tag messages. The agent's
    runtime extends it.
    """

    def __init__(self, job: str, program_id: str, dtypes: dict[int, str], peers: dict[str, str], *,
                 generation: int = 0, seq: int = 0, streams: dict[int, int] | None = None, num_streams: int = 0,
                 push_tickets: dict[str, str] | None = None, dtype_pairs: dict | None = None):
        self.job = job
        self.program_id = program_id  # the id of the plan or program the agent was handed
        # step -> (dtype name, numpy dtype); ``dtype_pairs`` gives them worked out already (`dtype_pairs`)
        self._dtypes = dtype_pairs if dtype_pairs is not None else dtype_pairs_of(dtypes)
        self.peers = dict(peers)
        self.push_tickets = dict(push_tickets or {})  # peer host -> the planner's ticket for pushes to it
        self.generation = generation
        self.seq = seq
        self.streams = streams or {}
        self.num_streams = num_streams
        self.traffic = Traffic()
        self.failed: BaseException | None = None
        self._fail_lock = threading.Lock()

    def fail(self, error: BaseException) -> BaseException:
        """Record ``error`` unless an earlier failure was; returns the one that counts."""
        with self._fail_lock:
            if self.failed is None:
                self.failed = error
            return self.failed

    def check(self) -> None:
        """Raise the job's failure, if any: every loop calls this between pieces, which is how a job cancels."""
        if self.failed is not None:
            raise self.failed

    def stream(self, key: StreamKey) -> int:
        return self.streams.get(key.step, 0) + key.hop

    def dtype(self, step: int) -> tuple[str, np.dtype]:
        """Step ``step``'s dtype: its reshard name and the numpy dtype that holds its elements."""
        return self._dtypes[step]


class Sink(Protocol):
    """Where received boxes land on this host: the job's destination buffers, by device."""

    def write(self, device: str, box: Box, data) -> None:
        """Copy ``data`` (shaped like ``box``) into ``device``'s buffer."""

    def place(self, devices: list[str], box: Box) -> tuple[str, Any] | None:
        """One of ``devices`` whose buffer holds ``box`` contiguously, and that region (a transport may receive
        into it directly), or None."""

    def mark(self, device: str, box: Box) -> None:
        """Count ``box`` as arrived in ``device``'s buffer, which a transport received into in place."""


class Outgoing(ABC):
    """One stream to a peer: pieces, then the trailer, then wait for the far end."""

    @abstractmethod
    def put(self, box: Box, data, wire=None) -> None: ...

    @abstractmethod
    def end(self, nbytes: int, digest: int) -> None:
        """Hand the trailer over (without waiting for the far end)."""

    @abstractmethod
    def wait(self, timeout: float) -> list[str] | None:
        """Wait until the stream is through; the hosts that verified the box, or None where the transport does
        not report them (every receiving host then reports to the planner itself)."""

    @abstractmethod
    def cancel(self) -> None:
        """End the stream early, without a trailer: the far end discards it."""


_STOP = object()


class QueuedOutgoing(Outgoing):
    """An `Outgoing` fed through a bounded queue to a consumer that ``start`` launches with the queue's items
    (a gRPC call, a thread of the memory network) and that returns a future of the confirming hosts.

    A stream gives up on a peer that stopped taking its pieces: when the queue accepts none for
    ``stall_s`` seconds (None: no limit but the consumer's own deadline), the call is cancelled and the
    stream fails naming the peer. ``check`` raises the job's failure: a job that failed elsewhere (the
    planner aborted it) stops waiting for a peer at once, and cancels the call rather than leave it open
    to a peer that may never read it.
    """

    def __init__(self, peer: str, depth: int, start: Callable[[Iterator], Any],
                 error: Callable[[BaseException], BaseException] = lambda e: e, *,
                 stall_s: float | None = None, check: Callable[[], None] = lambda: None):
        self.peer = peer
        self._queue: queue.Queue = queue.Queue(max(1, depth))
        self._error = error
        self._stall_s = stall_s
        self._check = check
        self._future = start(self._drain())

    def _drain(self) -> Iterator:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            yield item
            if isinstance(item, Trailer):
                return

    def _offer(self, item) -> None:
        since = time.monotonic()
        while True:
            if self._future.done():
                self.wait(0)
                raise FailedPreconditionError(f"the stream to host {self.peer} ended early")
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass
            self._check_job()
            if self._stall_s is not None and time.monotonic() - since > self._stall_s:
                self._future.cancel()
                raise DeadlineExceededError(
                    f"host {self.peer} took no bytes of a stream for {self._stall_s:g}s: its agent stopped reading "
                    f"(paused, hung or cut off), so the stream gives up (agent --stall-timeout)")

    def _check_job(self) -> None:
        """Raise the job's failure, if any, cancelling the call (see the class docstring)."""
        try:
            self._check()
        except BaseException:
            self._future.cancel()
            raise

    def put(self, box: Box, data, wire=None) -> None:
        self._offer(Piece(box, data, wire))

    def end(self, nbytes: int, digest: int) -> None:
        self._offer(Trailer(nbytes, digest))

    def wait(self, timeout: float) -> list[str] | None:
        deadline = time.monotonic() + timeout
        while True:
            if self._future.done():
                try:
                    return list(self._future.result())
                except BaseException as e:  # noqa: BLE001 - mapped by the transport
                    raise self._error(e) from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(f"host {self.peer} did not confirm its stream within {timeout:g}s")
            self._check_job()
            try:
                self._future.result(timeout=min(0.1, left))
            except BaseException:  # noqa: BLE001 - this wait's timeout, or the stream's error: the next turn sees it
                pass

    def cancel(self) -> None:
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            try:
                self._queue.get_nowait()
                self._queue.put_nowait(_STOP)
            except (queue.Empty, queue.Full):
                pass


class _Slot:
    def __init__(self):
        self.arrived = threading.Event()
        self.done = threading.Event()
        self.items: Iterable | None = None
        self.error: BaseException | None = None


class Mailbox:
    """Streams pushed to a passive transport that a running task receives actively (a reduce's rounds).

    The push's thread leaves its pieces here (`deliver`) and waits until the task that
    takes them (`take`) has checked them, so the sender learns the outcome.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._slots: dict[StreamKey, _Slot] = {}

    def _slot(self, key: StreamKey) -> _Slot:
        with self._lock:
            return self._slots.setdefault(key, _Slot())

    def deliver(self, key: StreamKey, items: Iterable, timeout: float) -> None:
        slot = self._slot(key)
        slot.items = items
        slot.arrived.set()
        if not slot.done.wait(timeout):
            raise DeadlineExceededError(f"job {key.job}: no task took stream {key.hop} of step {key.step} "
                                        f"within {timeout:g}s")
        if slot.error is not None:
            raise slot.error

    @contextmanager
    def take(self, key: StreamKey, timeout: float, session: Session) -> Iterator[Iterable]:
        slot = self._slot(key)
        deadline = time.monotonic() + timeout
        while not slot.arrived.wait(0.05):
            session.check()
            if time.monotonic() > deadline:
                self._drop(key)
                raise DeadlineExceededError(f"job {key.job}: stream {key.hop} of step {key.step} did not arrive "
                                            f"within {timeout:g}s")
        try:
            yield slot.items
        except BaseException as e:
            slot.error = e
            raise
        finally:
            slot.done.set()
            self._drop(key)

    def _drop(self, key: StreamKey) -> None:
        with self._lock:
            self._slots.pop(key, None)

    def cancel(self, job: str, error: BaseException) -> None:
        """Fail the pushes of ``job`` that wait for a task which will not come."""
        with self._lock:
            slots = [(k, s) for k, s in self._slots.items() if k.job == job]
            for k, _ in slots:
                del self._slots[k]
        for _, s in slots:
            s.error = error
            s.done.set()


# -- who talks to whom in a transfer -------------------------------------------------------------------


def first_peer(t: Transfer) -> str:
    """The host a transfer's sender streams to first ('' when it stays on the sender's host)."""
    if t.method == "broadcast":
        return t.route[0] if t.route else ""
    sender = host_of(t.sender)
    return next((h for h in map(host_of, t.receivers) if h != sender), "")


def receiving_hops(t: Transfer, host: str) -> list[int]:
    """The hops of ``t`` that deliver to ``host`` over the network."""
    if t.method == "broadcast":
        return [hop for hop, h in enumerate(t.route) if h == host]
    if t.method == "p2p" and host_of(t.sender) != host:
        return [hop for hop, r in enumerate(t.receivers) if host_of(r) == host]
    return []


def hop_targets(t: Transfer, hop: int, host: str) -> tuple[list[str], str | None, str] | None:
    """For hop ``hop`` of ``t`` arriving at ``host``: (its receivers on ``host``, the host it forwards to or None,
    the host it comes from); None when that hop does not deliver to ``host``."""
    if t.method == "broadcast" and 0 <= hop < len(t.route) and t.route[hop] == host:
        chain = (host_of(t.sender), *t.route)
        nxt = t.route[hop + 1] if hop + 1 < len(t.route) else None
        return [r for r in t.receivers if host_of(r) == host], nxt, chain[hop]
    if t.method == "p2p" and 0 <= hop < len(t.receivers) and host_of(t.receivers[hop]) == host != host_of(t.sender):
        return [t.receivers[hop]], None, host_of(t.sender)
    return None


def sending_peers(t: Transfer, host: str) -> set[str]:
    """The hosts ``host`` streams to as the sender of ``t``."""
    if t.method == "broadcast":
        return {t.route[0]} if t.route else set()
    if t.method == "p2p":
        return {host_of(r) for r in t.receivers} - {host}
    return set()


def stream_count(kind: str, transfer: Transfer | None = None, group_size: int = 0) -> int:
    """How many streams a step may open: its (transfer, hop) pairs, or a reduce's ring messages."""
    if kind == "move":
        return len(transfer.receivers) if transfer.method == "p2p" else len(transfer.route)
    if kind == "reduce":
        return 2 * group_size * (group_size - 1)
    return 0


def interleaved(transfers: list[tuple[int, Transfer]]) -> list[tuple[int, Transfer]]:
    """Round-robin over (sender host, destination host) pairs, so the transfers running at
    once (pools are bounded) share every NIC, as the cost model assumes, instead of all
    going to one host while the others idle. Plans list transfers grouped by destination.
    The order depends on the transfers alone, so every host computes the same one."""
    by_peer: dict[tuple[str, str], list[tuple[int, Transfer]]] = defaultdict(list)
    for it in transfers:
        by_peer[host_of(it[1].sender), first_peer(it[1])].append(it)
    queues = list(by_peer.values())
    out = []
    for k in range(max(map(len, queues), default=0)):
        out += [q[k] for q in queues if k < len(q)]
    return out


def verify_arrival(job: str, index: int, t: Transfer, hop: int, check: Checksum, sent_nbytes: int,
                   sent_digest: int, itemsize: int) -> None:
    """Check one received stream of transfer ``index`` against its sender's trailer: byte count and XXH3-64.

    ``check`` counts bytes only on a hop that forwards down a chain; the last hop's
    digest then speaks for the whole route (see the module docstring).
    """
    expected = boxes.volume(t.box) * itemsize
    sender = host_of(t.sender)
    if not check.nbytes == sent_nbytes == expected:
        raise DataLossError(
            f"job {job}: transfer {index} from {sender} arrived with {check.nbytes} bytes; the sender sent "
            f"{sent_nbytes} and the box holds {expected}"
        )
    if check.digests and check.xxh3_64 != sent_digest:
        if t.method == "broadcast" and hop:
            where = f"somewhere on the chain {' -> '.join([sender, *t.route[:hop + 1]])}"
        else:
            where = f"between {sender} and {t.route[0] if t.method == 'broadcast' else host_of(t.receivers[hop])}"
        raise DataLossError(
            f"job {job}: transfer {index} arrived with XXH3-64 {check.xxh3_64:016x}, but the sender sent "
            f"{sent_digest:016x}: the bytes changed {where}, so the job fails and no host commits them"
        )


# -- the interface -------------------------------------------------------------------------------------


SCRATCH_KEPT_BYTES = 256 * 2**20  # a transport's scratch arrays kept for its next reduces, at most


class Transport(ABC):
    """Moves boxes between agents (see the module docstring); one instance per agent and kind."""

    name = ""
    passive = True  # pushes arrive by themselves; False: the receiver posts its receives (`arrivals`)
    lanes = 0  # active transports: how many of a job's tasks may run at once

    def __init__(self, host: str, *, chunk_bytes: int, timeout_s: float, throttle: Throttle | None = None,
                 stall_timeout_s: float | None = None):
        self.host = host
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s  # the longest one stream may take
        self.stall_timeout_s = stall_timeout_s  # the longest a stream may wait for its peer to take a piece
        self.throttle = throttle or Throttle()
        self.mailbox = Mailbox()
        # The arrays a ring's incoming partial parts land in, kept between reduces: a training step or an einsum
        # repeats reduces of the same sizes, and a fresh array pays a page fault per 4 KiB on its first write.
        self.scratch = Recycler(SCRATCH_KEPT_BYTES)

    # -- primitives ---------------------------------------------------------------------------------

    @abstractmethod
    def open(self, s: Session, key: StreamKey, peer: str) -> Outgoing:
        """Start a stream to ``peer``'s agent."""

    def arrivals(self, s: Session, key: StreamKey, peer: str, box: Box,
                 place: Callable[[Box], tuple[str, Any] | None]) -> Iterator:
        """Receive the stream ``key`` of ``box`` from ``peer``: its `Piece` items, then its `Trailer`.
        ``place(sub)`` offers a destination region to receive a piece into directly. Passive transports take
        the push from the mailbox, where the agent left it."""
        raise AssertionError(f"the {self.name} transport receives passively: the agent hands pushes to take()")

    def serve(self, handler: Callable[[PushHeader, Iterable], list[str] | None]) -> None:
        """Where pushes to this host go (the agent runtime's ``accept``), for transports that deliver them
        themselves; the gRPC transport's pushes reach the agent's servicer instead."""

    def attach(self, s: Session) -> None:
        """A job starts on this host (prepare)."""

    def detach(self, s: Session) -> None:
        """A job ended on this host (commit or abort)."""

    def handshake(self, s: Session, peers: set[str]) -> None:
        """Before the first call with ``peers`` in a job."""

    def all_reduce(self, s: Session, step: int, group: tuple[str, ...], box: Box, op: str,
                   read: Callable[[str], Any], produce: Callable[[str, Box], tuple[Any, Box]]) -> bool:
        """This host's part of a replicated `reduce` as the backend's own all-reduce, where the transport has
        one and every member takes it this time; False: run `reduce`'s ring (what every member then does)."""
        return False

    def close(self) -> None:
        """Release connections (the agent stops)."""

    # -- the chunk loop -----------------------------------------------------------------------------

    def send(self, s: Session, key: StreamKey, peer: str, array, origin: Box, box: Box,
             digest: Future | None = None, origin_bytes: bool = True) -> list[str] | None:
        """Stream ``box`` of ``array`` (which holds ``origin``) to ``peer``; returns who verified it.
        ``digest`` is the box's XXH3-64 when it is computed elsewhere (the agent digests held shards early)."""
        out = self.open(s, key, peer)
        check = Checksum(digest=digest is None)
        try:
            for sub in chunk_boxes(box, s.dtype(key.step)[0], self.chunk_bytes):
                s.check()
                data = host_bytes(region(array, sub, origin))
                if not data.nbytes:
                    continue
                self.throttle.wait(data.nbytes)
                check.update(data)
                out.put(sub, data)
                s.traffic.add_out(peer, data.nbytes, origin_bytes)
            out.end(check.nbytes, digest.result() if digest is not None else check.xxh3_64)
            return out.wait(self.timeout_s)
        except BaseException:
            out.cancel()
            raise

    def relay(self, s: Session, key: StreamKey, peer: str, box: Box, items: Iterable, sink: Sink,
              local: list[str], forward_to: str | None,
              verify: Callable[[Checksum, int, int], None]) -> list[str] | None:
        """Take one incoming stream: forward every piece to ``forward_to`` (under the next hop's key) before
        writing it into ``local``'s buffers, then check the trailer; returns who verified the box."""
        forward = self.open(s, StreamKey(key.job, key.step, key.hop + 1), forward_to) if forward_to else None
        check = Checksum(digest=forward is None)  # a forwarding hop leaves the digest to the chain's last hop
        dtype = s.dtype(key.step)[1]
        try:
            for item in items:
                if isinstance(item, Trailer):
                    if forward is not None:
                        forward.end(item.nbytes, item.digest)
                    verify(check, item.nbytes, item.digest)
                    if forward is None:
                        return [self.host]
                    later = forward.wait(self.timeout_s)
                    return None if later is None else [self.host, *later]
                s.check()  # a job that failed elsewhere (a deadline, an abort) stops taking pieces
                sub, data = item.box, item.data
                if not boxes.contains(box, sub):
                    raise InvalidArgumentError(
                        f"job {key.job}: piece {boxes.box_str(sub)} lies outside transfer box {boxes.box_str(box)}"
                    )
                n = memoryview(data).nbytes
                if n != boxes.volume(sub) * dtype.itemsize:
                    raise InvalidArgumentError(f"job {key.job}: piece {boxes.box_str(sub)} carries {n} bytes, not "
                                               f"{boxes.volume(sub) * dtype.itemsize}")
                if forward is not None:
                    forward.put(sub, data, item.wire)
                    s.traffic.add_out(forward_to, n, origin=False)
                arr = np.frombuffer(data, dtype=dtype).reshape(tile_shape(sub))
                for r in local:
                    if r == item.landed:
                        sink.mark(r, sub)
                    else:
                        sink.write(r, sub, arr)
                check.update(data)
                s.traffic.add_in(peer, n)
            raise InvalidArgumentError(
                f"job {key.job}: stream {key.hop} of step {key.step} from {peer} ended after {check.nbytes} bytes "
                f"without a trailer; the sender stopped"
            )
        except BaseException:
            if forward is not None:
                forward.cancel()
            raise

    # -- moves ----------------------------------------------------------------------------------------

    def move(self, s: Session, step: int, t: Transfer, sink: Sink, array, origin: Box,
             digest: Future | None = None) -> None:
        """The sender's part of transfer ``t`` (step ``step``), from ``array`` holding ``origin``."""
        view = region(array, t.box, origin)
        nbytes = boxes.volume(t.box) * s.dtype(step)[1].itemsize
        for r in t.receivers:
            if host_of(r) == self.host:
                sink.write(r, t.box, view)
                s.traffic.add_local(nbytes)
        if t.method == "p2p":
            for hop, r in enumerate(t.receivers):
                if host_of(r) != self.host:
                    self.send(s, StreamKey(s.job, step, hop), host_of(r), array, origin, t.box, digest)
        elif t.method == "broadcast" and t.route:
            confirmed = self.send(s, StreamKey(s.job, step, 0), t.route[0], array, origin, t.box, digest)
            if confirmed is not None and list(confirmed) != list(t.route):
                raise FailedPreconditionError(
                    f"job {s.job}: broadcast {step} was confirmed by {confirmed}, expected the route {list(t.route)}"
                )

    def take(self, s: Session, step: int, t: Transfer, hop: int, sink: Sink,
             items: Iterable | None = None) -> list[str] | None:
        """Hop ``hop`` of transfer ``t`` arriving here: ``items`` as pushed (passive transports), or received
        now (active ones). Returns who verified the box: this host and every later hop."""
        targets = hop_targets(t, hop, self.host)
        if targets is None:
            raise InvalidArgumentError(f"job {s.job}: transfer {step} ({t}) hop {hop} does not deliver to host "
                                       f"{self.host}")
        local, nxt, peer = targets
        key = StreamKey(s.job, step, hop)
        if items is None:
            items = self.arrivals(s, key, peer, t.box, lambda sub: sink.place(local, sub))

        def verify(check: Checksum, nbytes: int, digest: int) -> None:
            verify_arrival(s.job, step, t, hop, check, nbytes, digest, s.dtype(step)[1].itemsize)

        return self.relay(s, key, peer, t.box, items, sink, local, nxt, verify)

    # -- reduce ---------------------------------------------------------------------------------------

    def reduce(self, s: Session, step: int, group: tuple[str, ...], box: Box, op: str, result: str,
               dim: int | None, read: Callable[[str], Any], produce: Callable[[str, Box], tuple[Any, Box]]) -> None:
        """This host's part of a ring reduce of ``box`` over the devices ``group`` (in that order).

        ``read(device)`` is the device's addends, a region shaped like ``box``. With ``result``
        ``replicate`` every device ends with the whole reduced box, with ``shard`` device ``i``
        with chunk ``i`` of it along ``dim`` (``box.chunk``, as ``torch.chunk`` cuts).
        ``produce(device, box)`` is the buffer a device's result goes into and the box it
        holds. The ring cuts the box in ``n`` parts (those chunks, or `box.split` for
        ``replicate``). Round ``r < n - 1`` (reduce-scatter): device ``i`` sends its partial
        part ``(i - r - 1) % n`` to device ``i + 1``, which folds it into its own; afterwards
        device ``i`` holds part ``i`` complete. Rounds ``n - 1 ..`` (all-gather, ``replicate``
        only) pass the complete parts on. Messages between devices of one host are copies; the
        others are streams keyed ``(job, step, round * n + sender index)``.

        Bytes are touched as few times as the ring allows: the first round sends addends as
        they are; a replicated result accumulates in the device's result buffer itself when
        that is host memory, each part written first by the fold of this device's addends
        with the incoming partial part (the old version stays intact, and nothing is copied
        in beforehand); incoming partial parts land in one scratch array reused every round,
        and all-gather parts are received straight into place.

        A replicated reduce goes to the transport's `all_reduce` first: where its backend runs it
        (the collective transport's gloo), that is the reduce, and the ring (`ring_reduce`) does not run.
        """
        if not (result == "replicate" and box and self.all_reduce(s, step, group, box, op, read, produce)):
            self.ring_reduce(s, step, group, box, op, result, dim, read, produce)

    def ring_reduce(self, s: Session, step: int, group: tuple[str, ...], box: Box, op: str, result: str,
                    dim: int | None, read: Callable[[str], Any],
                    produce: Callable[[str, Box], tuple[Any, Box]]) -> None:
        """`reduce` as the ring of tagged streams its docstring describes."""
        if not box:  # a scalar: the ring runs on its one element as a vector of one
            def produce_one(device: str, _box: Box):
                array, origin = produce(device, ())
                return region(array, (), origin).reshape((1,)), ((0, 1),)

            self.reduce(s, step, group, ((0, 1),), op, result, 0 if dim is not None else None,
                        lambda d: np.reshape(host_array(read(d)), (1,)), produce_one)
            return
        fold = _bfloat16_fold(REDUCE_OPS[op]) if s.dtype(step)[0] == "bfloat16" else REDUCE_OPS[op]
        dtype = s.dtype(step)[1]
        n = len(group)
        shape = tile_shape(box)
        parts = boxes.chunk(box, n, dim) if result == "shard" else boxes.split(box, n)
        mine = [i for i, d in enumerate(group) if host_of(d) == self.host]
        addends = {i: np.frombuffer(host_bytes(read(group[i])), dtype=dtype).reshape(shape) for i in mine}
        outs = {i: produce(group[i], box) for i in mine} if result == "replicate" else {}
        acc: dict[int, np.ndarray] = {}
        in_place: set[int] = set()  # devices whose result buffer is the accumulator
        for i in mine:
            view = region(outs[i][0], box, outs[i][1]) if i in outs else None
            if isinstance(view, np.ndarray) and view.dtype == dtype and view.flags.writeable:
                in_place.add(i)
            acc[i] = view if i in in_place else np.empty(shape, dtype=dtype)
            if n == 1:
                acc[i][...] = addends[i]
        need = max(boxes.volume(p) for p in parts) * dtype.itemsize
        held = None
        if n > 1:
            held = self.scratch.take(need)
            held = np.empty(need, dtype=np.uint8) if held is None else held
        scratch = held.view(dtype) if held is not None else None
        rounds = (n - 1) * (2 if result == "replicate" else 1)
        if n > 1 and len(mine) == 1 and len({host_of(d) for d in group}) == n:
            self._pipelined_ring(s, step, group, box, parts, mine[0], rounds, acc, addends, fold, scratch)
            rounds = 0  # done
        for rnd in range(rounds):
            s.check()
            gather = rnd >= n - 1
            r = rnd - (n - 1) if gather else rnd
            outgoing = [parts[(i - r - (0 if gather else 1)) % n] for i in range(n)]
            # the first round sends addends as they are; later ones what the previous rounds made
            sent = addends if rnd == 0 else acc
            sends = []
            for i in mine:
                j = (i + 1) % n
                if host_of(group[j]) != self.host and boxes.volume(outgoing[i]):
                    view = sent[i][boxes.to_slices(outgoing[i], box)]
                    key = StreamKey(s.job, step, rnd * n + i)
                    # a round sends while it receives: a ring where every member sent first would wait forever
                    sends.append(in_thread("reduce-send", self.send, s, key, host_of(group[j]), view, outgoing[i],
                                           outgoing[i], None, False))
            for j in mine:
                i = (j - 1) % n
                part = outgoing[i]
                if not boxes.volume(part):
                    continue
                where = boxes.to_slices(part, box)
                if host_of(group[i]) == self.host:
                    data = sent[i][where]
                    s.traffic.add_local(data.nbytes, origin=False)
                    if gather:
                        acc[j][where] = data
                elif gather:  # straight into place
                    self._receive_part(s, StreamKey(s.job, step, rnd * n + i), host_of(group[i]), part, acc[j][where])
                else:
                    data = scratch[:boxes.volume(part)].reshape(tile_shape(part))
                    self._receive_part(s, StreamKey(s.job, step, rnd * n + i), host_of(group[i]), part, data)
                if not gather:  # a part's first write: this device's addends folded with what came in
                    fold(addends[j][where], data, out=acc[j][where])
            for f in sends:
                f.result()
        if held is not None:
            # Back for the next reduce only now; a receive still posted into it after a failure holds it, and the
            # recycler hands out only what nothing else holds.
            self.scratch.put(held)
        for i in mine:
            if i in outs:
                if i not in in_place:
                    write(outs[i][0], box, outs[i][1], acc[i])
            elif boxes.volume(parts[i]):
                array, origin = produce(group[i], parts[i])
                write(array, parts[i], origin, acc[i][boxes.to_slices(parts[i], box)])

    def _pipelined_ring(self, s: Session, step: int, group: tuple[str, ...], box: Box, parts: list[Box], i: int,
                        rounds: int, acc: dict, addends: dict, fold, scratch: np.ndarray) -> None:
        """The ring of `reduce` where every member is on a host of its own (this one holds member ``i``), pipelined
        piece by piece across rounds: the part a device receives in round ``r`` is the part it sends in round
        ``r + 1`` (folded with its addends while reducing, as it came while gathering), so each piece goes on to
        the next host as soon as it is folded, and no round waits for the previous one to end.

        One thread sends every round's stream in turn (the first round's straight from the addends), each piece
        as the receiving loop hands its box over; the receiving loop never waits for a send. A receive that
        waited for its forward would wait for the next host to take the next round, which that host does only
        after its own receive ends: every host's wait would chain around the ring."""
        n = len(group)
        to, frm = host_of(group[(i + 1) % n]), host_of(group[(i - 1) % n])
        dtype = s.dtype(step)[1]
        # round -> (what it sends: its part, the array holding it, the boxes ready to go); None ends a round
        sending: list[tuple[int, Box, np.ndarray, queue.Queue, bool]] = []
        first = parts[(i - 1) % n]
        if boxes.volume(first):
            ready: queue.Queue = queue.Queue()
            for sub in chunk_boxes(first, s.dtype(step)[0], self.chunk_bytes):
                if boxes.volume(sub):
                    ready.put(sub)
            ready.put(None)
            sending.append((0, first, addends[i], ready, False))
        plan = []
        for rnd in range(rounds):
            gather = rnd >= n - 1
            r = rnd - (n - 1) if gather else rnd
            part = parts[(i - 1 - r - (0 if gather else 1)) % n]  # what member i - 1 sends this round
            if not boxes.volume(part):
                continue  # nor is it sent on: member i's next round sends this same part
            handoff: queue.Queue | None = None
            # A gathered part that goes on as it came is a chain of hops: only its last hop digests it, and the
            # others forward the origin's digest (as `relay` does). A hop's copy commits only if the whole job
            # does, and the last hop's check fails the job on any byte that changed on the way.
            forward = gather and rnd + 1 < rounds
            if rnd + 1 < rounds:
                handoff = queue.Queue()
                sending.append((rnd + 1, part, acc[i], handoff, forward))
            plan.append((rnd, gather, part, handoff, forward))
        sender = in_thread("reduce-send", self._send_rounds, s, step, n, i, to, box, sending)
        try:
            for rnd, gather, part, handoff, forward in plan:
                s.check()
                landing = (acc[i][boxes.to_slices(part, box)] if gather
                           else scratch[:boxes.volume(part)].reshape(tile_shape(part)))
                self._ring_hop(s, StreamKey(s.job, step, rnd * n + (i - 1) % n), frm, part, box, landing, acc[i],
                               None if gather else addends[i], fold, handoff, dtype, forward)
        except BaseException as e:
            for _, _, _, ready, _ in sending:
                ready.put(e)  # the sender stops at once
            raise
        sender.result()

    def _send_rounds(self, s: Session, step: int, n: int, i: int, to: str, box: Box, sending: list) -> None:
        """Member ``i``'s streams of a pipelined ring, round after round: each piece as soon as its box is handed
        over (see `_pipelined_ring`); waits for the peer's confirmations only after the last."""
        opened: list[Outgoing] = []
        try:
            for rnd, part, source, ready, forward in sending:
                out = self.open(s, StreamKey(s.job, step, rnd * n + i), to)
                opened.append(out)
                check = Checksum(digest=not forward)  # a forwarded part goes on with the digest it came with
                while True:
                    try:
                        sub = ready.get(timeout=0.1)
                    except queue.Empty:
                        s.check()
                        continue
                    if isinstance(sub, BaseException):
                        raise sub
                    if sub is None or isinstance(sub, _Passed):
                        break
                    data = host_bytes(source[boxes.to_slices(sub, box)])
                    self.throttle.wait(data.nbytes)
                    check.update(data)
                    out.put(sub, data)
                    s.traffic.add_out(to, data.nbytes, origin=False)
                out.end(check.nbytes, sub.digest if forward else check.xxh3_64)
            for out in opened:
                out.wait(self.timeout_s)
        except BaseException:
            for out in opened:
                out.cancel()
            raise

    def _ring_hop(self, s: Session, key: StreamKey, peer: str, part: Box, box: Box, landing: np.ndarray,
                  acc: np.ndarray, addends: np.ndarray | None, fold, handoff: queue.Queue | None, dtype,
                  forward: bool = False) -> None:
        """Take ring message ``key`` (``part`` of ``box``) from ``peer`` into ``landing``: fold each piece with
        ``addends`` into ``acc`` (reduce-scatter) or keep it as it came (all-gather, ``landing`` is in ``acc``),
        then hand its box to the next round's sender (``handoff``); check the message against its trailer. A
        part this member ``forward``s as it came is checked for its size only, and its trailer's digest goes on
        with it (`_Passed`): the chain's last hop digests it."""
        incoming = Checksum(digest=not forward)

        def place(sub: Box):
            view = landing[boxes.to_slices(sub, part)]
            return ("", view) if view.flags.c_contiguous else None

        with self._incoming(s, key, peer, part, place) as items:
            for item in items:
                if isinstance(item, Trailer):
                    expected = boxes.volume(part) * dtype.itemsize
                    got = incoming.xxh3_64 if incoming.digests else item.digest
                    if not incoming.nbytes == item.nbytes == expected or got != item.digest:
                        raise DataLossError(
                            f"job {s.job}: reduce step {key.step} message {key.hop} from {peer} arrived with "
                            f"{incoming.nbytes} bytes and XXH3-64 {got:016x}; the sender sent "
                            f"{item.nbytes} bytes with {item.digest:016x} and the part holds {expected}")
                    if handoff is not None:
                        handoff.put(_Passed(item.digest) if forward else None)
                    return
                s.check()
                sub, data = item.box, item.data
                nbytes = memoryview(data).nbytes
                if not boxes.contains(part, sub) or nbytes != boxes.volume(sub) * dtype.itemsize:
                    raise InvalidArgumentError(f"job {s.job}: reduce message {key.hop} of step {key.step} brought "
                                               f"{nbytes} bytes for {boxes.box_str(sub)}, which is not a piece of "
                                               f"{boxes.box_str(part)}")
                incoming.update(data)
                s.traffic.add_in(peer, nbytes)
                here = landing[boxes.to_slices(sub, part)]
                if item.landed != "":  # not received into place
                    here[...] = np.frombuffer(data, dtype=dtype).reshape(tile_shape(sub))
                if addends is not None:
                    where = boxes.to_slices(sub, box)
                    fold(addends[where], here, out=acc[where])
                if handoff is not None:
                    handoff.put(sub)
        raise InvalidArgumentError(f"job {s.job}: reduce message {key.hop} of step {key.step} from {peer} ended "
                                   f"after {incoming.nbytes} bytes without a trailer; the sender stopped")

    @contextmanager
    def _incoming(self, s: Session, key: StreamKey, peer: str, part: Box, place) -> Iterator[Iterable]:
        """The pieces, then the trailer, of stream ``key``: from the mailbox (passive transports) or received now
        (active ones, into ``place`` where it offers room)."""
        if self.passive:
            with self.mailbox.take(key, self.timeout_s, s) as items:
                yield items
        else:
            yield self.arrivals(s, key, peer, part, place)

    def _receive_part(self, s: Session, key: StreamKey, peer: str, part: Box, out: np.ndarray) -> None:
        """One reduce message from ``peer`` into ``out``, a host array (or view) shaped like ``part``."""
        into = _ArraySink(out, part)

        def verify(check: Checksum, nbytes: int, digest: int) -> None:
            expected = out.nbytes
            if not check.nbytes == nbytes == expected or check.xxh3_64 != digest:
                raise DataLossError(
                    f"job {s.job}: reduce step {key.step} message {key.hop} from {peer} arrived with "
                    f"{check.nbytes} bytes and XXH3-64 {check.xxh3_64:016x}; the sender sent {nbytes} bytes with "
                    f"{digest:016x} and the part holds {expected}"
                )

        if self.passive:
            with self.mailbox.take(key, self.timeout_s, s) as items:
                self.relay(s, key, peer, part, items, into, [""], None, verify)
        else:
            items = self.arrivals(s, key, peer, part, lambda sub: into.place([""], sub))
            self.relay(s, key, peer, part, items, into, [""], None, verify)


@dataclass(frozen=True)
class _Passed:
    """The end of a ring message that a member forwards as it came: the digest its origin sent, to send on."""

    digest: int


def _bfloat16_fold(op):
    """``op`` on bfloat16 elements held as uint16 bits: through float32, rounded back (adding the bits is wrong)."""

    def fold(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        out[...] = float32_to_bfloat16(op(bfloat16_to_float32(a), bfloat16_to_float32(b)))

    return fold


class _ArraySink:
    """A `Sink` of one host array (a reduce's incoming part), under the device name ''."""

    def __init__(self, array: np.ndarray, origin: Box):
        self.array, self.origin = array, origin

    def write(self, device: str, box: Box, data) -> None:
        self.array[boxes.to_slices(box, self.origin)] = data

    def place(self, devices: list[str], box: Box):
        view = self.array[boxes.to_slices(box, self.origin)]
        return ("", view) if view.flags.c_contiguous else None

    def mark(self, device: str, box: Box) -> None:
        pass


def in_thread(name: str, fn: Callable, *args) -> Future:
    """Run ``fn(*args)`` on a thread of its own; its result or error comes back through the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future
