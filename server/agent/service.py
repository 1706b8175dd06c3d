"""The agent service: a host's shards over gRPC, pushes between agents, and registration.

``serve_agent(config)`` builds the server and returns it with its bound port;
``Agent`` adds the registration and heartbeat loop that keeps the planner
informed. The servicer only converts messages; the `Runtime`
(``reshard.server.agent.runtime``), its transports and the `ShardStore` do the work.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack

import grpc

from reshard import box as boxes
from reshard.dtypes import dtype_name, itemsize
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError
from reshard.proto.frames import RawPiece, decode_push_chunk
from reshard.proto.status import SERVER_OPTIONS, RequestDecoding, domain_error, servicer_method, start_server
from reshard.proto.wire import box_from_pb, box_to_pb, read_shard_stream, shard_streams, unbatched
from reshard.server.common.config import AgentConfig
from reshard.server.agent.run import Run
from reshard.server.agent.runtime import Runtime
from reshard.server.transport.base import Transport
from reshard.server.transport.faults import wrap
from reshard.server.transport.streams import IpcRegion, Piece, PushHeader, Throttle, Trailer
from reshard.server.transport.grpc_link import GrpcTransport, LocalDevice, channel_options
from reshard.server.common.auth import Authenticator, warn_if_open
from reshard.server.common.contract import GroupView
from reshard.server.agent.reads import CarriedReads, HeldColumns
from reshard.server.common.tickets import (TicketCheck, abort_fields, commit_fields, execute_fields, new_secret,
                                           prepare_fields, program_digest, put_fields, release_fields, sign)
from reshard.proto.auth import channel
from reshard.server.agent.memory import default_memory_limit, keep_freed_memory
from reshard.server.agent.probe import DeviceRates, probe
from reshard.server.agent.pace import DevicePace
from reshard.server.agent.threads import Spares, limit_compute_threads
from reshard.server.agent.trace import TaskTrace
from reshard.server.agent.ucx import ucx_environment
from reshard.server.agent.store import ShardStore
from reshard.server.agent.ipc import CudaHandover, ShmHandover
from reshard.proto.devices import CudaIpcHandle, machine_id, visible_gpus
from reshard.server.transport import buffers

__all__ = ["Agent", "NixlPeers", "serve_agent", "HEARTBEAT_DEADLINE_S"]

log = logging.getLogger(__name__)

_PROGRESS_INTERVAL_S = 0.2
# An Execute's Prepare whose program text (carried, or held under its SHA-256) is no longer than this, and that carries
# no read columns, runs on the handler's own thread: it takes a small share of a progress interval, where a thread to
# load it and the hand-offs to and from that thread cost each host of a small job a few tenths of a millisecond.
QUICK_PREPARE_BYTES = 64 << 10
# How long a heartbeat call waits for the planner. A planner starved of CPU (a loaded machine) answers late, and a
# beat it reads late still counts; one whose call gave up after a second was lost, and the next went a whole interval
# later, so a planner slow for 3 s went 5 s, its default --heartbeat-timeout, without a beat from an agent that was
# alive. Well under that timeout, so that a beat that does time out leaves time for one more.
HEARTBEAT_DEADLINE_S = 3.0


def _push_stream(request_iterator) -> tuple[pb.PushHeader, Iterator]:
    """A Push's header and the messages after it; a whole push (``PushChunk.whole``, the stream's only message)
    reads as the header, `Piece` items and `Trailer` it holds."""
    it = iter(request_iterator)
    first = next(it, None)
    kind = None if first is None or isinstance(first, RawPiece) else first.WhichOneof("kind")
    if kind == "whole":
        return first.whole.header, _whole_items(first.whole)
    if kind != "header":
        raise InvalidArgumentError("a Push stream must open with a header")
    return first.header, it


def _whole_items(whole: pb.PushWhole) -> Iterator:
    for p in whole.pieces:
        yield Piece(box_from_pb(p.box), p.data)
    if whole.HasField("trailer"):  # else the stream ends without one, which the receiving hop refuses
        yield _trailer(whole.trailer)


def _trailer(t: pb.Trailer) -> Trailer:
    return Trailer(t.nbytes, t.xxh3_64, t.device_digest)


class NixlPeers:
    """The remote NIXL agents this agent's NIXL transport knows: only the hosts a Prepare from the planner named,
    with the metadata the planner gave for them (UCX authenticates no one: docs/security.md)."""

    def __init__(self, host: str, transport: Transport | None):
        self.host = host
        self.transport = transport
        self._lock = threading.Lock()
        self._known: set[str] = set()

    def introduce(self, job: str, peers: dict[str, bytes]) -> None:
        """Add the peers of ``job``'s Prepare before it runs; new metadata for a known host replaces the old
        (its agent restarted), the same again changes nothing (`NixlTransport.add_peer`)."""
        if self.transport is None:
            raise FailedPreconditionError(
                f"job {job[:12]!r} runs on the nixl transport, but the agent of host {self.host} has none; start it "
                f"with --transport nixl")
        for host, metadata in sorted(peers.items()):
            if host == self.host:
                continue  # a NIXL agent writes to itself through no peer
            if not metadata:
                raise InvalidArgumentError(f"the Prepare of job {job[:12]!r} names host {host!r} as a nixl peer "
                                           f"without its NIXL metadata")
            with self._lock:
                self.transport.add_peer(host, metadata)
                self._known.add(host)

    def forget_all(self, why: str) -> None:
        """Drop every peer (this agent registers again: the planner introduces the peers of its next jobs anew,
        and a host it no longer lists stays dropped)."""
        with self._lock:
            known, self._known = sorted(self._known), set()
            for host in known:
                self.transport.drop_peer(host)
        if known:
            log.info("host %s dropped its nixl peers %s: %s", self.host, known, why)


class AgentServicer(pb_grpc.AgentServicer):
    def __init__(self, config: AgentConfig, store: ShardStore, runtime: Runtime, tickets: TicketCheck):
        self.config = config
        self.store = store
        self.runtime = runtime
        self.tickets = tickets  # calls that change what this agent holds carry the planner's ticket
        self._loaders = Spares(f"load-{config.host}")  # threads that load an Execute's prepare (`_loading`)
        self.nixl_peers = NixlPeers(config.host, runtime.transports.get("nixl"))
        self.devices = {f"{config.host}/{i}" for i in range(config.num_devices)}
        self.handover = CudaHandover(config.host, store)
        self.shm = ShmHandover(config.host, store)
        self.read_columns = HeldColumns(config.host)

    def _check_device(self, device: str) -> None:
        if device not in self.devices:
            raise InvalidArgumentError(
                f"device {device!r} is not on host {self.config.host}; its devices are {sorted(self.devices)}"
            )

    def _check_put(self, h: pb.ShardHeader, what: str) -> None:
        self._check_device(h.device)
        self.tickets.check(h.ticket, "put", *put_fields(h.upload_id, h.tensor, h.device, h.dtype, box_from_pb(h.box)),
                           what=f"{what} of {h.tensor!r} for device {h.device} (upload {h.upload_id[:12]!r})")

    def _room(self, h: pb.ShardHeader, what: str):
        """Reserve the shard's bytes before anything is allocated for it (see `ShardStore.reserve`)."""
        nbytes = boxes.volume(box_from_pb(h.box)) * itemsize(h.dtype)
        return self.store.reserving(h.upload_id, h.device, nbytes, f"{what} of {h.tensor!r} for device {h.device}")

    @servicer_method
    def PutShard(self, request_iterator, context):
        """One shard, or several in a row (put_many sends an agent its small shards in one stream): each is checked
        and staged as it completes, so a failure leaves the shards before it staged and their uploads to the
        planner, which drops them with the transaction."""
        chunks, nbytes, shards = unbatched(request_iterator), 0, 0
        while True:
            with ExitStack() as receiving:
                def check(h: pb.ShardHeader) -> None:
                    self._check_put(h, "PutShard")
                    receiving.enter_context(self._room(h, "PutShard"))
                    receiving.enter_context(self.store.receiving(h.upload_id))  # heartbeats keep the upload alive

                got = read_shard_stream(chunks, check, or_end=shards > 0, with_digest=True)
                if got is None:
                    return pb.PutShardReply(nbytes=nbytes)
                header, shard, digest = got
                # On a GPU agent the bytes go on to the GPU through pinned staging buffers.
                self.store.stage(header.upload_id, header.device,
                                 self.store.adopt(shard, box_from_pb(header.box), dtype_name(header.dtype), digest))
            nbytes, shards = nbytes + shard.nbytes, shards + 1

    @servicer_method
    def GetShard(self, request, context):
        """The shard asked for, then those of ``more`` in order; every one is found before any byte goes out, so a
        missing shard fails the call at once, naming it."""
        asked = [request, *request.more]
        shards = [self.store.get(r.tensor, r.version, r.device) for r in asked]
        headers = (pb.ShardHeader(tensor=r.tensor, version=r.version, device=r.device, dtype=shard.dtype,
                                  box=box_to_pb(shard.tile)) for r, shard in zip(asked, shards))
        tiles = (buffers.host_array(shard.array) for shard in shards)  # pinned for CUDA
        yield from shard_streams(zip(headers, tiles), self.config.chunk_bytes)

    @servicer_method
    def Digest(self, request, context):
        out = {}
        for d in request.devices:
            shard = self.store.get(request.tensor, request.version, d)
            out[d] = hashlib.blake2b(buffers.host_bytes(shard.array)).hexdigest()
        return pb.DigestReply(blake2b=out)

    @servicer_method
    def DescribeDevice(self, request, context):
        d = self.handover.describe()
        return pb.AgentDevice(host=d.host, device=d.device, gpu_uuid=d.gpu_uuid, machine_id=d.machine_id, pid=d.pid,
                              visible_gpu_uuids=visible_gpus() if d.device != "cpu" else ())

    @servicer_method
    def PutShardIpc(self, request, context):
        h = request.header
        self._check_put(h, "PutShardIpc")
        with self._room(h, "PutShardIpc"):
            nbytes, digest = self.handover.put(h.upload_id, h.device, box_from_pb(h.box), dtype_name(h.dtype),
                                               CudaIpcHandle.from_message(request.source), request.digest)
        return pb.IpcShardReply(nbytes=nbytes, digest=digest)

    @servicer_method
    def GetShardIpc(self, request, context):
        r = request.shard
        shard = self.store.get(r.tensor, r.version, r.device)
        nbytes, digest = self.handover.get(shard, CudaIpcHandle.from_message(request.destination))
        return pb.IpcShardReply(nbytes=nbytes, digest=digest)

    @servicer_method
    def PutShardShm(self, request, context):
        h = request.header
        self._check_put(h, "PutShardShm")
        with self._room(h, "PutShardShm"):
            nbytes, digest = self.shm.put(h.upload_id, h.device, box_from_pb(h.box), dtype_name(h.dtype),
                                          request.region, request.digest, request.device_digest)
        return pb.IpcShardReply(nbytes=nbytes, digest=digest)

    @servicer_method
    def GetShardShm(self, request, context):
        r = request.shard
        shard = self.store.get(r.tensor, r.version, r.device)
        nbytes, digest = self.shm.get(shard, request.region, request.device_digest)
        return pb.IpcShardReply(nbytes=nbytes, digest=digest)

    @servicer_method
    def Push(self, request_iterator, context):
        h, it = _push_stream(request_iterator)
        self.tickets.check(h.ticket, "push", h.job, h.plan_id, what=f"Push of job {h.job[:12]!r} from {h.from_host!r}")
        header = PushHeader(h.job, h.plan_id, h.transfer, h.hop, h.from_host)

        def items() -> Iterator:
            for msg in it:
                if isinstance(msg, (Piece, Trailer)):  # of a whole push
                    yield msg
                    continue
                if isinstance(msg, RawPiece):
                    yield Piece(msg.box, msg.data, msg.frame)
                    continue
                kind = msg.WhichOneof("kind")
                if kind == "ipc_piece":
                    piece = msg.ipc_piece
                    yield Piece(box_from_pb(piece.box), IpcRegion(CudaIpcHandle.from_message(piece.source)))
                    continue
                if kind != "trailer":
                    raise InvalidArgumentError("a Push stream carries one header, then pieces, then one trailer")
                yield _trailer(msg.trailer)

        return pb.PushReply(confirmed=self.runtime.accept(header, items()) or ())

    @servicer_method
    def Prepare(self, request, context):
        self._prepare(request)
        return pb.Empty()

    def _prepare(self, r: pb.PrepareRequest) -> Run:
        carried = CarriedReads.of(r)
        delta_bases = {t: (b.src_version, b.dst_version) for t, b in r.delta_bases.items()}
        # The program comes as its text, or by the SHA-256 of a text this agent read before (`Runtime._loaded`).
        sha256 = program_digest(r.program_json) if r.program_json else r.program_sha256
        if not sha256 or (r.program_json and r.program_sha256 and r.program_sha256 != sha256):
            raise InvalidArgumentError(f"Prepare of job {r.job[:12]!r} must carry a program's text or the SHA-256 of "
                                       f"one this agent holds, and not two that differ")
        self.tickets.check(r.ticket, "prepare", *prepare_fields(r.job, sha256, r.tensor, r.src_version,
                                                                r.dst_version, r.transport, r.generation, r.job_seq,
                                                                r.peers, None, dict(r.nixl_peers), delta_bases,
                                                                signed_reads=carried.signed, reads_at=carried.at,
                                                                signed_deltas=carried.signed_deltas),
                          what=f"Prepare of job {r.job[:12]!r}")
        reads, deltas = carried.resolve(self.read_columns, r)
        delta_bases.update(deltas)
        if r.transport == "nixl":
            self.nixl_peers.introduce(r.job, dict(r.nixl_peers))
        return self.runtime.prepare(r.job, r.program_json, r.tensor, r.src_version, r.dst_version, dict(r.peers),
                                    r.transport, r.generation, r.job_seq, dict(r.push_tickets), reads,
                                    program_sha256=sha256, delta_bases=delta_bases, reads_at=carried.at)

    def _traffic(self, job: str) -> pb.HostTraffic:
        t = self.runtime.traffic(job)
        return pb.HostTraffic(host=self.config.host, bytes_in=dict(t.bytes_in), bytes_out=dict(t.bytes_out),
                              local_bytes=t.local_bytes, native_reduces=t.native_reduces,
                              delta_wire_bytes=dict(t.delta_wire), delta_full_bytes=dict(t.delta_full))

    @staticmethod
    def _progress(run: Run, **fields) -> pb.Progress:
        sent, total, steps_done, steps = run.progress()
        return pb.Progress(bytes_done=sent, bytes_total=total, steps_done=steps_done, steps_total=steps, **fields)

    def _quick(self, r: pb.PrepareRequest) -> bool:
        """Whether Prepare ``r`` is small enough to run without reporting ``loading`` (`QUICK_PREPARE_BYTES`)."""
        if r.read_tensors or r.read_columns_sha256:
            return False
        size = len(r.program_json) if r.program_json else self.runtime.program_bytes(r.program_sha256)
        return size is not None and size <= QUICK_PREPARE_BYTES

    def _loading(self, request, context):
        """Prepare the job an Execute carries, reporting ``loading`` on the stream every progress interval until it
        is done: the planner takes those reports as proof of life (`JobRunner._watch`). Loading a state dict's
        program takes seconds of this host's cores, and on cores that 8 agents share its heartbeat calls missed
        their 1 s deadline for 5 s at a time; a report is a message on a stream already open, written by the
        handler's own thread, with no deadline."""
        loaded = threading.Event()
        failed: list[BaseException] = []

        def load() -> None:
            try:
                self._prepare(request.prepare)
            except BaseException as e:  # noqa: BLE001 - raised again in the handler, as its own
                failed.append(e)
            finally:
                loaded.set()

        self._loaders.start(load)
        try:
            while not loaded.wait(_PROGRESS_INTERVAL_S):
                if context.is_active():
                    yield pb.Progress(loading=True)
        except GeneratorExit:  # the call ended (the planner cancelled it): what the load stages is aborted after it
            threading.Thread(target=lambda: loaded.wait() and self.runtime.abort(request.job), daemon=True,
                             name=f"unload-{request.job[:8]}").start()
            raise
        if failed:
            raise failed[0]

    @servicer_method
    def Execute(self, request, context):
        received = time.monotonic()
        self.tickets.check(request.ticket, "execute", *execute_fields(request.job, request.program_id,
                                                                        request.commit),
                           what=f"Execute of job {request.job[:12]!r}")
        if request.HasField("prepare"):
            if request.prepare.job != request.job:
                raise InvalidArgumentError(f"execute of job {request.job} carries the prepare of job "
                                           f"{request.prepare.job}")
            if self._quick(request.prepare):
                self._prepare(request.prepare)
            else:
                yield from self._loading(request, context)
        run = self.runtime.execute(request.job, request.program_id, commit=request.commit)
        # The run started: the planner counts a job's hosts started (`Job.started_s`, `Job.handed_s`)
        yield self._progress(run, started_after_s=time.monotonic() - received)
        while not run.wait(_PROGRESS_INTERVAL_S, self.runtime.step_timeout_s):
            if not context.is_active():
                self.runtime.abort(request.job)
                return
            yield self._progress(run)
        run.check()
        if request.commit:
            self.runtime.commit(request.job)
        yield self._progress(run, done=True, traffic=self._traffic(request.job))

    @servicer_method
    def Commit(self, request, context):
        more = [(m.upload_id, m.tensor, m.version, list(m.devices)) for m in request.more]
        self.tickets.check(request.ticket, "commit", *commit_fields(request.upload_id, request.job_id, request.tensor,
                                                                    request.version, request.devices, more),
                           what=f"Commit of {request.tensor!r} v{request.version}"
                                + (f" and {len(more)} more" if more else ""))
        if more and not request.upload_id:
            raise InvalidArgumentError(f"Commit of job {request.job_id[:12]!r} names {len(more)} further uploads; "
                                       f"only a Commit of uploads may")
        if request.upload_id:
            # In order; a failure stops there, and the planner releases what the call may have committed.
            for upload, tensor, version, devices in [(request.upload_id, request.tensor, request.version,
                                                      list(request.devices)), *more]:
                self.store.commit(upload, tensor, version, devices)
        else:
            self.runtime.commit(request.job_id)
        return pb.Empty()

    @servicer_method
    def Abort(self, request, context):
        more = [m.upload_id for m in request.more]
        self.tickets.check(request.ticket, "abort", *abort_fields(request.upload_id, request.job_id, more),
                           what=f"Abort of {request.upload_id[:12] or request.job_id[:12]!r}"
                                + (f" and {len(more)} more" if more else ""))
        if more and not request.upload_id:
            raise InvalidArgumentError(f"Abort of job {request.job_id[:12]!r} names {len(more)} further uploads; "
                                       f"only an Abort of uploads may")
        if request.upload_id:
            for upload in [request.upload_id, *more]:
                self.store.abort(upload)
        else:
            self.runtime.abort(request.job_id)
        return pb.Empty()

    @servicer_method
    def Release(self, request, context):
        versions = [(request.tensor, request.version), *((r.name, r.version) for r in request.more)]
        self.tickets.check(request.ticket, "release", *release_fields(versions),
                           what=f"Release of {request.tensor!r} v{request.version}"
                                + (f" and {len(request.more)} more" if request.more else ""))
        self.store.release_many(versions)
        return pb.Empty()

    @servicer_method
    def JobStats(self, request, context):
        return self._traffic(request.job)


