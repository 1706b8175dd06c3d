"""Who may call what, probed from outside with raw calls built from the project's own stubs (issue 11).

Every RPC of both services refuses a call without the cluster token or with a
wrong one; agent calls that change memory or run work need the planner's ticket
for exactly that call; a live host's name cannot be registered again; and the
whole path runs over mutual TLS with certificates from ``reshard certs``. After
every refusal the stored tensor is bit-exact and at its version.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from google.protobuf import message_factory

from reshard import Mesh, Sharding
from reshard.client import UnavailableError
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import TlsFiles, channel
from reshard.proto.wire import shard_stream
from reshard.server.common.auth import is_loopback_listen, is_loopback_peer
from reshard.server.common.tickets import new_secret, put_fields, sign

KEPT = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
SRC = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", "y"))


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, 2, transport="grpc", planner_args=["--heartbeat-timeout", "3"]) as cluster:
        with cluster.connect() as c:
            c.put("kept", KEPT, SRC)
        yield cluster


@pytest.fixture
def client(cluster):
    with cluster.connect() as c:
        yield c
        # Whatever was refused, the stored tensor is as it was put.
        assert c.info("kept").version == 1
        assert np.array_equal(c.get("kept"), KEPT)


def _methods(service: str):
    for m in pb.DESCRIPTOR.services_by_name[service].methods:
        yield m.name, m.client_streaming, m.server_streaming, message_factory.GetMessageClass(m.input_type)


ALL = [(s, *m) for s in ("Planner", "Agent") for m in _methods(s)]


def _call(ch: grpc.Channel, service: str, name: str, client_streaming: bool, server_streaming: bool, request):
    """The status code of one call (OK when it succeeded), and its details."""
    path = f"/reshard.v1.{service}/{name}"
    kinds = {(False, False): ch.unary_unary, (False, True): ch.unary_stream, (True, False): ch.stream_unary}
    call = kinds[client_streaming, server_streaming](path, request_serializer=lambda m: m.SerializeToString(),
                                                     response_deserializer=None)
    try:
        reply = call(iter([request]) if client_streaming else request, timeout=10)
        if server_streaming:
            list(reply)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _address(cluster, service):
    return cluster.address if service == "Planner" else cluster.agent_addresses["host0"]


@pytest.mark.parametrize("token", [None, "wrong-token-of-24-chars!"], ids=["no-token", "wrong-token"])
def test_every_rpc_of_both_services_refuses_a_call_without_the_cluster_token(cluster, client, token):
    for service, name, cs, ss, request_class in ALL:
        with channel(_address(cluster, service), token=token) as ch:
            code, details = _call(ch, service, name, cs, ss, request_class())
        assert code == grpc.StatusCode.UNAUTHENTICATED, (service, name, code, details)
        assert "token" in details, details


def test_every_rpc_with_the_token_reaches_its_servicer(cluster, client):
    for service, name, cs, ss, request_class in ALL:
        with channel(_address(cluster, service), token=cluster.token) as ch:
            code, details = _call(ch, service, name, cs, ss, request_class())
        assert code != grpc.StatusCode.UNAUTHENTICATED, (service, name, details)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (service, name, details)


def _kept_header(client, device: str, ticket: str = "", upload: str = "invented") -> pb.ShardHeader:
    loc = next(p for p in client._tensor("kept").locations if p.device == device)
    return pb.ShardHeader(upload_id=upload, tensor="kept", device=device, dtype="float32", box=loc.box, ticket=ticket)


def _agent(cluster) -> pb_grpc.AgentStub:
    return pb_grpc.AgentStub(channel(cluster.agent_addresses["host0"], token=cluster.token))


def test_zero_overwrite_through_an_invented_upload_is_refused(cluster, client):
    """The probe that found it: PutShard under an invented transaction, then Commit, replaced a committed tile
    with zeros while the catalog and version stayed the same."""
    agent = _agent(cluster)
    header = _kept_header(client, "host0/0")
    zeros = np.zeros((8, 3), np.float32)
    with pytest.raises(grpc.RpcError) as put:
        agent.PutShard(shard_stream(zeros, header, 1 << 20), timeout=10)
    assert put.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "carries no ticket" in put.value.details()
    with pytest.raises(grpc.RpcError) as commit:
        agent.Commit(pb.StagingRequest(upload_id="invented", tensor="kept", version=1, devices=["host0/0"]), timeout=10)
    assert commit.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_agent_calls_without_the_planners_ticket_change_nothing(cluster, client):
    agent = _agent(cluster)
    digests = client.digests("kept")
    forged = sign(new_secret(), "release", "kept", 1)  # well formed, but not under the host's secret
    refused = {
        "Release": lambda t: agent.Release(pb.ReleaseRequest(tensor="kept", version=1, ticket=t), timeout=10),
        "Abort": lambda t: agent.Abort(pb.StagingRequest(job_id="j", ticket=t), timeout=10),
        "Commit": lambda t: agent.Commit(pb.StagingRequest(job_id="j", tensor="kept", version=2, ticket=t),
                                         timeout=10),
        "Prepare": lambda t: agent.Prepare(pb.PrepareRequest(job="j", program_json="{}", tensor="kept",
                                                             src_version=1, dst_version=2, ticket=t), timeout=10),
        "Execute": lambda t: list(agent.Execute(pb.ExecuteRequest(job="j", program_id="p", ticket=t), timeout=10)),
        "Push": lambda t: agent.Push(iter([pb.PushChunk(header=pb.PushHeader(job="j", plan_id="p", ticket=t))]),
                                     timeout=10),
        "PutShard": lambda t: agent.PutShard(shard_stream(np.zeros((8, 3), np.float32),
                                                          _kept_header(client, "host0/0", t), 1 << 20), timeout=10),
        "PutShardIpc": lambda t: agent.PutShardIpc(pb.IpcPutShardRequest(header=_kept_header(client, "host0/0", t)),
                                                   timeout=10),
    }
    for name, call in refused.items():
        for ticket in ("", forged):
            with pytest.raises(grpc.RpcError) as e:
                call(ticket)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, ticket, e.value.details())
            assert "ticket" in e.value.details()
    assert client.digests("kept") == digests


def test_an_upload_ticket_is_good_for_its_own_device_only(cluster, client):
    planner = pb_grpc.PlannerStub(channel(cluster.address, token=cluster.token))
    one = Sharding(Mesh.from_hosts({"x": 2}, ["host0"], 2), ("x",))
    reply = planner.BeginUpload(pb.BeginUploadRequest(name="replayed", shape=[4], dtype="float32",
                                                      sharding_json=json.dumps(one.to_json()), kind="numpy"),
                                timeout=10)
    first, second = reply.locations
    # The first device's ticket, presented for the second device's tile, is refused.
    header = pb.ShardHeader(upload_id=reply.upload_id, tensor="replayed", device=second.device, dtype="float32",
                            box=second.box, ticket=first.ticket)
    with pytest.raises(grpc.RpcError) as e:
        _agent(cluster).PutShard(shard_stream(np.zeros(2, np.float32), header, 1 << 20), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "did not issue" in e.value.details()
    # The ticket the planner gave for it works; the upload completes with the right tickets.
    for loc, part in zip(reply.locations, (np.ones(2, np.float32), np.full(2, 2, np.float32))):
        h = pb.ShardHeader(upload_id=reply.upload_id, tensor="replayed", device=loc.device, dtype="float32",
                           box=loc.box, ticket=loc.ticket)
        _agent(cluster).PutShard(shard_stream(part, h, 1 << 20), timeout=10)
    planner.FinishUpload(pb.FinishUploadRequest(upload_id=reply.upload_id,
                                                devices=[p.device for p in reply.locations]), timeout=10)
    assert client.get("replayed").tolist() == [1, 1, 2, 2]
    client.delete("replayed")


def test_a_live_hosts_name_cannot_be_registered_again(cluster, client):
    planner = pb_grpc.PlannerStub(channel(cluster.address, token=cluster.token))
    with pytest.raises(grpc.RpcError) as e:
        planner.Register(pb.RegisterRequest(host="host0", num_devices=2, address="127.0.0.1:9", secret=new_secret()),
                         timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "registered by another live agent" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        planner.Heartbeat(pb.HeartbeatRequest(host="host0", address=cluster.agent_addresses["host0"],
                                              proof=sign(new_secret(), "heartbeat", "host0", "x")), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    agents = {a["host"]: a for a in client.agents()}
    assert agents["host0"]["address"] == cluster.agent_addresses["host0"] and agents["host0"]["up"]
    # The cluster still works: a reshard through host0 runs.
    dst = Sharding(Mesh.from_hosts({"x": 2}, ["host1"], 2), (None, "x"))
    client.reshard("kept", dst).result(timeout=60)
    assert np.array_equal(client.get("kept"), KEPT)
    client.reshard("kept", SRC).result(timeout=60)
    assert client.info("kept").version == 3
    client.delete("kept")
    client.put("kept", KEPT, SRC)  # the fixture's check expects version 1


def test_a_name_taken_while_its_agent_was_paused_goes_back_to_it_with_its_data(cluster, client):
    """A registrant takes host1's name while its agent is paused (it is down): the catalog marks host1's shards
    lost, since the registrant holds none. Resumed, the real agent is refused at its next heartbeat, registers
    again once the registrant is down in turn, says what it holds, and its shards are found again."""
    agent = cluster.agents["host1"]
    agent.send_signal(signal.SIGSTOP)
    try:
        _wait(lambda: not {a["host"]: a for a in client.agents()}["host1"]["up"], "host1 to be marked down")
        planner = pb_grpc.PlannerStub(channel(cluster.address, token=cluster.token))
        planner.Register(pb.RegisterRequest(host="host1", num_devices=2, address=cluster.agent_addresses["host1"],
                                            secret=new_secret()), timeout=10)
        assert client.info("kept").lost
    finally:
        agent.send_signal(signal.SIGCONT)
    _wait(lambda: not client.info("kept").lost, "host1's agent to register again with what it holds")
    cluster.wait_ready()


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_mutual_tls_with_reshard_certs(tmp_path):
    out = tmp_path / "certs"
    subprocess.run([sys.executable, "-m", "reshard.server.cli", "certs", "--out", str(out), "--names", "node"],
                   check=True, capture_output=True, timeout=60)
    tls = TlsFiles(str(out / "node.pem"), str(out / "node-key.pem"), str(out / "ca.pem"))
    with LocalCluster(2, 1, transport="grpc", tls=tls) as cluster, cluster.connect() as c:
        one = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None,))
        other = Sharding(Mesh.from_hosts({"x": 1}, ["host1"], 1), (None,))
        c.put("t", KEPT, one)
        c.reshard("t", other).result(timeout=60)  # planner -> agents and agent -> agent, all over TLS
        assert np.array_equal(c.get("t"), KEPT)
        with cluster.connect(tls=None, timeout=3) as plain:
            with pytest.raises(UnavailableError):
                plain.tensors()
        # A client that trusts the CA but has no certificate of its own is refused: the TLS is mutual.
        with cluster.connect(tls=TlsFiles(ca=str(out / "ca.pem")), timeout=3) as anonymous:
            with pytest.raises(UnavailableError):
                anonymous.tensors()


@pytest.mark.parametrize("peer, loopback", [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.3.2.1:1", True), ("ipv6:[::1]:5000", True),
    ("ipv6:[::ffff:127.0.0.1]:5000", True), ("unix:/tmp/s", True), ("ipv4:10.0.0.1:5000", False),
    ("ipv6:[fe80::1]:5000", False), ("ipv4:garbage", False), ("", False),
])
def test_loopback_peers(peer, loopback):
    assert is_loopback_peer(peer) is loopback


@pytest.mark.parametrize("listen, loopback", [
    ("127.0.0.1:0", True), ("localhost:50051", True), ("[::1]:0", True), ("0.0.0.0:50051", False),
    ("[::]:0", False), ("10.1.2.3:5", False), (":50051", False),
])
def test_loopback_listen_addresses(listen, loopback):
    assert is_loopback_listen(listen) is loopback


def test_put_ticket_fields_name_the_tile():
    a = put_fields("u", "t", "h/0", "float32", ((0, 4), (0, 2)))
    b = put_fields("u", "t", "h/0", "float32", ((0, 4), (0, 3)))
    assert a != b
    s = new_secret()
    assert sign(s, "put", *a) != sign(s, "put", *b)


def test_a_token_read_from_a_file_by_hand_works_as_the_file_would(tmp_path, monkeypatch):
    from reshard.proto.auth import resolve_token
    from reshard.proto.errors import InvalidArgumentError

    token = "a" * 40
    path = tmp_path / "cluster-token.txt"
    path.write_text(token + "\n")  # as `openssl rand -hex 24 > cluster-token.txt` leaves it
    assert resolve_token(token=path.read_text()) == token == resolve_token(token_file=str(path))
    monkeypatch.setenv("RESHARD_TOKEN", f" {token}\n")
    assert resolve_token() == token
    with pytest.raises(InvalidArgumentError, match="no usable token"):
        resolve_token(token="two words " + token)
