"""Agents' heartbeats through a planner that stalls, on real processes: a planner that answers late (paused here
with SIGSTOP, as a planner starved of CPU on a loaded machine answers) still gets every agent's heartbeat once it
runs again, so no agent is marked down for the planner's own slowness."""

from __future__ import annotations

import signal
import time

from reshard.client.cluster import LocalCluster
from reshard.server.agent.service import HEARTBEAT_DEADLINE_S

HOSTS = ("host0", "host1")
PAUSE_S = 2.5  # longer than the heartbeat interval (1 s), shorter than the call's deadline


def test_a_planner_paused_for_seconds_gets_the_heartbeats_sent_meanwhile():
    """Before, a heartbeat call waited 1 s for the planner: every beat sent in the first 1.5 s of a 2.5 s pause
    failed with DEADLINE_EXCEEDED, and the next one went a whole interval later, so a planner slow for 3 s went 5 s
    without a beat (likely how one bench run lost a host, "no heartbeat for 5.2s", while 8 processes started torch on
    2 cores). Now the call waits `HEARTBEAT_DEADLINE_S`, and the planner, once it runs, reads what was sent."""
    assert PAUSE_S < HEARTBEAT_DEADLINE_S
    with LocalCluster(len(HOSTS), 1, host_names=HOSTS, transport="grpc") as cluster:
        time.sleep(1.5)  # every agent has heartbeat since it registered
        logs = {h: cluster.log_dir / f"agent-{h}.log" for h in HOSTS}
        before = {h: p.stat().st_size for h, p in logs.items()}
        cluster.planner.send_signal(signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
        finally:
            cluster.planner.send_signal(signal.SIGCONT)
        time.sleep(1.5)  # the calls in flight are answered; the next beats go out
        for h, path in logs.items():
            with open(path, "rb") as f:
                f.seek(before[h])
                added = f.read().decode(errors="replace")
            assert "heartbeat to planner" not in added, f"{h}'s agent lost a heartbeat to the pause:\n{added}"
        with cluster.connect() as c:
            up = {a["host"]: a["up"] for a in c.agents()}
        assert up == {h: True for h in HOSTS}, up
