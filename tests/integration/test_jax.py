"""jax.Arrays in and out of a real cluster: `put_jax` from one NamedSharding, `get_jax` in another.

JAX runs in this process on 8 host-platform CPU devices: devices 0-3 stand for a
training mesh (reshard devices on host0, host1), 4-7 for a serving mesh (host2,
host3). Each array read back must equal, shard by shard and bit for bit, what
``jax.device_put`` of the whole array gives on the destination sharding.
"""

from __future__ import annotations

import numpy as np
import pytest

from reshard.errors import InvalidShardingError

jax = pytest.importorskip("jax", reason="jax is a dev extra: pip install -e '.[dev]'")
try:
    jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts; tests/core/test_placements.py asks alike
except RuntimeError:
    pass
if len(jax.devices("cpu")) < 8:
    pytest.skip(f"JAX started with {len(jax.devices('cpu'))} CPU devices in this process; these tests need 8",
                allow_module_level=True)

from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec as P  # noqa: E402

# reshard device of JAX device id i: the training devices, then the serving ones.
DEVICES = ["host0/0", "host0/1", "host1/0", "host1/1", "host2/0", "host2/1", "host3/0", "host3/1"]
TRAIN = JaxMesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "tp"))
SERVE_GRID = JaxMesh(np.array(jax.devices("cpu")[4:]).reshape(2, 2), ("replica", "tp"))
SERVE_LINE = JaxMesh(np.array(jax.devices("cpu")[4:]), ("tp",))

# The adapters are the same code on either transport: one is enough.
pytestmark = pytest.mark.parametrize("cluster", ["grpc"], indirect=True)


def _same_shards(got, want) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    by_device = {s.device: s for s in want.addressable_shards}
    assert len(got.addressable_shards) == len(by_device)
    for s in got.addressable_shards:
        w = by_device[s.device]
        assert s.index == w.index, s.device
        assert np.asarray(s.data).view(np.uint8).tobytes() == np.asarray(w.data).view(np.uint8).tobytes(), s.device


@pytest.mark.parametrize("dtype, shape, src, dst", [
    ("float32", (8, 12), NamedSharding(TRAIN, P("dp", "tp")), NamedSharding(SERVE_LINE, P(None, "tp"))),
    ("bfloat16", (12, 4), NamedSharding(TRAIN, P(("dp", "tp"))), NamedSharding(SERVE_GRID, P("tp"))),
    ("int32", (4, 4, 2), NamedSharding(TRAIN, P(None, "tp")), NamedSharding(SERVE_GRID, P("replica", None, "tp"))),
], ids=["float32", "bfloat16", "int32"])
def test_a_jax_array_comes_back_in_another_sharding(client, fresh_name, dtype, shape, src, dst):
    full = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32) * 100
    full = jax.numpy.asarray(full).astype(dtype)
    assert client.put_jax(fresh_name, jax.device_put(full, src), DEVICES) is True
    info = client.info(fresh_name)
    assert (info.shape, info.dtype, info.version) == (shape, dtype, 1)
    assert set(info.sharding.mesh.devices) == set(DEVICES[:4])

    got = client.get_jax(fresh_name, dst, DEVICES)
    _same_shards(got, jax.device_put(full, dst))
    after = client.info(fresh_name)
    assert after.version == 2 and set(after.sharding.mesh.devices) == set(DEVICES[4:])

    # Read again in that layout: nothing moves, no new version.
    _same_shards(client.get_jax(fresh_name, dst, DEVICES), jax.device_put(full, dst))
    assert client.info(fresh_name).version == 2
    client.delete(fresh_name)


def test_jax_layouts_reshard_cannot_read_are_refused(client, fresh_name):
    client.put(fresh_name, np.arange(13 * 4, dtype=np.float32).reshape(13, 4),
               reshard_sharding(DEVICES[:4]))
    with pytest.raises(InvalidShardingError, match=(
            rf"JAX splits a dim evenly only, but dim 0 of '{fresh_name}', shape \(13, 4\), is 13 long and split 4 "
            rf"ways by P\('tp'\); read it with get_dtensor or get")):
        client.get_jax(fresh_name, NamedSharding(SERVE_LINE, P("tp")), DEVICES)
    single = jax.device_put(np.ones((2, 2), np.float32), jax.devices("cpu")[0])
    with pytest.raises(InvalidShardingError, match=(
            r"put_jax takes a jax.Array laid out by a NamedSharding; this one has SingleDeviceSharding")):
        client.put_jax(fresh_name + "_single", single, DEVICES)
    info = client.info(fresh_name)
    assert info.version == 1 and set(info.sharding.mesh.devices) == set(DEVICES[:4])
    assert fresh_name + "_single" not in [t.name for t in client.tensors()]
    client.delete(fresh_name)


def reshard_sharding(devices):
    from reshard import Mesh, Sharding

    return Sharding(Mesh({"x": len(devices)}, devices), ("x", None))
