"""Bad input: each mistake gets its status code and a message naming the problem; nothing is touched."""

from __future__ import annotations

import time

import numpy as np
import pytest

import reshard
from reshard import Mesh, Sharding
from reshard.client import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from reshard.proto import reshard_pb2 as pb
from reshard.proto.auth import channel
from reshard.proto import reshard_pb2_grpc as pb_grpc

from .conftest import HEARTBEAT_TIMEOUT_S, held_bytes

SRC = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", None))
A = np.arange(40, dtype=np.float32).reshape(8, 5)


@pytest.fixture()
def tensor(client, fresh_name):
    client.put(fresh_name, A, SRC)
    yield fresh_name
    client.delete(fresh_name)


def _untouched(client, name):
    info = client.info(name)
    assert info.version == 1 and info.sharding == SRC
    assert np.array_equal(client.get(name), A)


def test_unknown_tensor(client):
    with pytest.raises(NotFoundError, match="no tensor named 'nope'"):
        client.get("nope")
    with pytest.raises(NotFoundError, match="no tensor named 'nope'"):
        client.reshard("nope", SRC)
    with pytest.raises(NotFoundError, match="no tensor named 'nope' to delete"):
        client.delete("nope")


def test_a_new_version_of_another_shape_or_dtype(client, tensor):
    with pytest.raises(InvalidArgumentError, match=rf"tensor '{tensor}' is float32\[8, 5\] \(v1\), and a new version "
                                                   rf"keeps its shape and dtype: this one is float64\[8, 5\]; delete "
                                                   rf"it first to change its shape or dtype"):
        client.put(tensor, A.astype(np.float64) * 2, SRC)
    _untouched(client, tensor)


def test_shard_of_wrong_shape(client, tensor):
    with pytest.raises(InvalidArgumentError, match=r"shard for device host0/0 has shape \(3, 5\).*of shape \(4, 5\)"):
        client.put_shard("wrongshape", "host0/0", A[:3], SRC, shape=A.shape)
    assert "wrongshape" not in [t.name for t in client.tensors()]


def test_shard_of_wrong_dtype(client):
    client.put_shard("mixed", "host0/0", A[:4], SRC, shape=A.shape)
    with pytest.raises(InvalidArgumentError, match="gives dtype float64 but earlier shards gave float32"):
        client.put_shard("mixed", "host0/1", A[:4].astype(np.float64), SRC, shape=A.shape)
    assert "mixed" not in [t.name for t in client.tensors()]


def test_unknown_dtype(client):
    with pytest.raises(reshard.UnknownDtypeError, match="unknown dtype"):
        client.put("strings", np.array(["a", "b"]), Sharding(SRC.mesh, (None,)))


def test_invalid_sharding(client, tensor):
    bad = Sharding(SRC.mesh, (None, None, "x"))  # 3 entries for a 2-dim tensor
    with pytest.raises(InvalidArgumentError, match=r"spec P\(None, None, 'x'\) has 3 entries but the tensor has 2 dims"):
        client.reshard(tensor, bad)
    with pytest.raises(InvalidArgumentError, match="unknown strategy 'fastest'"):
        client.reshard(tensor, SRC, strategy="fastest")
    _untouched(client, tensor)


def test_unknown_device(client, tensor):
    dst = Sharding(Mesh.from_hosts({"x": 2}, ["host9"], 2), ("x", None))
    with pytest.raises(InvalidArgumentError, match="unknown device 'host9/0': no registered agent has it"):
        client.reshard(tensor, dst)
    too_many = Sharding(Mesh({"x": 1}, ["host0/7"]), (None, None))
    with pytest.raises(InvalidArgumentError, match="unknown device 'host0/7'"):
        client.reshard(tensor, too_many)
    with pytest.raises(NotFoundError, match="has no shard on device 'host3/0'"):
        client.get_shard(tensor, "host3/0")
    _untouched(client, tensor)


# The planner refuses the mesh before any transport is chosen: the collective and nixl runs repeat it (make bench
# runs them).
@pytest.mark.parametrize("cluster", ["grpc", pytest.param("collective", marks=pytest.mark.slow),
                                     pytest.param("nixl", marks=pytest.mark.slow)], indirect=True)
def test_mesh_on_a_host_that_is_down(client, tensor):
    with channel(client.address, token=client.cluster.token) as ch:
        pb_grpc.PlannerStub(ch).Register(pb.RegisterRequest(host="ghost", num_devices=2, address="127.0.0.1:9",
                                                            secret=bytes(32)))
    time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)
    assert "ghost/0" not in client.devices()
    dst = Sharding(Mesh.from_hosts({"x": 2}, ["ghost"], 2), ("x", None))
    with pytest.raises(FailedPreconditionError, match="host 'ghost' is down: its agent at 127.0.0.1:9 sent no heartbeat"):
        client.reshard(tensor, dst)
    with pytest.raises(FailedPreconditionError, match="host 'ghost' is down"):
        client.put("onghost", A, dst)
    _untouched(client, tensor)


@pytest.mark.grpc_in_make_test  # the agents free tiles on their control calls, whatever moves the bytes
def test_delete_many_deletes_every_name_and_frees_their_tiles(client, fresh_name):
    names = [f"{fresh_name}.{i}" for i in range(3)]
    big = np.ones((1024, 256), dtype=np.float32)  # 1 MiB a tensor, 256 KiB a device
    before = held_bytes(client)
    client.put_many({n: (big * i, SRC) for i, n in enumerate(names)})
    grown = held_bytes(client)
    assert sum(grown.values()) - sum(before.values()) >= 3 * big.nbytes
    client.delete_many(names)
    assert not {t.name for t in client.tensors()} & set(names)
    for n in names:
        with pytest.raises(NotFoundError, match=f"no tensor named '{n}'"):
            client.get(n)
    assert sum(held_bytes(client).values()) <= sum(before.values())
    client.delete_many([])  # nothing to do


@pytest.mark.parametrize("bad, error, message", [
    (lambda t: [t, "nope"], NotFoundError, r"no tensor named 'nope' to delete \(none of the 2 was deleted\)"),
    (lambda t: [t, t], InvalidArgumentError, r"tensor '.*' is named twice in one delete"),
    (lambda t: t, InvalidArgumentError, r"delete_many takes a list of tensor names; got the string"),
])
def test_delete_many_refuses_bad_names_and_deletes_none(client, tensor, bad, error, message):
    with pytest.raises(error, match=message):
        client.delete_many(bad(tensor))
    _untouched(client, tensor)
