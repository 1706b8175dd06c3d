"""The destination tiles a job stages on this host, per tensor it commits: buffers, what is still missing, and the
`Sink` that moves deliver through.

A job commits one tensor, or several at once (`reshard.many`: a state dict in one program). Each tensor's tiles
are staged in the store under a transaction of their own (the job's id, or ``job/tensor`` when the job commits
several: the store keeps one buffer per device and transaction), invisible to readers until the planner's
commit, and dropped by an abort. Every write is checked to lie in a destination tile of this host and counted,
so commit can tell a tile that is not complete.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.mesh import host_of
from reshard.program import TensorDecl
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.layout import tile_shape
from reshard.server.agent.store import ShardStore, TileBuffer
from reshard.server.transport import buffers

__all__ = ["StagedTiles", "NoTiles", "TilePlan", "tile_plan", "staging_owner"]


def staging_owner(job: str, tensor: str, num_committed: int) -> str:
    """The store transaction a job's tiles of ``tensor`` are staged under (see the module docstring)."""
    return job if num_committed == 1 else f"{job}/{tensor}"


def staged_bytes(tensors: list[TensorDecl], host: str) -> dict[str, int]:
    """Bytes the destination tiles of ``tensors`` take on each device of ``host``."""
    out: dict[str, int] = {}
    for decl in tensors:
        for dev, tile in decl.dst.tiles(decl.shape).items():
            if host_of(dev) == host:
                out[dev] = out.get(dev, 0) + boxes.volume(tile) * decl.itemsize
    return out


@dataclass(frozen=True)
class TilePlan:
    """How a host stages its destination tiles of one tensor, the same for every run of a program (`tile_plan`,
    kept by `programs.HostLayout`): whether the tensor is made whole (see `StagedTiles`), its tiles here, and per
    device (device, tile, the tile's shape, the part its own source shard holds or None, the elements still to
    come once that part is in).

    ``places`` fills as runs deliver: (device, box) -> where that box lies in the device's tile (numpy slices) and
    its elements, for a box already checked to lie inside the tile. A weight sync delivers the same boxes every
    run, and working these out again took a receiving agent about 3 µs a box of the thousands it unpacks."""

    made_whole: bool
    tiles: dict[str, Box]
    devices: tuple[tuple[str, Box, tuple[int, ...], Box | None, int], ...]
    places: dict[tuple[str, Box], tuple[tuple, int]] = field(default_factory=dict, compare=False)


def tile_plan(decl: TensorDecl, tiles: dict[str, Box]) -> TilePlan:
    """`TilePlan` of ``decl`` on the host whose destination tiles are ``tiles``."""
    made_whole = decl.src is None or (decl.src.is_partial and decl.src.partial != decl.dst.partial)
    src_tiles = {} if made_whole else decl.src.tiles(decl.shape)
    devices = []
    for dev, tile in tiles.items():
        held = boxes.intersect(src_tiles[dev], tile) if dev in src_tiles else None
        devices.append((dev, tile, tile_shape(tile), held,
                        boxes.volume(tile) - (boxes.volume(held) if held is not None else 0)))
    return TilePlan(made_whole, tiles, tuple(devices))


