"""torch, where a component needs it: whether it is there, and a clear error where it is not.

The planner (its rendezvous store) and the collective transport both need
``torch.distributed``; nothing else in the service imports torch at module level.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util

from reshard.proto.errors import FailedPreconditionError

__all__ = ["torch_available", "torch_installed", "require_torch", "seconds_delta"]

_TORCH_HINT = "the collective transport needs torch: pip install 'reshard[torch]'"


@functools.cache
def torch_installed() -> bool:
    """Whether torch is installed, without importing it (which takes a second or more): see `torch_available`.
    Looked up once: an install does not change under a running process."""
    return importlib.util.find_spec("torch") is not None


def torch_available() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available()


def require_torch():
    """``torch.distributed``, or a `FailedPreconditionError` that says how to install it."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise FailedPreconditionError(f"torch is not installed; {_TORCH_HINT}") from None
    if not dist.is_available():
        raise FailedPreconditionError(f"this torch build has no torch.distributed; {_TORCH_HINT}")
    return dist


def seconds_delta(seconds: float) -> datetime.timedelta:
    """The timeout type torch.distributed takes."""
    return datetime.timedelta(seconds=seconds)
