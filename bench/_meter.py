"""What the benches meter beside the clock: the CPU seconds a set of processes used (the service's agents and
planner, or raw gloo's ranks), read from Linux ``/proc``."""

from __future__ import annotations

import os


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user and system, every thread) the processes ``pids`` have used so far (Linux ``/proc``)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")
