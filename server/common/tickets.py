"""Planner-issued tickets: an agent changes what it holds only for calls the planner signed.

Each agent makes a random secret at start and hands it to the planner when it
registers; the host stays bound to that secret until it is marked down. The
planner signs every call that changes an agent's memory or runs its work with
HMAC-SHA256 under that host's secret, over the call's kind and the fields below;
the agent checks the ticket before doing anything and answers PERMISSION_DENIED
otherwise. A client holding the cluster token therefore still cannot stage,
commit, push or free shards the planner did not ask for, and a forged ticket
for one host is worthless on another.

=========== ================================================== =======================
kind        fields signed                                      carried by
=========== ================================================== =======================
put         upload, tensor, device, dtype, box                 PutShard / PutShardIpc
                                                               header (the SDK got it
                                                               from BeginUpload)
prepare     job, sha256(program), tensor, versions, transport, PrepareRequest (with the
            generation, job number, peers                      program's text, or its
                                                               sha256 where the agent
                                                               holds it already)
execute     job, program id, whether it commits too             ExecuteRequest
push        job, program id (under the receiver's secret)      PushHeader
commit      upload or job, tensor, version, devices, then     StagingRequest
            each further upload, tensor, version, devices
abort       upload or job, then each further upload            StagingRequest
release     tensor, version, then each further name, version   ReleaseRequest
heartbeat   host, address                                      HeartbeatRequest.proof
=========== ================================================== =======================
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping, Sequence
import numpy as np

from reshard.box import Box
from reshard.proto.errors import PermissionDeniedError
from reshard.server.common.contract import read_columns

__all__ = ["new_secret", "sign", "TicketCheck", "put_fields", "program_digest", "reads_digest", "prepare_fields",
           "commit_fields",
           "abort_fields", "execute_fields", "release_fields", "SECRET_BYTES"]

SECRET_BYTES = 32
_SEP = "\x1f"


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def sign(secret: bytes, kind: str, *fields) -> str:
    message = _SEP.join([kind, *map(str, fields)]).encode("utf-8", "surrogatepass")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def put_fields(upload: str, tensor: str, device: str, dtype: str, box: Box) -> tuple:
    return upload, tensor, device, dtype, ",".join(f"{lo}:{hi}" for lo, hi in box)


def program_digest(program_json: str) -> str:
    """The SHA-256 (hex) of a program's text: what a prepare ticket signs, and the name an agent holds a program
    it has read under (a later Prepare may name it instead of carrying the text again)."""
    return hashlib.sha256(program_json.encode("utf-8", "surrogatepass")).hexdigest()


def columns_digest(tensors: Sequence[str], names: Sequence[str]) -> str:
    """The SHA-256 (hex) of a Prepare's read columns but the versions: program tensor ``tensors[i]`` reads stored
    ``names[i]`` (each given, its own name too). A later Prepare names them by it
    (`PrepareRequest.read_columns_sha256`)."""
    h = hashlib.sha256(_SEP.join(tensors).encode("utf-8", "surrogatepass"))
    h.update(b"\x1e" + _SEP.join(names).encode("utf-8", "surrogatepass") + b"\x1e")
    return h.hexdigest()


def signed_reads(columns_sha256: str, versions: Sequence[int]) -> str:
    """What a Prepare's ticket signs of its reads: the SHA-256 (hex) of its columns' `columns_digest` and its
    versions. Columns, not a string per read: a state dict's job signs 139,583 reads, and each host's agent checks
    its own; the names are hashed once for as long as they are the same (a repeated sync's)."""
    h = hashlib.sha256(columns_sha256.encode("utf-8", "surrogatepass"))
    h.update(np.asarray(versions, dtype="<i8").tobytes())
    return h.hexdigest()


def signed_coded_reads(columns_sha256: str, values: Sequence[int], codes: bytes) -> str:
    """`signed_reads` of versions given as a dictionary (`contract.code_versions`: the distinct versions, and a byte
    per read naming one): the SHA-256 of the columns' digest, the values as little-endian int64 and the codes,
    marked ``coded:`` so that no versions given plain sign the same."""
    h = hashlib.sha256(columns_sha256.encode("utf-8", "surrogatepass"))
    h.update(np.asarray(values, dtype="<i8").tobytes())
    h.update(b"\x1e" + bytes(codes))
    return "coded:" + h.hexdigest()


def deltas_digest(src: Sequence[int], dst: Sequence[int]) -> str:
    """What a Prepare's ticket signs of delta bases given as columns beside its reads (`read_delta_src`,
    ``read_delta_dst``): the SHA-256 (hex) of both, as little-endian int64."""
    h = hashlib.sha256(np.asarray(src, dtype="<i8").tobytes())
    h.update(b"\x1e" + np.asarray(dst, dtype="<i8").tobytes())
    return h.hexdigest()


def reads_digest(tensors: Sequence[str], names: Sequence[str], versions: Sequence[int]) -> str:
    """`signed_reads` of columns given whole, in the order carried: program tensor ``tensors[i]`` reads stored
    ``names[i]`` at ``versions[i]``."""
    return signed_reads(columns_digest(tensors, names), versions)


def prepare_fields(job: str, program_sha256: str, tensor: str, src_version: int, dst_version: int, transport: str,
                   generation: int, job_seq: int, peers: Mapping[str, str],
                   reads: Mapping[str, tuple[str, int]] | None = None,
                   nixl_peers: Mapping[str, bytes] | None = None,
                   delta_bases: Mapping[str, tuple[int, int]] | None = None, signed_reads: str = "",
                   reads_at: int | None = None, signed_deltas: str = "") -> tuple:
    """``program_sha256`` is `program_digest` of the program's text. ``reads`` (program tensor -> (stored name,
    version), in the order the request carries them) is signed as its `reads_digest`, or ``signed_reads`` is that
    digest where the caller has it; ``reads_at`` (`PrepareRequest.reads_at`: every program tensor with a source
    reads its own name at that version) in their place. ``nixl_peers`` (host -> NIXL metadata) is signed too: an
    agent adds as NIXL peers only the agents the planner introduced, and UCX authenticates nobody.
    ``delta_bases`` (program tensor -> (src_version, dst_version), `PrepareRequest.delta_bases`) is signed: which
    stored versions a delta move reads; ``signed_deltas`` (`deltas_digest`) where they come as columns beside the
    reads (`PrepareRequest.read_delta_src`)."""
    fields = (job, program_sha256, tensor, src_version, dst_version, transport or "grpc", generation, job_seq,
              ",".join(f"{h}={a}" for h, a in sorted(peers.items())))
    if reads:  # a compute program's tensors: which stored versions it reads, and the name it commits as
        signed_reads = reads_digest(*read_columns(reads))
    if reads_at is not None:
        if signed_reads:
            raise ValueError("a Prepare's reads are columns or reads_at, not both")
        fields += (f"reads_at:{reads_at}",)
    if signed_reads:
        fields += ("reads:" + signed_reads,)
    if nixl_peers:
        fields += ("nixl:" + ",".join(f"{h}={hashlib.sha256(m).hexdigest()}" for h, m in sorted(nixl_peers.items())),)
    if delta_bases:
        fields += ("delta:" + ",".join(f"{t}={s}>{d}" for t, (s, d) in sorted(delta_bases.items())),)
    if signed_deltas:
        fields += ("delta_columns:" + signed_deltas,)
    return fields


def execute_fields(job: str, program_id: str, commit: bool) -> tuple:
    return job, program_id, "commit" if commit else "run"


def commit_fields(upload: str, job: str, tensor: str, version: int, devices: Iterable[str],
                  more: Iterable[tuple[str, str, int, Iterable[str]]] = ()) -> tuple:
    """What a Commit's ticket signs: the staging it commits, then every further upload (upload, tensor, version,
    devices) of ``more``, in order."""
    return (upload, job, tensor, version, ",".join(devices),
            *(f for up, t, v, devs in more for f in (up, t, v, ",".join(devs))))


def abort_fields(upload: str, job: str, more: Iterable[str] = ()) -> tuple:
    """What an Abort's ticket signs: the staging it drops, then every further upload of ``more``, in order."""
    return (upload, job, *more)


def release_fields(versions: Iterable[tuple[str, int]]) -> tuple:
    """Every (tensor, version) a Release frees, in order."""
    return tuple(f for pair in versions for f in pair)


class TicketCheck:
    """An agent's side: checks tickets against its own secret."""

    def __init__(self, host: str, secret: bytes):
        self.host = host
        self.secret = secret

    def check(self, ticket: str, kind: str, *fields, what: str) -> None:
        """Raise PermissionDeniedError unless ``ticket`` is the planner's for ``kind`` over ``fields``."""
        if not ticket:
            raise PermissionDeniedError(f"{what} carries no ticket: host {self.host}'s agent acts only on calls its "
                                        f"planner issued (reshard.server.common.tickets)")
        if not hmac.compare_digest(ticket.encode("ascii", "replace"), sign(self.secret, kind, *fields).encode()):
            raise PermissionDeniedError(f"{what} carries a ticket this agent's planner did not issue for it "
                                        f"(host {self.host})")
