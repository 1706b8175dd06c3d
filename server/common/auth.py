"""Who may call a server: the cluster token on every call, or loopback callers only when there is none.

`Authenticator` is a server interceptor both services install. With a token,
a call whose ``authorization`` metadata is not ``Bearer <token>`` (compared in
constant time) ends UNAUTHENTICATED before the servicer sees it. Without one,
only callers on this machine (loopback or a Unix socket) are answered, and a
server asked to listen beyond loopback says so loudly at start. The gRPC health
service stays open to everyone: it tells only whether the server is serving,
and probes (Kubernetes, compose) carry no token.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Optional

import grpc

from reshard.proto.auth import METADATA_KEY
from reshard.proto.errors import UnauthenticatedError
from reshard.proto.status import refuse

__all__ = ["Authenticator", "is_loopback_peer", "is_loopback_listen", "warn_if_open"]

log = logging.getLogger(__name__)

_OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``) is this machine."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def is_loopback_listen(listen: str) -> bool:
    """Whether a listen address (``127.0.0.1:0``, ``[::1]:50051``, ``localhost:0``) binds loopback only."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(service: str, listen: str, token: Optional[str]) -> None:
    if token is None and not is_loopback_listen(listen):
        log.warning("\n" + "!" * 78 + "\n%s listens on %s WITHOUT a cluster token: it answers callers on this "
                    "machine only.\nGive every process the same token (--token-file, or RESHARD_TOKEN) to serve "
                    "other machines; see docs/security.md\n" + "!" * 78, service, listen)


class Authenticator(grpc.ServerInterceptor):
    def __init__(self, token: Optional[str], service: str):
        self._expected = f"Bearer {token}".encode() if token else None
        self._service = service

    def _refusal(self, context: grpc.ServicerContext, method: str) -> Optional[UnauthenticatedError]:
        if self._expected is None:
            peer = context.peer()
            if is_loopback_peer(peer):
                return None
            return UnauthenticatedError(f"{self._service} has no cluster token and answers callers on its own "
                                        f"machine only; {peer} called {method}")
        presented = next((v for k, v in context.invocation_metadata() or () if k == METADATA_KEY), None)
        if presented is None:
            return UnauthenticatedError(f"{method} needs the cluster token (metadata {METADATA_KEY!r}: Bearer "
                                        f"<token>); pass token= to reshard.connect or set RESHARD_TOKEN")
        if not hmac.compare_digest(presented.encode() if isinstance(presented, str) else presented,
                                   self._expected):
            return UnauthenticatedError(f"{method}: the cluster token presented is not this cluster's")
        return None

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(_OPEN_SERVICES):
            return handler
        return _guarded(handler, lambda context: self._refusal(context, details.method))


def _guarded(handler: grpc.RpcMethodHandler, refusal) -> grpc.RpcMethodHandler:
    """``handler`` with the check run first: a refused call ends with its status before the servicer runs."""
    if handler.unary_unary:
        inner, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream:
        inner, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary:
        inner, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    else:
        inner, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler

    if handler.response_streaming:
        def behaviour(request, context):
            error = refusal(context)
            if error is not None:
                refuse(context, error)
            yield from inner(request, context)
    else:
        def behaviour(request, context):
            error = refusal(context)
            if error is not None:
                refuse(context, error)
            return inner(request, context)

    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
