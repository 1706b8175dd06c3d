"""Domain errors to gRPC status codes and back, with the message unchanged.

A servicer that fails on purpose marks its status with trailing metadata, so a
caller can tell "the peer said no" (re-raised as the same domain error) from
"the peer could not be reached" (an `UnavailableError` naming the peer).
"""

from __future__ import annotations

import functools
from concurrent import futures
import inspect
import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from reshard.proto.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
    error_for_status,
    status_name,
)

__all__ = ["servicer_method", "domain_error", "start_server", "refuse", "RequestDecoding", "SERVER_OPTIONS"]

log = logging.getLogger(__name__)

_MARK = "reshard-domain-error"
# A status message travels in trailing metadata, percent-encoded outside printable ASCII; a client refuses
# metadata over 8 KiB (grpc.max_metadata_size) and would see RESOURCE_EXHAUSTED instead of the answer.
_MAX_DETAILS_BYTES = 4096


def _bounded(message: str) -> str:
    """``message`` cut to what a status carries safely: a message that quotes a caller's huge input stays
    readable, and the caller still gets the real status."""
    size = 0
    for i, ch in enumerate(message):
        size += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "surrogatepass"))
        if size > _MAX_DETAILS_BYTES:
            return message[:i] + " [... cut]"
    return message


def refuse(context: grpc.ServicerContext, error: Exception):
    """End the call with the status ``error`` maps to, its message unchanged (but `_bounded`). A bug (no
    domain error) is logged with its traceback and answers INTERNAL without the exception's text, which
    may hold internals."""
    name = status_name(error)
    if name is None:
        incident = uuid.uuid4().hex[:12]
        log.error("internal error %s answering %s", incident, getattr(context, "peer", lambda: "?")(),
                  exc_info=error)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error {incident} (a bug: the server logged it)")
    context.set_trailing_metadata(((_MARK, "1"),))
    context.abort(getattr(grpc.StatusCode, name), _bounded(str(error)))


def servicer_method(fn):
    """Wrap a servicer method (unary or streaming) so domain errors become status codes."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(self, request, context):
            try:
                yield from fn(self, request, context)
            except Exception as e:  # noqa: BLE001 - every error leaves as a status
                refuse(context, e)
        return stream

    @functools.wraps(fn)
    def unary(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as e:  # noqa: BLE001
            refuse(context, e)
    return unary


class _Undecodable:
    """What a request deserializer hands on in place of bytes it could not decode."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserializer):
    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any decoding failure is the caller's malformed request
            return _Undecodable(e)
    return decode


class RequestDecoding(grpc.ServerInterceptor):
    """Requests whose bytes do not decode end INVALID_ARGUMENT, naming the method.

    gRPC answers them INTERNAL ("Exception deserializing request!") before any
    servicer runs, which reads as a bug of ours. Here the deserializer hands on
    a marker instead, and the call (or, in a stream, the read of that message)
    is refused. Install it after `Authenticator`, so a call without the token is
    refused for that first.
    """

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method

        def refusal(request: _Undecodable) -> InvalidArgumentError:
            return InvalidArgumentError(f"a request message to {method} does not decode ({request.error}); "
                                        f"send messages of reshard.proto, whole")

        def check(request):
            if isinstance(request, _Undecodable):
                raise refusal(request)
            return request

        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)
        if handler.request_streaming:  # the servicer's own wrapper refuses, as it reads the bad message
            def behaviour(requests, context):
                return inner((check(r) for r in requests), context)
        elif handler.response_streaming:
            def behaviour(request, context):
                if isinstance(request, _Undecodable):
                    refuse(context, refusal(request))
                yield from inner(request, context)
        else:
            def behaviour(request, context):
                if isinstance(request, _Undecodable):
                    refuse(context, refusal(request))
                return inner(request, context)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(behaviour, request_deserializer=_lenient(handler.request_deserializer),
                    response_serializer=handler.response_serializer)


def domain_error(err: grpc.RpcError, peer: str) -> Exception:
    """The domain error a failed call stands for; ``peer`` describes whom we called."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    marked = any(k == _MARK for k, _ in (err.trailing_metadata() or ())) if hasattr(err, "trailing_metadata") else False
    if marked:
        mapped = error_for_status(code.name, details)
        if mapped is not None:
            return mapped
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"{peer} did not answer in time ({details})")
    return UnavailableError(f"{peer} failed: {code.name}: {details}")


# gRPC sets SO_REUSEPORT by default, so a second server on a port already in use binds "successfully"
# and the kernel splits new connections between the two: a misconfigured agent would silently receive
# another agent's shards. Without it, the second bind fails and the server refuses to start.
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


def start_server(server: grpc.Server, listen: str, service: str,
                 credentials: grpc.ServerCredentials | None = None) -> int:
    """Add health checking, bind ``listen`` (with TLS under ``credentials``), start, and report SERVING;
    returns the bound port."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError as e:  # grpcio raises this where older versions returned port 0
        raise OSError(f"{service} could not bind {listen}: is another server using the port?") from e
    if port == 0:
        raise OSError(f"{service} could not bind {listen}: is another server using the port?")
    server.start()
    for name in ("", service):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return port


def serve_health(listen: str, service: str) -> tuple[grpc.Server, int]:
    """A plaintext gRPC server with only the health service, reporting ``service`` SERVING; returns it and its port.

    For probes that cannot speak TLS (Kubernetes' native gRPC probes) while the service's own port does:
    it reveals nothing but whether the process is up.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    return server, start_server(server, listen, service)
