"""Several einsum and kernel ops as one program: one job, one commit, no planner round trip between them.

A training step is a chain of small ops (a layer's einsum, its relu, the gradient's einsums and sums), and as
jobs of their own each pays the job's fixed cost: the planner's checks, tickets, the agents' prepare, execute and
commit calls. `plan_sequence` plans each `Op` as `plan_einsum` or `plan_apply` would, on the layouts the earlier
ops leave, and joins the programs into one:

======================= =====================================================================================
a catalog tensor        op ``k`` reads it under the alias ``name@k`` (its ``src`` is the catalog's sharding;
                        the job's reads map the alias to the stored name and version), so the scratch buffers
                        one op makes for it never meet another op's
an op's output          program tensor ``out`` with the op's ``dst``: committed with the others when the whole
                        program has run; a later op that reads ``out`` reads what the earlier op wrote
read in place           a later op that reads ``out`` only where it lies (no move, no other role) reads the
                        output's ``dst`` buffers, after the steps that wrote them on that device
read through a copy     one that moves it first reads a copy (``out@k``, role ``src``) made on every device
                        once the earlier op is done, so its moves never write into the output being committed
the op's own tensors    its intermediate sums and the like are renamed ``name@k``
======================= =====================================================================================

Names are resolved in order: an op that names a tensor an earlier op of the sequence writes reads that value, not
the catalog's. Each output is written by one op; an output may replace a catalog tensor (its next version).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from reshard.einsum import APPLY_OPS, EinsumError, plan_apply, plan_einsum
from reshard.kernels import MAX_EQUATION_CHARS
from reshard.program import COMPUTE, DST, MOVE, SRC, Program, Step, TensorDecl, TileRef
from reshard.sharding import Sharding
from reshard.topology import Topology

__all__ = ["Op", "plan_sequence", "alias", "aliased"]


@dataclass(frozen=True)
class Op:
    """One op of a sequence: ``op`` is ``"einsum"`` (``params["equation"]``) or a kernel of `APPLY_OPS`, on the
    tensors named ``inputs``, into ``out``; ``out_sharding`` as for `plan_einsum` (None: the layout's own)."""

    op: str
    inputs: tuple[str, ...]
    out: str
    out_sharding: Optional[Sharding] = None
    params: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "params", dict(self.params))

    @classmethod
    def einsum(cls, equation: str, *inputs: str, out: str, out_sharding: Optional[Sharding] = None) -> "Op":
        return cls("einsum", inputs, out, out_sharding, {"equation": equation})

    @classmethod
    def apply(cls, op: str, *inputs: str, out: str, out_sharding: Optional[Sharding] = None, **params) -> "Op":
        return cls(op, inputs, out, out_sharding, params)

    def __str__(self) -> str:
        what = self.params.get("equation", self.op) if self.op == "einsum" else self.op
        if len(str(what)) > MAX_EQUATION_CHARS:  # refused for its length: messages quote only its start
            what = f"{str(what)[:32]}..."
        return f"{self.out} = {what}({', '.join(self.inputs)})"


def alias(name: str, k: int) -> str:
    """The program tensor under which op ``k`` of a sequence reads catalog tensor ``name``."""
    return f"{name}@{k}"


def aliased(program_tensor: str) -> str:
    """The catalog name an `alias` stands for (the name itself where it is none)."""
    return program_tensor.rsplit("@", 1)[0]


def check_ops(ops: Sequence[Op]) -> None:
    """Refuse a sequence that names no op, an unknown op, or writes one output twice, naming the op."""
    if not ops:
        raise EinsumError("a sequence needs at least one op; got none")
    written: dict[str, int] = {}
    for k, op in enumerate(ops):
        if op.op != "einsum" and op.op not in APPLY_OPS:
            raise EinsumError(f"op {k} ({op}): unknown op {op.op!r}; use 'einsum' or one of {list(APPLY_OPS)}")
        if not op.inputs:
            raise EinsumError(f"op {k} ({op}) names no input tensor")
        if "@" in op.out or any("@" in n for n in op.inputs):
            raise EinsumError(f"op {k} ({op}): tensor names in a sequence may not contain '@' (it marks the "
                              f"sequence's aliases)")
        if op.out in written:
            raise EinsumError(f"op {k} ({op}) writes {op.out!r}, which op {written[op.out]} already writes; each "
                              f"tensor of a sequence is written once (name the second result otherwise)")
        written[op.out] = k


