"""What moving a box means, for every transport: the chunk loop that sends a stream, the hop that takes one
(forwarding it down a chain and checking its trailer), and a transfer's sender and receiving parts.

================= ==========================================================================
``move``          a transfer's sender part: copies into the receivers on this host, then the
                  box down every hop this host streams itself (`reshard.routes`)
``take``          one receiving hop of a transfer: write the pieces into this host's
                  receivers, forward each piece down the chain before the next arrives,
                  check the bytes against the sender's trailer (`verify_arrival`)
``send``          the chunk loop: C-ordered sub-boxes (``chunk_boxes``), the throttle, each
                  chunk as its region of the source tile where the agent digested the box
                  early (``Outgoing.put_region``), else packed and digested as it goes (a
                  gathered bucket: whole members per chunk, ``Outgoing.put_parts``), the
                  trailer ``(nbytes, xxh3_64)``, byte accounting; to a receiver that lands
                  it in GPU memory (``Outgoing.device_digest``: nixl into VRAM) each chunk
                  as its region, the trailer holding the GPU digest
``relay``         the receiving loop of one stream: forward, write, count, check the trailer; a
                  piece landed in GPU memory is copied into the tile on the GPU, digested in
                  the same pass
``send_ipc``      a stream that carries no bytes: the box as one CUDA IPC handle of its region
                  (`Transport.ipc_to`: agents on one machine's GPUs), then the trailer with the
                  GPU digest (`reshard.proto.devices`); the receiver maps the region, copies it
                  device to device and digests it in the same pass
================= ==========================================================================

A move step the session names in ``Session.deltas`` (issue 40) sends its box as a delta frame instead
(`deltas`: one frame per transfer, the same down every hop this host originates, CUDA IPC hops and
this host's own receivers whole), and its receivers rebuild the box from their own base version.

A chain hop that forwards hands on the very bytes it keeps, so only the chain's last
hop digests them: its match covers every hop's copy, and a mismatch anywhere fails the
job before any host commits. Each function takes the `Transport` it runs on and calls
the others through its methods, so a wrapper (``faults``) that changes one changes it
for all. Transfers are ``reshard.plans.Transfer`` values; byte counts follow
``reshard.cost``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.mesh import host_of
from reshard.plans import Transfer
from reshard.proto.devices import DeviceChecksum, is_cuda, share_cuda, torch_dtype
from reshard.proto.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from reshard.proto.layout import Checksum, chunk_boxes, tile_shape
from reshard.routes import home_receivers, hop_targets, hops
from reshard.server.transport import deltas
from reshard.server.transport.buffers import host_bytes, region, synchronize
from reshard.server.transport.session import Session
from reshard.server.transport.streams import Gather, IpcRegion, Piece, Segments, Sink, StreamKey, Trailer, feed

if TYPE_CHECKING:
    from reshard.server.transport.base import Transport

__all__ = ["send", "send_ipc", "relay", "move", "take", "prepost", "verify_arrival"]


def send(transport: Transport, s: Session, key: StreamKey, peer: str, array, origin: Box, box: Box,
         digest: Future | None = None, origin_bytes: bool = True) -> list[str] | None:
    """Stream ``box`` of ``array`` (which holds ``origin``) to ``peer``; returns who verified it.
    ``digest`` is the box's XXH3-64 when it is computed elsewhere (the agent digests held shards early): each chunk
    then goes as its region of ``array`` (`Outgoing.put_region`: a one-sided transport writes it from the tile, with
    no packed copy); without it the running digest reads each chunk's bytes, which then go packed (`Outgoing.put`)."""
    out = transport.open(s, key, peer)
    dtype, np_type = s.dtype(key.step)
    sent = 0
    try:
        device = out.device_digest()  # the receiver lands the box in GPU memory: the GPU digest, each chunk in place
        check = DeviceChecksum() if device else Checksum(digest=digest is None)
        if isinstance(array, Gather):  # a bucket from its members' regions: whole members per chunk
            for sub, parts in array.chunks(transport.chunk_bytes):
                s.check()
                (lo, hi), = sub
                transport.throttle.wait(hi - lo)
                for p in parts:
                    check.update(np.ascontiguousarray(p))
                out.put_parts(sub, parts)
                sent += hi - lo
                s.traffic.add_out(peer, hi - lo, origin_bytes)
            return out.finish(sent, _digest(check), transport.timeout_s)
        # A far end that takes larger pieces at no cost (nixl into shared memory) still gets the transport's own
        # under a send-rate cap: one 16 MiB piece is a burst the cap cannot space
        size = transport.chunk_bytes if transport.throttle.rate > 0 else out.chunk_bytes(transport.chunk_bytes)
        for sub in chunk_boxes(box, dtype, size):
            s.check()
            n = boxes.volume(sub) * np_type.itemsize
            if not n:
                continue
            transport.throttle.wait(n)
            view = region(array, sub, origin)
            if device:
                if is_cuda(view) and not view.is_contiguous():
                    view = view.contiguous()  # packed once on the GPU, for the WRITE and the digest alike
                    synchronize(view)  # packed before the transport's copy, on a stream of its own, reads it
                out.put_region(sub, view)
                check.update(view)  # on this GPU while the transport's copy reads the same bytes
            elif digest is None:
                data = host_bytes(view)
                check.update(data)
                out.put(sub, data)
            else:
                out.put_region(sub, view)
            sent += n
            s.traffic.add_out(peer, n, origin_bytes)
        return out.finish(sent, digest.result() if digest is not None and not device else _digest(check),
                          transport.timeout_s)
    except BaseException:
        out.cancel()
        raise


