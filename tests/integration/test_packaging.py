"""The wire contract is current, dependencies point one way, and the documented commands work."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
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
    with reshard_up("--hosts", "2", "--devices-per-host", "2") as (proc, lines):
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
