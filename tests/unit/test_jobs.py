"""The planner's job runner against agents in this process: runtimes on the in-memory transport behind a fake
`AgentCalls`, so the job's control flow (one Execute per host, commit, abort on failure) is seen call by call."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.server.agent.store import ShardStore, TileBuffer
from reshard.server.planner.catalog import Catalog, TensorRecord
from reshard.server.planner.jobs import PHASES, JobRunner, Preparation
from reshard.server.planner.registry import Registry
from reshard.server.planner.state import StateStore
from reshard.server.transport.faults import Fail

from .test_runtime import HOSTS, Hosts

SHAPE = (37, 12)
SRC = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[:2]), 2), ("x", None))
DST = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[2:]), 2), (None, "y"))


class RuntimeCalls:
    """`AgentCalls` that call the hosts' runtimes directly, recording (call, host)."""

    def __init__(self, hosts: Hosts):
        self.hosts = hosts
        self.calls: list[tuple[str, str]] = []
        self.prepared: list[Preparation] = []  # every Preparation handed over, in order
        self._lock = threading.Lock()

    def _record(self, call: str, host: str):
        with self._lock:
            self.calls.append((call, host))
        return self.hosts.runtimes[host]

    def prepare(self, host, address, prep: Preparation, timeout):
        with self._lock:
            self.prepared.append(prep)
        # as a Prepare carries its reads: one version for every tensor (`PrepareRequest.reads_at`), else columns
        reads = None if prep.reads_at is not None else prep.reads_for(host)
        self._record("prepare", host).prepare(prep.job, prep.text_for(host), prep.tensor, prep.src_version,
                                              prep.dst_version, prep.peers, "memory", reads=reads,
                                              reads_at=prep.reads_at)

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
        if prepare is not None:  # a small job's hosts prepare inside their Execute
            self.prepare(host, address, prepare, timeout)
        runtime = self._record("execute+commit" if commit else "execute", host)
        run = runtime.execute(job, program_id)
        while not run.wait(0.02, runtime.step_timeout_s):
            on_progress(*run.progress())
        run.check()
        if commit:
            runtime.commit(job)
        on_progress(*run.progress())
        t = runtime.traffic(job)
        return {"bytes_in": dict(t.bytes_in), "bytes_out": dict(t.bytes_out), "local_bytes": t.local_bytes}

    def commit(self, host, address, staging, tensor, version, devices, timeout):
        self._record("commit", host).commit(staging.job)

    def abort(self, host, address, staging, timeout):
        self._record("abort", host).abort(staging.job)

    def release(self, host, address, versions, timeout):
        self._record("release", host)
        for tensor, version in versions:
            self.hosts.stores[host].release(tensor, version)

    def count(self, call: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for c, h in self.calls:
            if c == call:
                out[h] = out.get(h, 0) + 1
        return out


def _runner(hosts: Hosts, store: StateStore | None = None) -> tuple[JobRunner, RuntimeCalls, Catalog, np.ndarray]:
    registry = Registry(heartbeat_timeout_s=60.0)
    for h in HOSTS:
        registry.register(h, 2, h, 10.0, secret=bytes(16))
    catalog = Catalog()
    a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
    catalog.add(TensorRecord("t", SHAPE, "int32", SRC, 1))
    hosts.put_tensor("t", a, SRC)
    calls = RuntimeCalls(hosts)
    runner = JobRunner(registry, catalog, store or StateStore(None), calls, job_timeout_s=30.0, rpc_timeout_s=10.0,
                       max_concurrent=2)
    return runner, calls, catalog, a


def _watched_runner(hosts: Hosts, registry: Registry, calls: RuntimeCalls, stall_timeout_s: float):
    """A runner on ``registry`` and ``calls`` (whose hosts a test makes stop answering), with "t" put on SRC."""
    catalog = Catalog()
    a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
    catalog.add(TensorRecord("t", SHAPE, "int32", SRC, 1))
    hosts.put_tensor("t", a, SRC)
    return JobRunner(registry, catalog, StateStore(None), calls, job_timeout_s=60.0, rpc_timeout_s=30.0,
                     max_concurrent=2, stall_timeout_s=stall_timeout_s), a


def test_a_job_hands_every_host_the_program_once_and_runs_it_with_one_execute_per_host():
    hosts = Hosts()
    try:
        runner, calls, catalog, a = _runner(hosts)
        dst = Sharding(DST.mesh, (None, None))
        job = runner.submit("t", dst, "local_allgather")  # two phases: the planner used to run each apart
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert len({t.phase for t in job.plan.transfers}) == 2
        every = {h: 1 for h in HOSTS}
        assert calls.count("prepare") == every
        assert calls.count("execute") | calls.count("execute+commit") == every
        # every host that stages the new version commits it as its run ends: no Commit round after the runs
        assert calls.count("execute+commit") == {h: 1 for h in DST.mesh.hosts} and not calls.count("commit")
        assert not calls.count("abort")
        released = {h: 1 for h in SRC.mesh.hosts}  # the old version, once the job is done
        deadline = time.monotonic() + 5
        while calls.count("release") != released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls.count("release") == released
        assert catalog.get("t").version == 2 and np.array_equal(hosts.get("t", dst, SHAPE), a)
        assert set(job.traffic) == set(HOSTS)
        assert all(done == total for done, total in job.progress.values())
        assert all(done == total for done, total in job.steps.values())
        # where the time went: every phase, in order, and each host's Execute within the running phase
        assert list(job.phases) == list(PHASES) and all(s >= 0 for s in job.phases.values())
        assert job.phases["waiting"] == pytest.approx(job.started - job.created)
        assert sum(list(job.phases.values())[1:]) <= job.seconds
        assert set(job.host_seconds) == set(HOSTS) and max(job.host_seconds.values()) <= job.phases["running"]
    finally:
        hosts.close()


def test_a_failed_step_fails_the_job_aborts_every_host_and_leaves_the_source():
    hosts = Hosts(wrap=lambda host, t: Fail(t, steps=range(1000)) if host == "host1" else t)
    try:
        runner, calls, catalog, a = _runner(hosts)
        job = runner.submit("t", DST, "broadcast")
        assert job.done_event.wait(30) and job.state == "failed"
        assert "failed on host host1 (injected by the test)" in job.error
        assert list(job.phases) == ["waiting", "planning"]  # it never finished running, nor committed
        assert calls.count("abort") == {h: 1 for h in HOSTS}
        assert not calls.count("commit")
        # The aborts undo what any host committed, by the job: no release by tensor and version, which could free
        # a retry's same version where it reached a paused host late.
        assert not calls.count("release")
        assert catalog.get("t").version == 1
        for d in DST.mesh.devices:
            assert hosts.stores[d.split("/")[0]].find("t", 2, d) is None
        for d, box in SRC.tiles(SHAPE).items():
            shard = hosts.stores[d.split("/")[0]].get("t", 1, d)
            assert np.array_equal(shard.array, a[tuple(slice(lo, hi) for lo, hi in box)])
    finally:
        hosts.close()


@pytest.mark.parametrize("strategy", ["send_recv", "broadcast", "auto"])
def test_jobs_of_every_strategy_commit_what_the_plan_moves(strategy):
    hosts = Hosts()
    try:
        runner, calls, catalog, a = _runner(hosts)
        job = runner.submit("t", DST, strategy)
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert runner.bytes_moved().get("grpc", 0) == job.plan.network_bytes()
        assert np.array_equal(hosts.get("t", DST, SHAPE), a)
    finally:
        hosts.close()


class Unanswering(RuntimeCalls):
    """`RuntimeCalls` where ``host`` stops answering once its part started: its Execute reports once and then
    stays silent, and its Abort waits until ``resume`` is set, as calls to a paused agent do."""

    def __init__(self, hosts: Hosts, host: str, on_pause=lambda: None):
        super().__init__(hosts)
        self.host = host
        self.on_pause = on_pause
        self.resume = threading.Event()

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
        if host != self.host:
            return super().execute(host, address, job, program_id, on_progress, timeout, prepare, commit)
        if prepare is not None:
            self.prepare(host, address, prepare, timeout)
        self._record("execute", host).execute(job, program_id)
        on_progress(0, 0, 0, 1)
        self.on_pause()
        self.resume.wait(timeout)
        return None

    def abort(self, host, address, staging, timeout):
        if host == self.host:
            self.resume.wait(timeout)
        super().abort(host, address, staging, timeout)


@pytest.mark.parametrize("how", ["heartbeats", "progress reports"])
def test_a_host_that_stops_answering_fails_the_job_naming_it_before_its_own_cleanup_ends(how):
    now = [0.0]
    # Heartbeats run on this test's clock; the half-second timeout also bounds, in real time, how long a host's
    # last progress report vouches for it once its heartbeats stop.
    registry = Registry(heartbeat_timeout_s=0.5, clock=lambda: now[0])
    for h in HOSTS:
        registry.register(h, 2, h, 10.0, secret=bytes(16))

    def stop_heartbeats() -> None:  # host3's last heartbeat is 100 s old; the others' are fresh
        now[0] = 100.0
        for h in HOSTS[:3]:
            registry.register(h, 2, h, 10.0, secret=bytes(16))

    hosts = Hosts()
    calls = Unanswering(hosts, "host3", stop_heartbeats if how == "heartbeats" else lambda: None)
    try:
        runner, a = _watched_runner(hosts, registry, calls, stall_timeout_s=60.0 if how == "heartbeats" else 0.5)
        job = runner.submit("t", DST, "send_recv")
        assert job.done_event.wait(20) and job.state == "failed"
        why = "no heartbeat for 100.0s" if how == "heartbeats" else r"no progress report for [\d.]+s"
        assert re.search(rf"failed: host host3 stopped answering: {why}", job.error), job.error
        # the failure is published once the hosts that answer are clean; the paused host's calls come last
        assert calls.count("abort") == {h: 1 for h in HOSTS[:3]}
        retry = runner.submit("t", DST, "send_recv")  # waits behind the paused host's cleanup
        calls.host = ""
        registry.register("host3", 2, "host3", 10.0, secret=bytes(16))  # it answers again
        calls.resume.set()
        assert retry.done_event.wait(20) and retry.state == "succeeded", retry.error
        assert calls.count("abort") == {h: 1 for h in HOSTS}
        assert np.array_equal(hosts.get("t", DST, SHAPE), a)
    finally:
        calls.resume.set()
        hosts.close()


def test_a_repeated_move_reuses_its_plan_and_the_runner_forgets_the_oldest_finished_jobs(monkeypatch, tmp_path):
    from reshard.server.planner import jobs as jobs_module

    monkeypatch.setattr(jobs_module, "JOBS_KEPT", 4)
    hosts = Hosts()
    try:
        runner, calls, catalog, a = _runner(hosts, StateStore(str(tmp_path / "state.db")))
        back = catalog.get("t").sharding
        done = []
        for i in range(8):  # there and back four times: two distinct moves
            job = runner.submit("t", DST if i % 2 == 0 else back, "auto")
            assert job.done_event.wait(30) and job.state == "succeeded", job.error
            done.append(job)
        assert done[0].plan is done[2].plan is done[6].plan and done[1].plan is done[7].plan
        assert done[0].plan is not done[1].plan
        assert np.array_equal(hosts.get("t", back, SHAPE, version=9), a)  # the reused plans moved every element
        # 8 finished > 4 + 4 // 4: the oldest went, from memory and from the state store, newest first kept
        kept = [j.id for j in runner.list()]
        assert kept == [j.id for j in reversed(done[4:])]
        assert sorted(d["id"] for d in runner.store.jobs()) == sorted(kept)
        assert runner.get(done[0].id) is None
        # The metrics count what the runner keeps (states) and everything since it started (durations): a histogram
        # that forgot jobs would go down, which Prometheus reads as a restart.
        assert runner.states() == {"succeeded": 4}
        d = runner.durations()
        assert d.count == 8 and d.counts[-1] == 8 and d.counts == sorted(d.counts)
        assert d.total_s == pytest.approx(sum(j.seconds for j in done))
        assert d.counts[0] == sum(j.seconds <= jobs_module.DURATION_BUCKETS[0] for j in done)
        bad = runner.submit("no-such-tensor", DST, "auto")
        assert bad.done_event.wait(30) and bad.state == "failed"
        assert runner.durations().count == 8  # a failed job is no duration of a succeeded one
        assert runner.states() == {"succeeded": 4, "failed": 1}
    finally:
        hosts.close()


ONE_HOST = Mesh.from_hosts({"x": 2}, ["host0"], 2)


def _one_host_runner(hosts: Hosts):
    runner, calls, catalog, _ = _runner(hosts)
    u = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    catalog.add(TensorRecord("u", u.shape, "float32", Sharding(ONE_HOST, ("x", None)), 1))
    hosts.put_tensor("u", u, Sharding(ONE_HOST, ("x", None)))
    return runner, calls, catalog, u


def test_a_job_on_one_host_commits_as_its_run_ends_without_a_commit_call():
    hosts = Hosts()
    try:
        runner, calls, catalog, u = _one_host_runner(hosts)
        dst = Sharding(ONE_HOST, (None, "x"))
        job = runner.submit("u", dst, "auto")
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert calls.count("execute+commit") == {"host0": 1}
        assert not calls.count("execute") and not calls.count("commit")
        assert catalog.get("u").version == 2 and np.array_equal(hosts.get("u", dst, u.shape, version=2), u)
        # A job over several hosts commits the same way, on every host that holds the new version.
        job = runner.submit("t", DST, "auto")
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert calls.count("execute+commit") == {"host0": 1, **{h: 1 for h in DST.mesh.hosts}}
        assert not calls.count("commit")
    finally:
        hosts.close()


def test_a_one_host_job_that_fails_leaves_the_old_version_and_its_abort_drops_the_new_one():
    hosts = Hosts(wrap=lambda host, t: Fail(t, steps=range(1000)))
    try:
        runner, calls, catalog, u = _one_host_runner(hosts)
        job = runner.submit("u", Sharding(ONE_HOST, (None, "x")), "auto")
        assert job.done_event.wait(30) and job.state == "failed", job.error
        assert "injected by the test" in job.error
        assert calls.count("execute+commit") == {"host0": 1} and not calls.count("commit")
        assert calls.count("abort") == {"host0": 1}
        # Asked to commit with its Execute, the host may hold the new version: the abort drops what the job
        # committed, with no release by tensor and version.
        assert not calls.count("release")
        assert catalog.get("u").version == 1
        assert all(hosts.stores["host0"].find("u", 2, d) is None for d in ONE_HOST.devices)
        assert np.array_equal(hosts.get("u", Sharding(ONE_HOST, ("x", None)), u.shape, version=1), u)
    finally:
        hosts.close()


class ReportingWithoutHeartbeats(RuntimeCalls):
    """Stops every heartbeat once the job runs, while ``host``'s Execute keeps reporting for a while: ``report``
    (on_progress) every 50 ms, by default its progress."""

    def __init__(self, hosts: Hosts, host: str, stop_heartbeats, seconds: float,
                 report=lambda on_progress: on_progress(0, 0, 0, 1)):
        super().__init__(hosts)
        self.host, self.stop_heartbeats, self.seconds, self.report = host, stop_heartbeats, seconds, report

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
        if host == self.host:
            self.stop_heartbeats()
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:
                self.report(on_progress)
                time.sleep(0.05)
        return super().execute(host, address, job, program_id, on_progress, timeout, prepare, commit)


# What a host's Execute reports while its heartbeats miss: its run's progress, that it still loads the job (as an
# agent does while it loads a large program, `AgentServicer._loading`), or nothing
_REPORTS = {"progress": lambda on_progress: on_progress(0, 0, 0, 1),
            "loading": lambda on_progress: on_progress(loading=True),
            "nothing": lambda on_progress: None}


@pytest.mark.parametrize("reports", list(_REPORTS))
def test_a_host_whose_heartbeats_miss_while_its_part_reports_progress_is_not_taken_for_dead(reports):
    """On a machine the job keeps busy, an agent's heartbeat calls can miss their deadline at a slow planner while
    its Execute stream goes on: the job goes on too. So while it loads a state dict's program, seconds of cores that
    8 agents share, and reports that it does. A host silent as long fails the job, named."""
    now = [0.0]
    registry = Registry(heartbeat_timeout_s=0.5, clock=lambda: now[0])
    for h in HOSTS:
        registry.register(h, 2, h, 10.0, secret=bytes(16))

    def stop_heartbeats() -> None:
        now[0] = 100.0  # every host's last heartbeat is now 100 s old

    hosts = Hosts()
    calls = ReportingWithoutHeartbeats(hosts, "host3", stop_heartbeats, 1.5, _REPORTS[reports])
    try:
        runner, a = _watched_runner(hosts, registry, calls, stall_timeout_s=60.0)
        job = runner.submit("t", DST, "send_recv")
        assert job.done_event.wait(20)
        if reports == "nothing":
            assert job.state == "failed" and "host host3 stopped answering: no heartbeat" in job.error, job.error
            return
        assert job.state == "succeeded", job.error
        assert job.host_seconds["host3"] >= 1.5  # it ran three heartbeat timeouts past its last heartbeat
        assert np.array_equal(hosts.get("t", DST, SHAPE, version=2), a)
        if reports == "loading":
            assert job.started_s >= 1.5  # the run started after it loaded: a loading report is not its start
    finally:
        hosts.close()


class _HeldCalls(RuntimeCalls):
    """`RuntimeCalls` whose Executes wait until ``go`` is set: a job stays running while a test looks at it."""

    def __init__(self, hosts: Hosts):
        super().__init__(hosts)
        self.go = threading.Event()

    def execute(self, *args, **kw):
        self.go.wait(30)
        return super().execute(*args, **kw)


def test_a_job_in_flight_when_the_planner_restarts_reads_back_failed_and_one_that_ended_as_it_ended(tmp_path):
    """The state store has a job's record from its queueing and its end; a restart finds the running one failed."""
    hosts = Hosts()
    calls = _HeldCalls(hosts)
    path = str(tmp_path / "state.db")
    try:
        registry = Registry(heartbeat_timeout_s=60.0)
        for h in HOSTS:
            registry.register(h, 2, h, 10.0, secret=bytes(16))
        catalog = Catalog()
        catalog.add(TensorRecord("t", SHAPE, "int32", SRC, 1))
        hosts.put_tensor("t", np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE), SRC)
        runner = JobRunner(registry, catalog, StateStore(path), calls, job_timeout_s=30.0, rpc_timeout_s=10.0,
                           max_concurrent=2)
        running = runner.submit("t", DST, "broadcast")
        deadline = time.monotonic() + 10
        while running.state != "running" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.state == "running"
        restarted = JobRunner(registry, Catalog(), StateStore(path), calls, job_timeout_s=30.0, rpc_timeout_s=10.0,
                              max_concurrent=2)
        seen = restarted.get(running.id)
        assert seen.state == "failed" and seen.error == "the planner restarted while this job was in flight"
        calls.go.set()
        assert running.done_event.wait(30) and running.state == "succeeded", running.error
        again = JobRunner(registry, Catalog(), StateStore(path), calls, job_timeout_s=30.0, rpc_timeout_s=10.0,
                          max_concurrent=2)
        done = again.get(running.id)
        assert done.state == "succeeded" and done.started == running.started and list(done.phases) == list(PHASES)
    finally:
        calls.go.set()
        hosts.close()


