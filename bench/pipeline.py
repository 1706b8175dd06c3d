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

Checked at every step, untimed ones included, so a schedule that did less work cannot show as a gain: each stage
ran the forward and the backward of every microbatch once, in its schedule's order (its timeline's spans
against ``reshard.schedule.build``), and both schedules' losses agree to within ``LOSS_RTOL``; they run the same
ops on the same data and sum gradients in microbatch order, so the two models stay equal.

Devices: the four emulated hosts share this machine's two cores. Their links are shaped to a NIC's rate, and
their devices are emulated the same way (``reshard lab --device-gflops``, `reshard.server.agent.pace`): a kernel
runs at this machine's speed, then its step waits out the time a device of that rate would take, one step at a
time per device. The default rate makes a forward's matmul take as long as its activation on the link (width x
Gbit/s / 16 GFLOP/s: 16 at width 256 and 1 Gbit/s), the balance the issue asks for. Without emulation
(``--device-gflops 0``, also run and reported for reference), four stages that compute at once fight for two
cores: a schedule that keeps more stages busy (eager-1F1B) makes every kernel slower, which hosts with devices of
their own would not see, and the measured gain falls short of the prediction for that reason (the report says by
how much the same ops slowed down).

Sizes: at 1 Gbit/s, 8192 rows of width 256 make 8 MiB activations (67 ms on the link) for a 256x256 layer whose
matmul is about 1 GFLOP (67 ms at the emulated 16 GFLOP/s, a few ms of this machine's cores).

    python bench/pipeline.py                   # root: builds the lab twice; a few minutes on 2 cores
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
# The schedules' losses per step may differ by this much, relative: a few float32 roundings, should a kernel sum in
# another order (the arithmetic is otherwise the same, so they are equal to the bit); a skipped microbatch or
# gradient moves a loss by far more.
LOSS_RTOL = 8 * float(np.finfo(np.float32).eps)


def _where(timeline, i: int) -> dict[str, float]:
    compute = sum(timeline.seconds(i, op) for op in ("F", "B", "update"))
    wait = timeline.seconds(i, "wait")
    return {"compute": compute, "wait": wait, "idle": max(0.0, timeline.iteration_s - compute - wait)}


def _check_ran(kind: str, step: int, timeline, microbatches: int) -> None:
    """Every stage ran the forward and the backward of each microbatch once, in ``kind``'s order."""
    from reshard import schedule

    due = schedule.build(kind, STAGES, microbatches)
    for i in range(STAGES):
        spans = sorted((s for s in timeline.spans if s.stage == i and s.op in (schedule.FORWARD, schedule.BACKWARD)),
                       key=lambda s: s.start_s)
        for op in (schedule.FORWARD, schedule.BACKWARD):
            ran = sorted(s.microbatch for s in spans if s.op == op)
            if ran != list(range(microbatches)):
                raise AssertionError(f"{kind} step {step}: stage {i} ran {op} of microbatches {ran}; each of "
                                     f"0..{microbatches - 1} once was due")
        order = [(s.op, s.microbatch) for s in spans]
        if order != due[i]:
            raise AssertionError(f"{kind} step {step}: stage {i} ran {order}, not {kind}'s order {due[i]}")


def _check_losses(step: int, losses: dict[str, float]) -> None:
    """Both schedules trained the model to the same loss at ``step``."""
    base, other = KINDS
    a, b = losses[base], losses[other]
    if not abs(a - b) <= LOSS_RTOL * abs(a):
        raise AssertionError(f"step {step}: {other}'s loss {b!r} differs from {base}'s {a!r} by {b - a:.3g} (more "
                             f"than {LOSS_RTOL:.2g} relative): the two schedules did not do the same work")


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


def auto_gflops(width: int, gbps: float) -> float:
    """The device rate at which a ``width x width`` layer's matmul takes as long as its activation on the link:
    ``2 rows width^2`` FLOPs against ``4 rows width`` bytes at ``gbps``."""
    return width * gbps / 16


def run(gbps: float, rows: int, width: int, microbatches: int, steps: int, transport: str,
        device_gflops: float) -> dict:
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
    with Lab(LabConfig(num_hosts=STAGES, devices_per_host=1, gbps=gbps, device_gflops=device_gflops)) as emulated:
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
                losses = {}
                for kind in KINDS:
                    result = pipes[kind].step(kind, xs, ys)
                    print(f"step {step} {kind}{' (native kernels)' if not device_gflops else ''}: "
                          f"{result.timeline.iteration_s:.3f}s loss {result.loss:.5f}"
                          f"{' (untimed)' if step == 0 else ''}", flush=True)
                    _check_ran(kind, step, result.timeline, microbatches)
                    losses[kind] = result.loss
                    if step:
                        results[kind].append(result)
                _check_losses(step, losses)
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
        "step_s": step_s, "transfer_alone_s": alone, "forward_s": fwd, "backward_s": bwd, "transfer_s": xfer,
        "estimate_s": list(estimates),
        "predicted_s": {kind: p.iteration_s for kind, p in predicted.items()}, "own": own,
        "peak_bytes": {kind: list(typical[kind].peak_activation_bytes) for kind in KINDS},
        "peak": {kind: list(typical[kind].timeline.peak_activations) for kind in KINDS},
        "where": {kind: [_where(typical[kind].timeline, i) for i in range(STAGES)] for kind in KINDS},
        "timelines": {kind: typical[kind].timeline.to_json() for kind in KINDS},
        "losses": {kind: [r.loss for r in results[kind]] for kind in KINDS},
    }


