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
*units* (`lane_units`: the moves along one route, in that order, or one other task),
ordered largest first, again from the program alone. It runs a depth's units FIFO on
``lanes`` threads, each unit's tasks one after another, move units under
``SMALL_UNIT_BYTES`` FIFO on ``lanes`` threads of their own (tasks that call no peer,
local copies and computes, run beside them on the shared pool: they cannot block a
peer), and starts depth ``k + 1`` only after its own depth-``k`` tasks finished: a barrier
per host, not a global one. The tasks beside the lanes finish by themselves. Which
lanes a unit takes is again the program's to say, so each set of lanes runs one
sub-order that every host agrees on. Take the least unfinished unit in one set's order:
on each of its hosts every lower-depth task is finished (by induction on depth), so the
host is at its depth, and every unit before it in that set is finished, so it holds a
lane of the set or is next in its FIFO. Hence it runs on all its hosts at once, whatever
the other set does; its tasks come in the same order on each, and each calls only that
unit's hosts, so each completes; by induction on the order every unit of the depth does.
Before a depth's first call a host confirms, through the planner's store, that its new
peers run the same program on the same group generation (`Transport.handshake`), so a
mismatch raises instead of hanging a receive.
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

__all__ = ["Task", "host_tasks", "lane_units", "depth_order", "SMALL_UNIT_BYTES"]


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


def _route(t) -> tuple:
    """The hosts a move's streams pass, in order, and its method: moves along one route share their links."""
    if t.method == "broadcast":
        return (t.method, host_of(t.sender), *t.route)
    return (t.method, host_of(t.sender), *(host_of(r) for r in t.receivers))


def lane_units(tasks: list[Task], nbytes: Callable[[Step], int]) -> list[list[Task]]:
    """One depth's tasks that call peers (in the order every host derives alike, `host_tasks`), as the units the
    collective transport's lanes run: the moves along one route (`_route`: the same hosts in the same order) are
    one unit, run one after another in that order; any other task is a unit of its own. Units go largest first
    (``nbytes`` of a move step, summed), ties by their first task's place.

    Every host derives the same units and order from the program alone, so the module docstring's argument holds
    with units for tasks. Why: a lane held by a small move waits until every host of its route reaches it, and
    with one lane per move a few hundred small moves queue behind one another on every host while the links
    idle (a 500-tensor weight sync on 1 Gbit/s links took 1.5x its bound). A route's moves share its links
    anyway, so they lose nothing by running in turn, and the large routes, started first, keep every link busy."""
    units: dict[tuple, list[Task]] = {}
    for i, t in enumerate(tasks):
        key = _route(t.step.transfer) if t.step.kind == MOVE else ("", i)
        units.setdefault(key, []).append(t)
    place = {id(unit): n for n, unit in enumerate(units.values())}
    return sorted(units.values(), key=lambda unit: (-sum(nbytes(t.step) for t in unit if t.step.kind == MOVE),
                                                    place[id(unit)]))


def depth_order(tasks: list[Task], host: str, nbytes: Callable[[Step], int]) -> tuple[bool, list[tuple]]:
    """Whether any of ``tasks`` (one host's, `host_tasks`) calls a peer, and per depth, in order: the peers first
    called at that depth (frozenset), the indexes of its tasks that call none, and its lane units (`lane_units`),
    each as (whether it runs on the lanes for small routes: moves of under `SMALL_UNIT_BYTES` in all, its tasks'
    indexes)."""
    calls = [_task_peers(t, host) for t in tasks]
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
