"""What a state dict of many small tensors costs per tensor: put_many, reshard_many and get_many of N tiny tensors.

Norms, biases and the experts of a mixture-of-experts model make state dicts of thousands of tensors of a few KiB,
where the fixed cost per tensor, not the bytes, sets the time. Each size puts N tensors of 64 x 8 float32 (2 KiB)
split over tensor-parallel 4 on host0..host3 (`put_many`), moves them to columns over tensor-parallel 2 times two
replicas on host4..host7 (one `reshard_many`, with the planner's record of where its time went) and back, and reads
them all (`get_many`), on local agents (collective transport); before the move back, the tensors are put again and
moved out again, as a weight sync repeats its move every step (the planner and the agents hold its program), by the
same request and by a registered sync's run side by side, timed against issue 41's goal for a repeated sync of the
139,583-tensor Kimi-K2-like state dict. Each tensor holds its
own run of integers, so a tile put in the wrong place, or another tensor's tile, reads back different: every
device's tile is checked bit for bit after each move out, and every tensor as `get_many` returns it after the move
back (all outside the timed calls). Then, on a cluster of their own, as many 16 x 16 bfloat16 weights quantized on
the way (each whole on host0, served on host4 as fp8 with its block scale, which host0's agent makes), planned fresh
and requested again, a sample checked against the tests' reference quantizer.
One run per size: the point is how the cost grows with N, which a single run shows. Writes its section of
BENCHMARKS.md.

    python bench/small_tensors.py [--counts 500,2000,8000] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.core.test_fp8_kernels: the reference

from _report import write_section  # noqa: E402
from _checks import check_every_device, expected_digests  # noqa: E402

from reshard import Mesh, Sharding  # noqa: E402
from reshard.client.cluster import LocalCluster  # noqa: E402
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16  # noqa: E402
from tests.core.test_fp8_kernels import reference  # noqa: E402

HOSTS = [f"host{i}" for i in range(8)]
TRAIN = Sharding(Mesh.from_hosts({"tp": 4}, HOSTS[:4], 1), ("tp", None))
INFER = Sharding(Mesh.from_hosts({"dp": 2, "tp": 2}, HOSTS[4:], 1), (None, "tp"))
SHAPE = (64, 8)
NUM_VALUES = SHAPE[0] * SHAPE[1]
MAX_COUNT = 2**24 // NUM_VALUES  # float32 holds every integer up to 2**24 exactly
MAX_SYNC_COUNT = 2**31 // NUM_VALUES  # --sync-at's tensors are int32
TIMEOUT_S = 1800
KIMI_TENSORS = 139_583  # reshard.moe.KIMI_K2's state dict with its block scales (bench/plan_quality.py's MoE rows)
GOAL_MS = 50  # issue 41: a repeated sync of it, request to every agent started
SYNC_RUNS = 3  # --sync-at's timed runs
SYNC_HOSTS = ["host0", "host1"]  # --sync-at's: each tensor whole on host0, moved whole to host1 (see `sync_text`)
SYNC_SRC = Sharding(Mesh.from_hosts({"x": 1}, SYNC_HOSTS[:1], 1), ("x", None))
SYNC_DST = Sharding(Mesh.from_hosts({"x": 1}, SYNC_HOSTS[1:], 1), (None, "x"))
SAMPLE_EVERY = 97  # --sync-at's check: every device's tile of one tensor in this many
# Quantized on the way: each tensor a 16 x 16 bfloat16 weight whole on host0, served whole on host4 as fp8 with its
# block scale, made by host0's agent (`reshard_many(..., dtype=, scales=)`): a quantize step and a scale tensor more
# per weight, and the working buffers they fill
QUANT_SHAPE = (16, 16)
QUANT_SRC = Sharding(Mesh.from_hosts({"x": 1}, HOSTS[:1], 1), (None, None))
QUANT_DST = Sharding(Mesh.from_hosts({"y": 1}, HOSTS[4:5], 1), (None, None))


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
    # tensor. Once as the same reshard_many request again, once as a registered sync's run (registered once,
    # before the put), side by side.
    c.put_many(tensors)
    t0 = time.monotonic()
    # Whole (delta=False): the same values put again would otherwise move as an empty delta where one pays.
    again = c.reshard_many({name: INFER for name in tensors}, delta=False).result(timeout=TIMEOUT_S)
    out["again"] = time.monotonic() - t0
    out["again_job"] = again
    t0 = time.monotonic()
    sync = c.register_sync({name: INFER for name in tensors})
    out["register"] = time.monotonic() - t0
    c.put_many(tensors)
    t0 = time.monotonic()
    synced = sync.run(delta=False).result(timeout=TIMEOUT_S)
    out["sync"] = time.monotonic() - t0
    out["sync_job"] = synced
    for what, job in (("repeated reshard_many", again), ("registered sync", synced)):
        if job.plan_id != result.plan_id:
            raise AssertionError(f"the {what} ran program {job.plan_id[:12]}, not the first move's "
                                 f"{result.plan_id[:12]}: the same layouts planned another program")
    check_every_device(c, expected_digests(tensors, {name: INFER for name in tensors}), "the registered sync")
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


def weight(i: int) -> np.ndarray:
    """Weight ``i`` of the quantized rows: bfloat16 (ml_dtypes) normals of scale 0.02 drawn from seed ``i``, so
    that one weight's codes in another's place read back different."""
    x = (np.random.default_rng(i).standard_normal(QUANT_SHAPE) * 0.02).astype(np.float32)
    return float32_to_bfloat16(x).view(ml_dtypes.bfloat16)


def measure_quantized(c, n: int) -> dict:
    """Seconds of a reshard_many that quantizes ``n`` tiny weights on the way (its program planned fresh), and of
    the same request again (the program held); one weight in `SAMPLE_EVERY` checked against the tests' reference
    quantizer after each, and the first and the last."""
    weights = {f"q{n}.w{i}": weight(i) for i in range(n)}
    c.put_many({name: (w, QUANT_SRC) for name, w in weights.items()})
    out: dict = {}
    for what in ("fresh", "again"):
        t0 = time.monotonic()
        job = c.reshard_many({name: QUANT_DST for name in weights}, scales={name: f"{name}_s" for name in weights},
                             dtype={name: "float8_e4m3fn" for name in weights}).result(timeout=TIMEOUT_S)
        out[what] = time.monotonic() - t0
        out[f"{what}_phases"] = job.phases
        sample = sorted({0, n - 1, *range(0, n, SAMPLE_EVERY)})
        names = [f"q{n}.w{i}" for i in sample]
        got = c.get_many(names + [f"{name}_s" for name in names])
        for name in names:
            codes, scales = reference(bfloat16_to_float32(weights[name].view(np.uint16)), 128)
            if not (np.array_equal(got[name].view(np.uint8), codes)
                    and np.array_equal(got[f"{name}_s"].view(np.uint32), scales.view(np.uint32))):
                raise AssertionError(f"{name} quantized on the way is not the reference quantizer's bits")
        c.put_many({name: (w, QUANT_SRC) for name, w in weights.items()})  # the next step's bf16 (untimed)
    c.delete_many(list(weights) + [f"{name}_s" for name in weights])
    return out


def measure_sync(c, n: int, runs: int, src: Sharding, dst: Sharding) -> dict:
    """A registered sync of ``n`` tensors run ``runs`` times moving whole, each after the tensors are put again in
    the training layout (untimed), after one run that plans its program: each run's job (its planner's part is
    `JobResult.handed_s`). Every run must run the first one's program; after the last, every device's tile of one
    tensor in `SAMPLE_EVERY` (and the last) is checked bit for bit (a digest call per tensor: all of them would take
    minutes)."""
    # int32: 139,583 tensors hold 71 M distinct integers, past float32's exact 2**24
    tensors = {f"s{n}.t{i}": (np.arange(i * NUM_VALUES, (i + 1) * NUM_VALUES, dtype=np.int32).reshape(SHAPE), src)
               for i in range(n)}
    t0 = time.monotonic()
    c.put_many(tensors)
    print(f"{n} tensors put in {time.monotonic() - t0:.0f} s", flush=True)
    sync = c.register_sync({name: dst for name in tensors})
    first = sync.run(delta=False).result(timeout=TIMEOUT_S)
    jobs = []
    for k in range(runs):
        c.put_many(tensors)
        time.sleep(3.0)  # a pause between the put and the request (1 s gave the same figures)
        jobs.append(sync.run(delta=False).result(timeout=TIMEOUT_S))
        print(f"run {k + 1}: planner's part {jobs[-1].handed_s * 1e3:.1f} ms, every host running after "
              f"{jobs[-1].started_s:.2f} s", flush=True)
        if jobs[-1].plan_id != first.plan_id:
            raise AssertionError(f"run {k + 1} ran program {jobs[-1].plan_id[:12]}, not the first run's "
                                 f"{first.plan_id[:12]}")
    names = list(tensors)
    sample = {name: tensors[name] for name in names[::SAMPLE_EVERY] + names[-1:]}
    check_every_device(c, expected_digests(sample, {name: dst for name in sample}), "the registered sync")
    c.delete_many(names)
    return {"jobs": jobs, "checked": len(sample)}


def sync_text(measured: dict | None, n: int, transport: str) -> str:
    """The --sync-at measurement as BENCHMARKS.md has it ("" without one)."""
    if measured is None:
        return ""
    jobs = measured["jobs"]
    handed = sorted(j.handed_s for j in jobs)
    median = handed[len(handed) // 2]
    mid = sorted(jobs, key=lambda j: j.handed_s)[len(jobs) // 2]
    started = sorted(j.started_s for j in jobs)[len(jobs) // 2]
    return (f"\n\nMeasured at {n:,} tensors (`--sync-at`), through 2 agents of their own ({transport} transport): "
            "tensors of 64 x 8 int32, each its own run of integers, put whole on host0 and moved whole to host1. Not "
            "the 8 agents and layouts above: there, the first run of this many tensors (8 agents on 2 cores, each "
            "reading its slice and staging its tiles at once) took 59 s alone on this machine (planning 9.8 s, "
            "running 41.8, committing 5.7) and failed beside other load, its hosts' reports late; on 2 agents the "
            "runs measure the planner's part, not 8 agents' contention for 2 cores. The tensors are put again "
            "before each run (untimed), "
            f"a registered sync run {len(jobs)} times after the run that planned its program, each checked to run that "
            f"program; afterwards every device's tile of {measured['checked']:,} of the tensors (one in "
            f"{SAMPLE_EVERY}, and the last) checked bit for bit.\n\n"
            "| tensors | the planner's part, each run (ms) | median (ms) | goal | of the median run: waiting / "
            "planning (ms) | every host running, median (s) |\n|---:|---|---:|---|---|---:|\n"
            f"| {n:,} | {', '.join(f'{j.handed_s * 1e3:.1f}' for j in jobs)} | {median * 1e3:.1f} | "
            f"< {GOAL_MS} ms: {'met' if median * 1e3 < GOAL_MS else '**not met**'} | "
            f"{mid.phases.get('waiting', 0) * 1e3:.1f} / {mid.phases.get('planning', 0) * 1e3:.1f} | {started:.2f} |"
            "\n\nEvery host running (`started_s`) adds the agents' prepare, each staging every tile it receives: the "
            "agents' seconds, not the planner's.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="500,2000,8000",
                    help="how many tensors, comma separated (default 500,2000,8000)")
    ap.add_argument("--sync-at", type=int, default=0, metavar="N",
                    help=f"also run a registered sync of N tensors alone on 2 agents of their own, 3 times, and "
                         f"report its planner's part measured at that count (issue 41: {KIMI_TENSORS}; about 5 minutes "
                         f"here, most of it the puts); default 0, none")
    ap.add_argument("--sync-transport", default="collective", choices=("grpc", "collective", "nixl"),
                    help="the transport of --sync-at's 2 agents (default collective)")
    ap.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.counts.split(",")]
    except ValueError:
        ap.error(f"--counts takes whole numbers separated by commas, like 500,2000; got {args.counts!r}")
    if not 0 <= args.sync_at <= MAX_SYNC_COUNT:
        ap.error(f"--sync-at must be 0 (none) to {MAX_SYNC_COUNT} (its tensors are int32); got {args.sync_at}")
    if not all(1 <= n <= MAX_COUNT for n in counts):
        ap.error(f"--counts must each be 1 to {MAX_COUNT} (tensor i holds the integers from {NUM_VALUES} * i, exact "
                 f"in float32 up to 2**24); got {args.counts}")
    rows = ["| tensors | put_many s | ms per tensor | reshard_many s | ms per tensor | of it: planning s | running s "
            "| back s | get_many s | ms per tensor |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    repeats = ["| tensors | repeated reshard_many s | its planner's part s | register_sync s | the sync's run s | "
               "its planner's part s | us per tensor | of it: waiting s | planning s | until every host ran s | "
               f"at {KIMI_TENSORS:,} tensors (linear): reshard_many's planner part s | the sync's s |",
               "|---:|" + "---:|" * 11]
    quantized = ["| weights (and as many scales) | reshard_many s | ms per weight | of it: planning s | running s | "
                 "the same request again s | ms per weight |", "|---:|---:|---:|---:|---:|---:|---:|"]
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
            again, synced = m["again_job"], m["sync_job"]
            repeats.append(f"| {n} | {m['again']:.3f} | {again.handed_s:.3f} | {m['register']:.3f} | {m['sync']:.3f} | "
                           f"{synced.handed_s:.3f} | {1e6 * synced.handed_s / n:.1f} | "
                           f"{synced.phases.get('waiting', 0):.3f} | {synced.phases.get('planning', 0):.3f} | "
                           f"{synced.started_s:.3f} | {again.handed_s / n * KIMI_TENSORS:.2f} | "
                           f"{synced.handed_s / n * KIMI_TENSORS:.2f} |")
            last = synced.handed_s / n
    # on a cluster of their own, so that neither part's leftovers (the planner's and the agents' records of what
    # each job made and freed) reach the other's rows
    with LocalCluster(len(HOSTS), 1, host_names=HOSTS, transport="collective") as cluster, cluster.connect() as c:
        for n in counts:
            q = measure_quantized(c, n)
            print(f"{n} weights quantized on the way: {q['fresh']:.2f}s ({q['fresh_phases']}), again "
                  f"{q['again']:.2f}s", flush=True)
            quantized.append(f"| {n} | {q['fresh']:.2f} | {1e3 * q['fresh'] / n:.2f} | "
                             f"{q['fresh_phases'].get('planning', 0):.2f} | {q['fresh_phases'].get('running', 0):.2f} "
                             f"| {q['again']:.2f} | {1e3 * q['again'] / n:.2f} |")
    measured = None
    if args.sync_at:  # on 2 agents of their own: see `sync_text`
        with LocalCluster(2, 1, host_names=SYNC_HOSTS, transport=args.sync_transport) as cluster, \
                cluster.connect() as c:
            measured = measure_sync(c, args.sync_at, SYNC_RUNS, SYNC_SRC, SYNC_DST)
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
            "training layout (untimed) and moved out again, first by the same `reshard_many` request again, then "
            "(put again) by a registered sync's run (`Client.register_sync` once, timed apart, then "
            "`RegisteredSync.run`, which sends the sync's id alone). Both must run the first move's program (its "
            "id is checked, and the tiles again after the sync). Issue 41 asks for a repeated sync of the "
            f"{KIMI_TENSORS:,}-tensor Kimi-K2-like state dict to cost the planner under {GOAL_MS} ms from request "
            "to every agent started. The planner's part is `JobResult.handed_s`: from the request's arrival at the "
            "planner (its checks included) to the planner's calls having reached every host, i.e. each host's "
            "first report as its run starts, less that agent's own seconds before it (its prepare: staging every "
            "tile it receives, which an agent on its own host does in parallel with the others); `started_s` is "
            "the same to every host running, the agents' prepare included (8 agents on this machine's 2 cores "
            "take turns there). The last two columns scale the planner's part linearly to that count.\n\n"
            + "\n".join(repeats)
            + f"\n\nThe registered sync's planner part costs {1e6 * last:.1f} us per tensor at the largest count "
            f"({last * KIMI_TENSORS * 1e3:.0f} ms at {KIMI_TENSORS:,} tensors if it grew linearly, which it does not "
            "wholly: part of it is per host). A registered sync's run that moves every tensor whole (these rows: "
            "`delta=False`) claims its tensors' next versions and checks that its kept program still fits them as "
            "columns of the catalog (`server/planner/columns.py`: each tensor's current version, sharding object and "
            "dtype by a slot it keeps), holds them all in one step (`server/planner/locks.py`), names their reads by "
            "one version (`reads_at`) and reads their records only as it commits: a few array operations per job, "
            "not passes of Python per tensor. The rest of the planner's part is its calls reaching agents that share "
            "this machine's 2 cores with each other's prepare (8 agents, each staging every tile it receives). Still "
            "per tensor: a sync that may move deltas (`delta` unset, where base pairs are held) chooses per tensor, "
            "on the job's general way."
            + "\n\nQuantized on the way: as many 16 x 16 bfloat16 weights, each whole on host0, served whole on host4 "
            "as float8_e4m3fn with its block scale, which host0's agent makes (`reshard_many(..., dtype=, scales=)`: "
            "a quantize step, a scale tensor and the working buffers they fill, per weight), first as a program "
            "planned fresh, then the same request again on the held program; one weight in "
            f"{SAMPLE_EVERY}, the first and the last, checked against the tests' reference quantizer after each. Each "
            "working buffer the agent made was its own reservation against its memory limit, every reservation's "
            "check recounted them all, and every read of one listed the roles of all: per weight, a cost that grew "
            "with the weights before it (3,000 weights' fresh run took 7.9 s on this machine before "
            "`ShardStore.reserve_more`, the slow suite's test of it gave up after 2 s).\n\n"
            + "\n".join(quantized)
            + sync_text(measured, args.sync_at, args.sync_transport)
            + f"\n\nReproduce: `python bench/small_tensors.py --counts {args.counts}"
            + (f" --sync-at {args.sync_at} --sync-transport {args.sync_transport}" if args.sync_at else "") + "`.")
    print(body)
    if not args.no_write:
        write_section("small_tensors", "Many small tensors: what each tensor costs", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
