"""Issue 41's must-show 3: a scaled-down Kimi-K2-like state dict quantized on the way through real agents, on the
emulated hosts and on loopback, timed against the job's estimate and checked bit for bit.

The case is `reshard.moe`'s, cut to 2 layers (one dense, one of 16 routed experts and a shared one) two ways
(`SHAPES`): "kimi-k2" keeps Kimi K2's own tensor shapes (1.38 G parameters, the tiles the trillion-parameter sync
moves), "hidden-512" cuts every dimension as well (37 M parameters, where a tile's fixed costs weigh most). Each goes
from training on 4 hosts x 2 devices (bf16) to serving on 4 other hosts x 2 devices, 2
replicas of an expert-parallel group of 4, in fp8 with 128 x 128 block scales. Each run puts the bf16 weights in
the training layout (untimed, as a trainer publishes them), then times one ``reshard_many(..., dtype=the serving
dtypes, scales=...)`` from the request to its commit, and checks every device's tile of every tensor, replicas
included (`Client.digests`), against a numpy reference quantizer's bits of the whole weight and its scales
(`quantize_reference`: the rule of tests/core/test_fp8_kernels.py's ``reference``, one array at a time instead of
one value at a time, proved equal to it on a sample with zeros, subnormals and saturation before any run).

The estimate is the cost model's for the program the job ran: the same ``plan_many`` on the topology the service
plans on (the agents' NIC rates, which the lab shapes its links to, and their measured copy rates, read back from
a dry run), whose id must be the job's plan id. Goal on the emulated hosts: the median within 1.15x of it. Each
transport of ``--transports`` gets a cluster of its own, on loopback and on the emulated hosts. Both collective
and nixl post their receives, so an agent runs the tasks that call peers in one order every host derives (the
deadlock-freedom argument of ``server/agent/task_graph.py``), and quantizes beside them, the tiles the first
streams carry first: an fp8 move leaves as soon as its tile is quantized. The CPU seconds the service's processes
(planner and agents) used in each sync are measured beside it: the estimate prices the links, and each quantize
step as a roofline on its own device at the agent's measured memory rate, not 8 agents sharing this machine's
cores, nor the streams' own CPU.
Emulated hosts (``reshard lab``: 8 network namespaces, links shaped to ``--gbps`` each way) need root, else that
part says why it skipped. Writes its section of BENCHMARKS.md.

    python bench/moe_sync.py [--runs 3] [--gbps 1] [--transports collective,nixl] [--shapes kimi-k2,hidden-512]
                             [--no-lab] [--no-write] [--trace-dir DIR]

``--trace-dir DIR`` starts every agent with it (``reshard agent --trace-dir``): a line per task in
DIR/<where>-<transport>/<host>.jsonl, for ``python -m reshard.server.devtools.task_trace`` (the last job there is
the last timed sync).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _checks import check_every_device, tile_digests  # noqa: E402
from _meter import user_system_seconds  # noqa: E402
from _program_parts import many_lower_bound  # noqa: E402
from _report import write_section  # noqa: E402

from reshard import Mesh  # noqa: E402
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16, itemsize  # noqa: E402
from reshard.many import plan_many  # noqa: E402
from reshard.moe import MoeConfig, moe_state_dict  # noqa: E402
from tests.core.test_fp8_kernels import E4M3, reference  # noqa: E402

FP8 = "float8_e4m3fn"
BLOCK = 128
TRAIN_HOSTS, SERVE_HOSTS, DEVICES = 4, 4, 2
EP_DEVICES = 4  # the serving mesh's 8 devices: 2 replicas of an expert-parallel group of 4
# 2 layers (one dense, one of 16 experts), scaled down two ways. "kimi-k2": Kimi K2's own tensors (hidden 7168, an
# expert 2048 x 7168, the dense MLP 18432 x 7168, its attention), only fewer of them and a vocabulary of 2048 (its
# 163,840 would be 4.4 GiB of embeddings alone): 1.38 G parameters, 2.6 GiB of bf16, tiles of the size the
# trillion-parameter sync moves, so a run over 1 Gbit/s links takes seconds. "hidden-512": every dimension cut as
# well (37 M parameters, tiles of 1 MiB or less), where a tile's fixed costs, which the cost model does not price,
# are most of a run. Every serving cut over 2 devices a host falls on a block boundary in both.
SHAPES = {
    "kimi-k2": MoeConfig(num_layers=2, num_experts=16, vocab=2048),
    "hidden-512": MoeConfig(num_layers=2, num_experts=16, hidden=512, intermediate=1024, dense_intermediate=2048,
                            vocab=2048, num_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64,
                            qk_rope_head_dim=64, v_head_dim=64),
}
WHY = {"kimi-k2": "keeps Kimi K2's own tensor shapes, so its tiles are the size the trillion-parameter sync moves",
       "hidden-512": "cuts every dimension too, so a tile's fixed costs (a task, a stream, a commit entry), which the "
                     "cost model does not price, weigh most there"}
GOAL = 1.15  # measured over estimate, on the emulated hosts
CORES = os.cpu_count() or 1
TIMEOUT_S = 600


def _nearest_codes(q: np.ndarray) -> np.ndarray:
    """The e4m3fn codes of float32 values (a NaN's code is left to the caller): the nearest finite e4m3fn value,
    ties to the even code, saturating at 448, the sign from the value's sign bit."""
    a = np.minimum(np.abs(q).astype(np.float64), 448.0)
    hi = np.minimum(np.searchsorted(E4M3, a), len(E4M3) - 1)
    lo = np.maximum(hi - 1, 0)
    below, above = a - E4M3[lo], E4M3[hi] - a
    exact = (hi == 0) | (E4M3[hi] == a)
    pick_lo = (below < above) | ((below == above) & (lo % 2 == 0))
    code = np.where(exact, hi, np.where(pick_lo, lo, hi)).astype(np.uint8)
    return code | np.where(np.signbit(q), np.uint8(0x80), np.uint8(0))


# A float32 value's code depends only on its top 16 bits and on whether any of its low 16 bits is set: every e4m3fn
# value, every midpoint between two of them, and 448 has at most 5 significant bits (its low 16 bits are 0), so none
# lies strictly between two float32 values that share their top 16 bits. `_nearest_codes` of one value of each kind
# (low bits 0, low bits 1) is every value's code: a table of 131,072 looked up once an element, where
# `_nearest_codes` itself takes minutes on a billion elements.
_TOP_BITS = np.arange(1 << 16, dtype=np.uint32) << 16
with np.errstate(invalid="ignore"):
    _CODES = _nearest_codes(np.concatenate([_TOP_BITS, _TOP_BITS | 1]).view(np.float32))


def _table_codes(bits: np.ndarray) -> np.ndarray:
    """`_CODES` of float32 values given as their bits (uint32)."""
    return _CODES[(bits >> 16) | ((bits & 0xFFFF) != 0).astype(np.uint32) << 16]


def quantize_reference(x32: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 codes as uint8, float32 scales) of a float32 matrix by the rule of the tests' ``reference``: a block's
    scale is its largest finite magnitude / 448 (1 where that is 0); each value divided by its block's scale goes
    to the nearest finite e4m3fn value, ties to the even code, saturating at 448; NaN keeps its sign. One band of
    block rows at a time, so the temporaries are a few MiB that stay in cache, not the matrix's size in fresh
    memory."""
    m, n = x32.shape
    bn = -(-n // block)
    scales = np.empty((-(-m // block), bn), np.float32)
    code = np.empty((m, n), np.uint8)
    padded = np.zeros((block, bn * block), np.float32)
    for i, r in enumerate(range(0, m, block)):
        x = x32[r:r + block]
        padded[:len(x), :n] = np.where(np.isfinite(x), np.abs(x), np.float32(0))
        padded[len(x):] = 0
        band = (padded.reshape(block, bn, block).max(axis=(0, 2)) / np.float32(448)).astype(np.float32)
        band[band == 0] = np.float32(1)
        scales[i] = band
        with np.errstate(invalid="ignore"):
            bits = (x / np.repeat(band, block)[:n]).view(np.uint32)
        code[r:r + block] = _table_codes(bits)
    nan = np.isnan(x32)
    code[nan] = np.uint8(0x7F) | np.where(np.signbit(x32[nan]), np.uint8(0x80), np.uint8(0))
    return code, scales


def check_reference() -> None:
    """`quantize_reference` gives the tests' value-at-a-time ``reference``'s bits, on a sample with zeros, a
    subnormal range, a saturating block, a short last block and a NaN."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((200, 300)) * 0.02).astype(np.float32)
    x[0, :4] = [0.0, -0.0, 3.5, np.nan]
    x[130:140, 140:150] = rng.standard_normal((10, 10)).astype(np.float32) * 1e-6
    x[:128, 256:] = 0.0
    x = bfloat16_to_float32(float32_to_bfloat16(x))
    got, want = quantize_reference(x), reference(x, BLOCK)
    if not (np.array_equal(got[0], want[0]) and np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))):
        raise AssertionError("the bench's quantize_reference differs from tests/core/test_fp8_kernels.py's reference "
                             "on the sample; fix it before trusting any bit-exact check below")
    # Its table against `_nearest_codes` itself: random bit patterns, and every e4m3fn value and midpoint (the ties)
    # with the float32 values either side of it, both signs.
    grid = np.concatenate([E4M3, (E4M3[1:] + E4M3[:-1]) / 2, [448.0, 464.0, 2.0**-10]]).astype(np.float32)
    grid = np.concatenate([grid, np.nextafter(grid, np.float32(0)), np.nextafter(grid, np.float32(np.inf))])
    q = np.concatenate([rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32).view(np.float32), grid, -grid])
    q = q[~np.isnan(q)]
    if not np.array_equal(_table_codes(q.view(np.uint32)), _nearest_codes(q)):
        raise AssertionError("the bench's table of e4m3fn codes differs from the nearest-value rule it was built by")


