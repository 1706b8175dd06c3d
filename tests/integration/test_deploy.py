"""deploy/k8s: the manifests validate against the Kubernetes schema, hold together, and run a reshard.

There is no cluster here. The overlays are rendered by the real kustomize (``kubectl kustomize``, or
``kustomize build``; the tests skip, saying so, where neither is on the PATH) with the secret files an
operator writes (a token, an admin token, a certificate from ``reshard certs``), and a small
kubelet runs each pod's containers as local processes: each pod gets an IP of its own on
loopback (127.a.b.N), ``$(VAR)`` arguments are expanded from the container's env and the downward
API as the kubelet does, volumes become folders (a Secret's keys written as files), ``0.0.0.0``
binds become the pod's IP, and the planner's headless Service name resolves to its pod's IP, as
cluster DNS does. Nothing else in the commands changes. The GPU overlay's agents run with
``--device cpu`` in place of ``cuda:0``. A client with the cluster's Secrets then plays a pod of the
cluster: it reaches the agents at the pod IPs they advertise, over mutual TLS.
"""

from __future__ import annotations

import base64
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reshard.client import Client
from reshard.proto.auth import TlsFiles
from reshard.server.common.sizes import parse_size
from reshard.server.devtools.certs import make_certs

from .deploy_support import STARTUP_TIMEOUT_S, Processes, local, reshard_through, wait_devices, wait_serving

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
TOKEN = "k8s-cluster-token-0123456789abcdef"
ADMIN_TOKEN = "k8s-admin-token-0123456789abcdef"
GPUS_PER_NODE = 8
# Headroom the agent's container has above --memory-limit (deploy/k8s/base/agents.yaml).
AGENT_HEADROOM = 2 * 2**30


@pytest.fixture(scope="module")
def k8s(tmp_path_factory) -> Path:
    """A copy of deploy/k8s with the secret files the operator writes into base/secrets."""
    root = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S, root)
    secrets = root / "base" / "secrets"
    (secrets / "cluster-token.txt").write_text(TOKEN + "\n")
    (secrets / "admin-token.txt").write_text(ADMIN_TOKEN + "\n")
    make_certs(secrets, ["reshard"])
    return root


_POD_OWNERS = {"Deployment", "DaemonSet", "StatefulSet"}


