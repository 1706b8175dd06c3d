"""Types and names the planner and the agents both rely on, besides the protobuf messages.

======================= ==========================================================================
``GroupView``           the process group the planner wants an agent in (store port, generation,
                        members in rank order, backend)
``TRANSPORT_MODES``     what an agent may register: ``grpc``, ``collective``, ``auto``, ``nixl``
``BACKENDS``            the collective backends: ``gloo`` (CPU shards), ``nccl`` (CUDA shards)
``Staging``             an upload id or a job id: who staged shards on an agent
``confirm_prefix``      the rendezvous keys under which a job's hosts confirm its plan id before a
                        collective phase; the planner deletes them when the job ends
``check_host_name``     what a host name may hold: letters, digits, '.', '-', '_'
``PROGRAM_NOT_HELD``    how an agent's NOT_FOUND begins when a Prepare names a program by its
                        SHA-256 that the agent no longer holds: the planner sends the text then
``PROGRAMS_KEPT``       how many parsed programs an agent keeps, most recently used, and
``PROGRAMS_KEPT_BYTES`` how much of their text (the newest stays whatever its size): the planner
                        names a program by its SHA-256 to an agent it sent the text to while both
                        would still hold it
``prepare_reads``       a Prepare's reads (program tensor -> stored name and version) from the columns
                        the request carries them in, and ``read_columns`` those columns from the reads
``READS_NOT_HELD``      how an agent's NOT_FOUND begins when a Prepare names read columns by their
                        SHA-256 that the agent no longer holds: the planner sends them then
``READ_COLUMNS_KEPT``   how many read columns an agent keeps, most recently used, and how many
                        bytes of names (``READ_COLUMNS_KEPT_BYTES``, `columns_nbytes`; the newest
                        stays whatever its size), which the planner mirrors as for programs
``DELTA_BASE_MISMATCH`` how an agent's FAILED_PRECONDITION begins when a delta stream's base (the
                        receiver's copy of the version it starts from) differs from the sender's, or
                        the delta applied to it does not give the sender's box: the planner runs the
                        job again with those tensors moved whole, and says so (issue 40)
======================= ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter

import numpy as np

from reshard.proto.errors import InvalidArgumentError

__all__ = ["GroupView", "Staging", "prepare_reads", "read_versions", "code_versions", "version_codes", "read_columns",
           "columns_nbytes", "TRANSPORT_MODES", "BACKENDS", "MAX_VERSION_CODES",
           "PROGRAM_NOT_HELD", "PROGRAMS_KEPT", "PROGRAMS_KEPT_BYTES", "READS_NOT_HELD", "READ_COLUMNS_KEPT",
           "READ_COLUMNS_KEPT_BYTES", "DELTA_BASE_MISMATCH", "confirm_prefix", "check_host_name"]

TRANSPORT_MODES = ("grpc", "collective", "auto", "nixl")
BACKENDS = ("gloo", "nccl")
PROGRAM_NOT_HELD = "program not held"
READS_NOT_HELD = "read columns not held"
DELTA_BASE_MISMATCH = "delta base mismatch"
# A pipeline stage runs a dozen small programs in turn every step; a state dict's program is megabytes of JSON, and
# its parsed form several times that (an 8,000-tensor reshard_many is 15 MiB of text; agents holding it and the move
# back were 630-670 MB each). The byte budget holds a sync out and its way back, taking turns: at 16 MiB those two
# programs pushed each other out, and every job read its program again (8,000 tensors: 18-20 s a job against 1.5 s
# with both held, most of it each agent reading the text).
PROGRAMS_KEPT = 64
PROGRAMS_KEPT_BYTES = 64 * 2**20
# A quantized 139,583-tensor sync's columns are a few MiB of names per host: a sync out and back, and a few more
READ_COLUMNS_KEPT = 64
READ_COLUMNS_KEPT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class GroupView:
    """What an agent is told: where the store is and which group to form."""

    store_port: int
    generation: int
    members: tuple[str, ...]
    backend: str


@dataclass(frozen=True)
class Staging:
    """Who staged shards on an agent: an upload (``upload``, the SDK's) or a job (``job``, the planner's).

    Upload ids and job ids are different things that both stage shards until they
    commit or abort; naming which one a call means keeps them apart on the wire.
    """

    upload: str = ""
    job: str = ""

    def __post_init__(self):
        if bool(self.upload) == bool(self.job):
            raise ValueError(f"name exactly one of an upload id and a job id; got upload={self.upload!r}, job={self.job!r}")

    def __str__(self) -> str:
        return f"upload {self.upload[:8]}" if self.upload else f"job {self.job[:8]}"


def confirm_prefix(generation: int, job: str, phase: int) -> str:
    return f"reshard/g{generation}/confirm/{job}/{phase}/"


def check_host_name(host: str) -> str:
    """Host names are 1 to 253 characters of letters, digits, '.', '-' and '_' (no '/', no control bytes)."""
    if not host or len(host) > 253 or not all(c.isascii() and (c.isalnum() or c in ".-_") for c in host):
        raise InvalidArgumentError(f"host name {host[:80]!r} must be 1 to 253 characters of letters, digits, '.', "
                                   f"'-' and '_'")
    return host


MAX_VERSION_CODES = 256  # distinct versions a Prepare's reads may name by a byte each (`code_versions`)
_CODE_SPAN = 1 << 20  # the widest range of versions `code_versions` codes (it counts through the range once)


def code_versions(versions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``versions`` (int64) as a dictionary, as a Prepare may carry them (``read_version_values``,
    ``read_version_codes``): (the distinct versions ascending, and each one's index among them as a uint8), where
    there are at most `MAX_VERSION_CODES` within a span of a million; else None. One pass and no sort: a quantizing
    sync's job reads 139,583 tensors at a handful of versions."""
    if not len(versions):
        return None
    lo, hi = int(versions.min()), int(versions.max())
    if hi - lo >= _CODE_SPAN:
        return None
    offsets = versions - lo
    present = np.zeros(hi - lo + 1, bool)
    present[offsets] = True
    values = np.flatnonzero(present)
    if len(values) > MAX_VERSION_CODES:
        return None
    place = np.cumsum(present) - 1
    return values + lo, place[offsets].astype(np.uint8)


