"""The wire contract is current, dependencies point one way, the documented commands work, and the service and
SDK install and run without torch."""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import reshard_up

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto():
    proc = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


# Domain code: every server module except the servicers, the gRPC transport, the token check (a server
# interceptor both services install) and the tools around them.
_GRPC_ALLOWED = {"cli.py", "service.py", "grpc_link.py", "auth.py"}
DOMAIN = sorted(str(p.relative_to(ROOT / "server").with_suffix(""))
                for room in ("planner", "agent", "transport", "common")
                for p in (ROOT / "server" / room).glob("*.py") if p.name not in _GRPC_ALLOWED | {"__init__.py"})


def test_the_domain_modules_are_found():
    assert {"planner/registry", "planner/catalog", "planner/jobs", "agent/store", "common/config"} <= set(DOMAIN)


@pytest.mark.parametrize("module", DOMAIN)
def test_domain_code_knows_no_grpc(module):
    bad = {m for m in _imports(ROOT / "server" / f"{module}.py")
           if m.split(".")[0] in ("grpc", "grpc_health") or m.endswith(("_pb2", "_pb2_grpc"))
           or m in ("reshard.proto.wire", "reshard.proto.status")}
    assert not bad, f"server/{module}.py imports {bad}"


def test_sdk_never_imports_the_server():
    for path in (ROOT / "client").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith(("reshard.server", "server"))}, path
    code = "import reshard, sys; reshard.connect; assert not [m for m in sys.modules if m.startswith('reshard.server')]"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_pickle_anywhere():
    for folder in ("server", "client", "proto"):
        for path in (ROOT / folder).glob("*.py"):
            assert "pickle" not in _imports(path), path


def test_quickstart_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "quickstart.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "succeeded in" in proc.stdout


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_reshard_up_starts_a_cluster_and_ctrl_c_stops_it_all():
    # gRPC agents: the default transport's process group costs three torch imports (10 s of make test's 2 cores)
    # and has nothing to do with starting and stopping the processes
    with reshard_up("--hosts", "2", "--devices-per-host", "2", "--transport", "grpc") as (proc, lines):
        address = re.search(r"planner\s+(\S+)", "".join(lines)).group(1)
        assert sum(line.startswith("agent") for line in lines) == 2
        children = _children(proc.pid)
        assert len(children) == 3
        import reshard

        token_file = re.search(r"token\s+(\S+)", "".join(lines)).group(1)
        with reshard.connect(address, token=open(token_file).read()) as c:
            assert c.devices() == ["host0/0", "host0/1", "host1/0", "host1/1"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        time.sleep(0.2)
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@pytest.mark.slow
def test_demo_verifies_every_row():
    proc = subprocess.run([sys.executable, "-m", "reshard.server.cli", "demo", "--nbytes-mib", "4"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rows verified bit for bit" in proc.stdout


@pytest.mark.slow  # make demo runs the same command; 12 s of make test's 10 minutes
def test_demo_small_case_set():
    proc = subprocess.run([sys.executable, "-m", "reshard.server.cli", "demo", "--nbytes-mib", "1", "--hosts", "3",
                           "--devices-per-host", "2", "--cases", "1to1x2,1to2x2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all 8 rows verified" in proc.stdout


# -- the light install: the service and the SDK without torch --------------------------------------

_NO_TORCH = "raise ImportError(\"No module named 'torch' (hidden by test_packaging)\", name='torch')\n"


def test_the_grpc_service_and_sdk_run_where_torch_cannot_be_imported(tmp_path):
    """Every process of a cluster (planner, agents, client) with ``import torch`` failing, as on a plain
    ``pip install reshard``: agents stay on gRPC, numpy goes in and out, a reshard runs, and asking for a torch
    tensor names the extra."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "torch.py").write_text(_NO_TORCH)
    code = textwrap.dedent("""
        import numpy as np, reshard
        from reshard import Mesh, Sharding
        from reshard.client.cluster import LocalCluster
        with LocalCluster(2, 2) as cluster, cluster.connect() as c:
            assert {a["transport"] for a in c.agents()} == {"grpc"}, c.agents()
            a = np.arange(64 * 6, dtype=np.float32).reshape(64, 6)
            c.put("w", a, Sharding(Mesh.from_hosts({"x": 2}, ["host0"], 2), ("x", None)))
            c.reshard("w", Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), (None, "y"))).result(60)
            assert np.array_equal(c.get("w"), a)
            try:
                c.get("w", device="cpu")
            except reshard.client.FailedPreconditionError as e:
                print("torch read:", e)
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hide'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "ok"
    assert "pip install 'reshard[torch]'" in proc.stdout  # a torch tensor asked for names the extra


def test_torch_comes_with_the_torch_extra_only():
    from importlib.metadata import requires

    needs = requires("reshard")
    assert not [r for r in needs if r.startswith("torch") and "extra" not in r], needs
    assert any(r.startswith("torch") and 'extra == "torch"' in r for r in needs), needs


def _pip(venv: Path, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow  # a fresh virtual environment and three installs: about two minutes
def test_pip_install_pulls_no_torch_and_the_extra_does(tmp_path):
    """``pip install .`` in a fresh venv: no torch, no deprecation banner; the gRPC demo and the SDK tests run
    there; then ``pip install '.[torch]'`` brings torch and the collective transport."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("reshard", "server", "client", "proto"):  # a copy: the build writes build/ and egg-info
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    out = _pip(venv, "install", "-v", str(src))
    assert "deprecat" not in out.lower(), [line for line in out.splitlines() if "eprecat" in line][:5]
    installed = _pip(venv, "list", "--format=freeze").lower()
    assert "torch" not in installed and "nvidia" not in installed and "jax" not in installed, installed
    python = str(venv / "bin" / "python")
    demo = subprocess.run([str(venv / "bin" / "reshard"), "demo", "--nbytes-mib", "1", "--hosts", "3",
                           "--devices-per-host", "2", "--cases", "1to1x2,1to2x2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert demo.returncode == 0 and "all 8 rows verified" in demo.stdout, demo.stdout[-2000:] + demo.stderr[-2000:]
    _pip(venv, "install", "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "httpx>=0.27")
    sdk_tests = [str(ROOT / "tests" / "integration" / f) for f in
                 ("test_cluster.py", "test_errors.py", "test_empty_tiles.py", "test_traffic.py")]
    # cwd outside the checkout, so that `reshard` is the installed package and not the folder of that name
    run = subprocess.run([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow",
                          *sdk_tests], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", run.stdout) and "the collective transport needs torch" in run.stdout
    _pip(venv, "install", f"{src}[torch]")
    assert "torch" in _pip(venv, "list", "--format=freeze").lower()
    has = subprocess.run([python, "-c", "from reshard.server.common.torch_support import torch_available; "
                                        "print(torch_available())"], capture_output=True, text=True, cwd=tmp_path)
    assert has.stdout.strip() == "True", has.stderr[-2000:]
