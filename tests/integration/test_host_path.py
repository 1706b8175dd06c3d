"""The SDK's same-machine host path: shards of 1 MiB or more through a shared-memory segment, checked by digest."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

import reshard
from reshard import Mesh, Sharding
from reshard.client.client import _sharding_json
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto import shared_memory
from reshard.proto.shared_memory import Segment, SegmentPool

ONE = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
ONE_1D = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None,))
TWO = Sharding(Mesh.from_hosts({"x": 2}, ["host0", "host1"], 1), ("x", None))


def _my_segments() -> list[str]:
    return [n for n in os.listdir(shared_memory.SHM_DIR) if n.startswith("reshard-sdk-") and
            n.split("-")[3] == str(os.getpid())]


@pytest.fixture(scope="module")
def local():
    with reshard.local_cluster(hosts=2, devices_per_host=1, transport="grpc") as c:
        yield c


def test_large_shards_go_through_shared_memory_and_read_back_bit_exact(local):
    c = local
    a = np.random.default_rng(1).standard_normal((1024, 600)).astype(np.float32)  # 2.3 MiB, two 1.2 MiB tiles
    c.put("big", a, TWO)
    assert _my_segments(), "no shared-memory segment was made for shards of 1.2 MiB"
    assert np.array_equal(c.get("big"), a)
    assert np.array_equal(c.get_shard("big", "host1/0"), a[512:])
    b = a * 2
    c.put_shard("one", "host0/0", b, ONE)
    assert np.array_equal(c.get_shard("one", "host0/0"), b)
    assert np.array_equal(c.get("one"), b)
    c.delete("big")
    c.delete("one")


def test_small_shards_and_a_client_without_shared_memory_stream(local):
    with reshard.connect(local.address, token=local.cluster.token, shared_memory=False) as c:
        before = set(_my_segments())
        a = np.arange(600_000, dtype=np.float32).reshape(1000, 600)
        c.put("streamed", a, ONE)
        assert np.array_equal(c.get("streamed"), a)
        assert set(_my_segments()) == before
        c.delete("streamed")


def _upload(c, name: str, shape, dtype: str) -> tuple[pb.TileLocation, pb.ShardHeader]:
    opened = c._planner_call("BeginUpload", pb.BeginUploadRequest(
        name=name, shape=list(shape), dtype=dtype, sharding_json=_sharding_json(ONE_1D), kind="numpy"))
    loc, = opened.locations
    return loc, pb.ShardHeader(upload_id=opened.upload_id, tensor=name, device=loc.device, dtype=dtype, box=loc.box,
                               ticket=loc.ticket)


def _put_raw(c, loc, request):
    with grpc.insecure_channel(loc.address) as ch:
        return pb_grpc.AgentStub(ch).PutShardShm(request, metadata=[("authorization", f"Bearer {c.cluster.token}")])


def test_a_segment_whose_digest_differs_is_data_loss_and_stages_nothing(local):
    c = local
    a = np.arange(2**18, dtype=np.float32)  # 1 MiB
    loc, header = _upload(c, "lossy", a.shape, "float32")
    segment = Segment.create(a.nbytes)
    try:
        segment.view(0, a.nbytes)[:] = a.view(np.uint8)
        import xxhash

        request = pb.ShmPutShardRequest(header=header, region=pb.ShmRegion(name=segment.name, nbytes=a.nbytes),
                                        digest=xxhash.xxh3_64_intdigest(a.tobytes()) ^ 1)
        with pytest.raises(grpc.RpcError) as lost:
            _put_raw(c, loc, request)
        assert lost.value.code() == grpc.StatusCode.DATA_LOSS, lost.value.details()
        assert "differs from the client's" in lost.value.details() and "nothing was staged" in lost.value.details()
    finally:
        segment.close()
    assert "lossy" not in [t.name for t in c.tensors()]


@pytest.mark.parametrize("name, code, says", [
    ("../../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT, "not a name reshard makes"),
    ("reshard-sdk-1-1-" + "0" * 32, grpc.StatusCode.FAILED_PRECONDITION, "cannot be opened here"),
])
def test_a_segment_the_agent_cannot_open_is_refused_naming_it(local, name, code, says):
    c = local
    loc, header = _upload(c, f"refused_{code.name.lower()}", (4,), "float32")
    request = pb.ShmPutShardRequest(header=header, region=pb.ShmRegion(name=name, nbytes=16), digest=0)
    with pytest.raises(grpc.RpcError) as refused:
        _put_raw(c, loc, request)
    assert refused.value.code() == code and says in refused.value.details(), refused.value.details()


def test_a_region_past_the_segment_or_of_the_wrong_size_is_refused(local):
    c = local
    loc, header = _upload(c, "short", (2**18,), "float32")
    segment = Segment.create(2**20 - 4096)
    try:
        for region, says in ((pb.ShmRegion(name=segment.name, nbytes=2**20), "ends at byte"),
                             (pb.ShmRegion(name=segment.name, nbytes=2**19), "holds 524288 bytes, the shard 1048576")):
            with pytest.raises(grpc.RpcError) as refused:
                _put_raw(c, loc, pb.ShmPutShardRequest(header=header, region=region, digest=0))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert says in refused.value.details(), refused.value.details()
    finally:
        segment.close()


def test_segments_are_private_reused_and_removed():
    pool = SegmentPool(keep_bytes=3 * 2**20)
    first = pool.take(2**20)
    path = os.path.join(shared_memory.SHM_DIR, first.name)
    assert os.stat(path).st_mode & 0o777 == 0o600
    pool.give(first)
    assert pool.take(2**20 - 100) is first  # a free segment that fits is reused
    second = pool.take(2**21)
    pool.give(first)
    pool.give(second)
    third = pool.take(2**20)  # 3 MiB kept: taking the 1 MiB one leaves room
    assert third is first
    pool.give(pool.take(2**21 + 1))  # a new 2 MiB + 1: past 3 MiB free, the oldest free segments go
    assert not os.path.exists(os.path.join(shared_memory.SHM_DIR, second.name))
    pool.give(third)
    pool.close()
    assert not os.path.exists(path)


def test_segments_of_a_dead_client_are_removed_by_the_next():
    ns = os.stat("/proc/self/ns/pid").st_ino
    dead = 2**22 + 12345  # above pid_max's default: no such process
    orphan = os.path.join(shared_memory.SHM_DIR, f"reshard-sdk-{ns}-{dead}-{'ab' * 16}")
    other_ns = os.path.join(shared_memory.SHM_DIR, f"reshard-sdk-{ns + 1}-{dead}-{'cd' * 16}")
    for p in (orphan, other_ns):
        with open(p, "wb"):
            pass
    try:
        SegmentPool(keep_bytes=0).close()
        assert not os.path.exists(orphan)
        assert os.path.exists(other_ns)  # a pid of another namespace means nothing here
    finally:
        for p in (orphan, other_ns):
            if os.path.exists(p):
                os.unlink(p)
