"""Faults with real processes: an agent killed mid-reshard, and a client that dies mid-upload."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client import AlreadyExistsError, JobFailedError, NotFoundError
from reshard.client.cluster import LocalCluster

from .conftest import TRANSPORTS, reshard_in_flight
from .every_device import assert_every_device

RATE_MIB_S = 8  # every agent sends at most this fast, so a kill lands mid-transfer
UPLOAD_TIMEOUT_S = 2.0


# The collective cluster (a process group: 15 s to start, kill an agent in, and stop) runs in the slow suite (make
# bench); make test keeps the same tests on gRPC and nixl, well under its 10 minutes.
@pytest.fixture(scope="module", params=[pytest.param(t, marks=pytest.mark.slow) if t == "collective" else t
                                        for t in TRANSPORTS])
def slow_cluster(request):
    with LocalCluster(4, 2, agent_args=["--rate-limit-mib-s", str(RATE_MIB_S), "--chunk-mib", "0.25",
                                        "--collective-chunk-mib", "0.25"],
                      planner_args=["--heartbeat-timeout", "2", "--upload-timeout", str(UPLOAD_TIMEOUT_S)],
                      transport=request.param) as cluster:
        with cluster.connect() as c:
            c.cluster = cluster
            yield c


SRC = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", None))
DST = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host2", "host3"], 2), (None, "y"))


@pytest.mark.transports_in_turn(first="nixl")  # issue 38: a killed and a paused receiver on nixl
def test_killed_agent_fails_the_job_and_leaves_the_source(slow_cluster):
    c = slow_cluster
    a = np.random.default_rng(2).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB: about 1 s per sender
    job = reshard_in_flight(c, "victim", a, SRC, DST, "broadcast")
    t0 = time.monotonic()
    c.cluster.kill_agent("host3")
    with pytest.raises(JobFailedError, match=r"host3") as err:
        job.result(timeout=30)
    assert time.monotonic() - t0 < 10, "the job must fail within a bounded time"
    assert "failed" in str(err.value)
    info = c.info("victim")
    assert info.version == 1 and info.sharding == SRC
    assert_every_device(c, "victim", a, SRC)
    # a destination that avoids the dead host works at once
    other = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["host2"], 2), ("y", None))
    c.reshard("victim", other).result(timeout=60)
    assert_every_device(c, "victim", a, other)
    # once the agent is back, the original reshard succeeds: the restarted host's devices hold their tiles too
    c.cluster.start_agent("host3")
    c.reshard("victim", SRC).result(timeout=60)
    c.reshard("victim", DST, "broadcast").result(timeout=60)
    assert_every_device(c, "victim", a, DST)
    c.delete("victim")


_DYING_CLIENT = textwrap.dedent("""
    import os, sys, numpy as np, reshard
    import reshard.client.client as sdk
    from reshard import Mesh, Sharding
    real = sdk.shard_streams
    def dying(shards, chunk_bytes):
        for i, msg in enumerate(real(shards, chunk_bytes)):
            if i == 3:
                os._exit(17)  # the client dies with the upload half sent
            yield msg
    sdk.shard_streams = dying
    c = reshard.connect(sys.argv[1], chunk_bytes=65536)
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2)
    c.put("halfway", np.ones((1024, 256), np.float32), Sharding(mesh, ("x", None)))
