"""An agent's runtime: it runs the host's part of programs, many at once, each as a dependency graph of tasks.

A program becomes this host's tasks as ``reshard.server.agent.task_graph`` says (a send, receive, compute or
reduce per role the host has in a step); each run of it is a `Run` (``reshard.server.agent.run``), and the
parsed program with this host's `HostLayout` of it (``reshard.server.agent.programs``) is kept for the next.

A send, compute or reduce task starts as soon as every step in its ``after`` that has tasks here is done here
(its inputs are present, local or arrived); independent tasks overlap on a pool shared
by all programs. A receive needs nothing: a passive transport (gRPC, memory) hands the
pushed stream to `Runtime.accept` whenever it comes. Every running task has a deadline
(``step_timeout_s``; a passive receive counts from Execute, ``depth + 1`` timeouts, since
its sender may wait for earlier steps); when one passes, or any task fails, the
program fails: queued tasks never start, running ones stop at their next piece, and
nothing was written but the program's staged destination buffers, which only the
planner's commit makes visible, so every source stays intact.

On the active transports (collective, nixl) a receive blocks a lane until its peer sends, so a host runs the
tasks that call peers in the order of their lane units, depth after depth with no barrier between depths, each
task once its dependencies are done, and the tasks that call none (computes, local copies) on a pool of their own,
bounded at the kernels' threads, as soon as they are ready, those the first streams need first (`_in_order`);
``reshard.server.agent.task_graph`` proves that order cannot deadlock.

Shard buffers are read and written only through `reshard.server.transport.buffers`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from operator import itemgetter
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.host_slice import ProgramSlice, StepNotHere
from reshard.kernels import KERNELS as KERNEL_RULES
from reshard.program import COMPUTE, MOVE, REDUCE, SRC, Program, Step
from reshard.proto.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from reshard.proto.layout import Checksum, chunk_boxes, digest
from reshard.routes import first_peer
from reshard.server.agent.kernels import KERNELS
from reshard.server.agent.pace import DevicePace
from reshard.server.agent.programs import HostLayout, load_program
from reshard.server.agent.run import Run
from reshard.server.agent.store import ShardStore
from reshard.server.agent.task_graph import Task
from reshard.server.agent.threads import Spares, limit_this_thread
from reshard.server.agent.trace import TaskTrace
from reshard.server.common.config import AgentConfig
from reshard.server.common.contract import PROGRAM_NOT_HELD, PROGRAMS_KEPT, PROGRAMS_KEPT_BYTES
from reshard.server.common.tickets import program_digest
from reshard.server.transport import buffers, moves
from reshard.server.transport.base import Transport
from reshard.server.transport.session import Session, Traffic
from reshard.server.transport.streams import PushHeader

__all__ = ["Runtime"]

log = logging.getLogger(__name__)

_ENDED_KEPT = 256  # jobs that ended here whose traffic (and whether they ended with their run) a runtime keeps
_DIGEST_HERE_BYTES = 64 << 10  # a held box up to this size is digested as the job is prepared, not on the pool
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_IDLE_LANES_KEPT = 4  # a runtime's idle lane pools of each lane count (`Runtime._lanes`), for jobs that overlap
# A moves-only run's local copies wait at most this long for its first network units to begin
# (`Runtime._copies_after_streams`)
COPIES_WAIT_S = 0.05

# Parsed programs an agent keeps (`Runtime._loaded`): at most PROGRAMS_KEPT, and no more than PROGRAMS_KEPT_BYTES of
# program text in all, the newest kept whatever its size (`server.common.contract`; the planner follows the same rule).


class Runtime:
    """Runs the programs of one agent (see the module docstring); shared by all its jobs."""

    def __init__(self, host: str, store: ShardStore, transports: dict[str, Transport], *, workers: int,
                 step_timeout_s: float, device: str = "cpu", pace: DevicePace | None = None,
                 prepare_wait_s: float = AgentConfig.stall_timeout_s, compute_threads: int = 0,
                 trace: TaskTrace | None = None):
        self.host = host
        self.trace = trace  # a line per finished task (``--trace-dir``, `reshard.server.agent.trace`); None: off
        self.pace = pace  # an emulated device speed (the lab's hosts); None: kernels at this machine's speed
        self.store = store
        self.transports = dict(transports)
        self.step_timeout_s = step_timeout_s
        self.device = device  # where staged destination buffers live
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"step-{host}", initializer=limit_this_thread)
        self._digest_pool = ThreadPoolExecutor(2, thread_name_prefix=f"digest-{host}")
        self._runners = Spares(f"run-{host}")  # a thread per run in flight, each its units' scheduler (`_in_order`)
        # Active transports' local tasks (computes, copies between this host's devices): they call no peer, so a
        # pool of their own bounds them at the kernels' threads (``--compute-threads``; 0: every core) instead of
        # the steps' workers, which on a shared CPU would run dozens at once, each slower for the others. An
        # emulated device (``pace``) waits out its step's time after the kernel, holding no core: there each of the
        # host's devices must be able to wait at once, so the pool has the steps' workers.
        local_threads = workers if pace is not None else compute_threads or os.cpu_count() or 1
        self._local_pool = ThreadPoolExecutor(local_threads, thread_name_prefix=f"local-{host}",
                                              initializer=limit_this_thread)
        self._lock = threading.Lock()
        # A push may come before its job's prepare, which rides in the host's Execute (`accept`): it waits up to
        # ``prepare_wait_s`` for a prepare or an abort, which bump ``_arrivals`` and wake it.
        self.prepare_wait_s = prepare_wait_s
        self._arrived = threading.Condition(self._lock)
        self._arrivals = 0
        self._runs: dict[str, Run] = {}
        self._finished: OrderedDict[str, Traffic] = OrderedDict()
        self._over: OrderedDict[str, None] = OrderedDict()  # jobs that ended here with their run (`_end_if_over`)
        # `_loaded`'s programs with their ids and this host's layouts, most recent last
        self._programs: OrderedDict[bytes, tuple[Program, str, HostLayout, int]] = OrderedDict()  # + text length
        self._programs_bytes = 0
        # Lane pools of finished runs (`_in_order`), by lane count, for the next runs: a pool's threads would
        # otherwise be started for every job, about 0.15 ms of CPU each, eight or nine of them a job.
        self._idle_lanes: dict[int, list[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]] | None = {}  # None: closed
        for t in self.transports.values():
            t.serve(self.accept)

    # -- lifecycle ----------------------------------------------------------------------------------------

    def prepare(self, job: str, program_json: str, tensor: str, src_version: int, dst_version: int,
                peers: dict[str, str], transport: str = "grpc", generation: int = 0, seq: int = 0,
                push_tickets: dict[str, str] | None = None, reads: dict[str, tuple[str, int]] | None = None,
                program_sha256: str = "", delta_bases: dict[str, tuple[int, int]] | None = None,
                reads_at: int | None = None) -> Run:
        """Stage ``job``'s destination buffers on this host and get ready to run the program (or plan) in
        ``program_json``, or the one held under ``program_sha256`` (`_loaded`); ``tensor`` is the store's name
        of the program's reshard tensor (the one with a source and a destination sharding); its other tensors go
        by their own names. ``reads`` (a compute program) gives program tensors their stored name and version
        instead: the inputs' versions to read, and the name the output commits as. ``push_tickets`` are the
        planner's tickets for this job's pushes, by receiving host. ``delta_bases`` (program tensor ->
        (src_version, dst_version)) names the tensors whose moves carry delta frames
        (``reshard.server.transport.deltas``). ``reads_at`` stands for ``reads`` where every program tensor with a
        source reads its own name at that version (`PrepareRequest.reads_at`)."""
        if self.store.ended(job):  # an abort overtook this prepare (a paused agent), or a replayed prepare
            raise FailedPreconditionError(f"job {job} has already ended on agent {self.host}")
        link = self.transports.get(transport or "grpc")
        if link is None:
            raise FailedPreconditionError(
                f"job {job} asks agent {self.host} for the {transport} transport, but it runs "
                f"--transport {'/'.join(sorted(self.transports))}"
            )
        program, ident, layout = self._loaded(program_json, program_sha256)
        names = dict(layout.names)  # program tensor -> the store's name of it
        if reads_at is not None:
            # every tensor with a source reads its own name at that version, the resharded one too: the layout's
            # lists, not a pass over the program's tensors per job (a weight sync's hundreds, every step)
            versions = dict.fromkeys(layout.sourced, reads_at)
        else:
            resharded = layout.resharded
            # (counted over the whole program: a slice holds its host's tensors alone)
            if len(resharded) == 1 and (program.num_resharded if isinstance(program, ProgramSlice) else 1) == 1:
                names[resharded[0]] = tensor
            unknown = sorted(set(reads or ()) - set(names))
            if unknown:
                raise InvalidArgumentError(f"job {job}: reads name tensors {unknown[:5]} that its program does not "
                                           f"have")
            reads = reads or {}
            names.update(zip(reads, map(_FIRST, reads.values())))
            versions = dict(zip(reads, map(_SECOND, reads.values())))
        with self._lock:
            if job in self._runs:
                raise FailedPreconditionError(f"job {job} is already prepared on agent {self.host}")
        run = Run(job, program, ident, names, src_version, dst_version, peers, self.host, self.store, link,
                  generation=generation, seq=seq, device=self.device, push_tickets=push_tickets,
                  versions=versions, layout=layout,
                  tasks_at_once=link.lanes if not link.passive else self._workers, delta_bases=delta_bases)
        link.attach(run)
        with self._lock:
            self._runs[job] = run
            self._arrivals += 1
            self._arrived.notify_all()
        self._digest_sources(run)
        return run

    def program_bytes(self, sha256: str) -> int | None:
        """The length of the program text held under ``sha256`` (`_loaded`); None where none is."""
        with self._lock:
            hit = self._programs.get(sha256)
        return None if hit is None else hit[3]

    def _load(self, text: str) -> tuple[Program, str]:
        """The program in ``text`` and its id (`_loaded`)."""
        return self._loaded(text)[:2]

    def _loaded(self, text: str, sha256: str = "") -> tuple[Program, str, HostLayout]:
        """`load_program` of ``text`` and this host's `HostLayout` of it, kept while it is among the last
        `PROGRAMS_KEPT` distinct texts (and `PROGRAMS_KEPT_BYTES`): a weight sync hands the same program over
        every step, a pipeline each stage's few, and reading a state dict's and working out its layout take a
        large share of its job. Programs and layouts are immutable (runs copy the task templates), so runs share
        them; the key is the text's SHA-256 (``sha256``, `tickets.program_digest`, when the caller has it), so
        only the very same text hits. An empty ``text`` names a held program by ``sha256`` alone."""
        key = sha256 or program_digest(text)
        with self._lock:
            hit = self._programs.get(key)
            if hit is not None:
                self._programs.move_to_end(key)
                return hit[:3]
        if not text:
            raise NotFoundError(f"{PROGRAM_NOT_HELD}: agent {self.host} holds no program with SHA-256 {key[:16]} "
                                f"(it keeps the last {PROGRAMS_KEPT}); the planner sends its text again")
        program, ident = load_program(text)
        loaded = (program, ident, HostLayout(program, self.host))
        with self._lock:
            if key not in self._programs:
                self._programs_bytes += len(text)
            self._programs[key] = (*loaded, len(text))
            while len(self._programs) > 1 and (len(self._programs) > PROGRAMS_KEPT
                                                or self._programs_bytes > PROGRAMS_KEPT_BYTES):
                self._programs_bytes -= self._programs.popitem(last=False)[1][3]
        return loaded

    def _digest_sources(self, run: Run) -> None:
        """Start digesting, in the background, every box this host will stream from a shard it already holds.

        A sender's trailer needs the XXH3-64 of its box; computed from prepare on (xxhash
        releases the GIL), it is ready by the time the last chunk leaves, instead of adding a
        pass over the bytes to the send loop while the transfer is in flight.
        """
        for task in run.tasks:
            t = task.step.transfer if task.role == "send" else None
            # Only a move of role "src" reads the source shard (`Run.read`); one that reads another role, such as
            # the sums a reduce left, is digested as it is sent.
            # A delta stream digests its packed box as it encodes the frame (`deltas.encode_frame`).
            if t is None or task.step.role != SRC or not first_peer(t) or task.step.id in run.buckets or \
                    run.program.tensor(task.step.tensor).src is None or task.step.id in run.deltas:
                continue
            shard = self.store.find(run.names[task.step.tensor], run.version(task.step.tensor), t.sender)
            # A GPU tile is not digested here: reading it to the host for XXH3 would double its bytes' trips; a
            # CUDA IPC move digests it on the GPU, a byte stream each chunk as it goes.
            if shard is None or not boxes.contains(shard.tile, t.box) or buffers.device_of(shard.array) != "cpu":
                continue
            if shard.digest is not None and t.box == shard.tile:  # the whole tile, as its bytes arrived: no pass
                run.digests[task.step.id] = known = Future()
                known.set_result(shard.digest)
                continue
            # A box whose send reads its bytes anyway (packing a strided region chunk by chunk), or that crosses a
            # slow NIC, is digested chunk by chunk as it goes (`moves.send`): a pass of its own here would copy it
            # once more, or take the cores as every host starts the job (`Transport.digest_ahead`)
            if not run.transport.digest_ahead(buffers.region(shard.array, t.box, shard.tile)):
                continue
            dtype, np_type = run.dtype(task.step.id)
            args = (run, dtype, t.box, shard.array, shard.tile, run.transport.chunk_bytes)
            if boxes.volume(t.box) * np_type.itemsize > _DIGEST_HERE_BYTES:
                run.digests[task.step.id] = self._digest_pool.submit(_digest, *args)
                continue
            # A small box is digested here: a few microseconds, where the pool's thread switches cost more.
            run.digests[task.step.id] = digested = Future()
            try:
                digested.set_result(_digest(*args))
            except BaseException as e:  # noqa: BLE001 - the send that reads the digest raises it
                digested.set_exception(e)

    def run(self, job: str) -> Run:
        with self._lock:
            run = self._runs.get(job)
        if run is None:
            raise NotFoundError(f"agent {self.host} has no prepared job {job!r}")
        return run

    def _prepared(self, job: str) -> Run:
        """``job``'s run, waiting up to ``prepare_wait_s`` for its prepare where the job has not ended here: the
        planner hands a small job's hosts their prepare inside their Execute, all at once, so a peer's push can
        come first. An abort (the job failed elsewhere) ends the wait at once."""
        deadline = time.monotonic() + self.prepare_wait_s
        while True:
            with self._lock:
                run, seen = self._runs.get(job), self._arrivals
            if run is not None:
                return run
            if self.store.ended(job) or time.monotonic() >= deadline:
                break
            with self._lock:  # a prepare or abort since the look above bumped the count: look again at once
                if self._arrivals == seen:
                    self._arrived.wait(deadline - time.monotonic())
        raise NotFoundError(f"agent {self.host} has no prepared job {job!r}"
                            + ("" if self.store.ended(job) else f" (none came within {self.prepare_wait_s:g}s of "
                                                                 f"its first push)"))

    def execute(self, job: str, program_id: str, commit: bool = False) -> Run:
        """Start running ``job``'s tasks; returns its `Run` to wait on (`Run.wait`). ``commit``: the caller commits
        the run here as it ends (`commit`), so each tensor whose last receive ends before may commit then
        (`HostLayout.receives_of`); an abort takes those back with the rest (`ShardStore.uncommit`)."""
        run = self.run(job)
        if program_id != run.program_id:
            raise FailedPreconditionError(
                f"job {job}: execute names program {program_id[:12]} but agent {self.host} prepared program "
                f"{run.program_id[:12]}; every agent must run the same program"
            )
        run.commit_early = commit and not run.transport.passive  # a passive transport's receives end in `accept`
        ready = run.begin()
        later = self._copies_later(run, ready)
        if run.fills and not later:
            self._pool.submit(run.fill)
        if run.transport.passive:
            for task in run.tasks:
                if task.role == "recv":
                    task.deadline = run.started + self.step_timeout_s * (task.depth + 1)
            for task in ready:
                self._submit(run, task)
        elif run.tasks:
            self._runners.start(self._in_order, run, [] if later else ready)
        if later:
            self._runners.start(self._copies_after_streams, run, ready)
        self._end_if_over(run)  # a run with nothing to do here is over already
        return run

    @staticmethod
    def _copies_later(run: Run, ready: list[Task]) -> bool:
        """Whether ``run``'s local copies wait for its first network units (`_copies_after_streams`): on an active
        transport, in a program of moves alone (nothing waits for a copy but the commit), on a host that calls
        peers and has copies to make."""
        return (not run.transport.passive and run.layout.moves_only and run.layout.calls_peers
                and (bool(run.fills) or any(t.local for t in ready)))

    def _copies_after_streams(self, run: Run, ready: list[Task]) -> None:
        """A moves-only run's local copies (the held parts of its tiles, `Run.fill`, and its moves between this
        host's devices) once every unit of its first depth has begun on its lane, or after `COPIES_WAIT_S`.

        The copies need only be done by the job's end, which its network bytes set, but started with the run
        they take the cores while the hosts wake their lanes, post their receives and make their first WRITEs:
        on the lab's 2 shared cores, copies and XXH3 passes were about half of the CPU samples in the first 30 ms
        of a regroup job (`perf record -a`); with the copies waiting so, regroup's median on nixl went from 0.442 s
        to 0.427 s and allgather4's from 0.910 s to 0.893 s (medians of 6, taking turns)."""
        run.underway.wait(COPIES_WAIT_S)
        if run.failed is not None:
            return
        if run.fills:
            self._pool.submit(run.fill)
        for task in ready:
            if task.local:
                self._submit_local(run, task)

    def commit(self, job: str) -> None:
        with self._lock:
            if job in self._over:  # it ended with its run here: nothing is staged here to commit
                return
        run = self.run(job)
        if run.failed is not None:
            raise FailedPreconditionError(f"job {job} failed on agent {self.host}, so it cannot commit: {run.failed}")
        run.check_complete()
        # only tensors with destination tiles here stage any; those whose last receive ended before committed then
        self.store.commit_many([run.commit_entry(name) for name in run.staging if name not in run.committed_early],
                               by=job)
        self.store.end(job)
        self._retire(run)

    def abort(self, job: str) -> None:
        with self._lock:
            run = self._runs.get(job)
        if run is not None:
            run.fail(FailedPreconditionError(f"job {job} was aborted"))
            self._retire(run)
            for owner in run.owners():
                self.store.abort(owner)
        else:
            # Never prepared here, nor will it be (`prepare` refuses an ended job): what its peers sent for it
            # meanwhile (a nixl post held for its introduction) goes, and what comes later is dropped
            for t in self.transports.values():
                t.detach(Session(job, "", {}, {}))
        self.store.abort(job)
        # A host commits as its run ends (`commit`), before the job's other hosts end theirs: a job aborted after
        # that committed here, and what it committed goes
        self.store.uncommit(job)
        with self._lock:  # a push waiting for this job's prepare gives up now
            self._arrivals += 1
            self._arrived.notify_all()

    def _end_if_over(self, run: Run) -> None:
        """End ``run``'s job on this host once the run is over, where nothing else would: the planner asks only the
        hosts of a destination mesh to commit (those that stage tiles here), and aborts only a job that failed, so
        on a host that only sends (or relays) the job's end is its run's end. What the job reserved here (bucket
        buffers, working buffers) is free again, as a commit or an abort frees it on the other hosts; a Commit that
        comes all the same (a caller that commits every host) finds nothing to do."""
        if run.layout.here or not run.done.is_set() or run.failed is not None:
            return
        with self._lock:
            self._over[run.job] = None
            while len(self._over) > _ENDED_KEPT:
                self._over.popitem(last=False)
        self.store.end(run.job)
        self._retire(run)

    def _retire(self, run: Run) -> None:
        with self._lock:  # once, whichever ends the job first (an abort may overtake the run's own end)
            if run.retired:
                return
            run.retired = True
        run.transport.mailbox.cancel(run.job, run.failed or FailedPreconditionError(f"job {run.job} ended"))
        run.transport.detach(run)
        run.recycle()
        with self._lock:
            if self._runs.pop(run.job, None) is not None:
                self._finished[run.job] = run.traffic
                while len(self._finished) > _ENDED_KEPT:
                    self._finished.popitem(last=False)

    def traffic(self, job: str) -> Traffic:
        with self._lock:
            run = self._runs.get(job)
            if run is not None:
                return run.traffic
            if job in self._finished:
                return self._finished[job]
        raise NotFoundError(f"agent {self.host} knows no job {job!r}")

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
        if self.trace is not None:
            self.trace.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._local_pool.shutdown(wait=False, cancel_futures=True)
        self._digest_pool.shutdown(wait=False, cancel_futures=True)
        self._runners.close()
        with self._lock:  # a run that ends from now on shuts its lanes down (`_lanes_done`)
            idle, self._idle_lanes = self._idle_lanes or {}, None
        for pools in idle.values():
            for pool in (p for pair in pools for p in pair):
                pool.shutdown(wait=False)

    # -- running tasks --------------------------------------------------------------------------------------

    def _submit(self, run: Run, task: Task) -> None:
        self._pool.submit(self._run_task, run, task)

    def _submit_local(self, run: Run, task: Task) -> None:
        """Active transports: a ready task that calls no peer, on the pool of local tasks, which takes a run's ready
        ones least rank first (`Run.next_local`), not in the order they became ready."""
        run.queue_local(task)
        self._local_pool.submit(lambda: self._run_task(run, run.next_local()))

    def _run_task(self, run: Run, task: Task) -> None:
        if run.failed is not None:
            return
        task.deadline = time.monotonic() + self.step_timeout_s
        start = time.time() if self.trace is not None else 0.0
        try:
            self._perform(run, task)
            if run.commit_early and task.role == "recv":
                self._commit_received(run, task)
        except BaseException as e:  # noqa: BLE001 - the run fails; Execute reports it
            self._traced(run, task, start, False)
            run.fail(e)
            run.transport.mailbox.cancel(run.job, run.failed)
            return
        self._traced(run, task, start, True)
        ready = run.finish(task)
        for t in ready:
            # Active transports: a task that calls a peer is its lane's to start, in order (`_in_order`); one that
            # calls none starts here, as on a passive transport.
            if run.transport.passive:
                self._submit(run, t)
            elif t.local:
                self._submit_local(run, t)
        self._end_if_over(run)

    def _commit_received(self, run: Run, task: Task) -> None:
        """Commit the tensors whose last receive here ``task`` was (`Run.received`), complete, while the run goes on:
        the run's end then commits only the tensors of its last receives, and the commit's CPU is spent while the
        links still carry the rest. Nothing is visible before the planner's catalog swap, and an abort takes them
        back as it takes back the run's final commit (`ShardStore.uncommit`): by then every owner is ended, so a
        commit racing the abort either precedes its uncommit or finds nothing staged to commit."""
        # one whose tiles lack elements is left to the run's end, which names what is missing
        ready = [name for name in run.received(task.step) if name in run.staging and not run.staging[name].short()]
        if ready and run.failed is None:
            self.store.commit_many([run.commit_entry(name) for name in ready], by=run.job)
            run.committed_early.update(ready)

    def _traced(self, run: Run, task: Task, start: float, ok: bool) -> None:
        """The task's line in the trace (``--trace-dir``), if any; a diagnostic, so it never fails the task (or,
        on the failure path, keeps the run from failing as it should)."""
        if self.trace is None:
            return
        try:
            step = task.step
            nbytes = run.layout.step_bytes(step) if step.kind == MOVE else 0
            self.trace.record(run.job, task, run.names, nbytes, start, time.time(), ok)
        except Exception:  # see the docstring
            log.exception("job %s: could not trace %s", run.job, task)

    def _run_unit(self, run: Run, unit: list[Task], first: bool = False) -> None:
        """A lane's unit (`lane_units`): its tasks in order, each once the steps it waits for are done here, until
        one fails. A unit of the ``first`` depth counts as begun (`Run.unit_started`) as its first task starts."""
        for task in unit:
            if not run.wait_ready(task):
                return
            if first:
                run.unit_started()
                first = False
            self._run_task(run, task)

    def _perform(self, run: Run, task: Task) -> None:
        step, link = task.step, run.transport
        if task.role == "send":
            array, origin = run.source(step)
            link.move(run, step.id, step.transfer, run.destination(step), array, origin, run.digests.get(step.id))
            if step.id in run.buckets:  # the packed bucket is sent: its buffer goes back for the next one
                run.store.recycle(array)
        elif task.role == "recv":
            sink = run.presinks.pop((step.id, task.hop), None)
            link.take(run, step.id, step.transfer, task.hop, sink if sink is not None else run.destination(step))
        elif task.role == COMPUTE:
            self._compute(run, step)
        elif task.role == REDUCE:
            ref, out = step.inputs[0], step.output

            def read(device: str):
                array, origin = run.read(device, ref.tensor, ref.box, ref.role)
                return buffers.region(array, ref.box, origin)

            def produce(device: str, box: Box):
                return run.produce(device, out.tensor, out.role, box)

            link.reduce(run, step.id, step.devices, ref.box, step.op, step.result, step.dim, read, produce)
        else:
            raise AssertionError(f"unknown task role {task.role!r}")

    def _compute(self, run: Run, step: Step) -> None:
        kernel = KERNELS.get(step.kernel)
        if kernel is None:
            raise FailedPreconditionError(
                f"job {run.job}: step {step.id} names kernel {step.kernel!r}, which agent {self.host} does not "
                f"implement; it has {sorted(KERNELS)}"
            )
        inputs = []
        for ref in step.inputs:
            array, origin = run.read(step.device, ref.tensor, ref.box, ref.role)
            inputs.append(buffers.region(array, ref.box, origin))
        out = step.output
        array, origin = run.produce(step.device, out.tensor, out.role, out.box)
        params = dict(step.params)
        started = time.monotonic()
        kernel(inputs, buffers.region(array, out.box, origin), params)
        if self.pace is not None:
            flops = KERNEL_RULES[step.kernel].flops(tuple(tuple(a.shape) for a in inputs), params)
            self.pace.finish(step.device, flops, started, run.check)

    def _lanes(self, n: int) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """A run's own lanes: ``n`` for its units and ``n`` for its units of small routes, idle until now."""
        with self._lock:
            idle = self._idle_lanes.get(n) if self._idle_lanes is not None else None
            if idle:
                return idle.pop()
        return (ThreadPoolExecutor(n, thread_name_prefix=f"lane-{self.host}", initializer=limit_this_thread),
                ThreadPoolExecutor(n, thread_name_prefix=f"small-{self.host}", initializer=limit_this_thread))

    def _lanes_done(self, n: int, lanes: tuple[ThreadPoolExecutor, ThreadPoolExecutor], idle: bool) -> None:
        """The run that had ``lanes`` is over: kept for the next run when ``idle`` (no unit of the run is still
        queued or running on them, which could hold up that run's), else, or once the runtime is closed, shut
        down."""
        if idle:
            with self._lock:
                kept = self._idle_lanes.setdefault(n, []) if self._idle_lanes is not None else None
                if kept is not None and len(kept) < _IDLE_LANES_KEPT:
                    kept.append(lanes)
                    return
        for pool in lanes:
            pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _prepost(run: Run, firsts: list[Task]) -> None:
        """Post the receives that start the first depth's units now, as the run begins, rather than as each lane
        wakes to run its unit (`Transport.prepost`: only where the receiver posts its regions, nixl): on cores that
        agents share a lane took 3-16 ms to wake, and every sender waits for its receiver's post. All of them, not
        only each lane's first: leaving the others to their lanes took the emulated weight sync 0.968 s against
        0.956 s (rounds alternating, medians of 8)."""
        if not run.transport.preposts:
            return
        for task in firsts:
            # a delta frame lands in the transport's own buffer, posted by its lane (`moves.take`)
            if task.role != "recv" or task.waiting or run.failed is not None or run.delta(task.step.id) is not None:
                continue
            step = task.step
            run.stage_for(step)
            sink = run.destination(step)
            if moves.prepost(run.transport, run, step.id, step.transfer, task.hop, sink):
                run.presinks[(step.id, task.hop)] = sink

    def _in_order(self, run: Run, ready: list[Task]) -> None:
        """Active transports: this host's units on the transport's lanes, FIFO, in the order of their depths;
        ``ready`` (the tasks ready as the run began) and every other task that calls no peer on the pool of local
        tasks as soon as it is ready (`_submit_local`). A unit's task waits on its lane for the steps it depends
        on (`Run.wait_ready`), and a depth's units are queued as soon as its new peers confirm, not once the depth
        before is done: a move leaves as soon as its tile is made, while later tiles are still being made
        (quantized on the way, say)."""
        link = run.transport
        n = max(1, link.lanes)
        lanes, small_lanes = both = self._lanes(n)
        tasks = run.tasks  # in the layout's order: its depths name them by index
        pending: set = set()
        try:
            for task in ready:
                if task.local:
                    self._submit_local(run, task)
            if run.layout.calls_peers:
                # Announce this host's program at once, so a peer waiting at a later depth does not wait for this
                # host's earlier, local work. A host that calls no peer (a compute job's local steps) announces
                # nothing: a peer waits only for the hosts it calls, and they call it back.
                link.handshake(run, set())
            for depth, (peers, _, units) in enumerate(run.layout.depths):
                if run.failed is not None:
                    return
                if peers:
                    link.handshake(run, set(peers))
                if depth == 0:
                    firsts = [tasks[unit[0]] for _, unit in units if unit]
                    self._prepost(run, firsts)
                    run.stage_rest()  # the tiles no first receive lands in (`Run.stage_rest`), while they land
                    run.units_to_start(len(firsts))
                for small, unit in units:
                    lane = small_lanes if small else lanes
                    pending.add(lane.submit(self._run_unit, run, [tasks[i] for i in unit], depth == 0))
            while not run.done.wait(0.1):
                pass
            # Every task is done or the run failed: a finished unit's lane returns at once; a failed run's queued
            # units return at their first task (`Run.wait_ready`), and its lanes are not kept.
            pending = wait(pending, timeout=1.0 if run.failed is None else 0).not_done
        except BaseException as e:  # noqa: BLE001 - the run fails; Execute reports it
            run.fail(e)
        finally:
            self._lanes_done(n, both, not pending)

    # -- pushes ------------------------------------------------------------------------------------------

    def accept(self, header: PushHeader, items: Iterable) -> list[str] | None:
        """A stream pushed to this host (passive transports): one hop of a move, or a reduce's message."""
        run = self._prepared(header.job)
        if header.program_id != run.program_id:
            raise FailedPreconditionError(
                f"job {header.job}: push from {header.from_host} carries program {header.program_id[:12]} but agent "
                f"{self.host} prepared program {run.program_id[:12]}"
            )
        steps = run.program.steps
        try:
            step = run.executed(header.step) if 0 <= header.step < len(steps) else None
        except StepNotHere:
            raise InvalidArgumentError(f"job {header.job}: step {header.step} is not one of host {self.host}'s steps "
                                       f"of the program; it was pushed from {header.from_host}") from None
        if step is None:
            raise InvalidArgumentError(f"job {header.job}: step {header.step} is not in the program")
        if step.kind == REDUCE:
            run.transport.mailbox.deliver(header.key, items, self.step_timeout_s)
            return [self.host]
        if step.kind != MOVE:
            raise InvalidArgumentError(f"job {header.job}: step {header.step} is a {step.kind} step; nothing is "
                                       f"pushed for it")
        task = next((t for t in run.tasks if t.role == "recv" and t.step is step and t.hop == header.hop), None)
        try:
            confirmed = run.transport.take(run, step.id, step.transfer, header.hop, run.destination(step), items)
        except BaseException as e:
            run.fail(e)
            raise
        if task is not None:
            for ready in run.finish(task):
                self._submit(run, ready)
            self._end_if_over(run)
        return confirmed


def _digest(run: Run, dtype: str, box: Box, array, origin: Box, chunk_bytes: int) -> int:
    view = buffers.region(array, box, origin)
    if isinstance(view, np.ndarray) and view.flags.c_contiguous:
        return digest(view.reshape(-1).view(np.uint8))
    check = Checksum()
    for sub in chunk_boxes(box, dtype, chunk_bytes):
        run.check()
        check.update(buffers.host_bytes(buffers.region(array, sub, origin)))
    return check.xxh3_64
