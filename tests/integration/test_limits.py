"""Bounded resources and lost data with real processes (issue 11): the agents' memory limit, uploads the planner
did not issue, uploads it expires, the plan-size limit, and a tensor whose agent restarted.

One cluster serves the module: 4 hosts of 2 devices, every agent limited to 8 MiB of shards, a planner that
refuses plans over 32 unit tasks and marks agents down after 2 s. Host use: host0 for uploads, host1 for
reshards and the dying client, host2 for orphan uploads, host3 for the restart (the module's last test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import grpc
import httpx
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client import (
    DataLossError,
    FailedPreconditionError,
    JobFailedError,
    NotFoundError,
    ResourceExhaustedError,
)
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import channel
from reshard.proto.wire import shard_stream

MiB = 2**20
LIMIT = 8 * MiB
UPLOAD_TIMEOUT_S = 3.0
MAX_PLAN_TASKS = 32
MAX_PROGRAM_STEPS = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(4, 2, transport="grpc", dashboard=True, log_dir=str(tmp_path_factory.mktemp("limits")),
                      agent_args=["--memory-limit", "8MiB"],
                      planner_args=["--heartbeat-timeout", "2", "--upload-timeout", str(UPLOAD_TIMEOUT_S),
                                    "--max-plan-tasks", str(MAX_PLAN_TASKS),
                                    "--max-program-steps", str(MAX_PROGRAM_STEPS)]) as cluster:
        yield cluster


@pytest.fixture
def client(cluster):
    with cluster.connect() as c:
        yield c


def _on(host: str, spec=("x",), devices: int = 1) -> Sharding:
    return Sharding(Mesh.from_hosts({"x": devices}, [host], devices), spec)


def _floats(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)


def _planner(cluster) -> pb_grpc.PlannerStub:
    return pb_grpc.PlannerStub(channel(cluster.address, token=cluster.token))


def _agent(cluster, host: str) -> pb_grpc.AgentStub:
    return pb_grpc.AgentStub(channel(cluster.agent_addresses[host], token=cluster.token))


def _memory(cluster, host: str, since: float = 0.0) -> tuple[int, int]:
    """(used, limit) bytes of ``host``'s agent, from a heartbeat sent after ``since`` (time.monotonic())."""
    deadline = time.monotonic() + 10
    while True:
        now = time.monotonic()
        info = next(a for a in _planner(cluster).ListAgents(pb.Empty(), timeout=10).agents if a.host == host)
        if now - info.heartbeat_age_s > since or now > deadline:
            return info.memory_used_bytes, info.memory_limit_bytes
        time.sleep(0.1)


def _wait_memory(cluster, host: str, want: int) -> None:
    deadline = time.monotonic() + 10
    while _memory(cluster, host)[0] != want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _memory(cluster, host)[0] == want


def test_uploads_over_an_agents_memory_limit_are_refused_naming_sizes(cluster, client):
    kept = _floats(MiB, 1)
    client.put("kept", kept, _on("host0", devices=2))
    assert _memory(cluster, "host0", time.monotonic()) == (MiB, LIMIT)  # agents report their limit and use

    # The planner refuses a tile over the limit before any agent is called.
    with pytest.raises(ResourceExhaustedError, match=r"tensor 'too_big' .* would give host host0's device host0/0 a "
                                                     r"tile of 12\.0 MiB \(12,582,912 bytes\), more than its agent's "
                                                     r"memory limit of 8\.0 MiB \(8,388,608 bytes\)"):
        client.put("too_big", _floats(12 * MiB, 2), _on("host0"))
    for shape in ([2**40, 2**40], [2**62, 2**62]):  # never INTERNAL or MemoryError
        with pytest.raises(grpc.RpcError) as huge:
            _planner(cluster).BeginUpload(pb.BeginUploadRequest(
                name="huge", shape=shape, dtype="float32", sharding_json=json.dumps(_on("host0").to_json()),
                kind="numpy"), timeout=10)
        assert huge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, huge.value.details()

    # Each tile fits, but not beside what the agent already holds: the agent refuses before allocating.
    client.put("fills", _floats(6 * MiB, 3), _on("host0"))
    with pytest.raises(ResourceExhaustedError, match=r"PutShard(Shm)? of 'over' for device host0/1 needs 4\.0 MiB "
                                                     r"\(4,194,304 bytes\), but the agent of host host0 holds 7\.0 MiB "
                                                     r"\(7,340,032 bytes\) of its memory limit of 8\.0 MiB"):
        client.put("over", _floats(4 * MiB, 4), Sharding(Mesh({"x": 1}, ["host0/1"]), ("x",)))
    assert _memory(cluster, "host0", time.monotonic())[0] == 7 * MiB
    assert np.array_equal(client.get("kept"), kept) and client.info("kept").version == 1
    client.delete("fills")
    client.delete("kept")


