"""Where a job's time went on one host: a line of JSON per task the agent ran (``reshard agent --trace-dir DIR``).

An agent with a trace directory appends to ``DIR/<host>.jsonl``, as each task of a run ends, a line with:

=========== ===========================================================================================
``job``     the job's id
``host``    this agent's host
``step``    the program step's id; ``role``: send, recv, compute or reduce (a move's sender, one hop of
            it arriving here, a kernel, this host's part of a group reduce: `task_graph`'s table)
``depth``   its dependency depth in the program; ``hop`` and ``peer``: a receive's hop and the host it
            comes from
``kind``    the step's kind (move, compute, reduce); ``kernel``: a compute's kernel
``tensor``  the tensor the step moves or makes, by the name it is stored under (a bucket's: its first member)
``bytes``   what a move carries (its bucket's bytes, where it stands for one); 0 for the other steps
``start``,  seconds since the epoch (``time.time``), when the task began and ended on its thread; a task
``end``     that calls a peer waits inside for it, so its span is when it held its lane, not CPU time
``ok``      False where it raised (the run fails); ``thread``: the thread that ran it
=========== ===========================================================================================

Off by default: a line costs a few microseconds, and the file grows by about 200 bytes a task (a 141-tensor MoE
sync runs a few hundred tasks a host). `reshard.server.devtools.task_trace` reads a directory of them and prints each
host's part of a job. No pickle: JSON lines, written by this agent only, into a directory its operator names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path

from reshard.errors import ReshardError

__all__ = ["TaskTraceError", "TaskTrace"]

log = logging.getLogger(__name__)


class TaskTraceError(ReshardError, OSError):
    """The trace directory cannot be written: the agent does not start (``reshard agent`` exits with status 2)."""


class TaskTrace:
    """Appends one JSON line per finished task to ``<directory>/<host>.jsonl`` (made if missing)."""

    def __init__(self, directory: str | os.PathLike, host: str):
        path = Path(directory)
        self.path = path / f"{host}.jsonl"
        self.host = host
        self._lock = threading.Lock()
        self._stopped = False
        try:
            path.mkdir(parents=True, exist_ok=True)
            # held open for the agent's life, closed with its runtime; a line at a time, so readable mid-job
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as e:
            raise TaskTraceError(f"--trace-dir {directory}: cannot append to {self.path}: {e.strerror or e}; give a "
                                 f"directory this agent may write, or leave tracing off") from None

    def record(self, job: str, task, names: dict[str, str], nbytes: int, start: float, end: float,
               ok: bool) -> None:
        """One task's line (``task``: a `reshard.server.agent.task_graph.Task`; ``names``: program tensor -> the
        name it is stored under, which the line gives)."""
        step = task.step
        tensor = step.tensor or (step.output.tensor if step.output is not None else "")
        tensor = names.get(tensor, tensor)
        line = json.dumps({"job": job, "host": self.host, "step": step.id, "role": task.role, "depth": task.depth,
                           "hop": task.hop, "peer": task.peer, "kind": step.kind, "kernel": step.kernel,
                           "tensor": tensor, "bytes": int(nbytes), "start": round(start, 6), "end": round(end, 6),
                           "ok": ok, "thread": threading.current_thread().name}, separators=(",", ":"))
        with self._lock:
            if self._stopped:
                return
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:  # a full disk, say: the trace stops, the job does not
                log.warning("task trace %s: cannot append (%s); tracing stops here, jobs go on", self.path, e)
                self._stop()

    def _stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError, ValueError):  # the buffer's last line may still fail to flush
            self._file.close()

    def close(self) -> None:
        with self._lock:
            self._stop()