def case_for(config: MoeConfig, train_hosts: list[str], serve_hosts: list[str]):
    train = Mesh.from_hosts({"host": TRAIN_HOSTS, "gpu": DEVICES}, train_hosts, DEVICES)
    serve = Mesh.from_hosts({"host": SERVE_HOSTS, "gpu": DEVICES}, serve_hosts, DEVICES)
    return moe_state_dict(config, train, serve, ep_devices=EP_DEVICES)


def weights(case) -> tuple[dict, dict, dict]:
    """The bf16 (and float32) weights, seeded, and what each tensor of the serving state dict holds: the quantized
    weights' fp8 codes and their scales by `quantize_reference`, the rest as they are. The same for every case of
    one `MoeConfig` (names and shapes do not depend on the hosts), so computed once for all clusters; the third
    element holds their tile digests by serving devices (`sync`), which clusters with the same host names share."""
    rng = np.random.default_rng(41)
    values, served = {}, {}
    for t in case.weights:
        x = rng.standard_normal(t.shape, dtype=np.float32)
        x *= np.float32(0.02)
        values[t.name] = x if t.dtype == "float32" else float32_to_bfloat16(x).view(ml_dtypes.bfloat16)
        if t.name in case.scales:
            served[t.name], served[case.scales[t.name]] = quantize_reference(
                bfloat16_to_float32(values[t.name].view(np.uint16)))
        else:
            served[t.name] = values[t.name]
    return values, served, {}


