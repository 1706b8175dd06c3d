"""reshard: plan and carry out cross-mesh resharding of sharded tensors.

The core (this package's own modules) needs numpy only. The client SDK
(`reshard.client`) and the services (`reshard.server`) are imported on first
use, so planning-only users never load gRPC.
"""

from reshard.errors import (
    DtypeComputeError,
    InvalidMeshError,
    InvalidShapeError,
    InvalidShardingError,
    InvalidTopologyError,
    PlanValidationError,
    ReshardError,
    UnknownDtypeError,
)
from reshard.einsum import plan_apply, plan_einsum
from reshard.manifest import Manifest, ManifestError
from reshard.many import ManyProgram, plan_many
from reshard.mesh import Mesh, host_of
from reshard.partial_plan import reshard_program
from reshard.plans import Plan, Transfer
from reshard.program import (
    COMPUTE,
    MOVE,
    REDUCE,
    STEP_KINDS,
    Program,
    Step,
    StepEstimate,
    TensorDecl,
    TileRef,
)
from reshard.sequence import Op, plan_sequence
from reshard.strategies import BASELINES, STRATEGIES, plan
from reshard.sharding import Partial, Replicate, Shard, Sharding
from reshard.topology import Topology

__version__ = "0.1.0"

_SDK = ("connect", "local_cluster", "Client")

__all__ = [
    "Mesh",
    "Sharding",
    "Shard",
    "Replicate",
    "Partial",
    "Topology",
    "Plan",
    "Transfer",
    "Program",
    "Step",
    "TileRef",
    "TensorDecl",
    "StepEstimate",
    "MOVE",
    "COMPUTE",
    "REDUCE",
    "STEP_KINDS",
    "plan",
    "Op",
    "plan_sequence",
    "plan_einsum",
    "plan_apply",
    "reshard_program",
    "plan_many",
    "ManyProgram",
    "Manifest",
    "host_of",
    "STRATEGIES",
    "BASELINES",
    "ReshardError",
    "InvalidMeshError",
    "InvalidShardingError",
    "InvalidShapeError",
    "InvalidTopologyError",
    "UnknownDtypeError",
    "DtypeComputeError",
    "PlanValidationError",
    "ManifestError",
    *_SDK,
]


def __getattr__(name):
    if name in _SDK:
        from reshard import client

        return getattr(client, name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")
