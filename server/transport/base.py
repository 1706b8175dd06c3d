"""The transport interface: how a transport carries a stream's bytes between the agents of a job's hosts.

A transport moves boxes of a tensor between the agents of a job's hosts. Each one
(`grpc_link.GrpcTransport`, `collective.CollectiveTransport`, `memory.MemoryTransport`)
implements the primitives of the first table, and inherits from `Transport` the second:
what moving a box means, written once for every transport in the modules beside this one.

================= ==========================================================================
``open``          an `Outgoing` stream of pieces to a peer host under a `StreamKey`: each piece
                  as bytes, or as its region of a source tile (``put_region``), which a
                  one-sided transport writes from in place and the others pack
``arrivals``      (active transports) post the receives of a stream and yield its pieces;
                  passive ones (``passive = True``: gRPC, memory) have pushes arrive by
                  themselves, and the agent hands their pieces to ``take``
``serve``         where pushes to this host go (the agent's push handler)
``attach``        a job starts on this host (the collective transport checks its group)
``handshake``     before the first call with some peers (the collective transport confirms
                  that they run the same program on the same group generation)
``all_reduce``    (optional) a replicated reduce as the backend's own all-reduce; False: the ring
``ipc_to``        (optional) whether a box of a CUDA tile goes to a peer as a CUDA IPC handle
                  of its region (the gRPC transport between agents on one machine's GPUs),
                  which the peer maps (``map_ipc``) and copies device to device
================= ==========================================================================

================= ==========================================================================
``move``          a transfer's sender part: copies on this host, then its own hops (`moves`,
                  along the hops of ``reshard.routes``)
``take``          one receiving hop of a transfer, forwarded down the chain and checked
``send``          a stream's chunk loop (`moves`)
``relay``         a stream's receiving loop: forward, write, check the trailer (`moves`)
``reduce``        a box summed (or maxed) over an ordered group of devices: a ring of streams
                  (`reduce`), or the backend's own ``all_reduce`` where it has one
``incoming``      a stream a running task takes (a ring's message): from the mailbox where
                  the agent left the push (passive transports), or ``arrivals``
================= ==========================================================================

What a stream carries and its ends are `streams`; a job as a transport sees it is
`session.Session`. Tile buffers are touched only through
`reshard.server.transport.buffers`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import numpy as np

from reshard.box import Box
from reshard.plans import Transfer
from reshard.proto.errors import FailedPreconditionError
from reshard.proto.layout import Checksum
from reshard.server.transport import moves
from reshard.server.transport import reduce as ring
from reshard.server.transport.buffers import Recycler
from reshard.server.transport.reduce import SCRATCH_KEPT_BYTES
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Mailbox, Outgoing, PushHeader, Sink, StreamKey, Throttle

__all__ = ["Transport"]


class Transport(ABC):
    """Moves boxes between agents (see the module docstring); one instance per agent and kind."""

    name = ""
    passive = True  # pushes arrive by themselves; False: the receiver posts its receives (`arrivals`)
    # A bucket travels gathered from its members' source regions (`streams.Gather`, ``Outgoing.put_parts``) and
    # lands in their destination tiles (`streams.Segments`), with no packed copy at either end; False: packed
    scatters = False
    lanes = 0  # active transports: how many of a job's tasks may run at once
    # A box bound for a region of a GPU tile is received into GPU memory (`Sink.place_device` offers it to
    # ``arrivals``' ``place``); False: such a box lands in host memory and is copied to the GPU
    lands_on_gpu = False

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

    @contextmanager
    def incoming(self, s: Session, key: StreamKey, peer: str, box: Box,
                 place: Callable[[Box], tuple[str, Any] | None]) -> Iterator[Iterable]:
        """The pieces, then the trailer, of stream ``key`` that a running task takes (a reduce's messages): from the
        mailbox, where the agent left the push (passive transports), or received now (`arrivals`)."""
        if self.passive:
            with self.mailbox.take(key, self.timeout_s, s) as items:
                yield items
        else:
            yield self.arrivals(s, key, peer, box, place)

    def serve(self, handler: Callable[[PushHeader, Iterable], list[str] | None]) -> None:
        """Where pushes to this host go (the agent runtime's ``accept``), for transports that deliver them
        themselves; the gRPC transport's pushes reach the agent's servicer instead."""

    def attach(self, s: Session) -> None:
        """A job starts on this host (prepare)."""

    def detach(self, s: Session) -> None:
        """A job ended on this host (commit or abort)."""

    def handshake(self, s: Session, peers: set[str]) -> None:
        """Before the first call with ``peers`` in a job."""

    def digest_ahead(self, view) -> bool:
        """Whether the XXH3-64 of ``view``, a region of a held host tile this host will send, is worth a pass of
        its own as the job is prepared (`Runtime._digest_sources`) rather than over its chunks as they are sent
        (`moves.send`). Not where the send packs it into a copy chunk by chunk (the default `Outgoing.put_region`
        packs every strided region): the digest then rides on those copies, and a pass ahead would copy the box
        once more."""
        return not (isinstance(view, np.ndarray) and not view.flags.c_contiguous)

    # Whether `prepost` posts anything: only a transport whose receivers post their regions (nixl)
    preposts = False

    def prepost(self, s: Session, key: StreamKey, peer: str, box: Box, place) -> bool:
        """Post incoming stream ``key`` now, for `arrivals` to find when a lane takes it (`moves.prepost`); whether
        it was (never, where `preposts` is False)."""
        return False

    def all_reduce(self, s: Session, step: int, group: tuple[str, ...], box: Box, op: str,
                   read: Callable[[str], Any], produce: Callable[[str, Box], tuple[Any, Box]]) -> bool:
        """This host's part of a replicated `reduce` as the backend's own all-reduce, where the transport has
        one and every member takes it this time; False: run `reduce`'s ring (what every member then does)."""
        return False

    def close(self) -> None:
        """Release connections (the agent stops)."""

    def ipc_to(self, s: Session, peer: str, array) -> bool:
        """Whether ``array``'s boxes go to ``peer`` as CUDA IPC handles (`moves.send_ipc`); no by default."""
        return False

    def map_ipc(self, handle):
        """The CUDA tensor a peer's IPC handle names, mapped into this process."""
        raise FailedPreconditionError(f"the {self.name} transport of host {self.host} takes no CUDA IPC pieces")

    # -- what moving a box means, written once for every transport (each calls the others through these) -----

    def send(self, s: Session, key: StreamKey, peer: str, array, origin: Box, box: Box,
             digest: Future | None = None, origin_bytes: bool = True) -> list[str] | None:
        """Stream ``box`` of ``array`` (which holds ``origin``) to ``peer``; returns who verified it (`moves.send`)."""
        return moves.send(self, s, key, peer, array, origin, box, digest, origin_bytes)

    def relay(self, s: Session, key: StreamKey, peer: str, box: Box, items: Iterable, sink: Sink,
              local: list[str], forward_to: str | None,
              verify: Callable[[Checksum, int, int], None]) -> list[str] | None:
        """Take one incoming stream, forwarding it to ``forward_to``; returns who verified the box (`moves.relay`)."""
        return moves.relay(self, s, key, peer, box, items, sink, local, forward_to, verify)

    def move(self, s: Session, step: int, t: Transfer, sink: Sink, array, origin: Box,
             digest: Future | None = None) -> None:
        """The sender's part of transfer ``t`` (step ``step``), from ``array`` holding ``origin`` (`moves.move`)."""
        moves.move(self, s, step, t, sink, array, origin, digest)

    def take(self, s: Session, step: int, t: Transfer, hop: int, sink: Sink,
             items: Iterable | None = None) -> list[str] | None:
        """Hop ``hop`` of transfer ``t`` arriving here; returns who verified the box (`moves.take`)."""
        return moves.take(self, s, step, t, hop, sink, items)

    def reduce(self, s: Session, step: int, group: tuple[str, ...], box: Box, op: str, result: str,
               dim: int | None, read: Callable[[str], Any], produce: Callable[[str, Box], tuple[Any, Box]]) -> None:
        """This host's part of a reduce of ``box`` over the devices ``group``: `all_reduce` where it runs one,
        else the ring (`reduce.reduce`)."""
        ring.reduce(self, s, step, group, box, op, result, dim, read, produce)

    def ring_reduce(self, s: Session, step: int, group: tuple[str, ...], box: Box, op: str, result: str,
                    dim: int | None, read: Callable[[str], Any],
                    produce: Callable[[str, Box], tuple[Any, Box]]) -> None:
        """`reduce` as the ring of tagged streams (`reduce.ring_reduce`)."""
        ring.ring_reduce(self, s, step, group, box, op, result, dim, read, produce)
