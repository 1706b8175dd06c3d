"""How a service process waits to be told to stop."""

from __future__ import annotations

import gc
import signal
import sys
import time
from collections.abc import Callable

__all__ = ["on_signal", "wait_for_signal", "settle_heap", "settle_switching", "YOUNG_OBJECTS", "GIL_SWITCH_S"]

YOUNG_OBJECTS = 10_000  # a service's young-generation threshold (`settle_heap`); Python's default is 700
GIL_SWITCH_S = 0.001  # how long a service's busy thread keeps the GIL from one that waits (`settle_switching`); 5 ms


def settle_heap() -> None:
    """Tune the cyclic garbage collector for a long-lived service, once it is up.

    A service's work is done by reference counting: a job's objects form no cycles that hold memory (the agents'
    resident memory stays flat over 80 jobs either way). Two costs of the collector remain, both measured
    over 200 jobs of bench/weight_sync.py's move:

    - Its young passes ran every 700 objects, each visiting whatever of the job was still alive: 1-1.5 ms of every
      job on each agent and on the planner. From `YOUNG_OBJECTS` on, they run a few times in 200 jobs.
    - Its full passes visited every object of the modules the service imported (torch alone brings a hundred
      thousand functions, cells and tuples), a pause of 0.1-0.2 s with the GIL held and the agent's streams
      stopped. Those objects live as long as the process: frozen now, no pass visits them again.

    What the service makes from now on is collected as before. Nothing is collected first: a cycle already
    unreachable at start-up stays, which is a few objects at most.
    """
    gc.freeze()
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])


def settle_switching() -> None:
    """Have a service's busy thread hand the GIL on after `GIL_SWITCH_S` rather than Python's 5 ms.

    A service's threads mostly wait on the network, and each that wakes (a gRPC call that reached it, a NIXL
    notification the progress thread found, a lane a post unblocked) needs the GIL before it runs a line. A thread
    busy in Python (making a job's posts, decoding its program) keeps it up to the switch interval: 5 ms per hand-over,
    several of them on the path from a job's request to its first bytes, at the start of a job where every agent is
    busy at once. bench/weight_sync.py's emulated sync (rounds alternating in one cluster, medians of 10) took 0.951 s
    with 1 ms against 0.962 with 5, then 0.959 against 0.970 and 0.942 against 0.947. With 0.3 ms it took 0.952
    against 0.952 (the switches themselves costing what the shorter waits saved), and with 2 ms 0.944 against
    0.936."""
    sys.setswitchinterval(GIL_SWITCH_S)


def on_signal(*signals: int) -> Callable[[], int]:
    """Catch ``signals`` (default SIGINT, SIGTERM) from now on; returns the wait for the first of them.

    Install before printing the line that tells a user (or a test) to send one: a
    signal that came while that line was still being written would otherwise
    interrupt the print itself.

    The handler takes no lock. Python runs a handler in the main thread between two bytecodes, wherever that
    thread is: an ``Event.set`` there deadlocks when the signal lands while the same thread holds the event's
    lock inside ``Event.wait`` (seen as an agent that never stopped on SIGTERM and was killed). A signal may also
    arrive several times at once (a parent-death signal is re-sent as the dying parent's threads exit); only the
    first counts.
    """
    received: list[int] = []

    def handler(signum, _frame) -> None:
        if not received:
            received.append(signum)

    for sig in signals or (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)

    def wait() -> int:
        # Short sleeps: a signal the kernel hands to another thread (gRPC's) sets Python's flag but runs the
        # handler only when the main thread next runs bytecode.
        while not received:
            time.sleep(0.1)
        return received[0]

    return wait


def wait_for_signal(*signals: int) -> int:
    """Block until one of ``signals`` (default SIGINT, SIGTERM) arrives; returns it (see `on_signal`)."""
    return on_signal(*signals)()
