"""The collective transport: the agents' torch.distributed process group and a job's streams over it.

Owns everything of the transport that touches torch: an agent's membership in the
group (`GroupMember`) and the data plane (`CollectiveTransport`), point-to-point
``send``/``recv`` on the group behind the `Transport` interface, whose base class
runs what a move, a chain hop and a reduce mean (`moves`, `reduce`). The planner decides who the
members are and hosts the store (`reshard.server.planner.membership`,
``rendezvous``); this module only follows it.

=============== ==============================================================================
group           one ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) per generation,
                formed through ``PrefixStore("reshard/g<gen>/pg/", planner store)``; rank =
                index of the host in the members; a failed call closes gloo's pairs, so the
                agent reports the generation broken and the planner re-forms the group
confirm         as it starts a job an agent writes ``reshard/g<gen>/confirm/<job>/0/<host> =
                program id``, and before its first call with a peer it waits, with a deadline,
                for that peer's key: a peer on another program or generation raises at once
                instead of hanging a recv; the planner deletes a job's keys when the job ends
                (``Rendezvous.forget_job``)
stream          one box from one host to the next: pieces (``chunk_boxes``) as raw bytes,
                then a trailer ``uint64[nbytes, xxh3_64]`` (16 bytes); at most ``window``
                pieces in flight each way
waits           a stream's send or recv waits for the peer's lane to reach the stream (and,
                down a chain, for the next hop's), which on a loaded host (a cold sync) takes
                longer than any one call should; gloo closes every pair of a group whose wait
                times out, so stream calls wait up to the stream's timeout (the agent's
                transfer timeout), not ``--collective-timeout``. A job that ends on a host
                with calls of its still posted (it failed or was aborted elsewhere) reports
                the group broken there: the planner re-forms it, each member drops the old
                one, its connections close, and every call still waiting on it fails at once
tag             ``(job_seq mod 2^11) << 20 | stream``, streams numbered between each ordered
                pair of hosts (`reshard.routes.PairStreams`, in the order of their numbers over
                the program's steps: a move's hops, a reduce's ring messages): gloo matches a
                message by its peer and tag, so concurrent jobs and the streams between two
                hosts never share one, and a job may have 2^20 streams between two hosts,
                millions in all
chain           a route host receives piece k+1 while it forwards piece k to the next host
                and writes it into its own receivers (the fan-out to local devices); a piece
                is received straight into a receiver's buffer where it is contiguous there
lanes           receives block, so the agent's runtime dispatches a job's tasks in one order
                every host derives from the program, depth after depth, FIFO on ``lanes``
                threads (`reshard.server.agent.task_graph` proves it cannot deadlock); memory at
                most ``lanes * 2 * window * chunk_bytes``. NCCL ignores tags and orders calls
                per communicator, so it gets one lane
all-reduce      a replicated reduce whose members each have a host of their own runs as gloo's
                own ring all-reduce, in place in the result buffer, on a process group of
                those hosts (formed at its first use, ``PrefixStore("reshard/g<gen>/sub/
                <hosts>/")``); gloo matches collectives by their order on a group, so at
                most one reduce holds a group at a time: the first member to reach it claims
                the group (``reshard/g<gen>/native/<hosts> = <job>/<step>``, compare-and-set)
                and writes the decision every member follows (``native`` or ``ring``); a
                reduce that finds the group held runs the tagged ring instead. Its bytes are
                the ring's, counted as the ring counts them; TCP's checksum is the only check
                on them (``native_reduce=False``: always the ring, every message XXH3-checked)
=============== ==============================================================================
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.mesh import host_of
from reshard.errors import ReshardError
from reshard.proto.errors import DeadlineExceededError, FailedPreconditionError, UnavailableError
from reshard.proto.layout import chunk_boxes, tile_shape
from reshard.server.common.contract import confirm_prefix
from reshard.server.common.torch_support import require_torch, seconds_delta, torch_available
from reshard.server.transport import deltas
from reshard.server.transport.base import Transport
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Outgoing, Piece, StreamKey, Throttle, Trailer
from reshard.server.transport.buffers import host_bytes, region, write

if TYPE_CHECKING:
    from reshard.server.common.contract import GroupView

__all__ = ["torch_available", "GroupMember", "CollectiveTransport"]

log = logging.getLogger(__name__)

_STREAM_BITS = 20
# Reduces gloo's all-reduce runs as the ring would: its ops by our names, and dtypes it adds as numpy does
# (bfloat16, held as uint16 bits, stays on the ring, which adds it as numbers). Gloo's max is std::max, which
# keeps or drops a NaN by the order of its operands where numpy.maximum always keeps it: a float max stays on
# the ring.
_NATIVE_OPS = {"sum": "SUM", "max": "MAX"}
_NATIVE_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"})
_FLOATS = frozenset({"float16", "float32", "float64"})
# A native all-reduce goes in pieces of this many chunks: the copy of the next piece's addends overlaps the
# all-reduce of the one before, where one whole piece would keep the copy in front of the all-reduce
NATIVE_PIECE_CHUNKS = 4
_SEQ_MASK = (1 << 11) - 1


# -- the group ----------------------------------------------------------------------------------


@dataclass
class Group:
    generation: int
    members: tuple[str, ...]
    pg: object
    store: object  # a client of the planner's store, for the confirm keys
    device: object  # torch.device the chunks live on
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Native all-reduces: a process group of their own per set of member hosts, formed at first use (`_subgroup`)
    subgroups: dict[tuple[str, ...], object] = field(default_factory=dict)
    forming: dict[tuple[str, ...], threading.Lock] = field(default_factory=dict)

    def rank_of(self, host: str) -> int:
        try:
            return self.members.index(host)
        except ValueError:
            raise FailedPreconditionError(
                f"host {host} is not in process group generation {self.generation} (members {list(self.members)})"
            ) from None


class GroupMember:
    """An agent's place in the group: forms each generation the planner announces, in the background."""

    def __init__(self, host: str, planner_host: str, bind_host: str, backend: str, device: str,
                 join_timeout_s: float, op_timeout_s: float):
        self.dist = require_torch()
        import torch

        self.torch = torch
        self.host = host
        self.planner_host = planner_host.strip("[]")
        self.bind_host = bind_host
        self.backend = backend
        self.device = torch.device(device)
        if backend == "nccl" and not (torch.cuda.is_available() and self.dist.is_nccl_available()):
            raise FailedPreconditionError(
                f"agent {host} asks for the nccl backend, but this torch has no CUDA device or no NCCL; "
                f"run it with --device cpu (gloo) on hosts without GPUs"
            )
        self.join_timeout_s = join_timeout_s
        self.op_timeout_s = op_timeout_s
        self._lock = threading.Lock()
        self._target: tuple[int, int] | None = None  # (store port, generation)
        self._group: Group | None = None
        self._broken = 0
        # Called once this agent joined a generation or dropped one: the agent heartbeats at once to say so,
        # rather than at its next beat, so a group forms (or re-forms after a failure) a beat sooner.
        self.changed: Callable[[], None] = lambda: None

    def update(self, view: "GroupView") -> None:
        """Follow the planner's wanted group (called with every register and heartbeat reply)."""
        with self._lock:
            if not view.store_port or not view.generation or self.host not in view.members:
                self._target, self._group = None, None
                return
            target = (view.store_port, view.generation)
            if target == self._target:
                return
            self._target = target
        threading.Thread(target=self._join, args=(view,), daemon=True, name=f"join-g{view.generation}").start()

    def _join(self, view: "GroupView") -> None:
        dist = self.dist
        gen, members = view.generation, tuple(view.members)
        rank = members.index(self.host)
        try:
            store = dist.TCPStore(self.planner_host, view.store_port, is_master=False, wait_for_workers=False,
                                  timeout=seconds_delta(self.join_timeout_s))
            prefixed = dist.PrefixStore(f"reshard/g{gen}/pg/", store)
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = seconds_delta(self.op_timeout_s)
                pg = dist.ProcessGroupNCCL(prefixed, rank, len(members), opts)
            else:
                pg = dist.ProcessGroupGloo(prefixed, rank, len(members), self.gloo_options())
        except Exception as e:  # noqa: BLE001 - reported to the planner, which re-forms the group
            with self._lock:
                if self._target == (view.store_port, gen):
                    self._broken = gen
                    self._target = None
            log.warning("host %s could not form process group generation %d (members %s): %s",
                        self.host, gen, list(members), e)
            self.changed()
            return
        with self._lock:
            if self._target != (view.store_port, gen):
                return  # superseded while forming
            self._group = Group(gen, members, pg, store, self.device)
        log.info("host %s joined process group generation %d as rank %d of %d (%s)", self.host, gen, rank,
                 len(members), self.backend)
        self.changed()

    def gloo_options(self):
        """A gloo process group's options: the op timeout, and the address this agent binds."""
        dist = self.dist
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = seconds_delta(self.op_timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind_host) if self.bind_host
                         else dist.ProcessGroupGloo.create_default_device()]
        return opts

    def status(self) -> tuple[int, int]:
        """(joined generation, broken generation) for the next heartbeat."""
        with self._lock:
            broken, self._broken = self._broken, 0
            return (self._group.generation if self._group else 0), broken

    def require(self, generation: int, job: str) -> Group:
        with self._lock:
            group = self._group
        if group is None or group.generation != generation:
            have = f"generation {group.generation}" if group else "no group"
            raise FailedPreconditionError(
                f"job {job} runs on process group generation {generation}, but agent {self.host} has {have}: "
                f"the group was re-formed (an agent joined, left or failed) after the job was planned; "
                f"submit the reshard again"
            )
        return group

    def leave(self, why: str) -> None:
        """Drop the group and the generation wanted, reporting nothing broken: the planner that announced them
        forgot this agent (it restarted, and its store went with it), so the next view is formed anew even where
        it names the same store port and generation."""
        with self._lock:
            group, self._group, self._target = self._group, None, None
        if group is not None:
            log.info("host %s leaves process group generation %d: %s", self.host, group.generation, why)

    def mark_broken(self, group: Group, why: str) -> None:
        with self._lock:
            if self._group is not group:
                return
            self._group, self._broken = None, group.generation
            # A newer generation may be forming already (a call on the old one failed late, say after the
            # agent was paused): forming it goes on.
            if self._target is not None and self._target[1] == group.generation:
                self._target = None
            log.warning("host %s drops process group generation %d: %s", self.host, group.generation, why)
        self.changed()


