"""The job runner's hold on tensors: one job at a time per tensor, a state dict's 139,583 taken in one step.

A job holds every tensor it names from its start to its end (`TensorLocks.hold`), by the tensors' slots in the
catalog's columns (`Catalog.slots`). It takes all of them at once or none (so no two jobs can each hold a part of
what the other waits for), and in the order jobs asked: a job waits while a tensor it names is held, or while an
earlier job that still waits names one (so a stream of small jobs cannot keep a state dict's job waiting forever).
Taking or giving back 139,583 tensors is two array operations, where one lock per tensor cost 7 ms to take on
this machine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count

import numpy as np


class TensorLocks:
    def __init__(self, size: int = 1024):
        self._changed = threading.Condition()
        self._held = np.zeros(size, bool)
        self._waiting: dict[int, np.ndarray] = {}  # ticket -> the slots of a job that waits, oldest first
        self._tickets = count()

    @contextmanager
    def hold(self, slots: np.ndarray) -> Iterator[None]:
        """Hold the tensors at ``slots`` (each one job's at a time) while the block runs."""
        with self._changed:
            if len(slots) and int(slots.max()) >= len(self._held):
                grown = np.zeros(max(2 * len(self._held), int(slots.max()) + 1), bool)
                grown[:len(self._held)] = self._held
                self._held = grown
            if not self._free(slots, list(self._waiting.values())):
                ticket = next(self._tickets)
                self._waiting[ticket] = slots
                try:
                    self._changed.wait_for(lambda: self._free(slots, [s for t, s in self._waiting.items()
                                                                      if t < ticket]))
                finally:
                    del self._waiting[ticket]
                    self._changed.notify_all()  # a later job may have waited behind this one alone
            self._held[slots] = True
        try:
            yield
        finally:
            with self._changed:
                self._held[slots] = False
                self._changed.notify_all()

    def _free(self, slots: np.ndarray, earlier: list[np.ndarray]) -> bool:
        """Whether no tensor at ``slots`` is held, nor named by a job that waits from ``earlier``."""
        if self._held[slots].any():
            return False
        if not earlier:
            return True
        wanted = np.zeros(len(self._held), bool)
        for other in earlier:
            wanted[other] = True
        return not wanted[slots].any()
