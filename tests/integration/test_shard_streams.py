"""Several shards in one stream: put_many and get_many send an agent its small tiles in one PutShard stream and read
them back in one GetShard call, and FinishUploads commits a put_many's uploads with one Commit per agent.

Probed with raw calls built from the project's own stubs where the wire is the point (a bad shard in the middle of
a stream, a missing shard in a read), and through the SDK for what a user sees: many small tensors and a large
one, bit-exact, after a failure as before.
"""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import channel
from reshard.proto.layout import Checksum, digest
from reshard.proto.wire import read_shard_stream, run_start, shard_stream, unbatched
from reshard.server.common.tickets import commit_fields

TWO = Sharding(Mesh.from_hosts({"x": 2}, ["host0"], 2), ("x",))  # both tiles on host0
GRID = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", "y"))


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, 2, transport="grpc") as cluster:
        yield cluster


@pytest.fixture
def client(cluster):
    with cluster.connect() as c:
        yield c


def _stubs(cluster):
    planner = pb_grpc.PlannerStub(channel(cluster.address, token=cluster.token))
    agent = pb_grpc.AgentStub(channel(cluster.agent_addresses["host0"], token=cluster.token))
    return planner, agent


def _begin(planner, name: str):
    return planner.BeginUpload(pb.BeginUploadRequest(name=name, shape=[4], dtype="float32", kind="numpy",
                                                     sharding_json=json.dumps(TWO.to_json())), timeout=10)


def _header(reply, name: str, loc, ticket=None) -> pb.ShardHeader:
    return pb.ShardHeader(upload_id=reply.upload_id, tensor=name, device=loc.device, dtype="float32", box=loc.box,
                          ticket=loc.ticket if ticket is None else ticket)


