"""``make gpu-check``: every CUDA test and ``bench/gpu.py`` on this host's GPU, ending in one table.

Steps, each a subprocess with a wall limit of its own, its output shown as it comes and kept
under ``--log`` (``gpu-check-logs/``):

=========== ======== =================================================================================
step        limit    what
=========== ======== =================================================================================
CUDA tests  300 s    ``pytest -m cuda`` on test_cuda.py, test_collective.py and every other test file
                     that carries ``pytest.mark.cuda`` (found at run time); ``pytest.log``
bench       240 s    ``bench/gpu.py --json bench.json``; ``bench.log``
=========== ======== =================================================================================

The whole run keeps within ``--budget-s`` (450 s: ``make gpu-check``, install included, in under 8 minutes),
so a step gets the lesser of its limit and the time left. The table (also ``summary.txt``)
comes last even when a step fails, times out or crashes; the exit code is 1 when a test failed
or errored, a step timed out or crashed, or a goal row of the bench missed its goal or did not
run, and the lines under the table say which. Where torch sees no CUDA device it prints
``gpu-check skipped: <why>`` and exits 0 (1 with ``--require-gpu``).

    python bench/gpu_check.py                       # what make gpu-check runs
    python bench/gpu_check.py --mib 1024 --log /tmp/gpu-logs
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402  (bench/gpu.py: the rows, their goals and the table's lines)

TESTS_LIMIT_S = 300.0
BENCH_LIMIT_S = 240.0
PER_TEST_TIMEOUT_S = 120
ALWAYS = ("tests/integration/test_cuda.py", "tests/integration/test_collective.py")
COUNTS = ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed")


def _positive(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return v


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, default=Path("gpu-check-logs"),
                        help="folder for pytest.log, bench.log, bench.json and summary.txt")
    parser.add_argument("--budget-s", type=_positive, default=450.0,
                        help="the whole run's wall limit; each step gets the lesser of its own and what is left")
    parser.add_argument("--mib", type=gpu.positive_int, default=4096, help="bench/gpu.py --mib")
    parser.add_argument("--small-mib", type=gpu.size_mib, default=256, help="bench/gpu.py --small-mib")
    parser.add_argument("--repeats", type=gpu.positive_int, default=5, help="bench/gpu.py --repeats")
    parser.add_argument("--device", default="cuda:0", help="bench/gpu.py --device")
    parser.add_argument("--require-gpu", action="store_true",
                        help="fail (exit 1) instead of skipping where torch sees no CUDA device")
    return parser.parse_args(argv)


# a line that marks with it (a decorator, or an entry of pytestmark), not one that only names it in a string
_MARKS_CUDA = re.compile(r"^\s*(?:@|pytestmark\s*=\s*\[?\s*)?pytest\.mark\.cuda\b", re.M)


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The test files to run, relative to ``root``: the two named in the issue and every one that marks a test
    ``cuda``, so that a new CUDA test file runs without editing a list."""
    found = {str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
             if _MARKS_CUDA.search(p.read_text(errors="replace"))}
    return sorted(found | {f for f in ALWAYS if (root / f).exists()})


_SUMMARY = re.compile(r"^=*\s*(?P<counts>.*?)\s+in (?P<seconds>[\d.]+)s\b.*$")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?|rerun)\b")


def parse_pytest_summary(lines: Sequence[str]) -> Optional[dict]:
    """pytest's last line (``16 passed, 3 skipped, 80 deselected in 51.20s``) as counts and seconds; None when no
    line reads like one."""
    for line in reversed(lines):
        m = _SUMMARY.match(line.strip())
        if not m:
            continue
        counts = {k: 0 for k in COUNTS}
        for n, what in _COUNT.findall(m["counts"]):
            what = "errors" if what.startswith("error") else what
            if what in counts:
                counts[what] = int(n)
        if any(counts.values()) or "no tests ran" in m["counts"]:
            return {**counts, "seconds": float(m["seconds"])}
    return None


@dataclass
class Step:
    """What one subprocess did: its exit code (None when killed at its limit), wall seconds, last lines."""

    name: str
    limit_s: float
    rc: Optional[int] = None
    seconds: float = 0.0
    timed_out: bool = False
    crashed: str = ""  # it could not be started at all
    tail: list[str] = field(default_factory=list)


