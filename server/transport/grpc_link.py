"""The gRPC transport: a stream between agents is one ``Agent.Push`` call.

A sender opens a Push to the peer's agent, whose servicer hands the pieces to its
runtime (pushes arrive by themselves: ``passive``); a chain hop opens the next Push
and forwards every piece as the very message it received (`reshard.proto.frames`
decodes pieces without copying their bytes). The reply lists the hosts that
verified the box, so a broadcast's sender learns that its whole route did. A push
whose peer takes no piece for ``stall_timeout_s`` (a paused or hung agent) is
cancelled and fails its job naming the peer, instead of waiting out its deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc

from reshard.box import Box
from reshard.proto import devices
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import TlsFiles, channel
from reshard.proto.errors import FailedPreconditionError
from reshard.proto.frames import encode_piece, encode_whole
from reshard.proto.status import domain_error
from reshard.proto.wire import box_to_pb, message_size_options
from reshard.server.transport.base import Transport
from reshard.server.transport.session import Session
from reshard.server.transport.streams import (
    IpcRegion,
    Outgoing,
    Piece,
    QueuedOutgoing,
    Segments,
    StreamKey,
    Throttle,
    Trailer,
)

__all__ = ["GrpcTransport", "channel_options", "LocalDevice", "IPC_MAPPINGS_KEPT"]

IPC_MAPPINGS_KEPT = 16  # peer buffers kept mapped by CUDA IPC (each holds its buffer on the sender's GPU)
IPC_MAPPED_BYTES = 64 * 2**30  # and at most this many bytes of them
# and at most this share of the sender's GPU: a sender's tile is a version that its next commit frees, and the
# memory stays taken there while this agent keeps it mapped (a 16 GiB move each way between two agents of an H200
# ran out of its 140 GiB with 64 GiB kept)
IPC_MAPPED_SHARE = 1 / 8


@dataclass(frozen=True)
class LocalDevice:
    """What a peer must share with this agent for CUDA IPC between them: one machine, a GPU both can map."""

    gpu_uuid: str
    machine_id: str
    pid: int


def channel_options(chunk_bytes: int, max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of every agent channel and server: room for a chunk and for the largest message a peer sends."""
    limit = max(chunk_bytes, max_message_bytes)
    return message_size_options(limit, limit)


def _messages(header: bytes, items: Iterable) -> Iterator[bytes]:
    yield header
    for item in items:
        if isinstance(item, Piece):
            if isinstance(item.data, IpcRegion):
                yield pb.PushChunk(ipc_piece=pb.IpcPiece(box=box_to_pb(item.box), source=pb.CudaIpcTensor(
                    **item.data.handle.fields()))).SerializeToString()
                continue
            yield item.wire if isinstance(item.wire, bytes) else encode_piece(item.box, item.data)
        elif isinstance(item, Trailer):
            yield pb.PushChunk(trailer=pb.Trailer(nbytes=item.nbytes, xxh3_64=item.digest,
                                                  device_digest=item.device)).SerializeToString()


class GrpcTransport(Transport):
    name = "grpc"
    passive = True

    def __init__(self, host: str, *, chunk_bytes: int, timeout_s: float, depth: int, max_message_bytes: int,
                 throttle: Throttle | None = None, token: str | None = None, tls: TlsFiles | None = None,
                 stall_timeout_s: float | None = None, cuda_ipc: LocalDevice | None = None):
        super().__init__(host, chunk_bytes=chunk_bytes, timeout_s=timeout_s, throttle=throttle,
                         stall_timeout_s=stall_timeout_s)
        self.depth = depth  # pieces queued per stream before the sender waits
        self._options = channel_options(chunk_bytes, max_message_bytes)
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, object]] = {}
        self._token, self._tls = token, tls  # what every Push presents (reshard.proto.auth)
        self._local = cuda_ipc  # None: this agent's tiles are in host memory, or CUDA IPC is off
        self._peer_devices: dict[str, pb.AgentDevice | None] = {}  # address -> its DescribeDevice, None: no IPC
        self._mapped = devices.IpcMappings(IPC_MAPPINGS_KEPT, IPC_MAPPED_BYTES, IPC_MAPPED_SHARE)  # peer buffers mapped

    def _push_call(self, address: str):
        with self._lock:
            if address not in self._channels:
                ch = channel(address, token=self._token, tls=self._tls, options=self._options)
                # The generated stub's Push, but messages leave already serialised (see reshard.proto.frames).
                self._channels[address] = ch, ch.stream_unary("/reshard.v1.Agent/Push", request_serializer=None,
                                                              response_deserializer=pb.PushReply.FromString)
            return self._channels[address][1]

    def open(self, s: Session, key: StreamKey, peer: str) -> Outgoing:
        address = s.peers.get(peer)
        if not address:
            raise FailedPreconditionError(f"job {s.job}: no address for host {peer}; is its agent registered?")
        call = self._push_call(address)
        header = pb.PushChunk(header=pb.PushHeader(job=key.job, plan_id=s.program_id, transfer=key.step, hop=key.hop,
                                                   from_host=self.host, ticket=s.push_tickets.get(peer, ""))
                              ).SerializeToString()

        def start(items: Iterator):
            future = call.future(_messages(header, items), timeout=self.timeout_s, wait_for_ready=False)
            return _Confirmed(future)

        def error(e: BaseException) -> BaseException:
            if isinstance(e, grpc.RpcError):
                return domain_error(e, f"agent of host {peer} at {address}")
            return e

        def streaming() -> QueuedOutgoing:
            return QueuedOutgoing(peer, self.depth, start, error, stall_s=self.stall_timeout_s, check=s.check)

        return _SmallWhole(s, header, call, self.depth, streaming, error)

    def ipc_to(self, s: Session, peer: str, array) -> bool:
        local = self._local
        if local is None or not devices.is_cuda(array):
            return False
        info = self._describe(s.peers.get(peer, ""))
        return (info is not None and info.machine_id == local.machine_id and info.pid != local.pid
                and local.gpu_uuid in info.visible_gpu_uuids)

    def _describe(self, address: str) -> pb.AgentDevice | None:
        """The peer agent's device, asked once; None where it cannot take CUDA IPC pieces (or did not say)."""
        with self._lock:
            if address in self._peer_devices:
                return self._peer_devices[address]
        info = None
        if address:
            try:
                with channel(address, token=self._token, tls=self._tls, options=self._options) as ch:
                    info = pb_grpc.AgentStub(ch).DescribeDevice(pb.Empty(), timeout=min(self.timeout_s, 10.0))
            except grpc.RpcError:
                info = None  # an older or unreachable agent: its boxes stream as bytes
        with self._lock:
            self._peer_devices[address] = info
        return info

    def map_ipc(self, handle):
        """The tensor ``handle`` names: its buffer's mapping is kept (see the module docstring), so only the first
        piece from a buffer pays CUDA's open."""
        return self._mapped.open(handle)

    def close(self) -> None:
        with self._lock:
            for ch, _ in self._channels.values():
                ch.close()
            self._channels.clear()
            self._mapped.clear()


