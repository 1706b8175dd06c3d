"""``reshard planner --no-rendezvous``: a planner whose agents all run gRPC hosts no process-group store and never
imports torch (a local cluster on ``transport="grpc"`` starts its planner so); agents that want a group are told why
they cannot have one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.proto.errors import UnavailableError

from .test_listen import listening_sockets


def _maps_torch(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc/PID/maps (Linux) to see which libraries a process loaded")
    return "libtorch" in maps.read_text()


def test_a_grpc_cluster_s_planner_imports_no_torch_and_refuses_an_agent_that_wants_a_group(tmp_path):
    with LocalCluster(2, 1, transport="grpc", log_dir=str(tmp_path)) as cluster, cluster.connect() as c:
        assert "--no-rendezvous" in cluster.planner_args
        assert not _maps_torch(cluster.planner.pid)
        # its gRPC port is the only one it listens on: no store port to fence (docs/security.md)
        port = int(cluster.address.rsplit(":", 1)[1])
        assert [p for _, _, p in listening_sockets([cluster.planner.pid])] == [port]
        a = np.arange(64, dtype=np.float32).reshape(8, 8)
        mesh = Mesh.from_hosts({"x": 2}, ["host0", "host1"], 1)
        c.put("t", a, Sharding(mesh, ("x", None)))
        c.reshard("t", Sharding(mesh, (None, "x"))).result(timeout=60)
        assert np.array_equal(c.get("t"), a)
        # An agent that insists on the collective transport is refused at registration, naming the flag (one on
        # auto runs gRPC and is told why: tests/unit/test_membership.py).
        with pytest.raises(UnavailableError, match=r"asks for the collective transport, but this planner hosts no "
                                                   r"rendezvous store \(it runs with --no-rendezvous\)"):
            cluster.start_agent("host3", extra_args=["--transport", "collective"])
        assert [(x["host"], x["up"]) for x in c.agents()] == [("host0", True), ("host1", True)]  # never shown as up
        assert np.array_equal(c.get("t"), a) and not _maps_torch(cluster.planner.pid)
