"""Where an emulated weight sync's CPU goes, machine-wide (issue 38's must-show 3: `reshard_many` within 1.10x of its
lower bound on the emulated hosts, which share this machine's cores).

For each transport of ``--transports`` (one lab cluster each): the weight sync of ``bench/weight_sync.py`` (its
state dict, 50 layers of hidden 512 by default, tensor-parallel 4 on host0..host3 to two replicas of tensor-parallel
2 on host4..host7, links shaped to ``--gbps``) runs `weight_sync.WARMUP` untimed times, then ``--runs`` timed times
while ``perf record -a`` samples every core (`RATE_HZ`, on the monotonic clock, so that each sample can be placed in
or out of a sync by the sync's own start and end). Every run is checked bit-exact. Of the samples inside the syncs:

- how busy the machine was: the samples in which a core ran anything but the idle task, against the samples every
  core would give all the time (perf takes none on a core idle without its tick), over the whole syncs and over
  each sync's first `START_MS` (the job's start: its planning, its Execute reaching the agents, their prepares, the
  first posts);
- what ran, by kind: the Python interpreter (``libpython``), the kernel's networking (softirq, TCP, IP, the veth
  pairs and their shaping) and its copies to and from user memory, the rest of the kernel (scheduling, system
  calls, page faults), the C library, NIXL and UCX's libraries, numpy and the rest;
- and by whom: the planner, the training hosts' agents, the inference hosts' agents, this process (the client), and
  the kernel's own threads.

The sync is bound by these cores where they are busy nearly all the time: what would bring it to its bound is then
less CPU per byte, not a better plan. Needs root (the lab) and ``perf`` (Debian: ``apt-get install linux-perf``);
says why where either is missing.

    python bench/cpu_profile.py [--transports nixl,collective] [--runs 3] [--gbps 1] [--no-write]
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import write_section  # noqa: E402
from _checks import check_every_device, expected_digests  # noqa: E402
from buckets import _settle, state_dict  # noqa: E402
import link_timeline  # noqa: E402
import weight_sync  # noqa: E402

RATE_HZ = 2000  # perf's samples per second per core
START_MS = 60  # a sync's first milliseconds, counted apart: the job's start
TIMEOUT_S = 900
# The kernel's symbols counted as its networking: the stack the emulated links' bytes go through
NET = ("tcp", "softirq", "net_", "napi", "skb", "ip_", "ipv4", "veth", "dev_", "tbf", "htb", "qdisc", "sock", "inet")
KINDS = ("Python interpreter", "kernel: networking", "kernel: copies to and from user memory", "kernel: the rest",
         "C library", "NIXL and UCX", "numpy", "the rest")
SAMPLE = re.compile(r"\s*(.+?)\s+(\d+)/(\d+)\s+([\d.]+):\s+\S+\s+(.*?)\s+\((.*)\)\s*$")


def perf_missing() -> str | None:
    """Why ``perf record -a`` cannot run here, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian: apt-get install linux-perf)"
    if os.geteuid() != 0:
        return "perf record -a and the lab need root"
    return None


def kind(dso: str, sym: str) -> str:
    """What a sample ran, by its library and symbol (`KINDS`)."""
    name = dso.rsplit("/", 1)[-1]
    if "kernel" in name:
        # rep_movs_alternative: the user copy of x86 kernels from 6.5 on (this machine's 6.18), which copy_*_iter call
        if "copy_to_iter" in sym or "copy_from_iter" in sym or "copy_user" in sym or sym == "rep_movs_alternative":
            return KINDS[2]
        return KINDS[1] if any(k in sym for k in NET) else KINDS[3]
    if "libpython" in name:
        return KINDS[0]
    if name.startswith(("libc.", "libc-")):
        return KINDS[4]
    if any(k in name for k in ("nixl", "libuc", "plugin_UCX", "serdes")):
        return KINDS[5]
    if "multiarray" in name or "numpy" in name:
        return KINDS[6]
    return KINDS[7]


def measure(transport: str, runs: int, gbps: float, layers: int, hidden: int) -> dict:
    """Each timed run's seconds and window, and the perf samples of the timed part, parsed."""
    tensors, infer = state_dict(layers, hidden)
    windows, seconds = [], []
    with tempfile.TemporaryDirectory() as tmp, weight_sync._lab_cluster(gbps, transport) as (lab, c, tm, im):
        procs = lab.processes  # the planner first, then each host's agent (`start_cluster`)
        roles = {str(procs[0].pid): "planner"}
        roles.update({str(p.pid): "training hosts' agents" if i < 4 else "inference hosts' agents"
                      for i, p in enumerate(procs[1:])})
        roles[str(os.getpid())] = "this process (the client)"
        put, there, back = weight_sync.lab_layouts(tensors, infer, tm, im)
        expected = expected_digests(tensors, there)
        names = list(tensors)
        c.put_many(put)
        data = Path(tmp) / "perf.data"
        recorder = None
        try:
            for k in range(1 - weight_sync.WARMUP, runs + 1):  # k <= 0: untimed
                if k == 1:
                    recorder = subprocess.Popen(["perf", "record", "-a", "-k", "mono", "-F", str(RATE_HZ), "-o",
                                                 str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)  # perf is recording before the first timed sync
                t0 = time.monotonic()
                c.reshard_many(there).result(timeout=TIMEOUT_S)
                t1 = time.monotonic()
                if k > 0:
                    windows.append((t0, t1))
                    seconds.append(t1 - t0)
                _settle(c, names)
                check_every_device(c, expected, f"{transport} reshard_many")
                print(f"{transport}: reshard_many {'(untimed) ' if k <= 0 else ''}{t1 - t0:.3f}s", flush=True)
                c.reshard_many(back).result(timeout=TIMEOUT_S)
                _settle(c, names)
        finally:  # a failed sync leaves no perf recording every core behind
            if recorder is not None:
                recorder.send_signal(signal.SIGINT)
                recorder.wait(timeout=60)
        script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,tid,time,ip,sym,dso"],
                                capture_output=True, text=True, check=True).stdout
    return {"seconds": seconds, "bound": weight_sync.lab_bound(tensors, infer, gbps),
            **tally(script, windows, roles)}


