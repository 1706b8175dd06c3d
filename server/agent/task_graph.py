"""A program's task graph on one host: the tasks a host runs for its steps (`host_tasks`), and the order the
active transports' lanes run them in (`lane_units`), which cannot deadlock (the argument below).

A program (``reshard.program``) is steps with ids and dependencies (``step.after``). On
one host a step becomes *tasks*, one per role the host has in it:

=========== ========================================================================
send        a move's sender: copies into its receivers on this host, then the box to
            the remote receivers or down the chain (`Transport.move`)
recv        one hop of a move that arrives here: write, forward, verify (`Transport.take`)
compute     a named kernel on local tiles (``reshard.server.agent.kernels``: those of ``reshard.kernels``)
reduce      this host's devices' part of a group reduce (`Transport.reduce`: a ring, or gloo's own
            all-reduce on the collective transport; a step that asks for the ``chain`` algorithm
            runs the same way, with the same result)
=========== ========================================================================

A step is *done here* when all its tasks on this host are; a task waits for the steps in its
``after`` that have tasks here (`Task.deps`). When a task starts is ``reshard.server.agent.runtime``'s
to say: on a passive transport (gRPC, memory) as soon as it is ready, on the collective transport
in the order below.

**No deadlock on the collective transport.** There a receive is a call that blocks a
lane until its peer sends, so tasks cannot simply start when ready. Every host orders
its tasks by (dependency depth, then `interleaved` order within a depth, computed from
the program alone, so every host agrees) and groups a depth's tasks that call peers into
*units* (`lane_units`: the moves along one route, in that order, dealt in turn into
`ROUTE_UNITS` units where they are large, or one other task),
ordered largest first, again from the program alone. The units of all depths, depth by
depth, make one sequence, the *order*; every dependency points back in it (a step waits
only for steps of lower depth). A host queues its units in that order, FIFO, on
``lanes`` threads, move units under ``SMALL_UNIT_BYTES`` on ``lanes`` threads of their
own, each unit's tasks one after another, a task waiting on its lane until the steps it
depends on are done here. Tasks that call no peer (*local*: copies between the host's
devices, computes) are in no unit: each starts on a pool of its own once it is ready
(`local_ranks` says which first), and never waits for a peer. There is no barrier between
depths: a depth's units are queued as soon as its new peers confirm (below), while the
depth before still runs, so a stream leaves once its tile is made, not once all are.
Take the least unfinished unit U in the order. Every unit before U is finished, on every
host. Every local task that U waits for finishes: it waits only for earlier units
(finished) and local tasks of lower depth (by induction on depth, they finish). On each
of U's hosts every unit queued before U on U's set of lanes is before U in the order,
so finished; lanes pop FIFO, so U holds a lane there or is next when one frees, and
none is held by a unit after U. So U runs on all its hosts at once; its tasks' waits
end; they come in the same order on each host and call only U's hosts, so each
completes. By induction along the order every unit does.
Before a depth's first call a host confirms, through the planner's store, that its new
peers run the same program on the same group generation (`Transport.handshake`), so a
mismatch raises instead of hanging a receive. Every host announces its program as it
starts, so these confirmations wait for no peer's earlier work.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
import numpy as np

from reshard.host_slice import ProgramSlice, step_hosts, task_order
from reshard.mesh import host_of
from reshard.program import MOVE, REDUCE, Program, Step
from reshard.routes import hop_targets, receiving_hops, sending_peers
from reshard.server.agent.buckets import Bucket, bucket_moves

__all__ = ["Task", "host_tasks", "lane_units", "depth_order", "local_ranks", "rank_order", "SMALL_UNIT_BYTES",
           "ROUTE_UNITS"]


@dataclass(eq=False)
class Task:
    """One role of this host in one step (see the module table)."""

    step: Step
    role: str  # send, recv, compute, reduce
    depth: int
    hop: int = 0
    peer: str = ""  # recv: the host the stream comes from
    deps: tuple[int, ...] = ()  # steps that must be done here first
    waiting: int = 0
    local: bool = False  # calls no peer (a compute, a copy between this host's devices): see `depth_order`
    rank: int = 0  # a local task: the place of the first lane unit that needs it (`local_ranks`), run least first
    deadline: float = 0.0  # monotonic; 0 while it has not started
    finished: bool = False

    @property
    def index(self) -> int:
        return self.step.id

    @property
    def transfer(self):
        return self.step.transfer

    def __str__(self) -> str:
        if self.role == "recv":
            return f"step {self.step.id} (hop {self.hop} of {self.step}, arriving from {self.peer})"
        return f"step {self.step.id} ({self.step})"


def host_tasks(program: Program | ProgramSlice, host: str, buckets: dict[int, Bucket] | None = None) -> list[Task]:
    """``host``'s tasks of ``program`` (or of its slice for ``host``) in the order every host derives alike
    (`reshard.host_slice.task_order`): by dependency depth, then moves round-robin over (sender, destination) host
    pairs (`interleaved`), then the other steps by id. A bucket (the program's ``buckets``) is one move, its first
    step's; a step that waits for a member of a bucket waits for that move. ``buckets`` (`bucket_moves`: by the id
    of its first step) holds those ``host`` takes part in, at least."""
    buckets = bucket_moves(program, host) if buckets is None else buckets
    steps = program.steps
    if isinstance(program, ProgramSlice):  # its standing steps are the host's, with their places in the order
        order = np.argsort(program.rank, kind="stable")
        walk = zip(program.standing_ids[order].tolist(), program.depth[order].tolist())
        leads = {m: g[0] for g in program.buckets for m in g}
    else:
        # As columns over every step (a state dict's program holds millions, most of them other hosts' and in runs
        # that need not be made, `reshard.program.RunSteps`; a run's step goes where its template's does).
        lead, depth, order = task_order(program)
        mine = program.step_column(lambda s: host in step_hosts(s))
        here = order[mine[order]]
        walk = zip(here.tolist(), depth[here].tolist())
        leads = None
    out = []
    for i, d in walk:
        s = buckets[i].step if i in buckets else steps[i]
        if s.kind == MOVE:
            t = s.transfer
            if host_of(t.sender) == host:
                out.append(Task(s, "send", d))
            out += [Task(s, "recv", d, hop, hop_targets(t, hop, host)[2]) for hop in receiving_hops(t, host)]
        else:
            out.append(Task(s, s.kind, d))
    here = {t.step.id for t in out}
    for t in out:
        if t.role != "recv":
            after = t.step.after
            if not after:
                t.deps = ()
            elif leads is None:
                t.deps = tuple(sorted(set(lead[list(after)].tolist()) & here))
            else:
                t.deps = tuple(sorted({leads.get(a, a) for a in after} & here))
            t.waiting = len(t.deps)
    return out


def _task_peers(task: Task, host: str) -> set[str]:
    """The hosts ``task`` calls on the collective transport."""
    s = task.step
    if task.role == "recv":
        _, nxt, prev = hop_targets(s.transfer, task.hop, host)
        return {prev} | ({nxt} if nxt else set())
    if task.role == "send":
        return sending_peers(s.transfer, host)
    if task.role == REDUCE:
        n = len(s.devices)
        mine = [i for i, d in enumerate(s.devices) if host_of(d) == host]
        return {host_of(s.devices[(i + k) % n]) for i in mine for k in (-1, 1)} - {host}
    return set()


# Move units smaller than this run on lanes of their own beside the others (`Runtime._in_order`): a chain of a few
# KiB is latency, not bandwidth, and need not wait until the large routes have drained.
SMALL_UNIT_BYTES = 1 << 20
# A route's moves are dealt into this many units, in turn (`lane_units`), where they hold that many small units'
# bytes: a unit's next move starts once its last has left every hop of the route, and over a chain that is once
# the last hop's link, shared with other routes, has taken it, while the first hop's link idles
ROUTE_UNITS = 2


def _route(t) -> tuple:
    """The hosts a move's streams pass, in order, and its method: moves along one route share their links."""
    if t.method == "broadcast":
        return (t.method, host_of(t.sender), *t.route)
    return (t.method, host_of(t.sender), *(host_of(r) for r in t.receivers))


