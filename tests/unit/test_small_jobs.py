"""A small job's fixed cost: its hosts prepare inside their Execute, the one host that stages its result commits as
its run ends, a push that comes before its job's prepare waits for it, and a small push is one blocking call that
the job's failure cancels. Runtimes on the in-memory transport behind the planner's job runner, and a real gRPC
server for the push."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from concurrent import futures

import grpc
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import FailedPreconditionError, NotFoundError
from reshard.routes import hops
from reshard.server.planner.catalog import Catalog, TensorRecord
from reshard.server.planner.jobs import EARLY_PUSHES_MAX, JobRunner
from reshard.server.planner.registry import Registry
from reshard.server.planner.state import StateStore
from reshard.server.transport.grpc_link import GrpcTransport
from reshard.server.transport.session import Session
from reshard.server.transport.streams import StreamKey
from reshard.strategies import plan as make_plan

from .test_jobs import RuntimeCalls
from .test_runtime import HOSTS, Hosts

SHAPE = (37, 12)
ON_HOST0 = Sharding(Mesh.from_hosts({"x": 2}, ["host0"], 2), ("x", None))
ON_HOST1 = Sharding(Mesh.from_hosts({"x": 2}, ["host1"], 2), ("x", None))
OVER_TWO = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", "y"))
REPLICATED_ON_HOST2 = Sharding(Mesh.from_hosts({"x": 2}, ["host2"], 2), (None, None))


class CallsSeen(RuntimeCalls):
    """`RuntimeCalls` recording whether each Execute carried its host's prepare."""

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
        if prepare is not None:
            self._record("execute with prepare", host)
        return super().execute(host, address, job, program_id, on_progress, timeout, prepare, commit)


@pytest.mark.parametrize("src, dst, strategy, early", [
    (ON_HOST0, ON_HOST1, "auto", True),  # two streams into host1
    (OVER_TWO, REPLICATED_ON_HOST2, "send_recv", False),  # eight streams into host2: the Prepare round first
])
def test_a_small_grpc_job_prepares_in_its_executes_and_its_one_staging_host_commits_with_its_run(src, dst, strategy,
                                                                                                 early):
    hosts = Hosts()
    try:
        registry = Registry(heartbeat_timeout_s=60.0)
        for h in HOSTS:
            registry.register(h, 2, h, 10.0, secret=bytes(16))
        catalog = Catalog()
        a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
        catalog.add(TensorRecord("t", SHAPE, "int32", src, 1))
        hosts.put_tensor("t", a, src)
        calls = CallsSeen(hosts)
        runner = JobRunner(registry, catalog, StateStore(None), calls, job_timeout_s=30.0, rpc_timeout_s=10.0,
                           max_concurrent=2)
        pushed = Counter(h.dst for t in make_plan(SHAPE, "int32", src, dst, None, strategy).transfers for h in hops(t))
        assert (max(pushed.values()) <= EARLY_PUSHES_MAX) == early
        job = runner.submit("t", dst, strategy)
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        every = {h: 1 for h in job.traffic}
        assert calls.count("prepare") == every  # once per host either way
        assert calls.count("execute with prepare") == (every if early else {})
        # Only host1 (or host2) stages the new version: it commits as its run ends, and no Commit call is made.
        staging = dst.mesh.hosts[0]
        assert calls.count("execute+commit") == {staging: 1} and not calls.count("commit")
        assert catalog.get("t").version == 2 and np.array_equal(hosts.get("t", dst, SHAPE), a)
    finally:
        hosts.close()


