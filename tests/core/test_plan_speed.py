"""The fast paths of planning a state dict build what the plain ones build: transfers, steps, buckets, routes."""

from __future__ import annotations

import gc
import math
import random
from collections import defaultdict
from functools import reduce

import pytest

from reshard import Mesh, Sharding, TensorDecl, Topology, plan
from reshard.many import _as_moved, follow_scales, plan_many, scale_pairs
from reshard.plans import Transfer
from reshard.program import MOVE, SRC, Program, Step, StepsLike, move_steps, moves_like
from reshard.quantize import QuantizedSteps, conversions, source_name
from reshard.strategies import Loads, _long_routes

# 4 training hosts of 4 devices -> 20 inference hosts holding two replicas each: a tile is wanted on 20 hosts,
# more than a chain's exhaustive route search takes, so plans take the long deliveries (stars, chains, stripes).
TRAIN = Mesh.grid({"dp": 4, "tp": 4}, 4, "train")
INFER = Mesh.grid({"dp": 40, "tp": 2}, 4, "infer")
# NICs of 10 Mbit/s: every box here takes its sender 50 us or more, so none is small (`reshard.strategies.STEP_S`)
# and stars come up, as they do for the large boxes of real state dicts on real NICs.
SLOW = Topology(nic_gbps=0.01)


def _state_dict(layers: int = 3) -> list[TensorDecl]:
    out = [TensorDecl("embed", (1000, 64), "bfloat16", Sharding(TRAIN, ("tp", None)), Sharding(INFER, ("tp", None)))]
    for i in range(layers):
        for name, shape, dtype, spec in (("norm", (64,), "float32", (None,)),
                                         ("qkv", (192, 64), "bfloat16", ("tp", None)),
                                         ("bias", (192,), "bfloat16", ("tp",)),
                                         ("out", (64, 64), "float8_e4m3fn", (None, "tp"))):
            out.append(TensorDecl(f"layers.{i}.{name}", shape, dtype, Sharding(TRAIN, spec), Sharding(INFER, spec)))
    return out


def test_a_star_builds_the_transfers_the_constructor_builds():
    box = ((0, 8), (4, 12))
    groups = [("h1", ("h1/0",)), ("h2", ("h2/0", "h2/3")), ("h3", ("h3/1", "h3/2", "h3/5"))]
    got = Transfer.star(box, "h0/0", groups)
    want = [Transfer(box, "h0/0", ("h1/0",), "p2p"),
            Transfer(box, "h0/0", ("h2/0", "h2/3"), "broadcast", 0, ("h2",)),
            Transfer(box, "h0/0", ("h3/1", "h3/2", "h3/5"), "broadcast", 0, ("h3",))]
    assert got == want
    assert [hash(t) for t in got] == [hash(t) for t in want]
    assert [t.to_json() for t in got] == [t.to_json() for t in want]
    assert [str(t) for t in got] == [str(t) for t in want]
    with pytest.raises(AttributeError):
        got[0].sender = "h9/0"  # still frozen


@pytest.mark.parametrize("strategy", ["auto", "local_allgather"])
def test_move_steps_are_the_steps_step_move_builds(strategy):
    # local_allgather has a second phase, whose steps wait for the first's.
    p = plan((64, 48), "float32", Sharding(TRAIN, ("tp", None)), Sharding(INFER, (None, "tp")), strategy=strategy)
    got = move_steps(p.transfers, 5, "w")
    want = Program.from_plan(p).steps
    want = [Step.move(s.id + 5, s.transfer, [a + 5 for a in s.after], "w") for s in want]
    assert got == want
    assert [s.to_json() for s in got] == [s.to_json() for s in want]
    assert [str(s) for s in got] == [str(s) for s in want]
    assert all(s.kind == MOVE and s.role == SRC and s.inputs == () and s.output is None for s in got)
    if strategy == "local_allgather":
        assert any(s.after for s in got)
    # another tensor of the layout, moved alike (plan_many): the same steps as move_steps makes for it
    like = moves_like(move_steps(p.transfers, 0, "v"), 5, "w")
    assert like == got and [s.to_json() for s in like] == [s.to_json() for s in got]


