"""Transport bench: raw torch.distributed against a reshard over each transport, and nixl on one host pair.

On loopback with ``--hosts`` processes (4), one run measures side by side:

(a) raw gloo: ``broadcast`` of the bytes from rank 0, and a chain of sends
    0 -> 1 -> ... -> N-1 in the agents' collective chunk size (the last chunk what is left), each
    rank forwarding chunk k while it receives chunk k+1 (the same pipeline the agents run);
(b) a reshard of a replicated tensor from host0 to the other hosts through real
    agents on the collective transport (the plan is a chain broadcast);
(c) the same reshard with the agents on gRPC;
(d) the same reshard with the agents on NIXL (UCX, the transports UCX picks between processes of one machine);
(e) a host pair: the tensor from one agent to one other on NIXL, against a numpy copy of the same bytes into
    a buffer of this process (the most one machine's memory can do). The two agents share one kernel, so the
    sender copies straight into the receiver's shared tile (`server/transport/shm.py`); the row says whether it
    did (the sender's mappings of the receiver's segments, from ``/proc``), and prints its ratio as it goes.

The raw ranks stay up for the whole run and take turns with the reshards: after each timed reshard of (b), (c)
and (d) (each while the other side's processes sit idle), one raw turn of (a), so that this shared machine's
drifting load reaches a transport and the raw turns it is compared with alike; (e) takes turns with its numpy
copy the same way. Figures are medians of ``--repeats`` turns (the reshards after ``--warmup`` untimed round
trips, as the raw buffers are written first); a transport's ratio is against the raw turns taken beside it. GB/s
is bytes delivered to each receiver per second (the tensor's size over the time until the last receiver has it);
the reshard times are the job's own (plan, prepare, move, verify, commit). CPU per GiB is every process of a side
(the planner and agents from ``/proc``, each raw rank its own ``time.process_time``) over the timed part, summed,
per GiB delivered to all receivers. Every result is checked, untimed: before each raw turn the receivers' buffers
are overwritten with other bytes than rank 0's, and after it every byte of every receiver is compared with
rank 0's; after each reshard every receiver's copy is compared by its blake2b digest, and the tensor read back
after the last round trip. It writes its section of BENCHMARKS.md through ``bench/_report.py``.

    python bench/transport.py              # 256 MiB, 4 hosts, 5 turns
    python bench/transport.py --mib 64     # quicker
    python bench/transport.py --pair-only  # (e) alone, printed (BENCHMARKS.md keeps the whole run's section)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meter import cpu_seconds  # noqa: E402

MiB = 2**20
GiB = 2**30
TIMEOUT_S = 600
# What each transport's reshard should reach of the raw turns beside it (issues 8 and 38), and the host pair's
# NIXL reshard of a numpy copy.
TARGETS = {"collective": 0.8, "grpc": 0.45, "nixl": 1.0}
PAIR_TARGET = 0.5


def _agent_defaults() -> tuple[int, int, int]:
    """The agents' default collective chunk size and chunks in flight per stream (the raw chain pipelines the
    same way), and their gRPC chunk size."""
    from reshard.server.common.config import AgentConfig

    d = AgentConfig(host="bench", num_devices=1, planner="")
    return d.collective_chunk, d.forward_queue_chunks, d.chunk_bytes


CHUNK_BYTES, WINDOW, GRPC_CHUNK_BYTES = _agent_defaults()


# -- (a) raw torch.distributed, one process per rank ---------------------------------------------------


def _raw_worker(port: int, rank: int, world: int, nbytes: int) -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    # The store waits between turns while a whole cluster starts and warms up: far longer than a collective.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("bench/", store), rank, world, opts)
    # What rank 0 sends, known to every rank: bytes that vary along the buffer with a period (251) prime to the
    # chunk size, so a chunk delivered to the wrong offset differs as well as one never delivered.
    sent = torch.arange(251, dtype=torch.uint8).repeat(-(-nbytes // 251))[:nbytes]
    buf = sent.clone()
    n = -(-nbytes // CHUNK_BYTES)  # the last chunk may be shorter: the chain moves every byte

    def chunk(k):
        return buf[k * CHUNK_BYTES:(k + 1) * CHUNK_BYTES]

    def broadcast():
        pg.broadcast(buf, 0).wait()

    def chain():
        if rank == 0:
            works = []
            for k in range(n):
                works.append(pg.send([chunk(k)], 1, 7))
                if len(works) >= WINDOW:
                    works.pop(0).wait()
            for w in works:
                w.wait()
            return
        recvs = [pg.recv([chunk(k)], rank - 1, 7) for k in range(min(WINDOW, n))]
        sends = []
        for k in range(n):
            recvs[k].wait()
            if k + WINDOW < n:
                recvs.append(pg.recv([chunk(k + WINDOW)], rank - 1, 7))
            if rank + 1 < world:
                sends.append(pg.send([chunk(k)], rank + 1, 7))
        for w in sends:
            w.wait()

    def timed(name: str, fn: Callable[[], None], turn: int) -> tuple[float, float]:
        if rank:
            torch.bitwise_not(sent, out=buf)  # untimed: every byte differs until it is sent again
        pg.barrier().wait()
        t0, cpu0 = time.perf_counter(), time.process_time()
        fn()
        pg.barrier().wait()  # the time until the last receiver has every byte
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        _check_delivery(pg, rank, world, buf, sent, f"raw {name}, turn {turn}")
        return seconds, cpu

    turn = 0
    while True:  # a turn when the driver says (`RawTurns.round`), until it says stop
        store.wait([f"go/{turn}"])
        if store.get(f"go/{turn}") == b"stop":
            break
        out = {}
        for name, fn in (("broadcast", broadcast), ("chain", chain)):
            out[name], out[f"{name} cpu"] = timed(name, fn, turn)
        store.set(f"out/{turn}/{rank}", json.dumps(out))
        pg.barrier().wait()  # every rank's figures are in the store before rank 0 says the turn is done
        if rank == 0:
            store.set(f"done/{turn}", "1")
        turn += 1


def _check_delivery(pg, rank: int, world: int, buf, sent, what: str) -> None:
    """Every rank holds every byte rank 0 sent, or every rank raises naming the ranks that do not (all of them, so
    no rank goes on to wait for the others in a collective that will never come)."""
    import torch

    wrong = torch.zeros(world, dtype=torch.int64)
    wrong[rank] = int(torch.count_nonzero(buf != sent))  # no int64 sum of 256 Mi elements: 2 GiB per rank
    pg.allreduce([wrong]).wait()
    if int(wrong.sum()):
        bad = {r: int(v) for r, v in enumerate(wrong.tolist()) if v}
        raise AssertionError(f"{what}: not every byte arrived; bytes of {buf.numel()} that differ from rank 0's, "
                             f"by rank: {bad}")


class RawTurns:
    """The raw gloo ranks, one process each, up for the whole run and timed a turn at a time (`round`), while the
    agents they are compared with sit idle."""

    def __init__(self, world: int, nbytes: int):
        import torch.distributed as dist

        self.world = world
        self.turn = 0
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs = [subprocess.Popen([sys.executable, __file__, "--raw-worker", str(self.store.port), str(r),
                                        str(world), str(nbytes)]) for r in range(world)]

    def round(self) -> dict[str, float]:
        """One turn: broadcast, then chain; each one's seconds and the ranks' CPU seconds, summed."""
        turn, self.turn = self.turn, self.turn + 1
        self.store.set(f"go/{turn}", "run")
        deadline = time.monotonic() + TIMEOUT_S
        while not self.store.check([f"done/{turn}"]):
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise RuntimeError(f"raw gloo turn {turn} failed: exit codes {[p.poll() for p in self.procs]}")
            time.sleep(0.005)
        outs = [json.loads(self.store.get(f"out/{turn}/{r}")) for r in range(self.world)]
        return {"broadcast": outs[0]["broadcast"], "chain": outs[0]["chain"],
                "broadcast cpu": sum(o["broadcast cpu"] for o in outs), "chain cpu": sum(o["chain cpu"] for o in outs)}

    def close(self) -> None:
        self.store.set(f"go/{self.turn}", "stop")
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:  # a rank that failed or hung leaves the others waiting in a collective: end them all
            if p.poll() is None:
                p.kill()
                p.wait()


# -- (b) to (e) reshards through the agents --------------------------------------------------------------------




def shared_segments(sender_pid: int, receiver_pid: int) -> int:
    """How many of the receiver's shared segments (memfds its agent names ``reshard-<pid>``, `shm`) the sender's
    agent has mapped now: the host pair's bytes went through shared memory when that is not 0."""
    with open(f"/proc/{sender_pid}/maps") as f:
        return sum(f"/memfd:reshard-{receiver_pid} " in line for line in f)


