"""How a service process waits to be told to stop."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

__all__ = ["on_signal", "wait_for_signal"]


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
