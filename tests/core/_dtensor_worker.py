"""One rank of the DTensor comparison: distributes arange tensors and reports its local shards.

Run as ``python _dtensor_worker.py RANK WORLD_SIZE STORE CASES OUT``. ``CASES`` is
a JSON list of ``{"mesh": [sizes], "shape": [...], "placements": ["S0", "R", ...]}``;
``OUT`` receives, per case, the local shard's shape and its values in row-major
order, as JSON (no pickle).
"""

import datetime
import json
import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def _placement(text: str):
    return Replicate() if text == "R" else Shard(int(text[1:]))


def main(rank: int, world_size: int, store_path: str, cases_path: str, out_path: str) -> None:
    with open(cases_path) as f:
        cases = json.load(f)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    meshes = {}
    out = []
    for case in cases:
        key = tuple(case["mesh"])
        if key not in meshes:
            meshes[key] = init_device_mesh("cpu", key)
        shape = tuple(case["shape"])
        full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        local = distribute_tensor(full, meshes[key], [_placement(p) for p in case["placements"]]).to_local()
        out.append({"shape": list(local.shape), "values": local.reshape(-1).tolist()})
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