def reshard_turns(transport: str, world: int, nbytes: int, repeats: int, warmup: int,
                  between: Callable[[], None], out: dict | None = None) -> dict:
    """Each timed reshard's job seconds and the service's CPU seconds (planner and agents), the transports
    that carried it, and how many of host1's shared segments host0 maps at the end; ``between()`` runs after each
    timed reshard and its move back (the other side's turn); filled into ``out`` where given, as it goes."""
    import numpy as np
    from _checks import differing, tile_digests

    from reshard import Mesh, Sharding
    from reshard.client.cluster import LocalCluster

    hosts = [f"host{i}" for i in range(world)]
    src = Sharding(Mesh.from_hosts({"x": 1, "y": 1}, hosts[:1], 1), (None,))
    dst = Sharding(Mesh.from_hosts({"x": world - 1, "y": 1}, hosts[1:], 1), (None,))
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    want = tile_digests(a, dst)
    out = out if out is not None else {}
    out.update({"seconds": [], "cpu": [], "running": [], "transports": ()})
    with LocalCluster(world, 1, transport=transport) as cluster, cluster.connect() as c:
        pids = [cluster.planner.pid, *(p.pid for p in cluster.agents.values())]
        c.put("bench", a, src)
        for k in range(warmup + repeats):
            cpu0 = cpu_seconds(pids)
            result = c.reshard("bench", dst, "auto").result(timeout=TIMEOUT_S)
            cpu = cpu_seconds(pids) - cpu0
            out["transports"] = result.transports
            wrong = differing(c.digests("bench"), want)  # computed on the agents: every receiver's copy, not one
            if wrong:
                raise AssertionError(f"the reshard over {transport}, round {k + 1}, left other bytes than host0's "
                                     f"on {wrong}")
            c.reshard("bench", src, "auto").result(timeout=TIMEOUT_S)  # back, for the next round
            if k >= warmup:
                out["seconds"].append(result.seconds)
                out["cpu"].append(cpu)
                out["running"].append(result.phases.get("running", 0.0))
                between()
        if not np.array_equal(c.get("bench"), a):
            raise AssertionError(f"the reshard over {transport} did not arrive bit for bit")
        out["shared"] = shared_segments(cluster.agents[hosts[0]].pid, cluster.agents[hosts[1]].pid)
    print(f"{transport}: {[round(s, 3) for s in out['seconds']]} s", flush=True)
    return out


