"""Empty destination tiles through real agents, with every strategy on every transport (issue 10, item 8).

A (13, 64) tensor split 8 ways along dim 0 leaves the last device an empty
tile (13:13). Every strategy must deliver the other tiles bit for bit and
leave that device holding a (0, 64) shard.
"""

from __future__ import annotations

import numpy as np
import pytest

import reshard
from reshard import Mesh, Sharding

SHAPE = (13, 64)
SRC = Sharding(Mesh.from_hosts({"a": 2}, ["host0"], 2), ("a", None))
DST = Sharding(Mesh.from_hosts({"a": 4, "b": 2}, ["host0", "host1", "host2", "host3"], 2), (("a", "b"), None))
EMPTY = "host3/1"


def test_the_destination_really_has_an_empty_tile():
    assert DST.tile(SHAPE, EMPTY) == ((13, 13), (0, 64))


def _array():
    return np.random.default_rng(13).standard_normal(SHAPE).astype(np.float32)


@pytest.mark.parametrize("strategy", reshard.STRATEGIES)
def test_reshard_onto_a_mesh_with_an_empty_tile_is_bit_exact(client, strategy):
    name = f"empty_tiles_{strategy}"
    a = _array()
    client.put(name, a, SRC)
    try:
        result = client.reshard(name, DST, strategy).result(timeout=30)
        assert result.state == "succeeded", result
        got = client.get(name)
        assert got.dtype == a.dtype and np.array_equal(got, a)
        for dev, box in DST.tiles(SHAPE).items():
            if dev != EMPTY:
                assert np.array_equal(client.get_shard(name, dev), a[tuple(slice(lo, hi) for lo, hi in box)]), dev
    finally:
        client.delete(name)


def test_the_empty_tile_reads_back_as_an_empty_shard(client):
    name = "empty_tiles_get_shard"
    client.put(name, _array(), SRC)
    try:
        client.reshard(name, DST, "auto").result(timeout=30)
        assert client.get_shard(name, EMPTY).shape == (0, 64)
    finally:
        client.delete(name)


def test_a_sharding_with_an_empty_tile_uploads_and_reads_back(client):
    name = "empty_tiles_put"
    client.put(name, _array(), DST)
    try:
        assert np.array_equal(client.get(name), _array())
        assert client.get_shard(name, EMPTY).shape == (0, 64)
    finally:
        client.delete(name)
