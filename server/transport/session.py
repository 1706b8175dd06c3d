"""One job on one host, as its transport sees it: the `Session` (ids, dtypes, peers, the first failure) and the
`Traffic` it counts."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.proto.layout import np_dtype

if TYPE_CHECKING:
    from reshard.routes import PairStreams
    from reshard.server.transport.deltas import DeltaStream
    from reshard.server.transport.streams import StreamKey

__all__ = ["Session", "SharedFrames", "Traffic", "dtype_pairs_of"]


class Traffic:
    """Bytes a host moved for one job: over the network per peer host, and between its own devices; and, per program
    tensor that moved as deltas (`deltas`), the frame bytes it sent and what full streams would have carried."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_in: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)
        self.local_bytes = 0
        self.sent = 0  # as a transfer's sender: what progress reports (``reshard.cost.sender_bytes``)
        self.native_reduces = 0  # reduces run as the transport's own all-reduce (`Transport.all_reduce`)
        self.delta_wire: dict[str, int] = defaultdict(int)  # program tensor -> delta frame bytes sent (every hop)
        self.delta_full: dict[str, int] = defaultdict(int)  # program tensor -> what full streams would have sent

    def add_in(self, peer: str, n: int) -> None:
        with self._lock:
            self.bytes_in[peer] += n

    def add_out(self, peer: str, n: int, origin: bool) -> None:
        with self._lock:
            self.bytes_out[peer] += n
            if origin:
                self.sent += n

    def add_delta(self, wire: dict[str, int], full: dict[str, int], sent: int = 0) -> None:
        """A delta stream went out (`deltas.send_frame`, or forwarded): its frame bytes and full bytes per tensor
        (its bytes on the wire are counted by ``add_out`` as they go). ``sent``, the full box's bytes of a stream
        this host originated, counts toward progress, whose total counts full moves."""
        with self._lock:
            for t, n in wire.items():
                self.delta_wire[t] += n
            for t, n in full.items():
                self.delta_full[t] += n
            self.sent += sent

    def add_native_reduce(self) -> None:
        with self._lock:
            self.native_reduces += 1

    def add_local(self, n: int, origin: bool = True) -> None:
        with self._lock:
            self.local_bytes += n
            if origin:
                self.sent += n


def dtype_pairs_of(dtypes: dict[int, str]) -> dict[int, tuple[str, np.dtype]]:
    """Each step's dtype name and its numpy dtype, as a `Session` keeps them."""
    return {step: (name, np_dtype(name)) for step, name in dtypes.items()}


class SharedFrames:
    """A run's delta frames (`deltas.encode_frame`) that more than one of its move steps send from one device with
    the same segments (a star's streams: one p2p step per receiving host, each of the same box), encoded once and
    sent down each: a star's sender otherwise diffed the box once per receiver, where a chain's relays forward the
    frame they got. `expect` counts the steps a key's frame serves (as the run is built); `frame` encodes it for the
    first to ask (the others wait for it) and forgets it once the last has it, so a shared frame is held until its
    last stream takes it. A failed encode is raised in every step that asks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users: dict[tuple, int] = defaultdict(int)  # key -> the steps still to take its frame
        self._made: dict[tuple, Future] = {}

    def expect(self, key: tuple) -> None:
        """One more step sends the frame of ``key``."""
        with self._lock:
            self._users[key] += 1

    def frame(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The frame of ``key``: ``make()``'s, made once for every step `expect` counted."""
        with self._lock:
            left = self._users.get(key, 0)
            if left <= 1:  # a frame no other step sends, or the last of those that do
                self._users.pop(key, None)
                made = self._made.pop(key, None)
            else:
                self._users[key] = left - 1
                made = self._made.get(key)
                if made is None:
                    made = self._made[key] = Future()
                    made.set_running_or_notify_cancel()
                    mine = True
                else:
                    mine = False
        if left <= 1:
            return make() if made is None else made.result()
        if mine:
            try:
                made.set_result(make())
            except BaseException as e:
                made.set_exception(e)
                raise
        return made.result()