class _PushDecoding:
    """Stands in for the server while the generated code registers the Agent service, so that
    Push requests are decoded by `decode_push_chunk` (pieces without copying their bytes)."""

    def __init__(self, server: grpc.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers arrive in add_registered_method_handlers, which registers both

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        handlers = dict(handlers, Push=handlers["Push"]._replace(request_deserializer=decode_push_chunk))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)


def _add_agent_servicer(servicer: "AgentServicer", server: grpc.Server) -> None:
    pb_grpc.add_AgentServicer_to_server(servicer, _PushDecoding(server))


def serve_agent(config: AgentConfig, secret: bytes | None = None) -> tuple[grpc.Server, int, Runtime]:
    """Build and start an agent's gRPC server; returns (server, bound port, runtime).

    ``secret`` is the registration secret the planner signs this agent's tickets with (a fresh one by
    default). Fails at once, naming the host's CUDA devices, when ``config.device`` is not here, and naming the
    install when ``--transport nixl`` finds no NIXL.
    """
    return _serve(config, secret)[:3]


def _serve(config: AgentConfig, secret: bytes | None) -> tuple[grpc.Server, int, Runtime, "AgentServicer"]:
    device = buffers.check_device(config.device)
    store = ShardStore(device, config.memory_limit_bytes or default_memory_limit(device), config.host)
    throttle = Throttle(config.rate_limit_bytes_per_s)  # one cap on everything this agent sends
    on_gpu = None
    if device != "cpu" and config.cuda_ipc:
        on_gpu = LocalDevice(config.report_gpu_uuid or buffers.gpu_uuid(device), machine_id(), os.getpid())
    transports = {"grpc": GrpcTransport(config.host, chunk_bytes=config.chunk_bytes,
                                        timeout_s=config.transfer_timeout_s, depth=config.forward_queue_chunks,
                                        max_message_bytes=config.max_message_bytes, throttle=throttle,
                                        token=config.token, tls=config.tls, stall_timeout_s=config.stall_timeout_s,
                                        cuda_ipc=on_gpu)}
    collective = collective_transport(config, throttle)
    if collective is not None:
        transports["collective"] = collective
    nixl = nixl_transport(config, throttle)
    if nixl is not None:
        transports["nixl"] = nixl
    # --fault (tests only) wraps the transports; the production loops have no fault branch.
    runtime = Runtime(config.host, store, {k: wrap(t, config.fault) for k, t in transports.items()},
                      workers=config.max_workers, step_timeout_s=config.transfer_timeout_s, device=store.device,
                      pace=DevicePace(config.emulate_gflops) if config.emulate_gflops else None,
                      prepare_wait_s=config.stall_timeout_s, compute_threads=config.compute_threads,
                      trace=TaskTrace(config.trace_dir, config.host) if config.trace_dir else None)
    warn_if_open(f"the agent of host {config.host}", config.listen, config.token)
    server = grpc.server(futures.ThreadPoolExecutor(config.max_workers * 4, thread_name_prefix=f"agent-{config.host}"),
                         options=channel_options(config.chunk_bytes, config.max_message_bytes) + SERVER_OPTIONS,
                         interceptors=[Authenticator(config.token, f"the agent of host {config.host}"),
                                       RequestDecoding()])
    tickets = TicketCheck(config.host, secret or new_secret())
    servicer = AgentServicer(config, store, runtime, tickets)
    _add_agent_servicer(servicer, server)
    port = start_server(server, config.listen, "reshard.v1.Agent",
                        config.tls.server_credentials() if config.tls else None)
    return server, port, runtime, servicer


