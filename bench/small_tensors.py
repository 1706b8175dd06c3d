"""What a state dict of many small tensors costs per tensor: put_many, reshard_many and get_many of N tiny tensors.

Norms, biases and the experts of a mixture-of-experts model make state dicts of thousands of tensors of a few KiB,
where the fixed cost per tensor, not the bytes, sets the time. Each size puts N tensors of 64 x 8 float32 (2 KiB)
split over tensor-parallel 4 on host0..host3 (`put_many`), moves them to columns over tensor-parallel 2 times two
replicas on host4..host7 (one `reshard_many`, with the planner's record of where its time went) and back, and reads
them all (`get_many`), on local agents (collective transport); before the move back, the tensors are put again and
moved out again, as a weight sync repeats its move every step (the planner and the agents hold its program), timed
against issue 41's goal for a repeated sync of the 139,583-tensor Kimi-K2-like state dict. Each tensor holds its
own run of integers, so a tile put in the wrong place, or another tensor's tile, reads back different: every
device's tile is checked bit for bit after each move out, and every tensor as `get_many` returns it after the move
back (all outside the timed calls).
One run per size: the point is how the cost grows with N, which a single run shows. Writes its section of
BENCHMARKS.md.

    python bench/small_tensors.py [--counts 500,2000,8000] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import write_section  # noqa: E402
from _checks import check_every_device, expected_digests  # noqa: E402

from reshard import Mesh, Sharding  # noqa: E402
from reshard.client.cluster import LocalCluster  # noqa: E402

HOSTS = [f"host{i}" for i in range(8)]
TRAIN = Sharding(Mesh.from_hosts({"tp": 4}, HOSTS[:4], 1), ("tp", None))
INFER = Sharding(Mesh.from_hosts({"dp": 2, "tp": 2}, HOSTS[4:], 1), (None, "tp"))
SHAPE = (64, 8)
NUM_VALUES = SHAPE[0] * SHAPE[1]
MAX_COUNT = 2**24 // NUM_VALUES  # float32 holds every integer up to 2**24 exactly
TIMEOUT_S = 1800
KIMI_TENSORS = 139_583  # reshard.moe.KIMI_K2's state dict with its block scales (bench/plan_quality.py's MoE rows)
GOAL_MS = 50  # issue 41: a repeated sync of it, request to every agent started
REPEAT_PHASES = ("waiting", "planning", "running", "committing")


def values(i: int) -> np.ndarray:
    """Tensor ``i``: the integers i * NUM_VALUES onwards, no two elements of any two tensors alike."""
    return np.arange(i * NUM_VALUES, (i + 1) * NUM_VALUES, dtype=np.int64).astype(np.float32).reshape(SHAPE)


def measure(c, n: int) -> dict:
    """Seconds of each call for ``n`` tensors, and the reshard_many's phases."""
    tensors = {f"n{n}.t{i}": (values(i), TRAIN) for i in range(n)}
    out: dict = {}
    t0 = time.monotonic()
    c.put_many(tensors)
    out["put_many"] = time.monotonic() - t0
    t0 = time.monotonic()
    result = c.reshard_many({name: INFER for name in tensors}).result(timeout=TIMEOUT_S)
    out["reshard_many"] = time.monotonic() - t0
    out["phases"] = result.phases
    check_every_device(c, expected_digests(tensors, {name: INFER for name in tensors}), "the reshard_many out")
    # The same move again, as a weight sync repeats it every step: the trainer publishes the next version in its
    # layout (untimed), and the planner and the agents hold the move's program, so what is left is a job's cost per
    # tensor.
    c.put_many(tensors)
    t0 = time.monotonic()
    # Whole (delta=False): the same values put again would otherwise move as an empty delta where one pays.
    again = c.reshard_many({name: INFER for name in tensors}, delta=False).result(timeout=TIMEOUT_S)
    out["again"] = time.monotonic() - t0
    out["again_phases"] = again.phases
    if again.plan_id != result.plan_id:
        raise AssertionError(f"the repeated move ran program {again.plan_id[:12]}, not the first's "
                             f"{result.plan_id[:12]}: the same layouts planned another program")
    check_every_device(c, expected_digests(tensors, {name: INFER for name in tensors}), "the repeated reshard_many")
    t0 = time.monotonic()
    c.reshard_many({name: TRAIN for name in tensors}).result(timeout=TIMEOUT_S)
    out["back"] = time.monotonic() - t0
    t0 = time.monotonic()
    got = c.get_many(list(tensors))
    out["get_many"] = time.monotonic() - t0
    bad = [name for name, (a, _) in tensors.items() if not np.array_equal(got[name], a)]
    if bad:
        raise AssertionError(f"after the reshard_many back, {len(bad)} tensors read back different from what was "
                             f"put, {bad[:3]} first")
    c.delete_many(list(tensors))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="500,2000,8000",
                    help="how many tensors, comma separated (default 500,2000,8000)")
    ap.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.counts.split(",")]
    except ValueError:
        ap.error(f"--counts takes whole numbers separated by commas, like 500,2000; got {args.counts!r}")
    if not all(1 <= n <= MAX_COUNT for n in counts):
        ap.error(f"--counts must each be 1 to {MAX_COUNT} (tensor i holds the integers from {NUM_VALUES} * i, exact "
                 f"in float32 up to 2**24); got {args.counts}")
    rows = ["| tensors | put_many s | ms per tensor | reshard_many s | ms per tensor | of it: planning s | running s "
            "| back s | get_many s | ms per tensor |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    repeats = ["| tensors | repeated reshard_many s | us per tensor | "
               + " | ".join(f"of it: {k} s" for k in REPEAT_PHASES)
               + f" | at {KIMI_TENSORS:,} tensors (linear): waiting + planning s | the whole job s |",
               "|---:|---:|---:|" + "---:|" * len(REPEAT_PHASES) + "---:|---:|"]
    last = 0.0
    with LocalCluster(len(HOSTS), 1, host_names=HOSTS, transport="collective") as cluster, cluster.connect() as c:
        for n in counts:
            m = measure(c, n)
            print(f"{n} tensors: put_many {m['put_many']:.2f}s reshard_many {m['reshard_many']:.2f}s "
                  f"({m['phases']}) back {m['back']:.2f}s get_many {m['get_many']:.2f}s", flush=True)
            rows.append(f"| {n} | {m['put_many']:.2f} | {1e3 * m['put_many'] / n:.1f} | {m['reshard_many']:.2f} | "
                        f"{1e3 * m['reshard_many'] / n:.1f} | {m['phases'].get('planning', 0):.2f} | "
                        f"{m['phases'].get('running', 0):.2f} | {m['back']:.2f} | {m['get_many']:.2f} | "
                        f"{1e3 * m['get_many'] / n:.1f} |")
            phases = m["again_phases"]
            planner = phases.get("waiting", 0) + phases.get("planning", 0)
            repeats.append(f"| {n} | {m['again']:.3f} | {1e6 * m['again'] / n:.0f} | "
                           + " | ".join(f"{phases.get(k, 0):.3f}" for k in REPEAT_PHASES)
                           + f" | {planner / n * KIMI_TENSORS:.2f} | {m['again'] / n * KIMI_TENSORS:.1f} |")
            last = planner / n
    body = ("Tensors of 64 x 8 float32 (2 KiB) put split over tensor-parallel 4 on host0..host3, moved by one "
            "`reshard_many` to columns over tensor-parallel 2 times two replicas on host4..host7 and back, and read "
            "by one `get_many`, on 8 local agents (collective transport) of this machine; one run per size. Each "
            "tensor holds its own run of integers, so a misplaced tile reads back different; outside the timed "
            "calls, every device's tile of every tensor is checked bit for bit after the move out (blake2b on the "
            "agents, both replicas) and every tensor `get_many` returned after the move back. Planning and running "
            "are the move's phases as the planner recorded them (`JobResult.phases`). The bytes are few: the time "
            "is per tensor and per piece (each tensor here is 8 pieces in the move), paid in `put_many` and "
            "`get_many` as a header, a piece and a trailer message per shard (an agent's small shards share one "
            "stream each way, and a put_many commits with one call per agent) and in `reshard_many` as planning a "
            "program of 8 steps per tensor, which each agent then reads (once per distinct program: a weight sync "
            "that repeats its move reads it once).\n\n"
            + "\n".join(rows)
            + "\n\nThe same move again, as a weight sync repeats it every step: the tensors are put again in the "
            "training layout (untimed) and moved out again. The planner finds the program it planned (the run must "
            "report the first move's program id, and its tiles are checked again), and every agent holds it parsed, "
            "so what is left is a job's cost per tensor: the request, the catalog's records and claims, each host's "
            "prepare and run, the commit. Issue 41 asks "
            f"for a repeated sync of the {KIMI_TENSORS:,}-tensor Kimi-K2-like state dict to cost the planner under "
            f"{GOAL_MS} ms from request to every agent started: here the phases before any agent is called "
            "(waiting and planning: the records, the claims, the cached program, the transport), which leave out "
            "the request's own parsing before the job exists. The last two columns scale them, and the whole job, "
            "linearly to that count.\n\n"
            + "\n".join(repeats)
            + f"\n\nThe planner's part costs {1e6 * last:.1f} us per tensor at the largest count; the goal allows "
            f"{1e6 * GOAL_MS / 1e3 / KIMI_TENSORS:.2f} us "
            f"({'met' if last * KIMI_TENSORS <= GOAL_MS / 1e3 else '**not met**'}). Reaching it takes a job whose "
            "records, claims and commits are columns rather than an object per "
            "tensor (issue 41 part 1), and a request that names a sync it registered once instead of resending "
            "every name and sharding."
            + f"\n\nReproduce: `python bench/small_tensors.py --counts {args.counts}`.")
    print(body)
    if not args.no_write:
        write_section("small_tensors", "Many small tensors: what each tensor costs", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
