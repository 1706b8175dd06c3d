"""Split einsum: the program that runs an einsum on the devices that hold its inputs' tiles.

Mesh-TensorFlow's rule: a *layout* gives each dim letter of the equation the mesh axes
that split it, on one compute mesh, and every tensor of the op is cut by the same
layout. Each device then runs the local einsum on its tiles, and a summed letter split
over mesh axes leaves partial sums that a reduce over those axes completes.

================== ================================================================
letter             a dim letter of the equation (``"ij,jk->ik"``): one size everywhere
layout             letter -> the mesh axes (major first) that split it, on the compute
                   mesh; valid when no mesh axis splits two letters (validity is per
                   axis on the union of the op's dims, so ``x[a,b]·y[b,c]`` with ``a``
                   and ``c`` both on axis ``r`` is invalid: a device would hold a
                   "diagonal" pair of blocks)
lines up           an input lines up with a layout when it already lies on the compute
                   mesh in the tiles the layout gives it: it needs no move
reduced axes       the axes (of size > 1) that split a summed letter, or that a Partial
                   input carried through is summed over: each device holds addends of
                   its output tile, summed over the devices that differ only in them
candidate          a layout the planner prices: on each mesh an input or the output
                   lives on, every choice per letter among "whole" and the axes an input
                   (or ``out_sharding``) splits it over
================== ================================================================

The program (`plan_einsum`), in step order:

0. a Partial input is all-reduced over its partial axes into a tensor ``<name>~sum``,
   unless its addends may go through the local einsum as they are (it lines up, and
   no letter is split and no other input is Partial along those axes): then its
   partial axes join the reduced axes. The planner prices both;
1. moves of each input that does not line up into its tiles of the layout (a
   `reshard.strategies.plan`; receivers write role ``"dst"``), and a ``copy`` of the
   part of its new tile a device already held (so that role ``"dst"`` covers the tile);
2. one ``einsum`` compute step per device with a non-empty output tile, on its tiles;
   it writes the output's ``"dst"`` when nothing follows, else its partial sums into
   the tensor ``<out>~partial`` (a tensor of their own: a move reads whichever buffer
   of its sender holds its box, so the output's buffers hold only complete values);
3. reduce steps (ring) over each group of devices that differ only in reduced axes:
   a reduce-scatter per reduced axis that ``out_sharding`` puts on an output dim, then
   one all-reduce over the reduced axes it replicates; axes it keeps Partial are left;
4. when ``out_sharding`` is no such completion of the layout (another mesh, another
   layout), the result (role ``"result"``: all-reduced, or reduce-scattered onto one
   output dim, whichever the cost model prefers) is resharded into it: moves, and
   copies of the part a device already holds.

The output is declared with its final sharding as ``dst``, so the service commits it.
The layout is the inputs' own when they line up and ``out_sharding`` is None (no data
moves); otherwise the candidate whose whole program has the lowest `Program.estimate`.
"""

from __future__ import annotations

import itertools
import math
import string
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Optional, Union

from reshard import box as boxes
from reshard.dtypes import check_computable
from reshard.errors import ReshardError
from reshard.kernels import (KERNELS, KernelShapeError, axis_param, block_param, dims_param, letter_sizes,
                             parse_equation)
from reshard.mesh import Mesh
from reshard.program import DST, SRC, Program, Step, TensorDecl, TileRef
from reshard.sharding import Box, Sharding
from reshard.strategies import STRATEGIES, plan
from reshard.topology import Topology

__all__ = ["plan_einsum", "plan_apply", "APPLY_OPS", "EinsumError", "Layout", "PARTIAL", "RESULT"]

PARTIAL, RESULT, SUM = "partial", "result", "sum"
# Price every candidate layout up to this many; beyond, each source's layout, their greedy union and "all whole".
_MAX_CANDIDATES = 512


class EinsumError(ReshardError, ValueError):
    """An einsum the planner cannot run as asked; the message names the rule, the letters and the sizes."""


