"""plan_many: a state dict in one program, small moves in buckets, balance across tensors, scales that follow."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from reshard import Mesh, Program, Sharding, TensorDecl, Topology, plan
from reshard.errors import InvalidShardingError, PlanValidationError, ProgramSizeError, ScaleLayoutError
from reshard.many import SHARED_ROUTE_BYTES, ManyProgram, plan_many, program_from_json, scale_sharding
from reshard.program import MOVE, SRC
from reshard.cost import HostCache
from reshard.strategies import Loads
from reshard.tasks import decompose
from reshard.box import to_slices

MiB = 2**20


def _state_dict(num_layers: int = 6) -> list[TensorDecl]:
    """A small transformer's tensors: tensor-parallel 4 on hosts t0..t3 -> tensor-parallel 2 times two replicas on
    hosts i0..i3, in float32, bfloat16 and uint8 (fp8 bytes), uneven sizes included."""
    train = Mesh.from_hosts({"tp": 4}, [f"t{i}" for i in range(4)], 1)
    infer = Mesh.from_hosts({"dp": 2, "tp": 2}, [f"i{i}" for i in range(4)], 1)
    out = [TensorDecl("embed", (1003, 64), "float32", Sharding(train, ("tp", None)), Sharding(infer, ("tp", None)))]
    for layer in range(num_layers):
        p = f"layers.{layer}."
        out += [
            TensorDecl(p + "qkv", (64, 192), "bfloat16", Sharding(train, (None, "tp")), Sharding(infer, (None, "tp"))),
            TensorDecl(p + "out", (64, 64), "bfloat16", Sharding(train, ("tp", None)), Sharding(infer, ("tp", None))),
            TensorDecl(p + "up", (64, 256), "uint8", Sharding(train, (None, "tp")), Sharding(infer, (None, "tp"))),
            TensorDecl(p + "norm", (64,), "float32", Sharding(train, (None,)), Sharding(infer, (None,))),
            TensorDecl(p + "bias", (13,), "float32", Sharding(train, ("tp",)), Sharding(infer, ("tp",))),
        ]
    return out


def _run(program: Program) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """Run a program of moves on numpy: per (tensor, destination device), the tile it ends with and the one it
    should, from source tiles of distinct values."""
    values = {t.name: np.arange(math.prod(t.shape), dtype=np.int64).reshape(t.shape) * 7 + i
              for i, t in enumerate(program.tensors)}
    got: dict[tuple[str, str], np.ndarray] = {}
    for t in program.tensors:
        src = t.src.tiles(t.shape)
        for dev, tile in t.dst.tiles(t.shape).items():
            got[t.name, dev] = np.full([hi - lo for lo, hi in tile], -1, np.int64)
            held = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(src.get(dev, tile), tile))
            if dev in src and all(lo < hi for lo, hi in held):  # what the device holds of its tile already
                got[t.name, dev][to_slices(held, tile)] = values[t.name][to_slices(held)]
    for s in program.steps:
        assert s.kind == MOVE
        decl = program.tensor(s.tensor)
        for r in s.transfer.receivers:
            got[s.tensor, r][to_slices(s.transfer.box, decl.dst.tile(decl.shape, r))] = \
                values[s.tensor][to_slices(s.transfer.box)]
    return {(n, d): (a, values[n][to_slices(program.tensor(n).dst.tile(program.tensor(n).shape, d))])
            for (n, d), a in got.items()}


def test_every_tensor_is_delivered_whole_and_exactly():
    decls = _state_dict()
    program = plan_many(decls, bucket_bytes=64 * 1024).validate()
    assert isinstance(program, ManyProgram) and {t.name for t in program.tensors} == {t.name for t in decls}
    for (name, dev), (got, want) in _run(program).items():
        assert np.array_equal(got, want), (name, dev)
    # each layout's tensors move as reshard.plan moves all of them at once (copies=) against one Loads of the
    # layouts before it, largest in all first, whose floor is the whole state dict's (a small chain may run its
    # receivers in another order: `SHARED_ROUTE_BYTES`)
    layouts: dict[tuple, list[TensorDecl]] = {}
    for decl in sorted(program.tensors, key=lambda d: -math.prod(d.shape) * d.itemsize):
        layouts.setdefault((decl.shape, decl.dtype, decl.src, decl.dst), []).append(decl)
    assert len(layouts) == 6  # the embedding, and the layers' five
    nics = Loads(program.topology)
    nics.set_floor([(decompose(g[0].shape, g[0].src, g[0].dst), g[0].itemsize * len(g)) for g in layouts.values()],
                   HostCache())
    assert nics.floor > 0
    for group in sorted(layouts.values(), key=lambda g: -len(g) * math.prod(g[0].shape) * g[0].itemsize):
        d = group[0]
        alone = sorted((t.box, t.sender, tuple(sorted(t.receivers)))
                       for t in plan(d.shape, d.dtype, d.src, d.dst, loads=nics, copies=len(group)).transfers)
        for decl in group:
            mine = sorted((s.transfer.box, s.transfer.sender, tuple(sorted(s.transfer.receivers)))
                          for s in program.steps if s.tensor == decl.name and s.role == SRC)
            assert mine == alone, decl.name


def test_buckets_are_at_least_the_bucket_size_except_the_last_between_two_ends():
    decls = _state_dict(num_layers=12)
    bucket = 16 * 1024
    program = plan_many(decls, bucket_bytes=bucket).validate()
    size = {t.name: t.itemsize for t in program.tensors}

    def nbytes(i: int) -> int:
        s = program.steps[i]
        return math.prod(hi - lo for lo, hi in s.transfer.box) * size[s.tensor]

    def ends(i: int) -> tuple:
        t = program.steps[i].transfer
        return t.sender, t.receivers, t.method, t.route

    assert program.buckets
    short: dict[tuple, int] = defaultdict(int)
    for b in program.buckets:
        assert len(b) >= 2 and len({ends(i) for i in b}) == 1
        assert all(nbytes(i) < bucket for i in b)
        if sum(nbytes(i) for i in b) < bucket:
            short[ends(b[0])] += 1
    assert all(n == 1 for n in short.values()), short
    # every small move that could share a stream does, and no large one is packed
    packed = {i for b in program.buckets for i in b}
    alone: dict[tuple, int] = defaultdict(int)
    for s in program.steps:
        if s.id not in packed and nbytes(s.id) < bucket:
            alone[ends(s.id)] += 1
    assert all(n == 1 for n in alone.values()), alone
    assert all(nbytes(i) < bucket for i in packed)
    assert not plan_many(decls, bucket_bytes=0).buckets


def test_balance_across_tensors_beats_planning_each_tensor_alone():
    """A large tensor that only host a0 holds, and small ones replicated on a0 and a1: planned alone, each small
    one takes half from a0, so a0 sends the large one and half of the rest; planned together, a1 sends the rest."""
    a0 = Mesh.from_hosts({"t": 2}, ["a0"], 2)
    both = Mesh.from_hosts({"r": 2, "t": 2}, ["a0", "a1"], 2)
    b0 = Mesh.from_hosts({"t": 2}, ["b0"], 2)
    b1 = Mesh.from_hosts({"t": 2}, ["b1"], 2)
    decls = [TensorDecl("embed", (4096, 1024), "float32", Sharding(a0, ("t", None)), Sharding(b0, ("t", None)))]
    decls += [TensorDecl(f"w{i}", (1024, 512), "float32", Sharding(both, ("t", None)), Sharding(b1, (None, "t")))
              for i in range(8)]
    for strategy in ("auto", "broadcast"):
        together = plan_many(decls, strategy=strategy, bucket_bytes=0).validate()
        steps = []
        for d in decls:
            own = Program.from_plan(plan(d.shape, d.dtype, d.src, d.dst, strategy=strategy))
            steps += [replace(s, id=len(steps) + s.id, tensor=d.name) for s in own.steps]
        alone = Program(tuple(decls), tuple(steps), strategy).validate()
        assert together.estimate_seconds < alone.estimate_seconds / 1.4, (strategy, together.estimate_seconds,
                                                                           alone.estimate_seconds)
        sent = {h: v["bytes_out"] for h, v in together.host_bytes().items() if h in ("a0", "a1")}
        assert sent == {"a0": 16 * MiB, "a1": 16 * MiB}, sent


def test_balance_never_makes_the_busiest_nic_busier():
    decls = _state_dict()
    for strategy in ("auto", "broadcast"):
        together = plan_many(decls, strategy=strategy, bucket_bytes=0)
        steps = []
        for d in decls:
            own = Program.from_plan(plan(d.shape, d.dtype, d.src, d.dst, strategy=strategy))
            steps += [replace(s, id=len(steps) + s.id, tensor=d.name) for s in own.steps]
        alone = Program(tuple(decls), tuple(steps), strategy)
        assert together.estimate_seconds <= alone.estimate_seconds * (1 + 1e-9)


def test_json_round_trip_and_the_id_covers_the_buckets():
    decls = _state_dict(2)
    a = plan_many(decls, bucket_bytes=64 * 1024)
    b = plan_many(decls, bucket_bytes=0)
    assert [_move(s) for s in a.steps] == [_move(s) for s in b.steps]
    assert a.buckets != b.buckets and a.id != b.id
    back = program_from_json(a.dumps())
    assert isinstance(back, ManyProgram) and back == a and back.id == a.id
    assert type(program_from_json(Program.from_plan(plan((8, 8), "int32", decls[0].src, decls[0].dst)).dumps())) \
        is Program
    doc = a.to_json()
    doc["buckets"] = doc["buckets"][1:]
    with pytest.raises(PlanValidationError, match="it was altered"):
        program_from_json(doc)
    assert str(a).startswith(f"Program {a.id[:12]} auto: {len(decls)} tensors")


def _move(step) -> tuple:
    """What a move step delivers: its id, tensor, box, sender and receivers (a bucket may change a chain's order)."""
    t = step.transfer
    return step.id, step.tensor, t.box, t.sender, frozenset(t.receivers)


def test_small_chains_share_one_route_and_bucket_and_large_ones_keep_theirs():
    train = Mesh.from_hosts({"tp": 4}, [f"t{i}" for i in range(4)], 1)
    infer = Mesh.from_hosts({"dp": 2, "tp": 2}, [f"i{i}" for i in range(4)], 1)
    # (of four shapes: each its own layout, planned on its own, so their chains may take several orders)
    decls = _state_dict() + [TensorDecl(f"big{i}", (4096 + 64 * i, 64), "float32", Sharding(train, ("tp", None)),
                                        Sharding(infer, ("tp", None))) for i in range(4)]
    # The training hosts' NICs at half the serving hosts' rate: a star from a training host to both replicas of a
    # large box would take it past the floor its serving hosts set, where a chain does not (`_fewer_hops`)
    slow = Topology(host_nic_gbps=tuple((h, 5.0) for h in train.hosts))
    alone = plan_many(decls, slow, bucket_bytes=0)  # every chain as its tensor's plan ordered it
    packed = plan_many(decls, slow, bucket_bytes=200 * 1024).validate()  # holds all the small moves of two ends
    assert [_move(s) for s in packed.steps] == [_move(s) for s in alone.steps]

    def chains(program, small: bool) -> dict:
        """(sender, receivers) -> the routes of its chains under (or from) SHARED_ROUTE_BYTES."""
        out = defaultdict(set)
        for s in program.steps:
            t = s.transfer
            if len(t.route) > 1 and (math.prod(hi - lo for lo, hi in t.box) * program.tensor(s.tensor).itemsize
                                     < SHARED_ROUTE_BYTES) == small:
                out[t.sender, frozenset(t.receivers)].add(t.route)
        return out

    assert any(len(routes) > 1 for routes in chains(alone, True).values())  # the plans chose several orders
    assert all(len(routes) == 1 for routes in chains(packed, True).values())
    buckets = {i: k for k, b in enumerate(packed.buckets) for i in b}
    small = defaultdict(set)
    for s in packed.steps:
        if len(s.transfer.route) > 1 and not s.tensor.startswith("big"):
            small[s.transfer.sender, frozenset(s.transfer.receivers)].add(buckets.get(s.id))
    # one bucket each (None: a lone move, which needs none)
    assert all(len(ks) == 1 for ks in small.values()) and sum(None not in ks for ks in small.values()) >= 3
    # A larger chain's order balances which host forwards it: kept as its plan chose it.
    large = {s.id for s in packed.steps if s.tensor.startswith("big")}
    assert large and all(packed.steps[i] == alone.steps[i] for i in large)
    assert any(len(routes) > 1 for routes in chains(packed, False).values())


def test_bad_buckets_are_refused_naming_the_rule():
    program = plan_many(_state_dict(2), bucket_bytes=64 * 1024)
    first, second = program.buckets[0], program.buckets[1]
    cases = [
        ((first[:1],), "a bucket packs two or more moves"),
        ((first, (first[0], second[0])), f"step {first[0]} is already in bucket 0"),
        (((first[0], second[0]),), "share sender, receivers, method and route"),
        (((first[0], len(program.steps)),), "is not a step of this program"),
    ]
    for buckets, message in cases:
        with pytest.raises(PlanValidationError, match=message):
            replace(program, buckets=buckets).validate()


def test_arguments_are_checked():
    decls = _state_dict(1)
    with pytest.raises(InvalidShardingError, match="bucket_bytes -1 must be an integer from 0"):
        plan_many(decls, bucket_bytes=-1)
    with pytest.raises(InvalidShardingError, match="unknown strategy 'fast'"):
        plan_many(decls, strategy="fast")
    with pytest.raises(InvalidShardingError, match="needs at least one tensor"):
        plan_many([])
    with pytest.raises(InvalidShardingError, match="'embed' needs both src and dst"):
        plan_many([replace(decls[0], dst=None)])


# -- block scales ------------------------------------------------------------------------------------------------


MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1"], 2)


@pytest.mark.parametrize("shape,scale_shape,spec,block", [
    ((1024, 512), (8, 4), ("x", "y"), None),       # 128 x 128 blocks, 2 x 2 tiles of whole blocks
    ((1000, 512), (8, 4), (None, ("x", "y")), None),  # a trailing partial block on a dim that is not split
    ((1024, 300), (8, 3), (("x", "y"), None), 128),   # 4 tiles of 2 blocks; 3 blocks of 100 columns
    ((1023, 64), (8, 1), ("x", None), (128, 64)),    # tiles of 512 and 511 rows: 4 blocks each, the last partial
    ((500, 64), (4, 1), ("x", None), None),         # blocks of 125: tiles of 250, whole blocks
])
def test_scales_follow_their_weight_block_for_block(shape, scale_shape, spec, block):
    weight = Sharding(MESH, spec)
    scales = scale_sharding(shape, weight, scale_shape, "w", "w_scale", block)
    assert scales.mesh == weight.mesh and scales.spec == weight.spec
    blocks = block if isinstance(block, tuple) else [block or -(-n // s) for n, s in zip(shape, scale_shape)]
    s_tiles = scales.tiles(scale_shape)
    for dev, tile in weight.tiles(shape).items():
        assert s_tiles[dev] == tuple((lo // b, -(-hi // b)) for (lo, hi), b in zip(tile, blocks)), dev


def test_scales_that_cannot_follow_are_refused_naming_the_tile_and_the_way_out():
    rows = Sharding(MESH, (("x", "y"), None))
    with pytest.raises(ScaleLayoutError, match=r"device h0/1's tile of the weight, \[250:500, 0:512\] in "
                                               r"P\(\('x', 'y'\), None\), starts at 250 along dim 0, inside a block "
                                               r"of 128 elements"):
        scale_sharding((1000, 512), rows, (8, 4), "w", "w_scale", 128)
    with pytest.raises(ScaleLayoutError, match=r"dim 0 of 1023 elements has 8 scale entries, which blocks of 128 to "
                                               r"146 elements all make, .* name the block size: "
                                               r"scales=\{'w': \('w_scale', block\)\}"):
        scale_sharding((1023, 512), rows, (8, 4), "w", "w_scale")
    with pytest.raises(ScaleLayoutError, match="a block scale has one dim per weight dim"):
        scale_sharding((64, 64), Sharding(MESH, ("x", None)), (4,), "w", "s")
    with pytest.raises(ScaleLayoutError, match="6 blocks along dim 0 would be 2 elements each, but 10 elements make 5"):
        scale_sharding((10, 4), Sharding(MESH, ("x", None)), (6, 1), "w", "s")
    with pytest.raises(ScaleLayoutError, match="dim 1 has 9 scale entries for 4 weight elements"):
        scale_sharding((10, 4), Sharding(MESH, ("x", None)), (5, 9), "w", "s")
    with pytest.raises(ScaleLayoutError, match=r"block \(128, 128, 128\) gives 3 sizes for 2 dims"):
        scale_sharding((1024, 512), rows, (8, 4), "w", "s", (128, 128, 128))


def test_plan_many_moves_scales_with_their_weights():
    train = Mesh.from_hosts({"tp": 4}, ["t0", "t1", "t2", "t3"], 1)
    infer = Mesh.from_hosts({"dp": 2, "tp": 2}, ["i0", "i1", "i2", "i3"], 1)
    w = TensorDecl("w", (512, 256), "uint8", Sharding(train, ("tp", None)), Sharding(infer, (None, "tp")))
    s = TensorDecl("w_scale", (4, 2), "float32", Sharding(train, ("tp", None)))
    program = plan_many([w, s], scales={"w": "w_scale"}).validate()
    assert program.tensor("w_scale").dst == Sharding(infer, (None, "tp"))
    with pytest.raises(ScaleLayoutError, match="scale 'w_scale' is given destination"):
        plan_many([w, replace(s, dst=Sharding(infer, ("tp", None)))], scales={"w": "w_scale"})
    with pytest.raises(ScaleLayoutError, match="weight 'v' of the pair 'v' -> 'w_scale' is not among the tensors"):
        plan_many([w, s], scales={"v": "w_scale"})
    with pytest.raises(ScaleLayoutError, match="scale 'w_scale' follows both"):
        plan_many([w, replace(s, name="w2"), s], scales={"w": "w_scale", "w2": "w_scale"})


def test_a_program_over_max_steps_is_refused_naming_its_steps_before_they_are_made():
    decls = _state_dict()
    steps = len(plan_many(decls).steps)
    assert len(plan_many(decls, max_steps=steps).steps) == steps  # at the bound: made
    with pytest.raises(ProgramSizeError, match=rf"{len(decls)} tensors \(6 layouts\) would hold (at least|more "
                                               rf"than) [\d,]+ steps, over the {steps - 1:,} allowed \(max_steps"):
        plan_many(decls, max_steps=steps - 1)
    with pytest.raises(ProgramSizeError, match="would hold at least"):  # from the layouts' plans alone
        plan_many(decls, max_steps=10)
    with pytest.raises(InvalidShardingError, match="max_steps 0 must be a positive integer"):
        plan_many(decls, max_steps=0)


def test_copies_count_a_layouts_tensors_only_against_loads():
    d = _state_dict()[1]
    with pytest.raises(InvalidShardingError, match="copies 2 must be a positive integer, and more than 1 only with "
                                                   "loads="):
        plan(d.shape, d.dtype, d.src, d.dst, copies=2)
    with pytest.raises(InvalidShardingError, match="copies 0 must be a positive integer"):
        plan(d.shape, d.dtype, d.src, d.dst, loads=Loads(Topology()), copies=0)
    # the same transfers as one copy's, the loads counting three
    one, three = Loads(Topology()), Loads(Topology())
    alone = plan(d.shape, d.dtype, d.src, d.dst, loads=one)
    tripled = plan(d.shape, d.dtype, d.src, d.dst, loads=three, copies=3)
    assert tripled.transfers == alone.transfers
    assert max(three.send.values()) == pytest.approx(3 * max(one.send.values()))
