"""reshard_many(..., dtype="float8_e4m3fn") through real agents: bf16 weights arrive as fp8 with 128 x 128 block
scales, quantized by the senders, bit for bit the numpy reference quantizer's (tests/core/test_fp8_kernels.py).

Training tiles that start on block boundaries are quantized where they lie; tiles that cut blocks are gathered into
whole blocks first. The scale tensor is made by the job, or gets its next version; the bf16 version stays readable
through a pin; the job's per-tensor report says the weight was quantized (and why it moved whole, not as a delta).
A scaled-down Kimi-K2-like state dict (`reshard.moe`: 2 layers, 16 experts) goes the same way. Conversions the
planner cannot make are refused before anything moves, naming the tensor, and leave every tensor as it was.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client import InvalidArgumentError
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.moe import MoeConfig, moe_state_dict
from tests.core.test_fp8_kernels import reference

FP8 = "float8_e4m3fn"
TRAIN = Mesh.from_hosts({"x": 4}, ["host0", "host1"], 2)  # one axis over 2 hosts x 2 devices
SERVE = Mesh.from_hosts({"y": 2}, ["host2", "host3"], 1)
TRAIN_GRID = Mesh.from_hosts({"host": 2, "gpu": 2}, ["host0", "host1"], 2)
SERVE_GRID = Mesh.from_hosts({"host": 2, "gpu": 2}, ["host2", "host3"], 2)
# 2 layers (one dense, one of 16 experts), every serving cut on a block boundary over 2 devices a host, small enough
# for the reference quantizer, which encodes one value at a time
TINY_MOE = MoeConfig(num_layers=2, num_experts=16, num_shared_experts=0, hidden=128, intermediate=128,
                     dense_intermediate=256, vocab=256, num_heads=4, q_lora_rank=128, kv_lora_rank=128,
                     qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)


def _bf16(shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 3.5]
    return float32_to_bfloat16(x).view(ml_dtypes.bfloat16)


def _assert_quantized(client, name: str, scale: str, weight: np.ndarray) -> None:
    """``name`` and ``scale`` in the catalog are the reference quantizer's bits of ``weight`` (bf16)."""
    codes, scales = reference(bfloat16_to_float32(weight.view(np.uint16)), 128)
    got = client.get_many([name, scale])
    assert client.info(name).dtype == FP8 and client.info(scale).dtype == "float32"
    assert got[name].dtype == ml_dtypes.float8_e4m3fn and got[name].shape == weight.shape
    np.testing.assert_array_equal(got[name].view(np.uint8), codes, err_msg=name)
    np.testing.assert_array_equal(got[scale].view(np.uint32), scales.view(np.uint32), err_msg=scale)


def _cleanup(client, names) -> None:
    held = {t.name for t in client.tensors()}
    for n in names:
        if n in held:
            client.delete(n)


@pytest.mark.transports_in_turn
@pytest.mark.parametrize("src", [Sharding(TRAIN, ("x", None)), Sharding(TRAIN_GRID, ("host", None))],
                         ids=["64-rows-a-device-cut-blocks", "128-rows-a-host-aligned"])