# -- one plan per job: the program a request was checked with is the one its job runs ---------------------


def _planner(hosts: Hosts, calls: RuntimeCalls):
    from reshard.server.common.config import PlannerConfig
    from reshard.server.planner.control import Planner

    planner = Planner(PlannerConfig(heartbeat_timeout_s=60.0), calls)
    for h in HOSTS:
        planner.register(h, 2, h, 10.0, secret=f"{h}-secret-0123456789".encode())
    return planner


def _put_t(planner, hosts: Hosts) -> np.ndarray:
    """Tensor "t" (int32, `SHAPE`, counting up) held in `SRC` at version 1, catalogued and on the hosts."""
    a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
    planner.catalog.add(TensorRecord("t", SHAPE, "int32", SRC, 1))
    hosts.put_tensor("t", a, SRC)
    return a


def _counted(monkeypatch, name: str) -> list[int]:
    """Count the calls of ``name`` from every planner module that calls it (each binds it at import)."""
    from reshard.server.planner import control, jobs

    made = [0]
    for module in (control, jobs):
        if hasattr(module, name):
            real = getattr(module, name)

            def counted(*args, _real=real, **kw):
                made[0] += 1
                return _real(*args, **kw)

            monkeypatch.setattr(module, name, counted)
    return made


PARTIAL = Sharding(SRC.mesh, ("x", None), partial=("y",))  # host0 and host1 hold addends summed over y


