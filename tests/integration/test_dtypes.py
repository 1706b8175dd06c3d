"""bfloat16, float16 and float8 through real agents, on every transport: put, put_shard, reshard, get, get_shard
and the agents' digests, bit for bit (every byte pattern, NaNs included), across hosts and layouts.

torch in, torch out; an ml_dtypes array (what JAX arrays convert to) in, an ml_dtypes array out; the agents hold
these dtypes as unsigned integers of their bits and move the bytes unchanged.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from reshard import Mesh, Sharding
from reshard.client import InvalidArgumentError, NotFoundError

from .every_device import assert_every_device


def _mesh(hosts):
    return Mesh.from_hosts({"x": 2, "y": 2}, hosts, 2)


SRC = Sharding(_mesh(["host0", "host1"]), ("x", None, "y"))
DISJOINT = Sharding(_mesh(["host2", "host3"]), (None, ("x", "y"), None))  # every tile on another host, unreplicated
OVERLAPPING = Sharding(_mesh(["host1", "host2"]), ("y", None, None))
SHAPE = (2 * 3 + 1, 4 * 6 + 1, 5)  # uneven on every split
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _random(dtype, shape=SHAPE, seed=0) -> torch.Tensor:
    """Random bytes as ``dtype``: every bit pattern may occur, NaN, inf and -0.0 among them."""
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=g).view(dtype)


def _cut(t, box):
    return t[tuple(slice(lo, hi) for lo, hi in box)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_torch_in_torch_out_across_hosts_and_layouts(client, fresh_name, dtype):
    t = _random(dtype)
    info = client.put(fresh_name, t, SRC)
    assert info.dtype == str(dtype)[6:] and info.shape == SHAPE
    try:
        for dst in (DISJOINT, OVERLAPPING):
            result = client.reshard(fresh_name, dst).result(timeout=60)
            assert result.transport == client.cluster.transport
            if dst is DISJOINT:  # each byte enters its one new host once: elements counted at their own size
                assert set(result.transports) == {client.cluster.transport}
                assert result.network_bytes == t.numel() * t.element_size()
            got = client.get(fresh_name)
            assert isinstance(got, torch.Tensor) and got.dtype == dtype and torch.equal(_bits(got), _bits(t))
            digests = client.digests(fresh_name)
            for device, box in dst.tiles(SHAPE).items():
                want = _cut(t, box)
                shard = client.get_shard(fresh_name, device)
                assert shard.dtype == dtype and shard.shape == want.shape, device
                assert torch.equal(_bits(shard), _bits(want)), device
                assert digests[device] == hashlib.blake2b(_bits(want).numpy().tobytes()).hexdigest(), device
    finally:
        client.delete(fresh_name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=lambda d: str(d)[6:])
def test_shards_handed_over_by_device_are_read_back_in_another_layout(client, fresh_name, dtype):
    shape = (13, 7)
    src = Sharding(_mesh(["host0", "host1"]), ("x", "y"))
    dst = Sharding(_mesh(["host2", "host3"]), ("y", None))
    t = _random(dtype, shape, seed=1)
    done = [client.put_shard(fresh_name, d, _cut(t, src.tile(shape, d)), src, shape=shape) for d in src.mesh.devices]
    try:
        assert done == [False, False, False, True]  # the tensor appeared with its last shard
        assert client.info(fresh_name).dtype == str(dtype)[6:]
        client.reshard(fresh_name, dst).result(timeout=60)
        for device, box in dst.tiles(shape).items():
            assert torch.equal(_bits(client.get_shard(fresh_name, device)), _bits(_cut(t, box))), device
        on_cpu = client.get(fresh_name, device="cpu")  # through the torch read path
        assert on_cpu.dtype == dtype and torch.equal(_bits(on_cpu), _bits(t))
    finally:
        client.delete(fresh_name)


def test_ml_dtypes_arrays_in_ml_dtypes_arrays_out(client, fresh_name):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes comes with jax; reshard does not depend on it")
    values = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32) * 8
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        a = values.astype(getattr(ml_dtypes, name))
        client.put(fresh_name, a, SRC)
        try:
            assert client.info(fresh_name).dtype == name
            client.reshard(fresh_name, DISJOINT).result(timeout=60)
            got = client.get(fresh_name)
            assert isinstance(got, np.ndarray) and got.dtype == a.dtype
            assert got.tobytes() == a.tobytes(), name
            assert_every_device(client, fresh_name, a, DISJOINT)  # ml_dtypes shards, bit for bit
            as_torch = client.get(fresh_name, device="cpu")  # the same bits as torch's own conversion
            assert torch.equal(_bits(as_torch), _bits(torch.from_numpy(values).to(getattr(torch, name))))
        finally:
            client.delete(fresh_name)


def test_compute_on_float8_is_refused_and_changes_nothing(client, fresh_name):
    t = torch.tensor([[1.0, 2.0], [3.0, -4.0]]).to(torch.float8_e4m3fn)
    one_host = Sharding(_mesh(["host0", "host1"]), (None, None))
    client.put(fresh_name, t, one_host)
    out, job = f"{fresh_name}_sum", None
    try:
        with pytest.raises(InvalidArgumentError, match=r"computes on float8_e4m3fn elements, .* Convert first"):
            job = client.apply("add", fresh_name, fresh_name, out=out)
        assert client.info(fresh_name).version == 1 and torch.equal(_bits(client.get(fresh_name)), _bits(t))
    finally:
        if job is not None:  # a job the planner took runs to its end before its tensors can be deleted
            job.result(timeout=60)
        for name in (fresh_name, out):
            try:
                client.delete(name)
            except NotFoundError:
                pass


def test_partial_bfloat16_addends_sum_as_numbers(client, fresh_name):
    mesh = _mesh(["host0", "host1"])
    partial = Sharding(mesh, ("x", None), partial=("y",))
    addend = torch.tensor([[1.0, 2.0], [3.0, -4.0], [0.5, 8.0]], dtype=torch.bfloat16)
    for device in mesh.devices:
        client.put_shard(fresh_name, device, _cut(addend, partial.tile((3, 2), device)).clone(), partial, shape=(3, 2))
    try:
        assert torch.equal(client.get(fresh_name), addend * 2)
        assert client.info(fresh_name).sharding == partial
        replicated = Sharding(mesh, (None, None))
        client.reshard(fresh_name, replicated).result(timeout=60)
        assert client.info(fresh_name).sharding == replicated
        assert_every_device(client, fresh_name, addend * 2, replicated)  # the sum on every device, as bits
    finally:
        client.delete(fresh_name)