def _dtypes(case) -> dict[str, str]:
    weights = {t.name for t in case.weights}
    return {k: v for k, v in case.serve_dtypes.items() if k in weights}


def sync(c, case, weighed: tuple[dict, dict, dict], runs: int, where: str, pids: list[int]) -> dict:
    """One untimed and ``runs`` timed syncs, each after a put of the bf16 weights, each checked, with the CPU
    seconds the service's processes (``pids``: its planner and agents) used in each; the estimate of the program
    they ran, planned here on the service's topology. ``weighed``: `weights` of the case's config."""
    values, served, digests = weighed
    devices = tuple(case.serve.require_devices())
    if devices not in digests:
        layouts = {t.name: t.dst for t in case.tensors}
        digests[devices] = {name: tile_digests(a, layouts[name]) for name, a in served.items()}
    expected = digests[devices]
    dtypes, dst = _dtypes(case), {t.name: t.dst for t in case.weights}
    probe = next(t for t in case.weights if t.name in case.scales)
    times, results, cpu, system = [], [], [], []
    for i in range(runs + 1):
        c.put_many({t.name: (values[t.name], t.src) for t in case.weights})
        before = user_system_seconds(pids)
        t0 = time.monotonic()
        # Whole moves: every run puts the same weights, which a delta sync would skip (issue 40's rows time that).
        result = c.reshard_many(dst, scales=dict(case.scales), dtype=dtypes, delta=False).result(timeout=TIMEOUT_S)
        wall = time.monotonic() - t0
        after = user_system_seconds(pids)
        used, kernel = sum(after) - sum(before), after[1] - before[1]
        if result.state != "succeeded":
            raise AssertionError(f"{where}: the sync failed: {result.error}")
        check_every_device(c, expected, f"{where}: the quantized sync")
        print(f"{where}: sync {'(untimed) ' if not i else ''}{wall:.3f} s, {result.network_bytes / 2**20:.1f} MiB "
              f"over the network, on {result.transport}", flush=True)
        if i:
            times.append(wall)
            results.append(result)
            cpu.append(used)
            system.append(kernel)
        else:
            first = (wall, used, kernel)
    # The topology the planner planned on, as a dry run of one tensor reports it.
    topology = c.plan(probe.shape, probe.dst, dtype=probe.dtype, src=probe.src).topology
    program = plan_many(case.tensors, topology, scales=case.scales, dtypes=dtypes)
    wire = {t.name: itemsize(case.serve_dtypes[t.name]) for t in case.tensors}
    serve_host = case.serve.require_devices()[0].split("/")[0]
    bound = many_lower_bound(case.tensors, topology, wire)
    return {"times": times, "cpu": cpu, "system": system, "first": first, "estimate": program.estimate_seconds,
            "bound": bound,
            "network_bytes": statistics.median(r.network_bytes for r in results),
            "plan_bytes": sum(h["bytes_in"] for h in program.host_bytes().values()),
            "transport": sorted({r.transport for r in results}), "phases": _phases(results),
            "nic_gbps": topology.nic_bytes_per_s(serve_host) * 8 / 1e9}


