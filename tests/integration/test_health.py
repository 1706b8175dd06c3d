"""``reshard health``, ``--health-listen`` and ``--tls-server-name``: what healthchecks and probes of a TLS service use."""

from __future__ import annotations

import subprocess

import pytest

from reshard.proto.auth import TlsFiles
from reshard.proto.errors import InvalidArgumentError
from reshard.server.devtools.certs import make_certs

from .deploy_support import FreePorts, Processes, local, wait_serving

# Not a name the certificate gives (it names "reshard", localhost, 127.0.0.1 and ::1), as a Kubernetes pod IP is not.
IP = "127.0.0.2"


def _health(*args: str) -> subprocess.Popen:
    return subprocess.Popen(local(["reshard", "health", *args]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_health_answers_for_a_tls_server_on_its_plaintext_port_and_by_server_name(tmp_path):
    certs = tmp_path / "certs"
    make_certs(certs, ["reshard"])
    tls = ["--tls-cert", str(certs / "reshard.pem"), "--tls-key", str(certs / "reshard-key.pem"),
           "--tls-ca", str(certs / "ca.pem")]
    free = FreePorts(IP)
    port, health = free(), free()
    free.release()
    with Processes(tmp_path) as procs:
        procs.start({"planner": local(["reshard", "planner", "--listen", f"{IP}:{port}", *tls,
                                       "--tls-server-name", "reshard", "--health-listen", f"{IP}:{health}"])})
        wait_serving(f"{IP}:{health}", "reshard.v1.Planner")
        checks = {
            "health port": (0, _health(f"{IP}:{health}", "--service", "reshard.v1.Planner")),
            "whole server": (0, _health(f"{IP}:{health}")),
            "other service": (1, _health(f"{IP}:{health}", "--service", "reshard.v1.Agent")),
            "TLS port in plain text": (1, _health(f"{IP}:{port}", "--timeout", "3")),
            "TLS port, certificate checked against the IP": (1, _health(f"{IP}:{port}", *tls, "--timeout", "3")),
            "TLS port by server name": (0, _health(f"{IP}:{port}", *tls, "--tls-server-name", "reshard")),
        }
        results = {what: (want, *p.communicate(timeout=60), p.returncode) for what, (want, p) in checks.items()}
    for what, (want, out, err, code) in results.items():
        assert code == want, f"{what}: exit {code}, {out}{err}"
    assert results["health port"][1] == f"{IP}:{health} reshard.v1.Planner: SERVING\n"
    assert "NOT_FOUND" in results["other service"][2]
    gone = _health(f"{IP}:{health}", "--timeout", "2")
    out, err = gone.communicate(timeout=60)
    assert gone.returncode == 1 and "UNAVAILABLE" in err


def test_server_name_needs_tls_files():
    with pytest.raises(InvalidArgumentError, match="a TLS server name \\('reshard'\\) needs TLS files"):
        TlsFiles.from_args(None, None, None, "reshard")
    assert TlsFiles.from_args(None, None, None) is None
