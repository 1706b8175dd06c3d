"""Weight sync (issue 13): a whole state dict from a training layout to an inference layout, four ways.

A synthetic transformer state dict (``bench/buckets.py``'s: about 500 tensors, float32 norms and embedding, float16
attention weights and biases, float8 MLP weights as their bytes with float32 block scales) moves from
tensor-parallel 4 on host0..host3 to tensor-parallel 2 times two replicas on host4..host7, one process per host:

1. one ``reshard_many`` through local agents on the transport ``--transport`` names (default the collective, gloo,
   transport; ``nixl``: NIXL's one-sided writes, UCX picking its transports between the processes of this
   machine): one program, one atomic commit;
2. the same move as one ``reshard`` job per tensor, all submitted at once, on the same agents;
3. raw ``torch.distributed`` gloo broadcasts of the same bytes, 8 processes: for each tensor, each distinct
   source tile goes from one of the ranks that hold it (rotated over them, tensor by tensor) to the inference
   ranks whose tile it overlaps, by ``broadcast`` on a group of exactly those ranks, every broadcast issued
   asynchronously and waited for at the end: what a hand-written weight sync does, with its buffers allocated
   beforehand. Its runs take turns with those of (1), each while the other's processes sit idle, so that this
   shared machine's load, which drifts by tens of percent within minutes, reaches both alike;
4. the same-mesh part, 4 processes: on host0..host3 seen as a 2 x 2 mesh, from the training layout to the
   inference one (the tensor-parallel-4 tiles become two replicas of tensor-parallel 2), as a loop of DTensor
   ``redistribute`` over every tensor against one ``reshard_many`` on 4 agents. The DTensors' placements are
   reshard's layouts in torch's classes (tensor-parallel 4 is ``[Shard(d), Shard(d)]`` on the 2 x 2 mesh), and
   each rank checks that it starts from its training tile and ends with its inference tile: the two make the
   same move.

Every result is checked bit-exact (agents: every device's tile, replicas included, by digest against the arrays;
gloo and DTensor: each rank's received buffers, or local shard, against the arrays). Seconds are from the request (or a
barrier) to the last byte in place (or a barrier), median of ``--runs`` after two untimed (`WARMUP`); GB/s counts the
bytes the inference devices end up holding. For (1) and (3) on loopback the section also gives the CPU seconds every
process of each side used in a timed run (the service's planner and agents from ``/proc``, each gloo rank its own
``time.process_time``), summed: on this machine the cores, not the loopback, are what both sides share.

5. On emulated hosts (``reshard lab``, root: 8 network namespaces, links shaped to ``--gbps`` each way), the
   ``reshard_many`` of (1), measured against its lower bound: every inference host must receive its tiles and
   every byte must leave the 4 training hosts once, so no plan beats max(busiest inference host's tile bytes,
   state dict / 4) / link rate; and the raw gloo broadcasts of (3), one rank in each host's namespace on the
   same links, taking turns with it as in (3). On nixl the lab's agents run UCX on TCP over their namespace's
   own interface only (`reshard lab` adds ``--nixl-tcp-only``: the namespaces share one kernel, and UCX's shared
   memory would go around the shaped links); every timed run's bytes through the links' counters are set beside
   the plan's network bytes, to show they crossed the links. On this 2-core machine the loopback rows measure CPU
   as much as bytes (9 processes share the cores); the emulated links measure what a network leaves.

Goals: ``reshard_many`` at least 0.8x raw gloo's speed (1.0x on nixl, issue 38, where it is also to come within
1.10x of the lower bound on the emulated hosts) and at least 3x faster than one job per tensor.
Writes its section of BENCHMARKS.md.

6. ``--rl-loop`` (alone): the loop of ``examples/rl_weight_sync`` step by step, against raw gloo sends of a step's
   bytes; its own section.
7. The RL-step rows (issue 40; ``--rl-only`` runs them alone, the default run ends with them): real AdamW steps of
   that example's Llama at lr 1e-6, published as bfloat16 and synced whole (``delta=False``) against as deltas
   (``delta`` unset), taking turns, on loopback and on the emulated hosts (`rl_steps`); their own section. Goals:
   a delta step's network bytes at most 10% of a full one's, and its sync at least 4x faster on the emulated hosts.

    python bench/weight_sync.py [--layers 50] [--hidden 512] [--runs 3] [--gbps 1] [--transport collective|nixl]
                                [--no-lab] [--no-write] [--rl-loop | --rl-only] [--rl-steps 5] [--rl-hidden 256]
                                [--rl-layers 4] [--rl-vocab 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import turns as turn_spread, write_section  # noqa: E402
from _checks import check_every_device, expected_digests  # noqa: E402
from _meter import cpu_seconds  # noqa: E402
import rl_steps  # noqa: E402
from buckets import HOSTS, INFER, TRAIN, _settle, state_dict  # noqa: E402

from reshard import Mesh, Sharding  # noqa: E402
from reshard import box as boxes  # noqa: E402

GB = 1e9
MiB = 2**20
GOAL_PER_TENSOR = 3.0
GOAL_GLOO = {"collective": 0.8, "nixl": 1.0}  # reshard_many's speed against raw gloo's, by transport (issues 13, 38)
GOAL_BOUND = {"nixl": 1.10}  # the emulated hosts' reshard_many against its lower bound, at most (issue 38)
VERSUS = ("`reshard_many`", "raw gloo")  # how the turns' spread names the two sides (`_report.turns`)
TIMEOUT_S = 900
# Untimed moves there and back before the timed ones: the first two of a cluster both stage into fresh memory (the
# second too, as the delta base pair the first left holds the version before: `Catalog` keeps it for delta sync), a
# page fault per 4 KiB and a NIXL registration per buffer, which a sync repeated every step pays once; raw gloo's
# buffers are allocated before its timing
WARMUP = 2
STORE_HOST_ENV = "WEIGHT_SYNC_STORE_HOST"  # where a gloo rank finds the driver's store (the lab's root address)
# The same-mesh part: host0..host3 as 2 x 2, the inference layout's axes (DTensor: mesh dims "dp", "tp").
SAME = Mesh.from_hosts({"dp": 2, "tp": 2}, HOSTS[:4], 1)


def _rank(device: str) -> int:
    return HOSTS.index(device.split("/")[0])


def _received_bytes(tensors: dict, infer: dict) -> int:
    """The bytes the inference devices hold once the move is done: every device's tile."""
    return sum(boxes.volume(box) * a.itemsize
               for name, (a, _) in tensors.items() for box in infer[name].tiles(a.shape).values())


