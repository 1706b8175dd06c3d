"""How fast a job fails when its receiving agent is paused, with the default timeouts, on both transports.

A local cluster of three agents with the planner's and agents' default heartbeat and stall
timeouts; a rate-limited reshard is paused mid-transfer by SIGSTOP on its receiver. Reported:
seconds from SIGSTOP until the client sees the job failed (goal: under 15 s; the documented bound
is ``max(heartbeat_timeout_s, stall_timeout_s)`` plus the planner's watch interval), and the
retry's seconds after SIGCONT once the agent rejoined. Writes its section of BENCHMARKS.md.

    python bench/stall.py [--runs 3] [--no-write]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import write_section  # noqa: E402

from reshard import Mesh, Sharding  # noqa: E402
from reshard.client import JobFailedError  # noqa: E402
from reshard.client.cluster import LocalCluster  # noqa: E402
from reshard.server.common.config import PlannerConfig  # noqa: E402
from reshard.server.planner.jobs import WATCH_INTERVAL_S  # noqa: E402

SRC = Sharding(Mesh.from_hosts({"x": 2}, ["host0", "host1"], 1), ("x", None))
DST = Sharding(Mesh.from_hosts({"x": 2}, ["host1", "host2"], 1), (None, "x"))
RATE_MIB_S = 2
GOAL_S = 15.0


def one_run(cluster: LocalCluster, run: int) -> tuple[float, float, str]:
    """(seconds from SIGSTOP to the failure, seconds of the retry, the failure's text)."""
    a = np.arange(1024 * 1024, dtype=np.int32).reshape(1024, 1024)
    name = f"paused{run}"
    with cluster.connect() as c:
        c.put(name, a, SRC)
        job = c.reshard(name, DST, "send_recv")
        while job.progress()[0] == 0:
            time.sleep(0.02)
        receiver = cluster.agents["host2"]
        receiver.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            job.result(timeout=120)
            raise RuntimeError("the job succeeded with its receiver paused")
        except JobFailedError as e:
            failed, error = time.monotonic() - stopped, str(e)
        finally:
            receiver.send_signal(signal.SIGCONT)
        cluster.wait_ready()
        t0 = time.monotonic()
        c.reshard(name, DST, "send_recv").result(timeout=120)
        retry = time.monotonic() - t0
        assert np.array_equal(c.get(name), a)
        c.delete(name)
    return failed, retry, error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    d = PlannerConfig()
    bound = max(d.heartbeat_timeout_s, d.stall_timeout_s) + WATCH_INTERVAL_S
    rows = []
    for transport in ("grpc", "collective"):
        with LocalCluster(3, 1, transport=transport, agent_args=["--rate-limit-mib-s", str(RATE_MIB_S),
                                                                   "--chunk-mib", "0.25",
                                                                   "--collective-chunk-mib", "0.25"]) as cluster:
            runs = [one_run(cluster, i) for i in range(args.runs)]
        failed = [f for f, _, _ in runs]
        retry = [r for _, r, _ in runs]
        names_host = all("host2" in e for _, _, e in runs)
        rows.append(f"| {transport} | {statistics.median(failed):.1f} s (max {max(failed):.1f}) | {bound:.1f} s | "
                    f"{'yes' if names_host else 'NO'} | {statistics.median(retry):.2f} s |")
        print(rows[-1], flush=True)
    body = (f"A 4 MiB reshard over three local agents (rate-limited to {RATE_MIB_S} MiB/s so it is mid-transfer), "
            f"its receiver paused by SIGSTOP; the planner's defaults (heartbeat timeout {d.heartbeat_timeout_s:g} s, "
            f"stall timeout {d.stall_timeout_s:g} s). Median of {args.runs} runs. Goal: failed under {GOAL_S:g} s, "
            f"naming the host; the retry after SIGCONT succeeds.\n\n"
            "| transport | SIGSTOP to failed | documented bound | error names the host | retry after SIGCONT |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(body)
    if not args.no_write:
        write_section("stall", "A paused agent: time until its job fails", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
