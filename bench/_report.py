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


def write_section(name: str, title: str, body: str) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md."""
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else HEADER
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"<!-- bench:{name} -->\n## {title}\n\n"
        f"_Written by `bench/{name}.py` on {stamp} ({machine()})._\n\n{body.rstrip()}\n<!-- /bench:{name} -->\n"
    )
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    BENCHMARKS.write_text(text)