def _same_mesh(infer: dict) -> dict:
    return {name: Sharding(SAME, s.spec) for name, s in infer.items()}


# -- 1 and 2: agents ---------------------------------------------------------------------------------------------




def _timed(c, tensors: dict, there: dict, back: dict, runs: int, what: str,
           results: list | None = None, between: Callable[[int], None] | None = None,
           meter: tuple[Callable[[], float], list] | None = None) -> list[float]:
    """Seconds of each timed reshard_many to ``there``, after `WARMUP` untimed; each checked, and moved ``back``
    untimed (after the old versions' release, which follows a job, is over: `_settle`). The timed jobs' results go
    to ``results``; ``between(i)`` runs after run ``i`` (0 the last untimed one) and its move back. With ``meter``
    (a reading, such as the service's CPU seconds or the links' byte counters, and a list), what each timed run
    added to the reading goes to the list."""
    names, times = list(tensors), []
    expected = expected_digests(tensors, there)
    for k in range(1 - WARMUP, runs + 1):  # k <= 0: untimed
        used = meter[0]() if meter is not None else 0.0
        t0 = time.monotonic()
        result = c.reshard_many(there).result(timeout=TIMEOUT_S)
        wall = time.monotonic() - t0
        if meter is not None and k > 0:
            meter[1].append(meter[0]() - used)
        _settle(c, names)
        check_every_device(c, expected, what)
        if k > 0:
            times.append(wall)
            if results is not None:
                results.append(result)
        print(f"{what} {'(untimed) ' if k <= 0 else ''}{wall:.3f}s", flush=True)
        c.reshard_many(back).result(timeout=TIMEOUT_S)
        _settle(c, names)
        if between is not None and k >= 0:
            between(k)  # the baseline's run k, while these agents sit idle: the two take turns
    return times


def _speed(ours: float, theirs: float) -> str:
    """``reshard_many``'s seconds ``ours`` against another way's ``theirs``, as the larger ratio: "2.00x faster"
    or "7.10x slower", never "0.14x faster"."""
    if ours <= theirs:
        return f"`reshard_many` {theirs / ours:.2f}x faster"
    return f"`reshard_many` {ours / theirs:.2f}x slower"


def _phases(results: list) -> dict[str, float]:
    """Median seconds of each phase of the jobs (`JobResult.phases`), and of their slowest and fastest host's part
    of running."""
    out = {name: statistics.median(r.phases.get(name, 0.0) for r in results) for name in results[0].phases}
    out["slowest host"] = statistics.median(max(r.host_seconds.values()) for r in results)
    out["fastest host"] = statistics.median(min(r.host_seconds.values()) for r in results)
    return out


def agents(layers: int, hidden: int, runs: int, between: Callable[[int], None] | None = None,
           transport: str = "collective") -> dict:
    """Median seconds of one reshard_many, one run of a job per tensor (8 hosts), and the same-mesh reshard_many
    (4 hosts), each checked against the arrays, the agents on ``transport``."""
    from reshard.client.cluster import LocalCluster

    tensors, infer = state_dict(layers, hidden)
    train = {n: s for n, (_, s) in tensors.items()}
    out: dict = {}

    with LocalCluster(len(HOSTS), 1, host_names=HOSTS, transport=transport) as cluster, cluster.connect() as c:
        c.put_many(tensors)
        results: list = []
        pids = [cluster.planner.pid, *(p.pid for p in cluster.agents.values())]
        out["many_cpu"] = []
        out["many"] = _timed(c, tensors, infer, train, runs, "reshard_many", results, between,
                             (lambda: cpu_seconds(pids), out["many_cpu"]))
        out["carried_by"] = sorted({t for r in results for t in r.transports})
        out["many_phases"] = _phases(results)
        t0 = time.monotonic()
        for job in [c.reshard(name, sharding) for name, sharding in infer.items()]:
            job.result(timeout=TIMEOUT_S)
        out["per_tensor"] = [time.monotonic() - t0]
        print(f"one job per tensor {out['per_tensor'][0]:.3f}s", flush=True)
        check_every_device(c, expected_digests(tensors, infer), "one reshard job per tensor")
    with LocalCluster(4, 1, host_names=HOSTS[:4], transport=transport) as cluster, cluster.connect() as c:
        c.put_many(tensors)
        out["same_many"] = _timed(c, tensors, _same_mesh(infer), train, runs, "the same-mesh reshard_many")
    return out


# -- 3: raw gloo broadcasts --------------------------------------------------------------------------------------


