"""The split-einsum planner and the kernels' shape rules: layouts chosen, steps, errors, estimates.

Pure core: programs are planned and validated, never run (tests/unit/test_einsum_programs.py
runs them on the agents' runtime).
"""

from __future__ import annotations

import dataclasses
import itertools
import string
import time

import pytest

from reshard import InvalidShardingError, Mesh, PlanValidationError, Program, Sharding, Topology, plan_einsum
from reshard.einsum import EinsumError, Layout
from reshard.kernels import KERNELS, MAX_EQUATION_CHARS, KernelShapeError, parse_equation
from reshard.program import COMPUTE, MOVE, REDUCE, TensorDecl

MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1", "h2", "h3"])  # one device per host: every hop is a NIC's
HOST_PAIRS = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1"])  # y inside a host
OTHER = Mesh.from_hosts({"z": 2}, ["o0", "o1"])
TOPOLOGY = Topology(nic_gbps=8.0, intra_host_gbps=80.0, memory_gb_per_s=4.0)  # 1e9 B/s NICs, 4e9 B/s memory


def decl(name, shape, spec, mesh=MESH, dtype="float32", **kw) -> TensorDecl:
    return TensorDecl(name, shape, dtype, Sharding(mesh, spec, **kw))


def kinds(program: Program) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in program.steps:
        key = f"{s.kind} {s.kernel}" if s.kind == COMPUTE else f"{s.kind} {s.result}" if s.kind == REDUCE else s.kind
        out[key] = out.get(key, 0) + 1
    return out


def moved(program: Program) -> set[str]:
    return {s.tensor for s in program.steps if s.kind == MOVE}


# -- layouts chosen ----------------------------------------------------------------------------------------