def memcpy_turn(src, dst) -> tuple[float, float]:
    """Seconds and this process's CPU seconds of a numpy copy of ``src`` into ``dst`` (written before: no page
    faults), checked after."""
    import numpy as np

    np.bitwise_not(src, out=dst)
    t0, cpu0 = time.perf_counter(), time.process_time()
    np.copyto(dst, src)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if not np.array_equal(dst, src):
        raise AssertionError("the numpy copy did not arrive bit for bit")
    return seconds, cpu


def main(argv=None) -> int:
    from _report import turns as turn_spread

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="tensor size")
    p.add_argument("--hosts", type=int, default=4, help="processes / agents")
    p.add_argument("--repeats", type=int, default=5, help="timed turns of each")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed round trips before the timed reshards, as the raw runs write their buffers "
                        "before timing: here an agent's first jobs spent up to ~1 CPU-second per "
                        "256 MiB receiver faulting in fresh memory, which is not the transport")
    p.add_argument("--transports", default="collective,grpc,nixl",
                   help="the reshards' transports, comma-separated (nixl also runs the host pair)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    p.add_argument("--pair-only", action="store_true",
                   help="run (e) alone, the nixl host pair against the numpy copy; printed, not written")
    args = p.parse_args(argv)
    for flag, value, least in (("--mib", args.mib, 1), ("--hosts", args.hosts, 2), ("--repeats", args.repeats, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            p.error(f"{flag} must be at least {least}; got {value}")
    transports = [t for t in args.transports.split(",") if t]
    unknown = sorted(set(transports) - set(TARGETS))
    if unknown or not transports:
        p.error(f"--transports {args.transports!r} names {unknown or 'nothing'}; pick from {', '.join(TARGETS)}")
    if "nixl" in transports:
        from reshard.server.transport.nixl import nixl_missing

        if (missing := nixl_missing()) is not None:
            p.error(f"--transports names nixl, but {missing} (or leave nixl out of --transports)")
    nbytes = args.mib * MiB
    delivered_gib = nbytes * (args.hosts - 1) / GiB
    if args.pair_only:
        if "nixl" not in transports:
            p.error("--pair-only runs the nixl host pair: leave nixl in --transports")
        print("\n".join(pair_section(args, host_pair(nbytes, args.repeats, args.warmup))))
        return 0

    raw = RawTurns(args.hosts, nbytes)
    turns: dict[str, list[dict]] = {t: [] for t in transports}
    reshards: dict[str, dict] = {}
    try:
        raw.round()  # untimed: the pairs connect and the buffers are written
        for t in transports:
            reshards[t] = reshard_turns(t, args.hosts, nbytes, args.repeats, args.warmup,
                                        lambda t=t: turns[t].append(raw.round()))
    finally:
        raw.close()
    pair = host_pair(nbytes, args.repeats, args.warmup) if "nixl" in transports else None

    every = [r for t in transports for r in turns[t]]
    med = statistics.median

    def best_raw(rs: list[dict]) -> list[float]:
        return [min(r["broadcast"], r["chain"]) for r in rs]

    def cpu_gib(cpu: float, gib: float) -> str:
        return f"{cpu / gib:.2f}"

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    names = {"collective": "(b) reshard, collective transport", "grpc": "(c) reshard, gRPC transport",
             "nixl": "(d) reshard, nixl transport"}
    rows = [("(a) raw gloo broadcast", med(r["broadcast"] for r in every), "",
             cpu_gib(med(r["broadcast cpu"] for r in every), delivered_gib)),
            ("(a) raw gloo chain of sends", med(r["chain"] for r in every), "",
             cpu_gib(med(r["chain cpu"] for r in every), delivered_gib))]
    spreads = []
    for t in transports:
        s, beside = med(reshards[t]["seconds"]), med(best_raw(turns[t]))
        ratio = beside / s
        rows.append((names[t], s, f"{ratio:.2f}x (target {TARGETS[t]:g}x: {verdict(ratio >= TARGETS[t])})",
                     cpu_gib(med(reshards[t]["cpu"]), delivered_gib)))
        spreads.append(turn_spread(reshards[t]["seconds"], best_raw(turns[t]), f"the {t} reshard", "raw gloo",
                                   f"of {t} and the raw turns beside it"))
    lines = [
        f"A {args.mib} MiB tensor replicated on host0, delivered to the other {args.hosts - 1} of {args.hosts} "
        f"processes on loopback; medians of {args.repeats} turns (the reshards after {args.warmup} untimed round "
        f"trips). The raw gloo ranks stay up for the whole run and take a turn (broadcast, then chain) after each "
        f"timed reshard, while the agents sit idle; a transport's ratio is the median of the better raw figure in "
        f"the turns beside it over its own median. The raw chain pipelines like the collective transport: "
        f"{CHUNK_BYTES // MiB} MiB chunks, {WINDOW} in flight (gRPC streams use their own "
        f"{GRPC_CHUNK_BYTES // MiB} MiB chunks). GB/s is the tensor's size over the time until the last receiver has "
        f"it. The reshards run through real agents (job seconds: plan, prepare, move, XXH3-64 check at the chain's "
        f"end, commit); their plan is one chain broadcast (transfers carried by: "
        + ", ".join(f"{t} {list(reshards[t]['transports'])}" for t in transports)
        + "). The agents start as `LocalCluster` starts them, with glibc's non-temporal copy threshold at 1 MiB in "
        f"their environment (`client/cluster.py`, `agent_environment`: their chunks stream to memory); the raw ranks "
        f"with this process's environment (GLIBC_TUNABLES {os.environ.get('GLIBC_TUNABLES') or 'unset'}). CPU "
        f"s/GiB: every process of a side over the timed part (the planner and agents from `/proc`, each "
        f"raw rank its own `process_time`), summed, per GiB delivered ({delivered_gib:.2f} GiB: the tensor to "
        f"each receiver). Every run is checked outside its timing: each raw turn starts with the receivers' "
        f"buffers holding other bytes and ends with every byte of every receiver compared with rank 0's; each "
        f"reshard ends with every receiver's blake2b digest compared with the tensor's.",
        "",
        "| what | seconds | GB/s | of the better raw figure beside it | CPU s/GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {name} | {s:.3f} | {nbytes / s / 1e9:.2f} | {ratio} | {cpu} |" for name, s, ratio, cpu in rows]
    lines += ["", "Raw gloo's figure in a turn is the better of its broadcast and chain. " + " ".join(spreads)]
    if "nixl" in transports:
        # Must-show 5 of issue 38: a completion busy-polled in Python would show here as CPU, not as seconds.
        cpu = {t: med(reshards[t]["cpu"]) for t in transports}
        raw_cpu = min(med(r["broadcast cpu"] for r in every), med(r["chain cpu"] for r in every))
        others = [f"{cpu['nixl'] / cpu[t]:.2f}x the {t} transport's ({cpu[t] / delivered_gib:.2f})"
                  for t in transports if t != "nixl"]
        lines += ["", f"CPU per GiB delivered: the nixl transport's planner and agents used "
                      f"{cpu['nixl'] / delivered_gib:.2f} CPU s/GiB, " + ", ".join(others)
                  + f"{',' if others else ''} and {cpu['nixl'] / raw_cpu:.2f}x raw gloo's (the leaner of its "
                    f"broadcast and chain, {raw_cpu / delivered_gib:.2f}); the service's figure includes the job's "
                    f"control work and the XXH3-64 check that raw gloo does not do."]
    if pair is not None:
        lines += ["", *pair_section(args, pair)]
    lines += ["", f"Reproduce: `python bench/transport.py --mib {args.mib} --hosts {args.hosts} "
                  f"--repeats {args.repeats} --warmup {args.warmup} --transports {','.join(transports)}`."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        from _report import write_section

        write_section("transport", "Transport: collective vs gRPC vs nixl vs raw torch.distributed", body)
    return 0


def host_pair(nbytes: int, repeats: int, warmup: int) -> dict:
    """(e): the nixl host pair's turns, each followed by a numpy copy of the same bytes (printed as it goes)."""
    import numpy as np

    a = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst, copies = np.empty_like(a), []

    def copy_turn() -> None:
        copies.append(memcpy_turn(a, dst))
        print(f"host pair: {pair['seconds'][-1]:.3f} s, numpy copy {copies[-1][0]:.3f} s: "
              f"{copies[-1][0] / pair['seconds'][-1]:.2f}x", flush=True)

    pair: dict = {}
    reshard_turns("nixl", 2, nbytes, repeats, warmup, copy_turn, pair)
    pair["memcpy"], pair["memcpy cpu"] = zip(*copies)
    return pair


def pair_section(args, pair: dict) -> list[str]:
    """The lines of (e), against the numpy copies taken beside it in the same run."""
    from _report import turns as turn_spread

    med = statistics.median
    nbytes = args.mib * MiB
    s, copy = med(pair["seconds"]), med(pair["memcpy"])
    pair_gib = nbytes / GiB
    ok = "met" if copy / s >= PAIR_TARGET else "**not met**"
    how = (f"host0's agent copied straight into host1's shared tile (it maps {pair['shared']} of host1's shared "
           f"segments, `server/transport/shm.py`)" if pair["shared"] else
           "host1's tile was not shared memory (or NIXL wrote it): UCX carried the bytes")
    return [
        f"(e) One host pair on nixl: the same {args.mib} MiB from host0's agent to host1's, two processes of this "
        f"machine ({how}), taking turns with a numpy copy of the same bytes into a buffer of this process written "
        f"beforehand (`np.copyto`; one core, no page faults); medians of {args.repeats} turns.",
        "",
        "| what | seconds | GB/s | of the numpy copy | CPU s/GiB |",
        "|---|---:|---:|---:|---:|",
        f"| numpy copy | {copy:.3f} | {nbytes / copy / 1e9:.2f} |  | {med(pair['memcpy cpu']) / pair_gib:.2f} |",
        f"| (e) reshard, nixl, host0 -> host1 | {s:.3f} | {nbytes / s / 1e9:.2f} | {copy / s:.2f}x (target "
        f"{PAIR_TARGET:g}x: {ok}) | {med(pair['cpu']) / pair_gib:.2f} |",
        "",
        f"Of the host pair's job seconds, running (the hosts' part: the move and the XXH3-64 check) took "
        f"{med(pair['running']):.3f} s (median); the rest is the job's control work (plan, prepare, commit). "
        + turn_spread(pair["seconds"], list(pair["memcpy"]), "the host pair's reshard", "the numpy copy"),
    ]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-worker":
        _raw_worker(*(int(v) for v in sys.argv[2:6]))
    else:
        sys.exit(main())