@dataclass(frozen=True)
class Layout:
    """The op's layout: ``axes[i]`` splits letter ``letters[i]`` on ``mesh``; prints ``{i: x, k: (x, y)}``."""

    mesh: Mesh
    letters: str
    axes: tuple[tuple[str, ...], ...]

    def of(self, letter: str) -> tuple[str, ...]:
        return self.axes[self.letters.index(letter)]

    def sharding(self, letters: str) -> Sharding:
        """How a tensor with dims ``letters`` is cut by this layout."""
        return Sharding(self.mesh, [self.of(c) or None for c in letters])

    def interval(self, letter: str, size: int, device: str) -> tuple[int, int]:
        return Sharding(self.mesh, [self.of(letter) or None]).tile((size,), device)[0]

    def __str__(self) -> str:
        parts = [f"{c}: {a[0] if len(a) == 1 else '(' + ', '.join(a) + ')'}" for c, a in zip(self.letters, self.axes)
                 if a]
        mesh = ", ".join(f"{n}={s}" for n, s in self.mesh.axes)
        return "{" + ", ".join(parts) + "} on (" + mesh + ")"


InputLike = Union[TensorDecl, tuple]


def _decl(i: int, x: InputLike) -> TensorDecl:
    if isinstance(x, TensorDecl):
        decl = x
    else:
        try:
            name, shape, dtype, sharding = x
        except (TypeError, ValueError):
            raise EinsumError(f"einsum input {i} is {x!r}; give a TensorDecl or a (name, shape, dtype, sharding) "
                              f"record") from None
        decl = TensorDecl(name, shape, dtype, src=sharding)
    if decl.src is None:
        raise EinsumError(f"einsum input {i} ({decl.name!r}) has no sharding (TensorDecl.src); the planner needs "
                          f"to know where its tiles are")
    return decl


@dataclass
class _Problem:
    equation: str  # with an explicit output
    operands: tuple[str, ...]
    out: str
    sizes: dict[str, int]
    inputs: tuple[TensorDecl, ...]  # per operand (a tensor used twice appears twice)
    out_name: str
    dtype: str
    out_sharding: Optional[Sharding]
    topology: Topology
    strategy: str
    kernel: str = "einsum"  # what each device's compute step runs (`reshard.kernels`)
    params: Optional[dict] = None  # its parameters; None: the einsum's equation
    reduce_op: str = "sum"  # what completes a letter the kernel sums (or takes the maximum of) over a split
    whole: str = ""  # letters the kernel needs whole on every device (softmax's class dim)
    foldable: bool = True  # whether a Partial input may pass through the kernel as addends (it is linear in each)

    @property
    def step_params(self) -> dict:
        return {"equation": self.equation} if self.params is None else self.params

    @property
    def letters(self) -> str:
        return "".join(dict.fromkeys("".join(self.operands)))

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[c] for c in self.out)

    @property
    def summed(self) -> str:
        return "".join(c for c in self.letters if c not in self.out)


def _problem(equation, inputs, out_name, out_sharding, topology, strategy) -> _Problem:
    operands, out = parse_equation(equation, EinsumError)
    decls = tuple(_decl(i, x) for i, x in enumerate(inputs))
    if len(decls) != len(operands):
        raise EinsumError(f"einsum {equation!r} has {len(operands)} inputs but {len(decls)} tensors are given")
    sizes = letter_sizes(equation, operands, tuple(d.shape for d in decls), EinsumError,
                         labels=[f"input {i} ({d.name!r})" for i, d in enumerate(decls)])
    by_name: dict[str, TensorDecl] = {}
    for d in decls:
        if by_name.setdefault(d.name, d) != d:
            raise EinsumError(f"two inputs are named {d.name!r} but differ ({by_name[d.name]} and {d}); an input "
                              f"used twice must be the same tensor")
    if not isinstance(out_name, str) or not out_name:
        raise EinsumError(f"out_name {out_name!r} is not a tensor name; give the output a non-empty name")
    made = {out_name: "the output", f"{out_name}~{PARTIAL}": "the output's partial sums"}
    made.update((f"{d.name}~{SUM}", f"the sum of Partial input {d.name!r}") for d in decls if d.src.partial)
    for name, what in made.items():
        if name in by_name:
            raise EinsumError(f"input {name!r} has the name the program gives {what}; give the output another name")
    dtypes = sorted({d.dtype for d in decls})
    if len(dtypes) > 1:
        raise EinsumError(f"einsum inputs have dtypes {dtypes}; the local einsum needs one dtype, so cast the "
                          f"inputs to one first")
    check_computable(dtypes[0], f"the kernel of {equation!r} on {[d.name for d in decls]}")
    if strategy not in STRATEGIES:
        raise EinsumError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    for d in decls:
        d.src.mesh.require_devices()
    p = _Problem(f"{','.join(operands)}->{out}", operands, out, sizes, decls, out_name, dtypes[0], out_sharding,
                 topology or Topology(), strategy)
    if out_sharding is not None:
        if not isinstance(out_sharding, Sharding):
            raise EinsumError(f"out_sharding must be a reshard.Sharding or None, got {type(out_sharding).__name__}")
        out_sharding.mesh.require_devices()
        out_sharding.check_shape(p.out_shape)
    return p


