"""Delta moves between real agent servers (issue 40): two agents serving gRPC, registered with a real planner, are
driven as the planner drives them, with signed Prepare-in-Execute calls whose ``delta_bases`` name the tensor; the
box travels as a delta frame in a real Push between them. The agents run in this process (as in test_fuzz) so the
test knows their secrets and fills their stores directly with the base pair (the planner half of issue 40, which
keeps base pairs in the catalog, is not needed for this).

Covered here: the gRPC transport. The collective and nixl transports run the same engine code over a real gloo
group and real NIXL agents in tests/unit/test_delta_moves.py."""

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
from reshard.server.agent.service import Agent
from reshard.server.agent.store import TileBuffer
from reshard.server.common.contract import DELTA_BASE_MISMATCH
from reshard.server.common.tickets import execute_fields, prepare_fields, program_digest, sign
from reshard.strategies import plan as make_plan

from .conftest import agents_in_process

HOSTS = ("d0", "d1")
SRC_BASE, DST_BASE, NEW = 1, 7, 2


@pytest.fixture(scope="module")
def agents():
    with agents_in_process(HOSTS, 2) as got:
        yield got


def _put(agent: Agent, name: str, a: np.ndarray, sharding: Sharding, version: int) -> None:
    store = agent.runtime.store
    upload = f"upload-{uuid.uuid4().hex}"
    devices = [d for d in sharding.tiles(a.shape) if d.split("/")[0] == agent.config.host]
    for dev in devices:
        box = sharding.tiles(a.shape)[dev]
        store.stage(upload, dev, TileBuffer(a[tuple(slice(lo, hi) for lo, hi in box)].copy(), box, a.dtype.name))
    store.commit(upload, name, version, devices)