def test_a_reshard_over_the_limit_fails_cleanly_and_leaves_the_source(cluster, client):
    data = _floats(6 * MiB, 5)
    client.put("moved", data, _on("host1"))
    # Split over host1's two devices: 6 MiB for the host fits the limit, but not beside the 6 MiB source.
    split = _on("host1", devices=2)
    with pytest.raises(JobFailedError, match=r"job \w+'s destination tiles of 'moved' needs 6\.0 MiB \(6,291,456 "
                                             r"bytes\), but the agent of host host1 holds 6\.0 MiB"):
        client.reshard("moved", split).result(timeout=60)
    # Replicated on both devices (12 MiB for host1): refused by the planner before any agent is called.
    with pytest.raises(ResourceExhaustedError, match=r"resharding 'moved' .* would give host host1's 2 devices "
                                                     r"12\.0 MiB \(12,582,912 bytes\) together"):
        client.reshard("moved", _on("host1", spec=(None,), devices=2))
    info = client.info("moved")
    assert info.version == 1 and info.sharding == _on("host1")
    assert np.array_equal(client.get("moved"), data)
    _wait_memory(cluster, "host1", 6 * MiB)  # the failed job's staged tiles are gone
    client.reshard("moved", _on("host2")).result(timeout=60)  # where it fits, it moves
    assert np.array_equal(client.get("moved"), data)
    client.delete("moved")
    _wait_memory(cluster, "host1", 0)