class StagedTiles:
    """This host's destination tiles of one tensor a job commits (``decl``, stored as ``name``).

    The part of a tile that the device's own source shard holds (``src_version``) is copied in at once, or,
    with ``defer``, listed in ``fills`` for the run to copy beside its streams. The room for the tiles is reserved
    in the store first, unless ``reserve`` is False (the caller reserved it). A tensor the program makes (an
    einsum's output), or the sum of a Partial one (whose source holds addends, not values), is ``made_whole``:
    its steps write every element of the staged tiles, each once, and nothing is copied in.
    """

    def __init__(self, job: str, decl: TensorDecl, name: str, owner: str, store: ShardStore, src_version: int,
                 empty, defer: bool, plan: TilePlan, staged: list, reserve: bool = True):
        """``plan`` is worked out once for every run of a program (`programs.HostLayout`). The caller stages the
        buffers: each (owner, device, buffer) is appended to ``staged`` for `ShardStore.stage_many`."""
        self.job, self.decl, self.name, self.owner = job, decl, name, owner
        self._store = store
        self.made_whole = plan.made_whole
        self.tiles: dict[str, Box] = plan.tiles
        self._places = plan.places
        self.buffers: dict[str, Any] = {}
        self.missing: dict[str, int] = {}
        self.fills: list[tuple[Any, Box, Box, Any]] = []  # (staged buffer, held box, its tile, source shard)
        self._lock = threading.Lock()
        if reserve:  # else the caller reserved the room: refused before any buffer exists when over the limit
            store.reserve(owner, {d: boxes.volume(t) * decl.itemsize for d, t in self.tiles.items()},
                          f"job {job[:8]}'s destination tiles of {name!r}")
        dtype = decl.dtype
        for dev, tile, shape, held, missing in plan.devices:
            buf = empty(shape, dtype)
            if held is not None:
                src = store.get(name, src_version, dev)
                if defer:
                    self.fills.append((buf, held, tile, src))
                else:
                    buffers.write(buf, held, tile, buffers.region(src.array, held, src.tile))
            self.buffers[dev] = buf
            self.missing[dev] = missing
            staged.append((owner, dev, TileBuffer(buf, tile, dtype)))

    def holding(self, device: str, box: Box) -> tuple[Any, Box] | None:
        """``device``'s staged buffer and its tile, if that tile holds ``box``."""
        tile = self.tiles.get(device)
        if tile is not None and boxes.contains(tile, box):
            return self.buffers[device], tile
        return None

    def produce(self, device: str, box: Box) -> tuple[Any, Box]:
        """The staged buffer a step writes ``box`` into on ``device``, and its tile; a made-whole tensor counts
        the box as written."""
        tile = self.tile(device, box)
        if self.made_whole:
            with self._lock:
                self.missing[device] -= boxes.volume(box)
        return self.buffers[device], tile

    def tile(self, device: str, box: Box) -> Box:
        tile = self.tiles.get(device)
        if tile is None or not boxes.contains(tile, box):
            raise InvalidArgumentError(
                f"job {self.job}: box {boxes.box_str(box)} is not inside device {device}'s destination tile of "
                f"{self.name!r}"
            )
        return tile

    # -- the Sink moves deliver through -----------------------------------------------------------------

    def _place(self, device: str, box: Box) -> tuple[tuple, int]:
        """Where ``box`` lies in ``device``'s tile, and its elements (`TilePlan.places`); checked to lie inside."""
        place = self._places.get((device, box))
        if place is None:
            place = self._places[device, box] = (boxes.to_slices(box, self.tile(device, box)), boxes.volume(box))
        return place

    def write(self, device: str, box: Box, data) -> None:
        where, n = self._place(device, box)
        buf = self.buffers[device]
        if type(buf) is np.ndarray and type(data) is np.ndarray:  # host to host: the common case, kept short
            buf[where] = data
        else:
            buffers.write(buf, box, self.tiles[device], data)
        with self._lock:
            self.missing[device] -= n

    def place(self, devices: list[str], box: Box):
        for r in devices:
            tile = self.tiles.get(r)
            if tile is None:
                continue
            if tile == box:  # a whole tile (a bucket member moved whole), asked per member as each post is made
                view = self.buffers[r]
            else:
                # where the box lies, as `_place` keeps it for the program's later runs; a box outside the tile is
                # not kept (it may be asked of each device in turn)
                place = self._places.get((r, box))
                if place is None:
                    if not boxes.contains(tile, box):
                        continue
                    place = self._place(r, box)
                view = self.buffers[r][place[0]]
            if isinstance(view, np.ndarray) and view.flags.c_contiguous:
                return r, view
        return None

    place_whole = place  # its tiles are the destination: a delta is rebuilt where a transport lands

    def place_device(self, devices: list[str], box: Box):
        """Like `place`, for a CUDA IPC piece (`moves.relay`): a contiguous region of a GPU tile, to copy into while
        digesting in one pass."""
        for r in devices:
            tile = self.tiles.get(r)
            if tile is not None and boxes.contains(tile, box):
                view = buffers.region(self.buffers[r], box, tile)
                if buffers.is_torch(view) and view.is_cuda and view.is_contiguous():
                    return r, view
        return None

    def mark(self, device: str, box: Box) -> None:
        _, n = self._place(device, box)
        with self._lock:
            self.missing[device] -= n

    def digested(self, device: str, box: Box, digest: int) -> None:
        """Where ``box`` is ``device``'s whole tile, its digest goes with the staged buffer (`TileBuffer.digest`)."""
        if self.tiles.get(device) == box and not self.made_whole:
            self._store.digested(self.owner, device, self.buffers[device], digest)

    def short(self) -> dict[str, int]:
        """Devices whose tile still lacks elements, and how many."""
        with self._lock:
            return {d: n for d, n in self.missing.items() if n}


class NoTiles:
    """The `Sink` of a tensor a job commits that has no destination tile on this host: a chain may pass through
    it (pieces are forwarded, none land), but delivering a box here is a planning error, named as such."""

    def __init__(self, job: str, name: str):
        self.job, self.name = job, name

    def error(self, device: str, box: Box) -> InvalidArgumentError:
        return InvalidArgumentError(f"job {self.job}: box {boxes.box_str(box)} is not inside device {device}'s "
                                    f"destination tile of {self.name!r}: this host has none")

    def place(self, devices: list[str], box: Box):
        return None

    place_whole = place

    def write(self, device: str, box: Box, data) -> None:
        raise self.error(device, box)

    def mark(self, device: str, box: Box) -> None:
        raise self.error(device, box)

    def digested(self, device: str, box: Box, digest: int) -> None:
        pass  # no tile to keep it with (a box delivered here fails in write or mark)
