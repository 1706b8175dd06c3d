"""Plan quality on the paper's suites, and planning time at scale.

For the N-to-M cases 1-7 and 9 (2 GiB int32) and the 1-to-M suite (1 GiB to 1x1
... 8x4 receivers) on 10 Gbit/s NICs: every strategy's estimate, the lower bound,
their ratio and the effective bandwidth. Then the time to plan an (8192, 8192)
float32 reshard between two disjoint 128x8 meshes, a million-piece all-to-all
over 1024 devices, and a 1,001-tensor transformer state dict between two
1,024-device meshes (training tensor-parallel 8 on 128 hosts, inference
tensor-parallel 4 with two replicas a host on 128 others): each tensor planned by
`reshard.plan` against one shared `Loads`, and the whole by `reshard.plan_many`
(in a child process, given ``--many-timeout`` seconds; the median of three runs), then that program's
`Program.validate`, which a planner runs before any agent sees a program. Then issue 41's trillion-parameter rows
(`moe_rows`): a Kimi-K2-like state dict (`reshard.moe`) from 256 training GPUs to 128 serving GPUs on
`Topology.gpu_hosts()`, planned from scratch in a child process under a time limit and a memory cap, at the full 61
layers and, where that does not finish, at the largest of ``--moe-layers`` that does; beside it the records measured
elsewhere. Prints the tables and writes BENCHMARKS.md.

    python bench/plan_quality.py [--no-write] [--skip-million] [--skip-state-dict] [--many-timeout 120]
                                 [--skip-moe] [--moe-layers 61 16 4] [--moe-timeout 300] [--moe-memory-gib 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _program_parts import many_lower_bound  # noqa: E402
from _report import write_section  # noqa: E402

from reshard import Mesh, Sharding, Topology, plan  # noqa: E402
from reshard.cases import n_to_m_cases, one_to_m_cases, overlap_cases  # noqa: E402
from reshard.program import TensorDecl  # noqa: E402
from reshard.report import compare_strategies, format_rows  # noqa: E402
from reshard.strategies import Loads  # noqa: E402

# The state dict: bench/buckets.py's layout at 1,024 devices a side.
TRAIN = Mesh.grid({"dp": 128, "tp": 8}, 8, "train")
INFER = Mesh.grid({"dp": 256, "tp": 4}, 8, "infer")
LAYERS, HIDDEN = 100, 4096
PLAN_MANY_RUNS = 3  # the state dict's plan_many, timed this many times in one process: the median counts


def _timed_plan(shape, src, dst, repeats: int) -> tuple[float, float, object]:
    best = float("inf")
    result = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = plan(shape, "float32", src, dst)
        best = min(best, time.perf_counter() - t0)
    t0 = time.perf_counter()
    result.validate()
    return best, time.perf_counter() - t0, result


def scale_rows(skip_million: bool) -> list[list[str]]:
    a = Mesh.grid({"x": 128, "y": 8}, 8, "a")
    b = Mesh.grid({"x": 128, "y": 8}, 8, "b")
    cases = [("128x8 -> 128x8, P('x','y') -> P('y','x')", Sharding(a, ("x", "y")), Sharding(b, ("y", "x")), 3)]
    if not skip_million:
        cases.append(("all-to-all, dim0 over 1024 -> dim1 over 1024",
                      Sharding(a, (("x", "y"), None)), Sharding(b, (None, ("x", "y"))), 3))
    rows = []
    for name, src, dst, repeats in cases:
        secs, vsecs, p = _timed_plan((8192, 8192), src, dst, repeats)
        rows.append([name, f"{len(p.unit_tasks)}", f"{p.num_transfers}", f"{secs:.2f}", f"{vsecs:.2f}",
                     f"{p.estimate_seconds / p.lower_bound_seconds:.3f}"])
        print(f"planned {name}: {len(p.unit_tasks)} unit tasks in {secs:.2f}s (validate {vsecs:.2f}s)", flush=True)
    return rows


def state_dict(layers: int = LAYERS, hidden: int = HIDDEN) -> list[TensorDecl]:
    """A transformer's tensors, rows or columns split over tp, norms and some biases whole: training -> inference."""
    rows, cols, whole = ("tp", None), (None, "tp"), (None,)
    out = []

    def add(name, shape, dtype, spec):
        out.append(TensorDecl(name, shape, dtype, Sharding(TRAIN, spec), Sharding(INFER, spec)))

    add("embed", (32000, hidden), "bfloat16", rows)
    for i in range(layers):
        p = f"layers.{i}."
        add(p + "attn_norm", (hidden,), "float32", whole)
        add(p + "mlp_norm", (hidden,), "float32", whole)
        add(p + "qkv", (3 * hidden, hidden), "bfloat16", rows)
        add(p + "qkv_bias", (3 * hidden,), "bfloat16", ("tp",))
        add(p + "out", (hidden, hidden), "bfloat16", cols)
        add(p + "out_bias", (hidden,), "bfloat16", whole)
        add(p + "up", (4 * hidden, hidden), "float8_e4m3fn", rows)
        add(p + "up_bias", (4 * hidden,), "bfloat16", ("tp",))
        add(p + "down", (hidden, 4 * hidden), "float8_e4m3fn", cols)
        add(p + "down_bias", (hidden,), "bfloat16", whole)
    return out


