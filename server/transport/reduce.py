"""The reduce of a box over an ordered group of devices, for every transport: a ring of point-to-point streams.

A reduce sums (or maxes, `REDUCE_OPS`) one box over the devices of a group, ending
replicated on every device or cut over them (reduce-scatter, `REDUCE_RESULTS`). The ring's
messages are streams keyed ``(job, step, round * group size + sender index)``, sent and
taken with the stream loops of `reshard.server.transport.moves` through the transport's
methods, so every transport has it; a transport whose backend has its own all-reduce may
run a replicated one there (``Transport.all_reduce``: the collective transport's gloo).
The arrays incoming partial parts land in are kept between reduces (``Transport.scratch``,
at most `SCRATCH_KEPT_BYTES`).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.mesh import host_of
from reshard.proto.errors import DataLossError, InvalidArgumentError
from reshard.proto.layout import Checksum, chunk_boxes, tile_shape
from reshard.server.transport.buffers import host_array, host_bytes, region, write
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Outgoing, StreamKey, Trailer, in_thread

if TYPE_CHECKING:
    from reshard.server.transport.base import Transport

__all__ = ["reduce", "ring_reduce", "REDUCE_OPS", "REDUCE_RESULTS", "SCRATCH_KEPT_BYTES"]

REDUCE_OPS = {"sum": np.add, "max": np.maximum}
REDUCE_RESULTS = ("replicate", "shard")
SCRATCH_KEPT_BYTES = 256 * 2**20  # a transport's scratch arrays kept for its next reduces, at most


def reduce(transport: Transport, s: Session, step: int, group: tuple[str, ...], box: Box, op: str, result: str,
           dim: int | None, read: Callable[[str], Any], produce: Callable[[str, Box], tuple[Any, Box]]) -> None:
    """This host's part of a ring reduce of ``box`` over the devices ``group`` (in that order).

    ``read(device)`` is the device's addends, a region shaped like ``box``. With ``result``
    ``replicate`` every device ends with the whole reduced box, with ``shard`` device ``i``
    with chunk ``i`` of it along ``dim`` (``box.chunk``, as ``torch.chunk`` cuts).
    ``produce(device, box)`` is the buffer a device's result goes into and the box it
    holds. The ring cuts the box in ``n`` parts (those chunks, or `box.split` for
    ``replicate``). Round ``r < n - 1`` (reduce-scatter): device ``i`` sends its partial
    part ``(i - r - 1) % n`` to device ``i + 1``, which folds it into its own; afterwards
    device ``i`` holds part ``i`` complete. Rounds ``n - 1 ..`` (all-gather, ``replicate``
    only) pass the complete parts on. Messages between devices of one host are copies; the
    others are streams keyed ``(job, step, round * n + sender index)``.

    Bytes are touched as few times as the ring allows: the first round sends addends as
    they are; a replicated result accumulates in the device's result buffer itself when
    that is host memory, each part written first by the fold of this device's addends
    with the incoming partial part (the old version stays intact, and nothing is copied
    in beforehand); incoming partial parts land in one scratch array reused every round,
    and all-gather parts are received straight into place.

    A replicated reduce goes to the transport's `all_reduce` first: where its backend runs it
    (the collective transport's gloo), that is the reduce, and the ring (`ring_reduce`) does not run.
    """
    if not (result == "replicate" and box and transport.all_reduce(s, step, group, box, op, read, produce)):
        transport.ring_reduce(s, step, group, box, op, result, dim, read, produce)


def ring_reduce(transport: Transport, s: Session, step: int, group: tuple[str, ...], box: Box, op: str, result: str,
                dim: int | None, read: Callable[[str], Any],
                produce: Callable[[str, Box], tuple[Any, Box]]) -> None:
    """`reduce` as the ring of tagged streams its docstring describes."""
    if not box:  # a scalar: the ring runs on its one element as a vector of one
        def produce_one(device: str, _box: Box):
            array, origin = produce(device, ())
            return region(array, (), origin).reshape((1,)), ((0, 1),)

        transport.reduce(s, step, group, ((0, 1),), op, result, 0 if dim is not None else None,
                         lambda d: np.reshape(host_array(read(d)), (1,)), produce_one)
        return
    fold = _bfloat16_fold(REDUCE_OPS[op]) if s.dtype(step)[0] == "bfloat16" else REDUCE_OPS[op]
    dtype = s.dtype(step)[1]
    n = len(group)
    shape = tile_shape(box)
    parts = boxes.chunk(box, n, dim) if result == "shard" else boxes.split(box, n)
    mine = [i for i, d in enumerate(group) if host_of(d) == transport.host]
    addends = {i: np.frombuffer(host_bytes(read(group[i])), dtype=dtype).reshape(shape) for i in mine}
    outs = {i: produce(group[i], box) for i in mine} if result == "replicate" else {}
    acc: dict[int, np.ndarray] = {}
    in_place: set[int] = set()  # devices whose result buffer is the accumulator
    for i in mine:
        view = region(outs[i][0], box, outs[i][1]) if i in outs else None
        if isinstance(view, np.ndarray) and view.dtype == dtype and view.flags.writeable:
            in_place.add(i)
        acc[i] = view if i in in_place else np.empty(shape, dtype=dtype)
        if n == 1:
            acc[i][...] = addends[i]
    need = max(boxes.volume(p) for p in parts) * dtype.itemsize
    held = None
    if n > 1:
        held = transport.scratch.take(need)
        held = np.empty(need, dtype=np.uint8) if held is None else held
    scratch = held.view(dtype) if held is not None else None
    rounds = (n - 1) * (2 if result == "replicate" else 1)
    if n > 1 and len(mine) == 1 and len({host_of(d) for d in group}) == n:
        _pipelined_ring(transport, s, step, group, box, parts, mine[0], rounds, acc, addends, fold, scratch)
        rounds = 0  # done
    for rnd in range(rounds):
        s.check()
        gather = rnd >= n - 1
        r = rnd - (n - 1) if gather else rnd
        outgoing = [parts[(i - r - (0 if gather else 1)) % n] for i in range(n)]
        # the first round sends addends as they are; later ones what the previous rounds made
        sent = addends if rnd == 0 else acc
        sends = []
        for i in mine:
            j = (i + 1) % n
            if host_of(group[j]) != transport.host and boxes.volume(outgoing[i]):
                view = sent[i][boxes.to_slices(outgoing[i], box)]
                key = StreamKey(s.job, step, rnd * n + i)
                # a round sends while it receives: a ring where every member sent first would wait forever
                sends.append(in_thread("reduce-send", transport.send, s, key, host_of(group[j]), view, outgoing[i],
                                       outgoing[i], None, False))
        for j in mine:
            i = (j - 1) % n
            part = outgoing[i]
            if not boxes.volume(part):
                continue
            where = boxes.to_slices(part, box)
            if host_of(group[i]) == transport.host:
                data = sent[i][where]
                s.traffic.add_local(data.nbytes, origin=False)
                if gather:
                    acc[j][where] = data
            elif gather:  # straight into place
                _receive_part(transport, s, StreamKey(s.job, step, rnd * n + i), host_of(group[i]), part, acc[j][where])
            else:
                data = scratch[:boxes.volume(part)].reshape(tile_shape(part))
                _receive_part(transport, s, StreamKey(s.job, step, rnd * n + i), host_of(group[i]), part, data)
            if not gather:  # a part's first write: this device's addends folded with what came in
                fold(addends[j][where], data, out=acc[j][where])
        for f in sends:
            f.result()
    if held is not None:
        # Back for the next reduce only now; a receive still posted into it after a failure holds it, and the
        # recycler hands out only what nothing else holds.
        transport.scratch.put(held)
    for i in mine:
        if i in outs:
            if i not in in_place:
                write(outs[i][0], box, outs[i][1], acc[i])
        elif boxes.volume(parts[i]):
            array, origin = produce(group[i], parts[i])
            write(array, parts[i], origin, acc[i][boxes.to_slices(parts[i], box)])


def _pipelined_ring(transport: Transport, s: Session, step: int, group: tuple[str, ...], box: Box, parts: list[Box],
                    i: int, rounds: int, acc: dict, addends: dict, fold, scratch: np.ndarray) -> None:
    """The ring of `reduce` where every member is on a host of its own (this one holds member ``i``), pipelined
    piece by piece across rounds: the part a device receives in round ``r`` is the part it sends in round
    ``r + 1`` (folded with its addends while reducing, as it came while gathering), so each piece goes on to
    the next host as soon as it is folded, and no round waits for the previous one to end.

    One thread sends every round's stream in turn (the first round's straight from the addends), each piece
    as the receiving loop hands its box over; the receiving loop never waits for a send. A receive that
    waited for its forward would wait for the next host to take the next round, which that host does only
    after its own receive ends: every host's wait would chain around the ring."""
    n = len(group)
    to, frm = host_of(group[(i + 1) % n]), host_of(group[(i - 1) % n])
    dtype = s.dtype(step)[1]
    # round -> (what it sends: its part, the array holding it, the boxes ready to go); None ends a round
    sending: list[tuple[int, Box, np.ndarray, queue.Queue, bool]] = []
    first = parts[(i - 1) % n]
    if boxes.volume(first):
        ready: queue.Queue = queue.Queue()
        for sub in chunk_boxes(first, s.dtype(step)[0], transport.chunk_bytes):
            if boxes.volume(sub):
                ready.put(sub)
        ready.put(None)
        sending.append((0, first, addends[i], ready, False))
    plan = []
    for rnd in range(rounds):
        gather = rnd >= n - 1
        r = rnd - (n - 1) if gather else rnd
        part = parts[(i - 1 - r - (0 if gather else 1)) % n]  # what member i - 1 sends this round
        if not boxes.volume(part):
            continue  # nor is it sent on: member i's next round sends this same part
        handoff: queue.Queue | None = None
        # A gathered part that goes on as it came is a chain of hops: only its last hop digests it, and the
        # others forward the origin's digest (as `relay` does). A hop's copy commits only if the whole job
        # does, and the last hop's check fails the job on any byte that changed on the way.
        forward = gather and rnd + 1 < rounds
        if rnd + 1 < rounds:
            handoff = queue.Queue()
            sending.append((rnd + 1, part, acc[i], handoff, forward))
        plan.append((rnd, gather, part, handoff, forward))
    sender = in_thread("reduce-send", _send_rounds, transport, s, step, n, i, to, box, sending)
    try:
        for rnd, gather, part, handoff, forward in plan:
            s.check()
            landing = (acc[i][boxes.to_slices(part, box)] if gather
                       else scratch[:boxes.volume(part)].reshape(tile_shape(part)))
            _ring_hop(transport, s, StreamKey(s.job, step, rnd * n + (i - 1) % n), frm, part, box, landing, acc[i],
                      None if gather else addends[i], fold, handoff, dtype, forward)
    except BaseException as e:
        for _, _, _, ready, _ in sending:
            ready.put(e)  # the sender stops at once
        raise
    sender.result()


