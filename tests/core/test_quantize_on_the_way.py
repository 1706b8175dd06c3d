"""Quantizing on the way (`plan_many(..., dtypes=)`, `reshard.quantize`): the program a bf16 weight's move to fp8
with 128 x 128 block scales becomes, on small meshes.

Each program is validated whole, priced below moving the bf16 weight, and run here step by step on numpy tiles with
the agents' own kernels: every destination tile of the fp8 weight and of its scales must be the numpy reference
quantizer's bits of the whole tensor (tests/core/test_fp8_kernels.py), whether the source tiles start on block
boundaries (each sender quantizes its own tile) or cut blocks (whole blocks gathered within a host first).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard import box as boxes
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.errors import PlanValidationError
from reshard.many import WAITING_BUCKET_MOVES, ManyProgram, plan_many
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.program import COMPUTE, MOVE, SRC, TensorDecl
from reshard.mesh import host_of
from reshard.quantize import DtypeConversionError, quantize_layout
from reshard.server.agent.buckets import bucket_moves
from reshard.server.agent.task_graph import host_tasks
from reshard.server.agent.kernels import KERNELS as AGENT_KERNELS
from tests.core.test_fp8_kernels import reference

FP8 = "float8_e4m3fn"
TRAIN = Mesh.from_hosts({"x": 4}, ["h0", "h1"], 2)  # 2 hosts x 2 devices, one axis over all four
GRID = Mesh.from_hosts({"host": 2, "gpu": 2}, ["h0", "h1"], 2)
SERVE = Mesh.from_hosts({"y": 2}, ["s0", "s1"], 1)
SERVE2 = Mesh.from_hosts({"r": 2, "t": 2}, ["s0", "s1"], 2)
_BITS = {"bfloat16": np.uint16, FP8: np.uint8, "float32": np.float32}


def _weight(shape, seed=1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 3.5]
    return float32_to_bfloat16(x)


def _decls(shape, src, dst, scale_src=None):
    grid = tuple(-(-n // 128) for n in shape)
    return [TensorDecl("w", shape, "bfloat16", src, dst), TensorDecl("w_s", grid, "float32", scale_src),
            TensorDecl("norm", (shape[1],), "bfloat16", Sharding(src.mesh, (None,)), Sharding(dst.mesh, (None,)))]


def _run(program: ManyProgram, values: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Every step of ``program`` in order, on numpy tiles (bits), with the agents' kernels; returns each committed
    tensor's destination tiles by device. A read takes whichever buffer of its device holds the box in the role
    asked for (any role for a move of role 'src'), as an agent's run does."""
    held: dict[tuple[str, str], list[tuple[str, tuple, np.ndarray]]] = defaultdict(list)  # (dev, tensor) -> bufs

    def read(dev, tensor, role, box):
        decl = program.tensor(tensor)
        pieces = []
        if decl.src is not None and role in (None, SRC):
            tile = decl.src.tile(decl.shape, dev)
            pieces.append((tile, values[tensor.split("~")[0]][boxes.to_slices(tile)]))
        pieces += [(b, a) for r, b, a in held[dev, tensor] if role is None or r == role]
        out = np.zeros(tuple(hi - lo for lo, hi in box), dtype=_BITS[decl.dtype])
        got = []
        for b, a in pieces:
            part = boxes.intersect(b, box)
            if part is not None and boxes.volume(part):
                out[boxes.to_slices(part, box)] = a[boxes.to_slices(part, b)]
                got.append(part)
        assert not boxes.uncovered(box, got), (dev, tensor, role, box)
        return out

    for s in program.steps:
        if s.kind == MOVE:
            t = s.transfer
            data = read(t.sender, s.tensor, None if s.role == SRC else s.role, t.box)
            for r in t.receivers:
                held[r, s.tensor].append(("dst", t.box, data.copy()))
        else:
            assert s.kind == COMPUTE
            x = [read(s.device, ref.tensor, ref.role, ref.box) for ref in s.inputs]
            out = np.zeros(tuple(hi - lo for lo, hi in s.output.box),
                           dtype=_BITS[program.tensor(s.output.tensor).dtype])
            if s.kernel == "copy":
                out[...] = x[0]
            else:
                AGENT_KERNELS[s.kernel](x, out, dict(s.params))
            held[s.device, s.output.tensor].append((s.output.role, s.output.box, out))
    return {t.name: {dev: read(dev, t.name, "dst", tile) for dev, tile in t.dst.tiles(t.shape).items()}
            for t in program.tensors if t.dst is not None and t.src is None}


