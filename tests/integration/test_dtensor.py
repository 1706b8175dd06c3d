"""DTensors in and out of a real cluster: `put_dtensor` on one mesh, `get_dtensor` on another.

Four torch.distributed ranks (gloo, separate processes, rendezvous through a FileStore)
each connect their own client to the shared cluster. Every rank hands its shard over
on a training mesh (devices of host0, host1) and reads the tensor back on another mesh
and layout (devices of host2, host3), uneven shapes, an empty shard, bfloat16 and
Partial in and out included; each local shard must equal, bit for bit, what
``distribute_tensor`` of the full tensor gives that rank on the destination. The test
then checks the catalog: one reshard per layout change, though every rank asked.

The same ranks first distribute arange tensors on the meshes of `TILE_CASES` and report their local shards: our tiles
(`Sharding.from_placements(...).tile`) must be exactly those, uneven shapes, empty trailing shards and two mesh axes on
one tensor dim included. (The comparison had ranks of its own once, in tests/core: 20 s of make test for four more
torch start-ups.)

This file is also the rank's program: ``python test_dtensor.py RANK STORE PREFIX OUT``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.box import to_slices
from reshard.client import InvalidArgumentError

WORLD_SIZE = 4
TRAIN = ["host0/0", "host0/1", "host1/0", "host1/1"]  # reshard device of global rank r: TRAIN[r] ...
SERVE = ["host2/0", "host2/1", "host3/0", "host3/1"]  # ... or SERVE[r], on other hosts
GRID = ((2, 2), ("dp", "tp"))
LINE = ((4,), ("x",))

# name: (shape, dtype, put on (mesh, placements), reads in order (mesh, placements, devices)); placements "S0", "R",
# "P". Every tensor is put with the TRAIN devices. A read is compared with distribute_tensor in its placements, except
# a Partial read of a tensor stored summed: there the first rank along the Partial dim holds the Replicate() value
# and the others zeros (distribute_tensor divides by the ranks instead, turning int64 into float).
CASES = {
    "uneven": ((13, 7), "float32", (GRID, "S0 S1"), [(LINE, "S1", SERVE), (LINE, "S1", SERVE)]),
    "bf16": ((9, 10), "bfloat16", (LINE, "S0"), [(GRID, "R S0", SERVE)]),
    "partial_in": ((6, 5), "float32", (GRID, "P S0"), [(GRID, "P S0", TRAIN), (LINE, "S0", SERVE)]),
    "partial_out": ((7, 3), "int64", (LINE, "S0"), [(GRID, "P S1", SERVE)]),
}
SUMMED_PARTIAL_READS = {"partial_out/0": "R S1"}
# Our tiles against DTensor's local shards: (mesh shape, tensor shape, placements per mesh axis: "S<d>" or "R")
TILE_CASES = [
    ((4,), (5,), ("S0",)),
    ((4,), (3,), ("S0",)),
    ((4,), (13,), ("S0",)),
    ((4,), (3, 5), ("S0",)),
    ((4,), (6, 7), ("S1",)),
    ((4,), (2, 3), ("R",)),
    ((2, 2), (7, 5), ("S0", "S1")),
    ((2, 2), (9, 3), ("S0", "S1")),
    ((2, 2), (7, 5), ("S1", "S0")),
    ((2, 2), (7, 5), ("S0", "S0")),
    ((2, 2), (5,), ("S0", "S0")),
    ((2, 2), (3,), ("S0", "S0")),
    ((2, 2), (9, 3), ("S1", "S1")),
    ((2, 2), (5, 3), ("R", "S0")),
    ((2, 2), (5, 3), ("S1", "R")),
    ((2, 1, 2), (7, 5), ("S0", "R", "S1")),
    ((2, 1, 2), (9, 4), ("S1", "S0", "S0")),
    ((2, 1, 2), (3, 2, 5), ("S2", "S1", "S2")),
]
TILE_AXES = ("a", "b", "c")
# After the reads: (version, the last read's layout is what the catalog holds)
VERSIONS = {"uneven": 2, "bf16": 2, "partial_in": 2, "partial_out": 2}


def _full(name: str):
    """The case's whole tensor, the same in every process."""
    shape, dtype, _, _ = CASES[name]
    values = np.random.default_rng(sum(map(ord, name))).standard_normal(shape).astype(np.float32)
    if dtype == "int64":
        values = (values * 1000).astype(np.int64)
    import torch

    return torch.from_numpy(values).to(getattr(torch, dtype))


