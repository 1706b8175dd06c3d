"""Reshard jobs: plan, validate, hand each agent its part, wait, commit, release.

A job's life: ``queued`` (waiting for earlier jobs on the same tensor) ->
``running`` -> ``succeeded`` or ``failed``. The commit point is the catalog
swap: agents stage the new version's shards and make them visible only on
commit, and the old version's shards are released only after every receiver
confirmed and every agent committed, so a failed job leaves the source as it
was. Agent calls go through an `AgentCalls` object the service layer provides.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from reshard import box as boxes
from reshard.mesh import host_of
from reshard.plan import Plan, Transfer
from reshard.strategies import plan as make_plan
from reshard.proto.errors import DeadlineExceededError
from reshard.server.common.contract import Staging
from reshard.server.planner.catalog import Catalog, TensorRecord, bumped
from reshard.server.agent.executor import send_bytes
from reshard.server.planner.membership import GroupCoordinator
from reshard.server.planner.registry import Registry
from reshard.server.planner.state import StateStore
from reshard.sharding import Sharding

__all__ = ["Job", "JobRunner", "AgentCalls", "Preparation", "STATES"]

log = logging.getLogger(__name__)

STATES = ("queued", "running", "succeeded", "failed")


@dataclass(frozen=True)
class Preparation:
    """What an agent needs to take part in a job: the plan, the tensor's versions, its peers and transport."""

    job: str
    plan_json: str
    tensor: str
    src_version: int
    dst_version: int
    peers: dict[str, str]  # host -> agent address
    transport: str = "grpc"
    generation: int = 0  # collective: the process group generation
    job_seq: int = 0  # collective: the job's number, for message tags


class AgentCalls(Protocol):
    def prepare(self, host: str, address: str, prep: Preparation, timeout: float) -> None: ...

    def execute(self, host: str, address: str, job: str, plan_id: str, phase: int,
                on_progress: Callable[[int, int], None], timeout: float,
                prepare: Preparation | None = None) -> dict | None:
        """Run the host's part of ``phase`` (preparing first when ``prepare`` is given); returns the host's
        traffic for the job so far when the agent reports it (as `stats` does), else None."""

    def commit(self, host: str, address: str, staging: Staging, tensor: str, version: int, devices: list[str],
               timeout: float) -> None: ...

    def abort(self, host: str, address: str, staging: Staging, timeout: float) -> None: ...

    def release(self, host: str, address: str, tensor: str, version: int, timeout: float) -> None: ...

    def stats(self, host: str, address: str, job: str, timeout: float) -> dict: ...


@dataclass
class Job:
    id: str
    tensor: str
    dst: Sharding
    strategy: str
    state: str = "queued"
    error: str = ""
    plan: Plan | None = None
    created: float = field(default_factory=time.time)
    started: float = 0.0
    finished: float = 0.0
    version: int = 0
    progress: dict[str, list[int]] = field(default_factory=dict)  # host -> [done, total]
    traffic: dict[str, dict] = field(default_factory=dict)  # host -> {bytes_in, bytes_out, local_bytes}
    transport: str = ""  # grpc or collective, once chosen
    transports: list[str] = field(default_factory=list)  # per plan transfer: grpc, collective or local
    done_event: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def seconds(self) -> float:
        if not self.started:
            return 0.0
        return (self.finished or time.time()) - self.started

    def to_json(self) -> dict:
        return {"id": self.id, "tensor": self.tensor, "dst": self.dst.to_json(), "strategy": self.strategy,
                "state": self.state, "error": self.error, "plan_id": self.plan.id if self.plan else "",
                "created": self.created, "started": self.started, "finished": self.finished,
                "version": self.version, "progress": self.progress, "traffic": self.traffic,
                "transport": self.transport, "transports": self.transports}

    @classmethod
    def from_json(cls, d: dict, plan: Plan | None) -> "Job":
        job = cls(d["id"], d["tensor"], Sharding.from_json(d["dst"]), d["strategy"], d["state"], d["error"], plan,
                  d["created"], d["started"], d["finished"], d["version"], d["progress"], d["traffic"],
                  d.get("transport", ""), d.get("transports", []))
        if job.state in ("queued", "running"):
            job.state, job.error = "failed", "the planner restarted while this job was in flight"
        job.done_event.set()
        return job


