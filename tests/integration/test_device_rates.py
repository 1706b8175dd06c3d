"""Agents measure their devices' compute and memory rates and the planner's cost model prices compute with them."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster


def test_every_agent_reports_measured_rates_and_plans_use_them(client, fresh_name):
    agents = {a["host"]: a for a in client.agents() if a["up"]}
    for a in agents.values():  # a matmul and a copy on a CPU: GFLOP/s and GB/s, far from 0 and from absurd
        assert 0.1 < a["device_gflops"] < 1e5 and 0.1 < a["memory_gb_per_s"] < 1e5, a
    mesh = Mesh.from_hosts({"x": len(agents)}, sorted(agents), 1)
    client.put(fresh_name, np.ones((8, 8), np.float32), Sharding(mesh, ("x", None)))
    try:
        program = client.plan_einsum("ij,jk->ik", fresh_name, fresh_name, out=f"{fresh_name}_sq")
        assert dict(program.topology.host_device_gflops) == {h: a["device_gflops"] for h, a in agents.items()}
        assert dict(program.topology.host_memory_gb_per_s) == {h: a["memory_gb_per_s"] for h, a in agents.items()}
    finally:
        client.delete(fresh_name)


def test_configured_rates_replace_the_measurement_and_price_the_kernel():
    with LocalCluster(1, 1, agent_args=["--device-gflops", "0.5", "--memory-gbps", "100"]) as cluster:
        with cluster.connect() as c:
            (agent,) = c.agents()
            assert (agent["device_gflops"], agent["memory_gb_per_s"]) == (0.5, 100.0)
            mesh = Mesh({"x": 1}, ["host0/0"])
            c.put("a", np.ones((200, 300), np.float32), Sharding(mesh, (None, None)))
            c.put("b", np.ones((300, 100), np.float32), Sharding(mesh, (None, None)))
            program = c.plan_einsum("ij,jk->ik", "a", "b", out="c")
            # arithmetic-bound at 0.5 GFLOP/s: 2 * 200 * 300 * 100 flops, nothing moves, nothing reduces
            assert program.estimate_seconds == pytest.approx(2 * 200 * 300 * 100 / 0.5e9)
