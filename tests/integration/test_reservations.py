"""Memory an agent reserves for a job belongs to the job on every host it runs on, and ends with it (issue 37,
defect 3): on the hosts that commit (Commit), after a failure (Abort), and on a host that only sends, when its run
ends. Before, a sending-only host kept its bucket buffers' reservation for good, so a weight sync run every step
filled the agent's --memory-limit within a few steps and then every reshard_many failed.

One cluster of two single-device hosts, each agent limited to 4 MiB: four tensors of 256 KiB (1 MiB in all, one
bucket of 1 MiB) moved from one host to the other and back, 50 times.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import channel

MiB = 2**20
LIMIT = 4 * MiB
NAMES = [f"w{i}" for i in range(4)]
ROUND_TRIPS = 50


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(2, 1, transport="grpc", log_dir=str(tmp_path_factory.mktemp("reservations")),
                      agent_args=["--memory-limit", "4MiB"]) as cluster:
        yield cluster


def _on(host: str) -> Sharding:
    return Sharding(Mesh.from_hosts({"x": 1}, [host], 1), ("x", None))


def _memory_used(cluster, host: str, since: float) -> int:
    """``host``'s agent's memory in use (committed, staged and reserved bytes), from a heartbeat sent after
    ``since`` (time.monotonic())."""
    planner = pb_grpc.PlannerStub(channel(cluster.address, token=cluster.token))
    deadline = time.monotonic() + 10
    while True:
        now = time.monotonic()
        info = next(a for a in planner.ListAgents(pb.Empty(), timeout=10).agents if a.host == host)
        assert info.memory_limit_bytes == LIMIT
        if now - info.heartbeat_age_s > since:
            return info.memory_used_bytes
        assert now < deadline, f"no heartbeat from {host} for 10 s"
        time.sleep(0.1)


def test_reshard_many_back_and_forth_gives_back_every_reservation(cluster):
    rng = np.random.default_rng(3)
    data = {name: rng.standard_normal((256, 256)).astype(np.float32) for name in NAMES}  # 256 KiB each
    with cluster.connect() as c:
        c.put_many({name: (array, _on("host0")) for name, array in data.items()})
        before = {h: _memory_used(cluster, h, time.monotonic()) for h in ("host0", "host1")}
        assert before == {"host0": MiB, "host1": 0}
        for _ in range(ROUND_TRIPS):
            for host in ("host1", "host0"):
                c.reshard_many({name: _on(host) for name in NAMES}, bucket_mib=1).result(timeout=60)
        after = {h: _memory_used(cluster, h, time.monotonic()) for h in ("host0", "host1")}
        # the tensors are back on host0, and host1 holds only the version the last job moved from: with the one it
        # moved to, the delta base pair of the next sync (issue 40); no job's reservation is left anywhere
        assert after == {"host0": MiB, "host1": MiB}
        assert all([v.delta_base for v in c.versions(name)] == [True, True] for name in NAMES)
        got = c.get_many(NAMES)
        assert all(np.array_equal(got[name], data[name]) for name in NAMES)
        assert all(c.info(name).version == 1 + 2 * ROUND_TRIPS for name in NAMES)
        for name in NAMES:
            c.delete(name)
        deadline = time.monotonic() + 10  # a delete frees the base pair too, as its releases reach the agents
        while (gone := {h: _memory_used(cluster, h, time.monotonic()) for h in ("host0", "host1")}) != \
                {"host0": 0, "host1": 0} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone == {"host0": 0, "host1": 0}