# -- candidate layouts -------------------------------------------------------------------------------------


def _sources(p: _Problem, mesh: Mesh) -> list[dict[str, tuple[str, ...]]]:
    """Letter -> axes assignments on ``mesh`` that the inputs and ``out_sharding`` suggest."""
    names = set(mesh.axis_names)
    found = []
    tensors = [(letters, d.src) for letters, d in zip(p.operands, p.inputs)]
    if p.out_sharding is not None:
        tensors.append((p.out, p.out_sharding))
    for letters, s in tensors:
        got = {c: axes for c, axes in zip(letters, s.dim_axes(len(letters))) if axes}
        if all(set(a) <= names for a in got.values()):
            found.append(got)
    if p.out_sharding is not None:
        # An axis the output is Partial over is one that splits a summed letter.
        found += [{c: (a,)} for a in p.out_sharding.partial if a in names for c in p.summed]
    return found


def _valid(axes: Sequence[tuple[str, ...]]) -> bool:
    used = [a for group in axes for a in group]
    return len(used) == len(set(used))


def _candidates(p: _Problem, mesh: Mesh) -> list[Layout]:
    letters = p.letters
    sources = _sources(p, mesh)
    options = [list(dict.fromkeys([(), *(s[c] for s in sources if c in s)])) for c in letters]
    if math.prod(len(o) for o in options) <= _MAX_CANDIDATES:
        choices = list(itertools.product(*options))
    else:
        choices = [tuple(s.get(c, ()) for c in letters) for s in sources]
        merged: dict[str, tuple[str, ...]] = {}
        for s in sources:
            for c, axes in s.items():
                if c not in merged and _valid([*merged.values(), axes]):
                    merged[c] = axes
        choices += [tuple(merged.get(c, ()) for c in letters), tuple(() for _ in letters)]
    out = []
    for axes in dict.fromkeys(choices):
        if not _valid(axes) or any(a for c, a in zip(letters, axes) if c in p.whole):
            continue
        layout = Layout(mesh, letters, tuple(axes))
        # A tensor used twice is one set of buffers: both uses need the same tiles.
        targets: dict[str, Sharding] = {}
        if all(targets.setdefault(d.name, layout.sharding(ls)) == layout.sharding(ls)
               for ls, d in zip(p.operands, p.inputs)):
            out.append(layout)
    return out


def _lined_up(p: _Problem) -> Optional[Layout]:
    """The inputs' common layout, when they all live on one mesh and agree on every letter, else None."""
    mesh = p.inputs[0].src.mesh
    if any(d.src.mesh != mesh for d in p.inputs):
        return None
    assign: dict[str, tuple[str, ...]] = {}
    for letters, d in zip(p.operands, p.inputs):
        for c, axes in zip(letters, d.src.dim_axes(len(letters))):
            if assign.setdefault(c, axes) != axes:
                return None
    layout = Layout(mesh, p.letters, tuple(assign[c] for c in p.letters))
    return layout if _valid(layout.axes) and not any(layout.of(c) for c in p.whole) else None


# -- building the program -----------------------------------------------------------------------------------


