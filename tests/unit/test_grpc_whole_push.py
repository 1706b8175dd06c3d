"""A small push sent whole (`grpc_link._SmallWhole`) that its job cancels while the peer has not answered: the call
ends with the job's own failure, and gRPC's request reader logs nothing about the cancel it was made to do."""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from reshard.proto.errors import UnavailableError
from reshard.server.transport.grpc_link import _SmallWhole
from reshard.server.transport.session import Session

METHOD = "/test.Silent/Push"


@pytest.fixture()
def silent_peer():
    """A real gRPC server whose Push reads every message and then never answers until its call is cancelled."""
    answered = threading.Event()

    def push(requests, context):
        for _ in requests:
            pass
        context.add_callback(answered.set)
        answered.wait(30)
        context.abort(grpc.StatusCode.CANCELLED, "the test ended")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Silent", {"Push": grpc.stream_unary_rpc_method_handler(push)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        answered.set()
        server.stop(0)


def test_a_cancelled_whole_push_fails_with_the_job_and_logs_no_traceback(silent_peer, caplog):
    s = Session("job-1", "program", {0: "float32"}, {"peer": silent_peer})
    with grpc.insecure_channel(silent_peer) as ch:
        call = ch.stream_unary(METHOD, request_serializer=None, response_deserializer=None)
        out = _SmallWhole(s, b"header", call, 4, streaming=lambda: pytest.fail("a small push never streams"),
                          error=lambda e: e)
        out.put(((0, 4),), np.arange(4, dtype=np.float32).tobytes())
        failure = UnavailableError("job job-1: host other failed")
        threading.Timer(0.5, s.fail, [failure]).start()
        with caplog.at_level(logging.DEBUG, logger="grpc"):
            with pytest.raises(UnavailableError, match="host other failed"):
                out.finish(16, 0, timeout=20)
    assert "Exception iterating requests" not in caplog.text, caplog.text


def test_other_exceptions_of_the_request_reader_are_still_logged(caplog):
    logger = logging.getLogger("grpc._channel")
    with caplog.at_level(logging.ERROR, logger="grpc"):
        try:
            raise ValueError("a real bug in a request iterator")
        except ValueError:
            logger.exception("Exception iterating requests!")
    assert "a real bug in a request iterator" in caplog.text
