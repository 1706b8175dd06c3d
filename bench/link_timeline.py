"""Where an emulated weight sync's time goes, link by link (issue 38's must-show 3: `reshard_many` within 1.10x of
its lower bound on the emulated hosts).

For each transport of ``--transports`` (one lab cluster each): the weight sync of ``bench/weight_sync.py`` (its
state dict, 50 layers of hidden 512 by default: 202 MiB from tensor-parallel 4 on host0..host3 to two replicas of
tensor-parallel 2 on host4..host7; 8 emulated hosts, links shaped to ``--gbps`` each way) runs ``--runs`` timed
times after `weight_sync.WARMUP` untimed ones, each while the lab samples every host link's byte counters every
`INTERVAL_S` (`Lab.sample_links`), and each checked bit-exact. For each timed run:

- seconds from the request to the job's result, against the lower bound (`weight_sync.lab_bound`);
- when the first MiB had crossed into the hosts, and when the last byte crossed (the job's end after that is its
  commit and its answer);
- the inference hosts' links: their mean use over the sync (bytes received / (seconds x line rate)), and the share
  of `BIN_S` bins between the first and the last byte in which they ran at `FULL` of the line rate or more;
- the CPU seconds the service (planner and agents) used, and how many of this machine's cores that keeps busy.

Then the median run's timeline, bin by bin: what each training host sent and each inference host received.
Bytes on the links include their frames' headers (9000-byte frames) and the job's control messages.

Usage (root, for the lab's network namespaces):

    python bench/link_timeline.py [--transports nixl,collective] [--runs 3] [--gbps 1] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import write_section  # noqa: E402
from _checks import check_every_device, expected_digests  # noqa: E402
from _meter import cpu_seconds  # noqa: E402
from buckets import HOSTS, _settle, state_dict  # noqa: E402
import weight_sync  # noqa: E402

INTERVAL_S = 0.005  # how often the lab samples the links' counters
BIN_S = 0.05  # the timeline's bins
FULL = 0.9  # a link runs full in a bin where it moves this share of its line rate or more
FIRST_BYTES = 1 << 20  # the sync's bytes have begun to cross once this many have
LAST_BYTES = 16 << 10  # a sample in which a link moved fewer (a heartbeat) is not the sync's
TIMEOUT_S = 900
MB = 1e6


def measure(transport: str, layers: int, hidden: int, runs: int, gbps: float) -> dict:
    """Each timed run's seconds, its service CPU seconds and its `links.LinkTimeline` with the run's start and end."""
    tensors, infer = state_dict(layers, hidden)
    runs_out = []
    with weight_sync._lab_cluster(gbps, transport) as (lab, c, train_mesh, infer_mesh):
        service = [p.pid for p in lab.processes]  # the planner and the agents (`start_cluster`)
        put, there, back = weight_sync.lab_layouts(tensors, infer, train_mesh, infer_mesh)
        expected = expected_digests(tensors, there)
        names = list(tensors)
        c.put_many(put)
        for k in range(1 - weight_sync.WARMUP, runs + 1):  # k <= 0: untimed
            with lab.sample_links(INTERVAL_S) as sampler:
                used = cpu_seconds(service)
                t0 = time.monotonic()
                result = c.reshard_many(there).result(timeout=TIMEOUT_S)
                t1 = time.monotonic()
                cpu = cpu_seconds(service) - used
            _settle(c, names)
            check_every_device(c, expected, f"{transport} reshard_many")
            print(f"{transport}: reshard_many {'(untimed) ' if k <= 0 else ''}{t1 - t0:.3f}s, {cpu:.2f} CPU s",
                  flush=True)
            if k > 0:
                runs_out.append({"seconds": t1 - t0, "cpu": cpu, "timeline": sampler.timeline, "t0": t0, "t1": t1,
                                 "network_bytes": result.network_bytes, "carried_by": sorted(set(result.transports))})
            c.reshard_many(back).result(timeout=TIMEOUT_S)
            _settle(c, names)
    return {"runs": runs_out, "bound": weight_sync.lab_bound(tensors, infer, gbps)}


def analyse(run: dict) -> dict:
    """What a run's timeline says (see the module docstring)."""
    timeline, t0, t1 = run["timeline"], run["t0"], run["t1"]
    rate = timeline.rate
    receivers = [timeline.hosts.index(h) for h in HOSTS[4:]]
    first = timeline.first_byte(t0, FIRST_BYTES)
    last = timeline.last_byte(t0, t1, LAST_BYTES)
    starts, _, received = timeline.bins(t0, t1, BIN_S)
    moving = (starts + BIN_S > (first or 0.0)) & (starts < last)
    full = received[moving][:, receivers] >= FULL * rate * BIN_S
    crossed = timeline.totals(t0, t1)
    return {"first_ms": None if first is None else first * 1e3, "last_ms": last * 1e3,
            "after_last_ms": (run["seconds"] - last) * 1e3,
            "use": statistics.mean(crossed[timeline.hosts[h]][1] / (run["seconds"] * rate) for h in receivers),
            "full": float(full.mean()) if full.size else 0.0, "cores": run["cpu"] / run["seconds"]}