def _phases(results) -> dict[str, float]:
    return {name: statistics.median(r.phases.get(name, 0.0) for r in results) for name in results[0].phases}


def _traced(trace_dir: str | None, where: str, transport: str) -> list[str]:
    """The agents' ``--trace-dir`` for one cluster of the bench (none without ``--trace-dir``)."""
    return ["--trace-dir", str(Path(trace_dir) / f"{where}-{transport}")] if trace_dir else []


def loopback(config: MoeConfig, weighed: tuple[dict, dict, dict], runs: int, transport: str,
             trace_dir: str | None = None) -> dict:
    from reshard.client.cluster import LocalCluster

    hosts = [f"host{i}" for i in range(TRAIN_HOSTS + SERVE_HOSTS)]
    case = case_for(config, hosts[:TRAIN_HOSTS], hosts[TRAIN_HOSTS:])
    with LocalCluster(len(hosts), DEVICES, host_names=hosts, transport=transport,
                      agent_args=_traced(trace_dir, "loopback", transport)) as cluster, cluster.connect() as c:
        pids = [cluster.planner.pid, *(p.pid for p in cluster.agents.values())]
        return sync(c, case, weighed, runs, f"loopback, {transport}", pids)


@contextlib.contextmanager
def _lab(gbps: float, transport: str, trace_dir: str | None = None) -> Iterator[tuple]:
    from reshard.server.devtools.lab import Lab, LabConfig, start_cluster, wait_for_group

    with Lab(LabConfig(num_hosts=TRAIN_HOSTS + SERVE_HOSTS, devices_per_host=DEVICES, gbps=gbps)) as emulated:
        address = start_cluster(emulated, extra_agent_args=["--transport", transport,
                                                            *_traced(trace_dir, "lab", transport)])
        hosts = [emulated.host_name(i) for i in range(TRAIN_HOSTS + SERVE_HOSTS)]
        with emulated.connect(address) as c:
            wait_for_group(c, hosts, group=transport == "collective")
            yield c, hosts, [p.pid for p in emulated.processes]


