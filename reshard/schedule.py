"""Pipeline schedules: which forward and backward each stage runs, in what order, and how long a step takes.

Notation
--------
n           number of pipeline stages, stage ``i`` in ``0 .. n-1`` (stage 0 takes the input).
m           number of microbatches, microbatch ``k`` in ``0 .. m-1``.
op          ``("F", k)`` runs the forward of microbatch ``k`` on a stage; ``("B", k)`` its backward.
boundary    ``b`` joins stage ``b`` and stage ``b+1``: activations cross it forward, gradients backward.
kind        ``"gpipe"``: every forward, then every backward.
            ``"1f1b"``: ``min(m, n-i)`` forwards, then one backward and one forward (oldest first) while
            forwards remain, then the remaining backwards (PipeDream-flush).
            ``"eager-1f1b"``: the same with a warm-up of ``min(m, 2(n-i)-1)`` forwards, so a stage produces
            each activation at least one slot before the next stage needs it and the transfer hides behind
            that stage's backward (Alpa's overlapping-friendly schedule).

``build`` knows no times; ``simulate`` runs the ops as events: a stage runs its ops in its order, one at a
time; a forward on stage ``i`` waits for that microbatch's activation from stage ``i-1``, a backward for its
gradient from stage ``i+1`` (the last stage's backward follows its own forward). A transfer starts when its
producing op ends and the boundary is free in that direction: each boundary carries one transfer at a time
each way, and transfers overlap compute.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from reshard.errors import InvalidScheduleError
from reshard.jsonio import field_of, need

__all__ = ["KINDS", "FORWARD", "BACKWARD", "SPAN_OPS", "build", "warmup", "simulate", "peak_activations",
           "median_times", "Span", "Timeline"]

FORWARD = "F"
BACKWARD = "B"
KINDS = ("gpipe", "1f1b", "eager-1f1b")


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidScheduleError(f"{name} is {value!r}; a pipeline needs a positive integer number of {name}")
    return value


def _kind(kind) -> str:
    if kind not in KINDS:
        raise InvalidScheduleError(f"schedule kind {kind!r} is not known; choose one of {', '.join(KINDS)}")
    return kind


def warmup(kind: str, stages: int, microbatches: int, stage: int) -> int:
    """How many forwards stage ``stage`` runs before its first backward."""
    if kind == "gpipe":
        return microbatches
    lead = stages - stage if kind == "1f1b" else 2 * (stages - stage) - 1
    return min(microbatches, lead)


def build(kind: str, stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """One list per stage of ``("F" | "B", microbatch)`` in the order that stage runs them."""
    kind, n, m = _kind(kind), _count("stages", stages), _count("microbatches", microbatches)
    out = []
    for i in range(n):
        ahead = warmup(kind, n, m, i)
        ops = [(FORWARD, k) for k in range(ahead)]
        for k in range(ahead, m):
            ops += [(BACKWARD, k - ahead), (FORWARD, k)]
        ops += [(BACKWARD, k) for k in range(m - ahead, m)]
        out.append(ops)
    return out


def peak_activations(ops: Sequence[tuple[str, int]]) -> int:
    """Most microbatches one stage holds at once: a forward's activations live until its backward ends."""
    held = peak = 0
    for op, _ in ops:
        held += 1 if op == FORWARD else -1
        peak = max(peak, held)
    return peak


SPAN_OPS = (FORWARD, BACKWARD, "update", "wait", "send F", "send B")


@dataclass(frozen=True)
class Span:
    """One interval of a step on one stage: an op it runs (``"F"``, ``"B"``, ``"update"``: the SGD step after
    its last backward), time it waits for a transfer (``"wait"``), or a transfer it sent, from issue to arrival
    (``"send F"``: an activation to stage+1, ``"send B"``: a gradient to stage-1). ``microbatch`` is -1 for
    ``"update"``."""

    stage: int
    op: str
    microbatch: int
    start_s: float
    end_s: float

    def __str__(self) -> str:
        return f"stage {self.stage} {self.op}{self.microbatch} {self.start_s:.3g}-{self.end_s:.3g}s"


@dataclass(frozen=True)
class Timeline:
    """One training step under a schedule, as ``simulate`` predicts it or as a pipeline runtime measured it:
    how long it took, the most microbatches' activations each stage held at once, and every span."""

    kind: str
    stages: int
    microbatches: int
    iteration_s: float
    peak_activations: tuple[int, ...]
    spans: tuple[Span, ...]

    def __str__(self) -> str:
        peaks = ", ".join(map(str, self.peak_activations))
        return (f"{self.kind} n={self.stages} m={self.microbatches}: {self.iteration_s:.4g} s per step, "
                f"peak activations per stage ({peaks})")

    def seconds(self, stage: int, op: str) -> float:
        """Total length of ``stage``'s spans of ``op``."""
        return sum(s.end_s - s.start_s for s in self.spans if s.stage == stage and s.op == op)

    def to_json(self) -> dict:
        return {"kind": self.kind, "stages": self.stages, "microbatches": self.microbatches,
                "iteration_s": self.iteration_s, "peak_activations": list(self.peak_activations),
                "spans": [[s.stage, s.op, s.microbatch, s.start_s, s.end_s] for s in self.spans]}

    @classmethod
    def from_json(cls, data) -> "Timeline":
        err = InvalidScheduleError
        need(data, "object", "timeline", err)
        kind = _kind(field_of(data, "kind", "string", "timeline", err))
        n = _count("stages", field_of(data, "stages", "integer", "timeline", err))
        m = _count("microbatches", field_of(data, "microbatches", "integer", "timeline", err))
        spans = []
        for i, row in enumerate(field_of(data, "spans", "array", "timeline", err)):
            what = f"timeline span {i}"
            if not (isinstance(row, (list, tuple)) and len(row) == 5):
                raise err(f"{what} is {row!r}; a span is [stage, op, microbatch, start_s, end_s]")
            stage, op, k = need(row[0], "integer", what, err), need(row[1], "string", what, err), need(
                row[2], "integer", what, err)
            start, end = need(row[3], "number", what, err), need(row[4], "number", what, err)
            if not 0 <= stage < n or op not in SPAN_OPS or not -1 <= k < m or end < start:
                raise err(f"{what} is {row!r}; it needs 0 <= stage < {n}, op in {SPAN_OPS}, "
                          f"-1 <= microbatch < {m} and start_s <= end_s")
            spans.append(Span(stage, op, k, float(start), float(end)))
        peaks = field_of(data, "peak_activations", "array", "timeline", err)
        if len(peaks) != n:
            raise err(f"timeline peak_activations has {len(peaks)} values for {n} stages")
        return cls(kind, n, m, float(field_of(data, "iteration_s", "number", "timeline", err)),
                   tuple(need(p, "integer", "timeline peak_activations", err) for p in peaks), tuple(spans))


