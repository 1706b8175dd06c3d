"""The service's error vocabulary, shared by the services and the SDK.

Each error maps to one gRPC status code; the message travels unchanged. Caller
mistakes stay ``ValueError`` subclasses (the core's errors included) and map to
``INVALID_ARGUMENT``. This module imports no gRPC, so domain code may raise
these errors and the SDK may re-raise them without either depending on the
other.

==================== ====================== ========================================
error                status code            when
==================== ====================== ========================================
ValueError (any)     INVALID_ARGUMENT       bad shape, dtype, sharding, shard, device
NotFoundError        NOT_FOUND              unknown tensor, job or shard
AlreadyExistsError   ALREADY_EXISTS         a tensor name that is taken
FailedPrecondition.. FAILED_PRECONDITION    a host is down, a shard set is incomplete
UnavailableError     UNAVAILABLE            an agent that cannot be reached
DeadlineExceeded..   DEADLINE_EXCEEDED      a job or transfer that ran out of time
DataLossError        DATA_LOSS              bytes that arrived unlike the sender's (size, XXH3-64), or a
                                            tile whose every copy was lost with its agent
PermissionDenied..   PERMISSION_DENIED      an agent call without the planner's ticket; a host name
                                            registered by another live agent
Unauthenticated..    UNAUTHENTICATED        a call without the cluster token, or with a wrong one
ResourceExhausted..  RESOURCE_EXHAUSTED     over an agent's memory limit, a plan or JSON size limit
JsonLimitError       RESOURCE_EXHAUSTED     a JSON field over its size or nesting limit (reshard.jsonio)
==================== ====================== ========================================
"""

from __future__ import annotations

from reshard.errors import JsonLimitError, ReshardError

__all__ = [
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "UnavailableError",
    "DeadlineExceededError",
    "DataLossError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "ResourceExhaustedError",
    "status_name",
    "error_for_status",
]


class InvalidArgumentError(ReshardError, ValueError):
    """A request the service rejects as malformed (a shard of the wrong size, say)."""


class NotFoundError(ReshardError, LookupError):
    """No tensor, job, device or shard by that name."""


class AlreadyExistsError(ReshardError):
    """The name is taken."""


class FailedPreconditionError(ReshardError):
    """The request is well formed but the cluster is not in a state to carry it out."""


class UnavailableError(ReshardError, ConnectionError):
    """A service or agent could not be reached."""


class DeadlineExceededError(ReshardError, TimeoutError):
    """Work did not finish in the time allowed."""


class DataLossError(ReshardError):
    """Bytes arrived unlike what the sender sent: a short stream or a digest that does not match."""


class PermissionDeniedError(ReshardError):
    """The caller is known but may not make this call (an agent call without the planner's ticket)."""


class UnauthenticatedError(ReshardError):
    """The call carried no cluster token, or a wrong one."""


class ResourceExhaustedError(ReshardError):
    """The request would go over a limit: an agent's memory, the size of a plan or of a JSON field."""


_CODES = (
    (NotFoundError, "NOT_FOUND"),
    (AlreadyExistsError, "ALREADY_EXISTS"),
    (FailedPreconditionError, "FAILED_PRECONDITION"),
    (UnavailableError, "UNAVAILABLE"),
    (DeadlineExceededError, "DEADLINE_EXCEEDED"),
    (DataLossError, "DATA_LOSS"),
    (PermissionDeniedError, "PERMISSION_DENIED"),
    (UnauthenticatedError, "UNAUTHENTICATED"),
    (JsonLimitError, "RESOURCE_EXHAUSTED"),  # a ValueError, so listed before it; the SDK raises the next one
    (ResourceExhaustedError, "RESOURCE_EXHAUSTED"),
    (ValueError, "INVALID_ARGUMENT"),
)


def status_name(error: BaseException) -> str | None:
    """The gRPC status code name for a domain error, or None for a bug (INTERNAL)."""
    for cls, name in _CODES:
        if isinstance(error, cls):
            return name
    return None


def error_for_status(name: str, message: str) -> Exception | None:
    """The domain error a status code name stands for, carrying ``message``."""
    cls = {"INVALID_ARGUMENT": InvalidArgumentError, **{n: c for c, n in _CODES if c is not ValueError}}.get(name)
    return cls(message) if cls else None