def _check_bits(program: ManyProgram, weight: np.ndarray) -> None:
    codes, scales = reference(bfloat16_to_float32(weight), 128)
    tiles = _run(program, {"w": weight, "norm": weight[0]})
    w, s = program.tensor("w"), program.tensor("w_s")
    assert (w.dtype, s.dtype) == (FP8, "float32")
    for dev, tile in w.dst.tiles(w.shape).items():
        np.testing.assert_array_equal(tiles["w"][dev], codes[boxes.to_slices(tile)], err_msg=dev)
    for dev, tile in s.dst.tiles(s.shape).items():
        np.testing.assert_array_equal(tiles["w_s"][dev].view(np.uint32), scales[boxes.to_slices(tile)].view(np.uint32))


@pytest.mark.parametrize("shape, src, dst", [
    ((512, 384), Sharding(TRAIN, ("x", None)), Sharding(SERVE, ("y", None))),  # 128 rows a device: aligned
    ((256, 256), Sharding(TRAIN, ("x", None)), Sharding(SERVE, (None, "y"))),  # 64 rows a device: cuts blocks
    ((256, 300), Sharding(TRAIN, (None, None)), Sharding(SERVE, ("y", None))),  # replicated, a short last block
    ((256, 512), Sharding(GRID, ("host", "gpu")), Sharding(SERVE2, (None, "t"))),  # to 2 replicas of 2 devices
    ((384, 256), Sharding(GRID, (("host", "gpu"), None)), Sharding(SERVE2, (None, "t"))),  # 96 rows, 192 a host
], ids=["aligned-rows", "rows-cut-per-device", "replicated-300-columns", "blocks-to-replicas", "96-rows-a-device"])
def test_the_wire_carries_fp8_and_every_tile_is_the_reference_quantizers(shape, src, dst):
    program = plan_many(_decls(shape, src, dst), scales={"w": "w_s"}, dtypes={"w": FP8}).validate()
    assert program.tensor("w~bfloat16").src == src  # the weight as held, read by the quantize steps
    moved = {s.tensor: program.tensor(s.tensor).dtype for s in program.steps if s.kind == MOVE}
    assert moved["w"] == FP8 and moved["w_s"] == "float32"
    # every compute step reads a tile that starts on a block boundary of the tensor
    for s in program.steps:
        if s.kind == COMPUTE and s.kernel.startswith("fp8"):
            assert all(lo % 128 == 0 for lo, _ in s.inputs[0].box), s
    _check_bits(program, _weight(shape))
    bf16 = plan_many([_decls(shape, src, dst)[0]]).validate()
    assert program.estimate() < bf16.estimate()
    # the network carries the fp8 values (one byte an element) and the scales, not two bytes an element
    sent = sum(h["bytes_out"] for h in program.host_bytes().values())
    assert sent < sum(h["bytes_out"] for h in bf16.host_bytes().values()) + 2 * shape[1] * 2