def _put_partial(planner, hosts: Hosts, name: str) -> np.ndarray:
    from tests.core.test_partial import addends

    tiles, whole = addends(PARTIAL, SHAPE, np.random.default_rng(0))
    hosts.put(name, {dev: (a, PARTIAL.tile(SHAPE, dev)) for dev, a in tiles.items()})
    planner.catalog.add(TensorRecord(name, SHAPE, "float32", PARTIAL, 1))
    return sum(whole.values())


def test_a_partial_reshard_is_planned_once_when_its_request_is_checked_and_its_job_runs_that_program(monkeypatch):
    import json

    made = _counted(monkeypatch, "reshard_program")
    hosts = Hosts()
    planner = _planner(hosts, RuntimeCalls(hosts))
    try:
        value = _put_partial(planner, hosts, "p")
        job = planner.reshard("p", json.dumps(DST.to_json()), "auto")
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert made[0] == 1, f"the reshard of a Partial tensor was planned {made[0]} times"
        assert job.plan is None and planner.stored_program(job.program.id) == job.program
        assert np.array_equal(hosts.get("p", DST, SHAPE), value)
    finally:
        planner.close()
        hosts.close()


def test_a_partial_reshard_queued_behind_one_that_changes_its_sharding_plans_again_from_the_new_one(monkeypatch):
    """Both are planned from the Partial layout as they are asked for; when the second starts, the first has
    summed the tensor into DST, so the program planned for it no longer fits and it plans a move from DST."""
    import json

    made = _counted(monkeypatch, "reshard_program")
    hosts = Hosts()
    calls = _HeldCalls(hosts)
    planner = _planner(hosts, calls)
    try:
        value = _put_partial(planner, hosts, "p")
        back = Sharding(SRC.mesh, (None, None))
        first = planner.reshard("p", json.dumps(DST.to_json()), "auto")
        second = planner.reshard("p", json.dumps(back.to_json()), "auto")
        assert made[0] == 2 and second.state == "queued"
        calls.go.set()
        for job in (first, second):
            assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert made[0] == 2  # the second job's program was stale: it ran a plan of moves, planned as it started
        assert first.program is not None and second.program is None and second.plan is not None
        assert second.plan.src == DST and second.plan.dst == back
        assert np.array_equal(hosts.get("p", back, SHAPE, version=3), value)
    finally:
        calls.go.set()
        planner.close()
        hosts.close()


