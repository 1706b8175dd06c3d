"""Partial shardings (a tensor that is the sum over some mesh axes of what the devices hold), and the programs
that reshard them.

The sharding: its rules and their messages, its two printed forms, its JSON (which
must leave every non-partial sharding's JSON, and so every plan id, as it was),
DTensor's `Partial()` placement, equality. The programs: which steps and how many
bytes a few examples take, what is refused, and, for random problems, that a
numpy run of the program (written here, independently of the core) leaves every
destination tile equal to the summed tensor's tile.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from reshard import (
    REDUCE,
    STRATEGIES,
    InvalidShardingError,
    Mesh,
    Partial,
    PlanValidationError,
    Program,
    Replicate,
    Shard,
    Sharding,
    plan,
    reshard_program,
)
from reshard import box as boxes
from reshard.box import to_slices
from reshard.program import COMPUTE, DST, MOVE, SRC

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
     r"^placement 'P' on axis 'y' is not Shard\(d\), Replicate\(\) or Partial\(\) \(reshard's or "
     r"torch\.distributed\.tensor's\)$"),
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


# -- reshard programs of partial tensors ----------------------------------------------------------------


def addends(src: Sharding, shape, rng) -> tuple[dict[str, np.ndarray], dict[tuple[int, ...], np.ndarray]]:
    """Small-integer addends: one whole tensor per coordinate along ``src``'s partial axes (devices that differ
    in other axes hold tiles of the same one), and each device's tile of its coordinate's. The integers keep every
    float32 sum exact."""
    at = [src.mesh.axis_index(a) for a in src.partial]
    whole: dict[tuple[int, ...], np.ndarray] = {}
    tiles = {}
    for p, dev in enumerate(src.mesh.devices):
        c = tuple(src.mesh.coords(p)[i] for i in at)
        if c not in whole:
            whole[c] = rng.integers(-8, 8, shape).astype(np.float32)
        tiles[dev] = whole[c][to_slices(src.tile(shape, p))].copy()
    return tiles, whole


def expected(src: Sharding, dst: Sharding, shape, whole) -> dict[str, np.ndarray]:
    """Each destination device's tile: the sum over the axes summed of the addends at its coordinate along the
    axes ``dst`` keeps partial (on ``src``'s mesh)."""
    out = {}
    for p, dev in enumerate(dst.mesh.devices):
        kept = {a: dst.mesh.coords(p)[dst.mesh.axis_index(a)] for a in dst.partial}
        total = sum(a for c, a in whole.items() if all(c[src.partial.index(k)] == v for k, v in kept.items()))
        out[dev] = total[to_slices(dst.tile(shape, p))]
    return out


def run_on_numpy(program: Program, tiles: dict[str, np.ndarray], rng) -> dict[str, np.ndarray]:
    """Run a reshard program on numpy, its steps in a random order its dependencies allow.

    A step reads only what the source tiles hold or what steps it depends on (``after``, transitively) wrote:
    a missing dependency fails here, whatever order the steps ran in. A destination tile starts with what its
    device's source tile holds of it when ``dst`` keeps every partial axis (addends still), else NaN: a device
    must then write every element itself. A move reads the role it names, and role ``"src"`` as the agents do:
    the source tile first, else whatever its device holds (so a move of addends where sums belong gives wrong
    values here).
    """
    decl = program.tensors[0]
    src_tiles, dst_tiles = decl.src.tiles(decl.shape), decl.dst.tiles(decl.shape)
    summing = decl.src.partial != decl.dst.partial
    staged, writer = {}, {}  # writer: per element, the step that wrote it; -1 held from the start, -2 none
    for dev, tile in dst_tiles.items():
        staged[dev] = np.full(tuple(hi - lo for lo, hi in tile), np.nan)
        writer[dev] = np.full(staged[dev].shape, -2)
        held = boxes.intersect(src_tiles[dev], tile) if dev in src_tiles else None
        if held is not None:
            writer[dev][to_slices(held, tile)] = -1
            if not summing:
                staged[dev][to_slices(held, tile)] = tiles[dev][to_slices(held, src_tiles[dev])]
    made: dict[tuple[str, str], list] = defaultdict(list)
    ancestors: list[set[int]] = []
    for s in program.steps:
        ancestors.append(set(s.after).union(*(ancestors[a] for a in s.after)))

    def read(s, dev: str, role, box) -> np.ndarray:
        if role in (None, SRC):
            tile = src_tiles.get(dev)
            if tile is not None and boxes.contains(tile, box):
                return tiles[dev][to_slices(box, tile)]
        if role in (None, DST) and dev in dst_tiles and boxes.contains(dst_tiles[dev], box):
            who = writer[dev][to_slices(box, dst_tiles[dev])]
            if all(w in ancestors[s.id] or (w == -1 and not summing) for w in np.unique(who)):
                return staged[dev][to_slices(box, dst_tiles[dev])]
        for (d, r), held in made.items():
            for b, values, j in held:
                if d == dev and role in (None, r) and j in ancestors[s.id] and boxes.contains(b, box):
                    return values[to_slices(box, b)]
        raise AssertionError(f"{s}: {dev} holds no box {boxes.box_str(box)} in role {role} written before it")

    def write(s, dev: str, role: str, box, values) -> None:
        if role == DST:
            assert boxes.contains(dst_tiles[dev], box), f"{s}: {box} is outside {dev}'s destination tile"
            staged[dev][to_slices(box, dst_tiles[dev])] = values
            writer[dev][to_slices(box, dst_tiles[dev])] = s.id
        else:
            made[(dev, role)].append((box, np.array(values), s.id))

    waiting = {s.id: set(s.after) for s in program.steps}
    while waiting:
        s = program.steps[rng.choice(sorted(i for i, deps in waiting.items() if not deps))]
        del waiting[s.id]
        for deps in waiting.values():
            deps.discard(s.id)
        if s.kind == MOVE:
            values = read(s, s.transfer.sender, None if s.role == SRC else s.role, s.transfer.box)
            for r in s.transfer.receivers:
                write(s, r, DST, s.transfer.box, values)
        elif s.kind == COMPUTE:
            assert s.kernel == "copy", s
            write(s, s.device, s.output.role, s.output.box, read(s, s.device, s.inputs[0].role, s.inputs[0].box))
        else:
            ref, out = s.inputs[0], s.output
            total = sum(read(s, m, ref.role, ref.box) for m in s.devices)
            pieces = [out.box] * len(s.devices) if s.result == "replicate" else boxes.chunk(out.box, len(s.devices),
                                                                                           s.dim)
            for m, piece in zip(s.devices, pieces):
                if boxes.volume(piece):
                    write(s, m, out.role, piece, total[to_slices(piece, out.box)])
    for dev, who in writer.items():
        assert (who != -2).all() and not (summing and (who == -1).any()), f"{dev} misses part of its tile"
    return staged


M22 = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1"], 2)  # x across hosts, y inside them
M4 = Mesh.from_hosts({"x": 4}, ["h0", "h1", "h2", "h3"], 1)
M4_OTHER = Mesh.from_hosts({"x": 4}, ["h4", "h5", "h6", "h7"], 1)
M22_OTHER = Mesh.from_hosts({"x": 2, "y": 2}, ["h2", "h3"], 2)

# (name, shape, src, dst, {step kind: count}, {reduce result: count}, bytes out over NICs, summed over hosts).
# A ring over n members on n hosts sends 2(n-1)/n of the box per member to all-reduce it, (n-1)/n to reduce-scatter;
# in the copy case the groups all-reduce rows 0:4 and 2:5, the boxes their members' tiles span; to another mesh
# each of the four reduced quarters then crosses four NICs, down a chain of the receiving hosts.
PROGRAMS = [
    ("all-reduce to replicate", (8, 6), Sharding(M4, (None, None), ("x",)), Sharding(M4, (None, None)),
     {"reduce": 1}, {"replicate": 1}, 4 * 2 * 3 * 192 // 4),
    ("reduce-scatter to shard", (8, 6), Sharding(M4, (None, None), ("x",)), Sharding(M4, ("x", None)),
     {"reduce": 1}, {"shard": 1}, 4 * 3 * 192 // 4),
    ("reduce-scatter onto a split dim", (8, 6), Sharding(M22, ("x", None), ("y",)),
     Sharding(M22, (("x", "y"), None)), {"reduce": 2}, {"shard": 2}, 0),
    ("all-reduce of only what the group keeps", (8, 6), Sharding(M22, (None, None), ("y",)),
     Sharding(M22, (None, "x")), {"reduce": 2}, {"replicate": 2}, 0),
    ("all-reduce, then each copies its part", (5, 6), Sharding(M22, (None, None), ("x",)),
     Sharding(M22, (("x", "y"), None)), {"reduce": 2, "compute": 4}, {"replicate": 2}, 2 * (4 + 3) * 6 * 4),
    ("reduce-scatter, then another mesh", (8, 6), Sharding(M4, (None, None), ("x",)),
     Sharding(M4_OTHER, (None, None)), {"reduce": 1, "move": 4}, {"shard": 1}, 4 * 3 * 192 // 4 + 4 * 4 * 48),
    ("keep one partial axis, sum the other", (8, 6), Sharding(M22, (None, None), ("x", "y")),
     Sharding(M22, (None, None), ("y",)), {"reduce": 2}, {"replicate": 2}, 2 * 2 * (2 * 1 * 192 // 2)),
    ("keep every partial axis: addends move", (8, 6), Sharding(M22, ("x", None), ("y",)),
     Sharding(M22, (None, "x"), ("y",)), {"move": 4}, {}, 4 * 48),
    ("nothing to do", (8, 6), Sharding(M22, ("x", None), ("y",)), Sharding(M22, ("x", None), ("y",)), {}, {}, 0),
    ("not partial: the plan's program", (8, 6), Sharding(M22, ("x", None)), Sharding(M22_OTHER, (None, None)),
     {"move": 2}, {}, None),
]


@pytest.mark.parametrize("name, shape, src, dst, kinds, results, network", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_partial_reshard_programs(name, shape, src, dst, kinds, results, network):
    program = reshard_program(shape, "float32", src, dst).validate()
    assert Counter(s.kind for s in program.steps) == Counter(kinds)
    assert Counter(s.result for s in program.steps if s.kind == REDUCE) == Counter(results)
    assert all(s.op == "sum" and s.algorithm == "ring" for s in program.steps if s.kind == REDUCE)
    if network is not None:
        assert sum(h["bytes_out"] for h in program.host_bytes().values()) == network
    assert program.estimate() >= 0 and Program.from_json(program.dumps()) == program
    rng = np.random.default_rng(0)
    tiles, whole = addends(src, shape, rng)
    got = run_on_numpy(program, tiles, rng)
    for dev, want in expected(src, dst, shape, whole).items():
        assert np.array_equal(got[dev], want), dev


def test_a_program_that_is_not_partial_is_the_plans():
    src, dst = Sharding(M22, ("x", None)), Sharding(M22_OTHER, (None, "y"))
    assert reshard_program((8, 6), "float32", src, dst) == Program.from_plan(plan((8, 6), "float32", src, dst))


def _edit(program: Program, index: int, **changes) -> Program:
    steps = list(program.steps)
    steps[index] = dataclasses.replace(steps[index], **changes)
    return dataclasses.replace(program, steps=tuple(steps))


def test_moves_after_a_reduce_read_the_sums_and_forward_what_they_received():
    far = Mesh.from_hosts({"x": 2, "y": 2}, ["h4", "h5"], 2)
    src, dst = Sharding(M4, (None, None), ("x",)), Sharding(far, ("x", None))
    program = reshard_program((8, 6), "float32", src, dst, strategy="local_allgather").validate()
    moves = [s for s in program.steps if s.kind == MOVE]
    # Phase 0 of the plan sends each reduced quarter's rows to one receiver; phase 1 forwards them inside the host.
    assert Counter(s.role for s in moves) == {"reduced": 8, DST: 8}
    assert all(s.transfer.method == "local" for s in moves if s.role == DST)
    again = Program.from_json(program.dumps())
    assert again == program and again.id == program.id
    rng = np.random.default_rng(1)
    tiles, whole = addends(src, (8, 6), rng)
    got = run_on_numpy(program, tiles, rng)
    for dev, want in expected(src, dst, (8, 6), whole).items():
        assert np.array_equal(got[dev], want), dev


def test_validation_refuses_addends_where_sums_belong():
    summed = reshard_program((8, 6), "float32", Sharding(M4, (None, None), ("x",)), Sharding(M4_OTHER, (None, None)))
    move = next(s for s in summed.steps if s.kind == MOVE)
    with pytest.raises(PlanValidationError, match=(
            rf"^step #{move.id} move tensor broadcast .*: it reads role 'src' of 'tensor', which holds addends of "
            r"P\(None, None\) \+ partial\(x\) on \(x=4\), but its destination P\(None, None\) on \(x=4\) is not that "
            r"pending sum; addends move as they are only into a destination partial over \['x'\] on the same mesh, so "
            r"reduce them first and move the role the reduce writes")):
        _edit(summed, move.id, role=SRC).validate()
    # Kept partial: addends move, but only between devices at one coordinate along the partial axes.
    kept = reshard_program((8, 6), "float32", Sharding(M22, ("x", None), ("y",)), Sharding(M22, (None, "x"), ("y",)))
    move = next(s for s in kept.steps if s.transfer.sender == "h1/0")
    with pytest.raises(PlanValidationError, match=r"it moves addends of .* from h1/0 \(at \(0,\) along \['y'\]\) to "
                                                  r"h0/1 \(at \(1,\)\); each coordinate along the partial axes sums its "
                                                  r"own addends"):
        _edit(kept, move.id, transfer=dataclasses.replace(move.transfer, receivers=("h0/1",))).validate()
    # A device that held addends of its destination tile must have them overwritten with the sums.
    copying = reshard_program((5, 6), "float32", Sharding(M22, (None, None), ("x",)),
                              Sharding(M22, (("x", "y"), None)))
    copy = next(s for s in copying.steps if s.kind == COMPUTE and s.device == "h0/0")
    part = ((0, 1), (0, 6))
    with pytest.raises(PlanValidationError, match=(
            r"^destination device h0/0 \(tile \[0:2, 0:6\]\) holds \[0:2, 0:6\] of it as addends of .*, and no step "
            r"writes \[1:2, 0:6\] of that part with the sum; reduce into role 'dst' there, or copy the reduced box")):
        _edit(copying, copy.id, inputs=(dataclasses.replace(copy.inputs[0], box=part),),
              output=dataclasses.replace(copy.output, box=part)).validate()


REFUSED = [
    ("partial to partial on another mesh", Sharding(M22, (None,), ("y",)), Sharding(M22_OTHER, (None,), ("y",)),
     r"^dst P\(None\) \+ partial\(y\) stays partial over \['y'\] but lies on Mesh\(x=2, y=2 on 2 hosts \[h2,h3\]\), "
     r"not on src's Mesh\(x=2, y=2 on 2 hosts \[h0,h1\]\); a sum that stays pending stays on the devices that hold "
     r"its addends, so give dst on src's mesh, or without partial to complete the sum first$"),
    ("partial over an axis src holds no addends along", Sharding(M22, (None,), ("y",)),
     Sharding(M22, (None,), ("x",)),
     r"^dst P\(None\) \+ partial\(x\) is partial over \['x'\], along which src P\(None\) \+ partial\(y\) holds no "
     r"addends; dst may stay partial over some of src's partial axes \['y'\], or over none$"),
    ("values to a pending sum", Sharding(M22, (None,)), Sharding(M22, (None,), ("y",)),
     r"^dst P\(None\) \+ partial\(y\) is a pending sum over axes \['y'\], but src P\(None\) holds values, not "
     r"addends; a reshard may complete a sum but not start one"),
    ("unknown strategy", Sharding(M22, (None,), ("y",)), Sharding(M22, (None,)),
     r"^unknown strategy 'fast'; choose one of \["),
]


@pytest.mark.parametrize("name, src, dst, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_a_partial_reshard_refuses(name, src, dst, message):
    with pytest.raises(InvalidShardingError, match=message):
        reshard_program((8,), "float32", src, dst, strategy="fast" if name == "unknown strategy" else "auto")


@st.composite
def layouts(draw, mesh: Mesh, ndim: int, partial_from=None, partial=()):
    """A sharding on ``mesh``, partial over the axes ``partial``; each other axis splits a dim, replicates or (if
    it is one of ``partial_from``; None: any axis) is partial."""
    spec: list[list[str]] = [[] for _ in range(ndim)]
    partial = list(partial)
    for name in draw(st.permutations([n for n in mesh.axis_names if n not in partial])):
        may_sum = partial_from is None or name in partial_from
        role = draw(st.integers(-2 if may_sum else -1, ndim - 1))
        if role == -2:
            partial.append(name)
        elif role >= 0:
            spec[role].append(name)
    return Sharding(mesh, [tuple(e) or None for e in spec], partial)


@st.composite
def partial_problems(draw):
    """(shape, src, dst): a partial src on a 1- or 2-axis mesh; dst on the same mesh (perhaps still partial over
    some of src's axes), or on another mesh that shares none, some or all of its devices."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    names = draw(st.permutations(["x", "y"]))[: draw(st.integers(1, 2))]
    per_host = draw(st.integers(1, 2))
    axes = [(n, draw(st.integers(1, 3))) for n in names]
    size = math.prod(s for _, s in axes)
    mesh = Mesh(axes, [f"h{i // per_host}/{i % per_host}" for i in range(size)])
    src = draw(layouts(mesh, ndim, partial=[draw(st.sampled_from(names))]))
    if draw(st.booleans()):
        kept = draw(st.lists(st.sampled_from(src.partial), unique=True))
        dst = draw(layouts(mesh, ndim, partial_from=(), partial=kept))
    else:
        other = [(n, draw(st.integers(1, 3))) for n in draw(st.permutations(["x", "y"]))[: draw(st.integers(1, 2))]]
        first = draw(st.integers(0, size))  # devices from the source's onwards: shared, then new
        count = math.prod(s for _, s in other)
        dst = draw(layouts(Mesh(other, [f"h{i // per_host}/{i % per_host}" for i in range(first, first + count)]),
                           ndim, partial_from=()))
    return shape, src, dst


@settings(max_examples=150, deadline=None)  # 5.5 s of make test's 2 cores at 300; new draws every run
@given(partial_problems(), st.sampled_from(STRATEGIES), st.randoms(use_true_random=False))
def test_every_partial_reshard_completes_the_sum(problem, strategy, random):
    shape, src, dst = problem
    program = reshard_program(shape, "float32", src, dst, strategy=strategy).validate()
    assert program.estimate() >= 0
    event(" + ".join(sorted({s.result if s.kind == REDUCE else s.kind for s in program.steps})) or "nothing")
    rng = np.random.default_rng(random.getrandbits(32))
    tiles, whole = addends(src, shape, rng)
    got = run_on_numpy(program, tiles, rng)
    for dev, want in expected(src, dst, shape, whole).items():
        assert np.array_equal(got[dev], want), dev
    if src.mesh == dst.mesh and all(not boxes.volume(t) or boxes.contains(src.tile(shape, d), t)
                                    for d, t in dst.tiles(shape).items()):
        assert not any(s.kind == MOVE for s in program.steps), "every tile is at hand: nothing may move"
