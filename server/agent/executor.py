"""An agent's part of a plan: destination buffers, local copies, pushes to peers and chain hops.

Method semantics follow the cost model (``reshard.cost``):

=========== ===========================================================================
local       the sender copies the box into each receiver on its own host
p2p         a separate push of the box to each receiver (a local copy if it shares the
            sender's host)
broadcast   receivers on the sender's host get local copies; the box is pushed once to
            ``route[0]``, whose agent forwards every chunk to ``route[1]`` as soon as it
            has it (before the next chunk arrives), writes it into its own receivers, and
            so on down the route
=========== ===========================================================================

A receiver checks that every piece lies in the transfer's box, that the byte count
and XXH3-64 digest match the sender's trailer (`verify_arrival`), and, before its
buffers may commit, that each destination device got exactly the elements it
lacked. A chain's digest is checked once, end to end, by its last hop: a hop that
forwards hands on the very bytes it keeps, so the last hop's match covers every
hop's copy, and a mismatch anywhere fails the job before any hop commits (the
planner commits only once every agent's part succeeded). The executor knows no
gRPC: pushes go through a `PeerLink` the service layer provides.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.mesh import host_of
from reshard.plan import Plan, Transfer
from reshard.proto.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from reshard.proto.layout import Checksum, chunk_boxes, digest, np_dtype, tile_shape
from reshard.server.agent.store import ShardStore, TileBuffer

__all__ = ["PushHeader", "PeerLink", "Executor", "Traffic", "send_bytes", "interleaved", "verify_arrival"]

log = logging.getLogger(__name__)

# Items of a push stream: ("piece", box, data, wire) ... then ("trailer", nbytes, xxh3_64).
# ``data`` is a C-contiguous bytes-like view; ``wire`` is the link's own encoding of the
# piece as it arrived (a chain hop hands it on unchanged, so it is not re-encoded),
# or None when the sender made the piece.
Item = tuple


@dataclass(frozen=True)
class PushHeader:
    job: str
    plan_id: str
    transfer: int
    hop: int  # broadcast: index of the receiving host in the route; p2p: index of the receiver
    from_host: str


class PeerLink(Protocol):
    def push(self, host: str, address: str, header: PushHeader, items: Iterable[Item]) -> list[str]:
        """Stream ``items`` to the agent of ``host``; returns the hosts that verified the box."""


def send_bytes(plan: Plan, host: str, phase: int | None = None) -> int:
    """Bytes the agent of ``host`` sends as a transfer's sender (copies and first hops)."""
    total = 0
    size = plan.itemsize
    for t in plan.transfers:
        if host_of(t.sender) != host or (phase is not None and t.phase != phase):
            continue
        n = boxes.volume(t.box) * size
        if t.method == "broadcast":
            total += n * (sum(host_of(r) == host for r in t.receivers) + (1 if t.route else 0))
        else:
            total += n * len(t.receivers)
    return total


def verify_arrival(job: str, index: int, t: Transfer, hop: int, check: Checksum, sent_nbytes: int,
                   sent_digest: int, itemsize: int) -> None:
    """Check one received stream of transfer ``index`` against its sender's trailer: byte count and XXH3-64.

    ``check`` counts bytes only on a hop that forwards down a chain; the last hop's
    digest then speaks for the whole route (see the module docstring).
    """
    expected = boxes.volume(t.box) * itemsize
    sender = host_of(t.sender)
    if not check.nbytes == sent_nbytes == expected:
        raise DataLossError(
            f"job {job}: transfer {index} from {sender} arrived with {check.nbytes} bytes; the sender sent "
            f"{sent_nbytes} and the box holds {expected}"
        )
    if check.digests and check.xxh3_64 != sent_digest:
        if t.method == "broadcast" and hop:
            where = f"somewhere on the chain {' -> '.join([sender, *t.route[:hop + 1]])}"
        else:
            where = f"between {sender} and {t.route[0] if t.method == 'broadcast' else host_of(t.receivers[hop])}"
        raise DataLossError(
            f"job {job}: transfer {index} arrived with XXH3-64 {check.xxh3_64:016x}, but the sender sent "
            f"{sent_digest:016x}: the bytes changed {where}, so the job fails and no host commits them"
        )


def _first_peer(t: Transfer) -> str:
    """The host a transfer's sender streams to first ('' when it stays on the sender's host)."""
    if t.method == "broadcast":
        return t.route[0] if t.route else ""
    sender = host_of(t.sender)
    return next((h for h in map(host_of, t.receivers) if h != sender), "")


