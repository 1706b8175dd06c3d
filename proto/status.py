"""Domain errors to gRPC status codes and back, with the message unchanged.

A servicer that fails on purpose marks its status with trailing metadata, so a
caller can tell "the peer said no" (re-raised as the same domain error) from
"the peer could not be reached" (an `UnavailableError` naming the peer).
"""

from __future__ import annotations

import functools
import inspect
import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from reshard.proto.errors import DeadlineExceededError, UnavailableError, error_for_status, status_name

__all__ = ["servicer_method", "domain_error", "start_server", "refuse", "SERVER_OPTIONS"]

log = logging.getLogger(__name__)

_MARK = "reshard-domain-error"


def refuse(context: grpc.ServicerContext, error: Exception):
    """End the call with the status ``error`` maps to, its message unchanged. A bug (no domain error) is
    logged with its traceback and answers INTERNAL without the exception's text, which may hold internals."""
    name = status_name(error)
    if name is None:
        incident = uuid.uuid4().hex[:12]
        log.error("internal error %s answering %s", incident, getattr(context, "peer", lambda: "?")(),
                  exc_info=error)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error {incident} (a bug: the server logged it)")
    context.set_trailing_metadata(((_MARK, "1"),))
    context.abort(getattr(grpc.StatusCode, name), str(error))


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