def _kustomize() -> list[str] | None:
    """The real renderer: kubectl's built-in kustomize, else the kustomize binary."""
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(folder: Path) -> list[dict]:
    """The objects ``kubectl apply -k folder`` would apply, as kustomize renders them."""
    command = _kustomize()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is on the PATH: the overlays are rendered by the real kustomize "
                    "(install kubectl, whose `kubectl kustomize` is built in, or kustomize)")
    run = subprocess.run([*command, str(folder)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{' '.join(command)} {folder} exited {run.returncode}: {run.stderr}"
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def pod_templates(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(owner, pod spec) of every object that runs pods."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in _POD_OWNERS]


@pytest.fixture(scope="module")
def rendered(k8s) -> dict[str, list[dict]]:
    return {overlay: render(k8s / "overlays" / overlay) for overlay in OVERLAYS}


def _find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate_against_the_kubernetes_schema(rendered, overlay, tmp_path):
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(rendered[overlay]))
    run = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    passed = re.findall(r"passed for resource (\S+)", run.stdout)
    assert len(passed) == len(rendered[overlay]) - 1, run.stdout
    # The one kind the schema lacks is the Prometheus Operator's CRD; test_service_monitor checks it.
    assert re.findall(r"Couldn't find schema for kind (\w+)", run.stdout + run.stderr) == ["ServiceMonitor"]


def _containers(docs: list[dict], component: str) -> list[dict]:
    return [c for owner, spec in pod_templates(docs)
            if owner["metadata"]["labels"]["app.kubernetes.io/component"] == component for c in spec["containers"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_secrets_and_addresses_hold_together(rendered, overlay):
    docs = rendered[overlay]
    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    policy = _find(docs, "NetworkPolicy", "reshard")["spec"]["ingress"][1]["ports"][0]
    for owner, spec in pod_templates(docs):
        volumes = {v["name"]: v for v in spec["volumes"]}
        component = owner["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in spec["containers"]:
            args = c["args"]
            # Native gRPC probes ask the plaintext health port: the service port speaks mutual TLS.
            health = _port(_arg(args, "--health-listen"))
            service = {"planner": "reshard.v1.Planner", "agent": "reshard.v1.Agent"}[component]
            assert c["livenessProbe"]["grpc"] == {"port": health}
            assert c["readinessProbe"]["grpc"] == c["startupProbe"]["grpc"] == {"port": health, "service": service}
            assert {p["containerPort"] for p in c["ports"]} >= {_port(_arg(args, "--listen")), health}
            assert policy["port"] <= _port(_arg(args, "--listen")) <= policy["endPort"]
            assert _arg(args, "--tls-server-name") == "reshard"
            # Every file an argument names is a key of a mounted Secret that the kustomization makes.
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
            for flag in ("--token-file", "--admin-token-file", "--tls-cert", "--tls-key", "--tls-ca"):
                if flag in args:
                    folder, _, key = _arg(args, flag).rpartition("/")
                    assert key in secrets[mounts[folder]["secret"]["secretName"]], (c["name"], flag)
            if component == "agent":
                listen = _port(_arg(args, "--listen"))
                assert _arg(args, "--advertise") == f"$(POD_IP):{listen}"
                env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
                assert env["POD_IP"] == "status.podIP" and env["NODE_NAME"] == "spec.nodeName"
                assert _arg(args, "--planner") == "reshard-planner:50051"
    planner = _find(docs, "Deployment", "reshard-planner")
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"]["type"] == "Recreate"
    (c,) = planner["spec"]["template"]["spec"]["containers"]
    state = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[str(Path(_arg(c["args"], "--state")).parent)]
    volume = {v["name"]: v for v in planner["spec"]["template"]["spec"]["volumes"]}[state]
    assert volume["persistentVolumeClaim"]["claimName"] == _find(docs, "PersistentVolumeClaim",
                                                                 "reshard-planner-state")["metadata"]["name"]
    grpc_service = _find(docs, "Service", "reshard-planner")["spec"]
    assert grpc_service["clusterIP"] == "None"  # the rendezvous store's port is picked at start
    assert grpc_service["ports"][0]["port"] == _port(_arg(c["args"], "--listen"))


def test_agents_ask_for_what_they_hold(rendered):
    (cpu,) = _containers(rendered["cpu"], "agent")
    memory = parse_size(_arg(cpu["args"], "--memory-limit"))
    assert _arg(cpu["args"], "--device") == "cpu"
    for kind in ("requests", "limits"):
        assert parse_size(cpu["resources"][kind]["memory"].replace("Gi", "GiB")) == memory + AGENT_HEADROOM
    gpus = _containers(rendered["gpu"], "agent")
    assert [c["name"] for c in gpus] == [f"gpu{i}" for i in range(GPUS_PER_NODE)]
    for i, c in enumerate(gpus):
        # The device plugin shows each container its one GPU as device 0.
        assert _arg(c["args"], "--device") == "cuda:0" and _arg(c["args"], "--host") == f"$(NODE_NAME)-gpu{i}"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert len({_arg(c["args"], "--listen") for c in gpus}) == GPUS_PER_NODE
    (spec,) = [s for o, s in pod_templates(rendered["gpu"]) if o["kind"] == "DaemonSet"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_the_dashboard_with_the_admin_token(rendered, overlay):
    docs = rendered[overlay]
    monitor = _find(docs, "ServiceMonitor", "reshard")["spec"]
    (service,) = [d for d in docs if d["kind"] == "Service"
                  and monitor["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()]
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    (planner,) = _containers(docs, "planner")
    assert {p["name"]: p["containerPort"] for p in planner["ports"]}[port["targetPort"]] == \
        _port(_arg(planner["args"], "--http"))
    credentials = endpoint["authorization"]["credentials"]
    assert credentials["key"] in _find(docs, "Secret", credentials["name"])["data"]
    assert _arg(planner["args"], "--admin-token-file").startswith("/etc/reshard/admin-token/")


class Kubelet:
    """Runs a pod's containers as local processes, the pod's IP a loopback address of its own."""

    def __init__(self, docs: list[dict], root: Path, services: dict[str, str]):
        self._secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
        self._root = root
        self._services = services  # headless Service name -> the IP its one pod has

    def commands(self, pod: str, spec: dict, ip: str, node: str, device: str = "") -> dict[str, list[str]]:
        folders = {}
        for v in spec["volumes"]:
            folder = folders[v["name"]] = self._root / pod / v["name"]
            folder.mkdir(parents=True)
            if "secret" in v:
                for key, value in self._secrets[v["secret"]["secretName"]].items():
                    (folder / key).write_bytes(base64.b64decode(value))
                    (folder / key).chmod(v["secret"]["defaultMode"])
        out = {}
        for c in spec["containers"]:
            fields = {"status.podIP": ip, "spec.nodeName": node}
            env = {e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
                   for e in c.get("env", [])}
            mounts = sorted(((m["mountPath"], folders[m["name"]]) for m in c["volumeMounts"]), key=lambda m: -len(m[0]))
            args = []
            for arg in c["command"] + c["args"]:
                arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
                arg = re.sub(r"^0\.0\.0\.0:", f"{ip}:", arg)
                host, sep, port = arg.rpartition(":")
                if sep and host in self._services:
                    arg = f"{self._services[host]}:{port}"
                for path, folder in mounts:
                    if arg == path or arg.startswith(path + "/"):
                        arg = str(folder) + arg[len(path):]
                        break
                args.append(arg)
            if device:
                assert args[args.index("--device") + 1].startswith("cuda")
                args[args.index("--device") + 1] = device
            out[f"{pod}/{c['name']}"] = local(args)
        return out


def _probe(ip: str, c: dict) -> None:
    """The kubelet's native gRPC probes, in order: startup, then readiness and liveness."""
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]["grpc"]
        wait_serving(f"{ip}:{probe['port']}", probe.get("service", ""))


def _run_overlay(rendered_docs: list[dict], tmp: Path, nodes: list[str], device: str = "",
                 containers: int = 0, startup_timeout_s: float = STARTUP_TIMEOUT_S, light: bool = False) -> None:
    """Run the overlay's planner and its agents' pod on ``nodes``, then a reshard from a client pod; ``light``: as
    the light image (no torch) runs them, the image the README builds for CPU nodes."""
    subnet = f"127.{random.randrange(1, 255)}.{random.randrange(1, 255)}"
    planner_ip = f"{subnet}.1"
    kubelet = Kubelet(rendered_docs, tmp / "pods", {"reshard-planner": planner_ip})
    (planner_spec,) = [s for o, s in pod_templates(rendered_docs) if o["kind"] == "Deployment"]
    (agents_spec,) = [s for o, s in pod_templates(rendered_docs) if o["kind"] == "DaemonSet"]
    if containers:
        agents_spec = {**agents_spec, "containers": agents_spec["containers"][:containers]}
    commands = kubelet.commands("planner", planner_spec, planner_ip, "control")
    pods = {}
    for i, node in enumerate(nodes):
        pods[node] = (f"{subnet}.{i + 2}", agents_spec)
        commands |= kubelet.commands(f"agents-{node}", agents_spec, pods[node][0], node, device)
    tls_folder = tmp / "pods" / "planner" / "tls"
    tls = TlsFiles(str(tls_folder / "tls.crt"), str(tls_folder / "tls.key"), str(tls_folder / "ca.crt"),
                   server_name="reshard")
    with Processes(tmp, startup_timeout_s, light_image=light) as procs:
        procs.start(commands)  # as the cluster does: no order; agents retry until the planner answers
        _probe(planner_ip, planner_spec["containers"][0])
        for ip, spec in pods.values():
            for c in spec["containers"]:
                _probe(ip, c)
        # Why the probes have a port of their own: the service port speaks TLS, the kubelet plain text.
        with grpc.insecure_channel(f"{planner_ip}:50051") as plain:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=2)
        hosts = sorted(_arg(cmd, "--host") for name, cmd in commands.items() if not name.startswith("planner/"))
        per_host = int(_arg(next(c for n, c in commands.items() if not n.startswith("planner/")), "--devices"))
        with Client(f"{planner_ip}:50051", token=TOKEN, tls=tls) as c:  # a pod of the cluster
            wait_devices(c, [f"{h}/{d}" for h in hosts for d in range(per_host)])
            advertised = {_arg(cmd, "--host"): _arg(cmd, "--advertise")
                          for name, cmd in commands.items() if not name.startswith("planner/")}
            assert {a["host"]: a["address"] for a in c.agents()} == advertised
            assert all(a.rsplit(":", 1)[0] in {ip for ip, _ in pods.values()} for a in advertised.values())
            if light:
                assert {a["transport"] for a in c.agents()} == {"grpc"}  # the default, auto, without torch
            half = len(hosts) // 2
            reshard_through(c, "k8s", hosts[:half], hosts[half:], per_host)


def test_cpu_overlay_runs_a_reshard(rendered, tmp_path):
    _run_overlay(rendered["cpu"], tmp_path, ["node-a", "node-b"], light=True)


@pytest.mark.slow  # 19 s of make test: its manifests are checked above, and the CPU overlay's run is the same path
def test_gpu_overlay_runs_a_reshard_on_cpu(rendered, tmp_path):
    """Two of a GPU node's agent containers (they differ in N alone), with --device cpu."""
    _run_overlay(rendered["gpu"], tmp_path, ["gpu-node"], device="cpu", containers=2)


@pytest.mark.slow
def test_gpu_overlay_runs_a_reshard_on_cpu_with_every_container(rendered, tmp_path):
    """A whole GPU node's pod: nine processes importing torch at once take minutes on two cores."""
    _run_overlay(rendered["gpu"], tmp_path, ["gpu-node"], device="cpu", startup_timeout_s=300)