""")


# An upload goes from the client to the agents over gRPC whatever the transport; the collective and nixl runs
# repeat it (7 s each of make test's 10 minutes) and run from make bench (pytest -m slow).
UPLOAD_CLUSTERS = pytest.mark.parametrize(
    "slow_cluster", ["grpc", *(pytest.param(t, marks=pytest.mark.slow) for t in ("collective", "nixl"))], indirect=True)


@UPLOAD_CLUSTERS
def test_client_dying_mid_upload_leaves_no_tensor(slow_cluster):
    c = slow_cluster
    proc = subprocess.run([sys.executable, "-c", _DYING_CLIENT, c.address], timeout=60,
                          env={**os.environ, "RESHARD_TOKEN": c.cluster.token})
    assert proc.returncode == 17
    assert "halfway" not in [t.name for t in c.tensors()]
    with pytest.raises(NotFoundError, match="no tensor named 'halfway'"):
        c.get("halfway")
    with pytest.raises(AlreadyExistsError, match="'halfway' is being uploaded"):
        c.put("halfway", np.zeros((8, 8), np.float32), SRC)
    time.sleep(UPLOAD_TIMEOUT_S + 1.5)  # the planner expires the idle upload and drops its staged shards
    b = np.arange(64, dtype=np.float32).reshape(8, 8)
    c.put("halfway", b, SRC)
    assert np.array_equal(c.get("halfway"), b)
    c.delete("halfway")


# the collective run takes 16 s of make test's 10 minutes: it runs from make bench (pytest -m slow)
@pytest.mark.parametrize("transport", [pytest.param(t, marks=pytest.mark.slow) if t == "collective" else t
                                       for t in TRANSPORTS])
@pytest.mark.transports_in_turn(first="nixl")  # issue 38: a middle hop that corrupts a byte, on nixl
def test_a_relay_that_corrupts_a_chunk_fails_the_job_at_the_chain_end(tmp_path, transport):
    """Forwarding hops count bytes but leave the digest to the last hop: a bit flipped on a middle hop
    (in what it keeps and what it forwards) must still fail the job before any host commits."""
    hosts = ["host0", "host1", "host2", "host3"]
    src = Sharding(Mesh.from_hosts({"x": 1}, hosts[:1], 1), (None,))
    dst = Sharding(Mesh.from_hosts({"x": 3}, hosts[1:], 1), (None,))
    a = np.random.default_rng(5).integers(0, 2**31, (1024, 1024), dtype=np.int32)
    with LocalCluster(4, 1, log_dir=str(tmp_path), transport=transport,
                      agent_args=["--fault", "corrupt-relay", "--chunk-mib", "1", "--collective-chunk-mib", "1"]
                      ) as cluster, cluster.connect() as c:
        c.put("relayed", a, src)
        plan = c.plan("relayed", dst, "broadcast")
        (t,) = plan.transfers
        assert t.method == "broadcast" and len(t.route) == 3, plan  # two hops forward, the third keeps
        chain = " -> ".join(["host0", *t.route])
        with pytest.raises(JobFailedError, match=rf"XXH3-64 .* the bytes changed somewhere on the chain "
                                                 rf"{chain}, so the job fails and no host commits them"):
            c.reshard("relayed", dst, "broadcast").result(timeout=60)
        info = c.info("relayed")
        assert info.version == 1 and info.sharding == src
        assert np.array_equal(c.get("relayed"), a)
        # a delivery with no relaying hop is untouched by the fault and succeeds on the same agents
        one = Sharding(Mesh.from_hosts({"x": 1}, hosts[2:3], 1), (None,))
        c.reshard("relayed", one).result(timeout=60)
        assert np.array_equal(c.get("relayed"), a)


@UPLOAD_CLUSTERS
def test_an_upload_slower_than_the_idle_timeout_is_kept_alive_while_bytes_flow(slow_cluster, monkeypatch):
    """The planner only sees an upload begin and finish; agents report the shard streams they are receiving
    with every heartbeat, so one long shard does not expire mid-stream."""
    import reshard.client.client as sdk

    real = sdk.shard_streams

    def slow(shards, chunk_bytes):
        for msg in real(shards, chunk_bytes):
            time.sleep(0.25)  # 12 chunks: 3 s of streaming against a 2 s idle timeout
            yield msg

    monkeypatch.setattr(sdk, "shard_streams", slow)
    c = slow_cluster
    one = Sharding(Mesh.from_hosts({"x": 1}, ["host1"], 1), (None,))
    b = np.arange(10 * 1024, dtype=np.float32).reshape(10, 1024)  # 10 chunks of 4 KiB, header and trailer
    t0 = time.monotonic()
    with c.cluster.connect(chunk_bytes=4096) as slow_client:
        slow_client.put("long_upload", b, one)
    assert time.monotonic() - t0 > UPLOAD_TIMEOUT_S + 0.5
    assert np.array_equal(c.get("long_upload"), b)
    c.delete("long_upload")