def test_bf16_weights_arrive_as_fp8_with_scales_the_job_makes(client, fresh_name, src):
    n = fresh_name
    w, v, norm = _bf16((256, 512), 1), _bf16((256, 256), 2), _bf16((1, 512), 3)[0]
    names = [f"{n}.w", f"{n}.v", f"{n}.norm", f"{n}.w_s", f"{n}.v_s"]
    client.put_many({f"{n}.w": (w, src), f"{n}.v": (v, src), f"{n}.norm": (norm, Sharding(TRAIN, (None,)))})
    # v's scale exists already: the job publishes its next version
    client.put(f"{n}.v_s", np.zeros((2, 2), np.float32), Sharding(TRAIN, (None, None)))
    pin = client.pin([f"{n}.w"])
    try:
        result = client.reshard_many(
            {f"{n}.w": Sharding(SERVE, (None, "y")), f"{n}.v": Sharding(SERVE, ("y", None)),
             f"{n}.norm": Sharding(SERVE, (None,))},
            scales={f"{n}.w": f"{n}.w_s", f"{n}.v": f"{n}.v_s"},
            dtype={f"{n}.w": FP8, f"{n}.v": FP8, f"{n}.norm": "bfloat16"}).result(timeout=120)
        assert result.state == "succeeded", result.error
        _assert_quantized(client, f"{n}.w", f"{n}.w_s", w)
        _assert_quantized(client, f"{n}.v", f"{n}.v_s", v)
        assert client.info(f"{n}.w_s").sharding == Sharding(SERVE, (None, "y"))
        assert result.versions[f"{n}.w_s"] == 1 and result.versions[f"{n}.v_s"] == 2
        np.testing.assert_array_equal(client.get(f"{n}.norm").view(np.uint16), norm.view(np.uint16))
        # the bf16 version a pin holds is still there, as it was
        old = client.get_many([f"{n}.w"], version=pin)[f"{n}.w"]
        assert old.dtype == ml_dtypes.bfloat16 and np.array_equal(old.view(np.uint16), w.view(np.uint16))
        # the report names what was quantized, and why it did not move as a delta
        assert result.deltas[f"{n}.w"]["mode"] == "full"
        assert "quantized on the way, bfloat16 -> float8_e4m3fn" in result.deltas[f"{n}.w"]["why"]
        assert "made on the way" in result.deltas[f"{n}.w_s"]["why"]
        # no delta base pair across the change of dtype (it would hold the bf16 version for nothing), one for the norm
        assert not any(i.delta_base for i in client.versions(f"{n}.w") + client.versions(f"{n}.w_s"))
        assert any(i.delta_base for i in client.versions(f"{n}.norm"))
        # the wire carried fp8: a byte an element of the weights (and the scales, and the norm), not two
        assert 256 * 512 + 256 * 256 < result.network_bytes < 2 * (256 * 512 + 256 * 256)
    finally:
        client.release(pin)
        _cleanup(client, names)


@pytest.mark.transports_in_turn
def test_a_trainer_publishes_bf16_every_step_and_each_sync_serves_fp8(client, fresh_name):
    """The RL loop: the serving side's version is fp8, and the trainer's next put of the name is bf16 again (the
    dtype the sync quantized from); any other dtype is still refused, naming both."""
    n = fresh_name
    src, dst = Sharding(TRAIN_GRID, ("host", None)), Sharding(SERVE, (None, "y"))
    try:
        for step in range(2):
            w = _bf16((256, 512), 10 + step)
            client.put(f"{n}.w", w, src, step=step)
            assert client.info(f"{n}.w").dtype == "bfloat16"
            result = client.reshard_many({f"{n}.w": dst}, scales={f"{n}.w": f"{n}.w_s"}, dtype=FP8).result(timeout=120)
            assert result.state == "succeeded", result.error
            _assert_quantized(client, f"{n}.w", f"{n}.w_s", w)
            assert result.versions == {f"{n}.w": 2 * step + 2, f"{n}.w_s": step + 1}
        with pytest.raises(InvalidArgumentError, match=rf"tensor '{n}.w' is float8_e4m3fn\[256, 512\] \(v4, quantized "
                                                       rf"on the way from bfloat16, so a new version is bfloat16 or "
                                                       rf"float8_e4m3fn\).*this one is float32"):
            client.put(f"{n}.w", np.zeros((256, 512), np.float32), src)
        assert client.info(f"{n}.w").version == 4
    finally:
        _cleanup(client, [f"{n}.w", f"{n}.w_s"])


@pytest.mark.transports_in_turn
def test_a_registered_sync_serves_fp8_every_step_on_its_one_program(client, fresh_name):
    """A weight sync quantizing on the way, run every step moving whole: from the third run on its job works in
    the catalog's columns (`JobRunner._sync_work`); each step's weights arrive bit for bit the reference
    quantizer's, the unquantized norm as it was put, at the versions a step makes."""
    n = fresh_name
    src = Sharding(TRAIN_GRID, ("host", None))
    dsts = {f"{n}.w": Sharding(SERVE, (None, "y")), f"{n}.v": Sharding(SERVE, ("y", None)),
            f"{n}.norm": Sharding(SERVE, (None,))}
    try:
        sync, plans = None, set()
        for step in range(4):
            w, v, norm = _bf16((256, 512), 20 + step), _bf16((256, 256), 30 + step), _bf16((1, 512), 40 + step)[0]
            client.put_many({f"{n}.w": (w, src), f"{n}.v": (v, src), f"{n}.norm": (norm, Sharding(TRAIN, (None,)))},
                            step=step)
            if sync is None:
                sync = client.register_sync(dsts, scales={f"{n}.w": f"{n}.w_s", f"{n}.v": f"{n}.v_s"},
                                            dtype={f"{n}.w": FP8, f"{n}.v": FP8})
            result = sync.run(version=step, delta=False).result(timeout=120)
            assert result.state == "succeeded", result.error
            plans.add(result.plan_id)
            _assert_quantized(client, f"{n}.w", f"{n}.w_s", w)
            _assert_quantized(client, f"{n}.v", f"{n}.v_s", v)
            np.testing.assert_array_equal(client.get(f"{n}.norm").view(np.uint16), norm.view(np.uint16))
            made = 2 * step + 2  # the trainer's put and the sync's commit each step; a scale only the sync's
            assert result.versions == {f"{n}.w": made, f"{n}.v": made, f"{n}.norm": made, f"{n}.w_s": step + 1,
                                       f"{n}.v_s": step + 1}
            assert "quantized on the way, bfloat16 -> float8_e4m3fn" in result.deltas[f"{n}.w"]["why"]
        assert len(plans) == 1, plans
    finally:
        _cleanup(client, [*dsts, f"{n}.w_s", f"{n}.v_s"])