class _Builder:
    """The steps of one layout's program, appended in an order where every step follows what it waits for."""

    def __init__(self, p: _Problem, layout: Layout, plans: dict, fold: bool = True, scatter: Optional[int] = None):
        self.p, self.layout, self.plans, self.fold, self.scatter = p, layout, plans, fold, scatter
        self.scatterable = False  # set by build: the result is reduced, then moved (scatter may then apply)
        self.steps: list[Step] = []
        self.devices = layout.mesh.require_devices()
        self.made: list[TensorDecl] = []  # the tensors the program adds: partial sums, completed inputs

    def add(self, make, after: Iterable[int] = (), **kw) -> int:
        self.steps.append(make(len(self.steps), after=sorted(set(after)), **kw))
        return len(self.steps) - 1

    def _plan(self, shape, src: Sharding, dst: Sharding):
        key = (shape, src, dst)
        if key not in self.plans:
            self.plans[key] = plan(shape, self.p.dtype, src, dst, self.p.topology, self.p.strategy)
        return self.plans[key]

    def reshard(self, name: str, shape, src: Sharding, dst: Sharding, held_role: str,
                producers: Mapping[str, list[int]], whole: bool = False) -> dict[str, tuple[str, list[int]]]:
        """Moves (and copies of held parts) that lay ``name`` out in ``dst`` tiles, role ``"dst"``.

        ``held_role`` is where a device holds its ``src`` tile, made by the steps ``producers[device]``. A tile
        a device holds already is read where it is, unless ``whole`` asks for every tile in role ``"dst"``.
        Returns, per device of ``dst``, the role its tile is read from and the steps to wait for.
        """
        src_tiles, dst_tiles = src.tiles(shape), dst.tiles(shape)
        out: dict[str, tuple[str, list[int]]] = {}
        copies: dict[str, list[int]] = {}
        for dev, tile in dst_tiles.items():
            own = src_tiles.get(dev)
            if not whole and own is not None and boxes.contains(own, tile):
                out[dev] = (held_role, list(producers.get(dev, ())))
                continue
            held = boxes.intersect(own, tile) if own is not None else None
            copies[dev] = [] if held is None else [
                self.add(Step.compute, producers.get(dev, ()), kernel="copy", device=dev,
                         inputs=[TileRef(name, held_role, held)], output=TileRef(name, DST, held))]
            out[dev] = (DST, list(copies[dev]))
        transfers = [] if _same_tiles(src, dst, len(shape)) else \
            sorted(self._plan(shape, src, dst).transfers, key=lambda t: t.phase)
        delivered: dict[str, list[tuple[int, int, Box]]] = defaultdict(list)  # device -> (step, phase, box)
        for t in transfers:
            # A sender reads the box from whichever of its buffers holds it: its "dst" must be written by then.
            after = [*producers.get(t.sender, ()), *copies.get(t.sender, ())]
            after += [j for j, phase, b in delivered.get(t.sender, ())
                      if phase < t.phase and boxes.intersect(b, t.box) is not None]
            i = self.add(Step.move, after, transfer=replace(t, phase=0), tensor=name)
            for r in t.receivers:
                delivered[r].append((i, t.phase, t.box))
                out[r][1].append(i)
        return out

    def build(self) -> Program:
        p, layout = self.p, self.layout
        # 1. inputs into the layout's tiles; a Partial input's sum is completed first, unless it is folded into
        # the output's reduction
        reads: dict[str, tuple[str, dict[str, tuple[str, list[int]]]]] = {}
        folded: list[str] = []
        for letters, d in zip(p.operands, p.inputs):
            if d.name in reads:
                continue
            target = layout.sharding(letters)
            if d.src.partial and self.fold and self._foldable(d, target):
                folded += [a for a in d.src.partial if a not in folded]
                reads[d.name] = (d.name, {dev: (SRC, []) for dev in self.devices})
            elif d.src.partial:
                name, producers = self._complete(d)
                reads[d.name] = (name, self.reshard(name, d.shape, d.src.without_partial(), target, SUM, producers))
            else:
                reads[d.name] = (d.name, self.reshard(d.name, d.shape, d.src, target, SRC, {}))
        # 2. the local einsums
        iv = {c: {dev: layout.interval(c, p.sizes[c], dev) for dev in self.devices} for c in p.letters}
        reduced = [a for a in layout.mesh.axis_names if layout.mesh.axis_size(a) > 1 and
                   (a in folded or any(a in layout.of(c) for c in p.summed))]
        direct = self._completion(reduced)
        held = layout.sharding(p.out)
        if direct is not None:
            stages = direct
        elif p.out_sharding.partial:
            raise EinsumError(
                f"out_sharding {p.out_sharding} is Partial over {list(p.out_sharding.partial)}, but layout {layout} "
                f"does not leave a sum pending over those axes there (a summed letter {p.summed!r} split over them, "
                f"or a Partial input over them)"
            )
        elif self.scatter is None or not reduced:
            stages = [("replicate", tuple(reduced), None)] if reduced else []
        else:
            # reduce-scatter onto one output dim, as its minor axes: the moves then read the pieces
            stages = [("shard", (a,), self.scatter) for a in reduced]
            held = Sharding(layout.mesh, [layout.of(c) + (tuple(reduced) if i == self.scatter else ()) or None
                                          for i, c in enumerate(p.out)])
        self.scatterable = direct is None and bool(reduced)
        # Where each stage writes: partial sums in a tensor of their own, so that the output's buffers are all
        # complete values (a move reads whichever buffer of its sender holds its box).
        partials = f"{p.out_name}~{PARTIAL}"
        last = (p.out_name, DST if direct is not None else RESULT)
        writes = [(partials, f"{PARTIAL}{k}") for k in range(len(stages))] + [last]
        cur: dict[str, Box] = {}
        made: dict[str, list[int]] = {}
        for dev in self.devices:
            box = tuple(iv[c][dev] for c in p.out)
            cur[dev] = box
            if not boxes.volume(box):
                continue
            refs, waits = [], []
            for letters, d in zip(p.operands, p.inputs):
                name, roles = reads[d.name]
                r, w = roles[dev]
                refs.append(TileRef(name, r, tuple(iv[c][dev] for c in letters)))
                waits += w
            made[dev] = [self.add(Step.compute, waits, kernel=p.kernel, device=dev, inputs=refs,
                                  output=TileRef(*writes[0], box), params=p.step_params)]
        # 3. reductions
        for k, (result, axes, dim) in enumerate(stages):
            made = self._reduce(result, axes, dim, writes[k], writes[k + 1], cur, made)
        # 4. into another layout or mesh
        final = (p.out_sharding or held) if direct is not None else held
        tiles = final.tiles(p.out_shape)
        assert all(cur[d] == tiles[d] or not (boxes.volume(cur[d]) or boxes.volume(tiles[d])) for d in tiles), \
            "the reduce stages leave every device its tile of the sharding they promise"
        if direct is None:
            final = p.out_sharding
            self.reshard(p.out_name, p.out_shape, held, final, RESULT, made, whole=True)
        out = TensorDecl(p.out_name, p.out_shape, KERNELS[p.kernel].output_dtype or p.dtype, dst=final)
        tensors = tuple(dict.fromkeys(p.inputs)) + (out, *self.made)
        if stages:
            tensors += (TensorDecl(partials, p.out_shape, p.dtype),)
        return Program(tensors, tuple(self.steps), p.strategy, p.topology, einsum_layout=layout)

    def _foldable(self, d: TensorDecl, target: Sharding) -> bool:
        """Whether Partial input ``d`` can stay a pending sum through the local einsum: it lines up, and along its
        partial axes every other operand is the same on every device (no letter split there, no other addends)."""
        p = self.p
        if not p.foldable or [x.name for x in p.inputs].count(d.name) > 1 or \
                not _same_tiles(d.src, target, len(d.shape)):
            return False
        used = {a for axes in self.layout.axes for a in axes}
        others = {a for x in p.inputs if x.name != d.name for a in x.src.partial}
        return not (set(d.src.partial) & (used | others))

    def _complete(self, d: TensorDecl) -> tuple[str, dict[str, list[int]]]:
        """All-reduce Partial input ``d`` over its partial axes into tensor ``<name>~sum`` (role ``"sum"``), on
        its own mesh; returns that name and, per device, the step that wrote its tile."""
        name = f"{d.name}~{SUM}"
        self.made.append(TensorDecl(name, d.shape, d.dtype))
        tiles = d.src.tiles(d.shape)
        producers: dict[str, list[int]] = {}
        for group in _groups(d.src.mesh, d.src.partial):
            box = tiles[group[0]]
            if boxes.volume(box):
                i = self.add(Step.reduce, op="sum", devices=group, input=TileRef(d.name, SRC, box),
                             output=TileRef(name, SUM, box))
                producers.update((dev, [i]) for dev in group)
        return name, producers

    def _completion(self, reduced: list[str]) -> Optional[list[tuple[str, tuple[str, ...], Optional[int]]]]:
        """The reduce stages that leave the local results in ``out_sharding`` on the compute mesh: a reduce-scatter
        per reduced axis it appends to an output dim's axes, an all-reduce over those it replicates; None when
        ``out_sharding`` is no such completion of the layout."""
        p, layout = self.p, self.layout
        if p.out_sharding is None:
            return [("replicate", tuple(reduced), None)] if reduced else []
        o = p.out_sharding
        if o.mesh != layout.mesh:
            return None
        partial = {a for a in o.partial if o.mesh.axis_size(a) > 1}
        if not partial <= set(reduced):
            return None
        stages = []
        for dim, (c, axes) in enumerate(zip(p.out, o.dim_axes(len(p.out)))):
            mine = layout.of(c)
            extra = axes[len(mine):]
            if axes[:len(mine)] != mine or not set(extra) <= set(reduced):
                return None
            stages += [("shard", (a,), dim) for a in extra]
        scattered = {a for _, (a,), _ in stages}
        rest = tuple(a for a in reduced if a not in scattered and a not in partial)
        return stages + ([("replicate", rest, None)] if rest else [])

    def _reduce(self, result: str, axes: tuple[str, ...], dim: Optional[int], src: tuple[str, str],
                dst: tuple[str, str], cur: dict[str, Box], made: dict[str, list[int]]) -> dict[str, list[int]]:
        """One reduce stage over every group of devices that differ only in ``axes``, from the (tensor, role)
        ``src`` into ``dst``; ``cur`` is the box each device holds, ``made`` the steps that wrote it."""
        after: dict[str, list[int]] = {}
        for group in _groups(self.layout.mesh, axes):
            box = cur[group[0]]
            assert all(cur[d] == box for d in group), "members of a reduce group hold one box"
            pieces = boxes.chunk(box, len(group), dim) if result == "shard" else [box] * len(group)
            for d, piece in zip(group, pieces):
                cur[d] = piece
            if boxes.volume(box):
                i = self.add(Step.reduce, [j for d in group for j in made.get(d, ())], op=self.p.reduce_op, devices=group,
                             input=TileRef(*src, box), output=TileRef(*dst, box), result=result, dim=dim)
                after.update((d, [i]) for d in group)
        return after


