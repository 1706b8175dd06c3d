"""A planner killed with SIGKILL and restarted with its ``--state`` while the agents run on (issue 37).

The restarted planner hosts a new rendezvous store and numbers process group generations on from its state; the
agents, which the new planner does not know, leave the dead planner's group as they register again. So the first
collective job after a restart runs on a group formed through the new store, and succeeds, also when a job was in
flight at the kill. Real processes throughout: a planner, two agents on the collective transport, a client.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster, start_process

pytest.importorskip("torch")

HOSTS = ("host0", "host1")
RESTARTS = 4
MESH = Mesh.from_hosts({"x": 4}, list(HOSTS), 2)
LAYOUTS = (Sharding(MESH, ("x",)), Sharding(MESH, (None,)))  # S(x) and R: each reshard moves bytes between hosts


def _restart_planner(cluster: LocalCluster, args: list[str], log: str) -> None:
    """SIGKILL the planner, then start it again on the same address with the same arguments (and state file)."""
    cluster.planner.kill()
    cluster.planner.wait()
    cluster.planner.stdout.close()
    cmd = [sys.executable, "-m", "reshard.server.cli", "planner", "--listen", cluster.address, "--token-file",
           str(cluster.token_file), *args]
    cluster.planner, address = start_process(cmd, cluster.log_dir / log, cluster.startup_timeout_s)
    assert address == cluster.address
    cluster.wait_ready()  # every agent registered again and in the group the new planner wants


@pytest.mark.slow  # restarts a planner with a process group several times (14 s): make bench runs it
def test_the_first_collective_job_after_a_planner_restart_succeeds(tmp_path):
    args = ["--state", str(tmp_path / "state.db"), "--heartbeat-timeout", "3"]
    original = np.arange(1 << 20, dtype=np.float32)
    with LocalCluster(len(HOSTS), 2, host_names=HOSTS, transport="collective", planner_args=args,
                      log_dir=str(tmp_path / "logs")) as cluster:
        with cluster.connect() as c:
            c.put("w", original, LAYOUTS[0])
            assert c.reshard("w", LAYOUTS[1]).result(timeout=60).transport == "collective"
        for restart in range(RESTARTS):
            if restart % 2:  # a job in flight at the kill, every other time
                with cluster.connect() as c:
                    c.reshard("w", LAYOUTS[0] if c.info("w").sharding == LAYOUTS[1] else LAYOUTS[1])
            _restart_planner(cluster, args, f"planner-{restart + 1}.log")
            with cluster.connect() as c:  # a client of the new planner (the old one's channel backs off a while)
                before = c.info("w")
                target = LAYOUTS[0] if before.sharding == LAYOUTS[1] else LAYOUTS[1]
                result = c.reshard("w", target).result(timeout=60)  # the first job after the restart
                assert (result.state, result.transport) == ("succeeded", "collective"), result.error
                after = c.info("w")
                assert (after.version, after.sharding) == (before.version + 1, target)
                np.testing.assert_array_equal(c.get("w"), original)