CASES = {
    # name: (equation, inputs, out_sharding, layout, moved tensors, step counts, output sharding)
    "contracting dim split alike: all-reduce over y": (
        "ij,jk->ik", [decl("a", (64, 64), ("x", "y")), decl("b", (64, 64), ("y", None))], None,
        "{i: x, j: y} on (x=2, y=2)", set(), {"compute einsum": 4, "reduce replicate": 2}, "P('x', None)"),
    "batch and free dims: nothing to reduce": (
        "bij,bjk->bik", [decl("a", (4, 8, 6), ("x", None, None)), decl("b", (4, 6, 10), ("x", None, "y"))], None,
        "{b: x, k: y} on (x=2, y=2)", set(), {"compute einsum": 4}, "P('x', None, 'y')"),
    "outer product": (
        "i,j->ij", [decl("a", (6,), ("x",)), decl("b", (5,), ("y",))], None,
        "{i: x, j: y} on (x=2, y=2)", set(), {"compute einsum": 4}, "P('x', 'y')"),
    "a dim summed in one input only": (
        "ij,jk->k", [decl("a", (6, 4), ("x", None)), decl("b", (4, 8), (None, "y"))], None,
        "{i: x, k: y} on (x=2, y=2)", set(), {"compute einsum": 4, "reduce replicate": 2}, "P('y')"),
    "diagonal blocks (x splits i and k): the small input moves": (
        "ij,jk->ik", [decl("a", (1024, 64), ("x", None)), decl("b", (64, 8), (None, "x"))], None,
        "{i: x} on (x=2, y=2)", {"b"}, None, "P('x', None)"),
    "one letter split on one input only": (
        "ij,jk->ik", [decl("a", (64, 4096), ("x", None)), decl("b", (4096, 64), ("y", None))], None,
        "{i: x, j: y} on (x=2, y=2)", set(), {"compute einsum": 4, "reduce replicate": 2}, "P('x', None)"),
    "reduce-scatter onto k": (
        "ij,jk->ik", [decl("a", (64, 64), ("x", "y")), decl("b", (64, 64), ("y", None))],
        Sharding(MESH, ("x", "y")),
        "{i: x, j: y} on (x=2, y=2)", set(), {"compute einsum": 4, "reduce shard": 2}, "P('x', 'y')"),
    "Partial output: no reduction at all": (
        "ij,jk->ik", [decl("a", (64, 64), ("x", "y")), decl("b", (64, 64), ("y", None))],
        Sharding(MESH, ("x", None), partial=("y",)),
        "{i: x, j: y} on (x=2, y=2)", set(), {"compute einsum": 4}, "P('x', None) + partial(y)"),
    "output on another mesh: reduce-scatter, then move the pieces": (
        "ij,jk->ik", [decl("a", (64, 64), ("x", "y")), decl("b", (64, 64), ("y", None))],
        Sharding(OTHER, ("z", None)),
        "{i: x, j: y} on (x=2, y=2)", {"c"}, {"compute einsum": 4, "reduce shard": 2, "move": 4}, "P('z', None)"),
    "inputs on two meshes": (
        "ij,jk->ik", [decl("a", (256, 64), ("x", None)), decl("b", (64, 16), (None, None), OTHER)], None,
        "{i: x} on (x=2, y=2)", {"b"}, None, "P('x', None)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_chosen(name):
    eq, inputs, out, layout, moves, counts, out_spec = CASES[name]
    program = plan_einsum(eq, inputs, "c", out, topology=TOPOLOGY)
    assert str(program.einsum_layout) == layout
    assert moved(program) == moves
    if counts is not None:
        assert kinds(program) == counts
    assert program.tensor("c").dst.spec_str() == out_spec
    assert program.tensor("c").src is None  # made by the program, committed by the service


@pytest.mark.parametrize("eq, specs", [
    ("ij,jk->ik", [("x", "y"), ("y", None)]),
    ("ij,jk->ik", [(None, None), (None, None)]),
    ("bij,bjk->bik", [("x", None, "y"), ("x", "y", None)]),
    ("ijk,jkl->il", [(None, "x", "y"), ("x", "y", None)]),
    ("ij,ij->ij", [(("x", "y"), None), (("x", "y"), None)]),
])
def test_no_moves_when_the_layouts_line_up(eq, specs):
    operands = eq.split("->")[0].split(",")
    sizes = dict(zip("bijkl", (3, 4, 5, 6, 7)))
    inputs = [decl(n, tuple(sizes[c] for c in ls), s) for n, ls, s in zip("ab", operands, specs)]
    program = plan_einsum(eq, inputs, "c", topology=TOPOLOGY)
    assert not moved(program) and program.einsum_layout.mesh == MESH
    assert all(s.kernel == "einsum" for s in program.steps if s.kind == COMPUTE)
    assert all(r == "src" for s in program.steps if s.kind == COMPUTE for r in (i.role for i in s.inputs))


def test_the_cheapest_layout_wins_on_the_estimate():
    inputs = [decl("a", (512, 64), ("x", None)), decl("b", (64, 32), (None, "x"))]
    chosen = plan_einsum("ij,jk->ik", inputs, "c", topology=TOPOLOGY)
    options = [None, "x", "y", ("x", "y"), ("y", "x")]
    priced = 0
    for rules in itertools.product(options, repeat=3):
        layout = dict(zip("ijk", rules))
        try:
            other = plan_einsum("ij,jk->ik", inputs, "c", topology=TOPOLOGY, layout=layout)
        except EinsumError:
            continue  # an axis on two letters
        priced += 1
        if other.tensor("c").dst == chosen.tensor("c").dst:  # the same result, reached another way
            assert chosen.estimate() <= other.estimate() + 1e-15
    assert priced > 10


def test_a_program_validates_and_survives_json():
    inputs = [decl("a", (9, 7), ("x", "y")), decl("b", (7, 5), (None, "x"))]
    program = plan_einsum("ij,jk->ik", inputs, "c", Sharding(OTHER, (None, "z")), topology=TOPOLOGY)
    again = Program.from_json(program.dumps()).validate()
    assert again.id == program.id and again.steps == program.steps


def test_steps_are_listed_after_what_they_wait_for_and_only_devices_with_output_compute():
    # i = 3 over x=2 then y=2 (axes ("x", "y")): chunks 1, 1, 1, 0; the last device computes nothing
    inputs = [decl("a", (3, 4), (("x", "y"), None)), decl("b", (4, 2), (None, None))]
    program = plan_einsum("ij,jk->ik", inputs, "c", topology=TOPOLOGY)
    computes = [s for s in program.steps if s.kind == COMPUTE]
    assert [s.device for s in computes] == list(MESH.devices[:3])
    assert all(a < s.id for s in program.steps for a in s.after)


# -- estimates ----------------------------------------------------------------------------------------------


def test_estimate_is_the_local_einsum_then_the_ring():
    ring = Mesh.from_hosts({"x": 4}, ["h0", "h1", "h2", "h3"])
    inputs = [decl("a", (8, 16), (None, "x"), ring), decl("b", (16, 8), ("x", None), ring)]
    program = plan_einsum("ij,jk->ik", inputs, "c", topology=TOPOLOGY)
    compute = (8 * 4 + 4 * 8 + 8 * 8) * 4 / 4e9  # read both tiles, write the output's, at 4 GB/s
    reduce = 2 * 3 / 4 * (8 * 8 * 4) / 1e9  # each member sends 2(n-1)/n of the 256-byte tile at 1 GB/s
    assert program.estimate() == pytest.approx(compute + reduce)
    assert {h: r["bytes_out"] for h, r in program.host_bytes().items()} == {h: 384 for h in ring.hosts}


def test_a_reduce_scatter_sends_half_what_an_all_reduce_does():
    ring = Mesh.from_hosts({"x": 4}, ["h0", "h1", "h2", "h3"])
    inputs = [decl("a", (8, 16), (None, "x"), ring), decl("b", (16, 8), ("x", None), ring)]
    all_reduce = plan_einsum("ij,jk->ik", inputs, "c", topology=TOPOLOGY)
    scatter = plan_einsum("ij,jk->ik", inputs, "c", Sharding(ring, ("x", None)), topology=TOPOLOGY,
                          layout={"j": "x"})
    assert kinds(scatter) == {"compute einsum": 4, "reduce shard": 1}
    sent = {h: r["bytes_out"] for h, r in scatter.host_bytes().items()}
    assert sent == {h: 192 for h in ring.hosts}
    assert 2 * sum(sent.values()) == sum(r["bytes_out"] for r in all_reduce.host_bytes().values())


def test_a_partial_output_costs_only_the_local_einsum():
    inputs = [decl("a", (64, 64), ("x", "y")), decl("b", (64, 64), ("y", None))]
    program = plan_einsum("ij,jk->ik", inputs, "c", Sharding(MESH, ("x", None), partial=("y",)), topology=TOPOLOGY)
    memory, arithmetic = (32 * 32 + 32 * 64 + 32 * 64) * 4 / 4e9, 2 * 32 * 32 * 64 / TOPOLOGY.flops_per_s("h0")
    assert program.estimate() == pytest.approx(max(memory, arithmetic))  # the roofline of the one kernel
    assert all(r["bytes_out"] == 0 for r in program.host_bytes().values())


def test_two_reduced_axes_scatter_in_the_output_dims_order():
    # j over (x, y): a reduce-scatter over x onto i, then over y onto k
    inputs = [decl("a", (8, 12), (None, ("x", "y"))), decl("b", (12, 6), (("x", "y"), None))]
    program = plan_einsum("ij,jk->ik", inputs, "c", Sharding(MESH, ("x", "y")), topology=TOPOLOGY,
                          layout={"j": ("x", "y")})
    reduces = [s for s in program.steps if s.kind == REDUCE]
    assert [(s.result, s.dim, len(s.devices)) for s in reduces] == [("shard", 0, 2)] * 2 + [("shard", 1, 2)] * 2
    assert reduces[2].inputs[0].box == ((0, 4), (0, 6))  # the first stage's chunk, cut again


# -- errors -------------------------------------------------------------------------------------------------

A = decl("a", (4, 6), ("x", None))
B = decl("b", (6, 5), (None, "y"))


@pytest.mark.parametrize("call, error, message", [
    (lambda: plan_einsum("ij,jk->ik", [A, decl("b", (7, 5), (None, None))], "c"), EinsumError,
     r"dim letter 'j' has size 6 in input 0 \('a'\) \(shape \(4, 6\)\) but 7 in input 1 \('b'\) \(shape \(7, 5\)\); "
     r"a letter names one dim, of one size everywhere"),
    (lambda: plan_einsum("ij,jk->iz", [A, B], "c"), EinsumError,
     r"output letter\(s\) \['z'\] appear in no input; every output dim must be a dim of some input"),
    (lambda: plan_einsum("i1,1k->ik", [A, B], "c"), EinsumError, r"\['1'\] are not dim letters; use a-z and A-Z"),
    (lambda: plan_einsum("...j,jk->...k", [A, B], "c"), EinsumError, r"ellipsis \('...'\) is not supported"),
    (lambda: plan_einsum("ii,ik->k", [A, B], "c"), EinsumError,
     r"input 0 \('ii'\) repeats letter\(s\) \['i'\]; a letter may name one dim of each input"),
    (lambda: plan_einsum("ij,jk,kl->il", [A, B], "c"), EinsumError, r"has 3 inputs but 2 tensors are given"),
    (lambda: plan_einsum("ijk,jk->i", [A, B], "c"), EinsumError,
     r"input 0 \('a'\) has shape \(4, 6\) \(2 dims\) but its subscripts 'ijk' name 3; give one letter per dim"),
    (lambda: plan_einsum("ij,jk->ik", [A, decl("b", (6, 5), (None, "y"), dtype="float64")], "c"), EinsumError,
     r"einsum inputs have dtypes \['float32', 'float64'\]; the local einsum needs one dtype"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "a"), EinsumError, r"input 'a' has the name the program gives the output"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "c", strategy="fastest"), EinsumError, r"unknown strategy 'fastest'"),
    (lambda: plan_einsum("ij,jk->ik", [decl("a", (4, 6), ("x", None), partial=("y",)), decl("a~sum", (6, 5), ())],
                         "c"), EinsumError, r"input 'a~sum' has the name the program gives the sum of Partial input 'a'"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "c", Sharding(MESH, (None, None, "x"))), InvalidShardingError,
     r"spec P\(None, None, 'x'\) has 3 entries but the tensor has 2 dims \(4, 5\)"),
    (lambda: Sharding(MESH, ("x", "x")), InvalidShardingError,
     r"axis 'x' splits dim 1 but is already used by dim 0; a mesh axis may split at most one tensor dim"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "c", layout={"i": "x", "j": "x"}), EinsumError,
     r"layout splits letters 'i' \(size 4\) and 'j' \(size 6\) over axis 'x'; tensor 'ij' would have two dims on "
     r"axis 'x'; a mesh axis may split at most one dim of the op"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "c", layout={"i": "x", "k": "x"}), EinsumError,
     r"layout splits letters 'i' \(size 4\) and 'k' \(size 5\) over axis 'x'; tensor 'ik' would have two dims"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "c", layout={"q": "x"}), EinsumError,
     r"layout names letter\(s\) \['q'\], which einsum 'ij,jk->ik' does not have"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "c", layout={"i": "w"}), EinsumError,
     r"layout splits letter 'i' over 'w', which is not an axis of the compute mesh"),
    (lambda: plan_einsum("ij,jk->ik", [A, B], "c", Sharding(MESH, ("x", None), partial=("y",)),
                         layout={"i": "x"}), EinsumError,
     r"out_sharding P\('x', None\) \+ partial\(y\) on \(x=2, y=2\) is Partial over \['y'\], but layout \{i: x\}"),
    (lambda: plan_einsum("i,j->ij", [decl("a", (4,), ("x",)), decl("b", (5,), (None,))], "c",
                         Sharding(MESH, ("x", None), partial=("y",))), EinsumError,
     r"no layout of einsum 'i,j->ij' on the meshes of its inputs and output can give out_sharding as asked"),
])
def test_errors_name_the_rule_the_letter_and_the_sizes(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("k, steps, reduced", [
    # the output is small: the addends of a go through the einsum and the output is all-reduced over y
    (4, {"compute einsum": 4, "reduce replicate": 2}, "c~partial"),
    # the output is large: a is summed first (over y, its Partial axis), then the einsum needs no reduction
    (4096, {"reduce replicate": 2, "compute einsum": 4}, "a"),
])
def test_a_partial_input_is_summed_first_or_carried_into_the_output_whichever_is_cheaper(k, steps, reduced):
    a = decl("a", (64, 64), ("x", None), partial=("y",))
    b = decl("b", (64, k), (None, None))
    program = plan_einsum("ij,jk->ik", [a, b], "c", topology=TOPOLOGY)
    assert kinds(program) == steps and not moved(program)
    assert {s.inputs[0].tensor for s in program.steps if s.kind == REDUCE} == {reduced}
    assert program.tensor("c").dst.spec_str() == "P('x', None)"


def test_a_partial_input_and_a_partial_output_over_one_axis_need_no_reduction():
    a = decl("a", (64, 64), ("x", None), partial=("y",))
    b = decl("b", (64, 8), (None, None))
    program = plan_einsum("ij,jk->ik", [a, b], "c", Sharding(MESH, ("x", None), partial=("y",)), topology=TOPOLOGY)
    assert kinds(program) == {"compute einsum": 4} and not moved(program)


def test_a_partial_input_whose_axis_splits_a_letter_is_summed_first():
    a = decl("a", (8, 6), ("x", None), partial=("y",))
    b = decl("b", (6, 5), ("y", None))
    program = plan_einsum("ij,jk->ik", [a, b], "c", topology=TOPOLOGY, layout={"i": "x", "j": "y"})
    first = program.steps[0]
    assert (first.kind, first.inputs[0].tensor, first.output.tensor) == (REDUCE, "a", "a~sum")
    assert all(r.tensor != "a" for s in program.steps if s.kernel == "einsum" for r in s.inputs)


def test_an_input_used_twice_is_laid_out_once():
    a = decl("a", (6, 6), ("x", "y"))
    program = plan_einsum("ij,jk->ik", [a, a], "c", topology=TOPOLOGY)  # a @ a: one set of buffers
    assert [t.name for t in program.tensors if t.src is not None] == ["a"]
    with pytest.raises(EinsumError, match=r"input 'a' is used as 'ij' and as 'jk', which layout .* cuts differently"):
        plan_einsum("ij,jk->ik", [a, a], "c", layout={"i": "x"})


# -- kernel shape rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel, shapes, params, want", [
    ("einsum", [(2, 3), (3, 4)], {"equation": "ij,jk->ik"}, (2, 4)),
    ("einsum", [(2, 0), (0, 4)], {"equation": "ij,jk->ik"}, (2, 4)),  # an empty summed dim: zeros
    ("einsum", [(5, 2, 3), (5, 3, 4)], {"equation": "bij,bjk"}, (2, 4)),  # implicit: letters used once, so b sums
    ("einsum", [(2,), (3,), (4,)], {"equation": "i,j,k->kji"}, (4, 3, 2)),
    ("add", [(2, 3), (2, 3)], {}, (2, 3)),
    ("scale", [(0, 3)], {"factor": "0.5"}, (0, 3)),
    ("relu_grad", [(2, 3), (2, 3)], {}, (2, 3)),
    ("axpy", [(4,), (4,)], {"alpha": "1e-3"}, (4,)),
    ("sum", [(2, 3, 4)], {"dims": "0,2"}, (3,)),
    ("max", [(2, 3, 4)], {"dims": "-1"}, (2, 3)),
    ("softmax_xent", [(8, 10), (8, 10)], {}, (8,)),
    ("softmax_xent", [(8, 10), (8, 10)], {"axis": "0"}, (10,)),
    ("softmax_xent_grad", [(8, 10), (8, 10)], {"scale": "0.125"}, (8, 10)),
])
def test_kernel_shapes(kernel, shapes, params, want):
    assert KERNELS[kernel].output_shape(tuple(shapes), params) == want


