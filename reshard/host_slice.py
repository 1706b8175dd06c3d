"""A program cut per host: what one host's agent needs of a program, and nothing of the others' steps.

A state dict's program holds millions of steps over dozens of hosts; every host used to read all of it (48 MiB of
text for the Kimi-K2-like sync of bench/plan_quality.py) to run its own part. `HostCut` cuts a program's text per
host on the planner, and `read_slice` reads one back on the agent as a `ProgramSlice`: a program with the same id,
whose steps are only those the host takes part in (`step_hosts`), still with their ids in the whole program, and
whose runs (`reshard.program.Run`) repeat only their templates' steps of this host, with ``at``, their first step.

What a host works out from the whole program that its own steps do not say travels with its slice, as columns over
its *standing* steps (each of its steps but the members of a bucket after its first, which stand for the bucket):

============ =====================================================================================================
``depth``    the step's dependency depth in the whole program (an ``after`` may name another host's step)
``rank``     its place in the order every host runs its tasks in (`task_order`: by depth, then the moves
             round-robin over (sender host, first peer) pairs, then the other steps by id): the round-robin's
             queues hold every host's moves, so no host could work it out from its own
``stream``   its first stream number (`reshard.routes.stream_count`, counted over every step before it)
============ =====================================================================================================

and, for the whole program: its step count, its stream count, its number of committed and of resharded tensors, and
whether every step is a move that waits for nothing. The slice's tensors are those its steps name and those with a
destination tile on the host, each with ``at``, its position in the whole program's list, by which a run's renames
name tensors.

The planner signs each host's text as it signs a whole program's; the agents of a job confirm with one another the
whole program's id, which every slice carries.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from itertools import chain
from operator import itemgetter

import numpy as np

from reshard.errors import PlanValidationError
from reshard.jsonio import brief, field_of, need, quoted
from reshard.jsonio import plain as plain_text
from reshard.mesh import host_of
from reshard.program import (MOVE, PROGRAM_VERSION, MoveView, Program, Renamed, Step, StepsLike, TensorDecl,
                             layouts_of, no_cycle_collection, read_tensors, steps_text)
from reshard.routes import first_peer, hops, stream_count
from reshard.topology import Topology

__all__ = ["SLICE_KIND", "HostCut", "ProgramSlice", "StepNotHere", "read_slice", "step_hosts", "step_stream_count",
           "task_order"]

SLICE_KIND = "program_slice"


def step_hosts(s: Step) -> frozenset[str]:
    """The hosts that take part in step ``s``: a move's sender's and every host a hop of it reaches (to receive or
    to forward), a compute's or reduce's devices'."""
    if s.kind == MOVE:
        t = s.transfer
        return frozenset((host_of(t.sender), *(h.dst for h in hops(t))))
    return frozenset(map(host_of, s.participants()))


def task_order(program: Program) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lead, depth, order) of ``program``: per step, the step that stands for it (the first of its bucket, else
    itself) and its dependency depth, as int64 columns; and the standing steps in the order every host runs its
    tasks of them (``reshard.server.agent.task_graph``): by depth, then a depth's moves round-robin over (sender
    host, first peer) pairs (`interleaved_order`), then its other steps by id."""
    n = len(program.steps)
    lead = np.arange(n, dtype=np.int64)
    groups = getattr(program, "buckets", ())
    if groups:
        size = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
        members = np.fromiter(chain.from_iterable(groups), dtype=np.int64, count=int(size.sum()))
        lead[members] = np.repeat(members[np.cumsum(size) - size], size)
    depth = program.depth_column
    pairs: dict[tuple[str, str], int] = {}
    pair = program.step_column(lambda s: pairs.setdefault((host_of(s.transfer.sender), first_peer(s.transfer)),
                                                          len(pairs)) if s.kind == MOVE else -1, dtype=np.int64)
    stands = lead == np.arange(n)
    order = []
    for d in np.unique(depth[stands]).tolist():
        at_depth = stands & (depth == d)
        moves = np.flatnonzero(at_depth & (pair >= 0))
        order += [moves[interleaved_order(pair[moves])], np.flatnonzero(at_depth & (pair < 0))]
    return lead, depth, (np.concatenate(order) if order else np.zeros(0, dtype=np.int64))


def interleaved_order(pairs: np.ndarray) -> np.ndarray:
    """The positions of moves whose (sender host, first peer) pairs are numbered ``pairs`` (in step order) in
    `reshard.routes.interleaved`'s order of their transfers: round-robin over the pairs in the order each first
    appears, each pair's moves in step order (the k-th of every pair before the (k+1)-th of any)."""
    n = len(pairs)
    if not n:
        return np.zeros(0, dtype=np.int64)
    by_pair = np.argsort(pairs, kind="stable")
    ordered = pairs[by_pair]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    counts = np.diff(np.r_[starts, n])
    k = np.empty(n, dtype=np.int64)  # each move's place in its pair's queue
    k[by_pair] = np.arange(n) - np.repeat(starts, counts)
    rank = np.empty(len(starts), dtype=np.int64)  # each pair's queue by where it first appears
    rank[np.argsort(by_pair[starts])] = np.arange(len(starts))
    queue = np.empty(n, dtype=np.int64)
    queue[by_pair] = np.repeat(rank, counts)
    return np.lexsort((queue, k))


