"""What the program page shows, computed from a `reshard.program.Program`: plain data, then inline SVG.

The page answers "what runs where, in which order, and why" for a split einsum, an
apply or a Partial tensor's reshard: the steps cut into stages, when each step runs
on the cost model (`Program.step_estimates`), and what each host puts on its links
(`Program.host_bytes`).

============ ========================================================================
stage kind   its steps (a program lists every step after the steps it waits for)
============ ========================================================================
``sum``      the reduces of one Partial input that the compute waits for: its sum,
             completed before the local kernel
``input``    the moves of one tensor before the compute, and the copies of the part
             of its new tile that a device already held: an input laid out in the
             op's layout because it did not line up with it
``compute``  the compute steps of one kernel that are not such copies: one per device
``reduce``   the reduces after the compute from one buffer into the next: one stage
             of the output's reduction, one reduce step per group of devices
``move``     the moves (and copies) of one tensor after the compute or a reduction:
             the result into ``out_sharding``; a program without compute (a Partial
             tensor's reshard) has only ``reduce`` and ``move`` stages
============ ========================================================================

A stage's steps are those of one kind and one tensor (or buffer pair); stages are
listed kind by kind in the order above, and by their first step within a kind.

The layout is known for a program as `plan_einsum` or `plan_apply` returned it
(``program.einsum_layout``). A program read back from JSON has none, for the layout
is no part of its content; the page then gives the tiles the compute reads instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from html import escape
from typing import Optional

from reshard.box import box_str, volume
from reshard.cost import NIC, HostCache, reduce_rounds, transfer_flows
from reshard.einsum import Layout
from reshard.kernels import parse_equation
from reshard.program import COMPUTE, MOVE, REDUCE, Program, Step, StepEstimate
from reshard.server.common.sizes import format_size
from reshard.server.dashboard.svg import arrow_marker, colour, shorten
from reshard.sharding import Sharding
from reshard.topology import Topology

__all__ = ["ProgramView", "Stage", "MoveRow", "ComputeRow", "ReduceGroup", "program_view", "STAGE_KINDS"]

SUM, INPUT, COMPUTE_STAGE, REDUCE_STAGE, MOVE_STAGE = "sum", "input", "compute", "reduce", "move"
STAGE_KINDS = (SUM, INPUT, COMPUTE_STAGE, REDUCE_STAGE, MOVE_STAGE)
_KIND_FILL = {MOVE: "#3c8ae0", COMPUTE: "#4caf6a", REDUCE: "#e08a3c"}
# Neighbouring reduce groups must be told apart at a glance, so they take turns in a fixed palette.
_GROUP_FILLS = ("#8fb8f0", "#f0b27a", "#9fd89f", "#e59fd0", "#f5e17a", "#a9a0e8", "#7fd6d1", "#f09a9a")


@dataclass(frozen=True)
class MoveRow:
    """One move step: its transfer, and the bytes it puts on the network and on intra-host links."""

    step: int
    tensor: str
    role: str
    method: str
    box: str
    nbytes: int
    sender: str
    receivers: tuple[str, ...]
    route: tuple[str, ...]
    network_bytes: int
    local_bytes: int


@dataclass(frozen=True)
class ComputeRow:
    """One compute step: the kernel on one device, its input tiles (with shapes) and its output tile."""

    step: int
    device: str
    kernel: str
    params: tuple[tuple[str, str], ...]
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    output: str
    shape: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class ReduceGroup:
    """One reduce step: its group (ring order), the box every member holds addends of, and per member the bytes
    it holds and sends (`cost.reduce_rounds`)."""

    step: int
    devices: tuple[str, ...]
    box: str
    bytes_held: int
    bytes_sent: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class Stage:
    """Steps of one purpose (see the module's table); the fields a kind does not use stay empty."""

    kind: str
    title: str
    reason: str
    steps: tuple[int, ...]
    start: float
    finish: float
    tensor: str = ""  # input, move, sum: the tensor; reduce: the buffer it reads
    source: str = ""  # input, move: where the tensor is before the stage
    target: str = ""  # input, move: the sharding the stage leaves it in, where known
    tiles: tuple[tuple[str, str], ...] = ()  # input, move: (device, box) the stage leaves it in
    moves: tuple[MoveRow, ...] = ()
    copies: tuple[ComputeRow, ...] = ()
    computes: tuple[ComputeRow, ...] = ()
    groups: tuple[ReduceGroup, ...] = ()

    @property
    def network_bytes(self) -> int:
        return sum(m.network_bytes for m in self.moves)

    @property
    def local_bytes(self) -> int:
        return sum(m.local_bytes for m in self.moves)

    @property
    def label(self) -> str:
        """A column heading: a word or two."""
        if self.kind == COMPUTE_STAGE:
            return self.computes[0].kernel if self.computes else "compute"
        if self.kind == REDUCE_STAGE:
            return "reduce " + shorten(self.tensor, 10)
        return {SUM: "sum ", INPUT: "move ", MOVE_STAGE: "move "}[self.kind] + shorten(self.tensor, 10)

    def to_json(self) -> dict:
        return {**asdict(self), "network_bytes": self.network_bytes, "local_bytes": self.local_bytes}


@dataclass(frozen=True)
class ProgramView:
    program: Program
    layout: Optional[str]  # str of the op's `Layout`, when known
    kernel: str  # the compute's kernel ("" for a program without compute)
    equation: str  # an einsum's equation, else ""
    stages: tuple[Stage, ...]
    in_place: tuple[tuple[str, str, str], ...]  # (tensor, sharding, why) of inputs the compute reads where they are
    estimates: tuple[StepEstimate, ...]
    host_bytes: dict[str, dict[str, int]]
    devices: tuple[str, ...]  # every device a tensor lives on or a step names, meshes' order first

    @property
    def estimate(self) -> float:
        return max((e.finish for e in self.estimates), default=0.0)

    @property
    def inputs(self) -> list[str]:
        return [t.name for t in self.program.tensors if t.src is not None]

    @property
    def outputs(self) -> list[str]:
        return [t.name for t in self.program.tensors if t.dst is not None and t.src is None]

    def to_json(self) -> dict:
        return {
            "id": self.program.id, "program": self.program.to_json(), "layout": self.layout, "kernel": self.kernel,
            "equation": self.equation, "estimate_seconds": self.estimate,
            "stages": [s.to_json() for s in self.stages],
            "in_place": [{"tensor": t, "sharding": s, "reason": r} for t, s, r in self.in_place],
            "steps": [{**asdict(e), "text": str(s)} for s, e in zip(self.program.steps, self.estimates)],
            "host_bytes": self.host_bytes,
        }

    # -- svg ----------------------------------------------------------------------------

    def stages_svg(self, max_devices: int = 64) -> str:
        return _stages_svg(self.stages, self.devices[:max_devices])

    def timeline_svg(self, max_devices: int = 64, max_spans: int = 4000) -> str:
        return _timeline_svg(self.program.steps, self.estimates, self.devices[:max_devices], max_spans)


def program_view(program: Program, topology: Optional[Topology] = None) -> ProgramView:
    """The page's data for ``program``, its estimates on ``topology`` (default: the program's own)."""
    estimates = tuple(program.step_estimates(topology))
    layout = program.einsum_layout
    layout_text = program.einsum_layout_text or None
    kinds = _stage_kinds(program.steps)
    main = [s for s, k in zip(program.steps, kinds) if k == COMPUTE_STAGE]
    kernel = main[0].kernel if main else ""
    equation = dict(main[0].params).get("equation", "") if kernel == "einsum" else ""
    meshes = [*([layout.mesh] if layout is not None else []),
              *(s.mesh for t in program.tensors for s in (t.src, t.dst) if s is not None)]
    ctx = _Context(program, estimates, layout, kernel, equation, meshes, main)

    grouped: dict[tuple, list[Step]] = defaultdict(list)
    for s, kind in zip(program.steps, kinds):
        grouped[(STAGE_KINDS.index(kind), _stage_key(s, kind))].append(s)
    first = {key: steps[0].id for key, steps in grouped.items()}
    stages = tuple(ctx.stage(STAGE_KINDS[key[0]], grouped[key])
                   for key in sorted(grouped, key=lambda k: (k[0], first[k])))

    laid_out = {s.tensor for s in stages if s.kind in (SUM, INPUT)}
    read = {r.tensor for s in main for r in s.inputs}
    in_place = tuple((t.name, str(t.src), ctx.in_place_reason(t.src)) for t in program.tensors
                     if t.src is not None and t.name in read and t.name not in laid_out)

    order: list[str] = [d for m in meshes for d in (m.devices or ())]
    order += [d for s in program.steps for d in s.participants()]
    return ProgramView(program, layout_text, kernel, equation, stages, in_place, estimates, program.host_bytes(),
                       tuple(dict.fromkeys(order)))


# -- cutting the steps into stages ----------------------------------------------------------


def _is_copy(s: Step) -> bool:
    """A copy within one tensor: part of laying that tensor out, not the op's compute."""
    return s.kind == COMPUTE and s.kernel == "copy" and all(r.tensor == s.output.tensor for r in s.inputs)


def _stage_kinds(steps: tuple[Step, ...]) -> list[str]:
    """Each step's stage kind, by the module's table."""
    main = [s.kind == COMPUTE and not _is_copy(s) for s in steps]
    computes = any(main)
    late = [False] * len(steps)  # after the compute, or after a reduction of its result
    kinds = []
    for s in steps:
        after = any(late[a] or main[a] for a in s.after)
        if main[s.id]:
            kind = COMPUTE_STAGE
        elif s.kind == REDUCE:
            kind = REDUCE_STAGE if after or not computes else SUM
        else:
            kind = MOVE_STAGE if after or not computes else INPUT
        late[s.id] = kind in (REDUCE_STAGE, MOVE_STAGE)
        kinds.append(kind)
    return kinds


def _stage_key(s: Step, kind: str) -> tuple:
    if kind == COMPUTE_STAGE:
        return (s.kernel,)
    if s.kind == REDUCE:
        return (s.inputs[0].tensor, s.inputs[0].role, s.output.tensor, s.output.role)
    return (s.tensor if s.kind == MOVE else s.output.tensor,)


class _Itself(dict):
    """Every device its own host: `reduce_rounds` then names the device of every hop."""

    def __missing__(self, device: str) -> str:
        return device


def _shape_str(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "scalar"


class _Context:
    """What building each stage needs to know about the whole program."""

    def __init__(self, program: Program, estimates, layout: Optional[Layout], kernel: str, equation: str, meshes,
                 main: list[Step]):
        self.program, self.estimates, self.layout, self.kernel, self.equation = program, estimates, layout, kernel, \
            equation
        self.meshes, self.main = meshes, main
        self.hosts = HostCache()

    def stage(self, kind: str, steps: list[Step]) -> Stage:
        est = [self.estimates[s.id] for s in steps]
        common = dict(steps=tuple(s.id for s in steps), start=min(e.start for e in est),
                      finish=max(e.finish for e in est))
        if kind == COMPUTE_STAGE:
            rows = tuple(self._compute_row(s) for s in steps)
            return Stage(kind, f"Local {self.kernel} on {len(rows)} devices", self._compute_reason(), computes=rows,
                         **common)
        if kind in (SUM, REDUCE_STAGE):
            return self._reduce_stage(kind, steps, common)
        return self._move_stage(kind, steps, common)

    # -- compute ---------------------------------------------------------------------------

    def _compute_row(self, s: Step) -> ComputeRow:
        inputs = tuple((str(r), tuple(hi - lo for lo, hi in r.box)) for r in s.inputs)
        return ComputeRow(s.id, s.device, s.kernel, s.params, inputs, str(s.output),
                          tuple(hi - lo for lo, hi in s.output.box), self.estimates[s.id].seconds)

    def _compute_reason(self) -> str:
        what = f"einsum {self.equation}" if self.equation else \
            f"{self.kernel}" + "".join(f" {k}={v}" for k, v in self.main[0].params)
        where = f"its tiles of layout {self.layout}" if self.layout is not None else "its tiles"
        return f"{what}: every device runs it on {where}"

    # -- reductions ------------------------------------------------------------------------

    def _reduce_stage(self, kind: str, steps: list[Step], common: dict) -> Stage:
        first = steps[0]
        src, out = first.inputs[0], first.output
        itemsize = self.program.tensor(src.tensor).itemsize
        groups = []
        for s in steps:
            nbytes = volume(s.box) * itemsize
            sent: dict[str, int] = defaultdict(int)
            for flows in reduce_rounds(s.devices, nbytes, s.result, s.algorithm, _Itself()):
                for f in flows:
                    sent[f.src] += f.nbytes
            groups.append(ReduceGroup(s.id, s.devices, box_str(s.box), nbytes, tuple(sent[d] for d in s.devices),
                                      self.estimates[s.id].seconds))
        how = "all-reduce" if first.result == "replicate" else f"reduce-scatter along dim {first.dim}"
        size = max(len(s.devices) for s in steps)
        axes = self._axes_of(first.devices)
        over = f"axes {', '.join(axes)}" if axes else "their group"
        leaves = "every member the reduced box" if first.result == "replicate" else \
            f"member i chunk i of it along dim {first.dim}"
        if kind == SUM:
            decl = self.program.tensor(src.tensor)
            title = f"Sum Partial input {src.tensor}"
            reason = (f"{src.tensor} is {decl.src}: addends, summed over {over} before the local {self.kernel} "
                      f"({first.op} {how}, {first.algorithm}, into {out.tensor}); carrying them through the kernel "
                      f"is not allowed here or costs more")
        else:
            title = f"{first.op} {how} ({first.algorithm}) over {len(steps)} group(s) of {size}"
            partials = "partial sums" if first.op == "sum" else f"partial results of a {first.op}"
            reason = (f"devices that differ only in {over} hold {partials} of one box of {src.tensor} ({src.role}); "
                      f"each group's {first.algorithm} leaves {leaves} in {out.tensor} ({out.role})")
        return Stage(kind, title, reason, tensor=src.tensor, groups=tuple(groups), **common)

    def _axes_of(self, devices: tuple[str, ...]) -> list[str]:
        """The mesh axes along which the members of a group differ, on the first mesh that holds them all."""
        for mesh in self.meshes:
            position = {d: i for i, d in enumerate(mesh.devices or ())}
            if all(d in position for d in devices):
                coords = [mesh.coords(position[d]) for d in devices]
                return [a for i, a in enumerate(mesh.axis_names) if len({c[i] for c in coords}) > 1]
        return []

    # -- moves -----------------------------------------------------------------------------

    def _move_stage(self, kind: str, steps: list[Step], common: dict) -> Stage:
        name = steps[0].tensor if steps[0].kind == MOVE else steps[0].output.tensor
        decl = self.program.tensor(name)
        moves, copies = [], []
        for s in steps:
            if s.kind == COMPUTE:
                copies.append(self._compute_row(s))
                continue
            t = s.transfer
            flows = transfer_flows(t, decl.itemsize, self.hosts)
            network = sum(f.nbytes for f in flows if f.link == NIC)
            moves.append(MoveRow(s.id, name, s.role, t.method, box_str(t.box), volume(t.box) * decl.itemsize,
                                 t.sender, t.receivers, t.route, network, sum(f.nbytes for f in flows) - network))
        if kind == INPUT:
            source = str(decl.src) if decl.src is not None else self._made_by(name)
            tiles = tuple((s.device, box_str(r.box)) for s in self.main for r in s.inputs if r.tensor == name)
            reason = self._input_reason(decl.src)
            title = f"Move input {name} into the layout"
            target = self._layout_sharding(name, len(decl.shape))
        else:
            makers = [s for s in self.program.steps if s.id < steps[0].id and s.kind != MOVE and not _is_copy(s)
                      and s.output.tensor == name]
            roles = sorted({s.output.role for s in makers})
            source = f"{name} ({', '.join(roles)}), as steps {', '.join(f'#{s.id}' for s in makers)} leave it" \
                if makers else str(decl.src) if decl.src is not None else name
            tiles = tuple((d, box_str(b)) for d, b in decl.dst.tiles(decl.shape).items()) if decl.dst else ()
            target = str(decl.dst) if decl.dst is not None else ""
            into = f"{decl.dst}" if decl.dst is not None else "its destination"
            if self.main:
                left = f"where layout {self.layout} leaves it" if self.layout is not None else \
                    "where the compute leaves it"
                reason = f"out_sharding {into} is not {left}: the result moves after its reduction"
            else:
                reason = f"the reduced values move into the destination sharding {into}"
            title = f"Move {name} into {decl.dst.spec_str() if decl.dst is not None else 'place'}"
        return Stage(kind, title, reason, tensor=name, source=source, target=target, tiles=tiles, moves=tuple(moves),
                     copies=tuple(copies), **common)

    def _made_by(self, name: str) -> str:
        makers = [s for s in self.program.steps if s.kind != MOVE and not _is_copy(s) and s.output.tensor == name]
        if makers and all(s.kind == REDUCE for s in makers):
            src = self.program.tensor(makers[0].inputs[0].tensor)
            held = src.src.without_partial() if src.src is not None else None
            return f"the sum of {src.name}" + (f", {held}" if held is not None else "")
        return "made by steps " + ", ".join(f"#{s.id}" for s in makers)

    def _layout_sharding(self, name: str, ndim: int) -> str:
        """How the layout cuts input ``name``: its letters are its operand's in an einsum's equation, and all the
        layout's letters in order for an apply (every input of an apply has the op's dims); "" when unknown."""
        if self.layout is None:
            return ""
        if self.equation:
            operands, _ = parse_equation(self.equation, ValueError)
            letters = next((ls for ls, r in zip(operands, self.main[0].inputs) if r.tensor == name), "")
        else:
            letters = self.layout.letters if len(self.layout.letters) == ndim else ""
        return str(self.layout.sharding(letters)) if letters else ""

    def _input_reason(self, src: Optional[Sharding]) -> str:
        if self.layout is None:
            return "its tiles are not the tiles the compute steps read"
        if src is not None and src.mesh != self.layout.mesh:
            return f"it lives on another mesh than layout {self.layout}"
        return f"does not line up with layout {self.layout}"

    def in_place_reason(self, src: Sharding) -> str:
        if src.is_partial:
            lines = f"lines up with layout {self.layout}" if self.layout is not None else \
                "lines up with the compute's tiles"
            return f"{lines}; its addends go through the local {self.kernel} and join the output's reduction"
        tiles = f"its tile of layout {self.layout}" if self.layout is not None else "the tile the compute reads"
        return f"every device already holds {tiles}: read where it is, nothing moves"


# -- drawing --------------------------------------------------------------------------------------


_LABEL, _COL, _ROW, _HEAD, _GUTTER = 86, 150, 24, 40, 44


def _stages_svg(stages: tuple[Stage, ...], devices: tuple[str, ...]) -> str:
    """One row per device, one column per stage: what each device does there. Moves are arrows from sender to
    receiver; a reduce group is a bracket over its members, who share its colour."""
    rows = _Rows(devices)
    width = _LABEL + len(stages) * _COL + 10
    height = _HEAD + len(devices) * _ROW + 8
    parts = [f'<svg class="stages" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             arrow_marker("stage-arrow")]
    for d in devices:
        parts.append(f'<text x="{_LABEL - 6}" y="{rows.y(d) + 4}" text-anchor="end" font-size="11">{escape(d)}</text>')
    for k, stage in enumerate(stages):
        x0 = _LABEL + k * _COL
        parts.append(f'<g class="stage" data-kind="{stage.kind}" data-tensor="{escape(stage.tensor)}" '
                     f'data-steps="{",".join(map(str, stage.steps))}">'
                     f'<title>{escape(stage.title)}: {escape(stage.reason)}</title>'
                     f'<rect x="{x0 + 2}" y="2" width="{_COL - 4}" height="{height - 4}" rx="4" '
                     f'fill="{"#f7f8fb" if k % 2 else "#eef1f6"}"/>'
                     f'<text x="{x0 + _COL / 2}" y="16" text-anchor="middle" font-size="11" font-weight="600">'
                     f'{k + 1}. {escape(stage.label)}</text>'
                     f'<text x="{x0 + _COL / 2}" y="30" text-anchor="middle" font-size="9">'
                     f'{stage.start:.3g}s..{stage.finish:.3g}s</text>')
        if stage.kind == COMPUTE_STAGE:
            parts += _compute_column(stage, x0, rows)
        elif stage.kind in (SUM, REDUCE_STAGE):
            parts += _reduce_column(stage, x0, rows)
        else:
            parts += _move_column(stage, x0, rows)
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


class _Rows:
    """The devices drawn, one row each: the middle of a device's row, and whether it is drawn at all."""

    def __init__(self, devices: tuple[str, ...]):
        self.index = {d: i for i, d in enumerate(devices)}

    def __contains__(self, device: str) -> bool:
        return device in self.index

    def y(self, device: str) -> float:
        return _HEAD + self.index[device] * _ROW + _ROW / 2


def _compute_column(stage: Stage, x0: float, rows: _Rows) -> list[str]:
    return [_cell(x0 + _GUTTER, rows.y(c.device), "#cdeccf", f"{c.kernel} {_shape_str(c.shape)}",
                  f"#{c.step} {c.kernel} on {c.device} -> {c.output}",
                  f'class="cell compute" data-device="{escape(c.device)}" data-step="{c.step}" '
                  f'data-kernel="{escape(c.kernel)}" data-shape="{_shape_str(c.shape)}"')
            for c in stage.computes if c.device in rows]


def _reduce_column(stage: Stage, x0: float, rows: _Rows) -> list[str]:
    """Per group a bracket in the gutter with a tick to each member, and each member's cell in the group's colour."""
    parts = []
    for g, group in enumerate(stage.groups):
        fill = _GROUP_FILLS[g % len(_GROUP_FILLS)]
        ys = [rows.y(d) for d in group.devices if d in rows]
        if not ys:
            continue
        x = x0 + 8 + (g % 6) * 6
        ticks = "".join(f'<line x1="{x}" y1="{y}" x2="{x0 + _GUTTER - 2}" y2="{y}" stroke="{fill}" stroke-width="2"/>'
                        for y in ys)
        parts.append(f'<g class="group" data-step="{group.step}" data-devices="{escape(",".join(group.devices))}">'
                     f'<title>#{group.step} group {g}: {escape(" -> ".join(group.devices))}, {escape(group.box)}, '
                     f'{format_size(group.bytes_held)} each</title>'
                     f'<line x1="{x}" y1="{min(ys)}" x2="{x}" y2="{max(ys)}" stroke="{fill}" stroke-width="3"/>'
                     f'{ticks}</g>')
        held = format_size(group.bytes_held)
        for d, sent in zip(group.devices, group.bytes_sent):
            if d in rows:
                parts.append(_cell(x0 + _GUTTER, rows.y(d), fill, f"g{g} sends {format_size(sent)}",
                                   f"#{group.step} group {g} member {d}: holds {held}, sends {format_size(sent)}",
                                   f'class="cell reduce" data-device="{escape(d)}" data-step="{group.step}" '
                                   f'data-group="{g}"'))
    return parts


def _move_column(stage: Stage, x0: float, rows: _Rows) -> list[str]:
    """An arrow in the gutter per receiver of each move, and a cell per device saying what it gets and sends."""
    parts = []
    got: dict[str, int] = defaultdict(int)
    sent: dict[str, int] = defaultdict(int)
    for k, m in enumerate(stage.moves):
        sent[m.sender] += m.nbytes  # each box once, however many receive it
        for r in m.receivers:
            got[r] += m.nbytes
            if m.sender in rows and r in rows and k < 400:
                x = x0 + 8 + (k % 6) * 6
                parts.append(f'<line class="arrow" data-step="{m.step}" data-from="{escape(m.sender)}" '
                             f'data-to="{escape(r)}" x1="{x}" y1="{rows.y(m.sender)}" x2="{x}" y2="{rows.y(r)}" '
                             f'stroke="#555" marker-end="url(#stage-arrow)"/>')
    copied = {c.device for c in stage.copies}
    fill = colour(stage.tensor)
    for d in rows.index:
        if d not in got and d not in sent and d not in copied:
            continue
        what = [f"gets {format_size(got[d])}" if d in got else "", f"sends {format_size(sent[d])}" if d in sent else "",
                "copy" if d in copied else ""]
        text = " ".join(w for w in what if w)
        parts.append(_cell(x0 + _GUTTER, rows.y(d), fill if d in got else "#ffffff", text,
                           f"{stage.tensor} on {d}: {text}",
                           f'class="cell move" data-device="{escape(d)}" data-tensor="{escape(stage.tensor)}"'))
    return parts


def _cell(x: float, y: float, fill: str, text: str, title: str, attrs: str) -> str:
    return (f'<g {attrs}><title>{escape(title)}</title>'
            f'<rect x="{x}" y="{y - _ROW / 2 + 2}" width="{_COL - _GUTTER - 6}" height="{_ROW - 4}" rx="3" '
            f'fill="{fill}" stroke="#888"/>'
            f'<text x="{x + 4}" y="{y + 4}" font-size="9">{escape(shorten(text, 20))}</text></g>')


def _timeline_svg(steps: tuple[Step, ...], estimates: tuple[StepEstimate, ...], devices: tuple[str, ...],
                  max_spans: int) -> str:
    """One row per device; each step a bar from its start to its finish on the cost model, on every device it
    involves, coloured by kind."""
    plot = 720
    row_of = {d: i for i, d in enumerate(devices)}
    total = max((e.finish for e in estimates), default=0.0) or 1.0
    scale = plot / total
    height = len(devices) * _ROW + 30
    parts = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{_LABEL + plot + 20}" '
             f'height="{height}">']
    for d, i in row_of.items():
        parts.append(f'<text x="{_LABEL - 6}" y="{i * _ROW + 16}" text-anchor="end" font-size="11">{escape(d)}</text>'
                     f'<line x1="{_LABEL}" x2="{_LABEL + plot}" y1="{(i + 1) * _ROW}" y2="{(i + 1) * _ROW}" '
                     f'stroke="#eee"/>')
    drawn = 0
    for s, e in zip(steps, estimates):
        for d in s.participants():
            if d not in row_of or drawn >= max_spans:
                continue
            drawn += 1
            parts.append(f'<rect class="span" data-step="{s.id}" data-kind="{s.kind}" data-device="{escape(d)}" '
                         f'x="{_LABEL + e.start * scale:.1f}" y="{row_of[d] * _ROW + 4}" '
                         f'width="{max((e.finish - e.start) * scale, 1.0):.1f}" height="{_ROW - 8}" '
                         f'fill="{_KIND_FILL[s.kind]}" stroke="#fff">'
                         f'<title>{escape(str(s))} [{e.start:.4g}s..{e.finish:.4g}s, {escape(e.bottleneck)}]</title>'
                         f'</rect>')
    axis = len(devices) * _ROW + 16
    parts.append(f'<text x="{_LABEL}" y="{axis}" font-size="10">0 s</text>'
                 f'<text x="{_LABEL + plot}" y="{axis}" text-anchor="end" font-size="10">{total:.4g} s</text>')
    parts.append("</svg>")
    return "".join(parts)
