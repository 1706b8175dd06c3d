"""`reshard plan` as a person runs it: the installed command in a real subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reshard import STRATEGIES, Plan

RESHARD = Path(sys.executable).with_name("reshard")
ENTRY_POINTS = {
    "console script": [str(RESHARD)],
    "python -m": [sys.executable, "-m", "reshard.server.cli"],
}
# 1024 x 1024 float32 = 4 MiB: rows over the source hosts, columns over the destination hosts.
CASE = ["--shape", "1024,1024", "--src", "x=2,y=2", "--src-spec", "x,_", "--dst", "x=2,y=2", "--dst-spec", "_,x"]
HOST_LINE = re.compile(r"^\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", re.M)


def run(*args: str, entry: str = "console script") -> subprocess.CompletedProcess:
    if entry == "console script" and not RESHARD.exists():
        pytest.skip(f"{RESHARD} is not installed (pip install -e .)")
    return subprocess.run([*ENTRY_POINTS[entry], "plan", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_summary_shows_each_hosts_load_and_the_bound(entry):
    out = run(*CASE, entry=entry)
    assert out.returncode == 0, out.stderr
    assert "lower bound" in out.stdout
    assert re.search(r"host\s+send MiB\s+recv MiB", out.stdout)
    loads = {h: (float(s), float(r)) for h, s, r, _, _ in HOST_LINE.findall(out.stdout)}
    # Each source host sends its 2 MiB of rows once; each destination host receives its 2 MiB of columns.
    assert loads == {"src0": (2.0, 0.0), "src1": (2.0, 0.0), "dst0": (0.0, 2.0), "dst1": (0.0, 2.0)}
    assert re.search(r"ratio 1\.000\); 4\.00 MiB over the network", out.stdout)
    assert re.search(r"^transfers \(\d+\):$", out.stdout, re.M)


def test_json_is_a_plan_that_validates():
    out = run(*CASE, "--json", "--strategy", "broadcast")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    p = Plan.from_json(data).validate()
    assert p.strategy == "broadcast" and p.id == data["id"]
    assert p.network_bytes() == 4 * 2**20
    assert data["src"]["mesh"]["devices"] == ["src0/0", "src0/1", "src1/0", "src1/1"]


def test_strategy_all_compares_every_strategy():
    out = run(*CASE, "--strategy", "all")
    assert out.returncode == 0, out.stderr
    assert "lower bound" in out.stdout
    rows = [line.split()[0] for line in out.stdout.splitlines()[2:]]
    assert rows == list(STRATEGIES)


def test_strategy_all_as_json_lists_every_plan():
    out = run(*CASE, "--strategy", "all", "--json")
    assert out.returncode == 0, out.stderr
    plans = [Plan.from_json(d).validate() for d in json.loads(out.stdout)]
    assert [p.strategy for p in plans] == list(STRATEGIES)


BAD_ARGS = [
    (("--src-spec", "z,_"), r"dim 0 is split over unknown axis 'z'; the mesh's axes are \['x', 'y'\]"),
    (("--dst-spec", "x,x"), r"axis 'x' splits dim 1 but is already used by dim 0"),
    (("--src", "x=two"), r"mesh axis 'x=two' in 'x=two' is not NAME=SIZE"),
    (("--shape", "0,4"), r"dim 0 of shape \(0, 4\) has size 0; every dim size must be a positive integer"),
    (("--shape", "4,abc"), r"shape '4,abc' is not a list of sizes like 1024,1024,512"),
    (("--dtype", "float8"), r"unknown dtype 'float8'"),
    # The way out is named in the command's own notation, not as a Python argument (devices_per_host).
    (("--src", "x=2,y=4@node[0-5]"), r"^error: --src: mesh 'x=2,y=4@node\[0-5\]' has 8 positions, which do not divide "
                                     r"evenly over its 6 hosts; name 1, 2, 4 or 8 hosts .*or none \('x=2,y=4'"),
]


@pytest.mark.parametrize("change, message", BAD_ARGS, ids=[" ".join(c) for c, _ in BAD_ARGS])
def test_bad_input_exits_2_with_the_rule_on_stderr(change, message):
    args = list(CASE)
    flag, value = change
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    out = run(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    assert "error: " in out.stderr
    assert re.search(message, out.stderr), out.stderr
    assert "Traceback" not in out.stderr and "devices_per_host" not in out.stderr
