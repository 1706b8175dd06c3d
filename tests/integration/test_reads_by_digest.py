"""A Prepare names read columns the agent already holds by their SHA-256, carrying the versions alone.

A weight sync quantized on the way reads its tensors under the same names every step, as columns of program
tensors and stored names (a Kimi-K2-like state dict's hosts: 74 MiB of names every job); the columns go to an agent
once, and later Prepares carry their SHA-256 and the versions. Real gRPC agent server, the planner's real
`GrpcAgentCalls`; the agent's holder is watched, not replaced.
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from reshard import Mesh, Sharding, TensorDecl
from reshard.many import plan_many
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.server.agent.reads import HeldColumns
from reshard.server.agent.service import serve_agent
from reshard.server.common.config import AgentConfig
from reshard.server.common.contract import READS_NOT_HELD, Staging
from reshard.server.common.tickets import (columns_digest, new_secret, prepare_fields, program_digest, sign,
                                           signed_reads)
from reshard.server.planner.jobs import Preparation
from reshard.server.planner.service import GrpcAgentCalls

A = Mesh.from_hosts({"x": 2}, ["a0", "a1"], 1)
B = Mesh.from_hosts({"x": 2}, ["b0", "b1"], 1)
TIMEOUT_S = 30.0
PROGRAM = plan_many([TensorDecl(n, (8, 8), "float32", Sharding(A, ("x", None)), Sharding(B, (None, "x")))
                     for n in ("v", "w")])


@pytest.fixture
def agent(monkeypatch):
    """An agent of host b0, the planner's calls to it, and a record of what its read columns holder did: ("keep",
    sha) as a Prepare carried columns, ("named", sha) as one named them by their SHA-256."""
    secret = new_secret()
    seen: list[tuple[str, str]] = []
    holders: list[HeldColumns] = []
    keep, get = HeldColumns.keep, HeldColumns.get

    def keeping(self, sha256, tensors, names):
        seen.append(("keep", sha256))
        holders.append(self)
        return keep(self, sha256, tensors, names)

    def named(self, sha256):
        seen.append(("named", sha256))
        return get(self, sha256)

    monkeypatch.setattr(HeldColumns, "keep", keeping)
    monkeypatch.setattr(HeldColumns, "get", named)
    server, port, runtime = serve_agent(AgentConfig("b0", 1, "127.0.0.1:1", transport="grpc"), secret)
    calls = GrpcAgentCalls(lambda host: secret)
    try:
        yield calls, f"127.0.0.1:{port}", runtime, seen, holders, secret
    finally:
        calls.close()
        server.stop(0)
        runtime.close()


def _preparation(versions: tuple[int, int] = (3, 5), names: tuple[str, str] = ("v", "w")) -> Preparation:
    """A job of `PROGRAM` reading its tensors v and w as stored ``names`` at ``versions`` (columns: no one version)."""
    reads = {t: (n, version) for t, n, version in zip(("v", "w"), names, versions)}
    return Preparation(uuid.uuid4().hex, PROGRAM.dumps(), "w", 1, 2, {"b0": "unused:1"}, "grpc",
                       program_id=PROGRAM.id, reads=reads)


def _prepare(calls: GrpcAgentCalls, address: str, runtime, prep: Preparation, bases: dict | None = None):
    """Prepare ``prep`` on the agent; the versions its run reads, by program tensor (and, given ``bases``, fill it
    with the delta bases the run got); then abort it."""
    calls.prepare("b0", address, prep, TIMEOUT_S)
    run = runtime._runs[prep.job]
    versions = dict(run.versions)
    if bases is not None:
        bases.update(run.delta_bases)
    calls.abort("b0", address, Staging(job=prep.job), TIMEOUT_S)
    return versions


def test_repeated_columns_go_by_their_digest_and_whole_again_once_the_agent_dropped_them(agent):
    calls, address, runtime, seen, holders, _ = agent
    first = _preparation((3, 5))
    digest = columns_digest(["v", "w"], ["v", "w"])
    assert _prepare(calls, address, runtime, first) == {"v": 3, "w": 5}
    assert seen == [("keep", digest)]  # the first time, the columns
    assert _prepare(calls, address, runtime, _preparation((4, 6))) == {"v": 4, "w": 6}
    assert seen[-1] == ("named", digest)  # the next job names them, with versions of its own
    holders[0]._held.clear()  # as after a restart, or once newer columns pushed them out
    assert _prepare(calls, address, runtime, _preparation((7, 7))) == {"v": 7, "w": 7}
    assert seen[-2:] == [("named", digest), ("keep", digest)]  # named, not held: the columns follow
    renamed = _preparation((1, 2), names=("v", "w_old"))  # other stored names: other columns, sent whole
    assert _prepare(calls, address, runtime, renamed) == {"v": 1, "w": 2}
    assert seen[-1] == ("keep", columns_digest(["v", "w"], ["v", "w_old"]))
    assert runtime._programs  # the program itself went by its digest meanwhile


def _request(prep: Preparation, secret: bytes, versions: list[int], sha: str, signed_versions=None):
    """A Prepare of ``prep`` naming its program and its columns ``sha`` by digest, at ``versions``, its ticket
    signing ``signed_versions`` (default: the versions it carries)."""
    digest = program_digest(prep.program_json)
    request = pb.PrepareRequest(job=prep.job, program_sha256=digest, tensor="w", src_version=1, dst_version=2,
                                peers=prep.peers, transport="grpc", read_columns_sha256=sha, read_versions=versions)
    signed = signed_reads(sha, versions if signed_versions is None else signed_versions)
    request.ticket = sign(secret, "prepare", *prepare_fields(prep.job, digest, "w", 1, 2, "grpc", 0, 0, prep.peers,
                                                             signed_reads=signed))
    return request


def test_an_agent_answers_columns_it_does_not_hold_with_not_found_and_refuses_a_changed_version(agent):
    calls, address, runtime, seen, _, secret = agent
    prep = _preparation()
    _prepare(calls, address, runtime, prep)  # the agent holds the program and these columns now
    held = columns_digest(["v", "w"], ["v", "w"])
    unknown = columns_digest(["v", "w"], ["x", "y"])
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prepare(_request(_preparation(), secret, [1, 1], unknown), timeout=TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert refused.value.details().startswith(READS_NOT_HELD)
        assert f"agent b0 holds no read columns with SHA-256 {unknown[:16]}" in refused.value.details()
        # The ticket signs the versions: one changed on the way is refused before anything is read.
        with pytest.raises(grpc.RpcError) as changed:
            stub.Prepare(_request(_preparation(), secret, [9, 1], held, signed_versions=[1, 1]), timeout=TIMEOUT_S)
        assert changed.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A version per tensor of the columns, no fewer.
        with pytest.raises(grpc.RpcError) as short:
            stub.Prepare(_request(_preparation(), secret, [1], held), timeout=TIMEOUT_S)
        assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "reads 2 tensors at 1 versions; give one of each per tensor" in short.value.details()
        # Columns carried under a SHA-256 that is not theirs: refused.
        wrong = _request(_preparation(), secret, [1, 1], unknown)
        wrong.read_tensors.extend(["v", "w"])
        with pytest.raises(grpc.RpcError) as mixed:
            stub.Prepare(wrong, timeout=TIMEOUT_S)
        assert mixed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not the" in mixed.value.details() and unknown[:16] in mixed.value.details()
        # Not a SHA-256 at all: named as such.
        with pytest.raises(grpc.RpcError) as malformed:
            stub.Prepare(_request(_preparation(), secret, [1, 1], "\x80" + held[1:]), timeout=TIMEOUT_S)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a SHA-256 in 64 hexadecimal digits" in malformed.value.details()
    assert _prepare(calls, address, runtime, _preparation((2, 2))) == {"v": 2, "w": 2}  # and it still serves


def test_the_planner_mirrors_which_columns_the_agent_keeps(agent, monkeypatch):
    from reshard.server.agent import reads as agent_reads
    from reshard.server.planner import service

    calls, address, runtime, seen, _, _ = agent
    monkeypatch.setattr(service, "READ_COLUMNS_KEPT", 2)
    monkeypatch.setattr(agent_reads, "READ_COLUMNS_KEPT", 2)
    for names in (("a", "b"), ("c", "d"), ("e", "f")):
        _prepare(calls, address, runtime, _preparation(names=names))
    assert [kind for kind, _ in seen] == ["keep"] * 3
    _prepare(calls, address, runtime, _preparation(names=("a", "b")))  # dropped by both: sent whole, no NOT_FOUND
    _prepare(calls, address, runtime, _preparation(names=("e", "f")))  # kept by both: named
    assert [kind for kind, _ in seen[3:]] == ["keep", "named"]
    calls.forget(address)  # an address forgotten holds nothing the planner would name
    _prepare(calls, address, runtime, _preparation(names=("e", "f")))
    assert seen[-1][0] == "keep"


def test_delta_bases_go_as_columns_beside_the_reads_signed_and_checked(agent):
    """A delta sync's bases go as two columns beside the reads (`read_delta_src`, ``read_delta_dst``; -1: the
    tensor moves whole), not a map naming every tensor again, also where the reads themselves go by their SHA-256;
    the agent's run gets the same bases either way, and the ticket signs them."""
    calls, address, runtime, seen, _, secret = agent
    for versions, deltas in (((3, 5), {"w": (4, 2)}), ((4, 6), {"v": (3, 1), "w": (5, 3)})):
        prep = _preparation(versions)
        prep = Preparation(prep.job, prep.program_json, "w", 1, 2, prep.peers, "grpc", program_id=prep.program_id,
                           reads=prep.reads, delta_bases=deltas)
        request = calls.prepare_request("b0", prep, held=True, columns_held=True)
        assert not request.delta_bases and list(request.read_delta_src) == [deltas.get(t, (-1, -1))[0]
                                                                            for t in ("v", "w")]
        bases: dict = {}
        assert _prepare(calls, address, runtime, prep, bases) == dict(zip(("v", "w"), versions))
        assert bases == deltas
    assert seen[-1][0] == "named"  # the second job's reads went by digest, its bases beside them
    request = _request(_preparation(), secret, [1, 1], columns_digest(["v", "w"], ["v", "w"]))
    request.read_delta_src.extend([0, -1])
    request.read_delta_dst.extend([7, -1])  # bases the ticket does not sign
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as unsigned:
            stub.Prepare(request, timeout=TIMEOUT_S)
        assert unsigned.value.code() == grpc.StatusCode.PERMISSION_DENIED
        del request.read_delta_dst[:]
        with pytest.raises(grpc.RpcError) as uneven:
            stub.Prepare(request, timeout=TIMEOUT_S)
        assert uneven.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "give one pair per read" in uneven.value.details()
