"""A replayed upload with real processes (issue 37): an agent never commits over a committed version.

An agent remembers the last few thousand transactions that ended (`reshard.server.agent.store`), and the planner's
tickets carry no nonce: whoever holds the cluster token and reads one host's traffic (no TLS) can send a `put`'s
PutShard and Commit again once the agent has forgotten the upload. host1's agent is reached through a tap, a gRPC
proxy in this process that forwards every call byte for byte and keeps a copy, as a reader of the wire would; the
planner, both agents and the client are real processes and channels.
"""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto.auth import channel
from reshard.proto.layout import tile_shape
from reshard.proto.wire import box_from_pb, shard_stream, unbatched

SERVICE = pb.DESCRIPTOR.services_by_name["Agent"]
ENDED = 4_200  # transactions that end on host1 after the captured put: more than the 4,096 an agent remembers
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class Tap:
    """A gRPC proxy for the Agent service: forwards every call to ``upstream`` untouched (the caller's token
    included) and keeps each call's request messages as bytes, by method."""

    def __init__(self, upstream: str):
        self.calls: list[tuple[str, list[bytes]]] = []
        self._channel = grpc.insecure_channel(upstream, options=UNLIMITED)
        self.server = grpc.server(futures.ThreadPoolExecutor(16), options=UNLIMITED)
        handlers = {m.name: self._handler(m) for m in SERVICE.methods}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _handler(self, method):
        path = f"/{SERVICE.full_name}/{method.name}"
        kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming
                                                                           else "unary")
        upstream = getattr(self._channel, kind)(path)  # no (de)serializers: bytes pass through

        def call(request, context):
            kept: list[bytes] = []
            self.calls.append((method.name, kept))
            if method.client_streaming:
                request = (kept.append(msg) or msg for msg in request)
            else:
                kept.append(request)
            return upstream(request, metadata=[(k, v) for k, v in context.invocation_metadata()
                                               if k == "authorization"])

        def unary(request, context):
            try:
                return call(request, context)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        def streaming(request, context):
            try:
                yield from call(request, context)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        return getattr(grpc, f"{kind}_rpc_method_handler")(streaming if method.server_streaming else unary)

    def requests(self, method: str, cls) -> list[list]:
        """The request messages of every ``method`` call so far, parsed as ``cls``."""
        return [[cls.FromString(b) for b in kept] for name, kept in self.calls if name == method]

    def close(self) -> None:
        self.server.stop(0)
        self._channel.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tapped(tmp_path_factory):
    """A cluster of host0 and host1 (2 devices each, gRPC), host1's agent reached through a `Tap`."""
    agent_port = _free_port()
    tap = Tap(f"127.0.0.1:{agent_port}")
    try:
        with LocalCluster(1, 2, transport="grpc", log_dir=str(tmp_path_factory.mktemp("replay"))) as cluster:
            cluster.start_agent("host1", extra_args=["--listen", f"127.0.0.1:{agent_port}",
                                                     "--advertise", f"127.0.0.1:{tap.port}"])
            yield cluster, tap, f"127.0.0.1:{agent_port}"
    finally:
        tap.close()


def test_a_replayed_upload_cannot_overwrite_a_committed_version(tapped):
    cluster, tap, agent_address = tapped
    two_hosts = Sharding(Mesh.from_hosts({"x": 4}, ["host0", "host1"], 2), ("x",))
    on_host1 = Sharding(Mesh.from_hosts({"x": 1}, ["host1"], 1), (None,))
    original = np.arange(64, dtype=np.float32) + 1
    with cluster.connect() as c:
        c.put("T", original, two_hosts)
        # small shards go whole, several to a message (`shard_streams`): read as the header, piece and trailer each is
        shards = [msgs for msgs in (list(unbatched(m)) for m in tap.requests("PutShard", pb.ShardChunk))
                  if msgs[0].header.tensor == "T"]
        commits = [m for [m] in tap.requests("Commit", pb.StagingRequest) if m.tensor == "T"]
        assert len(shards) == 1 and len(commits) == 1 and commits[0].version == 1
        headers = [m.header for m in shards[0] if m.WhichOneof("kind") == "header"]
        assert sorted(h.device for h in headers) == ["host1/0", "host1/1"]

        # Cheap transactions, each ending on host1: a put_many of one-element tensors is one upload per tensor.
        c.put_many({f"small{i}": (np.zeros(1, np.float32), on_host1) for i in range(ENDED)})

        # The replay, straight to host1's agent with the cluster token: the captured headers (and tickets), with
        # every piece zeroed and the trailer made to match, then the captured Commit, byte for byte.
        ch = channel(agent_address, token=cluster.token, options=UNLIMITED)
        try:
            zeroed = [chunk.SerializeToString() for h in headers for chunk in
                      shard_stream(np.zeros(tile_shape(box_from_pb(h.box)), np.float32), h, 1 << 20)]
            reply = pb.PutShardReply.FromString(ch.stream_unary(f"/{SERVICE.full_name}/PutShard")(iter(zeroed)))
            assert reply.nbytes == original.nbytes // 2  # the agent cannot tell: the upload is long forgotten
            with pytest.raises(grpc.RpcError) as refused:
                ch.unary_unary(f"/{SERVICE.full_name}/Commit")(commits[0].SerializeToString())
        finally:
            ch.close()
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert refused.value.details().startswith(
            "cannot commit 'T' v1 for devices ['host1/0', 'host1/1']: host host1 holds that version already, and a "
            "committed version is never written over")
        np.testing.assert_array_equal(c.get("T"), original)
        assert c.info("T").version == 1