def plan_sequence(ops: Sequence[Op], stored: Mapping[str, TensorDecl], topology: Optional[Topology] = None,
                  strategy: str = "auto") -> Program:
    """One validated program that runs ``ops`` in order (see the module docstring). ``stored`` holds the catalog
    tensors the ops read (name, shape, dtype and ``src``: the sharding they are held in). Raises `EinsumError`
    naming the op for an op that cannot run, or a name that is neither stored nor written by an earlier op."""
    check_ops(ops)
    topology = topology or Topology()
    tensors: dict[str, TensorDecl] = {}
    steps: list[Step] = []
    outputs: dict[str, TensorDecl] = {}  # output name -> its program tensor (with dst)
    # (device, output) -> ids of the steps that write that output's dst buffers there
    writers: dict[tuple[str, str], list[int]] = defaultdict(list)
    for k, op in enumerate(ops):
        decls, produced = [], []
        for name in dict.fromkeys(op.inputs):
            if name in outputs:
                out = outputs[name]
                if out.dst.is_partial:
                    raise EinsumError(f"op {k} ({op}) reads {name!r}, which an earlier op leaves a pending sum "
                                      f"({out.dst}); complete it first (no Partial output feeds another op of a "
                                      f"sequence)")
                decls.append(TensorDecl(name, out.shape, out.dtype, out.dst))
                produced.append(name)
            elif name in stored:
                decls.append(stored[name])
            else:
                raise EinsumError(f"op {k} ({op}) reads {name!r}, which is neither in the catalog nor written by an "
                                  f"earlier op of the sequence")
        by_name = {d.name: d for d in decls}
        sub_out = op.out if op.out not in by_name else f"{op.out}~new"
        try:
            if op.op == "einsum":
                program = plan_einsum(str(op.params.get("equation", "")), [by_name[n] for n in op.inputs], sub_out,
                                      op.out_sharding, topology, strategy)
            else:
                program = plan_apply(op.op, [by_name[n] for n in op.inputs], sub_out, op.params, op.out_sharding,
                                     topology, strategy)
        except EinsumError as e:
            raise EinsumError(f"op {k} ({op}): {e}") from None
        copied = {n for n in produced if not _in_place(program, n)}
        names = {t.name: alias(t.name, k) for t in program.tensors}
        names[sub_out] = op.out
        for n in produced:
            names[n] = n if n not in copied else alias(n, k)
        first = len(steps)
        barrier: list[int] = []  # the copies every step of this op waits for
        for n in sorted(copied):
            out = outputs[n]
            for device, tile in out.dst.tiles(out.shape).items():
                step = Step.compute(len(steps), "copy", device, [TileRef(n, DST, tile)],
                                    TileRef(alias(n, k), SRC, tile), after=writers[(device, n)])
                steps.append(step)
                barrier.append(step.id)
        offset = len(steps)
        for t in program.tensors:
            if t.name in produced:
                if t.name in copied:
                    tensors[alias(t.name, k)] = TensorDecl(alias(t.name, k), t.shape, t.dtype)
                continue
            renamed = replace(t, name=names[t.name])
            if t.name == sub_out:
                outputs[op.out] = renamed
            tensors[renamed.name] = renamed
        in_place = {n for n in produced if n not in copied}
        for s in program.steps:
            after = {a + offset for a in s.after} | set(barrier)
            step = _renamed(s, names, in_place, offset)
            for device in _devices(s):
                for n in in_place:
                    if _reads(s, n):
                        after.update(writers[(device, n)])
            step = replace(step, after=tuple(sorted(after)))
            steps.append(step)
        for s in steps[first:]:
            for device, tensor, role, _ in s.produces():
                if role == DST and tensor in outputs:
                    writers[(device, tensor)].append(s.id)
    return Program(tuple(tensors.values()), tuple(steps), strategy, topology).validate()


def _in_place(program: Program, name: str) -> bool:
    """Whether ``program`` reads input ``name`` only where it lies: no move of it, no buffer of it made."""
    for s in program.steps:
        if s.kind == MOVE and s.tensor == name:
            return False
        if any(tensor == name for _, tensor, _, _ in s.produces()):
            return False
        if any(ref.tensor == name and ref.role != SRC for ref in s.inputs):
            return False
    return True


def _devices(s: Step) -> tuple[str, ...]:
    if s.kind == COMPUTE:
        return (s.device,)
    if s.kind == MOVE:
        return (s.transfer.sender,)
    return s.devices


def _reads(s: Step, name: str) -> bool:
    return (s.kind == MOVE and s.tensor == name) or any(ref.tensor == name for ref in s.inputs)


def _renamed(s: Step, names: Mapping[str, str], in_place: set[str], offset: int) -> Step:
    """``s`` with its id moved by ``offset`` and its tensors renamed; reads of an earlier op's output in place
    read that output's ``dst`` buffers."""

    def ref(r: TileRef) -> TileRef:
        if r.tensor in in_place:
            return TileRef(names[r.tensor], DST, r.box)
        return TileRef(names[r.tensor], r.role, r.box)

    fields = {"id": s.id + offset}
    if s.kind == MOVE:
        fields["tensor"] = names[s.tensor]
    else:
        fields["inputs"] = tuple(ref(r) for r in s.inputs)
        fields["output"] = TileRef(names[s.output.tensor], s.output.role, s.output.box)
    return replace(s, **fields)