def test_a_push_that_comes_before_its_jobs_prepare_waits_for_it_and_an_abort_ends_the_wait_at_once():
    hosts = Hosts(hosts=("host0", "host1"))
    try:
        a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
        hosts.put_tensor("t", a, ON_HOST0)
        text = make_plan(SHAPE, "int32", ON_HOST0, ON_HOST1, None, "auto").dumps()
        peers = {h: h for h in hosts.runtimes}
        sender, receiver = hosts.runtimes["host0"], hosts.runtimes["host1"]

        # host0 runs first and pushes to host1, which is prepared a moment later: the push waits for that
        job = uuid.uuid4().hex
        run = sender.prepare(job, text, "t", 1, 2, peers, "memory")
        sender.execute(job, run.program_id)
        time.sleep(0.3)
        assert not run.done.is_set()  # its push is waiting for host1's prepare
        late = receiver.prepare(job, text, "t", 1, 2, peers, "memory")
        receiver.execute(job, late.program_id)
        run.result(10)
        late.result(10)
        receiver.commit(job)
        assert np.array_equal(hosts.get("t", ON_HOST1, SHAPE), a)

        # host1 never gets the next job's prepare but its abort: host0's push fails then, not after the wait
        job = uuid.uuid4().hex
        run = sender.prepare(job, text, "t", 1, 3, peers, "memory")  # v1 is still held on host0
        sender.execute(job, run.program_id)
        time.sleep(0.3)
        began = time.monotonic()
        receiver.abort(job)
        with pytest.raises(NotFoundError, match=rf"agent host1 has no prepared job '{job}'$"):
            run.result(10)
        assert time.monotonic() - began < receiver.prepare_wait_s / 2
    finally:
        hosts.close()


class _Held:
    """A Push servicer that reads a stream's first message, which holds a small push whole, and then answers only
    once ``answer`` is set."""

    def __init__(self):
        self.called = threading.Event()
        self.read = threading.Event()
        self.answer = threading.Event()
        self.first: pb.PushChunk | None = None

    def push(self, request_iterator, context):
        self.called.set()
        self.first = pb.PushChunk.FromString(next(iter(request_iterator)))
        self.read.set()
        self.answer.wait(30)
        return b""


def _held_agent() -> tuple[grpc.Server, int, _Held]:
    held = _Held()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("reshard.v1.Agent", {
        "Push": grpc.stream_unary_rpc_method_handler(held.push)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, held


def test_a_small_push_is_one_call_once_whole_and_the_jobs_failure_cancels_it():
    server, port, held = _held_agent()
    link = GrpcTransport("host0", chunk_bytes=1 << 20, timeout_s=60.0, depth=4, max_message_bytes=1 << 20)
    s = Session("job", "program", {0: "int32"}, {"host1": f"127.0.0.1:{port}"})
    try:
        out = link.open(s, StreamKey("job", 0, 0), "host1")
        out.put(((0, 16),), np.arange(16, dtype=np.int32).tobytes())
        time.sleep(0.2)
        assert not held.called.is_set()  # nothing leaves before the stream is whole and its sender waits for it
        failure: list[BaseException] = []

        def wait() -> None:
            try:
                out.finish(64, 0, 60.0)
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                failure.append(e)

        waiting = threading.Thread(target=wait)
        waiting.start()
        assert held.read.wait(10)  # the whole stream is at the peer, which does not answer
        # in one message: a stream's every message costs a hand-off between threads at both ends
        whole = held.first.whole
        assert held.first.WhichOneof("kind") == "whole" and whole.header.job == "job"
        assert [bytes(p.data) for p in whole.pieces] == [np.arange(16, dtype=np.int32).tobytes()]
        assert whole.trailer.nbytes == 64
        began = time.monotonic()
        s.fail(FailedPreconditionError("job job was aborted"))
        waiting.join(10)
        assert not waiting.is_alive() and time.monotonic() - began < 5
        assert len(failure) == 1 and str(failure[0]) == "job job was aborted"
    finally:
        held.answer.set()
        link.close()
        server.stop(None)


def test_a_session_calls_what_watches_it_once_as_it_fails_and_at_once_after():
    s = Session("job", "program", {}, {})
    seen: list[str] = []
    s.watch(lambda: seen.append("first"))
    dropped = lambda: seen.append("dropped")  # noqa: E731 - a distinct callable to unwatch
    s.watch(dropped)
    s.unwatch(dropped)
    s.fail(FailedPreconditionError("one"))
    s.fail(FailedPreconditionError("two"))
    assert seen == ["first"]
    s.watch(lambda: seen.append("late"))
    assert seen == ["first", "late"] and str(s.failed) == "one"
