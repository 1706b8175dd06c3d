"""The per-host view of a program: reading a program's text (`load_program`), and what one host works out from the
program alone for every run of it (`HostLayout`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from reshard import box as boxes
from reshard.cost import sender_bytes
from reshard.host_slice import SLICE_KIND, ProgramSlice, read_slice, step_stream_count
from reshard.jsonio import loads
from reshard.many import program_from_json
from reshard.mesh import host_of
from reshard.program import MOVE, Program, Step, no_cycle_collection
from reshard.proto.errors import InvalidArgumentError
from reshard.routes import PairStreams
from reshard.server.agent.buckets import BYTES, bucket_moves
from reshard.server.agent.staging import staged_bytes, tile_plan
from reshard.server.agent.task_graph import Task, depth_order, host_tasks, local_ranks
from reshard.server.common.config import AgentConfig, PlannerConfig
from reshard.server.transport.buffers import RECYCLE_MIN_BYTES
from reshard.server.transport.session import dtype_pairs_of

__all__ = ["load_program", "HostLayout"]


def load_program(text: str, max_bytes: int = AgentConfig.max_message_bytes,
                 max_depth: int = PlannerConfig.max_json_depth) -> tuple[Program | ProgramSlice, str]:
    """A program from its JSON (or plan JSON v1, or one host's slice of a program), and the id it goes by: the id
    of the document handed over (a plan's id for plan JSON, the whole program's for a slice), which the planner's
    Execute and every peer name.

    The JSON nests no deeper than the planner reads JSON, and is no larger than the message that brings it:
    the planner's 4 MiB for a sharding would refuse the program of a 256-device all-to-all (10 MiB).

    The id the text claims is taken as it is, not worked out again from the content (a quarter of reading a
    16,000-step program): the planner's ticket for the Prepare signs the text's hash, and every host confirms the
    id with its peers before it calls them. A text without an id gets its content's."""
    with no_cycle_collection():  # a state dict's text: millions of small objects (see no_cycle_collection)
        data = loads(text, "program_json", max_bytes=max_bytes, max_depth=max_depth)
        if isinstance(data, dict) and data.get("kind") == SLICE_KIND:  # this host's part (`reshard.host_slice`)
            program = read_slice(data)
            return program, program.id
        claimed = data.get("id") if isinstance(data, dict) else None
        program = program_from_json(data, check_id=not isinstance(claimed, str))  # many tensors: with its buckets
    return program, claimed if isinstance(claimed, str) else program.id


def _dtype_of(program: Program, s: Step) -> str:
    """The dtype of the tensor step ``s`` moves, or of its first input (its output's without one)."""
    return program.tensor(s.tensor if s.kind == MOVE else (s.inputs or (s.output,))[0].tensor).dtype


class _PerStep(dict):
    """Step id -> a value worked out the first time it is asked for (a state dict's program holds millions of
    steps; a host asks about its own)."""

    def __init__(self, work_out: Callable[[int], object]):
        super().__init__()
        self._work_out = work_out

    def __missing__(self, step: int):
        value = self[step] = self._work_out(step)
        return value


class _Streams:
    """Step id -> its first stream number (`Session.streams`), from a column of them."""

    def __init__(self, first: np.ndarray):
        self._first = first

    def __getitem__(self, step: int) -> int:
        return int(self._first[step])

    def get(self, step: int, default: int = 0) -> int:
        return int(self._first[step]) if 0 <= step < len(self._first) else default


def _bytes_sent(program: Program | ProgramSlice, host: str) -> int:
    """The bytes ``host`` sends of ``program``'s moves whose sender is on it, found from the steps outside runs (a
    run's moves are its template's transfers), so that no run is made for it."""
    if isinstance(program, ProgramSlice):
        ids = np.flatnonzero(program.steps.present).tolist()
        sends = [i for i, s in zip(ids, program.steps.templates(ids))
                 if s.kind == MOVE and host_of(s.transfer.sender) == host]
        return sum(sender_bytes([m.transfer], program.tensor(m.tensor).itemsize, host)
                   for m in program.moves_at(sends))
    sends = program.step_column(lambda s: s.kind == MOVE and host_of(s.transfer.sender) == host)
    return sum(sender_bytes([s.transfer], program.tensor(s.tensor).itemsize, host)
               for s in map(program.steps.__getitem__, np.flatnonzero(sends)))


class HostLayout:
    """What a run of ``program`` on ``host`` works out from the program alone: its buckets, streams and each step's
    dtype, this host's tasks (templates: each run counts down copies), the bytes it sends, and the tiles it stages.
    A weight sync runs the same program every step, and for a state dict of hundreds of tensors working these out
    took most of a receiving agent's CPU in a job; the runtime keeps them with the parsed program."""

    def __init__(self, program: Program, host: str):
        with no_cycle_collection():  # a state dict's layout: millions of small objects (see no_cycle_collection)
            self._work_out(program, host)

    def _work_out(self, program: Program, host: str) -> None:
        self.program = program
        sliced = isinstance(program, ProgramSlice)
        if sliced and program.host != host:
            raise InvalidArgumentError(f"agent {host} was handed host {program.host}'s slice of program "
                                       f"{program.id[:12]}; each agent runs its own")
        # first step id -> the bucket that travels as that step's stream, of those this host sends, receives or
        # forwards
        self.buckets = bucket_moves(program, host)
        # Step -> its first stream number, over every step of the program (a run's counts are its template's; a
        # slice brings its steps'), and step -> its dtype, worked out for the steps this host asks about.
        if sliced:
            self.streams = dict(zip(program.standing_ids.tolist(), program.stream.tolist()))
            self.num_streams = program.num_streams
        else:
            counts = program.step_column(step_stream_count, dtype=np.int64)
            self.streams = _Streams(np.cumsum(counts) - counts)
            self.num_streams = int(counts.sum())
        leads = {g[0] for g in getattr(program, "buckets", ())}  # every bucket's stream carries bytes
        dtypes = self.dtypes = _PerStep(lambda i: BYTES if i in leads else _dtype_of(program, program.steps[i]))
        self.dtype_pairs = _PerStep(lambda i: dtype_pairs_of({i: dtypes[i]})[i])  # (not self: no cycle through it)
        self.tasks = host_tasks(program, host, self.buckets)
        # The streams numbered per pair of hosts, for the collective transport's tags (worked out as it asks)
        streams = self.streams
        self.pair_streams = PairStreams(host, [t.step for t in self.tasks], lambda i: streams.get(i, 0))
        self.bytes_total = _bytes_sent(program, host)
        self.committed = [t for t in program.tensors if t.dst is not None]
        # how many tensors the job commits, on every host: a slice holds those this host stages alone
        self.num_committed = program.num_committed if sliced else len(self.committed)
        self.committed_names = frozenset(t.name for t in self.committed)
        self.unresharded = [t.name for t in self.committed if not t.is_reshard]
        # every program tensor under its own name, those with a source, and those resharded (`Runtime.prepare`:
        # a job of a state dict's program names each of its hundreds of tensors)
        self.names = {t.name: t.name for t in program.tensors}
        self.sourced = [t.name for t in program.tensors if t.src is not None]
        self.resharded = [t.name for t in program.tensors if t.is_reshard]
        # tensor -> this host's devices' destination tiles, and how this host stages them (`staging.tile_plan`):
        # worked out once per layout, which a state dict's layers repeat (tensors of one layout share them)
        self.dst_tiles, self.tile_plans = {}, {}
        plans: dict[tuple, tuple] = {}
        for t in self.committed:
            key = (t.shape, t.src, t.dst)
            found = plans.get(key)
            if found is None:
                tiles = {d: b for d, b in t.dst.tiles(t.shape).items() if host_of(d) == host}
                found = plans[key] = (tiles, tile_plan(t, tiles) if tiles else None)
            self.dst_tiles[t.name] = found[0]
            if found[1] is not None:
                self.tile_plans[t.name] = found[1]
        self.here = [t for t in self.committed if self.dst_tiles[t.name]]  # the tensors this host stages tiles of
        self.staged = staged_bytes(self.here, host) if self.num_committed > 1 else {}
        # Every step a move that waits for nothing: the held parts of the tiles are copied beside the streams
        # (`Run._stage`).
        self.moves_only = program.moves_only
        # How the active transports run this host's tasks (`Runtime._in_order`), by index into `tasks`: whether
        # any calls a peer, then per depth the peers it calls first, the tasks that call none, and its lane units
        # (whether each runs on the lanes for small routes, and its tasks).
        self.calls_peers, self.depths = depth_order(self.tasks, host, self.step_bytes)
        local_ranks(self.tasks, self.depths)
        self.staged_later = self._staged_later()
        # Of those, the ones whose tiles a post may land a box in (`Run.stage_for`): a smaller tile is not landed in
        # place (`nixl.NixlTransport._landing`: only buffers the store's recycler keeps)
        itemsize = {t.name: t.itemsize for t in self.here}
        self.landed_later = frozenset(
            n for n in self.staged_later
            if max(boxes.volume(tile) for _, tile, _, _, _ in self.tile_plans[n].devices) * itemsize[n]
            >= RECYCLE_MIN_BYTES)
        self.receives_of = self._receives_of()
        # The host memory each of this host's bucket tasks holds while it runs, largest first: a sender packs its
        # bucket into one buffer, and every host the bucket reaches (the sender's own included) holds one per
        # device of its own that receives it, until the last byte (`buckets.Bucket`); in all, and apart for the
        # tasks of units that run on the lanes for small routes and for the others.
        small = {i for _, _, units in self.depths for on_small, unit in units if on_small for i in unit}
        held = [(i, self.buckets[t.step.id].nbytes * ((t.role == "send") + sum(host_of(r) == host
                                                                            for r in t.step.transfer.receivers)))
                for i, t in enumerate(self.tasks) if t.step.id in self.buckets and t.role in ("send", "recv")]
        self.bucket_buffers = sorted((n for _, n in held), reverse=True)
        self.small_bucket_buffers = sorted((n for i, n in held if i in small), reverse=True)
        self.large_bucket_buffers = sorted((n for i, n in held if i not in small), reverse=True)

    def _staged_later(self) -> frozenset[str]:
        """The tensors whose tiles a run on a transport that posts its first receives may stage as it posts the
        receive that lands in them, or after the posts (`Run.stage_for`, `Run.stage_rest`), rather than all before
        the first: in a program of moves alone, those written here only by receives from peers, with no part held
        here. On the lab's 2 shared cores a receiver staging a 501-tensor state dict took 10-15 ms before its
        first post, and every sender waits for its receiver's post."""
        if not self.moves_only or len(self.here) < 2:
            return frozenset()
        now: set[str] = set()
        for name, plan in self.tile_plans.items():
            if any(held is not None for _, _, _, held, _ in plan.devices):
                now.add(name)
        for task in self.tasks:
            if task.role != "recv" or task.local:
                now.update(self.tensors_of(task.step))
        return frozenset(t.name for t in self.here if t.name not in now)

    def _receives_of(self) -> dict[str, int]:
        """The tensors a run that commits may commit as its last receive of them ends (`Run.received`), each with its
        receives here: in a program of moves alone, those written here only by receives from peers (no part held
        here, no local copy). A state dict's commit then waits at the run's end only for the tensors of its last
        receives; committing 501 tensors at once held each receiver's end for 5-20 ms on the lab's 2 shared cores."""
        if not self.moves_only:
            return {}
        receives: dict[str, int] = {}
        other: set[str] = set()
        for task in self.tasks:
            names = self.tensors_of(task.step)
            if task.role != "recv":
                other.update(names)
                continue
            for name in names:
                receives[name] = receives.get(name, 0) + 1
        return {name: n for name, n in receives.items()
                if name not in other and (plan := self.tile_plans.get(name)) is not None and not plan.made_whole
                and all(held is None for _, _, _, held, _ in plan.devices)}

    def tensors_of(self, step: Step) -> list[str]:
        """The tensors move ``step`` carries: its bucket's members', where it stands for one."""
        bucket = self.buckets.get(step.id)
        return bucket.tensors if bucket is not None else [step.tensor]

    def step_bytes(self, step: Step) -> int:
        """The bytes a move step carries: its bucket's, when it stands for one."""
        bucket = self.buckets.get(step.id)
        if bucket is not None:
            return bucket.nbytes
        return boxes.volume(step.transfer.box) * self.program.tensor(step.tensor).itemsize

    def bucket_peak(self, at_once: int, small_at_once: int = 0) -> int:
        """The most bytes of bucket buffers this host holds when ``at_once`` of its tasks run together, or, with
        ``small_at_once`` (the active transports), ``at_once`` of the tasks outside the units for small routes
        and ``small_at_once`` of those."""
        if not small_at_once:
            return sum(self.bucket_buffers[:at_once])
        return sum(self.large_bucket_buffers[:at_once]) + sum(self.small_bucket_buffers[:small_at_once])

    def buckets_at_once(self, at_once: int, small_at_once: int = 0) -> int:
        """How many bucket tasks `bucket_peak` counts."""
        if not small_at_once:
            return min(at_once, len(self.bucket_buffers))
        return min(at_once, len(self.large_bucket_buffers)) + min(small_at_once, len(self.small_bucket_buffers))

    def fresh_tasks(self) -> list[Task]:
        return [copy.copy(t) for t in self.tasks]