def run_step(name: str, cmd: Sequence[str], log_path: Path, limit_s: float) -> Step:
    """Run ``cmd`` from the repo root, its output to the console and to ``log_path`` as it comes; past ``limit_s``
    kill it and every process it started (its own session)."""
    step = Step(name, limit_s)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        except OSError as e:
            step.crashed = f"{type(e).__name__}: {e}"
            return step
        tail: collections.deque[str] = collections.deque(maxlen=400)

        def pump() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                tail.append(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            step.rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            step.timed_out = True
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # Whatever it left behind (an agent a killed fixture never stopped) would hold GPU memory during the next step.
        _kill_group(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)
        step.seconds = time.monotonic() - start
        step.tail = list(tail)
        if step.timed_out:
            log.write(f"\n[gpu-check: killed at its {limit_s:.0f} s limit]\n")
    return step


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def card() -> dict:
    """The GPU and the software that drives it, each field on its own so that one failing leaves the others."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        props = torch.cuda.get_device_properties(0)
        info.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", devices=torch.cuda.device_count())
    except Exception as e:
        info["card"] = f"(unknown: {type(e).__name__}: {e})"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["triton"] = f"none ({type(e).__name__})"
    return info


def tests_row(step: Step) -> tuple[dict, list[str]]:
    """The CUDA tests' line of the table, and what failed."""
    counts = parse_pytest_summary(step.tail)
    problems = []
    if step.crashed:
        problems.append(f"the CUDA tests did not start ({step.crashed})")
    elif step.timed_out:
        problems.append(f"the CUDA tests ran past their {step.limit_s:.0f} s wall limit and were killed "
                        f"(pytest.log shows where)")
    elif counts is None:
        problems.append(f"pytest exited with code {step.rc} and printed no summary line (pytest.log)")
    else:
        if counts["failed"] or counts["errors"]:
            problems.append(f"{counts['failed']} CUDA tests failed and {counts['errors']} errored (pytest.log)")
        elif step.rc == 5 or not counts["passed"]:
            problems.append("no CUDA test passed: every one was skipped or none was collected (the skip reasons "
                            "are in pytest.log)")
        elif step.rc != 0:
            problems.append(f"pytest exited with code {step.rc} (pytest.log)")
    note = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped")) if counts else ""
    if step.timed_out or step.crashed:
        note = f"killed at its {step.limit_s:.0f} s limit" if step.timed_out else "did not start"
    row = {"name": "CUDA tests", "seconds": step.seconds, "note": note,
           "result": "error" if step.crashed or step.timed_out else ("FAILED" if problems else "passed")}
    return row, problems


def bench_rows(step: Step, data: Optional[dict], goal_mib: int) -> tuple[list[dict], list[str]]:
    """The bench's rows for the table, and what failed: a step that crashed or timed out, a row with an error, a
    goal missed, a goal row that never ran."""
    problems = []
    if step.crashed:
        problems.append(f"bench/gpu.py did not start ({step.crashed})")
    elif step.timed_out:
        problems.append(f"bench/gpu.py ran past its {step.limit_s:.0f} s wall limit and was killed "
                        f"(bench.log; the rows it finished are below)")
    if data is None:
        problems.append("bench/gpu.py wrote no readable bench.json (bench.log)")
        return [], problems
    if "skipped" in data:
        problems.append(f"bench/gpu.py skipped although this process sees a GPU: {data['skipped']}")
        return [], problems
    if data.get("error"):
        problems.append(f"bench/gpu.py stopped: {data['error']}")
    rows = data.get("rows", [])
    for r in rows:
        if r.get("error"):
            problems.append(f"bench row {r['name']!r} at {r['mib']} MiB failed: {r['error']}")
        elif r.get("met") is False:
            problems.append(f"bench row {r['name']!r} at {r['mib']} MiB missed its goal: {r['ratio']:.2f}x of "
                            f"{r['floor']}, the goal >= {r['goal']:g}x")
    ran = {(r["name"], r["mib"]) for r in rows}
    for name in gpu.GOAL_ROWS:
        if (name, goal_mib) not in ran:
            problems.append(f"bench row {name!r} at {goal_mib} MiB did not run, so its goal is not shown met")
    if step.rc not in (0, None) and not problems:
        problems.append(f"bench/gpu.py exited with code {step.rc} (bench.log)")
    return rows, problems


def summarize(header: str, tests: Step, bench: Step, data: Optional[dict], goal_mib: int) -> tuple[str, list[str]]:
    """The table every run ends with, and the problems that make it exit 1."""
    trow, problems = tests_row(tests)
    rows, bench_problems = bench_rows(bench, data, goal_mib)
    problems += bench_problems
    lines = [header, gpu.HEADER, gpu.row_line(trow), *(gpu.row_line(r) for r in rows)]
    if not rows:
        lines.append(gpu.row_line({"name": "bench", "seconds": bench.seconds, "result": "error",
                                   "note": "no rows (see below)"}))
    lines.append(f"bench: {bench.seconds:.0f} s; goals judged at {goal_mib} MiB; GB/s = bytes / seconds")
    if problems:
        lines += ["gpu-check FAILED:", *(f"  - {p}" for p in problems)]
    else:
        lines.append("gpu-check passed: every CUDA test passed and every goal was met")
    return "\n".join(lines), problems


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    reason = gpu.no_cuda_reason()
    if reason:
        print(f"gpu-check {'FAILED (--require-gpu)' if args.require_gpu else 'skipped'}: {reason}")
        return 1 if args.require_gpu else 0
    deadline = time.monotonic() + args.budget_s
    log_dir = args.log.resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    info = card()
    header = (f"gpu-check on {info.get('card')} ({info.get('memory_gib', '?')} GiB, sm {info.get('capability', '?')},"
              f" {info.get('devices', '?')} devices), torch {info['torch']}, CUDA {info['cuda']}, Triton "
              f"{info['triton']}, Python {info['python']}")
    print(header, flush=True)

    files = cuda_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(PER_TEST_TIMEOUT_S)]
    else:
        print("gpu-check: pytest-timeout is not installed: no per-test timeout, only the step's wall limit")
    print(f"\n== CUDA tests: {' '.join(files)}", flush=True)
    tests = run_step("CUDA tests", [*cmd, *files], log_dir / "pytest.log",
                     max(1.0, min(TESTS_LIMIT_S, deadline - time.monotonic())))

    json_path = log_dir / "bench.json"
    json_path.unlink(missing_ok=True)  # a file from an earlier run must not pass for this one's
    print("\n== bench/gpu.py", flush=True)
    bench = run_step("bench", [sys.executable, str(ROOT / "bench" / "gpu.py"), "--json", str(json_path),
                               "--mib", str(args.mib), "--small-mib", str(args.small_mib),
                               "--repeats", str(args.repeats), "--device", args.device],
                     log_dir / "bench.log", max(1.0, min(BENCH_LIMIT_S, deadline - time.monotonic())))

    table, problems = summarize(header, tests, bench, read_json(json_path), args.mib)
    print(f"\n{table}")
    (log_dir / "summary.txt").write_text(table + "\n")
    print(f"(logs in {log_dir})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