def test_a_compute_job_runs_the_program_its_request_was_checked_with(monkeypatch):
    """Even where the planner's program cache kept nothing (a pipeline step plans more programs than it keeps)."""
    import json

    from reshard.server.planner import control

    monkeypatch.setattr(control, "SEQUENCES_KEPT", 0)
    made = _counted(monkeypatch, "plan_einsum")
    hosts = Hosts()
    planner = _planner(hosts, RuntimeCalls(hosts))
    try:
        rows = Sharding(SRC.mesh, ("x", None))
        a = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
        b = np.arange(4 * 5, dtype=np.float32).reshape(4, 5) - 7
        for name, x in (("a", a), ("b", b)):
            hosts.put_tensor(name, x, rows if name == "a" else Sharding(SRC.mesh, (None, None)))
            planner.catalog.add(TensorRecord(name, x.shape, "float32", rows if name == "a" else
                                             Sharding(SRC.mesh, (None, None)), 1))
        job = planner.compute("einsum", ["a", "b"], "c", json.dumps(rows.to_json()), "auto",
                              {"equation": "ij,jk->ik"})
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert made[0] == 1, f"the einsum was planned {made[0]} times"
        assert np.array_equal(hosts.get("c", rows, (6, 5), version=1), a @ b)
    finally:
        planner.close()
        hosts.close()