def _groups(mesh: Mesh, axes: Sequence[str]) -> list[list[str]]:
    """The devices of ``mesh`` that differ only in ``axes``, each group in row-major order over ``axes``."""
    index = [mesh.axis_index(a) for a in axes]
    groups: dict[tuple, list[tuple[tuple, str]]] = defaultdict(list)
    for pos, dev in enumerate(mesh.require_devices()):
        coords = mesh.coords(pos)
        groups[tuple(x for i, x in enumerate(coords) if i not in index)].append((tuple(coords[i] for i in index), dev))
    return [[dev for _, dev in sorted(members)] for members in groups.values()]


def _same_tiles(a: Sharding, b: Sharding, ndim: int) -> bool:
    """The same layout of a tensor's values (partial axes aside)."""
    return a.mesh == b.mesh and a.dim_axes(ndim) == b.dim_axes(ndim)


def _moved_bytes(program: Program) -> int:
    return sum(sum(row.values()) for row in program.host_bytes().values())


def _pinned(p: _Problem, layout: Union[Layout, Mapping[str, object]]) -> Layout:
    """A layout the caller asks for: a `Layout`, or Mesh-TensorFlow rules (letter -> axis, axes or None) on the
    mesh of ``out_sharding``, else of the first input; checked against the einsum's letters and the rule."""
    if isinstance(layout, Layout):
        mesh, rules = layout.mesh, dict(zip(layout.letters, layout.axes))
    elif isinstance(layout, Mapping):
        mesh = (p.out_sharding or p.inputs[0].src).mesh
        rules = {c: (() if a is None else (a,) if isinstance(a, str) else tuple(a)) for c, a in layout.items()}
    else:
        raise EinsumError(f"layout must be a reshard.einsum.Layout or a mapping of letters to mesh axes such as "
                          f"{{'i': 'x'}}; got {type(layout).__name__}")
    unknown = sorted(set(rules) - set(p.letters))
    if unknown:
        raise EinsumError(f"layout names letter(s) {unknown}, which einsum {p.equation!r} does not have; its letters "
                          f"are {list(p.letters)}")
    for c, axes in rules.items():
        for a in axes:
            if a not in mesh.axis_names:
                raise EinsumError(f"layout splits letter {c!r} over {a!r}, which is not an axis of the compute mesh "
                                  f"{mesh}; its axes are {list(mesh.axis_names)}")
    seen: dict[str, str] = {}
    for c in p.letters:
        for a in rules.get(c, ()):
            if a in seen:
                both = [ls for ls in (*p.operands, p.out) if seen[a] in ls and c in ls]
                which = f"; tensor {both[0]!r} would have two dims on axis {a!r}" if both else ""
                raise EinsumError(
                    f"layout splits letters {seen[a]!r} (size {p.sizes[seen[a]]}) and {c!r} (size {p.sizes[c]}) "
                    f"over axis {a!r}{which}; a mesh axis may split at most one dim of the op, or a device would hold "
                    f"a 'diagonal' pair of blocks"
                )
            seen[a] = c
    for c in p.whole:
        if rules.get(c):
            raise EinsumError(f"layout splits letter {c!r} (size {p.sizes[c]}) over {list(rules[c])}, but kernel "
                              f"{p.kernel!r} needs that dim whole on every device")
    pinned = Layout(mesh, p.letters, tuple(rules.get(c, ()) for c in p.letters))
    for ls, d in zip(p.operands, p.inputs):
        for ls2, d2 in zip(p.operands, p.inputs):
            if d.name == d2.name and pinned.sharding(ls) != pinned.sharding(ls2):
                raise EinsumError(f"input {d.name!r} is used as {ls!r} and as {ls2!r}, which layout {pinned} cuts "
                                  f"differently; a tensor used twice needs one layout for both uses")
    return pinned


