"""A job's hosts prepare inside their Execute on nixl, in any order: a receiver's post may reach a sender whose own
Prepare has not yet introduced the receiver, or whose agent still knows the receiver's agent before it restarted.
The post names its agent's incarnation and waits, unread, until that incarnation is introduced; the memory it
carries (NIXL partial metadata) then loads into the right agent's entry and the WRITE finds it.

NIXL agents in this process, as in tests/unit/test_nixl.py; without the hold, the first test's post fails to load
(NIXL_ERR_NOT_FOUND) and the second's memory is dropped with the old agent's entry."""

from __future__ import annotations

import time

import numpy as np
import pytest

from reshard.proto.errors import InvalidArgumentError, UnavailableError
from reshard.server.transport.nixl import METADATA_MARK, NixlTransport, nixl_missing
from reshard.server.transport.session import Session
from reshard.server.transport.streams import StreamKey, Trailer, in_thread

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))

N = 4096
BOX = ((0, N),)


def _agent(host: str, timeout_s: float = 5.0) -> NixlTransport:
    return NixlTransport(host, chunk_bytes=64 << 10, timeout_s=timeout_s, stall_timeout_s=timeout_s)


def _post(receiver: NixlTransport, job: str):
    """``receiver`` posts stream 0 of ``job`` from b into scratch (first registered now: the post carries it);
    its pieces and trailer come back through the future."""
    s = Session(job, "p", {0: "float32"}, {})
    return s, in_thread("recv", lambda: list(receiver.arrivals(s, StreamKey(job, 0, 0), "b", BOX, lambda sub: None)))


def _held(b: NixlTransport, count: int) -> None:
    """Poll b's notifications (nothing of b waits, so nothing polls them) until ``count`` posts are held."""
    deadline = time.monotonic() + 5
    while b._progress.held() != count:
        assert time.monotonic() < deadline, f"{b._progress.held()} posts held, not {count}"
        b._progress.pump()
        time.sleep(0.005)


def _send_and_check(b: NixlTransport, s: Session, receiving) -> None:
    src = np.arange(N, dtype=np.float32) * 3
    b.send(s, StreamKey(s.job, 0, 0), "a", src, BOX, BOX)
    items = receiving.result(5)
    assert isinstance(items[-1], Trailer) and items[-1].nbytes == src.nbytes
    assert b"".join(bytes(p.data) for p in items[:-1]) == src.tobytes()


def test_a_post_that_comes_before_its_poster_is_introduced_waits_for_the_introduction():
    a, b = _agent("a"), _agent("b")
    try:
        a.add_peer("b", b.metadata())  # a's Prepare ran; b's has not yet
        s, receiving = _post(a, "early")
        _held(b, 1)
        b.add_peer("a", a.metadata())  # b's Prepare: the post is read now, its memory loaded
        assert b._progress.held() == 0
        _send_and_check(b, s, receiving)
    finally:
        a.close()
        b.close()


def test_a_post_from_a_restarted_agent_waits_until_its_new_incarnation_is_introduced():
    old, b = _agent("a"), _agent("b")
    a = None
    try:
        old.add_peer("b", b.metadata())
        b.add_peer("a", old.metadata())
        old.close()  # host a's agent restarts
        a = _agent("a")
        a.add_peer("b", b.metadata())
        s, receiving = _post(a, "after-restart")
        _held(b, 1)  # b still knows the agent before: loaded into its entry, the memory would go with it
        b.add_peer("a", a.metadata())
        assert b._progress.held() == 0
        _send_and_check(b, s, receiving)
        b.add_peer("a", a.metadata())  # the same incarnation again changes nothing
        s, receiving = _post(a, "again")  # a post of memory b was told of already: no metadata with it
        _send_and_check(b, s, receiving)
    finally:
        for t in (a, b):
            if t is not None:
                t.close()


