"""An in-memory transport: several agents' runtimes in one process, for unit tests.

Real threads and bounded queues stand in for the network: a stream to a peer is a
queue drained by a thread that calls the peer agent's push handler, as a gRPC Push
would. Bytes are copied when they are put on the queue, so a receiver never sees a
sender's buffer. Everything else (chunk loop, chains, checks, reduce) is the
`Transport` base class, exactly as the real transports run it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

from reshard.proto.errors import UnavailableError
from reshard.server.transport.base import Transport
from reshard.server.transport.session import Session
from reshard.server.transport.streams import (
    Outgoing,
    Piece,
    PushHeader,
    QueuedOutgoing,
    StreamKey,
    Throttle,
    in_thread,
)

__all__ = ["MemoryNetwork", "MemoryTransport"]

Handler = Callable[[PushHeader, Iterable], list]


class MemoryNetwork:
    """The hosts' push handlers by host name: what a stream to a host reaches."""

    def __init__(self):
        self._lock = threading.Lock()
        self._handlers: dict[str, Handler] = {}

    def serve(self, host: str, handler: Handler) -> None:
        with self._lock:
            self._handlers[host] = handler

    def handler(self, host: str) -> Handler:
        with self._lock:
            handler = self._handlers.get(host)
        if handler is None:
            raise UnavailableError(f"no agent of host {host} is on this in-memory network")
        return handler


def _copies(items: Iterable) -> Iterator:
    for item in items:
        yield Piece(item.box, bytes(item.data)) if isinstance(item, Piece) else item


class MemoryTransport(Transport):
    name = "memory"
    passive = True

    def __init__(self, host: str, network: MemoryNetwork, *, chunk_bytes: int = 1 << 16, timeout_s: float = 30.0,
                 depth: int = 4, throttle: Throttle | None = None):
        super().__init__(host, chunk_bytes=chunk_bytes, timeout_s=timeout_s, throttle=throttle)
        self.network = network
        self.depth = depth

    def serve(self, handler: Handler) -> None:
        """Make ``handler`` (the agent runtime's push handler) what streams to this host reach."""
        self.network.serve(self.host, handler)

    def open(self, s: Session, key: StreamKey, peer: str) -> Outgoing:
        handler = self.network.handler(peer)
        header = PushHeader(key.job, s.program_id, key.step, key.hop, self.host)
        return QueuedOutgoing(peer, self.depth, lambda items: in_thread("memory-push", handler, header, _copies(items)))
