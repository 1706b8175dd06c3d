"""A stream's sends and receives on the collective transport wait for the peer's lane to reach the stream, however
long past one call's timeout (``--collective-timeout``) that is, up to the stream's own; a wait left behind by a
job that ended is freed as the group is re-formed.

On a real gloo group formed in this process (`tests.unit.test_runtime.Gloo`), with a call timeout of one second:
a sender that reaches its stream 2.5 s after the receiver posted, and a receiver that reaches it 2.5 s after the
sender, both deliver bit-exact (gloo itself closed every pair of the group after one second of such a wait, and
the cold Kimi-K2 sync failed so at 30 s), and leave the group whole. A receiver left waiting by an aborted job (its
sender held a minute) reports the group broken as the job ends there, and its wait ends as soon as the members
leave the old group (as they do when the planner re-forms it).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.program import Program, Step, TensorDecl, Transfer
from reshard.proto.errors import FailedPreconditionError
from reshard.server.transport.faults import Stall, Wrapped
from tests.unit.test_runtime import Gloo, Hosts

CALL_TIMEOUT_S = 1.0
LATE_S = 2.5
SHAPE = (64, 256)  # 64 KiB of float32: 16 pieces of 4 KiB, four windows


class Watched(Wrapped):
    """Sets ``ended`` once a stream this host receives stops, delivered or not."""

    def __init__(self, inner):
        super().__init__(inner)
        self.ended = threading.Event()

    def arrivals(self, s, key, peer, box, place):
        try:
            yield from self.inner.arrivals(s, key, peer, box, place)
        finally:
            self.ended.set()


class LateReceiver(Wrapped):
    """Every stream this host receives is taken up ``seconds`` late (its lane busy elsewhere, say)."""

    def __init__(self, inner, seconds: float):
        super().__init__(inner)
        self.seconds = seconds

    def arrivals(self, s, key, peer, box, place):
        time.sleep(self.seconds)
        return self.inner.arrivals(s, key, peer, box, place)


def _one_move() -> tuple[Program, Sharding]:
    src = Sharding(Mesh({"x": 1}, ["host0/0"]), (None, None))
    dst = Sharding(Mesh({"x": 1}, ["host1/0"]), (None, None))
    full = tuple((0, n) for n in SHAPE)
    step = Step.move(0, Transfer(full, "host0/0", ("host1/0",), "p2p"))
    return Program((TensorDecl("tensor", SHAPE, "float32", src, dst),), (step,)).validate(), src


@pytest.fixture()
def group():
    pytest.importorskip("torch", reason="the collective transport needs torch")
    return Gloo(op_timeout_s=CALL_TIMEOUT_S)


@pytest.mark.parametrize("late", ["sender", "receiver"])
def test_a_stream_whose_peer_comes_later_than_a_calls_timeout_still_arrives(group, late):
    def wrap(host, t):
        if late == "sender" and host == "host0":
            return Stall(t, LATE_S)
        return LateReceiver(t, LATE_S) if late == "receiver" and host == "host1" else t

    h = Hosts(group=group, wrap=wrap)
    try:
        program, src = _one_move()
        a = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
        h.put_tensor("tensor", a, src)
        t0 = time.monotonic()
        job, runs = h.start(program.dumps(), "tensor")
        h.finish(job, runs)
        assert time.monotonic() - t0 > LATE_S  # the wait outlasted the call timeout
        assert h.stores["host1"].get("tensor", 2, "host1/0").array.tobytes() == a.tobytes()
        assert all(m.status() == (group.generation, 0) for m in group.members.values())  # nobody broke the group
    finally:
        h.close()


def test_a_receiver_left_waiting_by_an_aborted_job_reports_the_group_and_is_freed_as_its_peers_leave_it():
    # a call timeout of 30 s, as agents run by default, and a sender held a minute
    pytest.importorskip("torch", reason="the collective transport needs torch")
    group = Gloo(op_timeout_s=30.0)
    watched = {}
    h = Hosts(group=group, wrap=lambda host, t: Stall(t, 60.0) if host == "host0" else
              watched.setdefault(host, Watched(t)))
    try:
        program, src = _one_move()
        h.put_tensor("tensor", np.ones(SHAPE, np.float32), src)
        job, runs = h.start(program.dumps(), "tensor")
        time.sleep(LATE_S)  # the receive is posted and waiting
        t0 = time.monotonic()
        for r in h.runtimes.values():
            r.abort(job)
        with pytest.raises(FailedPreconditionError, match="was aborted"):
            runs["host1"].result(10)
        # host1 ended the job with its receive still posted: it reports the group broken at once
        assert group.members["host1"].status() == (0, group.generation)
        assert not watched["host1"].ended.is_set()
        # the planner re-forms the group; each member leaves the old one, whose connections close
        for m in group.members.values():
            m.leave("the planner re-forms the group (the test)")
        assert watched["host1"].ended.wait(2.0), "host1's receive still waits on the old group"
        assert time.monotonic() - t0 < 4.0
        assert h.stores["host0"].get("tensor", 1, "host0/0").array.sum() == SHAPE[0] * SHAPE[1]
    finally:
        h.close()
