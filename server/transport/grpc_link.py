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

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc

from reshard.proto import devices
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import TlsFiles, channel
from reshard.proto.errors import FailedPreconditionError
from reshard.proto.frames import encode_piece
from reshard.proto.status import domain_error
from reshard.proto.wire import box_to_pb, message_size_options
from reshard.server.transport.base import Transport
from reshard.server.transport.session import Session
from reshard.server.transport.streams import (
    IpcRegion,
    Outgoing,
    Piece,
    QueuedOutgoing,
    StreamKey,
    Throttle,
    Trailer,
)

__all__ = ["GrpcTransport", "channel_options", "LocalDevice", "IPC_MAPPINGS_KEPT"]

IPC_MAPPINGS_KEPT = 16  # peer buffers kept mapped by CUDA IPC (each holds its buffer on the sender's GPU)
IPC_MAPPED_BYTES = 64 * 2**30  # and at most this many bytes of them


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
        self._mapped = devices.IpcMappings(IPC_MAPPINGS_KEPT, IPC_MAPPED_BYTES)  # peer buffers mapped here

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

        return QueuedOutgoing(peer, self.depth, start, error, stall_s=self.stall_timeout_s, check=s.check)

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
