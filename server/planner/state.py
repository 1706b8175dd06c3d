"""The planner's durable state: tensors (current and pinned versions), pins, delta base pairs, jobs, plans and
counters in SQLite (``--state PATH``).

Without a path the tables live in memory, and only the plans and counters are written there: the rest is read
back by a restarted planner alone, which an in-memory store never has, and writing it cost a state dict's job a
row per tensor, several times over (`durable`; callers that build a row's text first check it).
Rows hold JSON documents; no pickle.
"""

from __future__ import annotations

import json
import sqlite3
import threading

__all__ = ["StateStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tensors (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, created REAL NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS plans (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS held_versions (name TEXT NOT NULL, version INTEGER NOT NULL, doc TEXT NOT NULL,
                                          PRIMARY KEY (name, version));
CREATE TABLE IF NOT EXISTS pins (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS delta_bases (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
"""


class StateStore:
    def __init__(self, path: str | None):
        self.path = path
        self.durable = path is not None  # whether a restarted planner reads it back: else only plans are kept
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False)
        self._db.executescript(_SCHEMA)
        self._db.commit()

    def _write(self, sql: str, args: tuple) -> None:
        with self._lock:
            self._db.execute(sql, args)
            self._db.commit()

    def _read(self, sql: str) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql).fetchall()

    def save_tensor(self, name: str, text: str) -> None:
        self.save_tensors([(name, text)])

    def save_tensors(self, docs: list[tuple[str, str]]) -> None:
        """Every tensor document of ``docs`` (name, its JSON text), in one transaction (a job that commits a whole
        state dict)."""
        if not self.durable:
            return
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO tensors (name, doc) VALUES (?, ?)", docs)
            self._db.commit()

    def delete_tensor(self, name: str) -> None:
        self.delete_tensors([name])

    def delete_tensors(self, names: list[str]) -> None:
        """The documents of ``names``, in one transaction."""
        if not self.durable:
            return
        with self._lock:
            self._db.executemany("DELETE FROM tensors WHERE name = ?", [(n,) for n in names])
            self._db.commit()

    def tensors(self) -> list[dict]:
        return [json.loads(d) for (d,) in self._read("SELECT doc FROM tensors ORDER BY name")]

    def save_held_versions(self, docs: list[tuple[str, int, str]]) -> None:
        """Versions no longer current that pins hold (name, version, the record's JSON text), in one transaction."""
        if not self.durable:
            return
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO held_versions (name, version, doc) VALUES (?, ?, ?)", docs)
            self._db.commit()

    def delete_held_versions(self, keys: list[tuple[str, int]]) -> None:
        if not self.durable:
            return
        if not keys:
            return
        with self._lock:
            self._db.executemany("DELETE FROM held_versions WHERE name = ? AND version = ?", keys)
            self._db.commit()

    def held_versions(self) -> list[dict]:
        return [json.loads(d) for (d,) in self._read("SELECT doc FROM held_versions ORDER BY name, version")]

    def save_pin(self, pin_id: str, text: str) -> None:
        if not self.durable:
            return
        self._write("INSERT OR REPLACE INTO pins (id, doc) VALUES (?, ?)", (pin_id, text))

    def delete_pin(self, pin_id: str) -> None:
        if not self.durable:
            return
        self._write("DELETE FROM pins WHERE id = ?", (pin_id,))

    def pins(self) -> list[dict]:
        return [json.loads(d) for (d,) in self._read("SELECT doc FROM pins")]

    def save_delta_bases(self, docs: list[tuple[str, str]]) -> None:
        """Delta base pairs (tensor name, the pair's JSON text), each replacing the name's previous one."""
        if not self.durable:
            return
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO delta_bases (name, doc) VALUES (?, ?)", docs)
            self._db.commit()

    def delete_delta_bases(self, names: list[str]) -> None:
        if not self.durable:
            return
        with self._lock:
            self._db.executemany("DELETE FROM delta_bases WHERE name = ?", [(n,) for n in names])
            self._db.commit()

    def delta_bases(self) -> list[dict]:
        return [json.loads(d) for (d,) in self._read("SELECT doc FROM delta_bases ORDER BY name")]

    def save_job(self, job_id: str, created: float, text: str) -> None:
        """The job ``job_id``'s document, as its JSON text (`Job.json_text`)."""
        if not self.durable:
            return
        self._write("INSERT OR REPLACE INTO jobs (id, created, doc) VALUES (?, ?, ?)", (job_id, created, text))

    def delete_jobs(self, job_ids: list[str]) -> None:
        """Forget the jobs of ``job_ids`` (the plans they ran stay: other jobs may share them)."""
        if not self.durable:
            return
        with self._lock:
            self._db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in job_ids])
            self._db.commit()

    def jobs(self) -> list[dict]:
        return [json.loads(d) for (d,) in self._read("SELECT doc FROM jobs ORDER BY created")]

    def save_plan(self, plan_id: str, doc: str) -> None:
        self._write("INSERT OR IGNORE INTO plans (id, doc) VALUES (?, ?)", (plan_id, doc))

    def plan(self, plan_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT doc FROM plans WHERE id = ?", (plan_id,)).fetchone()
        return row[0] if row else None

    def counter(self, name: str) -> int:
        """The last value saved of counter ``name`` (0 if never saved)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return row[0] if row else 0

    def save_counter(self, name: str, value: int) -> None:
        """Counter ``name`` is now ``value``: saved before anyone is told of it, so a restarted planner starts above
        every value its agents may have seen (the process group's generation)."""
        self._write("INSERT OR REPLACE INTO counters (name, value) VALUES (?, ?)", (name, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()