def test_plan_many_is_each_layouts_plan_against_one_loads_in_steps():
    decls = _state_dict()
    program = plan_many(decls, SLOW, bucket_bytes=0).validate()
    order = sorted(decls, key=lambda t: -math.prod(t.shape) * t.itemsize)  # largest first, stably
    # each (shape, dtype, src, dst) planned once for all its tensors (copies=), largest in all first
    layouts: dict[tuple, list[TensorDecl]] = defaultdict(list)
    for t in order:
        layouts[t.shape, t.dtype, t.src, t.dst].append(t)
    loads = Loads(SLOW)
    plans = {}
    for group in sorted(layouts.values(), key=lambda g: -len(g) * math.prod(g[0].shape) * g[0].itemsize):
        t = group[0]
        plans[t.shape, t.dtype, t.src, t.dst] = plan(t.shape, t.dtype, t.src, t.dst, loads=loads, copies=len(group))
    want = []
    for t in order:
        p = plans[t.shape, t.dtype, t.src, t.dst]
        want += [Step.move(len(want) + s.id, s.transfer, [len(want) + a for a in s.after], t.name)
                 for s in Program.from_plan(p).steps]
    assert [t.name for t in program.tensors] == [t.name for t in order]
    assert list(program.steps) == want
    # stars (one-host broadcasts) and chains both come up
    assert {len(s.transfer.route) > 1 for s in program.steps if s.transfer.method == "broadcast"} == {True, False}