def tally(script: str, windows: list[tuple[float, float]], roles: dict[str, str]) -> dict:
    """Counts of ``perf script``'s busy samples (not the idle task) inside ``windows``: all, by kind and by whom, and
    those within each window's first `START_MS`; against the samples every core would give all the time."""
    busy = start_busy = 0
    kinds, whom = Counter(), Counter()
    for line in script.splitlines():
        m = SAMPLE.match(line)
        if m is None:
            continue
        comm, pid, _, t, sym, dso = m.groups()
        t = float(t)
        window = next((w for w in windows if w[0] <= t < w[1]), None)
        if window is None:
            continue
        if comm == "swapper":
            continue
        busy += 1
        start_busy += t < window[0] + START_MS / 1e3
        kinds[kind(dso, sym.split("+")[0])] += 1
        whom[roles.get(pid, "the kernel's threads" if "kernel" in dso and comm.startswith("k") else "others")] += 1
    # perf takes no sample on a core that sleeps in the idle task without its tick: a core's time is counted from
    # the rate, and its idle part is what no busy sample covers
    cores = os.cpu_count() or 1
    return {"busy": busy, "start_busy": start_busy, "kinds": kinds,
            "whom": whom, "possible": sum(b - a for a, b in windows) * cores * RATE_HZ,
            "start_possible": len(windows) * START_MS / 1e3 * cores * RATE_HZ}


def section(measured: dict, gbps: float, layers: int, hidden: int, runs: int) -> str:
    parts = []
    for transport, m in measured.items():
        if "skipped" in m:
            parts.append(f"{transport}: skipped: {m['skipped']}")
            continue
        if not m["busy"]:
            parts.append(f"{transport}: perf recorded no sample inside the syncs")
            continue
        median = statistics.median(m["seconds"])
        rows = ["| what ran | share of the busy samples |", "|---|---:|"]
        rows += [f"| {k} | {m['kinds'][k] / m['busy']:.0%} |" for k in KINDS if m["kinds"][k]]
        rows += ["", "| whose | share of the busy samples |", "|---|---:|"]
        rows += [f"| {w} | {n / m['busy']:.0%} |" for w, n in m["whom"].most_common()]
        busy = min(1.0, m["busy"] / m["possible"])
        start = min(1.0, m["start_busy"] / m["start_possible"])
        parts.append(
            f"**{transport}**: median sync {median:.3f} s, {median / m['bound']:.2f}x the lower bound "
            f"({m['bound']:.3f} s). Over the {len(m['seconds'])} timed syncs this machine's cores were busy "
            f"{busy:.0%} of the time ({m['busy']:,} busy samples against {m['possible']:,.0f} for every core all the "
            f"time), and {start:.0%} of each sync's first {START_MS} ms (the job's start).\n\n" + "\n".join(rows))
    return (f"`bench/weight_sync.py`'s emulated-hosts sync ({layers} layers, hidden {hidden}: tensor-parallel 4 on "
            f"host0..host3 to two replicas of tensor-parallel 2 on host4..host7, links shaped to {gbps:g} Gbit/s each "
            f"way), {runs} timed runs each checked bit-exact, while `perf record -a` sampled every core at {RATE_HZ} "
            f"Hz; the samples inside the syncs, by what ran and by whom (the module docstring says how they are "
            f"sorted). Where the cores are busy nearly all the time, the sync is bound by them, not by the links: "
            f"what brings it to its bound is less CPU per byte.\n\n" + "\n\n".join(parts)
            + f"\n\nReproduce: `python bench/cpu_profile.py --runs {runs}` (root, with perf).")


def main(argv=None) -> int:
    args = link_timeline.sync_options(__doc__.split("\n\n")[0], argv)
    from reshard.server.devtools.lab import lab_available

    ok, why = lab_available()
    why = perf_missing() if ok else why
    measured = {}
    for transport in args.transports.split(","):
        measured[transport] = {"skipped": why} if why else measure(transport, args.runs, args.gbps, args.layers,
                                                                     args.hidden)
    body = section(measured, args.gbps, args.layers, args.hidden, args.runs)
    print(body)
    if not args.no_write:
        write_section("cpu_profile", "Issue 38: where an emulated weight sync's CPU goes, machine-wide", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
