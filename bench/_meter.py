"""What the benches meter beside the clock: the CPU seconds a set of processes used (the service's agents and
planner, or raw gloo's ranks), read from Linux ``/proc``."""

from __future__ import annotations

import os


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user and system, every thread) the processes ``pids`` have used so far (Linux ``/proc``)."""
    return sum(user_system_seconds(pids))


def user_system_seconds(pids: list[int]) -> tuple[float, float]:
    """`cpu_seconds` as its two parts: in user mode, and in the kernel (system calls, page faults)."""
    user = system = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        user += int(fields[11])  # utime, stime (fields 14 and 15 of proc(5))
        system += int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick
