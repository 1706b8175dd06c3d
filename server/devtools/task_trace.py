"""Where a job's time went, host by host, from the agents' task traces (``reshard agent --trace-dir DIR``, the lines
`reshard.server.agent.trace` writes).

    python -m reshard.server.devtools.task_trace DIR [--job JOB] [--top 10]

For one job (by default the one that ended last in the files), per host: its tasks, when its first task began and
its last ended, when it first sent a move and how many bytes it sent, the seconds its kernels ran (compute tasks
run on a pool of their own, so this is their own time, waits for a core included) and when the last one ended, and
the seconds its moves held a lane (a send or receive waits for its peer inside, so this is not CPU time: a host's
lanes wait at once, and their sum can be many times the job's), all in seconds after the job's first task on any
host; then the job's longest tasks. A host whose first send comes late while its kernels ran (a sender quantizing before its first stream
could leave, say), or whose kernels ran nearly the whole job and ended long before it (the streams they fed
finishing after them), shows here, where the job's total cannot tell it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from reshard.plan_command import non_negative_int

__all__ = ["HostPart", "JobTrace", "read", "job_trace", "format_trace", "main"]


@dataclass
class HostPart:
    """One host's part of a job, in seconds after the job's first task on any host (`job_trace`)."""

    host: str
    tasks: int = 0
    first_start: float = float("inf")
    last_end: float = 0.0
    first_send: float | None = None
    last_kernel: float | None = None  # when its last compute task ended
    sent_bytes: int = 0
    compute_s: float = 0.0
    move_s: float = 0.0
    failed: int = 0


@dataclass
class JobTrace:
    job: str
    hosts: list[HostPart]
    longest: list[dict] = field(default_factory=list)  # the records of the job's longest tasks, longest first
    start: float = 0.0  # the job's first task began (seconds since the epoch)


def read(directory: str | Path) -> tuple[list[dict], int]:
    """Every task record in ``directory``'s ``*.jsonl`` files, and how many lines could not be read as one (a line
    cut short by an agent that was killed mid-write, say)."""
    files = sorted(Path(directory).glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.jsonl task traces here (start agents with --trace-dir "
                                f"{directory})")
    records, bad = [], 0
    want = ("job", "host", "role", "start", "end")
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    bad += 1
                    continue
                if (not isinstance(r, dict) or any(k not in r for k in want)
                        or not all(isinstance(r[k], str) for k in ("job", "host", "role"))
                        or not all(isinstance(r[k], (int, float)) for k in ("start", "end"))):
                    bad += 1
                    continue
                records.append(r)
    return records, bad


def job_trace(records: list[dict], job: str | None = None, top: int = 10) -> JobTrace:
    """``job``'s part on each host (by default the job whose last task ended last); a job id prefix is enough."""
    if not records:
        raise ValueError("no task records to summarize")
    if job is None:
        job = max(records, key=lambda r: r["end"])["job"]
    else:
        matching = sorted({r["job"] for r in records if r["job"].startswith(job)})
        if len(matching) != 1:
            known = sorted({r["job"] for r in records})
            raise ValueError(f"job {job!r} names {len(matching)} of the traced jobs ({', '.join(known[:8])}"
                             f"{', ...' if len(known) > 8 else ''}): give one job's id or a prefix of one only")
        job = matching[0]
    mine = [r for r in records if r["job"] == job]
    t0 = min(r["start"] for r in mine)
    parts: dict[str, HostPart] = {}
    for r in mine:
        p = parts.get(r["host"])
        if p is None:
            p = parts[r["host"]] = HostPart(r["host"])
        start, end = r["start"] - t0, r["end"] - t0
        p.tasks += 1
        p.first_start = min(p.first_start, start)
        p.last_end = max(p.last_end, end)
        p.failed += not r.get("ok", True)
        if r["role"] == "compute":
            p.compute_s += end - start
            p.last_kernel = end if p.last_kernel is None else max(p.last_kernel, end)
        elif r["role"] in ("send", "recv"):
            p.move_s += end - start
        if r["role"] == "send":
            p.sent_bytes += int(r.get("bytes", 0))
            p.first_send = start if p.first_send is None else min(p.first_send, start)
    longest = sorted(mine, key=lambda r: r["start"] - r["end"])[:top]
    return JobTrace(job, [parts[h] for h in sorted(parts)], longest, t0)


def format_trace(t: JobTrace) -> str:
    """A table of ``t``'s hosts, then its longest tasks."""
    head = f"job {t.job}: {sum(p.tasks for p in t.hosts)} tasks on {len(t.hosts)} hosts, seconds after its first task"
    columns = (f"{'host':<16} {'tasks':>6} {'first':>8} {'last':>8} {'1st send':>9} {'MiB sent':>9} {'kernels s':>10} "
               f"{'last kernel':>12} {'moves s':>8} {'failed':>6}")
    lines = [head, columns]
    for p in t.hosts:
        send = f"{p.first_send:9.3f}" if p.first_send is not None else f"{'-':>9}"
        kernel = f"{p.last_kernel:12.3f}" if p.last_kernel is not None else f"{'-':>12}"
        lines.append(f"{p.host:<16} {p.tasks:>6} {p.first_start:8.3f} {p.last_end:8.3f} {send} "
                     f"{p.sent_bytes / 2**20:9.1f} {p.compute_s:10.3f} {kernel} {p.move_s:8.3f} {p.failed:>6}")
    if t.longest:
        lines += ["", "longest tasks:", f"{'host':<16} {'role':<8} {'step':>7} {'start':>8} {'seconds':>8}  what"]
        for r in t.longest:
            what = r.get("kernel") or r.get("kind", "")
            lines.append(f"{r['host']:<16} {r['role']:<8} {r.get('step', ''):>7} {r['start'] - t.start:8.3f} "
                         f"{r['end'] - r['start']:8.3f}  {what} {r.get('tensor', '')}"
                         + (f" from {r['peer']}" if r.get("peer") else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard.server.devtools.task_trace",
                                 description="Where a job's time went, host by host, from the agents' task traces "
                                             "(reshard agent --trace-dir DIR).")
    ap.add_argument("directory", help="the agents' --trace-dir")
    ap.add_argument("--job", help="a job id, or a prefix of one (default: the job that ended last)")
    ap.add_argument("--top", type=non_negative_int, default=10, help="longest tasks to list (default 10)")
    args = ap.parse_args(argv)
    try:
        records, bad = read(args.directory)
        trace = job_trace(records, args.job, args.top)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_trace(trace))
    if bad:
        print(f"({bad} lines could not be read as task records and were skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