def test_aligned_tiles_are_quantized_where_they_lie_with_no_gather():
    src = Sharding(TRAIN, ("x", None))
    program = plan_many(_decls((512, 256), src, Sharding(SERVE, ("y", None))), scales={"w": "w_s"},
                        dtypes={"w": FP8}).validate()
    assert not [s for s in program.steps if s.kind == MOVE and s.tensor == "w~bfloat16"]
    kernels = sorted((s.kernel, s.device, s.inputs[0].role) for s in program.steps if s.kind == COMPUTE)
    assert kernels == sorted((k, d, "src") for k in ("fp8_quantize_scaled", "fp8_scales")
                             for d in TRAIN.require_devices())
    # each device's quantize divides by the scales it made: it reads them, and waits for their step
    made = {(s.device, s.output.tensor): s.id for s in program.steps if s.kind == COMPUTE}
    for s in program.steps:
        if s.kind == COMPUTE and s.kernel == "fp8_quantize_scaled":
            assert s.inputs[1].tensor == "w_s" and made[(s.device, "w_s")] in s.after
    assert program.tensor("norm").dtype == "bfloat16"


def test_tiles_that_cut_blocks_are_gathered_within_their_host_first():
    src = Sharding(TRAIN, ("x", None))  # 64 rows a device; 128 a host
    q = quantize_layout((256, 256), src, 128)
    assert q.spec == (("host",), ("device",)) and q.mesh.require_devices() == TRAIN.require_devices()
    program = plan_many(_decls((256, 256), src, Sharding(SERVE, (None, "y"))), scales={"w": "w_s"},
                        dtypes={"w": FP8}).validate()
    gathers = [s.transfer for s in program.steps if s.kind == MOVE and s.tensor == "w~bfloat16"]
    assert gathers and {t.method for t in gathers} == {"local"}
    assert sum(boxes.volume(t.box) for t in gathers) == 4 * 64 * 128  # each device lacks half its 128 x 128 tile


def test_a_small_moe_state_dict_quantizes_every_linear_weight_on_the_way():
    train = Mesh.grid({"host": 2, "gpu": 4}, 4, "train")
    serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "serve", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    program = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes).validate()
    for name, dtype in case.serve_dtypes.items():
        assert program.tensor(name).dtype == dtype, name
    quantized = [w for w in case.scales if case.serve_dtypes[w] == FP8]
    assert len(quantized) == 64 and all(program.tensor(f"{w}~bfloat16").src is not None for w in quantized)
    assert program.estimate() < plan_many(case.weights).estimate()


def test_a_quantized_weights_small_moves_travel_in_buckets_that_wait_for_its_quantize_steps():
    """The moves of what the quantize steps made wait for those steps; the small ones are packed into buckets by
    path and depth as the moves that wait for nothing are, and an agent's bucket waits for everything its members
    wait for (the scaled-down MoE of bench/moe_sync.py made 546 such moves, one stream each, before)."""
    train = Mesh.grid({"host": 2, "gpu": 4}, 4, "train")
    serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "serve", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    program = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes).validate()
    made = {t.name for t in program.tensors if t.src is None}
    waiting = [s for s in program.steps if s.kind == MOVE and s.after and s.tensor in made]
    packed = {i: k for k, b in enumerate(program.buckets) for i in b}
    paths = defaultdict(list)  # every move of a made tile here is under 16 MiB: all but the lone ones are packed
    for s in waiting:
        t = s.transfer
        paths[program.depths[s.id], t.sender, t.receivers, t.method, t.route].append(s.id)
    assert sum(len(ids) > 1 for ids in paths.values()) >= 8
    assert all(i in packed for ids in paths.values() if len(ids) > 1 for i in ids)
    buckets = bucket_moves(program)
    lead = {i: first for first, b in buckets.items() for i in b.ids}
    for first, bucket in buckets.items():
        ids = set(bucket.ids)
        assert len({program.depths[i] for i in ids}) == 1
        assert set(bucket.step.after) == {a for m in bucket.members for a in m.after} - ids
    hosts = sorted({host_of(d) for d in (*train.require_devices(), *serve.require_devices())})
    for host in hosts:
        for task in host_tasks(program, host, buckets):
            if task.role == "send" and task.step.id in buckets and task.step.after:
                here = {t.step.id for t in host_tasks(program, host, buckets)}
                assert set(task.deps) == {lead.get(a, a) for a in task.step.after} & here and task.deps
    # Packing changes no step; and buckets are filled by the bytes their members carry, fp8 for a weight: each but
    # the last of its path and depth holds at least bucket_bytes, and drops under it without its last member.
    unpacked = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes, bucket_bytes=0).validate()
    assert not unpacked.buckets and unpacked.steps == program.steps
    small = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes, bucket_bytes=2**17).validate()
    last: dict[tuple, int] = {}
    for k, b in enumerate(small.buckets):
        t = small.steps[b[0]].transfer
        last[small.depths[b[0]], t.sender, t.receivers, t.method, t.route] = k
    for k, bucket in enumerate(bucket_moves(small).values()):
        if k not in last.values():
            assert bucket.nbytes >= 2**17 > bucket.nbytes - (bucket.parts[-1][3] - bucket.parts[-1][2]), k