def plan_einsum(equation: str, inputs: Sequence[InputLike], out_name: str, out_sharding: Optional[Sharding] = None,
                topology: Optional[Topology] = None, strategy: str = "auto",
                layout: Union[Layout, Mapping[str, object], None] = None) -> Program:
    """The program that computes ``numpy.einsum(equation, *inputs)`` where the inputs' tiles are, into ``out_name``.

    ``inputs`` are `TensorDecl` records (name, shape, dtype, and ``src``: the sharding the tensor is held in) or
    ``(name, shape, dtype, sharding)`` tuples, one per operand of the equation (one or more: ``"ij->i"`` sums,
    ``"ij->ji"`` transposes). ``out_sharding`` None keeps the layout's splits of the output dims and all-reduces
    the summed ones; a sharding on the compute mesh may keep reduced axes Partial or reduce-scatter them onto
    output dims; any other is reached by a reshard after the reduction. ``strategy`` plans the moves
    (`reshard.strategies.plan`). ``layout`` pins the op's layout (a `Layout`, or Mesh-TensorFlow rules such as
    ``{"b": "rows", "h": "cols"}`` on the mesh of ``out_sharding``, else of the first input) instead of the
    cheapest. See the module docstring for the steps.

    The chosen `Layout` is ``program.einsum_layout`` (a field of the program, not part of its id). Raises
    `EinsumError` (a ``ValueError``) naming the rule, the letters and sizes for an einsum it cannot run.
    """
    return _cheapest(_problem(equation, inputs, out_name, out_sharding, topology, strategy), layout)