def _broadcasts(tensors: dict, infer: dict) -> list[tuple[str, tuple, int, tuple[int, ...]]]:
    """(tensor, source box, source rank, the group's ranks) per broadcast: each distinct source tile from one of
    its holders, rotated tensor by tensor, to the inference ranks whose tile overlaps it."""
    out = []
    for k, (name, (a, src)) in enumerate(tensors.items()):
        holders: dict = {}
        for dev, box in src.tiles(a.shape).items():
            holders.setdefault(box, []).append(dev)
        dst = infer[name].tiles(a.shape)
        for box, devs in holders.items():
            if not boxes.volume(box):
                continue
            sender = _rank(devs[k % len(devs)])
            receivers = sorted(_rank(d) for d, b in dst.items() if boxes.intersect(b, box) is not None
                               and boxes.volume(boxes.intersect(b, box)))
            if receivers:
                out.append((name, box, sender, tuple(sorted({sender, *receivers}))))
    return out


def _gloo_worker(port: int, rank: int, layers: int, hidden: int, runs: int) -> None:
    import torch
    import torch.distributed as dist

    tensors, infer = state_dict(layers, hidden)
    # On the emulated hosts the driver's store is at the lab's root address (and GLOO_SOCKET_IFNAME names the link).
    store = dist.TCPStore(os.environ.get(STORE_HOST_ENV, "127.0.0.1"), port, is_master=False,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=len(HOSTS),
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    plan = _broadcasts(tensors, infer)
    groups = {}
    for _, _, _, ranks in plan:  # every rank creates every group, in the same order
        if ranks not in groups:
            groups[ranks] = dist.new_group(list(ranks))
    mine = []
    for name, box, sender, ranks in plan:
        if rank not in ranks:
            continue
        whole = tensors[name][0][boxes.to_slices(box)]
        buf = torch.from_numpy(np.ascontiguousarray(whole)) if rank == sender else \
            torch.empty(whole.shape, dtype=torch.from_numpy(whole[:0]).dtype)
        mine.append((buf, sender, groups[ranks], whole))

    def run(i: int) -> float:
        store.wait([f"go/{i}"])  # the driver's turn: its reshard_many run i is over (`Turns`)
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        works = [dist.broadcast(buf, sender, group=group, async_op=True) for buf, sender, group, _ in mine]
        for w in works:
            w.wait()
        dist.barrier()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        store.set(f"cpu/{i}/{rank}", json.dumps(cpu))  # this rank's CPU seconds in the timed part, all threads
        for buf, sender, _, whole in mine:
            if rank != sender and not np.array_equal(buf.numpy().view(np.uint8), whole.view(np.uint8)):
                raise AssertionError(f"rank {rank} received wrong bytes from rank {sender}")
            if rank != sender:
                buf.zero_()
        dist.barrier()  # every rank's checks are over too: none of them is busy when the agents' turn comes
        if rank == 0:
            store.set(f"done/{i}", json.dumps(seconds))
        return seconds

    run(0)  # untimed: the groups' pairs connect
    times = [run(i) for i in range(1, runs + 1)]
    if rank == 0:
        print(json.dumps({"times": times, "broadcasts": len(plan), "groups": len(groups)}), flush=True)
    dist.destroy_process_group()


# -- 4: a loop of DTensor redistribute on the same mesh ------------------------------------------------------------


def _same_mesh_train(tensors: dict) -> dict:
    """The training layout seen on the 2 x 2 mesh: tensor-parallel 4 becomes a split over both axes, dp-major, so
    each of host0..host3 holds the very tile it holds in the training layout (`_dtensor_worker` checks this)."""
    return {name: Sharding(SAME, tuple(("dp", "tp") if axes == ("tp",) else axes for axes in s.spec))
            for name, (_, s) in tensors.items()}


def _torch_placements(sharding: Sharding) -> list:
    """torch's DTensor placements for a reshard sharding (`Sharding.placements`, in torch's own classes)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from reshard import sharding as own

    return [Shard(p.dim) if isinstance(p, own.Shard) else Partial() if isinstance(p, own.Partial) else Replicate()
            for p in sharding.placements]


def _dtensor_worker(port: int, rank: int, layers: int, hidden: int, runs: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    tensors, infer = state_dict(layers, hidden)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # rank r is SAME's r-th device, row-major
    device = SAME.devices[rank]
    train, dst = _same_mesh_train(tensors), _same_mesh(infer)
    full = {n: torch.from_numpy(a) for n, (a, _) in tensors.items()}
    src = {n: distribute_tensor(full[n], mesh, _torch_placements(train[n]), src_data_rank=None) for n in tensors}
    want = {}
    for n, (a, layout) in tensors.items():
        # Both ways make the same move: each rank starts from its training tile and must end with its tile of the
        # inference layout on the 2 x 2 mesh, as the same-mesh reshard_many does.
        held = train[n].tiles(a.shape)[device]
        local = np.ascontiguousarray(src[n].to_local().numpy())
        if held != layout.tiles(a.shape)[f"{HOSTS[rank]}/0"] or not np.array_equal(
                local.view(np.uint8), a[boxes.to_slices(held)].view(np.uint8)):
            raise AssertionError(f"rank {rank}'s DTensor shard of {n} is not its training tile {held}")
        want[n] = torch.from_numpy(np.ascontiguousarray(a[boxes.to_slices(dst[n].tiles(a.shape)[device])]))
    placements = {n: _torch_placements(s) for n, s in dst.items()}

    def run() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        out = {n: dt.redistribute(mesh, placements[n]) for n, dt in src.items()}
        for dt in out.values():  # redistribute may return before its collectives end: wait for each
            dt.to_local().reshape(-1)[:1].clone()
        dist.barrier()
        seconds = time.perf_counter() - t0
        for n, dt in out.items():
            if not torch.equal(dt.to_local().contiguous().view(torch.uint8), want[n].contiguous().view(torch.uint8)):
                raise AssertionError(f"DTensor redistribute of {n} on rank {rank} differs from its inference tile")
        return seconds

    run()
    times = [run() for _ in range(runs)]
    if rank == 0:
        print(json.dumps({"times": times}), flush=True)
    dist.destroy_process_group()


class _Ranks:
    """``world`` processes of this script running ``worker`` (``--gloo-worker`` or ``--dtensor-worker``), meeting at
    a store this process holds."""

    def __init__(self, worker: str, world: int, layers: int, hidden: int, runs: int,
                 spawn: Callable[[int, list[str]], subprocess.Popen] | None = None):
        """``spawn(rank, argv)`` starts a rank (default: a process of this machine)."""
        import torch.distributed as dist

        self.worker = worker
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        spawn = spawn or (lambda _, argv: subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        self.procs = [spawn(r, [sys.executable, __file__, worker, str(self.store.port), str(r), str(layers),
                                str(hidden), str(runs)]) for r in range(world)]

    def result(self) -> dict:
        """What rank 0 printed last, once every rank exited."""
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in self.procs]
        if any(p.returncode for p in self.procs):
            raise RuntimeError(f"{self.worker} ranks failed: exit codes {[p.returncode for p in self.procs]}")
        return json.loads(outs[0].splitlines()[-1])

    def kill(self) -> None:
        """End the ranks still running (after a failure here: no more turns will come)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class Turns(_Ranks):
    """The raw gloo ranks, started beside the agents, each run when the driver says (`round`): the baseline's runs
    and `reshard_many`'s take turns, so that a change in this shared machine's load reaches both alike."""

    def __init__(self, layers: int, hidden: int, runs: int,
                 spawn: Callable[[int, list[str]], subprocess.Popen] | None = None):
        super().__init__("--gloo-worker", len(HOSTS), layers, hidden, runs, spawn)
        self.cpu: dict[int, float] = {}  # run -> the ranks' CPU seconds in its timed part, summed

    def round(self, i: int) -> float:
        """Run ``i`` of the ranks (0: the untimed one); its seconds."""
        self.store.set(f"go/{i}", "1")
        deadline = time.monotonic() + TIMEOUT_S
        while not self.store.check([f"done/{i}"]):
            if any(p.poll() for p in self.procs) or time.monotonic() > deadline:
                raise RuntimeError(f"raw gloo run {i} failed: exit codes {[p.poll() for p in self.procs]}")
            time.sleep(0.01)
        self.cpu[i] = sum(json.loads(self.store.get(f"cpu/{i}/{r}")) for r in range(len(self.procs)))
        return json.loads(self.store.get(f"done/{i}"))


def _ranks(worker: str, world: int, layers: int, hidden: int, runs: int) -> dict:
    ranks = _Ranks(worker, world, layers, hidden, runs)
    try:
        return ranks.result()
    finally:
        ranks.kill()


# -- 5: reshard_many on emulated hosts ----------------------------------------------------------------------------


@contextlib.contextmanager
def _lab_cluster(gbps: float, transport: str) -> Iterator[tuple]:
    """(the lab, a client of its planner, the TRAIN and INFER meshes on its hosts): 8 emulated hosts, one agent
    each on ``transport``, links shaped to ``gbps``, every agent up (and in the process group, on collective)."""
    from reshard.server.devtools.lab import Lab, LabConfig, start_cluster, wait_for_group

    with Lab(LabConfig(num_hosts=len(HOSTS), devices_per_host=1, gbps=gbps)) as emulated:
        address = start_cluster(emulated, extra_agent_args=["--transport", transport])
        lab_hosts = [emulated.host_name(i) for i in range(len(HOSTS))]
        rename = dict(zip(HOSTS, lab_hosts))
        train_mesh = Mesh.from_hosts(dict(TRAIN.axes), [rename[h] for h in HOSTS[:4]], 1)
        infer_mesh = Mesh.from_hosts(dict(INFER.axes), [rename[h] for h in HOSTS[4:]], 1)
        with emulated.connect(address) as c:
            wait_for_group(c, lab_hosts, group=transport == "collective")
            yield emulated, c, train_mesh, infer_mesh


def lab_layouts(tensors: dict, infer: dict, train_mesh: Mesh, infer_mesh: Mesh) -> tuple[dict, dict, dict]:
    """The state dict on the lab's hosts: what to put (arrays in the training layout), the inference layout to
    sync to, and the training layout to move back to."""
    put = {n: (a, Sharding(train_mesh, s.spec)) for n, (a, s) in tensors.items()}
    return put, {n: Sharding(infer_mesh, s.spec) for n, s in infer.items()}, {n: s for n, (_, s) in put.items()}


def lab_bound(tensors: dict, infer: dict, gbps: float) -> float:
    """The emulated hosts' lower bound on the sync (see the module docstring, 5): the busiest inference host's tile
    bytes, or a quarter of the state dict (every byte leaves the 4 training hosts once), at the link rate."""
    per_host = {h: 0 for h in HOSTS[4:]}
    for name, (a, _) in tensors.items():
        for dev, box in infer[name].tiles(a.shape).items():
            per_host[dev.split("/")[0]] += boxes.volume(box) * a.itemsize
    total = sum(a.nbytes for a, _ in tensors.values())
    return max(max(per_host.values()), total / 4) / (gbps * GB / 8)


def lab(layers: int, hidden: int, runs: int, gbps: float, transport: str = "collective") -> dict:
    from reshard.server.devtools.lab import lab_available

    ok, why = lab_available()
    if not ok:
        return {"skipped": why}
    tensors, infer = state_dict(layers, hidden)
    with _lab_cluster(gbps, transport) as (emulated, c, train_mesh, infer_mesh):
        put, there, back = lab_layouts(tensors, infer, train_mesh, infer_mesh)

        def spawn(rank: int, argv: list[str]) -> subprocess.Popen:  # rank r is HOSTS[r], on lab host r
            env = {**os.environ, STORE_HOST_ENV: emulated.root_ip, "GLOO_SOCKET_IFNAME": "eth0"}
            return emulated.spawn(emulated.host_ns(rank), argv, env=env, stdout=subprocess.PIPE, text=True)

        c.put_many(put)
        turns = Turns(layers, hidden, runs, spawn)
        try:
            results: list = []
            link_bytes: list = []  # every timed run's bytes received over the shaped links, all hosts
            times = _timed(c, tensors, there, back, runs, "lab reshard_many", results, between=turns.round,
                           meter=(lambda: sum(r for _, r in emulated.link_bytes().values()), link_bytes))
            gloo_times = turns.result()["times"]
        except BaseException:
            turns.kill()
            raise
    return {"times": times, "gloo_times": gloo_times, "bound_s": lab_bound(tensors, infer, gbps),
            "link_bytes": link_bytes, "plan_bytes": [r.network_bytes for r in results],
            "carried_by": sorted({t for r in results for t in r.transports})}


# -- the report ------------------------------------------------------------------------------------------------


# -- 6: an RL loop's steps (examples/rl_weight_sync) against raw gloo sends of the same bytes ---------------------

RL_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rl_weight_sync" / "rl_loop.py"
RL_TRAIN_HOSTS, RL_SERVE_HOSTS = ("host0", "host1"), ("host2", "host3")  # the example's: 4 trainer ranks, 2 serving


def _rl_pieces(layouts: dict, shapes: dict) -> list[tuple[str, int, int, tuple]]:
    """(tensor, trainer rank, serving rank, box): what a hand-written sync sends, each serving rank's tile cut
    from the FSDP2 trainer ranks' tiles (dim 0 over the 4, torch.chunk) that overlap it."""
    train = Mesh({"fsdp": 4}, [f"{h}/{i}" for h in RL_TRAIN_HOSTS for i in range(2)])
    pieces = []
    for name, layout in sorted(layouts.items()):
        shape = tuple(shapes[name])
        src = Sharding(train, ("fsdp",) + (None,) * (len(shape) - 1)).tiles(shape)
        dst = Sharding.from_json(layout).tiles(shape)
        for r, sbox in enumerate(src.values()):
            for s_rank, dbox in enumerate(dst[d] for d in Sharding.from_json(layout).mesh.devices):
                part = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(sbox, dbox))
                if all(lo < hi for lo, hi in part):
                    pieces.append((name, r, s_rank, part))
    return pieces