def test_a_reshard_many_whose_bucket_buffers_do_not_fit_is_refused_before_anything_moves(cluster, client):
    # Ten 0.5 MiB tensors (5 MiB) on host0, packed into one 5 MiB bucket: the sender's packed buffer and the
    # receiver's landing buffer come on top of the tiles, over the 8 MiB limit on both sides.
    tensors = {f"w{i}": (_floats(MiB // 2, 10 + i), _on("host0")) for i in range(10)}
    client.put_many(tensors)
    there = {name: _on("host2") for name in tensors}
    with pytest.raises(JobFailedError, match=r"job \w+'s bucket buffers \(1 of its 1 packed streams here at once, up "
                                             r"to 5\.0 MiB each: a smaller bucket_mib packs less\) needs 5\.0 MiB "
                                             r"\(5,242,880 bytes\), but the agent of host host[02] holds 5\.0 MiB"):
        client.reshard_many(there, bucket_mib=8).result(timeout=60)
    for name, (data, sharding) in tensors.items():  # every tensor where and as it was, and the memory freed
        info = client.info(name)
        assert (info.version, info.sharding) == (1, sharding)
        assert np.array_equal(client.get(name), data)
    _wait_memory(cluster, "host0", 5 * MiB)
    _wait_memory(cluster, "host2", 0)
    client.reshard_many(there, bucket_mib=0).result(timeout=60)  # unpacked, the same move fits
    for name, (data, _) in tensors.items():
        assert client.info(name).sharding == there[name] and np.array_equal(client.get(name), data)
    for name in tensors:
        client.delete(name)
    _wait_memory(cluster, "host2", 0)


def test_an_einsum_whose_working_buffers_do_not_fit_fails_cleanly_and_changes_nothing(cluster, client):
    # h is split over host0 and host1: each device's local product is a 4 MiB addend of the result, held in a
    # working buffer beside its 4 MiB replicated result tile and its 2 MiB of inputs: 10 MiB, over the limit.
    mesh = Mesh({"x": 2}, ["host0/0", "host1/0"])
    x, w = _floats(2 * MiB, 20).reshape(1024, 512), _floats(2 * MiB, 21).reshape(512, 1024)
    client.put("x", x, Sharding(mesh, (None, "x")))
    client.put("w", w, Sharding(mesh, ("x", None)))
    with pytest.raises(JobFailedError, match=r"job \w+'s working buffer of 'y~partial' in role 'partial0' \[0:1024, "
                                             r"0:1024\] on device host[01]/0 needs 4\.0 MiB \(4,194,304 bytes\), but "
                                             r"the agent of host host[01] holds 6\.0 MiB"):
        client.einsum("bh,hk->bk", "x", "w", out="y").result(timeout=60)
    with pytest.raises(NotFoundError):
        client.info("y")
    _wait_memory(cluster, "host0", 2 * MiB)  # the inputs alone
    # Left as a pending sum, the addends are the result's own tiles: it fits, and the sum is the product.
    partial = Sharding(mesh, (None, None), partial=("x",))
    client.einsum("bh,hk->bk", "x", "w", out="y", out_sharding=partial).result(timeout=60)
    # Two float32 addends of 512 terms each against one BLAS product: they round apart by a few units in the last
    # place of the terms' scale, which near-zero sums make a large relative error (an AMD host's kernel, 0.1% of them)
    expected = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(client.get("y"), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    for name in ("x", "w", "y"):
        client.delete(name)
    _wait_memory(cluster, "host0", 0)


def test_orphan_uploads_are_refused_and_change_nothing(cluster, client):
    """The zero-overwrite regression: PutShard under an invented upload id, then Commit, once replaced a committed
    tile with zeros. Now both are refused, the agent allocates nothing, and the tensor is bit-exact."""
    victim = _floats(MiB, 6)
    client.put("victim", victim, _on("host2", devices=2))
    digests = client.digests("victim")
    used, _ = _memory(cluster, "host2", time.monotonic())
    agent = _agent(cluster, "host2")
    tile = next(p for p in client._tensor("victim").locations if p.device == "host2/0")
    zeros = np.zeros(MiB // 8, np.float32)

    def put(upload: str, device: str, ticket: str, box=tile.box) -> grpc.RpcError:
        header = pb.ShardHeader(upload_id=upload, tensor="victim", device=device, dtype="float32", box=box,
                                ticket=ticket)
        with pytest.raises(grpc.RpcError) as e:
            agent.PutShard(shard_stream(zeros, header, MiB), timeout=10)
        return e.value

    refused = [put("invented", "host2/0", "")]
    # Real tickets of a real upload, for other devices and another host, do not open this agent either.
    decoy = _planner(cluster).BeginUpload(pb.BeginUploadRequest(
        name="decoy", shape=[8], dtype="float32", sharding_json=json.dumps(_on("host0", devices=2).to_json()),
        kind="numpy"), timeout=10)
    for loc in decoy.locations:
        refused.append(put(decoy.upload_id, "host2/0", loc.ticket))
    first, second = decoy.locations
    wrong_device = pb.ShardHeader(upload_id=decoy.upload_id, tensor="decoy", device=second.device, dtype="float32",
                                  box=second.box, ticket=first.ticket)
    with pytest.raises(grpc.RpcError) as e:
        _agent(cluster, "host0").PutShard(shard_stream(np.zeros(4, np.float32), wrong_device, MiB), timeout=10)
    refused.append(e.value)
    with pytest.raises(grpc.RpcError) as e:
        agent.Commit(pb.StagingRequest(upload_id="invented", tensor="victim", version=1, devices=["host2/0"]),
                     timeout=10)
    refused.append(e.value)
    assert [r.code() for r in refused] == [grpc.StatusCode.PERMISSION_DENIED] * 5, [r.details() for r in refused]
    assert "carries no ticket" in refused[0].details() and "did not issue" in refused[1].details()
    assert _memory(cluster, "host2", time.monotonic())[0] == used
    assert client.digests("victim") == digests and client.info("victim").version == 1
    assert np.array_equal(client.get("victim"), victim)
    client.delete("victim")


_DIES_BEFORE_FINISHING = textwrap.dedent("""
    import os, sys, numpy as np, reshard
    from reshard.client.client import Client
    from reshard import Mesh, Sharding
    real = Client._planner_call
    def dying(self, method, request, timeout=None):
        if method == "FinishUpload":
            os._exit(17)  # every shard is staged on the agent; the upload is never finished
        return real(self, method, request, timeout)
    Client._planner_call = dying
    c = reshard.connect(sys.argv[1])
    c.put("abandoned", np.ones(2**19, np.float32), Sharding(Mesh.from_hosts({"x": 2}, ["host1"], 2), ("x",)))
""")


def test_an_abandoned_upload_is_freed_when_the_planner_expires_it(cluster, client):
    before, _ = _memory(cluster, "host1", time.monotonic())
    proc = subprocess.run([sys.executable, "-c", _DIES_BEFORE_FINISHING, cluster.address], timeout=60,
                          env={**os.environ, "RESHARD_TOKEN": cluster.token})
    assert proc.returncode == 17
    assert _memory(cluster, "host1", time.monotonic())[0] == before + 2 * MiB  # staged, counted
    _wait_memory(cluster, "host1", before)  # expired after UPLOAD_TIMEOUT_S and aborted: freed
    assert "abandoned" not in [t.name for t in client.tensors()]


def test_plans_over_the_size_limit_are_refused_before_planning(cluster, client):
    big = Mesh.from_hosts({"x": 4096}, [f"node{i}" for i in range(512)], 8)
    with pytest.raises(ResourceExhaustedError, match=r"would make too large a plan: 4,096 unit tasks where the "
                                                     r"limit is 32; 16,777,216 deliveries where the limit is 32; .* "
                                                     r"\(reshard planner --max-plan-tasks 32 bounds"):
        client.plan((4096 * 4, 64), Sharding(big, (None, None)), dtype="float32", src=Sharding(big, ("x", None)))
    six = Mesh.from_hosts({"x": 6}, ["host0", "host1", "host2"], 2)
    data = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    client.put("grid", data, Sharding(six, ("x", None)))
    with pytest.raises(ResourceExhaustedError, match=r"resharding 'grid' of shape \(64, 64\) .* 36 unit tasks where "
                                                     r"the limit is 32"):
        client.reshard("grid", Sharding(six, (None, "x")))
    assert client.info("grid").version == 1 and np.array_equal(client.get("grid"), data)
    two = Sharding(Mesh.from_hosts({"x": 2}, ["host1"], 2), ("x", None))
    client.reshard("grid", two).result(timeout=60)  # 7 unit tasks: fits
    assert np.array_equal(client.get("grid"), data)
    client.delete("grid")


def test_a_state_dict_is_sized_by_its_layouts_and_its_program_by_its_steps(cluster, client):
    # 40 tensors of one layout, 2 unit tasks each: 80 in all, over the limit of 32, but planned once (2): one job
    split = Sharding(Mesh.from_hosts({"x": 2}, ["host1"], 2), ("x",))
    whole = Sharding(Mesh.from_hosts({"x": 2}, ["host1"], 2), (None,))
    values = {f"sd{i}": np.arange(8, dtype=np.float32) + i for i in range(160)}

    def put(names):  # a put_many takes up to --max-plan-tasks tensors
        for k in range(0, len(names), MAX_PLAN_TASKS):
            client.put_many({n: (values[n], split) for n in names[k:k + MAX_PLAN_TASKS]})

    put(list(values)[:40])
    client.reshard_many({n: whole for n in list(values)[:40]}).result(timeout=60)
    assert all(np.array_equal(client.get(n), values[n]) and client.info(n).version == 2 for n in list(values)[:40])
    # 120 more hold 240 steps, over --max-program-steps 200: the job fails naming the count, and every tensor
    # stays as it was
    put(list(values)[40:])
    before = {n: client.info(n).version for n in values}
    with pytest.raises(JobFailedError, match=r"would hold at least 240 steps, over the 200 allowed "
                                             r"\(max_steps, reshard planner --max-program-steps\)"):
        client.reshard_many({n: whole for n in list(values)[40:]}).result(timeout=60)
    assert {n: client.info(n).version for n in values} == before
    assert all(np.array_equal(client.get(n), values[n]) for n in values)
    client.delete_many(list(values))


def _dashboard(cluster, path: str):
    return httpx.get(cluster.dashboard_url.rstrip("/") + path, headers={"Authorization": f"Bearer "
                                                                          f"{cluster.admin_token}"}, timeout=30)


def test_a_tensor_whose_only_copy_died_is_lost_everywhere(cluster, client):
    """Runs last: it kills and restarts host3's agent."""
    solo, mirrored = _floats(MiB, 7), _floats(MiB, 8)
    client.put("solo", solo, _on("host3", devices=2))
    both = Sharding(Mesh.from_hosts({"r": 2, "x": 2}, ["host2", "host3"], 2), ("x",))  # a copy on each host
    client.put("mirrored", mirrored, both)
    cluster.kill_agent("host3")
    cluster.start_agent("host3")  # a new process: registers once the planner marked the old one down

    with pytest.raises(DataLossError, match=r"tensor 'solo' v1 lost 2 of its 2 tiles: every agent that held them "
                                            r"restarted \(tile \[0:131072\] held by host3/0; tile "
                                            r"\[131072:262144\] held by host3/1\)"):
        client.get("solo")
    with pytest.raises(DataLossError, match=r"device host3/1 .* was lost: the agent of host host3 restarted"):
        client.get_shard("solo", "host3/1")
    listed = {t.name: t for t in _planner(cluster).ListTensors(pb.Empty(), timeout=10).tensors}
    assert listed["solo"].lost and not listed["mirrored"].lost
    sdk = {t.name: t for t in client.tensors()}
    assert sdk["solo"].lost and not sdk["mirrored"].lost and str(sdk["solo"]).endswith("LOST")
    one = _planner(cluster).GetTensor(pb.TensorRequest(name="mirrored"), timeout=10)
    assert [(p.device, p.lost) for p in one.locations] == [("host2/0", False), ("host2/1", False),
                                                           ("host3/0", True), ("host3/1", True)]
    assert np.array_equal(client.get("mirrored"), mirrored)  # read from the surviving copies

    tensors = {t["name"]: t for t in _dashboard(cluster, "/api/tensors").json()}
    assert tensors["solo"]["lost"] and tensors["solo"]["lost_tiles"] == [
        {"tile": "[0:131072]", "devices": ["host3/0"]}, {"tile": "[131072:262144]", "devices": ["host3/1"]}]
    assert not tensors["mirrored"]["lost"] and tensors["mirrored"]["lost_devices"] == ["host3/0", "host3/1"]
    page = _dashboard(cluster, "/tensors").text
    assert '<td class="lost">lost: tile [0:131072] on host3/0; tile [131072:262144] on host3/1</td>' in page
    assert '<td class="degraded">replicas lost on host3/0, host3/1</td>' in page
    agents = {a["host"]: a for a in _dashboard(cluster, "/api/cluster").json()}
    assert {a["memory_limit_bytes"] for a in agents.values()} == {LIMIT}

    with pytest.raises(DataLossError, match=r"cannot reshard 'solo' v1: 2 of its tiles lost every copy"):
        client.reshard("solo", _on("host2"))
    with pytest.raises(FailedPreconditionError, match=r"cannot reshard 'mirrored' v1: devices \['host3/0', "
                                                      r"'host3/1'\] lost their shards"):
        client.reshard("mirrored", _on("host2"))
    client.delete("solo")
    client.delete("mirrored")
    client.put("solo", solo, _on("host3", devices=2))  # the new agent holds data as any other
    assert np.array_equal(client.get("solo"), solo)
    client.delete("solo")


def test_a_state_dicts_request_past_grpcs_default_4_mib_reaches_the_planner_and_one_past_its_limit_is_refused(
        cluster, client):
    """A state dict's requests name every tensor (a put_many of 32,000 small tensors: 4.6 MB): 17,000
    names of 256 characters, 4.4 MB, reach the planner, which answers for them (NOT_FOUND, naming the first); a
    request over the planner's 64 MiB is refused by the SDK before it is sent, naming both sizes, and the client and
    planner go on working."""
    names = [f"{i:08d}" + "n" * 248 for i in range(17_000)]
    with pytest.raises(NotFoundError, match=r"no tensor named '00000000n+' to delete \(none of the 17000"):
        client.delete_many(names)
    too_many = [f"{i:08d}" + "n" * 248 for i in range(270_000)]
    with pytest.raises(ResourceExhaustedError, match=r"DeleteTensors request of [0-9,]+ bytes is over the "
                                                     r"67,108,864 bytes a planner takes in one message"):
        client.delete_many(too_many)
    assert sorted(a["host"] for a in client.agents()) == [f"host{i}" for i in range(4)]
