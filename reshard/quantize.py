"""Quantizing on the way: which tensors of a `reshard.plan_many` change dtype, where each block is quantized, and
the steps that gather, quantize and move them.

A weight asked for in ``float8_e4m3fn`` (``plan_many(..., dtypes=)``) arrives in the DeepSeek / Kimi serving format:
e4m3 values and a float32 scale per ``block`` x ``block`` block (the ``fp8_scales`` kernel, then
``fp8_quantize_scaled`` by those scales: ``fp8_quantize``'s bits, the blocks read once for their scales).
The senders quantize before the moves, so the wire carries one byte an element and the scales, not two.

================ ===================================================================================================
conversion       today only to ``float8_e4m3fn``, from ``bfloat16``, ``float16`` or ``float32``; a 2-D weight (a
                 matrix: blocks are square), with a scale tensor named in ``scales``, float32, one entry per block
quantize layout  a block-aligned layout of the weight on its source mesh (`quantize_layout`): the source's own
                 where every source tile is whole blocks (experts), else the layout over the same mesh axes whose
                 tiles are whole blocks and that needs the fewest elements from other hosts, then from other
                 devices. Over the same devices, so the gather is the cheap part: where each host's tiles make
                 whole blocks (rows over every device, a multiple of 128 rows a host) it stays within hosts; and
                 a layout of the sharding vocabulary, so the fp8 moves are planned as any reshard from it
program tensors  ``<w>`` (its new dtype, no ``src``: made by the steps, committed in ``dst``), its scale (float32,
                 likewise) and ``<w>~<old dtype>`` (the weight as it is held, ``src`` only: read, never committed)
steps            on each device that sends a part or keeps one: the part of its quantize tile it lacks gathered
                 into role ``dst`` of ``<w>~<old dtype>`` (a ``copy`` of what it holds, moves of the rest from a
                 device of its host where one holds it), then ``fp8_scales`` of the whole tile into role ``q``
                 and ``fp8_quantize_scaled`` of the tile by those scales into role ``q``; then the moves of the
                 fp8 values and of the scales, as planned from the quantize layout to the destinations, and a
                 ``copy`` of the part a receiver made itself into its ``dst``
================ ===================================================================================================

Every tile quantized starts on a block boundary of the tensor, so each device makes the tensor's own blocks, bit for
bit those of quantizing it whole.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from reshard import box as boxes
from reshard.dtypes import dtype_name
from reshard.errors import InvalidShardingError, ReshardError
from reshard.kernels import FP8_BLOCK
from reshard.mesh import Mesh, host_of
from reshard.plans import Transfer
from reshard.program import DST, SRC, Step, TensorDecl, TileRef
from reshard.sharding import Box, Sharding

__all__ = ["DtypeConversionError", "Conversion", "CONVERSIONS", "QUANTIZED", "conversions", "quantize_layout",
           "source_name", "scale_box", "scale_shape", "made_scale", "block_of", "QuantizedSteps"]

FP8 = "float8_e4m3fn"
# target dtype -> the dtypes a weight may be converted from
CONVERSIONS: Mapping[str, tuple[str, ...]] = {FP8: ("bfloat16", "float16", "float32")}
QUANTIZED = "q"  # the role a quantize step writes on its device, which the moves read


class DtypeConversionError(ReshardError, ValueError):
    """A dtype asked for a tensor that reshard cannot convert it to on the way; the message names the tensor, its
    dtype, what was asked and what is supported."""


@dataclass(frozen=True)
class Conversion:
    """Weight ``weight`` arrives as ``dtype`` with its scales in ``scale``, one per ``block`` x ``block``."""

    weight: str
    dtype: str
    scale: str
    block: int


def source_name(weight: str, dtype: str) -> str:
    """The program tensor that stands for ``weight`` as it is held (its old dtype)."""
    return f"{weight}~{dtype}"


def scale_box(box: Box, block: int) -> Box:
    """The scale entries of the blocks of ``box`` (which starts on block boundaries)."""
    return tuple((lo // block, -(-hi // block)) for lo, hi in box)


def scale_shape(shape: Sequence[int], block: int) -> tuple[int, ...]:
    """The shape of a weight's scales: one entry per ``block`` elements of each dim (a short last block too)."""
    return tuple(-(-n // block) for n in shape)


def made_scale(name: str, weight_shape: Sequence[int], block: int, dst: Optional[Sharding]) -> TensorDecl:
    """The declaration of scale tensor ``name`` that a quantizing job makes: float32, `scale_shape`, no source."""
    return TensorDecl(name, scale_shape(weight_shape, block), "float32", None, dst)


def block_of(weight: str, scale: str, block) -> int:
    """The one block size of a pair's ``block`` (None: `FP8_BLOCK`); the fp8 kernels take square blocks."""
    if block is None:
        return FP8_BLOCK
    sizes = {block} if isinstance(block, int) else set(block)
    if len(sizes) != 1:
        raise DtypeConversionError(f"weight {weight!r} is quantized with the scale {scale!r} in blocks of {block!r}, "
                                   f"but the fp8 serving format's blocks are square (the kernels take one size); "
                                   f"give one block size, such as {FP8_BLOCK}")
    return sizes.pop()


def conversions(tensors: Iterable[TensorDecl], dtypes: Union[str, Mapping[str, str], None],
                scales: Mapping[str, tuple[str, object]]) -> dict[str, Conversion]:
    """The weights of ``tensors`` that ``dtypes`` asks to change dtype, checked; ``dtypes`` is one dtype name for
    every tensor (less the scales) or {name: dtype}; a tensor asked for in its own dtype does not change.
    ``scales`` is `reshard.many.scale_pairs`' weight -> (scale, block); a scale among ``tensors`` (one that exists
    already) must be float32 with one entry per block. Raises `DtypeConversionError` naming the tensor, its dtype,
    what was asked and what is supported."""
    decls = {t.name: t for t in tensors}
    scale_names = {s for s, _ in scales.values()}
    if dtypes is None:
        return {}
    if isinstance(dtypes, str):
        asked = {n: dtypes for n in decls if n not in scale_names}
    elif isinstance(dtypes, Mapping):
        asked = dict(dtypes)
    else:
        raise DtypeConversionError(f"dtypes is {type(dtypes).__name__}; give one dtype name for every tensor, or a "
                                   f"dict of tensor name -> dtype name")
    unknown = sorted(set(asked) - set(decls))
    if unknown:
        raise DtypeConversionError(f"dtypes names tensors {unknown[:5]} that are not moved here; name only tensors "
                                   f"of this reshard_many ({sorted(decls)[:5]}{' ...' if len(decls) > 5 else ''})")
    supported = "; ".join(f"{to} from {', '.join(froms)}" for to, froms in CONVERSIONS.items())
    out = {}
    for name, want in asked.items():
        t = decls[name]
        if not isinstance(want, str):
            raise DtypeConversionError(f"dtype asked for tensor {name!r} is {want!r}; give a dtype name such as "
                                       f"{FP8!r}")
        try:
            want = dtype_name(want)
        except ValueError as e:
            raise DtypeConversionError(f"tensor {name!r} ({t.dtype}) is asked for as {want!r}: {e}; reshard converts "
                                       f"{supported}") from None
        if want == t.dtype:
            continue
        if t.dtype not in CONVERSIONS.get(want, ()):
            raise DtypeConversionError(f"tensor {name!r} is {t.dtype} and is asked for as {want}, a conversion "
                                       f"reshard does not make on the way; it converts {supported}; leave the "
                                       f"tensor out of dtypes to move it as it is")
        if name in scale_names:
            raise DtypeConversionError(f"tensor {name!r} is the block scale of a weight here, asked for as {want}; "
                                       f"scales stay float32: leave it out of dtypes")
        if len(t.shape) != 2:
            raise DtypeConversionError(f"tensor {name!r} of shape {t.shape} is asked for as {want}, which quantizes "
                                       f"matrices in square blocks (the serving format's weight matrices); leave "
                                       f"1-D tensors such as norms and biases, and other non-2-D ones, out of "
                                       f"dtypes: they move as they are")
        if t.src is not None and t.src.is_partial:
            raise DtypeConversionError(f"tensor {name!r} is held as {t.src}, a pending sum; quantizing takes "
                                       f"values, so complete the sum first (reshard it on its own)")
        if name not in scales:
            raise DtypeConversionError(
                f"tensor {name!r} is asked for as {want}, which carries a float32 scale per {FP8_BLOCK} x "
                f"{FP8_BLOCK} block beside it, but scales names none for it; name one, e.g. "
                f"scales={{{name!r}: {name + '_scale_inv'!r}}} (the job creates it when it does not exist)")
        scale, block = scales[name]
        block = block_of(name, scale, block)
        grid = scale_shape(t.shape, block)
        have = decls.get(scale)
        if have is not None and (have.shape != grid or have.dtype != "float32"):
            raise DtypeConversionError(
                f"scale {scale!r} of weight {name!r} {t.shape} is {have.dtype}{list(have.shape)}, but quantizing in "
                f"blocks of {block} makes float32{list(grid)}, one entry per block; delete it so the job makes it, "
                f"or name another scale tensor")
        out[name] = Conversion(name, want, scale, block)
    return out


# -- the quantize layout ---------------------------------------------------------------------------------------------


def _aligned(tiles: Iterable[Box], shape: Sequence[int], block: int) -> bool:
    return all(not boxes.volume(b) or all(lo % block == 0 and (hi % block == 0 or hi == n)
                                          for (lo, hi), n in zip(b, shape)) for b in tiles)


def quantize_layout(shape: Sequence[int], src: Sharding, block: int) -> Sharding:
    """Where a weight of ``shape`` held as ``src`` is quantized in blocks of ``block``: see the module docstring.

    Candidates are ``src`` and every assignment of its mesh's axes to the tensor's dims (or to none); those whose
    tiles are all whole blocks are priced by the elements their devices lack, from other hosts first, then from
    other devices of their host; the first of the cheapest wins (``src`` itself when it is aligned)."""
    shape = tuple(shape)
    mesh = src.mesh
    src_tiles = src.tiles(shape)
    if _aligned(src_tiles.values(), shape, block):
        return src
    host_tiles: dict[str, list[Box]] = defaultdict(list)
    for dev, tile in src_tiles.items():
        if boxes.volume(tile) and tile not in host_tiles[host_of(dev)]:
            host_tiles[host_of(dev)].append(tile)
    best = None
    for k, candidate in enumerate(_candidates(mesh, len(shape))):
        try:
            tiles = candidate.tiles(shape)
        except InvalidShardingError:
            continue
        if not _aligned(tiles.values(), shape, block):
            continue
        other_hosts = other_devices = 0
        for dev, tile in tiles.items():
            if not boxes.volume(tile):
                continue
            other_hosts += sum(map(boxes.volume, boxes.uncovered(tile, host_tiles[host_of(dev)])))
            other_devices += sum(map(boxes.volume, boxes.uncovered(tile, [src_tiles[dev]])))
        key = (other_hosts, other_devices, k)
        if best is None or key < best[0]:
            best = (key, candidate)
    assert best is not None, "the layout with no split dim is whole blocks"
    return best[1]


def _candidates(mesh: Mesh, ndim: int) -> Iterable[Sharding]:
    """Every layout of ``ndim`` dims over ``mesh``'s axes, each axis on one dim or none (several on one dim in mesh
    order); then the same over its devices as hosts x devices of a host, where each host's devices are consecutive
    in the mesh and the mesh has no such axes: a mesh with one axis over every device then has a layout of rows over
    hosts, whose gather stays within hosts."""
    meshes = [mesh]
    devices = mesh.require_devices()
    hosts = list(dict.fromkeys(map(host_of, devices)))
    per_host = len(devices) // len(hosts)
    if (1 < len(hosts) < len(devices) and len(hosts) * per_host == len(devices)
            and all(host_of(d) == hosts[i // per_host] for i, d in enumerate(devices))
            and sorted(n for _, n in mesh.axes if n > 1) != sorted((len(hosts), per_host))):
        meshes.append(Mesh({"host": len(hosts), "device": per_host}, devices))
    for m in meshes:
        axes = [a for a, n in m.axes if n > 1]
        for choice in itertools.product(range(ndim + 1), repeat=len(axes)):
            try:
                yield Sharding(m, [tuple(a for a, c in zip(axes, choice) if c == d) or None for d in range(ndim)])
            except InvalidShardingError:
                continue


# -- steps -----------------------------------------------------------------------------------------------------------


class QuantizedSteps:
    """The steps of one quantized weight and its scale (see the module docstring), ids from ``first`` on.

    ``source`` is the weight as held; ``weight`` and ``scale`` as moved (their new dtypes, from the quantize
    layout, with their destinations); ``weight_moves`` and ``scale_moves`` their planned transfers (phases as a
    plan's)."""

    def __init__(self, first: int, source: TensorDecl, conversion: Conversion, weight: TensorDecl,
                 scale: TensorDecl, weight_moves: Sequence[Transfer], scale_moves: Sequence[Transfer]):
        self.first = first
        self.steps: list[Step] = []
        self.block = conversion.block
        self.source = source_name(source.name, source.dtype)
        self._src_tiles = source.src.tiles(source.shape)
        self._q_tiles = weight.src.tiles(weight.shape)
        self._sent: dict[str, int] = defaultdict(int)  # gather bytes each source device sends, to spread them
        w_need, w_keep = self._needs(weight, weight_moves)
        s_need, s_keep = self._needs(scale, scale_moves)
        makers = [d for d in weight.src.mesh.require_devices() if d in w_need or d in s_need]
        reads = {d: self._gather(d) for d in makers}
        params = {"block": str(self.block)}
        made_w, made_s = {}, {}
        for d in makers:
            role, after = reads[d]
            tile = self._q_tiles[d]
            x = TileRef(self.source, role, tile)
            # The scales first, wherever the values are made too: the quantize divides by them (one read of the
            # tile's blocks for their scales, not two); a device that sends no scales keeps them in role q unsent.
            scales = TileRef(scale.name, QUANTIZED, scale_box(tile, self.block))
            made = self._add(Step.compute, after, kernel="fp8_scales", device=d, inputs=[x], output=scales,
                             params=params)
            if d in s_need:
                made_s[d] = made
            if d in w_need:
                made_w[d] = self._add(Step.compute, [made], kernel="fp8_quantize_scaled", device=d,
                                      inputs=[x, scales], output=TileRef(weight.name, QUANTIZED, tile),
                                      params=params)
        self._moves(weight.name, weight_moves, w_keep, made_w)
        self._moves(scale.name, scale_moves, s_keep, made_s)

    def _add(self, make, after: Iterable[int] = (), **kw) -> int:
        i = self.first + len(self.steps)
        self.steps.append(make(i, after=sorted(set(after)), **kw))
        return i

    @staticmethod
    def _needs(moved: TensorDecl, transfers: Sequence[Transfer]) -> tuple[set[str], dict[str, Box]]:
        """The devices that must quantize their tile of ``moved`` (senders of the first moves, and receivers that
        keep part of their own), and per receiver the box it keeps."""
        q_tiles = moved.src.tiles(moved.shape)
        keep = {}
        for dev, tile in moved.dst.tiles(moved.shape).items():
            mine = q_tiles.get(dev)
            held = boxes.intersect(mine, tile) if mine is not None else None
            if held is not None and boxes.volume(held):
                keep[dev] = held
        return {t.sender for t in transfers if not t.phase} | set(keep), keep

    def _gather(self, dev: str) -> tuple[str, list[int]]:
        """The role ``dev`` reads its quantize tile of the weight from, and the steps that put it there: its source
        tile where that holds it; else a copy of what it holds and moves of the rest into role ``dst``, each part
        from a device of its host where one holds it, spread over the holders by bytes sent."""
        tile, own = self._q_tiles[dev], self._src_tiles.get(dev)
        if own is not None and boxes.contains(own, tile):
            return SRC, []
        after = []
        held = boxes.intersect(own, tile) if own is not None else None
        if held is not None and boxes.volume(held):
            after.append(self._add(Step.compute, kernel="copy", device=dev, inputs=[TileRef(self.source, SRC, held)],
                                   output=TileRef(self.source, DST, held)))
        holders: dict[Box, list[str]] = defaultdict(list)
        for d, t in self._src_tiles.items():
            if boxes.volume(t):
                holders[t].append(d)
        here = host_of(dev)
        for piece in boxes.uncovered(tile, [own] if own is not None else []):
            # The tiles of a layout of values are equal or disjoint: each part of the piece comes from one of them.
            for src_tile, devs in holders.items():
                part = boxes.intersect(piece, src_tile)
                if part is None or not boxes.volume(part):
                    continue
                near = [d for d in devs if host_of(d) == here] or devs
                sender = min(near, key=lambda d: (self._sent[d], devs.index(d)))
                self._sent[sender] += boxes.volume(part)
                method = "local" if host_of(sender) == here else "p2p"
                after.append(self._add(Step.move, transfer=Transfer(part, sender, (dev,), method),
                                       tensor=self.source))
        return DST, after

    def _moves(self, name: str, transfers: Sequence[Transfer], keep: Mapping[str, Box],
               made: Mapping[str, int]) -> None:
        """Moves of ``name`` from what the quantize steps ``made`` (a relay from what earlier phases delivered), and
        a copy of each kept box into its receiver's ``dst``."""
        delivered: dict[str, list[tuple[int, int, Box]]] = defaultdict(list)
        for t in sorted(transfers, key=lambda t: t.phase):
            if t.phase:
                after = [j for j, phase, b in delivered.get(t.sender, ())
                         if phase < t.phase and boxes.intersect(b, t.box) is not None]
            else:
                after = [made[t.sender]]
            phase = t.phase
            if phase:
                t = Transfer(t.box, t.sender, t.receivers, t.method, 0, t.route)
            i = self._add(Step.move, after, transfer=t, tensor=name)
            for r in t.receivers:
                delivered[r].append((i, phase, t.box))
        for dev, box in keep.items():
            self._add(Step.compute, [made[dev]], kernel="copy", device=dev, inputs=[TileRef(name, QUANTIZED, box)],
                      output=TileRef(name, DST, box))