def _digest(check: Checksum | DeviceChecksum) -> int:
    """What a trailer holds of ``check``: the GPU digest, or the XXH3-64."""
    return check.value if isinstance(check, DeviceChecksum) else check.xxh3_64


def send_ipc(transport: Transport, s: Session, key: StreamKey, peer: str, array, origin: Box,
             box: Box) -> list[str] | None:
    """Send ``box`` of CUDA tile ``array`` to ``peer`` as a CUDA IPC handle of its region, then the trailer with the
    GPU digest of its bytes; returns who verified it. The tile stays unchanged until the peer confirms: the peer
    copies from it."""
    out = transport.open(s, key, peer)
    try:
        s.check()
        view = region(array, box, origin)
        nbytes = view.numel() * view.element_size()
        if nbytes:
            out.put_ipc(box, share_cuda(view))
        check = DeviceChecksum().update(view)  # the peer copies meanwhile
        s.traffic.add_local(nbytes)
        out.end(nbytes, check.value, device=True)
        return out.wait(transport.timeout_s)
    except BaseException:
        out.cancel()
        raise


def _take_ipc(transport: Transport, s: Session, key: StreamKey, peer: str, item: Piece, box: Box, sink: Sink,
              local: list[str], check: DeviceChecksum) -> None:
    """Land a CUDA IPC piece: map the sender's region, copy it into ``local``'s tiles device to device, digesting it
    in the same pass where a tile's region is contiguous."""
    sub, handle = item.box, item.data.handle
    dtype = s.dtype(key.step)[0]
    if not boxes.contains(box, sub) or tuple(handle.shape) != tile_shape(sub) or handle.dtype != dtype:
        raise InvalidArgumentError(f"job {key.job}: the CUDA IPC piece is {handle.dtype}{list(handle.shape)} for box "
                                   f"{boxes.box_str(sub)}, but the transfer moves {dtype} box {boxes.box_str(box)}")
    try:
        src = transport.map_ipc(handle)
    except FailedPreconditionError as e:
        raise FailedPreconditionError(
            f"job {key.job}: host {transport.host} cannot map the CUDA IPC piece from host {peer}: {e}; "
            f"agents on one machine whose processes cannot share GPU memory (containers without a shared IPC "
            f"namespace) move bytes instead when started with reshard agent --no-cuda-ipc") from None
    if src.dtype != torch_dtype(dtype):
        raise InvalidArgumentError(f"job {key.job}: the CUDA IPC piece maps as {src.dtype}, not {dtype}")
    _land_device(sub, src, sink, local, check)


def _land_device(sub: Box, src, sink: Sink, local: list[str], check: DeviceChecksum) -> None:
    """Write CUDA tensor ``src`` (box ``sub``) into ``local``'s tiles on the GPU, adding it to ``check``: copied and
    digested in one pass where a tile's region is contiguous, else digested, then written."""
    place = getattr(sink, "place_device", None)
    spot = place(local, sub) if place is not None else None
    landed = None
    if spot is not None and spot[1].shape == src.shape and spot[1].dtype == src.dtype:
        landed = spot[0]
        check.copy(spot[1], src)
        sink.mark(landed, sub)
    else:
        check.update(src)
    for r in local:
        if r != landed:
            sink.write(r, sub, src)


