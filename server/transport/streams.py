"""The streams between agents: what one carries (pieces, then a trailer), its key, and its two ends.

A stream carries one box from one host to another: `Piece` items (a sub-box and its
bytes, C order), then one `Trailer` (the byte count and XXH3-64 of them all). It is
named by a `StreamKey` (job, step, hop); a push opens with a `PushHeader`. The sending
end is an `Outgoing` (`QueuedOutgoing` feeds a consumer through a bounded queue); a
receiving end lands pieces in a `Sink`, and a passive transport's pushes wait in the
`Mailbox` until the task that takes them runs. `Throttle` caps how fast pieces leave;
`in_thread` runs a stream's consumer (or a send) on a thread of its own.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from reshard.box import Box
from reshard.proto.errors import DeadlineExceededError, FailedPreconditionError
from reshard.server.transport.buffers import host_bytes

if TYPE_CHECKING:
    from reshard.server.transport.session import Session

__all__ = [
    "StreamKey", "PushHeader", "Piece", "Trailer", "IpcRegion", "Segments", "Gather", "Throttle", "Sink", "Outgoing",
    "QueuedOutgoing", "Mailbox", "in_thread", "feed",
]


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
    data: Any  # a C-contiguous bytes-like object, `Segments` (a bucket landed in its members' tiles), or a uint8
    # CUDA tensor (landed in GPU memory: `Transport.lands_on_gpu`)
    wire: Any = None
    landed: str | None = None


class Segments(tuple):
    """Bytes that lie in several buffers: C-contiguous numpy views whose bytes, in order, are a piece's. A
    one-sided transport lands a bucket this way, each member straight in its destination tile
    (`Sink.place` of a whole bucket); nothing copies them into one buffer unless it must."""

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self)

    def packed(self) -> np.ndarray:
        """The bytes in one new buffer (uint8)."""
        return np.concatenate([p.reshape(-1).view(np.uint8) for p in self]) if self else np.empty(0, np.uint8)


class Gather(NamedTuple):
    """A byte box a sender streams from where its bytes lie, not packed: a bucket's members' regions of their
    source tiles (numpy views, strided or not) in order, ``starts`` where each one's bytes begin in the box, and
    its end. A transport that `scatters` sends it (`moves.send`), one chunk of whole members at a time."""

    parts: tuple
    starts: tuple[int, ...]

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[Box, list]]:
        """(byte box, parts) of each chunk: whole members, as many as fit in ``chunk_bytes`` (at least one)."""
        i, k = 0, len(self.parts)
        while i < k:
            j = i + 1
            while j < k and self.starts[j + 1] - self.starts[i] <= chunk_bytes:
                j += 1
            yield ((self.starts[i], self.starts[j]),), list(self.parts[i:j])
            i = j


def feed(check, data) -> None:
    """Add a piece's bytes to a running digest (`Checksum`), ``data`` one buffer or `Segments`."""
    if isinstance(data, Segments):
        for p in data:
            check.update(p)
    else:
        check.update(data)


class Trailer(NamedTuple):
    nbytes: int
    digest: int  # XXH3-64 of all the stream's bytes in order
    device: bool = False  # ``digest`` is the GPU digest (`reshard.proto.devices.DeviceChecksum`): a CUDA IPC stream,
    # or one that landed in GPU memory (`Outgoing.device_digest`)


class IpcRegion(NamedTuple):
    """A piece's bytes where they lie, in the sender's GPU memory: a CUDA IPC handle of the region of its tile
    (`reshard.proto.devices.CudaIpcHandle`, strides included), which a receiver that sees that GPU maps and
    copies device to device (`GrpcTransport.map_ipc`)."""

    handle: Any


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