def _execute_all(cluster, agents, plan, tensor: str, delta_bases: dict) -> dict:
    """Execute (with its Prepare, commit=True) on every agent at once, as the planner does; host -> the last
    Progress, or the RpcError it raised."""
    job = uuid.uuid4().hex
    text = plan.dumps()
    peers = {h: a.address for h, a in agents.items()}
    metadata = ((METADATA_KEY, f"Bearer {cluster.token}"),)
    out = {}

    def run(h: str, a: Agent) -> None:
        prep = pb.PrepareRequest(job=job, program_json=text, tensor=tensor, src_version=NEW, dst_version=NEW + 1,
                                 peers=peers, transport="grpc",
                                 push_tickets={p: sign(b.secret, "push", job, plan.id) for p, b in agents.items()},
                                 delta_bases={t: pb.DeltaBase(src_version=s, dst_version=d)
                                              for t, (s, d) in delta_bases.items()})
        prep.ticket = sign(a.secret, "prepare", *prepare_fields(job, program_digest(text), tensor, NEW, NEW + 1,
                                                                "grpc", 0, 0, peers, {}, {}, delta_bases))
        request = pb.ExecuteRequest(job=job, program_id=plan.id, commit=True, prepare=prep)
        request.ticket = sign(a.secret, "execute", *execute_fields(job, plan.id, True))
        with grpc.insecure_channel(a.address) as ch:
            try:
                out[h] = list(pb_grpc.AgentStub(ch).Execute(request, timeout=60, metadata=metadata))[-1]
            except grpc.RpcError as e:
                out[h] = e

    threads = [threading.Thread(target=run, args=item) for item in agents.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _setup(agents, name: str, base_on_receiver=None):
    rng = np.random.default_rng(len(name))
    base = rng.standard_normal((128, 64)).astype(np.float32)
    new = base.copy()
    new.reshape(-1)[rng.choice(base.size, base.size // 100, replace=False)] += 1
    src = Sharding(Mesh.from_hosts({"x": 2}, ["d0"], 2), ("x", None))
    dst = Sharding(Mesh.from_hosts({"y": 2}, ["d1"], 2), (None, "y"))  # strided boxes at both ends
    _put(agents["d0"], name, base, src, SRC_BASE)
    _put(agents["d0"], name, new, src, NEW)
    _put(agents["d1"], name, base if base_on_receiver is None else base_on_receiver, dst, DST_BASE)
    return new, dst, make_plan(new.shape, new.dtype, src, dst, strategy="send_recv").validate()


def test_a_delta_move_between_agent_servers_is_bit_exact_and_reports_its_bytes(agents):
    cluster, started = agents
    new, dst, plan = _setup(started, "w")
    out = _execute_all(cluster, started, plan, "w", {"tensor": (SRC_BASE, DST_BASE)})
    assert all(isinstance(p, pb.Progress) and p.done for p in out.values()), out
    got = np.empty_like(new)
    for dev, box in dst.tiles(new.shape).items():
        got[tuple(slice(lo, hi) for lo, hi in box)] = started["d1"].runtime.store.get("w", NEW + 1, dev).array
    assert got.tobytes() == new.tobytes()
    sender = out["d0"].traffic
    assert sender.delta_full_bytes == {"tensor": new.nbytes}
    assert 0 < sender.delta_wire_bytes["tensor"] == sender.bytes_out["d1"] < new.nbytes / 5
    assert out["d1"].traffic.bytes_in["d0"] == sender.bytes_out["d1"]


def test_a_receiver_base_that_differs_fails_with_the_rule_and_commits_nothing(agents):
    cluster, started = agents
    rng = np.random.default_rng(9)
    stale = rng.standard_normal((128, 64)).astype(np.float32)
    new, dst, plan = _setup(started, "v", base_on_receiver=stale)
    out = _execute_all(cluster, started, plan, "v", {"tensor": (SRC_BASE, DST_BASE)})
    failed = out["d1"]
    assert isinstance(failed, grpc.RpcError) and failed.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert failed.details().startswith(f"{DELTA_BASE_MISMATCH}: tensor 'v': version {DST_BASE} on device d1/"), \
        failed.details()
    for dev in dst.mesh.devices:
        assert started["d1"].runtime.store.find("v", NEW + 1, dev) is None


def test_the_steps_that_send_one_box_from_one_device_as_deltas_are_each_bit_exact(agents):
    # send_recv moves a copy to every receiving device: two steps send each source box from one device of d0, one
    # to each device of d1, which share the frame the first of them encodes (`SharedFrames`)
    cluster, started = agents
    rng = np.random.default_rng(11)
    base = rng.standard_normal((128, 64)).astype(np.float32)
    new = base.copy()
    new.reshape(-1)[rng.choice(base.size, base.size // 100, replace=False)] += 1
    src = Sharding(Mesh.from_hosts({"x": 2}, ["d0"], 2), ("x", None))
    dst = Sharding(Mesh.from_hosts({"y": 2}, ["d1"], 2), (None, None))  # every device of d1 holds it whole
    _put(started["d0"], "s", base, src, SRC_BASE)
    _put(started["d0"], "s", new, src, NEW)
    _put(started["d1"], "s", base, dst, DST_BASE)
    plan = make_plan(new.shape, new.dtype, src, dst, strategy="send_recv").validate()
    by_box: dict = {}
    for t in plan.transfers:
        by_box.setdefault((t.sender, t.box), []).append(t)
    assert sorted(map(len, by_box.values())) == [2, 2]  # each box twice from its device: the frames are shared
    out = _execute_all(cluster, started, plan, "s", {"tensor": (SRC_BASE, DST_BASE)})
    assert all(isinstance(p, pb.Progress) and p.done for p in out.values()), out
    for dev in dst.mesh.devices:
        assert started["d1"].runtime.store.get("s", NEW + 1, dev).array.tobytes() == new.tobytes()
    sender = out["d0"].traffic
    assert sender.delta_full_bytes == {"tensor": 2 * new.nbytes}  # two full copies replaced
    assert 0 < sender.delta_wire_bytes["tensor"] == sender.bytes_out["d1"] < 2 * new.nbytes / 5
