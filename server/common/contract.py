"""Types and names the planner and the agents both rely on, besides the protobuf messages.

======================= ==========================================================================
``GroupView``           the process group the planner wants an agent in (store port, generation,
                        members in rank order, backend)
``TRANSPORT_MODES``     what an agent may register: ``grpc``, ``collective``, ``auto``
``BACKENDS``            the collective backends: ``gloo`` (CPU shards), ``nccl`` (CUDA shards)
``confirm_prefix``      the rendezvous keys under which a job's hosts confirm its plan id before a
                        collective phase; the planner deletes them when the job ends
======================= ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GroupView", "TRANSPORT_MODES", "BACKENDS", "confirm_prefix"]

TRANSPORT_MODES = ("grpc", "collective", "auto")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupView:
    """What an agent is told: where the store is and which group to form."""

    store_port: int
    generation: int
    members: tuple[str, ...]
    backend: str


def confirm_prefix(generation: int, job: str, phase: int) -> str:
    return f"reshard/g{generation}/confirm/{job}/{phase}/"