class Sink(Protocol):
    """Where received boxes land on this host: the job's destination buffers, by device."""

    def write(self, device: str, box: Box, data) -> None:
        """Copy ``data`` (shaped like ``box``) into ``device``'s buffer."""

    def place(self, devices: list[str], box: Box) -> tuple[str, Any] | None:
        """One of ``devices`` whose buffer holds ``box`` contiguously, and that region (a transport may receive
        into it directly), or None. A bucket's sink made for a transport that `scatters` offers its whole byte
        box as `Segments` (its members' regions, in order)."""

    def place_whole(self, devices: list[str], box: Box) -> tuple[str, Any] | None:
        """`place` for a box written in one pass by this host itself, not landed by a transport: a delta stream's
        rebuilt box (`deltas.apply_frame`). A bucket offers its members' tile regions here whatever the transport,
        where its `place` may offer a packed landing buffer; every other sink answers as `place`."""

    def mark(self, device: str, box: Box) -> None:
        """Count ``box`` as arrived in ``device``'s buffer, which a transport received into in place."""

    def digested(self, device: str, box: Box, digest: int) -> None:
        """``box`` arrived in ``device``'s buffer from a stream whose trailer gave its bytes' XXH3-64 ``digest``
        (checked here, or at the chain's last hop before the job commits): a sink whose tile is that box may keep
        it (`store.TileBuffer.digest`); the others ignore it."""


class Outgoing(ABC):
    """One stream to a peer: pieces, then the trailer, then wait for the far end.

    A piece is handed over as bytes (``put``: what a chain hop received, a ring's part) or as
    the region of a source tile that holds it (``put_region``): a one-sided transport writes
    that region from the tile's own memory, run by run, where a stream-shaped one packs it.
    """

    @abstractmethod
    def put(self, box: Box, data, wire=None) -> None:
        """Send sub-box ``box`` as ``data``, its bytes in C order; ``wire`` is the form it arrived in (a chain hop)."""

    def put_region(self, box: Box, view) -> None:
        """Send sub-box ``box`` from ``view``, the region of a source tile that holds it (strided where the tile is
        wider than the box; numpy or torch, any device). This default packs it into host bytes for ``put``."""
        self.put(box, host_bytes(view))

    def put_parts(self, box: Box, parts: list) -> None:
        """Send byte box ``box`` from ``parts``, regions of source tiles (numpy views, strided or not) whose bytes
        in order are the box's: a bucket's members, gathered where they lie (`buckets.Gather`). This default
        packs them into one buffer for ``put``."""
        self.put(box, Segments(np.ascontiguousarray(p) for p in parts).packed())

    def chunk_bytes(self, default: int) -> int:
        """The size of the pieces this stream's box goes in: ``default`` (the transport's), unless its far end
        takes larger ones at no cost (nixl into a mapped shared segment)."""
        return default

    def device_digest(self) -> bool:
        """Whether the far end lands the box in GPU memory and checks it by the GPU digest
        (`reshard.proto.devices.DeviceChecksum`), which the trailer then holds instead of the XXH3-64."""
        return False

    @abstractmethod
    def end(self, nbytes: int, digest: int) -> None:
        """Hand the trailer over (without waiting for the far end)."""

    @abstractmethod
    def wait(self, timeout: float) -> list[str] | None:
        """Wait until the stream is through; the hosts that verified the box, or None where the transport does
        not report them (every receiving host then reports to the planner itself)."""

    def finish(self, nbytes: int, digest: int, timeout: float) -> list[str] | None:
        """`end`, then `wait`: a sender with nothing else to do meanwhile says so, and a transport may then send a
        small stream whole, in one call (gRPC's `_SmallWhole`)."""
        self.end(nbytes, digest)
        return self.wait(timeout)

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

    def offer(self, item) -> None:
        """Queue a `Piece` or `Trailer` as it stands (pieces a buffered stream held before it became this one)."""
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
        self.offer(Piece(box, data, wire))

    def put_ipc(self, box: Box, handle) -> None:
        """Send sub-box ``box`` as a CUDA IPC handle of its region (`IpcRegion`): no byte leaves the GPU."""
        self.offer(Piece(box, IpcRegion(handle)))

    def end(self, nbytes: int, digest: int, device: bool = False) -> None:
        self.offer(Trailer(nbytes, digest, device))

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