def test_one_put_shard_stream_stages_several_shards_and_stops_at_a_bad_one(cluster, client):
    planner, agent = _stubs(cluster)
    reply = _begin(planner, "pair")
    parts = (np.ones(2, np.float32), np.full(2, 2, np.float32))
    stream = [m for loc, part in zip(reply.locations, parts)
              for m in shard_stream(part, _header(reply, "pair", loc), 1 << 20)]
    assert agent.PutShard(iter(stream), timeout=10).nbytes == 16
    planner.FinishUpload(pb.FinishUploadRequest(upload_id=reply.upload_id,
                                                devices=[p.device for p in reply.locations]), timeout=10)
    assert client.get("pair").tolist() == [1, 1, 2, 2]

    # The second shard carries the first's ticket: the call fails on it, naming it; the upload never completes.
    reply = _begin(planner, "forged")
    first, second = reply.locations
    stream = [*shard_stream(parts[0], _header(reply, "forged", first), 1 << 20),
              *shard_stream(parts[1], _header(reply, "forged", second, first.ticket), 1 << 20)]
    with pytest.raises(grpc.RpcError) as e:
        agent.PutShard(iter(stream), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"for device {second.device}" in e.value.details()
    assert "forged" not in {t.name for t in client.tensors()}
    assert client.get("pair").tolist() == [1, 1, 2, 2]


def test_a_shard_stream_that_stops_between_shards_or_inside_one_says_which():
    parts = [*shard_stream(np.ones(2, np.float32), pb.ShardHeader(device="h/0", dtype="float32",
                                                                   box=pb.Box(lo=[0], hi=[2])), 1 << 20)]
    chunks = iter(parts)
    header, values = read_shard_stream(chunks)
    assert header.device == "h/0" and values.tolist() == [1, 1]
    assert read_shard_stream(chunks, or_end=True) is None  # the stream's end, after a whole shard
    with pytest.raises(ValueError, match="ended after 0 bytes without a trailer"):
        read_shard_stream(iter(parts[:1]), or_end=True)  # cut inside a shard: an error even where an end may come


def test_a_shard_read_in_order_gives_its_tiles_digest_and_one_read_out_of_order_none():
    # What an agent keeps of an upload (`TileBuffer.digest`): the tile's C-order XXH3-64 only where its pieces
    # came as runs in that order, whatever their size; the bytes land either way.
    a = np.arange(6 * 5 * 4, dtype=np.float32).reshape(6, 5, 4)
    header = pb.ShardHeader(device="h/0", dtype="float32", box=pb.Box(lo=[2, 0, 0], hi=[8, 5, 4]))
    for chunk in (a.nbytes, 5 * 4 * 4, 4 * 4, 12):  # whole, a row, a row's column, parts of one
        head, *pieces, _ = shard_stream(a, header, chunk)
        _, values, got = read_shard_stream(iter(shard_stream(a, header, chunk)), with_digest=True)
        assert np.array_equal(values, a) and got == digest(a), chunk
        if len(pieces) > 1:  # the same pieces, the first two swapped, under a trailer of that order
            pieces[:2] = pieces[1::-1]
            check = Checksum()
            for p in pieces:
                check.update(p.piece.data)
            trailer = pb.ShardChunk(trailer=pb.Trailer(nbytes=check.nbytes, xxh3_64=check.xxh3_64))
            _, values, got = read_shard_stream(iter([head, *pieces, trailer]), with_digest=True)
            assert np.array_equal(values, a) and got is None, chunk


def test_run_start_finds_where_a_box_starts_in_its_tiles_c_order_only_if_it_is_one_run_there():
    tile = ((2, 8), (0, 5), (10, 14))
    assert run_start(tile, tile) == 0
    assert run_start(tile, ((3, 5), (0, 5), (10, 14))) == 20  # whole rows
    assert run_start(tile, ((3, 4), (1, 3), (10, 14))) == 24  # one row, whole columns of it
    assert run_start(tile, ((3, 4), (1, 2), (11, 13))) == 25  # inside one column
    assert run_start(tile, ((3, 5), (1, 3), (10, 14))) == -1  # two rows, part of each
    assert run_start(tile, ((3, 4), (1, 3), (11, 13))) == -1  # two columns, part of each
    assert run_start((), ()) == 0


def test_one_get_shard_call_streams_several_shards_in_order_or_fails_before_any(cluster, client):
    _, agent = _stubs(cluster)
    data = np.arange(16, dtype=np.float32).reshape(4, 4)
    client.put("grid", data, GRID)
    try:
        v = client.info("grid").version
        asked = [pb.GetShardRequest(tensor="grid", version=v, device=d) for d in ("host0/1", "host0/0")]
        first = pb.GetShardRequest(tensor="grid", version=v, device="host0/1", more=asked[1:])
        messages = list(agent.GetShard(first, timeout=10))
        assert [m.WhichOneof("kind") for m in messages] == ["batch"]  # small tiles whole, in one message
        stream = unbatched(messages)
        for r in asked:
            header, values = read_shard_stream(stream)
            assert header.device == r.device
            tile = GRID.tiles(data.shape)[r.device]
            assert np.array_equal(values.reshape(2, 2), data[tuple(slice(lo, hi) for lo, hi in tile)])
        assert next(stream, None) is None
        missing = pb.GetShardRequest(tensor="grid", version=v, device="host0/0",
                                     more=[pb.GetShardRequest(tensor="grid", version=v + 1, device="host0/1")])
        with pytest.raises(grpc.RpcError) as e:
            list(agent.GetShard(missing, timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and f"v{v + 1}" in e.value.details()
    finally:
        client.delete("grid")


def test_a_commit_ticket_covers_every_upload_it_carries():
    one = commit_fields("u1", "", "a", 1, ["h/0"])
    assert commit_fields("u1", "", "a", 1, ["h/0"], [("u2", "b", 1, ["h/0", "h/1"])]) != one
    assert commit_fields("u1", "", "a", 1, ["h/0"], [("u2", "b", 1, ["h/0"])]) != \
        commit_fields("u1", "", "a", 1, ["h/0"], [("u2", "b", 2, ["h/0"])])


def test_many_small_tensors_and_a_large_one_go_and_come_back_bit_exact(client):
    rng = np.random.default_rng(0)
    small = {f"s{i}": (rng.standard_normal((6, 5)).astype(np.float32), GRID) for i in range(300)}
    big = rng.standard_normal((1024, 1024)).astype(np.float32)  # 1 MiB tiles: streams of their own
    tensors = {**small, "big": (big, GRID), "ints": (np.arange(7 * 3, dtype=np.int64).reshape(7, 3), GRID)}
    client.put_many(tensors)
    try:
        got = client.get_many(list(tensors))
        for name, (array, _) in tensors.items():
            assert got[name].dtype == array.dtype and np.array_equal(got[name], array), name
        assert np.array_equal(client.get("s7"), small["s7"][0])
    finally:
        for name in tensors:
            client.delete(name)


def test_a_put_many_whose_commit_fails_on_one_agent_leaves_nothing_on_any_and_a_retry_succeeds():
    rng = np.random.default_rng(1)
    tensors = {f"w{i}": (rng.standard_normal((6, 5)).astype(np.float32), GRID) for i in range(300)}
    with LocalCluster(2, 2, transport="grpc", planner_args=["--heartbeat-timeout", "3"]) as cluster:
        with cluster.connect() as c:
            c.put("kept", np.arange(16, dtype=np.float32).reshape(4, 4), GRID)

            def host0_holds(nbytes: int) -> bool:
                """Whether host0 reports ``nbytes`` held, within 30 s (agents report with their heartbeats)."""
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if next(a["memory_used_bytes"] for a in c.agents() if a["host"] == "host0") == nbytes:
                        return True
                    time.sleep(0.1)
                return False

            held = 2 * 2 * 2 * 4  # host0's two 2 x 2 float32 tiles of "kept"
            assert host0_holds(held)
            reply = c._planner_call("BeginUploads", pb.BeginUploadsRequest(tensors=[
                pb.BeginUploadRequest(name=n, shape=a.shape, dtype="float32", kind="numpy",
                                      sharding_json=json.dumps(s.to_json())) for n, (a, s) in tensors.items()]))
            c._upload_all([(opened.upload_id, n, p, "float32",
                            np.ascontiguousarray(tensors[n][0][tuple(slice(lo, hi) for lo, hi in zip(p.box.lo,
                                                                                                      p.box.hi))]))
                           for n, opened in zip(tensors, reply.uploads) for p in opened.locations], False)
            cluster.kill_agent("host1")  # its Commit call fails (or the planner already has it down)
            with pytest.raises(Exception, match="host1"):
                c._planner_call("FinishUploads", pb.FinishUploadsRequest(group_id=reply.group_id))
            assert not set(tensors) & {t.name for t in c.tensors()}
            assert host0_holds(held)  # host0's committed and staged shards of the put are gone
            cluster.start_agent("host1")
            c.put_many(tensors)
            got = c.get_many(list(tensors))
            assert all(np.array_equal(got[n], a) for n, (a, _) in tensors.items())