def lane_units(tasks: list[Task], nbytes: Callable[[Step], int]) -> list[list[Task]]:
    """One depth's tasks that call peers (in the order every host derives alike, `host_tasks`), as the units the
    collective transport's lanes run: the moves along one route (`_route`: the same hosts in the same order) are
    one unit, run one after another in that order, or where they carry `ROUTE_UNITS` small units' bytes or more,
    dealt in turn into `ROUTE_UNITS` units; any other task is a unit of its own. Units go largest first (``nbytes``
    of a move step, summed), ties by their first task's place.

    Every host derives the same units and order from the program alone, so the module docstring's argument holds
    with units for tasks. Why: a lane held by a small move waits until every host of its route reaches it, and
    with one lane per move a few hundred small moves queue behind one another on every host while the links
    idle (a 500-tensor weight sync on 1 Gbit/s links took 1.5x its bound). A route's moves share its links
    anyway, and the large routes, started first, keep every link busy. But a move holds its unit until it has left
    every hop: on a chain (training host, serving host, its replica) the next move's first hop waited while the
    last one's relay drained into the replica's link, which other routes share. bench/weight_sync.py's emulated
    sync traced per task: each training host sent its two buckets of a route one after the other, the second
    leaving 530 ms in, after 250 ms of an idle link; dealt into two units, every move of the sync ran from the
    first 140 ms to its end. bench/link_timeline.py's serving links ran at 90% of their rate or more in 76-86% of
    the bins (58-72% before) in the run just after, but in 38-62% in one an hour busier (BENCHMARKS.md's), where
    the relays still lagged the direct streams into each serving host; the sync's seconds stayed within this
    machine's noise either way, so the gain is the idle first hop, not yet a faster sync."""
    routes: dict[tuple, list[Task]] = {}
    for i, t in enumerate(tasks):
        key = _route(t.step.transfer) if t.step.kind == MOVE else ("", i)
        routes.setdefault(key, []).append(t)

    def moved(unit: list[Task]) -> int:
        return sum(nbytes(t.step) for t in unit if t.step.kind == MOVE)

    units = []  # (bytes moved, its first task's place, the unit)
    place = {id(t): n for n, t in enumerate(tasks)}
    for unit in routes.values():
        parts = [unit[k::ROUTE_UNITS] for k in range(ROUTE_UNITS)] \
            if len(unit) >= ROUTE_UNITS and moved(unit) >= ROUTE_UNITS * SMALL_UNIT_BYTES else [unit]
        units += [(moved(part), place[id(part[0])], part) for part in parts]
    return [unit for _, _, unit in sorted(units, key=lambda u: (-u[0], u[1]))]