def interleaved(transfers: list[tuple[int, Transfer]]) -> list[tuple[int, Transfer]]:
    """Round-robin over (sender host, destination host) pairs, so the transfers running at
    once (pools are bounded) share every NIC, as the cost model assumes, instead of all
    going to one host while the others idle. Plans list transfers grouped by destination.
    The order depends on the transfers alone, so every host computes the same one."""
    by_peer: dict[tuple[str, str], list[tuple[int, Transfer]]] = defaultdict(list)
    for it in transfers:
        by_peer[host_of(it[1].sender), _first_peer(it[1])].append(it)
    queues = list(by_peer.values())
    out = []
    for k in range(max(map(len, queues), default=0)):
        out += [q[k] for q in queues if k < len(q)]
    return out


class Traffic:
    """Bytes a host moved for one job: over the network per peer host, and between its own devices."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_in: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)
        self.local_bytes = 0
        self.sent = 0  # as a sender: what progress reports

    def add_in(self, peer: str, n: int) -> None:
        with self._lock:
            self.bytes_in[peer] += n

    def add_out(self, peer: str, n: int, origin: bool) -> None:
        with self._lock:
            self.bytes_out[peer] += n
            if origin:
                self.sent += n

    def add_local(self, n: int) -> None:
        with self._lock:
            self.local_bytes += n
            self.sent += n


class _Throttle:
    """Caps the send rate (tests use it to interrupt a transfer midway)."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def wait(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        time.sleep(max(0.0, start - now))


class _AgentJob:
    """One job's state on one agent: the plan, destination buffers and what arrived."""

    def __init__(self, job: str, plan: Plan, tensor: str, src_version: int, dst_version: int,
                 peers: dict[str, str], host: str, store: ShardStore):
        self.id = job
        self.plan = plan
        self.tensor = tensor
        self.src_version = src_version
        self.dst_version = dst_version
        self.peers = dict(peers)
        self.dtype = np_dtype(plan.dtype)
        self.traffic = Traffic()
        self.failed: BaseException | None = None
        self.digests: dict[int, Future] = {}  # transfer index -> XXH3-64 of its box, from a held source shard
        self._lock = threading.Lock()
        src_tiles = plan.src.tiles(plan.shape)
        self.dst_tiles = {d: b for d, b in plan.dst.tiles(plan.shape).items() if host_of(d) == host}
        self.buffers: dict[str, np.ndarray] = {}
        self.missing: dict[str, int] = {}
        for dev, tile in self.dst_tiles.items():
            buf = np.empty(tile_shape(tile), dtype=self.dtype)
            held = boxes.intersect(src_tiles[dev], tile) if dev in src_tiles else None
            if held is not None:
                src = store.get(tensor, src_version, dev)
                buf[boxes.to_slices(held, tile)] = src.array[boxes.to_slices(held, src.tile)]
            self.buffers[dev] = buf
            self.missing[dev] = boxes.volume(tile) - (boxes.volume(held) if held else 0)
            store.stage(job, dev, TileBuffer(buf, tile, plan.dtype))

    def write(self, device: str, sub: Box, data: np.ndarray) -> None:
        tile = self.dst_tiles.get(device)
        if tile is None or not boxes.contains(tile, sub):
            raise InvalidArgumentError(
                f"job {self.id}: box {boxes.box_str(sub)} is not inside device {device}'s destination tile"
            )
        self.buffers[device][boxes.to_slices(sub, tile)] = data
        with self._lock:
            self.missing[device] -= boxes.volume(sub)

    def mark(self, device: str, sub: Box) -> None:
        """Count ``sub`` as arrived in ``device``'s buffer, which a transport received into in place."""
        tile = self.dst_tiles.get(device)
        if tile is None or not boxes.contains(tile, sub):
            raise InvalidArgumentError(
                f"job {self.id}: box {boxes.box_str(sub)} is not inside device {device}'s destination tile"
            )
        with self._lock:
            self.missing[device] -= boxes.volume(sub)

    def check_complete(self) -> None:
        short = {d: n for d, n in self.missing.items() if n}
        if short:
            d, n = next(iter(short.items()))
            raise FailedPreconditionError(
                f"job {self.id}: device {d} still lacks {n} elements of its destination tile "
                f"({len(short)} devices incomplete); a transfer did not arrive"
            )