@pytest.mark.parametrize("kernel, shapes, params, message", [
    ("einsum", [(2, 3), (4, 5)], {"equation": "ij,jk->ik"},
     r"dim letter 'j' has size 3 in input 0 \(shape \(2, 3\)\) but 4 in input 1 \(shape \(4, 5\)\)"),
    ("einsum", [(2, 3)], {}, r"einsum needs parameter\(s\) \['equation'\]"),
    ("einsum", [(2, 3)], {"equation": "ij->ij", "optimize": "1"}, r"einsum takes parameters \['equation'\]; got "
                                                                    r"unknown \['optimize'\]"),
    ("add", [(2, 3), (3, 2)], {}, r"add: a has shape \(2, 3\) but b has shape \(3, 2\)"),
    ("scale", [(2,)], {"factor": "lots"}, r"scale parameter factor='lots' is not a finite number"),
    ("scale", [(2,)], {"factor": "nan"}, r"is not a finite number"),
    ("axpy", [(2,), (2,)], {}, r"axpy needs parameter\(s\) \['alpha'\]"),
    ("sum", [(2, 3)], {"dims": "2"}, r"sum over dims '2': dim 2 is not a dim of a 2-dim tile"),
    ("max", [(2, 3)], {"dims": "0,-2"}, r"max over dims '0,-2' names a dim twice"),
    ("sum", [(2, 3)], {"dims": "rows"}, r"is not a comma-separated list of dim indices"),
    ("softmax_xent", [(8, 10), (8, 9)], {}, r"softmax_xent: logits has shape \(8, 10\) but targets has shape \(8, 9\)"),
])
def test_kernel_shape_errors(kernel, shapes, params, message):
    with pytest.raises(KernelShapeError, match=message):
        KERNELS[kernel].output_shape(tuple(shapes), params)


