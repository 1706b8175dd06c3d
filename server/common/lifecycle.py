"""How a service process waits to be told to stop."""

from __future__ import annotations

import gc
import signal
import threading
from collections.abc import Callable

__all__ = ["on_signal", "settle_heap", "wait_for_signal"]


def settle_heap() -> None:
    """Move everything a service process made while starting (modules, torch, the gRPC server) out of the cyclic
    garbage collector's sight, once, when it has started.

    An agent's jobs leave long-lived objects behind (parsed programs, shard records), and every so often those
    set off a full collection, which visits every live object: with torch imported that is about 100 ms of one
    core per pass, several times a minute under a state dict's moves, on every agent at once. Frozen start-up
    objects are still freed by reference counting; only a cycle among them would never be. A process-wide
    choice, so the command that runs the service makes it, not the library (CPython's ``gc.freeze`` docs).
    """
    gc.collect()
    gc.freeze()


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