def test_a_bucket_of_quantized_moves_waits_for_at_most_so_many_quantize_steps():
    """Tiny weights quantized on the way: their moves would fill a bucket by bytes only after thousands, each
    waiting for its quantize step on the sender while the receiver's posted receive counts down (a sync of 20,000
    gave up after the collective transport's 30 s); a bucket of them takes `WAITING_BUCKET_MOVES` at most."""
    src, dst = Sharding(Mesh.from_hosts({"x": 1}, ["h0"], 1), (None, None)), Sharding(SERVE, (None, None))
    n = 2 * WAITING_BUCKET_MOVES + 10
    decls = [d for i in range(n) for d in (TensorDecl(f"w{i}", (16, 16), "bfloat16", src, dst),
                                            TensorDecl(f"w{i}_s", (1, 1), "float32", None))]
    program = plan_many(decls, scales={f"w{i}": f"w{i}_s" for i in range(n)},
                        dtypes={f"w{i}": FP8 for i in range(n)}).validate()
    waits = {s.id for s in program.steps if s.kind == MOVE and s.after}
    sizes = sorted((len(b) for b in program.buckets if waits.issuperset(b)), reverse=True)
    # the weights' moves and the scales' moves, a chain to both serving hosts each: 2 full buckets of each, the rest
    assert sizes == [WAITING_BUCKET_MOVES] * 4 + [10] * 2 and sum(sizes) == 2 * n, sizes


def test_without_dtypes_the_program_is_unchanged():
    decls = _decls((256, 256), Sharding(TRAIN, ("x", None)), Sharding(SERVE, (None, "y")))[::2]
    assert plan_many(decls, dtypes={}).id == plan_many(decls).id
    assert plan_many(decls, dtypes={"w": "bfloat16"}).id == plan_many(decls).id  # its own dtype: no conversion


def test_a_made_tile_left_short_is_refused_by_validate():
    program = plan_many(_decls((512, 256), Sharding(TRAIN, ("x", None)), Sharding(SERVE, ("y", None))),
                        scales={"w": "w_s"}, dtypes={"w": FP8})
    last = max(s.id for s in program.steps if s.kind == MOVE and s.tensor == "w")
    steps = tuple(s for s in program.steps if s.id != last)
    steps = tuple(type(s)(**{**s.__dict__, "id": i}) for i, s in enumerate(steps))
    short = ManyProgram(program.tensors, steps, program.strategy, program.topology)
    with pytest.raises(PlanValidationError, match=r"tensor 'w' is made by the program's steps and must end in .* "
                                                  r"no step writes \[.*\] of it"):
        short.validate()