def test_a_program_with_a_kernel_of_the_wrong_arity_is_refused():
    inputs = [decl("a", (4, 6), ("x", None)), decl("b", (6, 5), ("x", None))]
    program = plan_einsum("ij,jk->ik", inputs, "c", topology=TOPOLOGY)
    step = next(s for s in program.steps if s.kernel == "einsum")
    bad = Program(program.tensors, tuple(s if s is not step else type(s)(
        s.id, s.kind, s.after, kernel="relu", device=s.device, inputs=s.inputs, output=s.output)
        for s in program.steps), program.strategy, program.topology)
    with pytest.raises(PlanValidationError, match=r"kernel 'relu' reads 1 input tile\(s\) and writes one output; the "
                                                  r"step names 2 input\(s\)"):
        bad.validate()
    assert str(KERNELS["einsum"]) == "einsum/1+" and KERNELS["einsum"].takes(3)


@pytest.mark.parametrize("equation, operands, out", [
    ("ij,jk->ik", ("ij", "jk"), "ik"),
    ("ij,jk", ("ij", "jk"), "ik"),
    ("ba,Ab", ("ba", "Ab"), "Aa"),  # implicit: the letters used once, sorted as numpy sorts them
    (" ij , jk -> ki ", ("ij", "jk"), "ki"),
])
def test_parse_equation(equation, operands, out):
    assert parse_equation(equation) == (operands, out)


