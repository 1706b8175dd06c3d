"""Tiles for named cases, even and uneven, with every device's bounds written out.

Each expected tile is checked three ways: against `Sharding.tile` (by device id
and by mesh position), against `Sharding.tiles`, and by value against an
independent oracle that cuts an ``arange`` tensor with plain numpy slicing,
axis by axis in the order the spec lists them (``torch.chunk`` semantics:
chunk size ``ceil(m / k)``; numpy clamps the trailing slices, so they come out
smaller or empty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from reshard import InvalidMeshError, Mesh, Sharding
from reshard.box import to_slices


@dataclass(frozen=True)
class TileCase:
    name: str
    axes: dict
    spec: tuple
    shape: tuple
    # Tile of each mesh position, row-major over the axes (last axis fastest).
    tiles: tuple


CASES = [
    TileCase("even 4x8 over x=2,y=4", {"x": 2, "y": 4}, ("x", "y"), (4, 8), (
        ((0, 2), (0, 2)), ((0, 2), (2, 4)), ((0, 2), (4, 6)), ((0, 2), (6, 8)),
        ((2, 4), (0, 2)), ((2, 4), (2, 4)), ((2, 4), (4, 6)), ((2, 4), (6, 8)),
    )),
    TileCase("7 over 4", {"x": 4}, ("x",), (7,), (
        ((0, 2),), ((2, 4),), ((4, 6),), ((6, 7),),
    )),
    TileCase("world*3+1: 13 over 4", {"x": 4}, ("x",), (13,), (
        ((0, 4),), ((4, 8),), ((8, 12),), ((12, 13),),
    )),
    TileCase("5 over 4 leaves the last chunk empty", {"x": 4}, ("x",), (5,), (
        ((0, 2),), ((2, 4),), ((4, 5),), ((5, 5),),
    )),
    TileCase("3 over 4: fewer elements than chunks", {"x": 4}, ("x",), (3,), (
        ((0, 1),), ((1, 2),), ((2, 3),), ((3, 3),),
    )),
    # x cuts 10 into 4+4+2, then y cuts each piece: not the same as 10 over 6 flat.
    TileCase("10 over x=3,y=2 as ('x', 'y')", {"x": 3, "y": 2}, (("x", "y"),), (10,), (
        ((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),), ((8, 9),), ((9, 10),),
    )),
    # y is major: y cuts 10 into 5+5, then x cuts each 5 into 2+2+1.
    TileCase("10 over x=3,y=2 as ('y', 'x')", {"x": 3, "y": 2}, (("y", "x"),), (10,), (
        ((0, 2),), ((5, 7),), ((2, 4),), ((7, 9),), ((4, 5),), ((9, 10),),
    )),
    TileCase("2 over x=3,y=2 as ('x', 'y'): empty pieces cut again", {"x": 3, "y": 2}, (("x", "y"),), (2,), (
        ((0, 1),), ((1, 1),), ((1, 2),), ((2, 2),), ((2, 2),), ((2, 2),),
    )),
    TileCase("replicated axis y", {"x": 2, "y": 2}, ("x", None), (5, 3), (
        ((0, 3), (0, 3)), ((0, 3), (0, 3)), ((3, 5), (0, 3)), ((3, 5), (0, 3)),
    )),
    TileCase("fully replicated", {"x": 2}, (None, None), (3, 2), (
        ((0, 3), (0, 2)), ((0, 3), (0, 2)),
    )),
    TileCase("empty spec replicates every dim", {"x": 3}, (), (2, 2), (
        ((0, 2), (0, 2)), ((0, 2), (0, 2)), ((0, 2), (0, 2)),
    )),
    TileCase("7x5 with dims over swapped axes ('y', 'x')", {"x": 2, "y": 3}, ("y", "x"), (7, 5), (
        ((0, 3), (0, 3)), ((3, 6), (0, 3)), ((6, 7), (0, 3)),
        ((0, 3), (3, 5)), ((3, 6), (3, 5)), ((6, 7), (3, 5)),
    )),
    TileCase("3 axes: 9x3 as (('x', 'z'), 'y')", {"x": 2, "y": 2, "z": 2}, (("x", "z"), "y"), (9, 3), (
        ((0, 3), (0, 2)), ((3, 5), (0, 2)), ((0, 3), (2, 3)), ((3, 5), (2, 3)),
        ((5, 7), (0, 2)), ((7, 9), (0, 2)), ((5, 7), (2, 3)), ((7, 9), (2, 3)),
    )),
    TileCase("3 axes, size-1 axis, trailing dim unnamed, empty chunk", {"a": 2, "b": 1, "c": 3}, (None, "c"), (2, 4, 3), (
        ((0, 2), (0, 2), (0, 3)), ((0, 2), (2, 4), (0, 3)), ((0, 2), (4, 4), (0, 3)),
        ((0, 2), (0, 2), (0, 3)), ((0, 2), (2, 4), (0, 3)), ((0, 2), (4, 4), (0, 3)),
    )),
    TileCase("size-1 axis splits nothing", {"x": 1}, ("x",), (3,), (
        ((0, 3),),
    )),
    TileCase("all three axes on one dim: 11 over 2x2x2", {"x": 2, "y": 2, "z": 2}, (None, ("x", "y", "z")), (1, 11), (
        ((0, 1), (0, 2)), ((0, 1), (2, 3)), ((0, 1), (3, 5)), ((0, 1), (5, 6)),
        ((0, 1), (6, 8)), ((0, 1), (8, 9)), ((0, 1), (9, 10)), ((0, 1), (10, 11)),
    )),
]


def _mesh(axes: dict) -> Mesh:
    size = math.prod(axes.values())
    # Two devices per host where possible, so ids carry real host names.
    return Mesh(axes, [f"h{i // 2}/{i % 2}" for i in range(size)])


def _oracle(a: np.ndarray, mesh: Mesh, spec: tuple, position: int) -> np.ndarray:
    """The values a device holds, by cutting ``a`` with numpy slices, major axis first."""
    coords = dict(zip(mesh.axis_names, np.unravel_index(position, mesh.shape)))
    for dim, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        for axis in axes:
            k, i = mesh.axis_size(axis), int(coords[axis])
            c = -(-a.shape[dim] // k)
            index = [slice(None)] * a.ndim
            index[dim] = slice(i * c, (i + 1) * c)
            a = a[tuple(index)]
    return a


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tile_bounds(case):
    mesh = _mesh(case.axes)
    sharding = Sharding(mesh, case.spec)
    assert len(case.tiles) == mesh.size, "the table lists one tile per mesh position"
    got_by_position = [sharding.tile(case.shape, p) for p in range(mesh.size)]
    got_by_device = [sharding.tile(case.shape, d) for d in mesh.devices]
    assert got_by_position == list(case.tiles)
    assert got_by_device == list(case.tiles)
    assert sharding.tiles(case.shape) == dict(zip(mesh.devices, case.tiles))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tile_values_match_numpy_slicing(case):
    mesh = _mesh(case.axes)
    sharding = Sharding(mesh, case.spec)
    a = np.arange(math.prod(case.shape)).reshape(case.shape)
    for p, tile in enumerate(case.tiles):
        got = a[to_slices(sharding.tile(case.shape, p))]
        want = _oracle(a, mesh, case.spec, p)
        assert got.shape == want.shape, f"position {p}"
        np.testing.assert_array_equal(got, want, err_msg=f"position {p}")
        np.testing.assert_array_equal(a[to_slices(tile)], want, err_msg=f"table row {p}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tiles_cover_the_tensor_once_per_replica(case):
    sharding = Sharding(_mesh(case.axes), case.spec)
    counts = np.zeros(case.shape, dtype=np.int64)
    for tile in sharding.tiles(case.shape).values():
        counts[to_slices(tile)] += 1
    assert (counts == sharding.num_replicas()).all()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_abstract_mesh_gives_the_same_tiles_by_position(case):
    abstract = Sharding(Mesh(case.axes), case.spec)
    assert [abstract.tile(case.shape, p) for p in range(abstract.mesh.size)] == list(case.tiles)
    with pytest.raises(InvalidMeshError, match="abstract"):
        abstract.tiles(case.shape)


def test_mesh_coords_are_row_major_last_axis_fastest():
    mesh = Mesh({"x": 2, "y": 3, "z": 2})
    assert [mesh.coords(p) for p in range(mesh.size)] == [
        tuple(int(c) for c in np.unravel_index(p, (2, 3, 2))) for p in range(12)
    ]
    assert mesh.coords(7) == (1, 0, 1)


def test_tile_of_a_device_outside_the_mesh_is_an_error():
    sharding = Sharding(_mesh({"x": 2}), ("x",))
    with pytest.raises(InvalidMeshError, match=r"device 'h9/0' is not in mesh"):
        sharding.tile((4,), "h9/0")


def test_shardings_parsed_apart_compare_by_value_and_keep_their_spec_text():
    """`Sharding.__eq__` settles on the kept hashes first and `spec_str` is kept once made: neither may change
    what equality or the text say."""
    one = Sharding(Mesh({"x": 2, "y": 2}, ["a/0", "a/1", "b/0", "b/1"]), ("x", None))
    same = Sharding(Mesh({"x": 2, "y": 2}, ["a/0", "a/1", "b/0", "b/1"]), ("x", None))
    assert one == same and hash(one) == hash(same) and not one != same
    assert {one: 1}[same] == 1
    other_devices = Sharding(Mesh({"x": 2, "y": 2}, ["a/0", "a/1", "b/1", "b/0"]), ("x", None))
    other_spec = Sharding(one.mesh, (None, "x"))
    summed = Sharding(one.mesh, ("x", None), partial=("y",))
    assert one != other_devices and one != other_spec and one != summed and one != ("x", None)
    assert one.spec_str() == "P('x', None)" and one.spec_str() is one.spec_str()
    assert summed.spec_str() == "P('x', None) + partial(y)" == summed.spec_str()
    assert repr(one) == repr(same) and "_spec_str" not in repr(one)