def timeline_table(run: dict) -> str:
    """The run's timeline in `BIN_S` bins: MB each host sent (an inference host forwards down its chains) and each
    inference host received."""
    timeline, t0, t1 = run["timeline"], run["t0"], run["t1"]
    starts, sent, received = timeline.bins(t0, t1, BIN_S)
    every = [timeline.hosts.index(h) for h in HOSTS]
    receivers = every[4:]
    head = ("| from ms | " + " | ".join(f"{h} sent" for h in HOSTS) + " | "
            + " | ".join(f"{h} received" for h in HOSTS[4:]) + " |")
    rows = [head, "|" + "---:|" * 13]
    for b, start in enumerate(starts):
        cells = [f"{sent[b, h] / MB:.1f}" for h in every] + [f"{received[b, h] / MB:.1f}" for h in receivers]
        rows.append(f"| {start * 1e3:.0f} | " + " | ".join(cells) + " |")
    line = timeline.rate * BIN_S / MB
    return (f"The median run's timeline, MB per {BIN_S * 1e3:.0f} ms bin (a link at line rate moves {line:.2f} MB "
            f"a bin, headers included):\n\n" + "\n".join(rows))


def section(measured: dict, gbps: float, layers: int, hidden: int) -> str:
    parts = []
    for transport, m in measured.items():
        if "skipped" in m:
            parts.append(f"{transport}: skipped: {m['skipped']}")
            continue
        bound = m["bound"]
        rows = ["| run | seconds | / bound | first MiB after ms | last byte after ms | after it ms | inference links' "
                f"use | bins at {FULL:.0%}+ of line rate | service CPU s | cores busy |", "|" + "---:|" * 10]
        found = [analyse(r) for r in m["runs"]]
        for i, (r, a) in enumerate(zip(m["runs"], found), 1):
            first = "-" if a["first_ms"] is None else f"{a['first_ms']:.0f}"
            rows.append(f"| {i} | {r['seconds']:.3f} | {r['seconds'] / bound:.2f}x | {first} | {a['last_ms']:.0f} | "
                        f"{a['after_last_ms']:.0f} | {a['use']:.0%} | {a['full']:.0%} | {r['cpu']:.2f} | "
                        f"{a['cores']:.2f} |")
        median = sorted(range(len(m["runs"])), key=lambda i: m["runs"][i]["seconds"])[len(m["runs"]) // 2]
        a, r = found[median], m["runs"][median]
        firsts = [f["first_ms"] for f in found if f["first_ms"] is not None]
        parts.append(
            f"**{transport}** (transfers carried by {r['carried_by']}; lower bound {bound:.3f} s): median run "
            f"{r['seconds']:.3f} s, {r['seconds'] / bound:.2f}x the bound. Over the {len(found)} runs the first MiB "
            f"crossed {min(firsts, default=0):.0f}-{max(firsts, default=0):.0f} ms after the request; the inference "
            f"hosts' links were used at {min(f['use'] for f in found):.0%}-{max(f['use'] for f in found):.0%} of "
            f"their line rate over the whole sync, and ran at {FULL:.0%} of it or more in "
            f"{min(f['full'] for f in found):.0%}-{max(f['full'] for f in found):.0%} of the bins between the first "
            f"byte and the last; the service kept {min(f['cores'] for f in found):.2f}-"
            f"{max(f['cores'] for f in found):.2f} of this machine's cores busy.\n\n" + "\n".join(rows)
            + "\n\n" + timeline_table(r))
    return (f"`bench/weight_sync.py`'s emulated-hosts sync ({layers} layers, hidden {hidden}: tensor-parallel 4 on "
            f"host0..host3 to two replicas of tensor-parallel 2 on host4..host7, links shaped to {gbps:g} Gbit/s each "
            f"way), each timed run with the lab sampling every host link's byte counters every "
            f"{INTERVAL_S * 1e3:.0f} ms (`Lab.sample_links`); every run checked bit-exact. What the columns mean is "
            f"in the script's docstring. The lower bound is the bytes of the busiest inference host at the line "
            f"rate: it is met only where that host's link runs full from the request to the result.\n\n"
            + "\n\n".join(parts) + "\n\nReproduce: `python bench/link_timeline.py` (root).")


def sync_options(description: str, argv=None) -> argparse.Namespace:
    """The options of a bench that runs the emulated-hosts sync once per transport (this one and cpu_profile.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--transports", default="nixl,collective", help="comma-separated (default nixl,collective)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gbps", type=float, default=1.0, help="the lab's link rate, Gbit/s each way (default 1)")
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--no-write", action="store_true", help="print, do not write BENCHMARKS.md")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = sync_options(__doc__.split("\n\n")[0], argv)
    from reshard.server.devtools.lab import lab_available

    ok, why = lab_available()
    measured = {}
    for transport in args.transports.split(","):
        measured[transport] = measure(transport, args.layers, args.hidden, args.runs, args.gbps) if ok \
            else {"skipped": why}
    body = section(measured, args.gbps, args.layers, args.hidden)
    print(body)
    if not args.no_write:
        write_section("link_timeline", "Issue 38: where an emulated weight sync's time goes, link by link", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
