"""What a state dict of many small tensors costs per tensor: put_many, reshard_many and get_many of N tiny tensors.

Norms, biases and the experts of a mixture-of-experts model make state dicts of thousands of tensors of a few KiB,
where the fixed cost per tensor, not the bytes, sets the time. Each size puts N tensors of 64 x 8 float32 (2 KiB)
split over tensor-parallel 4 on host0..host3 (`put_many`), moves them to columns over tensor-parallel 2 times two
replicas on host4..host7 (one `reshard_many`, with the planner's record of where its time went) and back, and reads
them all (`get_many`), checked bit for bit, on local agents (collective transport). One run per size: the point is
how the cost grows with N, which a single run shows. Writes its section of BENCHMARKS.md.

    python bench/small_tensors.py [--counts 500,2000] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import write_section  # noqa: E402

from reshard import Mesh, Sharding  # noqa: E402
from reshard.client.cluster import LocalCluster  # noqa: E402

HOSTS = [f"host{i}" for i in range(8)]
TRAIN = Sharding(Mesh.from_hosts({"tp": 4}, HOSTS[:4], 1), ("tp", None))
INFER = Sharding(Mesh.from_hosts({"dp": 2, "tp": 2}, HOSTS[4:], 1), (None, "tp"))
SHAPE = (64, 8)
TIMEOUT_S = 1800


def measure(c, n: int) -> dict:
    """Seconds of each call for ``n`` tensors, and the reshard_many's phases."""
    tensors = {f"n{n}.t{i}": (np.full(SHAPE, i, np.float32), TRAIN) for i in range(n)}
    out: dict = {}
    t0 = time.monotonic()
    c.put_many(tensors)
    out["put_many"] = time.monotonic() - t0
    t0 = time.monotonic()
    result = c.reshard_many({name: INFER for name in tensors}).result(timeout=TIMEOUT_S)
    out["reshard_many"] = time.monotonic() - t0
    out["phases"] = result.phases
    t0 = time.monotonic()
    c.reshard_many({name: TRAIN for name in tensors}).result(timeout=TIMEOUT_S)
    out["back"] = time.monotonic() - t0
    t0 = time.monotonic()
    got = c.get_many(list(tensors))
    out["get_many"] = time.monotonic() - t0
    bad = [name for name, (a, _) in tensors.items() if not np.array_equal(got[name], a)]
    if bad:
        raise AssertionError(f"{len(bad)} tensors read back different from what was put, {bad[:3]} first")
    for name in tensors:
        c.delete(name)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="500,2000", help="how many tensors, comma separated (default 500,2000)")
    ap.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    counts = [int(x) for x in args.counts.split(",")]
    rows = ["| tensors | put_many s | ms per tensor | reshard_many s | ms per tensor | of it: planning s | running s "
            "| back s | get_many s | ms per tensor |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    with LocalCluster(len(HOSTS), 1, host_names=HOSTS, transport="collective") as cluster, cluster.connect() as c:
        for n in counts:
            m = measure(c, n)
            print(f"{n} tensors: put_many {m['put_many']:.2f}s reshard_many {m['reshard_many']:.2f}s "
                  f"({m['phases']}) back {m['back']:.2f}s get_many {m['get_many']:.2f}s", flush=True)
            rows.append(f"| {n} | {m['put_many']:.2f} | {1e3 * m['put_many'] / n:.1f} | {m['reshard_many']:.2f} | "
                        f"{1e3 * m['reshard_many'] / n:.1f} | {m['phases'].get('planning', 0):.2f} | "
                        f"{m['phases'].get('running', 0):.2f} | {m['back']:.2f} | {m['get_many']:.2f} | "
                        f"{1e3 * m['get_many'] / n:.1f} |")
    body = ("Tensors of 64 x 8 float32 (2 KiB) put split over tensor-parallel 4 on host0..host3, moved by one "
            "`reshard_many` to columns over tensor-parallel 2 times two replicas on host4..host7 and back, and read "
            "by one `get_many`, on 8 local agents (collective transport) of this machine; every tensor checked bit "
            "for bit; one run per size. Planning and running are the move's phases as the planner recorded them "
            "(`JobResult.phases`). The bytes are few: the time is per tensor and per piece (each tensor here is 8 "
            "pieces in the move), paid in `put_many` and `get_many` as a header, a piece and a trailer message per "
            "shard (an agent's small shards share one stream each way, and a put_many commits with one call per "
            "agent) and in `reshard_many` as planning a program of 8 steps per tensor, which each agent then reads "
            "(once per distinct program: a weight sync that repeats its move reads it once).\n\n"
            + "\n".join(rows)
            + f"\n\nReproduce: `python bench/small_tensors.py --counts {args.counts}`.")
    print(body)
    if not args.no_write:
        write_section("small_tensors", "Many small tensors: what each tensor costs", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