def _cheapest(p: _Problem, layout: Union[Layout, Mapping[str, object], None]) -> Program:
    """The validated program of the candidate layout (or the pinned one) with the lowest estimate."""
    out_sharding = p.out_sharding
    plans: dict = {}
    lined = _pinned(p, layout) if layout is not None else _lined_up(p) if out_sharding is None else None
    if lined is not None:
        candidates = [lined]
    else:
        meshes = list(dict.fromkeys([d.src.mesh for d in p.inputs] + ([out_sharding.mesh] if out_sharding else [])))
        candidates = [c for mesh in meshes for c in _candidates(p, mesh)]
    # A Partial input is either summed first or, where it may, carried into the output's reduction; a result that
    # moves after its reduction is all-reduced or reduce-scattered onto one of its dims: price each.
    folds = (True, False) if any(d.src.partial for d in p.inputs) else (True,)
    best, key, refused = None, None, None
    for candidate, fold in itertools.product(candidates, folds):
        scatters: list[Optional[int]] = [None]
        while scatters:
            builder = _Builder(p, candidate, plans, fold, scatters.pop(0))
            try:
                program = builder.build()
            except EinsumError as e:  # only a Partial out_sharding this layout cannot leave pending
                refused = refused or e
                break
            if builder.scatterable and builder.scatter is None:
                scatters = list(range(len(p.out)))
            k = (program.estimate_seconds, _moved_bytes(program))
            if key is None or k < key:
                best, key = program, k
    if best is None:
        if lined is not None:
            raise refused
        raise EinsumError(f"no layout of {p.kernel} {p.equation!r} on the meshes of its inputs and output can give "
                          f"out_sharding as asked: {refused}")
    return best.validate()


# op -> (input letters from the dims, output letters, whole letters, reduce op, foldable), by kernel kind
_ELEMENTWISE = ("add", "sub", "mul", "scale", "relu", "relu_grad", "axpy")
_LINEAR = ("mul", "scale", "sum")  # a Partial input may pass through as addends (see `_Builder._foldable`)
# fp8_quantize keeps its input's shape and letters, as an elementwise op, but casts (`Kernel.output_dtype`)
APPLY_OPS = (*_ELEMENTWISE, "sum", "max", "softmax_xent", "softmax_xent_grad", "fp8_quantize")


