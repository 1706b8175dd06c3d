"""Integration fixtures: real planner and agent processes on loopback."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import time

import pytest

from reshard.client.cluster import LocalCluster

HOSTS = 4
DEVICES_PER_HOST = 2
HEARTBEAT_TIMEOUT_S = 2.0
# Every test on a shared cluster runs once per transport; explicit, so none can fall back to another.
TRANSPORTS = ("grpc", "collective", "nixl")
# A light install (pip install reshard, no torch extra) runs the gRPC third of every such test.
HAS_TORCH = importlib.util.find_spec("torch") is not None


def held_bytes(client) -> dict[str, int]:
    """Every agent's shard bytes, once its heartbeats (every second) have reported the same twice running."""
    seen = None
    while True:
        now = {a["host"]: a["memory_used_bytes"] for a in client.agents()}
        if now == seen:
            return now
        seen = now
        time.sleep(1.2)


def _nixl_missing() -> str | None:
    """Why the nixl transport cannot run here (its own words, ending with the install), or None."""
    if not HAS_TORCH:
        return "the nixl transport comes with torch: pip install 'reshard[nixl]'"
    from reshard.server.transport.nixl import nixl_missing

    return nixl_missing()


def pytest_collection_modifyitems(items):
    # a transport is a str parameter; others may be arrays, whose `in` compares element by element
    params = [(item, {v for v in getattr(getattr(item, "callspec", None), "params", {}).values()
                      if isinstance(v, str)}) for item in items]
    if not HAS_TORCH:
        skip = pytest.mark.skip(reason="the collective transport needs torch: pip install 'reshard[torch]'")
        for item, values in params:
            if "collective" in values:
                item.add_marker(skip)
    # A slow test whose behaviour the transport does not change runs on grpc in make test, the others in the slow
    # suite (`make bench`).
    for item, values in params:
        if item.get_closest_marker("grpc_in_make_test") and values & {"collective", "nixl"}:
            item.add_marker(pytest.mark.slow)
    _transports_in_turn(params)
    uses_nixl = [item for item, values in params if "nixl" in values]
    missing = _nixl_missing() if uses_nixl else None
    if missing:
        skip = pytest.mark.skip(reason=missing)
        for item in uses_nixl:
            item.add_marker(skip)


def _transports_in_turn(params) -> None:
    """A test marked ``transports_in_turn`` runs each of its cases on one transport in make test, taking the
    transports in turn from the marker's ``first`` (default grpc), and every case on every transport in the slow
    suite: for cases whose behaviour the transport does not change, where all of them on every transport would
    cost make test more than they find."""
    turns: dict[tuple, int] = {}
    for item, values in params:
        marker = item.get_closest_marker("transports_in_turn")
        transport = next(iter(values & set(TRANSPORTS)), None)
        if marker is None or transport is None:
            continue
        others = tuple((k, repr(v)) for k, v in sorted(item.callspec.params.items()) if v != transport)
        case = turns.setdefault((item.originalname, others), sum(k[0] == item.originalname for k in turns))
        first = TRANSPORTS.index(marker.kwargs.get("first", TRANSPORTS[0]))
        if TRANSPORTS[(first + case) % len(TRANSPORTS)] != transport:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", params=TRANSPORTS)
def cluster(request):
    """One planner and 4 agents x 2 devices, shared by the tests that leave it healthy."""
    # Every program is cut per host (the default cuts those of a megabyte or more), so that every test on this
    # cluster runs each agent on its own slice (`reshard.host_slice`); clusters of their own run the default.
    with LocalCluster(HOSTS, DEVICES_PER_HOST, planner_args=["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                                                             "--slice-program-bytes", "0"],
                      transport=request.param) as c:
        yield c


@pytest.fixture()
def client(cluster):
    with cluster.connect() as c:
        c.cluster = cluster
        yield c


@pytest.fixture()
def fresh_name(request):
    """A tensor name unique to the test, deleted afterwards if it exists."""
    return request.node.name.replace("[", "_").replace("]", "").replace("-", "_")


@contextlib.contextmanager
def reshard_up(*args: str):
    """``reshard up ARGS`` as a user runs it; yields the process and its output up to the "Ctrl-C" line."""
    proc = subprocess.Popen([sys.executable, "-m", "reshard.server.cli", "up", *args], stdout=subprocess.PIPE,
                            text=True)
    try:
        lines = []
        while not any("Ctrl-C" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "reshard up exited early"
            lines.append(line)
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def reshard_in_flight(c, name: str, array, src, dst, strategy: str):
    """Put ``array`` as ``name`` in ``src`` and start its reshard to ``dst``; returns the job once bytes flow,
    with bytes still to send (the agents must be rate-limited), so that a fault injected next lands mid-transfer."""
    c.put(name, array, src)
    job = c.reshard(name, dst, strategy)
    deadline = time.monotonic() + 30
    while job.progress()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    done, total = job.progress()
    assert 0 < done < total, f"the fault must land mid-transfer; {done} of {total} bytes were sent"
    return job