def relay(transport: Transport, s: Session, key: StreamKey, peer: str, box: Box, items: Iterable, sink: Sink,
          local: list[str], forward_to: str | None,
          verify: Callable[[Checksum, int, int], None]) -> list[str] | None:
    """Take one incoming stream: forward every piece to ``forward_to`` (under the next hop's key) before
    writing it into ``local``'s buffers, then check the trailer; returns who verified the box."""
    forward = transport.open(s, StreamKey(key.job, key.step, key.hop + 1), forward_to) if forward_to else None
    check = Checksum(digest=forward is None)  # a forwarding hop leaves the digest to the chain's last hop
    on_gpu: DeviceChecksum | None = None  # the digest of a stream of GPU pieces, summed where they lie
    # Where the next hop lands the box in the other kind of memory than this one (nixl: GPU memory against host
    # memory), it checks the other digest: this hop digests what it forwards in that kind for its trailer
    onward: Checksum | DeviceChecksum | None = None
    dtype = s.dtype(key.step)[1]
    try:
        for item in items:
            if isinstance(item, Trailer):
                if forward is not None:
                    forward.end(item.nbytes, item.digest if onward is None else _digest(onward))
                if item.device != (on_gpu is not None) and (on_gpu is not None or check.nbytes):
                    kinds = ("XXH3-64", "GPU digest")
                    raise DataLossError(
                        f"job {key.job}: stream {key.hop} of step {key.step} from {peer} carried "
                        f"{'GPU' if on_gpu is not None else 'host'} pieces but its trailer holds the "
                        f"{kinds[item.device]}, not the {kinds[on_gpu is not None]}")
                verify(on_gpu if on_gpu is not None else check, item.nbytes, item.digest)
                if forward is None:
                    return [transport.host]
                later = forward.wait(transport.timeout_s)
                return None if later is None else [transport.host, *later]
            s.check()  # a job that failed elsewhere (a deadline, an abort) stops taking pieces
            sub, data = item.box, item.data
            if isinstance(data, IpcRegion):
                if forward is not None or check.nbytes:
                    raise InvalidArgumentError(f"job {key.job}: a CUDA IPC piece from {peer} in a stream that "
                                               f"{'forwards' if forward is not None else 'carried bytes'}: the "
                                               f"sender may send one only to the last hop, as a stream's only kind")
                on_gpu = on_gpu if on_gpu is not None else DeviceChecksum()
                _take_ipc(transport, s, key, peer, item, box, sink, local, on_gpu)
                continue
            if not boxes.contains(box, sub):
                raise InvalidArgumentError(
                    f"job {key.job}: piece {boxes.box_str(sub)} lies outside transfer box {boxes.box_str(box)}"
                )
            gpu = is_cuda(data)  # landed in GPU memory (`Transport.lands_on_gpu`): kept there, digested there
            if forward is not None and not (check.nbytes or on_gpu is not None):  # the first piece
                onward_gpu = forward.device_digest()  # which digest the next hop checks
                if onward_gpu != gpu:
                    onward = DeviceChecksum() if onward_gpu else Checksum()
            if onward is not None:
                feed(onward, host_bytes(data) if gpu and isinstance(onward, Checksum) else data)
            if gpu and check.nbytes or not gpu and on_gpu is not None:
                raise InvalidArgumentError(f"job {key.job}: a piece in {'GPU' if gpu else 'host'} memory from {peer} "
                                           f"in a stream of {'host' if gpu else 'GPU'} pieces")
            n = data.numel() if gpu else data.nbytes if isinstance(data, Segments) else memoryview(data).nbytes
            if n != boxes.volume(sub) * dtype.itemsize:
                raise InvalidArgumentError(f"job {key.job}: piece {boxes.box_str(sub)} carries {n} bytes, not "
                                           f"{boxes.volume(sub) * dtype.itemsize}")
            if forward is not None:
                forward.put(sub, data, item.wire)
                s.traffic.add_out(forward_to, n, origin=False)
            if gpu:
                on_gpu = on_gpu if on_gpu is not None else DeviceChecksum()
                src = data.view(torch_dtype(s.dtype(key.step)[0])).reshape(tile_shape(sub))
                _land_device(sub, src, sink, local, on_gpu)
                s.traffic.add_in(peer, n)
                continue
            arr = None
            for r in local:
                if r == item.landed:
                    sink.mark(r, sub)
                    continue
                if arr is None:  # `Segments` go to a bucket's sink as they are
                    arr = data if isinstance(data, Segments) else \
                        np.frombuffer(data, dtype=dtype).reshape(tile_shape(sub))
                sink.write(r, sub, arr)
            feed(check, data)
            s.traffic.add_in(peer, n)
        raise InvalidArgumentError(
            f"job {key.job}: stream {key.hop} of step {key.step} from {peer} ended after {check.nbytes} bytes "
            f"without a trailer; the sender stopped"
        )
    except BaseException:
        if forward is not None:
            forward.cancel()
        raise


