"""Many tensors in one program: a state dict moved together, small moves packed into buckets, block scales that
follow their weights.

`plan_many` plans every tensor's reshard into one `ManyProgram`, which agents run as one job:

================ ==================================================================================
load balance     strategy ``auto``: every layout (shape, dtype, source and destination shardings) is
                 planned once, by `reshard.plan` with ``copies=`` its tensors, against one `Loads`
                 shared by all of them, largest layout in all first, so each plan's greedy sees the
                 NIC loads of the layouts before it and spreads replicated tiles over their
                 replicas' hosts, where planning each tensor alone picks the same least-loaded
                 replica for all of them. The tensors of one layout (a state dict's layers) move
                 alike, sharing their transfers: the 61 layers of a Kimi-K2-like state dict are a
                 few thousand layouts over 139,583 tensors, so planning costs what one layer's does,
                 and the estimate stays at the lower bound (bench/plan_quality.py).
                 Strategy ``broadcast`` plans each tensor alone, then, over all tensors at
                 once, gives every network transfer that reads a replicated source tile again the
                 replica host (and, for a chain, the host that ends the chain and so forwards
                 nothing) that keeps the busiest NIC lowest, largest transfers first; kept only
                 when the busiest NIC ends no busier than without it
bucket           move steps that wait for nothing and go between the same sender device and the
                 same receivers the same way (method, route), each of fewer than ``bucket_bytes``
                 bytes, packed in step order into groups of at least ``bucket_bytes`` (the last
                 group of each such pair may be smaller); an agent sends a bucket as one stream of
                 its members' bytes, one box after the other in C order, instead of one stream per
                 box. A chain of fewer than `SHARED_ROUTE_BYTES` (64 KiB) takes the route of the
                 first such chain from its sender to the same receivers, so that a state dict's
                 norms and biases share a bucket instead of one per order their plans chose.
                 The moves of quantized weights and their scales, which wait for the quantize
                 steps, are packed the same way among themselves, by dependency depth too: a
                 bucket waits for everything its members wait for, and members of one depth
                 never wait for one another (a state dict of experts made 546 such moves in the
                 scaled-down MoE of bench/moe_sync.py, 240 of them a scale of a few hundred bytes).
                 ``bucket_bytes`` 0 packs nothing
block scale      a weight's scale tensor (``scales={"w": "w_scale"}``, or ``{"w": ("w_scale", 128)}``
                 naming the block) has one entry per block of ``b`` elements of each weight dim: a
                 dim of ``n`` has ``ceil(n / b)`` of them. It is laid out like its weight (same mesh,
                 the same axes per dim, `scale_sharding`), which gives every device exactly the
                 scales of its weight tile when every weight tile starts on a block boundary
quantize         ``dtypes`` asks for a weight in ``float8_e4m3fn``: its senders quantize it before the
                 moves (``fp8_scales``, ``fp8_quantize_scaled``) and the wire carries the fp8 values and the
                 float32 scales, made on the way (`reshard.quantize`); without ``dtypes`` a program is
                 what it always was, byte for byte
================ ==================================================================================

A `ManyProgram` is a `Program` with its ``buckets`` (groups of step ids): they are part of its JSON and
of its id, and `ManyProgram.validate` checks them with the rest.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain, compress, repeat
from operator import attrgetter, is_
from typing import Optional, Union

import numpy as np

from reshard import box as boxes
from reshard.cost import HostCache
from reshard.delivery import link_numbers
from reshard.errors import InvalidShardingError, PlanValidationError, ProgramSizeError, ScaleLayoutError
from reshard.jsonio import brief, field_of, loads, need
from reshard.plans import Transfer
from reshard.program import (DST, MOVE, SRC, Program, Run, RunSteps, Step, StepsLike, TensorDecl, decl_with,
                             move_steps, moves_like, no_cycle_collection)
from reshard.quantize import (Conversion, DtypeConversionError, QuantizedSteps, conversions, quantize_layout,
                              source_name)
from reshard.sharding import Sharding
from reshard.strategies import STRATEGIES, Loads, plan
from reshard.topology import Topology

_step_output = attrgetter("output")

__all__ = ["ManyProgram", "plan_many", "scale_sharding", "scale_pairs", "follow_scales", "program_from_json",
           "DEFAULT_BUCKET_BYTES", "MAX_BUCKET_BYTES", "SHARED_ROUTE_BYTES"]

MiB = 2**20
# Measured with bench/buckets.py (reshard_many of 500 tensors on 4+4 local agents, the sizes taking turns): see
# BENCHMARKS.md. Fewer, larger streams cost less to schedule and check, and a chain still pipelines them chunk by
# chunk; the price is memory: a bucket is packed whole on its sender and held whole on each receiving device until
# its last byte, one per transfer that runs at once (on the collective transport, `AgentConfig.collective_lanes`,
# and as many again on the lanes for routes under 1 MiB).
# 16 and 64 MiB took turns being the faster in four runs; 16 holds a quarter of the memory.
DEFAULT_BUCKET_BYTES = 16 * MiB
MAX_BUCKET_BYTES = 1024 * MiB  # a bucket is packed in memory on its sender; larger ones gain nothing
# A chain this small takes the route of the first one from its sender to the same receivers (`_Buckets`). The
# weight sync of bench/weight_sync.py sent its norms and biases by up to 6 orders of the same 4 hosts per sender, each
# a bucket of a few KiB and a stream per hop. Sharing them took 56 buckets to 38, and the CPU of a move, the planner's
# and every agent's together, down 6% or more in each of 6 alternating runs. The order of a chain this small balances
# nothing.
SHARED_ROUTE_BYTES = 64 * 2**10
# A bucket of quantized weights' moves waits on its sender for every member's quantize step (1-2 ms of an agent's
# Python each for a tiny weight), while its receiver's posted receive counts down (then `--collective-timeout`,
# 30 s; now the transfer timeout): a sync of 20,000 tiny weights packed them into one bucket, and its receive gave
# up. This many members, 0.3-0.5 s of steps, bound a bucket's wait, and let the first buckets leave while the rest
# are quantized.
WAITING_BUCKET_MOVES = 256
# Strategies whose senders the joint pass may move: the baselines send_recv and local_allgather stay as
# measured, the way Alpa runs them.
_TRANSFER = attrgetter("transfer")
_BALANCED = ("broadcast",)  # auto balances as it plans, against one Loads


@dataclass(frozen=True)
class ManyProgram(Program):
    """A program over many tensors whose ``buckets`` (tuples of move step ids) each travel as one stream."""

    buckets: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.buckets, (str, bytes)) or not isinstance(self.buckets, Iterable):
            raise PlanValidationError(f"buckets {brief(self.buckets)} must be a sequence of step id sequences")
        buckets = self.buckets
        if not (type(buckets) is tuple and {*map(type, buckets)} <= {tuple}
                and {*map(type, chain.from_iterable(buckets))} <= {int}):  # as plan_many makes them: kept
            object.__setattr__(self, "buckets", tuple(tuple(map(int, b)) for b in buckets))

    def _canonical(self) -> dict:
        out = super()._canonical()
        out["buckets"] = [list(b) for b in self.buckets]
        return out

    def _json_fields(self, canonical: bool) -> dict[str, Iterable[str]]:
        out = super()._json_fields(canonical)
        # what the encoder writes for a list of lists of ints (`__post_init__` made them so), without it
        sep = "," if canonical else ", "
        out["buckets"] = (f"[{sep.join([f'[{sep.join(map(str, b))}]' for b in self.buckets])}]",)
        return out

    @classmethod
    def from_json(cls, data, check_id: bool = True) -> "ManyProgram":
        """Read what `to_json` writes (text as `Program.from_json` reads it)."""
        if isinstance(data, (str, bytes, bytearray)):
            data = loads(data, "program JSON", max_bytes=None)
        need(data, "object", "program JSON", PlanValidationError)
        raw = field_of(data, "buckets", "array", "program JSON", PlanValidationError)
        if {*map(type, raw)} <= {list} and {*map(type, chain.from_iterable(raw))} <= {int}:  # as they are written
            return cls._read(cls._program_kind(data), check_id, buckets=tuple(map(tuple, raw)))
        buckets = []
        for i, group in enumerate(raw):
            need(group, "array", f"program JSON bucket {i}", PlanValidationError)
            buckets.append(tuple(need(s, "integer", f"program JSON bucket {i} item {j}", PlanValidationError)
                                 for j, s in enumerate(group)))
        return cls._read(cls._program_kind(data), check_id, buckets=tuple(buckets))

    @staticmethod
    def _program_kind(data: Mapping) -> Mapping:
        if data.get("kind") != "program":
            raise PlanValidationError(f"program JSON with buckets has kind {brief(data.get('kind'))}, not 'program'")
        return data

    def validate(self) -> "ManyProgram":
        """`Program.validate`, and the buckets: each two or more move steps of the program, no step in two,
        every member reading what a plan's move reads (role ``src``) at one dependency depth, between the same
        sender and receivers by the same method and route."""
        return super().validate()  # which runs `_validate` below

    def _validate(self) -> None:
        super()._validate()
        if not _buckets_ok(self):
            self._check_buckets()
        self._check_made_tiles()

    def _check_made_tiles(self) -> None:
        """A tensor the steps make (a destination and no source: quantized on the way) gets every destination tile
        written whole, each element once, in role ``dst`` (`Program.validate` proves this for moved tensors only)."""
        made = {t.name: t for t in self.tensors if t.src is None and t.dst is not None}
        if not made:
            return
        # Per made tensor, what writes it: (a move's receivers or a compute's device, box), its moves first, then its
        # other steps. A run's writes are its template's, renamed (`Program._repeated`): listed once per template,
        # as a group that each run renames, so the steps looked at one by one are those outside the runs (a state
        # dict quantized on the way holds millions of steps, nearly all in runs).
        groups: dict[str, list[list]] = defaultdict(list)
        single: dict[str, list] = defaultdict(list)
        repeated = self._repeated
        if repeated is None:
            self._made_writes(range(len(self.steps)), made, single)
        else:
            self._made_writes(np.flatnonzero(~repeated).tolist(), made, single)
            templates: dict[tuple[int, int], dict[str, list]] = {}
            for first, count, like, renames in self.__dict__["_runs"]:
                written = templates.get((like, count))
                if written is None:
                    written = templates[like, count] = defaultdict(list)
                    self._made_writes(range(like, like + count), made, written)
                if written:
                    found = 0
                    for was, now in renames:  # (as many as the template names: a quantized weight's three)
                        pairs = written.get(was)
                        if pairs is not None:
                            groups[now].append(pairs)
                            found += 1
                    if found < len(written):  # names the run keeps
                        kept = {was for was, _ in renames}
                        for name, pairs in written.items():
                            if name not in kept:
                                groups[name].append(pairs)
        # A state dict's made tensors of one layout are written by the very same objects (their steps are one
        # another's renamed, `reshard.program.Run`): each such pattern is checked once. (The objects live as long
        # as this program, so their ids stay theirs; equal values in other objects only cost a check more.)
        proven: set[tuple] = set()
        for t in made.values():
            done = single.get(t.name, [])
            key = (t.shape, t.dst, tuple((id(where), id(box)) for where, box in done), tuple(map(id, groups[t.name])))
            if key in proven:
                continue
            done = [*done, *chain.from_iterable(groups[t.name])]
            written: dict[str, list] = defaultdict(list)
            for where, box in done:
                for dev in (where,) if type(where) is str else where:
                    written[dev].append(box)
            for dev, tile in t.dst.tiles(t.shape).items():
                pieces = written.get(dev, [])
                left = boxes.uncovered(tile, pieces)
                if left or sum(map(boxes.volume, pieces)) != boxes.volume(tile):
                    why = (f"no step writes {boxes.box_str(left[0])} of it" if left else
                           f"steps write {sum(map(boxes.volume, pieces))} elements into its "
                           f"{boxes.volume(tile)}, some twice")
                    raise PlanValidationError(
                        f"tensor {t.name!r} is made by the program's steps and must end in {t.dst.spec_str()}, but "
                        f"device {dev}'s destination tile {boxes.box_str(tile)}: {why}; each element of a made "
                        f"tile is written once, by a move or a compute step into role 'dst'")
            proven.add(key)

    def _made_writes(self, at: Iterable[int], made: Mapping[str, TensorDecl], writes: dict[str, list]) -> None:
        """Add to ``writes`` what the steps ``at`` write into the made tensors: per tensor, (a move's receivers or a
        compute's device, box) in role ``dst``, the moves first, then the other steps, each in step order."""
        steps = self.steps
        kinds, tensors, _ = self._columns
        at = list(at)
        for s in compress(map(steps.__getitem__, at), [tensors[i] in made for i in at]):  # only moves name a tensor
            writes[s.tensor].append((s.transfer.receivers, s.transfer.box))
        others = [steps[i] for i in at if kinds[i] != MOVE]
        outputs = list(map(_step_output, others))
        for s, out in compress(zip(others, outputs),
                               [o is not None and o.tensor in made and o.role == DST for o in outputs]):
            writes[out.tensor] += [(dev, b) for dev, _, _, b in s.produces()]

    def _check_buckets(self) -> None:
        """The buckets' rules one step at a time, naming the first problem (`_buckets_ok` found one, or could not
        tell)."""
        seen: dict[int, int] = {}
        for k, group in enumerate(self.buckets):
            where = f"bucket {k} (steps {list(group)[:8]}{' ...' if len(group) > 8 else ''})"
            if len(group) < 2:
                raise PlanValidationError(f"{where}: a bucket packs two or more moves; leave a lone move out")
            first = None
            for i in group:
                if not 0 <= i < len(self.steps):
                    raise PlanValidationError(f"{where}: step {i} is not a step of this program (ids 0.."
                                              f"{len(self.steps) - 1})")
                if i in seen:
                    raise PlanValidationError(f"{where}: step {i} is already in bucket {seen[i]}; a move travels "
                                              f"in one stream")
                seen[i] = k
                s = self.steps[i]
                if s.kind != MOVE or s.role != SRC:
                    raise PlanValidationError(
                        f"{where}: step {s} is not a move that reads what a plan's move reads (role 'src'); a "
                        f"bucket is packed from its members' boxes as their moves would read them")
                t = s.transfer
                shape = (t.sender, t.receivers, t.method, t.route)
                if first is None:
                    first = (s, shape)
                elif self.depths[i] != self.depths[first[0].id]:
                    raise PlanValidationError(
                        f"{where}: step {s} is at dependency depth {self.depths[i]}, but step {first[0]} at "
                        f"{self.depths[first[0].id]}; a bucket waits for everything its members wait for, so its "
                        f"members share a depth (where none can wait for another)")
                elif shape != first[1]:
                    raise PlanValidationError(
                        f"{where}: step {s} goes {t.sender} -> {list(t.receivers)} by {t.method}, but step "
                        f"{first[0]} goes {first[1][0]} -> {list(first[1][1])} by {first[1][2]}; a bucket is one "
                        f"stream, so its moves share sender, receivers, method and route")

    def __str__(self) -> str:
        nbytes = sum(math.prod(t.shape) * t.itemsize for t in self.tensors)
        packed = sum(len(b) for b in self.buckets)
        return (f"Program {self.id[:12]} {self.strategy or 'custom'}: {len(self.tensors)} tensors, "
                f"{nbytes / MiB:.1f} MiB, {len(self.steps)} steps ({packed} packed in {len(self.buckets)} "
                f"buckets), estimate {self.estimate_seconds:.4g}s")


def _buckets_ok(program: ManyProgram) -> bool:
    """Whether ``program``'s buckets keep every rule `ManyProgram.validate` names, checked as columns: a bucket per
    tens of moves of a state dict, where building each member's where-string and path tuple was a quarter of
    validating it. False leaves the verdict, and the message, to `ManyProgram._check_buckets`."""
    steps, buckets = program.steps, program.buckets
    if not buckets:
        return True
    size = np.fromiter(map(len, buckets), dtype=np.int64, count=len(buckets))
    members = np.fromiter(chain.from_iterable(buckets), dtype=np.int64, count=int(size.sum()))
    if (size < 2).any() or (members < 0).any() or (members >= len(steps)).any():
        return False
    if np.bincount(members, minlength=len(steps)).max(initial=0) > 1:  # a step in two buckets, or twice in one
        return False
    if not program._src_moves[members].all():
        return False
    firsts = np.cumsum(size) - size
    depth = program._depth_column[members]
    if not (depth == np.repeat(depth[firsts], size)).all():
        return False
    # Each member's (sender, receivers, method, route) is its bucket's first member's: the very objects (the planner
    # shares them between a bucket's moves), else numbered by value.
    ids = program._link_ids[members]
    same = (ids == np.repeat(ids[firsts], size, axis=0)).all(axis=0)
    if same.all():
        return True
    # equal values in other objects (a layout's plan and another's make their own receivers' tuples): the parts
    # that differ numbered by value, each distinct object read once
    path = link_numbers(_Members(program, members), ids, np.flatnonzero(~same).tolist())
    return bool((path == np.repeat(path[firsts], size)).all())


class _Members(Sequence):
    """The transfers of a program's bucket members, in bucket order, read where asked (`link_numbers` reads the
    first of each distinct object only)."""

    def __init__(self, program: Program, members: np.ndarray):
        self.program, self.members = program, members

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, i):
        return self.program.transfers_of(self.members[i:i + 1])[0]  # a run's member's: its template's


