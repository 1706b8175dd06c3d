"""Agents started with ``--trace-dir`` write a line per task they run (``reshard.server.agent.trace``), and
``python -m reshard.server.devtools.task_trace`` reads them back per host: real planner and agent processes.

A replicated tensor broadcast to three other hosts (a chain on the collective transport) shows up as its sender's
sends and each receiver's receives, with the job's id, its bytes and times in order; a quantize on the way shows as
its kernels on the host that runs them; an agent without the flag writes nothing (tests/unit/test_task_trace.py reads
made-up lines, and a directory an agent cannot write).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.server.devtools.task_trace import format_trace, job_trace, read

HOSTS = ["host0", "host1", "host2", "host3"]


def test_a_traced_broadcast_shows_each_hosts_sends_receives_and_times(tmp_path):
    trace = tmp_path / "trace"
    a = np.arange(256 * 1024, dtype=np.float32).reshape(512, 512)
    src = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    dst = Sharding(Mesh.from_hosts({"x": 3}, HOSTS[1:], 1), (None, None))
    with LocalCluster(host_names=HOSTS, devices_per_host=1, transport="collective",
                      agent_args=["--trace-dir", str(trace)]) as cluster, cluster.connect() as c:
        c.put("w", a, src)
        result = c.reshard("w", dst).result(timeout=60)
        assert result.state == "succeeded"
        assert np.array_equal(c.get("w"), a)
    records, bad = read(trace)
    assert bad == 0
    assert sorted(p.name for p in trace.iterdir()) == [f"{h}.jsonl" for h in HOSTS]
    mine = [r for r in records if r["job"] == result.id]
    sends = [r for r in mine if r["role"] == "send"]
    recvs = [r for r in mine if r["role"] == "recv"]
    assert {r["host"] for r in sends} == {"host0"}
    assert {r["host"] for r in recvs} == set(HOSTS[1:])  # every receiver, the chain's middle hops included
    assert all(r["tensor"] == "w" and r["ok"] and r["start"] <= r["end"] for r in mine)
    assert sum(r["bytes"] for r in sends) == a.nbytes
    assert all(r["peer"] in HOSTS for r in recvs)
    summary = job_trace(records, result.id[:8])
    assert [p.host for p in summary.hosts] == HOSTS
    assert summary.hosts[0].first_send is not None and summary.hosts[0].sent_bytes == a.nbytes
    assert all(p.first_send is None and p.tasks >= 1 for p in summary.hosts[1:])
    text = format_trace(summary)
    assert f"job {result.id}" in text and all(h in text for h in HOSTS)
    # the command line prints the same table
    out = subprocess.run([sys.executable, "-m", "reshard.server.devtools.task_trace", str(trace), "--job",
                          result.id], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert f"job {result.id}" in out.stdout


def test_a_quantize_on_the_way_shows_its_kernels_and_an_untraced_agent_writes_nothing(tmp_path, monkeypatch):
    trace = tmp_path / "trace"
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((256, 256)) * 0.02).astype(np.float32)
    src = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    dst = Sharding(Mesh.from_hosts({"x": 1}, ["host1"], 1), (None, None))
    with LocalCluster(host_names=HOSTS[:2], devices_per_host=1, transport="grpc",
                      agent_args=["--trace-dir", str(trace)]) as cluster, cluster.connect() as c:
        c.put("w", x, src)
        result = c.reshard_many({"w": dst}, dtype="float8_e4m3fn", scales={"w": "w.scale"}).result(timeout=60)
        assert result.state == "succeeded"
    records, _ = read(trace)
    kernels = {r["kernel"] for r in records if r["job"] == result.id and r["role"] == "compute"}
    assert {"fp8_scales", "fp8_quantize_scaled"} <= kernels or "fp8_quantize" in kernels
    summary = job_trace(records)
    assert summary.job == result.id  # the job that ended last
    assert sum(p.compute_s for p in summary.hosts) > 0
    # no flag, no file: agents started in an empty directory leave no trace there
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    monkeypatch.chdir(quiet)
    with LocalCluster(host_names=HOSTS[:2], devices_per_host=1, transport="grpc") as cluster, cluster.connect() as c:
        c.put("w", x, src)
        assert c.reshard("w", dst).result(timeout=60).state == "succeeded"
    assert not list(quiet.rglob("*.jsonl"))
