"""put, reshard and get through real agents: every strategy, mesh relation and uneven shapes, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import reshard
from reshard import Mesh, Sharding

from .every_device import assert_every_device


def _mesh(hosts, dev=2, axes=("x", "y")):
    return Mesh.from_hosts({axes[0]: len(hosts), axes[1]: dev}, hosts, dev)


SRC = Sharding(_mesh(["host0", "host1"]), ("x", None, "y"))
TARGETS = {
    "disjoint": Sharding(_mesh(["host2", "host3"]), (None, ("x", "y"), None)),
    "identical": Sharding(_mesh(["host0", "host1"]), (None, "y", "x")),
    "overlapping": Sharding(_mesh(["host1", "host2"]), ("y", None, None)),
    "replicated": Sharding(_mesh(["host1", "host2", "host3"], 2), (None, None, None)),
}
SHAPE = (2 * 3 + 1, 8 * 3 + 1, 5)  # uneven on every split


@pytest.mark.parametrize("strategy", reshard.STRATEGIES)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_reshard_is_bit_exact(client, fresh_name, strategy, target):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(SHAPE).astype(np.float32)
    client.put(fresh_name, a, SRC)
    try:
        result = client.reshard(fresh_name, TARGETS[target], strategy).result(timeout=60)
        assert result.state == "succeeded" and result.version == 2
        assert result.transport == client.cluster.transport
        assert set(result.transports) <= {client.cluster.transport, "local"}
        info = client.info(fresh_name)
        assert info.sharding == TARGETS[target] and info.version == 2
        got = client.get(fresh_name)
        assert got.dtype == a.dtype and np.array_equal(got, a)
        assert_every_device(client, fresh_name, a, TARGETS[target])
        # and back again, through the new version
        client.reshard(fresh_name, SRC, strategy).result(timeout=60)
        assert np.array_equal(client.get(fresh_name), a)
    finally:
        client.delete(fresh_name)


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "float16", "uint8"])
def test_put_get_numpy_dtypes(client, fresh_name, dtype):
    a = (np.arange(np.prod(SHAPE)) % 7).reshape(SHAPE).astype(dtype)
    client.put(fresh_name, a, SRC)
    got = client.get(fresh_name)
    assert isinstance(got, np.ndarray) and got.dtype == a.dtype and np.array_equal(got, a)
    client.delete(fresh_name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_in_torch_out(client, fresh_name, dtype):
    t = torch.randn(SHAPE).to(dtype)
    client.put(fresh_name, t, SRC)
    client.reshard(fresh_name, TARGETS["overlapping"], "auto").result(timeout=60)
    got = client.get(fresh_name)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype and torch.equal(got, t)
    shard = client.get_shard(fresh_name, "host2/1")
    box = TARGETS["overlapping"].tile(SHAPE, "host2/1")
    assert torch.equal(shard, t[tuple(slice(lo, hi) for lo, hi in box)])
    client.delete(fresh_name)


def test_many_reshards_in_flight(client):
    """Each tensor holds its own values, so bytes written into another tensor, or another tile, do not read back."""
    size = int(np.prod(SHAPE))
    names = [f"inflight{i}" for i in range(4)]
    arrays = [np.arange(i * size, (i + 1) * size, dtype=np.int32).reshape(SHAPE) for i in range(4)]
    for n, a in zip(names, arrays):
        client.put(n, a, SRC)
    jobs = [client.reshard(n, TARGETS[t], "auto") for n, t in zip(names, sorted(TARGETS))]
    jobs.append(client.reshard(names[0], SRC, "broadcast"))  # queued behind the first job on that tensor
    for j in jobs:
        j.result(timeout=60)
    assert client.info(names[0]).version == 3
    finals = [SRC] + [TARGETS[t] for t in sorted(TARGETS)[1:]]  # the first went out and came back
    for n, a, dst in zip(names, arrays, finals):
        assert_every_device(client, n, a, dst)
        client.delete(n)


def test_dry_run_plan_matches_core(client, fresh_name):
    a = np.zeros(SHAPE, dtype=np.float32)
    client.put(fresh_name, a, SRC)
    by_name = client.plan(fresh_name, TARGETS["disjoint"], "broadcast")
    by_shape = client.plan(SHAPE, TARGETS["disjoint"], "broadcast", dtype="float32", src=SRC)
    local = reshard.plan(SHAPE, "float32", SRC, TARGETS["disjoint"], strategy="broadcast")
    assert by_name.id == by_shape.id == local.id
    assert client.info(fresh_name).version == 1  # a dry run moves nothing
    client.delete(fresh_name)


_RANK = textwrap.dedent("""
    import sys, numpy as np, reshard
    from reshard import Mesh, Sharding
    address, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2)
    sharding = Sharding(mesh, ("x", "y"))
    full = np.arange(9 * 6, dtype=np.float64).reshape(9, 6)
    device = mesh.devices[rank]
    box = sharding.tile(full.shape, device)
    mine = full[tuple(slice(lo, hi) for lo, hi in box)]
    c = reshard.connect(address)
    if mode == "put":
        print(c.put_shard("ranks", device, mine, sharding, shape=full.shape))
    else:
        dst = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host2", "host3"], 2), ("y", None))
        box = dst.tile(full.shape, dst.mesh.devices[rank])
        got = c.get_shard("ranks", dst.mesh.devices[rank])
        assert np.array_equal(got, full[tuple(slice(lo, hi) for lo, hi in box)]), rank
        print("ok")
""")


def _ranks(client, mode):
    env = {**os.environ, "RESHARD_TOKEN": client.cluster.token}  # as a launcher hands its ranks the token
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, client.address, str(r), mode], stdout=subprocess.PIPE,
                              text=True, env=env)
             for r in range(4)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


@pytest.mark.transports_in_turn(first="collective")
def test_put_shard_and_get_shard_from_rank_processes(client):
    outs = _ranks(client, "put")
    assert sorted(outs) == ["False", "False", "False", "True"]  # exactly one rank completed the tensor
    full = np.arange(9 * 6, dtype=np.float64).reshape(9, 6)
    assert np.array_equal(client.get("ranks"), full)
    dst = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host2", "host3"], 2), ("y", None))
    client.reshard("ranks", dst).result(timeout=60)
    assert _ranks(client, "get") == ["ok"] * 4
    client.delete("ranks")


def test_devices_and_tensors_listing(client, fresh_name):
    assert client.devices() == [f"host{h}/{d}" for h in range(4) for d in range(2)]
    client.put(fresh_name, np.ones((4, 4), np.float32), Sharding(_mesh(["host0"]), ("y", None)))
    assert fresh_name in [t.name for t in client.tensors()]
    client.delete(fresh_name)
    assert fresh_name not in [t.name for t in client.tensors()]
