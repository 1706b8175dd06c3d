"""The nixl transport's data path in one process: 256 MiB from one NIXL agent to three, beside a numpy copy.

Four `NixlTransport`s in this process (UCX, whatever transports UCX picks in one process)
move one array from ``a`` to ``b``, ``c`` and ``d`` through the transport's own streams
(`Transport.send`, `Transport.relay`), each box landing in the receiver's destination
array (registered once, before the timed repeats, as a repeated weight sync's are):

pair   one stream ``a -> b``: the cost of one move
star   three streams from ``a`` at once, one to each receiver
chain  ``a -> b -> c -> d``: each hop forwards chunk k (a WRITE from its own landed
       region) while k + 1 arrives; the last hop checks the XXH3-64
strided  ``a -> b``, the left half of each row of a source tile of rows of 32 KiB (half the
       bytes, in runs of 16 KiB): "in place" with the box's digest known beforehand, as the agent
       digests held shards early (each chunk a WRITE from the tile's runs,
       `Outgoing.put_region`), "packed" without it (each chunk packed and digested as it goes)

It prints the best of ``--repeats`` seconds (the time until the last receiver has every
byte, digest checked), the bytes delivered to each receiver per second, the process's CPU
seconds per GiB delivered, and the same for a plain numpy copy of the bytes into one and
three destination arrays. Every repeat's destinations are overwritten first and compared
after. Not part of the tests; a figure for the lead to look at:

    python bench/nixl_path.py               # 256 MiB, chunks of 4 MiB, 5 repeats
    python bench/nixl_path.py --mib 64 --chunk-mib 1
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reshard.proto.errors import DataLossError  # noqa: E402
from reshard.proto.layout import Checksum  # noqa: E402
from reshard.server.transport.nixl import NixlTransport, nixl_missing  # noqa: E402
from reshard.server.transport.session import Session  # noqa: E402
from reshard.server.transport.streams import StreamKey, in_thread  # noqa: E402

MiB = 2**20
HOSTS = ("a", "b", "c", "d")


class _Tile:
    """A `Sink` of one destination array that holds the whole box."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def write(self, device, box, data) -> None:
        self.array[tuple(slice(lo, hi) for lo, hi in box)] = data

    def place(self, devices, box):
        view = self.array[tuple(slice(lo, hi) for lo, hi in box)]
        return (devices[0], view) if view.flags.c_contiguous else None

    place_whole = place

    def mark(self, device, box) -> None:
        pass


def _verify(check: Checksum, nbytes: int, digest: int) -> None:
    if check.digests and (check.nbytes, check.xxh3_64) != (nbytes, digest):
        raise DataLossError(f"arrived {check.nbytes} bytes with {check.xxh3_64:016x}, sent {nbytes} with {digest:016x}")


def _receive(t: NixlTransport, s: Session, key: StreamKey, peer: str, box, tile: np.ndarray, forward_to):
    sink = _Tile(tile)
    items = t.arrivals(s, key, peer, box, lambda sub: sink.place([t.host], sub))
    return t.relay(s, key, peer, box, items, sink, [t.host], forward_to, _verify)


def _run(agents: dict, src: np.ndarray, dsts: dict, job: str, route: tuple[str, ...], chain: bool) -> float:
    """``src`` from ``a`` to every host of ``route``, down the chain ``a -> route`` or as a star; seconds."""
    box = ((0, src.size),)
    s = {h: Session(job, "bench", {0: "uint8"}, {}) for h in HOSTS}
    receivers = []
    hops = ("a", *route)
    t0 = time.perf_counter()
    if chain:
        for i, h in enumerate(hops[1:], start=1):
            nxt = hops[i + 1] if i + 1 < len(hops) else None
            receivers.append(in_thread(f"recv-{h}", _receive, agents[h], s[h], StreamKey(job, 0, i - 1),
                                       hops[i - 1], box, dsts[h], nxt))
        agents["a"].send(s["a"], StreamKey(job, 0, 0), route[0], src, box, box)
    else:
        for i, h in enumerate(route):
            receivers.append(in_thread(f"recv-{h}", _receive, agents[h], s[h], StreamKey(job, 0, i), "a", box,
                                       dsts[h], None))
        sends = [in_thread(f"send-{h}", agents["a"].send, s["a"], StreamKey(job, 0, i), h, src, box, box)
                 for i, h in enumerate(route)]
        for f in sends:
            f.result(60)
    for f in receivers:
        f.result(60)
    return time.perf_counter() - t0