def lab(config: MoeConfig, weighed: tuple[dict, dict, dict], runs: int, gbps: float, transport: str,
        trace_dir: str | None = None) -> dict:
    from reshard.server.devtools.lab import lab_available

    ok, why = lab_available()
    if not ok:
        return {"skipped": why}
    with _lab(gbps, transport, trace_dir) as (c, hosts, pids):
        return sync(c, case_for(config, hosts[:TRAIN_HOSTS], hosts[TRAIN_HOSTS:]), weighed, runs,
                    f"emulated hosts, {transport}", pids)


def _row(shapes: str, where: str, r: dict) -> str:
    median = statistics.median(r["times"])
    return (f"| {shapes} | {where} | {', '.join(r['transport'])} | {r['nic_gbps']:g} | {median:.3f} "
            f"({', '.join(f'{t:.3f}' for t in r['times'])}) | {r['estimate']:.3f} | {median / r['estimate']:.2f}x | "
            f"{r['bound']:.3f} | {r['network_bytes'] / 2**20:.1f} | {r['plan_bytes'] / 2**20:.1f} | "
            f"{statistics.median(r['cpu']):.2f} ({statistics.median(r['system']):.2f}) | "
            f"{statistics.median(r['cpu']) / CORES:.3f} | {r['first'][0]:.3f} | "
            f"{r['first'][1]:.2f} ({r['first'][2]:.2f}) |")


