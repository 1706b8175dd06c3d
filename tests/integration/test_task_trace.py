"""Agents started with ``--trace-dir`` write a line per task they run (``reshard.server.agent.trace``), and
``python -m reshard.server.devtools.task_trace`` reads them back per host: real planner and agent processes.

A tensor on one host broadcast to two others (a chain on the nixl transport, whose lanes run receives as tasks)
shows up as its sender's sends and each receiver's receives, with the job's id, its bytes and times in order; a
quantize on the way, in the same cluster, as its kernels on the host that runs them; an agent without the flag
writes nothing (tests/unit/test_task_trace.py reads made-up lines, and a directory an agent cannot write).
"""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.server.devtools.task_trace import format_trace, job_trace, read

from .conftest import _nixl_missing

NIXL_MISSING = _nixl_missing()

HOSTS = ["host0", "host1", "host2"]


@pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))
def test_a_traced_broadcast_and_quantize_show_each_hosts_sends_receives_kernels_and_times(tmp_path):
    trace = tmp_path / "trace"
    a = np.arange(256 * 1024, dtype=np.float32).reshape(512, 512)
    x = (np.random.default_rng(0).standard_normal((256, 256)) * 0.02).astype(np.float32)
    src = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    dst = Sharding(Mesh.from_hosts({"x": 2}, HOSTS[1:], 1), (None, None))
    with LocalCluster(host_names=HOSTS, devices_per_host=1, transport="nixl",
                      agent_args=["--trace-dir", str(trace)]) as cluster, cluster.connect() as c:
        c.put("w", a, src)
        result = c.reshard("w", dst).result(timeout=60)
        assert result.state == "succeeded"
        assert np.array_equal(c.get("w"), a)
        c.put("x", x, src)
        quantized = c.reshard_many({"x": dst}, dtype="float8_e4m3fn", scales={"x": "x.scale"}).result(timeout=60)
        assert quantized.state == "succeeded"
    records, bad = read(trace)
    assert bad == 0
    assert sorted(p.name for p in trace.iterdir()) == [f"{h}.jsonl" for h in HOSTS]
    mine = [r for r in records if r["job"] == result.id]
    sends = [r for r in mine if r["role"] == "send"]
    recvs = [r for r in mine if r["role"] == "recv"]
    assert {r["host"] for r in sends} == {"host0"}
    assert {r["host"] for r in recvs} == set(HOSTS[1:])  # every receiver, the chain's middle hop included
    assert all(r["tensor"] == "w" and r["ok"] and r["start"] <= r["end"] for r in mine)
    assert sum(r["bytes"] for r in sends) == a.nbytes
    assert all(r["peer"] in HOSTS for r in recvs)
    summary = job_trace(records, result.id[:8])
    assert [p.host for p in summary.hosts] == HOSTS
    assert summary.hosts[0].first_send is not None and summary.hosts[0].sent_bytes == a.nbytes
    assert all(p.first_send is None and p.tasks >= 1 for p in summary.hosts[1:])
    text = format_trace(summary)
    assert f"job {result.id}" in text and all(h in text for h in HOSTS)
    # the quantize: its kernels on the sender, the job that ended last
    kernels = {(r["host"], r["kernel"]) for r in records if r["job"] == quantized.id and r["role"] == "compute"}
    assert {("host0", "fp8_scales"), ("host0", "fp8_quantize_scaled")} <= kernels
    last = job_trace(records)
    assert last.job == quantized.id and last.hosts[0].compute_s > 0 and last.hosts[0].last_kernel is not None


def test_an_agent_without_the_flag_writes_no_trace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # agents started in an empty directory leave no trace there
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    with LocalCluster(host_names=["host0"], devices_per_host=2, transport="grpc") as cluster, cluster.connect() as c:
        c.put("w", a, Sharding(Mesh.from_hosts({"x": 2}, ["host0"], 2), ("x", None)))
        assert c.reshard("w", Sharding(Mesh.from_hosts({"x": 2}, ["host0"], 2), (None, "x"))).result(60).state \
            == "succeeded"
    assert not list(tmp_path.rglob("*.jsonl"))
