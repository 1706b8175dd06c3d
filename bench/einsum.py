"""Split einsum on the agents (issue 12): their local compute, their all-reduce, and a split matmul on emulated hosts.

One run measures, each comparison side by side (the machine is shared and noisy, so only
ratios taken in one run are reported, each the median of interleaved repeats):

(a) compute: ``plan_einsum("bh,hk->bk")`` on a mesh of 4 devices (2 hosts x 2, in this
    process, the agents' `Runtime` on the in-memory transport) whose inputs already line up,
    so the program is one einsum step per device and nothing moves. Timed from Execute on
    every host to every run done, against ``numpy.einsum(..., optimize=True)`` (which hands a
    matmul to BLAS, as the agents' kernel does) on the same per-device tiles (the store's
    arrays), one thread per device as the runtimes' step pools run them; and, for reference,
    plain ``numpy.einsum``.
    Goal: agents at most 1.2x numpy.einsum(optimize=True)'s time.
(b) all-reduce: the program of a reshard that completes a Partial tensor (one reduce step
    over 4 hosts x 1 device), run by the agents' runtimes on the collective transport (gloo),
    one process per host, with the agents' defaults: chunk size, lanes, window, and the reduce
    run as gloo's own all-reduce in the result buffer (``native_reduce``); against a raw
    ``torch.distributed`` gloo ``all_reduce`` of the same bytes in the same processes. Both
    timed from a barrier to a barrier. Goal: raw time / agents' time >= 0.8. For reference,
    the same program again on agents that run every reduce as the ring of XXH3-checked
    streams (``native_reduce=False``).
    Measured on loopback (4 processes sharing this machine's cores) and again with one process
    in each of 4 emulated hosts' namespaces (`reshard lab`, root), where ``--gbps`` links set
    the pace.
(c) emulated hosts (`reshard lab`, needs root: 4 network namespaces, links shaped to
    ``--gbps``): a matmul whose contracting dim is split across the hosts, through the SDK
    (``Client.plan_einsum`` for the estimate, ``Client.einsum`` to run it), timed from the
    request to the committed result as ``bench/paper.py`` times reshards. Goal: measured at
    most 1.25x the program's estimate. Its two parts run as jobs of their own beside it, each
    against its own estimate: the einsum with the sum left Partial (the local einsums), and
    the reshard of that Partial result to replicated (the all-reduce).

Every result is checked against numpy (small-integer values, so the sums are exact), outside the timed
sections, on every device that holds a copy. In (c) each job's result is first checked to be held in the layout
asked for (a Partial tensor reads back as its sum, so reading alone would pass a reduce that never ran), then a
whole result by each device's digest (``Client.digests``, through ``bench/_checks.py`` as the other benches).
Writes its section of BENCHMARKS.md through ``bench/_report.py``.

    python bench/einsum.py               # under ~5 minutes on 2 cores
    python bench/einsum.py --quick --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
STORE_HOST_ENV, BIND_HOST_ENV = "EINSUM_STORE_HOST", "EINSUM_BIND_HOST"  # (b) on emulated hosts: see lab_allreduce

from _checks import differing, tile_digests  # noqa: E402
from _report import turns as turn_spread  # noqa: E402

MiB = 2**20
EQUATION = "bh,hk->bk"
NUM_DEVICES = 4  # (a) 2 hosts x 2 devices; (b) and (c) 4 hosts x 1 device
STEP_TIMEOUT_S = 300.0
GOAL_COMPUTE, GOAL_ALLREDUCE, GOAL_LAB = 1.2, 0.8, 1.25
VERSUS = ("the agents", "raw gloo all_reduce")  # how the turns' spread names the two sides of (b)


def _agent_config(host: str):
    from reshard.server.common.config import AgentConfig

    return AgentConfig(host=host, num_devices=1, planner="")


def _small_ints(shape, rng) -> np.ndarray:
    """float32 values whose sums of products stay exact."""
    return rng.integers(-4, 5, shape).astype(np.float32)


# -- (a) the agents' local einsum against numpy.einsum ------------------------------------------------------


def compute(size: int, repeats: int) -> dict:
    """Median seconds of the agents' einsum program and of numpy.einsum on the same tiles, interleaved."""
    from reshard import Mesh, Sharding, TensorDecl, host_of, plan_einsum
    from reshard.box import to_slices
    from reshard.program import COMPUTE
    from reshard.server.agent.runtime import Runtime
    from reshard.server.agent.store import ShardStore, TileBuffer
    from reshard.server.transport.memory import MemoryNetwork, MemoryTransport

    hosts = ("host0", "host1")
    mesh = Mesh.from_hosts({"x": NUM_DEVICES}, list(hosts), NUM_DEVICES // len(hosts))
    rng = np.random.default_rng(0)
    x, w = _small_ints((NUM_DEVICES * size, size), rng), _small_ints((size, size), rng)
    shardings = {"x": Sharding(mesh, ("x", None)), "w": Sharding(mesh, (None, None))}
    program = plan_einsum(EQUATION, [TensorDecl(n, a.shape, "float32", shardings[n]) for n, a in (("x", x), ("w", w))],
                          "y").validate()
    assert all(s.kind == COMPUTE for s in program.steps), f"the inputs line up, so nothing moves: {program}"
    text = program.dumps()

    config = _agent_config("bench")
    net = MemoryNetwork()
    stores = {h: ShardStore() for h in hosts}
    runtimes = {h: Runtime(h, stores[h], {"memory": MemoryTransport(h, net, chunk_bytes=config.chunk_bytes,
                                                                    timeout_s=STEP_TIMEOUT_S)},
                           workers=config.max_workers, step_timeout_s=STEP_TIMEOUT_S) for h in hosts}
    for name, a in (("x", x), ("w", w)):
        for dev, box in shardings[name].tiles(a.shape).items():
            stores[host_of(dev)].stage(f"put-{name}", dev, TileBuffer(a[to_slices(box)].copy(), box, "float32"))
        for h in hosts:
            stores[h].commit(f"put-{name}", name, 1, [d for d in mesh.devices if host_of(d) == h])
    # The per-device tiles numpy computes on: the very arrays the agents read.
    tiles = [tuple(stores[host_of(s.device)].get(r.tensor, 1, s.device).array for r in s.inputs)
             for s in program.steps]
    want = np.einsum(EQUATION, x, w)
    peers = {h: h for h in hosts}

    def agents(version: int) -> float:
        job = uuid.uuid4().hex
        runs = {h: rt.prepare(job, text, "y", 1, version, peers, "memory") for h, rt in runtimes.items()}
        t0 = time.perf_counter()
        for h, rt in runtimes.items():
            rt.execute(job, runs[h].program_id)
        for run in runs.values():
            run.result(STEP_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        for rt in runtimes.values():
            rt.commit(job)
        for dev, box in program.tensor("y").dst.tiles(want.shape).items():
            if not np.array_equal(stores[host_of(dev)].get("y", version, dev).array, want[to_slices(box)]):
                raise AssertionError(f"the agents' einsum tile of {dev} differs from numpy's")
        for store in stores.values():
            store.release("y", version)
        return seconds

    times: dict[str, list[float]] = {"agents": [], "numpy": [], "blas": []}
    with ThreadPoolExecutor(len(tiles)) as pool:
        def numpy_einsum(**kw) -> float:
            t0 = time.perf_counter()
            outs = list(pool.map(lambda xs: np.einsum(EQUATION, *xs, **kw), tiles))
            seconds = time.perf_counter() - t0
            if not np.array_equal(np.concatenate(outs), want):
                raise AssertionError(f"numpy.einsum{kw or ''} on the tiles differs from numpy.einsum on the whole")
            return seconds

        try:
            agents(2)  # untimed: the pools' threads start, fresh memory is touched once
            for k in range(repeats):
                times["agents"].append(agents(k + 3))
                times["numpy"].append(numpy_einsum())
                times["blas"].append(numpy_einsum(optimize=True))
        finally:
            for rt in runtimes.values():
                rt.close()
    return {k: statistics.median(v) for k, v in times.items()}


# -- (b) the agents' all-reduce against raw gloo, one process per host ----- -------------------------------------


def _reduce_worker(port: int, rank: int, world: int, nbytes: int, repeats: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from reshard import Mesh, Sharding, reshard_program
    from reshard.server.agent.runtime import Runtime
    from reshard.server.agent.store import ShardStore, TileBuffer
    from reshard.server.common.contract import GroupView
    from reshard.server.transport.collective import CollectiveTransport, GroupMember

    hosts = tuple(f"host{i}" for i in range(world))
    host, dev = hosts[rank], f"{hosts[rank]}/0"
    config = _agent_config(host)
    timeout = datetime.timedelta(seconds=120)
    # On emulated hosts the driver's store is at the lab's root address, and each rank binds its own link's.
    store_host, bind = (os.environ.get(k, "127.0.0.1") for k in (STORE_HOST_ENV, BIND_HOST_ENV))
    store = dist.TCPStore(store_host, port, is_master=False, timeout=timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    raw = dist.ProcessGroupGloo(dist.PrefixStore("bench/raw/", store), rank, world, opts)

    # The agent's side, as an agent process builds it (reshard.server.agent.service), on a group of its own.
    member = GroupMember(host, store_host, bind, "gloo", "cpu", config.group_join_timeout_s,
                         config.collective_timeout_s)
    member.update(GroupView(port, 1, hosts, "gloo"))
    deadline = time.monotonic() + 60
    while member.status()[0] != 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host} did not join the agents' process group within 60 s")
        time.sleep(0.02)
    def agent(native: bool):  # the default agent, which runs the reduce as gloo's all-reduce, or one on the ring
        link = CollectiveTransport(host, member, lanes=config.collective_lanes, window=config.forward_queue_chunks,
                                   chunk_bytes=config.collective_chunk, confirm_timeout_s=config.collective_timeout_s,
                                   timeout_s=STEP_TIMEOUT_S, native_reduce=native)
        shards = ShardStore()
        return link, shards, Runtime(host, shards, {"collective": link}, workers=config.max_workers,
                                     step_timeout_s=STEP_TIMEOUT_S)

    sides = {"agents": agent(config.native_reduce), "ring": agent(False)}
    link = sides["agents"][0]

    shape = (nbytes // 4 // 1024, 1024)
    base = (np.arange(shape[0] * shape[1]) % 7).astype(np.float32).reshape(shape)
    addend = base + rank  # exact: the sum is world * base + world * (world - 1) / 2
    want = base * world + world * (world - 1) // 2
    for _, shards, _ in sides.values():
        shards.stage("put", dev, TileBuffer(addend.copy(), tuple((0, n) for n in shape), "float32"))
        shards.commit("put", "t", 1, [dev])
    mesh = Mesh.from_hosts({"x": world}, list(hosts), 1)
    program = reshard_program(shape, "float32", Sharding(mesh, (None, None), partial=("x",)),
                              Sharding(mesh, (None, None))).validate()
    text = program.dumps()
    peers = {h: h for h in hosts}
    buf = torch.from_numpy(addend.copy())

    def barrier() -> None:
        raw.barrier().wait()

    def gloo() -> tuple[float, float]:
        buf.copy_(torch.from_numpy(addend))
        barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        raw.allreduce([buf]).wait()
        barrier()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if not np.array_equal(buf.numpy(), want):
            raise AssertionError("raw gloo all_reduce gave wrong sums")
        return seconds, cpu

    native = {"agents": 0, "ring": 0}  # reduces each side's jobs ran as gloo's own all-reduce, on this host

    def agents(k: int, side: str) -> tuple[float, float, int]:
        _, shards, runtime = sides[side]
        job, version = f"allreduce-{side}-{k}", k + 2
        run = runtime.prepare(job, text, "t", 1, version, peers, "collective", 1, k + 1)
        barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        runtime.execute(job, run.program_id)
        run.result(STEP_TIMEOUT_S)
        barrier()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        runtime.commit(job)
        if not np.array_equal(shards.get("t", version, dev).array, want):
            raise AssertionError(f"the agents' all-reduce left wrong sums on {dev}")
        shards.release("t", version)
        native[side] += runtime.traffic(job).native_reduces
        return seconds, cpu, sum(runtime.traffic(job).bytes_out.values())

    try:
        gloo()  # untimed: both groups' pairs connect, fresh memory is touched once
        agents(0, "agents")
        agents(0, "ring")
        out: dict[str, list] = {"gloo": [], "gloo_cpu": [], "agents": [], "agents_cpu": [], "sent": [], "ring": [],
                                "ring_cpu": []}
        for k in range(1, repeats + 1):
            for key, value in zip(("gloo", "gloo_cpu"), gloo()):
                out[key].append(value)
            for key, value in zip(("agents", "agents_cpu", "sent"), agents(k, "agents")):
                out[key].append(value)
            for key, value in zip(("ring", "ring_cpu"), agents(k, "ring")):
                out[key].append(value)
    finally:
        for _, _, runtime in sides.values():
            runtime.close()
    if rank == 0:
        out["chunk_bytes"], out["lanes"], out["window"] = link.chunk_bytes, link.lanes, link.window
        out["native"], out["ring_native"] = native["agents"], native["ring"]
        print(json.dumps(out), flush=True)


def allreduce(nbytes: int, repeats: int, spawn=None) -> dict:
    """Medians of the agents (gloo's all-reduce; the ring) and of raw gloo ``all_reduce`` in the same processes,
    one per host; ``spawn(rank, argv)`` starts a rank (default: a process of this machine)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spawn = spawn or (lambda _, argv: subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
    procs = [spawn(r, [sys.executable, __file__, "--reduce-worker", str(store.port), str(r), str(NUM_DEVICES),
                       str(nbytes), str(repeats)]) for r in range(NUM_DEVICES)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"all-reduce workers failed: exit codes {[p.returncode for p in procs]}")
    out = json.loads(outs[0])
    return {**out, **{f"{k}_s": statistics.median(out[k])
                      for k in ("gloo", "gloo_cpu", "agents", "agents_cpu", "ring", "ring_cpu")}}


def lab_allreduce(gbps: float, nbytes: int, repeats: int) -> dict:
    """`allreduce` with one rank in each emulated host's namespace, on links shaped to ``gbps``; or
    ``{"skipped": why}``."""
    from reshard.server.devtools.lab import Lab, LabConfig, lab_available

    ok, why = lab_available()
    if not ok:
        return {"skipped": why}
    with Lab(LabConfig(num_hosts=NUM_DEVICES, devices_per_host=1, gbps=gbps)) as emulated:
        def spawn(rank: int, argv: list[str]) -> subprocess.Popen:
            env = {**os.environ, STORE_HOST_ENV: emulated.root_ip, BIND_HOST_ENV: emulated.host_ip(rank)}
            return emulated.spawn(emulated.host_ns(rank), argv, env=env, stdout=subprocess.PIPE, text=True)

        return allreduce(nbytes, repeats, spawn)


# -- (c) a split matmul on emulated hosts, measured against its estimate ------------------------------------------


def _check_lab_result(c, job: str, name: str, layout, want: np.ndarray, digests: dict[str, str]) -> None:
    """``name`` is held as ``layout`` after ``job``, with the bytes of its tile on every device of a whole tensor.

    The layout is checked first: `Client.get` of a Partial tensor returns the sum of its addends, so a reshard to
    replicated that never ran would read back right. A whole tensor is checked by each device's digest, as
    ``bench/paper.py`` checks a reshard, since `Client.get` reads one replica of each tile."""
    held = c.info(name).sharding
    if held != layout:
        raise AssertionError(f"the lab's {job} job left {name!r} as {held}, where {layout} was asked for")
    if layout.is_partial:
        # Partial over every device here, so each device holds an addend of its own and get reads them all.
        if not np.array_equal(c.get(name), want):
            raise AssertionError(f"the lab's {job} job left addends of {name!r} whose sum differs from numpy.einsum")
        return
    wrong = differing(c.digests(name), digests)
    if wrong:
        raise AssertionError(f"the lab's {job} job left {name!r} different from numpy.einsum on devices {wrong} "
                             f"(of {sorted(digests)})")


def lab(gbps: float, b: int, h: int, k: int, runs: int, warmup: int) -> dict:
    """Median measured and estimated seconds of the split matmul, and of its two parts, or ``{"skipped": why}``.

    The parts: the same einsum with its sum left pending (``out_sharding`` Partial: the local einsums only), and
    the reshard of that Partial result to replicated (the ring all-reduce only), interleaved with the whole.
    """
    from reshard.client.client import Client
    from reshard.server.devtools.lab import Lab, LabConfig, lab_available, start_cluster, wait_for_group

    if not hasattr(Client, "einsum") or not hasattr(Client, "plan_einsum"):
        return {"skipped": "Client.einsum not built yet"}
    ok, why = lab_available()
    if not ok:
        return {"skipped": why}
    from reshard import Mesh, Sharding, reshard_program

    rng = np.random.default_rng(1)
    x, w = _small_ints((b, h), rng), _small_ints((h, k), rng)
    want = np.einsum(EQUATION, x, w)
    with Lab(LabConfig(num_hosts=NUM_DEVICES, devices_per_host=1, gbps=gbps)) as emulated:
        address = start_cluster(emulated, extra_agent_args=["--transport", "collective"])
        hosts = [emulated.host_name(i) for i in range(NUM_DEVICES)]
        with emulated.connect(address) as c:
            wait_for_group(c, hosts)
            rates = {a["host"]: (a["device_gflops"], a["memory_gb_per_s"]) for a in c.agents()}
            mesh = Mesh.from_hosts({"x": NUM_DEVICES}, hosts, 1)
            pending, whole = Sharding(mesh, (None, None), partial=("x",)), Sharding(mesh, (None, None))
            c.put("x", x, Sharding(mesh, (None, "x")))  # the contracting dim h split over the hosts
            c.put("w", w, Sharding(mesh, ("x", None)))
            program = c.plan_einsum(EQUATION, "x", "w", out="y")
            estimates = {
                "einsum": program.estimate_seconds,
                "compute": c.plan_einsum(EQUATION, "x", "w", out="yp", out_sharding=pending).estimate_seconds,
                "reduce": reshard_program(want.shape, "float32", pending, whole, program.topology).estimate_seconds,
            }
            jobs = {  # name: (start the job, the tensor it leaves, in what layout)
                "einsum": (lambda: c.einsum(EQUATION, "x", "w", out="y"), "y", whole),
                "compute": (lambda: c.einsum(EQUATION, "x", "w", out="yp", out_sharding=pending), "yp", pending),
                "reduce": (lambda: c.reshard("yp", whole), "yp", whole),  # completes the sum "compute" left pending
            }
            digests = tile_digests(want, whole)
            walls: dict[str, list[float]] = {name: [] for name in jobs}
            job_s, transports = [], set()
            for i in range(warmup + runs):
                for name, (start, out, layout) in jobs.items():
                    t0 = time.perf_counter()
                    result = start().result(timeout=600)
                    wall = time.perf_counter() - t0
                    _check_lab_result(c, name, out, layout, want, digests)
                    if i < warmup:
                        continue
                    walls[name].append(wall)
                    if name == "einsum":
                        job_s.append(result.seconds)
                        transports.add(result.transport)
                c.delete("y")
                c.delete("yp")
    return {"estimate_s": estimates, "wall_s": {name: statistics.median(v) for name, v in walls.items()},
            "job_s": statistics.median(job_s), "transports": sorted(transports),
            "sent_bytes": max(row["bytes_out"] for row in program.host_bytes().values()), "rates": rates,
            "summary": program.summary()}


# -- the report ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke run of all three")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of (a) and (b) (default 7, quick 2)")
    p.add_argument("--size", type=int, default=None, help="(a): each device's tiles are size x size (default 1024)")
    p.add_argument("--mib", type=int, default=None, help="(b): the all-reduced tile (default 64, quick 8)")
    p.add_argument("--gbps", type=float, default=1.0, help="(c): every emulated host link's rate, each way")
    p.add_argument("--lab-runs", type=int, default=None, help="(c): timed runs after one untimed (default 3)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 7)
    size = args.size or (256 if args.quick else 1024)
    nbytes = (args.mib or (8 if args.quick else 64)) * MiB
    lab_runs = args.lab_runs or (1 if args.quick else 3)
    # (c): output b x k float32 all-reduced over the hosts; h small, so the link, not the local einsum, sets the pace
    lab_b, lab_h, lab_k = (512, 64, 1024) if args.quick else (2048, 128, 4096)

    a = compute(size, repeats)
    print(f"(a) agents {a['agents']:.4f}s  numpy.einsum {a['numpy']:.4f}s  optimize=True {a['blas']:.4f}s", flush=True)
    b = allreduce(nbytes, repeats)
    print(f"(b) agents {b['agents_s']:.4f}s  raw gloo {b['gloo_s']:.4f}s", flush=True)
    bl = lab_allreduce(args.gbps, nbytes, repeats)
    print(f"(b) on emulated hosts: skipped: {bl['skipped']}" if "skipped" in bl else
          f"(b) on emulated hosts: agents {bl['agents_s']:.4f}s  raw gloo {bl['gloo_s']:.4f}s", flush=True)
    c = lab(args.gbps, lab_b, lab_h, lab_k, lab_runs, warmup=1)
    print(f"(c) skipped: {c['skipped']}" if "skipped" in c else
          f"(c) measured {c['wall_s']['einsum']:.4f}s  estimate {c['estimate_s']['einsum']:.4f}s", flush=True)

    def verdict(ok: bool) -> str:
        return "yes" if ok else "**no**"

    tiles = f"{NUM_DEVICES} x ({size}x{size} . {size}x{size})"
    rows = [
        f"| (a) local einsum, {tiles} float32 | agents' program | {a['agents']:.4f} | numpy.einsum(optimize=True) | "
        f"{a['blas']:.4f} | {a['agents'] / a['blas']:.2f}x time | <= {GOAL_COMPUTE:g}x | "
        f"{verdict(a['agents'] <= GOAL_COMPUTE * a['blas'])} |",
        f"| (a) the same, reference | agents' program | {a['agents']:.4f} | numpy.einsum (no optimize) | "
        f"{a['numpy']:.4f} | {a['agents'] / a['numpy']:.2f}x time | - | - |",
        f"| (b) all-reduce, {nbytes // MiB} MiB float32 over {NUM_DEVICES} hosts | agents (collective) | "
        f"{b['agents_s']:.4f} | raw gloo all_reduce | {b['gloo_s']:.4f} | {b['gloo_s'] / b['agents_s']:.2f}x speed | "
        f">= {GOAL_ALLREDUCE:g}x | {verdict(b['gloo_s'] >= GOAL_ALLREDUCE * b['agents_s'])} |",
        f"| (b) the same, reference | agents' ring (`native_reduce=False`) | {b['ring_s']:.4f} | raw gloo all_reduce | "
        f"{b['gloo_s']:.4f} | {b['gloo_s'] / b['ring_s']:.2f}x speed | - | - |",
    ]
    lab_b_what = f"(b) the same on emulated hosts, links shaped to {args.gbps:g} Gbit/s"
    if "skipped" in bl:
        rows.append(f"| {lab_b_what} | agents (collective) | - | raw gloo all_reduce | - | skipped: "
                    f"{bl['skipped']} | >= {GOAL_ALLREDUCE:g}x | - |")
    else:
        rows.append(f"| {lab_b_what} | agents (collective) | {bl['agents_s']:.4f} | raw gloo all_reduce | "
                    f"{bl['gloo_s']:.4f} | {bl['gloo_s'] / bl['agents_s']:.2f}x speed | >= {GOAL_ALLREDUCE:g}x | "
                    f"{verdict(bl['gloo_s'] >= GOAL_ALLREDUCE * bl['agents_s'])} |")
        rows.append(f"| (b) the same on emulated hosts, reference | agents' ring (`native_reduce=False`) | "
                    f"{bl['ring_s']:.4f} | raw gloo all_reduce | {bl['gloo_s']:.4f} | "
                    f"{bl['gloo_s'] / bl['ring_s']:.2f}x speed | - | - |")
    lab_what = f"(c) {EQUATION}, x {lab_b}x{lab_h} . w {lab_h}x{lab_k}, h split over {NUM_DEVICES} hosts"
    if "skipped" in c:
        rows.append(f"| {lab_what} | measured | - | program's estimate | - | skipped: {c['skipped']} | "
                    f"<= {GOAL_LAB:g}x | - |")
    else:
        wall, estimate = c["wall_s"], c["estimate_s"]
        ratio = wall["einsum"] / estimate["einsum"]
        rows.append(f"| {lab_what} | measured | {wall['einsum']:.4f} | program's estimate | "
                    f"{estimate['einsum']:.4f} | {ratio:.2f}x time | <= {GOAL_LAB:g}x | {verdict(ratio <= GOAL_LAB)} |")
        for name, what in (("compute", "its local einsums: the sum left Partial"),
                           ("reduce", "its all-reduce: that Partial result resharded to replicated")):
            rows.append(f"| (c) part: {what} | measured | {wall[name]:.4f} | program's estimate | "
                        f"{estimate[name]:.4f} | {wall[name] / estimate[name]:.2f}x time | - | - |")
    sent = statistics.median(b["sent"])
    lines = [
        f"Median of {repeats} interleaved repeats for (a) and (b), each after one untimed run; every result is "
        f"checked against numpy on every device that holds a copy, outside the timed sections (small-integer "
        f"values, so sums are exact).",
        "",
        f"- (a) `plan_einsum({EQUATION!r})` on 4 devices (2 hosts x 2; x split on b, w replicated, so nothing "
        f"moves: one einsum step per device), run by the agents' runtimes in one process on the in-memory "
        f"transport, timed from Execute to every run done; numpy.einsum runs on the same tiles (the store's "
        f"arrays), one thread per device as the runtimes' step pools do. The goal compares with numpy's fastest "
        f"einsum, `optimize=True` (it hands a matmul to BLAS), as the agents' kernel runs it; plain numpy.einsum, for "
        f"reference, loops in C without BLAS.",
        f"- (b) the program of a reshard that completes a Partial tensor, `P(None, None) + partial(x)` -> "
        f"`P(None, None)` (one reduce step), run by the agents' runtimes on the collective transport, one "
        f"process per host on loopback (chunks {b['chunk_bytes'] // MiB} MiB, {b['lanes']} lanes, window "
        f"{b['window']}: the agents' defaults), against raw gloo `all_reduce` of the same bytes in the same "
        f"processes; both timed barrier to barrier. The agents ran {b['native']} of their {repeats + 1} reduces "
        f"(host0) as gloo's own all-reduce, in place in the new version's buffer after copying the addends in "
        f"(the source version stays intact; raw gloo reduces its buffer in place, its copy untimed); the reference "
        f"agents ran {b['ring_native']} so, every other one as the ring of XXH3-checked streams. Each host sent "
        f"{sent / MiB:.1f} MiB, the ring's 2(n-1)/n of the tile (as the agents count it). CPU seconds per process "
        f"in that time (host0, all threads): agents {b['agents_cpu_s']:.3f}, agents' ring {b['ring_cpu_s']:.3f}, "
        f"raw gloo {b['gloo_cpu_s']:.3f}; {NUM_DEVICES} processes share this machine's "
        f"{os.cpu_count()} cores." + ("" if "skipped" in bl else
                                      f" The same processes also ran with one in each of {NUM_DEVICES} emulated "
                                      f"hosts' namespaces (`reshard lab`, links shaped to {args.gbps:g} Gbit/s each "
                                      f"way, root), where the links, not the shared cores, set the pace: the ring's "
                                      f"bound there is {sent / (args.gbps * 1e9 / 8):.4f} s.")
        + f" {turn_spread(b['agents'], b['gloo'], *VERSUS, where='on loopback')}"
        + ("" if "skipped" in bl else
           f" {turn_spread(bl['agents'], bl['gloo'], *VERSUS, where='on the emulated hosts')}"),
    ]
    if "skipped" in c:
        lines.append(f"- (c) skipped: {c['skipped']}.")
    else:
        lines.append(
            f"- (c) `reshard lab`: {NUM_DEVICES} hosts x 1 device, links shaped to {args.gbps:g} Gbit/s each way, "
            f"agents on the collective transport (runs carried by {c['transports']}). `Client.plan_einsum` gives "
            f"the estimate (busiest host sends {c['sent_bytes'] / MiB:.1f} MiB); `Client.einsum` runs it, timed "
            f"from the request to the committed result (median of {lab_runs} after one untimed; the job's own "
            f"seconds {c['job_s']:.4f}). The two parts run as jobs of their own, interleaved with the whole: the "
            f"same einsum with `out_sharding` Partial (no reduce; estimated by `Client.plan_einsum`), and the "
            f"reshard of its result to replicated (`reshard_program` on the planner's topology). After each job, "
            f"untimed, its result is checked to be held as asked (replicated after the whole einsum and the reshard, "
            f"Partial after the parts' einsum), a replicated result by every device's digest, a Partial one by the "
            f"sum of its addends. A compute step's estimate is a roofline, the longer of its bytes over the "
            f"device's memory bandwidth and its "
            f"floating-point operations over the device's rate, both measured by each agent as it starts "
            f"({'; '.join(f'{h}: {g:.0f} GFLOP/s, {m:.1f} GB/s' for h, (g, m) in sorted(c['rates'].items()))}); "
            f"the {NUM_DEVICES} emulated hosts share this machine's {os.cpu_count()} cores, which each measured "
            f"alone.")
    lines += [
        "",
        "| measurement | agents | seconds | baseline | seconds | ratio | goal | met |",
        "|---|---|---:|---|---:|---:|---:|---|",
        *rows,
        "",
        f"Reproduce: `python bench/einsum.py{' --quick' if args.quick else ''} --repeats {repeats} --size {size} "
        f"--mib {nbytes // MiB} --gbps {args.gbps:g} --lab-runs {lab_runs}` (root for (c)).",
    ]
    body = "\n".join(lines)
    print(body)
    if "summary" in c:
        print(c["summary"])
    if not args.no_write:
        from _report import write_section

        write_section("einsum", "Split einsum on the agents: compute, all-reduce, estimate", body)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--reduce-worker":
        _reduce_worker(*(int(v) for v in sys.argv[2:7]))
    else:
        sys.exit(main())
