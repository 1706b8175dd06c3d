"""Programs: moves, compute and reduce steps with dependencies, as plain data.

A program is what an agent runs: steps with ids, each naming the steps it
waits for. A reshard is a program of moves (`Program.from_plan`); split einsum
and pipelines add compute and reduce steps. Like a plan, a program serialises
to JSON, has a stable content hash (its id), is validated whole before
anything runs, and has an estimate on the fluid cost model (`reshard.cost`).

================== =============================================================
step               one unit of work; ``id`` is its position in ``Program.steps``
``after``          ids of the steps that must finish before it starts; always
                   earlier steps, so the steps are listed in a valid order
ancestor           a step reached through ``after``, transitively
depth              0 for a step with no ``after``, else 1 + the deepest of them;
                   for a program made from a plan it is the transfer's phase
tensor             a name in ``Program.tensors`` (a `TensorDecl`: shape, dtype,
                   and optionally ``src``, the sharding it is held in when the
                   program starts, and ``dst``, the one it must end in)
reshard tensor     a tensor with both ``src`` and ``dst``: its moves must give
                   every ``dst`` tile exactly its elements (`Plan.validate`'s
                   checks, with ancestors in place of earlier phases)
role               which buffer of a tensor on a device: ``"src"`` is the tile
                   held at the start, ``"dst"`` the buffer moves deliver into;
                   steps may name others (``"partial"``, ``"out"``)
`TileRef`          (tensor, role, box): one buffer's box on the step's device
holds              a device holds a box in a role when the step starts if its
                   ``src`` tile (role ``"src"``) and the boxes its ancestors
                   produced there in that role together cover it
*move*             ``transfer`` (a `Transfer`: box, sender, receivers, method,
                   route) of ``tensor``; the sender reads ``role``, receivers
                   write into ``"dst"``; the transfer's phase is unused (0):
                   ``after`` orders the moves
move ``role``      ``"src"`` (the default; JSON leaves it out) reads as a plan's
                   transfer does: the source tile, or what earlier steps left
                   on the sender in any role (a relay). Any other role reads
                   only what the sender holds in that role (``"reduced"``: what
                   a reduce completed). A Partial tensor's ``"src"`` holds
                   addends, so a move reads it only into a destination partial
                   over the same axes, at the same coordinates along them
*compute*          ``kernel`` (one of `reshard.kernels.KERNELS`) on ``device``
                   reads ``inputs`` and writes ``output``, shaped by the
                   kernel's rule, with string ``params``
*reduce*           ``op`` (``"sum"`` or ``"max"``) over the ordered group
                   ``devices``; every member holds addends of ``inputs[0]``
                   (its ``box``); ``result`` ``"replicate"`` leaves every member
                   the reduced ``output`` box, ``"shard"`` (reduce-scatter)
                   leaves member ``i`` chunk ``i`` of it along ``dim``, cut as
                   ``torch.chunk`` cuts (`box.chunk`: trailing members may get
                   an empty chunk); ``algorithm`` ``"ring"`` or ``"chain"``
                   (what each puts on the links: `cost.reduce_rounds`)
================== =============================================================

The estimate is the longest path through the dependency graph, each step
taking its own time, except that moves of one depth share links as the moves
of one phase do in a plan: they run as one fluid round that starts when all
their dependencies are done. Rounds of two depths that overlap in time (moves
that wait for a compute step while other moves still run) share links too: a
link carries a depth's bytes after the earlier depths' (`_LinkClock`), so no
estimate is below what all the moves' loads take together. A move-only
program therefore estimates exactly as the plan it came from. A compute step
takes the bytes it reads and writes over its device's memory bandwidth; a
reduce its rounds on the fluid model.
"""

from __future__ import annotations

import gc
import hashlib
import re
import threading
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from itertools import chain, compress, groupby, repeat
from operator import and_, attrgetter, is_, not_
from typing import TYPE_CHECKING, NamedTuple, Optional

import numpy as np

from reshard import box as boxes
from reshard.cost import HostCache, PhaseLoad, flow_totals, move_phase_loads, reduce_rounds, transfer_flows
from reshard.delivery import delivered_by_pattern, link_ids
from reshard.dtypes import dtype_name, itemsize
from reshard.errors import InvalidMeshError, PlanValidationError
from reshard.jsonio import brief, field_of, loads, need, quoted
from reshard.jsonio import canonical as canonical_text
from reshard.jsonio import plain as plain_text
from reshard.kernels import KERNELS, KernelShapeError
from reshard.mesh import host_of
from reshard.plans import (
    METHODS,
    ContentAddressed,
    Plan,
    Transfer,
    box_from_json,
    check_claimed_id,
    check_delivery,
    check_transfer,
    check_version,
    strings,
)
from reshard.sharding import Box, Sharding, normalise_shape
from reshard.topology import Topology

if TYPE_CHECKING:  # reshard.einsum builds programs: a run-time import would be circular
    from reshard.einsum import Layout

__all__ = [
    "Program",
    "Step",
    "TileRef",
    "TensorDecl",
    "StepEstimate",
    "MOVE",
    "COMPUTE",
    "REDUCE",
    "STEP_KINDS",
    "REDUCE_OPS",
    "REDUCE_RESULTS",
    "REDUCE_ALGORITHMS",
    "SRC",
    "DST",
    "RESHARD_TENSOR",
    "PROGRAM_VERSION",
    "Run",
    "decl_with",
    "StepsLike",
    "moves_like",
    "MoveView",
    "RunSteps",
    "steps_text",
    "read_tensors",
    "layouts_of",
    "Renamed",
    "no_cycle_collection",
]

PROGRAM_VERSION = 1
MOVE, COMPUTE, REDUCE = "move", "compute", "reduce"
STEP_KINDS = (MOVE, COMPUTE, REDUCE)
REDUCE_OPS = ("sum", "max")
REDUCE_RESULTS = ("replicate", "shard")
REDUCE_ALGORITHMS = ("ring", "chain")
SRC, DST = "src", "dst"
# The one tensor of a program made from a plan; plans do not know the catalog's name.
RESHARD_TENSOR = "tensor"

# The fields each kind of step uses; a step leaves the others at their defaults.
_KIND_FIELDS = {
    MOVE: ("transfer", "tensor", "role"),
    COMPUTE: ("kernel", "device", "inputs", "output", "params"),
    REDUCE: ("op", "devices", "inputs", "output", "result", "algorithm", "dim"),
}
_DEFAULTS = {"transfer": None, "tensor": "", "role": SRC, "kernel": "", "device": "", "inputs": (), "output": None,
             "params": (), "op": "", "devices": (), "result": "", "algorithm": "", "dim": None}
# Per kind, the fields it leaves at their defaults, with those defaults: checked for every step an agent reads.
_UNUSED = {kind: tuple((f, d) for f, d in _DEFAULTS.items() if f not in used) for kind, used in _KIND_FIELDS.items()}


def _box(raw) -> Box:
    return tuple((int(lo), int(hi)) for lo, hi in raw)


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


@dataclass(frozen=True, slots=True)
class TileRef:
    """A box of one buffer (``role``) of ``tensor`` on the device of the step that names it."""

    tensor: str
    role: str
    box: Box

    def __post_init__(self):
        object.__setattr__(self, "box", _box(self.box))

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "role": self.role, "box": [[lo, hi] for lo, hi in self.box]}

    @classmethod
    def from_json(cls, data, what: str = "tile JSON") -> "TileRef":
        need(data, "object", what, PlanValidationError)
        return cls(field_of(data, "tensor", "string", what, PlanValidationError),
                   field_of(data, "role", "string", what, PlanValidationError),
                   box_from_json(field_of(data, "box", "array", what, PlanValidationError), f"{what} field 'box'"))

    def __str__(self) -> str:
        return f"{self.tensor}:{self.role}{boxes.box_str(self.box)}"


