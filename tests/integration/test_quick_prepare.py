"""A small job's Prepare inside its Execute runs on the handler's own thread (no loader thread, no hand-offs), and a
large one still loads on a thread of its own that reports ``loading`` meanwhile. Two agent servers in this process,
driven as the planner drives them with signed Prepare-in-Execute calls (as in test_delta_engine)."""

from __future__ import annotations

import threading
import uuid

import grpc
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import METADATA_KEY
from reshard.server.agent import service
from reshard.server.agent.service import Agent
from reshard.server.agent.store import TileBuffer
from reshard.server.common.tickets import execute_fields, prepare_fields, program_digest, sign
from reshard.strategies import plan as make_plan

from .conftest import agents_in_process

HOSTS = ("q0", "q1")
ON = {h: Sharding(Mesh.from_hosts({"x": 1}, [h], 1), (None,)) for h in HOSTS}


@pytest.fixture(scope="module")
def agents():
    with agents_in_process(HOSTS, 1) as got:
        yield got


def _move(cluster, agents, version: int) -> tuple[dict, list[str]]:
    """Put version ``version`` of a small tensor on q0 and move it to q1 in one job; returns each host's messages
    (whether each was a ``loading`` report) and the names of the threads started meanwhile."""
    a = np.arange(16, dtype=np.int32)
    store = agents["q0"].runtime.store
    upload = f"upload-{uuid.uuid4().hex}"
    store.stage(upload, "q0/0", TileBuffer(a.copy(), ((0, 16),), "int32"))
    store.commit(upload, "t", version, ["q0/0"])
    plan = make_plan((16,), "int32", ON["q0"], ON["q1"], None, "auto")
    job, text = uuid.uuid4().hex, plan.dumps()
    peers = {h: x.address for h, x in agents.items()}
    out: dict = {}

    def run(h: str, x: Agent) -> None:
        prep = pb.PrepareRequest(job=job, program_json=text, tensor="t", src_version=version,
                                 dst_version=version + 1, peers=peers, transport="grpc",
                                 push_tickets={p: sign(b.secret, "push", job, plan.id) for p, b in agents.items()})
        prep.ticket = sign(x.secret, "prepare", *prepare_fields(job, program_digest(text), "t", version, version + 1,
                                                                "grpc", 0, 0, peers, {}, {}, {}))
        request = pb.ExecuteRequest(job=job, program_id=plan.id, commit=h == "q1", prepare=prep)
        request.ticket = sign(x.secret, "execute", *execute_fields(job, plan.id, h == "q1"))
        with grpc.insecure_channel(x.address) as ch:
            out[h] = [m.loading for m in pb_grpc.AgentStub(ch).Execute(
                request, timeout=60, metadata=((METADATA_KEY, f"Bearer {cluster.token}"),))]

    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    threading.Thread.start = counted
    try:
        callers = [threading.Thread(target=run, args=item) for item in agents.items()]
        for t in callers:
            start(t)
        for t in callers:
            t.join(60)
    finally:
        threading.Thread.start = start
    found = agents["q1"].runtime.store.find("t", version + 1, "q1/0")
    assert found is not None and np.array_equal(found.array, a)
    return out, started


def test_a_small_jobs_prepare_runs_on_its_executes_own_thread(agents):
    cluster, started_agents = agents
    out, started = _move(cluster, started_agents, 1)
    assert set(out) == set(HOSTS) and not any(any(loading) for loading in out.values())
    assert not [n for n in started if n.startswith("load-")], started


def test_a_large_jobs_prepare_still_loads_on_a_thread_of_its_own(agents, monkeypatch):
    cluster, started_agents = agents
    monkeypatch.setattr(service, "QUICK_PREPARE_BYTES", 0)  # every program counts as large
    out, started = _move(cluster, started_agents, 3)
    assert set(out) == set(HOSTS)
    assert len([n for n in started if n.startswith("load-")]) == len(HOSTS), started