def _rl_gloo_worker(port: int, rank: int, plan_path: str, runs: int) -> None:
    """One of 6 ranks (0-3 trainers, 4-5 serving): every piece by isend/irecv, all at once, timed barrier to
    barrier, received bytes checked."""
    import torch
    import torch.distributed as dist

    plan = json.loads(Path(plan_path).read_text())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=6,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    mine = []
    for name, r, s_rank, box in plan["pieces"]:
        if rank not in (r, 4 + s_rank):
            continue
        shape = tuple(hi - lo for lo, hi in box)
        rng = np.random.default_rng([zlib.crc32(name.encode()), r, s_rank])  # the same at both ends
        want = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        mine.append((want if rank == r else torch.empty(shape), r, 4 + s_rank, want))
    times = []
    for i in range(runs + 1):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(buf, dst) if rank == src else dist.irecv(buf, src) for buf, src, dst, _ in mine]
        for w in works:
            w.wait()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
        for buf, src, _, want in mine:
            if rank != src and not torch.equal(buf, want):
                raise AssertionError(f"rank {rank} received wrong bytes from rank {src}")
    if rank == 0:
        print(json.dumps({"times": times}), flush=True)
    dist.destroy_process_group()


def rl_loop(steps: int, hidden: int, layers: int, vocab: int, transport: str, runs: int) -> dict:
    """The example's loop on a local cluster (4 hosts x 2 devices), its per-step report, and raw gloo sends of
    the bytes one step's sync delivers, between 6 processes laid out as the example's ranks."""
    import tempfile

    from reshard.client.cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
        report = Path(tmp) / "steps.jsonl"
        with LocalCluster(4, 2, transport=transport) as cluster:
            env = {**os.environ, "RESHARD_TOKEN": cluster.token, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, str(RL_EXAMPLE), "--planner", cluster.address, "--steps", str(steps),
                            "--hidden", str(hidden), "--layers", str(layers), "--vocab", str(vocab),
                            "--report", str(report)], env=env, check=True, timeout=TIMEOUT_S)
            with cluster.connect() as c:
                shapes = {t.name: t.shape for t in c.tensors()}
        rows = [json.loads(line) for line in report.read_text().splitlines()]
        pieces = _rl_pieces(rows[-1]["layouts"], shapes)
        plan = Path(tmp) / "plan.json"
        plan.write_text(json.dumps({"pieces": pieces}))
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=300))
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, "--rl-gloo-worker", str(store.port), str(r), str(plan),
                                   str(runs)], env=env, stdout=subprocess.PIPE, text=True) for r in range(6)]
        out = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"raw gloo ranks failed: {[p.returncode for p in procs]}")
    piece_bytes = sum(4 * int(np.prod([hi - lo for lo, hi in box])) for _, _, _, box in pieces)
    return {"rows": rows, "gloo_times": json.loads(out[0].strip().splitlines()[-1])["times"],
            "pieces": len(pieces), "piece_bytes": piece_bytes, "nbytes": sum(4 * int(np.prod(s)) for s in
                                                                              shapes.values())}


