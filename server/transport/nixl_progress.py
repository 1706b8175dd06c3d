"""The progress of one NIXL agent: a single thread that polls it while anything waits on it or a WRITE is under way,
files each notification under its stream and wakes the one thread waiting for that stream or that WRITE.

NIXL runs here with no progress thread of its own (an idle agent would burn a core) and offers no descriptor to
block on: its notifications arrive, and a WRITE's own notification leaves, only while something polls the agent.
Each waiting thread used to poll for itself, backing off from 20 us to 1 ms; with a move's streams waiting at once
on 2 cores shared by 8 agents that was about 5,000 wake-ups per agent and sync (bench/moe_sync.py on loopback,
five times the collective transport's), each one a pass through the interpreter for the GIL. Now one thread polls
with such a backoff (`Backoff`, from `shortest_pause`: a 40th of a chunk's time on the NIC), and a waiter sleeps on
its own event until its notification or its WRITE's end is found, or its job fails (`wake_all`: the transport has
each job's session call it as the job fails), or for at most `CHECK_S` between looks at its job and its deadline. A
waiter leaves the polling of its WRITE to the thread too: each of NIXL's checks of a WRITE runs UCX's progress loop.
With nothing waiting and no WRITE under way the thread blocks: an idle agent still burns nothing.

The thread also polls while an incoming stream this agent posted has not all landed, and confirms it (``K``) as its
last chunk and trailer land, counting them as it files them: the sender waits for that word, and the stream's reader
may be busy for seconds yet with what already landed (forwarding it down a chain, or copying it into its tile).

A post (``D``) names the poster's incarnation and carries the memory it registered since as NIXL partial metadata,
which loads only into that incarnation's whole metadata. A job's hosts prepare inside their Execute, so a post may
come before this agent's own Prepare introduced the poster (`NixlTransport.add_peer`), or, where the poster's agent
restarted, while this agent still knows the one before it: such a post is held, unread, until its incarnation is
introduced (`admit`), then routed in the order it came; one for an incarnation introduced since is dropped (its
agent is gone). Loaded into nothing or into the old agent's entry, its memory would be lost while the poster, which
tracks what each peer was told, never sends it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from reshard.proto.errors import UnavailableError
from reshard.server.transport.nixl_memory import POST, TRAILER, decode, encode, unblob

__all__ = ["Backoff", "Progress", "CHECK_S", "shortest_pause"]

log = logging.getLogger(__name__)

POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3
# The poll's shortest pause, as a share of a chunk's time on the NIC (`shortest_pause`)
PAUSE_OF_CHUNK = 1 / 40
# A waiter looks at its job and deadline at least this often, woken or not: a failed job wakes its waiters at once
# (`Progress.wake_all`), so this is a safety net, not the way a failure is noticed. At 20 ms the weight-sync bench's
# waits (776 per sync on the emulated hosts, some of them a whole sync long) took 126 ms of the agents' CPU per sync,
# 95 ms at 250 ms (a timing wrapper around `Progress.wait` in every agent).
CHECK_S = 0.25
LINGER_S = 0.02
ENDED_KEPT = 4096  # ended jobs whose late notifications are dropped
FINISHED = ("DONE", "ERR")
# Posts held for peers not yet introduced (`Progress.admit`); beyond this many, the oldest of the peer holding the
# most is dropped (its stream then fails naming the host, as for a post that never came)
HELD_MAX = 4096
CHUNKS = (b"C", b"S", b"c", b"s")  # the notifications of an incoming stream that say a chunk landed
TRAILERS = (b"T", b"c", b"s")  # those that carry its trailer (``c``, ``s``: riding on the last chunk)

T = TypeVar("T")


def shortest_pause(chunk_bytes: int, nic_gbps: float) -> float:
    """The poll's pause after a poll that found something: `PAUSE_OF_CHUNK` of a chunk's time at the NIC's rate,
    from `POLL_MIN_S` to `POLL_MAX_S`. Each poll is a pass through the interpreter and two calls into NIXL, and
    after each find the pause doubles back up to `POLL_MAX_S`, so a 20 us start costs about seven polls per
    notification; where a chunk takes milliseconds on the link (1 MiB on 1 Gbit/s: 8 ms), a notification found
    200 us late costs the link nothing (a stream keeps a second WRITE in flight, `nixl_out.WINDOW`), and the polls
    it saves are CPU that agents sharing cores spend on moving bytes. bench/link_timeline.py's nixl sync on the
    emulated 1 Gbit/s hosts (medians of three runs, rounds alternating): with 200 us for every agent the service's
    CPU took 1.66 s against 1.93 at 20 us and 1.44 against 1.57, the sync 1.059 s against 1.121 and 1.005 against
    1.008; with this rule against 20 us, three rounds, 1.350, 1.108 and 1.190 s against 1.194, 1.208 and 1.237, CPU
    2.18, 1.89 and 2.02 s against 2.05, 1.98 and 2.16: no loss, a gain within this machine's noise.
    bench/transport.py on loopback with 200 us: unchanged (loopback agents' 10 Gbit/s and 4 MiB chunks give 84 us).
    A 400 Gbit/s NIC's 16 MiB chunk takes 0.34 ms: 20 us there, as before."""
    chunk_s = chunk_bytes * 8 / (nic_gbps * 1e9) if nic_gbps > 0 else 0.0
    return min(POLL_MAX_S, max(POLL_MIN_S, chunk_s * PAUSE_OF_CHUNK))


class Backoff:
    """A poll's pause: ``least`` while things happen, doubling to `POLL_MAX_S` while nothing does."""

    def __init__(self, least: float = POLL_MIN_S):
        self.least = least
        self.pause = least

    def idle(self) -> None:
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, POLL_MAX_S)

    def busy(self) -> None:
        self.pause = self.least


