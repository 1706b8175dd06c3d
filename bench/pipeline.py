"""Pipeline training across meshes (issue 14): 1F1B against eager-1F1B on emulated hosts, measured and predicted.

A 4-stage MLP (one ``width x width`` Dense layer per stage, relu on all but the last) on `reshard lab`'s
emulated hosts, one host and one device per stage, links shaped to ``--gbps`` (1 Gbit/s by default; see
below): each step runs ``m``
microbatches of ``rows`` rows through `reshard.client.pipeline.Pipeline` and applies SGD. The two schedules
train their own copies of the model, steps interleaved (1F1B, eager, 1F1B, ...) so the shared machine's load
falls on both alike; the first step of each is untimed.

Reported: the median step time of each, the measured gain (1F1B's time over eager's), and the gain
``reshard.schedule.simulate`` predicts for the forward, backward and transfer times this run measured
(per stage the median forward and backward spans, per boundary the median of its activation and gradient
transfers, from issue to arrival), beside the planner's estimate of a boundary reshard; the peak activation
bytes each stage held; and per stage where the time went (compute, waiting for an input, idle).

Sizes: the four emulated hosts share this machine's two cores, so a boundary transfer as long as a forward must
come from activations that are large in bytes but cheap to compute. At 1 Gbit/s, 8192 rows of width 256 make
8 MiB activations (67 ms on the link) for a 256x256 layer whose matmul is about 1 GFLOP. A wider layer at the
same link rate (``--rows 4096 --width 512``) asks four stages at once for more compute than two cores have:
every stage's ops slow down together, the step is bound by the CPU rather than by the pipeline's bubbles, and no
order of ops can gain (measured: 0.73x against 1.11x predicted). ``--gbps 0.25 --rows 2048`` is the same
balance at a quarter of the bytes.

    python bench/pipeline.py                   # root: builds the lab; a few minutes on 2 cores
    python bench/pipeline.py --quick --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20
STAGES = 4
KINDS = ("1f1b", "eager-1f1b")
GOAL_WITHIN, GOAL_GAIN, GOAL_GAIN_WHEN = 0.15, 1.2, 1.3


def _where(timeline, i: int) -> dict[str, float]:
    compute = sum(timeline.seconds(i, op) for op in ("F", "B", "update"))
    wait = timeline.seconds(i, "wait")
    return {"compute": compute, "wait": wait, "idle": max(0.0, timeline.iteration_s - compute - wait)}


def _transfer_alone(c, meshes, rows: int, width: int, runs: int = 5) -> float:
    """Median seconds of one boundary activation's reshard between stage 0's and stage 1's hosts with nothing else
    running (after one untimed): what a transfer costs before the pipeline's transfers share links and cores."""
    from reshard import Sharding

    name = "alone.activation"
    c.put(name, np.ones((rows, width), np.float32), Sharding(meshes[0], (None, None)))
    times = []
    for i in range(runs + 1):
        t0 = time.monotonic()
        c.reshard(name, Sharding(meshes[(i + 1) % 2], (None, None))).result(timeout=600)
        if i:
            times.append(time.monotonic() - t0)
    c.delete(name)
    return statistics.median(times)


