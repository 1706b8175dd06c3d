"""What bucket size reshard_many should pack small moves into: one state dict moved at several sizes.

A synthetic transformer state dict (about 500 tensors, norms and biases of a few KiB beside weights of about
1 MiB) goes from tensor-parallel 4 on hosts host0..host3 to tensor-parallel 2 times two replicas on host4..host7,
through local agents, as one reshard_many per bucket size; each is timed from submission to the client seeing it
succeed (the old versions' release, which follows, is left out by waiting for it before the next run). Bucket
size 0 sends every move as its own stream. Median of ``--runs``; both transports. Writes its section of
BENCHMARKS.md, which the default (`reshard.many.DEFAULT_BUCKET_BYTES`) is read from. Each size's move is checked
on every device (replicas included) against the arrays, once, in the untimed round.

    python bench/buckets.py [--layers 50] [--hidden 512] [--runs 3] [--sizes 0,0.25,1,4,16,64] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _checks import check_every_device, expected_digests  # noqa: E402
from _report import write_section  # noqa: E402

from reshard import Mesh, Sharding  # noqa: E402
from reshard.client.cluster import LocalCluster  # noqa: E402
from reshard.many import DEFAULT_BUCKET_BYTES  # noqa: E402

HOSTS = [f"host{i}" for i in range(8)]
TRAIN = Mesh.from_hosts({"tp": 4}, HOSTS[:4], 1)
INFER = Mesh.from_hosts({"dp": 2, "tp": 2}, HOSTS[4:], 1)
MiB = 2**20


def state_dict(layers: int, hidden: int) -> tuple[dict, dict]:
    """{name: (array, training sharding)} and {name: inference sharding}: float32 norms and embedding, float16
    attention weights and biases, uint8 (float8 bytes) MLP weights with float32 block scales."""
    if hidden < 128 or hidden % 128:
        raise ValueError(f"--hidden {hidden}: give a multiple of 128 (the MLP weights' float8 scales are one per "
                         f"128 x 128 block)")
    rng = np.random.default_rng(0)
    tensors, infer = {}, {}
    rows, cols = ("tp", None), (None, "tp")

    def add(name, a, train_spec, infer_spec):
        tensors[name] = (a, Sharding(TRAIN, train_spec))
        infer[name] = Sharding(INFER, infer_spec)

    add("embed", rng.standard_normal((1003, hidden)).astype(np.float32), rows, rows)
    for i in range(layers):
        p = f"layers.{i}."
        add(p + "attn_norm", np.ones(hidden, np.float32), (None,), (None,))
        add(p + "mlp_norm", np.ones(hidden, np.float32), (None,), (None,))
        add(p + "qkv", rng.standard_normal((3 * hidden, hidden)).astype(np.float16), rows, rows)
        add(p + "qkv_bias", rng.standard_normal(3 * hidden).astype(np.float16), ("tp",), ("tp",))
        add(p + "out", rng.standard_normal((hidden, hidden)).astype(np.float16), cols, cols)
        add(p + "out_bias", rng.standard_normal(hidden).astype(np.float16), (None,), (None,))
        add(p + "up", rng.integers(0, 255, (4 * hidden, hidden), dtype=np.uint8), rows, rows)
        add(p + "up_scale", np.ones((4 * hidden // 128, hidden // 128), np.float32), rows, rows)
        add(p + "down", rng.integers(0, 255, (hidden, 4 * hidden), dtype=np.uint8), cols, cols)
        add(p + "down_scale", np.ones((hidden // 128, 4 * hidden // 128), np.float32), cols, cols)
    return tensors, infer


def measure(transport: str, layers: int, hidden: int, sizes: list[float], runs: int) -> dict:
    """Median seconds per bucket size, and (key "per tensor") of the same move as one reshard job per tensor,
    all submitted at once. The sizes take turns, round after round (each round in another order), after one
    untimed round in which the agents read each size's program: this shared machine's speed drifts over minutes,
    which would otherwise favour whichever size ran in a quiet spell."""
    tensors, infer = state_dict(layers, hidden)
    train = {n: s for n, (_, s) in tensors.items()}
    names = list(tensors)
    expected = expected_digests(tensors, infer)
    times: dict[float, list[float]] = {mib: [] for mib in sizes}
    with LocalCluster(len(HOSTS), 1, host_names=HOSTS, transport=transport) as cluster, cluster.connect() as c:
        c.put_many(tensors)
        for k in range(runs + 1):
            turn = sizes[k % len(sizes):] + sizes[:k % len(sizes)]
            for mib in turn:
                c.reshard_many(train, bucket_mib=mib).result(timeout=600)  # back, untimed
                _settle(c, names)
                t0 = time.monotonic()
                c.reshard_many(infer, bucket_mib=mib).result(timeout=600)
                if k:
                    times[mib].append(time.monotonic() - t0)
                _settle(c, names)
                if not k:  # each size's program is the one every round runs: check what it delivers once
                    check_every_device(c, expected, f"{transport} reshard_many with {mib:g} MiB buckets")
        out: dict = {}
        for mib in sizes:
            out[mib] = statistics.median(times[mib])
            print(f"{transport} bucket {mib:g} MiB: {out[mib]:.3f}s ({', '.join(f'{t:.3f}' for t in times[mib])})",
                  flush=True)
        c.reshard_many(train).result(timeout=600)
        _settle(c, list(tensors))
        t0 = time.monotonic()
        for job in [c.reshard(name, sharding) for name, sharding in infer.items()]:
            job.result(timeout=1200)
        out["per tensor"] = time.monotonic() - t0
        print(f"{transport} one job per tensor: {out['per tensor']:.3f}s", flush=True)
        check_every_device(c, expected, f"{transport} one reshard job per tensor")
    return out


def _settle(c, names: list[str]) -> None:
    """Wait until the old versions are released (the tensors' locks are free): a delete-free probe is a no-op
    reshard_many of one tensor into its own layout, which queues behind the release."""
    info = c.info(names[0])
    c.reshard_many({names[0]: info.sharding}).result(timeout=600)


def _summary(results: dict, sizes: list[float]) -> str:
    """Per transport: the default's seconds against the fastest size's and against no buckets."""
    default = DEFAULT_BUCKET_BYTES / MiB
    parts = []
    for t, secs in results.items():
        best = min(sizes, key=lambda mib: secs[mib])
        name = f"the default {best:g} MiB" if best == default else f"{best:g} MiB"
        text = f"on {t}, {secs[best]:.3f} s at {name} (the fastest here)"
        if default in secs and best != default:
            text += f", {secs[default]:.3f} s at the default {default:g} MiB"
        if 0 in secs:
            text += f" and {secs[0]:.3f} s with none"
        parts.append(text)
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="0,0.25,1,4,16,64", help="bucket sizes in MiB, comma separated")
    ap.add_argument("--transports", default="grpc,collective")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    sizes = [float(x) for x in args.sizes.split(",")]
    tensors, _ = state_dict(args.layers, args.hidden)
    nbytes = sum(a.nbytes for a, _ in tensors.values())
    results = {t: measure(t, args.layers, args.hidden, sizes, args.runs) for t in args.transports.split(",")}
    rows = ["| bucket MiB | " + " | ".join(f"{t} seconds" for t in results) + " |",
            "|---:|" + "---:|" * len(results)]
    for mib in sizes:
        rows.append(f"| {mib:g}{' (default)' if mib * MiB == DEFAULT_BUCKET_BYTES else ''} | "
                    + " | ".join(f"{results[t][mib]:.3f}" for t in results) + " |")
    rows.append("| one reshard job per tensor | " + " | ".join(f"{results[t]['per tensor']:.3f}" for t in results)
                + " |")
    body = (f"A state dict of {len(tensors)} tensors ({nbytes / MiB:.0f} MiB; {args.layers} layers, hidden "
            f"{args.hidden}) moved by one `reshard_many` from tensor-parallel 4 on 4 local agents to tensor-parallel "
            f"2 times two replicas on 4 others, per bucket size: moves smaller than the size travel packed into "
            f"streams of at least that size (0: every move its own stream). Seconds from submission until the job "
            f"succeeded, median of {args.runs} rounds in which the sizes take turns (after one untimed round); "
            f"the last row moves the same tensors as one `reshard` job each, submitted at once (one run). Without "
            f"packing every small move pays a stream's set-up, and fewer, larger streams also cost the runtime "
            f"less to schedule and check: {_summary(results, sizes)}. A bucket is packed in memory on its sender "
            f"and held whole on each receiving device until its last byte, so past the point where the time "
            f"stops falling a larger one only costs memory. Each size's move, and the jobs per tensor, are checked "
            f"once: every device's tile, replicas included, bit for bit against the arrays.\n\n"
            + "\n".join(rows)
            + f"\n\nReproduce: `python bench/buckets.py --layers {args.layers} --hidden {args.hidden} --runs "
              f"{args.runs} --sizes {args.sizes}`.")
    print(body)
    if not args.no_write:
        write_section("buckets", "reshard_many: bucket size", body)


if __name__ == "__main__":
    main()