def program_from_json(data, check_id: bool = True) -> Program:
    """A program from its JSON: a `ManyProgram` when it has buckets, else what `Program.from_json` reads
    (``check_id`` as there)."""
    if isinstance(data, (str, bytes, bytearray)):
        data = loads(data, "program JSON", max_bytes=None)
    if isinstance(data, Mapping) and "buckets" in data:
        return ManyProgram.from_json(data, check_id)
    return Program.from_json(data, check_id)


# -- block scales -----------------------------------------------------------------------------------------------


Block = Union[int, Sequence[int], None]  # elements a scale entry covers, for every dim or per dim; None: from the shapes


def scale_pairs(scales: Mapping[str, object]) -> dict[str, tuple[str, Block]]:
    """``scales`` as weight -> (scale name, block sizes or None): a value is the scale's name, or (name, block),
    the block an int for every dim or one per dim."""
    out = {}
    for w, value in dict(scales).items():
        block = None
        if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str):
            value, block = value
            block = (block,) if isinstance(block, int) else block
            if block is not None and (not isinstance(block, Sequence) or isinstance(block, str) or not block or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise ScaleLayoutError(f"block of scale {value!r} for weight {w!r} is {block!r}: give a positive "
                                       f"number of elements, one for every dim or one per dim")
            block = tuple(block) if block is not None else None
        if not isinstance(w, str) or not isinstance(value, str):
            raise ScaleLayoutError(f"scales maps a weight's name to its scale's name, or to (name, block); got "
                                   f"{w!r}: {value!r}")
        out[w] = (value, block)
    return out


def scale_sharding(weight_shape, weight: Sharding, scale_shape, weight_name: str = "weight",
                   scale_name: str = "scale", block: Block = None) -> Sharding:
    """The sharding of a block-scale tensor of ``scale_shape`` that follows its weight of ``weight_shape`` laid out
    as ``weight``: the same mesh and axes per dim.

    ``block`` gives the elements one scale entry covers along each dim (one int for every dim). None takes
    ``n / s`` for a dim of ``n`` elements with ``s`` entries where ``s`` divides ``n``, the convention (1024 rows
    with 8 scale rows are blocks of 128); where it does not, several sizes make ``s`` blocks (1023 rows are 8
    blocks of anything from 128 to 146), so a dim that the layout splits needs ``block``. Name it too when the
    quantizer's block is not ``n / s`` (1000 rows in blocks of 128 have 8 scale rows as well). Raises
    `ScaleLayoutError` when the shapes are not a weight and its block scales, or when a weight tile does not start
    on a block boundary (its scales could not follow it)."""
    w_shape = weight.check_shape(weight_shape)
    s_shape = tuple(scale_shape)
    what = f"scale {scale_name!r} of shape {s_shape} for weight {weight_name!r} of shape {w_shape}"
    if len(s_shape) != len(w_shape):
        raise ScaleLayoutError(
            f"{what}: a block scale has one dim per weight dim (the number of blocks along it), but it has "
            f"{len(s_shape)} dims and the weight {len(w_shape)}")
    if weight.is_partial:
        raise ScaleLayoutError(f"{what}: the weight's layout {weight.spec_str()} is a pending sum; block scales "
                               f"follow values, so complete the sum first")
    if block is not None:
        block = (block,) if isinstance(block, int) else tuple(block)
        block = block * (len(w_shape) if len(block) == 1 else 1)
        if len(block) != len(w_shape):
            raise ScaleLayoutError(f"{what}: block {block} gives {len(block)} sizes for {len(w_shape)} dims; give one "
                                   f"for every dim, or one per dim")
    split = [bool(axes) for axes in weight.dim_axes(len(w_shape))]
    blocks = []
    for d, (n, s) in enumerate(zip(w_shape, s_shape)):
        if isinstance(s, bool) or not isinstance(s, int) or not 0 < s <= n:
            raise ScaleLayoutError(f"{what}: dim {d} has {s!r} scale entries for {n} weight elements; a dim has "
                                   f"1 to {n} blocks")
        b = block[d] if block is not None else -(-n // s)
        if -(-n // b) != s:
            raise ScaleLayoutError(
                f"{what}: {s} blocks along dim {d} would be {b} elements each, but {n} elements make "
                f"{-(-n // b)} blocks of {b}" + ("" if block is not None else
                                                 f"; no block size gives {s} blocks of a dim of {n}"))
        if block is None and n % s and split[d]:
            top = -(-n // (s - 1)) - 1 if s > 1 else n
            raise ScaleLayoutError(
                f"{what}: dim {d} of {n} elements has {s} scale entries, which blocks of {b} to {top} elements all "
                f"make, and {weight.spec_str()} splits that dim, so where its tiles may start depends on which; "
                f"name the block size: scales={{{weight_name!r}: ({scale_name!r}, block)}}")
        blocks.append(b)
    out = Sharding(weight.mesh, weight.spec)
    s_tiles = out.tiles(s_shape)
    for dev, tile in weight.tiles(w_shape).items():
        for d, ((lo, hi), b) in enumerate(zip(tile, blocks)):
            if lo < hi and lo % b:
                raise ScaleLayoutError(
                    f"{what}: device {dev}'s tile of the weight, {boxes.box_str(tile)} in {weight.spec_str()}, "
                    f"starts at {lo} along dim {d}, inside a block of {b} elements, so its scales could not "
                    f"follow it; lay the weight out so every tile along dim {d} is whole blocks (dim {d} of "
                    f"{w_shape[d]} cut into pieces of a multiple of {b}), or reshard it without its scales")
        want = tuple((lo // b, -(-hi // b)) if lo < hi else None for (lo, hi), b in zip(tile, blocks))
        got = s_tiles[dev]
        if any(w is not None and w != g for w, g in zip(want, got)) or (None in want and boxes.volume(got)):
            raise ScaleLayoutError(
                f"{what}: in {weight.spec_str()} device {dev} holds weight tile {boxes.box_str(tile)} but would "
                f"hold scale tile {boxes.box_str(got)}, not the blocks of its weight; choose a layout whose tiles "
                f"are whole blocks along every split dim")
    return out


def follow_scales(tensors: Iterable[TensorDecl], scales: Mapping[str, object]) -> list[TensorDecl]:
    """``tensors`` with each scale's destination derived from its weight's (`scale_sharding`); ``scales`` as
    `scale_pairs` reads it. A scale given a destination already must be given that one; every weight and scale
    must be among ``tensors``."""
    decls = list(tensors)
    by_name = {t.name: t for t in decls}
    pairs = scale_pairs(scales)
    scale_of: dict[str, str] = {}
    for w, (s, _) in pairs.items():
        for role, name in (("weight", w), ("scale", s)):
            if name not in by_name:
                raise ScaleLayoutError(f"{role} {name!r} of the pair {w!r} -> {s!r} is not among the tensors "
                                       f"{sorted(by_name)[:10]}; name tensors that are moved together")
        if s == w or s in pairs:
            raise ScaleLayoutError(f"scale {s!r} of weight {w!r} is itself a weight here; a scale follows one "
                                   f"weight and has none of its own")
        if s in scale_of:
            raise ScaleLayoutError(f"scale {s!r} follows both {scale_of[s]!r} and {w!r}; give each weight its "
                                   f"own scale tensor")
        scale_of[s] = w
    out = []
    # A state dict's layers repeat a few (weight shape, layout, scale shape, block): each is derived once (the names
    # only word a refusal, which the first of them raises).
    derived_of: dict[tuple, Sharding] = {}
    for t in decls:
        w = scale_of.get(t.name)
        if w is not None:
            weight = by_name[w]
            if weight.dst is None:
                raise ScaleLayoutError(f"weight {w!r} has no destination sharding for its scale {t.name!r} to "
                                       f"follow")
            key = (weight.shape, weight.dst, t.shape, pairs[w][1])
            derived = derived_of.get(key)
            if derived is None:
                derived = derived_of[key] = scale_sharding(weight.shape, weight.dst, t.shape, w, t.name, pairs[w][1])
                derived.check_shape(t.shape)  # as TensorDecl checks it, once per key
            if t.dst is not None and t.dst != derived:
                raise ScaleLayoutError(
                    f"scale {t.name!r} is given destination {t.dst} but follows weight {w!r} into {derived}; "
                    f"leave the scale's destination out, or give it that one")
            t = decl_with(t, dst=derived)
        out.append(t)
    return out


# -- planning ------------------------------------------------------------------------------------------------------


def plan_many(tensors: Iterable[TensorDecl], topology: Optional[Topology] = None, strategy: str = "auto",
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, scales: Optional[Mapping[str, object]] = None,
              dtypes: Union[str, Mapping[str, str], None] = None, max_steps: Optional[int] = None) -> ManyProgram:
    """One program that moves every tensor (a `TensorDecl` with ``src`` and ``dst``) to its destination.

    Tensors are planned one by one with ``strategy`` (as `reshard.plan`), balanced together, and small moves
    packed into buckets of ``bucket_bytes`` (see the module docstring). ``scales`` maps a weight's name to its
    block-scale tensor's (or to (name, block), `scale_sharding`), whose destination may be left None: it follows
    the weight's. ``dtypes`` (one dtype name for every tensor but the scales, or {name: dtype}) asks for weights in
    another dtype: ``float8_e4m3fn`` quantizes them on the way (`reshard.quantize`), each with its scale in
    ``scales``, whose ``src`` is then unused (it may be None: the program makes the scales). ``max_steps`` bounds
    the steps the program may hold (what its planner holds, about a kilobyte each): `ProgramSizeError`, naming the
    count, as soon as the planned layouts show more, before their steps are made.
    """
    if strategy not in STRATEGIES:
        raise InvalidShardingError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or not 0 <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise InvalidShardingError(f"bucket_bytes {bucket_bytes!r} must be an integer from 0 (no buckets) to "
                                   f"{MAX_BUCKET_BYTES} ({MAX_BUCKET_BYTES // MiB} MiB)")
    decls = list(tensors)
    if not decls:
        raise InvalidShardingError("plan_many needs at least one tensor; got none")
    for t in decls:
        if not isinstance(t, TensorDecl):
            raise InvalidShardingError(f"plan_many takes reshard.TensorDecl values (name, shape, dtype, src, dst); "
                                       f"got {type(t).__name__}")
    if scales:
        decls = follow_scales(decls, scales)
    converted = conversions(decls, dtypes, scale_pairs(scales or {})) if dtypes is not None else {}
    made = {c.scale for c in converted.values()}
    for t in decls:
        if (t.src is None and t.name not in made) or t.dst is None:
            raise InvalidShardingError(f"tensor {t.name!r} needs both src and dst shardings to be moved; it has "
                                       f"src {t.src} and dst {t.dst}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise InvalidShardingError(f"max_steps {max_steps!r} must be a positive integer, or None for no bound")
    topology = topology or Topology()
    with no_cycle_collection():
        return _plan_many(decls, topology, strategy, bucket_bytes, converted, max_steps)


def _plan_many(decls: list[TensorDecl], topology: Topology, strategy: str, bucket_bytes: int,
               converted: Mapping[str, Conversion], max_steps: Optional[int] = None) -> ManyProgram:
    """`plan_many` of checked arguments."""
    given = decls
    if converted:
        decls = _as_moved(decls, converted)
    # Largest first, as each plan's own greedy goes: the joint pass then settles the large transfers first.
    order = sorted(range(len(decls)), key=lambda i: -math.prod(decls[i].shape) * decls[i].itemsize)
    # A state dict's layers repeat a few layouts: the tensors of one (shape, dtype, source, destination) are planned
    # once, all together, and each moves the way that plan says.
    layouts: dict[tuple, list[int]] = defaultdict(list)
    for i in order:
        layouts[decls[i].shape, decls[i].dtype, decls[i].src, decls[i].dst].append(i)
    if strategy == "auto":
        # One record of the NICs' loads for all the tensors: each plan's greedy balances against the ones before,
        # a layout's plan counting all its tensors' bytes (copies=), largest layout first.
        nics = Loads(topology)
        groups = sorted(layouts.values(), key=lambda g: -len(g) * math.prod(decls[g[0]].shape) * decls[g[0]].itemsize)
        nics.set_floor([(nics.unit_tasks(decls[g[0]].shape, decls[g[0]].src, decls[g[0]].dst),
                         decls[g[0]].itemsize * len(g)) for g in groups], HostCache())
        planned = [(g, plan(decls[g[0]].shape, decls[g[0]].dtype, decls[g[0]].src, decls[g[0]].dst, loads=nics,
                            copies=len(g))) for g in groups]
    else:
        planned = [(g, plan(decls[g[0]].shape, decls[g[0]].dtype, decls[g[0]].src, decls[g[0]].dst, topology,
                            strategy)) for g in layouts.values()]
    if max_steps is not None:
        # Every tensor's moves at least (a quantized weight's gathers and computes come on top): known from the
        # layouts' plans alone, before a step is made.
        moving = sum(p.num_transfers * len(g) for g, p in planned)
        if moving > max_steps:
            raise ProgramSizeError(_too_many(moving, max_steps, len(decls), len(planned), "at least "))
    transfers: dict[int, list[Transfer]] = {}
    for g, p in planned:
        moves = list(p.transfers)
        for i in g:
            # the same list for all of a layout's tensors where nothing changes it per tensor (_balance does)
            transfers[i] = moves if strategy not in _BALANCED else list(moves)
    if strategy in _BALANCED:
        _balance([(decls[i], transfers[i]) for i in order], topology)
    steps: list[Step] = []
    packer = _Buckets(bucket_bytes)
    program_tensors: list[TensorDecl] = []
    position = {d.name: i for i, d in enumerate(decls)}
    scale_of = {c.scale: w for w, c in converted.items()}
    # per list of transfers (a layout's, shared by its tensors): its moves, where the first's begin, its name
    templates: dict[int, tuple[list[Step], int, str]] = {}
    quantized: dict[tuple, tuple] = {}  # per layout of quantized weights: its steps, names, packing, first step
    runs: list[Run] = []  # tensors' steps that repeat another's of their layout, renamed (the compact text)
    for i in (*order, None):
        # the steps so far against max_steps, once per tensor (and after the last)
        if max_steps is not None and len(steps) > max_steps:
            raise ProgramSizeError(_too_many(len(steps), max_steps, len(decls), len(layouts), "more than "))
        if i is None:
            break
        d = decls[i]
        if d.name in scale_of:
            continue  # made and moved with its weight
        c = converted.get(d.name)
        if c is not None:
            k = position[c.scale]
            source = given[i]
            names = (d.name, decls[k].name, source_name(d.name, source.dtype))
            # The weights of one layout (their moves and their scales' one list each) are made and moved alike: the
            # first's steps, renamed.
            key = (id(transfers[i]), id(transfers[k]), source.shape, source.dtype, source.src, c.dtype, c.block)
            found = quantized.get(key)
            if found is None:
                template = QuantizedSteps(0, source, c, d, decls[k], transfers[i], transfers[k]).steps
                # The weight (in its new dtype), its scale, and the weight as held, which the gathers move.
                packing = packer.waiting(template, {d.name: d.itemsize, decls[k].name: decls[k].itemsize,
                                                    names[2]: source.itemsize})
                found = quantized[key] = (StepsLike(template), names, packing, len(steps))
            like, was, packing, at = found
            if bucket_bytes:
                packer.pack_all(len(steps), packing)
            if at != len(steps):
                # A run of the first's steps (`pack_all` replaces none, unlike `add`), made only when asked for
                # (`RunSteps`): a planner validates, hashes, prices and writes it by its template's.
                runs.append((len(steps), len(like.steps), at, tuple(zip(was, names))))
                steps += repeat(None, len(like.steps))
            else:
                steps += like.make(len(steps), dict(zip(was, names)))
            # declarations made without their checks: the fields of checked ones, src left out or a name changed
            program_tensors += [decl_with(d, src=None), decl_with(decls[k], src=None),
                                decl_with(source, name=names[2], dst=None)]
            continue
        moves = transfers[i]
        found = templates.get(id(moves))
        if found is None:
            found = templates[id(moves)] = (move_steps(moves, 0, d.name), len(steps), d.name)
        template, like, was = found
        if like == len(steps):
            made = moves_like(template, len(steps), d.name)
            if bucket_bytes:
                packer.add(len(steps), transfers[i], made, d.itemsize)
            steps += made
        else:
            # Packed as the first's steps: where each keeps its transfer (`_Buckets._shared_route` may give a small
            # chain another), the tensor's steps are a run of the first's, renamed, made only when asked for
            # (`RunSteps`).
            n = len(template)
            packed = steps[like:like + n]
            if bucket_bytes:
                packer.add(len(steps), transfers[i], packed, d.itemsize)
            if all(map(is_, map(_TRANSFER, packed), map(_TRANSFER, steps[like:like + n]))):
                runs.append((len(steps), n, like, ((was, d.name),)))
                steps += repeat(None, n)
            else:
                steps += [_with_transfer(s, p.transfer) if p.transfer is not s.transfer else s
                          for s, p in zip(moves_like(template, len(steps), d.name), packed)]
        program_tensors.append(d)
    return ManyProgram(tuple(program_tensors), RunSteps(steps, runs) if runs else tuple(steps), strategy, topology,
                       packer.buckets())._with_runs(runs)


def _too_many(steps: int, max_steps: int, tensors: int, layouts: int, bound: str) -> str:
    return (f"a program of these {tensors:,} tensors ({layouts:,} layouts) would hold {bound}{steps:,} steps, over "
            f"the {max_steps:,} allowed (max_steps, reshard planner --max-program-steps); move the tensors in "
            f"several jobs, or raise the limit")


def _with_transfer(step: Step, transfer: Transfer) -> Step:
    """``step`` moving ``transfer`` instead, made without Step's checks: the same move along another route."""
    out = object.__new__(Step)
    object.__setattr__(out, "__dict__", {**step.__dict__, "transfer": transfer})
    return out


def _as_moved(decls: list[TensorDecl], converted: Mapping[str, Conversion]) -> list[TensorDecl]:
    """``decls`` as their moves carry them: a converted weight in its new dtype from its quantize layout, its scale
    (float32) from the same layout over the scale's blocks; the others as they are."""
    by_name = {d.name: d for d in decls}
    # A state dict repeats a few (shapes, layouts, block, dtype): each is chosen, and its declarations checked, once;
    # the others are the first's fields with their own names.
    layouts: dict[tuple, tuple[TensorDecl, TensorDecl]] = {}
    moved: dict[str, TensorDecl] = {}
    for w, c in converted.items():
        d = by_name[w]
        taken = source_name(w, d.dtype)
        if taken in by_name:
            raise DtypeConversionError(f"tensor {taken!r} is moved here too, but quantizing {w!r} names the weight as "
                                       f"it is held so in the program; rename that tensor")
        s = by_name[c.scale]
        key = (d.shape, d.src, d.dst, c.block, c.dtype, s.shape, s.dst)
        first = layouts.get(key)
        if first is None:
            q = quantize_layout(d.shape, d.src, c.block)
            # A block-aligned layout's scale tiles are its weight tiles' blocks (`scale_sharding`).
            first = layouts[key] = (TensorDecl(w, d.shape, c.dtype, q, d.dst),
                                    TensorDecl(c.scale, s.shape, "float32", Sharding(q.mesh, q.spec), s.dst))
        moved[w] = decl_with(first[0], name=w)
        moved[c.scale] = decl_with(first[1], name=c.scale)
    return [moved.get(d.name, d) for d in decls]


class _Buckets:
    """Packs the small moves that wait for nothing, per (sender, receivers, method, route), in step order: each
    tensor's moves as `move_steps` made them, one step per transfer (ids from ``first`` on), read from the
    transfers themselves (a state dict's program is hundreds of thousands of steps); and, apart from them, a
    quantized weight's moves by depth too (`waiting`, `pack_all`)."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self._open: dict[int, list] = {}  # path key's number (`_key`) -> [step ids, bytes so far]
        self._keys: dict[tuple, int] = {}  # path key -> its number: a tuple of receivers is hashed once, not per move
        self._full: list[list[int]] = []
        self._routes: dict[tuple, Transfer] = {}  # (sender, receivers as a set) -> its first small chain
        self._packables: dict[tuple, tuple] = {}  # (id of a list of transfers, itemsize) -> (it, `_packable`'s)
        # id of a small chain -> (it, the one it goes as, that one's path key's number)
        self._chosen: dict[int, tuple[Transfer, Transfer, int]] = {}

    def _key(self, key: tuple) -> int:
        return self._keys.setdefault(key, len(self._keys))

    def add(self, first: int, transfers: Sequence[Transfer], steps: list[Step], itemsize: int) -> None:
        """Pack the moves ``steps`` (ids from ``first`` on) of ``transfers``; a small chain's step is replaced by one
        along the shared route (`SHARED_ROUTE_BYTES`)."""
        self._pack(first, self._packable(transfers, steps, itemsize), transfers, steps)

    def _pack(self, first: int, packing: Sequence[tuple], transfers: Sequence[Transfer] = (),
              steps: Optional[list[Step]] = None, waiting: bool = False) -> None:
        """Pack the moves of ``packing`` ((position, path key's number, bytes, whether a small chain) each, ids
        from ``first`` on), a small chain along its shared route (of ``transfers``, replacing its step in
        ``steps``); moves that wait for steps, `WAITING_BUCKET_MOVES` at most a bucket."""
        open_, full, limit = self._open, self._full, self.bucket_bytes
        members = WAITING_BUCKET_MOVES if waiting else None
        for k, key, nbytes, small_chain in packing:
            group = open_.get(key)
            if small_chain:  # a small chain's order was a choice
                key = self._shared_route(transfers[k], steps, k, group is None)
                group = open_.get(key)
            if group is None:
                group = open_[key] = [[first + k], nbytes]
            else:
                group[0].append(first + k)
                group[1] += nbytes
            if group[1] >= limit or len(group[0]) == members:
                full.append(group[0])
                del open_[key]

    def _packable(self, transfers: Sequence[Transfer], steps: list[Step], itemsize: int) -> list[tuple]:
        """Of ``transfers``, those a bucket may take, as (position, path key, bytes, whether a small chain), worked
        out once per list (the tensors of one layout share theirs) and itemsize."""
        found = self._packables.get((id(transfers), itemsize))
        if found is not None and found[0] is transfers:
            return found[1]
        out = []
        box, nbytes = None, 0
        for k, t in enumerate(transfers):
            if t.phase and steps[k].after:
                continue
            if t.box is not box:
                # The moves of a star share their box and come one after another: its bytes are worked out once.
                box = t.box
                nbytes = boxes.volume(box) * itemsize
            if nbytes < self.bucket_bytes:
                out.append((k, self._key((t.sender, t.receivers, t.method, t.route)), nbytes,
                            len(t.route) > 1 and nbytes < SHARED_ROUTE_BYTES))
        self._packables[id(transfers), itemsize] = (transfers, out)  # the list kept: its id stays its own
        return out

    def waiting(self, steps: Sequence[Step], itemsize: Mapping[str, int]) -> list[tuple]:
        """The small moves among ``steps`` (ids from 0 on, waiting only for one another: a quantized weight's and
        its scale's) as `pack_all` packs them: by dependency depth as well as path, since moves of one depth never
        wait for one another, so a bucket that waits for all its members wait for makes no cycle. As `_pack` reads
        them, the same for every weight of one layout."""
        depth: list[int] = []
        out = []
        for k, s in enumerate(steps):
            d = 1 + max(depth[a] for a in s.after) if s.after else 0
            depth.append(d)
            if s.kind != MOVE or s.role != SRC:
                continue
            t = s.transfer
            nbytes = boxes.volume(t.box) * itemsize[s.tensor]
            if nbytes < self.bucket_bytes:
                out.append((k, self._key(("waiting", d, t.sender, t.receivers, t.method, t.route)), nbytes, False))
        return out

    def pack_all(self, first: int, packing: Sequence[tuple]) -> None:
        """Pack the moves `waiting` found, ids from ``first`` on."""
        self._pack(first, packing, waiting=True)

    def _shared_route(self, t: Transfer, steps: list[Step], k: int, unopened: bool) -> int:
        """``t`` along the route of the first small chain from its sender to the same receivers where no bucket of
        its own path is open (``unopened``), and step ``k`` of ``steps`` with it; the path key's number of the
        transfer it goes as. Decided once per transfer object:
        the tensors of one layout share their transfers (`plan_many`), and each of them goes the way the first did,
        in the very same transfer, so that their steps stay the first's renamed (the program's compact text)."""
        chosen = self._chosen.get(id(t))
        if chosen is None:
            key = (t.sender, frozenset(t.receivers))
            first = self._routes.setdefault(key, t)
            same = not unopened or (first.route == t.route and first.receivers == t.receivers)
            went = t if same else replace(t, receivers=first.receivers, route=first.route)
            chosen = self._chosen[id(t)] = (t, went, self._key((went.sender, went.receivers, went.method, went.route)))
        if chosen[1] is not t:  # the step with its transfer along the shared route (its receivers in that order)
            steps[k] = _with_transfer(steps[k], chosen[1])
        return chosen[2]

    def buckets(self) -> tuple[tuple[int, ...], ...]:
        out = self._full + [ids for ids, _ in self._open.values()]
        return tuple(tuple(b) for b in sorted(out) if len(b) > 1)


def _balance(tensors: list[tuple[TensorDecl, list[Transfer]]], topology: Topology) -> None:
    """Reassign, in place, the replica host (and the chain's last host) of every movable network transfer over
    all tensors together, largest first, each to the choice that keeps the busiest NIC's sending lowest; undone
    when the busiest NIC would end busier than the tensors' own plans left it (see the module docstring)."""
    hosts = HostCache()
    bw: dict[str, float] = {}

    def secs(h: str, nbytes: int) -> float:
        if h not in bw:
            bw[h] = topology.nic_bytes_per_s(h)
        return nbytes / bw[h]

    movable: list[tuple[int, int, list[Transfer], list[str], int]] = []  # (bytes, order, list, candidates, index)
    base: dict[str, float] = defaultdict(float)
    before: dict[str, float] = defaultdict(float)
    for decl, ts in tensors:
        holders: dict = {}
        src_tiles = None
        for k, t in enumerate(ts):
            if t.phase:
                continue
            nbytes = boxes.volume(t.box) * decl.itemsize
            hs = hosts[t.sender]
            sends = _sends(t, hosts)
            for h in sends:
                before[h] += secs(h, nbytes)
            receiving = {hosts[r] for r in t.receivers}
            if t.method not in ("p2p", "broadcast") or hs in receiving or not receiving:
                for h in sends:
                    base[h] += secs(h, nbytes)
                continue
            if src_tiles is None:
                src_tiles = decl.src.tiles(decl.shape)
                for dev, tile in src_tiles.items():
                    holders.setdefault(tile, {}).setdefault(hosts[dev], dev)  # one device per host, mesh order
            candidates = [d for h, d in holders[src_tiles[t.sender]].items() if h not in receiving]
            if len(candidates) < 2 and (t.method != "broadcast" or len(t.route) < 2):
                for h in sends:
                    base[h] += secs(h, nbytes)
                continue
            movable.append((nbytes, len(movable), ts, candidates, k))
    if not movable:
        return
    loads = defaultdict(float, base)
    peak = max(loads.values(), default=0.0)
    chosen: list[tuple[list[Transfer], int, str, tuple[str, ...]]] = []
    for nbytes, _, ts, candidates, k in sorted(movable, key=lambda m: (-m[0], m[1])):
        t = ts[k]
        best = None
        for sender, route in _options(t, candidates, hosts):
            delta: dict[str, float] = defaultdict(float)
            for h in _sends(t, hosts, hosts[sender], route):
                delta[h] += secs(h, nbytes)
            top, sq = peak, 0.0
            for h, d in delta.items():
                new = loads[h] + d
                top = max(top, new)
                sq += new * new - loads[h] * loads[h]
            if best is None or (top, sq) < best[0]:
                best = ((top, sq), sender, route, delta)
        _, sender, route, delta = best
        for h, d in delta.items():
            loads[h] += d
            peak = max(peak, loads[h])
        chosen.append((ts, k, sender, route))
    if peak <= max(before.values(), default=0.0) * (1 + 1e-9):
        for ts, k, sender, route in chosen:
            t = ts[k]
            if (sender, route) != (t.sender, t.route):
                # a chain delivers host by host along its route: its receivers follow the route's order
                receivers = t.receivers if route == t.route else \
                    tuple(r for h in route for r in t.receivers if hosts[r] == h)
                ts[k] = replace(t, sender=sender, route=route, receivers=receivers)


def _sends(t: Transfer, hosts: HostCache, sender_host: str | None = None,
           route: tuple[str, ...] | None = None) -> list[str]:
    """The hosts whose NIC sends ``t``'s box (once each): the sender's and every chain hop that forwards; with
    ``sender_host`` and ``route``, as if ``t`` went from there along that route."""
    hs = hosts[t.sender] if sender_host is None else sender_host
    route = t.route if route is None else route
    if t.method == "broadcast":
        return [hs, *route[:-1]] if route else []
    if t.method == "p2p":
        return [hs] * sum(hosts[r] != hs for r in t.receivers)
    return []


def _options(t: Transfer, candidates: list[str], hosts: HostCache) -> list[tuple[str, tuple[str, ...]]]:
    """(sender, route) of ``t`` from each candidate sender and, for a chain, with each of its hosts last: the
    current form first, so that ties keep it."""
    routes = [t.route] if t.method != "broadcast" else [t.route[i:] + t.route[:i] for i in range(len(t.route))]
    senders = [t.sender] + [d for d in candidates if hosts[d] != hosts[t.sender]]
    return [(s, route) for s in senders for route in routes]