@dataclass(frozen=True)
class TensorDecl:
    """A tensor a program names: ``src`` is how it is held at the start, ``dst`` how it must end (both optional)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    src: Optional[Sharding] = None
    dst: Optional[Sharding] = None

    def __post_init__(self):
        object.__setattr__(self, "shape", normalise_shape(self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for s in (self.src, self.dst):
            if s is not None:
                s.check_shape(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def is_reshard(self) -> bool:
        return self.src is not None and self.dst is not None

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        for key, s in (("src", self.src), ("dst", self.dst)):
            if s is not None:
                out[key] = s.to_json()
        return out

    @classmethod
    def from_json(cls, data, what: str = "tensor JSON", shardings: Optional[dict] = None) -> "TensorDecl":
        """Read what `to_json` writes. ``shardings`` (a dict the caller keeps for one document) reads each distinct
        sharding once: a state dict's thousands of tensors share a few layouts, and the tensors then share their
        `Sharding` objects (and what those work out once, such as their tiles)."""
        need(data, "object", what, PlanValidationError)
        src, dst = (field_of(data, key, "object", what, PlanValidationError, default=None) for key in ("src", "dst"))
        return cls(
            name=field_of(data, "name", "string", what, PlanValidationError),
            shape=field_of(data, "shape", "array", what, PlanValidationError),
            dtype=field_of(data, "dtype", "string", what, PlanValidationError),
            src=_sharding_of(src, shardings) if src is not None else None,
            dst=_sharding_of(dst, shardings) if dst is not None else None,
        )


def decl_with(decl: TensorDecl, **fields) -> TensorDecl:
    """``decl`` with ``fields`` changed, without `TensorDecl`'s checks: for a src or dst left out, a new name, or
    fields already checked together on another declaration."""
    out = object.__new__(TensorDecl)
    object.__setattr__(out, "__dict__", {**decl.__dict__, **fields})
    return out


_INTS = frozenset({int})


def _sharding_of(data, seen: Optional[dict]) -> Sharding:
    """`Sharding.from_json`, once per distinct JSON value where ``seen`` keeps those read (keyed by the value made
    hashable; a value that is not well-formed JSON of a sharding is read, and refused, as it is)."""
    if seen is None:
        return Sharding.from_json(data)
    try:
        key = _hashable(data)
    except TypeError:
        return Sharding.from_json(data)
    made = seen.get(key)
    if made is None:
        made = seen[key] = Sharding.from_json(data)
    return made


def _hashable(value):
    """A JSON value as nested tuples, equal exactly where the values are (a dict's keys sorted; the kind of each
    container kept, so that [] and {} differ)."""
    if type(value) is list:
        return ("[", *map(_hashable, value))
    if type(value) is dict:
        return ("{", *sorted((k, _hashable(v)) for k, v in value.items()))
    hash(value)  # TypeError for anything json.loads does not make
    return (type(value).__name__, value)


@dataclass(frozen=True)
class Step:
    """One step of a program; which fields it uses depends on its ``kind`` (see the module's table).

    Build steps with `Step.move`, `Step.compute` and `Step.reduce`.
    """

    id: int
    kind: str
    after: tuple[int, ...] = ()
    transfer: Optional[Transfer] = None
    tensor: str = ""
    role: str = SRC
    kernel: str = ""
    device: str = ""
    inputs: tuple[TileRef, ...] = ()
    output: Optional[TileRef] = None
    params: tuple[tuple[str, str], ...] = ()
    op: str = ""
    devices: tuple[str, ...] = ()
    result: str = ""
    algorithm: str = ""
    dim: Optional[int] = None

    def __post_init__(self):
        if self.kind not in STEP_KINDS:
            raise PlanValidationError(f"step {self.id}: kind {self.kind!r} is not one of {list(STEP_KINDS)}")
        # ``after`` is a set of steps; sorting it gives one JSON form, so one id, per program.
        object.__setattr__(self, "after", tuple(sorted(set(map(int, self.after)))))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "devices", tuple(map(str, self.devices)))
        params = self.params.items() if isinstance(self.params, Mapping) else self.params
        object.__setattr__(self, "params", tuple(sorted((str(k), str(v)) for k, v in params)) if params else ())
        stray = [f for f, default in _UNUSED[self.kind] if getattr(self, f) != default]
        if stray:
            raise PlanValidationError(
                f"step {self.id}: a {self.kind} step uses only {list(_KIND_FIELDS[self.kind])}, but sets {stray}"
            )

    # -- builders ---------------------------------------------------------------------------

    @classmethod
    def move(cls, id: int, transfer: Transfer, after: Iterable[int] = (), tensor: str = RESHARD_TENSOR,
             role: str = SRC) -> "Step":
        return cls(id, MOVE, tuple(after), transfer=transfer, tensor=tensor, role=role)

    @classmethod
    def compute(cls, id: int, kernel: str, device: str, inputs: Iterable[TileRef], output: TileRef,
                after: Iterable[int] = (), params: Mapping[str, str] | None = None) -> "Step":
        return cls(id, COMPUTE, tuple(after), kernel=kernel, device=device, inputs=tuple(inputs), output=output,
                   params=tuple((params or {}).items()))

    @classmethod
    def reduce(cls, id: int, op: str, devices: Iterable[str], input: TileRef, output: TileRef,
               result: str = "replicate", algorithm: str = "ring", dim: Optional[int] = None,
               after: Iterable[int] = ()) -> "Step":
        return cls(id, REDUCE, tuple(after), op=op, devices=tuple(devices), inputs=(input,), output=output,
                   result=result, algorithm=algorithm, dim=dim)

    # -- what it touches ---------------------------------------------------------------------

    @property
    def box(self) -> Box:
        """The box a move moves, or a reduce's members hold addends of, or a compute writes."""
        if self.kind == MOVE:
            return self.transfer.box
        if self.kind == REDUCE:
            return self.inputs[0].box
        return self.output.box

    def named(self) -> tuple[str, ...]:
        """The tensors the step names: a move's, or a compute's or reduce's inputs' and output's."""
        if self.kind == MOVE:
            return (self.tensor,)
        return (*(r.tensor for r in self.inputs), *(() if self.output is None else (self.output.tensor,)))

    def participants(self) -> tuple[str, ...]:
        """The devices that take part: the sender and receivers, the compute device, the group."""
        if self.kind == MOVE:
            return (self.transfer.sender, *self.transfer.receivers)
        if self.kind == COMPUTE:
            return (self.device,)
        return self.devices

    def produces(self) -> list[tuple[str, str, str, Box]]:
        """(device, tensor, role, box) of every buffer the step writes."""
        if self.kind == MOVE:
            return [(r, self.tensor, DST, self.transfer.box) for r in self.transfer.receivers]
        out = self.output
        if self.kind == COMPUTE:
            return [(self.device, out.tensor, out.role, out.box)]
        if self.result == "replicate":
            return [(d, out.tensor, out.role, out.box) for d in self.devices]
        pieces = boxes.chunk(out.box, len(self.devices), self.dim)
        return [(d, out.tensor, out.role, b) for d, b in zip(self.devices, pieces) if boxes.volume(b)]

    # -- serialisation ------------------------------------------------------------------------

    def to_json(self) -> dict:
        out: dict = {"id": self.id, "kind": self.kind, "after": list(self.after)}
        if self.kind == MOVE:
            out["tensor"] = self.tensor
            if self.role != SRC:  # so that a program of plain moves keeps the JSON, and the id, it always had
                out["role"] = self.role
            out.update(self.transfer.to_json())
            del out["phase"]
        elif self.kind == COMPUTE:
            out.update(kernel=self.kernel, device=self.device, params=dict(self.params))
        else:
            out.update(op=self.op, devices=list(self.devices), result=self.result, algorithm=self.algorithm)
            if self.dim is not None:
                out["dim"] = self.dim
        if self.kind != MOVE:
            out["inputs"] = [r.to_json() for r in self.inputs]
            out["output"] = self.output.to_json() if self.output is not None else None
        return out

    @classmethod
    def from_json(cls, data, what: str = "step JSON") -> "Step":
        """Read what `to_json` writes; ``what`` names ``data`` in errors."""
        E = PlanValidationError
        need(data, "object", what, E)
        kind = data.get("kind")
        if kind not in STEP_KINDS:
            raise E(f"{what} field 'kind' is {brief(kind)}, not one of {list(STEP_KINDS)}")
        sid = field_of(data, "id", "integer", what, E)
        after = field_of(data, "after", "array", what, E, default=())
        if not set(map(type, after)) <= _INTS:  # the usual case, ints, checked in C; else name the item
            after = tuple(need(a, "integer", f"{what} field 'after' item {i}", E) for i, a in enumerate(after))
        if kind == MOVE:
            return cls.move(sid, Transfer.from_json(data, what), after, field_of(data, "tensor", "string", what, E),
                            field_of(data, "role", "string", what, E, default=SRC))
        inputs = tuple(TileRef.from_json(r, f"{what} input {i}")
                       for i, r in enumerate(field_of(data, "inputs", "array", what, E)))
        output = field_of(data, "output", "object", what, E, default=None)
        output = TileRef.from_json(output, f"{what} field 'output'") if output is not None else None
        if kind == COMPUTE:
            params = field_of(data, "params", "object", what, E, default={})
            for key, value in params.items():
                need(value, "string", f"{what} param {brief(key)}", E)
            return cls.compute(sid, field_of(data, "kernel", "string", what, E),
                               field_of(data, "device", "string", what, E), inputs, output, after, params)
        dim = data.get("dim")
        return cls(sid, REDUCE, after, op=field_of(data, "op", "string", what, E),
                   devices=strings(field_of(data, "devices", "array", what, E), f"{what} field 'devices'"),
                   inputs=inputs, output=output, result=field_of(data, "result", "string", what, E),
                   algorithm=field_of(data, "algorithm", "string", what, E),
                   dim=None if dim is None else need(dim, "integer", f"{what} field 'dim'", E))

    def __str__(self) -> str:
        after = f" after {','.join(map(str, self.after))}" if self.after else ""
        if self.kind == MOVE:
            t = self.transfer
            via = f" via {'->'.join(t.route)}" if t.route else ""
            role = f":{self.role}" if self.role != SRC else ""
            body = (f"{self.tensor}{role} {t.method} {boxes.box_str(t.box)} {t.sender} -> "
                    f"{','.join(t.receivers)}{via}")
        elif self.kind == COMPUTE:
            body = f"{self.kernel} on {self.device}: {', '.join(map(str, self.inputs))} -> {self.output}"
        else:
            how = f"{self.result}" + (f"(dim {self.dim})" if self.dim is not None else "")
            refs = ", ".join(map(str, self.inputs))
            body = f"{self.op} {how} by {self.algorithm} over {','.join(self.devices)}: {refs} -> {self.output}"
        return f"#{self.id} {self.kind} {body}{after}"


def move_steps(transfers: Sequence[Transfer], first: int = 0, tensor: str = RESHARD_TENSOR) -> list[Step]:
    """One move step of ``tensor`` per transfer, ids from ``first`` on in the transfers' order (`Program.from_plan`).

    A step waits for the steps of earlier phases that deliver part of its box to its sender: the dependency graph
    replaces the phase barrier. Built without `Step`'s checks, which these fields pass by construction: a state
    dict's program has hundreds of thousands of them.
    """
    delivered: dict[str, list[tuple[int, int, Box]]] = defaultdict(list)
    if any(t.phase for t in transfers):
        for j, t in enumerate(transfers):
            for r in t.receivers:
                delivered[r].append((j, t.phase, t.box))
    steps = []
    new, set_state = object.__new__, object.__setattr__
    for i, t in enumerate(transfers):
        after = ()
        if t.phase:
            feeds = [j for j, phase, b in delivered.get(t.sender, ())
                     if phase < t.phase and boxes.intersect(b, t.box) is not None]
            if any(j > i for j in feeds):
                raise PlanValidationError(
                    f"transfer {i} ({t}) comes before a transfer of an earlier phase that feeds it; a program's "
                    f"steps depend on earlier steps only, so list the plan's transfers by phase"
                )
            after = tuple(sorted({first + j for j in feeds}))
            t = replace(t, phase=0)
        step = new(Step)
        # A move's own fields; the others read the class's defaults, as they would read equal values here.
        set_state(step, "__dict__", {"id": first + i, "kind": MOVE, "after": after, "transfer": t, "tensor": tensor})
        steps.append(step)
    return steps


def moves_like(template: Sequence[Step], first: int, tensor: str) -> list[Step]:
    """The move steps of ``template`` (`move_steps` from id 0) for ``tensor``, ids from ``first`` on: the steps of
    a tensor that moves as another of its layout does (`reshard.plan_many`), sharing their transfers, built without
    redoing `move_steps`' dependencies per tensor."""
    new, set_state = object.__new__, object.__setattr__
    steps = []
    for s in template:
        step = new(Step)
        after = tuple([first + a for a in s.after]) if s.after else ()
        set_state(step, "__dict__", {"id": first + s.id, "kind": MOVE, "after": after, "transfer": s.transfer,
                                     "tensor": tensor})
        steps.append(step)
    return steps


_STEP_DEFAULTS = {f.name: f.default for f in fields(Step)}


class StepsLike:
    """The steps of ``template`` (ids from 0 on), ready to be made again for other tensors (`make`): the steps of
    tensors made and moved as others of their layouts are (`reshard.plan_many`'s quantized weights)."""

    def __init__(self, template: Sequence[Step]):
        ref_at: dict[int, int] = {}
        tensor_at: dict[str, int] = {}
        self.refs: list[TileRef] = []  # the template's distinct tile refs
        self.tensors: list[str] = []  # the tensors its moves name
        # per step: its state, its after, and which of the tensors (a move) or refs (a compute) it names, by position
        self.steps: list[tuple] = []

        def ref(r: TileRef) -> int:
            k = ref_at.get(id(r))
            if k is None:
                k = ref_at[id(r)] = len(self.refs)
                self.refs.append(r)
            return k

        for s in template:
            # Only the fields a step sets to other than their defaults, which the others read from the class (as
            # `move_steps` builds them): fewer to copy per step made.
            state = {k: v for k, v in s.__dict__.items() if k in ("id", "kind") or v != _STEP_DEFAULTS[k]}
            if s.kind == MOVE:
                tensor = tensor_at.setdefault(s.tensor, len(tensor_at))
                if tensor == len(self.tensors):
                    self.tensors.append(s.tensor)
                self.steps.append((state, s.after, tensor, None, None))
            else:
                self.steps.append((state, s.after, None, [ref(r) for r in s.inputs],
                                   ref(s.output) if s.output is not None else None))

    def make(self, first: int, names: Mapping[str, str]) -> list[Step]:
        """The template's steps with ids from ``first`` on and the tensors they name renamed by ``names`` (template
        name -> name, every tensor a step names in it), built without their checks, which renaming keeps passing."""
        new, set_state = object.__new__, object.__setattr__
        refs = []
        for ref in self.refs:
            out = new(TileRef)
            set_state(out, "tensor", names[ref.tensor])
            set_state(out, "role", ref.role)
            set_state(out, "box", ref.box)
            refs.append(out)
        tensors = [names[t] for t in self.tensors]
        steps = []
        for state, after, tensor, inputs, output in self.steps:
            state = state.copy()
            state["id"] += first
            if after:
                state["after"] = tuple([first + a for a in after])
            if tensor is not None:
                state["tensor"] = tensors[tensor]
            else:
                state["inputs"] = tuple([refs[k] for k in inputs])
                if output is not None:
                    state["output"] = refs[output]
            step = new(Step)
            set_state(step, "__dict__", state)
            steps.append(step)
        return steps


class MoveView(NamedTuple):
    """What a move step says, without the step (`Program.moves_at`)."""

    id: int
    tensor: str
    transfer: Transfer
    after: tuple[int, ...]
    role: str


class RunSteps(Sequence):
    """A program's steps where the steps of runs (`Run`) are made from their templates' (`StepsLike`) when first
    asked for, a run at a time: a state dict quantized on the way holds millions of steps, nearly all in runs, and
    a planner that validates, hashes, prices and writes it by its templates (`Program._repeated`) never needs them
    as objects (making them was half of planning one). Reads as a tuple of the steps; iterating makes them all.

    ``items`` holds each step, or None for one of a run of ``runs`` not made yet (each run's template made, or in
    an earlier run)."""

    __slots__ = ("_items", "_pending", "_firsts", "_forms", "_lock")

    def __init__(self, items: list, runs: Iterable[Run]):
        self._items = items
        self._pending: dict[int, Run] = {}  # first step -> a run not made yet
        for run in runs:
            first, count = run[:2]
            if items[first] is None:
                self._pending[first] = run
        self._firsts = sorted(self._pending)
        self._forms: dict[tuple[int, int], StepsLike] = {}
        self._lock = threading.Lock()  # an agent's threads read one program

    @property
    def unmade(self) -> bool:
        """Whether some run's steps are not made yet."""
        return bool(self._pending)

    @property
    def items(self) -> list:
        """The steps made so far, None for the others: the steps outside runs (templates) are all made."""
        return self._items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            at = range(*i.indices(len(self._items)))
            if self._pending and at:
                self._make_between(min(at[0], at[-1]), max(at[0], at[-1]) + 1)
            return tuple(self._items[i])
        s = self._items[i]
        if s is None:
            self._make_between(i % len(self._items), i % len(self._items) + 1)
            s = self._items[i]
        return s

    def __iter__(self) -> Iterator[Step]:
        if self._pending:
            self._make_between(0, len(self._items))
        return iter(self._items)

    def __eq__(self, other) -> bool:
        if not isinstance(other, (tuple, list, RunSteps)):
            return NotImplemented
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def add_run(self, run: Run) -> None:
        """Append ``run``'s steps, after every step so far, unmade (a program's text read a run at a time)."""
        first, count = run[:2]
        if first != len(self._items):
            raise ValueError(f"run {run[:3]} starts at step {first}, not after the {len(self._items)} steps so far")
        self._items.extend(repeat(None, count))
        self._pending[first] = run
        self._firsts.append(first)

    def _make_between(self, lo: int, hi: int) -> None:
        """Make every pending run with a step in ``lo`` .. ``hi`` - 1 (as many objects as `plan_many` would have
        made: without cycle collection, see `no_cycle_collection`)."""
        with self._lock, no_cycle_collection():
            firsts = self._firsts
            k = max(0, bisect_right(firsts, lo) - 1)
            todo = []
            while k < len(firsts) and firsts[k] < hi:
                run = self._pending.get(firsts[k])
                if run is not None and run[0] + run[1] > lo:
                    todo.append(run)
                k += 1
            for run in todo:
                self._make(run)

    def _make(self, run: Run) -> None:
        """Make ``run``'s steps (its template's first, where it is in an earlier run); the lock held."""
        first, count, like, renames = run
        if self._pending.pop(first, None) is None:
            return
        if any(s is None for s in self._items[like:like + count]):
            for earlier in [r for f, r in self._pending.items() if f < like + count and f + r[1] > like]:
                self._make(earlier)
        form = self._forms.get((like, count))
        if form is None:
            form = self._forms[like, count] = StepsLike(self._items[like:like + count])
        self._items[first:first + count] = form.make(first - like, Renamed(renames))
        if not self._pending:
            self._firsts, self._forms = [], {}


# -- the compact text ----------------------------------------------------------------------------------------
#
# A state dict's program repeats a few layouts over many tensors, and each tensor's steps are another's of its layout
# with the names changed (`reshard.plan_many` makes them so: `moves_like`, `StepsLike`). Its text (`Program.dumps`)
# then says so instead of writing every step: ``layouts`` lists each distinct (shape, dtype, src, dst) once and a
# tensor names its layout by position (``{"name": ..., "layout": k}``), and a ``steps`` entry
# ``{"like": a, "count": n, "rename": [[i, j], ...]}`` stands for steps a .. a + n - 1, written before it, again, as
# the next n steps: each id and ``after`` moved by the same amount, and the tensors they name renamed, tensor i of
# the program's to tensor j (by position; those not renamed kept). The steps of a run wait only for steps of the
# run. The program is the same: its id is the hash of its canonical text, every step written out (the Kimi-K2-like
# state dict of bench/plan_quality.py: 919 MiB of plain text, under 64 written so).

# (first step, count, first step it repeats, ((old name, new name), ...)) each, in step order, not overlapping
Run = tuple[int, int, int, tuple[tuple[str, str], ...]]


def layouts_of(tensors: Sequence[TensorDecl]) -> tuple[list[str], list[int]]:
    """The compact text's layouts: each distinct (shape, dtype, src, dst) of ``tensors`` as the plain JSON text of a
    declaration without its name, and each tensor's layout by position (what its ``{"name", "layout"}`` names)."""
    layouts: dict[tuple, int] = {}
    texts: list[str] = []
    of: list[int] = []
    for t in tensors:
        key = (t.shape, t.dtype, t.src, t.dst)
        k = layouts.get(key)
        if k is None:
            k = layouts[key] = len(texts)
            fields = t.to_json()
            del fields["name"]
            texts.append(plain_text(fields))
        of.append(k)
    return texts, of


def _compact_fields(tensors: Sequence[TensorDecl], steps: Sequence[Step], runs: Sequence[Run]) -> dict:
    """The ``layouts``, ``tensors`` and ``steps`` fields of the compact text, as chunks of plain JSON text."""
    layout_texts, of = layouts_of(tensors)
    tensor_texts = [f'{{"name": {quoted(t.name)}, "layout": {k}}}' for t, k in zip(tensors, of)]
    return {"layouts": (f"[{', '.join(layout_texts)}]",), "tensors": (f"[{', '.join(tensor_texts)}]",),
            "steps": _run_chunks(steps, runs, {t.name: i for i, t in enumerate(tensors)})}


def _run_chunks(steps: Sequence[Step], runs: Sequence[Run], position: Mapping[str, int]) -> Iterator[str]:
    """The compact ``steps`` field: the steps outside ``runs`` written out (as `_step_chunks` writes them), a run
    entry for each run, naming tensors by their ``position`` among the program's."""

    def entry(run: Run) -> str:
        _, count, like, renames = run
        rename = ", ".join(f"[{position[a]}, {position[b]}]" for a, b in renames)
        return f'{{"like": {like}, "count": {count}, "rename": [{rename}]}}'

    return _chunks_with_runs(steps, runs, _StepWriter(canonical=False), entry)


def _chunks_with_runs(steps: Sequence[Step], runs: Sequence[Run], writer: "_StepWriter",
                      run_text: Callable[[Run], str]) -> Iterator[str]:
    """A JSON list's text in chunks: the steps outside ``runs`` (in step order) as ``writer`` writes them, a
    chunk at a time, and ``run_text`` of each run in its place."""
    sep = writer.sep
    yield "["
    written = 0  # chunks so far
    at = 0
    for run in (*runs, (len(steps), 0, 0, ())):
        first, count = run[:2]
        for start in range(at, first, _STEPS_PER_CHUNK):
            chunk = writer.chunk(steps[start:min(first, start + _STEPS_PER_CHUNK)])
            yield f"{sep}{chunk}" if written else chunk
            written += 1
        if count:
            chunk = run_text(run)
            yield f"{sep}{chunk}" if written else chunk
            written += 1
        at = first + count
    yield "]"


class Renamed(dict):
    """A ``rename`` of a run (old name -> new name): a name it does not list stays as it is."""

    def __missing__(self, key):
        return key


def read_tensors(data: Mapping, seen: dict) -> list[TensorDecl]:
    """The ``tensors`` of program JSON, each written whole or (the compact text) by name and layout."""
    E = PlanValidationError
    raw = field_of(data, "tensors", "array", "program JSON", E)
    layouts = [TensorDecl.from_json({**need(fields, "object", f"program JSON layout {k}", E), "name": ""},
                                    f"program JSON layout {k}", seen)
               for k, fields in enumerate(field_of(data, "layouts", "array", "program JSON", E, default=[]))]
    out = []
    for i, t in enumerate(raw):
        if type(t) is dict and type(t.get("name")) is str and type(t.get("layout")) is int \
                and 0 <= t["layout"] < len(layouts):  # by name and layout, as the compact text writes it
            out.append(decl_with(layouts[t["layout"]], name=t["name"]))
        elif isinstance(t, Mapping) and "layout" in t:
            what = f"program JSON tensor {i}"
            k = field_of(t, "layout", "integer", what, E)
            if not 0 <= k < len(layouts):
                raise E(f"{what} names layout {k}, but the program lists {len(layouts)} layouts (0.."
                        f"{len(layouts) - 1})")
            out.append(decl_with(layouts[k], name=field_of(t, "name", "string", what, E)))
        else:
            out.append(TensorDecl.from_json(t, f"program JSON tensor {i}", seen))
    return out


def _read_steps(data: Mapping, tensors: Sequence[TensorDecl]) -> tuple[Sequence[Step], list[Run]]:
    """The ``steps`` of program JSON, each written whole or (the compact text) as a run of earlier steps again,
    renaming ``tensors`` by position, a run's made when asked for (`RunSteps`); and the runs read (`Run`), for
    `Program._with_runs`."""
    E = PlanValidationError
    out: list[Optional[Step]] = []
    steps = RunSteps(out, ())
    runs: list[Run] = []
    checked: set[tuple[int, int]] = set()  # a state dict's runs repeat a few hundred templates
    for i, item in enumerate(field_of(data, "steps", "array", "program JSON", E)):
        if not (isinstance(item, Mapping) and "like" in item):
            out.append(Step.from_json(item, f"program JSON step {len(out)}"))
            continue
        what = f"program JSON steps entry {i} (a run, from step {len(out)})"
        like, count = (field_of(item, key, "integer", what, E) for key in ("like", "count"))
        pairs = field_of(item, "rename", "array", what, E, default=[])
        if not all(isinstance(p, list) and len(p) == 2 and all(type(k) is int and 0 <= k < len(tensors) for k in p)
                   for p in pairs):
            raise E(f"{what}: rename is a list of [tensor, tensor] pairs, each a position among the program's "
                    f"{len(tensors)} tensors; got {brief(pairs)}")
        rename = {tensors[a].name: tensors[b].name for a, b in pairs}
        if not (0 <= like and 0 < count and like + count <= len(out)):
            raise E(f"{what} repeats steps {like}..{like + count - 1}, which are not all steps written before it "
                    f"(there are {len(out)}); a run repeats earlier steps")
        if (like, count) not in checked:
            template = steps[like:like + count]
            outside = [(s.id, a) for s in template for a in s.after if not like <= a < like + count]
            if outside:
                raise E(f"{what} repeats steps {like}..{like + count - 1}, but step {outside[0][0]} of them waits "
                        f"for step {outside[0][1]}, outside the run; a run's steps wait only for steps of the run")
            checked.add((like, count))
        runs.append((len(out), count, like, tuple(rename.items())))
        steps.add_run(runs[-1])
    return (steps if runs else out), runs


# Steps written per chunk of JSON text: the id hashes one chunk at a time, and dumps joins a few hundred of them.
_STEPS_PER_CHUNK = 4096


def _json_text_chunks(fields: Mapping[str, Iterable[str]], canonical: bool) -> Iterator[str]:
    """An object's JSON text in chunks, each field's value given as chunks of its text: what ``json.dumps`` of the
    object writes, or with ``canonical`` what `reshard.plans.content_id` hashes (keys sorted, no spaces)."""
    sep, colon = (",", ":") if canonical else (", ", ": ")
    yield "{"
    for i, key in enumerate(sorted(fields) if canonical else fields):
        yield f"{sep if i else ''}{quoted(key)}{colon}"
        yield from fields[key]
    yield "}"


def _tensor_chunks(tensors: Sequence[TensorDecl], canonical: bool) -> Iterator[str]:
    """``[t.to_json() for t in tensors]`` as JSON text (see `_json_text_chunks`), each sharding written once."""
    enc = canonical_text if canonical else plain_text
    shardings: dict[int, tuple[Sharding, str]] = {}  # by id(); holding the sharding keeps its id from being reused

    def sharding(s: Sharding) -> str:
        kept = shardings.get(id(s))
        if kept is None:
            kept = shardings[id(s)] = (s, enc(s.to_json()) if canonical else s.json_text())
        return kept[1]

    out = []
    for t in tensors:
        name, shape, dtype = enc(t.name), enc(list(t.shape)), enc(t.dtype)
        if canonical:
            dst = f'"dst":{sharding(t.dst)},' if t.dst is not None else ""
            src = f',"src":{sharding(t.src)}' if t.src is not None else ""
            out.append(f'{{{dst}"dtype":{dtype},"name":{name},"shape":{shape}{src}}}')
        else:
            src = f', "src": {sharding(t.src)}' if t.src is not None else ""
            dst = f', "dst": {sharding(t.dst)}' if t.dst is not None else ""
            out.append(f'{{"name": {name}, "shape": {shape}, "dtype": {dtype}{src}{dst}}}')
    yield f"[{(',' if canonical else ', ').join(out)}]"


_step_id, _step_kind, _step_role, _step_after, _step_tensor, _step_transfer = (
    attrgetter(f) for f in ("id", "kind", "role", "after", "tensor", "transfer"))
_transfer_box = _ref_box = attrgetter("box")
_transfer_path = attrgetter("sender", "method", "receivers", "route")
_flat = chain.from_iterable


def _known(cache: dict, keys: list, write_all, objects: Optional[list] = None) -> Optional[list[str]]:
    """``cache[k]`` for each of ``keys``; those not seen before from ``write_all`` of their objects (the keys
    themselves unless ``objects``), each once, which gives None for values it does not write (then so does this)."""
    texts = list(map(cache.get, keys))
    if None in texts:
        missing = list(map(is_, texts, repeat(None)))
        new = dict(zip(compress(keys, missing), compress(keys if objects is None else objects, missing)))
        written = write_all(list(new.values()))
        if written is None:
            return None
        cache.update(zip(new, written))
        texts = list(map(cache.get, keys))
    return texts


class _StepWriter:
    """The JSON text of steps for one pass of `dumps` (plain) or of the id (canonical), with that pass's caches.

    A state dict's million moves share a few thousand names, boxes, receiver lists and routes, and a transfer
    often moves for several tensors: each is written once and remembered, by value where values that compare equal
    have the same JSON (str, tuples of str or of int pairs), else by its object's id (``keep`` holds those objects,
    so an id is not reused while the pass runs). A chunk of moves with role 'src' and int ids (all of a state
    dict's) is written column by column with ``map``, its text one join of the columns' pieces, so that the
    interpreter runs per value first seen rather than per step (3 us a step when it did). Other steps are
    written one at a time by `step`.
    """

    def __init__(self, canonical: bool):
        self.canonical = canonical
        self.enc = canonical_text if canonical else plain_text
        self.sep = "," if canonical else ", "
        self.keep: list = []
        self.names: dict[str, str] = {}  # tensors, devices, methods, roles
        self.lists: dict[tuple[str, ...], str] = {}  # receivers, routes
        self.boxes: dict[Box, str] = {}  # boxes of int pairs (True == 1, but not in JSON)
        self.box_objects: dict[int, str] = {}  # the same, by id
        # What `moves` writes for a move's transfer: canonical, between its after and its id (the box) and between
        # its id and its tensor (the rest, by the transfer's sender, method, receivers and route); plain, both
        # after its tensor.
        self.box_texts: dict[int, str] = {}  # by id(box)
        self.paths: dict[tuple, str] = {}
        self.params: dict[int, str] = {}  # a compute step's params, by id
        self.refs: dict[int, str] = {}  # a compute step's tile refs, by id

    # -- one value at a time, for `step` ---------------------------------------------------------------

    def name(self, v) -> str:
        if type(v) is not str:
            return self.enc(v)
        text = self.names.get(v)
        if text is None:
            text = self.names[v] = quoted(v)
        return text

    def listed(self, v) -> str:
        if type(v) is not tuple or not all(type(x) is str for x in v):
            return self.enc(list(v))
        text = self.lists.get(v)
        if text is None:
            # What the encoder writes for a list of str, without its set-up per call.
            text = self.lists[v] = f"[{self.sep.join(map(quoted, v))}]"
        return text

    def box(self, b: Box) -> str:
        text = self.box_objects.get(id(b))  # a program's steps share a few thousand box objects
        if text is not None:
            return text
        if type(b) is not tuple or not all(type(p) is tuple and len(p) == 2 and type(p[0]) is int and
                                           type(p[1]) is int for p in b):
            return self.enc([[lo, hi] for lo, hi in b])
        text = self.boxes.get(b)
        if text is None:
            text = self.boxes[b] = self.int_boxes([b])[0]
        self.keep.append(b)
        self.box_objects[id(b)] = text
        return text

    def path(self, sender, method, receivers, route) -> tuple[str, str]:
        """The texts of a transfer's sender, receivers, method and route: before and after the key 'role' when
        canonical, one piece after the box when not (`Transfer.to_json`'s order)."""
        sender, receivers, method, route = (self.name(sender), self.listed(receivers), self.name(method),
                                            self.listed(route) if method == "broadcast" else None)
        if self.canonical:
            routed = "" if route is None else f',"route":{route}'
            return f'"method":{method},"receivers":{receivers}', f'{routed},"sender":{sender}'
        routed = "" if route is None else f', "route": {route}'
        return f'"sender": {sender}, "receivers": {receivers}, "method": {method}{routed}', ""

    def step(self, s: Step) -> str:
        """Any step's text."""
        if s.kind != MOVE:
            text = self.compute(s) if s.kind == COMPUTE else None
            return self.enc(s.to_json()) if text is None else text
        t = s.transfer
        box, (first, second) = self.box(t.box), self.path(t.sender, t.method, t.receivers, t.route)
        sid = str(s.id) if type(s.id) is int else self.enc(s.id)
        after = self.after(s.after)
        tensor = self.name(s.tensor)
        if self.canonical:
            role = f',"role":{self.name(s.role)}' if s.role != SRC else ""
            return (f'{{"after":{after},"box":{box},"id":{sid},"kind":"move",{first}{role}{second},'
                    f'"tensor":{tensor}}}')
        role = f', "role": {self.name(s.role)}' if s.role != SRC else ""
        return f'{{"id": {sid}, "kind": "move", "after": {after}, "tensor": {tensor}{role}, "box": {box}, {first}}}'

    def compute(self, s: Step) -> Optional[str]:
        """A compute step's text from its values' remembered texts (a state dict quantized on the way holds
        1.7 million compute steps); None where a value is not of the usual types (then the encoder writes it)."""
        if type(s.id) is not int or type(s.inputs) is not tuple:
            return None
        refs = [*map(self.ref, s.inputs), "null" if s.output is None else self.ref(s.output)]
        if None in refs:
            return None
        # by object: a template's steps share theirs
        params = self.params.get(id(s.params))
        if params is None:
            try:
                params = self.params[id(s.params)] = self.enc(dict(s.params))
            except (TypeError, ValueError):  # odd params: the encoder's text from to_json, or its error
                return None
            self.keep.append(s.params)
        after = self.after(s.after)
        kernel, device, output = self.name(s.kernel), self.name(s.device), refs.pop()
        if self.canonical:
            return (f'{{"after":{after},"device":{device},"id":{s.id},"inputs":[{",".join(refs)}],"kernel":{kernel},'
                    f'"kind":"compute","output":{output},"params":{params}}}')
        return (f'{{"id": {s.id}, "kind": "compute", "after": {after}, "kernel": {kernel}, "device": {device}, '
                f'"params": {params}, "inputs": [{", ".join(refs)}], "output": {output}}}')

    def after(self, after) -> str:
        """A step's ``after``'s text."""
        if not after:
            return "[]"
        if {*map(type, after)} == {int}:  # what the encoder writes for a list of ints, without its set-up
            return f"[{self.sep.join(map(str, after))}]"
        return self.enc(list(after))

    def ref(self, r) -> Optional[str]:
        """A `TileRef`'s text, by object (a tensor's steps share theirs); None unless it is one."""
        text = self.refs.get(id(r))
        if text is not None:
            return text
        if type(r) is not TileRef:
            return None
        tensor, role, box = self.name(r.tensor), self.name(r.role), self.box(r.box)
        if self.canonical:
            text = f'{{"box":{box},"role":{role},"tensor":{tensor}}}'
        else:
            text = f'{{"tensor": {tensor}, "role": {role}, "box": {box}}}'
        self.keep.append(r)
        self.refs[id(r)] = text
        return text

    def chunk(self, steps: Sequence[Step]) -> str:
        """The texts of ``steps`` joined by the separator: moves that read role 'src' a column at a time (`moves`),
        in stretches of such steps, the others one at a time (`step`)."""
        text = self.moves(steps)
        if text is not None:
            return text
        pieces = []
        for plain, stretch in groupby(steps, key=_is_src_move):
            stretch = list(stretch)
            text = self.moves(stretch) if plain else None
            pieces.append(self.sep.join(map(self.step, stretch)) if text is None else text)
        return self.sep.join(pieces)

    # -- many values at once, for `moves` -------------------------------------------------------------

    def int_boxes(self, boxes: list[Box]) -> list[str]:
        pair = "[{},{}]" if self.canonical else "[{}, {}]"
        return [f"[{self.sep.join([pair.format(lo, hi) for lo, hi in b])}]" for b in boxes]

    def str_lists(self, lists: list[tuple[str, ...]]) -> list[str]:
        sep = self.sep
        return [f"[{sep.join(map(quoted, v))}]" for v in lists]

    def str_names(self, names: list) -> Optional[list[str]]:
        return list(map(quoted, names)) if {*map(type, names)} <= {str} else None

    def path_texts(self, keys: list[tuple]) -> Optional[list[str]]:
        """The tails' texts of transfers' (sender, method, receivers, route); None unless all are str."""
        senders, methods, receivers, routes = zip(*keys)
        if not ({*map(type, senders), *map(type, methods), *map(type, _flat(receivers)), *map(type, _flat(routes))}
                <= {str} and {*map(type, receivers), *map(type, routes)} <= {tuple}):
            return None
        receivers = _known(self.lists, list(receivers), self.str_lists)
        if self.canonical:
            routed = [f',"route":{self.listed(r)}' if m == "broadcast" else "" for m, r in zip(methods, routes)]
            return [f',"kind":"move","method":{quoted(m)},"receivers":{r}{routed},"sender":{quoted(s)},"tensor":'
                    for s, m, r, routed in zip(senders, methods, receivers, routed)]
        routed = [f', "route": {self.listed(r)}' if m == "broadcast" else "" for m, r in zip(methods, routes)]
        return [f', "sender": {quoted(s)}, "receivers": {r}, "method": {quoted(m)}{routed}'
                for s, m, r, routed in zip(senders, methods, receivers, routed)]

    def box_pieces(self, boxes: list[Box]) -> Optional[list[str]]:
        """What `moves` writes for each of ``boxes`` (distinct objects); None unless all are tuples of int pairs."""
        pairs = list(_flat(boxes))
        if not ({*map(type, boxes), *map(type, pairs)} <= {tuple} and {*map(len, pairs)} <= {2}
                and {*map(type, _flat(pairs))} <= {int}):
            return None
        self.keep.extend(boxes)
        texts = _known(self.boxes, boxes, self.int_boxes)
        return list(map(',"box":{},"id":'.format if self.canonical else ', "box": {}'.format, texts))

    def moves(self, steps: Sequence[Step]) -> Optional[str]:
        """The texts of ``steps`` joined by the separator, or None unless all are moves with role 'src', int ids
        and the values `box_pieces`, `path_texts` and `str_names` write.

        Each column (ids, boxes, tensors, ...) is a list, and they are interleaved into one list of pieces by
        slice assignment and joined: every loop but those over values first seen runs in C.
        """
        if ({*map(_step_kind, steps)} != {MOVE} or {*map(_step_role, steps)} != {SRC}
                or {*map(type, map(_step_id, steps))} != {int}):
            return None
        transfers = list(map(_step_transfer, steps))
        box_objects = list(map(_transfer_box, transfers))
        boxes = _known(self.box_texts, list(map(id, box_objects)), self.box_pieces, box_objects)
        try:
            tensors = _known(self.names, list(map(_step_tensor, steps)), self.str_names)
            paths = _known(self.paths, list(map(_transfer_path, transfers)), self.path_texts)
        except TypeError:  # a key holding a list cannot be hashed
            return None
        if boxes is None or paths is None or tensors is None:
            return None
        step_ids = list(map(str, map(_step_id, steps)))  # str of an int is its JSON
        afters = list(map(_step_after, steps))
        afters = list(map(self.after, afters)) if any(afters) else None
        # Each step's pieces, the first carrying the end of the step before it.
        if self.canonical:
            columns = (['},{"after":', afters, boxes, step_ids, paths, tensors] if afters else
                       ['},{"after":[]', boxes, step_ids, paths, tensors])
        else:
            columns = (['}, {"id": ', step_ids, ', "kind": "move", "after": ', afters, ', "tensor": ', tensors, boxes,
                        paths] if afters else
                       ['}, {"id": ', step_ids, ', "kind": "move", "after": [], "tensor": ', tensors, boxes, paths])
        width, n = len(columns), len(steps)
        pieces = [""] * (width * n)
        for j, column in enumerate(columns):
            pieces[j::width] = column if isinstance(column, list) else [column] * n
        pieces[0] = pieces[0][1 + len(self.sep):]
        pieces.append("}")
        return "".join(pieces)


def _step_chunks(steps: Sequence[Step], canonical: bool) -> Iterator[str]:
    """``[s.to_json() for s in steps]`` as JSON text (see `_json_text_chunks`), written by a `_StepWriter`."""
    writer = _StepWriter(canonical)
    sep = writer.sep
    yield "["
    for start in range(0, len(steps), _STEPS_PER_CHUNK):
        chunk = writer.chunk(steps[start:start + _STEPS_PER_CHUNK])
        yield f"{sep}{chunk}" if start else chunk
    yield "]"


def steps_text(stretches: Iterable[Sequence[Step]]) -> list[str]:
    """The plain JSON text of each stretch of steps, its steps' texts joined by ", " (no brackets), as `dumps`
    writes them, with one writer's caches for them all: what a host's slice of a program (`reshard.host_slice`)
    writes of the steps outside runs."""
    writer = _StepWriter(canonical=False)
    return [writer.sep.join(writer.chunk(stretch[k:k + _STEPS_PER_CHUNK])
                            for k in range(0, len(stretch), _STEPS_PER_CHUNK)) for stretch in stretches]


def _run_step_chunks(steps: Sequence[Step], runs: Sequence[Run]) -> Iterator[str]:
    """`_step_chunks`' canonical text of ``steps`` (the id's), each run's steps written from its template's text
    (`_RunText`) rather than one by one: the same text, in half the time for a state dict quantized on the way.
    ``runs`` in step order, their steps the templates' renamed (`Program._repeated`)."""
    writer = _StepWriter(canonical=True)
    forms: dict[tuple[int, int], Optional[_RunText]] = {}
    repeats = Counter((like, count) for _, count, like, _ in runs)
    if isinstance(steps, RunSteps) and steps.unmade:  # a form pays where the steps would be made to be written
        repeats = Counter(dict.fromkeys(repeats, _FORM_REPEATS))

    def run_text(run: Run) -> str:
        first, count, like, renames = run
        if (like, count) not in forms:
            forms[like, count] = _RunText.of(steps[like:like + count], repeats[like, count])
        form = forms[like, count]
        return writer.chunk(steps[first:first + count]) if form is None else \
            form.text(first, Renamed(renames), writer)

    return _chunks_with_runs(steps, runs, writer, run_text)


# How many runs of moves alone a form pays for: making one writes its template's steps one by one, which runs
# repeated this often win back against the columnar writer (the 61-layer Kimi-K2-like program's id, bf16 on the
# wire: 4.0 -> 3.0 s here).
_FORM_REPEATS = 8


class _RunText:
    """The canonical text of a template's steps as one ``str.format`` form, with the places that a run changes left
    open: the tensors its steps name, and each step's ``after`` values and id; `text` fills them in for a run."""

    _MARK = re.compile(r'"\\u0000(\d+)\\u0000"')  # a marker name, as the writer quotes it

    @classmethod
    def of(cls, template: Sequence[Step], repeats: int) -> Optional["_RunText"]:
        """The form of a template that ``repeats`` runs repeat, or None where its steps are all moves from source
        tiles and repeat too few times for a form to pay (the writer writes those a column at a time, nearly as
        fast), or where a step's text is not as this reads it (values of odd types): then the run's steps are
        written as any others."""
        if all(map(_is_src_move, template)) and repeats < _FORM_REPEATS:
            return None
        try:
            return cls(template)
        except ValueError:
            return None

    def __init__(self, template: Sequence[Step]):
        like = template[0].id
        self.names = list(dict.fromkeys(t for s in template for t in s.named()))
        # the template's steps with ids from 0 and each tensor named by a marker, written out
        steps = StepsLike(template).make(-like, {t: f"\x00{k}\x00" for k, t in enumerate(self.names)})
        writer = _StepWriter(canonical=True)
        fields = len(self.names)  # fields 0..: the names, then the numbers, in order
        self.numbers: list[int] = []  # each step's after values, then its id (from 0: a run adds its first)

        def number(value: int) -> str:
            self.numbers.append(value)
            return f"{{{fields + len(self.numbers) - 1}}}"

        def opened(piece: str) -> str:  # literal braces doubled, each marker name a field
            return self._MARK.sub(lambda m: f"{{{m.group(1)}}}", piece.replace("{", "{{").replace("}", "}}"))

        forms = []
        for s in steps:
            text = writer.step(s)
            head = '{"after":' + writer.after(s.after)
            cut = text.index(',"id":', len(head)) + len(',"id":')  # ValueError where there is none
            end = cut + len(str(s.id))
            if not ({*map(type, s.after)} <= {int} and type(s.id) is int and text.startswith(head)
                    and text[cut:end] == str(s.id) and text[end] == ","):
                raise ValueError(f"step {s}: its text {text[:200]!r} is not as _RunText reads it")
            after = f"[{','.join(map(number, s.after))}]"
            forms.append('{{"after":' + after + opened(text[len(head):cut]) + number(s.id) + opened(text[end:]))
        self.form = ",".join(forms)

    def text(self, first: int, rename: Mapping[str, str], writer: _StepWriter) -> str:
        """The run's steps from ``first`` on, its tensors ``rename``d, as one chunk of the id's text."""
        return self.form.format(*[writer.name(rename[t]) for t in self.names], *map(first.__add__, self.numbers))


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """When a step runs on the cost model: seconds, start and finish, and what limits it."""

    id: int
    kind: str
    seconds: float
    start: float
    finish: float
    bottleneck: str


def _when(s: Step) -> str:
    return f"when its dependencies {list(s.after)} are done" if s.after else "at the start (it depends on no step)"


class _StepWhere:
    """Names a step in an error message, formatted only if one is raised."""

    __slots__ = ("step",)

    def __init__(self, step: Step):
        self.step = step

    def __str__(self) -> str:
        return f"step {self.step}"


@contextmanager
def no_cycle_collection():
    """Pause the cyclic garbage collector while a program is built, read or validated, and restore it as it was.

    A state dict's program is hundreds of thousands of steps, transfers and tuples that form no cycles (reference
    counting frees them). Each still counts towards the collector's thresholds, and the full passes that the
    growing heap sets off visit every live object again: a third of planning the 1,001-tensor state dict of
    bench/plan_quality.py, and a third of validating the 61-layer Kimi-K2-like one. Mercurial pauses the collector
    around building large containers for the same reason.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if not gc.get_freeze_count():
                # Everything made meanwhile is still the youngest generation: the first allocation after enable()
                # would visit all of it (0.15 s for that state dict). Freezing and unfreezing moves it to the
                # oldest generation without a visit; the next full pass, when the heap has grown enough, sees it.
                # (Skipped where the application froze objects itself: unfreeze would undo that.)
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _is_move(s: Step) -> bool:
    return s.kind == MOVE


def _is_src_move(s: Step) -> bool:
    return s.kind == MOVE and s.role == SRC


class _Ancestors:
    """Which steps are ancestors of which: `has` answers "is step ``j`` an ancestor of step ``i``" for `_validate`.

    A bit set per step grows with the square of the steps where moves wait for compute steps (issue 41: 1.75 GiB
    for a quantized two-layer MoE program), so a set is kept only for the steps others wait for, made when a check
    first needs it, and relative to its lowest member (bit ``k``: step ``lo + k``): a planner lists a tensor's
    steps together, so a set spans one tensor's steps, not the program's. Any other step's set is the union of its
    dependencies', made when a check asks about it; the last one made is kept, as the checks ask about one step
    many times in a row.
    """

    __slots__ = ("_steps", "_kept", "_last", "_last_set")

    def __init__(self, steps: Sequence[Step]):
        self._steps = steps
        # (lo, bits) per step others wait for, made when a check first needs it: a state dict's checks ask about a
        # few template tensors' steps among millions (`Program._repeated`)
        self._kept: dict[int, tuple[int, int]] = {}
        self._last, self._last_set = -1, (0, 0)

    def _keep(self, after: Sequence[int]) -> None:
        """Make the kept sets of the steps in ``after`` and of their ancestors, those others wait for first."""
        kept, steps = self._kept, self._steps
        stack = [a for a in after if a not in kept]
        while stack:
            top = stack[-1]
            if top in kept:
                stack.pop()
                continue
            missing = [b for b in steps[top].after if b not in kept]
            if missing:
                stack += missing
            else:
                kept[top] = self._union(steps[top].after)
                stack.pop()

    def _union(self, after: Sequence[int]) -> tuple[int, int]:
        """(lo, bits) of the steps in ``after`` and their ancestors (from the kept sets of those steps, made)."""
        if not after:
            return 0, 0
        kept = self._kept
        if len(after) == 1:  # most moves that wait: for the step that made their box
            a = after[0]
            lo, bits = kept[a]
            return (lo, bits | 1 << (a - lo)) if bits else (a, 1)
        lo = min(min(after), min((kept[a][0] for a in after if kept[a][1]), default=len(self._steps)))
        bits = 0
        for a in after:
            bits |= 1 << (a - lo)
            lo_a, bits_a = kept[a]
            if bits_a:
                bits |= bits_a << (lo_a - lo)
        return lo, bits

    def of(self, i: int) -> tuple[int, int]:
        """(lo, bits) of step ``i``'s ancestors: bit ``k`` set when step ``lo + k`` is one."""
        got = self._kept.get(i)
        if got is not None:
            return got
        if i != self._last:
            after = self._steps[i].after
            self._keep(after)
            self._last, self._last_set = i, self._union(after)
        return self._last_set

    def has(self, i: int, j: int) -> bool:
        lo, bits = self.of(i)
        return j >= lo and bool(bits >> (j - lo) & 1)


class _LinkClock:
    """When each link is done with the moves of the depths priced so far, so that moves of a later depth that start
    while it still carries earlier ones wait for it (`Program.estimate`).

    The moves of one depth run as one fluid round; depths may overlap in time (the fp8 moves of a quantized weight
    start when its quantize step ends, while other tensors' first moves still run), and two rounds that overlap on
    a link share it: a link carries a depth's bytes after those of the depths before it. A round ends when its
    slowest link does, so it never ends before its own load alone allows, and no link carries more than its
    bandwidth: the estimate is at least what all the moves' loads take together. Where each depth starts after
    the moves of the depths before it end (every program of moves alone, and one depth without waits) no link is
    still busy, and each round costs what `PhaseLoad.seconds` says, to the bit.
    """

    __slots__ = ("_topology", "_hosts", "_free")

    def __init__(self, topology: Topology, hosts: HostCache):
        self._topology, self._hosts = topology, hosts
        self._free: dict[str, float] = {}

    def run(self, load: PhaseLoad, start: float, seconds: float, what: str) -> tuple[float, str]:
        """The end of ``load``'s round that starts at ``start`` and takes ``seconds`` (its busiest link ``what``)
        on links of its own, and that link; later rounds see its links busy until their own bytes are through."""
        end, free, topo, hosts = start + seconds, self._free, self._topology, self._hosts
        nic = topo.nic_bytes_per_s

        def intra(device: str) -> float:
            return topo.intra_bytes_per_s(hosts[device])

        for name, by_node, rate in (("NIC send of ", load.send, nic), ("NIC receive of ", load.recv, nic),
                                    ("intra-host link in of ", load.dev_in, intra),
                                    ("intra-host link out of ", load.dev_out, intra)):
            for node, nbytes in by_node.items():
                link = name + node
                busy = free.get(link, 0.0)
                # The division is `PhaseLoad.seconds`' own: the same floats, so an idle link changes nothing.
                secs = nbytes / rate(node)
                if busy > start:
                    free[link] = busy + secs
                    if busy + secs > end:
                        end, what = busy + secs, f"{link}, shared with moves of earlier depths"
                else:
                    free[link] = start + secs
        return end, what


@dataclass(frozen=True)
class Program(ContentAddressed):
    """Steps over named tensors; see the module's table for what each field means.

    ``einsum_layout`` is the op's layout (a `reshard.einsum.Layout`) where `plan_einsum` or `plan_apply` chose
    one, and ``einsum_layout_text`` that layout as it prints: all a client's dry run is told of it. Like the
    topology they describe the program without being part of it: not in its id, its JSON or its equality, so a
    program read back from JSON has neither.
    """

    tensors: tuple[TensorDecl, ...]
    steps: Sequence[Step]  # a tuple, or `RunSteps` (a run's steps made when asked for)
    strategy: str = ""
    topology: Topology = field(default_factory=Topology, compare=False)
    einsum_layout: Optional[Layout] = field(default=None, compare=False, repr=False, kw_only=True)
    einsum_layout_text: str = field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self):
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if not isinstance(self.steps, RunSteps):  # a run's steps made when asked for (`RunSteps`)
            object.__setattr__(self, "steps", tuple(self.steps))
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise PlanValidationError(f"program tensors {names} repeat a name; each tensor needs its own name")
        if self.einsum_layout is not None:
            text = str(self.einsum_layout)
            if self.einsum_layout_text not in ("", text):
                raise PlanValidationError(f"einsum_layout_text {self.einsum_layout_text!r} is not the text of "
                                          f"einsum_layout {text!r}; give the layout alone")
            object.__setattr__(self, "einsum_layout_text", text)

    # -- tensors ------------------------------------------------------------------------------

    @cached_property
    def _by_name(self) -> dict[str, TensorDecl]:
        return {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorDecl:
        decl = self._by_name.get(name)
        if decl is not None:
            return decl
        raise PlanValidationError(
            f"tensor {name!r} is not declared by the program; it declares {[t.name for t in self.tensors]}"
        )

    @cached_property
    def num_sources(self) -> int:
        """How many of its tensors have a source (are read from stored shards, not made by its steps)."""
        return sum(t.src is not None for t in self.tensors)

    @property
    def is_reshard(self) -> bool:
        """One tensor, with a source and a destination sharding: what `from_plan` makes."""
        return len(self.tensors) == 1 and self.tensors[0].is_reshard

    def _only(self) -> TensorDecl:
        if not self.is_reshard:
            raise PlanValidationError(
                f"shape, dtype, src and dst name the one tensor of a reshard program, but this program declares "
                f"{[t.name for t in self.tensors]}; use program.tensor(name)"
            )
        return self.tensors[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._only().shape

    @property
    def dtype(self) -> str:
        return self._only().dtype

    @property
    def itemsize(self) -> int:
        return self._only().itemsize

    @property
    def src(self) -> Sharding:
        return self._only().src

    @property
    def dst(self) -> Sharding:
        return self._only().dst

    # -- the dependency graph -------------------------------------------------------------------

    @cached_property
    def _ancestors(self) -> _Ancestors:
        """Which steps are ancestors of which (`_Ancestors.has`)."""
        self._check_graph()
        return _Ancestors(self.steps)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Per step, its depth: 0 without dependencies, else one more than its deepest dependency."""
        return tuple(self._depth_column.tolist())

    @cached_property
    def _depth_column(self) -> np.ndarray:
        """`depths` as an int64 column. A run's steps (`_repeated`) are at its template's depths."""
        self._check_graph()
        out = np.zeros(len(self.steps), dtype=np.int64)
        repeated = self._repeated
        steps = self.steps if repeated is None else list(map(self.steps.__getitem__, np.flatnonzero(~repeated)))
        # only the steps that wait (a state dict's plain moves, most of its steps, wait for nothing); outside the
        # runs, none waits for a step in one
        for s in compress(steps, map(bool, map(_step_after, steps))):
            out[s.id] = 1 + max(out[list(s.after)])
        self._copy_runs(out)
        return out

    @property
    def depth_column(self) -> np.ndarray:
        """`depths` as a read-only int64 numpy column."""
        view = self._depth_column.view()
        view.flags.writeable = False
        return view

    @cached_property
    def moves_only(self) -> bool:
        """Whether every step is a move that waits for nothing (an agent then copies the held parts of its tiles
        beside the streams)."""
        return bool(self.step_column(lambda s: s.kind == MOVE and not s.after).all())

    @property
    def runs(self) -> tuple[Run, ...]:
        """The runs (`Run`) whose steps repeat earlier steps, in step order, as the text writes them; none where
        the program has none (or its runs are not read as runs, `_repeated`)."""
        return tuple(self._ordered_runs())

    def _ordered_runs(self) -> list[Run]:
        """The runs `_repeated` stands for, in step order (a run's template before it), or none."""
        return sorted(self.__dict__["_runs"]) if self._repeated is not None else []

    def _copy_runs(self, column: np.ndarray) -> None:
        """Fill each run's rows of a per-step ``column`` from its template's rows (the rows of the steps outside
        runs that `_template_index` names), in one gather."""
        if self._repeated is not None:
            column[...] = column[self._template_index]

    @cached_property
    def _columns(self) -> tuple[list[str], list[str], list[Optional[str]]]:
        """Every step's kind, tensor and role, as three lists in step order (what `_validate` and `_read_back`
        both go through)."""
        steps = self.steps
        if self._repeated is None:
            return list(map(_step_kind, steps)), list(map(_step_tensor, steps)), list(map(_step_role, steps))
        # A run's steps are its template's renamed (`_repeated`): its columns are the template's, its tensors renamed.
        kinds, tensors, roles = [None] * len(steps), [None] * len(steps), [None] * len(steps)
        at, runs = 0, self._ordered_runs()
        for first, count, like, renames in (*runs, (len(steps), 0, 0, ())):
            if at < first:
                part = steps[at:first]
                kinds[at:first], tensors[at:first] = map(_step_kind, part), map(_step_tensor, part)
                roles[at:first] = map(_step_role, part)
            if count:
                kinds[first:first + count] = kinds[like:like + count]
                roles[first:first + count] = roles[like:like + count]
                get = Renamed(renames).__getitem__
                tensors[first:first + count] = map(get, tensors[like:like + count])
            at = first + count
        return kinds, tensors, roles

    def step_column(self, of: Callable[[Step], object], dtype=bool) -> np.ndarray:
        """``of`` each step, as a numpy column of ``dtype``: asked of the steps outside runs, a run's copied from
        its template's (`_repeated`), so ``of`` must give a run's step what it gives its template's (a value of
        its transfer, kind or devices, not of its id or tensors)."""
        steps, repeated = self.steps, self._repeated
        if repeated is None:
            return np.fromiter(map(of, steps), dtype=dtype, count=len(steps))
        out = np.zeros(len(steps), dtype=dtype)
        at = np.flatnonzero(~repeated)
        out[at] = np.fromiter(map(of, map(steps.__getitem__, at)), dtype=dtype, count=len(at))
        self._copy_runs(out)
        return out

    @cached_property
    def _template_index(self) -> np.ndarray:
        """Per step, the step outside runs it repeats (`_repeated`; itself for a step outside runs), as an int64
        column: a run's step moves its template's very transfer (`StepsLike` shares it)."""
        out = np.arange(len(self.steps), dtype=np.int64)
        runs = self._ordered_runs()
        if runs:
            first, count, like = (np.fromiter((r[k] for r in runs), dtype=np.int64, count=len(runs)) for k in range(3))
            # every run's rows at once: row first + j of a run is its template's like + j
            rows = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
            out[rows] -= np.repeat(first - like, count)
            while self._repeated[out].any():  # a template inside an earlier run: follow it to the steps outside runs
                out = out[out]
        return out

    def transfers_of(self, ids: Sequence[int] | np.ndarray) -> list[Transfer]:
        """The transfers of the move steps ``ids``, read from the steps outside runs (a run's step's is its
        template's), so that a program's runs (`RunSteps`) are not made to be read."""
        at = np.asarray(ids, dtype=np.int64)
        steps = self.steps
        if self._repeated is not None:
            at = self._template_index[at]
            steps = steps.items if isinstance(steps, RunSteps) else steps  # the steps outside runs are all made
        return list(map(_step_transfer, map(steps.__getitem__, at.tolist())))

    def moves_at(self, ids: Sequence[int]) -> list["MoveView"]:
        """The move steps ``ids`` as `MoveView`s, read as columns where they are in runs (a run's step is its
        template's, renamed and shifted), so that a host's buckets do not make the runs they draw from."""
        steps, repeated = self.steps, self._repeated
        if repeated is None or not isinstance(steps, RunSteps):
            return [MoveView(s.id, s.tensor, s.transfer, s.after, s.role) for s in map(steps.__getitem__, ids)]
        items, tensors, like = steps.items, self._columns[1], self._template_index
        out = []
        for i in ids:
            s = items[i]
            if s is None:
                s, shift = items[like[i]], i - int(like[i])
                out.append(MoveView(i, tensors[i], s.transfer, tuple([a + shift for a in s.after]), s.role))
            else:
                out.append(MoveView(s.id, s.tensor, s.transfer, s.after, s.role))
        return out

    def moves(self) -> tuple[np.ndarray, list[Transfer], list[str], list[int]]:
        """The move steps' ids, transfers, tensors and their tensors' item sizes, in step order, read as columns
        (`transfers_of`): a planner asks this of every program it runs, and a state dict's runs need not be made
        for it. Raises `PlanValidationError` for a move of a tensor the program does not declare."""
        kinds, tensors, _ = self._columns
        at = np.flatnonzero(np.fromiter(map(MOVE.__eq__, kinds), dtype=bool, count=len(kinds)))
        moved = list(map(tensors.__getitem__, at.tolist()))
        itemsizes = {t.name: t.itemsize for t in self.tensors}
        return at, self.transfers_of(at), moved, [itemsizes.get(t) or self.tensor(t).itemsize for t in moved]

    def step_kinds(self) -> set[str]:
        """The kinds of step the program holds."""
        return set(self._columns[0])

    def hosts(self) -> set[str]:
        """Every host a step takes part in (`Step.participants`; a run's steps' are their templates')."""
        repeated = self._repeated
        steps = self.steps if repeated is None else map(self.steps.__getitem__, np.flatnonzero(~repeated).tolist())
        return set(map(host_of, set(chain.from_iterable(map(Step.participants, steps)))))

    @cached_property
    def _src_moves(self) -> np.ndarray:
        """Per step, whether it is a move that reads what a plan's move reads (role ``src``), as a bool column."""
        return self.step_column(_is_src_move)

    @cached_property
    def _link_ids(self) -> np.ndarray:
        """Per step, the ids of its transfer's sender, receivers, method and route objects (`delivery.link_ids`;
        a row of -1 for a step that is not a move): numbered once for the delivery proof and the buckets' check."""
        is_move = self.step_column(_is_move)
        out = np.full((len(is_move), 4), -1, dtype=np.int64)
        repeated = self._repeated
        if repeated is not None:  # a run's moves share its template's transfers: their rows are the template's
            is_move &= ~repeated
        out[is_move] = link_ids(map(_step_transfer, map(self.steps.__getitem__, np.flatnonzero(is_move))))
        self._copy_runs(out)
        return out

    def _check_graph(self) -> None:
        """Ids are positions; every ``after`` names an existing, earlier step; no cycle. Checked once: `_ancestors`
        and `depths` both ask."""
        if self.__dict__.get("_graph_checked"):
            return
        n = len(self.steps)
        if self._graph_columns_ok(n, self._repeated):
            object.__setattr__(self, "_graph_checked", True)
            return
        for i, s in enumerate(self.steps):
            if s.id != i:
                raise PlanValidationError(
                    f"step {s} is listed at position {i}; a step's id is its position in the program, so renumber "
                    f"the steps 0..{n - 1} in order"
                )
            unknown = [a for a in s.after if not 0 <= a < n]
            if unknown:
                raise PlanValidationError(
                    f"step {s} depends on {unknown}, which are not steps of this program (ids 0..{n - 1})"
                )
        # Steps that depend on earlier steps only cannot form a cycle: the search runs only when one does not.
        if any(s.after and max(s.after) >= s.id for s in self.steps):
            cycle = self._find_cycle()
            if cycle:
                raise PlanValidationError(
                    f"steps depend on each other in a cycle {' -> '.join(map(str, cycle))}, so none of them could "
                    f"start; break the cycle by removing one of those dependencies"
                )
            for s in self.steps:
                later = [a for a in s.after if a >= s.id]
                if later:
                    raise PlanValidationError(
                        f"step {s} depends on the later steps {later}; list every step after the steps it depends on"
                    )
        object.__setattr__(self, "_graph_checked", True)  # not a field, as ``_valid``

    def _graph_columns_ok(self, n: int, repeated: Optional[np.ndarray] = None) -> bool:
        """Whether every id is its position and every ``after`` an earlier step, checked as columns (a state dict's
        hundreds of thousands of steps); False leaves the verdict, and the message, to `_check_graph`'s loop. The
        steps of runs (``repeated``) are their templates' shifted, which keeps both rules: only the others are
        read."""
        at = np.arange(n) if repeated is None else np.flatnonzero(~repeated)
        steps = self.steps if repeated is None else list(map(self.steps.__getitem__, at))
        try:
            ids = np.fromiter(map(_step_id, steps), dtype=np.int64, count=len(at))
            afters = list(map(_step_after, steps))
            lens = np.fromiter(map(len, afters), dtype=np.int64, count=len(at))
            flat = np.fromiter(chain.from_iterable(afters), dtype=np.int64, count=int(lens.sum()))
        except (TypeError, ValueError, OverflowError):
            return False
        return bool((ids == at).all() and (flat >= 0).all() and (flat < np.repeat(at, lens)).all())

    def _find_cycle(self) -> list[int]:
        state = [0] * len(self.steps)  # 0 unseen, 1 on the current path, 2 done
        for root in range(len(self.steps)):
            if state[root]:
                continue
            path, stack = [], [(root, iter(self.steps[root].after))]
            state[root] = 1
            path.append(root)
            while stack:
                node, deps = stack[-1]
                nxt = next(deps, None)
                if nxt is None:
                    state[node] = 2
                    path.pop()
                    stack.pop()
                elif state[nxt] == 1:
                    return path[path.index(nxt):] + [nxt]
                elif state[nxt] == 0:
                    state[nxt] = 1
                    path.append(nxt)
                    stack.append((nxt, iter(self.steps[nxt].after)))
        return []

    # -- plans ------------------------------------------------------------------------------------

    @classmethod
    def from_plan(cls, plan: Plan) -> "Program":
        """One move step per transfer, step id = transfer index.

        A step waits for the steps of earlier phases that deliver part of its box
        to its sender: the dependency graph replaces the phase barrier.
        """
        decl = TensorDecl(RESHARD_TENSOR, plan.shape, plan.dtype, plan.src, plan.dst)
        return cls((decl,), tuple(move_steps(plan.transfers)), plan.strategy, plan.topology)

    def to_plan(self) -> Plan:
        """The plan of a move-only reshard program; a transfer's phase is its step's depth."""
        decl = self._only()
        others = sorted({s.kind for s in self.steps} - {MOVE})
        if others:
            raise PlanValidationError(f"only a program of moves is a plan; this one has {others} steps")
        depths = self.depths
        transfers = tuple(replace(s.transfer, phase=depths[s.id]) for s in self.steps)
        return Plan(decl.shape, decl.dtype, decl.src, decl.dst, self.strategy, transfers, self.topology)

    # -- identity and serialisation -------------------------------------------------------------------

    def _canonical(self) -> dict:
        return {
            "kind": "program",
            "version": PROGRAM_VERSION,
            "strategy": self.strategy,
            "tensors": [t.to_json() for t in self.tensors],
            "steps": [s.to_json() for s in self.steps],
        }

    def _extras(self) -> dict:
        return {"estimate_seconds": self.estimate_seconds, "topology": self.topology.to_json()}

    def _json_fields(self, canonical: bool) -> dict[str, Iterable[str]]:
        """`_canonical`'s fields in its order, each value as chunks of its JSON text: plain, or ``canonical``
        (keys sorted, no spaces). `dumps` and `id` write these instead of `_canonical`'s dicts, byte for byte
        the same text, five times faster on a state dict's program."""
        enc = canonical_text if canonical else plain_text
        # the id's text of a program with runs: each run's steps from its template's text (`_RunText`)
        steps = (_run_step_chunks(self.steps, self._ordered_runs()) if canonical and self._repeated is not None
                 else _step_chunks(self.steps, canonical))
        return {"kind": (enc("program"),), "version": (enc(PROGRAM_VERSION),), "strategy": (enc(self.strategy),),
                "tensors": _tensor_chunks(self.tensors, canonical), "steps": steps}

    @cached_property
    def id(self) -> str:
        """sha256 of the canonical JSON, hashed a chunk at a time as `_json_fields` writes it: the text of a
        million steps is never held whole."""
        digest = hashlib.sha256()
        with no_cycle_collection():
            for chunk in _json_text_chunks(self._json_fields(canonical=True), canonical=True):
                digest.update(chunk.encode())
        return digest.hexdigest()

    @classmethod
    def from_json(cls, data, check_id: bool = True) -> "Program":
        """Read program JSON, or plan JSON v1 (what `Plan.to_json` writes), which becomes `from_plan` of it; text
        as `Plan.from_json` reads it. The id the JSON claims is checked against its content unless ``check_id`` is
        False (a reader that trusts the text already: an agent, whose planner signed it)."""
        if isinstance(data, (str, bytes, bytearray)):
            data = loads(data, "program JSON", max_bytes=None)
        E = PlanValidationError
        need(data, "object", "program JSON", E)
        if data.get("kind") != "program":
            if "transfers" in data and "steps" not in data:
                return cls.from_plan(Plan.from_json(data))
            raise E(f"JSON with kind {brief(data.get('kind'))} and fields {brief(sorted(map(str, data)))} is neither "
                    f"a program (kind 'program', with steps) nor a plan (with transfers)")
        return cls._read(data, check_id)

    @classmethod
    def _read(cls, data: Mapping, check_id: bool, **fields) -> "Program":
        """A program of kind ``program`` from its JSON object, with a subclass's own ``fields`` (read by it);
        its claimed id checked unless ``check_id`` is False."""
        E = PlanValidationError
        check_version(data, "program", PROGRAM_VERSION)
        seen: dict = {}  # each distinct sharding read once (`TensorDecl.from_json`)
        tensors = tuple(read_tensors(data, seen))  # written whole, or by layout (the compact text)
        with no_cycle_collection():
            steps, runs = _read_steps(data, tensors)  # written whole, or as runs of earlier steps (the compact text)
        program = cls(
            tensors=tensors,
            steps=steps,
            strategy=field_of(data, "strategy", "string", "program JSON", E, default=""),
            topology=Topology.from_json(field_of(data, "topology", "object", "program JSON", E, default={})),
            **fields,
        )._with_runs(runs)
        return check_claimed_id(data, program, "program") if check_id else program

    # -- validation ---------------------------------------------------------------------------------

    def validate(self) -> "Program":
        """Prove the program can run and delivers what it promises.

        The graph: ids are positions, dependencies are earlier steps, no cycle.
        Moves: the rules of `Plan.validate`, where a sender must hold its box
        from its source tile or from an ancestor, in the role it reads; a
        reshard tensor's moves give every destination tile exactly its
        elements; addends move only into the same pending sum, and the part of
        a destination tile that a device held as addends is written by a step
        with completed sums. Compute: a known kernel,
        boxes inside their tensors, shapes by the kernel's rule, inputs held.
        Reduce: a known op, result and algorithm, distinct devices, a non-empty
        box that every member holds. Raises `PlanValidationError` naming the
        first problem and its step; returns the program. A program is
        immutable, so one that passed is not checked again (a planner runs a
        pipeline's cached programs every microbatch).
        """
        if self.__dict__.get("_valid"):
            return self
        with no_cycle_collection():
            self._validate()
        object.__setattr__(self, "_valid", True)  # not a field: equality, hashing and repr ignore it
        return self

    def dumps(self) -> str:
        """The program's JSON, written out once (a program is immutable): ``json.dumps(self.to_json())``'s text,
        or, for a program made with runs of steps that repeat others (`_with_runs`), its compact text (see `Run`),
        which `from_json` reads back into the same program."""
        text = self.__dict__.get("_text")
        if text is None:
            # What ``json.dumps(self.to_json())`` writes: the canonical fields, the extras, then the id.
            ident = self.id
            fields = self._json_fields(canonical=False)
            runs = self.__dict__.get("_runs")
            if runs:  # the compact text (see `Run`): layouts before the tensors that name them
                compact = _compact_fields(self.tensors, self.steps, runs)
                fields = {k: v for key, value in fields.items()
                          for k, v in ((("layouts", compact["layouts"]),) if key == "tensors" else ())
                          + ((key, compact.get(key, value)),)}
            fields.update((key, (plain_text(value),)) for key, value in self._extras().items())
            fields["id"] = (plain_text(ident),)
            with no_cycle_collection():
                text = "".join(_json_text_chunks(fields, canonical=False))
            object.__setattr__(self, "_text", text)
        return text

    def _with_runs(self, runs: Sequence[Run]) -> "Program":
        """This program, whose text (`dumps`) writes ``runs`` as runs of the steps they repeat (see `Run`), and
        whose checks, id, estimate and columns read a run's template for it (`_repeated`). The caller guarantees
        each run is that (`reshard.plan_many` builds them so, and the text's reader makes them so): nothing here
        checks it, and a reader of the text that trusts its claimed id (an agent) would not either. Returns
        self."""
        object.__setattr__(self, "_runs", tuple(runs))  # not a field: equality, hashing and repr ignore it
        for worked_out in ("_repeated", "_columns", "_src_moves", "_link_ids", "_depth_column", "_template_index",
                           "_text"):
            self.__dict__.pop(worked_out, None)  # what the runs change how it is worked out, if it was already
        return self

    def _validate(self) -> None:
        # The graph's rules now; its ancestor sets (`_ancestors`) only where a check reads what earlier steps wrote
        # (a state dict's moves read their source tiles only, and 400,000 steps' sets take a quarter second).
        self._check_graph()
        hosts = HostCache()
        produced: dict[tuple[str, str], list[tuple[int, str, Box]]] = defaultdict(list)
        # A state dict repeats a few layouts over many tensors: each (sharding, shape) pair's tiles are made once.
        layouts: dict[tuple, dict[str, Box]] = {}
        src_tiles = {}
        for t in self.tensors:
            if t.src is not None:
                tiles = layouts.get((t.src, t.shape))
                if tiles is None:
                    tiles = layouts[(t.src, t.shape)] = t.src.tiles(t.shape)
                src_tiles[t.name] = tiles
        by_name = self._by_name
        # Steps that repeat others (runs, see `Run`): the steps they repeat stand for their checks (`_repeated`).
        repeated = self._repeated
        reshard = [t for t in self.tensors if t.is_reshard]
        position = {t.name: k for k, t in enumerate(reshard)}
        # Every move of a reshard tensor, as columns for `delivered`: its tensor's position in ``reshard``, its step.
        move_tensor: list[int] = []
        move_step: list[int] = []
        other_role: list[Step] = []  # reshard moves that read a role other than the source tile, checked last
        addends = {t.name for t in self.tensors if t.src is not None and t.src.is_partial}
        addend_coords: dict[str, dict[str, tuple[int, ...]]] = {}
        read_back = self._read_back(repeated)

        def holds(i: int, device: str, tensor: str, role: Optional[str], box: Box) -> bool:
            if not boxes.volume(box):
                return True
            tile = src_tiles.get(tensor, {}).get(device)
            if role in (None, SRC) and tile is not None and boxes.contains(tile, box):
                return True
            pieces = []
            found = produced.get((device, tensor), ())
            if found:
                lo, bits = self._ancestors.of(i)
                for j, r, b in found:
                    if role in (None, r) and j >= lo and bits >> (j - lo) & 1:
                        if boxes.contains(b, box):
                            return True
                        pieces.append(b)
            # Several boxes together (the moved pieces of a tile): the runtime assembles them.
            return not boxes.uncovered(box, pieces + ([tile] if role in (None, SRC) and tile is not None else []))

        # The usual move (a state dict's are all of this kind): a reshard tensor's, from its source tile, of a
        # tensor no check reads back and no addend. Nothing below reads what such a move writes (`holds` looks only
        # at ``read_back``'s tensors), so these are only listed, in one pass; every other step is checked in order.
        plain = {t.name for t in reshard if t.name not in addends and t.name not in read_back}
        steps = self.steps
        kinds, tensors, roles = self._columns
        is_plain = self._src_moves & np.fromiter(map(plain.__contains__, tensors), dtype=bool, count=len(steps))
        move_step += np.flatnonzero(is_plain).tolist()
        move_tensor += map(position.__getitem__, map(tensors.__getitem__, move_step))
        listed = len(move_step)
        checked = ~is_plain
        if repeated is not None:
            # A repeated step's checks are its template's; its reshard moves still count for the delivery proof.
            for i in np.flatnonzero(repeated & checked).tolist():
                k = position.get(tensors[i])  # a reshard tensor's
                if k is not None and kinds[i] == MOVE:
                    move_tensor.append(k)
                    move_step.append(i)
            checked &= ~repeated
        for s in map(steps.__getitem__, np.flatnonzero(checked).tolist()):
            if s.kind == MOVE:
                decl = by_name.get(s.tensor)
                if decl is None:
                    decl = self._declared(_StepWhere(s), s.tensor)
                if decl.is_reshard:
                    move_tensor.append(position[decl.name])
                    move_step.append(s.id)
                    if s.role != SRC:
                        other_role.append(s)
                else:
                    self._check_free_move(_StepWhere(s), s, decl, hosts, holds)
                if decl.name in addends:
                    self._check_addends(_StepWhere(s), s, decl, addend_coords)
            elif s.kind == COMPUTE:
                self._check_compute(_StepWhere(s), s, hosts, holds)
            else:
                self._check_reduce(_StepWhere(s), s, hosts, holds)
            if s.kind != MOVE or s.tensor in read_back:
                for dev, tensor, role, b in s.produces():
                    if tensor in read_back:
                        produced[(dev, tensor)].append((s.id, role, b))
        if listed < len(move_step):  # moves listed above and in the loop: in step order, as one pass lists them
            move_step, move_tensor = (list(c) for c in zip(*sorted(zip(move_step, move_tensor))))
        transfers = self.transfers_of(move_step)
        proven = delivered_by_pattern(reshard, move_tensor, transfers, METHODS, hosts,
                                      link_ids=self._link_ids[np.asarray(move_step, dtype=np.int64)])
        # What the columns did not prove, check_delivery proves or names the first problem of, tensor by tensor.
        reshard_moves: dict[str, list[tuple[int, Transfer]]] = defaultdict(list)
        if not proven.all():
            for k, i in zip(move_tensor, move_step):
                if not proven[k]:
                    reshard_moves[reshard[k].name].append((i, steps[i].transfer))
        for k, decl in enumerate(reshard):
            if not proven[k]:
                check_delivery(
                    decl.shape, decl.src, decl.dst, reshard_moves.get(decl.name, []),
                    before=self._ancestors.has,
                    where=lambda i, t: _StepWhere(self.steps[i]),
                    when=lambda i, t: _when(self.steps[i]),
                    hosts=hosts,
                )
            self._check_summed_tiles(decl, produced)
        for s in other_role:
            # A reshard tensor's senders were checked as a plan's, from the source tile or deliveries; one that
            # reads another role must hold the box in that role.
            self._check_held(_StepWhere(s), s, s.transfer.sender, TileRef(s.tensor, s.role, s.transfer.box), holds)

    def _read_back(self, repeated: Optional[np.ndarray] = None) -> set[str]:
        """The tensors whose written boxes a check looks up (`_validate`'s ``holds``, `_check_summed_tiles`):
        those a step reads other than as a reshard's move from its source tiles, and the sums of Partial ones.
        A state dict's moves are all of that one kind, which `check_delivery` proves on its own; indexing every
        box each of them writes was a fifth of validating one. Steps marked ``repeated`` are not checked, so what
        they read is not looked up."""
        by_name = {t.name: t for t in self.tensors}
        out = {t.name for t in self.tensors if t.src is not None and t.src.is_partial}
        kinds, tensors, roles = self._columns
        src_moves, steps = self._src_moves, self.steps
        if repeated is not None:
            at = np.flatnonzero(~repeated)
            kinds, tensors = list(map(kinds.__getitem__, at)), list(map(tensors.__getitem__, at))
            src_moves, steps = src_moves[at], list(map(steps.__getitem__, at))
        # each distinct tensor once: a state dict's steps repeat each a few times
        for tensor in set(compress(tensors, src_moves)):
            decl = by_name.get(tensor)
            if decl is None or not decl.is_reshard:
                out.add(tensor)
        out.update(compress(tensors, map(and_, map(MOVE.__eq__, kinds), map(not_, src_moves))))  # other roles
        for s in compress(steps, map(MOVE.__ne__, kinds)):
            out.update(r.tensor for r in s.inputs)
        return out

    @cached_property
    def _repeated(self) -> Optional[np.ndarray]:
        """Per step, whether a run (`Run`, `_with_runs`) repeats it from a template whose checks stand for its own,
        as a bool column; None where the program has no runs, or where a condition below fails (then every step
        is checked, as without runs).

        A run's steps are its template's (steps written before it), their ids and ``after`` shifted and the tensors
        they name renamed: where each renamed tensor is declared as the one it replaces (shape, dtype, shardings),
        the template's steps wait only for one another, and no addends are named (their sums are checked from what
        every step writes), each step of the run passes `_validate`'s checks of one step if the template's did:
        the same transfers, kernels and boxes against the same declarations, and a device holds what its template
        step's held, from the same source tiles and from the same writes by its ancestors (the template's,
        shifted). Nothing outside the runs may wait for a step in one, so what runs write is never looked up. The
        delivery proof, the buckets and the made tiles still count every step, a run's by its template's (its
        transfers, `transfers_of`; its writes, renamed), so its steps need not be made (`RunSteps`). A program
        read from text repeats its runs' templates by construction; `plan_many` builds its runs so."""
        runs = self.__dict__.get("_runs")
        if not runs:
            return None
        n = len(self.steps)
        by_name = self._by_name
        addends = {t.name for t in self.tensors if t.src is not None and t.src.is_partial}
        out = np.zeros(n, dtype=bool)
        named: dict[tuple[int, int], set[str]] = {}  # per template, the tensors its steps name
        for first, count, like, renames in runs:
            if not (0 <= like and like + count <= first and first + count <= n) or out[first:first + count].any():
                return None
            names = named.get((like, count))
            if names is None:
                template = self.steps[like:like + count]
                try:
                    if any(not like <= a < like + count for s in template for a in s.after):
                        return None
                except TypeError:  # not a step's number: `_check_graph` names it
                    return None
                names = named[like, count] = {t for s in template for t in s.named()}
            rename = dict(renames)
            for was, now in renames:
                a, b = by_name.get(was), by_name.get(now)
                if a is None or b is None or (a.shape, a.dtype, a.src, a.dst) != (b.shape, b.dtype, b.src, b.dst):
                    return None
            if addends and any(rename.get(t, t) in addends for t in names):
                return None
            out[first:first + count] = True
        try:
            for s in map(self.steps.__getitem__, np.flatnonzero(~out)):
                if s.after and out[list(s.after)].any():
                    return None
        except (IndexError, TypeError, ValueError):  # an ``after`` that is no step: `_check_graph` names it
            return None
        return out

    def _declared(self, where, name: str) -> TensorDecl:
        try:
            return self.tensor(name)
        except PlanValidationError as e:
            raise PlanValidationError(f"{where}: {e}") from None

    def _check_ref(self, where, ref: TileRef, what: str) -> TensorDecl:
        decl = self._declared(where, ref.tensor)
        full = tuple((0, n) for n in decl.shape)
        if len(ref.box) != len(decl.shape) or any(lo > hi for lo, hi in ref.box) or not boxes.contains(full, ref.box):
            raise PlanValidationError(
                f"{where}: {what} {ref} is not a box of tensor {decl.name!r} of shape {decl.shape}; a box has one "
                f"(lo, hi) per dim with 0 <= lo <= hi <= size"
            )
        return decl

    @staticmethod
    def _check_device(where, device: str) -> str:
        try:
            return host_of(device)
        except InvalidMeshError as e:
            raise PlanValidationError(f"{where}: {e}") from None

    @staticmethod
    def _check_held(where, s: Step, device: str, ref: TileRef, holds, any_role: bool = False) -> None:
        if not holds(s.id, device, ref.tensor, None if any_role else ref.role, ref.box):
            what = f"box {boxes.box_str(ref.box)} of {ref.tensor!r}" if any_role else str(ref)
            raise PlanValidationError(
                f"{where}: device {device} does not hold {what} {_when(s)}; its source tile (role 'src') and the "
                f"boxes that steps it depends on, directly or not, write there must together cover it"
            )

    def _check_free_move(self, where, s: Step, decl: TensorDecl, hosts: HostCache, holds) -> None:
        """A move of a tensor without both shardings: the transfer's own rules, and a sender that holds its box."""
        t = s.transfer
        check_transfer(where, t, decl.shape, hosts)
        for d in (t.sender, *t.receivers):
            self._check_device(where, d)
        self._check_held(where, s, t.sender, TileRef(decl.name, s.role, t.box), holds, any_role=s.role == SRC)

    @staticmethod
    def _check_addends(where, s: Step, decl: TensorDecl, coords: dict[str, dict[str, tuple[int, ...]]]) -> None:
        """A move that reads a Partial tensor's ``src`` moves addends: only into the same pending sum (a
        destination partial over the same axes of the same mesh), between devices at the same coordinates along
        those axes, whose addends add up to one value."""
        src, dst, t = decl.src, decl.dst, s.transfer
        if s.role != SRC or src is None or not src.is_partial:
            return
        if dst is None or dst.mesh != src.mesh or set(dst.partial) != set(src.partial):
            into = f"its destination {dst} is not that pending sum" if dst is not None else \
                "the tensor has no destination sharding"
            raise PlanValidationError(
                f"{where}: it reads role 'src' of {decl.name!r}, which holds addends of {src}, but {into}; addends "
                f"move as they are only into a destination partial over {list(src.partial)} on the same mesh, so "
                f"reduce them first and move the role the reduce writes (Step.move(..., role='reduced'))"
            )
        at = coords.get(decl.name)
        if at is None:
            index = [src.mesh.axis_index(a) for a in src.partial]
            at = coords[decl.name] = {dev: tuple(src.mesh.coords(p)[i] for i in index)
                                      for p, dev in enumerate(src.mesh.require_devices())}
        apart = [r for r in t.receivers if r in at and t.sender in at and at[r] != at[t.sender]]
        if apart:
            raise PlanValidationError(
                f"{where}: it moves addends of {src} from {t.sender} (at {at[t.sender]} along "
                f"{list(src.partial)}) to {apart[0]} (at {at[apart[0]]}); each coordinate along the partial axes "
                f"sums its own addends, so a move of them stays at its sender's coordinate"
            )

    @staticmethod
    def _check_summed_tiles(decl: TensorDecl, produced) -> None:
        """A reshard that sums a Partial source: the part of a destination tile that its device's source tile
        holds starts as addends (the runtime stages it so), so steps must write it with completed sums."""
        src, dst = decl.src, decl.dst
        if not src.is_partial or set(dst.partial) == set(src.partial):
            return
        src_tiles = src.tiles(decl.shape)
        for dev, tile in dst.tiles(decl.shape).items():
            held = boxes.intersect(src_tiles[dev], tile) if dev in src_tiles else None
            if held is None:
                continue
            left = boxes.uncovered(held, [b for _, r, b in produced.get((dev, decl.name), ()) if r == DST])
            if left:
                raise PlanValidationError(
                    f"destination device {dev} (tile {boxes.box_str(tile)}) holds {boxes.box_str(held)} of it as "
                    f"addends of {src}, and no step writes {boxes.box_str(left[0])} of that part with the sum; "
                    f"reduce into role 'dst' there, or copy the reduced box into it"
                )

    def _check_compute(self, where, s: Step, hosts: HostCache, holds) -> None:
        kernel = KERNELS.get(s.kernel)
        if kernel is None:
            raise PlanValidationError(
                f"{where}: kernel {s.kernel!r} is not one of {sorted(KERNELS)}; use one of those or add it to "
                f"reshard.kernels.KERNELS with its shape rule"
            )
        self._check_device(where, s.device)
        if not kernel.takes(len(s.inputs)) or s.output is None:
            raise PlanValidationError(
                f"{where}: kernel {kernel.name!r} reads {kernel.arity} input tile(s) and writes one output; "
                f"the step names {len(s.inputs)} input(s) and {'an' if s.output is not None else 'no'} output"
            )
        for ref in s.inputs:
            self._check_ref(where, ref, "input")
        self._check_ref(where, s.output, "output")
        shapes = tuple(_shape(r.box) for r in s.inputs)
        try:
            want = tuple(kernel.output_shape(shapes, dict(s.params)))
        except KernelShapeError as e:
            raise PlanValidationError(f"{where}: {e}") from None
        got = _shape(s.output.box)
        if got != want:
            raise PlanValidationError(
                f"{where}: kernel {kernel.name!r} makes a tile of shape {want} from input shapes {list(shapes)}, "
                f"but the output box {boxes.box_str(s.output.box)} has shape {got}; give the output a box of "
                f"shape {want}"
            )
        for ref in s.inputs:
            self._check_held(where, s, s.device, ref, holds)

    def _check_reduce(self, where, s: Step, hosts: HostCache, holds) -> None:
        for name, value, valid in (("op", s.op, REDUCE_OPS), ("result", s.result, REDUCE_RESULTS),
                                   ("algorithm", s.algorithm, REDUCE_ALGORITHMS)):
            if value not in valid:
                raise PlanValidationError(f"{where}: {name} {value!r} is not one of {list(valid)}")
        if not s.devices:
            raise PlanValidationError(f"{where}: a reduce needs a group of at least one device")
        repeated = sorted(d for d, n in Counter(s.devices).items() if n > 1)
        if repeated:
            raise PlanValidationError(
                f"{where}: devices {list(s.devices)} name {repeated} more than once; each member of the group "
                f"holds one set of addends, so list each device once"
            )
        for d in s.devices:
            self._check_device(where, d)
        if len(s.inputs) != 1 or s.output is None:
            raise PlanValidationError(
                f"{where}: a reduce reads one input tile on every member and writes one output; the step names "
                f"{len(s.inputs)} input(s) and {'an' if s.output is not None else 'no'} output"
            )
        ref = s.inputs[0]
        self._check_ref(where, ref, "input")
        self._check_ref(where, s.output, "output")
        if not boxes.volume(ref.box):
            raise PlanValidationError(f"{where}: the reduced box {boxes.box_str(ref.box)} is empty; drop the step")
        if s.output.box != ref.box:
            raise PlanValidationError(
                f"{where}: a reduce writes the box it reduces, but the output box {boxes.box_str(s.output.box)} "
                f"differs from the input box {boxes.box_str(ref.box)}"
            )
        ndim = len(ref.box)
        if s.result == "shard" and not (isinstance(s.dim, int) and 0 <= s.dim < ndim):
            raise PlanValidationError(
                f"{where}: a reduce-scatter (result 'shard') cuts its box along a dim 0..{ndim - 1}; dim is {s.dim!r}"
            )
        if s.result == "replicate" and s.dim is not None:
            raise PlanValidationError(f"{where}: dim {s.dim} applies to result 'shard' only; leave it out")
        for d in s.devices:
            self._check_held(where, s, d, ref, holds)

    # -- cost -----------------------------------------------------------------------------------------------

    def loads(self, hosts: HostCache | None = None) -> list[PhaseLoad]:
        """Per depth with moves, the bytes each link carries (a plan's `loads`, with depth for phase)."""
        hosts = hosts if hosts is not None else HostCache()
        depths = self.depths
        levels: dict[int, PhaseLoad] = {}
        for s in self.steps:
            if s.kind == MOVE:
                load = levels.get(depths[s.id])
                if load is None:
                    load = levels[depths[s.id]] = PhaseLoad(depths[s.id])
                load.add(transfer_flows(s.transfer, self.tensor(s.tensor).itemsize, hosts))
        return [levels[d] for d in sorted(levels)]

    def _reduce_rounds(self, s: Step, hosts: HostCache):
        nbytes = boxes.volume(s.box) * self.tensor(s.inputs[0].tensor).itemsize
        return reduce_rounds(s.devices, nbytes, s.result, s.algorithm, hosts)

    def step_estimates(self, topology: Optional[Topology] = None) -> list[StepEstimate]:
        """When each step runs on the cost model (see the module docstring)."""
        topo = topology or self.topology
        hosts = HostCache()
        depths = self.depths
        loads = {load.phase: load for load in self.loads(hosts)}
        levels = {depth: load.seconds(topo, hosts) for depth, load in loads.items()}
        links = _LinkClock(topo, hosts)
        by_depth: dict[int, list[Step]] = defaultdict(list)
        for s in self.steps:
            by_depth[depths[s.id]].append(s)
        finish = [0.0] * len(self.steps)
        out: list[Optional[StepEstimate]] = [None] * len(self.steps)
        for depth in sorted(by_depth):
            steps = by_depth[depth]
            moves = [s for s in steps if s.kind == MOVE]
            if moves:
                secs, what = levels[depth]
                start = max((finish[a] for s in moves for a in s.after), default=0.0)
                end, what = links.run(loads[depth], start, secs, what)
                if end != start + secs:  # its links still carried earlier depths' moves
                    secs = end - start
                for s in moves:
                    finish[s.id] = end
                    out[s.id] = StepEstimate(s.id, MOVE, secs, start, end, what)
            for s in steps:
                if s.kind == MOVE:
                    continue
                secs, what = self._seconds(s, topo, hosts)
                start = max((finish[a] for a in s.after), default=0.0)
                finish[s.id] = start + secs
                out[s.id] = StepEstimate(s.id, s.kind, secs, start, start + secs, what)
        return out

    def _seconds(self, s: Step, topo: Topology, hosts: HostCache) -> tuple[float, str]:
        if s.kind == COMPUTE:  # a roofline: memory traffic or arithmetic, whichever takes longer
            host = hosts[s.device]
            nbytes = sum(boxes.volume(r.box) * self.tensor(r.tensor).itemsize for r in (*s.inputs, s.output))
            memory = nbytes / topo.memory_bytes_per_s(host)
            flops = KERNELS[s.kernel].flops(tuple(_shape(r.box) for r in s.inputs), dict(s.params))
            arithmetic = flops / topo.flops_per_s(host)
            if arithmetic > memory:
                return arithmetic, f"arithmetic of {s.device}"
            return memory, f"memory of {s.device}"
        total, what = 0.0, "nothing moves"
        for i, flows in enumerate(self._reduce_rounds(s, hosts)):
            load = PhaseLoad(i)
            load.add(flows)
            secs, busiest = load.seconds(topo, hosts)
            if secs > 0:
                total += secs
                what = busiest
        return total, what

    def estimate(self, topology: Optional[Topology] = None) -> float:
        """Seconds on the cost model: the longest path through the dependency graph.

        The latest finish of `step_estimates`, the same float, without a `StepEstimate` per step: a state dict's
        program has a million moves, so their loads are added up per group of like transfers (`move_phase_loads`),
        and all moves of one depth end together, so a depth's end stands for its moves'.
        """
        topo = topology or self.topology
        hosts = HostCache()
        steps, depths = self.steps, self.depths
        itemsizes = {t.name: t.itemsize for t in self.tensors}
        # The moves as columns, in step order (a run's transfers its template's, `transfers_of`); ``self.tensor``
        # raises for a tensor the program does not declare, as `step_estimates` does.
        at, transfers, _, sizes = self.moves()
        loads = move_phase_loads(zip(self._depth_column[at].tolist(), transfers, sizes), hosts)
        by_depth = {load.phase: load for load in loads}
        move_end = {load.phase: load.seconds(topo, hosts)[0] for load in loads}  # each depth's seconds, for now
        links = _LinkClock(topo, hosts)
        waits: dict[int, list[tuple[int, ...]]] = defaultdict(list)  # per depth, what its moves wait for
        others: dict[int, list[Step]] = defaultdict(list)  # per depth, its reduces and computes
        # A run's steps wait only for one another, at its template's depths, and nothing else waits for them: each
        # ends when its template's step does (the same depths' moves' ends, the same computes), so a run adds no
        # wait and no end that its template does not (`_repeated`).
        repeated = self._repeated
        timed = range(len(steps)) if repeated is None else np.flatnonzero(~repeated).tolist()
        for s, d in zip(map(steps.__getitem__, timed), map(depths.__getitem__, timed)):
            if s.kind != MOVE:
                others[d].append(s)
            elif s.after:
                waits[d].append(s.after)
        other_end: dict[int, float] = {}
        # A compute's seconds by its kernel, device, params and tiles' boxes and itemsizes: a state dict's computes
        # repeat a few hundred templates' (their box and params objects shared, which live as long as the program).
        priced: dict[tuple, float] = {}

        def seconds(s: Step) -> float:
            if s.kind != COMPUTE:
                return self._seconds(s, topo, hosts)[0]
            refs = (*s.inputs, s.output)
            key = (s.kernel, s.device, id(s.params), *map(id, map(_ref_box, refs)),
                   *(itemsizes.get(r.tensor) for r in refs))
            found = priced.get(key)
            if found is None:
                found = priced[key] = self._seconds(s, topo, hosts)[0]
            return found

        def finish(i: int) -> float:
            return other_end[i] if i in other_end else move_end[depths[i]]

        # As `step_estimates`: the moves of one depth start together, when the last step any of them waits for
        # ends; then that depth's reduces and computes, each when its own dependencies end.
        for depth in sorted(move_end.keys() | others.keys()):
            if depth in move_end:
                start = max((finish(a) for after in waits.get(depth, ()) for a in after), default=0.0)
                move_end[depth] = links.run(by_depth[depth], start, move_end[depth], "")[0]
            for s in others.get(depth, ()):
                start = max((finish(a) for a in s.after), default=0.0)
                other_end[s.id] = start + seconds(s)
        return max([*move_end.values(), *other_end.values()], default=0.0)

    @cached_property
    def estimate_seconds(self) -> float:
        return self.estimate()

    def host_bytes(self) -> dict[str, dict[str, int]]:
        """Per host, ``bytes_out``/``bytes_in`` over its NIC and ``local_bytes`` between its devices."""
        hosts = HostCache()
        flows = []
        for s in self.steps:
            if s.kind == MOVE:
                flows += transfer_flows(s.transfer, self.tensor(s.tensor).itemsize, hosts)
            elif s.kind == REDUCE:
                flows += [f for r in self._reduce_rounds(s, hosts) for f in r]
        return flow_totals(flows, hosts)

    # -- presentation -----------------------------------------------------------------------------------------

    def __str__(self) -> str:
        counts = defaultdict(int)
        for s in self.steps:
            counts[s.kind] += 1
        kinds = ", ".join(f"{counts[k]} {k}" for k in STEP_KINDS if counts[k]) or "none"
        if self.is_reshard:
            d = self.tensors[0]
            what = f"{d.dtype}[{','.join(map(str, d.shape))}] {d.src.spec_str()} -> {d.dst.spec_str()}"
        else:
            what = f"tensors {', '.join(t.name for t in self.tensors)}"
        depth = 1 + max(self.depths, default=-1)
        return (f"Program {self.id[:12]} {self.strategy or 'custom'}: {what}, {len(self.steps)} steps ({kinds}), "
                f"{depth} deep, estimate {self.estimate_seconds:.4g}s")

    def summary(self, max_steps: int = 20) -> str:
        """The one-line form, then each step with when it runs on the cost model."""
        lines = [str(self), f"topology: {self.topology}"]
        estimates = self.step_estimates()
        for s, e in list(zip(self.steps, estimates))[:max_steps]:
            lines.append(f"  {s}  [{e.start:.4g}s..{e.finish:.4g}s, {e.bottleneck}]")
        if len(self.steps) > max_steps:
            lines.append(f"  ... {len(self.steps) - max_steps} more (use --json for all)")
        return "\n".join(lines)
