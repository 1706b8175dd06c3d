"""jax.Arrays in and out of a real cluster: `put_jax` from one NamedSharding, `get_jax` in another.

JAX runs in this process on 8 host-platform CPU devices: devices 0-3 stand for a
training mesh (reshard devices on host0, host1), 4-7 for a serving mesh (host2,
host3). Each array read back must equal, shard by shard and bit for bit, what
``jax.device_put`` of the whole array gives on the destination sharding (or, read back
unreduced as it went in, what the jitted einsum that made it left on each device).
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

from jax.sharding import AxisType, Mesh as JaxMesh, NamedSharding, PartitionSpec as P  # noqa: E402

# reshard device of JAX device id i: the training devices, then the serving ones.
DEVICES = ["host0/0", "host0/1", "host1/0", "host1/1", "host2/0", "host2/1", "host3/0", "host3/1"]
TRAIN = JaxMesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "tp"))
SERVE_GRID = JaxMesh(np.array(jax.devices("cpu")[4:]).reshape(2, 2), ("replica", "tp"))
SERVE_LINE = JaxMesh(np.array(jax.devices("cpu")[4:]), ("tp",))
# JAX lets only Explicit axes be unreduced.
TRAIN_EXPLICIT = JaxMesh(TRAIN.devices, TRAIN.axis_names, axis_types=(AxisType.Explicit,) * 2)
SERVE_EXPLICIT = JaxMesh(SERVE_GRID.devices, SERVE_GRID.axis_names, axis_types=(AxisType.Explicit,) * 2)

# The adapters are the same code on either transport: one is enough.
pytestmark = pytest.mark.parametrize("cluster", ["grpc"], indirect=True)


def _same_shards(got, want) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    by_device = {s.device: s for s in want.addressable_shards}
    assert len(got.addressable_shards) == len(by_device)
    # JAX gives no shard index under an unreduced spec; an unreduced axis splits no dim, so drop it to ask.
    got_index = _tiled(got.sharding).devices_indices_map(got.shape)
    want_index = _tiled(want.sharding).devices_indices_map(want.shape)
    for s in got.addressable_shards:
        w = by_device[s.device]
        assert got_index[s.device] == want_index[w.device], s.device
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


def _tiled(sharding):
    return sharding.update(spec=sharding.spec.update(unreduced=frozenset()))


def test_a_jit_einsums_unreduced_output_goes_in_and_comes_back(client, fresh_name):
    rng = np.random.default_rng(37)
    # Whole numbers: every sum is exact in float32, in whatever order JAX or reshard adds.
    a = rng.integers(-50, 50, (8, 6)).astype(np.float32)
    b = rng.integers(-50, 50, (6, 4)).astype(np.float32)
    unreduced = NamedSharding(TRAIN_EXPLICIT, P("dp", None, unreduced={"tp"}))
    out = jax.jit(lambda a, b: jax.numpy.einsum("ij,jk->ik", a, b, out_sharding=unreduced))(
        jax.device_put(a, NamedSharding(TRAIN_EXPLICIT, P("dp", "tp"))),
        jax.device_put(b, NamedSharding(TRAIN_EXPLICIT, P("tp", None))))
    assert out.sharding.spec.unreduced == {"tp"}

    assert client.put_jax(fresh_name, out, DEVICES) is True
    info = client.info(fresh_name)
    assert (info.shape, info.dtype, info.version) == ((8, 4), "float32", 1)
    assert info.sharding.spec_str() == "P('dp', None) + partial(tp)"
    assert info.sharding.mesh.devices == tuple(DEVICES[:4])

    # Read in the same unreduced layout: the addends as the einsum left them, nothing moves.
    _same_shards(client.get_jax(fresh_name, unreduced, DEVICES), out)
    assert client.info(fresh_name).version == 1

    # Read reduced on the serving devices: reshard sums the addends, as JAX's own reduction does.
    dst = NamedSharding(SERVE_EXPLICIT, P("tp", None))
    want = jax.device_put(a @ b, dst)
    jax_summed = jax.jit(lambda x: jax.sharding.reshard(x, NamedSharding(TRAIN_EXPLICIT, P("dp", None))))(out)
    assert np.asarray(jax_summed).tobytes() == np.asarray(want).tobytes()
    _same_shards(client.get_jax(fresh_name, dst, DEVICES), want)
    after = client.info(fresh_name)
    assert after.version == 2 and not after.sharding.partial
    client.delete(fresh_name)


def test_get_jax_reads_into_an_unreduced_sharding_as_jax_device_put_lays_it_out(client, fresh_name):
    full = jax.numpy.asarray(np.random.default_rng(7).standard_normal((8, 6)).astype(np.float32) * 100)
    full = full.astype("bfloat16")
    assert client.put_jax(fresh_name, jax.device_put(full, NamedSharding(TRAIN, P("dp", "tp"))), DEVICES) is True

    # The first device along 'replica' holds the value, the other zeros: their sum is exact in every dtype.
    dst = NamedSharding(SERVE_EXPLICIT, P("tp", None, unreduced={"replica"}))
    got = client.get_jax(fresh_name, dst, DEVICES)
    _same_shards(got, jax.device_put(full, dst))
    after = client.info(fresh_name)
    assert after.version == 2 and set(after.sharding.mesh.devices) == set(DEVICES[4:])

    # Handed back as it came out, unreduced, it is the same tensor: summed on the way to a plain layout.
    name = fresh_name + "_back"
    assert client.put_jax(name, got, DEVICES) is True
    assert client.info(name).sharding.partial == ("replica",)
    plain = NamedSharding(TRAIN, P(None, "tp"))
    _same_shards(client.get_jax(name, plain, DEVICES), jax.device_put(full, plain))
    client.delete(name)
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