def state_dict_rows(many_timeout: float) -> tuple[list[list[str]], str]:
    """The rows, and what the plan_many program's steps are (chains over several hosts, or moves to one host)."""
    tensors = state_dict()
    loads = Loads(Topology())
    t0 = time.perf_counter()
    plans = [plan(t.shape, t.dtype, t.src, t.dst, loads=loads) for t in tensors]
    secs = time.perf_counter() - t0
    transfers = sum(p.num_transfers for p in plans)
    tasks = sum(len(p.unit_tasks) for p in plans)
    name = f"{len(tensors)} tensors, 128x8 tp8 -> 128x8 tp4 x 2 replicas"
    print(f"planned {name}: {tasks} unit tasks in {secs:.2f}s with reshard.plan and one Loads", flush=True)
    rows = [[f"{name}: `reshard.plan` each, one `Loads`", f"{tasks}", f"{transfers}", f"{secs:.2f}"]]
    note = ""
    try:
        child = subprocess.run([sys.executable, __file__, "--plan-many-child"], capture_output=True, text=True,
                               timeout=many_timeout, check=True)
        many = json.loads(child.stdout.splitlines()[-1])
        rows.append([f"{name}: `reshard.plan_many` (median of {len(many['runs'])} in one process)", "",
                     f"{many['steps']}", f"{many['seconds']:.2f}"])
        rows.append([f"{name}: `Program.validate` of that program, once", "", f"{many['steps']}",
                     f"{many['validate']:.2f}"])
        note = (f"{many['chains']:,} of the program's {many['steps']:,} steps are chains over several hosts, the "
                f"rest moves to one host each (a star's legs, point-to-point): a box its sender moves in under 50 us "
                f"goes as one chain wherever a chain keeps the busiest NIC where a star would "
                f"(`reshard.strategies.STEP_S`), the rest as the NIC loads choose. ")
    except subprocess.TimeoutExpired:
        rows.append([f"{name}: `reshard.plan_many`", "", "", f"over {many_timeout:g}"])
    print(f"plan_many: {rows[1][-1]}s" + (f", validate: {rows[2][-1]}s" if len(rows) > 2 else ""), flush=True)
    return rows, note


def _refusal(decls: list[TensorDecl]) -> str:
    """What a planner with its default ``--max-plan-tasks`` says of one reshard_many of ``decls`` before planning
    (the planner's own rule: its distinct layouts' planning work, `layouts_plan_size`)."""
    from reshard.plan_size import excess_text, layouts_plan_size
    from reshard.server.common.config import PlannerConfig

    limit = PlannerConfig.max_plan_tasks
    over = layouts_plan_size(decls).excess(limit, "auto")
    if not over:
        return f"A planner with the default `--max-plan-tasks` ({limit:,}) takes it as one job"
    return (f"A planner with the default `--max-plan-tasks` ({limit:,}) refuses it as one job ({excess_text(over)}), "
            f"so in a service it runs as several `reshard_many` jobs of fewer tensors each")


def _one_job(refusal: str, full: dict, quantized: list[dict]) -> tuple[str, str]:
    """The verdict on one atomic job, and why: the planner takes the request (`_refusal`), and the program it makes
    holds no more steps than its default ``--max-program-steps`` and has a text an agent takes in one message."""
    from reshard.server.common.config import AgentConfig, PlannerConfig

    if "refuses" in refusal:
        return "**not met**", refusal + "."
    steps, message = PlannerConfig.max_program_steps, AgentConfig.max_message_bytes / 2**20
    why = [refusal]
    ok = True
    for m in (full, *(q for q in quantized if q.get("layers") == full.get("layers"))):
        what = "quantized on the way" if m.get("quantize") else "without dtypes"
        if "steps" not in m or "slice_mib" not in m:
            why.append(f"the program {what} was not measured to the end ({m.get('over', 'no figures')})")
            ok = ok and not m.get("quantize")
            continue
        fits = m["steps"] <= steps and m["slice_mib"] <= message
        ok = ok and fits
        why.append(f"its program {what} holds {m['steps']:,} steps (the default `--max-program-steps` is {steps:,}) "
                   f"and its largest per-host slice is {m['slice_mib']:.1f} MiB (an agent takes {message:g} MiB in "
                   f"one message)" + ("" if fits else ": too large"))
    return ("met" if ok else "**not met**"), "; ".join(why) + "."