def _send_rounds(transport: Transport, s: Session, step: int, n: int, i: int, to: str, box: Box, sending: list) -> None:
    """Member ``i``'s streams of a pipelined ring, round after round: each piece as soon as its box is handed
    over (see `_pipelined_ring`); waits for the peer's confirmations only after the last."""
    opened: list[Outgoing] = []
    try:
        for rnd, part, source, ready, forward in sending:
            out = transport.open(s, StreamKey(s.job, step, rnd * n + i), to)
            opened.append(out)
            check = Checksum(digest=not forward)  # a forwarded part goes on with the digest it came with
            while True:
                try:
                    sub = ready.get(timeout=0.1)
                except queue.Empty:
                    s.check()
                    continue
                if isinstance(sub, BaseException):
                    raise sub
                if sub is None or isinstance(sub, _Passed):
                    break
                data = host_bytes(source[boxes.to_slices(sub, box)])
                transport.throttle.wait(data.nbytes)
                check.update(data)
                out.put(sub, data)
                s.traffic.add_out(to, data.nbytes, origin=False)
            out.end(check.nbytes, sub.digest if forward else check.xxh3_64)
        for out in opened:
            out.wait(transport.timeout_s)
    except BaseException:
        for out in opened:
            out.cancel()
        raise


def _ring_hop(transport: Transport, s: Session, key: StreamKey, peer: str, part: Box, box: Box, landing: np.ndarray,
              acc: np.ndarray, addends: np.ndarray | None, fold, handoff: queue.Queue | None, dtype,
              forward: bool = False) -> None:
    """Take ring message ``key`` (``part`` of ``box``) from ``peer`` into ``landing``: fold each piece with
    ``addends`` into ``acc`` (reduce-scatter) or keep it as it came (all-gather, ``landing`` is in ``acc``),
    then hand its box to the next round's sender (``handoff``); check the message against its trailer. A
    part this member ``forward``s as it came is checked for its size only, and its trailer's digest goes on
    with it (`_Passed`): the chain's last hop digests it."""
    incoming = Checksum(digest=not forward)

    def place(sub: Box):
        view = landing[boxes.to_slices(sub, part)]
        return ("", view) if view.flags.c_contiguous else None

    with transport.incoming(s, key, peer, part, place) as items:
        for item in items:
            if isinstance(item, Trailer):
                expected = boxes.volume(part) * dtype.itemsize
                got = incoming.xxh3_64 if incoming.digests else item.digest
                if not incoming.nbytes == item.nbytes == expected or got != item.digest:
                    raise DataLossError(
                        f"job {s.job}: reduce step {key.step} message {key.hop} from {peer} arrived with "
                        f"{incoming.nbytes} bytes and XXH3-64 {got:016x}; the sender sent "
                        f"{item.nbytes} bytes with {item.digest:016x} and the part holds {expected}")
                if handoff is not None:
                    handoff.put(_Passed(item.digest) if forward else None)
                return
            s.check()
            sub, data = item.box, item.data
            nbytes = memoryview(data).nbytes
            if not boxes.contains(part, sub) or nbytes != boxes.volume(sub) * dtype.itemsize:
                raise InvalidArgumentError(f"job {s.job}: reduce message {key.hop} of step {key.step} brought "
                                           f"{nbytes} bytes for {boxes.box_str(sub)}, which is not a piece of "
                                           f"{boxes.box_str(part)}")
            incoming.update(data)
            s.traffic.add_in(peer, nbytes)
            here = landing[boxes.to_slices(sub, part)]
            if item.landed != "":  # not received into place
                here[...] = np.frombuffer(data, dtype=dtype).reshape(tile_shape(sub))
            if addends is not None:
                where = boxes.to_slices(sub, box)
                fold(addends[where], here, out=acc[where])
            if handoff is not None:
                handoff.put(sub)
    raise InvalidArgumentError(f"job {s.job}: reduce message {key.hop} of step {key.step} from {peer} ended "
                               f"after {incoming.nbytes} bytes without a trailer; the sender stopped")


