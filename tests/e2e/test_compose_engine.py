"""docker-compose.yml on a real Docker engine, deployed by the README's own commands and used from the host.

The README's "On one machine, with Docker Compose" blocks run verbatim in a copy of the checkout: the
compose plugin, then this machine's two settings (no bridge network: the host-network override with
servers on 127.0.0.1; no image registry: a base image built from Debian's packages), then the stack
itself and the NIXL variant. Between them a client on the host puts, reshards with both strategies that
matter (the paper's ``broadcast`` and the default ``auto``) and reads back bit for bit; an agent's process
is killed with SIGKILL and must be restarted by the engine while the planner reports its tiles lost; the
stack is taken down and up again and the planner's catalog must survive in its volume. Every phase's time is
printed. At the end the stack, its volume and its images go, and the engine too if this test started it.

Run with ``make e2e`` (root; Debian's packages and PyPI reachable, no registry needed).
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.box import to_slices
from reshard.client import Client, DataLossError
from reshard.proto.auth import read_token_file

from .engine import Engine, Phases, Shell, copy_checkout, readme_compose_blocks, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROJECT = "reshard-e2e"  # COMPOSE_PROJECT_NAME: its containers and volume, apart from any other stack
PLANNER = "127.0.0.1:61051"
PORTS = (61051, 61052, 61053, 61054, 61055, 61080)  # docker-compose.yml's, all above the ephemeral range
AGENTS = [f"agent{i}" for i in range(4)]
DEVICES = 4
IMAGES = ("reshard:0.1.0", "reshard:0.1.0-nixl")  # docker-compose.yml's and docker/compose.nixl.yml's
HEALTHY_TIMEOUT_S = 180.0


def _ports_in_use() -> list[int]:
    taken = []
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                taken.append(port)
    return taken


def _wait(what: str, ready, timeout: float = HEALTHY_TIMEOUT_S, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(poll)


class Stack:
    """The compose project as the host sees it: its containers through the docker CLI, its planner through the SDK."""

    def __init__(self, sh: Shell):
        self.sh = sh

    def container(self, service: str) -> dict:
        cid = self.sh(f"docker compose ps -q {service}").strip()
        assert cid, f"compose has no container for {service}"
        return json.loads(self.sh(f"docker inspect {cid}"))[0]

    def client(self) -> Client:
        return Client(PLANNER, token=read_token_file(str(self.sh.cwd / "cluster-token.txt")))


def _roundtrip(c: Client, name: str, transport: str) -> np.ndarray:
    """Put 64 MiB split over agent0 and agent1, reshard it by ``broadcast`` to both of agent2 and agent3
    (rows over each host's devices, replicated across the two), then by ``auto`` to columns over every
    device; each step read back bit for bit."""
    a = np.random.default_rng(42).standard_normal((4096, 4096)).astype(np.float32)
    src = Sharding(Mesh.from_hosts({"x": 2 * DEVICES}, AGENTS[:2], DEVICES), ("x", None))
    c.put(name, a, src)
    assert np.array_equal(c.get(name), a)
    both = Sharding(Mesh.from_hosts({"h": 2, "d": DEVICES}, AGENTS[2:], DEVICES), ("d", None))
    spread = Sharding(Mesh.from_hosts({"x": 4 * DEVICES}, AGENTS, DEVICES), (None, "x"))
    for strategy, dst in (("broadcast", both), ("auto", spread)):
        result = c.reshard(name, dst, strategy).result(timeout=300)
        assert result.state == "succeeded", result.error
        assert result.strategy == strategy and result.network_bytes > 0
        assert set(result.transports) - {"local"} == {transport}, result.transports
        assert np.array_equal(c.get(name), a)
        device = f"{AGENTS[-1]}/{DEVICES - 1}"
        assert np.array_equal(c.get_shard(name, device), a[to_slices(dst.tile(a.shape, device))])
    return a


@pytest.mark.timeout(3600)  # the first builds download and install on two busy cores; each step has its own limit
def test_readme_compose_deployment_on_a_real_engine(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    blocks = readme_compose_blocks()
    assert len(blocks) == 4, "the README's compose section has four blocks: plugin, this machine, the stack, NIXL"
    plugin, machine, stack_lines, nixl = blocks
    taken = _ports_in_use()
    assert not taken, f"ports {taken} of docker-compose.yml already serve something: stop it first"
    phases = Phases()
    checkout = copy_checkout(tmp_path / "reshard")
    home = tmp_path / "home"  # the plugin's ~/.docker/cli-plugins, apart from the real home's
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "RESHARD_"))}
    env |= {"HOME": str(home), "COMPOSE_PROJECT_NAME": PROJECT,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # `python` and `pip`: this venv's
    sh = Shell(checkout, env, tmp_path / "commands.log")
    stack = Stack(sh)
    with ExitStack() as cleanup:
        with phases.timed("engine (install if missing, start if not running)"):
            engine = cleanup.enter_context(Engine(tmp_path))
        cleanup.callback(_remove_everything, sh, phases, engine)
        with phases.timed("compose plugin (README)"):
            for line in plugin:
                sh(line)
        assert "Docker Compose version v2" in sh("docker compose version")
        with phases.timed("base image (README: no registry, no bridge)"):
            for line in machine:
                sh(line)
        base = sh.variable("RESHARD_BASE")
        assert base and "docker-compose.yml" in sh.variable("COMPOSE_FILE")
        for line in stack_lines:
            if "compose build" in line:
                with phases.timed("build"):
                    sh(line)
            elif "up -d --wait" in line:
                with phases.timed("up to healthy"):
                    sh(line)
                states = {s: stack.container(s)["State"] for s in ["planner", *AGENTS]}
                assert all(st["Health"]["Status"] == "healthy" for st in states.values()), states
                _check_the_stack(stack, phases)
            elif "compose down" in line:
                with phases.timed("down"):
                    sh(line)
                _check_up_again(stack, sh, phases, next(x for x in stack_lines if "up -d --wait" in x), line)
            elif line.startswith("RESHARD_TOKEN_FILE="):
                with phases.timed("README client line"):
                    out = sh(line)
                assert sorted(ast.literal_eval(out)) == sorted(f"{a}/{d}" for a in AGENTS for d in range(DEVICES))
            else:
                sh(line)
        with phases.timed("nixl image build and up to healthy"):
            for line in nixl:
                sh(line)
        with phases.timed("check: put, reshard (broadcast, auto), get on nixl"):
            with stack.client() as c:
                _wait("agents on nixl", lambda: sorted(c.devices()) == sorted(
                    f"{a}/{d}" for a in AGENTS for d in range(DEVICES)))
                assert {a["host"]: a["transport"] for a in c.agents()} == {a: "nixl" for a in AGENTS}
                _roundtrip(c, "on-nixl", "nixl")
    print(f"e2e phases: {phases.summary()}", flush=True)


def _check_the_stack(stack: Stack, phases: Phases) -> None:
    with stack.client() as c:
        with phases.timed("check: put, reshard (broadcast, auto), get"):
            _wait("all agents registered", lambda: len(c.devices()) == len(AGENTS) * DEVICES)
            a = _roundtrip(c, "w", "grpc")
            c.put("small", a[:64, :64].copy(), Sharding(Mesh.from_hosts({"x": DEVICES}, AGENTS[:1], DEVICES), ("x",)))
        with phases.timed("check: kill -9 an agent, restart, DataLossError"):
            before = stack.container(AGENTS[-1])
            os.kill(before["State"]["Pid"], signal.SIGKILL)  # the agent's process, as the host sees it
            after = _wait("the engine restarts the killed agent", lambda: (
                lambda s: s if s["RestartCount"] > before["RestartCount"] and s["State"]["Running"] else None)(
                stack.container(AGENTS[-1])))
            assert after["State"]["Pid"] != before["State"]["Pid"]
            _wait("the restarted agent healthy", lambda: stack.container(AGENTS[-1])["State"]["Health"]["Status"]
                  == "healthy")

            def lost() -> str:
                try:
                    c.get("w")
                except DataLossError as e:
                    return str(e)
                return ""

            message = _wait("the planner marks the killed agent's tiles lost", lost, timeout=60)
            # 4096 columns over 16 devices: agent3's 4 tiles of 256 columns had no other copy.
            assert message.startswith("tensor 'w' v3 lost 4 of its 16 tiles: every agent that held them restarted"), \
                message
            assert f"held by {AGENTS[-1]}/0" in message and message.endswith("put it again, or delete it")
            assert np.array_equal(c.get("small"), a[:64, :64])  # agent0's tensor is untouched


def _check_up_again(stack: Stack, sh: Shell, phases: Phases, up: str, down: str) -> None:
    """`docker compose down` kept the planner-state volume: up again, the catalog still names the tensors."""
    with phases.timed("up again (planner-state volume kept)"):
        sh(up)
    with phases.timed("check: the catalog survived"):
        with stack.client() as c:
            catalog = {t.name: t for t in c.tensors()}
            assert set(catalog) == {"w", "small"}, catalog
            assert catalog["w"].version == 3 and catalog["w"].shape == (4096, 4096)
            # Every agent restarted with the stack, so the bytes are gone; the catalog says so rather than lying.
            _wait("the catalog marks the tensors lost", lambda: all(t.lost for t in c.tensors()), timeout=60)
            with pytest.raises(DataLossError, match="lost 16 of its 16 tiles"):
                c.get("w")
    with phases.timed("down"):
        sh(down)


def _remove_everything(sh: Shell, phases: Phases, engine: Engine) -> None:
    """The project's containers and volume, every image this test built, and on an engine it started the build
    cache too (its layers grew from a base image made afresh, so no later run can use them); the engine goes
    after."""
    t0 = time.monotonic()
    sh("docker compose down --volumes --remove-orphans")
    images = [*IMAGES, sh.variable("RESHARD_BASE")]
    present = [i for i in filter(None, images)
               if subprocess.run(["docker", "image", "inspect", i], capture_output=True).returncode == 0]
    if present:
        sh("docker image rm " + " ".join(present))
    if engine.started_here:
        sh("docker builder prune --all --force")
    phases.add("clean up", time.monotonic() - t0)
