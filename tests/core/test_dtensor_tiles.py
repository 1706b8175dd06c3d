"""Our tiles are DTensor's local shards: compared with real `distribute_tensor` calls.

Four processes form a gloo process group on CPU (rendezvous through a FileStore,
loopback only) and run every case once; each rank reports its local shard's
shape and values as JSON, and every one must equal the arange tensor sliced by
`Sharding.from_placements(...).tile(shape, rank)`. Uneven shapes, empty
trailing shards and two mesh axes on one tensor dim are included.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reshard import Mesh, Replicate, Shard, Sharding
from reshard.box import to_slices

pytest.importorskip("torch.distributed.tensor")

WORLD_SIZE = 4
WORKER = Path(__file__).with_name("_dtensor_worker.py")
AXIS_NAMES = ("a", "b", "c")

# (mesh shape, tensor shape, placements per mesh axis: "S<d>" or "R")
CASES = [
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


def _case_id(case) -> str:
    mesh, shape, placements = case
    return f"mesh{'x'.join(map(str, mesh))}-shape{'x'.join(map(str, shape))}-{''.join(placements)}"


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory):
    """Per case, per rank: (local shape, flat values) from real DTensors."""
    tmp = tmp_path_factory.mktemp("dtensor")
    cases_path = tmp / "cases.json"
    cases_path.write_text(json.dumps([
        {"mesh": list(mesh), "shape": list(shape), "placements": list(pl)} for mesh, shape, pl in CASES
    ]))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(WORLD_SIZE), str(tmp / "store"),
             str(cases_path), str(tmp / f"rank{rank}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"
    per_rank = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return {_case_id(case): [per_rank[r][i] for r in range(WORLD_SIZE)] for i, case in enumerate(CASES)}


def _placement(text: str):
    return Replicate() if text == "R" else Shard(int(text[1:]))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_tile_is_the_dtensor_local_shard(case, local_shards):
    mesh_shape, shape, placements = case
    mesh = Mesh(list(zip(AXIS_NAMES, mesh_shape)), [f"rank{r}/0" for r in range(WORLD_SIZE)])
    sharding = Sharding.from_placements(mesh, [_placement(p) for p in placements], ndim=len(shape))
    full = np.arange(math.prod(shape)).reshape(shape)
    for rank, shard in enumerate(local_shards[_case_id(case)]):
        ours = full[to_slices(sharding.tile(shape, f"rank{rank}/0"))]
        assert list(ours.shape) == shard["shape"], f"rank {rank}: tile {sharding.tile(shape, rank)}"
        assert ours.reshape(-1).tolist() == shard["values"], f"rank {rank}"


def test_the_table_has_uneven_and_empty_shards(local_shards):
    """Guards the table itself: it must keep exercising the hard cases."""
    shards = [s for per_rank in local_shards.values() for s in per_rank]
    assert any(0 in s["shape"] for s in shards), "no case gives a rank an empty shard"
    assert any(len({tuple(s["shape"]) for s in per_rank}) > 2 for per_rank in local_shards.values())