# -- the data plane ---------------------------------------------------------------------------------


class _Outgoing(Outgoing):
    """A stream to one peer over the group: a ``send`` per piece, at most ``window`` unfinished, then the
    trailer ``uint64[nbytes, xxh3_64]``."""

    def __init__(self, transport: "CollectiveTransport", s: Session, group: Group, peer: str, tag: int):
        self._transport, self._session, self._group = transport, s, group
        self.peer, self._rank, self._tag = peer, group.rank_of(peer), tag
        self._pending: deque = deque()

    def _send(self, tensor) -> None:
        # Counted by the caller when handed over (gloo's send work reports completion only on wait):
        # at most ``window`` pieces ahead of the wire, and progress moves piece by piece.
        self._pending.append(self._transport.post(self._session, self._group, "send", self.peer,
                                                  lambda: self._group.pg.send([tensor], self._rank, self._tag)))
        if len(self._pending) >= self._transport.window:
            self._transport.finish(self._session, self._group, self._pending.popleft(), "send", self.peer)

    def put(self, box, data, wire=None) -> None:
        self._send(wire if wire is not None else self._transport.tensor(data, self._group))

    def end(self, nbytes: int, digest: int) -> None:
        self._send(self._transport.tensor(np.array([nbytes, digest], dtype=np.uint64), self._group))

    def wait(self, timeout: float) -> None:
        while self._pending:
            self._transport.finish(self._session, self._group, self._pending.popleft(), "send", self.peer)
        return None  # every receiving host reports to the planner itself

    def cancel(self) -> None:
        self._pending.clear()  # the group is re-formed after a failed job, which drops what is in flight


