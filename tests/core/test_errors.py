"""Bad input raises a `ValueError` subclass whose message states the rule, the value and the way out.

Also the other vocabularies (Mesh-TensorFlow layout rules, DTensor placements),
which must mean exactly what the equivalent spec means, and the printed notation.
"""

from __future__ import annotations

import dataclasses

import pytest

from reshard import (
    InvalidMeshError,
    InvalidShapeError,
    InvalidShardingError,
    InvalidTopologyError,
    Mesh,
    ReshardError,
    Replicate,
    Shard,
    Sharding,
    Topology,
    UnknownDtypeError,
    plan,
)

MESH = Mesh({"x": 2, "y": 2}, ["a/0", "a/1", "b/0", "b/1"])
OTHER = Mesh({"x": 2, "y": 2}, ["c/0", "c/1", "d/0", "d/1"])
GOOD = Sharding(MESH, ("x", None))
GOOD_DST = Sharding(OTHER, (None, "y"))

# (name, call, error type, the message: rule, offending value and valid options)
BAD_INPUT = [
    ("unknown axis", lambda: Sharding(MESH, ("z", None)), InvalidShardingError,
     r"dim 0 is split over unknown axis 'z'; the mesh's axes are \['x', 'y'\]"),
    ("unknown axis inside a tuple", lambda: Sharding(MESH, (("x", "w"),)), InvalidShardingError,
     r"unknown axis 'w'; the mesh's axes are \['x', 'y'\]"),
    ("axis used by two dims", lambda: Sharding(MESH, ("x", "x")), InvalidShardingError,
     r"axis 'x' splits dim 1 but is already used by dim 0; a mesh axis may split at most one tensor dim"),
    ("axis twice in one tuple", lambda: Sharding(MESH, (("y", "y"), None)), InvalidShardingError,
     r"axis 'y' splits dim 0 but is already used by the same dim; a mesh axis may split at most one tensor dim, once"),
    ("spec is a bare string", lambda: Sharding(MESH, "x"), InvalidShardingError,
     r"spec 'x' must be a sequence with one entry per tensor dim, each None, an axis name or a tuple"),
    ("spec entry of the wrong type", lambda: Sharding(MESH, (0, None)), InvalidShardingError,
     r"spec entry 0 for dim 0 must be None, an axis name or a tuple of axis names"),
    ("spec longer than the shape", lambda: Sharding(MESH, ("x", None, None)).tile((4, 4), 0), InvalidShardingError,
     r"spec P\('x', None, None\) has 3 entries but the tensor has 2 dims \(4, 4\); give at most one entry per dim"),
    ("spec longer than the shape, planned", lambda: plan((4,), "float32", GOOD, GOOD_DST), InvalidShardingError,
     r"has 2 entries but the tensor has 1 dims \(4,\); give at most one entry per dim"),
    ("too few devices", lambda: Mesh({"x": 2, "y": 2}, ["a/0", "a/1", "b/0"]), InvalidMeshError,
     r"mesh \(x=2 x y=2\) has 4 positions but 3 devices were given; list exactly 4 device ids"),
    ("too many devices", lambda: Mesh({"x": 2}, ["a/0", "a/1", "a/2"]), InvalidMeshError,
     r"has 2 positions but 3 devices were given; list exactly 2 device ids, row-major"),
    ("duplicate devices", lambda: Mesh({"x": 3}, ["a/0", "b/0", "a/0"]), InvalidMeshError,
     r"devices \['a/0'\] appear more than once in the mesh; each device may hold one position"),
    ("device id without a slash", lambda: Mesh({"x": 2}, ["gpu0", "a/1"]), InvalidMeshError,
     r"device id 'gpu0' has no host: a device id is 'HOST/INDEX' with a non-empty host and index, e.g. 'node3/1'"),
    ("device id with an empty host", lambda: Mesh({"x": 2}, ["/0", "a/1"]), InvalidMeshError,
     r"device id '/0' has no host: a device id is 'HOST/INDEX'"),
    ("device id with an empty index", lambda: Mesh({"x": 2}, ["h/", "a/1"]), InvalidMeshError,
     r"device id 'h/' has no host: a device id is 'HOST/INDEX'"),
    ("device id that is not a string", lambda: Mesh({"x": 2}, [0, 1]), InvalidMeshError,
     r"device id 0 is not a string like 'node0/1'"),
    ("zero-sized mesh axis", lambda: Mesh({"x": 0}), InvalidMeshError,
     r"mesh axis 'x' has size 0; axis sizes must be positive integers"),
    ("negative mesh axis", lambda: Mesh({"x": 2, "y": -1}), InvalidMeshError,
     r"mesh axis 'y' has size -1; axis sizes must be positive integers"),
    ("fractional mesh axis", lambda: Mesh({"x": 1.5}), InvalidMeshError,
     r"mesh axis 'x' has size 1.5; axis sizes must be positive integers"),
    ("mesh without axes", lambda: Mesh({}), InvalidMeshError,
     r"a mesh needs at least one axis, e.g. \{'x': 2\}"),
    ("axis name that is not an identifier", lambda: Mesh({"1x": 2}), InvalidMeshError,
     r"mesh axis name '1x' is not valid: axis names are identifiers like 'x' or 'rows'"),
    ("axis name twice", lambda: Mesh([("x", 2), ("x", 2)]), InvalidMeshError,
     r"mesh axis 'x' appears twice; each axis name must be unique"),
    ("zero tensor dim", lambda: GOOD.tile((4, 0), 0), InvalidShapeError,
     r"dim 1 of shape \(4, 0\) has size 0; every dim size must be a positive integer"),
    ("negative tensor dim", lambda: plan((-3, 2), "float32", GOOD, GOOD_DST), InvalidShapeError,
     r"dim 0 of shape \(-3, 2\) has size -3; every dim size must be a positive integer"),
    ("fractional tensor dim", lambda: GOOD.tile((4, 2.5), 0), InvalidShapeError,
     r"dim 1 of shape \(4, 2.5\) has size 2.5; every dim size must be a positive integer"),
    ("shape that is not a sequence", lambda: GOOD.tile(4, 0), InvalidShapeError,
     r"shape 4 is not a sequence of sizes like \(1024, 512\)"),
    ("unknown dtype", lambda: plan((4, 4), "float8", GOOD, GOOD_DST), UnknownDtypeError,
     r"unknown dtype 'float8'; known dtypes are \[.*'bfloat16'.*'float32'.*\]"),
    ("unknown strategy", lambda: plan((4, 4), "float32", GOOD, GOOD_DST, strategy="fastest"), ValueError,
     r"unknown strategy 'fastest'; choose one of \['send_recv', 'local_allgather', 'broadcast', 'auto'\]"),
    ("abstract source mesh given to plan",
     lambda: plan((4, 4), "float32", Sharding(Mesh({"x": 2}), ("x",)), GOOD_DST), InvalidMeshError,
     r"mesh Mesh\(x=2, abstract\) is abstract \(no devices\); planning needs device ids: "
     r"use Mesh\(axes, devices\), Mesh.from_hosts or Mesh.grid"),
    ("abstract destination mesh given to plan",
     lambda: plan((4, 4), "float32", GOOD, Sharding(Mesh({"x": 2, "y": 2}), ())), InvalidMeshError,
     r"is abstract \(no devices\); planning needs device ids"),
    ("plan given a mesh, not a sharding", lambda: plan((4, 4), "float32", MESH, GOOD_DST), InvalidShardingError,
     r"src must be a reshard.Sharding, got Mesh"),
    ("zero NIC bandwidth", lambda: Topology(nic_gbps=0), InvalidTopologyError,
     r"nic_gbps is 0; bandwidths must be positive numbers of Gbit/s"),
    ("negative per-host bandwidth", lambda: Topology(host_nic_gbps={"a": -5}), InvalidTopologyError,
     r"host_nic_gbps\['a'\] is -5; bandwidths must be positive numbers of Gbit/s"),
    # Mesh-TensorFlow layout rules
    ("layout rules naming a dim twice",
     lambda: Sharding.from_layout_rules(MESH, ["batch", "batch"], {"batch": "x"}), InvalidShardingError,
     r"dim names \['batch', 'batch'\] repeat a name; each tensor dim needs its own name"),
    ("layout rules sending two dims to one axis",
     lambda: Sharding.from_layout_rules(MESH, ["batch", "hidden"], {"batch": "x", "hidden": "x"}),
     InvalidShardingError, r"axis 'x' splits dim 1 but is already used by dim 0"),
    ("layout rule with an unknown axis",
     lambda: Sharding.from_layout_rules(MESH, ["batch"], {"batch": "rows"}), InvalidShardingError,
     r"dim 0 is split over unknown axis 'rows'; the mesh's axes are \['x', 'y'\]"),
    # DTensor placements
    ("too few placements", lambda: Sharding.from_placements(MESH, [Shard(0)]), InvalidShardingError,
     r"1 placements given for a mesh with 2 axes \['x', 'y'\]; give one Shard\(d\), Replicate\(\) or Partial\(\) "
     r"per mesh axis"),
    ("negative Shard dim", lambda: Sharding.from_placements(MESH, [Shard(-1), Replicate()]), InvalidShardingError,
     r"Shard\(-1\) on axis 'x': dims must be >= 0"),
    ("placement of the wrong type", lambda: Sharding.from_placements(MESH, ["S0", Replicate()]), InvalidShardingError,
     r"placement 'S0' on axis 'x' is not Shard\(d\), Replicate\(\) or Partial\(\)"),
    ("placements sharding a dim past ndim",
     lambda: Sharding.from_placements(MESH, [Replicate(), Shard(1)], ndim=1), InvalidShardingError,
     r"placements shard dim 1 but ndim is 1"),
]


