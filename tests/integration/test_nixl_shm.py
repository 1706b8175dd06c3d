"""Agents of one machine on nixl copy straight into each other's shared tiles, real processes on loopback: the
sender's agent maps the receiver's segments (seen in its ``/proc/<pid>/maps``), a middle hop that corrupts a byte
still fails the chain with DATA_LOSS before any commit, and agents started with ``--nixl-tcp-only`` share nothing."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client import JobFailedError
from reshard.client.cluster import LocalCluster

from .conftest import _nixl_missing

pytestmark = pytest.mark.skipif(bool(_nixl_missing()), reason=str(_nixl_missing()))

HOSTS = ["host0", "host1", "host2", "host3"]
SRC = Sharding(Mesh.from_hosts({"x": 1}, HOSTS[:1], 1), (None,))
ONE = Sharding(Mesh.from_hosts({"x": 1}, HOSTS[1:2], 1), (None,))
CHAIN = Sharding(Mesh.from_hosts({"x": 3}, HOSTS[1:], 1), (None,))


def shared_segments(cluster: LocalCluster, sender: str, receiver: str) -> int:
    """How many of ``receiver``'s shared segments (memfds its agent names ``reshard-<pid>``) ``sender``'s agent maps."""
    with open(f"/proc/{cluster.agents[sender].pid}/maps") as f:
        return sum(f"/memfd:reshard-{cluster.agents[receiver].pid} " in line for line in f)


def test_agents_of_one_machine_copy_into_shared_tiles_and_a_corrupting_middle_hop_still_fails(tmp_path):
    a = np.random.default_rng(38).integers(0, 2**31, (1024, 1024), dtype=np.int32)  # 4 MiB tiles: shared
    with LocalCluster(4, 1, log_dir=str(tmp_path), transport="nixl",
                      agent_args=["--fault", "corrupt-relay", "--collective-chunk-mib", "1"]) as cluster, \
            cluster.connect() as c:
        c.put("w", a, SRC)
        moved = c.reshard("w", ONE, "send_recv").result(timeout=60)  # no relaying hop: the fault leaves it be
        assert moved.transport == "nixl" and moved.network_bytes == a.nbytes
        assert np.array_equal(c.get("w"), a)
        assert shared_segments(cluster, "host0", "host1") == 1  # host1's tile, copied into by host0's agent
        assert shared_segments(cluster, "host0", "host2") == 0  # nothing went there

        c.reshard("w", SRC, "send_recv").result(timeout=60)
        with pytest.raises(JobFailedError, match=r"XXH3-64 .* the bytes changed somewhere on the chain "
                                                 r"host0 -> host1 -> host2 -> host3, so the job fails"):
            c.reshard("w", CHAIN, "broadcast").result(timeout=60)
        assert shared_segments(cluster, "host1", "host2") >= 1  # the chain's hops copied into shared tiles too
        info = c.info("w")
        assert info.version == 3 and info.sharding == SRC  # nothing committed
        assert np.array_equal(c.get("w"), a)


def test_agents_kept_to_tcp_share_no_memory(tmp_path):
    a = np.random.default_rng(39).integers(0, 2**31, (1024, 1024), dtype=np.int32)
    with LocalCluster(2, 1, log_dir=str(tmp_path), transport="nixl", agent_args=["--nixl-tcp-only"]) as cluster, \
            cluster.connect() as c:
        c.put("w", a, SRC)
        moved = c.reshard("w", ONE, "send_recv").result(timeout=60)
        assert moved.transport == "nixl"
        assert np.array_equal(c.get("w"), a)
        assert shared_segments(cluster, "host0", "host1") == 0
        with open(f"/proc/{cluster.agents['host1'].pid}/maps") as f:
            assert "/memfd:reshard-" not in f.read()  # not even its own tiles are shared segments