def _placements(text: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [Replicate() if p == "R" else Partial() if p == "P" else Shard(int(p[1:])) for p in text.split()]


def _bits(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


# -- one rank ------------------------------------------------------------------------------------------

def _rank_main(rank: int, store_path: str, prefix: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import reshard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))
    meshes = {m: init_device_mesh("cpu", m[0], mesh_dim_names=m[1]) for m in (GRID, LINE)}
    report: dict = {"reads": {}, "errors": {}, "tiles": []}
    tile_meshes: dict = {}
    for mesh_shape, shape, placements in TILE_CASES:
        if mesh_shape not in tile_meshes:
            tile_meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        local = distribute_tensor(full, tile_meshes[mesh_shape], _placements(" ".join(placements))).to_local()
        report["tiles"].append({"shape": list(local.shape), "values": local.reshape(-1).tolist()})
    with reshard.connect(os.environ["RESHARD_PLANNER"]) as c:
        for name, (shape, _, (mesh, placements), reads) in CASES.items():
            full = _full(name)
            c.put_dtensor(prefix + name, distribute_tensor(full, meshes[mesh], _placements(placements)), TRAIN)
            dist.barrier()  # every rank has handed over: the tensor is in the catalog
            for i, (mesh, placements, devices) in enumerate(reads):
                got = c.get_dtensor(prefix + name, meshes[mesh], _placements(placements), devices)
                read = f"{name}/{i}"
                want = distribute_tensor(full, meshes[mesh], _placements(SUMMED_PARTIAL_READS.get(read, placements)))
                report["reads"][read] = {
                    "same_bits": torch.equal(_bits(got.to_local()), _bits(want.to_local())),
                    "local_shape": list(got.to_local().shape), "want_shape": list(want.to_local().shape),
                    "meta": [list(got.shape), list(got.stride()), str(got.dtype), str(got.placements)],
                    "want_meta": [list(want.shape), list(want.stride()), str(want.dtype),
                                  str(tuple(_placements(placements)))],
                    "sum_equal": torch.equal(got.full_tensor(), full),
                    "zeros": bool((got.to_local() == 0).all()),
                }
                dist.barrier()  # the next read may reshard what this one read
        # Shards torch.chunk would not cut (5, 4, 2, 2 rows of 13) are refused, not stored.
        cut = [0, 5, 9, 11, 13]
        odd = DTensor.from_local(_full("uneven")[cut[rank]:cut[rank + 1]], meshes[LINE], [Shard(0)], run_check=False,
                                 shape=torch.Size((13, 7)), stride=(7, 1))
        for what, call in {
            "odd_shards": lambda: c.put_dtensor(prefix + "odd", odd, TRAIN),
            "rank_missing": lambda: c.get_dtensor(prefix + "uneven", meshes[GRID], _placements("S0 S1"), SERVE[:3]),
            "max_partial": lambda: c.get_dtensor(prefix + "uneven", meshes[LINE], [_max_partial()], SERVE),
        }.items():
            try:
                call()
            except ValueError as e:
                report["errors"][what] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(report))


def _max_partial():
    from torch.distributed.tensor import Partial

    return Partial("max")


