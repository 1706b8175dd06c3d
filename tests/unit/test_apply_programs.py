"""Elementwise and reduction programs (`reshard.einsum.plan_apply`) run for real on the agents' runtime.

Each case puts its inputs in their layouts on several in-process hosts, plans, runs, commits
and reads the output back; it must equal numpy's result. Inputs in different layouts are
moved to a common one first; ``sum`` and ``max`` over a dim split across devices are
completed by a reduce (op ``sum`` or ``max``); a sum over every dim gives a scalar.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.einsum import EinsumError, plan_apply, plan_einsum
from reshard.program import MOVE, REDUCE, TensorDecl

from .test_einsum_programs import memory_hosts, put_addends, read_back, run_planned  # noqa: F401 - fixture
from .test_runtime import HOSTS

_NAMES = itertools.count()
MESH = Mesh.from_hosts({"x": 2, "y": 2}, HOSTS[:2], 2)
ROWS, COLS, WHOLE = Sharding(MESH, ("x", "y")), Sharding(MESH, ("y", "x")), Sharding(MESH, (None, None))


def run_apply(cluster, op, arrays, shardings, params=None, out_sharding=None):
    program, _, got = run_planned(cluster, arrays, shardings,
                                  lambda decls, out: plan_apply(op, decls, out, params, out_sharding))
    return program, got


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


RNG = np.random.default_rng(7)
A, B = RNG.normal(size=(6, 5)), RNG.normal(size=(6, 5))
T = np.eye(5)[RNG.integers(0, 5, 6)]
CASES = [
    ("add", [A, B], {}, A + B),
    ("sub", [A, B], {}, A - B),
    ("mul", [A, B], {}, A * B),
    ("scale", [A], {"factor": 0.5}, 0.5 * A),
    ("relu", [A], {}, np.maximum(A, 0)),
    ("relu_grad", [A, B], {}, np.where(A > 0, B, 0)),
    ("axpy", [A, B], {"alpha": 0.1}, A - 0.1 * B),
    ("sum", [A], {"dims": [0]}, A.sum(0)),
    ("sum", [A], {"dims": [1]}, A.sum(1)),
    ("sum", [A], {"dims": [0, 1]}, A.sum()),
    ("max", [A], {"dims": [0]}, A.max(0)),
    ("max", [A], {"dims": [0, 1]}, A.max()),
    ("softmax_xent", [A, T], {}, -(T * np.log(_softmax(A))).sum(-1)),
    ("softmax_xent_grad", [A, T], {"scale": 1 / 6}, (_softmax(A) - T) / 6),
]


@pytest.mark.parametrize("layouts", [(ROWS, ROWS), (ROWS, COLS), (WHOLE, COLS)], ids=["same", "differ", "whole"])
@pytest.mark.parametrize("op,arrays,params,want", CASES, ids=[f"{c[0]}{c[2].get('dims', '')}" for c in CASES])
def test_ops_equal_numpy(memory_hosts, op, arrays, params, want, layouts):
    program, got = run_apply(memory_hosts, op, arrays, layouts[:len(arrays)], params)
    assert got.shape == np.shape(want)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if layouts == (ROWS, ROWS) and not op.startswith("softmax"):
        assert not any(s.kind == MOVE for s in program.steps), program.summary()
    if op in ("sum", "max") and layouts[0] == ROWS:
        assert {s.op for s in program.steps if s.kind == REDUCE} == {op}


def test_softmax_needs_its_class_dim_whole(memory_hosts):
    program, got = run_apply(memory_hosts, "softmax_xent", [A, T], [ROWS, ROWS])
    assert program.einsum_layout.of("b") == (), "the class dim is split over y in the inputs; it must be gathered"
    np.testing.assert_allclose(got, -(T * np.log(_softmax(A))).sum(-1), rtol=1e-12)


def test_a_partial_input_is_summed_before_a_nonlinear_op(memory_hosts):
    partial = Sharding(MESH, ("x", None), partial=("y",))
    program, got = run_apply(memory_hosts, "relu", [A], [partial])
    np.testing.assert_allclose(got, np.maximum(A, 0), rtol=1e-12)
    program, got = run_apply(memory_hosts, "scale", [A], [partial], {"factor": 2}, out_sharding=partial)
    assert not any(s.kind == REDUCE for s in program.steps), "a linear op carries the addends through"
    np.testing.assert_allclose(got, 2 * A, rtol=1e-12)


def test_scalar_einsum(memory_hosts):
    k = next(_NAMES)
    for i, a in enumerate((A, B)):
        put_addends(memory_hosts, f"sc{k}_{i}", a, ROWS, np.random.default_rng(k))
    decls = [TensorDecl(f"sc{k}_{i}", A.shape, "float64", ROWS) for i in range(2)]
    program = plan_einsum("ij,ij->", decls, f"scout{k}")
    job, runs = memory_hosts.start(program.dumps(), f"scout{k}")
    memory_hosts.finish(job, runs)
    got = read_back(memory_hosts, f"scout{k}", program.tensor(f"scout{k}").dst, ())
    np.testing.assert_allclose(got, (A * B).sum(), rtol=1e-12)


@pytest.mark.parametrize("op,shapes,params,message", [
    ("add", [(6, 5), (6, 4)], {}, r"add: input 't0' has shape \(6, 5\) but 't1' has shape \(6, 4\) \(dim 1: 5 vs 4\)"),
    ("add", [(6, 5), (6, 5, 1)], {}, r"shape"),
    ("sum", [(6, 5)], {"dims": [2]}, r"dims"),
    ("nosuch", [(6, 5)], {}, r"unknown op 'nosuch'"),
    ("relu", [(6, 5), (6, 5)], {}, r"relu takes 1"),
    ("axpy", [(6, 5), (6, 5)], {}, r"alpha"),
])
def test_bad_input_is_named(op, shapes, params, message):
    decls = [TensorDecl(f"t{i}", s, "float64", Sharding(MESH, [None] * len(s))) for i, s in enumerate(shapes)]
    with pytest.raises(EinsumError, match=message):
        plan_apply(op, decls, "out", params)


def test_max_cannot_be_left_partial():
    decls = [TensorDecl("t", (6, 5), "float64", ROWS)]
    with pytest.raises(EinsumError, match="max over dims cannot be left pending"):
        plan_apply("max", decls, "out", {"dims": [0]}, Sharding(MESH, (None,), partial=("x",)))
