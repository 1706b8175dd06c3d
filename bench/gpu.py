"""GPU bench: a CUDA shard handed to an agent by CUDA IPC, against the same bytes over gRPC and a plain copy.

One agent on ``cuda:0`` (``--device``) and a planner run as local processes; this
process plays the training rank. For a ``--mib`` tensor (256 MiB) on the same GPU
it measures, best of ``--repeats``:

=================== ===================================================================
put_shard ipc       ``put_shard(..., ipc=True)``: the agent maps the rank's memory, copies
                    it on the GPU and checks the GPU digest
put_shard grpc      ``put_shard(..., ipc=False)``: pinned staging, a gRPC stream, the
                    agent's pinned staging onto its GPU
get_shard ipc/grpc  the same for reading the shard back onto the GPU
device copy         ``dst.copy_(src)`` of the same bytes on the GPU, the floor
=================== ===================================================================

Figures are the call's wall time and the tensor's size over it. Where torch sees
no CUDA device it says so and exits 0. Not part of BENCHMARKS.md.

    python bench/gpu.py                 # 256 MiB, 5 repeats
    python bench/gpu.py --mib 64 --device cuda:1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

MiB = 2**20


def _best(fn: Callable[[], object], repeats: int, before: Callable[[], object] = lambda: None) -> float:
    import torch

    times = []
    for _ in range(repeats):
        before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(mib: int, repeats: int, device: str) -> list[tuple[str, float]]:
    import torch

    import reshard
    from reshard import Mesh, Sharding

    sharding = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None,))
    src = torch.randint(-2**31, 2**31 - 1, (mib * MiB // 4,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    rows = []
    with reshard.local_cluster(hosts=1, devices_per_host=1, device=device, transport="grpc") as c:
        def drop() -> None:
            if any(t.name == "bench" for t in c.tensors()):
                c.delete("bench")

        for ipc in (True, False):
            label = "ipc" if ipc else "grpc"
            rows.append((f"put_shard {label}",
                         _best(lambda: c.put_shard("bench", "host0/0", src, sharding, ipc=ipc), repeats, drop)))
            stored = c.get_shard("bench", "host0/0", to=device, ipc=False)  # what the last timed put left there
            assert torch.equal(stored, src), f"put_shard over {label} stored other bytes than were put"
        for ipc in (True, False):
            label = "ipc" if ipc else "grpc"
            got = c.get_shard("bench", "host0/0", to=device, ipc=ipc)
            assert torch.equal(got, src), f"get_shard over {label} differs from what was put"
            rows.append((f"get_shard {label}",
                         _best(lambda: c.get_shard("bench", "host0/0", to=device, ipc=ipc), repeats)))
        rows.append(("device copy", _best(lambda: dst.copy_(src), repeats)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="tensor size in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row; the best counts")
    parser.add_argument("--device", default="cuda:0", help="the GPU of the agent and of the rank")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("skipped: no CUDA device (torch is not installed)")
        return 0
    if not torch.cuda.is_available():
        print(f"skipped: no CUDA device (torch {torch.__version__} sees {torch.cuda.device_count()})")
        return 0
    rows = run(args.mib, args.repeats, args.device)
    name = torch.cuda.get_device_name(torch.device(args.device))
    print(f"{args.mib} MiB on {args.device} ({name}), torch {torch.__version__}, best of {args.repeats}")
    print(f"{'method':<16} {'seconds':>9} {'GB/s':>8}")
    for label, seconds in rows:
        print(f"{label:<16} {seconds:>9.4f} {args.mib * MiB / seconds / 1e9:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
