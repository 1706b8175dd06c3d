"""The ``reshard`` commands as an operator meets them: what ``up`` says while it starts and stops, where its
logs stay, a reader that leaves a pipe early, and mistakes named in the commands' own flags. Real processes."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import reshard_up

CLI = [sys.executable, "-m", "reshard.server.cli"]


def test_reshard_up_reports_each_agent_what_it_stops_and_keeps_its_logs():
    with reshard_up("--hosts", "2", "--devices-per-host", "1", "--transport", "grpc") as (proc, lines):
        printed = "".join(lines)
        log_dir = Path(re.search(r"^logs\s+(\S+)", printed, re.M).group(1))
        assert re.search(rf"^starting the planner, then 2 agents x 1 devices, on loopback; logs in {log_dir}$", printed,
                         re.M)
        planner = re.search(r"^planner\s+127\.0\.0\.1:\d+\s+pid (\d+)$", printed, re.M)
        agents = re.findall(r"^agent\s+(host\d)\s+127\.0\.0\.1:\d+\s+pid (\d+)\s+devices", printed, re.M)
        assert planner.start() < printed.index("\nagent") and [h for h, _ in agents] == ["host0", "host1"]
        assert sorted(re.findall(r"^\s+(host\d) registered with the planner$", printed, re.M)) == ["host0", "host1"]
        pids = {"planner": int(planner.group(1)), **{h: int(pid) for h, pid in agents}}
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait(30) == 0
    try:
        assert rest.splitlines()[0] == "SIGINT: stopping the cluster"
        for name, pid in pids.items():
            assert f"stopping {name} (pid {pid})" in rest and f"stopped  {name} (exit code 0)" in rest, rest
        assert rest.splitlines()[-1] == f"logs kept in {log_dir}"
        assert {"planner.log", "agent-host0.log", "agent-host1.log"} <= {p.name for p in log_dir.iterdir()}
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def test_a_reader_that_leaves_the_pipe_early_ends_the_command_quietly():
    # 4,096 transfers listed: far more than a pipe holds, so the writer meets the closed end
    proc = subprocess.Popen([*CLI, "plan", "--shape", "1024,1024", "--src", "x=16,y=16", "--src-spec", "x,y",
                             "--dst", "x=256", "--dst-spec", "_,x", "--max-transfers", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("Plan ")
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read()
    assert proc.wait(60) == 128 + signal.SIGPIPE  # what a shell shows for `yes | head -1`
    assert err == ""


def _fails(*args: str, timeout: float = 120) -> str:
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout + out.stderr


def test_the_demo_refuses_case_names_it_lacks_and_says_which_exist():
    said = _fails("demo", "--cases", "bogus,1to1x2")
    assert "error: --cases names 'bogus', which the demo does not have; choose from case1, case2," in said
    assert "1to8x4" in said and "starting" not in said and "verified" not in said  # before any cluster starts
    said = _fails("demo", "--strategies", "auto,fastest")
    assert "--strategies names 'fastest', which the demo does not have; choose from send_recv," in said


def test_the_demo_says_what_a_case_needs_when_the_cluster_is_too_small():
    said = _fails("demo", "--cases", "1to4x4", "--hosts", "2", "--devices-per-host", "1", "--nbytes-mib", "1")
    assert "error: --cases 1to4x4 needs 5 hosts x 4 devices, but the cluster has 2 x 1; raise --hosts and " \
           "--devices-per-host, or choose from 1to1x1" in said
    assert "starting" not in said  # refused before the cluster starts


def test_up_names_its_own_flags_in_errors():
    assert "argument --hosts: '0' is not a whole number of at least 1" in _fails("up", "--hosts", "0")
    said = _fails("up", "--hosts", "2", "--device", "cpu,cpu,cpu")
    assert "error: --device names 3 devices for --hosts 2: give one device for every agent" in said
    assert "device=" not in said
    assert "argument --devices: '0' is not a whole number of at least 1" in \
        _fails("agent", "--planner", "127.0.0.1:9", "--host", "h", "--devices", "0")


def test_the_planner_refuses_a_heartbeat_interval_not_under_its_timeout_naming_both():
    said = _fails("planner", "--heartbeat-interval", "5", "--heartbeat-timeout", "5")
    assert "error: --heartbeat-interval 5 must be above 0 and under --heartbeat-timeout (5), or the planner would " \
           "take every agent for down" in said


def test_agents_heartbeat_as_often_as_the_planner_tells_them():
    # Sampled every 50 ms for 1.5 s, the age of an agent's last heartbeat stays under 0.6 s at --heartbeat-interval
    # 0.2; at the default 1 s it reaches about a second.
    from reshard.client.cluster import LocalCluster

    with LocalCluster(1, 1, transport="grpc", planner_args=["--heartbeat-interval", "0.2"]) as cluster, \
            cluster.connect() as c:
        ages = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            ages += [a["heartbeat_age_s"] for a in c.agents()]
            time.sleep(0.05)
    assert ages and max(ages) < 0.6, max(ages)
