"""Transport bench: raw torch.distributed against a reshard over the collective transport and over gRPC.

On loopback with ``--hosts`` processes (4), one run measures side by side:

(a) raw gloo: ``broadcast`` of the bytes from rank 0, and a chain of sends
    0 -> 1 -> ... -> N-1 in the agents' collective chunk size (the last chunk what is left), each
    rank forwarding chunk k while it receives chunk k+1 (the same pipeline the agents run);
(b) a reshard of a replicated tensor from host0 to the other hosts through real
    agents on the collective transport (the plan is a chain broadcast);
(c) the same reshard with the agents on gRPC.

Figures are bytes delivered to each receiver per second (the tensor's size over
the time until the last receiver has it), best of ``--repeats`` (the reshards
after ``--warmup`` untimed round trips, as the raw buffers are written first); the reshard
times are the job's own (prepare, move, verify, commit). Every result is checked, untimed:
before each raw repeat the receivers' buffers are overwritten with other bytes than rank 0's,
and after it every byte of every receiver is compared with rank 0's; after each reshard every
receiver's copy is compared by its blake2b digest, and the tensor read back after the last
round trip. It writes its section of BENCHMARKS.md through ``bench/_report.py``.

    python bench/transport.py              # 256 MiB, 4 hosts, 5 repeats
    python bench/transport.py --mib 64     # quicker
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20


def _agent_defaults() -> tuple[int, int, int]:
    """The agents' default collective chunk size and chunks in flight per stream (the raw chain pipelines the
    same way), and their gRPC chunk size."""
    from reshard.server.common.config import AgentConfig

    d = AgentConfig(host="bench", num_devices=1, planner="")
    return d.collective_chunk, d.forward_queue_chunks, d.chunk_bytes


CHUNK_BYTES, WINDOW, GRPC_CHUNK_BYTES = _agent_defaults()


# -- (a) raw torch.distributed, one process per rank ---------------------------------------------------


def _raw_worker(port: int, rank: int, world: int, nbytes: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
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

    out = {}
    for name, fn in (("broadcast", broadcast), ("chain", chain)):
        best = float("inf")
        for repeat in range(repeats):
            if rank:
                torch.bitwise_not(sent, out=buf)  # untimed: every byte differs until it is sent again
            pg.barrier().wait()
            t0 = time.perf_counter()
            fn()
            pg.barrier().wait()  # the time until the last receiver has every byte
            best = min(best, time.perf_counter() - t0)
            _check_delivery(pg, rank, world, buf, sent, f"raw {name}, repeat {repeat + 1} of {repeats}")
        out[name] = best
    if rank == 0:
        print(json.dumps(out), flush=True)


def _check_delivery(pg, rank: int, world: int, buf, sent, what: str) -> None:
    """Every rank holds every byte rank 0 sent, or every rank raises naming the ranks that do not (all of them, so
    no rank goes on to wait for the others in a collective that will never come)."""
    import torch

    wrong = torch.zeros(world, dtype=torch.int64)
    wrong[rank] = int((buf != sent).sum())
    pg.allreduce([wrong]).wait()
    if int(wrong.sum()):
        bad = {r: int(v) for r, v in enumerate(wrong.tolist()) if v}
        raise AssertionError(f"{what}: not every byte arrived; bytes of {buf.numel()} that differ from rank 0's, "
                             f"by rank: {bad}")


def raw(world: int, nbytes: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, __file__, "--raw-worker", str(store.port), str(r), str(world),
                               str(nbytes), str(repeats)], stdout=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:  # a worker that failed or hung leaves the others waiting in a collective: end them all
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"raw workers failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0])


# -- (b), (c) reshard through the agents --------------------------------------------------------------


def reshard_seconds(transport: str, world: int, nbytes: int, repeats: int,
                    warmup: int) -> tuple[float, tuple[str, ...]]:
    import numpy as np
    from _checks import differing, tile_digests

    from reshard import Mesh, Sharding
    from reshard.client.cluster import LocalCluster

    hosts = [f"host{i}" for i in range(world)]
    src = Sharding(Mesh.from_hosts({"x": 1, "y": 1}, hosts[:1], 1), (None,))
    dst = Sharding(Mesh.from_hosts({"x": world - 1, "y": 1}, hosts[1:], 1), (None,))
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    want = tile_digests(a, dst)
    best, transports = float("inf"), ()
    with LocalCluster(world, 1, transport=transport) as cluster, cluster.connect() as c:
        c.put("bench", a, src)
        for k in range(warmup + repeats):
            result = c.reshard("bench", dst, "auto").result(timeout=600)
            if k >= warmup:
                best = min(best, result.seconds)
            transports = result.transports
            wrong = differing(c.digests("bench"), want)  # computed on the agents: every receiver's copy, not one
            if wrong:
                raise AssertionError(f"the reshard over {transport}, round {k + 1}, left other bytes than host0's "
                                     f"on {wrong}")
            c.reshard("bench", src, "auto").result(timeout=600)  # back, for the next round
        if not np.array_equal(c.get("bench"), a):
            raise AssertionError(f"the reshard over {transport} did not arrive bit for bit")
    return best, transports


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="tensor size")
    p.add_argument("--hosts", type=int, default=4, help="processes / agents")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed round trips before the timed reshards, as the raw runs write their buffers "
                        "before timing: here an agent's first jobs spent up to ~1 CPU-second per "
                        "256 MiB receiver faulting in fresh memory, which is not the transport")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    for flag, value, least in (("--mib", args.mib, 1), ("--hosts", args.hosts, 2), ("--repeats", args.repeats, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            p.error(f"{flag} must be at least {least}; got {value}")
    nbytes = args.mib * MiB
    raw_s = raw(args.hosts, nbytes, args.repeats)
    coll_s, coll_t = reshard_seconds("collective", args.hosts, nbytes, args.repeats, args.warmup)
    grpc_s, grpc_t = reshard_seconds("grpc", args.hosts, nbytes, args.repeats, args.warmup)
    best_raw = min(raw_s.values())
    rows = [
        ("(a) raw gloo broadcast", raw_s["broadcast"], ""),
        ("(a) raw gloo chain of sends", raw_s["chain"], ""),
        ("(b) reshard, collective transport", coll_s, f"{best_raw / coll_s:.2f}x (target 0.8x)"),
        ("(c) reshard, gRPC transport", grpc_s, f"{best_raw / grpc_s:.2f}x (target 0.45x)"),
    ]
    lines = [
        f"A {args.mib} MiB tensor replicated on host0, delivered to the other {args.hosts - 1} of {args.hosts} "
        f"processes on loopback; best of {args.repeats} (the reshards after {args.warmup} untimed round trips). "
        f"The raw chain pipelines like the collective transport: {CHUNK_BYTES // MiB} MiB chunks, {WINDOW} in "
        f"flight (gRPC streams use their own {GRPC_CHUNK_BYTES // MiB} MiB chunks). GB/s is the tensor's size "
        f"over the time until the last receiver has it. The reshards run through real agents (job seconds: plan, "
        f"prepare, move, XXH3-64 check at the chain's end, commit); their plan is one chain broadcast (transfers "
        f"carried by: collective {list(coll_t)}, gRPC {list(grpc_t)}). Every run is checked outside its timing: "
        f"each raw repeat starts with the receivers' buffers holding other bytes and ends with every byte of "
        f"every receiver compared with rank 0's; each reshard ends with every receiver's blake2b digest compared "
        f"with the tensor's.",
        "",
        "| what | seconds | GB/s | of the better raw figure |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {s:.3f} | {nbytes / s / 1e9:.2f} | {ratio} |" for name, s, ratio in rows]
    lines += ["", f"Reproduce: `python bench/transport.py --mib {args.mib} --hosts {args.hosts} "
                  f"--repeats {args.repeats} --warmup {args.warmup}`."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        from _report import write_section

        write_section("transport", "Transport: collective vs gRPC vs raw torch.distributed", body)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-worker":
        _raw_worker(*(int(v) for v in sys.argv[2:7]))
    else:
        sys.exit(main())
