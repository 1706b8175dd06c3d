"""Framework layouts read as reshard shardings: torch's placements and DeviceMesh, JAX's NamedSharding.

The objects are the frameworks' own (torch's placement classes, a real ``DeviceMesh``
built without a process group, JAX meshes over 8 host-platform CPU devices); the
core recognises them without importing either framework. JAX's tiles are compared
with JAX's own ``devices_indices_map``.
"""

from __future__ import annotations

import pytest

from reshard import Mesh, Partial, Replicate, Shard, Sharding
from reshard.errors import InvalidMeshError, InvalidShardingError, ReshardError

MESH = Mesh({"x": 2, "y": 2}, [f"h{i}/0" for i in range(4)])


@pytest.fixture(scope="module")
def tp():
    """torch.distributed.tensor's placement types."""
    return pytest.importorskip("torch.distributed.tensor.placement_types",
                               reason="torch is a dev extra: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def jax():
    """JAX on 8 host-platform CPU devices (set before its backend starts; the JAX tests of a run ask alike)."""
    jax = pytest.importorskip("jax", reason="jax is a dev extra: pip install -e '.[dev]'")
    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:  # the backend already started in this process, with whatever count it was given
        pass
    if len(jax.devices("cpu")) < 8:
        pytest.skip(f"JAX started with {len(jax.devices('cpu'))} CPU devices in this process; these tests need 8")
    return jax


def _bad(error, message, call):
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, ReshardError)


# -- torch placements --------------------------------------------------------------------------

TORCH_CASES = [
    # (torch placements as (kind, dim), ndim, the spec and partial axes they mean)
    ((("S", 0), ("S", 1)), 2, ("x", "y"), ()),
    ((("R", None), ("S", 0)), 2, ("y", None), ()),
    ((("S", 0), ("S", 0)), 1, (("x", "y"),), ()),
    ((("S", 1), ("R", None)), 3, (None, "x", None), ()),
    ((("P", None), ("S", 1)), 2, (None, "y"), ("x",)),
    ((("S", -1), ("P", None)), 3, (None, None, "x"), ("y",)),
]


@pytest.mark.parametrize("placements, ndim, spec, partial", TORCH_CASES,
                         ids=["".join(f"{k}{d if d is not None else ''}" for k, d in c[0]) for c in TORCH_CASES])
def test_torch_placements_mean_what_reshards_own_do(tp, placements, ndim, spec, partial):
    made = {"S": lambda d: tp.Shard(d), "R": lambda d: tp.Replicate(), "P": lambda d: tp.Partial()}
    ours = {"S": lambda d: Shard(d % ndim), "R": lambda d: Replicate(), "P": lambda d: Partial()}
    theirs = Sharding.from_placements(MESH, [made[k](d) for k, d in placements], ndim)
    assert theirs == Sharding(MESH, spec, partial)
    assert theirs == Sharding.from_placements(MESH, [ours[k](d) for k, d in placements], ndim)


def test_torch_placements_reshard_cannot_lay_out_are_refused(tp):
    _bad(InvalidShardingError, r"placement Partial\(max\) on axis 'x' reduces by 'max', but reshard completes a "
         r"Partial tensor by summing its addends; redistribute it to Replicate\(\) or Partial\('sum'\) first",
         lambda: Sharding.from_placements(MESH, [tp.Partial("max"), tp.Replicate()]))
    _bad(InvalidShardingError, r"placement _StridedShard\(dim=0, sf=2\) on axis 'y' is torch's _StridedShard, not "
         r"Shard\(d\), Replicate\(\) or Partial\(\); reshard lays out torch.chunk tiles only",
         lambda: Sharding.from_placements(MESH, [tp.Replicate(), tp._StridedShard(0, split_factor=2)]))
    _bad(InvalidShardingError, r"Shard\(-3\) on axis 'x': dims must be >= 0 \(or at least -2 for a tensor of 2 dims\)",
         lambda: Sharding.from_placements(MESH, [tp.Shard(-3), tp.Replicate()], ndim=2))
    _bad(InvalidShardingError, r"Shard\(-1\) on axis 'x': dims must be >= 0; a negative dim counts from the last "
         r"only when ndim is given", lambda: Sharding.from_placements(MESH, [tp.Shard(-1), tp.Replicate()]))


# -- DeviceMesh --------------------------------------------------------------------------------