def _strided(agents: dict, tile: np.ndarray, dst: np.ndarray, job: str, digest: Future | None) -> float:
    """The left half of every row of ``tile`` from ``a`` into ``b``'s ``dst``; seconds."""
    box = ((0, tile.shape[0]), (0, dst.shape[1]))
    s = {h: Session(job, "bench", {0: "uint8"}, {}) for h in ("a", "b")}
    t0 = time.perf_counter()
    received = in_thread("recv-b", _receive, agents["b"], s["b"], StreamKey(job, 0, 0), "a", box, dst, None)
    agents["a"].send(s["a"], StreamKey(job, 0, 0), "b", tile, ((0, tile.shape[0]), (0, tile.shape[1])), box, digest)
    received.result(60)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--chunk-mib", type=float, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    missing = nixl_missing()
    if missing:
        sys.exit(missing)
    n = args.mib * MiB
    agents = {h: NixlTransport(h, chunk_bytes=int(args.chunk_mib * MiB), timeout_s=60.0, stall_timeout_s=30.0)
              for h in HOSTS}
    for h, t in agents.items():
        for peer, other in agents.items():
            if peer != h:
                t.add_peer(peer, other.metadata())
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dsts = {h: np.zeros(n, np.uint8) for h in HOSTS[1:]}
    gib = n / 2**30
    rows = []
    for name, route, chain in (("pair", ("b",), True), ("star", HOSTS[1:], False), ("chain", HOSTS[1:], True)):
        _run(agents, src, dsts, f"warm-{name}", route, chain)  # registers the arrays and connects the agents
        best = cpu = float("inf")
        for r in range(args.repeats):
            for d in dsts.values():
                d[:] = 0
            c0 = time.process_time()
            seconds = _run(agents, src, dsts, f"{name}-{r}", route, chain)
            used = time.process_time() - c0
            assert all(np.array_equal(dsts[h], src) for h in route), f"{name}: a receiver's bytes differ"
            if seconds < best:
                best, cpu = seconds, used
        rows.append((f"nixl {name}, 1 -> {len(route)}", best, cpu / (len(route) * gib)))
    tile = src.reshape(-1, 32768)
    half = np.zeros((tile.shape[0], 16384), np.uint8)
    early: Future = Future()
    early.set_result(xxhash.xxh3_64_intdigest(np.ascontiguousarray(tile[:, :16384])))
    for name, digest in (("in place", early), ("packed", None)):
        _strided(agents, tile, half, f"warm-strided-{name}", digest)
        best = cpu = float("inf")
        for r in range(args.repeats):
            half[:] = 0
            c0 = time.process_time()
            seconds = _strided(agents, tile, half, f"strided-{name}-{r}", digest)
            used = time.process_time() - c0
            assert np.array_equal(half, tile[:, :16384]), f"strided {name}: the bytes differ"
            if seconds < best:
                best, cpu = seconds, used
        rows.append((f"nixl strided, {name}", best, cpu / (half.nbytes / 2**30)))
    for copies in (1, 3):
        best = cpu = float("inf")
        for _ in range(args.repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            for d in list(dsts.values())[:copies]:
                np.copyto(d, src)
            seconds, used = time.perf_counter() - t0, time.process_time() - c0
            if seconds < best:
                best, cpu = seconds, used
        rows.append((f"numpy copy, 1 -> {copies}", best, cpu / (copies * gib)))
    print(f"{args.mib} MiB, chunks of {args.chunk_mib:g} MiB, best of {args.repeats}; GB/s = bytes each receiver "
          f"got per second")
    print(f"{'path':<22} {'seconds':>8} {'GB/s':>7} {'CPU s/GiB':>10}")
    for name, seconds, per_gib in rows:
        moved = n // 2 if name.startswith("nixl strided") else n
        print(f"{name:<22} {seconds:8.3f} {moved / seconds / 1e9:7.2f} {per_gib:10.3f}")
    for t in agents.values():
        t.close()


if __name__ == "__main__":
    main()