def move(transport: Transport, s: Session, step: int, t: Transfer, sink: Sink, array, origin: Box,
         digest: Future | None = None) -> None:
    """The sender's part of transfer ``t`` (step ``step``), from ``array`` holding ``origin``: its copies on this
    host, then every hop it streams itself (`reshard.routes`)."""
    home = home_receivers(t)
    if home:  # a gathered bucket (`streams.Gather`) is packed where it has receivers on its sender's host
        view = region(array, t.box, origin)
        nbytes = boxes.volume(t.box) * s.dtype(step)[1].itemsize
        for r in home:
            sink.write(r, t.box, view)
            s.traffic.add_local(nbytes)
    delta = s.delta(step)
    frame = None
    for h in hops(t):
        if not h.origin:
            continue
        key = StreamKey(s.job, step, h.index)
        if h.forward_to is None and boxes.volume(t.box) and transport.ipc_to(s, h.dst, array):  # mapped there
            confirmed = send_ipc(transport, s, key, h.dst, array, origin, t.box)  # puts nothing on the network
        elif delta is not None:
            if frame is None:  # once per transfer, the same frame down every hop, and for every step sending it
                frame = s.frames.frame((delta.sender, delta.segments), lambda: deltas.encode_frame(
                    s.job, delta, _packed(array, t.box, origin), digest.result() if digest is not None else None))
            confirmed = deltas.send_frame(transport, s, key, h.dst, frame, delta.nbytes)
        else:
            confirmed = transport.send(s, key, h.dst, array, origin, t.box, digest)
        if t.method == "broadcast" and confirmed is not None and list(confirmed) != list(t.route):
            raise FailedPreconditionError(
                f"job {s.job}: broadcast {step} was confirmed by {confirmed}, expected the route {list(t.route)}"
            )


def take(transport: Transport, s: Session, step: int, t: Transfer, hop: int, sink: Sink,
         items: Iterable | None = None) -> list[str] | None:
    """Hop ``hop`` of transfer ``t`` arriving here: ``items`` as pushed (passive transports), or received
    now (active ones). Returns who verified the box: this host and every later hop."""
    targets = hop_targets(t, hop, transport.host)
    if targets is None:
        raise InvalidArgumentError(f"job {s.job}: transfer {step} ({t}) hop {hop} does not deliver to host "
                                   f"{transport.host}")
    local, nxt, peer = targets
    key = StreamKey(s.job, step, hop)
    delta = s.delta(step)
    if delta is not None:
        if items is None:  # a frame lands in the transport's own buffer, never in a destination tile
            items = transport.arrivals(s, key, peer, t.box, lambda sub: None)
        first, items = deltas.take_first(items)
        if not (isinstance(first, Piece) and isinstance(first.data, IpcRegion)):  # CUDA IPC hops go whole
            return _take_frame(transport, s, key, t, delta, items, sink, local, nxt, peer)
    if items is None:
        items = transport.arrivals(s, key, peer, t.box, _placer(transport, sink, local))

    def verify(check: Checksum, nbytes: int, digest: int) -> None:
        verify_arrival(s.job, step, t, hop, check, nbytes, digest, s.dtype(step)[1].itemsize)
        if not isinstance(check, DeviceChecksum):  # the sender's XXH3-64 of the box, which the job's commit proves
            for r in local:
                sink.digested(r, t.box, digest)

    return transport.relay(s, key, peer, t.box, items, sink, local, nxt, verify)


def prepost(transport: Transport, s: Session, step: int, t: Transfer, hop: int, sink: Sink) -> bool:
    """Post hop ``hop`` of transfer ``t`` arriving here now, into ``sink``, before the lane that takes it runs
    (`Transport.prepost`); whether it was: that lane's `take` must then be given the same ``sink``."""
    targets = hop_targets(t, hop, transport.host)
    if targets is None:
        return False
    local, _, peer = targets
    return transport.prepost(s, StreamKey(s.job, step, hop), peer, t.box, _placer(transport, sink, local))