def _plan_many_child() -> int:
    from reshard.many import plan_many

    decls, seconds = state_dict(), []
    for k in range(PLAN_MANY_RUNS):
        t0 = time.perf_counter()
        program = plan_many(decls)
        seconds.append(time.perf_counter() - t0)
        steps = len(program.steps)
        if k < PLAN_MANY_RUNS - 1:
            del program  # freed before the next run, as a planner drops a program it no longer keeps
    t0 = time.perf_counter()
    program.validate()  # what a planner's reshard_many runs next, before any agent sees the program
    checked = time.perf_counter() - t0
    chains = sum(1 for s in program.steps if s.transfer is not None and len(s.transfer.route) > 1)
    print(json.dumps({"seconds": statistics.median(seconds), "runs": seconds, "steps": steps, "validate": checked,
                      "chains": chains}))
    return 0


# -- issue 41: the trillion-parameter rows -----------------------------------------------------------------------

GIB = 2**30
# The records a 1 T weight sync is priced against, as issue 41 quotes them: (who, seconds, how, hardware as stated).
RECORDS = [
    ("Perplexity", 1.3, "one-sided RDMA WRITE, a static schedule computed once",
     "Kimi-K2 from 256 training GPUs (bf16) to 128 inference GPUs (fp8)"),
    ("Awex", 6.0, "RDMA", "not stated in the issue"),
    ("Awex", 20.0, "NCCL", "not stated in the issue"),
    ("miles", 7.2, "P2P RDMA", "not stated in the issue"),
    ("miles", 53.3, "NCCL broadcast", "not stated in the issue"),
    ("checkpoint-engine", 16.0, "broadcast", "Kimi-K2, across thousands of GPUs (its README says about 20 s)"),
]
# Must-show 1's goals: (what, limit, unit).
MOE_GOALS = {"plan": 5.0, "validate": 5.0, "rss_gib": 4.0, "slice_mib": 64.0, "ratio": 1.05}


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _moe_child(layers: int, quantize: bool, cap_gib: float) -> int:
    """Plan, validate and measure the MoE case at ``layers`` layers under an address-space cap of ``cap_gib``; prints
    one JSON line: the figures, or the stage at which the cap ran out."""
    from moe_plan import build

    from reshard.dtypes import itemsize
    from reshard.many import plan_many

    resource.setrlimit(resource.RLIMIT_AS, (int(cap_gib * GIB), int(cap_gib * GIB)))
    out: dict = {"layers": layers, "quantize": quantize}

    def start(what: str) -> str:
        """A JSON line of the figures so far and the stage now under way: a parent that stops this child at its
        timeout still has them."""
        print(json.dumps({**out, "stage": what}), flush=True)
        return what

    stage = "build"
    try:
        t0 = time.perf_counter()
        case = build(layers, KIMI_EXPERTS)
        out["build_s"] = time.perf_counter() - t0
        topo = Topology.gpu_hosts()
        weights = {t.name for t in case.weights}
        dtypes = {k: v for k, v in case.serve_dtypes.items() if k in weights} if quantize else None
        out.update(tensors=len(case.tensors), params=case.num_params, serve_bytes=case.serve_bytes)
        stage = start("plan_many")
        t0 = time.perf_counter()
        program = plan_many(case.tensors, topo, scales=case.scales, dtypes=dtypes)
        out["plan"] = time.perf_counter() - t0
        out.update(steps=len(program.steps), buckets=len(program.buckets), rss_plan_gib=_rss_gib())
        stage = start("validate")
        t0 = time.perf_counter()
        program.validate()
        out["validate"] = time.perf_counter() - t0
        # What a planner does next, before an agent gets the program: its id (what jobs, caches and tickets name),
        # its estimate (which its text carries) and its text, each timed.
        stage = start("the program's id")
        t0 = time.perf_counter()
        program.id
        out["id_s"] = time.perf_counter() - t0
        stage = start("the estimate")
        t0 = time.perf_counter()
        out["estimate"] = program.estimate_seconds
        out["estimate_s"] = time.perf_counter() - t0
        stage = start("the program's text")
        t0 = time.perf_counter()
        out["text_mib"] = len(program.dumps()) / 2**20
        out["dumps"] = time.perf_counter() - t0
        stage = start("the planner's account of the moves")
        from reshard.server.planner.jobs import program_moves

        t0 = time.perf_counter()
        program_moves(program)
        out["moves_s"] = time.perf_counter() - t0
        # The planner's cut of the program per host (`reshard.host_slice`): every host's slice written, as a
        # planner does before the job's first Prepare (`JobRunner._slices`), and kept.
        stage = start("the per-host cut")
        from reshard.host_slice import HostCut

        t0 = time.perf_counter()
        cut = HostCut(program)
        slices = {h: cut.text(h) for h in sorted(cut.hosts)}
        out["cut_s"] = time.perf_counter() - t0
        host = max(slices.items(), key=lambda item: len(item[1]))[0]
        out.update(slice_mib=len(slices[host]) / 2**20, slice_host=host, hosts=len(slices),
                   slices_mib=sum(map(len, slices.values())) / 2**20)
        # What every job of this program costs a planner before its agents start, a repeated sync's included: each
        # host's Prepare (by digest: the agents hold their slices), reading every program tensor at one version.
        stage = start("a job's Prepares")
        from reshard.server.planner.jobs import Preparation, reads_at_of
        from reshard.server.planner.service import GrpcAgentCalls

        calls = GrpcAgentCalls(lambda host: bytes(32))
        names = {h: cut.tensors(h) for h in slices}
        moved = [t.name for t in program.tensors if t.src is not None]
        # the first job hashes each slice once (the ticket signs it); the next find them kept; the last two move
        # every tensor read as a delta from the versions before (a delta sync's bases, beside its reads), the
        # fourth timed: its columns' SHA-256 as kept by the third
        for job in (1, 2, 3, 4):
            # as the planner reads them (`JobRunner._work`): each by its version alone where none is quantized
            reads = {t.name: (t.name, job) for t in program.tensors}
            prep = Preparation(f"bench{job}", "", "", job, job + 1, {h: h for h in slices}, program_id=program.id,
                               reads=reads, host_texts=slices, host_tensors=names,
                               reads_at=reads_at_of(program, moved, [job] * len(moved), quantize),
                               delta_bases={t: (job - 2, job - 1) for t in reads} if job >= 3 else {})
            t0 = time.perf_counter()
            # (the first job carries each host's read columns; a later one names them by their SHA-256)
            sent = sum(len(calls.prepare_request(h, prep, held=True, columns_held=job > 1).SerializeToString())
                       for h in slices)
            out[f"prepares{job}_s"], out[f"prepares{job}_mib"] = time.perf_counter() - t0, sent / 2**20
        out.update(prepares_s=out.pop("prepares2_s"), prepares_mib=out.pop("prepares2_mib"),
                   delta_prepares_s=out.pop("prepares4_s"), delta_prepares_mib=out.pop("prepares4_mib"))
        del calls, prep, names
        # What a planner holds: the program planned, validated, written out and cut (the measures below are the
        # bench's).
        out["rss_gib"] = _rss_gib()
        stage = start("the lower bound")
        wire = {t.name: itemsize(case.serve_dtypes[t.name]) for t in case.tensors} if quantize else None
        out["bound"] = many_lower_bound(case.tensors, topo, wire)
        # What the agent of the host with the largest slice does with it before its first run of the job: read it
        # and work out its own layout (`HostLayout`: its buckets, tasks, streams, tiles).
        stage = start("an agent's reading and layout")
        from reshard.server.agent.programs import HostLayout, load_program

        text = slices[host]
        del program, cut, slices
        t0 = time.perf_counter()
        read, _ = load_program(text, max_bytes=None)
        out["agent_read_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        HostLayout(read, host)
        out["agent_layout_s"] = time.perf_counter() - t0
    except MemoryError:
        out["over_memory"] = stage
    print(json.dumps(out), flush=True)
    return 0


KIMI_EXPERTS = 384


def _moe_run(layers: int, quantize: bool, timeout: float, cap_gib: float) -> dict:
    """One size in a child process: its figures, or why it did not finish (``over``)."""
    what = f"over {timeout:g} s"
    try:
        child = subprocess.run([sys.executable, __file__, "--moe-child", str(layers), str(int(quantize)),
                                str(cap_gib)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        # the figures of the stages that finished, and the one under way
        out = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else (stopped.stdout or "")
        lines = out.strip().splitlines()
        m = json.loads(lines[-1]) if lines else {"layers": layers, "quantize": quantize}
        m["over"] = what + (f" (while {m.pop('stage')})" if "stage" in m else "")
        return m
    lines = child.stdout.strip().splitlines()
    if child.returncode or not lines:
        # numpy's or the allocator's own failure under the cap ends the child without the JSON line
        tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return {"layers": layers, "quantize": quantize,
                "over": f"over {cap_gib:g} GiB of address space (the child ended: {tail})"}
    m = json.loads(lines[-1])
    m.pop("stage", None)
    if "over_memory" in m:
        m["over"] = f"over {cap_gib:g} GiB of address space (while {m['over_memory']})"
    return m


QUANTIZED_LADDER = [61, 4]  # quantized on the way: the sizes tried, largest first


def _ladder(ladder: list[int], quantize: bool, timeout: float, cap_gib: float) -> list[dict]:
    """The sizes of ``ladder``, largest first, until one finishes."""
    runs = []
    for layers in ladder:
        m = _moe_run(layers, quantize, timeout, cap_gib)
        runs.append(m)
        what = "quantized on the way" if quantize else "without dtypes"
        print(f"MoE {layers} layers, {what}: " + (m["over"] if "over" in m else
              f"plan {m['plan']:.2f} s, validate {m['validate']:.2f} s, {m['steps']:,} steps, peak RSS "
              f"{m['rss_gib']:.2f} GiB, largest slice {m['slice_mib']:.1f} MiB, estimate {m['estimate']:.3f} s, "
              f"bound {m['bound']:.3f} s, a job's Prepares {m['prepares_s']:.3f} s ({m['prepares_mib']:,.1f} MiB), "
              f"a delta sync's {m['delta_prepares_s']:.3f} s ({m['delta_prepares_mib']:,.1f} MiB)"),
              flush=True)
        if "over" not in m:
            break
    return runs


def moe_rows(ladder: list[int], timeout: float, cap_gib: float) -> dict:
    """The full case, then the sizes of ``ladder`` (largest first) until one finishes, planned without dtypes; then
    quantized on the way, `QUANTIZED_LADDER` likewise."""
    return {"runs": _ladder(ladder, False, timeout, cap_gib),
            "quantized": _ladder(QUANTIZED_LADDER, True, timeout, cap_gib),
            "refusal": _refusal(_moe_decls(ladder[0])), "bounds": _full_bounds(ladder[0])}


def _full_bounds(layers: int) -> dict:
    """The lower bound of the case at ``layers`` layers, which needs no program: its bytes as bf16 and as served."""
    from moe_plan import build

    from reshard.dtypes import itemsize

    case = build(layers, KIMI_EXPERTS)
    topo = Topology.gpu_hosts()
    served = {t.name: itemsize(case.serve_dtypes[t.name]) for t in case.tensors}
    return {"layers": layers, "train_bytes": case.train_bytes, "serve_bytes": case.serve_bytes,
            "bf16": many_lower_bound(case.tensors, topo), "served": many_lower_bound(case.tensors, topo, served)}


def _moe_decls(layers: int) -> list[TensorDecl]:
    from moe_plan import build

    return list(build(layers, KIMI_EXPERTS).tensors)


def _quantized_note(quantized: list[dict]) -> str:
    """Why the main rows plan without ``dtypes=``, from the quantized rows' own figures."""
    over = [m for m in quantized if "over" in m]
    done = next((m for m in quantized if "over" not in m), None)
    said = ("The main rows plan without `dtypes=` (bf16 weights, and the scales in their training layout, on the "
            "wire), and the last rows quantize on the way (`dtypes=` the serving dtypes: fp8 and scales made by "
            "the senders)")
    if over:
        said += f": at {over[0]['layers']} layers that is {over[0]['over']}"
    if done is not None and done["estimate"] < done["bound"]:
        said += (f". Its estimate ({done['estimate']:.3f} s) is below the lower bound ({done['bound']:.3f} s): "
                 "`Program.estimate` starts each dependency depth's moves when their own dependencies end and "
                 "prices each depth alone, so the unquantized moves (depth 0) and the fp8 moves after their "
                 "quantize steps share the serving hosts' NICs for free")
    return said + "."


def _goal(value: float | None, limit: float, over: str = "", unit: str = "") -> str:
    if value is None:
        return f"**not met** ({over})" if over else "not measured"
    return ("met" if value <= limit else "**not met**") + f" ({value:.3g}{unit})"


def _moe_row(m: dict) -> list[str]:
    label = f"{m['layers']} layers" + (", quantized on the way (fp8 + scales)" if m["quantize"] else
                                       ", planned without dtypes (bf16 weights and scales on the wire)")
    after = [m.get(k) for k in ("id_s", "estimate_s", "dumps", "moves_s", "cut_s")]
    cells = [
        f"{m['tensors']:,} ({m['build_s']:.1f})" if "tensors" in m else None,
        f"{m['steps']:,}" if "steps" in m else None,
        f"{m['plan']:.2f}" if "plan" in m else None, f"{m['validate']:.2f}" if "validate" in m else None,
        " / ".join(f"{v:.2f}" for v in after) if None not in after else None,
        f"{m['plan'] + m['validate'] + sum(after):.1f}" if None not in after else None,
        f"{m['rss_gib']:.2f}" if "rss_gib" in m else None, f"{m['text_mib']:,.0f}" if "text_mib" in m else None,
        f"{m['slice_mib']:,.1f} ({m['slice_host']})" if "slice_mib" in m else None,
        f"{m['agent_read_s']:.1f} / {m['agent_layout_s']:.1f}" if "agent_layout_s" in m else None,
        f"{m['prepares1_s']:.2f} / {m['prepares_s']:.3f} ({m['prepares_mib']:,.1f} MiB) / {m['delta_prepares_s']:.3f} "
        f"({m['delta_prepares_mib']:,.1f} MiB)" if "delta_prepares_s" in m else None,
        f"{m['estimate']:.3f}" if "estimate" in m else None, f"{m['bound']:.3f}" if "bound" in m else None,
        f"{m['estimate'] / m['bound']:.3f}" if "bound" in m else None,
    ]
    if "over" in m:
        # the stages that finished keep their figures; the first that did not says why
        first = cells.index(None, 2) if None in cells[2:] else 2
        cells[first] = m["over"]
    return [label, *(c or "" for c in cells)]


def moe_markdown(moe: dict, timeout: float, cap_gib: float) -> str:
    runs, quantized, b = moe["runs"], moe["quantized"], moe["bounds"]
    full = runs[0]
    done = next((m for m in runs if "over" not in m), None)
    head = ["case", "tensors (declared in s)", "steps", "plan s", "validate s",
            "then id / estimate / text / the job's moves / the per-host cut s",
            "a planner's seconds before an agent gets it", "peak RSS GiB", "whole text MiB",
            "largest per-host slice MiB (what that host's agent gets)", "that host's agent: read / layout s",
            "the hosts' Prepares, first job / every later one / a later delta sync's s (sent)",
            "estimate s", "lower bound s",
            "estimate / bound"]
    table = _table(head, [_moe_row(m) for m in runs + quantized])
    g = MOE_GOALS
    over = full.get("over", "")
    # the issue's own case: the same layers, quantized to fp8 on the way
    asked = next((q for q in quantized if q.get("layers") == full.get("layers")), None)

    def verdicts(m: dict | None) -> dict[str, str]:
        if m is None:
            return dict.fromkeys(("plan", "validate", "rss_gib", "slice_mib", "ratio"), "not measured")
        late = m.get("over", "")
        return {"plan": _goal(m.get("plan"), g["plan"], late, " s"),
                "validate": _goal(m.get("validate"), g["validate"], late, " s"),
                "rss_gib": _goal(m.get("rss_gib"), g["rss_gib"], late, " GiB"),
                "slice_mib": _goal(m.get("slice_mib"), g["slice_mib"], late, " MiB"),
                "ratio": _goal(m["estimate"] / m["bound"] if "bound" in m else None, g["ratio"], late, "x")}

    plain, fp8 = verdicts(full), verdicts(asked)
    one_job, one_job_why = _one_job(moe["refusal"], full, quantized)
    goals = [
        ("planned from scratch < 5 s", plain["plan"], fp8["plan"]),
        ("validated < 5 s", plain["validate"], fp8["validate"]),
        ("planner memory (peak RSS of the child) < 4 GiB", plain["rss_gib"], fp8["rss_gib"]),
        ("largest per-host slice < 64 MiB of program text", plain["slice_mib"], fp8["slice_mib"]),
        ("estimate <= 1.05x the lower bound", plain["ratio"], fp8["ratio"]),
        ("a repeated sync (cached program) < 50 ms from request to every agent started",
         "measured whole by bench/sync_start.py (a planner and its calls: its section); here "
         + _goal(full.get("prepares_s"), 0.05, over, " s") + " for the hosts' Prepares alone",
         "measured whole by bench/sync_start.py; here " + _goal(asked.get("prepares_s") if asked else None, 0.05,
                                                               asked.get("over", "") if asked else "", " s")
         + " for the hosts' Prepares alone"),
        ("one job, one atomic commit (both programs: see below)", one_job, one_job),
    ]
    lines = [f"| {what} | {a} | {b} |" for what, a, b in goals]
    if done is not None and done is not full:
        smaller = [
            ("planned < 5 s", _goal(done["plan"], g["plan"], unit=" s")),
            ("validated < 5 s", _goal(done["validate"], g["validate"], unit=" s")),
            ("peak RSS < 4 GiB", _goal(done["rss_gib"], g["rss_gib"], unit=" GiB")),
            ("largest per-host slice < 64 MiB", _goal(done["slice_mib"], g["slice_mib"], unit=" MiB")),
            ("estimate <= 1.05x bound", _goal(done["estimate"] / done["bound"], g["ratio"], unit="x")),
        ]
        tail = (f"\n\nAt {done['layers']} layers, the largest size that finished: "
                + "; ".join(f"{w}: {v}" for w, v in smaller) + ".")
    else:
        tail = ""
    records = _table(["record (measured elsewhere)", "seconds", "how", "hardware, as quoted"],
                     [[who, f"{secs:g}", how, hw] for who, secs, how, hw in RECORDS])
    ours = (f"the full case's estimate is {full['estimate']:.3f} s against a lower bound of {full['bound']:.3f} s"
            if "over" not in full else
            (f"the full case did not finish ({over}); at {done['layers']} layers the estimate is "
             f"{done['estimate']:.3f} s against a bound of {done['bound']:.3f} s" if done is not None else
             "no size finished"))
    return (
        "\n### Issue 41: a trillion-parameter MoE state dict in one job\n\n"
        "A Kimi-K2-like state dict (`reshard.moe.KIMI_K2`: 61 layers, hidden 7168, 384 routed experts; 139,583 "
        "tensors with the fp8 block scales, 1.03 T parameters) from 256 training GPUs as 32 hosts x 8 (bf16; experts "
        "whole on one host, split over its 8 devices) to 128 serving GPUs as 16 hosts x 8 (8 replicas of an "
        "expert-parallel group of 16), on `Topology.gpu_hosts()` (8 NICs x 400 Gbit/s a host, NVLink inside). "
        f"Each size is built and planned from scratch (`plan_many` with the case's scales) in a child process given "
        f"{timeout:g} s and an address space of {cap_gib:g} GiB (`RLIMIT_AS`), which keep this shared machine "
        "usable; where the full 61 layers do not finish within them the row says so, and the next rows are the "
        "largest of the smaller sizes that did. After planning and validating, a planner works out the program's "
        "id (the hash of its canonical text, every step written out), its estimate, its text and, as a job, its "
        "account of the moves (`reshard.server.planner.jobs.program_moves`: each host's bytes to send, the bytes "
        "over NICs per tensor, the streams pushed into each host) before any agent gets it: each is timed, and the "
        "sum is what a planner spends on a fresh request of this state dict. Peak RSS is the child's after all of "
        "these (what a planner holds). "
        "A run's steps are made only where something asks for one of them (`reshard.program.RunSteps`): a planner "
        "validates, hashes, prices and writes the program by the runs' templates, so it never makes them. "
        "The program's text is `Program.dumps`: each tensor by its layout, and each tensor's steps as a run of the "
        "first of its layout's, renamed (`reshard.program.Run`). The planner then cuts it per host "
        "(`reshard.host_slice.HostCut`, timed as part of its seconds): each agent is handed the steps its host takes "
        "part in (as sender, receiving or forwarding hop, compute device), their tensors, its buckets and the few "
        "facts of the whole program its order needs, still as runs. The agent of the host with the largest slice "
        "then reads it (`load_program`, which leaves the runs unmade too) and works out its own layout "
        "(`HostLayout`: the buckets it sends, receives or forwards, its tasks in order, stream numbers, tiles; it "
        "makes the runs of the steps it takes part in), timed in the same child. Every job of the program, a "
        "repeated sync's included, then costs the planner each host's Prepare (`GrpcAgentCalls.prepare_request`: "
        "by digest, the agents holding their slices; each with the reads of its own tensors, every program tensor "
        "read at one version here: that version alone (`reads_at`) where nothing is quantized, else its columns "
        "of names and versions), built and serialized for all hosts and timed: the first job's, which hashes each "
        "slice and each host's read columns once for its ticket and carries the columns, and the next job's, "
        "which names them by their SHA-256 beside the versions, and a later job that moves every tensor as a "
        "delta (its base pairs beside its reads, one per read). The lower bound is the cost "
        "model's (`lower_bound_seconds`) over all tensors at once, each at the itemsize it travels in. "
        + _quantized_note(quantized) + "\n\n" + table + "\n\n"
        f"Must-show 1's goals, from the full {full['layers']} layers' figures, planned without dtypes and as the "
        "issue states the case, quantized to fp8 on the way:\n\n| goal | without dtypes (bf16 on the wire) | "
        "quantized on the way (the issue's case) |\n|---|---|---|\n" + "\n".join(lines)
        + tail + f"\n\nOne job: {one_job_why}\n\n"
        f"Must-show 2: {ours}. The lower bound of the full {b['layers']} layers needs no program: "
        f"{b['served']:.3f} s with the weights quantized on the way (fp8 and scales on the wire, "
        f"{b['serve_bytes'] / 1e9:,.0f} GB a replica) and {b['bf16']:.3f} s moving bf16 (the scales in their "
        "training layout beside them), each serving host needing its replica's half of the experts and every "
        "other weight whole. The records below were measured elsewhere, on their own hardware, not by this "
        "bench.\n\n" + records + "\n"
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--skip-million", action="store_true", help="skip the million-piece all-to-all")
    ap.add_argument("--skip-state-dict", action="store_true", help="skip the 1,001-tensor state dict")
    ap.add_argument("--many-timeout", type=float, default=120.0, help="seconds plan_many may take (default 120)")
    ap.add_argument("--skip-moe", action="store_true", help="skip issue 41's trillion-parameter MoE rows")
    ap.add_argument("--moe-layers", type=int, nargs="+", default=[61, 16, 4],
                    help="MoE sizes to try, largest first, until one finishes (default 61 16 4)")
    ap.add_argument("--moe-timeout", type=float, default=300.0, help="seconds a MoE size may take (default 300)")
    ap.add_argument("--moe-memory-gib", type=float, default=8.0,
                    help="address space a MoE size may take, in GiB (default 8)")
    ap.add_argument("--plan-many-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--moe-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plan_many_child:
        return _plan_many_child()
    if args.moe_child:
        return _moe_child(int(args.moe_child[0]), bool(int(args.moe_child[1])), float(args.moe_child[2]))
    topo = Topology(nic_gbps=10.0)
    n_to_m = compare_strategies(n_to_m_cases(), topo)
    one_to_m = compare_strategies(one_to_m_cases(), topo)
    overlap = compare_strategies(overlap_cases(), topo)
    print("N-to-M suite (2 GiB int32, 10 Gbit/s NICs)")
    print(format_rows(n_to_m))
    print("\n1-to-M suite (1 GiB int32, 10 Gbit/s NICs)")
    print(format_rows(one_to_m))
    print("\nMeshes that share hosts (2 GiB float32)")
    print(format_rows(overlap))
    worst = max(r.ratio for r in n_to_m + one_to_m if r.strategy in ("auto", "broadcast"))
    print(f"\nworst estimate/lower bound of auto and broadcast on the paper's suites: {worst:.3f}")
    scale = scale_rows(args.skip_million)
    scale_md = _table(["reshard", "unit tasks", "transfers", "plan s", "validate s", "estimate / bound"], scale)
    many, many_note = ([], "") if args.skip_state_dict else state_dict_rows(args.many_timeout)
    many_md = _table(["state dict", "unit tasks", "transfers or steps", "seconds"], many)
    moe = None if args.skip_moe else moe_rows(args.moe_layers, args.moe_timeout, args.moe_memory_gib)
    if not args.no_write:
        body = (
            "Estimates on the fluid cost model (`Plan.estimate`), 10 Gbit/s NICs, 100 Gbit/s inside a host. "
            "Ratio is estimate over `Plan.lower_bound`; effective Gbit/s is tensor bits over the estimate, "
            "as in the paper's plots.\n\n"
            "### N-to-M suite (cases 1-7 and 9, 2 GiB int32)\n\n" + format_rows(n_to_m, markdown=True) + "\n\n"
            "### 1-to-M suite (1 GiB int32, one source device to H x G replicas)\n\n"
            + format_rows(one_to_m, markdown=True) + "\n\n"
            "### Beyond the paper: meshes that share hosts (2 GiB float32, `reshard.cases.overlap_cases`)\n\n"
            "Here a receiver's host often holds a replica and hosts forward chains while sending their own data; "
            "`auto` picks local senders and rotates chains so forwarding spreads over hosts.\n\n"
            + format_rows(overlap, markdown=True) + "\n\n"
            f"Worst estimate / lower bound for `auto` and `broadcast` on the paper's suites: **{worst:.3f}**.\n\n"
            "### Planning time, (8192, 8192) float32 between two disjoint 128-host x 8-device meshes\n\n"
            "Best of 3 (the first run also fills the caches of tile groups and device numbers that later plans "
            "between the same meshes reuse); validation timed separately.\n\n" + scale_md + "\n"
        )
        if many:
            body += (
                "\n### Planning time, a 1,001-tensor state dict between two 1,024-device meshes\n\n"
                "A transformer's weights (bf16 and fp8, rows or columns split over `tp`), norms and biases, from "
                "training (`dp`=128 x `tp`=8 on hosts train0..train127, 8 devices each) to inference (`dp`=256 x "
                "`tp`=4 on infer0..infer127: two replicas a host): every tile is wanted by all 128 inference hosts, "
                "so every unit task is a broadcast over 128 hosts. `reshard.plan` per tensor against one shared "
                "`Loads` (planning only), then `reshard.plan_many` for the whole (each of the state dict's layouts "
                "planned once for all its tensors against one `Loads`, largest first, with the program's steps and "
                "buckets; given "
                f"{args.many_timeout:g} s in a child process). Goal: under 2 s. {many_note}A planner's `reshard_many` "
                "then proves the program (`Program.validate`: every destination tile of every tensor covered "
                "exactly once, every sender holding what it sends) before any agent sees it; that check is timed "
                f"on its own. {_refusal(state_dict())}.\n\n"
                + many_md + "\n"
            )
        if moe is not None:
            body += moe_markdown(moe, args.moe_timeout, args.moe_memory_gib)
        write_section("plan_quality", "Plan quality and planning time", body)
        print("wrote BENCHMARKS.md")
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
