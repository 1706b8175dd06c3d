"""`reshard.sequence.plan_sequence`: several einsum and kernel ops joined into one program."""

import pytest

from reshard import Mesh, Op, Sharding, TensorDecl, plan_sequence
from reshard.einsum import EinsumError
from reshard.program import COMPUTE, DST, MOVE, SRC

MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1", "h2", "h3"], 1)
ROWS = Sharding(MESH, ("x", None))


def stored(**shapes_and_specs):
    return {n: TensorDecl(n, shape, "float32", Sharding(MESH, spec)) for n, (shape, spec) in shapes_and_specs.items()}


def layer(x="h", w="w", pre="z", out="a"):
    return [Op.einsum("bi,io->bo", x, w, out=pre, out_sharding=ROWS), Op.apply("relu", pre, out=out)]


def test_a_layer_is_one_program_whose_relu_reads_the_einsum_output_in_place():
    program = plan_sequence(layer(), stored(h=((8, 6), ("x", None)), w=((6, 4), (None, None))))
    names = {t.name: t for t in program.tensors}
    assert {n for n, t in names.items() if t.dst is not None} == {"z", "a"}
    assert names["h@0"].src == ROWS and names["w@0"].src is not None  # catalog tensors under op 0's aliases
    relus = [s for s in program.steps if s.kind == COMPUTE and s.kernel == "relu"]
    assert len(relus) == 4 and all(s.inputs[0].tensor == "z" and s.inputs[0].role == DST for s in relus)
    writers = {s.device: s.id for s in program.steps if s.kind == COMPUTE and s.output.tensor == "z"}
    assert all(writers[s.device] in s.after for s in relus)  # each relu waits for its own device's einsum only
    assert not [s for s in program.steps if s.kind == MOVE]


def test_a_later_op_that_moves_an_output_reads_a_copy_and_never_writes_the_output():
    cols = Sharding(MESH, (None, ("x", "y")))
    ops = [Op.einsum("bi,io->bo", "h", "w", out="z", out_sharding=ROWS),
           Op.apply("add", "z", "q", out="y", out_sharding=cols)]  # z's rows must move to q's columns
    program = plan_sequence(ops, {**stored(h=((8, 6), ("x", None)), w=((6, 8), (None, None))),
                                  "q": TensorDecl("q", (8, 8), "float32", cols)})
    copies = [s for s in program.steps if s.kind == COMPUTE and s.kernel == "copy" and s.inputs[0].tensor == "z"]
    assert len(copies) == 4 and all(s.inputs[0].role == DST and (s.output.tensor, s.output.role) == ("z@1", SRC)
                                    for s in copies)
    later = [s for s in program.steps if s.id > max(c.id for c in copies)]
    assert later and all({c.id for c in copies} <= set(s.after) for s in later)
    moved = {s.tensor for s in program.steps if s.kind == MOVE}
    assert moved == {"z@1"}  # the output z itself is never a move's tensor, so nothing writes into it
    assert program.tensor("z@1").src is None and program.tensor("z@1").dst is None


def test_an_output_may_replace_an_input_and_names_resolve_in_order():
    ops = [Op.einsum("bi,bo->io", "h", "d", out="gk"), Op.apply("add", "g", "gk", out="g"),
           Op.apply("axpy", "w", "g", out="w", alpha=0.5)]
    program = plan_sequence(ops, stored(h=((8, 6), ("x", None)), d=((8, 6), ("x", None)), g=((6, 6), (None, None)),
                                        w=((6, 6), (None, None))))
    names = {t.name for t in program.tensors}
    assert {"g@1", "w@2", "gk", "g", "w"} <= names
    axpy = [s for s in program.steps if s.kind == COMPUTE and s.kernel == "axpy"]
    assert all(s.inputs[0].tensor == "w@2" and s.inputs[1].tensor == "g" and s.inputs[1].role == DST for s in axpy)


@pytest.mark.parametrize("ops, match", [
    ([], "at least one op"),
    ([Op.apply("relu", "nope", out="a")], "op 0 .* reads 'nope', which is neither in the catalog nor written"),
    (layer() + [Op.apply("relu", "z", out="a")], "op 2 .* writes 'a', which op 1 already writes"),
    ([Op.apply("gelu", "h", out="a")], "op 0 .*unknown op 'gelu'"),
    ([Op.apply("relu", "h", out="a@3")], "may not contain '@'"),
    ([Op.einsum("bi,io->bx", "h", "w", out="z")], "op 0 .*output letter"),
    ([Op.einsum("bi,io->bo", "h", "w", out="z", out_sharding=Sharding(MESH, ("x", None), partial=("y",))),
      Op.apply("relu", "z", out="a")], "op 1 .* reads 'z', which an earlier op leaves a pending sum"),
])
def test_a_sequence_that_cannot_run_is_refused_naming_the_op(ops, match):
    with pytest.raises(EinsumError, match=match):
        plan_sequence(ops, stored(h=((8, 6), ("x", None)), w=((6, 4), (None, "y"))))