def test_a_layout_prints_as_rules():
    assert str(Layout(MESH, "ijk", (("x",), (), ("y",)))) == "{i: x, k: y} on (x=2, y=2)"
    assert str(Layout(MESH, "ij", ((), ("y", "x")))) == "{j: (y, x)} on (x=2, y=2)"
    assert Layout(MESH, "ijk", (("x",), (), ("y",))).sharding("ki").spec_str() == "P('y', 'x')"


# -- one operand ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eq, spec, layout, groups, out_spec", [
    # the summed dim split over x: local sums, all-reduced over the devices that differ only in x
    ("ij->i", (None, "x"), "{j: x} on (x=2, y=2)", {("h0/0", "h2/0"), ("h1/0", "h3/0")}, "P(None)"),
    ("ij->", ("x", "y"), "{i: x, j: y} on (x=2, y=2)", {("h0/0", "h1/0", "h2/0", "h3/0")}, "P()"),
    # a transpose: each device transposes its tile, and the output keeps the input's splits
    ("ij->ji", ("x", "y"), "{i: x, j: y} on (x=2, y=2)", set(), "P('y', 'x')"),
    ("ij", ("x", None), "{i: x} on (x=2, y=2)", set(), "P('x', None)"),  # implicit: the letters, sorted
])
def test_one_operand_einsum_sums_or_transposes_with_the_reductions_of_any_other(eq, spec, layout, groups, out_spec):
    program = plan_einsum(eq, [decl("a", (6, 4), spec)], "c", topology=TOPOLOGY)
    assert str(program.einsum_layout) == layout and not moved(program)
    assert kinds(program) == {"compute einsum": 4, **({"reduce replicate": len(groups)} if groups else {})}
    assert {tuple(s.devices) for s in program.steps if s.kind == REDUCE} == groups
    assert program.tensor("c").dst.spec_str() == out_spec