@pytest.mark.transports_in_turn
def test_a_serving_manifest_lists_what_the_job_commits_fp8_weights_and_float32_scales(client, fresh_name):
    """The consumer's manifest gate checks what the job will commit: the weight in fp8 and its scale (made by the
    job, not in the catalog yet) as float32, one entry per block; one that expects the weight in bf16 is refused
    before anything moves, naming it."""
    from reshard import Manifest

    n = fresh_name
    src, dst = Sharding(TRAIN_GRID, ("host", None)), Sharding(SERVE, (None, "y"))
    w = _bf16((256, 512), 21)
    try:
        client.put(f"{n}.w", w, src)
        stale = Manifest({f"{n}.w": ((256, 512), "bfloat16"), f"{n}.w_s": ((2, 4), "float32")})
        with pytest.raises(InvalidArgumentError, match=rf"{n}\.w.*bfloat16.*float8_e4m3fn|{n}\.w.*float8_e4m3fn.*"
                                                       rf"bfloat16"):
            client.reshard_many({f"{n}.w": dst}, scales={f"{n}.w": f"{n}.w_s"}, dtype=FP8, manifest=stale)
        assert client.info(f"{n}.w").dtype == "bfloat16" and client.info(f"{n}.w").version == 1
        serving = Manifest({f"{n}.w": ((256, 512), FP8), f"{n}.w_s": ((2, 4), "float32")})
        result = client.reshard_many({f"{n}.w": dst}, scales={f"{n}.w": f"{n}.w_s"}, dtype=FP8,
                                     manifest=serving).result(timeout=120)
        assert result.state == "succeeded", result.error
        assert result.manifest_digest == serving.digest
        _assert_quantized(client, f"{n}.w", f"{n}.w_s", w)
    finally:
        _cleanup(client, [f"{n}.w", f"{n}.w_s"])


@pytest.mark.transports_in_turn(first="nixl")
def test_a_small_moe_state_dict_arrives_quantized(client, fresh_name):
    n = fresh_name
    case = moe_state_dict(TINY_MOE, TRAIN_GRID, SERVE_GRID, ep_devices=2)
    rng = np.random.default_rng(7)
    values = {}
    for t in case.weights:
        x = (rng.standard_normal(t.shape) * 0.02).astype(np.float32)
        values[t.name] = x if t.dtype == "float32" else float32_to_bfloat16(x).view(ml_dtypes.bfloat16)
    client.put_many({f"{n}.{t.name}": (values[t.name], t.src) for t in case.weights})
    names = [f"{n}.{t.name}" for t in case.tensors]
    try:
        result = client.reshard_many({f"{n}.{t.name}": t.dst for t in case.weights},
                                     scales={f"{n}.{w}": f"{n}.{s}" for w, s in case.scales.items()},
                                     dtype={f"{n}.{k}": d for k, d in case.serve_dtypes.items()
                                            if k not in case.scales.values()}).result(timeout=300)
        assert result.state == "succeeded", result.error
        got = client.get_many(names)
        quantized = 0
        for t in case.weights:
            mine = got[f"{n}.{t.name}"]
            assert client.info(f"{n}.{t.name}").sharding == t.dst
            if t.name not in case.scales:
                assert mine.dtype == values[t.name].dtype and mine.tobytes() == values[t.name].tobytes(), t.name
                continue
            codes, scales = reference(bfloat16_to_float32(values[t.name].view(np.uint16)), 128)
            np.testing.assert_array_equal(mine.view(np.uint8), codes, err_msg=t.name)
            np.testing.assert_array_equal(got[f"{n}.{case.scales[t.name]}"], scales, err_msg=t.name)
            quantized += 1
        assert quantized == 3 * 16 + 3 + 2 * 5  # experts, the dense MLP, attention
    finally:
        _cleanup(client, names)