@pytest.mark.parametrize("name, call, error, message", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_names_the_rule_and_the_value(name, call, error, message):
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, ReshardError)


# -- other vocabularies mean what the spec means -----------------------------------------

LAYOUT_RULES = [
    (["batch", "hidden"], {"batch": "x", "hidden": "y"}, ("x", "y")),
    (["batch", "seq"], {"batch": ("x", "y")}, (("x", "y"), None)),
    (["batch", "seq"], {"heads": "y", "batch": "x"}, ("x", None)),
    (["seq", "hidden"], {"hidden": ("y", "x")}, (None, ("y", "x"))),
    (["seq"], {}, (None,)),
]


@pytest.mark.parametrize("dim_names, rules, spec", LAYOUT_RULES)
def test_layout_rules_equal_the_spec(dim_names, rules, spec):
    assert Sharding.from_layout_rules(MESH, dim_names, rules) == Sharding(MESH, spec)


PLACEMENTS = [
    ([Shard(0), Replicate()], 2, ("x", None), "S(0)R"),
    ([Replicate(), Shard(1)], 2, (None, "y"), "RS(1)"),
    ([Shard(1), Shard(0)], 2, ("y", "x"), "S(1)S(0)"),
    ([Shard(0), Shard(0)], 1, (("x", "y"),), "S(0)S(0)"),
    ([Replicate(), Replicate()], 3, (None, None, None), "RR"),
    ([Shard(2), Replicate()], 3, (None, None, "x"), "S(2)R"),
]