def test_one_operand_with_a_diagonal_is_refused_naming_the_rule():
    with pytest.raises(EinsumError, match=r"einsum 'ii->i': input 0 \('ii'\) repeats letter\(s\) \['i'\]; a letter may "
                                          r"name one dim of each input \(diagonals are not supported\)"):
        plan_einsum("ii->i", [decl("a", (4, 4), (None, None))], "c")


# -- equation length ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("check", [
    lambda eq: parse_equation(eq),
    lambda eq: plan_einsum(eq, [A, B], "c"),
    lambda eq: KERNELS["einsum"].output_shape(((2, 3), (3, 4)), {"equation": eq}),  # what every agent checks
], ids=["parse", "plan", "kernel"])
def test_a_megabyte_equation_is_refused_at_once_naming_the_cap(check):
    equation = "ij,jk->ik" + "k" * (2**20 - 9)
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        check(equation)
    assert time.perf_counter() - start < 0.1
    assert str(info.value) == (
        f"einsum equation 'ij,jk->ikkkkkkkkkkkkkkkkkkkkkkkk'... is {2**20} characters long, but an equation may be at "
        f"most {MAX_EQUATION_CHARS} characters (an operand names each of the 52 letters at most once, so a real one "
        f"is far shorter); name each dim once per operand")