def _param_text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(int(v)) for v in value)
    if isinstance(value, bool):
        raise EinsumError(f"parameter value {value!r} is a bool; give a number")
    return str(value)


def plan_apply(op: str, inputs: Sequence[InputLike], out_name: str, params: Optional[Mapping[str, object]] = None,
               out_sharding: Optional[Sharding] = None, topology: Optional[Topology] = None, strategy: str = "auto",
               layout: Union[Layout, Mapping[str, object], None] = None) -> Program:
    """The program that runs kernel ``op`` (`APPLY_OPS`) on every device's tiles of ``inputs``, into ``out_name``.

    Built as an einsum is, with the kernel in place of the local einsum: the dims of the inputs are letters
    ``a``, ``b``, ... in order (``layout`` names them so), every input of an elementwise op has the same shape
    and letters, ``sum`` and ``max`` drop the ``dims`` they reduce (``params["dims"]``: a list of ints) and
    complete them over the mesh axes that split them (a sum or a max), and the softmax kernels keep their
    ``axis`` whole on every device. Inputs whose layouts differ are moved into the common layout the cost model
    prices lowest; ``out_sharding`` as for `plan_einsum` (Partial only for a sum). Raises `EinsumError`.
    """
    if op not in APPLY_OPS:
        raise EinsumError(f"unknown op {op!r}; apply runs one of {list(APPLY_OPS)} (einsum has its own call)")
    kernel = KERNELS[op]
    decls = [_decl(i, x) for i, x in enumerate(inputs)]
    if not kernel.takes(len(decls)):
        raise EinsumError(f"{op} takes {kernel.arity} input(s) ({kernel.doc}); {len(decls)} given")
    text = {str(k): _param_text(v) for k, v in (params or {}).items()}
    ndim = len(decls[0].shape)
    if ndim > len(string.ascii_lowercase):
        raise EinsumError(f"{op}: input {decls[0].name!r} has {ndim} dims; apply names at most 26")
    letters = string.ascii_lowercase[:ndim]
    for d in decls[1:]:
        if tuple(d.shape) != tuple(decls[0].shape):
            dim = next((i for i, (m, n) in enumerate(zip(decls[0].shape, d.shape)) if m != n), None)
            where = f" (dim {dim}: {decls[0].shape[dim]} vs {d.shape[dim]})" if dim is not None else ""
            raise EinsumError(f"{op}: input {decls[0].name!r} has shape {tuple(decls[0].shape)} but {d.name!r} has "
                              f"shape {tuple(d.shape)}{where}; {op} works element by element on one shape")
    try:
        kernel.output_shape(tuple(d.shape for d in decls), text)
    except KernelShapeError as e:
        raise EinsumError(str(e)) from None
    out, whole, reduce_op = letters, "", "sum"
    if op in ("sum", "max"):
        dims = dims_param(op, text, ndim)
        out = "".join(c for i, c in enumerate(letters) if i not in dims)
        reduce_op = op
    elif op.startswith("softmax_xent"):
        whole = letters[axis_param(op, text, ndim)]
        if op == "softmax_xent":
            out = letters.replace(whole, "")
    if reduce_op == "max" and out_sharding is not None and out_sharding.partial:
        raise EinsumError(f"out_sharding {out_sharding} is Partial, a pending sum; a max over dims cannot be left "
                          f"pending as a sum, so give a sharding without partial axes")
    equation = ",".join([letters] * len(decls)) + "->" + out
    p = _problem(equation, decls, out_name, out_sharding, topology, strategy)
    p.kernel, p.params, p.reduce_op, p.whole, p.foldable = op, text, reduce_op, whole, op in _LINEAR
    program = _cheapest(p, layout)
    if op == "fp8_quantize":
        _check_blocks(program, block_param(op, text))
    return program


def _check_blocks(program: Program, block: int) -> None:
    """Refuse a quantize whose tiles do not start on block boundaries: their blocks would not be the tensor's."""
    for s in program.steps:
        tile = s.inputs[0].box if s.kernel == "fp8_quantize" else ()
        if any(lo % block for lo, _ in tile):
            raise EinsumError(f"fp8_quantize on {s.device}: its tile {boxes.box_str(tile)} does not start on a "
                              f"boundary of the {block} x {block} blocks, so its blocks would not be the tensor's; "
                              f"lay the input out so that each split dim is cut at multiples of {block}")
