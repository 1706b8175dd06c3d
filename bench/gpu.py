"""GPU bench: CUDA shards handed over and moved by CUDA IPC and by gRPC, each against the plain copy it should approach.

Two agents (``host0``, ``host1``) on one GPU (``--device``, ``cuda:0``) and a planner run as local
processes, transport ``grpc`` (then ``nixl``, for its row); this process plays the training rank. For an int32 tensor of
``--mib`` MiB (4096), then of ``--small-mib`` MiB (256), on that GPU it measures, best of
``--repeats`` (5) each:

==================== ======================== ========================================================
row                  floor, goal              what is timed
==================== ======================== ========================================================
device copy          (a floor)                ``dst.copy_(src)`` of the same bytes on the GPU
d2h pageable         (a floor)                ``host.copy_(src)`` into an ordinary (not pinned) CPU tensor
gpu digest           device copy              ``device_digest(src)``: the digest every IPC hand-over
                                              checks, one read of the bytes (`reshard.proto.gpu_digest`)
copy and digest      device copy              ``copy_digest(dst, src)``: the receiver's one pass
put_shard ipc        device copy, >= 0.5x     ``put_shard(..., ipc=True)``: the agent maps the rank's
                                              memory, copies it on the GPU and checks the GPU digest
get_shard ipc        device copy              ``get_shard(..., to=device, ipc=True)``
get_shard no-ipc     d2h pageable             ``get_shard(..., to=device, ipc=False)``: the agent is on
                                              this machine, so through a pinned shared-memory segment
                                              (`reshard.client.host_path`), the call over gRPC
agent-to-agent ipc   device copy, >= 0.5x     ``reshard`` of the tensor, replicated, from host0's mesh to
                                              host1's and back, alternating: the job's wall time
put_shard no-ipc     d2h pageable, >= 0.5x    ``put_shard(..., ipc=False)``, as ``get_shard no-ipc``
put_shard stream     d2h pageable             ``put_shard(..., ipc=False)`` from a client with
                                              ``shared_memory=False``: a gRPC byte stream through
                                              pinned host buffers (what another machine gets)
agent-to-agent nixl  device copy              ``agent-to-agent ipc`` on a second cluster whose agents
                                              run ``--transport nixl``: one-sided WRITEs from GPU
                                              memory into GPU memory (VRAM: UCX's CUDA IPC between
                                              agents of one machine), checked by the GPU digest;
                                              where NIXL is missing its note says so
==================== ======================== ========================================================

GB/s is the tensor's bytes over the seconds. Goals are judged at ``--mib`` only: there a call's
fixed cost (gRPC calls and CUDA IPC set-up: 5-9 ms on an H200) weighs least beside the copy; the
small size shows that cost. Every row checks its bytes once after timing, each path read back by
another (put by IPC is read through shared memory, put without IPC by IPC); a row that fails is recorded with its error
and the next row runs. A row stops repeating after ``--row-budget-s`` once it has run twice.
``--json PATH`` writes the rows after each one, so a run cut short still leaves what it measured.
Where torch sees no CUDA device it says so and exits 0. Run by ``make gpu-check``
(``bench/gpu_check.py``); not part of BENCHMARKS.md.

    python bench/gpu.py                         # 4096 and 256 MiB, 5 repeats
    python bench/gpu.py --mib 1024 --small-mib 0 --device cuda:1 --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

MiB = 2**20
# Each measured row's floor (a row of the same size) and, at the goal size, the fraction of the floor's GB/s it
# must reach (None: shown against its floor, no goal).
FLOORS = ("device copy", "d2h pageable")
AGAINST = {
    "gpu digest": ("device copy", None),
    "copy and digest": ("device copy", None),
    "put_shard ipc": ("device copy", 0.5),
    "get_shard ipc": ("device copy", None),
    "get_shard no-ipc": ("d2h pageable", None),
    "agent-to-agent ipc": ("device copy", 0.5),
    "put_shard no-ipc": ("d2h pageable", 0.5),
    "put_shard stream": ("d2h pageable", None),
    "agent-to-agent nixl": ("device copy", None),
}
ROWS = (*FLOORS, *AGAINST)
GOAL_ROWS = tuple(name for name, (_, goal) in AGAINST.items() if goal is not None)
MOVE_TIMEOUT_S = 120.0


def positive_int(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, got {text}")
    return n


def size_mib(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of MiB, 0 to leave the size out, got {text}")
    return n


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=positive_int, default=4096, help="tensor size in MiB; goals are judged here")
    parser.add_argument("--small-mib", type=size_mib, default=256, help="a second, smaller size (0: none)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per row; the best counts")
    parser.add_argument("--row-budget-s", type=float, default=30.0,
                        help="a row stops repeating past this many seconds once it has run twice")
    parser.add_argument("--device", default="cuda:0", help="the GPU of the agents and of the rank")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here, after every row")
    return parser.parse_args(argv)


def no_cuda_reason() -> Optional[str]:
    """Why this process cannot run CUDA (torch missing, a CPU build, no device), or None when it can."""
    try:
        import torch
    except Exception as e:  # a broken install raises more than ImportError (OSError for a missing libcudart)
        return f"torch does not import ({type(e).__name__}: {e}), so it sees no CUDA device"
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
        count = torch.cuda.device_count()
    except Exception as e:
        return f"torch {torch.__version__} sees no CUDA device ({type(e).__name__}: {e})"
    build = (f"a CUDA {torch.version.cuda} build, {count} devices" if torch.version.cuda
             else "a CPU-only build: torch.version.cuda is None")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hints = [f"CUDA_VISIBLE_DEVICES={visible!r}"] if visible is not None else []
    if os.path.exists("/dev/nvidiactl"):  # a driver is loaded, so a device was expected
        hints.append("/dev/nvidiactl exists: check that this torch's CUDA suits the driver (nvidia-smi)")
    return f"torch {torch.__version__} sees no CUDA device ({'; '.join([build, *hints])})"


def judged(rows: Sequence[dict], goal_mib: int) -> list[dict]:
    """``rows`` with each one's floor, its ratio to the floor's GB/s, and at ``goal_mib`` its goal and whether it
    was met (None where either side has no figure)."""
    gbps = {(r["name"], r["mib"]): r.get("gbps") for r in rows}
    out = []
    for r in rows:
        r = dict(r)
        floor, goal = AGAINST.get(r["name"], (None, None))
        r["floor"] = floor
        r["goal"] = goal if r["mib"] == goal_mib else None
        base = gbps.get((floor, r["mib"]))
        r["ratio"] = r["gbps"] / base if floor and r.get("gbps") and base else None
        r["met"] = None if r["goal"] is None or r["ratio"] is None else r["ratio"] >= r["goal"]
        out.append(r)
    return out


HEADER = (f"{'row':<20} {'MiB':>6} {'seconds':>9} {'GB/s':>8} {'x floor':>8} {'goal':>7}  {'result':<7} note")


def row_line(r: dict) -> str:
    """One line of the table: a bench row, or any step shaped like one (missing fields print as -)."""
    def num(key: str, fmt: str) -> str:
        v = r.get(key)
        return "-" if v is None else format(v, fmt)

    if r.get("error"):
        result = "error"
    elif r.get("result"):
        result = r["result"]
    elif r.get("met") is not None:
        result = "met" if r["met"] else "MISSED"
    else:
        result = "floor" if r.get("name") in FLOORS else "-"
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
    goal = "-" if r.get("goal") is None else f">={r['goal']:g}x"
    note = r.get("error") or r.get("note") or ""
    return (f"{r['name']:<20} {num('mib', 'd'):>6} {num('seconds', '.4f'):>9} {num('gbps', '.1f'):>8} {ratio:>8} "
            f"{goal:>7}  {result:<7} {note}")


class Report:
    """The run's header and rows, rewritten whole to ``path`` after every change (atomically: a reader never sees
    half a file)."""

    def __init__(self, path: Optional[Path], goal_mib: int, header: dict):
        self.path, self.goal_mib, self.header = path, goal_mib, header
        self.rows: list[dict] = []
        self.error = ""
        self.done = False

    def add(self, row: dict) -> None:
        self.rows.append(row)
        shown = judged(self.rows, self.goal_mib)[-1]
        print(f"  {row_line(shown)}", flush=True)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        data = {**self.header, "goal_mib": self.goal_mib, "rows": judged(self.rows, self.goal_mib),
                "error": self.error, "done": self.done}
        _write_json(self.path, data)

    def failed(self) -> bool:
        rows = judged(self.rows, self.goal_mib)
        return bool(self.error) or any(r.get("error") or r["met"] is False for r in rows)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _best(fn: Callable[[], object], repeats: int, budget_s: float,
          before: Callable[[], object] = lambda: None) -> tuple[float, int]:
    """(best seconds, runs) of ``fn``, each run between GPU synchronisations; ``before`` runs untimed ahead of
    each. Past ``budget_s`` a row stops once it has two runs, so that one slow path cannot eat the whole run,
    and still keeps a run that is not its first (buffers and handles are set up on the first)."""
    import torch

    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - start < budget_s):
        before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times), len(times)


class Bench:
    """The rows of one tensor size on one cluster. ``where`` tracks which host holds "bench" (None: unknown, after
    a row failed), so that a row that needs the tensor on host0 can put it there itself."""

    NAME = "bench"
    HOSTS = ("host0", "host1")

    def __init__(self, c, device: str, mib: int, args: argparse.Namespace, report: Report):
        import torch

        from reshard import Mesh, Sharding

        self.c, self.device, self.mib, self.args, self.report = c, device, mib, args, report
        self.streaming = c.cluster.connect(shared_memory=False)  # what a client on another machine gets
        self.one_host = {h: Sharding(Mesh.from_hosts({"x": 1}, [h], 1), (None,)) for h in self.HOSTS}
        self.src = torch.randint(-2**31, 2**31 - 1, (mib * MiB // 4,), dtype=torch.int32, device=device)
        self.nbytes = self.src.numel() * self.src.element_size()
        self.where: Optional[str] = None
        self._drop()

    def rows(self) -> None:
        for name, fn in (("device copy", self.device_copy), ("d2h pageable", self.d2h_pageable),
                         ("gpu digest", self.gpu_digest), ("copy and digest", self.copy_and_digest),
                         ("put_shard ipc", lambda: self.put_shard(ipc=True)),
                         ("get_shard ipc", lambda: self.get_shard(ipc=True)),
                         ("get_shard no-ipc", lambda: self.get_shard(ipc=False)),
                         ("agent-to-agent ipc", self.agent_to_agent),
                         ("put_shard no-ipc", lambda: self.put_shard(ipc=False)),
                         ("put_shard stream", lambda: self.put_shard(ipc=False, client=self.streaming))):
            self.row(name, fn)

    def row(self, name: str, fn: Callable[[], tuple[float, int, dict]]) -> None:
        try:
            seconds, runs, extra = fn()
        except Exception as e:
            traceback.print_exc()
            self.where = None
            self.report.add({"name": name, "mib": self.mib, "error": f"{type(e).__name__}: {e}"[:300]})
            return
        self.report.add({"name": name, "mib": self.mib, "seconds": seconds, "gbps": self.nbytes / seconds / 1e9,
                         "runs": runs, **extra})

    def close(self) -> None:
        import torch

        try:
            self._drop()
        finally:
            self.streaming.close()
            del self.src
            torch.cuda.empty_cache()

    # -- the rows: each returns (best seconds, runs, extra fields of its row) --------------------------------

    def device_copy(self):
        import torch

        dst = torch.empty_like(self.src)  # freed when this row returns
        seconds, runs = self._best(lambda: dst.copy_(self.src))
        self._check(dst, "the device copy")
        return seconds, runs, {"note": "dst.copy_(src) on the GPU"}

    def gpu_digest(self):
        from reshard.proto import devices

        want = devices.device_digest(self.src.cpu().numpy())  # numpy on the CPU, untimed
        got = []
        seconds, runs = self._best(lambda: got.append(devices.device_digest(self.src)))
        if got[-1] != want:
            raise AssertionError(f"the GPU digest {got[-1]:016x} differs from numpy's {want:016x}")
        return seconds, runs, {"note": "a read of the bytes; equal to numpy's"}

    def copy_and_digest(self):
        import torch

        from reshard.proto import devices

        dst = torch.empty_like(self.src)
        want = devices.device_digest(self.src)
        got = []
        seconds, runs = self._best(lambda: got.append(devices.copy_digest(dst, self.src)))
        self._check(dst, "the copy that digests")
        if got[-1] != want:
            raise AssertionError(f"the copy's digest {got[-1]:016x} differs from the source's {want:016x}")
        return seconds, runs, {"note": "one pass: read, write, sums"}

    def d2h_pageable(self):
        import torch

        # Pageable, what a gRPC stream starts from; freed when this row returns, before the gRPC rows stage host
        # copies of their own: at most two at a time.
        host = torch.empty(self.src.shape, dtype=self.src.dtype)
        seconds, runs = self._best(lambda: host.copy_(self.src))
        self._check(host.to(self.device), "the pageable device-to-host copy")
        return seconds, runs, {"note": "host.copy_(src), not pinned"}

    def put_shard(self, ipc: bool, client=None):
        client = client or self.c
        seconds, runs = self._best(
            lambda: client.put_shard(self.NAME, "host0/0", self.src, self.one_host["host0"], ipc=ipc), self._drop)
        self.where = "host0"
        # read back by the other path, so that the check does not share a fault with what it checks
        back = "shared memory" if ipc else "ipc"
        self._check(self.c.get_shard(self.NAME, "host0/0", to=self.device, ipc=not ipc),
                    f"put_shard {'over ipc' if ipc else 'without ipc'}, read back by {back},")
        return seconds, runs, {"note": f"checked by get_shard through {back}"}

    def get_shard(self, ipc: bool):
        self._on_host0()
        last = []

        def get():
            last[:] = [self.c.get_shard(self.NAME, "host0/0", to=self.device, ipc=ipc)]

        seconds, runs = self._best(get)
        self._check(last[0], f"get_shard over {'ipc' if ipc else 'grpc'}")
        return seconds, runs, {"note": "the last read checked"}

    def agent_to_agent(self):
        self._on_host0()
        results = []

        def move():
            target = "host1" if self.where == "host0" else "host0"
            results.append(self.c.reshard(self.NAME, self.one_host[target]).result(timeout=MOVE_TIMEOUT_S))
            self.where = target

        seconds, runs = self._best(move)
        last = results[-1]
        if self.where != "host1":  # one more, untimed, so that the check reads host1
            move()
        self._check(self.c.get_shard(self.NAME, "host1/0", to=self.device, ipc=True), "the move to host1")
        transports = sorted(set(last.transports))
        # The hosts' running part of the job (its moves), without planning and committing: what a job's fixed
        # cost leaves of the copy's rate.
        running = min(max(r.host_seconds.values(), default=0.0) for r in results)
        note = (f"transport {last.transport or '-'}, transfers {','.join(transports) or '-'}, "
                f"network bytes {last.network_bytes}, hosts running {running * 1e3:.2f} ms")
        return seconds, runs, {"note": note, "transport": last.transport, "transports": list(last.transports),
                               "transport_reason": last.transport_reason, "network_bytes": last.network_bytes,
                               "job_seconds": last.seconds, "running_seconds": running,
                               "phases": dict(last.phases)}

    # -- helpers ------------------------------------------------------------------------------------------------

    def _best(self, fn, before=lambda: None) -> tuple[float, int]:
        return _best(fn, self.args.repeats, self.args.row_budget_s, before)

    def _drop(self) -> None:
        if any(t.name == self.NAME for t in self.c.tensors()):
            self.c.delete(self.NAME)
        self.where = None

    def _on_host0(self) -> None:
        if self.where != "host0":
            self._drop()
            self.c.put_shard(self.NAME, "host0/0", self.src, self.one_host["host0"], ipc="auto")
            self.where = "host0"

    def _check(self, got, what: str) -> None:
        import torch

        if got.shape != self.src.shape or got.dtype != self.src.dtype or not torch.equal(got.to(self.device),
                                                                                          self.src):
            raise AssertionError(f"{what} gave other bytes than the source ({got.dtype} {tuple(got.shape)} on "
                                 f"{got.device}; the source is {self.src.dtype} {tuple(self.src.shape)})")


def sizes_mib(args: argparse.Namespace) -> list[int]:
    return [args.mib] + ([args.small_mib] if args.small_mib and args.small_mib != args.mib else [])


def run(args: argparse.Namespace, report: Report) -> None:
    import reshard
    from reshard.server.transport.nixl_api import nixl_missing

    with reshard.local_cluster(hosts=2, devices_per_host=1, device=args.device, transport="grpc") as c:
        for mib in sizes_mib(args):
            print(f"{mib} MiB, best of {args.repeats}:", flush=True)
            bench = Bench(c, args.device, mib, args, report)
            try:
                bench.rows()
            finally:
                bench.close()
    missing = nixl_missing()
    if missing:
        for mib in sizes_mib(args):
            report.add({"name": "agent-to-agent nixl", "mib": mib, "note": f"not run: {missing}"})
        return
    with reshard.local_cluster(hosts=2, devices_per_host=1, device=args.device, transport="nixl") as c:
        for mib in sizes_mib(args):
            print(f"{mib} MiB over nixl, best of {args.repeats}:", flush=True)
            bench = Bench(c, args.device, mib, args, report)
            try:
                bench.row("agent-to-agent nixl", bench.agent_to_agent)
            finally:
                bench.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    reason = no_cuda_reason()
    if reason:
        print(f"skipped: {reason}")
        if args.json:
            _write_json(args.json, {"skipped": reason})
        return 0
    import torch

    try:
        device = torch.device(args.device)
        if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"torch sees {torch.cuda.device_count()} CUDA devices")
    except (RuntimeError, ValueError) as e:
        message = (f"--device {args.device} names no CUDA device of this machine ({e}); give one of "
                   f"{[f'cuda:{i}' for i in range(torch.cuda.device_count())]}")
        print(f"error: {message}", file=sys.stderr)
        if args.json:
            _write_json(args.json, {"error": message, "rows": []})
        return 2
    torch.cuda.set_device(device)
    header = {"card": torch.cuda.get_device_name(device), "device": args.device, "torch": torch.__version__,
              "cuda": torch.version.cuda, "repeats": args.repeats,
              "sizes_mib": sizes_mib(args)}
    print(f"{header['card']} ({args.device}), torch {header['torch']}, CUDA {header['cuda']}", flush=True)
    report = Report(args.json, args.mib, header)
    report.save()
    try:
        run(args, report)
    except Exception as e:  # the cluster did not start, or died: the rows so far still print
        traceback.print_exc()
        report.error = f"{type(e).__name__}: {e}"[:500]
    report.done = True
    report.save()
    print(f"\n{header['card']}: goals judged at {args.mib} MiB; GB/s = the tensor's bytes / seconds")
    print(HEADER)
    for r in judged(report.rows, args.mib):
        print(row_line(r))
    if report.error:
        print(f"error: {report.error}")
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
