"""The RL-step rows of ``bench/weight_sync.py`` (issue 40): real AdamW steps of the weight-sync example's Llama,
published as bfloat16 and synced from the training layout to the serving one, whole against as deltas.

The model is ``examples/rl_weight_sync``'s (`rl_loop.llama`: a transformers LlamaForCausalLM from a small config,
random init, fixed seed), trained in float32 (the master weights) by AdamW at an RL learning rate on a fresh random
batch every step (the rollouts' stand-in). Each step's weights are cast to bfloat16, as a trainer publishes them
for serving, and kept as their bits (numpy uint16, `reshard.dtypes`): the fraction of elements whose bits changed
since the step before is what a delta can save. Training runs once, before any cluster starts, so the loopback
and the emulated rows publish the very same steps.

On a cluster (`sync_steps`) the state dict is published twice per step, under ``full/`` and ``delta/`` names, in one
`put_many` labeled with the step: from the bench's training layout (the FSDP-style dim-0 split over the 4
training hosts) to its serving one (transformers' tensor-parallel plan for Llama, 2 ways, times two replicas on the
4 serving hosts). Then ``reshard_many(..., version=step)`` syncs each copy, ``delta=False`` for ``full/`` and
``delta=True`` for ``delta/``: two copies, so each keeps its own base pair (the previous sync
of its names), and the two take turns (which goes first alternates step by step), so a drift of this shared
machine's load reaches both. Step 0 publishes the initial weights and syncs both whole (nothing to diff
against). Every sync is checked right after it, every device's tile by digest against the published bits; that
check also lets the old versions' release, which follows a job under its tensors' locks, finish before the next
sync is timed. On loopback the rows also give the CPU seconds the planner and agents used over each sync: the
emulated hosts share this machine's 2 cores, so a sync there takes at least half its CPU seconds, whatever the links.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _checks import check_every_device, tile_digests  # noqa: E402

from reshard import Mesh, Sharding  # noqa: E402
from reshard.delta import COMPILED  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rl_weight_sync"
LR = 1e-6  # an RL-typical learning rate (issue 40 measured 1e-6 to 1e-4)
BATCH = (2, 32)  # token ids per step, as the example trains on
GOAL_BYTES = 0.10  # a delta step's network bytes against a full one's, at most
GOAL_SPEEDUP = 4.0  # a full step's sync seconds against a delta one's on the emulated hosts, at least
# Each side's reshard_many options: whole, and as deltas wherever a base pair is held. The default (`delta` unset)
# prices a delta against its hosts' CPU: on loopback's 10 Gbit/s agents it moves these tensors whole, on the
# emulated 1 Gbit/s links as deltas (tests/integration/test_delta_planner.py); True measures the codec on both.
SIDES = {"full": {"delta": False}, "delta": {"delta": True}}
TIMEOUT_S = 900
# transformers' tensor-parallel plan for Llama (`LlamaConfig.base_model_tp_plan`): column-wise projections split
# their output dim (dim 0 of the [out, in] weight), row-wise ones their input dim; lm_head splits the vocabulary;
# the embedding and the norms are replicated.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROWWISE = ("o_proj", "down_proj")


def train(steps: int, hidden: int, layers: int, vocab: int) -> tuple[list[dict[str, np.ndarray]], float]:
    """The bfloat16 bits (numpy uint16, by parameter name) of the initial weights and of each of ``steps`` AdamW
    steps at `LR`, and the seconds the steps took."""
    import torch

    sys.path.insert(0, str(EXAMPLE))
    from rl_loop import llama

    model = llama(Namespace(vocab=vocab, hidden=hidden, layers=layers), seed=0)  # float32: the master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = torch.Generator().manual_seed(0)

    def bits() -> dict[str, np.ndarray]:  # the bf16 a trainer publishes for serving, as its bits
        return {n: p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
                for n, p in model.named_parameters()}

    out = [bits()]
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(0, vocab, BATCH, generator=batches)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(bits())
    return out, time.perf_counter() - t0


def changed(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> float:
    """The fraction of all elements whose bits differ between two steps."""
    return (sum(int(np.count_nonzero(old[n] != new[n])) for n in new)
            / sum(a.size for a in new.values()))


def layouts(shapes: dict[str, tuple[int, ...]], train_mesh: Mesh, infer_mesh: Mesh) -> tuple[dict, dict]:
    """{name: training sharding}, {name: serving sharding}: dim 0 over the training mesh's ``tp`` (FSDP's split);
    transformers' tensor-parallel plan over the serving mesh's ``tp``, replicated over its ``dp``."""
    train_layout, serve_layout = {}, {}
    for name, shape in shapes.items():
        rest = (None,) * (len(shape) - 1)
        train_layout[name] = Sharding(train_mesh, ("tp",) + rest)
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        spec = (("tp", None) if module in COLWISE else (None, "tp") if module in ROWWISE else (None,) * len(shape))
        serve_layout[name] = Sharding(infer_mesh, spec)
    return train_layout, serve_layout


def _bf16(bits: np.ndarray):
    """A torch bfloat16 tensor of these bits: what a trainer hands `put_many`."""
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def sync_steps(c, steps: list[dict[str, np.ndarray]], train_mesh: Mesh, infer_mesh: Mesh, where: str,
               meter: Callable[[], float] | None = None, cpu: Callable[[], float] | None = None) -> dict:
    """Publish and sync every step of ``steps`` (`train`) on ``c``, both sides taking turns; per step and side:
    seconds (request to result), the job's network bytes, what a full move would have sent, the tensors that moved
    as deltas, the job's delta note, and what ``meter`` (e.g. the emulated links' received bytes) and ``cpu`` (the
    service's CPU seconds so far) grew by over the sync."""
    options = SIDES
    sides = list(options)
    shapes = {n: a.shape for n, a in steps[0].items()}
    train_layout, serve_layout = layouts(shapes, train_mesh, infer_mesh)
    dsts = {side: {f"{side}/{n}": s for n, s in serve_layout.items()} for side in sides}
    rows = []
    for k, weights in enumerate(steps):
        c.put_many({f"{side}/{n}": (_bf16(a), train_layout[n]) for side in sides for n, a in weights.items()}, step=k)
        want = {n: tile_digests(a, serve_layout[n]) for n, a in weights.items()}
        row: dict = {"step": k, "changed": changed(steps[k - 1], weights) if k else None}
        for side in (sides if k % 2 else sides[::-1]):
            used = meter() if meter is not None else 0.0
            spent = cpu() if cpu is not None else 0.0
            t0 = time.monotonic()
            result = c.reshard_many(dsts[side], version=k, **options[side]).result(timeout=TIMEOUT_S)
            seconds = time.monotonic() - t0
            grew = meter() - used if meter is not None else None
            spent = cpu() - spent if cpu is not None else None
            check_every_device(c, {f"{side}/{n}": d for n, d in want.items()}, f"{where} {side} sync of step {k}")
            deltas = result.deltas
            row[side] = {"seconds": seconds, "network_bytes": result.network_bytes,
                         "full_network_bytes": result.full_network_bytes or result.network_bytes,
                         "as_delta": sum(1 for d in deltas.values() if d["mode"] == "delta"),
                         "tensors": len(dsts[side]), "note": result.delta_note, "meter": grew, "cpu": spent}
            print(f"{where} step {k} {side}: {seconds:.3f}s, {result.network_bytes:,} network bytes"
                  + (f", {row[side]['as_delta']} of {len(dsts[side])} tensors as deltas" if deltas else "")
                  + (f" (changed {row['changed']:.2%})" if k else " (first sync)"), flush=True)
        rows.append(row)
    return {"rows": rows, "sides": sides, "nbytes": sum(a.nbytes for a in steps[0].values()),
            "tensors": len(shapes)}


def codec_share(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> float:
    """What `reshard.delta.encode` puts on the wire for the step, whole tensors (one box each), against their
    bytes: the share a delta side should come near (its boxes are tiles, each with a header of its own)."""
    from reshard.delta import encode

    return sum(encode(old[n], new[n]).nbytes for n in new) / sum(a.nbytes for a in new.values())


def loopback(steps: list[dict[str, np.ndarray]], transport: str, cpu_of: Callable[[list[int]], float]) -> dict:
    """`sync_steps` on 8 local agents, one device each: the bench's TRAIN and INFER meshes; ``cpu_of(pids)`` is the
    CPU seconds those processes used so far (the planner's and the agents')."""
    from buckets import HOSTS, INFER, TRAIN
    from reshard.client.cluster import LocalCluster

    with LocalCluster(len(HOSTS), 1, host_names=HOSTS, transport=transport) as cluster, cluster.connect() as c:
        pids = [cluster.planner.pid, *(p.pid for p in cluster.agents.values())]
        return sync_steps(c, steps, TRAIN, INFER, "loopback", cpu=lambda: cpu_of(pids))


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def table(r: dict) -> list[str]:
    """Markdown rows: per step, the change rate, each side's seconds, network bytes and (where measured) the
    service's CPU seconds; then delta against full."""
    timed = r["rows"][0]["full"]["cpu"] is not None
    head, rule = "| step | bf16 elements changed |", "|---:|---:|"
    for side in r["sides"]:
        head += f" {side}: seconds | {side}: network bytes |" + (f" {side}: CPU s |" if timed else "")
        rule += "---:|---:|" + ("---:|" if timed else "")
    head += " delta / full bytes | full / delta seconds | tensors as deltas |"
    rule += "---:|---:|---:|"
    lines = [head, rule]
    for row in r["rows"]:
        line = f"| {row['step']}{' (first sync)' if not row['step'] else ''} | {_pct(row['changed'])} |"
        for side in r["sides"]:
            line += f" {row[side]['seconds']:.3f} | {row[side]['network_bytes']:,} |"
            line += f" {row[side]['cpu']:.2f} |" if timed else ""
        f, d = row["full"], row["delta"]
        line += (f" {d['network_bytes'] / f['network_bytes']:.1%} | {f['seconds'] / d['seconds']:.2f}x | "
                 f"{d['as_delta']} of {d['tensors']} |")
        lines.append(line)
    return lines


def _summary(r: dict, where: str, speed_goal: bool) -> str:
    """A sentence or two on one setting's rows (medians over the steps after the first sync), with the goals beside
    the figures where both sides ran."""
    later = r["rows"][1:]
    seconds = {side: statistics.median(row[side]["seconds"] for row in later) for side in r["sides"]}
    nbytes = {side: statistics.median(row[side]["network_bytes"] for row in later) for side in r["sides"]}
    speed = seconds["full"] / seconds["delta"]
    shares = [row["delta"]["network_bytes"] / row["full"]["network_bytes"] for row in later]
    own = statistics.median(row["delta"]["network_bytes"] / row["delta"]["full_network_bytes"] for row in later)
    text = (f"{where}: a full step's sync took {seconds['full']:.3f} s and put {nbytes['full'] / 2**20:.2f} MiB on the "
            f"network; a delta step's {seconds['delta']:.3f} s ("
            + (f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower")
            + (f"; goal >= {GOAL_SPEEDUP:g}x faster: {_verdict(speed >= GOAL_SPEEDUP)}" if speed_goal else "")
            + f") and {statistics.median(shares):.1%} of the full side's bytes (worst step {max(shares):.1%}; goal <= "
              f"{GOAL_BYTES:.0%}: {_verdict(max(shares) <= GOAL_BYTES)}; by the delta jobs' own "
              f"`full_network_bytes`, {own:.1%}); medians over the steps after the first sync.")
    if later and later[0]["full"]["cpu"] is not None:
        cpu = {side: statistics.median(row[side]["cpu"] for row in later) for side in r["sides"]}
        ratio = cpu["delta"] / cpu["full"] if cpu["full"] else float("inf")
        text += (f" The planner and agents used {cpu['full']:.2f} CPU s for a full sync and {cpu['delta']:.2f} for a "
                 f"delta one ({ratio:.2f}x; delta codec {'compiled' if COMPILED else 'numpy'}): the sender still "
                 f"compares every element and each receiver copies its base and checks the result, which on "
                 f"loopback costs about what moving every byte does.")
    notes = sorted({row["delta"]["note"] for row in r["rows"] if row["delta"]["note"]})
    if notes:
        text += " The delta jobs' notes: " + "; ".join(notes) + "."
    return text


def _floor(loop: dict, lab: dict) -> str:
    """What the emulated hosts' shared cores leave a delta sync: its loopback CPU seconds over 2 cores."""
    later = loop["rows"][1:]
    if not later or later[0]["delta"]["cpu"] is None:
        return ""
    cpu = statistics.median(row["delta"]["cpu"] for row in later)
    cores = os.cpu_count() or 1
    full = statistics.median(row["full"]["seconds"] for row in lab["rows"][1:])
    return (f" The 8 emulated hosts share this machine's {cores} cores, so a delta sync here needs about its "
            f"{cpu:.2f} CPU s (loopback's median, a noisy figure on a shared machine) over {cores} cores, about "
            f"{cpu / cores:.3f} s, whatever the links: about {full / (cpu / cores):.1f}x faster than the full "
            f"sync's {full:.3f} s at best, where hosts with cores of their own would each do their share at once.")


def section(steps: list[dict[str, np.ndarray]], train_s: float, a: Namespace, loop: dict, lab: dict) -> str:
    """The section's text: how the steps were made and what changed, then each setting's rows and summary.
    ``a``: the bench's arguments (``delta_hidden``, ``delta_layers``, ``rl_vocab``, ``transport``, ``gbps``); ``lab``
    may be ``{"skipped": why}``."""
    fractions = [changed(steps[k - 1], steps[k]) for k in range(1, len(steps))]
    shares = [codec_share(steps[k - 1], steps[k]) for k in range(1, len(steps))]
    head = (f"The weight-sync example's model (`examples/rl_weight_sync`: a transformers LlamaForCausalLM, "
            f"{a.delta_layers} layers, hidden {a.delta_hidden}, vocabulary {a.rl_vocab}, random init: "
            f"{loop['tensors']} "
            f"tensors, {loop['nbytes'] / 2**20:.2f} MiB as bfloat16) trained with AdamW at lr {LR:g} on float32 "
            f"master weights, a fresh random batch of {BATCH[0]} x {BATCH[1]} tokens per step ({len(fractions)} "
            f"steps, {train_s:.1f} s of training here), each step published as bfloat16 (`put_many(..., step=k)`) "
            f"from the training layout (dim 0 over 4 hosts, FSDP's split) and synced (`reshard_many(..., "
            f"version=k)`, the {a.transport} transport) to the serving one (transformers' tensor-parallel plan, 2 "
            f"ways, times 2 replicas on 4 other hosts). The bf16 elements that changed per step: "
            f"{', '.join(f'{x:.2%}' for x in fractions)}; the delta codec (`reshard.delta.encode`, whole tensors) "
            f"would put {', '.join(f'{x:.1%}' for x in shares)} of their bytes on the wire. Seconds are from the "
            f"request to the job's result; network bytes are `JobResult.network_bytes`; every sync is checked "
            f"bit-exact, every device's tile against the published bits.")
    head += (" Two copies of the state dict take turns on one cluster, which goes first alternating step by "
             "step: `delta=False` moves one whole, `delta=True` moves the other as deltas (the default, `delta` "
             "unset, prices a delta against its hosts' CPU: whole on loopback's 10 Gbit/s agents, deltas on the "
             "emulated 1 Gbit/s links), each "
             "from the base pair of its own previous sync. Goals: a delta step's bytes at most "
             f"{GOAL_BYTES:.0%} of a full one's; its sync at least {GOAL_SPEEDUP:g}x faster on the emulated "
             "hosts.")
    parts = [head, "", "Loopback (8 local agents, one device each):", "", *table(loop), "",
             _summary(loop, "On loopback", speed_goal=False) + " On this 2-core machine the loopback rows measure "
             "CPU as much as bytes.", ""]
    if "skipped" in lab:
        parts.append(f"Emulated hosts: skipped ({lab['skipped']}).")
    else:
        links = [row[side]["meter"] for row in lab["rows"] for side in lab["sides"]]
        parts += [f"Emulated hosts (`reshard lab`, 8 hosts x 1 device, links shaped to {a.gbps:g} Gbit/s each way):",
                  "", *table(lab), "",
                  _summary(lab, "On the emulated hosts", speed_goal=True)
                  + f" The shaped links' counters: {min(links) / 2**20:.2f}-{max(links) / 2**20:.2f} MiB received "
                    f"per sync, all hosts." + _floor(loop, lab)]
    parts += ["", f"Reproduce: `python bench/weight_sync.py --rl-only --rl-steps {len(fractions)} --delta-hidden "
                  f"{a.delta_hidden} --delta-layers {a.delta_layers} --rl-vocab {a.rl_vocab} --gbps {a.gbps:g} "
                  f"--transport {a.transport}` (root for the emulated hosts)."]
    return "\n".join(parts)
