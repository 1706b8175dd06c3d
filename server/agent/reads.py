"""A Prepare's reads as it carries them (issue 41): columns of program tensors, stored names and versions, the
columns named by their SHA-256 once an agent holds them (`HeldColumns`), or one version for every tensor
(``reads_at``); and the delta bases beside them. `CarriedReads` checks what can be checked before the Prepare's
ticket and says what the ticket signs of them; `CarriedReads.resolve` gives the reads once it is checked."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError, NotFoundError
from reshard.server.common.contract import (READ_COLUMNS_KEPT, READ_COLUMNS_KEPT_BYTES, READS_NOT_HELD, columns_nbytes,
                                            prepare_reads, read_versions, version_codes)
from reshard.server.common.tickets import columns_digest, deltas_digest, signed_coded_reads, signed_reads

__all__ = ["HeldColumns", "CarriedReads"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class HeldColumns:
    """The read columns (program tensors, stored names) Prepares carried under their SHA-256, most recently used
    last: at most `READ_COLUMNS_KEPT`, and `READ_COLUMNS_KEPT_BYTES` of names (the newest whatever its size), the
    rule the planner mirrors to know which it may name by digest."""

    def __init__(self, host: str):
        self.host = host
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[list[str], list[str], int]] = OrderedDict()
        self._bytes = 0

    def keep(self, sha256: str, tensors: list[str], names: list[str]) -> None:
        nbytes = columns_nbytes(tensors, names)
        with self._lock:
            old = self._held.pop(sha256, None)
            self._bytes -= old[2] if old is not None else 0
            self._held[sha256] = (tensors, names, nbytes)
            self._bytes += nbytes
            while len(self._held) > 1 and (len(self._held) > READ_COLUMNS_KEPT or
                                           self._bytes > READ_COLUMNS_KEPT_BYTES):
                self._bytes -= self._held.popitem(last=False)[1][2]

    def get(self, sha256: str) -> tuple[list[str], list[str]]:
        """The columns held under ``sha256`` (program tensors, stored names)."""
        with self._lock:
            held = self._held.get(sha256)
            if held is not None:
                self._held.move_to_end(sha256)
        if held is None:
            raise NotFoundError(f"{READS_NOT_HELD}: agent {self.host} holds no read columns with SHA-256 "
                                f"{sha256[:16]} (it keeps the last {READ_COLUMNS_KEPT}); the planner sends them again")
        return held[0], held[1]


@dataclass(frozen=True)
class CarriedReads:
    """A Prepare's reads as it carries them (`AgentServicer._prepare`): columns (kept under their SHA-256 where it
    names one, for the Prepares that name them by it alone), their SHA-256 alone (looked up once the ticket is
    checked), or ``reads_at``; what the ticket signs of them; and the delta bases carried beside them as columns."""

    job: str
    sha: str
    columns: tuple[list[str], list[str]] | None  # carried
    reads: dict[str, tuple[str, int]]  # of the columns carried
    at: int | None
    signed: str
    signed_deltas: str

    @classmethod
    def of(cls, r: pb.PrepareRequest) -> "CarriedReads":
        """The reads ``r`` carries, checked for what can be checked before its ticket."""
        what = f"Prepare of job {r.job[:12]!r}"
        sha, columns, signed, reads = r.read_columns_sha256, None, "", {}
        if sha and not _SHA256_HEX.fullmatch(sha):
            raise InvalidArgumentError(f"{what} names read columns by {sha[:80]!r}, which is not a SHA-256 in 64 "
                                       f"hexadecimal digits")
        if sha and not r.read_tensors:
            signed = _signed(sha, r)
        elif reads := prepare_reads(r):  # (which checks the columns' lengths)
            columns = (list(r.read_tensors), list(r.read_names or r.read_tensors))
            digest = columns_digest(*columns)
            if sha and sha != digest:
                raise InvalidArgumentError(f"{what} carries read columns whose SHA-256 is {digest[:16]}, not the "
                                           f"{sha[:16]} it names them by")
            signed = _signed(digest, r)
        at = r.reads_at if r.HasField("reads_at") else None
        if signed and at is not None:
            raise InvalidArgumentError(f"{what} names its reads twice: as columns and as reads_at {at}; give one")
        src, dst = r.read_delta_src, r.read_delta_dst
        if (src or dst) and (len(src) != len(dst) or not signed or r.delta_bases):
            raise InvalidArgumentError(f"{what} gives delta bases as {len(src)} sources and {len(dst)} destinations "
                                       f"beside {'columns of reads' if signed else 'no columns of reads'}"
                                       f"{' and a map of them' if r.delta_bases else ''}: give one pair per read, "
                                       f"beside columns, or the map alone")
        return cls(r.job, sha, columns, reads, at, signed, deltas_digest(src, dst) if src else "")

    def resolve(self, held: HeldColumns, r: pb.PrepareRequest) -> tuple[dict[str, tuple[str, int]],
                                                                         dict[str, tuple[int, int]]]:
        """Once the ticket is checked: the reads (program tensor -> (stored name, version)) and the delta bases
        given beside them (program tensor -> (src_version, dst_version))."""
        if self.columns is None and not self.signed:
            return {}, {}
        if self.columns is None:
            tensors, names = held.get(self.sha)
        else:
            tensors, names = self.columns
            if self.sha:
                held.keep(self.sha, tensors, names)
        versions, src = read_versions(r), r.read_delta_src
        if len(versions) != len(tensors) or (src and len(src) != len(tensors)):
            raise InvalidArgumentError(f"Prepare of job {self.job[:12]!r} reads {len(tensors)} tensors at "
                                       f"{len(versions)} versions" + (f" with {len(src)} delta bases" if src else "")
                                       + "; give one of each per tensor")
        deltas = {t: (a, b) for t, a, b in zip(tensors, src, r.read_delta_dst) if a >= 0} if src else {}
        return self.reads or dict(zip(tensors, zip(names, versions))), deltas


def _signed(columns_sha256: str, r: pb.PrepareRequest) -> str:
    """What ``r``'s ticket signs of its reads' versions, as it carries them: plain, or coded (checked first:
    `version_codes`)."""
    if version_codes(r) is not None:  # (checked, not decoded: `resolve` decodes them once)
        return signed_coded_reads(columns_sha256, r.read_version_values, r.read_version_codes)
    return signed_reads(columns_sha256, r.read_versions)
