"""Weight sync: a training job publishes its DTensors, an inference job reads them in its own layout.

The block between the markers is the README's "Weight sync in ten lines"; tests/integration/test_weight_sync_doc.py
runs this file as written, as two torchrun jobs of 2 ranks against a local cluster of 4 hosts (host0 and host1
train, host2 and host3 serve). Against your own cluster:

    export RESHARD_PLANNER=planner-host:50051 RESHARD_TOKEN=...
    torchrun --nproc-per-node 2 docs/weight_sync.py train   # then, once it has finished:
    torchrun --nproc-per-node 2 docs/weight_sync.py serve
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import reshard
from reshard import Sharding

dist.init_process_group("gloo")
c = reshard.connect(os.environ["RESHARD_PLANNER"], token=os.environ.get("RESHARD_TOKEN"))
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))  # this job's ranks
names = [f"layers.{i}.{w}" for i in range(4) for w in ("qkv", "out", "up", "down")]


def weight(name: str) -> torch.Tensor:
    """The same bfloat16 values in both jobs, so that the inference job can check what it reads bit for bit."""
    return torch.randn(96, 64, generator=torch.Generator().manual_seed(sum(map(ord, name)))).to(torch.bfloat16)


# -- README begins
if sys.argv[1] == "train":  # every training rank hands over its shards: rows split over the training ranks
    for name in names:
        c.put_dtensor(name, distribute_tensor(weight(name), mesh, [Shard(0)]), ["host0/0", "host1/0"])
else:  # every inference rank, in its own layout: columns split over the inference ranks
    serving = ["host2/0", "host3/0"]
    if dist.get_rank() == 0:  # one job for the whole state dict, committed atomically
        layout = Sharding.from_device_mesh(mesh, [Shard(1)], serving, ndim=2)
        c.reshard_many({name: layout for name in names}).result(timeout=600)
    dist.barrier()
    weights = {name: c.get_dtensor(name, mesh, [Shard(1)], serving) for name in names}
# -- README ends

if sys.argv[1] == "serve":
    for name in names:
        want = distribute_tensor(weight(name), mesh, [Shard(1)]).to_local()
        if not torch.equal(weights[name].to_local().view(torch.int16), want.view(torch.int16)):
            raise SystemExit(f"rank {dist.get_rank()}: {name} differs from distribute_tensor's shard")
    print(f"rank {dist.get_rank()}: {len(names)} weights read bit-exact in the serving layout", flush=True)
dist.destroy_process_group()
