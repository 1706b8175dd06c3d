"""A Prepare names a program the agent already read by its SHA-256 instead of carrying its text again.

A weight sync runs one program every step, and a state dict's program is half a megabyte of JSON or more: the
planner sent it to every agent on every step. Real gRPC agent server, the planner's real `GrpcAgentCalls`.
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from reshard import Mesh, Sharding, TensorDecl
from reshard.many import plan_many
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.errors import NotFoundError
from reshard.server.agent.service import serve_agent
from reshard.server.common.config import AgentConfig
from reshard.server.common.contract import PROGRAM_NOT_HELD, Staging
from reshard.server.common.tickets import new_secret, prepare_fields, program_digest, sign
from reshard.server.planner.jobs import Preparation
from reshard.server.planner.service import GrpcAgentCalls

A = Mesh.from_hosts({"x": 2}, ["a0", "a1"], 1)
B = Mesh.from_hosts({"x": 2}, ["b0", "b1"], 1)
TIMEOUT_S = 30.0


@pytest.fixture
def agent():
    """An agent of host b0 and the planner's calls to it, both keyed with the same registration secret."""
    secret = new_secret()
    server, port, runtime = serve_agent(AgentConfig("b0", 1, "127.0.0.1:1", transport="grpc"), secret)
    calls = GrpcAgentCalls(lambda host: secret)
    texts: list[bool] = []  # per program the agent looked up: whether the Prepare carried the text
    loaded = runtime._loaded

    def recording(text: str, sha256: str = ""):
        texts.append(bool(text))
        return loaded(text, sha256)

    runtime._loaded = recording
    try:
        yield calls, f"127.0.0.1:{port}", runtime, texts, secret
    finally:
        calls.close()
        server.stop(0)
        runtime.close()


def _preparation(rows: int = 8) -> Preparation:
    program = plan_many([TensorDecl("w", (rows, 8), "float32", Sharding(A, ("x", None)), Sharding(B, (None, "x")))])
    return Preparation(uuid.uuid4().hex, program.dumps(), "w", 1, 2, {"b0": "unused:1"}, "grpc",
                       program_id=program.id)


def _prepare(calls: GrpcAgentCalls, address: str, prep: Preparation) -> None:
    calls.prepare("b0", address, prep, TIMEOUT_S)
    calls.abort("b0", address, Staging(job=prep.job), TIMEOUT_S)


def test_a_repeated_program_goes_by_its_digest_and_its_text_again_once_the_agent_dropped_it(agent):
    calls, address, runtime, texts, _ = agent
    first = _preparation()
    _prepare(calls, address, first)
    assert texts == [True]  # the first time, the text
    again = _preparation()
    assert again.program_json == first.program_json and again.job != first.job
    _prepare(calls, address, again)
    assert texts == [True, False]  # the next job of the same program names it
    runtime._programs.clear()  # as after a restart, or once newer programs pushed it out
    _prepare(calls, address, _preparation())
    assert texts == [True, False, False, True]  # named, not held: the text follows in a second call
    _prepare(calls, address, _preparation(rows=12))
    assert texts[-1] is True  # another program: its text