def _reference_buckets(program, bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The bucket rule of reshard.many's docstring, written plainly."""
    groups: dict[tuple, list[list[int]]] = defaultdict(list)
    size: dict[tuple, int] = {}
    for s in program.steps:
        t = s.transfer
        nbytes = t.num_elements * program.tensor(s.tensor).itemsize
        if s.kind != MOVE or s.after or s.role != SRC or nbytes >= bucket_bytes:
            continue
        key = (t.sender, t.receivers, t.method, t.route)
        if key not in size or size[key] >= bucket_bytes:
            groups[key].append([])
            size[key] = 0
        groups[key][-1].append(s.id)
        size[key] += nbytes
    return tuple(sorted(tuple(b) for bs in groups.values() for b in bs if len(b) > 1))


@pytest.mark.parametrize("bucket_bytes", [1, 200, 700, 4096, 2**20])
def test_buckets_follow_the_rule(bucket_bytes):
    program = plan_many(_state_dict(), bucket_bytes=bucket_bytes)
    assert program.buckets == _reference_buckets(program, bucket_bytes)
    if bucket_bytes == 4096:
        assert program.buckets  # the case packs something
    program.validate()


def test_long_routes_add_their_hops_in_route_order():
    rng = random.Random(7)
    hosts = [f"h{i}" for i in range(30)]
    loads = Loads(Topology())
    for _ in range(400):
        a, b = rng.sample(hosts, 2)
        loads.add_path(a, (b,), rng.random() * 1e6)
    routes = _long_routes(hosts, loads)
    assert len(routes) > 1
    for cost, route in routes:
        assert sorted(route) == sorted(hosts) and route[-1] == hosts[-1]
        assert cost == reduce(lambda acc, hop: acc + loads.pairs.get(hop, 0.0), zip(route, route[1:]), 0.0)


@pytest.mark.parametrize("enabled", [True, False])
def test_plan_many_leaves_the_collector_as_it_found_it(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        plan_many(_state_dict(1))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_what_plan_many_made_skips_the_youngest_generation_and_an_applications_freeze_stays():
    was = gc.isenabled()
    try:
        gc.enable()
        gc.collect()
        program = plan_many(_state_dict(3), SLOW)
        # Hundreds of steps and transfers were made, and went to the oldest generation without a pass over them.
        step = program.steps[-1]
        assert len(program.steps) > 300 and gc.get_freeze_count() == 0
        assert any(o is step for o in gc.get_objects(generation=2))
        frozen = [[i] for i in range(50)]
        gc.freeze()
        held = gc.get_freeze_count()
        plan_many(_state_dict(1))
        assert gc.get_freeze_count() == held and frozen  # the application's frozen objects stay frozen
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


class _Forgetful(dict):
    """A memo that keeps nothing: every star is built anew."""

    def __setitem__(self, key, value):
        pass


def test_stars_sent_again_are_the_stars_built_anew(monkeypatch):
    decls = _state_dict(4)
    kept = plan_many(decls, SLOW)
    init = Loads.__init__

    def forgetful(self, topology):
        init(self, topology)
        self._stars = _Forgetful()

    monkeypatch.setattr(Loads, "__init__", forgetful)
    anew = plan_many(decls, SLOW)
    assert anew.steps == kept.steps and anew.buckets == kept.buckets and anew.id == kept.id
    shared = {id(s.transfer) for s in kept.steps}
    assert len(shared) < len(kept.steps)  # the case sends some star again


def test_a_normal_shape_comes_back_as_it_is_and_others_are_still_checked():
    import numpy as np
    import pytest

    from reshard import InvalidShapeError
    from reshard.sharding import normalise_shape

    shape = (4096, 512)
    assert normalise_shape(shape) is shape  # the fast path: no new tuple
    assert normalise_shape([3, 4]) == (3, 4)  # any sequence of ints, as before
    made = normalise_shape([np.int64(3), np.uint32(4)])  # numpy's integers too, as Python ints
    assert made == (3, 4) and all(type(n) is int for n in made)
    with pytest.raises(InvalidShapeError, match=r"dim 0 of shape \(0, 4\) has size 0;"):
        normalise_shape((np.int64(0), 4))  # named as plain numbers
    for bad in [(True, 2), (np.bool_(True),), (0, 3), (2.0,), (np.float32(2),), (-1,), (2**63,), tuple([1] * 65)]:
        with pytest.raises(InvalidShapeError):
            normalise_shape(bad)


def test_a_quantized_weights_steps_made_from_another_of_its_layout_are_its_own():
    """`StepsLike`: plan_many makes the steps of every quantized weight of one layout from the first's, renamed and
    shifted; they must equal what `QuantizedSteps` builds for that weight itself."""
    train = Mesh.from_hosts({"x": 4}, ["h0", "h1"], 2)  # rows over 4 devices cut 128-row blocks: gathers first
    serve = Mesh.from_hosts({"r": 2, "t": 2}, ["s0", "s1"], 2)
    decls = []
    for w in ("a", "b"):
        decls += [TensorDecl(w, (384, 256), "bfloat16", Sharding(train, ("x", None)), Sharding(serve, (None, "t"))),
                  TensorDecl(f"{w}_s", (3, 2), "float32")]
    pairs = scale_pairs({"a": "a_s", "b": "b_s"})
    decls = follow_scales(decls, pairs)
    converted = conversions(decls, {"a": "float8_e4m3fn", "b": "float8_e4m3fn"}, pairs)
    moved = {d.name: d for d in _as_moved(decls, converted)}
    given = {d.name: d for d in decls}
    moves = {n: list(plan(d.shape, d.dtype, d.src, d.dst).transfers) for n, d in moved.items()}

    def quantized(w: str, first: int):
        return QuantizedSteps(first, given[w], converted[w], moved[w], moved[f"{w}_s"], moves["a"], moves["a_s"]).steps

    template = quantized("a", 0)
    assert any(s.kind == MOVE and s.after for s in template) and any(s.kind != MOVE for s in template)
    names = {"a": "b", "a_s": "b_s", source_name("a", "bfloat16"): source_name("b", "bfloat16")}
    made = StepsLike(template).make(37, names)
    want = quantized("b", 37)
    assert made == want
    assert [s.to_json() for s in made] == [s.to_json() for s in want]
    assert [str(s) for s in made] == [str(s) for s in want]