def _placer(transport: Transport, sink: Sink, local: list[str]) -> Callable[[Box], tuple[str, object] | None]:
    """Where a box may land in ``local``'s tiles (`Sink.place`): host regions, and for a transport that lands on GPUs
    the contiguous regions of GPU tiles too (`Sink.place_device`)."""
    on_gpu = getattr(sink, "place_device", None) if transport.lands_on_gpu else None
    if on_gpu is None:
        return lambda sub: sink.place(local, sub)
    return lambda sub: sink.place(local, sub) or on_gpu(local, sub)


def _take_frame(transport: Transport, s: Session, key: StreamKey, t: Transfer, delta: deltas.DeltaStream,
                items: Iterable, sink: Sink, local: list[str], nxt: str | None, peer: str) -> list[str] | None:
    """A delta stream arriving here (`deltas`): forward it, check its trailer, then rebuild the box on each of
    ``local``'s devices from its own base and write it whole; returns who verified it."""
    frame, forward = deltas.relay_frame(transport, s, key, peer, delta, items, nxt)
    try:
        np_type = s.dtype(key.step)[1]
        shape = tile_shape(t.box)
        for r in local:
            # the tile's region (a bucket: its members' regions), to apply straight into
            spot = sink.place_whole([r], t.box)
            if spot is not None and spot[0] == r and _lands_whole(spot[1], delta.nbytes):
                deltas.apply_frame(s.job, delta, frame, r, out=spot[1])
                s.check()
                sink.mark(r, t.box)
                continue
            box = deltas.apply_frame(s.job, delta, frame, r)
            s.check()
            sink.write(r, t.box, box.view(np_type).reshape(shape))
    except BaseException:
        if forward is not None:
            forward.cancel()
        raise
    if forward is None:
        return [transport.host]
    later = forward.wait(transport.timeout_s)
    return None if later is None else [transport.host, *later]


def _lands_whole(spot, nbytes: int) -> bool:
    """Whether a sink's offered region takes a whole delta-rebuilt box: host bytes, C-contiguous, all of them (a
    bucket's `Segments` of member regions, or one region)."""
    parts = spot if isinstance(spot, Segments) else (spot,)
    return all(isinstance(p, np.ndarray) and p.flags.c_contiguous for p in parts) and \
        sum(p.nbytes for p in parts) == nbytes


def _packed(array, box: Box, origin: Box) -> np.ndarray | tuple:
    """``box`` of ``array`` (a tile holding ``origin``) as `deltas.encode_frame` reads it: host numpy views, one per
    segment of the delta stream, where they lie (the box's region, or a bucket's `Gather` members: strided ones too,
    which the compiled encode reads in place); packed host bytes where the tile is not numpy (torch, a GPU)."""
    if isinstance(array, Gather):
        return tuple(p if type(p) is np.ndarray else np.frombuffer(host_bytes(p), dtype=np.uint8)
                     for p in array.parts)
    view = region(array, box, origin)
    if type(view) is np.ndarray:
        return (view,)
    return np.frombuffer(host_bytes(view), dtype=np.uint8)


def verify_arrival(job: str, index: int, t: Transfer, hop: int, check: Checksum, sent_nbytes: int,
                   sent_digest: int, itemsize: int) -> None:
    """Check one received stream of transfer ``index`` against its sender's trailer: byte count and XXH3-64.

    ``check`` counts bytes only on a hop that forwards down a chain; the last hop's
    digest then speaks for the whole route (see the module docstring).
    """
    expected = boxes.volume(t.box) * itemsize
    sender = host_of(t.sender)
    on_gpu = isinstance(check, DeviceChecksum)
    if not check.nbytes == sent_nbytes == expected:
        raise DataLossError(
            f"job {job}: transfer {index} from {sender} arrived with {check.nbytes} bytes; the sender sent "
            f"{sent_nbytes} and the box holds {expected}"
        )
    got = check.value if on_gpu else check.xxh3_64 if check.digests else None
    if got is not None and got != sent_digest:
        if t.method == "broadcast" and hop:
            where = f"somewhere on the chain {' -> '.join([sender, *t.route[:hop + 1]])}"
        else:
            where = f"between {sender} and {t.route[0] if t.method == 'broadcast' else host_of(t.receivers[hop])}"
        raise DataLossError(
            f"job {job}: transfer {index} arrived with {'GPU digest' if on_gpu else 'XXH3-64'} {got:016x}, but the "
            f"sender sent "
            f"{sent_digest:016x}: the bytes changed {where}, so the job fails and no host commits them"
        )