def median_times(timeline: Timeline) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """From a measured step: per stage the median forward and backward seconds, per boundary the median
    transfer seconds (activations and gradients together), as ``simulate`` takes them. Raises when a stage ran
    no forward or backward, or a boundary carried nothing."""
    n = timeline.stages

    def median(what: str, values: list[float]) -> float:
        if not values:
            raise InvalidScheduleError(f"the timeline has no {what} to take a time from")
        return statistics.median(values)

    spans = timeline.spans
    fwd = tuple(median(f"forward on stage {i}", [s.end_s - s.start_s for s in spans
                                                 if s.stage == i and s.op == FORWARD]) for i in range(n))
    bwd = tuple(median(f"backward on stage {i}", [s.end_s - s.start_s for s in spans
                                                  if s.stage == i and s.op == BACKWARD]) for i in range(n))
    xfer = tuple(median(f"transfer over boundary {b}", [
        s.end_s - s.start_s for s in spans
        if (s.op == "send F" and s.stage == b) or (s.op == "send B" and s.stage == b + 1)]) for b in range(n - 1))
    return fwd, bwd, xfer


def _per(name: str, value, count: int, what: str) -> tuple[float, ...]:
    values = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value] * count
    if len(values) != count:
        raise InvalidScheduleError(f"{name} has {len(values)} values; give one number or one per {what} ({count})")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise InvalidScheduleError(f"{name} has {v!r}; times are finite numbers of seconds, zero or more")
    return tuple(float(v) for v in values)


def simulate(kind: str, stages: int, microbatches: int, forward_s, backward_s, transfer_s) -> Timeline:
    """Event simulation of one step of ``build(kind, stages, microbatches)``.

    ``forward_s`` and ``backward_s`` are one number or one per stage; ``transfer_s`` one number or one per
    boundary (``stages - 1``), the same time for the activation going forward and the gradient coming back.
    """
    schedule = build(kind, stages, microbatches)
    n = stages
    fwd = _per("forward_s", forward_s, n, "stage")
    bwd = _per("backward_s", backward_s, n, "stage")
    xfer = _per("transfer_s", transfer_s, n - 1, "boundary")
    arrival: dict[tuple[str, int, int], float] = {}  # (op, stage, microbatch) -> when its input is there
    link_free: dict[tuple[int, str], float] = {}  # (boundary, op) -> when the boundary is free that way
    stage_free = [0.0] * n
    position = [0] * n
    spans: list[Span] = []

    def send(op: str, stage: int, k: int, ready: float) -> None:
        boundary, to = (stage, stage + 1) if op == FORWARD else (stage - 1, stage - 1)
        start = max(ready, link_free.get((boundary, op), 0.0))
        end = start + xfer[boundary]
        link_free[(boundary, op)] = end
        arrival[(op, to, k)] = end
        spans.append(Span(stage, f"send {op}", k, start, end))

    progressed = True
    while progressed:
        progressed = False
        for i in range(n):
            while position[i] < len(schedule[i]):
                op, k = schedule[i][position[i]]
                if op == FORWARD:
                    ready = 0.0 if i == 0 else arrival.get((FORWARD, i, k))
                else:
                    ready = arrival.get((BACKWARD, i, k))
                if ready is None:
                    break
                start = max(stage_free[i], ready)
                end = start + (fwd[i] if op == FORWARD else bwd[i])
                stage_free[i] = end
                position[i] += 1
                progressed = True
                spans.append(Span(i, op, k, start, end))
                if op == FORWARD and i < n - 1:
                    send(FORWARD, i, k, end)
                elif op == FORWARD:
                    arrival[(BACKWARD, i, k)] = end  # the last stage's loss gradient is its own
                elif i > 0:
                    send(BACKWARD, i, k, end)
    stuck = [f"stage {i} at {schedule[i][position[i]]}" for i in range(n) if position[i] < len(schedule[i])]
    assert not stuck, f"{kind} deadlocks: {', '.join(stuck)}"
    return Timeline(kind, n, microbatches, max(stage_free),
                      tuple(peak_activations(ops) for ops in schedule), tuple(spans))