def test_job_info_names_the_program_a_reshard_many_or_compute_job_ran_as_a_reshard_names_its_plan():
    """A client tells which program ran by the plan id `GetJob` reports; a reshard_many or compute job runs a
    program, not a plan, and reported none."""
    import json

    from reshard.server.planner.service import job_info

    hosts = Hosts()
    planner = _planner(hosts, RuntimeCalls(hosts))
    try:
        _put_t(planner, hosts)
        many = planner.jobs.submit_many({"t": DST}, "auto", 0, {})
        assert many.done_event.wait(30) and many.state == "succeeded", many.error
        info = job_info(many)
        assert info.plan_id == many.program.id and len(info.plan_id) == 64
        assert json.loads(planner.jobs.store.plan(info.plan_id))["id"] == info.plan_id  # what the agents ran
        one = planner.jobs.submit("t", SRC, "auto")
        assert one.done_event.wait(30) and one.state == "succeeded", one.error
        assert job_info(one).plan_id == one.plan.id
        rows = Sharding(SRC.mesh, ("x", None))
        hosts.put_tensor("b", np.ones((12, 5), dtype=np.int32), Sharding(SRC.mesh, (None, None)))
        planner.catalog.add(TensorRecord("b", (12, 5), "int32", Sharding(SRC.mesh, (None, None)), 1))
        product = planner.compute("einsum", ["t", "b"], "c", json.dumps(rows.to_json()), "auto",
                                  {"equation": "ij,jk->ik"})
        assert product.done_event.wait(30) and product.state == "succeeded", product.error
        assert job_info(product).plan_id == product.program.id
    finally:
        planner.close()
        hosts.close()


