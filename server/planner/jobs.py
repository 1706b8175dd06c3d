"""Reshard jobs: plan, validate, hand every agent the program, wait, commit, release.

A job reshards one tensor, runs a compute program, or (kind ``reshard_many``) reshards many tensors in one
program (`reshard.many`): it locks them all, runs once, and commits every tensor's new version in one catalog
step, so a reader sees all of them old or all of them new, and a failure leaves every one at its old version.
A job claims the versions it commits as it starts (`Catalog.claim`); the versions its commit supersedes are
released on their agents unless a pin holds them (`Catalog.commit`).

A job's life: ``queued`` (waiting for earlier jobs on the same tensor) ->
``running`` -> ``succeeded`` or ``failed``. Running, the planner makes the plan (or
takes the program planned as the request was checked, while what it was planned
from still holds: `Planned`), picks the transport, hands every host of the job the
plan once (its program of moves: ``reshard.program``) and starts it with ONE Execute per host; each agent
then runs its steps as their dependencies allow, so the planner is no barrier
between phases; it only collects progress and results. The commit point is the
catalog swap: agents stage the new version's shards and make them visible only on
commit, and the old version's shards are released only after every host finished
and every receiver committed, so a failed job leaves the source as it was. Agent
calls go through an `AgentCalls` object the service layer provides.

While agents are called, the runner watches the job's hosts every `WATCH_INTERVAL_S`: a host
whose agent is marked down (no heartbeat for ``heartbeat_timeout_s``) or was replaced, or whose
Execute stream sent no progress report for ``stall_timeout_s`` while its part runs, *stopped
answering*, and the job fails at once naming it, instead of waiting for the transports' own
timeouts. The other hosts are aborted first and the failure is published; the calls to the host
that stopped answering finish last, still under the tensor's lock, so a retry starts after them.

Delta sync (issue 40): a reshard_many moves a tensor as deltas against its base pair (`Catalog.bases`: the
versions of its previous sync, one on the senders in the sharding moved, its copy on the receivers in the
destination's) where the pair is usable and, with the request's ``delta`` unset, where the tensor's learned change
rate says it pays (`JobRunner._choose_deltas`); the Prepare names those tensors' bases (``delta_bases``). A job
whose agents find a base that differs (an error beginning `DELTA_BASE_MISMATCH`) runs once more, with every tensor
moved whole; nothing was committed by the run that failed. The job records per tensor how it moved, why,
and its bytes against a full move's (``Job.deltas``).
"""

from __future__ import annotations

import json
import logging
import operator
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from collections import Counter, OrderedDict, defaultdict
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field, replace
from functools import cached_property
from operator import attrgetter, itemgetter
from typing import NamedTuple, Protocol

import numpy as np

from reshard import box as boxes
from reshard.cost import sender_bytes
from reshard.delta import RECEIVER_PASSES, SENDER_PASSES
from reshard.host_slice import HostCut
from reshard.mesh import Mesh, host_of
from reshard.jsonio import loads, quoted
from reshard.many import plan_many, program_from_json
from reshard.partial_plan import reshard_program
from reshard.plans import Plan, Transfer
from reshard.program import REDUCE, Program, TensorDecl, no_cycle_collection
from reshard.quantize import block_of, made_scale, source_name
from reshard.routes import hops
from reshard.sequence import aliased
from reshard.strategies import plan as make_plan
from reshard.topology import Topology
from reshard.proto.errors import DeadlineExceededError, NotFoundError, UnavailableError
from reshard.server.common.config import PlannerConfig
from reshard.server.common.contract import DELTA_BASE_MISMATCH, Staging, read_columns
from reshard.server.common.sizes import format_size
from reshard.server.planner.catalog import Catalog, TensorRecord, bumped, new_content
from reshard.server.planner.locks import TensorLocks
from reshard.server.planner.membership import GroupCoordinator
from reshard.server.planner.registry import Registry
from reshard.server.planner.state import StateStore
from reshard.sharding import Sharding

__all__ = ["Job", "JobRunner", "AgentCalls", "Planned", "Preparation", "STATES", "WATCH_INTERVAL_S", "planned_from",
           "program_moves"]

log = logging.getLogger(__name__)

STATES = ("queued", "running", "succeeded", "failed")
WATCH_INTERVAL_S = 0.2  # how often the hosts of a job are checked while agent calls are out
# A gRPC job prepares inside its Execute when no host gets more pushed streams than this (`JobRunner._prepares_early`):
# with the planner's 8 concurrent jobs, at most 32 early pushes wait in an agent's 64 server threads.
EARLY_PUSHES_MAX = 4
# Delta sync, with the request's ``delta`` unset: a tensor whose last delta sync sent more than this fraction of a
# full move's bytes moves whole (a delta's indices cost more than they save); after this many such syncs it tries a
# delta again, since a training run's change rate falls as its learning rate decays.
DELTA_FULL_ABOVE = 0.9
DELTA_PROBE_EVERY = 16


_SHARDING, _VERSION, _DTYPE = attrgetter("sharding"), attrgetter("version"), attrgetter("dtype")


class _NotAnswering(UnavailableError):
    """A host of a running job stopped answering (see the module docstring)."""

    def __init__(self, host: str, why: str):
        super().__init__(f"host {host} stopped answering: {why}")
        self.host = host


def planned_from(records: Iterable[TensorRecord], topology: Topology) -> tuple:
    """What a job's program is planned from besides its request: each tensor's name, shape, dtype and sharding,
    and the topology (a version or a lost shard changes no program)."""
    return tuple((r.name, r.shape, r.dtype, r.sharding) for r in records), topology


@dataclass(frozen=True)
class Planned:
    """A job's program as its request was checked, and what it was planned from (`planned_from`).

    The job runs it if its tensors and the topology are still those when it starts; a job queued before it on
    the same tensors (or an agent that registered meanwhile) may have changed them, and then it plans again."""

    program: Program
    basis: tuple


@dataclass(frozen=True)
class Preparation:
    """What an agent needs to take part in a job: the program, the tensor's versions, its peers and transport.

    A reshard's program is its plan: plan JSON is the program-of-moves form agents read
    (``reshard.program.Program.from_json``), and the plan's id names it.
    """

    job: str
    program_json: str
    tensor: str
    src_version: int
    dst_version: int
    peers: dict[str, str]  # host -> agent address
    transport: str = "grpc"
    generation: int = 0  # collective: the process group generation
    job_seq: int = 0  # collective: the job's number, for message tags
    program_id: str = ""  # the program's id (the plan's): pushes of the job name it, and their tickets sign it
    # a compute program: program tensor -> (stored name, version) it reads, or the name its output commits as
    reads: dict[str, tuple[str, int]] = field(default_factory=dict)
    nixl_peers: dict[str, bytes] = field(default_factory=dict)  # nixl: host -> the NIXL metadata it registered
    # delta sync: program tensor -> (src_version, dst_version), the base its move's deltas start from
    delta_bases: dict[str, tuple[int, int]] = field(default_factory=dict)
    # host -> its slice of the program (`reshard.host_slice`) where it is cut per host: handed that host instead of
    # ``program_json``
    host_texts: dict[str, str] = field(default_factory=dict)
    # host -> the tensors its slice declares: its Prepare carries the reads and delta bases of those alone
    host_tensors: dict[str, frozenset[str]] = field(default_factory=dict)
    # ``reads`` is every program tensor with a source reading its own stored name at this version (a state dict
    # published in one step): Prepares say so in one number (`PrepareRequest.reads_at`), not a column per tensor
    reads_at: int | None = None
    # ``reads`` as columns, given in its place by a registered sync's job (`JobRunner._sync_work`): (program
    # tensors, the stored names they read, their versions as int64), the lists the same objects every run
    columns: tuple[list[str], list[str], np.ndarray] | None = None

    def text_for(self, host: str) -> str:
        """The program's text ``host`` is handed: its slice, or the whole program."""
        return self.host_texts.get(host, self.program_json)

    def reads_for(self, host: str) -> dict[str, tuple[str, int]]:
        """The ``reads`` ``host`` is handed: those of its slice's tensors (a state dict's job reads 139,583 tensors,
        a serving host's slice half of them), or all."""
        reads = self.reads if self.columns is None else dict(zip(self.columns[0], zip(
            self.columns[1], self.columns[2].tolist())))
        names = self.host_tensors.get(host)
        if names is None:
            return reads
        tensors, stored, versions = read_columns(reads, names)  # what its Prepare carries (the service's)
        return dict(zip(tensors, zip(stored, versions)))

    def delta_bases_for(self, host: str) -> dict[str, tuple[int, int]]:
        """The ``delta_bases`` ``host`` is handed, as `reads_for`."""
        names = self.host_tensors.get(host)
        if names is None or not self.delta_bases:
            return self.delta_bases
        return {t: b for t, b in self.delta_bases.items() if t in names}


class AgentCalls(Protocol):
    def prepare(self, host: str, address: str, prep: Preparation, timeout: float) -> None: ...

    def execute(self, host: str, address: str, job: str, program_id: str,
                on_progress: Callable[..., None], timeout: float,
                prepare: Preparation | None = None, commit: bool = False) -> dict | None:
        """Run the host's part of the whole program (preparing first when ``prepare`` is given), reporting
        ``on_progress(bytes done, bytes to send, steps done, steps, started after)`` (the last: on the first
        report, the agent's seconds from the call to its run starting; may be left out), or
        ``on_progress(loading=True)`` while the host still loads and prepares the job (alive, not started), and
        commit what it staged
        as the run ends when ``commit`` (a host that stages the job's new versions); returns the host's traffic for
        the job."""

    def commit(self, host: str, address: str, staging: Staging, tensor: str, version: int, devices: list[str],
               timeout: float, more: list[tuple[str, str, int, list[str]]] = ()) -> None:
        """Make what ``staging`` staged visible as ``tensor`` at ``version`` on ``devices``; an upload's commit
        may carry further uploads (upload id, tensor, version, devices) in ``more``, committed in order."""

    def abort(self, host: str, address: str, staging: Staging, timeout: float, more: list[str] = ()) -> None:
        """Drop what ``staging`` staged on the host; an upload's abort may name further uploads in ``more``."""

    def release(self, host: str, address: str, versions: list[tuple[str, int]], timeout: float) -> None:
        """Free every (tensor, version) of ``versions`` (at least one) on the host, in one call."""

    def forget(self, address: str) -> None:
        """No agent serves at ``address`` any more (its host registered again elsewhere): drop what is kept for it."""