def depth_order(tasks: list[Task], host: str, nbytes: Callable[[Step], int]) -> tuple[bool, list[tuple]]:
    """Whether any of ``tasks`` (one host's, `host_tasks`) calls a peer, and per depth, in order: the peers first
    called at that depth (frozenset), the indexes of its tasks that call none, and its lane units (`lane_units`),
    each as (whether it runs on the lanes for small routes: moves of under `SMALL_UNIT_BYTES` in all, its tasks'
    indexes). Marks each task that calls no peer `Task.local`."""
    calls = [_task_peers(t, host) for t in tasks]
    for t, peers in zip(tasks, calls):
        t.local = not peers
    index = {id(t): i for i, t in enumerate(tasks)}
    by_depth: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        by_depth[t.depth].append(i)
    confirmed: set[str] = set()
    depths = []
    for depth in sorted(by_depth):
        at = by_depth[depth]
        peers = set().union(*(calls[i] for i in at)) - confirmed
        confirmed |= peers
        units = []
        for unit in lane_units([tasks[i] for i in at if calls[i]], nbytes):
            small = all(t.step.kind == MOVE for t in unit) and sum(nbytes(t.step) for t in unit) < SMALL_UNIT_BYTES
            units.append((small, [index[id(t)] for t in unit]))
        depths.append((frozenset(peers), [i for i in at if not calls[i]], units))
    return any(calls), depths


def rank_order(depths: list[tuple]) -> list[list[int]]:
    """The lane units of ``depths`` (`depth_order`'s answer) in the order their local tasks are made
    (`local_ranks`): the units of large routes in the lanes' order, then those of small routes (their own lanes,
    `SMALL_UNIT_BYTES`) in theirs. Why: a small unit holds none of the large lanes, and what it carries (a tensor's
    block scales, a small tile) is needed by the commit, not by a link; ranked in the lanes' order, the block scales
    of every tile a host quantizes (moved at the depth after their ``fp8_scales`` step, before the depth of the
    quantized tiles' moves) were all made before its first quantize, and the links waited for them (the kimi-k2
    sync of ``bench/moe_sync.py`` on the emulated hosts: 10.81 s median against 10.23 with large units first, six
    runs each, alternating)."""
    units = [(small, unit) for _, _, depth_units in depths for small, unit in depth_units]
    return [unit for small, unit in units if not small] + [unit for small, unit in units if small]


def local_ranks(tasks: list[Task], depths: list[tuple]) -> None:
    """Rank each local task of ``tasks`` (`depth_order` marked them, ``depths`` is its answer) by the place of the
    first unit that waits for it, directly or through other local tasks, in `rank_order`; one that no unit waits
    for ranks after every unit. An active transport runs the ready local tasks least rank first
    (`Runtime._in_order`), so the tiles the first streams need are made first, and a stream leaves while later tiles
    are still being made, instead of after all of them."""
    by_step: dict[int, list[Task]] = defaultdict(list)
    for t in tasks:
        by_step[t.step.id].append(t)
    ranked: set[int] = set()
    place = 0
    for unit in rank_order(depths):
        todo = [a for i in unit for a in tasks[i].deps]
        while todo:
            for t in by_step.get(todo.pop(), ()):
                if t.local and id(t) not in ranked:
                    ranked.add(id(t))
                    t.rank = place
                    todo.extend(t.deps)
        place += 1
    for t in tasks:
        if t.local and id(t) not in ranked:
            t.rank = place
