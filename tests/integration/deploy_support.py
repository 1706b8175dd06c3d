"""Deployment files run without their orchestrator: each container's command as a local process on loopback.

Shared by the compose and Kubernetes tests: the command translation they have in common, the
health checks an orchestrator makes before it starts what depends on a service, and the reshard a
client runs through the result.
"""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reshard import Mesh, Sharding
from reshard.box import to_slices
from reshard.client import Client
from reshard.proto.auth import TlsFiles, channel

STARTUP_TIMEOUT_S = 120.0  # a limit, not a wait: under a load of 20 on two cores three processes took 60 s
STOP_TIMEOUT_S = 30.0  # Kubernetes' default grace period
_READY = re.compile(r"listening on (\S+)")  # the line services print once they serve


class FreePorts:
    """Distinct free ports on one loopback address: every socket stays bound until all are chosen."""

    def __init__(self, host: str = "127.0.0.1"):
        self._host = host
        self._held: list[socket.socket] = []

    def __call__(self) -> int:
        s = socket.socket()
        s.bind((self._host, 0))
        self._held.append(s)
        return s.getsockname()[1]

    def release(self) -> None:
        for s in self._held:
            s.close()


def local(command: list[str]) -> list[str]:
    """A container's ``reshard ...`` command as this interpreter runs it."""
    assert command[0] == "reshard", f"containers run the reshard CLI; got {command}"
    return [sys.executable, "-m", "reshard.server.cli", *command[1:]]


def light_image_environment(folder: Path) -> dict[str, str]:
    """This environment as the light image's (``pip install reshard``, no torch: the Dockerfile's default) is for
    a process of this interpreter: a ``sitecustomize`` in ``folder`` marks torch as absent before anything runs,
    so ``import torch`` fails and `importlib.util.find_spec` says it is not installed, as in that image."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text('import sys\n\nsys.modules["torch"] = None  # the light image\n')
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


class Processes:
    """Processes started for one test, stopped (SIGTERM, as an orchestrator does) when it ends."""

    def __init__(self, log_dir: Path, startup_timeout_s: float = STARTUP_TIMEOUT_S, light_image: bool = False):
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        # light_image: the processes run without torch, as in the image the Dockerfile builds by default
        self.env = light_image_environment(log_dir / "light-image") if light_image else None
        self._procs: list[subprocess.Popen] = []

    def start(self, commands: dict[str, list[str]]) -> dict[str, str]:
        """Start every command at once, as an orchestrator starts the replicas of a service; returns the
        address each says it listens on. Started from this thread: a child that asks to die with its
        parent dies with the thread that started it."""
        started = {}
        for name, command in commands.items():
            with open(self.log_dir / f"{name.replace('/', '-')}.log", "ab") as log:
                started[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log,
                                                 stdin=subprocess.DEVNULL, env=self.env)
            self._procs.append(started[name])
        addresses: dict[str, str] = {}
        deadline = time.monotonic() + self.startup_timeout_s
        while len(addresses) < len(started):
            waiting = {p.stdout: name for name, p in started.items() if name not in addresses}
            for name in waiting.values():
                code = started[name].poll()
                log = self.log_dir / f"{name.replace('/', '-')}.log"
                assert code is None, f"{name} exited {code}; log {log}:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{sorted(waiting.values())} did not start in {self.startup_timeout_s} s"
            for out in select.select(list(waiting), [], [], 0.1)[0]:
                m = _READY.search(out.readline().decode(errors="replace"))
                if m:
                    addresses[waiting[out]] = m.group(1)
        return addresses

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # the orchestrator's SIGKILL after its grace period
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()


def wait_serving(address: str, service: str = "", tls: Optional[TlsFiles] = None,
                 timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Poll the gRPC health service at ``address`` until ``service`` is SERVING, as a probe would."""
    deadline = time.monotonic() + timeout
    last = ""
    with channel(address, tls=tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(0.05)
    raise AssertionError(f"{address} never reported {service or 'the server'} SERVING: {last}")


def run_checks(commands: list[list[str]]) -> None:
    """Run health-check commands side by side; each must exit 0."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    for c, p in zip(commands, procs):
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, f"{c} exited {p.returncode}: {out}"


def wait_devices(c: Client, expected: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while sorted(c.devices()) != sorted(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(c.devices()) == sorted(expected)


def reshard_through(c: Client, name: str, src_hosts: list[str], dst_hosts: list[str], devices_per_host: int) -> None:
    """Put a tensor split over ``src_hosts``, reshard it onto ``dst_hosts`` and read it back, bit for bit."""
    n = len(src_hosts) * devices_per_host
    src = Sharding(Mesh.from_hosts({"x": n}, src_hosts, devices_per_host), ("x",))
    dst = Sharding(Mesh.from_hosts({"x": n}, dst_hosts, devices_per_host), (None, "x"))
    a = np.random.default_rng(7).standard_normal((4 * n + 1, 3 * n + 2)).astype(np.float32)
    c.put(name, a, src)
    c.reshard(name, dst, "auto").result(timeout=60)
    assert np.array_equal(c.get(name), a)
    device = f"{dst_hosts[-1]}/{devices_per_host - 1}"
    assert np.array_equal(c.get_shard(name, device), a[to_slices(dst.tile(a.shape, device))])
