"""The reshard SDK: ``reshard.connect(address)`` and ``reshard.local_cluster(...)``.

Imports the core and the wire contract (``reshard.proto``), never the services.
"""

from reshard.client.client import Client, Job, JobFailedError, JobResult, Pin, RegisteredSync, TensorInfo, connect
from reshard.client.cluster import LocalCluster, local_cluster
from reshard.proto.errors import (
    AlreadyExistsError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = [
    "Client",
    "connect",
    "local_cluster",
    "LocalCluster",
    "Job",
    "JobResult",
    "JobFailedError",
    "TensorInfo",
    "Pin",
    "RegisteredSync",
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
]
