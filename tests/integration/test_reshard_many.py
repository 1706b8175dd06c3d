"""reshard_many, put_many and get_many on real agents: a transformer's state dict moved from a training layout to an
inference layout in one job, bit for bit, block scales with their weights; an agent killed mid-job leaves every
tensor at its old version, and the job succeeds once the agent is back."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client import AlreadyExistsError, InvalidArgumentError, JobFailedError, NotFoundError
from reshard.client.cluster import LocalCluster
from reshard.dtypes import DTYPE_SIZES
from reshard.errors import ScaleLayoutError
from reshard.proto import reshard_pb2 as pb

from .every_device import assert_every_device

torch = pytest.importorskip("torch", reason="the state dict is torch tensors (bfloat16, float8)")

TRAIN = Mesh.from_hosts({"tp": 4}, ["host0", "host1"], 2)  # tensor-parallel 4
INFER = Mesh.from_hosts({"dp": 2, "tp": 2}, ["host2", "host3"], 2)  # tensor-parallel 2, a replica per host
BLOCK = 128
# float8 weights once reshard stores them; until then bfloat16 ones, with the same block scales.
WEIGHT_DTYPE = torch.float8_e4m3fn if "float8_e4m3fn" in DTYPE_SIZES else torch.bfloat16


def state_dict(num_layers: int, hidden: int, seed: int = 0, train: Mesh = TRAIN, infer_mesh: Mesh = INFER):
    """A transformer's tensors in the training layout (``train``'s axis ``tp``): {name: (tensor, sharding)}, the
    inference layout of each weight (``infer_mesh``'s axis ``tp``), and {weight: scale} for the block-quantised
    MLP weights (their scales follow them)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    rows, cols = ("tp", None), (None, "tp")
    tensors, infer, scales = {}, {}, {}

    def add(name, t, train_spec, infer_spec):
        tensors[name] = (t, Sharding(train, train_spec))
        infer[name] = Sharding(infer_mesh, infer_spec)

    add("embed", rand(1003, hidden, dtype=torch.float32), rows, rows)  # uneven rows over 4 and over 2
    for i in range(num_layers):
        p = f"layers.{i}."
        add(p + "norm", rand(hidden, dtype=torch.float32), (None,), (None,))
        add(p + "attn.qkv", rand(3 * hidden, hidden), rows, rows)
        add(p + "attn.qkv_bias", rand(3 * hidden), ("tp",), ("tp",))
        add(p + "attn.out", rand(hidden, hidden), cols, cols)
        for name, shape, spec in (("mlp.up", (4 * hidden, hidden), rows), ("mlp.down", (hidden, 4 * hidden), cols)):
            add(p + name, rand(*shape, dtype=torch.float32).to(WEIGHT_DTYPE), spec, spec)
            scale = rand(shape[0] // BLOCK, shape[1] // BLOCK, dtype=torch.float32)
            tensors[p + name + "_scale"] = scale  # the array alone: it takes its weight's layout
            scales[p + name] = p + name + "_scale"
    return tensors, infer, scales


def _bits(t) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy() if t.dtype.itemsize == 1 else \
        t.contiguous().view({2: torch.int16, 4: torch.int32}[t.dtype.itemsize]).numpy()


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _values(tensors) -> dict:
    return {n: v[0] if isinstance(v, tuple) else v for n, v in tensors.items()}


def _check_scales_follow(c, scales, values, infer_mesh: Mesh = INFER) -> None:
    """On every inference device, each scale tile holds exactly the blocks of its weight tile."""
    for weight, scale in scales.items():
        w_info, s_info = c.info(weight), c.info(scale)
        for dev in infer_mesh.require_devices():
            tile = w_info.sharding.tile(w_info.shape, dev)
            want = values[scale][tuple(slice(lo // BLOCK, -(-hi // BLOCK)) for lo, hi in tile)]
            assert _same(c.get_shard(scale, dev), want), (scale, dev)
            assert s_info.sharding.tile(s_info.shape, dev) == tuple((lo // BLOCK, -(-hi // BLOCK)) for lo, hi in tile)


def _move_state_dict(c, num_layers: int, hidden: int, bucket_mib=None) -> None:
    tensors, infer, scales = state_dict(num_layers, hidden)
    values = _values(tensors)
    try:
        infos = c.put_many(tensors, scales=scales)
        assert set(infos) == set(tensors) and {i.version for i in infos.values()} == {1}
        for weight, scale in scales.items():
            assert infos[scale].sharding.spec == infos[weight].sharding.spec
        result = c.reshard_many(infer, bucket_mib=bucket_mib, scales=scales).result(timeout=120)
        assert result.versions == {n: 2 for n in tensors}
        got = c.get_many(list(tensors))
        assert all(_same(got[n], values[n]) for n in tensors), [n for n in tensors if not _same(got[n], values[n])]
        expected = {**infer, **{s: Sharding(INFER, infer[w].spec) for w, s in scales.items()}}
        listed = {t.name: t for t in c.tensors()}
        assert all(listed[n].version == 2 and listed[n].sharding == expected[n] for n in tensors)
        _check_scales_follow(c, scales, values)
        # moved bytes: every inference host received one replica, less what it held
        assert result.network_bytes > 0 and result.state == "succeeded"
    finally:
        for name in tensors:
            try:
                c.delete(name)
            except NotFoundError:
                pass


@pytest.mark.transports_in_turn(first="nixl")  # issue 38: buckets on nixl
def test_a_state_dict_moves_from_training_to_inference_layout_in_one_job(client):
    _move_state_dict(client, num_layers=4, hidden=256)


@pytest.mark.slow
def test_hundreds_of_tensors_move_bit_exact_in_one_job(client):
    _move_state_dict(client, num_layers=48, hidden=256)  # 433 tensors
    _move_state_dict(client, num_layers=8, hidden=512, bucket_mib=0)  # every move its own stream


def test_put_many_is_visible_all_at_once_or_not_at_all(client, fresh_name):
    c = client
    mesh = Sharding(TRAIN, ("tp", None))
    a, b = np.arange(64, dtype=np.float32).reshape(8, 8), np.arange(13 * 3, dtype=np.int64).reshape(13, 3)
    names = [f"{fresh_name}_a", f"{fresh_name}_b"]
    # opened, with every shard staged: still no tensor of them until the transaction finishes
    reply = c._planner_call("BeginUploads", pb.BeginUploadsRequest(tensors=[
        pb.BeginUploadRequest(name=n, shape=x.shape, dtype=x.dtype.name, kind="numpy",
                              sharding_json=json.dumps(mesh.to_json())) for n, x in zip(names, (a, b))]))
    for name, x, opened in zip(names, (a, b), reply.uploads):
        for p in opened.locations:
            tile = tuple(slice(lo, hi) for lo, hi in zip(p.box.lo, p.box.hi))
            c._upload(opened.upload_id, name, p.device, p, x.dtype.name, np.ascontiguousarray(x[tile]), False)
    assert not set(names) & {t.name for t in c.tensors()}
    with pytest.raises(NotFoundError, match=f"no tensor named '{names[0]}'"):
        c.get_many(names)
    with pytest.raises(AlreadyExistsError, match="is being uploaded"):
        c.put(names[1], b, mesh)
    c._planner_call("FinishUploads", pb.FinishUploadsRequest(group_id=reply.group_id))
    got = c.get_many(names)
    assert np.array_equal(got[names[0]], a) and np.array_equal(got[names[1]], b)
    # a put_many whose new version of one name changes its dtype adds none of its tensors
    with pytest.raises(InvalidArgumentError, match=rf"tensor '{names[1]}' is int64\[13, 3\] \(v1\), and a new "
                                                   rf"version keeps its shape and dtype"):
        c.put_many({f"{fresh_name}_c": (a, mesh), names[1]: (b.astype(np.int32), mesh)})
    assert f"{fresh_name}_c" not in {t.name for t in c.tensors()}
    # a scale whose weight tiles do not start on block boundaries is refused before anything is opened
    with pytest.raises(ScaleLayoutError, match="starts at 256 along dim 0, inside a block of 384"):
        c.put_many({f"{fresh_name}_w": (np.zeros((1024, 8), np.float32), mesh),
                    f"{fresh_name}_s": np.zeros((3, 1), np.float32)},
                   scales={f"{fresh_name}_w": (f"{fresh_name}_s", (384, 8))})
    assert not {f"{fresh_name}_w", f"{fresh_name}_s"} & {t.name for t in c.tensors()}
    for n in names:
        c.delete(n)


def test_bad_requests_name_the_rule_and_change_nothing(client, fresh_name):
    c = client
    src = Sharding(TRAIN, ("tp", None))
    a = np.arange(256 * 4, dtype=np.float32).reshape(256, 4)
    c.put(fresh_name, a, src)
    try:
        with pytest.raises(NotFoundError, match="no tensor named 'nope'"):
            c.reshard_many({fresh_name: Sharding(INFER, ("tp", None)), "nope": Sharding(INFER, ("tp", None))})
        with pytest.raises(ValueError, match="bucket_bytes -1 must be 0"):
            c._planner_call("ReshardMany", pb.ReshardManyRequest(
                targets=[pb.TensorTarget(name=fresh_name, dst_json=json.dumps(src.to_json()))],
                bucket_bytes=-1))
        with pytest.raises(ValueError, match="bucket_mib=-1: give a size in MiB"):
            c.reshard_many({fresh_name: src}, bucket_mib=-1)
        with pytest.raises(NotFoundError, match="no tensor named 'nope'"):
            c.reshard_many({fresh_name: Sharding(INFER, ("tp", None))}, scales={fresh_name: "nope"})
        with pytest.raises(ValueError, match=f"scale {fresh_name!r} of weight {fresh_name!r} is itself a "
                                             f"weight here"):
            c.reshard_many({fresh_name: Sharding(INFER, ("tp", None))}, scales={fresh_name: fresh_name})
        with pytest.raises(ValueError, match="a pending sum on one side; reshard_many moves values"):
            c.reshard_many({fresh_name: Sharding(INFER, ("tp", None), partial=("dp",))})
        info = c.info(fresh_name)
        assert info.version == 1 and info.sharding == src and np.array_equal(c.get(fresh_name), a)
    finally:
        c.delete(fresh_name)


def test_a_state_dict_asked_again_moves_as_it_is_now(client, fresh_name):
    # The client keeps the last few target lists as wire bytes (`Client._targets`): the same dict asked again, one
    # layout changed in it since, must move that tensor to its new layout, and a value that is no sharding is named
    c = client
    names = [f"{fresh_name}_{i}" for i in range(3)]
    values = {n: np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + i for i, n in enumerate(names)}
    c.put_many({n: (v, Sharding(TRAIN, ("tp", None))) for n, v in values.items()})
    try:
        there = {n: Sharding(INFER, ("tp", None)) for n in names}
        back = {n: Sharding(TRAIN, ("tp", None)) for n in names}
        for _ in range(2):  # the second time round, both dicts are kept
            c.reshard_many(there).result(timeout=60)
            c.reshard_many(back).result(timeout=60)
        there[names[1]] = Sharding(INFER, (None, "tp"))  # the same dict object, one value replaced
        c.reshard_many(there).result(timeout=60)
        listed = {t.name: t for t in c.tensors()}
        assert [listed[n].sharding for n in names] == [there[n] for n in names]
        assert all(np.array_equal(got, values[n]) for n, got in c.get_many(names).items())
        with pytest.raises(InvalidArgumentError, match="sharding must be a reshard.Sharding, got list"):
            c.reshard_many({**there, names[2]: ["tp", None]})
    finally:
        for n in names:
            c.delete(n)


# -- an agent killed mid-job --------------------------------------------------------------------------------------

RATE_MIB_S = 8  # every agent sends at most this fast, so the kill lands mid-job
ONE_HOST = Mesh.from_hosts({"tp": 4}, ["host0"], 4)  # the training job on one host: it sends everything
TWO_REPLICAS = Mesh.from_hosts({"dp": 2, "tp": 2}, ["host1", "host2"], 2)


@pytest.fixture(scope="module", params=["grpc", pytest.param("collective", marks=pytest.mark.slow), "nixl"])
def throttled(request):
    with LocalCluster(3, 4, agent_args=["--rate-limit-mib-s", str(RATE_MIB_S), "--chunk-mib", "0.25",
                                        "--collective-chunk-mib", "0.25"],
                      planner_args=["--heartbeat-timeout", "2"], transport=request.param) as cluster:
        with cluster.connect() as c:
            c.cluster = cluster
            yield c


def test_an_agent_killed_mid_job_leaves_every_tensor_at_its_old_version_and_a_retry_succeeds(throttled):
    c = throttled
    # 8 MiB from host0 at 8 MiB/s: the job runs about a second
    tensors, infer, scales = state_dict(num_layers=3, hidden=256, seed=1, train=ONE_HOST, infer_mesh=TWO_REPLICAS)
    values = _values(tensors)
    c.put_many(tensors, scales=scales)
    before = {t.name: (t.version, t.sharding) for t in c.tensors()}
    job = c.reshard_many(infer, scales=scales)
    deadline = time.monotonic() + 30
    while job.progress()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    done, total = job.progress()
    assert 0 < done < total, f"the kill must land mid-job; {done} of {total} bytes were sent"
    c.cluster.kill_agent("host2")
    with pytest.raises(JobFailedError, match=r"reshard_many of \d+ tensors .* failed: .*host2"):
        job.result(timeout=30)
    assert {t.name: (t.version, t.sharding) for t in c.tensors()} == before  # every tensor at its old version
    got = c.get_many(list(tensors))
    assert all(_same(got[n], values[n]) for n in tensors)
    c.cluster.start_agent("host2")
    result = c.reshard_many(infer, scales=scales).result(timeout=60)
    assert result.versions == {n: 2 for n in tensors}
    got = c.get_many(list(tensors))
    assert all(_same(got[n], values[n]) for n in tensors)
    for name, value in values.items():  # the restarted host2 holds one of the two replicas
        assert_every_device(c, name, value)
    _check_scales_follow(c, scales, values, TWO_REPLICAS)