def test_an_equation_at_the_cap_is_checked_and_one_past_it_refused():
    eq = ",".join([string.ascii_lowercase] * 19)  # 19 operands of 26 letters: 512 characters, every letter summed
    assert len(eq) == MAX_EQUATION_CHARS
    assert parse_equation(eq) == ((string.ascii_lowercase,) * 19, "")
    with pytest.raises(KernelShapeError, match=rf"is {MAX_EQUATION_CHARS + 1} characters long, but an equation"):
        parse_equation(eq + " ")


# -- the program carries its layout -----------------------------------------------------------------------


def test_the_layout_is_a_declared_field_outside_the_id_json_and_equality():
    program = plan_einsum("ij,jk->ik", [A, B], "c", topology=TOPOLOGY)
    assert "einsum_layout" in {f.name for f in dataclasses.fields(Program)}
    assert program.einsum_layout == Layout(MESH, "ijk", (("x",), (), ("y",)))
    assert program.einsum_layout_text == "{i: x, k: y} on (x=2, y=2)"
    read = Program.from_json(program.dumps())
    assert (read.einsum_layout, read.einsum_layout_text) == (None, "") and read == program and read.id == program.id
    assert "einsum_layout" not in program.dumps()
    copied = dataclasses.replace(program, strategy=program.strategy)
    assert copied.einsum_layout == program.einsum_layout and copied.id == program.id
    as_text = dataclasses.replace(read, einsum_layout_text="{i: x, k: y} on (x=2, y=2)")  # what a client holds
    assert as_text.einsum_layout_text == program.einsum_layout_text and as_text.einsum_layout is None
    with pytest.raises(PlanValidationError, match=r"einsum_layout_text '\{i: x\} on \(x=2, y=2\)' is not the text of "
                                                  r"einsum_layout '\{i: x, k: y\} on \(x=2, y=2\)'"):
        dataclasses.replace(program, einsum_layout_text="{i: x} on (x=2, y=2)")