@pytest.mark.parametrize("placements, ndim, spec, text", PLACEMENTS)
def test_placements_equal_the_spec_and_print_short(placements, ndim, spec, text):
    sharding = Sharding.from_placements(MESH, placements, ndim=ndim)
    assert sharding == Sharding(MESH, spec)
    assert sharding.placements == tuple(placements)
    assert sharding.placements_str() == text


def test_placements_default_ndim_is_the_last_sharded_dim():
    assert Sharding.from_placements(MESH, [Replicate(), Shard(1)]) == Sharding(MESH, (None, "y"))


# A dim over two axes whose major axis is not the first mesh axis.
MINOR_FIRST = Sharding(Mesh({"x": 3, "y": 2}, [f"h{i}/0" for i in range(6)]), (("y", "x"),))


def test_placements_of_a_minor_first_dim_keep_its_tiles():
    """DTensor cuts a dim by its mesh axes in mesh order, so ('y', 'x') has no plain
    Shard/Replicate form: `placements` must not report one that lays out other tiles."""
    try:
        placements = MINOR_FIRST.placements
    except InvalidShardingError:
        return
    back = Sharding.from_placements(MINOR_FIRST.mesh, placements, ndim=1)
    assert back.tiles((10,)) == MINOR_FIRST.tiles((10,)), (
        f"{MINOR_FIRST} reports placements {MINOR_FIRST.placements_str()}, which lay out "
        f"{back.tiles((10,))} instead of {MINOR_FIRST.tiles((10,))}")


# -- notation ---------------------------------------------------------------------------------

NOTATION = [
    (("x", None), "P('x', None)", "S(0)R"),
    ((None, "y"), "P(None, 'y')", "RS(1)"),
    ((("x", "y"), None), "P(('x', 'y'), None)", "S(0)S(0)"),
    ((None, None), "P(None, None)", "RR"),
    ((), "P()", "RR"),
]


@pytest.mark.parametrize("spec, text, short", NOTATION)
def test_sharding_prints_in_the_notation_users_type(spec, text, short):
    sharding = Sharding(MESH, spec)
    assert sharding.spec_str() == text
    assert str(sharding) == f"{text} on (x=2, y=2)"
    assert sharding.placements_str() == short


def test_placement_and_mesh_notation():
    assert (str(Shard(0)), str(Shard(2)), str(Replicate())) == ("S(0)", "S(2)", "R")
    assert str(MESH) == "Mesh(x=2, y=2 on 2 hosts [a,b])"
    assert str(Mesh({"x": 4})) == "Mesh(x=4, abstract)"
    assert str(Mesh.grid({"x": 4, "y": 2}, 2)) == "Mesh(x=4, y=2 on 4 hosts [node0,node1,node2,...])"


def test_repr_is_unambiguous_and_values_are_frozen():
    assert repr(Sharding(MESH, ("x",))) != repr(Sharding(MESH, (("x",), ())))
    assert "spec=(('x',),)" in repr(Sharding(MESH, ("x",)))
    assert Sharding(MESH, ("x",)) == Sharding(MESH, (("x",),))
    assert hash(Sharding(MESH, ("x",))) == hash(Sharding(MESH, [["x"]]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        GOOD.spec = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        MESH.devices = ()
