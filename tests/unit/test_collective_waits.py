"""A stream's first send or recv on the collective transport waits for the peer's lane to reach the stream, however
long past one call's timeout (``--collective-timeout``) that is, and gives way at once when the job fails elsewhere.

On a real gloo group formed in this process (`tests.unit.test_runtime.Gloo`), with a call timeout of one second:
a sender that reaches its stream 2.5 s after the receiver posted, and a receiver that reaches it 2.5 s after the
sender, both deliver bit-exact (gloo itself closed every pair of the group after one second of such a wait, and
the cold Kimi-K2 sync failed so at 30 s). With the default 30 s, a receiver waiting for a sender held a minute is
freed within a second or two of the job's abort, and reports the group broken (the posted receive is still in it).
"""

from __future__ import annotations

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


def test_a_receiver_waiting_for_its_first_piece_gives_way_when_the_job_is_aborted():
    # a call timeout of 30 s, as agents run by default: a lane blocked in its call would hold on that long
    pytest.importorskip("torch", reason="the collective transport needs torch")
    group = Gloo(op_timeout_s=30.0)
    h = Hosts(group=group, wrap=lambda host, t: Stall(t, 60.0) if host == "host0" else t)
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
        # The lane gives up within a check's time and, its receive still posted in the group, reports the group
        # broken for the planner to re-form (status() hands a broken generation over once)
        while group.members["host1"].status() != (0, group.generation):
            assert time.monotonic() - t0 < 2.0, "host1's lane still waits for its first piece"
            time.sleep(0.02)
        assert h.stores["host0"].get("tensor", 1, "host0/0").array.sum() == SHAPE[0] * SHAPE[1]
    finally:
        h.close()
