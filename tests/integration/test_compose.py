"""docker-compose.yml, run without Docker: each service's exact command as a local process.

Compose service addresses (``agent0:50052``) and in-container binds
(``0.0.0.0:50052``) are translated to distinct loopback ports; paths under
``/var/lib/reshard`` to a temporary folder. Nothing else in the commands changes.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from reshard import Mesh, Sharding
from reshard.client import Client, UnauthenticatedError
from reshard.client.cluster import start_process

ROOT = Path(__file__).resolve().parents[2]


class _FreePorts:
    """Distinct free loopback ports: every socket stays bound until all are chosen, so none repeats."""

    def __init__(self):
        self._held: list[socket.socket] = []

    def __call__(self) -> int:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self._held.append(s)
        return s.getsockname()[1]

    def release(self) -> None:
        for s in self._held:
            s.close()


def translate(services: dict, tmp: Path) -> dict[str, list[str]]:
    """Each service's command with compose addresses mapped to loopback ports."""
    ports: dict[tuple[str, str], int] = {}
    _free_port = _FreePorts()
    for name in sorted(services):
        for arg in services[name]["command"]:
            for svc, port in re.findall(r"\b([a-z][\w-]*):(\d+)\b", arg):
                if svc in services:
                    ports.setdefault((svc, port), _free_port())
            for port in re.findall(r"\b0\.0\.0\.0:(\d+)", arg):
                ports.setdefault((name, port), _free_port())
    _free_port.release()
    out = {}
    for name, svc in services.items():
        cmd = []
        for arg in svc["command"]:
            arg = re.sub(r"\b0\.0\.0\.0:(\d+)", lambda m: f"127.0.0.1:{ports[(name, m.group(1))]}", arg)
            arg = re.sub(r"\b([a-z][\w-]*):(\d+)\b",
                         lambda m: f"127.0.0.1:{ports[(m.group(1), m.group(2))]}" if m.group(1) in services else m.group(0),
                         arg)
            cmd.append(arg.replace("/var/lib/reshard", str(tmp)).replace("/run/secrets", str(tmp)))
        assert cmd[0] == "reshard"
        out[name] = [sys.executable, "-m", "reshard.server.cli", *cmd[1:]]
    return out


def test_compose_services_run_a_reshard(tmp_path):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert sorted(services) == ["agent0", "agent1", "agent2", "agent3", "planner"]
    assert all(s.get("build") == "." for s in services.values())
    assert (ROOT / "Dockerfile").exists()
    assert services["planner"]["secrets"] == ["admin_token", "cluster_token"]
    assert all(services[f"agent{i}"]["secrets"] == ["cluster_token"] for i in range(4))
    assert {"admin_token", "cluster_token"} <= set(compose["secrets"])
    token = "compose-test-token"
    (tmp_path / "admin_token").write_text(token)
    cluster_token = "compose-cluster-token-0123456789"
    (tmp_path / "cluster_token").write_text(cluster_token + "\n")  # as `openssl rand -hex 24 >` writes it
    commands = translate(services, tmp_path)
    web = commands["planner"][commands["planner"].index("--http") + 1]
    procs = []
    try:
        planner, address = start_process(commands.pop("planner"), tmp_path / "planner.log", 60)
        procs.append(planner)
        for name in sorted(commands):
            procs.append(start_process(commands[name], tmp_path / f"{name}.log", 60)[0])
        with Client(address, token=cluster_token) as c:
            deadline = time.monotonic() + 30
            while len(c.devices()) < 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.devices() == [f"agent{h}/{d}" for h in range(4) for d in range(4)]
            src = Sharding(Mesh.from_hosts({"x": 2, "y": 4}, ["agent0", "agent1"], 4), ("x", "y"))
            dst = Sharding(Mesh.from_hosts({"x": 2, "y": 4}, ["agent2", "agent3"], 4), (None, ("x", "y")))
            a = np.random.default_rng(3).standard_normal((33, 65)).astype(np.float32)
            c.put("compose", a, src)
            c.reshard("compose", dst, "auto").result(timeout=60)
            assert np.array_equal(c.get("compose"), a)
        with Client(address, token=None) as stranger:
            with pytest.raises(UnauthenticatedError, match="needs the cluster token"):
                stranger.tensors()
        assert (tmp_path / "state.db").exists()
        base = f"http://{web}"
        assert httpx.get(f"{base}/api/tensors", timeout=30).status_code == 401
        tensors = httpx.get(f"{base}/api/tensors", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
        assert [t["name"] for t in tensors] == ["compose"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
            if p.stdout:
                p.stdout.close()