def step_stream_count(s: Step) -> int:
    """How many stream numbers step ``s`` may use (`reshard.routes.stream_count`)."""
    return stream_count(s.kind, s.transfer, len(s.devices))


def _ints(values: np.ndarray) -> str:
    return f"[{', '.join(map(str, values.tolist()))}]"


class HostCut:
    """The slices of one program, a host's text at a time (`text`): what is the same for every host (the whole
    program's columns, each tensor's and run's text) is worked out once, on the first host's."""

    def __init__(self, program: Program):
        self.program = program
        with no_cycle_collection():
            self._work_out(program)
        self._texts: dict[str, str] = {}
        self._names: dict[str, frozenset[str]] = {}
        self._interned: dict[frozenset[str], frozenset[str]] = {}
        self._lock = threading.Lock()

    def _work_out(self, program: Program) -> None:
        """What every host's slice draws from. Each step is numbered by the set of hosts that take part in it
        (`step_hosts`; a run's steps go where their template's do), and the columns kept are those of the few
        rows a host's text reads (the steps outside runs, the runs, the standing steps, the buckets), each with
        its set's number: a host's are the rows whose set holds it."""
        steps, n = program.steps, len(program.steps)
        lead, depth, order = task_order(program)
        counts = program.step_column(step_stream_count, dtype=np.int64)
        self.num_streams = int(counts.sum())
        sets: dict[frozenset[str], int] = {}
        where = program.step_column(lambda s: sets.setdefault(step_hosts(s), len(sets)), dtype=np.int64)
        self._sets = list(sets)
        self.hosts = frozenset().union(*sets)
        # the standing steps (`task_order`), with their sets, depths, ranks and first stream numbers
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(len(order))
        standing = np.sort(order)
        self._standing = (standing, where[standing], depth[standing], rank[standing],
                          (np.cumsum(counts) - counts)[standing])
        del rank, counts
        runs = self._runs = program.runs
        first = np.fromiter((x[0] for x in runs), dtype=np.int64, count=len(runs))
        count = np.fromiter((x[1] for x in runs), dtype=np.int64, count=len(runs))
        in_run = np.zeros(n + 1, dtype=np.int64)
        np.add.at(in_run, first, 1)
        np.add.at(in_run, first + count, -1)
        written = np.flatnonzero(np.cumsum(in_run[:n]) == 0)  # the steps outside runs: written out
        self._written = (written, where[written])
        self._run_first = first
        position = {t.name: i for i, t in enumerate(program.tensors)}
        self._run_texts = [
            f'{{"at": {first}, "like": {like}, "count": {count}, "rename": '
            f'[{", ".join(f"[{position[a]}, {position[b]}]" for a, b in renames)}]}}'
            for first, count, like, renames in runs]
        layout_texts, layout_of = layouts_of(program.tensors)
        self._tensor_texts = [f'{{"name": {quoted(t.name)}, "layout": {k}, "at": {i}}}'
                              for i, (t, k) in enumerate(zip(program.tensors, layout_of))]
        self._layouts_text = ", ".join(layout_texts)
        # The tensors a host's slice declares: those its steps name (the tensors named by the steps of each set,
        # a run's steps naming their template's, renamed), and those it stages a destination tile of (and
        # commits), steps or none. And each run's sets: a host's slice holds a run where one holds it.
        named: list[set[int]] = [set() for _ in self._sets]
        for i, k in zip(written.tolist(), self._written[1].tolist()):
            named[k].update(map(position.__getitem__, steps[i].named()))
        forms: dict[tuple[int, int], list[tuple[int, set[str]]]] = {}  # per template, its sets -> their names
        run_sets: list[list[int]] = []
        for first, count, like, renames in runs:
            form = forms.get((like, count))
            if form is None:
                by_set: dict[int, set[str]] = {}
                for k, s in zip(where[like:like + count].tolist(), steps[like:like + count]):
                    by_set.setdefault(k, set()).update(s.named())
                form = forms[like, count] = list(by_set.items())
            rename = dict(renames)
            for k, names in form:
                named[k].update(position[rename.get(t, t)] for t in names)
            run_sets.append([k for k, _ in form])
        self._named = [np.fromiter(x, dtype=np.int64, count=len(x)) for x in named]
        self._run_sets = (np.repeat(np.arange(len(runs)), [len(x) for x in run_sets]).astype(np.int64),
                          np.fromiter(chain.from_iterable(run_sets), dtype=np.int64))
        staged: dict[str, list[int]] = {}
        dst_hosts: dict[object, tuple[str, ...]] = {}
        for i, t in enumerate(program.tensors):
            if t.dst is not None:
                for h in dst_hosts.setdefault(t.dst, t.dst.mesh.hosts):
                    staged.setdefault(h, []).append(i)
        self._staged = {h: np.asarray(v, dtype=np.int64) for h, v in staged.items()}
        groups = getattr(program, "buckets", ())
        self._bucket_texts = [f"[{', '.join(map(str, g))}]" for g in groups]
        self._bucket_sets = where[np.fromiter((g[0] for g in groups), dtype=np.int64, count=len(groups))]
        self._committed = sum(t.dst is not None for t in program.tensors)
        self._resharded = sum(t.is_reshard for t in program.tensors)
        self._steps = steps

    def text(self, host: str) -> str:
        """``host``'s slice of the program, as JSON text (kept once written)."""
        with self._lock:
            text = self._texts.get(host)
            if text is None:
                with no_cycle_collection():
                    text = self._texts[host] = self._write(host)
        return text

    def tensors(self, host: str) -> frozenset[str]:
        """The names of the tensors ``host``'s slice declares: what a job's reads of it may name."""
        self.text(host)
        return self._names[host]

    def _write(self, host: str) -> str:
        program, steps = self.program, self._steps
        mine = np.zeros(len(self._sets), dtype=bool)  # per set, whether the host is in it
        mine[[k for k, hs in enumerate(self._sets) if host in hs]] = True
        runs_kept = np.zeros(len(self._runs), dtype=bool)
        runs_kept[self._run_sets[0][mine[self._run_sets[1]]]] = True
        runs_kept = np.flatnonzero(runs_kept)
        written = self._written[0][mine[self._written[1]]]
        # The entries in step order: each stretch of steps written out (the few outside runs) before the run it
        # precedes, the runs' entries as written once for every host.
        cuts = np.r_[0, np.searchsorted(written, self._run_first[runs_kept]), len(written)]
        stretches = np.flatnonzero(np.diff(cuts) > 0).tolist()
        texts = steps_text([[steps[i] for i in written[cuts[j]:cuts[j + 1]].tolist()] for j in stretches])
        runs_kept = runs_kept.tolist()
        run_texts, entries, at = self._run_texts, [], 0
        for j, text in zip(stretches, texts):
            entries += [run_texts[k] for k in runs_kept[at:j]]
            entries.append(text)
            at = j
        entries += [run_texts[k] for k in runs_kept[at:]]
        keep = np.zeros(len(self._tensor_texts), dtype=bool)
        for k in np.flatnonzero(mine).tolist():
            keep[self._named[k]] = True
        keep[self._staged.get(host, [])] = True
        tensors = np.flatnonzero(keep).tolist()
        names = frozenset(program.tensors[i].name for i in tensors)
        # One object for hosts whose slices declare the same tensors (a serving group's replicas): what is worked
        # out per set of them (a job's read columns) is then found by identity, not by comparing the sets
        self._names[host] = self._interned.setdefault(names, names)
        ids, sets, depth, rank, stream = self._standing
        at = mine[sets]
        buckets = np.flatnonzero(mine[self._bucket_sets]).tolist()
        # The text in pieces joined once (a serving host's is tens of megabytes: each copy of it counts).
        return "".join((
            f'{{"kind": {plain_text(SLICE_KIND)}, "version": {PROGRAM_VERSION}, "host": {quoted(host)}, '
            f'"strategy": {plain_text(program.strategy)}, "steps_total": {len(steps)}, '
            f'"num_streams": {self.num_streams}, "committed": {self._committed}, "resharded": {self._resharded}, '
            f'"moves_only": {plain_text(program.moves_only)}, "layouts": [', self._layouts_text, '], "tensors": [',
            ", ".join(itemgetter(*tensors)(self._tensor_texts)) if len(tensors) > 1 else
            "".join(self._tensor_texts[i] for i in tensors),
            '], "steps": [', ", ".join(entries), '], "buckets": [',
            ", ".join(itemgetter(*buckets)(self._bucket_texts)) if len(buckets) > 1 else
            "".join(self._bucket_texts[i] for i in buckets),
            f'], "standing": {{"ids": {_ints(ids[at])}, "depth": {_ints(depth[at])}, "rank": {_ints(rank[at])}, '
            f'"stream": {_ints(stream[at])}}}, "estimate_seconds": {plain_text(program.estimate_seconds)}, '
            f'"topology": {plain_text(program.topology.to_json())}, "id": {quoted(program.id)}}}'))