def _device_mesh(ranks, names=None, rank=None):
    """A real DeviceMesh over ``ranks`` seen from global rank ``rank``, without a process group."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.tensor(ranks)
    return DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False,
                      _rank=int(ranks.flatten()[0]) if rank is None else rank)


def test_a_device_mesh_names_its_axes_and_maps_ranks_to_devices(tp):
    by_rank = [f"node{r // 2}/{r % 2}" for r in range(8)]
    s = Sharding.from_device_mesh(_device_mesh([[6, 4], [5, 7]], ("dp", "tp")), [tp.Shard(0), tp.Replicate()],
                                  by_rank)
    assert s.mesh == Mesh({"dp": 2, "tp": 2}, ["node3/0", "node2/0", "node2/1", "node3/1"])
    assert s.spec == (("dp",),)
    # No dim names: dim0, dim1, ...; a dict keyed by rank serves as well as a list.
    s = Sharding.from_device_mesh(_device_mesh([[4, 5], [6, 7]]), [tp.Partial(), tp.Shard(1)],
                                  {r: by_rank[r] for r in range(4, 8)}, ndim=2)
    assert s == Sharding(Mesh({"dim0": 2, "dim1": 2}, by_rank[4:]), (None, "dim1"), ("dim0",))
    assert str(s) == "P(None, 'dim1') + partial(dim0) on (dim0=2, dim1=2)"


def test_a_device_mesh_with_a_rank_devices_lacks_is_refused(tp):
    mesh = _device_mesh([[4, 5], [6, 7]], ("dp", "tp"))
    _bad(InvalidMeshError, r"devices has no entry for rank 5, which the mesh holds \(its ranks are \[4, 5, 6, 7\]\); "
         r"give devices as a list indexed by rank or a dict \{rank: 'host/index'\} covering every one",
         lambda: Sharding.from_device_mesh(mesh, [tp.Shard(0), tp.Replicate()], {4: "a/0", 6: "a/1", 7: "a/2"}))
    _bad(InvalidMeshError, r"devices has no entry for rank 6",
         lambda: Sharding.from_device_mesh(mesh, [tp.Shard(0), tp.Replicate()], ["a/0", "a/1", "a/2", "a/3", "b/0",
                                                                                  "b/1"]))
    _bad(InvalidMeshError, r"devices must map each rank to a reshard device: a list indexed by rank or a dict "
         r"\{rank: 'host/index'\}; got str", lambda: Sharding.from_device_mesh(mesh, [tp.Replicate()] * 2, "a/0"))
    _bad(InvalidMeshError, r"device_mesh must be a torch.distributed DeviceMesh \(its .mesh holds the ranks\), got "
         r"list", lambda: Sharding.from_device_mesh([[0, 1]], [tp.Replicate()], ["a/0", "a/1"]))


# -- JAX -----------------------------------------------------------------------------------------

JAX_CASES = [
    # (mesh shape, axis names, spec, tensor shape)
    ((2, 2), ("x", "y"), ("x", "y"), (8, 6)),
    ((2, 2), ("x", "y"), (("x", "y"), None), (12, 3)),
    ((2, 2), ("x", "y"), (("y", "x"),), (4,)),
    ((2, 2), ("x", "y"), (None, "y"), (3, 4, 5)),
    ((2, 1, 2), ("a", "b", "c"), ("c", ("a", "b")), (6, 2)),
    ((4,), ("x",), (), (5, 5)),
]


@pytest.mark.parametrize("mesh_shape, names, spec, shape", JAX_CASES, ids=[str(c[2]) + str(c[3]) for c in JAX_CASES])
def test_named_sharding_tiles_are_jaxs_shards(jax, mesh_shape, names, spec, shape):
    import numpy as np
    from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec

    # The second half of the devices, in reverse: the table is indexed by device id, not by mesh position.
    jax_devices = np.array(jax.devices("cpu")[8 - int(np.prod(mesh_shape)):][::-1]).reshape(mesh_shape)
    named = NamedSharding(JaxMesh(jax_devices, names), PartitionSpec(*spec))
    table = [f"n{i}/0" for i in range(8)]
    s = Sharding.from_named_sharding(named, table)
    assert s.mesh.devices == tuple(table[d.id] for d in jax_devices.flat)
    want = {table[d.id]: tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
            for d, index in named.devices_indices_map(shape).items()}
    assert s.tiles(shape) == want
    # A dict keyed by JAX device means the same.
    assert Sharding.from_named_sharding(named, {d: table[d.id] for d in jax_devices.flat}) == s


def test_unreduced_jax_axes_are_partial(jax):
    import numpy as np
    from jax.sharding import AxisType, Mesh as JaxMesh, NamedSharding, PartitionSpec

    mesh = JaxMesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    s = Sharding.from_named_sharding(NamedSharding(mesh, PartitionSpec("x", unreduced={"y"})),
                                     [f"n{i}/0" for i in range(4)])
    assert s.partial == ("y",) and s.spec == (("x",),)


def test_named_shardings_reshard_cannot_lay_out_are_refused(jax):
    import numpy as np
    from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec

    mesh = JaxMesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("x", "y"))
    table = [f"n{i}/0" for i in range(8)]
    _bad(InvalidShardingError, r"PartitionSpec entry UNCONSTRAINED for dim 1 of .* is not None, an axis name or a "
         r"tuple of axis names; reshard needs the layout itself",
         lambda: Sharding.from_named_sharding(NamedSharding(mesh, PartitionSpec("x", PartitionSpec.UNCONSTRAINED)),
                                              table))
    _bad(InvalidMeshError, r"devices has no entry for JAX device id 3, which the mesh holds \(its JAX device ids are "
         r"\[0, 1, 2, 3\]\)", lambda: Sharding.from_named_sharding(NamedSharding(mesh, PartitionSpec()), table[:3]))
    _bad(InvalidShardingError, r"is not a jax NamedSharding over a concrete Mesh",
         lambda: Sharding.from_named_sharding(jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]), table))
