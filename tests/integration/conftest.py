"""Integration fixtures: real planner and agent processes on loopback."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from reshard.client.cluster import LocalCluster

HOSTS = 4
DEVICES_PER_HOST = 2
HEARTBEAT_TIMEOUT_S = 2.0
# Every test on a shared cluster runs once per transport; explicit, so none can fall back to another.
TRANSPORTS = ("grpc", "collective", "nixl")
# A light install (pip install reshard, no torch extra) runs the gRPC third of every such test.
HAS_TORCH = importlib.util.find_spec("torch") is not None
_HERE = Path(__file__).parent


def held_bytes(client) -> dict[str, int]:
    """Every agent's shard bytes, from a heartbeat each agent that is up sent after this call began (what the
    planner knows of an agent's memory comes with its heartbeats, every second by default)."""
    began = time.monotonic()
    while True:
        asked = time.monotonic()
        agents = [a for a in client.agents() if a["up"]]
        if all(asked - a["heartbeat_age_s"] > began for a in agents):
            return {a["host"]: a["memory_used_bytes"] for a in agents}
        assert asked - began < 30, f"no heartbeat from every agent in 30 s: {agents}"
        time.sleep(0.1)


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
    """In make test, an integration test that runs on several transports runs each of its cases on one of them,
    taking the transports in turn; the slow suite (`make bench`) runs every case on every transport. The transports'
    own suites (tests/unit's runtime, delta and ring tests, test_nixl, test_collective) cover what differs between
    them; here a case checks what the service does whatever carries its bytes, and the whole matrix cost make test
    more than it found (186 of its 611 s on the CI-sized machine).

    A test marked ``transports_in_turn(first=...)`` takes its turns from ``first``, its own cases only, so a test of
    one case runs on ``first`` (issue 38 keeps one case of each kind on nixl); the others take turns through their
    module, so a module's single-case tests spread over the transports."""
    cases: dict[tuple, list] = {}  # (scope, test, its other parameters) -> its (transport, item) in make test
    for item, values in params:
        transport = next(iter(values & set(TRANSPORTS)), None)
        if transport is None or _HERE not in item.path.parents or item.get_closest_marker("slow"):
            continue
        marker = item.get_closest_marker("transports_in_turn")
        others = tuple((k, repr(v)) for k, v in sorted(item.callspec.params.items()) if v != transport)
        scope = item.originalname if marker else item.path
        cases.setdefault((scope, item.originalname, others), []).append((transport, item, marker))
    turns: dict = defaultdict(int)
    for (scope, *_), variants in cases.items():
        marker = variants[0][2]
        turn = TRANSPORTS.index(marker.kwargs.get("first", TRANSPORTS[0]) if marker else TRANSPORTS[0]) + turns[scope]
        turns[scope] += 1
        # this case's turn, or the next transport it runs on where that one's variant is slow anyway
        keep = min(variants, key=lambda v: (TRANSPORTS.index(v[0]) - turn) % len(TRANSPORTS))
        for v in variants:
            if v is not keep:
                v[1].add_marker(pytest.mark.slow)


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
def agents_in_process(hosts, devices_per_host: int):
    """(the cluster, {host: Agent}): agents ``hosts`` running gRPC in this process, registered with the planner of a
    `LocalCluster` (one spare agent of its own), so that a test can reach into their stores and drive them with
    signed calls of its own."""
    from reshard.server.agent.service import Agent
    from reshard.server.common.config import AgentConfig

    with LocalCluster(1, 1, host_names=["spare"], transport="grpc") as cluster:
        started = {h: Agent(AgentConfig(h, devices_per_host, cluster.address, transport="grpc", token=cluster.token))
                   for h in hosts}
        for a in started.values():
            a.start()
        try:
            yield cluster, started
        finally:
            for a in started.values():
                a.stop()


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
