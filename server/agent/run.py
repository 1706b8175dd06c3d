"""One program's run on one host (`Run`): its buffers, the memory it holds for its job, and its tasks' progress."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.program import DST, SRC, Program, Step, TensorDecl
from reshard.proto.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError
from reshard.proto.layout import tile_shape
from reshard.routes import home_receivers
from reshard.server.agent.buckets import BUCKETS_KEY
from reshard.server.agent.programs import HostLayout
from reshard.server.agent.staging import NoTiles, StagedTiles, staging_owner
from reshard.server.agent.store import ShardStore, TileBuffer
from reshard.server.agent.task_graph import Task
from reshard.server.common.sizes import format_size
from reshard.server.transport import buffers
from reshard.server.transport.base import Transport
from reshard.server.transport.deltas import DeltaStream, Segment
from reshard.server.transport.session import Session

__all__ = ["Run", "WORKING_KEY"]

# The store key a job's working buffers (`Run.produce`: a step's output that is not a destination tile) are reserved
# under, all of them together, until the job ends
WORKING_KEY = "working buffers"


class _Scratch:
    """The `Sink` of a move into a tensor that is not staged for commit: buffers made as pieces arrive."""

    def __init__(self, run: "Run", tensor: str, box: Box):
        self.run, self.tensor, self.box = run, tensor, box

    def write(self, device: str, box: Box, data) -> None:
        array, origin = self.run.produce(device, self.tensor, DST, self.box)
        buffers.write(array, box, origin, data)

    def place(self, devices: list[str], box: Box):
        return None

    place_whole = place

    def mark(self, device: str, box: Box) -> None:
        pass

    def digested(self, device: str, box: Box, digest: int) -> None:
        pass


class Run(Session):
    """One program's run on this host: its buffers, its tasks and their progress.

    Buffers, by (device, tensor, role): ``src`` is the tensor's committed shard of
    ``src_version``; ``dst`` of a tensor with a destination sharding is its tile, staged
    for the planner's commit (`staging.StagedTiles`, also the `Sink` its moves deliver
    through); every other buffer (another role, or ``dst`` of a tensor that is not
    committed) is made by the step that writes it. A bucket of moves (`buckets.Bucket`)
    runs as its first step: one stream of its members' packed bytes.
    """

    def __init__(self, job: str, program: Program, ident: str, names: dict[str, str], src_version: int,
                 dst_version: int, peers: dict[str, str], host: str, store: ShardStore, transport: Transport, *,
                 generation: int = 0, seq: int = 0, device: str = "cpu", push_tickets: dict[str, str] | None = None,
                 versions: dict[str, int] | None = None, layout: HostLayout | None = None, tasks_at_once: int = 1,
                 delta_bases: dict[str, tuple[int, int]] | None = None):
        layout = layout if layout is not None else HostLayout(program, host)
        self.layout = layout
        self.buckets = layout.buckets  # first step id -> the bucket that travels as that step's stream
        # (step id, hop) -> the sink a receive was posted into as the run began (`Runtime._prepost`): its lane's
        # take must deliver into the same one (a bucket's sink is made anew at each `destination`)
        self.presinks: dict[tuple[int, int], object] = {}
        super().__init__(job, ident, layout.dtypes, peers, generation=generation, seq=seq, streams=layout.streams,
                         num_streams=layout.num_streams, push_tickets=push_tickets, dtype_pairs=layout.dtype_pairs,
                         pair_streams=layout.pair_streams)
        self.program = program
        self.names = names  # program tensor -> the agent's store name
        self.src_version = src_version
        self.versions = versions or {}  # program tensor -> the stored version it reads, where not src_version
        self.dst_version = dst_version
        self.host = host
        self.store = store
        self.transport = transport
        self.device = device
        self.tasks = layout.fresh_tasks()
        # program tensor -> (src_version, dst_version): its moves carry delta frames (`_delta_streams`)
        self.delta_bases = dict(delta_bases or {})
        self.deltas.update(self._delta_streams())
        self.digests: dict[int, Future] = {}  # step -> XXH3-64 of its box, from a held source shard
        self.done = threading.Event()
        # Set once every unit of this host's first depth has begun on its lane (`Runtime._in_order`): a moves-only
        # run's local copies wait for it (`Runtime._copies_after_streams`)
        self.underway = threading.Event()
        self._unstarted = 0
        self.executing = False
        self.started = 0.0
        self.retired = False  # the job has ended on this host, and the runtime let the run go (`Runtime._retire`)
        self._lock = threading.Lock()
        self._awaited: dict[int, threading.Event] = {}  # id of a task a lane waits for -> set once it is ready
        self._local: list[tuple[int, int, Task]] = []  # ready local tasks of an active transport, least rank first
        self._queued = itertools.count()  # ties of rank go in the order they became ready
        self._left: dict[int, int] = defaultdict(int)  # step -> its unfinished tasks here
        self._dependents: dict[int, list[Task]] = defaultdict(list)
        for t in self.tasks:
            self._left[t.step.id] += 1
            for a in t.deps:
                self._dependents[a].append(t)
        self.steps_total = len(self._left)
        self.steps_done = 0
        self.bytes_total = layout.bytes_total
        self._made: dict[tuple[str, str, str], list[tuple[Box, Any]]] = defaultdict(list)
        self._roles: set[str] = set()  # the roles of the buffers in ``_made``: what a read without a role looks in
        self.fills: list[tuple[Any, Box, Box, Any]] = []  # (staged buffer, held box, its tile, source shard)
        # Set where the run commits its tensors here (`Runtime.execute`): each of `HostLayout.receives_of` as its last
        # receive ends (`received`), the rest at the run's end
        self.commit_early = False
        self._receives_left = dict(layout.receives_of)
        self.committed_early: set[str] = set()
        self._staging_lock = threading.Lock()  # `stage_rest` against an abort's look at what is staged (`owners`)
        self._stage(tasks_at_once)
        self.num_left = len(self.tasks) + bool(self.fills)  # the fills count as one task
        if not self.num_left:
            self.done.set()

    # -- buffers -----------------------------------------------------------------------------------------

    def _stage(self, tasks_at_once: int) -> None:
        """Stage this host's destination tiles and hold room for its bucket buffers (`_reserve_buckets`); a
        failure leaves none of the run's own transactions behind."""
        committed, several = self.layout.committed, self.layout.num_committed > 1
        unversioned = [name for name in self.layout.unresharded if name not in self.versions]
        if several and unversioned:
            raise FailedPreconditionError(
                f"job {self.job}: the program ends {self.layout.num_committed} tensors in a destination sharding "
                f"({[t.name for t in committed][:8]}); an agent commits several tensors in one job only when each is "
                f"resharded (reshard_many) or the job names its version (compute_many), and {unversioned} are neither"
            )
        # The part of a tile that the device's own source shard holds is copied in at prepare, unless every step
        # is a move that waits for nothing: those read only source shards, and no stream writes that part, so the
        # copy runs beside the streams (`fill`) instead of delaying this host's first call to its peers.
        defer = self.layout.moves_only
        # program tensor -> its tiles staged on this host; a tensor without tiles here stages nothing and has no
        # entry (a sender of a state dict has none)
        self.staging: dict[str, StagedTiles] = {}
        owners = []
        # Several tensors reserve their tiles together: one check against the memory limit, where one per tensor
        # would each pass over everything the store holds. Every tile is staged at the end, under one hold of the
        # store's lock.
        together = staging_owner(self.job, "", 2) if several else None
        # A transport that posts its first receives as the run begins stages the other tiles after those posts
        # (`stage_rest`; which they are: `HostLayout.staged_later`), held meanwhile by ``together``'s reservation.
        later = self.layout.staged_later if self.transport.preposts and several else frozenset()
        self._later = {d.name: d for d in self.layout.here if d.name in later}
        staged: list = []
        try:
            if together is not None:
                owners.append(together)
                self.store.reserve(together, self.layout.staged,
                                   f"job {self.job[:8]}'s destination tiles of {len(committed)} tensors")
            owners += self._stage_tiles([d for d in self.layout.here if d.name not in later], defer, staged,
                                        reserve=together is None)
            self.store.stage_many(staged, reserved_by=together)
            if together is not None and not self._later:
                self.store.abort(together)  # every tile is staged now, and counts as staged
            self._held = together if self._later else None  # the reservation that holds the later tiles' room
            self._reserve_buckets(tasks_at_once)
        except BaseException:
            if several:  # the job's own transaction is the planner's to abort; these are the run's
                for owner in owners:
                    self.store.abort(owner)
            raise

    def _stage_tiles(self, decls: list[TensorDecl], defer: bool, staged: list, reserve: bool) -> list[str]:
        """`StagedTiles` of each of ``decls`` into `staging`, their buffers appended to ``staged`` (for
        `ShardStore.stage_many`), each reserving its own room unless the caller holds it (``reserve``); returns their
        store transactions."""
        owners = []
        empty = self.store.empty if self.device == self.store.device else self.empty  # asked per tile: bound once
        plans, num_committed = self.layout.tile_plans, self.layout.num_committed
        for decl in decls:
            name = decl.name
            owners.append(staging_owner(self.job, name, num_committed))
            tiles = StagedTiles(self.job, decl, self.names[name], owners[-1], self.store, self.version(name), empty,
                                defer, plans[name], staged, reserve=reserve)
            self.staging[name] = tiles
            if tiles.fills:
                self.fills += tiles.fills
        return owners

    def stage_for(self, step: Step) -> None:
        """Stage the tiles move ``step`` may land in that `_stage` left for later, as its receive is posted. Of a
        bucket's members, those a post lands a box in (`HostLayout.landed_later`): the smaller ones, which their
        bytes reach through the bucket's buffer and a copy as the bucket is unpacked (its sink finds each member's
        tiles then), wait for `stage_rest` after the run's first posts. 300 of the weight-sync bench's 501 tensors
        are such, and staging them held up each receiver's first posts, which every sender waits for."""
        if self._later:
            names = self.layout.tensors_of(step)
            if step.id in self.buckets:
                landed = self.layout.landed_later
                names = [n for n in names if n in landed]
            with self._staging_lock:
                self._stage_later([d for n in names if (d := self._later.pop(n, None)) is not None], self._held)

    def stage_rest(self) -> None:
        """Stage every tile `_stage` left for later (none is held in part here, so none has a fill): once the run's
        first receives are posted. Where the run failed first, or an abort took its transactions (`owners`),
        nothing is staged; either way the reservation that held their room ends."""
        if self._held is None:
            return
        with self._staging_lock:
            held, self._held = self._held, None
            if held is None:
                return
            try:
                decls, self._later = list(self._later.values()), {}
                self._stage_later(decls, held)
            finally:
                self.store.abort(held)  # the room left is free again (all of it, after a failure)

    def _stage_later(self, decls: list[TensorDecl], held: str) -> None:
        """Stage ``decls``' tiles into the room ``held`` holds for them (`_stage`); under the staging lock."""
        if decls and self.failed is None:
            staged: list = []
            try:
                self._stage_tiles(decls, self.layout.moves_only, staged, reserve=False)
                self.store.stage_many(staged, reserved_by=held)
            except BaseException:
                self._later = {}
                raise

    def owners(self) -> list[str]:
        """The store transactions of the run's staged tiles, and of the room still held for tiles to stage, for an
        abort to end: nothing is staged after this (`stage_rest`)."""
        with self._staging_lock:
            self._later, held, self._held = {}, self._held, None
            return [s.owner for s in self.staging.values()] + ([held] if held is not None else [])

    def _reserve_buckets(self, tasks_at_once: int) -> None:
        """Hold room, until the job ends here, for the bucket buffers of the ``tasks_at_once`` tasks that may run
        together here: they are allocated as the job runs, and a job over the memory limit is refused now, not
        part way. The job ends at its commit or abort, or at the run's end on a host that commits nothing
        (`Runtime._end_if_over`). A cuda agent's limit is its GPU's memory, and bucket buffers are host memory:
        none is held."""
        # Active transports run as many tasks again on the lanes for small routes (`Runtime._in_order`).
        small = 0 if self.transport.passive else tasks_at_once
        peak = self.layout.bucket_peak(tasks_at_once, small)
        if not peak or self.store.device != "cpu":
            return
        n = self.layout.buckets_at_once(tasks_at_once, small)
        self.store.reserve(self.job, {BUCKETS_KEY: peak},
                           f"job {self.job[:8]}'s bucket buffers ({n} of its {len(self.layout.bucket_buffers)} "
                           f"packed streams here at once, up to {format_size(self.layout.bucket_buffers[0])} "
                           f"each: a smaller bucket_mib packs less)")

    def _delta_streams(self) -> dict[int, DeltaStream]:
        """The move steps of this host (sent or received here) whose streams carry delta frames: a move of a
        tensor's source (role ``src``) named in ``delta_bases``, or a bucket with such a member (its other members
        go as ``full`` segments), of at least one element. Every host works out the same from the same program and
        the same signed ``delta_bases``."""
        unknown = sorted(set(self.delta_bases) - {t.name for t in self.program.tensors})
        if unknown:
            raise InvalidArgumentError(f"job {self.job}: delta_bases name tensors {unknown[:5]} that its program does "
                                       f"not have; it has {[t.name for t in self.program.tensors][:5]}")
        out: dict[int, DeltaStream] = {}
        if not self.delta_bases:
            return out
        for task in self.tasks:
            step = task.step
            if task.role not in ("send", "recv") or step.id in out:
                continue
            bucket = self.buckets.get(step.id)
            if bucket is not None:
                parts = [(m, tensor, box, lo, hi, kind.itemsize)
                         for m, (tensor, box, lo, hi, kind, _) in zip(bucket.members, bucket.parts)]
            else:
                itemsize = self.program.tensor(step.tensor).itemsize
                parts = [(step, step.tensor, step.transfer.box, 0, boxes.volume(step.transfer.box) * itemsize,
                          itemsize)]
            segments = tuple(
                Segment(tensor, self.names.get(tensor, tensor), box, lo, hi, itemsize,
                        self.delta_bases.get(tensor) if m.role == SRC and self.program.tensor(tensor).src is not None
                        else None)
                for m, tensor, box, lo, hi, itemsize in parts)
            nbytes = segments[-1].hi if segments else 0
            if nbytes and any(seg.versions is not None for seg in segments):
                sender = step.transfer.sender
                if task.role == "send":  # this host sends it: a frame shared by the steps of the same box
                    self.frames.expect((sender, segments))
                out[step.id] = DeltaStream(step.id, sender, segments, nbytes,
                                           lambda k, segments=segments, sender=sender:
                                           self._delta_base(sender, segments[k], 0),
                                           lambda device, k, segments=segments:
                                           self._delta_base(device, segments[k], 1))
        return out

    def _delta_base(self, device: str, seg: Segment, side: int) -> np.ndarray | None:
        """``seg``'s box of its base version on ``device``: ``src_version`` (side 0, the sender), as the region of
        its tile where that is host numpy (strided or not: the sender's encode reads it in place), or
        ``dst_version`` (side 1, a receiver), as packed bytes; None where ``device`` holds no tile of it with the
        box."""
        shard = self.store.find(seg.name, seg.versions[side], device)
        if shard is None or not boxes.contains(shard.tile, seg.box):
            return None
        view = buffers.region(shard.array, seg.box, shard.tile)
        if type(view) is np.ndarray and (side == 0 or view.flags.c_contiguous):  # the common cases, kept short
            return view if side == 0 else view.reshape(-1).view(np.uint8)
        return np.frombuffer(buffers.host_bytes(view), dtype=np.uint8)

    def commit_version(self, tensor: str) -> int:
        """The version program tensor ``tensor`` commits as: ``dst_version``, except in a job that commits several
        tensors, where a resharded one, read at a version of its own (``versions``), commits as the version after
        it, and one the program makes (no ``src``) as the version the job names for it (compute_many)."""
        if self.layout.num_committed > 1 and tensor in self.versions:
            return self.versions[tensor] + (self.program.tensor(tensor).src is not None)
        return self.dst_version

    def version(self, tensor: str) -> int:
        """The stored version of program tensor ``tensor`` that its ``src`` tiles are."""
        return self.versions.get(tensor, self.src_version)

    def read(self, device: str, tensor: str, box: Box, role: str | None = None) -> tuple[Any, Box]:
        """A buffer of ``device`` that holds ``box`` of ``tensor`` in ``role``, and the box that buffer holds:
        the source shard, the staged tile once earlier steps delivered ``box``, or a buffer an earlier step made.
        ``role`` None is what a move of role ``"src"`` reads, as a plan's transfer does: the source shard, else
        any buffer that holds the box (``"dst"`` first, then the other roles by name)."""
        shard = None
        # A tensor the program declares without ``src`` is made by its steps: a stored tensor of the same name (an
        # output that replaces an older version) is none of its data.
        if role in (None, SRC) and self.program.tensor(tensor).src is not None:
            shard = self.store.find(self.names.get(tensor, tensor), self.version(tensor), device)
            if shard is not None and boxes.contains(shard.tile, box):
                return shard.array, shard.tile
        staged = self.staging.get(tensor) if role in (None, DST) else None
        held = staged.holding(device, box) if staged is not None else None
        if held is not None:
            return held
        with self._lock:
            held = [(b, a) for r in ((role,) if role else (DST, *sorted(self._roles - {DST})))
                    for b, a in self._made.get((device, tensor, r), ())]
        made = [(b, a) for b, a in held if boxes.contains(b, box)]
        if made:
            return made[-1][1], made[-1][0]
        if role in (None, SRC) and shard is not None:
            held.append((shard.tile, shard.array))
        if not boxes.uncovered(box, [b for b, _ in held]):
            return self._assemble(box, held, self.program.tensor(tensor).dtype), box
        what = f"{tensor!r} in role {role!r}" if role else repr(tensor)
        raise FailedPreconditionError(
            f"job {self.job}: agent {self.host} holds no data of box {boxes.box_str(box)} of {what} for device "
            f"{device}"
        )

    def source_shards(self, device: str, tensors: list[str]) -> list[TileBuffer | None]:
        """``device``'s source shard of each of ``tensors`` (program tensors with a ``src``), at the version this
        run reads: what `read` looks at first, under one hold of the store's lock."""
        return self.store.find_many([(self.names.get(t, t), self.version(t), device) for t in tensors])

    def _assemble(self, box: Box, pieces: list[tuple[Box, Any]], dtype: str):
        """A new buffer of ``box``, copied from the buffers ``pieces`` (held box, buffer) that cover it together:
        a tile that moves delivered in several boxes, read whole by a compute step."""
        out = self.empty(tile_shape(box), dtype)
        for held, array in pieces:
            part = boxes.intersect(held, box)
            if part is not None:
                buffers.write(out, part, box, buffers.region(array, part, held))
        return out

    def empty(self, shape: tuple[int, ...], dtype: str):
        """A new buffer on this run's device, recycled by the store when it can be."""
        if self.device == self.store.device:
            return self.store.empty(shape, dtype)
        return buffers.empty(shape, dtype, self.device)

    def recycle(self) -> None:
        """The run has ended: the buffers its steps made go back to the store for reuse, and its delta streams,
        whose base readers refer back to the run, are dropped: that cycle would keep the run's staged tiles alive
        after their version is freed, until Python's cycle collector happens to run."""
        self.deltas.clear()
        with self._lock:
            made = [a for arrays in self._made.values() for _, a in arrays]
            self._made.clear()
            self._roles.clear()
        for array in made:
            self.store.recycle(array)

    def produce(self, device: str, tensor: str, role: str, box: Box) -> tuple[Any, Box]:
        """The buffer a step writes ``box`` of ``tensor`` in ``role`` into on ``device``, and the box it holds:
        the staged tile for the committed tensor's ``dst``, else a buffer made for ``box`` (once)."""
        if role == DST and tensor in self.layout.committed_names:
            staged = self.staging.get(tensor)
            if staged is None:
                raise NoTiles(self.job, self.names[tensor]).error(device, box)
            return staged.produce(device, box)
        with self._lock:
            made = self._made[(device, tensor, role)]
            for b, a in made:
                if b == box:
                    return a, b
            decl = self.program.tensor(tensor)
            if self.device == self.store.device:  # counted against the limit until the job ends, as it is held
                self.store.reserve_more(self.job, WORKING_KEY, boxes.volume(box) * decl.itemsize,
                                        f"job {self.job[:8]}'s working buffer of {tensor!r} in role {role!r} "
                                        f"{boxes.box_str(box)} on device {device}")
            array = self.empty(tile_shape(box), decl.dtype)
            made.append((box, array))
            self._roles.add(role)
            return array, box

    def sink(self, tensor: str, box: Box):
        """Where a move of ``box`` of ``tensor`` delivers on this host."""
        staged = self.staging.get(tensor)
        if staged is not None:
            return staged
        if tensor in self.layout.committed_names:
            return NoTiles(self.job, self.names[tensor])
        return _Scratch(self, tensor, box)

    def executed(self, index: int) -> Step:
        """Step ``index`` as this host runs it: a bucket's first step is the move of the whole bucket."""
        bucket = self.buckets.get(index)
        return bucket.step if bucket is not None else self.program.steps[index]

    def source(self, step: Step) -> tuple[Any, Box]:
        """What the sender of move ``step`` (as `executed` gives it) reads, and the box that buffer holds."""
        bucket = self.buckets.get(step.id)
        if bucket is not None:
            def read(device: str, tensor: str, box: Box):
                return self.read(device, tensor, box)

            # A delta stream diffs member by member (`deltas.encode_frame` reads `Segments`): packing the new
            # bytes into one buffer first would copy every member for nothing.
            if (self.transport.scatters or step.id in self.deltas) and not home_receivers(bucket.step.transfer):
                gathered = bucket.gather(read, self.source_shards)
                if gathered is not None:
                    return gathered, bucket.step.transfer.box
            return bucket.pack(read, self.store.host_buffer, self.source_shards)
        t = step.transfer
        return self.read(t.sender, step.tensor, t.box, None if step.role == SRC else step.role)

    def destination(self, step: Step):
        """Where move ``step`` (as `executed` gives it) delivers on this host."""
        bucket = self.buckets.get(step.id)
        if bucket is not None:
            return bucket.sink(self.sink, self.store.host_buffer, self.store.recycle, self.transport.scatters)
        return self.sink(step.tensor, step.transfer.box)

    def fill(self) -> None:
        """Copy the held parts of this host's tiles that `_stage` left for the run (counted as one task)."""
        try:
            for buf, held, tile, src in self.fills:
                self.check()
                buffers.write(buf, held, tile, buffers.region(src.array, held, src.tile))
        except BaseException as e:  # noqa: BLE001 - the run fails; Execute reports it
            self.fail(e)
            return
        with self._lock:
            self.num_left -= 1
            if not self.num_left:
                self.done.set()

    def commit_entry(self, name: str) -> tuple[str, str, int, list[str]]:
        """`ShardStore.commit_many`'s entry for staged tensor ``name``: its transaction, store name, version and
        devices."""
        staged = self.staging[name]
        return staged.owner, self.names[name], self.commit_version(name), list(staged.tiles)

    def received(self, step: Step) -> list[str]:
        """A receive of ``step`` ended here: the tensors (of `HostLayout.receives_of`) whose last receive it was."""
        done = []
        with self._lock:
            for name in self.layout.tensors_of(step):
                left = self._receives_left.get(name)
                if left is not None:
                    self._receives_left[name] = left - 1
                    if left == 1:
                        done.append(name)
        return done

    def check_complete(self) -> None:
        """Refuse the commit of a tile that still lacks elements; a tensor committed as its last receive ended was
        complete then (`Runtime._commit_received`)."""
        early = self.committed_early
        short = [(name, d, n) for name, staged in self.staging.items() if name not in early
                 for d, n in staged.short().items()]
        if short:
            name, d, n = short[0]
            raise FailedPreconditionError(
                f"job {self.job}: device {d} still lacks {n} elements of its destination tile of "
                f"{self.names[name]!r} ({len(short)} tiles incomplete); a transfer did not arrive"
            )

    # -- progress -------------------------------------------------------------------------------------

    def begin(self) -> list[Task]:
        """Start executing; returns the tasks ready now (receives excepted: they come by themselves)."""
        with self._lock:
            if self.executing:
                raise FailedPreconditionError(f"job {self.job} is already executing on agent {self.host}")
            self.executing = True
            self.started = time.monotonic()
            return [t for t in self.tasks if t.role != "recv" and not t.waiting and not t.finished]

    def units_to_start(self, n: int) -> None:
        """This host's first depth has ``n`` lane units; `underway` is set once each has begun (`unit_started`)."""
        with self._lock:
            self._unstarted = n
            if n <= 0:
                self.underway.set()

    def unit_started(self) -> None:
        """One unit of this host's first depth has begun on its lane."""
        with self._lock:
            self._unstarted -= 1
            if self._unstarted <= 0:
                self.underway.set()

    def finish(self, task: Task) -> list[Task]:
        """Count ``task`` as done; returns the tasks it made ready."""
        ready = []
        with self._lock:
            if task.finished:
                return ready
            task.finished = True
            self.num_left -= 1
            self._left[task.step.id] -= 1
            if not self._left[task.step.id]:
                self.steps_done += 1
                for t in self._dependents.get(task.step.id, ()):
                    t.waiting -= 1
                    if not t.waiting and self.executing:
                        ready.append(t)
                        awaited = self._awaited.pop(id(t), None)
                        if awaited is not None:
                            awaited.set()
            if not self.num_left:
                self.done.set()
        return ready

    def queue_local(self, task: Task) -> None:
        """Hold a ready local task for the next `next_local` (active transports, `Runtime._in_order`)."""
        with self._lock:
            heapq.heappush(self._local, (task.rank, next(self._queued), task))

    def next_local(self) -> Task:
        """The ready local task of least rank (`reshard.server.agent.task_graph.local_ranks`)."""
        with self._lock:
            return heapq.heappop(self._local)[2]

    def wait_ready(self, task: Task) -> bool:
        """Block until every step ``task`` waits for is done here (an active transport's lane holds its next task
        until then, `Runtime._in_order`); False where the run failed first."""
        with self._lock:
            if not task.waiting:
                return self.failed is None
            ready = self._awaited.setdefault(id(task), threading.Event())
        while not ready.wait(0.1):  # a failure sets no event: it is seen within this
            if self.failed is not None:
                return False
        return self.failed is None

    def fail(self, error: BaseException) -> BaseException:
        first = super().fail(error)
        self.done.set()
        return first

    def step_bytes(self, step: Step) -> int:
        """The bytes a move step carries: its bucket's, when it stands for one."""
        return self.layout.step_bytes(step)

    def progress(self) -> tuple[int, int, int, int]:
        """(bytes sent, bytes to send, steps done, steps) on this host; bytes as ``reshard.cost.sender_bytes``."""
        return self.traffic.sent, self.bytes_total, self.steps_done, self.steps_total

    def overdue(self) -> Task | None:
        now = time.monotonic()
        with self._lock:
            return next((t for t in self.tasks if not t.finished and t.deadline and now > t.deadline), None)

    def wait(self, poll: float, timeout: float) -> bool:
        """Wait up to ``poll`` seconds; True once the run finished or failed. Fails the run when a task is past
        its deadline (``timeout`` seconds, see ``reshard.server.agent.runtime``)."""
        if self.done.wait(poll):
            return True
        late = self.overdue()
        if late is not None:
            self.fail(DeadlineExceededError(
                f"job {self.job}: {late} on host {self.host} did not finish within {timeout:g}s"
            ))
            return True
        return False

    def result(self, timeout: float, poll: float = 0.05) -> None:
        """Wait for the run (failing it at a task's deadline, ``timeout`` per task); raises its failure."""
        while not self.wait(poll, timeout):
            pass
        self.check()
