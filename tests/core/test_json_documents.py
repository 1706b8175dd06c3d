"""Malformed JSON documents: each ``from_json`` raises its own ``ValueError`` subclass naming the field.

A table of one-field mistakes (wrong type, missing, null, list for object), then
hypothesis: arbitrary JSON values, and valid documents with one node replaced by
an arbitrary value or removed, read by every reader. A reader either succeeds or
raises a `ReshardError` that is a ``ValueError``, never a ``TypeError``,
``KeyError`` or ``AttributeError``; what it reads then validates or fails the
same way.
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import Mesh, Plan, Program, Sharding, Step, TensorDecl, TileRef, Topology, Transfer, plan
from reshard.errors import (
    InvalidJsonError,
    InvalidMeshError,
    InvalidShapeError,
    InvalidShardingError,
    InvalidTopologyError,
    PlanValidationError,
    ReshardError,
    UnknownDtypeError,
)
from reshard import many
from reshard.program import SRC

MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["a", "b"], 2)
SHARDING = Sharding(MESH, ("x", None)).to_json()
PLAN = plan((8, 6), "float32", Sharding(MESH, ("x", None)), Sharding(MESH, (None, "y")), strategy="broadcast").to_json()
WHOLE = ((0, 8), (0, 6))
GENERAL = Program(
    (TensorDecl("g", (8, 6), "float32", src=Sharding(MESH, (None, None))), TensorDecl("t", (8, 6), "float32")),
    (Step.compute(0, "copy", "a/0", [TileRef("g", SRC, WHOLE)], TileRef("g", "p", WHOLE)),
     Step.reduce(1, "sum", ["a/0", "b/0"], TileRef("g", SRC, WHOLE), TileRef("t", "r", WHOLE), result="shard", dim=0),
     Step.move(2, Transfer(((0, 4), (0, 6)), "a/0", ("a/1",), "local"), after=[1], tensor="t")),
    "custom").validate().to_json()
PROGRAM = Program.from_plan(Plan.from_json(PLAN)).to_json()


def _with(doc: dict, path: tuple, value=...) -> dict:
    """``doc`` with the node at ``path`` replaced by ``value``, or removed when no value is given."""
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


READERS = {"mesh": Mesh.from_json, "sharding": Sharding.from_json, "plan": Plan.from_json,
           "program": Program.from_json, "topology": Topology.from_json}

# (name, reader, document, error, message)
MALFORMED = [
    ("mesh: null", "mesh", None, InvalidMeshError, r"^mesh JSON must be a JSON object \{\.\.\.\}; got null$"),
    ("mesh: no axes", "mesh", {"devices": None}, InvalidMeshError,
     r"^mesh JSON lacks the field 'axes', which must be a JSON array"),
    ("mesh: axes an object", "mesh", {"axes": {"x": 2}}, InvalidMeshError,
     r"^mesh JSON field 'axes' must be a JSON array \[\.\.\.\]; got an object \{'x': 2\}$"),
    ("mesh: an axis a string", "mesh", {"axes": ["x2"]}, InvalidMeshError,
     r"^mesh JSON axis 0 \(a \[name, size\] pair\) must be a JSON array \[\.\.\.\]; got a string 'x2'$"),
    ("mesh: an axis of three", "mesh", {"axes": [["x", 2, 3]]}, InvalidMeshError, r"is not a \(name, size\) pair"),
    ("mesh: a size of the wrong type", "mesh", {"axes": [["x", "2"]]}, InvalidMeshError,
     r"mesh axis 'x' has size '2'; axis sizes must be positive integers"),
    ("mesh: devices a number", "mesh", {"axes": [["x", 2]], "devices": 5}, InvalidMeshError,
     r"^mesh JSON field 'devices' \(device ids, or null for an abstract mesh\) must be a JSON array"),
    ("mesh: a device a number", "mesh", {"axes": [["x", 2]], "devices": ["a/0", 1]}, InvalidMeshError,
     r"device id 1 is not a string"),
    ("sharding: a list", "sharding", [], InvalidShardingError, r"^sharding JSON must be a JSON object .*; got an array"),
    ("sharding: mesh null", "sharding", _with(SHARDING, ("mesh",), None), InvalidShardingError,
     r"^sharding JSON field 'mesh' must be a JSON object \{\.\.\.\}; got null$"),
    ("sharding: no spec", "sharding", _with(SHARDING, ("spec",)), InvalidShardingError,
     r"^sharding JSON lacks the field 'spec', which must be a JSON array"),
    ("sharding: a spec entry a number", "sharding", _with(SHARDING, ("spec", 0), 3), InvalidShardingError,
     r"^sharding JSON spec entry 0 \(the axes that split dim 0\) must be a JSON array .*; got an integer 3$"),
    ("sharding: an axis a number", "sharding", _with(SHARDING, ("spec", 0), [1]), InvalidShardingError,
     r"spec entry \(1,\) for dim 0 must be None, an axis name or a tuple of axis names"),
    ("plan: null", "plan", None, PlanValidationError, r"^plan JSON must be a JSON object \{\.\.\.\}; got null$"),
    ("plan: a list", "plan", [], PlanValidationError, r"^plan JSON must be a JSON object"),
    ("plan: text null", "plan", "null", PlanValidationError, r"^plan JSON must be a JSON object"),
    ("plan: text too deep", "plan", "[" * 100_000, InvalidJsonError, r"^plan JSON nests .* more than 32 levels"),
    ("plan: version true", "plan", _with(PLAN, ("version",), True), PlanValidationError,
     r"^plan JSON version True is not supported; this reshard reads version 1$"),
    ("plan: shape a string", "plan", _with(PLAN, ("shape",), "8,6"), PlanValidationError,
     r"^plan JSON field 'shape' must be a JSON array \[\.\.\.\]; got a string '8,6'$"),
    ("plan: a size a float", "plan", _with(PLAN, ("shape", 0), 8.0), InvalidShapeError,
     r"dim 0 of shape \(8\.0, 6\) has size 8\.0"),
    ("plan: 65 dims", "plan", _with(PLAN, ("shape",), [1] * 65), InvalidShapeError,
     r"shape has 65 dims; a tensor has at most 64"),
    ("plan: a size of 2**63", "plan", _with(PLAN, ("shape", 0), 2**63), InvalidShapeError,
     r"every dim size must be a positive integer \(below 2\*\*63\)"),
    ("plan: dtype a list", "plan", _with(PLAN, ("dtype",), ["float32"]), PlanValidationError,
     r"^plan JSON field 'dtype' must be a string; got an array \['float32'\]$"),
    ("plan: an unknown dtype", "plan", _with(PLAN, ("dtype",), "float8"), UnknownDtypeError, r"unknown dtype 'float8'"),
    ("plan: no transfers", "plan", _with(PLAN, ("transfers",)), PlanValidationError,
     r"^plan JSON lacks the field 'transfers'"),
    ("plan: a transfer null", "plan", _with(PLAN, ("transfers", 1), None), PlanValidationError,
     r"^plan JSON transfer 1 must be a JSON object \{\.\.\.\}; got null$"),
    ("plan: a box bound a string", "plan", _with(PLAN, ("transfers", 0, "box", 1, 0), "0"), PlanValidationError,
     r"^plan JSON transfer 0 field 'box' dim 1 lo must be an integer; got a string '0'$"),
    ("plan: a box dim of three", "plan", _with(PLAN, ("transfers", 0, "box", 0), [0, 1, 2]), PlanValidationError,
     r"^plan JSON transfer 0 field 'box' dim 0 must be a \[lo, hi\] pair; got an array \[0, 1, 2\]$"),
    ("plan: a receiver a number", "plan", _with(PLAN, ("transfers", 0, "receivers"), [7]), PlanValidationError,
     r"^plan JSON transfer 0 field 'receivers' item 0 must be a string; got an integer 7$"),
    ("plan: phase a float", "plan", _with(PLAN, ("transfers", 0, "phase"), 0.5), PlanValidationError,
     r"^plan JSON transfer 0 field 'phase' must be an integer; got a number 0\.5$"),
    ("plan: topology a list", "plan", _with(PLAN, ("topology",), []), PlanValidationError,
     r"^plan JSON field 'topology' must be a JSON object"),
    ("plan: an id of the wrong type", "plan", _with(PLAN, ("id",), [1]), PlanValidationError,
     r"^plan JSON claims id \[1\] but its content hashes to [0-9a-f]{64}; it was altered$"),
    ("program: steps an object", "program", _with(GENERAL, ("steps",), {}), PlanValidationError,
     r"^program JSON field 'steps' must be a JSON array"),
    ("program: an unknown step kind", "program", _with(GENERAL, ("steps", 0, "kind"), "einsum"), PlanValidationError,
     r"^program JSON step 0 field 'kind' is 'einsum', not one of \['move', 'compute', 'reduce'\]$"),
    ("program: a step id a string", "program", _with(GENERAL, ("steps", 0, "id"), "0"), PlanValidationError,
     r"^program JSON step 0 field 'id' must be an integer; got a string '0'$"),
    ("program: after a number", "program", _with(GENERAL, ("steps", 2, "after"), 1), PlanValidationError,
     r"^program JSON step 2 field 'after' must be a JSON array"),
    ("program: an input null", "program", _with(GENERAL, ("steps", 0, "inputs", 0), None), PlanValidationError,
     r"^program JSON step 0 input 0 must be a JSON object \{\.\.\.\}; got null$"),
    ("program: a param a number", "program", _with(GENERAL, ("steps", 0, "params"), {"k": 1}), PlanValidationError,
     r"^program JSON step 0 param 'k' must be a string; got an integer 1$"),
    ("program: an output box missing", "program", _with(GENERAL, ("steps", 1, "output", "box")), PlanValidationError,
     r"^program JSON step 1 field 'output' lacks the field 'box'"),
    ("program: dim a string", "program", _with(GENERAL, ("steps", 1, "dim"), "0"), PlanValidationError,
     r"^program JSON step 1 field 'dim' must be an integer; got a string '0'$"),
    ("program: devices a string", "program", _with(GENERAL, ("steps", 1, "devices"), "a/0"), PlanValidationError,
     r"^program JSON step 1 field 'devices' must be a JSON array"),
    ("program: a tensor's src null", "program", _with(GENERAL, ("tensors", 0, "src"), None), PlanValidationError,
     r"^program JSON tensor 0 field 'src' must be a JSON object \{\.\.\.\}; got null$"),
    ("program: a tensor name a number", "program", _with(GENERAL, ("tensors", 1, "name"), 1), PlanValidationError,
     r"^program JSON tensor 1 field 'name' must be a string; got an integer 1$"),
    ("program: kind missing, fields listed", "program", {"steps": 1, "tensors": 2}, PlanValidationError,
     r"JSON with kind None and fields \['steps', 'tensors'\] is neither a program"),
    ("program: a move's tensor missing", "program", _with(PROGRAM, ("steps", 0, "tensor")), PlanValidationError,
     r"^program JSON step 0 lacks the field 'tensor', which must be a string$"),
    ("topology: a list", "topology", [], InvalidTopologyError, r"^topology JSON must be a JSON object"),
    ("topology: per-host NICs a list", "topology", {"host_nic_gbps": [["a", 1]]}, InvalidTopologyError,
     r"^topology JSON field 'host_nic_gbps' must be a JSON object"),
    ("topology: an infinite NIC", "topology", {"nic_gbps": float("inf")}, InvalidTopologyError,
     r"nic_gbps is inf; bandwidths must be positive numbers of Gbit/s, and finite"),
    ("topology: a NIC a string", "topology", {"host_nic_gbps": {"a": "10"}}, InvalidTopologyError,
     r"host_nic_gbps\['a'\] is '10'; bandwidths must be positive numbers"),
]


@pytest.mark.parametrize("reader,document,error,message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_documents(reader, document, error, message):
    with pytest.raises(error, match=message) as e:
        READERS[reader](document)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ReshardError)


def test_the_documents_the_core_writes_read_back():
    assert Sharding.from_json(SHARDING).to_json() == SHARDING
    assert Plan.from_json(json.dumps(PLAN)).to_json() == PLAN
    assert Program.from_json(GENERAL).to_json() == GENERAL
    assert Program.from_json(PLAN).to_json() == PROGRAM


def test_text_of_any_size_reads_but_not_of_any_depth():
    # A planner's plan of 256 devices is some 10 MiB: trusted text (a reply, a stored plan) has no size limit.
    padded = json.dumps(PLAN) + " " * (5 * 2**20)
    assert Plan.from_json(padded).to_json() == PLAN
    assert Program.from_json(padded.encode()).to_json() == PROGRAM
    with pytest.raises(InvalidJsonError, match=r"^program JSON nests arrays and objects more than 32 levels"):
        Program.from_json("[" * 10**6)


# -- any value, and valid documents with one node changed --------------------------------------------------------

NAMES = st.sampled_from(["x", "y", "a/0", "a/1", "b/0", "b", "float32", "p2p", "local", "src", "g", "t", "sum",
                         "shard", "ring", "copy", "move", "compute", "reduce", "program", ""])
SCALARS = (st.none() | st.booleans() | st.integers(-3, 10) | st.sampled_from([2**40, -2**63, 2**64, 1e300, 0.5])
           | st.floats() | NAMES | st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES, inner, max_size=4),
                      max_leaves=20)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*path, i))


@st.composite
def mutants(draw, doc):
    """``doc`` with one node replaced by an arbitrary value, or removed from its object or array."""
    path = draw(st.sampled_from([p for p in _paths(doc) if p]))
    if draw(st.integers(0, 4)) == 0:
        return _with(doc, path)
    return _with(doc, path, draw(VALUES))


def _reads_cleanly(reader, document) -> None:
    try:
        made = reader(document)
        if isinstance(made, (Plan, Program)):
            made.validate()
            made.id  # noqa: B018 - hashing reads every field
            str(made)
    except ReshardError as e:
        assert isinstance(e, ValueError), f"{type(e).__name__} is not a ValueError: {e}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(READERS)), VALUES)
def test_any_json_value_reads_or_raises_a_value_error(reader, value):
    _reads_cleanly(READERS[reader], value)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from([("mesh", SHARDING["mesh"]), ("sharding", SHARDING), ("plan", PLAN), ("program", GENERAL),
                        ("program", PROGRAM), ("topology", PLAN["topology"])]).flatmap(
    lambda r: st.tuples(st.just(r[0]), mutants(r[1]))))
def test_a_valid_document_with_one_node_changed_reads_or_raises_a_value_error(case):
    reader, document = case
    _reads_cleanly(READERS[reader], document)


def test_a_program_reads_each_distinct_sharding_once_and_back_to_the_same_program():
    rows = Sharding(MESH, ("x", None))
    cols = Sharding(MESH, (None, "y"))
    decls = [TensorDecl(f"t{i}", (8, 6), "float32", rows, cols if i % 2 else rows) for i in range(6)]
    program = many.plan_many(decls)
    again = many.program_from_json(json.loads(program.dumps()))
    assert again.id == program.id and again.tensors == program.tensors
    # the tensors share the Sharding objects of their layouts, one per distinct JSON value
    assert len({id(t.src) for t in again.tensors}) == 1
    assert len({id(t.dst) for t in again.tensors}) == 2