def _receive_part(transport: Transport, s: Session, key: StreamKey, peer: str, part: Box, out: np.ndarray) -> None:
    """One reduce message from ``peer`` into ``out``, a host array (or view) shaped like ``part``."""
    into = _ArraySink(out, part)

    def verify(check: Checksum, nbytes: int, digest: int) -> None:
        expected = out.nbytes
        if not check.nbytes == nbytes == expected or check.xxh3_64 != digest:
            raise DataLossError(
                f"job {s.job}: reduce step {key.step} message {key.hop} from {peer} arrived with "
                f"{check.nbytes} bytes and XXH3-64 {check.xxh3_64:016x}; the sender sent {nbytes} bytes with "
                f"{digest:016x} and the part holds {expected}"
            )

    with transport.incoming(s, key, peer, part, lambda sub: into.place([""], sub)) as items:
        transport.relay(s, key, peer, part, items, into, [""], None, verify)


@dataclass(frozen=True)
class _Passed:
    """The end of a ring message that a member forwards as it came: the digest its origin sent, to send on."""

    digest: int


def _bfloat16_fold(op):
    """``op`` on bfloat16 elements held as uint16 bits: through float32, rounded back (adding the bits is wrong)."""

    def fold(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        out[...] = float32_to_bfloat16(op(bfloat16_to_float32(a), bfloat16_to_float32(b)))

    return fold


class _ArraySink:
    """A `Sink` of one host array (a reduce's incoming part), under the device name ''."""

    def __init__(self, array: np.ndarray, origin: Box):
        self.array, self.origin = array, origin

    def write(self, device: str, box: Box, data) -> None:
        self.array[boxes.to_slices(box, self.origin)] = data

    def place(self, devices: list[str], box: Box):
        view = self.array[boxes.to_slices(box, self.origin)]
        return ("", view) if view.flags.c_contiguous else None

    place_whole = place

    def mark(self, device: str, box: Box) -> None:
        pass

    def digested(self, device: str, box: Box, digest: int) -> None:
        pass