def rl_section(args) -> str:
    r = rl_loop(args.rl_steps, args.rl_hidden, args.rl_layers, args.rl_vocab, args.transport, args.runs)
    gloo = statistics.median(r["gloo_times"])
    lines = ["| step | trainer's publish (s) | sync (s) | network bytes | serving's read into the standby (s) | "
             "generations during the sync and the read | serving paused: the swap (s) | raw gloo, same bytes (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['step']} | {row['publish_s']:.3f} | {row['sync_s']:.3f} | {row['network_bytes']:,} | "
                     f"{row['read_s']:.3f} | {row['generated']} | {row['pause_s']:.6f} | {gloo:.3f} |")
    syncs = [row["sync_s"] for row in r["rows"][1:]] or [r["rows"][0]["sync_s"]]
    publishes = [row["publish_s"] for row in r["rows"][1:]] or [r["rows"][0]["publish_s"]]
    whole = [row["publish_s"] + row["sync_s"] + row["read_s"] for row in r["rows"]]
    pause = max(row["pause_s"] for row in r["rows"])
    return (f"The loop of `examples/rl_weight_sync` ({args.rl_layers} layers, hidden {args.rl_hidden}, vocabulary "
            f"{args.rl_vocab}: {r['nbytes'] / MiB:.1f} MiB of float32 weights): 4 FSDP2 ranks (gloo, CPU) train a "
            f"transformers LlamaForCausalLM with AdamW and publish every step (`put_state_dict`: one upload "
            f"transaction over every rank and tensor, every name's new version visible at once; median after the "
            f"first step {statistics.median(publishes):.3f} s); the 2-rank tensor-parallel server's first rank "
            f"syncs it (`sync_state_dict`, one `reshard_many` on the {args.transport} transport, checked against "
            f"the model's manifest) and every rank reads its shards into a standby copy of the model "
            f"(`get_state_dict`), while both ranks keep generating from the live copy; then they swap the copies. "
            f"Serving pauses only for the swap, a reference assignment under a lock: at most {pause * 1e6:.0f} us "
            f"here (the pause column), with generations running through the sync and the read (the generations "
            f"column). Raw gloo: 6 processes laid out as the example's ranks send the {r['pieces']} pieces a step's "
            f"sync delivers ({r['piece_bytes'] / MiB:.2f} MiB: each serving rank's tiles cut from the trainer ranks' "
            f"tiles), all isend/irecv at once, median of {args.runs} after one untimed; the sync's median after the "
            f"first step, {statistics.median(syncs):.3f} s, is {statistics.median(syncs) / gloo:.1f}x that, the "
            f"price of a job (plan check, prepare, commit, the manifest gate) on this many small tensors. A "
            f"hand-written gloo sync has no publish or read of its own: its one transfer stands for all three "
            f"columns, whose sum's median is {statistics.median(whole):.3f} s "
            f"({statistics.median(whole) / gloo:.0f}x), and it needs the trainer and the server in one process "
            f"group, in lockstep, with serving paused while it lands.\n\n"
            + "\n".join(lines)
            + f"\n\nReproduce: `python bench/weight_sync.py --rl-loop --rl-steps {args.rl_steps} --rl-hidden "
              f"{args.rl_hidden} --rl-layers {args.rl_layers} --transport {args.transport}`.")


