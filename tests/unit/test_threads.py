"""Agents sharing a machine cap their kernels' threads (`reshard.server.agent.threads`)."""

import json
import subprocess
import sys

import pytest

from reshard.client.cluster import share_of_cores
from reshard.server.common.config import AgentConfig

_PROBE = """
import json, sys
import numpy, torch
from threadpoolctl import threadpool_info
from reshard.server.agent.threads import limit_compute_threads
limit_compute_threads(int(sys.argv[1]))
print(json.dumps({"blas": [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"],
                  "torch": torch.get_num_threads()}))
"""


def _threads(limit: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(limit)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_limit_caps_blas_and_torch_threads_in_the_process():
    got = _threads(1)
    assert got["blas"] and set(got["blas"]) == {1}
    assert got["torch"] == 1


def test_no_limit_leaves_the_libraries_defaults():
    import os

    got = _threads(0)
    if (os.cpu_count() or 1) > 1:
        assert max(got["blas"]) > 1


def test_agents_share_the_cores_and_each_gets_one_at_least():
    import os

    cores = os.cpu_count() or 1
    assert share_of_cores(1) == cores
    assert share_of_cores(cores * 4) == 1
    assert share_of_cores(0) == cores


def test_a_negative_thread_count_is_refused():
    with pytest.raises(ValueError, match="compute_threads must be 0"):
        AgentConfig("h", 1, "127.0.0.1:1", compute_threads=-1)
    out = subprocess.run([sys.executable, "-m", "reshard.server.cli", "agent", "--planner", "127.0.0.1:1", "--host",
                          "h", "--devices", "1", "--compute-threads", "-2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--compute-threads" in out.stderr and "'-2' is not a whole number" in out.stderr


def test_a_local_cluster_gives_each_agent_its_share_unless_told():
    from reshard.client.cluster import LocalCluster

    shared = LocalCluster(hosts=4, devices_per_host=1)
    assert shared.agent_args[-2:] == ["--compute-threads", str(share_of_cores(4))]
    told = LocalCluster(hosts=4, devices_per_host=1, agent_args=["--compute-threads=3"])
    assert told.agent_args.count("--compute-threads") == 0 and "--compute-threads=3" in told.agent_args