@dataclass
class Job:
    """A reshard of ``tensor`` into ``dst``, or (``kind`` not "reshard") a compute job: a program that reads
    ``inputs`` and commits its output as ``tensor``, made by ``make_program`` from the inputs' records (their
    versions as the job starts) and the topology; ``dst`` is then the output's sharding, known once planned."""

    id: str
    tensor: str
    dst: Sharding | None
    strategy: str
    state: str = "queued"
    error: str = ""
    plan: Plan | None = None
    created: float = field(default_factory=time.time)
    started: float = 0.0
    finished: float = 0.0
    version: int = 0
    progress: dict[str, list[int]] = field(default_factory=dict)  # host -> [bytes done, bytes to send]
    steps: dict[str, list[int]] = field(default_factory=dict)  # host -> [steps done, steps with a part there]
    traffic: dict[str, dict] = field(default_factory=dict)  # host -> {bytes_in, bytes_out, local_bytes, native_reduces}
    transport: str = ""  # grpc, collective or nixl, once chosen
    transports: list[str] = field(default_factory=list)  # per plan transfer: grpc, collective, nixl or local
    kind: str = "reshard"  # or "reshard_many", "einsum", or the kernel of an apply
    inputs: list[str] = field(default_factory=list)  # a compute job's inputs; every tensor of a reshard_many
    program: Program | None = None  # what ran where it is no plan of moves: a compute job, a Partial tensor's reshard
    make_program: Callable[[dict[str, TensorRecord], Topology], Program] | None = field(default=None, repr=False)
    planned: Planned | None = field(default=None, repr=False)  # the program its request was checked with, if any
    dsts: dict[str, Sharding] = field(default_factory=dict)  # reshard_many: tensor -> destination
    scales: dict[str, list] = field(default_factory=dict)  # reshard_many: weight -> [its scale tensor, block or None]
    bucket_bytes: int = 0  # reshard_many: moves smaller than this are packed into buckets of at least this
    versions: dict[str, int] = field(default_factory=dict)  # reshard_many, compute_many: tensor -> its new version
    outputs: list[str] = field(default_factory=list)  # compute_many: every tensor its ops write, in order
    # reshard_many: the pin or step label that names the versions it moves (each must still be current)
    pin: str = ""
    step: int | None = None
    # Where the job's seconds went, in `PHASES` order (those it reached), and each host's Execute call, seconds
    phases: dict[str, float] = field(default_factory=dict)
    host_seconds: dict[str, float] = field(default_factory=dict)
    # the bytes of program text each host was handed: its slice where the program is cut per host, else all of it
    program_bytes: dict[str, int] = field(default_factory=dict)
    transport_reason: str = ""  # why the job runs on ``transport`` (`GroupCoordinator.choose`)
    manifest_digest: str = ""  # reshard_many: SHA-256 of the consumer's manifest it was checked against, if any
    # Delta sync (reshard_many): the request's choice (None: where it pays, False: never, True: wherever a base
    # pair is usable); per tensor {"mode": "delta" or "full", "why", "bytes" (network bytes sent), "full_bytes"
    # (a full move's), "expected" (what the plan priced it at: rate x full for a delta)}; the job's network bytes
    # as sent, as full moves would have sent them, and as priced; what to say of the job as a whole (a fallback)
    delta: bool | None = None
    deltas: dict[str, dict] = field(default_factory=dict)
    network_bytes: int = 0
    full_network_bytes: int = 0
    expected_network_bytes: int = 0
    delta_note: str = ""
    # reshard_many: weight -> the dtype it is quantized to on the way (`reshard.quantize`); its scale is made
    dtypes: dict[str, str] = field(default_factory=dict)
    sync: str = ""  # reshard_many: the registered sync it runs (`Planner.sync`), if any
    # a registered sync's job, or a repeated request's: its tensors' slots in the catalog's columns
    # (`Catalog.slots`), ``inputs``' order
    slots: np.ndarray | None = field(default=None, repr=False)
    # reshard_many: what its program is kept under for the next job alike (`JobRunner._sync_programs`): its registered
    # sync's id, or the digest of a request made again as it was (`Planner._repeated`); "" for neither
    kept_as: str = field(default="", repr=False)
    # Seconds from the request (``created``) to every host's part running (its agent's first report), and to the
    # planner's calls having reached every host (each report's time less the agent's own seconds before it: its
    # prepare): what starting the job cost the planner. 0 until then.
    started_s: float = 0.0
    handed_s: float = 0.0
    done_event: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def ran(self) -> Plan | Program | None:
        return self.program if self.program is not None else self.plan

    @property
    def what(self) -> str:
        if self.kind == "reshard":
            return f"reshard of {self.tensor!r}" + (f" to {self.dst.spec_str()}" if self.dst is not None else "")
        if self.kind == "reshard_many" and self.sync and not self.inputs:  # read back brief (`json_text`)
            return f"reshard_many of registered sync {self.sync[:12]}"
        if self.kind == "reshard_many":
            shown = ", ".join(map(repr, self.inputs[:3])) + (", ..." if len(self.inputs) > 3 else "")
            return f"reshard_many of {len(self.inputs)} tensors ({shown})"
        if self.kind == "compute_many":
            return f"compute_many of {self.inputs} into {self.outputs}"
        return f"{self.kind} of {self.inputs} into {self.tensor!r}"

    @property
    def seconds(self) -> float:
        if not self.started:
            return 0.0
        return (self.finished or time.time()) - self.started

    def to_json(self) -> dict:
        return {**self._fields(), "dsts": {n: d.to_json() for n, d in self.dsts.items()}}

    def json_text(self, brief: bool = False) -> str:
        """``json.dumps(self.to_json())``, with each destination sharding's part written once per sharding
        (`Sharding.json_text`): a state dict's job, saved as it ends, names thousands of destinations that share
        a few layouts. ``brief``: without its tensors and their destinations, as a registered sync's job is saved
        as it is queued (a restart reads it back failed, naming its sync; the record it ends with has them)."""
        if brief and self.sync:
            return json.dumps({**self._fields(), "inputs": [], "dsts": {}})
        head = json.dumps(self._fields())
        dsts = ", ".join(f"{quoted(n)}: {d.json_text()}" for n, d in self.dsts.items())
        return f'{head[:-1]}, "dsts": {{{dsts}}}}}'

    def _fields(self) -> dict:
        """`to_json` without ``dsts``."""
        ran = self.ran
        return {"id": self.id, "tensor": self.tensor, "dst": self.dst.to_json() if self.dst is not None else None,
                "strategy": self.strategy, "state": self.state, "error": self.error,
                "plan_id": ran.id if ran is not None else "", "created": self.created, "started": self.started,
                "finished": self.finished, "version": self.version, "progress": self.progress, "steps": self.steps,
                "traffic": self.traffic, "transport": self.transport, "transports": self.transports,
                "kind": self.kind, "inputs": self.inputs, "scales": self.scales, "bucket_bytes": self.bucket_bytes,
                "versions": self.versions, "outputs": self.outputs, "phases": self.phases,
                "host_seconds": self.host_seconds, "program_bytes": self.program_bytes,
                "transport_reason": self.transport_reason,
                "manifest_digest": self.manifest_digest, "delta": self.delta, "deltas": self.deltas,
                "network_bytes": self.network_bytes, "full_network_bytes": self.full_network_bytes,
                "expected_network_bytes": self.expected_network_bytes, "delta_note": self.delta_note,
                "dtypes": self.dtypes, "sync": self.sync, "started_s": self.started_s,
                "handed_s": self.handed_s}

    @classmethod
    def from_json(cls, d: dict, ran: Plan | Program | None) -> "Job":
        plan, program = (ran, None) if isinstance(ran, Plan) else (None, ran)
        job = cls(d["id"], d["tensor"], Sharding.from_json(d["dst"]) if d.get("dst") else None, d["strategy"],
                  d["state"], d["error"], plan, d["created"], d["started"], d["finished"], d["version"],
                  d["progress"], d.get("steps", {}), d["traffic"], d.get("transport", ""), d.get("transports", []),
                  d.get("kind", "reshard"), d.get("inputs", []), program,
                  dsts={n: Sharding.from_json(x) for n, x in d.get("dsts", {}).items()}, scales=d.get("scales", {}),
                  bucket_bytes=d.get("bucket_bytes", 0), versions=d.get("versions", {}),
                  outputs=d.get("outputs", []), phases=d.get("phases", {}), host_seconds=d.get("host_seconds", {}),
                  program_bytes=d.get("program_bytes", {}),
                  transport_reason=d.get("transport_reason", ""), manifest_digest=d.get("manifest_digest", ""),
                  delta=d.get("delta"), deltas=d.get("deltas", {}), network_bytes=d.get("network_bytes", 0),
                  full_network_bytes=d.get("full_network_bytes", 0),
                  expected_network_bytes=d.get("expected_network_bytes", 0), delta_note=d.get("delta_note", ""),
                  dtypes=d.get("dtypes", {}), sync=d.get("sync", ""), started_s=d.get("started_s", 0.0),
                  handed_s=d.get("handed_s", 0.0))
        if job.state in ("queued", "running"):
            job.state, job.error = "failed", "the planner restarted while this job was in flight"
        job.done_event.set()
        return job


# A job's phases (`Job.phases`): waiting for the jobs before it on its tensors (or for a free runner); planning
# (its plan or program, and the transport, a collective job waiting for the process group); running (every host's
# Execute, from the first call to the last host's end, a destination host's commit at its end); committing (the
# catalog's swap).
PHASES = ("waiting", "planning", "running", "committing")
MANY_PROGRAMS_KEPT = 8  # reshard_many programs a planner keeps, most recently used
SLICED_PROGRAMS_KEPT = 4  # programs whose per-host slices a planner keeps (each about as large as its text)
PROGRAM_MOVES_KEPT = 512  # programs whose moves a planner keeps worked out (`_Moves`), newest last
JOBS_KEPT = 5000  # finished jobs a planner keeps, in memory and in its state store; older ones are forgotten
PLANS_KEPT = 256  # reshard plans a planner keeps (a pipeline's boundary moves repeat every microbatch)
PLAN_KEPT_MAX_BYTES = 8 * 2**20  # larger plans are planned anew: planning them costs more than finding them
# Upper bounds, in seconds, of the buckets `JobRunner.durations` counts succeeded jobs' durations in.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300)


@dataclass
class Durations:
    """How long the jobs that succeeded since the planner started took: a cumulative histogram (``counts[i]``
    jobs took at most ``DURATION_BUCKETS[i]`` seconds), their number and their sum. It only grows, as a
    Prometheus histogram must, however many finished jobs the runner forgets."""

    counts: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS))
    count: int = 0
    total_s: float = 0.0

    def add(self, seconds: float) -> None:
        for i, le in enumerate(DURATION_BUCKETS):
            if seconds <= le:
                self.counts[i] += 1
        self.count += 1
        self.total_s += seconds


