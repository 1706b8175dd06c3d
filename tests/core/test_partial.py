"""Partial shardings (a tensor that is the sum over some mesh axes of what the devices hold).

The sharding: its rules and their messages, its two printed forms, its JSON (which
must leave every non-partial sharding's JSON, and so every plan id, as it was),
DTensor's `Partial()` placement, equality.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import InvalidShardingError, Mesh, Partial, Replicate, Shard, Sharding, plan

MESH = Mesh({"x": 2, "y": 2}, ["a/0", "a/1", "b/0", "b/1"])
OTHER = Mesh({"x": 2, "y": 2}, ["c/0", "c/1", "d/0", "d/1"])

# -- the sharding ------------------------------------------------------------------------------------

# (name, call, the message: rule, offending value and valid options)
BAD = [
    ("unknown partial axis", lambda: Sharding(MESH, ("x", None), partial=("z",)),
     r"^partial axis 'z' is not an axis of the mesh; the mesh's axes are \['x', 'y'\]$"),
    ("partial axis twice", lambda: Sharding(MESH, (None,), partial=("y", "y")),
     r"^partial axes \('y', 'y'\) name 'y' 2 times; a tensor is summed over each mesh axis at most once, so list "
     r"each axis once$"),
    ("partial axis that splits a dim", lambda: Sharding(MESH, (None, ("y", "x")), partial=("x",)),
     r"^axis 'x' is partial but also splits dim 1; devices along a partial axis hold whole tiles of addends, so an "
     r"axis is either partial or splits a dim \(drop 'x' from the spec or from partial\)$"),
    ("partial axes not names", lambda: Sharding(MESH, (None,), partial=(0,)),
     r"^partial \(0,\) must be a tuple of mesh axis names, e.g. \('y',\); the mesh's axes are \['x', 'y'\]$"),
    ("partial a number", lambda: Sharding(MESH, (None,), partial=1),
     r"^partial 1 must be a tuple of mesh axis names"),
    ("placement of another kind", lambda: Sharding.from_placements(MESH, [Shard(0), "P"]),
     r"^placement 'P' on axis 'y' is not Shard\(d\), Replicate\(\) or Partial\(\)$"),
    ("too few placements", lambda: Sharding.from_placements(MESH, [Partial()]),
     r"^1 placements given for a mesh with 2 axes \['x', 'y'\]; give one Shard\(d\), Replicate\(\) or Partial\(\) "
     r"per mesh axis$"),
    ("JSON partial not an array", lambda: Sharding.from_json({**Sharding(MESH, (None,)).to_json(), "partial": "y"}),
     r"^sharding JSON field 'partial' must be a JSON array \[\.\.\.\]; got a string 'y'$"),
    ("JSON partial item not a string", lambda: Sharding.from_json({**Sharding(MESH, (None,)).to_json(),
                                                                    "partial": [["y"]]}),
     r"^sharding JSON field 'partial' item 0 \(a mesh axis the tensor is summed over\) must be a string; got an "
     r"array \['y'\]$"),
    ("JSON partial axis unknown", lambda: Sharding.from_json({**Sharding(MESH, (None,)).to_json(), "partial": ["q"]}),
     r"^partial axis 'q' is not an axis of the mesh"),
    ("JSON partial axis also splits", lambda: Sharding.from_json({**Sharding(MESH, ("y",)).to_json(),
                                                                   "partial": ["y"]}),
     r"^axis 'y' is partial but also splits dim 0"),
    ("plan of a partial source", lambda: plan((4,), "float32", Sharding(MESH, (None,), ("y",)),
                                              Sharding(OTHER, (None,))),
     r"^src P\(None\) \+ partial\(y\) is a pending sum over axes \['y'\], but a plan only moves values, so it would "
     r"copy addends as if they were the tensor; use reshard.reshard_program, which adds the reduce steps$"),
    ("plan to a partial destination", lambda: plan((4,), "float32", Sharding(MESH, (None,)),
                                                   Sharding(OTHER, ("x",), ("y",))),
     r"^dst P\('x'\) \+ partial\(y\) is a pending sum"),
]


@pytest.mark.parametrize("name, call, message", BAD, ids=[b[0] for b in BAD])
def test_bad_partial_input_names_the_rule(name, call, message):
    with pytest.raises(InvalidShardingError, match=message):
        call()


# (spec, partial, str without the mesh, placements)
NOTATION = [
    (("x", None), ("y",), "P('x', None) + partial(y)", "S(0)P"),
    ((None, None), ("x", "y"), "P(None, None) + partial(x, y)", "PP"),
    ((None, None), ("y", "x"), "P(None, None) + partial(x, y)", "PP"),  # mesh order: a sum has no order
    ((None, "x"), ("y",), "P(None, 'x') + partial(y)", "S(1)P"),
    ((), ("x",), "P() + partial(x)", "PR"),
    ((None,), "y", "P(None) + partial(y)", "RP"),  # one axis name is one axis, as in a spec entry
    ((None,), frozenset({"y"}), "P(None) + partial(y)", "RP"),  # JAX's ``unreduced`` is a set
    (("x", None), (), "P('x', None)", "S(0)R"),
]


@pytest.mark.parametrize("spec, partial, text, short", NOTATION)
def test_a_partial_sharding_prints_its_pending_sum(spec, partial, text, short):
    sharding = Sharding(MESH, spec, partial=partial)
    assert sharding.spec_str() == text
    assert str(sharding) == f"{text} on (x=2, y=2)"
    assert sharding.placements_str() == short
    assert Sharding.from_placements(MESH, sharding.placements, ndim=len(spec)) == sharding


def test_the_partial_placement_reads_as_dtensors():
    assert (repr(Partial()), str(Partial())) == ("Partial()", "P")
    assert Partial() == Partial() and hash(Partial()) == hash(Partial())
    assert Sharding(MESH, (None, "x"), ("y",)).placements == (Shard(1), Partial())


PLACEMENTS = [
    ([Shard(0), Partial()], 2, ("x", None), ("y",)),
    ([Partial(), Partial()], 1, (None,), ("x", "y")),
    ([Partial(), Shard(1)], 2, (None, "y"), ("x",)),
    ([Replicate(), Partial()], 0, (), ("y",)),
]


@pytest.mark.parametrize("placements, ndim, spec, partial", PLACEMENTS)
def test_partial_placements_mean_partial_axes(placements, ndim, spec, partial):
    sharding = Sharding.from_placements(MESH, placements, ndim=ndim)
    assert sharding == Sharding(MESH, spec, partial=partial)
    assert sharding.placements == tuple(placements)


def test_partial_helpers():
    s = Sharding(MESH, ("x", None), partial=("y",))
    assert s.partial == ("y",) and s.is_partial
    assert s.without_partial() == Sharding(MESH, ("x", None)) and not s.without_partial().is_partial
    assert s.tiles((5, 3)) == s.without_partial().tiles((5, 3))  # the tile rule is unchanged


def test_equality_and_hashing_see_partial():
    a, b = Sharding(MESH, (None,), ("x", "y")), Sharding(MESH, (None,), ("y", "x"))
    assert a == b and hash(a) == hash(b)
    c = Sharding(MESH, (None,), ("y",))
    assert len({a, c, c.without_partial()}) == 3
    assert c != Sharding(OTHER, (None,), ("y",))


def test_the_json_of_a_sharding_without_partial_is_unchanged():
    # A literal, not to_json itself: the JSON (and so every plan's and program's id) must stay byte-identical.
    text = json.dumps(Sharding(MESH, ("x", None)).to_json(), sort_keys=True, separators=(",", ":"))
    assert text == ('{"mesh":{"axes":[["x",2],["y",2]],"devices":["a/0","a/1","b/0","b/1"]},'
                    '"spec":[["x"],[]]}')
    p = plan((8, 6), "float32", Sharding(MESH, ("x", None)), Sharding(OTHER, (None, "y")), strategy="send_recv")
    assert p.id == "399729ac05f6cb0251792e67513614d5baf9e6a76f6730cbf71c064eda0e53b3"  # as before Partial existed


def test_the_json_of_a_partial_sharding_names_its_axes():
    s = Sharding(MESH, (None, "x"), partial=("y",))
    assert s.to_json() == {"mesh": MESH.to_json(), "spec": [[], ["x"]], "partial": ["y"]}
    assert Sharding.from_json(s.to_json()) == s
    assert Sharding.from_json({**s.without_partial().to_json(), "partial": []}) == s.without_partial()


@st.composite
def partial_shardings(draw):
    """Any valid sharding of a 1-3 axis mesh: each axis splits some dim, is partial, or replicates."""
    names = draw(st.permutations(["x", "y", "z"]))[: draw(st.integers(1, 3))]
    mesh = Mesh([(n, draw(st.integers(1, 3))) for n in names])
    ndim = draw(st.integers(0, 3))
    spec: list[list[str]] = [[] for _ in range(ndim)]
    partial = []
    for n in draw(st.permutations(names)):
        role = draw(st.integers(-2, ndim - 1))
        if role == -2:
            partial.append(n)
        elif role >= 0:
            spec[role].append(n)
    return Sharding(mesh, [tuple(e) or None for e in spec], partial)


@settings(max_examples=200, deadline=None)
@given(partial_shardings())
def test_json_and_placements_round_trip(sharding):
    assert Sharding.from_json(json.loads(json.dumps(sharding.to_json()))) == sharding
    assert ("partial" in sharding.to_json()) == sharding.is_partial
    assert sharding.without_partial().without_partial() == sharding.without_partial()
    try:
        placements = sharding.placements
    except InvalidShardingError:  # a dim cut minor axis first has no DTensor form
        return
    assert Sharding.from_placements(sharding.mesh, placements, ndim=len(sharding.spec)) == sharding
    assert sharding.placements_str().count("P") == len(sharding.partial)
