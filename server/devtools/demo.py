"""``reshard demo``: the paper's cases with every strategy, through real agents, verified.

Starts an embedded cluster (a planner and 5 agents x 4 devices, enough for
every N-to-M case and the 1-to-M meshes up to 4x4) unless ``--planner`` names
one. For each case the source tensor is put once; each strategy then reshards
it to the destination (timed), every destination shard's blake2b digest is
computed where it lives and compared with the digest of the expected tile, and
an untimed reshard brings the tensor back.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from reshard.box import to_slices
from reshard.cases import Case, n_to_m_cases, one_to_m_cases
from reshard.plan_command import positive_float, positive_int
from reshard.strategies import STRATEGIES
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.layout import np_dtype

if TYPE_CHECKING:  # rich is imported when the demo runs, not whenever the CLI builds its parser
    from rich.table import Table

__all__ = ["add_demo_arguments", "run_demo", "DemoRow"]

MiB = 2**20


@dataclass(frozen=True)
class DemoRow:
    case: str
    strategy: str
    nbytes: int
    seconds: float
    network_bytes: int
    verified: bool
    error: str = ""

    @property
    def gbytes_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--planner", default=None, help="use this cluster instead of starting one")
    p.add_argument("--nbytes-mib", type=positive_float, default=32, help="size of each case's tensor")
    p.add_argument("--hosts", type=positive_int, default=5, help="agents of the embedded cluster")
    p.add_argument("--devices-per-host", type=positive_int, default=4, help="devices per agent of the embedded cluster")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all that fit)")


def _all_cases(hosts: list[str], nbytes: int) -> list[Case]:
    padded = hosts + [f"absent{i}" for i in range(max(0, 9 - len(hosts)))]
    return n_to_m_cases(padded, nbytes) + one_to_m_cases(padded, nbytes)


def check_names(cases: set[str], strategies: list[str]) -> None:
    """Refuse ``--cases`` and ``--strategies`` names the demo does not know, listing those it does."""
    known = [c.name for c in _all_cases([], MiB)]
    for flag, names, valid in (("--cases", sorted(cases), known), ("--strategies", strategies, list(STRATEGIES))):
        unknown = [n for n in names if n not in valid]
        if unknown:
            raise InvalidArgumentError(f"{flag} names {', '.join(map(repr, unknown))}, which the demo does not "
                                       f"have; choose from {', '.join(valid)}")


def select_cases(hosts: list[str], devices_per_host: int, nbytes: int, names: set[str]) -> list[Case]:
    """The paper's cases that fit on ``hosts`` (each with ``devices_per_host`` devices), or those ``names`` names:
    every one of them, or an error naming what it needs."""
    available = {f"{h}/{i}" for h in hosts for i in range(devices_per_host)}
    cases = _all_cases(hosts, nbytes)
    fits = [c for c in cases if set(c.src.mesh.devices) | set(c.dst.mesh.devices) <= available]
    if not names:
        return fits
    for c in cases:
        if c.name in names and c not in fits:
            used = set(c.src.mesh.devices) | set(c.dst.mesh.devices)
            need_hosts = len({d.rpartition("/")[0] for d in used})
            need_devices = 1 + max(int(d.rpartition("/")[2]) for d in used)
            raise InvalidArgumentError(
                f"--cases {c.name} needs {need_hosts} hosts x {need_devices} devices, but the cluster has "
                f"{len(hosts)} x {devices_per_host}; raise --hosts and --devices-per-host, or choose from "
                f"{', '.join(f.name for f in fits) or 'none (this cluster fits no case)'}")
    return [c for c in fits if c.name in names]


def _expected_digests(a: np.ndarray, case: Case) -> dict[str, str]:
    by_tile: dict = {}
    out = {}
    for dev, tile in case.dst.tiles(case.shape).items():
        if tile not in by_tile:
            part = np.ascontiguousarray(a[to_slices(tile)])
            by_tile[tile] = hashlib.blake2b(part.tobytes()).hexdigest()
        out[dev] = by_tile[tile]
    return out


def run_cases(client, cases: list[Case], strategies: list[str], progress=None) -> list[DemoRow]:
    rows = []
    rng = np.random.default_rng(0)
    for case in cases:
        name = f"demo-{case.name}"
        if name in {t.name for t in client.tensors()}:
            client.delete(name)
        a = rng.integers(-2**31, 2**31 - 1, size=case.shape, dtype=np.int64).astype(np_dtype(case.dtype))
        client.put(name, a, case.src)
        expected = _expected_digests(a, case)
        for strategy in strategies:
            if progress is not None:
                progress.update(progress.task_ids[0], description=f"{case.name} {strategy}")
            try:
                result = client.reshard(name, case.dst, strategy).result(timeout=600)
                ok = client.digests(name) == expected
                rows.append(DemoRow(case.name, strategy, case.nbytes, result.seconds, result.network_bytes, ok))
                client.reshard(name, case.src, "auto").result(timeout=600)
            except Exception as e:  # noqa: BLE001 - a failed row is reported, the demo goes on
                rows.append(DemoRow(case.name, strategy, case.nbytes, 0.0, 0, False, str(e)))
            if progress is not None:
                progress.advance(progress.task_ids[0])
        client.delete(name)
    return rows


def rows_table(rows: list[DemoRow], title: str) -> Table:
    from rich.table import Table

    table = Table(title=title)
    for col, justify in (("case", "left"), ("strategy", "left"), ("seconds", "right"), ("GB/s", "right"),
                         ("network MiB", "right"), ("verified", "center")):
        table.add_column(col, justify=justify)
    for r in rows:
        table.add_row(r.case, r.strategy, f"{r.seconds:.3f}", f"{r.gbytes_per_s:.3f}",
                      f"{r.network_bytes / MiB:.1f}", "yes" if r.verified else f"NO {r.error[:60]}")
    return table


def run_demo(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from reshard.client import Client, LocalCluster

    console = Console()
    strategies = [s for s in args.strategies.split(",") if s]
    names = {n for n in args.cases.split(",") if n}
    check_names(names, strategies)
    nbytes = int(args.nbytes_mib * MiB)
    cluster = None
    if args.planner:
        address = args.planner
    else:
        # a case the embedded cluster cannot hold is refused before it starts
        select_cases([f"host{i}" for i in range(args.hosts)], args.devices_per_host, nbytes, names)
        console.print(f"starting a planner and {args.hosts} agents x {args.devices_per_host} devices on loopback")
        cluster = LocalCluster(args.hosts, args.devices_per_host).start()
        address = cluster.address
    try:
        with (cluster.connect() if cluster else Client(address)) as client:
            agents = [a for a in client.agents() if a["up"]]
            hosts = [a["host"] for a in agents]
            per_host = min(a["num_devices"] for a in agents)
            cases = select_cases(hosts, per_host, nbytes, names)
            console.print(f"planner {address}: {len(hosts)} hosts, {len(cases)} cases x {len(strategies)} "
                          f"strategies, {args.nbytes_mib:g} MiB each")
            columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console, transient=True) as progress:
                progress.add_task("starting", total=len(cases) * len(strategies))
                rows = run_cases(client, cases, strategies, progress)
    finally:
        if cluster is not None:
            cluster.stop()
    console.print(rows_table(rows, f"reshard demo: {args.nbytes_mib:g} MiB per case, through real agents"))
    failed = [r for r in rows if not r.verified]
    if failed:
        console.print(f"[red]{len(failed)} of {len(rows)} rows failed verification[/red]")
        return 1
    console.print(f"all {len(rows)} rows verified bit for bit (blake2b of every destination shard)")
    return 0