def read_versions(request) -> list[int]:
    """A ``PrepareRequest``'s read versions: ``read_versions``, or those ``read_version_values`` and
    ``read_version_codes`` code (`code_versions`), checked (`version_codes`)."""
    coded = version_codes(request)
    if coded is None:
        return list(request.read_versions)
    values, codes = coded
    return values[codes].tolist()


def version_codes(request) -> tuple[np.ndarray, np.ndarray] | None:
    """A ``PrepareRequest``'s coded read versions (`code_versions`) as (values, codes), checked: given alone, and
    every code naming a value; None where its versions are given plain."""
    if not (request.read_version_codes or request.read_version_values):
        return None
    what = f"Prepare of job {request.job[:12]!r}"
    if request.read_versions:
        raise InvalidArgumentError(f"{what} gives its read versions twice, as {len(request.read_versions)} versions "
                                   f"and as codes; give one")
    values = np.asarray(request.read_version_values, np.int64)
    codes = np.frombuffer(request.read_version_codes, np.uint8)
    top = int(codes.max()) if len(codes) else -1
    if len(values) > MAX_VERSION_CODES or top >= len(values):
        raise InvalidArgumentError(f"{what} codes its read versions by {len(values)} values, and a code names value "
                                   f"{top}: give at most {MAX_VERSION_CODES} values, and codes below their count")
    return values, codes


def prepare_reads(request) -> dict[str, tuple[str, int]]:
    """The reads of a ``PrepareRequest``: program tensor ``read_tensors[i]`` -> (``read_names[i]``, or its own name
    where the request names none, ``read_versions[i]``, or its version as coded: `read_versions`)."""
    tensors, names, versions = request.read_tensors, request.read_names or request.read_tensors, read_versions(request)
    if not len(tensors) == len(names) == len(versions):
        raise InvalidArgumentError(f"Prepare of job {request.job[:12]!r} reads {len(tensors)} tensors with "
                                   f"{len(request.read_names)} stored names and {len(versions)} versions; give a "
                                   f"version for each, and a name for each or none")
    return dict(zip(tensors, zip(names, versions)))


_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def read_columns(reads: Mapping[str, tuple[str, int]],
                 tensors: Iterable[str] | None = None) -> tuple[list[str], list[str], list[int]]:
    """``reads`` (program tensor -> (stored name, version)) as the columns a Prepare carries them in (program
    tensors, stored names, versions): all of them, or those of ``tensors`` (a host's slice's) in that order.
    Made a column at a time: a state dict's job reads 139,583 tensors. `prepare_reads` reads them back."""
    if tensors is None:
        tensors, read = list(reads), list(reads.values())
    else:
        tensors, read = list(tensors), list(map(reads.get, tensors))
        if not all(read):  # a slice's tensor no read names: one its program makes
            tensors, read = [t for t, r in zip(tensors, read) if r], [r for r in read if r]
    return tensors, list(map(_FIRST, read)), list(map(_SECOND, read))


def columns_nbytes(tensors: Sequence[str], names: Sequence[str]) -> int:
    """What a pair of read columns (program tensors, stored names: each given) counts against
    `READ_COLUMNS_KEPT_BYTES`: its characters."""
    return sum(map(len, tensors)) + sum(map(len, names))
