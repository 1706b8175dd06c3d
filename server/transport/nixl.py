"""The NIXL transport: a job's streams as one-sided WRITEs into the receiver's registered memory, one NIXL agent
per reshard agent.

The receiver offers the region a box lands in and the sender (`nixl_out`) writes each chunk straight into it; what a
move, a chain hop and a reduce mean stays the `Transport` base class's (`moves`, `reduce`: the ring runs over these
streams).

=============== ==============================================================================
agent           one ``nixl_agent`` per transport, named by the host, UCX by default, with no
                progress thread and no listen thread of NIXL's: progress is made by one thread
                of ours that polls while anything waits or a WRITE is under way (from a 40th
                of a chunk's time on the NIC, at least 20 us, doubling to 1 ms) and wakes the
                waiter each notification or WRITE is for, and blocks
                otherwise: an idle agent burns no CPU (`nixl_progress`)
peers           whole metadata travels through the planner (`metadata`, `add_peer`,
                `drop_peer`), marked with the agent's incarnation (random, new each time its
                NIXL agent is made); memory registered later travels to a peer as NIXL
                partial metadata inside the first post that names it, loaded as the post
                arrives; a post from an incarnation not yet introduced here (a job's hosts
                prepare inside their Execute, in any order) waits for its introduction
                (`nixl_progress`)
post ``D``      the receiver registers the buffer the box lands in (the destination tile that
                ``place`` offers, else a scratch buffer of the transport's `Pool`) and notifies the sender
                of the box's contiguous runs in that buffer, in C order (a strided box is a
                list of runs, not a packed copy); an empty box is posted too. A run's first
                receives are posted as the run begins (`prepost`), not as their lanes wake
chunk ``C``     the sender WRITEs each chunk into the part of the runs its bytes fill, at most
                `WINDOW` WRITEs in flight per stream; the WRITE's notification names the
                chunk's byte range and sub-box, and arrives after its bytes, so the receiver
                yields the chunk as a `Piece` of the landed bytes, in stream order: a chain
                hop forwards chunk k (WRITE from its own region) while k + 1 arrives
trailer ``T``   bytes, XXH3-64 and chunk count; it rides on the notification of the chunk that
                fills the posted runs (``c``, ``s``: trailer, then the chunk's fields), whose
                WRITE waits for it (a box in one chunk, most of a bucketed sync's streams,
                costs one message, not two), else a notification of its own after the last
                chunk; the receiver yields the `Trailer` once every chunk landed
confirm ``K``   every chunk and the trailer landed at the receiver: its progress thread sends
                it as the last of them arrives, not once the stream's reader took them in
                (`nixl_progress`); the sender's ``wait`` waits for it: a message leaves an
                agent only while the agent makes progress, so the sender polls until its
                trailer is known to be out (``K`` itself goes down the connection the post
                already went down)
cancel ``X``    the sender gave up: the receiver fails the stream at once
registration    a buffer is registered once, cached by (address, size) and reused across
                jobs, deregistered as it is freed or the transport closes
                (`nixl_memory.Registry`)
source          a chunk of a source tile (``put_region``) is written from the tile's own
                contiguous runs, a descriptor each, registered through the same cache; a
                chunk handed over as bytes (``put``: a chain hop's landed region, a ring's
                part) from its own buffer where it is a view into a larger host buffer, else
                from a registered staging copy (`_source`)
messages        our own byte layout (`nixl_memory.encode`): NIXL's own descriptor
                serialisation pickles, and no pickle goes on a wire
one machine     where the box lands in shared segments (`shm`: host tiles are, while this
                transport shares host memory), the post also offers them; a sender of the
                same kernel maps each once (kept across jobs) and copies its chunks straight
                into it, each chunk's ``S`` notification after its bytes: one copy, where
                UCX's same-host path copies twice. Such chunks cost a notification and a
                wake-up, not NIC time, so they are `SHARED_CHUNK_BYTES` (256 MiB on the host pair
                of bench/transport.py: 50 ms in 4 MiB chunks, 43 ms in 16, no less in 32 or 64;
                memcpy 25 ms). A sender that cannot map them (another
                kernel, container or user) WRITEs as above. Off, on both ends, where UCX is
                kept off shared memory (``UCX_TLS``, which ``--nixl-tcp-only`` sets to tcp)
GPU memory      a box bound for a contiguous region of a GPU tile lands in a GPU buffer of the
                transport's `DevicePool` (VRAM, registered once, kept), and the post says so;
                the sender then WRITEs each chunk (`DEVICE_CHUNK_BYTES`) from its GPU tensor
                where it lies (VRAM, registered through the cache; a strided box packed on
                the GPU), or from host memory, and the trailer holds the GPU digest
                (`reshard.proto.devices.DeviceChecksum`), which the receiver computes as it
                copies each piece into the tile (`moves.relay`). UCX moves it by CUDA IPC on
                one machine (tested on an H200), by GPU-direct RDMA across machines where the
                NIC and UCX have it (not tried here). A post of host memory gets host bytes
                and the XXH3-64, from a GPU source too
=============== ==============================================================================

A peer that never posts its receive, goes silent or whose WRITE fails fails the stream within ``stall_timeout_s``
(else ``timeout_s``) with `UnavailableError` naming the host, as does a post whose memory cannot be loaded (its agent
died before the post was read): only that stream, whichever stream's poll met the error; a digest mismatch is the
base class's DATA_LOSS.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.proto.devices import is_cuda
from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from reshard.server.common.config import AgentConfig
from reshard.server.transport import shm
from reshard.server.transport.base import Transport
from reshard.server.transport.buffers import RECYCLE_MIN_BYTES
from reshard.server.transport.nixl_api import api as _api
from reshard.server.transport.nixl_api import nixl_missing, ucx_tcp_only
from reshard.server.transport.nixl_memory import (
    CHUNK,
    INCARNATION,
    POST,
    TRAILER,
    DeviceLanding,
    DevicePool,
    Landing,
    Pool,
    Registry,
    blobs,
    box_of,
    encode,
)
from reshard.server.transport.nixl_runs import owner_of, place_runs, segment_runs, source_runs
from reshard.server.transport.nixl_out import DEVICE_CHUNK_BYTES, SHARED_CHUNK_BYTES, SOURCE_RUN_BYTES, WINDOW, NixlOut
from reshard.server.transport.nixl_progress import POLL_MIN_S, Progress
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Outgoing, Piece, Segments, StreamKey, Throttle, Trailer

__all__ = ["nixl_missing", "NixlTransport", "WINDOW", "MIN_RUN_BYTES", "TCP_MIN_RUN_BYTES", "SHARED_CHUNK_BYTES",
           "DEVICE_CHUNK_BYTES"]

log = logging.getLogger(__name__)

# A box whose runs in the destination average fewer bytes lands in a scratch buffer, copied into place: below this a
# descriptor per run costs more than the copy; over TCP alone (--nixl-tcp-only, the lab) a run is a message of its own
# (bench/paper.py's case4, 16 KiB runs: 1.19-1.21x its estimate landing run by run, 1.11-1.13x through scratch)
MIN_RUN_BYTES, TCP_MIN_RUN_BYTES = 1024, 64 << 10
METADATA_MARK = b"reshard-nixl-1:"  # the start of an agent's metadata (`NixlTransport.metadata`), then its incarnation
STAGE_REGISTER_BYTES = 1 << 20  # a chunk's own buffer this large is registered rather than copied to staging
# Where every stream crosses a NIC of at most this rate, a box is digested as its chunks are sent, not in a pass of its
# own as the job is prepared (`NixlTransport.digest_ahead`): XXH3-64 reads 8 GB/s and more on one core of this
# machine, so a chunk's hash takes at most a quarter of its time on such a NIC, beside the WRITEs in flight; a pass
# ahead instead takes each sender's cores as every host starts its job. bench/paper.py's cases on the emulated hosts
# (1 Gbit/s links), taking turns, medians of 6: shift1 0.291 s against 0.296, allgather4 0.873 against 0.890, case6
# 0.555 against 0.561, 1to4x2 1.152 against 1.162; every host running 10-12 ms after the request against 12-20.
# Where UCX may use shared memory a peer on this machine takes a stream at memory speed: digested ahead there.
HASH_IN_STREAM_GBPS = 16.0


# -- the transport --------------------------------------------------------------------------------------


class _Posted(NamedTuple):
    """A stream posted here (`NixlTransport._post`): its sender, the region it lands in (None: an empty box), its
    bytes, and the secrets its shared segments were offered by (withdrawn as the sender copies or the stream ends)."""

    peer: str
    landing: Landing | DeviceLanding | None
    nbytes: int
    offered: list[bytes]


class NixlTransport(Transport):
    """Streams as one-sided WRITEs into the receiver's registered memory (see the module table)."""

    name = "nixl"
    passive = False  # receivers post their receives (`arrivals`), as the collective transport's do
    scatters = True  # a bucket WRITEs from its members' source regions into their destination tiles
    lands_on_gpu = True  # a box bound for a GPU tile lands in GPU memory (VRAM), not host scratch
    preposts = True  # a run's first receives are posted as it begins (`prepost`)

    # ``lanes``: `AgentConfig.collective_lanes`' default (the agent passes its own); a transport made here alone, as
    # the tests make them, runs as many as an agent would
    def __init__(self, host: str, *, backend: str = "UCX", lanes: int = AgentConfig.collective_lanes,
                 chunk_bytes: int, timeout_s: float, throttle: Throttle | None = None,
                 stall_timeout_s: float | None = None, shared_memory: bool | None = None,
                 poll_pause_s: float = POLL_MIN_S, nic_gbps: float = 0.0):
        super().__init__(host, chunk_bytes=chunk_bytes, timeout_s=timeout_s, throttle=throttle,
                         stall_timeout_s=stall_timeout_s)
        missing = nixl_missing()
        if missing:
            raise FailedPreconditionError(f"agent {host} asks for the nixl transport, but {missing}")
        api = _api()
        self.lanes = lanes
        self.backend = backend
        self.min_run_bytes = TCP_MIN_RUN_BYTES if ucx_tcp_only(os.environ) else MIN_RUN_BYTES  # landing in place
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[backend],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = api.nixl_agent(host, config)
        if backend not in self._agent.backends:
            raise FailedPreconditionError(
                f"agent {host} asks for NIXL backend {backend!r}, which this NIXL does not have; its plugins are "
                f"{sorted(self._agent.plugin_list)}")
        self._lock = threading.Lock()  # peers
        self._post_lock = threading.Lock()  # a post's metadata and its sending, one post at a time (`arrivals`)
        self._progress = Progress(self._agent, host, poll_pause_s)  # `nixl_progress.shortest_pause`
        self._peers: dict[str, bytes] = {}
        self._preposted: dict[StreamKey, _Posted] = {}  # streams posted before their lanes took them (`prepost`)
        self.incarnation = os.urandom(INCARNATION)  # this NIXL agent's, in its metadata and every post it makes
        self._memory = Registry(self._agent, host)
        self._pool = Pool(self._memory)
        self._device_pool = DevicePool(self._memory)  # GPU memory a box bound for a GPU tile lands in
        # One copy into the receiver's shared segments between agents of one machine (`shm`); ``None``: where UCX
        # may use shared memory too (its environment is set before this agent is made: `server/agent/ucx.py`)
        self.shared = shm.Sharing(host, shm.allowed(os.environ) if shared_memory is None else shared_memory)
        # Every stream crosses a NIC (no shared memory) of ``nic_gbps`` that hashing outpaces: each box is digested
        # chunk by chunk as it is sent, not in a pass ahead (`digest_ahead`)
        self.hash_in_stream = not self.shared.on and 0 < nic_gbps <= HASH_IN_STREAM_GBPS

    @property
    def registrations(self) -> int:
        """How many buffers are registered now."""
        return len(self._memory)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the transport's own host buffers (`Pool`: scratch and staging), kept for reuse until it closes."""
        return self._pool.nbytes

    @property
    def device_scratch_bytes(self) -> int:
        """Bytes of GPU memory the transport keeps for boxes bound for GPU tiles to land in (`DevicePool`)."""
        return self._device_pool.nbytes

    @property
    def registered(self) -> int:
        """Registrations made, for tests and stats."""
        return self._memory.registered

    # -- peers ---------------------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata, which the planner hands to its peers: `METADATA_MARK`, the incarnation, then
        NIXL's own."""
        return METADATA_MARK + self.incarnation + self._agent.get_agent_metadata()

    def add_peer(self, host: str, metadata: bytes) -> None:
        """Let ``host`` be written to and notified, and route the posts it made before (`Progress.admit`).
        Idempotent for one incarnation of the host's agent (the same agent, whatever memory it registered since);
        a new incarnation (its agent restarted) replaces the old."""
        incarnation, md = self._split(host, metadata)
        with self._lock:
            if self._progress.introduced(host) == incarnation:
                return
            if host in self._peers:  # the agent there restarted: the one before it is gone
                self._progress.forget(host)
                self._agent.remove_remote_agent(host)
                del self._peers[host]
            try:
                name = self._agent.add_remote_agent(md)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own nixlMismatchError, nixlInvalidParamError
                raise self._unloadable(host, metadata, f"{type(e).__name__}: {e}") from None
            name = name.decode() if isinstance(name, bytes) else name
            if name != host:
                self._agent.remove_remote_agent(name)
                raise InvalidArgumentError(f"the NIXL metadata given for host {host} is agent {name!r}'s; each "
                                           f"agent's NIXL agent is named by its host")
            self._peers[host] = metadata
            self._agent.make_connection(host)  # starts connecting now; it completes as both sides poll
            self._progress.admit(host, incarnation)
        self._memory.forget_peer(host)  # a new agent there knows none of this agent's memory
        self.shared.forget(host)

    def _split(self, host: str, metadata: bytes) -> tuple[bytes, bytes]:
        """A peer's metadata (`metadata`) as its incarnation and NIXL's own."""
        if not metadata.startswith(METADATA_MARK) or len(metadata) <= len(METADATA_MARK) + INCARNATION:
            raise self._unloadable(host, metadata, f"it does not start with {METADATA_MARK!r} and an incarnation, as "
                                                   f"this reshard release's agents' does")
        at = len(METADATA_MARK)
        return bytes(metadata[at:at + INCARNATION]), bytes(metadata[at + INCARNATION:])

    @staticmethod
    def _unloadable(host: str, metadata: bytes, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"the NIXL metadata given for host {host} ({len(metadata)} bytes) is not an "
                                    f"agent's that NIXL can load here ({why}); the host's agent registers it from its "
                                    f"own NIXL agent, and every agent of a cluster runs one reshard release")

    def drop_peer(self, host: str) -> None:
        with self._lock:
            if self._peers.pop(host, None) is None:
                return
            self._progress.forget(host)
            self._agent.remove_remote_agent(host)
        self._memory.forget_peer(host)
        self.shared.forget(host)

    def _require_peer(self, s: Session, peer: str) -> None:
        with self._lock:
            known = peer in self._peers
        if not known:
            raise FailedPreconditionError(
                f"job {s.job}: host {peer} is not a NIXL peer of agent {self.host}: the planner introduces a job's "
                f"peers before it runs (add_peer), and it introduced none by that name")

    def attach(self, s: Session) -> None:
        """The job's failure, whoever fails it, wakes this agent's waiters at once (`Progress.wake_all`), until
        `detach`."""
        s.watch(self._progress.wake_all)

    def detach(self, s: Session) -> None:
        """Drop what is left of the job's notifications, and those that come late; release its posts that no lane
        took (its run failed first)."""
        with self._lock:
            left = [(k, self._preposted.pop(k)) for k in [k for k in self._preposted if k.job == s.job]]
        for key, posted in left:
            self._unpost(key, posted)
        self._progress.detach(s.job)
        s.unwatch(self._progress.wake_all)

    def close(self) -> None:
        """Deregister every buffer and let the agent go; a buffer freed later has nothing to deregister."""
        agent, self._agent = self._agent, None
        if agent is None:
            return
        self._progress.close()
        self._memory.close()
        self._pool.close()
        self._device_pool.close()
        self.shared.close()
        with self._lock:
            self._peers.clear()  # the agent's connections go with it

    # -- notifications ---------------------------------------------------------------------------------------

    def _notify(self, peer: str, msg: bytes) -> None:
        self._progress.notify(peer, msg)

    def _limit(self) -> float:
        return self.stall_timeout_s if self.stall_timeout_s is not None else self.timeout_s

    def _await(self, s: Session, peer: str, role: str, key: StreamKey, what: str, limit: float):
        """The next notification (kind, payload) of stream ``key`` from ``peer`` (`Progress.wait`); `UnavailableError`
        naming the host when none comes within ``limit`` seconds."""
        item = self._progress.wait((peer, role, key), lambda: self._progress.take(peer, role, key), s.check,
                                   time.monotonic() + limit)  # s.check: a job that failed elsewhere stops waiting
        if item is None:
            raise UnavailableError(
                f"job {key.job}: host {peer} {what} stream {key.hop} of step {key.step} within {limit:g}s: its "
                f"agent is down, paused, cut off or behind, so the stream gives up (agent --stall-timeout)")
        kind, payload = item
        if kind == b"X":
            raise UnavailableError(f"job {key.job}: host {peer} gave up stream {key.hop} of step "
                                   f"{key.step} (its job failed there)")
        if kind == b"E":
            raise UnavailableError(f"job {key.job}: host {peer} posted stream {key.hop} of step {key.step}, "
                                   f"but the memory it named could not be loaded here "
                                   f"({payload.decode(errors='replace')}): its agent went away")
        return item

    # -- memory ------------------------------------------------------------------------------------------------

    def _scratch(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` from the transport's `Pool`; `_unscratch` gives it back."""
        return self._pool.take(nbytes)

    def _unscratch(self, buf: np.ndarray) -> None:
        self._pool.put(buf)

    def _source(self, data) -> tuple[int, Any, np.ndarray | None]:
        """Where a chunk is written from: its own buffer where that is a view into a host buffer worth registering,
        else a registered staging copy. Returns (address, what to keep alive until the WRITE ends, staging)."""
        owner, flat = owner_of(data)
        if owner is not None and (owner.nbytes > flat.nbytes or flat.nbytes >= STAGE_REGISTER_BYTES):
            self._memory.register(owner)
            return shm.address_of(flat), data, None
        staged = self._scratch(flat.nbytes)
        staged[:flat.nbytes] = flat
        self._memory.register(staged)
        return shm.address_of(staged), None, staged

    # -- transfers ---------------------------------------------------------------------------------------------

    def _write(self, s: Session, peer: str, key: StreamKey, local: tuple[str, np.ndarray],
               remote: tuple[str, np.ndarray], note: bytes):
        """Post one WRITE of the ``local`` descriptors into the ``remote`` ones, each (memory kind, descriptors)."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local[1], local[0]),
                                           agent.get_xfer_descs(remote[1], remote[0]), peer, note)
            state = agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise UnavailableError(f"job {key.job}: a WRITE of stream {key.hop} of step {key.step} to host {peer} "
                                   f"could not start: {e}") from None
        if state == "ERR":
            self._abandon(handle)
            raise UnavailableError(f"job {key.job}: a WRITE of stream {key.hop} of step {key.step} to host {peer} "
                                   f"failed as it was posted (NIXL state ERR)")
        self._progress.track(handle)
        return handle

    def _complete(self, s: Session, peer: str, key: StreamKey, handle, timeout: float) -> None:
        """Wait until ``handle``'s WRITE is done (`Progress.wait`); `UnavailableError` naming the host when it fails
        or hangs."""
        def check() -> None:
            try:
                s.check()
            except BaseException:
                self._abandon(handle)
                raise

        limit = min(timeout, self._limit())
        state = self._progress.wait(("xfer", handle), lambda: self._progress.state(handle), check,
                                    time.monotonic() + limit)
        if state == "DONE":
            self._release(handle)
            return
        self._abandon(handle)
        if state == "ERR":
            raise UnavailableError(f"job {key.job}: a WRITE of stream {key.hop} of step {key.step} to host "
                                   f"{peer} failed (NIXL state ERR): the peer's agent went away or its "
                                   f"memory is no longer registered")
        raise UnavailableError(f"job {key.job}: a WRITE of stream {key.hop} of step {key.step} to host "
                               f"{peer} did not finish within {limit:g}s")

    def _release(self, handle) -> None:
        self._progress.release(handle)

    def _abandon(self, handle) -> None:
        """Release ``handle``, which NIXL cancels where the WRITE is still under way."""
        try:
            self._release(handle)
        except Exception as e:  # noqa: BLE001 - a handle NIXL cannot cancel is freed with the agent
            log.debug("host %s: a WRITE could not be released: %s", self.host, e)

    # -- primitives ------------------------------------------------------------------------------------------

    def open(self, s: Session, key: StreamKey, peer: str) -> Outgoing:
        self._require_peer(s, peer)
        return NixlOut(self, s, key, peer)

    def _landing(self, box: Box, nbytes: int, place: Callable[[Box], tuple[str, Any] | None], peer: str) -> Landing:
        """The region ``box`` lands in: its runs in the buffers ``place`` offers (a tile, or a bucket's members'
        tiles) where they hold it all (unregistered where they are shared segments ``peer`` copies into), else a
        registered scratch buffer; a box bound for a region of a GPU tile, a registered GPU buffer (`DeviceLanding`):
        the receiver copies it into the tile on the GPU, digesting it in the same pass."""
        got = place(box)
        if got is not None and is_cuda(got[1]):
            buf = self._device_pool.take(nbytes, got[1].device)
            return DeviceLanding(buf, nbytes, self._memory.register_device(buf), self._device_pool)
        most = max(1, nbytes // self.min_run_bytes)
        keys = views = None
        if got is not None and isinstance(got[1], Segments):  # a whole bucket: its runs, owners and views at once
            seg, found = segment_runs(got[1], most), None
            if seg is not None:
                owners, keys, runs, views = seg
                found = (got[0], owners, runs, True)
        else:  # `place_runs` asks for the whole box first: its answer is ``got``, not asked for again
            found = place_runs(box, lambda b: got if b == box else place(b), most)
        # only into buffers the store's recycler keeps (`RECYCLE_MIN_BYTES`): a smaller tile is fresh memory every
        # run, to register and announce each time, and freed after, which leaves peers knowing memory that
        # malloc hands out again (`Registry.usable`)
        if found is not None and all(o.nbytes >= RECYCLE_MIN_BYTES for o in found[1]):
            device, owners, runs, segments = found
            if self.shared.copies(peer) and all(shm.segment_of(o) is not None for o in owners):
                return Landing(owners, runs, device, [], segments=segments, views=views)
            registrations = self._memory.register_usable(owners, keys)
            if registrations is not None:
                return Landing(owners, runs, device, registrations, segments=segments, views=views)
        buf = self._scratch(nbytes)
        return Landing([buf], [(shm.address_of(buf), nbytes)], None, [self._memory.register(buf)],
                       lambda: self._unscratch(buf))

    def digest_ahead(self, view) -> bool:
        """A strided region goes from its own runs, unpacked, unless they average under `SOURCE_RUN_BYTES`
        (`NixlOut.put_region`); and where every stream crosses a NIC that hashing outpaces (`hash_in_stream`), each
        box is digested chunk by chunk as it goes."""
        if self.hash_in_stream:
            return False
        return super().digest_ahead(view) or source_runs(view, max(1, view.nbytes // SOURCE_RUN_BYTES)) is not None

    def prepost(self, s: Session, key: StreamKey, peer: str, box: Box, place) -> bool:
        """Post stream ``key`` now, before the lane that takes it runs: `arrivals` finds the post made. A run's first
        receives are posted so as it begins (`moves.prepost`, from `Runtime._in_order`), not as each of its lanes
        wakes (on cores that agents share, a lane took 3-16 ms to wake). A delta frame is posted by its lane."""
        if s.delta(key.step) is not None:
            return False
        self._require_peer(s, peer)
        posted = self._post(s, key, peer, box, place)
        with self._lock:
            self._preposted[key] = posted
        return True

    def arrivals(self, s: Session, key: StreamKey, peer: str, box: Box, place) -> Iterator:
        """Post the region the box lands in (unless `prepost` did), then yield each chunk once it landed, in stream
        order, then the trailer (see the module table)."""
        self._require_peer(s, peer)
        with self._lock:
            posted = self._preposted.pop(key, None)
        yield from self._receive(s, key, peer, posted if posted is not None else self._post(s, key, peer, box, place))

    def _post(self, s: Session, key: StreamKey, peer: str, box: Box, place) -> _Posted:
        """Make the region the box lands in and post it to ``peer`` (see the module table)."""
        delta = s.delta(key.step)  # a delta frame (`deltas`) lands in scratch of the most it may take; it may be less
        nbytes = delta.limit if delta is not None else boxes.volume(box) * s.dtype(key.step)[1].itemsize
        landing = self._landing(box, nbytes, place, peer) if nbytes else None
        posted = _Posted(peer, landing, nbytes, [])  # offered: secrets a peer may fetch the box's segments by
        try:
            runs = np.empty((0, 2), dtype=np.uint64)  # an empty box is posted too (`nixl_out.NixlOut.end`)
            if landing is not None:
                runs = np.column_stack((np.asarray(landing.addrs, dtype=np.uint64),
                                        np.diff(np.asarray(landing.cum, dtype=np.uint64))))
            # A buffer's metadata goes to a peer with the first post that names it, and a post that names it later
            # goes without: the two must leave in that order, or the peer may WRITE into memory it cannot find yet
            # (NIXL_ERR_NOT_FOUND) while two streams post regions of one new tile at once.
            with self._post_lock:
                metadata = b"" if landing is None else \
                    blobs([self._memory.metadata_for(r, peer) for r in landing.registrations])
                in_place = landing is not None and landing.device is not None  # not scratch: its tiles may be shared
                offer = self.shared.offer(peer, landing.owners if in_place else None, posted.offered,
                                          only=in_place and not landing.registrations)
                vram = landing is not None and landing.vram
                device = (landing.buf.device.index or 0) if vram else 0
                self._progress.expect(peer, key)
                self._notify(peer, encode(b"D", key, POST.pack(device, len(metadata), len(offer), vram,
                                                               self.incarnation) + metadata
                                          + offer + runs.tobytes()))
        except BaseException:
            self._unpost(key, posted)
            raise
        return posted

    def _unpost(self, key: StreamKey, posted: _Posted) -> None:
        """Release what a post holds: the stream ended here, taken or not."""
        self._progress.ended(posted.peer, key)
        self.shared.withdraw(posted.offered)
        if posted.landing is not None:
            posted.landing.release()

    def _receive(self, s: Session, key: StreamKey, peer: str, posted: _Posted) -> Iterator:
        """Yield each chunk of posted stream ``key`` once it landed, in stream order, then the trailer."""
        landing, nbytes, offered = posted.landing, posted.nbytes, posted.offered
        try:
            waiting: dict[int, tuple[Box, int]] = {}
            got = chunks = 0
            trailer = None
            while trailer is None or chunks < trailer[2]:
                # the first notification may wait as long as the stream may take (the sender's lanes may be busy
                # with an earlier unit), each later one the stall limit
                kind, payload = self._await(s, peer, "in", key, "sent nothing more of" if got else "sent nothing of",
                                            self._limit() if got else self.timeout_s)
                if kind == b"T":
                    trailer = TRAILER.unpack_from(payload)
                    continue
                if kind in (b"c", b"s"):  # the last chunk, the trailer riding on it
                    trailer = TRAILER.unpack_from(payload)
                    kind, payload = kind.upper(), payload[TRAILER.size:]
                off, n, ndim = CHUNK.unpack_from(payload)
                if landing is None or off + n > nbytes:
                    raise InvalidArgumentError(f"job {key.job}: host {peer} wrote bytes {off}..{off + n} of stream "
                                               f"{key.hop} of step {key.step}, whose box holds {nbytes}")
                if offered:  # the peer has what it maps by now, or WRITEs instead: no secret outlives its use
                    self.shared.withdraw(offered)
                if kind == b"S":
                    self.shared.copied_in(peer, n)
                waiting[off] = (box_of(payload[CHUNK.size:], ndim), n)
                while got in waiting:
                    sub, n = waiting.pop(got)
                    yield Piece(sub, landing.piece(got, n), None, landing.device)
                    got += n
                    chunks += 1
            yield Trailer(trailer[0], trailer[1], landing is not None and landing.vram)
        finally:
            self._unpost(key, posted)
