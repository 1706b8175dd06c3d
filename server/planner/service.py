"""The planner's gRPC face: the servicer, the calls it makes to agents, and its factory."""

from __future__ import annotations

import json
from dataclasses import replace
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import NamedTuple
from itertools import repeat
from operator import itemgetter
from concurrent import futures

import grpc
import grpc.experimental
import numpy as np

from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import TlsFiles, channel
from reshard.proto.errors import InvalidArgumentError, NotFoundError
from reshard.proto.status import SERVER_OPTIONS, RequestDecoding, domain_error, servicer_method, start_server
from reshard.server.common.auth import Authenticator, warn_if_open
from reshard.server.common.tickets import (abort_fields, columns_digest, commit_fields, deltas_digest, execute_fields,
                                           prepare_fields, program_digest, release_fields, sign, signed_coded_reads,
                                           signed_reads)
from reshard.proto.wire import box_to_pb
from reshard.server.common.torch_support import torch_installed
from reshard.server.planner.rendezvous import Rendezvous
from reshard.server.common.config import PlannerConfig
from reshard.server.common.contract import (PROGRAM_NOT_HELD, PROGRAMS_KEPT, PROGRAMS_KEPT_BYTES, READ_COLUMNS_KEPT,
                                            READ_COLUMNS_KEPT_BYTES, READS_NOT_HELD, GroupView, Staging,
                                            code_versions, columns_nbytes)
from reshard.server.planner.jobs import Job, Preparation
from reshard.server.planner.control import Planner, TileLocation

__all__ = ["serve_planner", "GrpcAgentCalls"]


def _traffic(t: pb.HostTraffic) -> dict:
    out = {"bytes_in": dict(t.bytes_in), "bytes_out": dict(t.bytes_out), "local_bytes": t.local_bytes,
           "native_reduces": t.native_reduces}
    if t.delta_wire_bytes or t.delta_full_bytes:  # only a host that sent deltas: a job's record stays small
        out["delta_wire_bytes"], out["delta_full_bytes"] = dict(t.delta_wire_bytes), dict(t.delta_full_bytes)
    return out


# An Execute stream's messages are read by the thread that called it, not handed over by the channel's own polling
# thread: a job's Execute calls each took two thread switches more per message, most of a small job's planner time.
_AGENT_CHANNEL_OPTIONS = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)
_PREPARED_KEPT = 64  # jobs whose prepare request the planner keeps built, newest last
# Program texts whose SHA-256 the planner keeps (`GrpcAgentCalls._digest`), and their bytes in all: a program cut per
# host is a text per host (48 for the Kimi-K2-like sync, 412 MiB), each hashed once, not at every job. The texts are
# the planner's caches' own (`JobRunner._slices`): a key holds them a while longer at most.
_DIGESTS_KEPT = 256
_DIGESTS_KEPT_BYTES = 1 << 30
_READ_ORDERS_KEPT = 8  # programs whose reads' order and columns' SHA-256 the planner keeps: `_read_order`
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


class _ReadColumns(NamedTuple):
    """A job's reads of one host's slice (or of the whole program) as columns: `GrpcAgentCalls._columns`."""

    tensors: list[str]  # program tensors
    names: list[str]  # the stored names they read
    versions: np.ndarray | None  # int64; None where ``coded`` holds them
    sha256: str  # `tickets.columns_digest` of the first two; "" where there are none
    deltas: tuple[np.ndarray, np.ndarray] | None  # delta bases beside them (-1: none), or None: they go as a map
    coded: tuple[np.ndarray, np.ndarray] | None = None  # the versions as `contract.code_versions` codes them


def _request_of(p: Preparation, columns: _ReadColumns | None,
                delta_bases: Mapping[str, tuple[int, int]]) -> tuple[pb.PrepareRequest, tuple]:
    """Job ``p``'s Prepare without its program and tickets, naming its reads by ``columns``' SHA-256 and versions
    (`GrpcAgentCalls.prepare_request` adds the columns themselves for an agent that does not hold them), or None for
    ``p.reads_at`` in their place, and carrying
    ``delta_bases`` where the columns do not; and the fields its ticket signs but the program's SHA-256."""
    versions, digest = (columns.versions, columns.sha256) if columns is not None else ((), "")
    values, codes = columns.coded if columns is not None and columns.coded is not None else ((), b"")
    if len(values):
        codes = codes.tobytes()
        signed = signed_coded_reads(digest, values, codes) if digest else ""
        values = values.tolist()
    else:
        signed = signed_reads(digest, versions) if digest else ""
    src, dst = columns.deltas if columns is not None and columns.deltas is not None else ((), ())
    if len(src):
        delta_bases = {}
    request = pb.PrepareRequest(
        job=p.job, tensor=p.tensor, src_version=p.src_version, dst_version=p.dst_version, peers=p.peers,
        transport=p.transport, generation=p.generation, job_seq=p.job_seq,
        read_versions=versions.tolist() if versions is not None and len(versions) else (),
        read_version_values=values, read_version_codes=codes,
        read_columns_sha256=digest, nixl_peers=p.nixl_peers,
        delta_bases={t: pb.DeltaBase(src_version=a, dst_version=b) for t, (a, b) in delta_bases.items()},
        read_delta_src=src.tolist() if len(src) else (), read_delta_dst=dst.tolist() if len(src) else (),
        reads_at=p.reads_at if columns is None else None)
    fields = prepare_fields(p.job, "", p.tensor, p.src_version, p.dst_version, p.transport, p.generation, p.job_seq,
                            p.peers, None, p.nixl_peers, delta_bases,
                            signed_reads=signed,
                            reads_at=p.reads_at if columns is None else None,
                            signed_deltas=deltas_digest(src, dst) if len(src) else "")
    return request, fields