# A push whose pieces come to no more than this is sent whole, in one call on its sender's thread (`_SmallWhole`).
# Well inside HTTP/2's first flow-control window, so its messages leave whether or not the peer reads them.
SMALL_STREAM_BYTES = 32 << 10


class _SmallWhole(Outgoing):
    """A push held while it stays small (`SMALL_STREAM_BYTES`, ``depth`` pieces) and, where its sender `finish`es
    it, sent whole in one blocking call on the sender's own thread, as one message (``PushChunk.whole``: a stream
    pays a hand-off between threads for each message at both ends). Otherwise it becomes the `QueuedOutgoing` that
    ``streaming`` makes, fed with what was held: as soon as it outgrows that (a CUDA IPC piece at once: the peer
    maps it while the sender digests the region), or at `end`, whose sender goes on meanwhile (a ring's member
    sends its rounds' messages, then receives, and only then waits for its sends).

    Why: a streaming call starts two threads of gRPC's (the channel's poller and the request reader), which cost a
    small job's sender more than everything else it did. The whole call needs the reader only. The call cannot
    be polled for the job's failure as a queued stream's wait does, so the session cancels it (`Session.watch`):
    its request iterator, which stays open until the answer comes, raises, and gRPC cancels the call."""

    def __init__(self, s: Session, header: bytes, call, depth: int, streaming: Callable[[], QueuedOutgoing],
                 error: Callable[[BaseException], BaseException]):
        self._s, self._header, self._call, self._depth = s, header, call, max(1, depth)
        self._streaming, self._error = streaming, error
        self._held: list = []
        self._nbytes = 0
        self._queued: QueuedOutgoing | None = None
        self._over = threading.Event()  # the call was answered, or is to be cancelled (`_cancelled`)
        self._cancelled = False

    def _stream(self) -> QueuedOutgoing:
        if self._queued is None:
            self._queued = self._streaming()
            held, self._held = self._held, []
            for item in held:
                self._queued.offer(item)
        return self._queued

    def put(self, box: Box, data, wire=None) -> None:
        if self._queued is None:
            self._nbytes += data.nbytes if isinstance(data, Segments) else memoryview(data).nbytes
            if self._nbytes <= SMALL_STREAM_BYTES and len(self._held) < self._depth:
                self._held.append(Piece(box, data, wire))
                return
        self._stream().put(box, data, wire)

    def put_ipc(self, box: Box, handle) -> None:
        self._stream().put_ipc(box, handle)

    def end(self, nbytes: int, digest: int, device: bool = False) -> None:
        self._stream().end(nbytes, digest, device)

    def wait(self, timeout: float) -> list[str] | None:
        return self._stream().wait(timeout)

    def finish(self, nbytes: int, digest: int, timeout: float) -> list[str] | None:
        if self._queued is not None:
            return super().finish(nbytes, digest, timeout)
        held, self._held = [*self._held, Trailer(nbytes, digest, False)], []

        def messages() -> Iterator[bytes]:
            yield encode_whole(list(_messages(self._header, held)))
            self._over.wait()  # open until answered: the only way to cancel a blocking call is from in here
            if self._cancelled:
                raise _Cancelled("the job failed while its push waited for the peer's answer")

        self._s.watch(self.cancel)
        try:
            self._s.check()
            return list(self._call(messages(), timeout=timeout, wait_for_ready=False).confirmed)
        except grpc.RpcError as e:
            self._s.check()  # cancelled because the job failed: that failure is what counts
            raise self._error(e) from None
        finally:
            self._s.unwatch(self.cancel)
            self._over.set()

    def cancel(self) -> None:
        if self._queued is not None:
            self._queued.cancel()
            return
        self._cancelled = True
        self._over.set()


class _Cancelled(Exception):
    """Raised in a whole push's request iterator to make gRPC cancel the call (`_SmallWhole`)."""


class _QuietCancel(logging.Filter):
    """gRPC logs every exception its request reader meets, with a traceback ("Exception iterating requests!"); a
    `_Cancelled` is how a whole push is cancelled on purpose (its job failed elsewhere, which is logged there), so
    its record is dropped. Every other exception is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Cancelled))


logging.getLogger("grpc._channel").addFilter(_QuietCancel())


class _Confirmed:
    """A Push call's future, answering with the hosts its reply confirms."""

    def __init__(self, future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[str]:
        return list(self._future.result(timeout=timeout).confirmed)

    def cancel(self) -> bool:
        return self._future.cancel()