class StepNotHere(LookupError):
    """A step of the whole program that is not in this host's slice."""


class SliceSteps(Sequence):
    """A slice's steps, by their ids in the whole program: ``len`` is the whole program's step count, and a step
    this host does not take part in raises `StepNotHere`; a run's steps are made from their template's when first
    asked for, as `reshard.program.RunSteps` makes them. Iterating gives the host's steps alone, in order."""

    def __init__(self, n: int):
        self._items: list[Step | None] = [None] * n
        self.present = np.zeros(n, dtype=bool)
        self._pending: dict[int, tuple] = {}  # first step -> a run not made yet
        self._firsts: list[int] = []  # every run's first step, in order
        self._runs: list[tuple] = []
        self._forms: dict[tuple[int, int], StepsLike] = {}
        self._columns: tuple | None = None  # `_run_columns`
        self._lock = threading.RLock()  # an agent's threads read one program; a run's template may be a run

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> Step:
        if not -len(self._items) <= i < len(self._items) or not self.present[i]:
            raise StepNotHere(f"step {i} is not one of this host's steps of the program (it takes part in "
                              f"{int(self.present.sum())} of its {len(self._items)})")
        s = self._items[i]
        if s is None:
            self._make(self._run_of(i % len(self._items)))
            s = self._items[i]
        return s

    def __iter__(self) -> Iterator[Step]:
        return map(self.__getitem__, np.flatnonzero(self.present).tolist())

    def _add(self, s: Step) -> None:
        self._items[s.id] = s
        self.present[s.id] = True

    def _add_run(self, run: tuple) -> None:
        first, count, like, _ = run
        self.present[first:first + count] = self.present[like:like + count]
        self._pending[first] = run
        self._firsts.append(first)
        self._runs.append(run)

    def _run_of(self, i: int) -> tuple | None:
        k = bisect_right(self._firsts, i) - 1
        if k >= 0:
            run = self._runs[k]
            if i < run[0] + run[1]:
                return run
        return None

    def _make(self, run: tuple) -> None:
        with self._lock, no_cycle_collection():
            first, count, like, renames = run
            if self._pending.pop(first, None) is None:
                return
            at = np.flatnonzero(self.present[like:like + count]).tolist()
            template = [self[like + k] for k in at]  # (an earlier run's steps made first)
            form = self._forms.get((like, count))
            if form is None:
                form = self._forms[like, count] = StepsLike(template)
            for k, s in zip(at, form.make(first - like, Renamed(renames))):
                self._items[first + k] = s

    def _run_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict[str, str]]]:
        """Every run's first step, end and template's first step as int64 columns, and its renames (the runs are
        all read by the time a host asks)."""
        columns = self._columns
        if columns is None or len(columns[0]) != len(self._runs):
            runs, n = self._runs, len(self._runs)
            first = np.fromiter((r[0] for r in runs), dtype=np.int64, count=n)
            end = first + np.fromiter((r[1] for r in runs), dtype=np.int64, count=n)
            like = np.fromiter((r[2] for r in runs), dtype=np.int64, count=n)
            columns = self._columns = (first, end, like, [Renamed(r[3]) for r in runs])
        return columns

    def _template_rows(self, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per step of ``ids``: the run it is in (-1: none) and the step it repeats (itself outside runs), one
        level down (a run's template may be in an earlier run)."""
        at = np.asarray(ids, dtype=np.int64)
        first, end, like, _ = self._run_columns()
        if not len(first):
            return np.full(len(at), -1, dtype=np.int64), at
        k = np.searchsorted(first, at, side="right") - 1
        inside = (k >= 0) & (at < end[np.maximum(k, 0)])
        k[~inside] = -1
        return k, np.where(inside, like[np.maximum(k, 0)] + at - first[np.maximum(k, 0)], at)

    def templates(self, ids: Sequence[int]) -> list[Step]:
        """The step outside runs that each of ``ids`` repeats (itself outside runs), made already: its kind,
        transfer and devices are the step's (its id and tensors not)."""
        at = np.asarray(ids, dtype=np.int64)
        while len(at):
            k, down = self._template_rows(at)
            if (k < 0).all():
                break
            at = down
        return list(map(self._items.__getitem__, at.tolist()))

    def moves_at(self, ids: Sequence[int]) -> list[MoveView]:
        """The move steps ``ids`` as `MoveView`s, read from their templates' steps where they are in runs not
        made yet (a serving host's buckets draw a million members from runs)."""
        items, present = self._items, self.present
        runs, tops = self._template_rows(ids)
        renames = self._run_columns()[3]
        out = []
        for i, k, t in zip(ids, runs.tolist(), tops.tolist()):
            s = items[i] if present[i] else self[i]
            if s is not None:
                out.append(MoveView(s.id, s.tensor, s.transfer, s.after, s.role))
                continue
            s = items[t]
            if s is None:  # a template in an earlier run, not made
                s = self.moves_at([t])[0]
            shift = i - t
            out.append(MoveView(i, renames[k][s.tensor], s.transfer,
                                tuple([a + shift for a in s.after]) if s.after else (), s.role))
        return out


class ProgramSlice:
    """One host's part of a program (see the module's docstring): ``id`` is the whole program's; ``steps`` a
    `SliceSteps`; ``tensors`` those its steps name and those it stages a tile of; ``buckets`` those it takes part
    in; ``standing_ids`` and the ``depth``, ``rank`` and ``stream`` columns its standing steps', in id order."""

    def __init__(self, *, id: str, host: str, tensors: Sequence[TensorDecl], steps: SliceSteps,
                 buckets: tuple[tuple[int, ...], ...], standing: Mapping[str, np.ndarray], num_streams: int,
                 committed: int, resharded: int, moves_only: bool, strategy: str = "",
                 topology: Topology | None = None, estimate_seconds: float = 0.0):
        self.id = id
        self.host = host
        self.tensors = tuple(tensors)
        self.steps = steps
        self.buckets = buckets
        self.standing_ids = standing["ids"]
        self.depth, self.rank, self.stream = standing["depth"], standing["rank"], standing["stream"]
        self.num_streams = num_streams
        self.num_committed = committed
        self.num_resharded = resharded
        self.moves_only = moves_only
        self.strategy = strategy
        self.topology = topology or Topology()
        self.estimate_seconds = estimate_seconds
        self._by_name = {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorDecl:
        decl = self._by_name.get(name)
        if decl is None:
            raise PlanValidationError(f"tensor {name!r} is not declared by host {self.host}'s slice of program "
                                      f"{self.id[:12]}; it declares {[t.name for t in self.tensors][:8]}")
        return decl

    def moves_at(self, ids: Sequence[int]) -> list[MoveView]:
        """The move steps ``ids`` as `MoveView`s, without making the runs they are in."""
        return self.steps.moves_at(ids)

    def __repr__(self) -> str:
        return (f"ProgramSlice({self.id[:12]}, host={self.host!r}, {int(self.steps.present.sum())} of "
                f"{len(self.steps)} steps, {len(self.tensors)} tensors, {len(self.buckets)} buckets)")


def read_slice(data: Mapping) -> ProgramSlice:
    """A `ProgramSlice` from its JSON object (what `HostCut.text` writes). Its structure is checked (ids in range,
    a run after the template it repeats, columns of its standing steps that match them); what its steps do is not:
    the planner validated the whole program and signed this text."""
    E = PlanValidationError
    what = "program slice JSON"
    if field_of(data, "kind", "string", what, E) != SLICE_KIND:
        raise E(f"{what} has kind {brief(data.get('kind'))}, not {SLICE_KIND!r}")
    if field_of(data, "version", "integer", what, E) != PROGRAM_VERSION:
        raise E(f"{what} has version {brief(data.get('version'))}; this reader reads version {PROGRAM_VERSION}")
    n = field_of(data, "steps_total", "integer", what, E)
    tensors = read_tensors(data, {})  # the compact text's: by name and layout
    ids = [t.get("at") if isinstance(t, Mapping) else None for t in data["tensors"]]
    if not all(type(k) is int for k in ids):
        raise E(f"{what}: each tensor must give its position in the program as 'at'")
    name_at = dict(zip(ids, (t.name for t in tensors)))
    steps = SliceSteps(n)
    for i, item in enumerate(field_of(data, "steps", "array", what, E)):
        if isinstance(item, Mapping) and "like" in item:
            where = f"{what} steps entry {i} (a run)"
            first, like, count = (field_of(item, k, "integer", where, E) for k in ("at", "like", "count"))
            if not (0 <= like and 0 < count and like + count <= first and first + count <= n) or \
                    (steps._firsts and first < steps._firsts[-1] + steps._runs[-1][1]) or \
                    steps.present[first:first + count].any():
                raise E(f"{where} repeats steps {like}..{like + count - 1} as {first}..{first + count - 1}; a run "
                        f"repeats earlier steps, after the runs and steps before it, within the program's {n} steps")
            pairs = field_of(item, "rename", "array", where, E)
            # a rename of a tensor the slice does not hold names none of its steps
            renames = tuple((name_at[a], name_at[b]) for a, b in pairs if a in name_at and b in name_at)
            steps._add_run((first, count, like, renames))
            continue
        s = Step.from_json(need(item, "object", f"{what} step {i}", E), f"{what} step {i}")
        if not 0 <= s.id < n or steps.present[s.id] or (steps._runs and s.id < sum(steps._runs[-1][:2])):
            raise E(f"{what} step {i} has id {s.id}: outside the program's {n} steps, given twice, or not after the "
                    f"runs before it")
        steps._add(s)
    raw = field_of(data, "standing", "object", what, E)
    standing = {k: np.asarray(field_of(raw, k, "array", f"{what} standing", E), dtype=np.int64)
                for k in ("ids", "depth", "rank", "stream")}
    at = standing["ids"]
    if len({len(v) for v in standing.values()}) != 1 or (len(at) and (np.any(np.diff(at) <= 0) or at[0] < 0
                                                                      or at[-1] >= n or not steps.present[at].all())):
        raise E(f"{what}: its standing steps' ids, depths, ranks and streams must be columns of one length, the ids "
                f"ascending and each one of its steps")
    raw = field_of(data, "buckets", "array", what, E)
    if not ({*map(type, raw)} <= {list} and {*map(type, chain.from_iterable(raw))} <= {int}) or not all(raw):
        raise E(f"{what}: buckets must be lists of step ids; got {brief(raw)}")
    buckets = tuple(map(tuple, raw))
    members = np.fromiter(chain.from_iterable(buckets), dtype=np.int64)
    if len(members) and (members.min() < 0 or members.max() >= n or not steps.present[members].all()):
        bad = next(g for g in buckets if not all(0 <= k < n and steps.present[k] for k in g))
        raise E(f"{what}: bucket {brief(list(bad))} must list steps of the slice")
    return ProgramSlice(
        id=field_of(data, "id", "string", what, E), host=field_of(data, "host", "string", what, E),
        tensors=tensors, steps=steps, buckets=buckets, standing=standing,
        num_streams=field_of(data, "num_streams", "integer", what, E),
        committed=field_of(data, "committed", "integer", what, E),
        resharded=field_of(data, "resharded", "integer", what, E),
        moves_only=field_of(data, "moves_only", "boolean", what, E),
        strategy=field_of(data, "strategy", "string", what, E, default=""),
        topology=Topology.from_json(field_of(data, "topology", "object", what, E, default={})),
        estimate_seconds=field_of(data, "estimate_seconds", "number", what, E, default=0.0))