def test_a_reshard_many_of_layouts_it_moved_before_runs_the_program_it_planned_then(monkeypatch):
    """The planner keys its reshard_many programs by what they are planned from, read off the records: a move out,
    back and out again plans twice and runs the first program again."""
    made = _counted(monkeypatch, "plan_many")
    hosts = Hosts()
    planner = _planner(hosts, RuntimeCalls(hosts))
    try:
        a = _put_t(planner, hosts)
        jobs = []
        for dst in (DST, SRC, DST):
            jobs.append(planner.jobs.submit_many({"t": dst}, "auto", 0, {}))
            assert jobs[-1].done_event.wait(30) and jobs[-1].state == "succeeded", jobs[-1].error
        assert made[0] == 2, f"three moves over two layouts planned {made[0]} programs"
        assert jobs[2].program.id == jobs[0].program.id != jobs[1].program.id
        assert np.array_equal(hosts.get("t", DST, SHAPE, version=4), a)
    finally:
        planner.close()
        hosts.close()


def test_a_state_dict_at_one_version_names_its_reads_by_that_version_and_one_at_several_by_columns():
    """A reshard_many whose tensors are all at one version hands its hosts that version alone
    (`Preparation.reads_at`: a 139,583-tensor sync's Prepares do not name every tensor again each job), which each
    agent expands over its program's tensors; tensors at different versions go as columns. Both commit the values
    moved, each tensor the version after the one it read."""
    hosts = Hosts()
    calls = RuntimeCalls(hosts)
    planner = _planner(hosts, calls)
    try:
        values = {}
        for i, (name, version) in enumerate((("a", 1), ("b", 1), ("c", 4))):
            values[name] = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE) * (i + 2)
            planner.catalog.add(TensorRecord(name, SHAPE, "int32", SRC, version))
            tiles = SRC.tiles(SHAPE)
            hosts.put(name, {d: (values[name][tuple(slice(lo, hi) for lo, hi in b)].copy(), b)
                             for d, b in tiles.items()}, version=version)
        for names, reads_at in ((["a", "b"], 1), (["a", "b", "c"], None)):
            job = planner.jobs.submit_many({n: DST for n in names}, "auto", 0, {})
            assert job.done_event.wait(30) and job.state == "succeeded", job.error
            prep = calls.prepared[-1]
            assert prep.job == job.id and prep.reads_at == reads_at
            for name in names:
                assert np.array_equal(hosts.get(name, DST, SHAPE, version=job.versions[name]), values[name])
        assert (job.versions["a"], job.versions["c"]) == (3, 5)  # read 2 (the first job's) and 4, each one on
    finally:
        planner.close()
        hosts.close()