class CollectiveTransport(Transport):
    """Streams over the process group (see the module table); the receiver posts its receives."""

    name = "collective"
    passive = False

    def __init__(self, host: str, member: GroupMember, *, lanes: int, window: int, chunk_bytes: int,
                 confirm_timeout_s: float, timeout_s: float, throttle: Throttle | None = None,
                 native_reduce: bool = True):
        super().__init__(host, chunk_bytes=chunk_bytes, timeout_s=timeout_s, throttle=throttle)
        # Whether this agent proposes gloo's own all-reduce for a replicated reduce (the module table); it
        # follows whatever the reduce's first member decided either way.
        self.native_reduce = native_reduce and member.backend == "gloo"
        self.member = member
        self.torch = member.torch
        self.lanes = 1 if member.backend == "nccl" else lanes
        self.window = max(1, window)
        self.confirm_timeout_s = confirm_timeout_s
        self.op_timeout = seconds_delta(member.op_timeout_s)
        self._lock = threading.Lock()
        self._groups: dict[str, Group] = {}  # job -> the group it runs on
        self._announced: set[str] = set()  # jobs whose plan-id key this host wrote
        self.stream_timeout = seconds_delta(timeout_s)  # one stream call's (see the module table's waits)
        self._posted: dict[str, int] = {}  # job -> its calls posted and not yet finished
        # Pieces are read-only views of shards that arrived as bytes; torch only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

    # -- jobs -------------------------------------------------------------------------------------------

    def attach(self, s: Session) -> None:
        group = self.member.require(s.generation, s.job)
        # A tag numbers the streams between the two hosts of a call (`Session.pair_stream`): the widest pair must
        # fit its bits, not the job's streams in all (a Kimi-K2-sized state dict's program has 16.8 million)
        n, pair = s.pair_streams.widest() if s.pair_streams is not None else (s.num_streams, None)
        if n > 1 << _STREAM_BITS:
            between = f" from host {pair[0]} to host {pair[1]}" if pair is not None else ""
            raise FailedPreconditionError(
                f"program {s.program_id[:12]} has {n} streams{between}; the collective transport numbers at most "
                f"{1 << _STREAM_BITS} between two hosts in a job (in its message tags): run it with --transport grpc "
                f"or nixl, or as several jobs"
            )
        with self._lock:
            self._groups[s.job] = group

    def detach(self, s: Session) -> None:
        """The job ended here. With calls of it still posted (it failed or was aborted elsewhere), the group is
        reported broken: a call left waiting would otherwise hold its lane until its peer's connection closes or the
        stream's timeout passes, and that timeout would close every pair of the group under a later job."""
        with self._lock:
            group = self._groups.pop(s.job, None)
            self._announced.discard(s.job)
            posted = self._posted.pop(s.job, 0)
        if group is not None and posted > 0:
            self.member.mark_broken(group, f"job {s.job} ended with {posted} of its calls still posted")

    def _group(self, s: Session) -> Group:
        with self._lock:
            group = self._groups.get(s.job)
        if group is None:
            raise FailedPreconditionError(f"job {s.job} is not prepared for the collective transport on {self.host}")
        return group

    def handshake(self, s: Session, peers: set[str]) -> None:
        """Publish this agent's plan id for the job (once) and check every new peer's before any call; a store
        that no longer answers fails the job with `UnavailableError` and drops the group (the planner re-forms it)."""
        me = self.host
        group = self._group(s)
        try:
            self._confirm(s, group, peers)
        except ReshardError:  # a refusal of this agent's or a peer's, or the run failed meanwhile
            raise
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError, DistStoreError or RuntimeError
            # The store answers no more (the planner restarted or is down): the group cannot confirm a job again.
            self.member.mark_broken(group, "its rendezvous store failed")
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnavailableError(
                f"job {s.job}: agent {me} cannot reach the rendezvous store of process group generation "
                f"{s.generation} on the planner ({type(e).__name__}: {text}); the planner may have restarted or be "
                f"down: the group is re-formed once it answers, then submit the job again") from None

    def _confirm(self, s: Session, group: Group, peers: set[str]) -> None:
        """The handshake's calls on the store (see the module table's ``confirm``)."""
        me = self.host
        prefix = confirm_prefix(s.generation, s.job, 0)
        mine = s.program_id
        try:
            self.member.require(s.generation, s.job)
        except FailedPreconditionError as e:
            with group.lock:  # tell the peers at once, so none of them waits for this agent
                group.store.set(prefix + me, f"!{e}")
            raise
        with self._lock:
            announce = s.job not in self._announced
            self._announced.add(s.job)
        if announce:
            with group.lock:
                group.store.set(prefix + me, mine)
        keys = [prefix + p for p in sorted(peers)]
        start = time.monotonic()
        deadline = start + self.confirm_timeout_s
        pause = 0.0005
        while keys:
            s.check()
            with group.lock:
                ready = group.store.check(keys)
            if ready:
                break
            if time.monotonic() > deadline:
                with group.lock:
                    late = [k.rsplit("/", 1)[1] for k in keys if not group.store.check([k])]
                raise DeadlineExceededError(
                    f"job {s.job}: hosts {late} did not confirm plan {mine[:12]} on process group generation "
                    f"{s.generation} within {self.confirm_timeout_s:g}s; they may run another generation or have "
                    f"failed, so agent {me} made no collective call"
                )
            time.sleep(pause)
            # Peers start within a few ms of each other: poll fast at first, then back off.
            pause = 0.0005 if time.monotonic() < start + 0.1 else min(pause * 2, 0.02)
        for key in keys:
            with group.lock:
                theirs = group.store.get(key).decode()
            if theirs.startswith("!"):
                raise FailedPreconditionError(f"job {s.job}: host {key.rsplit('/', 1)[1]} cannot run it: {theirs[1:]}")
            if theirs != mine:
                raise FailedPreconditionError(
                    f"job {s.job}: host {key.rsplit('/', 1)[1]} confirmed plan {theirs[:12]}, but agent {me} "
                    f"prepared plan {mine[:12]}; every agent must run the same plan, so no collective call was made"
                )

    # -- streams ----------------------------------------------------------------------------------------

    def _tag(self, s: Session, key: StreamKey, src: str, dst: str) -> int:
        return ((s.seq & _SEQ_MASK) << _STREAM_BITS) | s.pair_stream(key, src, dst)

    def tensor(self, data, group: Group):
        """A piece's bytes as a tensor on the group's device (a view of host bytes on CPU)."""
        flat = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(
            np.uint8)
        tensor = self.torch.from_numpy(flat)
        return tensor if group.device.type == "cpu" else tensor.to(group.device, non_blocking=False)

    def finish(self, s: Session, group: Group, work, what: str, peer: str) -> None:
        """Wait for one send or recv, up to the stream's timeout (the module table's waits); a failure marks the
        group broken (the planner re-forms it)."""
        try:
            work.wait(self.stream_timeout)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError for every failure
            raise self._failed(s, group, e, what, peer, self.stream_timeout.total_seconds()) from None
        finally:
            with self._lock:
                if s.job in self._posted:  # else the job ended here already (`detach`)
                    self._posted[s.job] -= 1

    def post(self, s: Session, group: Group, what: str, peer: str, call: Callable[[], object]):
        """Post one send or recv (``call``): gloo raises at once where the peer's connection is already closed, which
        fails the job naming the peer, as a failed wait does."""
        try:
            work = call()
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError for every failure
            raise self._failed(s, group, e, what, peer) from None
        with self._lock:
            if s.job in self._groups:  # else the job ended here already (`detach`)
                self._posted[s.job] = self._posted.get(s.job, 0) + 1
        return work

    def _failed(self, s: Session, group: Group, e: Exception, what: str, peer: str,
                seconds: float | None = None) -> Exception:
        self.member.mark_broken(group, f"{what} failed")
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        where = (f"job {s.job}: {what} with host {peer} (rank {group.rank_of(peer)} of process group "
                 f"generation {group.generation})")
        if "pair closure" in text:  # gloo's words for a group closed by another call's timeout
            return UnavailableError(f"{where} failed: another call on the group timed out, which closed its "
                                    f"connections ({text})")
        if "Timed out" in text or "timeout" in text.lower():
            seconds = self.op_timeout.total_seconds() if seconds is None else seconds
            return DeadlineExceededError(f"{where} did not finish in {seconds:g}s: {text}")
        return UnavailableError(f"{where} failed: {text}")

    def open(self, s: Session, key: StreamKey, peer: str) -> Outgoing:
        return _Outgoing(self, s, self._group(s), peer, self._tag(s, key, self.host, peer))

    def arrivals(self, s: Session, key: StreamKey, peer: str, box: Box, place) -> Iterator:
        """Post up to ``window`` receives ahead; a piece lands in a receiver's buffer when ``place`` offers one
        (no staging buffer, no copy), else in a new tensor. A delta stream (`Session.delta`) is received as its
        sender cuts it (`deltas.frame_ranges`): the head first, whose payload length gives the rest."""
        torch = self.torch
        group = self._group(s)
        src, tag = group.rank_of(peer), self._tag(s, key, peer, self.host)
        dtype, np_dtype = s.dtype(key.step)
        delta = s.delta(key.step)
        if delta is None:
            subs = iter([sub for sub in chunk_boxes(box, dtype, self.chunk_bytes) if boxes.volume(sub)])

            def size(sub: Box) -> int:
                return boxes.volume(sub) * np_dtype.itemsize
        else:
            head = torch.empty(deltas.HEAD.size, dtype=torch.uint8, device=group.device)
            work = self.post(s, group, "recv", peer, lambda: group.pg.recv([head], src, tag))
            self.finish(s, group, work, "recv", peer)
            raw = head.cpu().numpy()
            total = deltas.read_head(s.job, delta, raw)[0]
            yield Piece(((0, deltas.HEAD.size),), raw, head, None)
            subs = iter([((lo, hi),) for lo, hi in deltas.frame_ranges(total, self.chunk_bytes)][1:])
            place = None  # a frame lands in tensors of its own

            def size(sub: Box) -> int:
                return sub[0][1] - sub[0][0]
        posted: deque = deque()

        def post() -> None:
            sub = next(subs, None)
            if sub is None:
                return
            into, view = (place(sub) or ("", None)) if place is not None and group.device.type == "cpu" else \
                ("", None)
            buf = (torch.from_numpy(view.reshape(-1).view(np.uint8)) if view is not None
                   else torch.empty(size(sub), dtype=torch.uint8, device=group.device))
            work = self.post(s, group, "recv", peer, lambda: group.pg.recv([buf], src, tag))
            posted.append((sub, buf, into if view is not None else None, work))

        for _ in range(self.window):
            post()
        while posted:
            sub, buf, into, work = posted.popleft()
            self.finish(s, group, work, "recv", peer)
            post()
            raw = (buf if buf.device.type == "cpu" else buf.cpu()).numpy()
            yield Piece(sub, raw, buf, into)
        trailer = torch.empty(16, dtype=torch.uint8, device=group.device)
        work = self.post(s, group, "recv", peer, lambda: group.pg.recv([trailer], src, tag))
        self.finish(s, group, work, "recv", peer)
        nbytes, digest = (int(v) for v in trailer.cpu().numpy().view(np.uint64))
        yield Trailer(nbytes, digest)

    # -- native all-reduces -----------------------------------------------------------------------------

    def all_reduce(self, s: Session, step: int, group: tuple[str, ...], box: Box, op: str, read, produce) -> bool:
        """Gloo's own all-reduce of ``box`` over ``group`` (see the module table), when every member has a host of
        its own and the members decide on it (`_decide`); False: they run the ring."""
        hosts = [host_of(d) for d in group]
        dtype = s.dtype(step)[0]
        if (len(group) < 2 or len(set(hosts)) != len(group) or self.host not in hosts or op not in _NATIVE_OPS
                or dtype not in _NATIVE_DTYPES or (op == "max" and dtype in _FLOATS) or self.member.backend != "gloo"):
            return False  # decided by the program alone: every member returns here too
        g = self._group(s)
        members = tuple(sorted(hosts))
        native, done = self._decide(s, g, step, members)
        if native:
            self._native(s, g, step, group, members, box, op, read, produce)
        else:
            self.ring_reduce(s, step, group, box, op, "replicate", None, read, produce)
        done()
        return True

    def _decide(self, s: Session, g: Group, step: int, members: tuple[str, ...]) -> tuple[bool, Callable[[], None]]:
        """Whether reduce ``step`` of the job runs natively on the hosts ``members``: the first member to get here
        claims their group if no other reduce holds it (and this agent proposes it) and writes the decision;
        the others read it. ``done()``, called by each member after the reduce, lets the last one free the group
        and delete the keys."""
        held_key = f"reshard/g{g.generation}/native/{','.join(members)}"
        prefix = f"reshard/g{g.generation}/native-job/{s.job}/{step}/"
        tag = f"{s.job}/{step}"
        with g.lock:
            held = self.native_reduce and g.store.compare_set(held_key, "", tag).decode() == tag
            native = g.store.compare_set(prefix + "decision", "", "native" if held else "ring").decode() == "native"
            if held and not native:  # claimed after another member decided on the ring: free it again
                g.store.compare_set(held_key, tag, "")

        def done() -> None:
            with g.lock:
                if g.store.add(prefix + "done", 1) == len(members):
                    if native:
                        g.store.compare_set(held_key, tag, "")
                    g.store.delete_key(prefix + "decision")
                    g.store.delete_key(prefix + "done")

        return native, done

    def _subgroup(self, g: Group, members: tuple[str, ...]):
        """The process group of the hosts ``members`` in generation ``g``, formed with them at its first use."""
        with g.lock:
            forming = g.forming.setdefault(members, threading.Lock())
        with forming:  # one formation per set of hosts; others form beside it
            pg = g.subgroups.get(members)
            if pg is None:
                dist = self.member.dist
                store = dist.TCPStore(g.store.host, g.store.port, is_master=False, wait_for_workers=False,
                                      timeout=seconds_delta(self.member.join_timeout_s))
                prefixed = dist.PrefixStore(f"reshard/g{g.generation}/sub/{','.join(members)}/", store)
                try:
                    pg = dist.ProcessGroupGloo(prefixed, members.index(self.host), len(members),
                                               self.member.gloo_options())
                except Exception as e:  # noqa: BLE001 - torch raises RuntimeError for every failure
                    self.member.mark_broken(g, f"forming the group of {list(members)} failed")
                    raise UnavailableError(f"host {self.host} could not form the process group of hosts "
                                           f"{list(members)} for an all-reduce: {e}") from None
                g.subgroups[members] = pg
        return pg

    def _native(self, s: Session, g: Group, step: int, group: tuple[str, ...], members: tuple[str, ...], box: Box,
                op: str, read, produce) -> None:
        """This host's device's part of gloo's all-reduce, in place in its result buffer where it can be: the
        addends are copied in piece by piece (`NATIVE_PIECE_CHUNKS` chunks each), each piece's all-reduce started
        as soon as it is there, so the next piece's copy overlaps it; the source version stays intact."""
        dist = self.member.dist
        i = next(k for k, d in enumerate(group) if host_of(d) == self.host)
        n, dtype, shape = len(group), s.dtype(step)[1], tile_shape(box)
        pg = self._subgroup(g, members)
        array, origin = produce(group[i], box)
        view = region(array, box, origin)
        in_place = (isinstance(view, np.ndarray) and view.dtype == dtype and view.flags.writeable
                    and view.flags.c_contiguous)
        acc = (view if in_place else np.empty(shape, dtype=dtype)).reshape(-1)
        addends = np.frombuffer(host_bytes(read(group[i])), dtype=dtype)
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, _NATIVE_OPS[op])
        to, frm = host_of(group[(i + 1) % n]), host_of(group[(i - 1) % n])
        s.check()
        step_n = max(1, NATIVE_PIECE_CHUNKS * self.chunk_bytes // dtype.itemsize)
        works = []
        for lo in range(0, acc.size, step_n):
            np.copyto(acc[lo:lo + step_n], addends[lo:lo + step_n])
            piece = self.torch.from_numpy(acc[lo:lo + step_n])
            works.append(self.post(s, g, "all-reduce", to, lambda piece=piece: pg.allreduce([piece], opts)))
        for work in works:
            self.finish(s, g, work, "all-reduce", to)
        if not in_place:
            write(array, box, origin, acc.reshape(shape))
        # The ring's bytes, counted as `reduce` counts its rounds: parts to the next member, from the previous one
        parts, itemsize = boxes.split(box, n), dtype.itemsize
        sent = sum(boxes.volume(parts[(i - r - 1) % n]) + boxes.volume(parts[(i - r) % n]) for r in range(n - 1))
        got = sum(boxes.volume(parts[(i - r - 2) % n]) + boxes.volume(parts[(i - r - 1) % n]) for r in range(n - 1))
        s.traffic.add_out(to, sent * itemsize, origin=False)
        s.traffic.add_in(frm, got * itemsize)
        s.traffic.add_native_reduce()
