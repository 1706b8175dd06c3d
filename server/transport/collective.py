"""The collective transport: the agents' torch.distributed process group and a plan's bytes over it.

Owns everything that touches torch: the planner's rendezvous store
(`Rendezvous`), an agent's membership in the group (`GroupMember`), and the
data plane (`CollectiveTransport`), which runs one agent's part of a phase with
point-to-point ``send``/``recv`` on the group. The planner decides who the
members are (`reshard.server.planner.membership`); this module only follows it.

=============== ==============================================================================
group           one ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) per generation,
                formed through ``PrefixStore("reshard/g<gen>/pg/", planner store)``; rank =
                index of the host in the members; a failed call closes gloo's pairs, so the
                agent reports the generation broken and the planner re-forms the group
confirm         before a phase's first send or recv, an agent writes
                ``reshard/g<gen>/confirm/<job>/<phase>/<host> = plan id`` and waits, with a
                deadline, for the keys of every peer it will talk to in that phase: a peer
                on another plan or generation raises at once instead of hanging a recv;
                the planner deletes a job's keys when the job ends (`Rendezvous.forget_job`)
stream          one box from one host to the next: chunks (``chunk_boxes``) as raw bytes,
                then a trailer ``uint64[nbytes, xxh3_64]`` (16 bytes); at most ``window`` chunks in flight
tag             ``(job_seq mod 2^11) << 20 | stream``, stream numbered over the plan's
                (transfer, hop) pairs: concurrent jobs and transfers never share a tag
chain           a route host receives chunk k+1 while it forwards chunk k to the next host
                and writes it into its own receivers (the fan-out to local devices)
lanes           a phase's tasks (one per transfer and hop this host takes part in) run on a
                FIFO pool of ``lanes`` threads in one order every host derives from the plan
                (``interleaved``: round-robin over sender and destination host pairs, so the
                tasks running at once load every NIC), so the first unfinished transfer in
                that order always runs on all its hosts: no deadlock, concurrency up to
                ``lanes``, memory at most ``lanes * 2 * window * chunk_bytes``. NCCL
                ignores tags and orders calls per communicator, so it gets one lane
=============== ==============================================================================

Received chunks are checked like the gRPC path's: every byte lands inside the
transfer's box, and the byte count and XXH3-64 digest match the sender's trailer
before the receiver's Execute returns (and so before the planner commits); a
chain's digest is checked end to end by its last hop, which covers every hop's
bytes because each hop forwards from the very buffer it keeps
(`reshard.server.agent.executor.verify_arrival`).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from reshard import box as boxes
from reshard.mesh import host_of
from reshard.plan import Plan, Transfer
from reshard.proto.errors import DeadlineExceededError, FailedPreconditionError, UnavailableError
from reshard.proto.layout import Checksum, chunk_boxes, tile_shape
from reshard.server.agent.executor import corrupt_bit, interleaved, send_bytes, verify_arrival
from reshard.server.common.contract import confirm_prefix
from reshard.server.common.torch_support import require_torch, seconds_delta, torch_available

if TYPE_CHECKING:
    from reshard.server.agent.executor import Executor, _AgentJob
    from reshard.server.common.contract import GroupView

__all__ = ["torch_available", "GroupMember", "CollectiveTransport", "stream_offsets"]

log = logging.getLogger(__name__)

_STREAM_BITS = 20
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
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = seconds_delta(self.op_timeout_s)
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind_host) if self.bind_host
                                 else dist.ProcessGroupGloo.create_default_device()]
                pg = dist.ProcessGroupGloo(prefixed, rank, len(members), opts)
        except Exception as e:  # noqa: BLE001 - reported to the planner, which re-forms the group
            with self._lock:
                if self._target == (view.store_port, gen):
                    self._broken = gen
                    self._target = None
            log.warning("host %s could not form process group generation %d (members %s): %s",
                        self.host, gen, list(members), e)
            return
        with self._lock:
            if self._target != (view.store_port, gen):
                return  # superseded while forming
            self._group = Group(gen, members, pg, store, self.device)
        log.info("host %s joined process group generation %d as rank %d of %d (%s)", self.host, gen, rank,
                 len(members), self.backend)

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

    def mark_broken(self, group: Group, why: str) -> None:
        with self._lock:
            if self._group is group:
                self._group, self._target, self._broken = None, None, group.generation
                log.warning("host %s drops process group generation %d: %s", self.host, group.generation, why)


# -- the data plane ---------------------------------------------------------------------------------


def stream_offsets(plan: Plan) -> list[int]:
    """First stream number of each transfer: p2p has one stream per receiver, broadcast one per route hop."""
    out, n = [], 0
    for t in plan.transfers:
        out.append(n)
        n += len(t.receivers) if t.method == "p2p" else len(t.route) if t.method == "broadcast" else 0
    if n >= 1 << _STREAM_BITS:
        raise FailedPreconditionError(
            f"plan {plan.id[:12]} has {n} streams; the collective transport numbers at most {1 << _STREAM_BITS} "
            f"per job: run it with --transport grpc"
        )
    return out


@dataclass(frozen=True)
class _Task:
    index: int
    transfer: Transfer
    role: str  # "send" (sender: local copies, then its streams) or "recv" (a receiving hop)
    hop: int = 0
    peer: str = ""  # recv: the host sending to us


def _tasks(plan: Plan, phase: int, host: str) -> list[_Task]:
    out = []
    for i, t in interleaved([(i, t) for i, t in enumerate(plan.transfers) if t.phase == phase]):
        src = host_of(t.sender)
        if src == host:
            out.append(_Task(i, t, "send"))
        if t.method == "p2p":
            out += [_Task(i, t, "recv", hop, src) for hop, r in enumerate(t.receivers)
                    if host_of(r) == host and src != host]
        elif t.method == "broadcast":
            chain = [src, *t.route]
            out += [_Task(i, t, "recv", hop, chain[hop]) for hop, h in enumerate(t.route) if h == host]
    return out


def _peers(tasks: list[_Task], host: str) -> set[str]:
    peers = set()
    for task in tasks:
        t = task.transfer
        if task.role == "recv":
            peers.add(task.peer)
            if t.method == "broadcast" and task.hop + 1 < len(t.route):
                peers.add(t.route[task.hop + 1])
        elif t.method == "p2p":
            peers |= {host_of(r) for r in t.receivers if host_of(r) != host}
        elif t.method == "broadcast" and t.route:
            peers.add(t.route[0])
    return peers


class CollectiveTransport:
    """Runs an agent's part of a phase over the process group (see the module table)."""

    def __init__(self, executor: "Executor", member: GroupMember, *, lanes: int, window: int, chunk_bytes: int,
                 confirm_timeout_s: float):
        self.executor = executor
        self.chunk_bytes = chunk_bytes
        self.member = member
        self.torch = member.torch
        self.lanes = 1 if member.backend == "nccl" else lanes
        self.window = max(1, window)
        self.confirm_timeout_s = confirm_timeout_s
        self.op_timeout = seconds_delta(member.op_timeout_s)
        # Chunks are read-only views of shards that arrived as bytes; torch only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

    def execute(self, state: "_AgentJob", phase: int) -> tuple[Callable[[], None], Callable[[], tuple[int, int]]]:
        group = state.group
        plan = state.plan
        tasks = _tasks(plan, phase, self.executor.host)
        offsets = stream_offsets(plan)
        total = send_bytes(plan, self.executor.host, phase)
        base = state.traffic.sent
        pool = ThreadPoolExecutor(self.lanes, thread_name_prefix=f"coll-{state.id[:6]}")
        futures = []

        def run() -> None:
            self._confirm(state, group, phase, _peers(tasks, self.executor.host))
            futures.extend(pool.submit(self._run_task, state, group, task, offsets) for task in tasks)
            done, pending = wait(futures, timeout=self.executor.transfer_timeout_s, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
            if pending:
                raise DeadlineExceededError(
                    f"job {state.id}: {len(pending)} collective transfers of agent {self.executor.host} did not "
                    f"finish in {self.executor.transfer_timeout_s:g}s"
                )

        result: dict[str, BaseException | None] = {"error": None}
        finished = threading.Event()

        def runner() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - handed to wait_all
                result["error"] = e
                state.failed = state.failed or e
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
                finished.set()

        threading.Thread(target=runner, daemon=True, name=f"phase-{state.id[:6]}-{phase}").start()

        def wait_all() -> None:
            finished.wait()
            if result["error"] is not None:
                raise result["error"]

        return wait_all, lambda: (state.traffic.sent - base, total)

    # -- confirm ---------------------------------------------------------------------------

    def _confirm(self, state: "_AgentJob", group: Group, phase: int, peers: set[str]) -> None:
        """Publish this agent's plan id for the phase and check every peer's before any call."""
        me = self.executor.host
        prefix = confirm_prefix(state.generation, state.id, phase)
        mine = state.plan.id
        try:
            self.member.require(state.generation, state.id)
        except FailedPreconditionError as e:
            with group.lock:  # tell the peers at once, so none of them waits for this agent
                group.store.set(prefix + me, f"!{e}")
            raise
        current = group
        with current.lock:
            current.store.set(prefix + me, mine)
        keys = [prefix + p for p in sorted(peers)]
        start = time.monotonic()
        deadline = start + self.confirm_timeout_s
        pause = 0.0005
        while keys:
            if state.failed is not None:
                raise state.failed
            with current.lock:
                ready = current.store.check(keys)
            if ready:
                break
            if time.monotonic() > deadline:
                with current.lock:
                    late = [k.rsplit("/", 1)[1] for k in keys if not current.store.check([k])]
                raise DeadlineExceededError(
                    f"job {state.id}: hosts {late} did not confirm plan {mine[:12]} for phase {phase} on process "
                    f"group generation {state.generation} within {self.confirm_timeout_s:g}s; they may run another "
                    f"generation or have failed, so agent {me} made no collective call"
                )
            time.sleep(pause)
            # Peers start within a few ms of each other: poll fast at first, then back off.
            pause = 0.0005 if time.monotonic() < start + 0.1 else min(pause * 2, 0.02)
        for key in keys:
            with current.lock:
                theirs = current.store.get(key).decode()
            if theirs.startswith("!"):
                raise FailedPreconditionError(
                    f"job {state.id}: host {key.rsplit('/', 1)[1]} cannot run phase {phase}: {theirs[1:]}"
                )
            if theirs != mine:
                raise FailedPreconditionError(
                    f"job {state.id}: host {key.rsplit('/', 1)[1]} confirmed plan {theirs[:12]} for phase {phase}, "
                    f"but agent {me} prepared plan {mine[:12]}; every agent must run the same plan, so no collective "
                    f"call was made"
                )

    # -- streams ------------------------------------------------------------------------------

    def _tag(self, state: "_AgentJob", stream: int) -> int:
        return ((state.job_seq & _SEQ_MASK) << _STREAM_BITS) | stream

    def _wait(self, state: "_AgentJob", group: Group, work, what: str, peer: str) -> None:
        try:
            work.wait(self.op_timeout)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError for every failure
            self.member.mark_broken(group, f"{what} failed")
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            where = (f"job {state.id}: {what} with host {peer} (rank {group.rank_of(peer)} of process group "
                     f"generation {group.generation})")
            if "Timed out" in text or "timeout" in text.lower():
                raise DeadlineExceededError(f"{where} did not finish in {self.op_timeout.total_seconds():g}s: "
                                            f"{text}") from None
            raise UnavailableError(f"{where} failed: {text}") from None

    def _run_task(self, state: "_AgentJob", group: Group, task: _Task, offsets: list[int]) -> None:
        if state.failed is not None:
            raise state.failed
        t = task.transfer
        stream = offsets[task.index] + task.hop
        if task.role == "recv":
            self._receive(state, group, task, stream)
            return
        me = self.executor.host
        array, origin = self.executor._source(state, t.sender, t.box)
        view = array[boxes.to_slices(t.box, origin)]
        nbytes = boxes.volume(t.box) * state.dtype.itemsize
        for r in t.receivers:
            if host_of(r) == me:
                state.write(r, t.box, view)
                state.traffic.add_local(nbytes)
        if t.method == "p2p":
            for hop, r in enumerate(t.receivers):
                if host_of(r) != me:
                    self._send(state, group, task.index, host_of(r), offsets[task.index] + hop, array, origin)
        elif t.method == "broadcast" and t.route:
            self._send(state, group, task.index, t.route[0], offsets[task.index], array, origin)

    def _chunk_tensor(self, data: np.ndarray, group: Group):
        flat = data.reshape(-1).view(np.uint8)
        tensor = self.torch.from_numpy(flat)
        return tensor if group.device.type == "cpu" else tensor.to(group.device, non_blocking=False)

    def _send(self, state: "_AgentJob", group: Group, index: int, peer: str, stream: int, array: np.ndarray,
              origin) -> None:
        t = state.plan.transfers[index]
        dst, tag = group.rank_of(peer), self._tag(state, stream)
        known = state.digests.get(index)  # started at prepare (Executor._digest_sources)
        check = Checksum(digest=known is None)
        pending: deque = deque()
        for sub in chunk_boxes(t.box, state.plan.dtype, self.chunk_bytes):
            if state.failed is not None:
                raise state.failed
            data = np.ascontiguousarray(array[boxes.to_slices(sub, origin)])
            if data.nbytes == 0:
                continue
            self.executor._throttle.wait(data.nbytes)
            check.update(data.reshape(-1).view(np.uint8))
            # Counted when handed to the group (gloo's send work reports completion only on wait):
            # at most ``window`` chunks ahead of the wire, and progress moves chunk by chunk.
            pending.append(group.pg.send([self._chunk_tensor(data, group)], dst, tag))
            state.traffic.add_out(peer, data.nbytes, origin=True)
            if len(pending) >= self.window:
                self._wait(state, group, pending.popleft(), "send", peer)
        xxh3 = known.result() if known is not None else check.xxh3_64
        trailer = self._chunk_tensor(np.array([check.nbytes, xxh3], dtype=np.uint64), group)
        pending.append(group.pg.send([trailer], dst, tag))
        while pending:
            self._wait(state, group, pending.popleft(), "send", peer)

    @staticmethod
    def _in_place(state: "_AgentJob", group: Group, local: list[str], sub) -> tuple[str, np.ndarray | None]:
        """A receiver whose buffer holds ``sub`` contiguously, and that part of it: chunks land there directly
        (no staging buffer, no copy); the other local receivers copy from it, and the next hop is fed from it."""
        if group.device.type != "cpu":
            return "", None
        for r in local:
            tile = state.dst_tiles.get(r)
            if tile is not None and boxes.contains(tile, sub):
                view = state.buffers[r][boxes.to_slices(sub, tile)]
                if view.flags.c_contiguous:
                    return r, view
        return "", None

    def _receive(self, state: "_AgentJob", group: Group, task: _Task, stream: int) -> None:
        torch = self.torch
        t, me = task.transfer, self.executor.host
        src, tag = group.rank_of(task.peer), self._tag(state, stream)
        if t.method == "broadcast":
            local = [r for r in t.receivers if host_of(r) == me]
            nxt = t.route[task.hop + 1] if task.hop + 1 < len(t.route) else None
        else:
            local, nxt = [t.receivers[task.hop]], None
        fwd_rank, fwd_tag = (group.rank_of(nxt), self._tag(state, stream + 1)) if nxt else (0, 0)
        size = state.dtype.itemsize
        subs = [s for s in chunk_boxes(t.box, state.plan.dtype, self.chunk_bytes) if boxes.volume(s)]
        posted: deque = deque()
        forwards: deque = deque()
        nxt_sub = iter(subs)

        def post() -> None:
            sub = next(nxt_sub, None)
            if sub is not None:
                into, view = self._in_place(state, group, local, sub)
                buf = (torch.from_numpy(view.reshape(-1).view(np.uint8)) if into
                       else torch.empty(boxes.volume(sub) * size, dtype=torch.uint8, device=group.device))
                posted.append((sub, buf, into, group.pg.recv([buf], src, tag)))

        for _ in range(self.window):
            post()
        check = Checksum(digest=nxt is None)  # a forwarding hop leaves the digest to the chain's last hop
        while posted:
            sub, buf, into, work = posted.popleft()
            self._wait(state, group, work, "recv", task.peer)
            post()
            if nxt and self.executor.fault == "corrupt-relay" and check.nbytes == 0 and buf.numel():
                buf[0] ^= corrupt_bit(task.hop)
            if nxt:
                forwards.append(group.pg.send([buf], fwd_rank, fwd_tag))
                state.traffic.add_out(nxt, buf.numel(), origin=False)
                if len(forwards) > self.window:
                    self._wait(state, group, forwards.popleft(), "send", nxt)
            host_buf = buf if buf.device.type == "cpu" else buf.cpu()
            raw = host_buf.numpy()
            arr = raw.view(state.dtype).reshape(tile_shape(sub))
            for r in local:
                if r == into:
                    state.mark(r, sub)
                else:
                    state.write(r, sub, arr)
            check.update(raw)
            state.traffic.add_in(task.peer, raw.nbytes)
        trailer = torch.empty(16, dtype=torch.uint8, device=group.device)
        self._wait(state, group, group.pg.recv([trailer], src, tag), "recv", task.peer)
        if nxt:
            forwards.append(group.pg.send([trailer], fwd_rank, fwd_tag))
        nbytes, digest = (int(v) for v in trailer.cpu().numpy().view(np.uint64))
        verify_arrival(state.id, task.index, t, task.hop, check, nbytes, digest, size)
        while forwards:
            self._wait(state, group, forwards.popleft(), "send", nxt)
