"""Writes one bench's section of BENCHMARKS.md, leaving the other benches' sections alone."""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nEvery section below is written by a script in `bench/` (run `make bench`); none is edited by hand.\n"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def turns(ours: list[float], theirs: list[float], what: str, baseline: str, where: str = "") -> str:
    """A sentence on the spread of interleaved timed turns (``where``: a few words on where they ran): each side's
    seconds, and ``what``'s speed against ``baseline``'s turn by turn (a turn of each runs in the same stretch of
    this shared machine's drifting load)."""
    ratios = [t / o for o, t in zip(ours, theirs)]
    where = f" {where}," if where else ""
    return (f"Over the {len(ours)} timed turns{where} {what} took {min(ours):.3f}-{max(ours):.3f} s and {baseline} "
            f"{min(theirs):.3f}-{max(theirs):.3f} s, and turn by turn {what} ran at {min(ratios):.2f}x to "
            f"{max(ratios):.2f}x {baseline}'s speed.")


def write_section(name: str, title: str, body: str, script: str | None = None) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md, written by ``bench/{script}.py`` (default: the
    script named ``name``; one script may write several sections, e.g. one per transport)."""
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else HEADER
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"<!-- bench:{name} -->\n## {title}\n\n"
        f"_Written by `bench/{script or name}.py` on {stamp} ({machine()})._\n\n{body.rstrip()}\n<!-- /bench:{name} -->\n"
    )
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    BENCHMARKS.write_text(text)