def test_a_made_tile_left_short_is_refused_for_the_second_weight_of_a_layout_too():
    """The made tiles of one layout's weights are checked once per pattern of the steps that write them: a second
    weight written otherwise (a move left out) is checked on its own, and refused."""
    src, dst = Sharding(TRAIN, ("x", None)), Sharding(SERVE, ("y", None))
    decls = [TensorDecl(w, (512, 256), "bfloat16", src, dst) for w in ("w", "v")]
    decls += [TensorDecl(f"{w}_s", (4, 2), "float32") for w in ("w", "v")]
    program = plan_many(decls, scales={"w": "w_s", "v": "v_s"}, dtypes={"w": FP8, "v": FP8}).validate()
    last = max(s.id for s in program.steps if s.kind == MOVE and s.tensor == "v")
    steps = tuple(s for s in program.steps if s.id != last)
    steps = tuple(type(s)(**{f: getattr(s, f) for f in ("kind", "after", "transfer", "tensor", "role", "kernel",
                                                         "device", "inputs", "output", "params", "op", "devices",
                                                         "result", "algorithm", "dim")},
                          id=i) for i, s in enumerate(steps))
    short = ManyProgram(program.tensors, steps, program.strategy, program.topology)
    with pytest.raises(PlanValidationError, match=r"tensor 'v' is made by the program's steps and must end in .* "
                                                  r"no step writes \[.*\] of it"):
        short.validate()


@pytest.mark.parametrize("dtypes, scales, message", [
    ({"w": "float9"}, {"w": "w_s"}, r"tensor 'w' \(bfloat16\) is asked for as 'float9': .*; reshard converts "
                                    r"float8_e4m3fn from bfloat16, float16, float32"),
    ({"w": "float16"}, {"w": "w_s"}, r"tensor 'w' is bfloat16 and is asked for as float16, a conversion reshard "
                                     r"does not make on the way; it converts float8_e4m3fn from bfloat16, float16, "
                                     r"float32"),
    ({"w": FP8}, {}, r"tensor 'w' is asked for as float8_e4m3fn, which carries a float32 scale per 128 x 128 block "
                     r"beside it, but scales names none for it; name one"),
    ({"norm": FP8}, {"w": "w_s"}, r"tensor 'norm' of shape \(256,\) is asked for as float8_e4m3fn, which quantizes "
                                  r"matrices in square blocks .* leave 1-D tensors .* out of dtypes"),
    (FP8, {"w": "w_s"}, r"tensor 'norm' of shape \(256,\)"),  # one dtype for all reaches the norm too
    ({"w": FP8, "w_s": FP8}, {"w": "w_s"}, r"'w_s' is the block scale of a weight here, .*; scales stay float32"),
    ({"nope": FP8}, {"w": "w_s"}, r"dtypes names tensors \['nope'\] that are not moved here"),
])
def test_conversions_it_cannot_make_are_refused_naming_the_tensor(dtypes, scales, message):
    decls = _decls((256, 256), Sharding(TRAIN, ("x", None)), Sharding(SERVE, (None, "y")))
    if not scales:
        decls = decls[::2]
    with pytest.raises(DtypeConversionError, match=message):
        plan_many(decls, scales=scales, dtypes=dtypes)


def test_a_scale_of_the_wrong_shape_is_refused():
    decls = _decls((256, 256), Sharding(TRAIN, ("x", None)), Sharding(SERVE, (None, "y")))
    decls[1] = TensorDecl("w_s", (2, 2), "bfloat16")
    with pytest.raises(DtypeConversionError, match=r"scale 'w_s' of weight 'w' \(256, 256\) is bfloat16\[2, 2\], but "
                                                   r"quantizing in blocks of 128 makes float32\[2, 2\]"):
        plan_many(decls, scales={"w": "w_s"}, dtypes={"w": FP8})


def test_blocks_that_are_not_square_are_refused():
    decls = _decls((256, 256), Sharding(TRAIN, ("x", None)), Sharding(SERVE, (None, "y")))
    decls[1] = TensorDecl("w_s", (2, 4), "float32")
    with pytest.raises(DtypeConversionError, match=r"weight 'w' is quantized with the scale 'w_s' in blocks of "
                                                   r"\(128, 64\), but the fp8 serving format's blocks are square"):
        plan_many(decls, scales={"w": ("w_s", (128, 64))}, dtypes={"w": FP8})