def collective_transport(config: AgentConfig, throttle: Throttle) -> Transport | None:
    """The agent's collective transport, or None when it runs gRPC only.

    ``--transport collective`` without torch is an error naming the install; ``auto``
    where its backend cannot run (no torch, or no NCCL for a GPU) stays on gRPC, and
    says why in the log and at registration.
    """
    from reshard.server.transport.collective import CollectiveTransport, GroupMember

    if config.transport in ("grpc", "nixl") or (config.transport == "auto"
                                                 and buffers.backend_refusal(config.backend)):
        if config.transport == "auto":
            log.info("agent %s runs the gRPC transport only: %s", config.host, buffers.backend_refusal(config.backend))
        return None
    bind = (config.advertise or config.listen).rsplit(":", 1)[0].strip("[]")
    member = GroupMember(config.host, config.planner.rsplit(":", 1)[0], "" if bind in ("0.0.0.0", "::", "") else bind,
                         config.backend, config.device, config.group_join_timeout_s, config.collective_timeout_s)
    return CollectiveTransport(config.host, member, lanes=config.collective_lanes, window=config.forward_queue_chunks,
                               chunk_bytes=config.collective_chunk, confirm_timeout_s=config.collective_timeout_s,
                               timeout_s=config.transfer_timeout_s, throttle=throttle,
                               native_reduce=config.native_reduce)


