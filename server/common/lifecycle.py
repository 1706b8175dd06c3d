"""How a service process waits to be told to stop."""

from __future__ import annotations

import gc
import signal
import threading
from collections.abc import Callable

__all__ = ["on_signal", "wait_for_signal", "settle_heap", "YOUNG_OBJECTS"]

YOUNG_OBJECTS = 10_000  # a service's young-generation threshold (`settle_heap`); Python's default is 700


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


def on_signal(*signals: int) -> Callable[[], int]:
    """Catch ``signals`` (default SIGINT, SIGTERM) from now on; returns the wait for the first of them.

    Install before printing the line that tells a user (or a test) to send one: a
    signal that came while that line was still being written would otherwise
    interrupt the print itself. A signal may arrive several times at once: a
    parent-death signal is re-sent each time the dying parent's threads exit one
    by one. Python runs a handler nested inside the previous one, and ``Event.set``
    from a nested handler would deadlock on the lock the outer one holds, so only
    the first delivery sets the event.
    """
    stop = threading.Event()
    received: list[int] = []

    def handler(signum, _frame) -> None:
        if not received:
            received.append(signum)
            stop.set()

    for sig in signals or (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)

    def wait() -> int:
        # Short waits: a signal the kernel hands to another thread (gRPC's) sets Python's flag but does not
        # wake the main thread from a long lock wait, and the handler only runs when that wait ends.
        while not stop.wait(0.2):
            pass
        return received[0]

    return wait


def wait_for_signal(*signals: int) -> int:
    """Block until one of ``signals`` (default SIGINT, SIGTERM) arrives; returns it (see `on_signal`)."""
    return on_signal(*signals)()
