"""Side-by-side plan figures for a set of cases: what the demo and the plan bench print."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reshard.cases import Case
from reshard.strategies import STRATEGIES, plan
from reshard.topology import Topology

__all__ = ["PlanRow", "compare_strategies", "format_rows"]


@dataclass(frozen=True)
class PlanRow:
    case: str
    strategy: str
    nbytes: int
    estimate_seconds: float
    lower_bound_seconds: float
    network_bytes: int
    num_transfers: int

    @property
    def ratio(self) -> float:
        return self.estimate_seconds / self.lower_bound_seconds if self.lower_bound_seconds else 1.0

    @property
    def effective_gbps(self) -> float:
        """Tensor bits over estimated seconds, as the paper's plots show bandwidth."""
        return self.nbytes * 8 / self.estimate_seconds / 1e9 if self.estimate_seconds else float("inf")


def compare_strategies(cases: Sequence[Case], topology: Topology, strategies: Sequence[str] = STRATEGIES) -> list[PlanRow]:
    rows = []
    for case in cases:
        for s in strategies:
            p = plan(case.shape, case.dtype, case.src, case.dst, topology, s).validate()
            rows.append(PlanRow(case.name, s, case.nbytes, p.estimate_seconds, p.lower_bound_seconds,
                                p.network_bytes(), len(p.transfers)))
    return rows


def format_rows(rows: Sequence[PlanRow], markdown: bool = False) -> str:
    header = ["case", "strategy", "estimate s", "lower bound s", "ratio", "effective Gbit/s", "network MiB", "transfers"]
    body = [
        [r.case, r.strategy, f"{r.estimate_seconds:.4f}", f"{r.lower_bound_seconds:.4f}", f"{r.ratio:.3f}",
         f"{r.effective_gbps:.2f}", f"{r.network_bytes / 2**20:.1f}", str(r.num_transfers)]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header)] + [fmt.format(*row) for row in body])