class FailsAfterAnotherCommitted(RuntimeCalls):
    """``failing``'s Execute waits until ``committer``'s ran and committed there, then fails."""

    def __init__(self, hosts: Hosts, committer: str, failing: str):
        super().__init__(hosts)
        self.committer, self.failing = committer, failing
        self.committed = threading.Event()

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
        if host == self.failing:
            assert self.committed.wait(20), f"{self.committer} never committed"
            self._record("execute", host)
            raise RuntimeError(f"host {host} failed after {self.committer} committed (injected by the test)")
        traffic = super().execute(host, address, job, program_id, on_progress, timeout, prepare, commit)
        if host == self.committer:
            assert commit  # it stages tiles of the new version
            self.committed.set()
        return traffic


def test_a_job_that_fails_after_a_host_committed_leaves_no_new_version_there():
    # host2 and host3 both stage the new version and commit it as their runs end; host2 did, then host3 fails: the
    # job's abort drops what it committed on host2, and the catalog never saw it.
    hosts = Hosts()
    try:
        registry = Registry(heartbeat_timeout_s=60.0)
        for h in HOSTS:
            registry.register(h, 2, h, 10.0, secret=bytes(16))
        calls = FailsAfterAnotherCommitted(hosts, "host2", "host3")
        runner, a = _watched_runner(hosts, registry, calls, stall_timeout_s=30.0)
        job = runner.submit("t", DST, "send_recv")  # no relays: host2 needs nothing from host3, and finishes first
        assert job.done_event.wait(30) and job.state == "failed"
        assert "host host3 failed after host2 committed" in job.error
        assert calls.count("abort") == {h: 1 for h in HOSTS} and not calls.count("release")
        assert runner.catalog.get("t").version == 1
        for d in DST.mesh.devices:
            assert hosts.stores[d.split("/")[0]].find("t", 2, d) is None
        assert np.array_equal(hosts.get("t", SRC, SHAPE, version=1), a)
    finally:
        hosts.close()


def test_an_abort_undoes_only_what_its_own_job_committed_here():
    # Job j1 commits t v2 on this host and fails elsewhere; its abort is slow to come. Meanwhile the version went
    # (say, a cleanup freed it) and the retry j2 committed t v2 here again: j1's late abort must leave j2's alone,
    # which a release by tensor and version would not.
    store = ShardStore(host="host0")

    def commit(job: str, fill: int) -> None:
        store.stage(f"{job}/t", "host0/0", TileBuffer(np.full(4, fill, dtype=np.int32), ((0, 4),), "int32"))
        store.commit_many([(f"{job}/t", "t", 2, ["host0/0"])], by=job)

    commit("j1", 1)
    assert store.uncommit("j1") == 1 and store.find("t", 2, "host0/0") is None
    commit("j1b", 2)
    store.release("t", 2)  # released by tensor and version: the job that committed it has nothing left here
    assert store.uncommit("j1b") == 0
    commit("j2", 3)
    assert store.uncommit("j1") == 0  # late, and again
    assert store.get("t", 2, "host0/0").array.tolist() == [3] * 4
    assert store.held() == [("t", 2)]
    assert store.uncommit("j2") == 1 and store.held() == [] and store.nbytes() == 0
