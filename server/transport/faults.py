"""Fault injection as transport wrappers: tests wrap a transport, the production loops have no fault branch.

==================== ===================================================================
``CorruptRelay``     a chain hop that forwards flips bit ``1 << (hop % 8)`` of the first
                     byte of the first piece it receives, in what it keeps and what it
                     forwards (the agent's hidden ``--fault corrupt-relay``)
``Stall``            every move this host sends starts ``seconds`` late; records when
                     each one ran (unit tests measure overlap and deadlines with it)
``Fail``             the moves of chosen steps fail on this host
``DeltaBaseDiffers`` this host's copy of every delta base it applies to differs from the
                     sender's in one bit (the receiver's ``DELTA_BASE_MISMATCH``)
``CorruptFrame``     the first payload piece of every delta frame this host sends has one
                     bit flipped on the wire, after the trailer's digest was taken
==================== ===================================================================
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np

from reshard.box import Box
from reshard.proto.errors import UnavailableError
from reshard.server.transport.base import Transport
from reshard.server.transport.deltas import HEAD
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Piece, Segments, StreamKey

__all__ = ["Wrapped", "CorruptRelay", "Stall", "Fail", "DeltaBaseDiffers", "CorruptFrame", "corrupt_bit", "FAULTS",
           "wrap"]


def corrupt_bit(hop: int) -> int:
    """The bit of its first byte that chain hop ``hop`` flips under ``CorruptRelay`` (one per hop, so two
    relaying hops never undo each other)."""
    return 1 << (hop % 8)


class Wrapped(Transport):
    """A transport whose primitives are ``inner``'s while the semantics (the `Transport` methods) run here,
    so a subclass changes one behaviour and keeps the rest."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.name, self.passive, self.lanes, self.scatters = inner.name, inner.passive, inner.lanes, inner.scatters
        self.lands_on_gpu, self.preposts = inner.lands_on_gpu, inner.preposts
        self.host, self.chunk_bytes, self.timeout_s = inner.host, inner.chunk_bytes, inner.timeout_s
        self.throttle, self.mailbox, self.scratch = inner.throttle, inner.mailbox, inner.scratch

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # what only the inner transport has (the collective's group member)

    def open(self, s, key, peer):
        return self.inner.open(s, key, peer)

    def arrivals(self, s, key, peer, box, place):
        return self.inner.arrivals(s, key, peer, box, place)

    def serve(self, handler) -> None:
        self.inner.serve(handler)

    def attach(self, s) -> None:
        self.inner.attach(s)

    def detach(self, s) -> None:
        self.inner.detach(s)

    def handshake(self, s, peers) -> None:
        self.inner.handshake(s, peers)

    def all_reduce(self, s, step, group, box, op, read, produce) -> bool:
        return self.inner.all_reduce(s, step, group, box, op, read, produce)

    def digest_ahead(self, view) -> bool:
        return self.inner.digest_ahead(view)

    def prepost(self, s, key, peer, box, place) -> bool:
        return self.inner.prepost(s, key, peer, box, place)

    def close(self) -> None:
        self.inner.close()


def _corrupt_first(items: Iterable, hop: int) -> Iterator:
    pending = True
    for item in items:
        data = item.data[0] if isinstance(item, Piece) and isinstance(item.data, Segments) else \
            item.data if isinstance(item, Piece) else None
        if pending and data is not None and memoryview(data).nbytes:
            pending = False
            view = memoryview(data).cast("B")
            if view.readonly:  # bytes as received (gRPC): change a copy, kept and forwarded
                out = bytearray(view)
                out[0] ^= corrupt_bit(hop)
                item = Piece(item.box, memoryview(out))
            else:  # received in place (collective): the kept buffer is what is forwarded
                view[0] ^= corrupt_bit(hop)
        yield item


class CorruptRelay(Wrapped):
    def relay(self, s: Session, key: StreamKey, peer: str, box: Box, items: Iterable, sink, local,
              forward_to, verify):
        if forward_to:
            items = _corrupt_first(items, key.hop)
        return super().relay(s, key, peer, box, items, sink, local, forward_to, verify)


class Stall(Wrapped):
    """Every move sent from this host waits ``seconds`` first (giving way at once if the job fails)."""

    def __init__(self, inner: Transport, seconds: float):
        super().__init__(inner)
        self.seconds = seconds
        self._lock = threading.Lock()
        self.intervals: dict[tuple[str, int], tuple[float, float]] = {}  # (job, step) -> (start, end), monotonic

    def move(self, s: Session, step: int, *args, **kwargs) -> None:
        start = time.monotonic()
        while time.monotonic() < start + self.seconds:
            s.check()
            time.sleep(min(0.01, self.seconds))
        super().move(s, step, *args, **kwargs)
        with self._lock:
            self.intervals[s.job, step] = (start, time.monotonic())


class Fail(Wrapped):
    """The moves of ``steps`` fail on this host with `UnavailableError`."""

    def __init__(self, inner: Transport, steps: Iterable[int]):
        super().__init__(inner)
        self.steps = frozenset(steps)

    def move(self, s: Session, step: int, *args, **kwargs) -> None:
        if step in self.steps:
            raise UnavailableError(f"job {s.job}: step {step} failed on host {self.host} (injected by the test)")
        super().move(s, step, *args, **kwargs)


def _flipped(base):
    """A copy of ``base`` (packed bytes, or None) with the lowest bit of its first byte flipped."""
    if base is None or not len(base):
        return base
    out = np.array(base, dtype=np.uint8)
    out[0] ^= 1
    return out


class DeltaBaseDiffers(Wrapped):
    """As a job is prepared here, every delta stream's receiving base reads one bit off (`deltas.DeltaStream`): the
    receiver's copy of the version it applies to differs from the sender's, as after a lost or stale base."""

    def attach(self, s: Session) -> None:
        super().attach(s)
        for step, d in list(s.deltas.items()):
            s.deltas[step] = dataclasses.replace(
                d, receiver_base=lambda device, k, read=d.receiver_base: _flipped(read(device, k)))


class _FlipOnce:
    """An `Outgoing` whose first piece past a delta frame's head goes with one bit flipped."""

    def __init__(self, inner):
        self._inner = inner
        self._pending = True

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def put(self, box, data, wire=None) -> None:
        if self._pending and box[0][0] >= HEAD.size:
            self._pending = False
            data = _flipped(np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8))
            wire = None
        self._inner.put(box, data, wire)


class CorruptFrame(Wrapped):
    """Delta frames this host sends arrive with one bit flipped (`_FlipOnce`); full streams go as they are."""

    def open(self, s: Session, key: StreamKey, peer: str):
        out = self.inner.open(s, key, peer)
        return _FlipOnce(out) if s.delta(key.step) is not None else out


FAULTS = {"corrupt-relay": CorruptRelay, "delta-base-differs": DeltaBaseDiffers}


def wrap(transport: Transport, fault: str) -> Transport:
    """``transport`` under the agent's ``--fault`` (``''``: as it is)."""
    return FAULTS[fault](transport) if fault else transport