def _verdict(shapes: str, transport: str, emulated: dict) -> str:
    median = statistics.median(emulated["times"])
    ratio = median / emulated["estimate"]
    floor = statistics.median(emulated["cpu"]) / CORES
    verdict = (f"{shapes} on the emulated hosts on {transport}: the median sync took {ratio:.3f}x its estimate "
               f"(goal: within {GOAL:g}x: {'met' if ratio <= GOAL else '**not met**'}) and "
               f"{median / emulated['bound']:.3f}x the lower bound. Where the time went (median seconds per phase): "
               + ", ".join(f"{k} {v:.3f}" for k, v in emulated["phases"].items()) + ". "
               f"The service's processes used {statistics.median(emulated['cpu']):.2f} CPU seconds a sync: on this "
               f"machine's {CORES} cores that alone takes {floor:.3f} s, {floor / emulated['estimate']:.2f}x the "
               "estimate, which prices the links and each quantize step on a device of its own, not agents sharing "
               "cores.")
    if emulated["estimate"] < emulated["bound"] * (1 - 1e-9):  # the two sum the same floats in other orders
        verdict += (" The estimate is below the bound, which no schedule can beat: a cost-model bug (the program's "
                    "moves priced as sharing no links where they do).")
    return verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="timed syncs each way, after one untimed (default 3)")
    ap.add_argument("--gbps", type=float, default=1.0, help="the lab's link rate, Gbit/s each way (default 1)")
    ap.add_argument("--no-lab", action="store_true", help="skip the emulated hosts")
    ap.add_argument("--transports", default="collective,nixl",
                    help="the agents' transports, one run each, comma separated (default collective,nixl)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"the state dicts, comma separated, of {', '.join(SHAPES)} (default all)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--trace-dir", help="the agents' task traces go here, a directory per cluster (reshard agent "
                                        "--trace-dir; read them with python -m reshard.server.devtools.task_trace)")
    args = ap.parse_args()
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    shapes = [k.strip() for k in args.shapes.split(",") if k.strip()]
    if unknown := sorted(set(shapes) - set(SHAPES)):
        ap.error(f"--shapes {', '.join(unknown)}: the state dicts are {', '.join(SHAPES)}")
    check_reference()
    head = ("| shapes | where | transport | NIC Gbit/s (planner's) | median s (runs) | estimate s | "
            "measured / estimate | lower bound s | network MiB (job) | network MiB (estimated program) | "
            "service CPU s, median (of it system) | CPU s / cores | first sync s (untimed) | "
            "its service CPU s (of it system) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases, emulated_rows, loop_rows, verdicts = [], [], [], []
    for name in shapes:
        config = SHAPES[name]
        case = case_for(config, [f"t{i}" for i in range(TRAIN_HOSTS)], [f"s{i}" for i in range(SERVE_HOSTS)])
        print(f"{name}: {case}; weighing it and quantizing it by the reference", flush=True)
        cases.append(f"**{name}**: {case}, hidden {config.hidden}, expert intermediate {config.intermediate}: "
                     f"{case.train_bytes / 2**20:,.1f} MiB of bf16 weights, {case.serve_bytes / 2**20:,.1f} MiB a "
                     "serving replica")
        weighed = weights(case)
        for transport in transports:
            loop_rows.append(_row(name, "loopback (8 agents, one machine)",
                                  loopback(config, weighed, args.runs, transport, args.trace_dir)))
            emulated = {"skipped": "--no-lab"} if args.no_lab else lab(config, weighed, args.runs, args.gbps,
                                                                       transport, args.trace_dir)
            if "skipped" in emulated:
                verdicts.append(f"{name} on the emulated hosts on {transport}: skipped ({emulated['skipped']}); "
                                "the goal is not measured.")
                continue
            emulated_rows.append(_row(name, f"emulated hosts ({args.gbps:g} Gbit/s links)", emulated))
            verdicts.append(_verdict(name, transport, emulated))
        del weighed
    rows = emulated_rows + loop_rows
    body = (
        "Two scaled-down cuts of the trillion-parameter case (2 layers, 16 experts, a vocabulary of 2048), on "
        f"{TRAIN_HOSTS} training hosts x {DEVICES} devices in bf16, served on {SERVE_HOSTS} other hosts x {DEVICES} "
        f"in fp8 with 128 x 128 block scales (2 replicas of an expert-parallel group of {EP_DEVICES}): "
        + "; ".join(cases) + ". " + "; ".join(f"{k} {WHY[k]}" for k in shapes) + ". Each run puts the bf16 "
        "weights (untimed), then times one `reshard_many(..., dtype=, scales=)` from request to commit; every "
        "device's tile of every tensor, replicas included, is checked against a numpy reference quantizer's bits "
        "(the rule of tests/core/test_fp8_kernels.py's `reference`, vectorised here and proved equal to it on a "
        f"sample first): all runs bit-exact. Whole moves (`delta=False`): every run puts the same weights. Median of "
        f"{args.runs} after one untimed; the untimed first sync's seconds and CPU, and the kernel's part of that "
        "CPU, are the last two columns: its agents stage every tile into memory they have not touched before, where "
        "the later syncs reuse the buffers the earlier ones released, and the kernel faults fresh memory in page by "
        "page (on this machine, a VM that hands the memory its processes free back to its host, from the host). The "
        "estimate is the cost model's for the program the job runs: the same "
        "`plan_many` call, made here on the topology the planner reports (the last two columns set the network bytes "
        "the job reported beside that program's). The bound is the cost model's lower bound over all tensors at the "
        f"itemsize they travel in. Loopback is for comparison: its agents share this machine's {CORES} cores, and "
        "its planner's NIC rate is the agents' default, not a link's.\n\n" + head + "\n" + "\n".join(rows) + "\n\n"
        + "\n\n".join(verdicts) + "\n\n"
        f"Run: `python bench/moe_sync.py --runs {args.runs} --gbps {args.gbps:g} --transports {args.transports} "
        f"--shapes {','.join(shapes)}` (root for the emulated hosts)."
    )
    print(body)
    if not args.no_write:
        write_section("moe_sync", "Issue 41: a scaled-down MoE state dict quantized on the way through real agents",
                      body)
        print("wrote BENCHMARKS.md")
    return 0  # a missed goal is in the table; a sync that is not bit-exact raises


if __name__ == "__main__":
    sys.exit(main())