def _gains(r: dict) -> tuple[float, float, float]:
    """The measured gain, the predicted one, and how far apart they are (relative to the prediction)."""
    gain = r["step_s"]["1f1b"] / r["step_s"]["eager-1f1b"]
    predicted = r["predicted_s"]["1f1b"] / r["predicted_s"]["eager-1f1b"]
    return gain, predicted, abs(gain - predicted) / predicted


def _verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _slower(r: dict) -> str:
    """How much longer the same ops took under eager-1F1B than under 1F1B."""
    own = r["own"]

    def longer(what: str) -> str:
        a, b = sum(own["1f1b"][what]), sum(own["eager-1f1b"][what])
        return f"{b / a - 1:+.0%}"

    return f"forwards {longer('forward_s')}, backwards {longer('backward_s')}, transfers {longer('transfer_s')}"


def _busy(r: dict, kind: str) -> float:
    return sum(w["compute"] for w in r["where"][kind]) / r["timelines"][kind]["iteration_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer, smaller microbatches, no native run: a smoke run")
    p.add_argument("--gbps", type=float, default=1.0, help="every emulated host link's rate, each way")
    p.add_argument("--rows", type=int, default=None, help="rows per microbatch (default 8192, quick 512)")
    p.add_argument("--width", type=int, default=256, help="every layer's input and output width")
    p.add_argument("--microbatches", type=int, default=None, help="m (default 16, quick 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per schedule after one untimed (default 3)")
    p.add_argument("--transport", choices=("grpc", "collective"), default="collective",
                   help="the agents' transport (collective: what agents pick by default where torch is installed)")
    p.add_argument("--device-gflops", type=float, default=None,
                   help="the emulated devices' float32 rate (default: a forward's matmul as long as its activation "
                        "on the link, width x gbps / 16); 0: kernels at this machine's speed only")
    p.add_argument("--timelines", type=Path, default=None,
                   help="also write each schedule's typical step timeline as JSON here (the dashboard's "
                        "pipeline page draws it)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    rows = args.rows or (512 if args.quick else 8192)
    m = args.microbatches or (4 if args.quick else 16)
    steps = args.steps or (1 if args.quick else 3)
    gflops = auto_gflops(args.width, args.gbps) if args.device_gflops is None else args.device_gflops
    r = run(args.gbps, rows, args.width, m, steps, args.transport, gflops)
    if "skipped" in r:
        print(f"skipped: {r['skipped']}")
        return 0
    # For reference: the same pipeline with kernels at this machine's speed, the four hosts sharing its cores.
    native = run(args.gbps, rows, args.width, m, steps, args.transport, 0.0) if gflops and not args.quick else None
    if args.timelines:
        args.timelines.write_text(json.dumps(r["timelines"], indent=1))

    gain, predicted, within = _gains(r)
    act = rows * args.width * 4
    devices = (f"devices emulated at {gflops:g} GFLOP/s (a forward's {2 * rows * args.width ** 2 / 1e9:.2f} GFLOP "
               f"matmul: {2 * rows * args.width ** 2 / (gflops * 1e9):.3f} s)" if gflops
               else "kernels at this machine's speed")
    lines = [
        f"A {STAGES}-stage MLP (one {args.width}x{args.width} float32 Dense layer per stage) on `reshard lab`: "
        f"{STAGES} emulated hosts x 1 device, one stage each, links shaped to {args.gbps:g} Gbit/s each way, "
        f"{devices}, agents on the {args.transport} transport. m = {m} microbatches of {rows} rows (a boundary "
        f"activation is {act / MiB:.1f} MiB, {act * 8 / (args.gbps * 1e9):.3f} s on the link); median of {steps} "
        f"steps per schedule, interleaved, after one untimed each. The {STAGES} hosts share this machine's "
        f"{os.cpu_count()} cores. At every step, untimed ones included, each stage ran the forward and the "
        f"backward of each microbatch once, in its schedule's order, and the two schedules' losses agreed (to "
        f"{LOSS_RTOL:.1g} relative), so both did the same work.",
        "",
        "| schedule | step (s) | simulated (s) | peak activations per stage | peak activation MiB per stage |",
        "|---|---:|---:|---|---|",
    ]
    for kind in KINDS:
        lines.append(f"| {kind} | {r['step_s'][kind]:.3f} | {r['predicted_s'][kind]:.3f} | "
                     f"{', '.join(map(str, r['peak'][kind]))} | "
                     f"{', '.join(f'{b / MiB:.1f}' for b in r['peak_bytes'][kind])} |")
    own = r["own"]
    lines += [
        "",
        f"- Measured gain of eager-1F1B over 1F1B: **{gain:.2f}x**; the simulator predicts **{predicted:.2f}x** "
        f"for the measured times ({within:.0%} apart; goal within {GOAL_WITHIN:.0%}: {_verdict(within <= GOAL_WITHIN)}"
        + (f"; goal at least {GOAL_GAIN:g}x as the prediction is {GOAL_GAIN_WHEN:g}x or more: "
           f"{_verdict(gain >= GOAL_GAIN)}" if predicted >= GOAL_GAIN_WHEN else "") + ").",
        f"- Measured per stage, median seconds: forward {', '.join(f'{v:.3f}' for v in r['forward_s'])}; "
        f"backward {', '.join(f'{v:.3f}' for v in r['backward_s'])}. Per boundary, a transfer from issue to "
        f"arrival: {', '.join(f'{v:.3f}' for v in r['transfer_s'])} (the planner estimates "
        f"{', '.join(f'{v:.3f}' for v in r['estimate_s'])} for the reshard alone; one such reshard between stage 0's "
        f"and stage 1's hosts with nothing else running takes {r['transfer_alone_s']:.3f}, as a job, median of 5). "
        f"The simulator lets transfers overlap one another; on a link, a boundary's transfers queue.",
        "- Each schedule simulated with its own steps' median times: "
        + ", ".join(f"{kind} {own[kind]['predicted_s']:.3f} s (measured {r['step_s'][kind]:.3f} s)" for kind in KINDS)
        + f". Under eager-1F1B the same ops took longer than under 1F1B: {_slower(r)} (sums over stages and "
        f"boundaries); the simulation above takes both schedules' steps together.",
        "- Where each stage's time went in a typical step (compute / waiting for an input / idle, seconds):",
    ]
    for kind in KINDS:
        parts = "; ".join(f"stage {i}: {w['compute']:.2f} / {w['wait']:.2f} / {w['idle']:.2f}"
                          for i, w in enumerate(r["where"][kind]))
        lines.append(f"  - {kind}: {parts}; stages computing at once, on average: {_busy(r, kind):.2f}")
    if native is not None:
        n_gain, n_predicted, n_within = _gains(native)
        lines += [
            f"- For reference, the same run with kernels at this machine's speed (no device emulation): 1F1B "
            f"{native['step_s']['1f1b']:.3f} s, eager-1F1B {native['step_s']['eager-1f1b']:.3f} s, a gain of "
            f"{n_gain:.2f}x against {n_predicted:.2f}x predicted ({n_within:.0%} apart). Forwards took "
            f"{', '.join(f'{v:.3f}' for v in native['forward_s'])} s per stage; stages computing at once, on "
            f"average: {_busy(native, '1f1b'):.2f} under 1F1B, {_busy(native, 'eager-1f1b'):.2f} under eager-1F1B, "
            f"on {os.cpu_count()} cores shared with the planner and the transfers, and under eager-1F1B the same ops "
            f"took longer: {_slower(native)}, a slowdown that hosts with devices of their own would not see.",
        ]
    lines += [
        "",
        f"Reproduce: `python bench/pipeline.py{' --quick' if args.quick else ''} --gbps {args.gbps:g} --rows {rows} "
        f"--width {args.width} --microbatches {m} --steps {steps} --transport {args.transport}"
        f"{'' if args.device_gflops is None else f' --device-gflops {args.device_gflops:g}'}` (root).",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        from _report import write_section

        write_section("pipeline", "Pipeline training across meshes: 1F1B against eager-1F1B", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