def run(gbps: float, rows: int, width: int, microbatches: int, steps: int, transport: str) -> dict:
    """Measured and predicted figures, or ``{"skipped": why}`` without the lab."""
    from reshard import Mesh, Sharding, schedule
    from reshard.schedule import Timeline
    from reshard.client.pipeline import Dense, Pipeline, Stage
    from reshard.server.devtools.lab import Lab, LabConfig, lab_available, start_cluster

    ok, why = lab_available()
    if not ok:
        return {"skipped": why}
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(STAGES)]
    batches = [([rng.standard_normal((rows, width)).astype(np.float32) for _ in range(microbatches)],
                [np.eye(width, dtype=np.float32)[rng.integers(0, width, rows)] for _ in range(microbatches)])
               for _ in range(steps + 1)]
    with Lab(LabConfig(num_hosts=STAGES, devices_per_host=1, gbps=gbps)) as emulated:
        address = start_cluster(emulated, extra_agent_args=["--transport", transport])
        hosts = [emulated.host_name(i) for i in range(STAGES)]
        with emulated.connect(address) as c:
            deadline = time.monotonic() + 60
            while {a["host"] for a in c.agents() if a["up"]} != set(hosts):
                if time.monotonic() > deadline:
                    raise RuntimeError("the lab's agents did not register within 60 s")
                time.sleep(0.1)
            meshes = [Mesh.from_hosts({"x": 1}, [h], 1) for h in hosts]
            alone = _transfer_alone(c, meshes, rows, width)
            pipes = {}
            for kind in KINDS:
                prefix = kind.replace("-", "_")
                stages = []
                for i, mesh in enumerate(meshes):
                    c.put(f"{prefix}.w{i}", weights[i], Sharding(mesh, (None, None)))
                    stages.append(Stage([Dense(f"{prefix}.w{i}", relu=i < STAGES - 1)], Sharding(mesh, (None, None))))
                pipes[kind] = Pipeline(c, stages, lr=0.1, prefix=prefix, timeout_s=600)
            results = {kind: [] for kind in KINDS}
            for step, (xs, ys) in enumerate(batches):
                for kind in KINDS:
                    result = pipes[kind].step(kind, xs, ys)
                    print(f"step {step} {kind}: {result.timeline.iteration_s:.3f}s loss {result.loss:.5f}"
                          f"{' (untimed)' if step == 0 else ''}", flush=True)
                    if step:
                        results[kind].append(result)
            estimates = pipes["1f1b"].transfer_estimates(rows)
    # One timeline holding every timed step's ops, so the medians are over all of them.
    pooled = Timeline("1f1b", STAGES, microbatches, 0.0, (0,) * STAGES,
                      tuple(s for kind in KINDS for r in results[kind] for s in r.timeline.spans))
    fwd, bwd, xfer = schedule.median_times(pooled)
    predicted = {kind: schedule.simulate(kind, STAGES, microbatches, fwd, bwd, xfer) for kind in KINDS}
    # Each schedule with its own steps' times: whether the simulator holds for each, and how much longer the same
    # ops take when more stages run at once.
    own = {}
    for kind in KINDS:
        alone_kind = Timeline(kind, STAGES, microbatches, 0.0, (0,) * STAGES,
                              tuple(s for r in results[kind] for s in r.timeline.spans))
        f, b, x = schedule.median_times(alone_kind)
        own[kind] = {"forward_s": f, "backward_s": b, "transfer_s": x,
                     "predicted_s": schedule.simulate(kind, STAGES, microbatches, f, b, x).iteration_s}
    step_s = {kind: statistics.median(r.timeline.iteration_s for r in results[kind]) for kind in KINDS}
    typical = {kind: min(results[kind], key=lambda r: abs(r.timeline.iteration_s - step_s[kind])) for kind in KINDS}
    return {
        "step_s": step_s, "transfer_alone_s": alone, "forward_s": fwd, "backward_s": bwd, "transfer_s": xfer, "estimate_s": list(estimates),
        "predicted_s": {kind: p.iteration_s for kind, p in predicted.items()}, "own": own,
        "peak_bytes": {kind: list(typical[kind].peak_activation_bytes) for kind in KINDS},
        "peak": {kind: list(typical[kind].timeline.peak_activations) for kind in KINDS},
        "where": {kind: [_where(typical[kind].timeline, i) for i in range(STAGES)] for kind in KINDS},
        "timelines": {kind: typical[kind].timeline.to_json() for kind in KINDS},
        "losses": {kind: [r.loss for r in results[kind]] for kind in KINDS},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer, smaller microbatches: a smoke run")
    p.add_argument("--gbps", type=float, default=1.0, help="every emulated host link's rate, each way")
    p.add_argument("--rows", type=int, default=None, help="rows per microbatch (default 8192, quick 512)")
    p.add_argument("--width", type=int, default=256, help="every layer's input and output width")
    p.add_argument("--microbatches", type=int, default=None, help="m (default 8, quick 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per schedule after one untimed (default 3)")
    p.add_argument("--transport", choices=("grpc", "collective"), default="collective",
                   help="the agents' transport (collective: what agents pick by default where torch is installed)")
    p.add_argument("--timelines", type=Path, default=None,
                   help="also write each schedule's typical step timeline as JSON here (the dashboard's "
                        "pipeline page draws it)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    rows = args.rows or (512 if args.quick else 8192)
    m = args.microbatches or (4 if args.quick else 8)
    steps = args.steps or (1 if args.quick else 3)
    r = run(args.gbps, rows, args.width, m, steps, args.transport)
    if "skipped" in r:
        print(f"skipped: {r['skipped']}")
        return 0
    if args.timelines:
        args.timelines.write_text(json.dumps(r["timelines"], indent=1))

    def verdict(ok: bool) -> str:
        return "yes" if ok else "**no**"

    gain = r["step_s"]["1f1b"] / r["step_s"]["eager-1f1b"]
    predicted = r["predicted_s"]["1f1b"] / r["predicted_s"]["eager-1f1b"]
    within = abs(gain - predicted) / predicted
    act = rows * args.width * 4
    lines = [
        f"A {STAGES}-stage MLP (one {args.width}x{args.width} float32 Dense layer per stage) on `reshard lab`: "
        f"{STAGES} emulated hosts x 1 device, one stage each, links shaped to {args.gbps:g} Gbit/s each way, "
        f"agents on the {args.transport} transport. m = {m} microbatches of {rows} rows (a boundary activation "
        f"is {act / MiB:.1f} MiB); median of {steps} steps per schedule, interleaved, after one untimed each. "
        f"The {STAGES} hosts share this machine's cores.",
        "",
        "| schedule | step (s) | simulated (s) | peak activations per stage | peak activation MiB per stage |",
        "|---|---:|---:|---|---|",
    ]
    for kind in KINDS:
        lines.append(f"| {kind} | {r['step_s'][kind]:.3f} | {r['predicted_s'][kind]:.3f} | "
                     f"{', '.join(map(str, r['peak'][kind]))} | "
                     f"{', '.join(f'{b / MiB:.1f}' for b in r['peak_bytes'][kind])} |")
    lines += [
        "",
        f"- Measured gain of eager-1F1B over 1F1B: **{gain:.2f}x**; the simulator predicts **{predicted:.2f}x** "
        f"for the measured times ({within:.0%} apart; goal within {GOAL_WITHIN:.0%}: {verdict(within <= GOAL_WITHIN)}"
        + (f"; goal at least {GOAL_GAIN:g}x as the prediction is {GOAL_GAIN_WHEN:g}x or more: "
           f"{verdict(gain >= GOAL_GAIN)}" if predicted >= GOAL_GAIN_WHEN else "") + ").",
        f"- Measured per stage, median seconds: forward {', '.join(f'{v:.3f}' for v in r['forward_s'])}; "
        f"backward {', '.join(f'{v:.3f}' for v in r['backward_s'])}. Per boundary, a transfer from issue to "
        f"arrival: {', '.join(f'{v:.3f}' for v in r['transfer_s'])} (the planner estimates "
        f"{', '.join(f'{v:.3f}' for v in r['estimate_s'])} for the reshard alone; one such reshard between stage 0's "
        f"and stage 1's hosts with nothing else running takes {r['transfer_alone_s']:.3f}, as a job, median of 5). "
        f"The simulator lets transfers overlap one another; on a link, a boundary's transfers queue.",
    ]
    own = r["own"]

    def longer(what: str) -> str:
        a, b = sum(own["1f1b"][what]), sum(own["eager-1f1b"][what])
        return f"{b / a - 1:+.0%}"

    lines += [
        "- Each schedule simulated with its own steps' median times: "
        + ", ".join(f"{kind} {own[kind]['predicted_s']:.3f} s (measured {r['step_s'][kind]:.3f} s)" for kind in KINDS)
        + f". Under eager-1F1B the same ops took longer than under 1F1B: forwards {longer('forward_s')}, "
        f"backwards {longer('backward_s')}, transfers {longer('transfer_s')} (sums over stages and boundaries), "
        f"as more stages compute at once on this machine's {os.cpu_count()} cores (below); the simulation above "
        f"takes both schedules' steps together.",
        "- Where each stage's time went in a typical step (compute / waiting for an input / idle, seconds):",
    ]
    for kind in KINDS:
        parts = "; ".join(f"stage {i}: {w['compute']:.2f} / {w['wait']:.2f} / {w['idle']:.2f}"
                          for i, w in enumerate(r["where"][kind]))
        busy = sum(w["compute"] for w in r["where"][kind]) / r["timelines"][kind]["iteration_s"]
        lines.append(f"  - {kind}: {parts}; stages computing at once, on average: {busy:.2f} (this machine has "
                     f"{os.cpu_count()} cores, shared with the planner, the transfers and other users)")
    lines += [
        "",
        f"Reproduce: `python bench/pipeline.py{' --quick' if args.quick else ''} --gbps {args.gbps:g} --rows {rows} "
        f"--width {args.width} --microbatches {m} --steps {steps} --transport {args.transport}` (root).",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        from _report import write_section

        write_section("pipeline", "Pipeline training across meshes: 1F1B against eager-1F1B", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