class JobRunner:
    def __init__(self, registry: Registry, catalog: Catalog, store: StateStore, agents: AgentCalls, *,
                 job_timeout_s: float, rpc_timeout_s: float, max_concurrent: int,
                 group: GroupCoordinator | None = None, group_wait_s: float = 0.0):
        self.registry = registry
        self.group = group
        self.group_wait_s = group_wait_s
        self._moved: dict[str, int] = defaultdict(int)  # bytes moved by succeeded jobs, per transport
        self.catalog = catalog
        self.store = store
        self.agents = agents
        self.job_timeout_s = job_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        # (generation, job id, hosts by phase) -> None: drops a collective job's keys from the rendezvous store
        self.collective_cleanup: Callable[[int, str, dict[int, list[str]]], None] | None = None
        self._nccl_turn = threading.Lock()  # one collective job at a time on an NCCL group
        self._jobs_pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="job")
        self._calls_pool = ThreadPoolExecutor(max(8, 4 * max_concurrent), thread_name_prefix="agent-call")
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._tensor_locks: dict[str, threading.Lock] = {}
        for doc in store.jobs():
            plan_doc = store.plan(doc["plan_id"]) if doc.get("plan_id") else None
            job = Job.from_json(doc, Plan.from_json(plan_doc) if plan_doc else None)
            self._jobs[job.id] = job

    def submit(self, tensor: str, dst: Sharding, strategy: str) -> Job:
        job = Job(uuid.uuid4().hex, tensor, dst, strategy)
        with self._lock:
            self._jobs[job.id] = job
            lock = self._tensor_locks.setdefault(tensor, threading.Lock())
        self.store.save_job(job.to_json())
        self._jobs_pool.submit(self._run, job, lock)
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def list(self) -> list[Job]:
        """Every job the planner knows, newest first."""
        with self._lock:
            return sorted(self._jobs.values(), key=lambda j: j.created, reverse=True)

    def bytes_moved(self) -> dict[str, int]:
        """Bytes succeeded jobs moved, by transport: grpc and collective over the network, local within hosts."""
        with self._lock:
            return dict(self._moved)

    def busy(self, tensor: str) -> bool:
        with self._lock:
            return any(j.tensor == tensor and j.state in ("queued", "running") for j in self._jobs.values())

    # -- running ------------------------------------------------------------------------

    def _run(self, job: Job, lock: threading.Lock) -> None:
        with lock:
            job.state, job.started = "running", time.time()
            self.store.save_job(job.to_json())
            superseded = None
            try:
                superseded = self._reshard(job)
                job.state = "succeeded"
            except Exception as e:  # noqa: BLE001 - every failure is recorded on the job
                job.state = "failed"
                job.error = f"reshard of {job.tensor!r} to {job.dst.spec_str()} failed: {e}"
                log.warning("job %s failed: %s", job.id[:8], job.error)
            finally:
                job.finished = time.time()
                self.store.save_job(job.to_json())
                job.done_event.set()
            if superseded is not None:
                # The new version is committed and the caller has it; freeing the old one is housekeeping,
                # still under the tensor's lock so the next job on this tensor starts after it.
                self.release(superseded)

    def release(self, rec: TensorRecord) -> None:
        """Free ``rec``'s version on every host of its mesh that is registered, at once; failures are logged."""
        src_agents = {h: a for h in rec.sharding.mesh.hosts if (a := self.registry.get(h)) is not None}
        self._best_effort(lambda h: self.agents.release(h, src_agents[h].address, rec.name, rec.version,
                                                        self.rpc_timeout_s), sorted(src_agents))

    def _fan_out(self, fn, hosts, deadline: float) -> None:
        """Call ``fn(host)`` for every host at once; raise the first error, naming its host."""
        futures = {self._calls_pool.submit(fn, h): h for h in hosts}
        done, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
        if pending:
            late = sorted(futures[f] for f in pending)
            raise DeadlineExceededError(f"agents of hosts {late} did not finish within the job timeout "
                                        f"({self.job_timeout_s:g}s)")

    def _reshard(self, job: Job) -> TensorRecord:
        """Run the job up to its commit; returns the tensor's record as it was, whose version is now free."""
        rec: TensorRecord = self.catalog.get(job.tensor)
        deadline = time.monotonic() + self.job_timeout_s
        plan = make_plan(rec.shape, rec.dtype, rec.sharding, job.dst, self.registry.topology(), job.strategy)
        plan.validate()
        job.plan = plan
        plan_json = plan.dumps()
        self.store.save_plan(plan.id, plan_json)
        hosts = set(job.dst.mesh.hosts) | {host_of(t.sender) for t in plan.transfers}
        hosts |= {h for t in plan.transfers for h in t.route}
        hosts = sorted(hosts)
        peers = {h: self.registry.require_up(h).address for h in hosts}
        job.version = rec.version + 1
        job.progress = {h: [0, send_bytes(plan, h)] for h in hosts}
        dst_hosts = sorted(job.dst.mesh.hosts)
        timeout = self.rpc_timeout_s
        transport, generation, seq = (self.group.choose(hosts, self.group_wait_s) if self.group
                                      else ("grpc", 0, 0))
        job.transport = transport
        job.transports = [transport if _network(t) else "local" for t in plan.transfers]
        prep = Preparation(job.id, plan_json, rec.name, rec.version, job.version, peers, transport, generation, seq)
        phases = sorted({t.phase for t in plan.transfers})
        traffic: dict[str, dict] = {}
        runs = {phase: _phase_hosts(plan, phase, transport) for phase in phases}
        # NCCL has no message tags and orders the calls on a communicator: two jobs interleaving their
        # sends and recvs in different orders on different agents would deadlock, so NCCL jobs take turns.
        serial = transport == "collective" and self.group is not None and self.group.view().backend == "nccl"
        if serial:
            self._nccl_turn.acquire()
        try:
            # On the collective transport the first phase's hosts prepare inside their Execute call: the
            # plan-id confirmation before any send or recv waits for every peer anyway.
            early = set(runs[phases[0]]) if transport == "collective" and phases else set()
            self._fan_out(lambda h: self.agents.prepare(h, peers[h], prep, timeout),
                          [h for h in hosts if h not in early], deadline)
            base = {h: 0 for h in hosts}
            for phase in phases:
                def run(h, phase=phase):
                    def on_progress(done: int, total: int) -> None:
                        job.progress[h][0] = base[h] + done
                    reported = self.agents.execute(h, peers[h], job.id, plan.id, phase, on_progress,
                                                   max(0.1, deadline - time.monotonic()),
                                                   prep if h in early and phase == phases[0] else None)
                    base[h] = job.progress[h][0] = base[h] + send_bytes(plan, h, phase)
                    if transport == "collective" and reported is not None:
                        traffic[h] = reported  # all of a host's collective traffic happens inside its Executes

                self._fan_out(run, runs[phase], deadline)
            # Each host's traffic is final once the phases ran: what Execute did not report is fetched
            # while the receivers commit.
            stats = {self._calls_pool.submit(self.agents.stats, h, peers[h], job.id, timeout): h
                     for h in hosts if h not in traffic}
            self._fan_out(lambda h: self.agents.commit(h, peers[h], Staging(job=job.id), rec.name, job.version, [], timeout),
                          dst_hosts, deadline)
            self.catalog.swap(rec, bumped(rec, job.dst))
        except BaseException as e:
            if transport == "collective" and self.group is not None:
                # A failed call may leave recvs posted and gloo pairs closed: the next job gets a fresh group.
                self.group.reform(f"job {job.id[:8]} failed on generation {generation}: {str(e)[:120]}")
            self._best_effort(lambda h: self.agents.abort(h, peers[h], Staging(job=job.id), timeout), hosts)
            self._best_effort(lambda h: self.agents.release(h, peers[h], rec.name, job.version, timeout), dst_hosts)
            raise
        finally:
            if serial:
                self._nccl_turn.release()
            if transport == "collective" and self.collective_cleanup is not None:
                try:
                    self.collective_cleanup(generation, job.id, runs)
                except Exception as e:  # noqa: BLE001 - a few stale keys are no reason to fail the job
                    log.info("could not drop the confirmation keys of job %s: %s", job.id[:8], e)
        self.store.save_tensor(self.catalog.get(rec.name).to_json())
        with self._lock:
            for t in plan.transfers:
                n = boxes.volume(t.box) * plan.itemsize
                self._moved[job.transport] += n * _network(t)
                self._moved["local"] += n * sum(host_of(r) == host_of(t.sender) for r in t.receivers)
        job.traffic.update(traffic)
        for f, h in stats.items():
            try:
                job.traffic[h] = f.result(timeout=self.rpc_timeout_s)
            except Exception as e:  # noqa: BLE001 - statistics are informative only
                log.info("no traffic statistics from %s for job %s: %s", h, job.id[:8], e)
        return rec

    def _best_effort(self, fn, hosts) -> None:
        futures = {self._calls_pool.submit(fn, h): h for h in hosts}
        for f, h in futures.items():
            try:
                f.result(timeout=self.rpc_timeout_s)
            except Exception as e:  # noqa: BLE001 - cleanup must reach every other host
                log.info("cleanup call to host %s failed: %s", h, e)


def _phase_hosts(plan: Plan, phase: int, transport: str) -> list[str]:
    """The hosts whose agents run ``phase``: its senders; on the collective transport also every host that
    receives or relays (they post the recvs)."""
    ts = [t for t in plan.transfers if t.phase == phase]
    hosts = {host_of(t.sender) for t in ts}
    if transport == "collective":
        hosts |= {h for t in ts for h in (*map(host_of, t.receivers), *t.route)}
    return sorted(hosts)


def _network(t: Transfer) -> int:
    """How many times a transfer's box crosses the network (0: it stays on the sender's host)."""
    src = host_of(t.sender)
    if t.method == "broadcast":
        return len(t.route)
    if t.method == "p2p":
        return sum(host_of(r) != src for r in t.receivers)
    return 0