# -- the tests -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(cluster, tmp_path_factory):
    """Runs the four ranks against the cluster; yields the tensor name prefix and each rank's report."""
    pytest.importorskip("torch.distributed.tensor")
    tmp = tmp_path_factory.mktemp("dtensor_ranks")
    prefix = f"dt_{cluster.transport}_"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "RESHARD_PLANNER": cluster.address,
           "RESHARD_TOKEN": cluster.token}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(tmp / "store"), prefix, str(tmp / f"{r}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD_SIZE)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-4000:]}"
    yield prefix, [json.loads((tmp / f"{r}.json").read_text()) for r in range(WORLD_SIZE)]
    with cluster.connect() as c:  # the cluster is shared: leave it as it was
        for name in CASES:
            c.delete(prefix + name)


# The adapters are the same code on either transport: one is enough, and saves the ranks' start-up.
pytestmark = pytest.mark.parametrize("cluster", ["grpc"], indirect=True)


def test_every_rank_reads_what_distribute_tensor_gives_it(ranks):
    _, reports = ranks
    for rank, report in enumerate(reports):
        assert set(report["reads"]) == {f"{n}/{i}" for n, c in CASES.items() for i in range(len(c[3]))}
        for read, r in report["reads"].items():
            name = read.split("/")[0]
            assert r["meta"] == r["want_meta"], f"rank {rank}, {read}"
            assert r["sum_equal"], f"rank {rank}, {read}: full_tensor() differs from the tensor put"
            if name == "partial_out" and rank >= 2:  # dp coordinate 1 along the Partial dim holds zeros
                assert r["zeros"] and r["local_shape"] == r["want_shape"], f"rank {rank}, {read}"
            else:
                assert r["same_bits"], f"rank {rank}, {read}: local shard differs from distribute_tensor's"
    # The hard cases are there: a read with a 1-column shard, and a put where rank 3 holds no rows of 9.
    assert [13, 1] in [r["local_shape"] for report in reports for r in report["reads"].values()]
    put = Sharding.from_placements(Mesh({"x": 4}, TRAIN), [_own("S0")], 2).tiles(CASES["bf16"][0])
    assert put["host1/1"] == ((9, 9), (0, 10))


def _own(text: str):
    from reshard import Partial, Replicate, Shard

    return Replicate() if text == "R" else Partial() if text == "P" else Shard(int(text[1:]))


def test_the_catalog_holds_one_new_version_per_layout_change(ranks, client):
    prefix, _ = ranks
    for name, (shape, dtype, _, reads) in CASES.items():
        info = client.info(prefix + name)
        (sizes, names), placements, devices = reads[-1]
        last = Sharding.from_placements(Mesh(list(zip(names, sizes)), devices), [_own(p) for p in placements.split()],
                                        len(shape)).without_partial()
        assert info.version == VERSIONS[name], f"{name}: every rank asked, the first alone resharded"
        assert info.sharding.tiles(shape) == last.tiles(shape) and not info.sharding.partial, name
        assert (info.shape, info.dtype) == (shape, dtype)
        got = client.get(prefix + name)
        assert _bits(got).tolist() == _bits(_full(name)).tolist(), name


def _tile_case_id(case) -> str:
    mesh, shape, placements = case
    return f"mesh{'x'.join(map(str, mesh))}-shape{'x'.join(map(str, shape))}-{''.join(placements)}"


@pytest.mark.parametrize("case", TILE_CASES, ids=_tile_case_id)
def test_our_tile_is_the_dtensor_local_shard(case, ranks):
    _, reports = ranks
    mesh_shape, shape, placements = case
    mesh = Mesh(list(zip(TILE_AXES, mesh_shape)), [f"rank{r}/0" for r in range(WORLD_SIZE)])
    sharding = Sharding.from_placements(mesh, [_own(p) for p in placements], ndim=len(shape))
    full = np.arange(math.prod(shape)).reshape(shape)
    for rank, report in enumerate(reports):
        shard = report["tiles"][TILE_CASES.index(case)]
        ours = full[to_slices(sharding.tile(shape, f"rank{rank}/0"))]
        assert list(ours.shape) == shard["shape"], f"rank {rank}: tile {sharding.tile(shape, f'rank{rank}/0')}"
        assert ours.reshape(-1).tolist() == shard["values"], f"rank {rank}"


def test_the_tile_table_has_uneven_and_empty_shards(ranks):
    """Guards the table itself: it must keep exercising the hard cases."""
    _, reports = ranks
    per_case = [[report["tiles"][i] for report in reports] for i in range(len(TILE_CASES))]
    assert any(0 in s["shape"] for shards in per_case for s in shards), "no case gives a rank an empty shard"
    assert any(len({tuple(s["shape"]) for s in shards}) > 2 for shards in per_case)


def test_bad_input_is_refused_and_stores_nothing(ranks, client):
    prefix, reports = ranks
    for rank, report in enumerate(reports):
        errors = report["errors"]
        assert errors["rank_missing"].startswith("InvalidMeshError: devices has no entry for rank 3")
        assert errors["max_partial"].startswith("InvalidShardingError: placement Partial(max) on axis 'x' reduces by "
                                                "'max'")
        # 5, 4, 2, 2 rows where torch.chunk cuts 4, 4, 4, 1: rank 1 cannot tell, but the others refuse, so the
        # upload never completes.
        if rank == 1:
            assert "odd_shards" not in errors
        else:
            assert errors.pop("odd_shards").startswith(
                f"InvalidShardingError: the DTensor's local shard on rank {rank} is of shape ({[5, 4, 2, 2][rank]}, 7), "
                f"but P('x', None) on (x=4) of shape (13, 7) gives that device the tile "
                f"{[[(0, 4), (0, 7)], [], [(8, 12), (0, 7)], [(12, 13), (0, 7)]][rank]} of shape "
                f"({[4, 4, 4, 1][rank]}, 7): reshard stores torch.chunk tiles")
        assert set(errors) == {"rank_missing", "max_partial"}, f"rank {rank}: {errors}"
    assert prefix + "odd" not in [t.name for t in client.tensors()]
    assert client.info(prefix + "uneven").version == VERSIONS["uneven"]


def test_put_shard_of_an_uneven_shard_needs_the_global_shape(client, fresh_name):
    """13 rows over 4 devices: the shards are 4, 4, 4 and 1 rows, and a shard of 4 fits 13 to 16 rows."""
    full = np.arange(13 * 7, dtype=np.int32).reshape(13, 7)
    sharding = Sharding(Mesh({"x": 4}, TRAIN), ("x", None))
    tiles = sharding.tiles(full.shape)
    with pytest.raises(InvalidArgumentError, match=(
            rf"put_shard of '{fresh_name}' on device host0/0 needs shape=, the global shape: P\('x', None\) splits "
            rf"dim 0 4 ways, and a shard 4 long does not tell how long the dim is")):
        client.put_shard(fresh_name, "host0/0", full[:4], sharding)
    assert fresh_name not in [t.name for t in client.tensors()]
    done = [client.put_shard(fresh_name, d, full[lo:hi], sharding, shape=full.shape) for d, ((lo, hi), _) in
            tiles.items()]
    assert done == [False, False, False, True]
    assert client.info(fresh_name).shape == (13, 7)
    assert np.array_equal(client.get(fresh_name), full)
    client.delete(fresh_name)
    # A sharding that splits no dim needs no shape: the shard is the whole tensor.
    assert client.put_shard(fresh_name, "host0/0", full, Sharding(Mesh({"x": 1}, ["host0/0"]), (None, None)))
    assert np.array_equal(client.get(fresh_name), full)
    client.delete(fresh_name)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
    # The report is written: leave without the interpreter's teardown, whose last collections over torch's
    # objects kept each rank 2-4 s past its work while four ranks shared make test's 2 cores
    sys.stdout.flush()
    os._exit(0)