def nixl_transport(config: AgentConfig, throttle: Throttle) -> Transport | None:
    """The agent's NIXL transport for ``--transport nixl`` (None otherwise), with UCX bound to the interface of
    the listen address (`reshard.server.agent.ucx`); refuses at start, naming the install, where NIXL does not
    import. ``auto`` does not start one: NIXL is asked for by name (README, "Which transport")."""
    if config.transport != "nixl":
        return None
    try:
        from reshard.server.transport import nixl, nixl_progress
    except ImportError as e:
        missing = f"NIXL's transport does not import here ({e}): pip install 'reshard[nixl]'"
    else:
        missing = nixl.nixl_missing()
    if missing:
        raise FailedPreconditionError(f"host {config.host} asks for --transport nixl, but {missing}")
    # NIXL's Python logger, configured as it imported, writes to stdout; the agent's stdout carries its "listening
    # on" line alone, which local clusters and reshard up read: NIXL's lines join the agent's own on stderr.
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    env, said = ucx_environment(config.listen, config.advertise, config.nixl_tcp_only, os.environ)
    os.environ.update(env)  # UCX reads its environment as the NIXL agent is made, which is next
    log.info("agent %s: nixl transport on backend %s; %s", config.host, config.nixl_backend, said)
    return nixl.NixlTransport(config.host, backend=config.nixl_backend, lanes=config.collective_lanes,
                              chunk_bytes=config.nixl_chunk, timeout_s=config.transfer_timeout_s,
                              throttle=throttle, stall_timeout_s=config.stall_timeout_s,
                              poll_pause_s=nixl_progress.shortest_pause(config.nixl_chunk, config.nic_gbps),
                              nic_gbps=config.nic_gbps)


