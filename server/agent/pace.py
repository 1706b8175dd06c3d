"""An emulated device speed: each compute step lasts at least its floating-point operations at a set rate.

The lab runs several emulated hosts on one machine. ``tc`` shapes their links to a NIC's rate; this does the same
for their devices (``reshard agent --emulate-gflops``, ``reshard lab --device-gflops``). Without it, four
emulated hosts on two cores compute at this machine's speed while they fight for its cores: a schedule that keeps
more stages busy at once (eager-1F1B) makes every kernel slower, which real hosts, each with its own device, do
not see. With it, a kernel runs at full speed and its step then waits out the rest of the time the emulated
device would take; waiting costs no core, so the hosts' compute overlaps as it would on separate machines.

A device runs one step at a time, as a GPU stream does: a step starts when its kernel starts or when the
device's previous step ends, whichever is later. Only the floating-point rate is emulated; a step with few
operations (a copy, an elementwise kernel) takes what its kernel takes. The agent reports the emulated rate to
the planner as its device's, so the cost model prices compute at the speed it will run at.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["DevicePace"]

_SLICE_S = 0.05  # a wait checks for the job's failure this often


class DevicePace:
    """The emulated devices of one agent, each at ``gflops`` (10^9 floating-point operations per second)."""

    def __init__(self, gflops: float, clock: Callable[[], float] = time.monotonic):
        if not gflops > 0:
            raise ValueError(f"an emulated device computes a positive number of GFLOP/s; got {gflops!r}")
        self.gflops = gflops
        self._clock = clock
        self._lock = threading.Lock()
        self._free: dict[str, float] = {}  # device -> when its last step ends, on the emulated device

    def seconds(self, flops: float) -> float:
        """How long the emulated device takes for ``flops``."""
        return flops / (self.gflops * 1e9)

    def finish(self, device: str, flops: float, started: float, check: Callable[[], None] = lambda: None) -> float:
        """Wait until the emulated ``device`` has done a step of ``flops`` whose kernel started at ``started``
        (``clock`` time) and has now ended; ``check`` is called between slices of the wait and may raise to end
        it (the job failed). Returns the seconds waited."""
        with self._lock:
            start = max(started, self._free.get(device, started))
            end = start + self.seconds(flops)
            self._free[device] = end
        waited = 0.0
        while True:
            left = end - self._clock()
            if left <= 0:
                return waited
            check()
            pause = min(left, _SLICE_S)
            time.sleep(pause)
            waited += pause