class Executor:
    """Runs the plan parts of one agent; shared by every job on it."""

    def __init__(self, host: str, store: ShardStore, link: PeerLink, *, chunk_bytes: int,
                 workers: int, forward_queue_chunks: int, transfer_timeout_s: float, rate_limit_bytes_per_s: float,
                 fault: str = ""):
        self.host = host
        self.fault = fault  # AgentConfig.fault: tests only
        self.store = store
        self.link = link
        self.chunk_bytes = chunk_bytes
        self.forward_queue_chunks = forward_queue_chunks
        self.transfer_timeout_s = transfer_timeout_s
        self._throttle = _Throttle(rate_limit_bytes_per_s)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"send-{host}")
        self._digest_pool = ThreadPoolExecutor(2, thread_name_prefix=f"digest-{host}")
        self._lock = threading.Lock()
        self._jobs: dict[str, _AgentJob] = {}
        self._finished: OrderedDict[str, Traffic] = OrderedDict()
        self.collective = None  # a CollectiveTransport when this agent may join the process group

    # -- lifecycle ------------------------------------------------------------------

    def prepare(self, job: str, plan_json: str, tensor: str, src_version: int, dst_version: int,
                peers: dict[str, str], transport: str = "grpc", generation: int = 0, job_seq: int = 0) -> _AgentJob:
        plan = Plan.from_json(plan_json)
        group = None
        if transport == "collective":
            if self.collective is None:
                raise FailedPreconditionError(
                    f"job {job} asks agent {self.host} for the collective transport, but it runs --transport grpc"
                )
            group = self.collective.member.require(generation, job)
        state = _AgentJob(job, plan, tensor, src_version, dst_version, peers, self.host, self.store)
        state.transport, state.generation, state.job_seq, state.group = transport or "grpc", generation, job_seq, group
        with self._lock:
            self._jobs[job] = state
        self._digest_sources(state)
        return state

    def _digest_sources(self, state: _AgentJob) -> None:
        """Start digesting, on a background thread, every box this host will send from a shard it already holds.

        A sender's trailer needs the XXH3-64 of its box; computed from prepare on (xxhash
        releases the GIL), it is ready by the time the last chunk leaves, instead of adding a
        pass over the bytes to the send loop while the transfer is in flight.
        """
        for phase in sorted({t.phase for t in state.plan.transfers}):
            for i, t in interleaved([(i, t) for i, t in enumerate(state.plan.transfers) if t.phase == phase]):
                if host_of(t.sender) != self.host or not _first_peer(t):  # stays on this host
                    continue
                shard = self.store.find(state.tensor, state.src_version, t.sender)
                if shard is not None and boxes.contains(shard.tile, t.box):
                    state.digests[i] = self._digest_pool.submit(self._digest, state, t, shard.array, shard.tile)

    def _digest(self, state: _AgentJob, t: Transfer, array: np.ndarray, origin: Box) -> int:
        view = array[boxes.to_slices(t.box, origin)]
        if view.flags.c_contiguous:
            return digest(view.reshape(-1).view(np.uint8))
        check = Checksum()
        for sub in chunk_boxes(t.box, state.plan.dtype, self.chunk_bytes):
            if state.failed is not None:
                raise state.failed
            check.update(np.ascontiguousarray(array[boxes.to_slices(sub, origin)]).reshape(-1).view(np.uint8))
        return check.xxh3_64

    def _job(self, job: str) -> _AgentJob:
        with self._lock:
            state = self._jobs.get(job)
        if state is None:
            raise NotFoundError(f"agent {self.host} has no prepared job {job!r}")
        return state

    def commit(self, job: str) -> None:
        state = self._job(job)
        state.check_complete()
        self.store.commit(job, state.tensor, state.dst_version, list(state.dst_tiles))
        self._retire(job)

    def abort(self, job: str) -> None:
        with self._lock:
            state = self._jobs.get(job)
        if state is not None:
            state.failed = state.failed or FailedPreconditionError(f"job {job} was aborted")
        self.store.abort(job)
        self._retire(job)

    def _retire(self, job: str) -> None:
        with self._lock:
            state = self._jobs.pop(job, None)
            if state is not None:
                self._finished[job] = state.traffic
                while len(self._finished) > 256:
                    self._finished.popitem(last=False)

    def traffic(self, job: str) -> Traffic:
        with self._lock:
            state = self._jobs.get(job)
            if state is not None:
                return state.traffic
            if job in self._finished:
                return self._finished[job]
        raise NotFoundError(f"agent {self.host} knows no job {job!r}")

    # -- sending ---------------------------------------------------------------------

    def execute(self, job: str, plan_id: str, phase: int) -> tuple[Callable[[], None], Callable[[], tuple[int, int]]]:
        """Start this host's sends of ``phase``; returns (wait, progress) callables."""
        state = self._job(job)
        if plan_id != state.plan.id:
            raise FailedPreconditionError(
                f"job {job}: execute names plan {plan_id[:12]} but agent {self.host} prepared plan "
                f"{state.plan.id[:12]}; every agent must run the same plan"
            )
        if state.transport == "collective":
            return self.collective.execute(state, phase)
        mine = interleaved([(i, t) for i, t in enumerate(state.plan.transfers)
                             if t.phase == phase and host_of(t.sender) == self.host])
        total = send_bytes(state.plan, self.host, phase)
        base = state.traffic.sent
        futures = [self._pool.submit(self._run_transfer, state, i, t) for i, t in mine]

        def wait_all() -> None:
            done, pending = wait(futures, timeout=self.transfer_timeout_s, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    state.failed = state.failed or f.exception()
                    raise f.exception()
            if pending:
                state.failed = DeadlineExceededError(
                    f"job {job}: {len(pending)} transfers of agent {self.host} did not finish in "
                    f"{self.transfer_timeout_s:g}s"
                )
                raise state.failed

        return wait_all, lambda: (state.traffic.sent - base, total)

    def _source(self, state: _AgentJob, device: str, box: Box) -> tuple[np.ndarray, Box]:
        shard = self.store.find(state.tensor, state.src_version, device)
        if shard is not None and boxes.contains(shard.tile, box):
            return shard.array, shard.tile
        tile = state.dst_tiles.get(device)
        if tile is not None and boxes.contains(tile, box):
            return state.buffers[device], tile
        raise FailedPreconditionError(
            f"job {state.id}: agent {self.host} holds no data of box {boxes.box_str(box)} for sender {device}"
        )

    def _run_transfer(self, state: _AgentJob, index: int, t: Transfer) -> None:
        array, origin = self._source(state, t.sender, t.box)
        view = array[boxes.to_slices(t.box, origin)]
        nbytes = boxes.volume(t.box) * state.dtype.itemsize
        local = [r for r in t.receivers if host_of(r) == self.host]
        for r in local:
            state.write(r, t.box, view)
            state.traffic.add_local(nbytes)
        if t.method == "p2p":
            for hop, r in enumerate(t.receivers):
                if host_of(r) != self.host:
                    self._push(state, index, t, hop, host_of(r), array, origin)
        elif t.method == "broadcast" and t.route:
            confirmed = self._push(state, index, t, 0, t.route[0], array, origin)
            if list(confirmed) != list(t.route):
                raise FailedPreconditionError(
                    f"job {state.id}: broadcast {index} was confirmed by {confirmed}, expected the route {list(t.route)}"
                )

    def _push(self, state: _AgentJob, index: int, t: Transfer, hop: int, host: str,
              array: np.ndarray, origin: Box) -> list[str]:
        address = state.peers.get(host)
        if address is None:
            raise FailedPreconditionError(f"job {state.id}: no address for host {host}; is its agent registered?")
        header = PushHeader(state.id, state.plan.id, index, hop, self.host)
        return self.link.push(host, address, header, self._items(state, index, t.box, array, origin, host))

    def _items(self, state: _AgentJob, index: int, box: Box, array: np.ndarray, origin: Box,
               peer: str) -> Iterator[Item]:
        known = state.digests.get(index)
        check = Checksum(digest=known is None)
        for sub in chunk_boxes(box, state.plan.dtype, self.chunk_bytes):
            if state.failed is not None:
                return  # the stream ends without a trailer: the receiver discards it
            # A view, not a copy: the link copies the bytes once, into the message it sends.
            data = memoryview(np.ascontiguousarray(array[boxes.to_slices(sub, origin)])).cast("B")
            self._throttle.wait(len(data))
            check.update(data)
            yield ("piece", sub, data, None)
            state.traffic.add_out(peer, len(data), origin=True)
        yield ("trailer", check.nbytes, known.result() if known is not None else check.xxh3_64)

    # -- receiving ---------------------------------------------------------------------

    def receive(self, header: PushHeader, items: Iterable[Item]) -> list[str]:
        """Take one push: write the box into local receivers, forward down the chain, verify."""
        state = self._job(header.job)
        plan = state.plan
        if header.plan_id != plan.id:
            raise FailedPreconditionError(
                f"job {header.job}: push from {header.from_host} carries plan {header.plan_id[:12]} but agent "
                f"{self.host} prepared plan {plan.id[:12]}"
            )
        if not 0 <= header.transfer < len(plan.transfers):
            raise InvalidArgumentError(f"job {header.job}: transfer {header.transfer} is not in the plan")
        t = plan.transfers[header.transfer]
        nxt = None
        if t.method == "broadcast" and 0 <= header.hop < len(t.route) and t.route[header.hop] == self.host:
            local = [r for r in t.receivers if host_of(r) == self.host]
            nxt = t.route[header.hop + 1] if header.hop + 1 < len(t.route) else None
        elif t.method == "p2p" and 0 <= header.hop < len(t.receivers) and host_of(t.receivers[header.hop]) == self.host:
            local = [t.receivers[header.hop]]
        else:
            raise InvalidArgumentError(
                f"job {header.job}: transfer {header.transfer} ({t}) hop {header.hop} does not deliver to host {self.host}"
            )
        forward = None
        if nxt is not None:
            forward = _Forwarder(self.link, nxt, state.peers.get(nxt, ""),
                                 PushHeader(header.job, plan.id, header.transfer, header.hop + 1, self.host),
                                 self.forward_queue_chunks, state.traffic)
        check = Checksum(digest=forward is None)
        try:
            for item in items:
                if item[0] == "piece":
                    _, sub, data, _wire = item
                    if not boxes.contains(t.box, sub):
                        raise InvalidArgumentError(
                            f"job {header.job}: piece {boxes.box_str(sub)} lies outside transfer box {boxes.box_str(t.box)}"
                        )
                    if forward is not None:
                        if self.fault == "corrupt-relay" and check.nbytes == 0:
                            data = _corrupted(data, header.hop)
                            item = ("piece", sub, data, None)
                        forward.send(item)
                    shape = tile_shape(sub)
                    if len(data) != boxes.volume(sub) * state.dtype.itemsize:
                        raise InvalidArgumentError(
                            f"job {header.job}: piece {boxes.box_str(sub)} carries {len(data)} bytes, not "
                            f"{boxes.volume(sub) * state.dtype.itemsize}"
                        )
                    arr = np.frombuffer(data, dtype=state.dtype).reshape(shape)
                    for r in local:
                        state.write(r, sub, arr)
                    check.update(data)
                    state.traffic.add_in(header.from_host, len(data))
                else:
                    _, nbytes, digest = item
                    if forward is not None:
                        forward.send(item)
                    verify_arrival(header.job, header.transfer, t, header.hop, check, nbytes, digest,
                                   state.dtype.itemsize)
                    confirmed = [self.host]
                    if forward is not None:
                        confirmed += forward.result(self.transfer_timeout_s)
                    return confirmed
            raise InvalidArgumentError(
                f"job {header.job}: push of transfer {header.transfer} from {header.from_host} ended after "
                f"{check.nbytes} bytes without a trailer; the sender stopped"
            )
        except BaseException:
            if forward is not None:
                forward.cancel()
            raise


def corrupt_bit(hop: int) -> int:
    """The bit of its first byte that chain hop ``hop`` flips under AgentConfig.fault "corrupt-relay"
    (one per hop, so two relaying hops never undo each other)."""
    return 1 << (hop % 8)


def _corrupted(data, hop: int) -> memoryview:
    out = bytearray(data)
    if out:
        out[0] ^= corrupt_bit(hop)
    return memoryview(out)


_STOP = object()


class _Forwarder:
    """The next hop of a chain: a push fed chunk by chunk from a bounded queue."""

    def __init__(self, link: PeerLink, host: str, address: str, header: PushHeader, depth: int, traffic: Traffic):
        self.host = host
        self._queue: queue.Queue = queue.Queue(depth)
        self._traffic = traffic
        self._error: BaseException | None = None
        self._confirmed: list[str] = []
        if not address:
            raise FailedPreconditionError(f"job {header.job}: no address for next hop {host}")
        self._thread = threading.Thread(target=self._run, args=(link, address, header), daemon=True,
                                        name=f"forward-{host}")
        self._thread.start()

    def _items(self) -> Iterator[Item]:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            yield item
            if item[0] == "trailer":
                return
            self._traffic.add_out(self.host, len(item[2]), origin=False)

    def _run(self, link: PeerLink, address: str, header: PushHeader) -> None:
        try:
            self._confirmed = link.push(self.host, address, header, self._items())
        except BaseException as e:
            self._error = e

    def send(self, item: Item) -> None:
        while True:
            if self._error is not None:
                raise self._error
            if not self._thread.is_alive():
                raise FailedPreconditionError(f"the push to next hop {self.host} ended early")
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def result(self, timeout: float) -> list[str]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise DeadlineExceededError(f"next hop {self.host} did not confirm within {timeout:g}s")
        if self._error is not None:
            raise self._error
        return self._confirmed

    def cancel(self) -> None:
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            try:
                self._queue.get_nowait()
                self._queue.put_nowait(_STOP)
            except (queue.Empty, queue.Full):
                pass