# -- 7: RL steps, full against delta (issue 40) ---------------------------------------------------------------------


def lab_rl_steps(steps: list, gbps: float, transport: str) -> dict:
    """`rl_steps.sync_steps` on the emulated hosts, with the bytes the shaped links received over each sync."""
    from reshard.server.devtools.lab import lab_available

    ok, why = lab_available()
    if not ok:
        return {"skipped": why}
    with _lab_cluster(gbps, transport) as (emulated, c, train_mesh, infer_mesh):
        return rl_steps.sync_steps(c, steps, train_mesh, infer_mesh, "lab",
                                   meter=lambda: sum(r for _, r in emulated.link_bytes().values()))


def rl_steps_section(args) -> str:
    """The RL-step rows: train once, then the same steps on loopback and (unless --no-lab) the emulated hosts."""
    steps, train_s = rl_steps.train(args.rl_steps, args.delta_hidden, args.delta_layers, args.rl_vocab)
    print(f"{args.rl_steps} AdamW steps in {train_s:.1f}s; bf16 elements changed per step: "
          + ", ".join(f"{rl_steps.changed(a, b):.2%}" for a, b in zip(steps, steps[1:])), flush=True)
    loop = rl_steps.loopback(steps, args.transport, cpu_seconds)
    e = {"skipped": "--no-lab"} if args.no_lab else lab_rl_steps(steps, args.gbps, args.transport)
    return rl_steps.section(steps, train_s, args, loop, e)