def advertised_address(config: AgentConfig, port: int) -> str:
    if config.advertise:
        return config.advertise
    host = config.listen.rsplit(":", 1)[0]
    if host in ("0.0.0.0", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


class Agent:
    """A running agent: its server plus the loop that registers and heartbeats."""

    def __init__(self, config: AgentConfig):
        self.config = config
        keep_freed_memory()
        limit_compute_threads(config.compute_threads)  # before serve_agent: the probe measures with the limit
        self.secret = new_secret()
        self.server, self.port, self.runtime, servicer = _serve(config, self.secret)
        self.collective = self.runtime.transports.get("collective")
        self.nixl = self.runtime.transports.get("nixl")
        self.nixl_peers = servicer.nixl_peers
        self.address = advertised_address(config, self.port)
        self._stop = threading.Event()
        self._wake = threading.Event()  # beat now: stopping, or the process group changed under this agent
        if self.collective is not None:
            self.collective.member.changed = self._wake.set
        self._channel = channel(config.planner, token=config.token, tls=config.tls)
        self._planner = pb_grpc.PlannerStub(self._channel)
        self._interval = config.heartbeat_interval_s
        self._thread: threading.Thread | None = None
        self.device = self.runtime.store.device  # checked by serve_agent
        self.gpu_uuid = config.report_gpu_uuid or buffers.gpu_uuid(self.device)
        self.transport_reason = (buffers.backend_refusal(config.backend)
                                 if config.transport == "auto" and self.collective is None else "")
        self.rates = self._rates(config)

    def _rates(self, config: AgentConfig) -> DeviceRates:
        """What the cost model prices this agent's compute with: the configured figures (an emulated device's
        rate first), the rest measured."""
        gflops = config.emulate_gflops or config.device_gflops
        if gflops > 0 and config.memory_gb_per_s > 0:
            return DeviceRates(gflops, config.memory_gb_per_s)
        measured = probe(self.device)
        return DeviceRates(gflops or measured.gflops,
                           config.memory_gb_per_s or measured.memory_gb_per_s)

    def register(self) -> None:
        """Register with the planner, retrying until ``register_timeout_s`` runs out."""
        deadline = time.monotonic() + self.config.register_timeout_s
        while True:
            try:
                reply = self._planner.Register(pb.RegisterRequest(
                    host=self.config.host, num_devices=self.config.num_devices, address=self.address,
                    nic_gbps=self.config.nic_gbps, transport=self.transport, backend=self.config.backend,
                    device=self.device, gpu_uuid=self.gpu_uuid, transport_reason=self.transport_reason,
                    secret=self.secret, memory_limit_bytes=self.runtime.store.limit_bytes,
                    device_gflops=self.rates.gflops, memory_gb_per_s=self.rates.memory_gb_per_s,
                    held=[pb.TensorVersion(tensor=t, version=v) for t, v in self.runtime.store.held()],
                    nixl_metadata=self.nixl.metadata() if self.nixl is not None else b""),
                    timeout=5.0, wait_for_ready=True)
                self._interval = reply.heartbeat_interval_s or self.config.heartbeat_interval_s
                self._follow_group(reply.group)
                log.info("host %s registered with planner %s as %s (transport %s)", self.config.host,
                         self.config.planner, self.address, self.transport)
                return
            except grpc.RpcError as e:
                if time.monotonic() > deadline or e.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                                               grpc.StatusCode.INVALID_ARGUMENT,
                                                               grpc.StatusCode.UNAUTHENTICATED):
                    raise domain_error(e, f"planner at {self.config.planner}") from None
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:  # the name's last agent is not marked down yet
                    log.info("waiting to register host %s: %s", self.config.host, e.details())
                    time.sleep(0.5)
                time.sleep(0.2)

    @property
    def transport(self) -> str:
        """What this agent registers: its --transport, or grpc when it has neither a group to join nor NIXL."""
        return "grpc" if self.collective is None and self.nixl is None else self.config.transport

    def _follow_group(self, info: pb.GroupInfo) -> None:
        if self.collective is not None:
            self.collective.member.update(
                GroupView(info.store_port, info.generation, tuple(info.members), info.backend))

    def start(self) -> "Agent":
        self.register()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat")
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                joined, broken = (self.collective.member.status() if self.collective
                                  else (0, 0))
                reply = self._planner.Heartbeat(pb.HeartbeatRequest(
                    host=self.config.host, address=self.address, joined_generation=joined,
                    broken_generation=broken, uploading=self.runtime.store.receiving_uploads(),
                    proof=sign(self.secret, "heartbeat", self.config.host, self.address),
                    memory_used_bytes=self.runtime.store.used_bytes()),
                    timeout=max(self._interval, HEARTBEAT_DEADLINE_S))
                self._interval = reply.heartbeat_interval_s or self.config.heartbeat_interval_s
                if not reply.known:
                    self._register_again("the planner does not know this agent")
                else:
                    self._follow_group(reply.group)
            except grpc.RpcError as e:
                log.warning("heartbeat to planner %s failed: %s", self.config.planner, e.code().name)
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # it has waited already: the next beat goes now
                    self._wake.set()
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:  # another registrant holds the name now
                    self._register_again(e.details())

    def _register_again(self, why: str) -> None:
        """Register again from the heartbeat loop; a failure is logged and retried at the next beat, so the loop
        never dies (it is what brings the agent back after the planner or another registrant forgot it)."""
        log.info("host %s registers again: %s", self.config.host, why)
        if self.collective is not None:
            # A planner that forgot this agent (it restarted) numbers and hosts its groups anew: the one this agent
            # is in hangs on the dead planner's store, even where the new one names the same port and generation.
            self.collective.member.leave(f"it registers again ({why})")
        self.nixl_peers.forget_all(f"it registers again ({why})")
        try:
            self.register()
        except Exception as e:  # noqa: BLE001 - the next heartbeat tries again
            log.warning("host %s could not register again: %s", self.config.host, e)

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self._wake.set()
        self.server.stop(grace).wait()
        self.runtime.close()
        self._channel.close()