class Progress:
    """The notifications and WRITEs of one NIXL ``agent`` (the transport's, named ``host``): its inbox by
    (peer, role, stream key), its WRITEs under way, and the thread that polls them (see the module docstring)."""

    def __init__(self, agent, host: str, least_pause_s: float = POLL_MIN_S):
        self.agent = agent
        self.host = host
        self.least_pause_s = least_pause_s  # the thread's pause after a poll that found something (`Backoff`)
        self._lock = threading.Lock()  # inbox, ended jobs, waiters' events
        self._pump_lock = threading.Lock()  # one thread takes and routes the agent's notifications at a time
        # WRITEs under way: NIXL sends a WRITE's notification only when a poll of its state finds it done, so every
        # poll polls them all (a ring's sender waits for the next round's post while its last round's WRITEs still
        # need polls); a handle leaves the set, under the lock, before its release
        self._xfer_lock = threading.Lock()
        self.inflight: set = set()
        self._finished: dict[Any, str] = {}  # handle -> DONE or ERR, as a poll found it, until its release
        self._inbox: dict[tuple, deque] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._events: dict[Hashable, threading.Event] = {}
        # A thread waits for one thing at a time: its event is made once and reused (a wait is per chunk). A waker
        # that looked it up as the last wait ended may still set it; the next wait then looks once more, no harm.
        self._own = threading.local()
        self._idle = threading.Condition()  # the thread sleeps on it while nothing waits and nothing is under way
        self._waiting = 0
        self._asleep = False  # the thread waits on ``_idle``: only then does a new waiter or WRITE notify it
        self._thread: threading.Thread | None = None
        self._closed = False
        # peer -> the incarnation introduced (`admit`), and the posts held until theirs is: (incarnation, job, msg)
        # in the order they came; both change under the pump's lock, so a held post is routed before any later one
        self._incarnations: dict[str, bytes] = {}
        self._held: dict[str, deque] = {}
        self.held_dropped = 0  # held posts dropped: of an incarnation gone, or beyond `HELD_MAX`
        # incoming streams not yet confirmed: (peer, "in", key) -> [chunks landed, chunks the trailer names or None]
        self._landed: dict[tuple, list] = {}

    # -- notifications ---------------------------------------------------------------------------------------

    def notify(self, peer: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(peer, msg)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise UnavailableError(f"agent {self.host} could not notify host {peer} over NIXL: {e}") from None

    def pump(self) -> bool:
        """Poll the WRITEs under way, take the agent's new notifications (both make progress), file each under its
        stream and wake whoever waits for it; whether anything came. Routing happens under the pump's lock, so a
        post's metadata is loaded before a later post that relies on it is filed."""
        if not self._pump_lock.acquire(blocking=False):
            return False
        try:
            agent = self.agent
            if agent is None:
                return False
            ended = []
            with self._xfer_lock:
                for handle in self.inflight:
                    if handle not in self._finished:
                        state = self._poll(handle)
                        if state in FINISHED:
                            self._finished[handle] = state
                            ended.append(handle)
            notifs = agent.get_new_notifs()
            for peer, msgs in notifs.items():
                peer = peer.decode() if isinstance(peer, bytes) else peer
                for msg in msgs:
                    self._route(peer, msg)
            for handle in ended:
                self._wake(("xfer", handle))
            return bool(notifs) or bool(ended)
        finally:
            self._pump_lock.release()

    def _route(self, peer: str, msg: bytes) -> None:
        kind, key, payload = decode(msg)
        if kind == b"D":
            _, mdlen, _, _, incarnation = POST.unpack_from(payload)
            if self._incarnations.get(peer) != incarnation:
                self._hold(peer, incarnation, key.job, msg)
                return
            try:
                for blob in unblob(payload[POST.size:POST.size + mdlen]):  # memory the peer registered since: known
                    self.agent.add_remote_agent(blob)  # here before any WRITE into it
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types (the peer went away meanwhile)
                # the stream that waits for this post fails naming the host, not whichever stream was polling
                kind, payload = b"E", f"{type(e).__name__}: {e}".encode()
        role = "out" if kind in (b"D", b"K", b"E") else "in"
        waiter = (peer, role, key)
        with self._lock:
            if key.job in self._ended:
                return
            self._inbox.setdefault(waiter, deque()).append((kind, payload))
            event = self._events.get(waiter)
            confirm = role == "in" and self._landing(waiter, kind, payload)
        if event is not None:
            event.set()
        if confirm:
            self._confirm(peer, key)

    def _landing(self, waiter: tuple, kind: bytes, payload) -> bool:
        """Count a notification of an incoming stream; whether every chunk it will have and its trailer are here now
        (under the lock)."""
        if kind == b"X":
            self._landed.pop(waiter, None)
            return False
        landed = self._landed.get(waiter)
        if landed is None:  # not posted here, or given up
            return False
        if kind in CHUNKS:
            landed[0] += 1
        if kind in TRAILERS:
            landed[1] = TRAILER.unpack_from(payload)[2]
        if landed[0] != landed[1]:
            return False
        del self._landed[waiter]
        return True

    def expect(self, peer: str, key) -> None:
        """This agent posted incoming stream ``key`` from ``peer``: count what lands of it, and poll until it all
        did, whether or not its reader waits (`ended` stops that)."""
        with self._lock:
            self._landed[peer, "in", key] = [0, None]
        with self._idle:
            self._start()

    def ended(self, peer: str, key) -> None:
        """Incoming stream ``key`` from ``peer`` ended here, whether all of it landed or not."""
        with self._lock:
            self._landed.pop((peer, "in", key), None)

    def _confirm(self, peer: str, key) -> None:
        """Tell the sender that every chunk of its stream and the trailer landed (``K``, `nixl_out.NixlOut.wait`):
        as they land, not once the receiver took them in, so a sender never waits on a receiver that is busy
        forwarding or copying what already arrived (a cold kimi-k2 sync on the emulated hosts failed about one
        time in three so: a sender waited over the stall limit for a serving host whose lanes were full)."""
        try:
            self.notify(peer, encode(b"K", key))
        except UnavailableError as e:  # the sender's own wait then fails naming this host
            log.debug("%s", e)

    def _hold(self, peer: str, incarnation: bytes, job: str, msg: bytes) -> None:
        """Keep a post until ``peer``'s ``incarnation`` is introduced (see the module docstring); under the pump's
        lock."""
        with self._lock:
            if job in self._ended:
                return
        held = self._held.setdefault(peer, deque())
        held.append((incarnation, job, msg))
        if sum(map(len, self._held.values())) > HELD_MAX:
            oldest = max(self._held.values(), key=len)
            _, job, _ = oldest.popleft()
            self.held_dropped += 1
            log.warning("agent %s dropped a post of job %s held for a peer not yet introduced: more than %d held",
                        self.host, job, HELD_MAX)

    def admit(self, peer: str, incarnation: bytes) -> None:
        """``peer``'s ``incarnation`` is introduced (its whole metadata loaded): route the posts held for it, in the
        order they came, and drop those of any other incarnation."""
        with self._pump_lock:
            self._incarnations[peer] = incarnation
            held = self._held.pop(peer, ())
            for theirs, job, msg in held:
                if theirs == incarnation:
                    self._route(peer, msg)
                else:
                    self.held_dropped += 1
                    log.info("agent %s dropped a post of job %s from an agent of host %s that is gone", self.host,
                             job, peer)

    def forget(self, peer: str) -> None:
        """``peer`` is no longer introduced: its posts are held from now on, until it is again."""
        with self._pump_lock:
            self._incarnations.pop(peer, None)

    def introduced(self, peer: str) -> bytes | None:
        """The incarnation of ``peer`` introduced here (`admit`), or None."""
        return self._incarnations.get(peer)

    def held(self) -> int:
        """Posts held now for peers not yet introduced."""
        with self._pump_lock:
            return sum(map(len, self._held.values()))

    def take(self, peer: str, role: str, key) -> tuple[bytes, bytes] | None:
        """The oldest notification filed under (peer, role, key), or None."""
        with self._lock:
            q = self._inbox.get((peer, role, key))
            if not q:
                return None
            item = q.popleft()
            if not q:
                del self._inbox[peer, role, key]
            return item

    def linger(self) -> None:
        """Make progress a moment longer, so the last message this agent sent (a cancel) leaves it."""
        backoff, end = Backoff(), time.monotonic() + LINGER_S
        while time.monotonic() < end:
            self.pump()
            backoff.idle()

    def detach(self, job: str) -> None:
        """Drop what is left of the job's notifications, and those that come late."""
        with self._lock:
            self._ended[job] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            for k in [k for k in self._inbox if k[2].job == job]:
                del self._inbox[k]
            for k in [k for k in self._landed if k[2].job == job]:
                del self._landed[k]
        with self._pump_lock:
            for peer, held in list(self._held.items()):
                kept = deque(h for h in held if h[1] != job)
                if kept:
                    self._held[peer] = kept
                else:
                    del self._held[peer]

    # -- waiting -----------------------------------------------------------------------------------------------

    def wait(self, waiter: Hashable, ready: Callable[[], T | None], check: Callable[[], None],
             deadline: float) -> T | None:
        """``ready()``'s first result that is not None, or None once ``deadline`` (monotonic) passed; ``ready`` runs
        whenever the poll finds something for ``waiter`` (a (peer, role, stream key) or ("xfer", handle)), and with
        ``check`` (which raises to stop waiting) at least every `CHECK_S`."""
        event = getattr(self._own, "event", None)
        if event is None:
            event = self._own.event = threading.Event()
        event.clear()
        with self._lock:
            self._events[waiter] = event
        self._enter()
        try:
            while True:
                got = ready()
                if got is not None:
                    return got
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                event.wait(min(CHECK_S, left))
                event.clear()  # what set it is found by the next ready()
        finally:
            with self._lock:
                if self._events.get(waiter) is event:
                    del self._events[waiter]
            self._leave()

    def wake_all(self) -> None:
        """Wake every waiter, to look at its job and deadline now: a job failed (`NixlTransport` watches each job's
        session), or the agent closes."""
        with self._lock:
            events = list(self._events.values())
        for event in events:
            event.set()

    def _wake(self, waiter: Hashable) -> None:
        with self._lock:
            event = self._events.get(waiter)
        if event is not None:
            event.set()

    def _enter(self) -> None:
        with self._idle:
            self._waiting += 1
            self._start()

    def _leave(self) -> None:
        with self._idle:
            self._waiting -= 1

    def _start(self) -> None:
        """Start the thread (under ``_idle``) or wake it."""
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"nixl-progress-{self.host}", daemon=True)
            self._thread.start()
        elif self._asleep:
            self._idle.notify()

    def _busy(self) -> bool:
        return bool(self._waiting) or bool(self._landed) or len(self.inflight) > len(self._finished)

    def _run(self) -> None:
        backoff = Backoff(self.least_pause_s)
        while True:
            with self._idle:
                while not self._closed and not self._busy():
                    self._asleep = True
                    self._idle.wait()
                    self._asleep = False
                if self._closed:
                    return
            try:
                progressed = self.pump()
            except Exception:  # noqa: BLE001 - a poll that fails is a stream's error, met where it waits
                log.exception("host %s: polling NIXL failed", self.host)
                progressed = False
            if progressed:
                backoff.busy()
            else:
                backoff.idle()

    # -- WRITEs ------------------------------------------------------------------------------------------------

    def track(self, handle) -> None:
        """A WRITE was posted: polled from now on, until its `release`."""
        with self._xfer_lock:
            self.inflight.add(handle)
        with self._idle:  # notifies the thread only where it sleeps: else it is polling, and finds it
            self._start()

    def state(self, handle) -> str | None:
        """DONE or ERR once the thread's poll found the WRITE ended, else None. The thread polls every WRITE under
        way (`track`) and wakes its waiter; a poll here as well would run UCX's progress loop once more (about 500
        polls per weight sync on the emulated hosts, 33 us each)."""
        with self._xfer_lock:
            state = self._finished.get(handle)
        return "ERR" if state is None and self._closed else state  # closed: nothing polls it any more

    def _poll(self, handle) -> str:
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types (NIXL_ERR_REMOTE_DISCONNECT)
            log.debug("host %s: a WRITE failed: %s", self.host, e)  # its own stream meets it and names the host
            return "ERR"

    def release(self, handle) -> None:
        with self._xfer_lock:
            self.inflight.discard(handle)
            self._finished.pop(handle, None)
        self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Stop the thread; the agent goes with the transport."""
        with self._idle:
            self._closed = True
            self._idle.notify_all()
            thread = self._thread
        self.wake_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        self.agent = None