class ProgramCache:
    """The last ``size`` programs planned and validated, with their JSON, by what they were planned from (the
    tensors' shapes, dtypes and both shardings, the topology, the strategy, the buckets): a program depends on
    nothing else, so a repeated move skips planning, validating and writing it out."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._programs: OrderedDict[tuple, tuple[Program, str]] = OrderedDict()

    def get(self, key: tuple) -> tuple[Program, str] | None:
        with self._lock:
            hit = self._programs.get(key)
            if hit is not None:
                self._programs.move_to_end(key)
            return hit

    def put(self, key: tuple, program: Program | Plan, text: str | None = None) -> tuple[Program, str]:
        entry = (program, program.dumps() if text is None else text)
        with self._lock:
            self._programs[key] = entry
            while len(self._programs) > self.size:
                self._programs.popitem(last=False)
        return entry


class JobRunner:
    def __init__(self, registry: Registry, catalog: Catalog, store: StateStore, agents: AgentCalls, *,
                 job_timeout_s: float, rpc_timeout_s: float, max_concurrent: int,
                 group: GroupCoordinator | None = None, group_wait_s: float = 0.0,
                 stall_timeout_s: float = PlannerConfig.stall_timeout_s,
                 max_program_steps: int = PlannerConfig.max_program_steps,
                 slice_program_bytes: int = PlannerConfig.slice_program_bytes):
        self.registry = registry
        self.max_program_steps = max_program_steps  # the most steps a reshard_many program may hold
        self.slice_program_bytes = slice_program_bytes  # a program's text this long or longer is cut per host
        self.group = group
        self.group_wait_s = group_wait_s
        self._moved: dict[str, int] = defaultdict(int)  # bytes moved by succeeded jobs, per transport
        # Delta sync: per tensor, its last delta sync's wire bytes / full bytes, and the syncs it moved whole since
        # for its rate (`DELTA_PROBE_EVERY`); succeeded jobs' delta bytes sent, and the full bytes they replaced
        self._change_rates: dict[str, float] = {}
        self._full_since: Counter[str] = Counter()
        self._delta_moved = [0, 0]
        self._durations = Durations()
        self.catalog = catalog
        self.store = store
        self.agents = agents
        self.job_timeout_s = job_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.stall_timeout_s = stall_timeout_s  # a host silent on its Execute stream this long stopped answering
        # (generation, job id, hosts by phase) -> None: drops a collective job's keys from the rendezvous store
        self.collective_cleanup: Callable[[int, str, dict[int, list[str]]], None] | None = None
        self._nccl_turn = threading.Lock()  # one collective job at a time on an NCCL group
        self._jobs_pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="job")
        self._calls_pool = ThreadPoolExecutor(max(8, 4 * max_concurrent), thread_name_prefix="agent-call")
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        # reshard_many's programs by what they were planned from: a weight sync repeats the same move every step
        self._many_programs = ProgramCache(MANY_PROGRAMS_KEPT)
        # registered sync -> ((`Catalog.shapes`, topology), its arguments' dsts, its tensors' source shardings and
        # dtypes, (program, text)) as its last job found them: the next finds its program by comparing those
        # (`_work`)
        self._sync_programs: OrderedDict[str, tuple] = OrderedDict()
        self._plans = ProgramCache(PLANS_KEPT)
        self._program_moves: OrderedDict[str, _Moves] = OrderedDict()  # program id -> its moves, worked out
        # program id -> each host's slice of it (`_slices`), for the programs cut per host
        self._program_slices: OrderedDict[str, tuple[dict, dict]] = OrderedDict()
        self._held = TensorLocks()  # the tensors of every job running, one job at a time per tensor
        for doc in store.jobs():
            plan_doc = store.plan(doc["plan_id"]) if doc.get("plan_id") else None
            job = Job.from_json(doc, _ran_from_json(plan_doc) if plan_doc else None)
            self._jobs[job.id] = job

    def submit(self, tensor: str, dst: Sharding, strategy: str, planned: Planned | None = None) -> Job:
        """Queue a reshard of ``tensor`` into ``dst``; ``planned``, its program planned as the request was checked
        (a Partial tensor's), runs unless what it was planned from changed by the time the job starts."""
        return self._submit(Job(uuid.uuid4().hex, tensor, dst, strategy, planned=planned))

    def submit_compute(self, kind: str, inputs: list[str], out: str, strategy: str,
                       make_program: Callable[[dict[str, TensorRecord], Topology], Program],
                       outputs: list[str] | None = None, planned: Planned | None = None) -> Job:
        """Queue a compute job: it waits for the jobs before it on any of its tensors, then runs ``planned`` (the
        program its request was checked with) if the inputs' records and the topology are still what it was
        planned from, else plans again from them as they are then (`Job`). A ``compute_many`` job writes every
        tensor of ``outputs`` (``out`` is the first) and commits them together."""
        return self._submit(Job(uuid.uuid4().hex, out, None, strategy, kind=kind, inputs=list(inputs),
                                make_program=make_program, outputs=list(outputs or []), planned=planned))

    def submit_many(self, dsts: dict[str, Sharding], strategy: str, bucket_bytes: int,
                    scales: dict[str, list], *, manifest_digest: str = "", pin: str = "",
                    step: int | None = None, delta: bool | None = None, dtypes: dict[str, str] | None = None,
                    sync: tuple[str, list[str], np.ndarray] | None = None, received: float | None = None,
                    repeat: tuple[str, list[str], np.ndarray] | None = None) -> Job:
        """Queue a reshard of every tensor of ``dsts`` into its destination in one program and one commit; with
        ``pin`` or ``step``, of the versions they name (still current as the job starts). ``delta``: move tensors
        as deltas where it pays (None), never (False), or wherever a base pair is usable (True). ``dtypes``: the
        weights quantized on the way, each to its dtype; their scales (in ``scales``) are made by the job.
        ``sync``: the registered sync the job runs (`Planner.sync`): its id, its tensors in order and their slots
        (`Catalog.slots`); the arguments are the sync's own, not copied. ``repeat``: the same of a request made again
        as it was (`Planner._repeated`: its digest for an id), whose job finds its program as a registered sync's
        does. ``received``: when its request arrived (`time.time`; default now), which the job's waiting phase and
        ``started_s`` count from."""
        kept = sync if sync is not None else repeat
        if kept is None:
            names, dsts, scales, dtypes = sorted(dsts), dict(dsts), dict(scales), dict(dtypes or {})
        else:
            names = kept[1]
        return self._submit(Job(uuid.uuid4().hex, names[0], None, strategy, kind="reshard_many", inputs=names,
                                dsts=dsts, scales=scales, bucket_bytes=bucket_bytes,
                                manifest_digest=manifest_digest, pin=pin, step=step, delta=delta,
                                dtypes=dtypes or {}, sync=sync[0] if sync is not None else "",
                                slots=kept[2] if kept is not None else None,
                                kept_as=kept[0] if kept is not None else "",
                                created=time.time() if received is None else received))

    def _submit(self, job: Job) -> Job:
        # A registered sync's job names its tensors' slots (one of them is its ``tensor``); any other job's are
        # looked up (`TensorLocks`)
        slots = job.slots if job.slots is not None else self.catalog.slots(
            list(dict.fromkeys([job.tensor, *job.inputs, *job.outputs])))
        with self._lock:
            self._jobs[job.id] = job
        if self.store.durable:
            self.store.save_job(job.id, job.created, job.json_text(brief=True))
        self._jobs_pool.submit(self._run, job, slots)
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def count(self) -> int:
        """How many jobs the planner knows (the last `JOBS_KEPT` finished ones and every one in flight)."""
        with self._lock:
            return len(self._jobs)

    def states(self) -> dict[str, int]:
        """How many of the jobs the planner knows are in each state (``queued``, ``running``, ...)."""
        with self._lock:
            return dict(Counter(j.state for j in self._jobs.values()))

    def durations(self) -> Durations:
        """The durations of every job that succeeded since the planner started (a copy)."""
        with self._lock:
            d = self._durations
            return Durations(list(d.counts), d.count, d.total_s)

    def list(self) -> list[Job]:
        """Every job the planner knows, newest first."""
        with self._lock:
            return sorted(self._jobs.values(), key=lambda j: j.created, reverse=True)

    def bytes_moved(self) -> dict[str, int]:
        """Bytes succeeded jobs moved, by transport: grpc and collective over the network, local within hosts."""
        with self._lock:
            return dict(self._moved)

    def delta_bytes(self) -> tuple[int, int]:
        """(network bytes succeeded jobs sent as deltas, the bytes full moves of those tensors would have sent)."""
        with self._lock:
            return self._delta_moved[0], self._delta_moved[1]

    def busy_of(self, names: set[str]) -> set[str]:
        """Which of ``names`` a queued or running job names. The state first: the jobs kept are mostly finished, and
        a reshard_many names thousands of tensors."""
        with self._lock:
            active = [j for j in self._jobs.values() if j.state in ("queued", "running")]
            return {n for j in active for n in (j.tensor, *j.inputs, *j.outputs) if n in names}

    # -- running ------------------------------------------------------------------------

    def _run(self, job: Job, slots: np.ndarray) -> None:
        with self._held.hold(slots):
            job.state, job.started = "running", time.time()
            job.phases["waiting"] = job.started - job.created
            # Not saved here: after a restart a queued job and a running one both read back as failed (`Job.from_json`),
            # and the save (a state dict's job writes hundreds of destinations) was a millisecond or more of every
            # job, a disk sync with --state; the record is saved as the job is queued and as it ends.
            superseded = []
            try:
                superseded = self._reshard(job)
            except Exception as e:  # noqa: BLE001 - every failure is recorded on the job
                self._finish(job, e)
            else:
                self._finish(job)
            finally:
                self.catalog.unclaim(_commits_of(job), job.slots)
            if superseded:
                # The new versions are committed and the caller has them; freeing the old ones is housekeeping,
                # still under the tensors' locks so the next job on them starts after it.
                self.release(*superseded)

    def _finish(self, job: Job, error: BaseException | None = None) -> None:
        """Record the job's outcome and wake its waiters (once: a failure may be published before the cleanup
        that follows it ends)."""
        if job.done_event.is_set():
            return
        if error is None:
            job.state = "succeeded"
        else:
            job.state = "failed"
            job.error = f"{job.what} failed: {error}"
            log.warning("job %s failed: %s", job.id[:8], job.error)
        job.finished = time.time()
        if error is None:
            with self._lock:
                self._durations.add(job.seconds)
        if self.store.durable:
            self.store.save_job(job.id, job.created, job.json_text())
        job.done_event.set()
        self._forget_old()

    def _forget_old(self) -> None:
        """Drop the oldest finished jobs once more than `JOBS_KEPT` (and a quarter) have finished, from memory and
        from the state store: a pipeline runs a hundred jobs a step, and every job kept would slow each look at
        the job list and grow the planner without end. Queued and running jobs are never dropped."""
        with self._lock:
            if len(self._jobs) <= JOBS_KEPT + JOBS_KEPT // 4:
                return
            done = [j for j in self._jobs.values() if j.state in ("succeeded", "failed")]
            if len(done) <= JOBS_KEPT:
                return
            done.sort(key=lambda j: j.finished or j.created)
            old = [j.id for j in done[:len(done) - JOBS_KEPT]]
            for job_id in old:
                del self._jobs[job_id]
        self.store.delete_jobs(old)

    def release(self, *records: TensorRecord) -> None:
        """Free each record's version on every host of its mesh that is registered, hosts at once (each host's in
        turn); failures are logged."""
        by_host: dict[str, list[TensorRecord]] = defaultdict(list)
        for rec in records:
            for h in rec.sharding.mesh.hosts:
                by_host[h].append(rec)
        src_agents = {h: a for h in by_host if (a := self.registry.get(h)) is not None}

        def free(h: str) -> None:  # one call per host, however many tensors the job replaced
            self.agents.release(h, src_agents[h].address, [(rec.name, rec.version) for rec in by_host[h]],
                                self.rpc_timeout_s)

        self._best_effort(free, sorted(src_agents))

    def _fan_out(self, fn, hosts, deadline: float, watch: Callable[[list[str]], None] | None = None) -> None:
        """Call ``fn(host)`` for every host at once; raise the first error, naming its host. While calls are
        out, ``watch(hosts whose call is out)`` runs every `WATCH_INTERVAL_S` and fails the fan-out by raising."""
        futures = {self._calls_pool.submit(fn, h): h for h in hosts}
        pending = set(futures)
        while True:
            left = deadline - time.monotonic()
            done, pending = wait(pending, timeout=max(0.0, min(left, WATCH_INTERVAL_S)), return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
            if not pending:
                return
            late = sorted(futures[f] for f in pending)
            if left <= WATCH_INTERVAL_S:
                raise DeadlineExceededError(f"agents of hosts {late} did not finish within the job timeout "
                                            f"({self.job_timeout_s:g}s)")
            if watch is not None:
                watch(late)

    def _watch(self, peers: dict[str, str], reported: dict[str, float]) -> Callable[[list[str]], None]:
        """A ``watch`` for `_fan_out`: raises `_NotAnswering` for the first of the given hosts that is marked
        down, whose agent was replaced, or whose last progress report (``reported``: host -> monotonic time,
        kept by the caller) is older than ``stall_timeout_s``.

        A host whose part of the job reported progress within the heartbeat timeout is alive, whatever its
        heartbeats say: on a machine whose cores the job keeps busy, an agent's heartbeat calls can miss their
        deadline at a slow planner while its Execute stream, which the planner reads, goes on."""

        def watch(hosts: list[str]) -> None:
            now = time.monotonic()
            for h in hosts:
                rec = self.registry.get(h)
                if rec is None or rec.address != peers[h]:
                    raise _NotAnswering(h, f"its agent at {peers[h]} was replaced"
                                           + (f" by one at {rec.address}" if rec is not None else ""))
                last = reported.get(h)
                if not self.registry.is_up(rec) and (last is None or now - last > self.registry.heartbeat_timeout_s):
                    raise _NotAnswering(h, f"no heartbeat for {self.registry.age(rec):.1f}s (agents are down after "
                                           f"{self.registry.heartbeat_timeout_s:g}s without one)")
                if last is not None and now - last > self.stall_timeout_s:
                    raise _NotAnswering(h, f"no progress report for {now - last:.1f}s while its part of the job runs "
                                           f"(the planner's --stall-timeout is {self.stall_timeout_s:g}s)")

        return watch

    def _reshard(self, job: Job) -> list[TensorRecord]:
        """Run the job up to its commit; returns the records it replaced whose versions are now free (none when
        the job made a new tensor, or a pin holds them). A run whose agents found a delta base that differs
        (`DELTA_BASE_MISMATCH`) committed nothing: the job runs once more with every tensor moved whole. Not only
        those the error names: one host's error names the tensors it found, and another host may have found others
        (a base that is not what the catalog says it is may be stale for more of them); one more run must be the
        last."""
        began = time.monotonic()
        deadline = began + self.job_timeout_s
        work = self._work(job)
        try:
            return self._attempt(job, work, job.id, began, deadline)
        except Exception as e:  # noqa: BLE001 - all but a base mismatch are raised again below
            named = _mismatched(e, work.delta_bases)
            if named is None:
                raise
            error = str(e)
        whole = sorted(work.delta_bases)
        for n in whole:
            why = "the agents' delta base differed" if n in named else "another tensor's delta base differed"
            job.deltas[n].update(mode="full", expected=job.deltas[n]["full_bytes"],
                                 why=f"fell back: {why} ({_brief(error, 160)})")
        job.delta_note = (f"ran again with {len(whole)} tensor{'s' * (len(whole) != 1)} moved whole after a delta "
                          f"base mismatch ({', '.join(named[:5])}{', ...' if len(named) > 5 else ''}): "
                          f"{_brief(error, 240)}")
        log.warning("job %s: %s", job.id[:8], job.delta_note)
        job.expected_network_bytes = sum(d["expected"] for d in job.deltas.values())
        again = replace(work, delta_bases={n: b for n, b in work.delta_bases.items() if n not in whole})
        # The agents ended the first run's job id (`Runtime.prepare` refuses an ended one): the second has its own.
        return self._attempt(job, again, f"{job.id}-full", time.monotonic(), deadline)

    def _attempt(self, job: Job, work: "_Work", run_id: str, began: float, deadline: float) -> list[TensorRecord]:
        """One run of ``work`` on the agents, as job ``run_id`` there, up to the catalog's commit (`_reshard`)."""
        hosts = receivers_first(work.hosts, work.moves)
        peers = {h: self.registry.require_up(h).address for h in hosts}
        # only a move's sender's host sends its first copies
        job.progress = {h: [0, work.moves.to_send.get(h, 0)] for h in hosts}
        job.traffic, job.host_seconds = {}, {}
        job.program_bytes = {h: len(work.host_texts.get(h, work.program_json)) for h in hosts}
        transport, generation, seq = self._transport(job, work.moves, hosts)
        # The NIXL metadata of every host, as it registered: each agent adds the others as peers before the job.
        nixl_peers = ({h: self.registry.require_up(h).nixl_metadata for h in hosts} if transport == "nixl"
                      else {})
        prep = Preparation(run_id, work.program_json, job.tensor, work.src_version, job.version, peers, transport,
                           generation, seq, program_id=work.program_id, reads=work.reads, nixl_peers=nixl_peers,
                           delta_bases=work.delta_bases, host_texts=work.host_texts,
                           host_tensors=work.host_tensors, reads_at=work.reads_at, columns=work.columns)
        with ExitStack() as turn:
            if transport == "collective" and self.group.view().backend == "nccl":
                # NCCL has no message tags and orders the calls on a communicator: two jobs interleaving their
                # sends and recvs in different orders on different agents would deadlock, so NCCL jobs take turns.
                turn.enter_context(self._nccl_turn)
            # Every host that stages new versions commits them as its run ends: no Commit round after the runs (3-15
            # ms of a job here). Nothing is visible before the catalog swap below, which waits for every host's
            # Execute; where the job fails anywhere, its abort undoes what a host committed (`ShardStore.uncommit`,
            # keyed by the job, so an abort that reaches a paused host late never frees a retry's same version).
            staging = frozenset(work.commits.hosts)
            # the records it commits, and its report where it waits for the run, are made once every host runs,
            # off the job's start and its end
            report = _Meanwhile(work.report) if work.report is not None else None

            def running() -> None:
                work.commits.make_meanwhile()
                if report is not None:
                    report.start()

            try:
                ran = time.monotonic()
                job.phases["planning"] = job.phases.get("planning", 0.0) + ran - began
                self._run_program(job, prep, hosts, deadline, self._prepares_early(transport, work.moves), staging,
                                  running)
                if report is not None:
                    report.finish()
                committed = time.monotonic()
                job.phases["running"] = job.phases.get("running", 0.0) + committed - ran
                work.commits.check()
                freed = self.catalog.commit(work.commits.records, self._bases(job, work.commits.records))
                job.phases["committing"] = time.monotonic() - committed
            except BaseException as e:
                if report is not None:
                    with suppress(Exception):  # the job's own error is the one to raise
                        report.finish()
                self._undo(job, prep, hosts, e)
                raise
            finally:
                # A host writes its plan-id key only to call a peer: a job on one host wrote none to drop.
                if transport == "collective" and self.collective_cleanup is not None and len(hosts) > 1:
                    try:
                        self.collective_cleanup(generation, run_id, {0: hosts})
                    except Exception as e:  # noqa: BLE001 - a few stale keys are no reason to fail the job
                        log.info("could not drop the confirmation keys of job %s: %s", run_id[:8], e)
        if self.store.durable:
            self.store.save_tensors([(new.name, new.json_text()) for _, new in work.commits.records])
        self._count_moved(job, work)
        return freed

    @staticmethod
    def _bases(job: Job, commits: list[tuple[TensorRecord | None, TensorRecord]]) -> dict[str, tuple[int, int]] | None:
        """The delta base pairs a job's commit makes: a reshard_many's makes each tensor's (version moved, version
        committed) its next; not a quantized one's, nor its scale's: their new version holds other values (no
        delta could start there)."""
        if job.kind != "reshard_many":
            return None
        made = _made_on_the_way(job)
        return {new.name: (old.version, new.version) for old, new in commits
                if old is not None and new.name not in made}

    def _work(self, job: Job) -> "_Work":
        """What the job runs: a plan of moves for a reshard between value shardings, else a program (a Partial
        tensor's reshard: `reshard_program`; a compute job: its ``make_program``), the one its request was checked
        with (`Planned`) where it still fits the records and the topology, else planned now."""
        planned, job.planned = job.planned, None  # used once: the job then holds what ran (``plan``, ``program``)
        if job.slots is not None and not job.pin and (job.delta is False or not self.catalog.delta):
            work = self._sync_work(job)
            if work is not None:
                return work
        claimed = self.catalog.claim(_commits_of(job), job.slots)
        if job.kind == "reshard":
            rec: TensorRecord = self.catalog.get(job.tensor)
            job.version = claimed[job.tensor]
            if not (rec.sharding.is_partial or job.dst.is_partial):
                plan, plan_json = self._plan(job, rec)
                moves = _Moves.of([(t, plan.itemsize) for t in plan.transfers], set(job.dst.mesh.hosts))
                return _Work(plan_json, plan.id, moves, sorted(moves.hosts), rec.version, {},
                             _Commits.of([(rec, bumped(rec, job.dst, job.version))]))
            topology = self.registry.topology()
            program = _still_fits(planned, [rec], topology)
            if program is None:
                program = reshard_program(rec.shape, rec.dtype, rec.sharding, job.dst, topology, job.strategy)
            return self._program_work(job, program.validate(), rec.version, {},
                                      _Commits.of([(rec, bumped(rec, job.dst, job.version))]))
        if job.kind == "reshard_many":
            # A scale made on the way (its weight is quantized) need not exist yet: the job creates it.
            scales = _made_scales(job)
            stored = [n for n in job.inputs if n not in scales or self.catalog.contains(n)]
            shapes = self.catalog.shapes
            records = dict(zip(stored, self.catalog.current_named(stored, job.pin, job.step, scales)))
            topology = self.registry.topology()
            blocks = {s: block_of(w, s, job.scales[w][1]) for s, w in scales.items()}
            # A registered sync's program (or a request's made again as it was: `Job.kept_as`), where its request was
            # checked as at its last job (the same arguments),
            # the tensors it read are declared as they were, each in the dtype it had and from the very sharding
            # object it came from then (the planner reads each layout's text into one object): found without a key
            # of every tensor's layout
            sources = list(map(_SHARDING, records.values())) if job.kept_as else []
            dtypes = list(map(_DTYPE, records.values())) if job.kept_as else []
            with self._lock:
                kept = self._sync_programs.get(job.kept_as)
            if (kept is not None and kept.basis == (shapes, topology) and kept.dsts is job.dsts
                    and kept.dtypes == dtypes and len(kept.sources) == len(sources)
                    and all(map(operator.is_, sources, kept.sources)) and self.catalog.shapes == shapes):
                hit = kept.hit
            else:
                hit = self._many_program(job, records, topology, scales, blocks)
                if job.kept_as:
                    every = len(records) == len(job.inputs)  # else a scale the job makes is not there yet
                    kept = _KeptSync((shapes, topology), job.dsts, sources, dtypes, hit,
                                     np.fromiter(map(id, sources), np.int64, len(sources)),
                                     self.catalog.dtype_ids(dtypes), _commit_meshes(job, hit[0]),
                                     _sync_reads(job, dict(zip(records, dtypes))) if job.dtypes and every else None,
                                     np.array([n not in scales for n in records], bool) if scales else None)
                    with self._lock:
                        self._sync_programs[job.kept_as] = kept
                        while len(self._sync_programs) > MANY_PROGRAMS_KEPT:
                            self._sync_programs.popitem(last=False)
            program, text = hit
            job.versions = claimed
            job.version = job.versions[job.tensor]
            # Each tensor is read at its own version and commits as the next (the agents' rule for a program
            # that commits several tensors): what a claim gives a current version, as no upload commits meanwhile.
            # A state dict's job reads 139,583 tensors: the reads are made column by column.
            moved = [n for n in records if n not in job.dtypes and n not in scales] if job.dtypes or scales else \
                list(records)
            versions = list(map(_VERSION, map(records.__getitem__, moved)))
            assert list(map(claimed.__getitem__, moved)) == [v + 1 for v in versions], (claimed, records)
            reads = dict(zip(moved, zip(moved, versions)))
            reads_at = reads_at_of(program, moved, versions, bool(job.dtypes))
            for w in job.dtypes:
                # The quantized weight and its scale are made by the program (no src), and commit as the versions
                # claimed; the weight as held is read as its own program tensor.
                s = job.scales[w][0]
                reads[w], reads[s] = (w, claimed[w]), (s, claimed[s])
                reads[source_name(w, records[w].dtype)] = (w, records[w].version)

            def commits() -> list[tuple[TensorRecord | None, TensorRecord]]:
                return _many_commits(job, program, records, claimed, moved)

            src_version = records[job.tensor].version if job.tensor in records else 0
            work = self._program_work(job, program, src_version, reads, _Commits(commits, _commit_meshes(job, program)),
                                      text)
            # Program tensors are the stored names here (``reads``): delta_bases is keyed by them too.
            bases, report = self._choose_deltas(job, records, work.moves)
            return replace(work, delta_bases=bases, report=report, reads_at=reads_at)
        inputs = {n: self.catalog.get(n) for n in dict.fromkeys(job.inputs)}
        topology = self.registry.topology()
        program = _still_fits(planned, inputs.values(), topology)
        if program is None:
            program = job.make_program(inputs, topology)
        program = program.validate()
        if job.kind == "compute_many":
            return self._many_outputs_work(job, program, inputs, claimed)
        out = next(t for t in program.tensors if t.dst is not None)
        job.dst = out.dst
        old = self.catalog.get(job.tensor) if self.catalog.contains(job.tensor) else None
        job.version = claimed[job.tensor]
        reads = {n: (n, r.version) for n, r in inputs.items()}
        reads[out.name] = (job.tensor, job.version)
        new = TensorRecord(job.tensor, out.shape, out.dtype, out.dst, job.version, inputs[job.inputs[0]].kind)
        return self._program_work(job, program, 0, reads, _Commits.of([(old, new)]))

    def _sync_work(self, job: Job) -> "_Work | None":
        """A registered sync's job where its last job's program still fits, worked out in array operations over
        the catalog's columns: every tensor current (labeled ``job.step``, where given) and unclaimed, from the
        very sharding object and in the dtype it had then, the catalog's shapes and the topology as they were
        (`_KeptSync`). None where anything differs, claiming nothing: the job then takes `_work`'s way, which finds
        what. The job's records are read as it commits, each checked to be the version it moved (`_Commits`).

        Only for a job that moves every tensor whole and names no pin (a delta is chosen per tensor:
        `_choose_deltas`). Its Prepares name the reads by one version where every tensor is at one (`reads_at`), as
        a state dict published in one step is; else by columns (`Preparation.columns`), made here: where it
        quantizes on the way, in the order its sync's reads were worked out once (`_sync_reads`), each quantized
        weight and its scale at the version claimed and the weight as held at its current one."""
        with self._lock:
            kept = self._sync_programs.get(job.sync)
        if (kept is None or kept.dsts is not job.dsts or len(kept.layouts) != len(job.slots)
                or (job.dtypes and kept.reads is None)
                or kept.basis != (self.catalog.shapes, self.registry.topology())):
            return None
        current = self.catalog.claim_current(job.slots, job.step, kept.labeled)
        if current is None:
            return None
        versions, layouts, dtypes = current
        if (not np.array_equal(layouts, kept.layouts) or not np.array_equal(dtypes, kept.dtype_ids)
                or self.catalog.shapes != kept.basis[0]):
            self.catalog.unclaim(job.inputs, job.slots)
            return None
        program, text = kept.hit
        names, claimed = job.inputs, versions + 1
        job.version = int(claimed[0])  # the job's ``tensor`` is its first
        one = None
        if job.dtypes:
            keys, stored, index, at_claimed = kept.reads
            columns = (keys, stored, np.where(at_claimed, claimed[index], versions[index]))
        elif len(names) == program.num_sources and (versions == versions[0]).all():
            one, columns = int(versions[0]), None
        else:
            columns = (names, names, versions)
        held: list[TensorRecord | None] = []

        def commits() -> list[tuple[TensorRecord | None, TensorRecord]]:
            held[:] = self.catalog.current(names)
            news = claimed.tolist()
            job.versions = dict(zip(names, news))
            if not job.dtypes:
                return [(r, bumped(r, job.dsts[n], v)) for n, r, v in zip(names, held, news) if r is not None]
            records = {n: r for n, r in zip(names, held) if r is not None}
            scales = _made_scales(job)
            moved = [n for n in records if n not in job.dtypes and n not in scales]
            return _many_commits(job, program, records, job.versions, moved)

        def check() -> None:
            moved = versions.tolist()
            for n, r, v in zip(names, held, moved):
                if r is None or r.version != v:
                    raise NotFoundError(f"tensor {n!r} v{v} changed or was deleted during the reshard")

        def report() -> None:
            records = {n: r for n, r in zip(names, self.catalog.current(names)) if r is not None}
            self._delta_report(job, records, work.moves, {}, None, _made_scales(job), {})

        work = self._program_work(job, program, int(versions[0]), {}, _Commits(commits, kept.meshes, check), text)
        return replace(work, reads_at=one, columns=columns, report=report)

    def _many_program(self, job: Job, records: dict[str, TensorRecord], topology: Topology,
                      scales: dict[str, str], blocks: dict[str, tuple]) -> tuple[Program, str]:
        """Job ``job``'s reshard_many program and its text, from ``records`` (its tensors' current versions): kept
        under what it is planned from, read off the records, so a repeated sync finds its program without
        declaring every tensor again (equal records and destinations declare equal tensors)."""
        key = (tuple((n, r.shape, r.dtype, r.sharding, job.dsts[n]) for n, r in records.items() if n not in scales),
               tuple((s, records[w].shape, blocks[s], job.dsts[s]) for s, w in scales.items()), topology,
               job.strategy, job.bucket_bytes,
               tuple(sorted((w, s, tuple(b) if b else None) for w, (s, b) in job.scales.items())),
               tuple(sorted(job.dtypes.items())))
        hit = self._many_programs.get(key)
        if hit is None:
            decls = [TensorDecl(n, r.shape, r.dtype, r.sharding, job.dsts[n]) for n, r in records.items()
                     if n not in scales]
            decls += [made_scale(s, records[w].shape, blocks[s], job.dsts[s]) for s, w in scales.items()]
            hit = self._many_programs.put(key, plan_many(decls, topology, job.strategy, job.bucket_bytes,
                                                         job.scales, job.dtypes or None,
                                                         self.max_program_steps).validate())
        return hit

    def _many_outputs_work(self, job: Job, program: Program, inputs: dict[str, TensorRecord],
                           claimed: dict[str, int]) -> "_Work":
        """A compute_many job's work: op ``k`` reads catalog tensor ``n`` as ``n@k`` (`reshard.sequence`) at its
        version now, and every output commits as the version it claimed (1 for a new tensor), all together."""
        reads: dict[str, tuple[str, int]] = {}
        for t in program.tensors:
            base = aliased(t.name)
            if t.src is not None and base in inputs:
                reads[t.name] = (base, inputs[base].version)
        commits = []
        kind = inputs[job.inputs[0]].kind
        for t in program.tensors:
            if t.dst is None:
                continue
            old = self.catalog.get(t.name) if self.catalog.contains(t.name) else None
            version = claimed[t.name]
            job.versions[t.name] = version
            reads[t.name] = (t.name, version)
            commits.append((old, TensorRecord(t.name, t.shape, t.dtype, t.dst, version, kind)))
        job.dst = program.tensor(job.tensor).dst
        job.version = job.versions[job.tensor]
        return self._program_work(job, program, 0, reads, _Commits.of(commits))

    def _program_work(self, job: Job, program: Program, src_version: int, reads: dict[str, tuple[str, int]],
                      commits: _Commits, text: str = "") -> "_Work":
        job.program = program
        moves = self._program_moves.get(program.id)
        if moves is None:  # once per program: a weight sync or a training step runs the same one every time
            text = text or program.dumps()
            self.store.save_plan(program.id, text)
            moves = program_moves(program)
            with self._lock:
                self._program_moves[program.id] = moves
                while len(self._program_moves) > PROGRAM_MOVES_KEPT:
                    self._program_moves.popitem(last=False)
        text = text or program.dumps()
        hosts = moves.hosts | commits.hosts
        texts, tensors = self._slices(program, text, hosts)
        return _Work(text, program.id, moves, sorted(hosts), src_version, reads, commits, host_texts=texts,
                     host_tensors=tensors)

    def _slices(self, program: Program, text: str,
                hosts: set[str]) -> tuple[dict[str, str], dict[str, frozenset[str]]]:
        """Each of ``hosts``' slice of ``program`` (`reshard.host_slice`) and the tensors it declares, where its
        ``text`` is long enough to cut (``slice_program_bytes``), else none: worked out once per program and kept
        for the last few, as a weight sync runs the same program every step."""
        if len(text) < self.slice_program_bytes:
            return {}, {}
        with self._lock:
            slices = self._program_slices.get(program.id)
            if slices is not None:
                self._program_slices.move_to_end(program.id)
        if slices is None or not hosts <= slices[0].keys():
            began = time.monotonic()
            cut = HostCut(program)
            slices = ({h: cut.text(h) for h in sorted(hosts)}, {h: cut.tensors(h) for h in sorted(hosts)})
            log.info("program %s cut for %d hosts in %.2f s: %s of text, the largest part %s", program.id[:8],
                     len(hosts), time.monotonic() - began, format_size(len(text)),
                     format_size(max(map(len, slices[0].values()), default=0)))
            with self._lock:
                self._program_slices[program.id] = slices
                while len(self._program_slices) > SLICED_PROGRAMS_KEPT:
                    self._program_slices.popitem(last=False)
        return slices

    def _plan(self, job: Job, rec: TensorRecord) -> tuple[Plan, str]:
        """Plan the job on the registered topology, validate the plan whole and persist it; a move planned before
        (same shape, dtype, layouts, topology and strategy: a pipeline's boundary move, every microbatch) reuses
        that plan, validated and saved already."""
        topology = self.registry.topology()
        key = (rec.shape, rec.dtype, rec.sharding, job.dst, topology, job.strategy)
        hit = self._plans.get(key)
        if hit is None:
            plan = make_plan(rec.shape, rec.dtype, rec.sharding, job.dst, topology, job.strategy)
            plan.validate()
            plan_json = plan.dumps()
            self.store.save_plan(plan.id, plan_json)
            if len(plan_json) <= PLAN_KEPT_MAX_BYTES:
                self._plans.put(key, plan, plan_json)
            hit = (plan, plan_json)
        job.plan = hit[0]
        return hit

    def _transport(self, job: Job, moves: "_Moves", hosts: list[str]) -> tuple[str, int, int]:
        """(transport, group generation, job number) for the job; records it, why, and what carries each of its
        ``moves``."""
        if self.group is not None:
            transport, generation, seq, job.transport_reason = self.group.choose(hosts, self.group_wait_s)
        else:
            transport, generation, seq, job.transport_reason = "grpc", 0, 0, "the planner runs no process group"
        job.transport = transport
        job.transports = moves.carriers(transport)
        return transport, generation, seq

    @staticmethod
    def _prepares_early(transport: str, moves: "_Moves") -> bool:
        """Whether the job's hosts prepare inside their Execute, saving the Prepare round.

        On the collective transport always: the plan-id confirmation before any call waits for every peer anyway.
        On nixl always: a receiver posts where a box lands as a notification, which waits in the sender's NIXL agent
        (no thread of it) until the sender's run asks for it, and a post that comes before the sender's own Prepare
        introduced the poster is held until it does (`nixl_progress`). On gRPC when no host has more than
        `EARLY_PUSHES_MAX` streams pushed into it: a push that reaches a host before its Execute does waits in one
        of the host's server threads for the prepare (``Runtime.accept``), and a handful per job, times the
        planner's concurrent jobs, cannot take every thread the Execute itself needs. A larger job, or one with a
        reduce ring over hosts, is prepared everywhere first (one more round, which its transfer time dwarfs)."""
        if transport in ("collective", "nixl"):
            return True
        return transport == "grpc" and moves.pushes_in is not None and moves.pushes_in <= EARLY_PUSHES_MAX

    def _run_program(self, job: Job, prep: Preparation, hosts: list[str], deadline: float, early: bool,
                     commit: frozenset[str] = frozenset(), running: Callable[[], None] | None = None) -> None:
        """Hand every host the program once, then run it with one Execute per host; collects progress and
        each host's traffic. Unless ``early`` (`_prepares_early`: each host prepares inside its Execute), every
        host is prepared before any runs, since pushes may reach a host as soon as its peers start. ``commit``:
        the hosts that commit as their runs end (those that stage new versions). ``running()`` is called once
        every host's run has started."""
        if not early:
            self._fan_out(lambda h: self.agents.prepare(h, prep.peers[h], prep, self.rpc_timeout_s), hosts,
                          deadline, self._watch(prep.peers, {}))
        job.steps = {h: [0, 0] for h in hosts}
        reported: dict[str, float] = {}  # host -> when its Execute stream last reported (from its first report)
        handed: dict[str, float] = {}  # host -> when the planner's call reached it (`time.time`)

        def run(h: str) -> None:
            def on_progress(done: int = 0, total: int = 0, steps_done: int = 0, steps: int = 0,
                            started_after: float = 0.0, loading: bool = False) -> None:
                reported[h] = time.monotonic()
                self.registry.alive(h, prep.peers[h])  # a report is proof of life (`Registry.alive`)
                if loading:  # still loading the job: alive, not started
                    return
                if h not in handed:  # its first report as its run starts there
                    now = time.time()
                    handed[h] = now - started_after
                    if len(handed) == len(hosts):
                        job.started_s, job.handed_s = now - job.created, max(handed.values()) - job.created
                        if running is not None:
                            running()
                if job.done_event.is_set():
                    return  # a host that answers again after the job failed
                job.progress[h][0] = done
                job.steps[h] = [steps_done, steps]

            called = time.monotonic()
            traffic = self.agents.execute(h, prep.peers[h], prep.job, prep.program_id, on_progress,
                                          max(0.1, deadline - called), prep if early else None, h in commit)
            job.host_seconds[h] = time.monotonic() - called
            if traffic is not None:
                job.traffic[h] = traffic

        self._fan_out(run, hosts, deadline, self._watch(prep.peers, reported))

    def _undo(self, job: Job, prep: Preparation, hosts: list[str], error: BaseException) -> None:
        """After a failure: a fresh group for the next collective job, and nothing staged or committed by the job
        left anywhere.

        A host that stopped answering is cleaned up last: its calls may wait out ``rpc_timeout_s`` (they
        finish as soon as it answers again), so the job's failure is published before them.
        """
        if prep.transport == "collective" and self.group is not None:
            # A failed call may leave recvs posted and gloo pairs closed: the next job gets a fresh group.
            self.group.reform(f"job {job.id[:8]} failed on generation {prep.generation}: {str(error)[:120]}")
        gone = [error.host] if isinstance(error, _NotAnswering) else []
        self._abort_on(prep, [h for h in hosts if h not in gone])
        if gone:
            self._finish(job, error)
            self._abort_on(prep, gone)

    def _abort_on(self, prep: Preparation, hosts: list[str]) -> None:
        """Abort the job on ``hosts``: what it staged there goes, and what a host committed as its run ended
        (`ShardStore.uncommit`: by the job, never a retry's same version)."""
        self._best_effort(lambda h: self.agents.abort(h, prep.peers[h], Staging(job=prep.job), self.rpc_timeout_s),
                          hosts)

    def _count_moved(self, job: Job, work: "_Work") -> None:
        """Count a succeeded job's bytes, and report its deltas (`_report_deltas`)."""
        sent, replaced = self._report_deltas(job, work)
        with self._lock:
            self._moved[job.transport] += job.network_bytes
            self._moved["local"] += work.moves.local_bytes
            self._delta_moved[0] += sent
            self._delta_moved[1] += replaced

    def _report_deltas(self, job: Job, work: "_Work") -> tuple[int, int]:
        """Fill the job's network bytes, as sent and as full moves would have sent them, and each tensor's
        (`Job.deltas`) from its hosts' traffic: a delta tensor's bytes are what its senders report having sent
        for it (``delta_wire_bytes``) against what those streams carried whole (``delta_full_bytes``), a full
        tensor's its moves' as planned. Learns each delta tensor's change rate; returns (delta bytes sent, the full
        bytes they replaced)."""
        full = work.moves.network_bytes
        if not job.deltas:
            job.network_bytes = job.full_network_bytes = job.expected_network_bytes = full
            return 0, 0
        wire: Counter[str] = Counter()
        whole: Counter[str] = Counter()
        for t in job.traffic.values():
            wire.update(t.get("delta_wire_bytes", {}))
            whole.update(t.get("delta_full_bytes", {}))
        sent = replaced = 0
        for n, d in job.deltas.items():
            planned = work.moves.tensor_network.get(n, 0)
            if d["mode"] == "delta" and whole[n]:
                d["bytes"], d["full_bytes"] = wire[n], whole[n]
                sent, replaced = sent + wire[n], replaced + whole[n]
                with self._lock:
                    self._change_rates[n] = wire[n] / whole[n]
                    self._full_since.pop(n, None)
            else:  # moved whole: by the plan, or by agents that report no delta (they predate delta sync)
                d["bytes"] = d["full_bytes"] = planned
        job.network_bytes = full - replaced + sent
        job.full_network_bytes = full
        return sent, replaced

    def _choose_deltas(self, job: Job, records: dict[str, TensorRecord], moves: "_Moves"
                       ) -> tuple[dict[str, tuple[int, int]], Callable[[], None] | None]:
        """Which tensors of reshard_many ``job`` move as deltas, each with its base (src_version, dst_version);
        records every tensor's mode and why in ``job.deltas``, priced by its expected network bytes (rate x full
        for a delta; full where its rate is unknown yet) in ``job.expected_network_bytes``.

        A base pair is usable when its src version is in the sharding of the version moved and its dst version in
        the destination's, both hold one content (a reshard's copy of the other) and neither lost a device. With
        ``job.delta`` None a usable pair is used where a delta pays (`_delta_pays`: the link time it saves at the
        tensor's last change rate, or at none where that is unknown, against its hosts' CPU to diff and apply), and
        not where the tensor's last delta sync sent more than `DELTA_FULL_ABOVE` of its full bytes (then every
        `DELTA_PROBE_EVERY`-th sync tries again); True uses every usable pair; False none.

        Returns the bases, and where no tensor can move as a delta (delta off, a first sync, base pairs in other
        layouts: a weight sync that moves its tensors there and back) the report to write as the job's agents run:
        every tensor moves whole then, and a state dict's job writes 139,583 entries (501 took 3.7 ms here)."""
        pairs = self.catalog.bases(records) if self.catalog.delta and job.delta is not False else {}
        topology = self.registry.topology() if pairs else None
        bases: dict[str, tuple[int, int]] = {}
        made = _made_scales(job)

        def report() -> None:
            self._delta_report(job, records, moves, pairs, topology, made, bases)

        # A pair whose src version has another sharding than the version moved starts no delta, whatever else
        # holds (`_whole`'s other reasons say whole as well): told by the shardings' kept hashes first, as a weight
        # sync that moves its tensors there and back meets it for every tensor of every job, ahead of its start
        # (501 tensors through `_whole` took 2.4 ms of the planner there, between the request and its first call)
        network = moves.tensor_network
        if all(hash(pair[1].sharding) != hash(rec.sharding)
               or self._whole(job, n, rec, pair, network.get(n, 0), made, explain=False)
               for n, pair in pairs.items() if (rec := records.get(n)) is not None):
            return bases, report
        report()
        return bases, None

    def _whole(self, job: Job, n: str, rec: TensorRecord | None, pair, full: int, made: dict[str, str],
               explain: bool = True) -> str:
        """Why tensor ``n`` of reshard_many ``job`` moves whole whatever its change rate; "" where a delta may pay
        (`_delta_report` prices it). Without ``explain``, any non-empty text stands for why (`_unusable`)."""
        if n in job.dtypes:
            return (f"quantized on the way, {rec.dtype} -> {job.dtypes[n]}: a delta needs one dtype at both ends, "
                    f"so it moves whole") if explain else "dtype"
        if n in made:
            return (f"the block scales of {made[n]!r}, made on the way as it is quantized: nothing to diff "
                    f"against") if explain else "made"
        if not self.catalog.delta:
            return "the planner runs with --no-delta"
        if job.delta is False:
            return "delta off for this job (delta=False)"
        if pair is None:
            return "no base pair held (the tensor's first sync, or its pair expired)"
        if not full:
            return "its moves stay within hosts: no network bytes to save"
        return _unusable(pair[1], pair[2], rec, job.dsts[n], explain)

    def _delta_report(self, job: Job, records: dict[str, TensorRecord], moves: "_Moves", pairs: dict,
                      topology: Topology | None, made: dict[str, str], bases: dict[str, tuple[int, int]]) -> None:
        """`_choose_deltas`'s decision per tensor, recorded in ``job.deltas``; those that move as deltas are added
        to ``bases``."""
        for n, rec in [*records.items(), *((s, None) for s in made if s not in records)]:
            full = moves.tensor_network.get(n, 0)
            mode, expected = "full", full
            pair = pairs.get(n)
            why = self._whole(job, n, rec, pair, full, made)
            if not why:
                base = f"base v{pair[0].src} -> v{pair[0].dst}"
                with self._lock:
                    rate = self._change_rates.get(n)
                    if rate is not None and rate > DELTA_FULL_ABOVE and job.delta is None:
                        self._full_since[n] += 1
                        if self._full_since[n] >= DELTA_PROBE_EVERY:
                            self._full_since.pop(n)
                            rate = None  # tried again: the change rate may have fallen
                # Unknown, the rate is priced at nothing changed: a delta is tried where it could pay at all.
                saved, codec = _delta_pays(moves.tensor_codec.get(n), topology, rate or 0.0)
                if job.delta is True:
                    mode, why = "delta", f"{base}; delta=True"
                elif rate is not None and rate > DELTA_FULL_ABOVE:
                    why = (f"its last delta sync sent {rate:.0%} of the full bytes (above {DELTA_FULL_ABOVE:.0%}): "
                           f"a full move pays")
                elif saved <= codec:
                    changed = "with nothing changed" if rate is None else f"at its last rate, {rate:.1%} of the bytes"
                    why = (f"a delta would save {_ms(saved)} of link time {changed}, and cost its hosts "
                           f"{_ms(codec)} to diff and apply (reshard.delta.SENDER_PASSES and RECEIVER_PASSES over "
                           f"the boxes at each host's memory rate): on links this fast a full move pays")
                elif rate is None:
                    mode, why = "delta", f"{base}; change rate unknown: trying a delta"
                else:
                    mode, why = "delta", f"{base}; its last delta sync sent {rate:.1%} of the full bytes"
                if mode == "delta":
                    bases[n] = (pair[0].src, pair[0].dst)
                    expected = round(full * rate) if rate is not None else full
            job.deltas[n] = {"mode": mode, "why": why, "bytes": full, "full_bytes": full, "expected": expected}
        job.expected_network_bytes = sum(d["expected"] for d in job.deltas.values())
        job.full_network_bytes = moves.network_bytes

    def _best_effort(self, fn, hosts) -> None:
        hosts = list(hosts)
        if len(hosts) == 1:  # called here: handing one call to the pool and back cost two thread switches
            try:
                fn(hosts[0])
            except Exception as e:  # noqa: BLE001 - cleanup must reach every other host
                log.info("cleanup call to host %s failed: %s", hosts[0], e)
            return
        futures = {self._calls_pool.submit(fn, h): h for h in hosts}
        for f, h in futures.items():
            try:
                f.result(timeout=self.rpc_timeout_s)
            except Exception as e:  # noqa: BLE001 - cleanup must reach every other host
                log.info("cleanup call to host %s failed: %s", h, e)


def _delta_pays(codec: tuple[dict[str, int], dict[str, int]] | None, topology: Topology,
                rate: float) -> tuple[float, float]:
    """(link seconds a tensor's delta saves, seconds of its hosts' CPU it costs), summed over hosts.

    ``codec`` is the tensor's box bytes each host diffs (as a sender) and applies (as a hop's receiver,
    `_Moves.tensor_codec`); ``rate`` the share of the full bytes a delta still sends. A hop saves ``1 - rate`` of its
    bytes over its host's NIC; the codec costs `reshard.delta.SENDER_PASSES` (resp. ``RECEIVER_PASSES``) passes over
    the bytes at the host's memory rate (the agent's probe). Every host works at once on both, so the sums compare
    like with like."""
    if not codec:
        return 0.0, 0.0
    diffs, applies = codec
    saved = sum(b * (1.0 - rate) / topology.nic_bytes_per_s(h) for h, b in applies.items())
    cost = (sum(b * SENDER_PASSES / topology.memory_bytes_per_s(h) for h, b in diffs.items())
            + sum(b * RECEIVER_PASSES / topology.memory_bytes_per_s(h) for h, b in applies.items()))
    return saved, cost


def reads_at_of(program: Program, moved: list[str], versions: list[int], converts: bool) -> int | None:
    """The version a reshard_many job's Prepares name its reads by (`Preparation.reads_at`), or None for columns:
    where its tensors ``moved`` (each reading its own stored name, at ``versions``) are every program tensor with
    a source, all at one version, and none is converted on the way (``converts``: a quantized weight is read under
    another program tensor's name, and it and its scale commit as versions of their own)."""
    if converts or not versions or len(moved) != program.num_sources or versions.count(versions[0]) != len(versions):
        return None
    return versions[0]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


class _Commits:
    """Each record a job commits, as it was (None: a new tensor) and as it will be (``records``), made when first
    asked for: a state dict's job makes 139,583, which nothing needs before its agents start; and the hosts of the
    meshes they commit into (``hosts``), which the job needs at once."""

    def __init__(self, make: Callable[[], list[tuple[TensorRecord | None, TensorRecord]]], meshes: Iterable[Mesh],
                 check: Callable[[], None] | None = None):
        self._make = make
        self.hosts = frozenset(h for mesh in set(meshes) for h in mesh.hosts)
        self._check = check

    def make_meanwhile(self) -> None:
        """Make the records on a thread of their own, as the job's hosts run (the first to ask for them waits for
        them): a 501-tensor weight sync's took 3.5 ms of its end, after its last host was done, and as many of its
        start where they were made as the planner handed the hosts their calls."""
        def make() -> None:
            with suppress(Exception):  # raised again where the commit asks for them
                self.records  # noqa: B018 - made and kept (cached_property, under its lock)

        threading.Thread(target=make, name="commit-records", daemon=True).start()

    def check(self) -> None:
        """Raise where a record the job read as it started is no longer current (`JobRunner._sync_work` reads
        them as it commits)."""
        self.records  # noqa: B018 - made first: the check reads what they were made from
        if self._check is not None:
            self._check()

    @classmethod
    def of(cls, records: list[tuple[TensorRecord | None, TensorRecord]]) -> "_Commits":
        return cls(lambda: records, {new.sharding.mesh for _, new in records})

    @cached_property
    def records(self) -> list[tuple[TensorRecord | None, TensorRecord]]:
        return self._make()


class _KeptSync(NamedTuple):
    """What a registered sync's last planned job found (`JobRunner._work`), that its next compares to reuse the
    program (`JobRunner._sync_work`)."""

    basis: tuple  # (`Catalog.shapes`, topology)
    dsts: dict  # the sync's arguments' destinations (the very object)
    sources: list  # each tensor's source sharding object, kept alive: ``layouts`` holds their ids
    dtypes: list[str]  # each tensor's dtype
    hit: tuple  # (program, text)
    layouts: np.ndarray  # ``id`` of each of ``sources``, as the catalog's columns hold them
    dtype_ids: np.ndarray  # ``dtypes`` as the columns hold them
    meshes: frozenset  # the destination meshes: where the job commits
    reads: tuple | None  # where the sync quantizes on the way, its reads as `_sync_reads` works them out
    labeled: np.ndarray | None  # where it does, which of its tensors a step names (not the scales it makes)


@dataclass(frozen=True)
class _Work:
    """A job's program as planned: its JSON and id, its moves (each with its tensor's item size), its hosts, the
    versions it reads, and each record it commits (`_Commits`)."""

    program_json: str
    program_id: str
    moves: "_Moves"
    hosts: list[str]
    src_version: int
    reads: dict[str, tuple[str, int]]
    commits: _Commits
    delta_bases: dict[str, tuple[int, int]] = field(default_factory=dict)  # reshard_many: `_choose_deltas`
    host_texts: dict[str, str] = field(default_factory=dict)  # host -> its slice, where the program is cut per host
    host_tensors: dict[str, frozenset[str]] = field(default_factory=dict)  # host -> the tensors its slice declares
    report: Callable[[], None] | None = None  # what to record of the job once its agents run (`_choose_deltas`)
    reads_at: int | None = None  # every program tensor with a source reads its own name at it (`Preparation`)
    columns: tuple | None = None  # ``reads`` as columns instead (`Preparation.columns`)


@dataclass(frozen=True)
class _Moves:
    """What the runner needs of a job's moves (each with its tensor's item size), worked out once per program and
    kept without the moves themselves (a state dict's program has millions): every host a move or step touches,
    the bytes each host sends as a sender (its progress total), per move whether it crosses a NIC, the bytes that
    go over NICs and within hosts, and the most streams pushed into any one host (``pushes_in``; None where the
    count is unbounded: a reduce's ring messages), and the bytes that go over NICs per program tensor (where the
    moves' tensors were given)."""

    hosts: frozenset[str]
    to_send: dict[str, int]
    network: list[bool]
    network_bytes: int
    local_bytes: int
    pushes_in: int | None = 0
    # the hosts a move's network hop reaches, those reached by the most first: a job calls them first
    # (`receivers_first`)
    receivers: tuple[str, ...] = ()
    tensor_network: dict[str, int] = field(default_factory=dict)
    # per program tensor: the bytes of its moves' boxes each sending host would diff and each host a hop reaches
    # would apply as deltas (`_delta_pays`); moves within a host are left out, as no bytes of theirs cross a NIC
    tensor_codec: dict[str, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)
    # transport -> what carries each move on it (``transport``, or "local" where it stays within a host), made once
    # per transport: a state dict's program has millions of moves, and every job of it names them (`Job.transports`)
    _carriers: dict[str, list[str]] = field(default_factory=dict, compare=False, repr=False)

    def carriers(self, transport: str) -> list[str]:
        """What carries each move on ``transport`` (shared by the jobs of the program: read it, never change it)."""
        got = self._carriers.get(transport)
        if got is None:
            got = self._carriers[transport] = [transport if net else "local" for net in self.network]
        return got

    @classmethod
    def of(cls, moves: list[tuple[Transfer, int]], hosts: set[str], reduces: bool = False,
           tensors: list[str] | None = None) -> "_Moves":
        """``moves`` and the hosts their steps touch besides (``hosts``); ``reduces``: the program has reduce
        steps, whose ring messages are pushes too; ``tensors``: each move's program tensor."""
        hosts = set(hosts)
        # A state dict's moves share their transfers (a layout's tensors move alike: 2.2 million moves of the
        # 61-layer Kimi-K2-like program quantized on the way, a few hundred thousand distinct transfers): each
        # distinct (transfer, item size) is worked out once and counted as often as it moves (this loop, move by
        # move, took a minute for that program).
        # (numbered as columns: each move's transfer object, then that number and its item size as one int64; the
        # moves hold the objects, so their ids stay theirs)
        objects = np.fromiter(map(id, map(_FIRST, moves)), dtype=np.uint64, count=len(moves))
        itemsizes = np.fromiter(map(_SECOND, moves), dtype=np.int64, count=len(moves))
        numbered = np.unique(objects, return_inverse=True)[1].astype(np.int64).reshape(-1)
        sizes_seen = np.unique(itemsizes, return_inverse=True)
        firsts, key = np.unique(numbered * len(sizes_seen[0]) + sizes_seen[1].reshape(-1), return_index=True,
                                return_inverse=True)[1:]
        key = key.reshape(-1)
        distinct = list(map(moves.__getitem__, firsts.tolist()))
        count = np.bincount(key, minlength=len(distinct)).tolist()
        to_send: dict[str, int] = defaultdict(int)
        pushed: dict[str, int] = defaultdict(int)
        network_bytes = local_bytes = 0
        senders, sizes, copies = [], [], []  # per distinct transfer: its sender's host, box bytes, network hops
        for (t, itemsize), times in zip(distinct, count):
            sender = host_of(t.sender)
            hosts |= {sender, *map(host_of, t.receivers), *t.route}
            to_send[sender] += sender_bytes([t], itemsize, sender) * times
            n = boxes.volume(t.box) * itemsize
            went = hops(t)
            for hop in went:
                pushed[hop.dst] += times
            network_bytes += n * len(went) * times
            local_bytes += n * sum(host_of(r) == sender for r in t.receivers) * times
            senders.append(sender)
            sizes.append(n)
            copies.append(tuple(hop.dst for hop in went))
        network = np.fromiter(map(bool, copies), dtype=bool, count=len(copies))[key].tolist()
        per_tensor: dict[str, int] = {}
        codec: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
        if tensors is not None and len(moves):
            # per tensor, the transfers it moves in (its keys, in step order): tensors that move alike share the
            # figures below, worked out once
            names = list(dict.fromkeys(tensors))
            position = {name: j for j, name in enumerate(names)}
            of_tensor = np.fromiter(map(position.__getitem__, tensors), dtype=np.int64, count=len(tensors))
            order = np.argsort(of_tensor, kind="stable")
            bounds = np.searchsorted(of_tensor[order], np.arange(len(names) + 1)).tolist()
            grouped = key[order].tolist()
            alike: dict[tuple[int, ...], tuple] = {}
            for j, name in enumerate(names):
                sig = tuple(grouped[bounds[j]:bounds[j + 1]])
                found = alike.get(sig)
                if found is None:
                    diffs: dict[str, int] = defaultdict(int)
                    applies: dict[str, int] = defaultdict(int)
                    total = 0
                    for k in sig:
                        if copies[k]:
                            total += sizes[k] * len(copies[k])
                            diffs[senders[k]] += sizes[k]
                            for dst in copies[k]:
                                applies[dst] += sizes[k]
                    found = alike[sig] = (total, (dict(diffs), dict(applies)) if diffs else None)
                per_tensor[name] = found[0]
                if found[1] is not None:
                    codec[name] = (dict(found[1][0]), dict(found[1][1]))
        pushes_in = None if reduces and len(hosts) > 1 else max(pushed.values(), default=0)
        receivers = tuple(sorted(pushed, key=lambda h: (-pushed[h], h)))
        return cls(frozenset(hosts), dict(to_send), network, network_bytes, local_bytes, pushes_in, receivers,
                   per_tensor, codec)


_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def receivers_first(hosts: list[str], moves: _Moves) -> list[str]:
    """``hosts`` in the order a job calls them: those its moves reach over the network first, the most reached
    first (`_Moves.receivers`), then the others as they were.

    A receiver's call starts the job's bytes, a sender's does not: on nixl each receiver posts where its first
    boxes land and its senders wait for that, and on every transport a sender is ready long before. The calls go
    out from one thread each, and on cores that agents share the last reached its host 6-10 ms after the first
    (the emulated weight sync: the planner's calls left from 13 to 22 ms after the request, in no set order).
    Called first, the receivers got theirs 13-17 ms after it. The sync took 0.957 s against 0.966, then 0.957
    against 0.957 (rounds alternating, medians of 10 and 12): within this machine's noise, so the order stands on
    the reason above, not on a measured gain."""
    first = [h for h in moves.receivers if h in hosts]
    return first + [h for h in hosts if h not in first]


def program_moves(program: Program) -> _Moves:
    """What a planner works out of ``program``'s moves before it runs the program the first time (`_Moves`), read
    as columns (`Program.moves`: a state dict's runs of steps by their templates)."""
    with no_cycle_collection():  # millions of moves' tuples, in no cycle (see no_cycle_collection)
        _, transfers, tensors, itemsizes = program.moves()
        return _Moves.of(list(zip(transfers, itemsizes)), program.hosts(), REDUCE in program.step_kinds(), tensors)


def _commit_meshes(job: Job, program: Program) -> frozenset[Mesh]:
    """The meshes reshard_many ``job`` commits into: its destinations', and its quantized weights' as ``program``
    makes them."""
    return frozenset({d.mesh for d in set(job.dsts.values())} | {program.tensor(w).dst.mesh for w in job.dtypes})


def _many_commits(job: Job, program: Program, records: dict[str, TensorRecord], claimed: dict[str, int],
                  moved: list[str]) -> list[tuple[TensorRecord | None, TensorRecord]]:
    """What reshard_many ``job`` commits: each of ``moved`` bumped into its destination, each quantized weight in
    its new dtype and its scale as the program made them, all at the versions ``claimed``, from ``records`` (the
    versions the job read)."""
    out = [(r, bumped(r, job.dsts[n], claimed[n])) for n, r in zip(moved, map(records.__getitem__, moved))]
    for w, dtype in job.dtypes.items():
        rec, d = records[w], program.tensor(w)
        s = job.scales[w][0]
        made = program.tensor(s)
        out.append((rec, TensorRecord(w, rec.shape, dtype, d.dst, claimed[w], rec.kind, step=rec.step,
                                      content=new_content(), converted_from=rec.dtype)))
        out.append((records.get(s), TensorRecord(s, made.shape, made.dtype, made.dst, claimed[s], rec.kind,
                                                 step=rec.step, content=new_content())))
    return out


def _sync_reads(job: Job, dtypes: dict[str, str]) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """A quantizing registered sync's reads, in the order `JobRunner._work` makes them, worked out once: (program
    tensors, the stored names they read, each name's place in the job's tensors, and whether it reads the version
    the job claimed (a quantized weight and its scale, which the program makes) rather than the current one). Each
    tensor moved reads its own name; each quantized weight of ``dtypes`` (name -> its dtype as held) is read as
    held under its source name (`source_name`)."""
    scales = _made_scales(job)
    place = {n: i for i, n in enumerate(job.inputs)}
    moved = [n for n in job.inputs if n not in job.dtypes and n not in scales]
    keys, stored, claimed = list(moved), list(moved), [False] * len(moved)
    for w in job.dtypes:
        s = job.scales[w][0]
        keys += [w, s, source_name(w, dtypes[w])]
        stored += [w, s, w]
        claimed += [True, True, False]
    return keys, stored, np.fromiter(map(place.__getitem__, stored), np.int64, len(stored)), np.array(claimed, bool)


def _made_scales(job: Job) -> dict[str, str]:
    """A reshard_many's scales made on the way, each to its quantized weight."""
    return {job.scales[w][0]: w for w in job.dtypes}


def _made_on_the_way(job: Job) -> set[str]:
    """The tensors a reshard_many's program makes rather than moves: its quantized weights and their scales."""
    return {*job.dtypes, *_made_scales(job)}


def _commits_of(job: Job) -> list[str]:
    """The tensors ``job`` commits new versions of (what it claims versions for)."""
    if job.kind == "reshard_many":
        return list(job.inputs)
    if job.kind == "compute_many":
        return list(job.outputs)
    return [job.tensor]


def _unusable(src: TensorRecord, dst: TensorRecord, moved: TensorRecord, target: Sharding, explain: bool = True
              ) -> str:
    """Why base pair (``src``, ``dst``) cannot start a delta move of ``moved`` into ``target``; "" where it can.
    Without ``explain``, any non-empty text stands for why (a decision over every tensor of a state dict)."""
    if src.sharding != moved.sharding:
        return (f"its base pair's v{src.version} is in {src.sharding.spec_str()}, but v{moved.version} moves from "
                f"{moved.sharding.spec_str()}: the senders hold no base in that layout") if explain else "src"
    if dst.sharding != target:
        return (f"its base pair's v{dst.version} is in {dst.sharding.spec_str()}, but the job moves it to "
                f"{target.spec_str()}: the receivers hold no base in that layout") if explain else "dst"
    if not src.content or src.content != dst.content:
        return f"its base pair's v{src.version} and v{dst.version} are not known to hold the same values"
    if src.lost or dst.lost:
        return f"its base pair lost devices {sorted(src.lost | dst.lost)[:4]} when their agents restarted"
    return ""


class _Meanwhile:
    """``fn`` run on a thread of its own from `start`, or by `finish` where it never started; `finish` waits for it
    and raises what it raised. It runs once: a `start` after `finish` (a host that reports its start after the job
    failed) does nothing."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished = False

    def start(self) -> None:
        def run() -> None:
            try:
                self._fn()
            except BaseException as e:  # noqa: BLE001 - raised again by finish
                self._error = e

        with self._lock:
            if self._finished or self._thread is not None:
                return
            self._thread = threading.Thread(target=run, name="job-report", daemon=True)
            self._thread.start()

    def finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            thread = self._thread
        if thread is None:
            self._fn()
            return
        thread.join()
        if self._error is not None:
            raise self._error


def _mismatched(error: BaseException, bases: dict[str, tuple[int, int]]) -> list[str] | None:
    """The tensors to move whole after ``error``, where it is an agent's `DELTA_BASE_MISMATCH` in a run that moved
    deltas (those named ``: tensor '<name>'`` among ``bases``; all of them where none can be read); else None."""
    text = str(error)
    if not bases or DELTA_BASE_MISMATCH not in text:
        return None
    named = set(re.findall(re.escape(DELTA_BASE_MISMATCH) + r": tensor '(.+?)'", text)) & set(bases)
    return sorted(named or bases)


def _brief(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _still_fits(planned: Planned | None, records: Iterable[TensorRecord], topology: Topology) -> Program | None:
    """``planned``'s program if it was planned from ``records`` and ``topology`` as they are now, else None."""
    return planned.program if planned is not None and planned.basis == planned_from(records, topology) else None


def _ran_from_json(doc) -> Plan | Program:
    """A stored job's plan, or its program where it ran one."""
    data = loads(doc, "a stored plan", max_bytes=None) if isinstance(doc, (str, bytes)) else doc
    return program_from_json(data) if isinstance(data, dict) and data.get("kind") == "program" else Plan.from_json(data)


