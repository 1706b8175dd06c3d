"""The catalog's tensors as numpy columns beside their records: what a registered sync's job reads of 139,583
tensors without a pass of Python over them.

A name gets a slot the first time the catalog is asked about it, kept for the planner's life (like a name's lock
was), so a registered sync works out its tensors' slots once (`Catalog.slots`) and every later run indexes the
columns with them: its claim of every tensor's next version (`Catalog.claim_current`) and the check that its kept
program still fits (each tensor's sharding object and dtype) are a few array operations. On this machine a pass of
Python over 139,583 names costs 6-10 ms, a fancy index of an int64 column well under one.

Not thread-safe: the catalog reads and writes its columns under its own lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

NO_STEP = -1  # a record without a step label (labels are ints >= 0: `check_step`)


class Columns:
    """Per name slot: its current record's version (0: no current record), the ``id`` of its sharding object (a
    program kept with those objects alive matches them exactly), its dtype (interned), its step label, the version
    a job in flight claimed (0: none) and how many uploads are committing it now."""

    def __init__(self, size: int = 1024):
        self.slot: dict[str, int] = {}
        self._dtypes: dict[str, int] = {}
        self.version = np.zeros(size, np.int64)
        self.layout = np.zeros(size, np.int64)
        self.dtype = np.zeros(size, np.int64)
        self.step = np.full(size, NO_STEP, np.int64)
        self.claim = np.zeros(size, np.int64)
        self.publishing = np.zeros(size, np.int64)

    def of(self, names: Sequence[str]) -> np.ndarray:
        """The slots of ``names``, in order; a name never seen gets the next free one."""
        have = self.slot.get
        out = list(map(have, names))
        if None in out:
            for i, (name, s) in enumerate(zip(names, out)):
                if s is None:
                    out[i] = self.slot.setdefault(name, len(self.slot))
            self._grow(len(self.slot))
        return np.array(out, dtype=np.int64)

    def dtype_ids(self, dtypes: Iterable[str]) -> np.ndarray:
        """``dtypes`` as the ids the dtype column holds (a dtype never seen gets the next one)."""
        ids = self._dtypes
        return np.array([ids.setdefault(d, len(ids) + 1) for d in dtypes], dtype=np.int64)

    def set(self, records: list) -> None:
        """Write ``records`` (`TensorRecord`) as their names' current ones."""
        if not records:
            return
        slots = self.of([r.name for r in records])
        self.version[slots] = [r.version for r in records]
        self.layout[slots] = [id(r.sharding) for r in records]
        self.dtype[slots] = self.dtype_ids([r.dtype for r in records])
        self.step[slots] = [NO_STEP if r.step is None else r.step for r in records]

    def clear(self, name: str) -> None:
        """``name`` has no current record."""
        s = self.slot.get(name)
        if s is not None:
            self.version[s] = self.layout[s] = self.dtype[s] = 0
            self.step[s] = NO_STEP

    def claimed(self, name: str) -> int:
        s = self.slot.get(name)
        return int(self.claim[s]) if s is not None else 0

    def _grow(self, needed: int) -> None:
        size = len(self.version)
        if needed <= size:
            return
        while size < needed:
            size *= 2
        for attr, fill in (("version", 0), ("layout", 0), ("dtype", 0), ("step", NO_STEP), ("claim", 0),
                           ("publishing", 0)):
            old = getattr(self, attr)
            new = np.full(size, fill, np.int64)
            new[:len(old)] = old
            setattr(self, attr, new)