def write_rl_steps(args) -> None:
    body = rl_steps_section(args)
    print(body)
    if not args.no_write:
        write_section("weight_sync_rl_steps" if args.transport == "collective"
                      else f"weight_sync_rl_steps_{args.transport}",
                      "Weight sync across RL steps: whole against deltas"
                      + ("" if args.transport == "collective" else f", on the {args.transport} transport"), body,
                      script="weight_sync")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rl-gloo-worker":
        _rl_gloo_worker(int(argv[1]), int(argv[2]), argv[3], int(argv[4]))
        return 0
    workers = {"--gloo-worker": _gloo_worker, "--dtensor-worker": _dtensor_worker}
    if argv and argv[0] in workers:
        port, rank, layers, hidden, runs = map(int, argv[1:6])
        workers[argv[0]](port, rank, layers, hidden, runs)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=50, help="transformer layers (10 tensors each; default 50)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each, after two untimed (default 3)")
    ap.add_argument("--gbps", type=float, default=1.0, help="the lab's link rate, Gbit/s each way (default 1)")
    ap.add_argument("--transport", default="collective", choices=tuple(GOAL_GLOO),
                    help="the agents' transport for the reshards (default collective)")
    ap.add_argument("--no-lab", action="store_true", help="skip the emulated hosts")
    ap.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    ap.add_argument("--rl-loop", action="store_true", help="only the RL loop's rows (examples/rl_weight_sync)")
    ap.add_argument("--rl-only", action="store_true",
                    help="only the RL-step rows: AdamW steps synced whole against as deltas (issue 40)")
    ap.add_argument("--rl-steps", type=int, default=5, help="RL loop and RL-step rows: AdamW steps (default 5)")
    ap.add_argument("--rl-hidden", type=int, default=256,
                    help="RL loop and RL-step rows: the Llama's hidden size (default 256)")
    ap.add_argument("--rl-layers", type=int, default=4, help="RL loop and RL-step rows: its layers (default 4)")
    ap.add_argument("--rl-vocab", type=int, default=1000,
                    help="RL loop and RL-step rows: its vocabulary (default 1000)")
    # The RL-step rows' model is larger than the loop's: a delta saves link time, which a 5 MiB model hardly uses
    ap.add_argument("--delta-hidden", type=int, default=1024,
                    help="RL-step rows: the Llama's hidden size (default 1024: 124 MiB in bf16 with 8 layers)")
    ap.add_argument("--delta-layers", type=int, default=8, help="RL-step rows: its layers (default 8)")
    args = ap.parse_args(argv)
    if args.rl_loop and args.rl_only:
        ap.error("--rl-loop and --rl-only each run one part alone: give one of them")
    if args.rl_steps < 1:
        ap.error(f"--rl-steps {args.rl_steps}: give at least 1 step")
    if args.rl_only:
        write_rl_steps(args)
        return 0
    if args.rl_loop:
        body = rl_section(args)
        print(body)
        if not args.no_write:
            write_section("weight_sync_rl_loop", "Weight sync in an RL loop: FSDP2 training to tensor-parallel serving",
                          body, script="weight_sync")
        return 0
    if args.transport == "nixl":
        from reshard.server.transport.nixl import nixl_missing

        if (missing := nixl_missing()) is not None:
            ap.error(f"--transport nixl needs NIXL, but {missing}")
    goal = GOAL_GLOO[args.transport]

    tensors, infer = state_dict(args.layers, args.hidden)
    nbytes = sum(a.nbytes for a, _ in tensors.values())
    received = _received_bytes(tensors, infer)
    print(f"{len(tensors)} tensors, {nbytes / MiB:.0f} MiB; the inference devices receive {received / MiB:.0f} MiB",
          flush=True)
    turns = Turns(args.layers, args.hidden, args.runs)

    def gloo_run(i: int) -> None:
        print(f"raw gloo broadcasts {'(untimed) ' if not i else ''}{turns.round(i):.3f}s", flush=True)

    try:
        a = agents(args.layers, args.hidden, args.runs, between=gloo_run, transport=args.transport)
        g = turns.result()
    finally:
        turns.kill()
    d = _ranks("--dtensor-worker", 4, args.layers, args.hidden, args.runs)
    print(f"DTensor redistribute loop {statistics.median(d['times']):.3f}s", flush=True)
    e = {"skipped": "--no-lab"} if args.no_lab else lab(args.layers, args.hidden, args.runs, args.gbps,
                                                         args.transport)

    many, per_tensor, gloo = (statistics.median(x) for x in (a["many"], a["per_tensor"], g["times"]))
    same_many, dtensor = statistics.median(a["same_many"]), statistics.median(d["times"])
    many_cpu = statistics.median(a["many_cpu"])
    gloo_cpu = statistics.median(turns.cpu[i] for i in range(1, args.runs + 1))
    same_received = _received_bytes(tensors, _same_mesh(infer))

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    def row(what: str, seconds: float, nbytes: int, vs: str) -> str:
        return f"| {what} | {seconds:.3f} | {nbytes / seconds / GB:.3f} | {vs} |"

    rows = ["| move | seconds | GB/s | against `reshard_many` |", "|---|---:|---:|---|",
            row(f"cross-mesh: one `reshard_many` ({args.transport} transport)", many, received, "1"),
            row("cross-mesh: one `reshard` job per tensor, submitted at once", per_tensor, received,
                f"`reshard_many` {per_tensor / many:.2f}x faster (goal >= {GOAL_PER_TENSOR:g}x: "
                f"{verdict(per_tensor >= GOAL_PER_TENSOR * many)})"),
            row(f"cross-mesh: raw gloo broadcasts ({g['broadcasts']} on {g['groups']} groups)", gloo, received,
                f"`reshard_many` at {gloo / many:.2f}x gloo's speed (goal >= {goal:g}x: "
                f"{verdict(gloo >= goal * many)})"),
            row("same mesh (4 hosts as 2 x 2): one `reshard_many`", same_many, same_received, "1"),
            row("same mesh: a loop of DTensor `redistribute`", dtensor, same_received, _speed(same_many, dtensor))]
    if "skipped" in e:
        lab_text = f"Emulated hosts: skipped ({e['skipped']})."
    else:
        measured, lab_gloo = statistics.median(e["times"]), statistics.median(e["gloo_times"])
        bound_goal = GOAL_BOUND.get(args.transport)
        bound_verdict = (f" (goal at most {bound_goal:.2f}x: {verdict(measured <= bound_goal * e['bound_s'])})"
                         if bound_goal else "")
        # Every byte a plan puts on the network crosses two shaped links (out of its sender, into its receiver):
        # the receivers' counters should hold the plan's network bytes and a little more (headers, control).
        crossed = [got / want for got, want in zip(e["link_bytes"], e["plan_bytes"]) if want]
        links_text = (f" The links' counters (each emulated host's shaped link, bytes it received) over each timed "
                      f"run: {min(e['link_bytes']) / MiB:.0f}-{max(e['link_bytes']) / MiB:.0f} MiB against the "
                      f"plan's {statistics.median(e['plan_bytes']) / MiB:.0f} MiB of network bytes, "
                      f"{min(crossed):.2f}x-{max(crossed):.2f}x: the bytes crossed the shaped links (transfers "
                      f"carried by {e['carried_by']})." if crossed else "")
        lab_text = (f"Emulated hosts (`reshard lab`, 8 hosts x 1 device, links shaped to {args.gbps:g} Gbit/s each "
                    f"way), the same `reshard_many`: measured {measured:.3f} s against a lower bound of "
                    f"{e['bound_s']:.3f} s (the busiest inference host's tiles, or a quarter of the state dict, "
                    f"whichever is more, at the link rate): {measured / e['bound_s']:.2f}x the bound"
                    f"{bound_verdict}.{links_text} The raw gloo broadcasts of (3), one rank in each emulated "
                    f"host's namespace on the same links and taking turns with it: {lab_gloo:.3f} s "
                    f"({lab_gloo / e['bound_s']:.2f}x the bound), so `reshard_many` "
                    f"runs at {lab_gloo / measured:.2f}x gloo's speed there (goal >= {goal:g}x: "
                    f"{verdict(lab_gloo >= goal * measured)}). "
                    f"{turn_spread(e['times'], e['gloo_times'], *VERSUS)} Where the sync's time goes on the links "
                    f"(when its first bytes cross, how busy each link runs, the cores it keeps busy): "
                    f"`bench/link_timeline.py`.")
    ph = a["many_phases"]
    rest = many - sum(ph[p] for p in ("waiting", "planning", "running", "committing"))
    phases_text = (f"The agents ran on the {args.transport} transport (transfers carried by {a['carried_by']}). "
                   f"Where one cross-mesh `reshard_many`'s {many:.3f} s went (the planner's record of each timed job, "
                   f"`JobResult.phases`; medians): waiting {ph['waiting']:.3f} s, planning {ph['planning']:.3f} s "
                   f"(the program is reused, so this is checking the request and choosing the transport), running "
                   f"{ph['running']:.3f} s (every host's Execute, a destination host's commit at its end; the "
                   f"slowest host's part {ph['slowest host']:.3f} s, the fastest {ph['fastest host']:.3f} s), "
                   f"committing {ph['committing']:.3f} s (the catalog's swap); the remaining {rest:.3f} s are the "
                   f"client's request and its wait for the result. "
                   f"Raw gloo's {gloo:.3f} s is all moving bytes. {turn_spread(a['many'], g['times'], *VERSUS)} "
                   f"CPU in the timed part, every process summed (medians): `reshard_many` {many_cpu:.3f} s (the "
                   f"planner and 8 agents: {many_cpu / many:.2f} of this machine's {os.cpu_count()} cores busy on "
                   f"average), raw gloo {gloo_cpu:.3f} s (its 8 ranks: {gloo_cpu / gloo:.2f} cores busy), so "
                   f"`reshard_many` spends {many_cpu / gloo_cpu:.2f}x gloo's CPU on the same bytes. "
                   f"What the service does that gloo does not: a job's control work (plan, prepare, commit), "
                   f"packing small tiles into buckets and unpacking them into whole destination tiles, and an "
                   f"XXH3-64 check of every stream.")
    body = (f"A synthetic state dict of {len(tensors)} tensors ({nbytes / MiB:.0f} MiB: {args.layers} layers, hidden "
            f"{args.hidden}; float32, float16 and float8 bytes with float32 block scales) moved from tensor-parallel "
            f"4 on host0..host3 to tensor-parallel 2 times two replicas on host4..host7 of this machine, one process "
            f"per host; the inference devices end up with {received / MiB:.0f} MiB, which the GB/s counts. Seconds "
            f"from the request (or a barrier) until every byte is in place (or a barrier), median of {args.runs} "
            f"after two untimed (the first two moves of a cluster both stage into fresh memory, the second as the "
            f"delta base pair the first left holds the version before; one job per tensor: one run); every result "
            f"checked bit-exact. Raw gloo sends each "
            f"distinct source tile once, by `broadcast` to the ranks that need it, all issued asynchronously, into "
            f"buffers allocated beforehand; its runs and the cross-mesh `reshard_many`'s take turns (each while the "
            f"other's processes sit idle), so the machine's drifting load reaches both alike. The same-mesh rows move "
            f"host0..host3's tensor-parallel-4 tiles to two replicas of tensor-parallel 2 on the same four "
            f"processes; for DTensor that is `[Shard(d), Shard(d)]` to `[Replicate(), Shard(d)]` on a 2 x 2 "
            f"`DeviceMesh`, for which torch warns that it runs two sequential all-gathers, and each rank checks that "
            f"it starts from its training tile and ends with its inference tile.\n\n"
            + "\n".join(rows) + "\n\n" + phases_text + "\n\n" + lab_text
            + f"\n\nReproduce: `python bench/weight_sync.py --layers {args.layers} --hidden {args.hidden} --runs "
              f"{args.runs} --gbps {args.gbps:g} --transport {args.transport}` (root for the emulated hosts).")
    print(body)
    if not args.no_write:
        # each transport keeps a section of its own: the collective figures stay beside the nixl ones
        write_section("weight_sync" if args.transport == "collective" else f"weight_sync_{args.transport}",
                      "Weight sync: a state dict from training to inference layouts"
                      + ("" if args.transport == "collective" else f", on the {args.transport} transport"), body,
                      script="weight_sync")
    write_rl_steps(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