class Session:
    """One job on one host, as its transport sees it: ids, dtype, peers, traffic and the first failure.

    ``dtypes`` gives each step's dtype (the dtype of the tensor it moves or reduces). ``deltas`` (step ->
    `deltas.DeltaStream`, filled by the agent's run) names the move steps whose streams carry delta frames.
    ``streams`` numbers every stream of the job (step -> its first stream number, see
    `reshard.routes.stream_count`; ``num_streams`` in all) for transports that tag messages, and
    ``pair_streams`` (`reshard.routes.PairStreams`) numbers them anew between each pair of hosts, for tags of few
    bits. The agent's runtime extends it.
    """

    def __init__(self, job: str, program_id: str, dtypes: dict[int, str], peers: dict[str, str], *,
                 generation: int = 0, seq: int = 0, streams: dict[int, int] | None = None, num_streams: int = 0,
                 push_tickets: dict[str, str] | None = None, dtype_pairs: dict | None = None,
                 pair_streams: PairStreams | None = None):
        self.job = job
        self.program_id = program_id  # the id of the plan or program the agent was handed
        # step -> (dtype name, numpy dtype); ``dtype_pairs`` gives them worked out already (`dtype_pairs`)
        self._dtypes = dtype_pairs if dtype_pairs is not None else dtype_pairs_of(dtypes)
        self.peers = dict(peers)
        self.push_tickets = dict(push_tickets or {})  # peer host -> the planner's ticket for pushes to it
        self.generation = generation
        self.seq = seq
        self.streams = streams or {}
        self.num_streams = num_streams
        self.pair_streams = pair_streams
        self.traffic = Traffic()
        self.deltas: dict[int, DeltaStream] = {}
        self.frames = SharedFrames()  # the delta frames several of its steps send (the agent's run counts them)
        self.failed: BaseException | None = None
        self._fail_lock = threading.Lock()
        self._on_fail: set[Callable[[], None]] = set()  # `watch`: called once, as the first failure is recorded

    def fail(self, error: BaseException) -> BaseException:
        """Record ``error`` unless an earlier failure was; returns the one that counts."""
        with self._fail_lock:
            if self.failed is not None:
                return self.failed
            self.failed = error
            watchers, self._on_fail = self._on_fail, set()
        for cancel in watchers:
            cancel()
        return error

    def watch(self, cancel: Callable[[], None]) -> None:
        """Call ``cancel`` when the job fails (at once, if it has): what a thread blocked in a call, which cannot
        look at `check` between pieces, is stopped by. `unwatch` drops it."""
        with self._fail_lock:
            if self.failed is None:
                self._on_fail.add(cancel)
                return
        cancel()

    def unwatch(self, cancel: Callable[[], None]) -> None:
        with self._fail_lock:
            self._on_fail.discard(cancel)

    def check(self) -> None:
        """Raise the job's failure, if any: every loop calls this between pieces, which is how a job cancels."""
        if self.failed is not None:
            raise self.failed

    def stream(self, key: StreamKey) -> int:
        return self.streams.get(key.step, 0) + key.hop

    def pair_stream(self, key: StreamKey, src: str, dst: str) -> int:
        """The stream's number among those from host ``src`` to host ``dst`` (`pair_streams`), or its job-wide
        number where the session has no such numbering."""
        if self.pair_streams is None:
            return self.stream(key)
        return self.pair_streams.number(src, dst, self.stream(key))

    def delta(self, step: int) -> DeltaStream | None:
        """Move step ``step``'s delta stream, or None where it moves whole."""
        return self.deltas.get(step)

    def dtype(self, step: int) -> tuple[str, np.dtype]:
        """Step ``step``'s dtype: its reshard name and the numpy dtype that holds its elements."""
        return self._dtypes[step]