class GrpcAgentCalls:
    """`AgentCalls` over gRPC: one cached channel per agent address, every call presenting the cluster token
    and a ticket signed with the host's registration secret (``secret_of``)."""

    def __init__(self, secret_of: Callable[[str], bytes], token: str | None = None, tls: TlsFiles | None = None):
        self._secret_of = secret_of
        self._token, self._tls = token, tls
        self._lock = threading.Lock()
        self._building = threading.Lock()  # held while a job's Prepare is built (`_made`)
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.AgentStub] = {}  # one per channel: a stub builds a callable per method
        # job -> (its Preparation, (the request without its program and tickets, the fields its ticket signs but the
        # program's SHA-256, its read columns) or None for a program cut per host, push tickets by peer, per set of
        # tensors that hosts' slices declare the same three, and its reads in order: `_made`, `_part`, `_read_order`)
        self._prepared: OrderedDict[str, tuple] = OrderedDict()
        # agent address -> SHA-256 of the program texts it was sent, most recent last, with their lengths: what it
        # holds while it keeps programs as it is meant to (contract.PROGRAMS_KEPT); a Prepare names those
        self._held: dict[str, OrderedDict[str, int]] = {}
        # agent address -> SHA-256 of the read columns it was sent, most recent last, with their `columns_nbytes`
        self._held_columns: dict[str, OrderedDict[str, int]] = {}
        # program id -> its jobs' reads in order, and per slice their columns' SHA-256: `_read_order`, `_columns`
        self._read_orders: OrderedDict[str, tuple] = OrderedDict()
        # program text -> its SHA-256: a weight sync runs one program every step, and hashing its half megabyte of
        # JSON again each time cost the planner most of a millisecond per job. Keyed by the text itself, not the
        # program's id: a plan's id leaves out figures its JSON carries (a restarted agent's measured rates), and
        # a digest must be of the very text sent. The planner's caches hand out the same string object for a
        # repeated move, whose hash Python keeps, so a hit costs no pass over the text.
        self._digests: OrderedDict[str, str] = OrderedDict()
        self._digests_bytes = 0

    def _stub(self, address: str) -> pb_grpc.AgentStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                ch = self._channels[address] = channel(address, token=self._token, tls=self._tls,
                                                       options=_AGENT_CHANNEL_OPTIONS)
                stub = self._stubs[address] = pb_grpc.AgentStub(ch)
        return stub

    def _sign(self, host: str, kind: str, *fields) -> str:
        return sign(self._secret_of(host), kind, *fields)

    def _made(self, p: Preparation) -> tuple:
        """Job ``p``'s Prepare as every host gets it but for its program and tickets: built once per job (a state
        dict's reads are large), by the first of the job's calls to get here, and signed per host. (p, the request
        without its program, the fields its ticket signs with the program's SHA-256 left empty and its read columns,
        push tickets by peer, for a program cut per host the same three per set of tensors its hosts' slices
        declare, filled by `_part`, and its reads in order, `_read_order`.) A program cut per host has none for every
        host, unless its reads go by one version (``reads_at``) and it moves no deltas."""
        with self._lock:
            made = self._prepared.get(p.job)
        if made is not None and made[0] is p:
            return made
        with self._building:  # the job's calls to its hosts start at once: one builds, the others take its result
            with self._lock:
                made = self._prepared.get(p.job)
            if made is not None and made[0] is p:
                return made
            # columns of reads where they are not one version, or where delta bases go beside them
            order = self._read_order(p) if p.reads_at is None or p.delta_bases else None
            pushes = {peer: self._sign(peer, "push", p.job, p.program_id) for peer in p.peers}
            made = (p, None, pushes, {}, order)
            if not p.host_tensors or (p.reads_at is not None and not p.delta_bases):
                # the same for every host: no slices, or each slice's reads named by reads_at and no deltas
                columns = self._columns(made, None) if order is not None else None
                made = (p, (*_request_of(p, columns, p.delta_bases), columns), pushes, {}, order)
            with self._lock:
                self._prepared[p.job] = made
                while len(self._prepared) > _PREPARED_KEPT:
                    self._prepared.popitem(last=False)
        return made

    def _part(self, made: tuple, host: str) -> tuple[pb.PrepareRequest, tuple, _ReadColumns | None]:
        """``host``'s Prepare of job ``made`` (`_made`) without its program and tickets, the fields its ticket
        signs but the program's SHA-256, and its read columns (`_columns`, None where it has none): with the reads
        and delta bases of its slice's tensors where the program is cut per host, built once for every host whose
        slice declares the same tensors (a serving host's replicas hold the same experts: 8 of the Kimi-K2-like
        sync's 16 serving hosts share each set)."""
        p, base, _, parts, order = made
        if base is not None:
            return base
        names = p.host_tensors.get(host)
        with self._lock:
            part = parts.get(names)
        if part is None:
            columns = self._columns(made, names) if order is not None else None
            by_map = columns is None or columns.deltas is None  # the delta bases as a map (none beside the columns)
            part = (*_request_of(p, columns, p.delta_bases_for(host) if by_map else {}), columns)
            with self._lock:
                part = parts.setdefault(names, part)
        return part

    def _read_order(self, p: Preparation) -> tuple[tuple, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """``p``'s reads in the order it holds them: (program tensors, stored names, each tensor's place, and per
        slice `_columns`' columns), kept per program while its jobs read the same tensors under the same names (a
        repeated sync's); its versions as an int64 column; and its delta bases as two columns beside them (-1: none),
        or None (no delta bases, or one of a tensor it does not read). A job then costs a pass over its reads, not
        one per host: the Kimi-K2-like sync quantized on the way reads 139,583 tensors, its 48 hosts' slices
        395,638."""
        if p.columns is not None:  # a registered sync's: the same lists every run
            keys, stored, versions = p.columns
        else:
            keys, values = list(p.reads), list(p.reads.values())
            stored = list(map(_FIRST, values))
            versions = np.fromiter(map(_SECOND, values), dtype="<i8", count=len(values))
        with self._lock:
            kept = self._read_orders.get(p.program_id)
            if kept is not None:
                self._read_orders.move_to_end(p.program_id)
        if kept is None or not (kept[0] is keys or kept[0] == keys) or not (kept[1] is stored or kept[1] == stored):
            kept = (keys, stored, {t: i for i, t in enumerate(keys)}, {})
            with self._lock:
                self._read_orders[p.program_id] = kept
                while len(self._read_orders) > _READ_ORDERS_KEPT:
                    self._read_orders.popitem(last=False)
        deltas = None
        at = list(map(kept[2].get, p.delta_bases))
        if at and None not in at:
            pairs = np.array(list(p.delta_bases.values()), dtype="<i8").reshape(-1, 2)
            src, dst = np.full(len(keys), -1, dtype="<i8"), np.full(len(keys), -1, dtype="<i8")
            src[at], dst[at] = pairs[:, 0], pairs[:, 1]
            deltas = (src, dst)
        return kept, versions, deltas, code_versions(versions)

    def _columns(self, made: tuple, names: frozenset[str] | None) -> _ReadColumns:
        """Job ``made``'s reads of the tensors ``names`` (a host's slice's; None: all) as columns, the tensors,
        their names and SHA-256 worked out once per program and slice, the delta bases from `_read_order`."""
        (keys, stored, place, slices), versions, deltas, coded = made[4]
        with self._lock:
            kept = slices.get(names)
        if kept is None:
            if names is None:
                tensors, index = keys, np.arange(len(keys))
            else:  # the slice's tensors a read names (not those its program makes)
                tensors = [t for t in names if t in place]
                index = np.fromiter(map(place.__getitem__, tensors), dtype=np.intp, count=len(tensors))
            names_read = list(map(stored.__getitem__, index.tolist()))
            kept = (tensors, names_read, index, columns_digest(tensors, names_read) if tensors else "")
            with self._lock:
                kept = slices.setdefault(names, kept)
        tensors, names_read, index, digest = kept
        by_codes = coded is not None and len(index) > 0
        return _ReadColumns(tensors, names_read, None if by_codes else versions[index], digest,
                            (deltas[0][index], deltas[1][index]) if deltas is not None else None,
                            (coded[0], coded[1][index]) if by_codes else None)

    def _digest(self, text: str) -> str:
        """`program_digest` of ``text``, a program's text (or a host's slice of one) handed to agents."""
        with self._lock:
            digest = self._digests.get(text)
            if digest is not None:
                self._digests.move_to_end(text)
                return digest
        digest = program_digest(text)
        with self._lock:
            if text not in self._digests:
                self._digests[text] = digest
                self._digests_bytes += len(text)
            while len(self._digests) > 1 and (len(self._digests) > _DIGESTS_KEPT
                                              or self._digests_bytes > _DIGESTS_KEPT_BYTES):
                self._digests_bytes -= len(self._digests.popitem(last=False)[0])
        return digest

    def prepare_request(self, host: str, p: Preparation, held: bool = False,
                        request: pb.PrepareRequest | None = None, columns_held: bool = False) -> pb.PrepareRequest:
        """The Prepare of job ``p`` for ``host``, written into ``request`` (default: a new one): with the program's
        text (or ``host``'s slice of it, `Preparation.text_for`), or (``held``) naming it by its SHA-256 alone; with
        its read columns, or (``columns_held``) naming them by their SHA-256 and versions alone."""
        made = self._made(p)
        part, fields, columns = self._part(made, host)
        text = p.text_for(host)
        digest = self._digest(text)
        request = request if request is not None else pb.PrepareRequest()
        request.CopyFrom(part)
        if held:
            request.program_sha256 = digest
        else:
            request.program_json = text
        if columns is not None and columns.tensors and not columns_held:
            request.read_tensors.extend(columns.tensors)
            if columns.names != columns.tensors:  # none where each tensor reads its own name, a state dict's case
                request.read_names.extend(columns.names)
        request.ticket = self._sign(host, "prepare", fields[0], digest, *fields[2:])
        pushes = made[2]
        request.push_tickets.update({peer: ticket for peer, ticket in pushes.items() if peer != host})
        return request

    def _holds(self, host: str, address: str, p: Preparation) -> bool:
        """Whether the agent of ``host`` at ``address`` holds its text of ``p``'s program (it was sent the text,
        and kept it since)."""
        return self._still_held(self._held, address, self._digest(p.text_for(host)))

    def _still_held(self, table: dict[str, OrderedDict[str, int]], address: str, digest: str) -> bool:
        """Whether ``table`` (`_held`, `_held_columns`) has the agent at ``address`` holding ``digest``, which
        counts as its latest use."""
        with self._lock:
            held = table.get(address)
            if held is None or digest not in held:
                return False
            held.move_to_end(digest)
            return True

    def _sent(self, host: str, address: str, p: Preparation, kept: bool) -> None:
        """The agent of ``host`` at ``address`` read its text of ``p``'s program (``kept``), or said it no longer
        holds it: the agent's own rule (`Runtime._loaded`) mirrored."""
        text = p.text_for(host)
        self._mirror(self._held, address, self._digest(text), len(text), kept, PROGRAMS_KEPT, PROGRAMS_KEPT_BYTES)

    def _columns_sent(self, address: str, columns: _ReadColumns | None, kept: bool) -> None:
        """The agent at ``address`` was sent ``columns`` (`_columns`) and keeps them (``kept``), or said it no
        longer holds them: its own rule (`agent.reads.HeldColumns`) mirrored."""
        if columns is None or not columns.sha256:
            return
        self._mirror(self._held_columns, address, columns.sha256,
                     columns_nbytes(columns.tensors, columns.names) if kept else 0, kept, READ_COLUMNS_KEPT,
                     READ_COLUMNS_KEPT_BYTES)

    def _mirror(self, table: dict[str, OrderedDict[str, int]], address: str, digest: str, nbytes: int, kept: bool,
                most: int, most_bytes: int) -> None:
        """``table`` (`_held`, `_held_columns`) after the agent at ``address`` kept ``digest`` of ``nbytes``, or
        dropped it: an agent keeps at most ``most`` and ``most_bytes`` of them, dropping the least recently used and
        keeping the newest whatever its size."""
        with self._lock:
            held = table.setdefault(address, OrderedDict())
            held.pop(digest, None)
            if kept:
                held[digest] = nbytes
            while len(held) > 1 and (len(held) > most or sum(held.values()) > most_bytes):
                held.popitem(last=False)

    def _by_digest_first(self, host: str, address: str, p: Preparation | None,
                         call: Callable[[bool, bool], object]):
        """``call(held, columns_held)`` naming ``p``'s program and its read columns by their SHA-256 where the agent
        of ``host`` should hold them, and again with both whole if it does not (an agent restarted, or one that
        dropped them)."""
        if p is None:
            return call(False, False)
        columns = self._part(self._made(p), host)[2]
        held = self._holds(host, address, p)
        columns_held = columns is not None and bool(columns.sha256) and self._still_held(self._held_columns, address,
                                                                                         columns.sha256)
        if held or columns_held:
            try:
                result = call(held, columns_held)
            except NotFoundError as e:
                if not str(e).startswith((PROGRAM_NOT_HELD, READS_NOT_HELD)):
                    raise
                self._sent(host, address, p, kept=False)
                self._columns_sent(address, columns, kept=False)
            else:
                if not held:
                    self._sent(host, address, p, kept=True)
                if not columns_held:
                    self._columns_sent(address, columns, kept=True)
                return result
        result = call(False, False)
        self._sent(host, address, p, kept=True)
        self._columns_sent(address, columns, kept=True)
        return result

    def _call(self, host: str, address: str, method: str, request, timeout: float):
        try:
            return getattr(self._stub(address), method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise domain_error(e, f"agent of host {host} at {address}") from None

    def prepare(self, host, address, prep, timeout):
        self._by_digest_first(host, address, prep, lambda held, columns_held: self._call(
            host, address, "Prepare", self.prepare_request(host, prep, held, columns_held=columns_held), timeout))

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
        return self._by_digest_first(host, address, prepare, lambda held, columns_held: self._execute(
            host, address, job, program_id, on_progress, timeout, prepare, commit, held, columns_held))

    def _execute(self, host, address, job, program_id, on_progress, timeout, prepare, commit, held, columns_held):
        request = pb.ExecuteRequest(job=job, program_id=program_id,
                                    ticket=self._sign(host, "execute", *execute_fields(job, program_id, commit)),
                                    commit=commit)
        if prepare is not None:
            self.prepare_request(host, prepare, held, request.prepare, columns_held)
        traffic = None
        try:
            for msg in self._stub(address).Execute(request, timeout=timeout):
                if msg.loading:
                    on_progress(loading=True)
                else:
                    on_progress(msg.bytes_done, msg.bytes_total, msg.steps_done, msg.steps_total, msg.started_after_s)
                if msg.HasField("traffic"):
                    traffic = _traffic(msg.traffic)
        except grpc.RpcError as e:
            raise domain_error(e, f"agent of host {host} at {address}") from None
        return traffic

    def commit(self, host, address, staging, tensor, version, devices, timeout, more=()):
        ticket = self._sign(host, "commit", *commit_fields(staging.upload, staging.job, tensor, version, devices,
                                                           more))
        self._call(host, address, "Commit", _staging(
            staging, tensor=tensor, version=version, devices=devices, ticket=ticket,
            more=[pb.UploadCommit(upload_id=u, tensor=t, version=v, devices=d) for u, t, v, d in more]), timeout)

    def abort(self, host, address, staging, timeout, more=()):
        ticket = self._sign(host, "abort", *abort_fields(staging.upload, staging.job, more))
        self._call(host, address, "Abort",
                   _staging(staging, ticket=ticket, more=[pb.UploadCommit(upload_id=u) for u in more]), timeout)

    def release(self, host, address, versions, timeout):
        if not versions:
            return
        (tensor, version), more = versions[0], versions[1:]
        self._call(host, address, "Release", pb.ReleaseRequest(
            tensor=tensor, version=version, more=[pb.TensorRead(name=n, version=v) for n, v in more],
            ticket=self._sign(host, "release", *release_fields(versions))), timeout)

    def forget(self, address: str) -> None:
        """Close the channel to ``address`` and forget the programs sent there: an agent restarted on another
        port (``--listen 127.0.0.1:0``) leaves its old address behind, which no call reaches again."""
        with self._lock:
            ch = self._channels.pop(address, None)
            self._stubs.pop(address, None)
            self._held.pop(address, None)
            self._held_columns.pop(address, None)
        if ch is not None:
            ch.close()

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            self._stubs.clear()


def _staging(staging: Staging, **fields) -> pb.StagingRequest:
    return pb.StagingRequest(upload_id=staging.upload, job_id=staging.job, **fields)


def _step(request) -> int | None:
    """A request's optional version label (``step``), None when unset."""
    return request.step if request.HasField("step") else None


def _locations(items: list[TileLocation]) -> list[pb.TileLocation]:
    return [pb.TileLocation(device=t.device, address=t.address, box=box_to_pb(t.box), ticket=t.ticket, lost=t.lost)
            for t in items]


def job_info(job: Job, brief: bool = False) -> pb.JobInfo:
    """``job`` as the wire has it; ``brief``, without the fields that grow with it (`JobRequest.brief`), which a
    whole reply carries as columns (`job_columns`)."""
    columns = None if brief else job_columns(job)
    job = replace(job, inputs=[], versions={}, deltas={}, transports=[])
    return pb.JobInfo(columns=columns,
        id=job.id, tensor=job.tensor, state=job.state, error=job.error,
        plan_id=job.ran.id if job.ran is not None else "", strategy=job.strategy,  # the program, where no plan ran
        progress=[pb.AgentProgress(host=h, bytes_done=d, bytes_total=t) for h, (d, t) in sorted(job.progress.items())],
        traffic=[pb.HostTraffic(host=h, bytes_in=t["bytes_in"], bytes_out=t["bytes_out"], local_bytes=t["local_bytes"],
                                native_reduces=t.get("native_reduces", 0),  # a record from before the count
                                delta_wire_bytes=t.get("delta_wire_bytes", {}),
                                delta_full_bytes=t.get("delta_full_bytes", {}))
                 for h, t in sorted(job.traffic.items())],
        seconds=job.seconds, version=job.version, transport=job.transport, transports=job.transports,
        transport_reason=job.transport_reason,
        kind=job.kind, inputs=job.inputs, versions=job.versions,
        phases=[pb.JobPhase(name=n, seconds=s) for n, s in dict(job.phases).items()],
        host_seconds=dict(job.host_seconds), manifest_digest=job.manifest_digest,
        deltas=[pb.TensorDelta(name=n, mode=d["mode"], why=d["why"], bytes=d["bytes"], full_bytes=d["full_bytes"])
                for n, d in job.deltas.items()],
        network_bytes=job.network_bytes, full_network_bytes=job.full_network_bytes, delta_note=job.delta_note,
        started_s=job.started_s, handed_s=job.handed_s)


def job_columns(job: Job) -> pb.JobColumns:
    """``job``'s inputs, versions, deltas and transports as `JobColumns`: names with a delta entry first (in the
    report's order, so that its columns line up without a look-up per tensor), then what it commits, then its
    other inputs. A running job's runner adds to them meanwhile (its transports, its delta report): each is read
    once, as it is now, and the reply built from those copies."""
    deltas, versions, transports = dict(job.deltas), dict(job.versions), list(job.transports)
    names = list(deltas)
    names += [n for n in versions if n not in deltas]
    listed = set(names)
    names += [n for n in dict.fromkeys(job.inputs) if n not in listed]
    text = "\n".join(names)
    if text.count("\n") != max(len(names) - 1, 0):  # printable names (`catalog.check_name`): never here
        raise ValueError(f"job {job.id[:8]} names a tensor with a newline in its name")
    modes, whys = list(map(itemgetter("mode"), deltas.values())), list(map(itemgetter("why"), deltas.values()))
    texts = {t: i for i, t in enumerate(dict.fromkeys(modes) | dict.fromkeys(whys) | dict.fromkeys(transports))}
    return pb.JobColumns(
        names=text, versions=list(map(versions.get, names, repeat(0))), texts=list(texts),
        delta_modes=list(map(texts.__getitem__, modes)), delta_whys=list(map(texts.__getitem__, whys)),
        delta_bytes=list(map(itemgetter("bytes"), deltas.values())),
        delta_full_bytes=list(map(itemgetter("full_bytes"), deltas.values())),
        transports=list(map(texts.__getitem__, transports)))


def group_info(view: GroupView) -> pb.GroupInfo:
    return pb.GroupInfo(store_port=view.store_port, generation=view.generation, members=view.members,
                        backend=view.backend)


class PlannerServicer(pb_grpc.PlannerServicer):
    def __init__(self, planner: Planner):
        self.planner = planner

    @servicer_method
    def Register(self, request, context):
        self.planner.register(request.host, request.num_devices, request.address, request.nic_gbps,
                              request.transport, request.backend, request.device, request.gpu_uuid,
                              request.transport_reason, request.secret, request.memory_limit_bytes,
                              [(h.tensor, h.version) for h in request.held], request.device_gflops,
                              request.memory_gb_per_s, request.nixl_metadata)
        return pb.RegisterReply(heartbeat_interval_s=self._next_beat(), group=group_info(self.planner.group.view()))

    @servicer_method
    def Heartbeat(self, request, context):
        known = self.planner.heartbeat(request.host, request.address, request.joined_generation,
                                       request.broken_generation, list(request.uploading), request.proof,
                                       request.memory_used_bytes)
        return pb.HeartbeatReply(known=known, group=group_info(self.planner.group.view()),
                                 heartbeat_interval_s=self._next_beat())

    def _next_beat(self) -> float:
        return self.planner.group.next_beat(self.planner.config.heartbeat_interval_s)

    @servicer_method
    def ListAgents(self, request, context):
        reg = self.planner.registry
        return pb.AgentList(agents=[
            pb.AgentInfo(host=r.host, address=r.address, num_devices=r.num_devices, up=reg.is_up(r),
                         heartbeat_age_s=reg.age(r), transport=self.planner.group.mode(r.host),
                         in_group=self.planner.group.in_group(r.host), device=r.device, gpu_uuid=r.gpu_uuid,
                         transport_reason=self.planner.group.reason(r.host), memory_limit_bytes=r.memory_limit_bytes,
                         memory_used_bytes=r.memory_used_bytes, device_gflops=r.device_gflops,
                         memory_gb_per_s=r.memory_gb_per_s) for r in reg.agents()])

    @servicer_method
    def BeginUpload(self, request, context):
        upload, locations = self.planner.begin_upload(
            request.name, tuple(request.shape), request.dtype, request.sharding_json, request.kind,
            request.device, tuple(request.shard_shape), _step(request))
        return pb.BeginUploadReply(upload_id=upload.id, version=upload.record.version, locations=_locations(locations))

    @servicer_method
    def FinishUpload(self, request, context):
        complete, missing = self.planner.finish_upload(request.upload_id, list(request.devices))
        return pb.FinishUploadReply(complete=complete, num_missing=missing)

    def _tensor_info(self, rec, locations=(), pins: int = 0, delta_base: bool = False) -> pb.TensorInfo:
        return pb.TensorInfo(name=rec.name, shape=rec.shape, dtype=rec.dtype, version=rec.version, kind=rec.kind,
                             sharding_json=json.dumps(rec.sharding.to_json(), sort_keys=True), locations=_locations(locations),
                             lost=bool(rec.lost_tiles()), step=rec.step, pins=pins, delta_base=delta_base)

    @servicer_method
    def GetTensor(self, request, context):
        rec, locations = self.planner.tensor(request.name, request.pin, _step(request))
        return self._tensor_info(rec, locations)

    @servicer_method
    def Versions(self, request, context):
        return pb.TensorList(tensors=[self._tensor_info(rec, pins=n, delta_base=base)
                                      for rec, n, base in self.planner.versions(request.name)])

    @servicer_method
    def Pin(self, request, context):
        if request.every and request.names:
            raise InvalidArgumentError("a pin names its tensors or sets every (all of the catalog's), not both")
        pin = self.planner.pin(None if request.every else list(request.names), _step(request))
        return pb.PinInfo(id=pin.id, versions=pin.versions, step=pin.step)

    @servicer_method
    def ReleasePin(self, request, context):
        self.planner.release_pin(request.id)
        return pb.Empty()

    @servicer_method
    def ListTensors(self, request, context):
        return pb.TensorList(tensors=[self._tensor_info(r) for r in self.planner.tensors()])

    @servicer_method
    def DeleteTensor(self, request, context):
        self.planner.delete(request.name)
        return pb.Empty()

    @servicer_method
    def DeleteTensors(self, request, context):
        self.planner.delete_many(list(request.names))
        return pb.Empty()

    @servicer_method
    def Plan(self, request, context):
        _, text = self.planner.dry_plan_json(request.name, tuple(request.shape), request.dtype, request.src_json,
                                             request.dst_json, request.strategy)
        return pb.PlanReply(plan_json=text)

    @servicer_method
    def Reshard(self, request, context):
        return job_info(self.planner.reshard(request.name, request.dst_json, request.strategy))

    @servicer_method
    def ReshardMany(self, request, context):
        # brief, as Sync's: the caller named the tensors, and the job has just been queued (GetJob has it whole).
        # Whole, the reply of a 501-tensor state dict took 1.2 ms of the planner while the job it queued was planned.
        return job_info(self.planner.reshard_many(
            [(t.name, t.dst_json) for t in request.targets], request.strategy,
            request.bucket_bytes if request.HasField("bucket_bytes") else None,
            [(p.weight, p.scale, tuple(p.block) or None) for p in request.scales],
            manifest_json=request.manifest_json, pin=request.pin, step=_step(request),
            delta=request.delta if request.HasField("delta") else None, dtypes=dict(request.dtypes)), brief=True)

    @servicer_method
    def RegisterSync(self, request, context):
        if request.HasField("step") or request.pin or request.HasField("delta"):
            raise InvalidArgumentError("RegisterSync keeps what every run of the sync moves; give the step, pin and "
                                       "delta to each Sync")
        sync = self.planner.register_sync(
            [(t.name, t.dst_json) for t in request.targets], request.strategy,
            request.bucket_bytes if request.HasField("bucket_bytes") else None,
            [(p.weight, p.scale, tuple(p.block) or None) for p in request.scales],
            manifest_json=request.manifest_json, dtypes=dict(request.dtypes))
        return pb.SyncInfo(sync_id=sync.id, num_tensors=len(sync.names))

    @servicer_method
    def Sync(self, request, context):
        # brief: the caller knows the sync's tensors, and a state dict's job names 139,583 (GetJob has them)
        return job_info(self.planner.sync(request.sync_id, pin=request.pin, step=_step(request),
                                          delta=request.delta if request.HasField("delta") else None), brief=True)

    @servicer_method
    def BeginUploads(self, request, context):
        if any(t.device or t.shard_shape for t in request.tensors):
            raise InvalidArgumentError("BeginUploads opens uploads of whole tensors; a device and a shard shape "
                                       "belong to BeginUpload (put_shard)")
        group, opened = self.planner.begin_uploads(
            [(t.name, tuple(t.shape), t.dtype, t.sharding_json, t.kind) for t in request.tensors], _step(request),
            request.group_key, list(request.devices))
        return pb.BeginUploadsReply(group_id=group, uploads=[
            pb.BeginUploadReply(upload_id=up.id, version=up.record.version, locations=_locations(locations))
            for up, locations in opened])

    @servicer_method
    def FinishUploads(self, request, context):
        complete, missing = self.planner.finish_uploads(
            request.group_id, [(d.upload_id, list(d.devices)) for d in request.done], request.wait_s)
        return pb.FinishUploadReply(complete=complete, num_missing=missing)

    @servicer_method
    def GetTensors(self, request, context):
        return pb.TensorList(tensors=[self._tensor_info(rec, locations) for rec, locations in
                                      self.planner.tensors_at_once(list(request.names), request.pin, _step(request))])

    @servicer_method
    def GetJob(self, request, context):
        job = self.planner.job(request.job, request.wait_s)
        return job_info(job, brief=request.brief and job.state in ("queued", "running"))

    @staticmethod
    def _compute_args(r: pb.ComputeRequest) -> tuple:
        return r.op, list(r.inputs), r.out, r.out_sharding_json, r.strategy, dict(r.params)

    @servicer_method
    def Compute(self, request, context):
        return job_info(self.planner.compute(*self._compute_args(request)))

    @servicer_method
    def PlanCompute(self, request, context):
        program, text = self.planner.plan_compute(*self._compute_args(request))
        return pb.ProgramReply(program_json=text, summary=program.summary(), estimate_s=program.estimate_seconds,
                               layout=program.einsum_layout_text)


    @staticmethod
    def _ops(r: pb.ComputeManyRequest) -> list:
        return [(op.op, list(op.inputs), op.out, op.out_sharding_json, dict(op.params)) for op in r.ops]

    @servicer_method
    def ComputeMany(self, request, context):
        return job_info(self.planner.compute_many(self._ops(request), request.strategy))

    @servicer_method
    def PlanComputeMany(self, request, context):
        program, text = self.planner.plan_compute_many(self._ops(request), request.strategy)
        return pb.ProgramReply(program_json=text, summary=program.summary(), estimate_s=program.estimate_seconds)


def serve_planner(config: PlannerConfig) -> tuple[grpc.Server, int, Planner]:
    """Build and start the planner's gRPC server; returns (server, bound port, planner)."""
    made: list[Planner] = []  # the calls sign with secrets the planner's registry holds
    agents = GrpcAgentCalls(lambda host: made[0].registry.secret(host), config.token, config.tls)
    rendezvous = None
    if config.rendezvous and torch_installed():  # bound now; started once the server is (see Rendezvous)
        rendezvous = Rendezvous(config.listen.rsplit(":", 1)[0], config.group_wait_s)
    planner = Planner(config, agents, rendezvous.port if rendezvous else 0)
    made.append(planner)
    planner.rendezvous = rendezvous  # the store lives as long as the planner
    if rendezvous is not None:
        planner.jobs.collective_cleanup = rendezvous.forget_job
    warn_if_open("the planner", config.listen, config.token)
    sizes = [("grpc.max_receive_message_length", config.max_message_bytes),
             ("grpc.max_send_message_length", config.max_message_bytes)]
    server = grpc.server(futures.ThreadPoolExecutor(config.max_workers, thread_name_prefix="planner"),
                         options=SERVER_OPTIONS + sizes,
                         interceptors=[Authenticator(config.token, "the planner"), RequestDecoding()])
    pb_grpc.add_PlannerServicer_to_server(PlannerServicer(planner), server)
    port = start_server(server, config.listen, "reshard.v1.Planner",
                        config.tls.server_credentials() if config.tls else None)
    if rendezvous is not None:
        rendezvous.start_in_background(planner.group.store_failed)
    return server, port, planner