def test_held_posts_of_an_agent_that_is_gone_or_of_an_ended_job_are_dropped():
    b = _agent("b")
    gone = _agent("a", timeout_s=0.3)
    a = None
    try:
        gone.add_peer("b", b.metadata())
        s, receiving = _post(gone, "orphan")
        _held(b, 1)
        with pytest.raises(UnavailableError, match="host b sent nothing of stream 0 of step 0 within 0.3s"):
            receiving.result(5)
        gone.close()
        a = _agent("a")
        b.add_peer("a", a.metadata())  # another incarnation of host a: the old one's post is dropped, not loaded
        assert b._progress.held() == 0 and b._progress.held_dropped == 1

        b.drop_peer("a")
        a.add_peer("b", b.metadata())
        s, receiving = _post(a, "ended")
        _held(b, 1)
        b.detach(s)  # the job ended here: its held post goes with its other notifications
        assert b._progress.held() == 0
    finally:
        for t in (a, b):
            if t is not None:
                t.close()


def test_metadata_without_the_mark_and_incarnation_is_refused_naming_the_host():
    a, b = _agent("a"), _agent("b")
    try:
        raw = b._agent.get_agent_metadata()  # NIXL's own, as an agent of an earlier release registered it
        with pytest.raises(InvalidArgumentError, match=rf"the NIXL metadata given for host b \({len(raw)} bytes\) "
                                                       rf"is not an agent's that NIXL can load here \(it does not "
                                                       rf"start with {METADATA_MARK!r}"):
            a.add_peer("b", raw)
        assert b.metadata().startswith(METADATA_MARK + b.incarnation)
        a.add_peer("b", b.metadata())  # and the real one still loads
    finally:
        a.close()
        b.close()


def test_an_abort_of_a_job_never_prepared_here_drops_its_held_posts():
    """The planner aborts a failed job on every host, also one whose Execute never came: a post its peer made
    for it meanwhile goes, and one that comes later is dropped as it arrives (the job cannot be prepared here any
    more: `Runtime.prepare` refuses an ended job)."""
    from reshard.server.agent.runtime import Runtime
    from reshard.server.agent.store import ShardStore

    a, b = _agent("a", timeout_s=0.3), _agent("b")
    runtime = Runtime("b", ShardStore(), {"nixl": b}, workers=2, step_timeout_s=5.0)
    try:
        a.add_peer("b", b.metadata())
        s, receiving = _post(a, "failed-elsewhere")
        _held(b, 1)
        runtime.abort("failed-elsewhere")
        assert b._progress.held() == 0
        with pytest.raises(UnavailableError):
            receiving.result(5)
        _, late = _post(a, "failed-elsewhere")  # another post of the same job, after the abort
        with pytest.raises(UnavailableError):
            late.result(5)
        b.add_peer("a", a.metadata())
        assert b._progress.held() == 0 and not b._progress._inbox  # dropped, not held nor filed
    finally:
        runtime.close()
        a.close()
        b.close()


def test_beyond_the_most_posts_held_the_oldest_goes_and_its_stream_fails_naming_the_host(monkeypatch):
    from reshard.server.transport import nixl_progress

    monkeypatch.setattr(nixl_progress, "HELD_MAX", 2)
    a, b = _agent("a", timeout_s=1.0), _agent("b")
    try:
        a.add_peer("b", b.metadata())
        s = Session("flood", "p", {0: "float32"}, {})
        posts = []
        for hop in range(3):  # one at a time, so the first is the oldest
            posts.append(in_thread(f"recv-{hop}", lambda hop=hop: list(
                a.arrivals(s, StreamKey("flood", 0, hop), "b", BOX, lambda sub: None))))
            if hop < 2:
                _held(b, hop + 1)
        deadline = time.monotonic() + 5
        while b._progress.held_dropped != 1:  # the third post came: the first goes
            assert time.monotonic() < deadline
            b._progress.pump()
            time.sleep(0.005)
        assert b._progress.held() == 2
        b.add_peer("a", a.metadata())
        src = np.arange(N, dtype=np.float32)
        for hop in (1, 2):
            b.send(s, StreamKey("flood", 0, hop), "a", src, BOX, BOX)
            assert b"".join(bytes(p.data) for p in posts[hop].result(5)[:-1]) == src.tobytes()
        with pytest.raises(UnavailableError, match="host b sent nothing of stream 0 of step 0 within 1s"):
            posts[0].result(5)
    finally:
        a.close()
        b.close()
