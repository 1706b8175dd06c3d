"""Planning time of a Kimi-K2-like MoE state dict (`reshard.moe`) as it grows: layers and experts scaled.

Each row builds the case (`moe_state_dict` on 256 training GPUs as 32 hosts x 8, 128 serving GPUs as 16 hosts x 8,
replicas of an expert-parallel group of 16) and plans it with `reshard.plan_many` and the case's scales on
`Topology.gpu_hosts()`, in a child process given ``--timeout`` seconds, so that a size the planner cannot yet
handle prints "over N s" instead of stalling the table. Then, as a planner does before it hands the program out, it
takes the program's id (the hash of its canonical JSON), its estimate, its JSON text (`Program.dumps`, which holds
the estimate) and validates it, each timed on its own. Prints the table; writes nothing.

    python bench/moe_plan.py [--layers 2 8 61] [--experts 384] [--timeout 120] [--profile LAYERS]

``--profile L`` runs one size in this process under cProfile and prints the 25 most expensive functions by
their own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reshard import Mesh, Topology, plan_many  # noqa: E402
from reshard.moe import KIMI_K2, moe_state_dict  # noqa: E402

TRAIN = Mesh.grid({"host": 32, "gpu": 8}, 8, "train")
SERVE = Mesh.grid({"host": 16, "gpu": 8}, 8, "serve")
EP_DEVICES = 16


def build(layers: int, experts: int):
    config = replace(KIMI_K2, num_layers=layers, num_dense_layers=min(KIMI_K2.num_dense_layers, layers),
                     num_experts=experts)
    return moe_state_dict(config, TRAIN, SERVE, ep_devices=EP_DEVICES)


def measure(layers: int, experts: int) -> dict:
    """Build and plan one size; what it took."""
    t0 = time.perf_counter()
    case = build(layers, experts)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    program = plan_many(case.tensors, Topology.gpu_hosts(), scales=case.scales)
    planned = time.perf_counter() - t0
    seconds = {}
    for what, work in (("id", lambda: program.id), ("estimate", lambda: program.estimate_seconds),
                       ("dumps", program.dumps), ("validate", program.validate)):
        t0 = time.perf_counter()
        work()
        seconds[what] = time.perf_counter() - t0
    return {"tensors": len(case.tensors), "steps": len(program.steps), "buckets": len(program.buckets),
            "build": built, "plan": planned, **seconds, "text_mib": len(program.dumps()) / 2**20,
            "program_id": program.id[:12], "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def row(layers: int, experts: int, timeout: float) -> list[str]:
    try:
        child = subprocess.run([sys.executable, __file__, "--child", str(layers), str(experts)], capture_output=True,
                               text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return [str(layers), str(experts), "", "", "", "", f"over {timeout:g}", "", "", "", "", "", "", ""]
    m = json.loads(child.stdout.splitlines()[-1])
    return [str(layers), str(experts), f"{m['tensors']:,}", f"{m['steps']:,}", f"{m['buckets']:,}",
            f"{m['build']:.2f}", f"{m['plan']:.2f}", f"{m['id']:.2f}", f"{m['estimate']:.2f}", f"{m['dumps']:.2f}",
            f"{m['validate']:.2f}", f"{m['text_mib']:,.0f}", f"{m['rss_mib']:,.0f}", m["program_id"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 61])
    parser.add_argument("--experts", type=int, nargs="+", default=[KIMI_K2.num_experts])
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a size may take")
    parser.add_argument("--profile", type=int, metavar="LAYERS", help="profile one size here instead")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    if args.profile:
        case = build(args.profile, args.experts[0])
        profiler = cProfile.Profile()
        profiler.enable()
        plan_many(case.tensors, Topology.gpu_hosts(), scales=case.scales)
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
        return
    head = ["layers", "experts", "tensors", "steps", "buckets", "build s", "plan_many s", "id s", "estimate s",
            "dumps s", "validate s", "text MiB", "peak RSS MiB", "id"]
    rows = []
    for layers in args.layers:
        for experts in args.experts:
            rows.append(row(layers, experts, args.timeout))
            print(" | ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, ["-" * w for w in widths], *rows]:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