@pytest.mark.parametrize("dtype, scales, message", [
    ("float9", True, r"tensor '.*\.w' \(bfloat16\) is asked for as 'float9'"),
    ({"w": "int32"}, True, r"tensor '.*\.w' is bfloat16 and is asked for as int32, a conversion reshard does not "
                           r"make on the way; it converts float8_e4m3fn from bfloat16, float16, float32"),
    (FP8, False, r"tensor '.*\.w' is asked for as float8_e4m3fn, which carries a float32 scale per 128 x 128 block "
                 r"beside it, but scales names none for it"),
    ({"w": FP8, "norm": FP8}, True, r"tensor '.*\.norm' of shape \(384,\) is asked for as float8_e4m3fn, which "
                                    r"quantizes matrices in square blocks"),
], ids=["unknown-dtype", "unsupported-conversion", "missing-scale", "not-2-d"])
def test_conversions_it_cannot_make_are_refused_and_nothing_changes(client, fresh_name, dtype, scales, message):
    n = fresh_name
    w, norm = _bf16((256, 384), 4), _bf16((1, 384), 5)[0]
    client.put_many({f"{n}.w": (w, Sharding(TRAIN, ("x", None))), f"{n}.norm": (norm, Sharding(TRAIN, (None,)))})
    try:
        if isinstance(dtype, dict):
            dtype = {f"{n}.{k}": d for k, d in dtype.items()}
        targets = {f"{n}.w": Sharding(SERVE, (None, "y"))}
        if isinstance(dtype, dict) and f"{n}.norm" in dtype:
            targets[f"{n}.norm"] = Sharding(SERVE, (None,))
        with pytest.raises(InvalidArgumentError, match=message):
            client.reshard_many(targets, scales={f"{n}.w": f"{n}.w_s"} if scales else None, dtype=dtype)
        # the service is alive and the tensors are as they were, no scale made
        assert client.info(f"{n}.w").dtype == "bfloat16" and client.info(f"{n}.w").sharding == Sharding(TRAIN,
                                                                                                       ("x", None))
        np.testing.assert_array_equal(client.get(f"{n}.w").view(np.uint16), w.view(np.uint16))
        assert f"{n}.w_s" not in {t.name for t in client.tensors()}
    finally:
        _cleanup(client, [f"{n}.w", f"{n}.norm"])


@pytest.mark.slow  # a collective cluster of its own and 6,000 tensors: 12 s; the planner's rule is in tests/core
def test_thousands_of_tiny_weights_quantized_on_the_way_outlast_no_receive():
    """Each tiny weight's quantize step costs its sender 1-2 ms of Python: packed by bytes alone, 3,000 of them went
    in one bucket, and the receiver's posted receive gave up after --collective-timeout (2 s here, 30 s by default:
    a sync of 20,000 failed so) before the bucket left. Buckets of moves that wait for steps are cut by their count
    (`reshard.many.WAITING_BUCKET_MOVES`), so each leaves as its members are quantized. Stream calls now wait for
    their peer up to the transfer timeout rather than --collective-timeout (tests/unit/test_collective_waits.py), so
    what this shows is the sync of thousands arriving bit-exact; the bucket rule itself is tested in tests/core."""
    pytest.importorskip("torch")
    from reshard.client.cluster import LocalCluster

    n = 3000
    one, two = Mesh.from_hosts({"x": 1}, ["host0"], 1), Mesh.from_hosts({"y": 1}, ["host1"], 1)
    weights = {f"w{i}": _bf16((16, 16), i) for i in range(n)}
    with LocalCluster(2, 1, transport="collective", agent_args=["--collective-timeout", "2"]) as cluster, \
            cluster.connect() as c:
        c.put_many({name: (w, Sharding(one, (None, None))) for name, w in weights.items()})
        result = c.reshard_many({name: Sharding(two, (None, None)) for name in weights},
                                scales={name: f"{name}_s" for name in weights},
                                dtype={name: FP8 for name in weights}).result(timeout=300)
        assert result.state == "succeeded", result.error
        for i in (0, n // 2, n - 1):
            _assert_quantized(c, f"w{i}", f"w{i}_s", weights[f"w{i}"])