def test_an_agent_answers_a_digest_it_does_not_hold_with_not_found_and_keeps_serving(agent):
    calls, address, runtime, texts, secret = agent
    prep = _preparation()
    digest = program_digest(prep.program_json)
    request = pb.PrepareRequest(job=prep.job, program_sha256=digest, tensor="w", src_version=1, dst_version=2,
                                peers=prep.peers, transport="grpc")
    request.ticket = sign(secret, "prepare", *prepare_fields(prep.job, digest, "w", 1, 2, "grpc", 0, 0, prep.peers))
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prepare(request, timeout=TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert refused.value.details().startswith(PROGRAM_NOT_HELD)
        assert f"agent b0 holds no program with SHA-256 {digest[:16]}" in refused.value.details()
        # A text and a digest that is not the text's: refused before anything is read.
        request.program_json = _preparation(rows=12).program_json
        with pytest.raises(grpc.RpcError) as mixed:
            stub.Prepare(request, timeout=TIMEOUT_S)
        assert mixed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not two that differ" in mixed.value.details()
    # The agent holds nothing of those jobs and still serves: the planner's calls work.
    _prepare(calls, address, prep)
    assert texts[-1] is True


def test_a_ticket_signs_the_digest_so_a_named_program_cannot_be_swapped(agent):
    calls, address, runtime, texts, secret = agent
    held, other = _preparation(), _preparation(rows=12)
    _prepare(calls, address, held)
    _prepare(calls, address, other)  # the agent holds both now
    # A ticket for one program does not pass for the other.
    request = pb.PrepareRequest(job=held.job + "x", program_sha256=program_digest(other.program_json), tensor="w",
                                src_version=1, dst_version=2, peers=held.peers, transport="grpc")
    request.ticket = sign(secret, "prepare", *prepare_fields(request.job, program_digest(held.program_json), "w", 1,
                                                             2, "grpc", 0, 0, held.peers))
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.AgentStub(ch).Prepare(request, timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_planner_forgets_what_an_agent_would_have_dropped(agent, monkeypatch):
    from reshard.server.planner import service

    calls, address, runtime, texts, _ = agent
    monkeypatch.setattr(service, "PROGRAMS_KEPT", 2)
    preps = [_preparation(rows) for rows in (4, 6, 8)]
    for prep in preps:
        _prepare(calls, address, prep)
    assert texts == [True, True, True]
    again = _preparation(4)  # the oldest of three, with the agent keeping two: the planner sends the text
    _prepare(calls, address, again)
    assert texts[-1] is True
    with pytest.raises(NotFoundError):  # and an unknown digest is the agent's NOT_FOUND, as the SDK sees it
        runtime.prepare(uuid.uuid4().hex, "", "w", 1, 2, {}, "grpc", program_sha256="0" * 64)


def test_the_planner_counts_program_text_as_the_agent_does(agent, monkeypatch):
    from reshard.server.agent import runtime as agent_runtime
    from reshard.server.planner import service

    calls, address, runtime, texts, _ = agent
    preps = [_preparation(rows) for rows in (4, 6, 8)]
    budget = len(preps[0].program_json) + len(preps[1].program_json) + 10  # two texts fit, not three
    monkeypatch.setattr(service, "PROGRAMS_KEPT_BYTES", budget)
    monkeypatch.setattr(agent_runtime, "PROGRAMS_KEPT_BYTES", budget)
    for prep in preps:
        _prepare(calls, address, prep)
    _prepare(calls, address, _preparation(8))  # the newest: both keep it
    _prepare(calls, address, _preparation(6))  # kept beside it
    _prepare(calls, address, _preparation(4))  # dropped by both: the planner sends the text, with no NOT_FOUND
    assert texts[3:] == [False, False, True]


def test_an_address_the_planner_forgets_gets_a_new_channel_and_the_text_again(agent):
    """The planner forgets an agent's old address when its host registers elsewhere (`Planner.register`): the
    channel is closed and nothing is taken as held there, so a later agent at that address gets the text."""
    calls, address, runtime, texts, _ = agent
    _prepare(calls, address, _preparation())
    old = calls._channels[address]
    calls.forget(address)
    assert address not in calls._channels and address not in calls._held
    with pytest.raises(ValueError, match="closed"):  # grpc refuses calls on a closed channel
        old.unary_unary("/reshard.Agent/Prepare")(b"", timeout=TIMEOUT_S)
    _prepare(calls, address, _preparation())
    assert texts == [True, True] and calls._channels[address] is not old
    calls.forget("127.0.0.1:9")  # an address never called: nothing to do


def test_two_texts_under_one_program_id_are_each_signed_with_their_own_digest(agent):
    """A plan's id leaves out figures its JSON carries (a restarted agent's measured rates): the planner signs the
    digest of the very text it sends, however the id repeats."""
    calls, address, runtime, texts, _ = agent
    first = _preparation()
    _prepare(calls, address, first)
    # the same program in another text of the same length (as a figure that changed in place would make)
    changed = first.program_json.replace('"tensors": [', '"tensors":[ ', 1)
    assert changed != first.program_json and len(changed) == len(first.program_json)
    again = Preparation(uuid.uuid4().hex, changed, "w", 1, 2, first.peers, "grpc", program_id=first.program_id)
    _prepare(calls, address, again)  # the agent hashes the text it gets: a stale digest would fail its ticket
    assert texts == [True, True]
