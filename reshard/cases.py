"""The paper's benchmark cases (arXiv 2211.05322, as run in Alpa's artifact), as plain data.

Meshes are (hosts, devices per host) with axes ``x`` (hosts) and ``y`` (devices in
a host). The source mesh takes the first hosts of ``hosts``, the destination mesh
the next ones, so the two are disjoint as in the paper. ``nbytes`` scales the
tensors down (the paper used 2 GiB for N-to-M and 1 GiB for 1-to-M).

============ ============= ============================ ==================================
case         meshes        source layout                destination layout
============ ============= ============================ ==================================
case1        (2,4)->(2,4)  dim0 over hosts              same
case2        (2,4)->(2,4)  replicated x8                dim0 over hosts
case3        (2,4)->(2,4)  dim1 over hosts              dim0 over hosts
case4        (2,4)->(2,4)  dim1 over all 8 devices      dim0 over all 8 devices
case5        (2,4)->(2,4)  dim0 over a host's devices   dim0 over hosts
case6        (2,4)->(3,4)  dim0 over 2 hosts            dim0 over 3 hosts (unaligned)
case7        (1,4)->(2,4)  dim0 over a host's devices   replicated x8
case9        (2,4)->(2,4)  dim1 over hosts              dim2 over hosts
1to(HxG)     (1,1)->(H,G)  one device                   replicated on every device
============ ============= ============================ ==================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from reshard.dtypes import itemsize
from reshard.errors import InvalidMeshError
from reshard.mesh import Mesh
from reshard.sharding import Sharding

__all__ = ["Case", "n_to_m_cases", "one_to_m_cases", "overlap_cases", "ONE_TO_M_MESHES", "N_TO_M_BYTES", "ONE_TO_M_BYTES"]

N_TO_M_BYTES = 2 * 2**30
ONE_TO_M_BYTES = 2**30
ONE_TO_M_MESHES = ((1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4))


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    dtype: str
    src: Sharding
    dst: Sharding
    description: str

    @property
    def nbytes(self) -> int:
        n = itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n

    @property
    def num_hosts(self) -> int:
        return len(set(self.src.mesh.hosts) | set(self.dst.mesh.hosts))


def _hosts(hosts: Optional[Sequence[str]], needed: int) -> list[str]:
    hosts = list(hosts) if hosts is not None else [f"h{i}" for i in range(needed)]
    if len(hosts) < needed:
        raise InvalidMeshError(f"this case needs {needed} hosts but only {len(hosts)} were given: {hosts}; pass at least {needed} host names")
    return hosts


def _mesh(hosts: list[str], start: int, shape: tuple[int, int]) -> Mesh:
    return Mesh.from_hosts({"x": shape[0], "y": shape[1]}, hosts[start:start + shape[0]], shape[1])


def n_to_m_cases(hosts: Optional[Sequence[str]] = None, nbytes: int = N_TO_M_BYTES) -> list[Case]:
    """Cases 1-7 and 9 of the paper's N-to-M suite (case 8 repeats case 7)."""
    # The paper's tensors are (1024, 1024, 512) int32; dim 1 is scaled, the split dims are kept.
    mid = max(8, round(1024 * nbytes / N_TO_M_BYTES) // 8 * 8)
    big = (1024, mid, 512)
    specs = [
        ("case1", big, (2, 4), (2, 4), ("x", None, None), ("x", None, None), "same layout, 4 replicas per half"),
        ("case2", big, (2, 4), (2, 4), (None, None, None), ("x", None, None), "replicated x8 -> dim0 over hosts"),
        ("case3", big, (2, 4), (2, 4), (None, "x", None), ("x", None, None), "dim1 over hosts -> dim0 over hosts"),
        ("case4", big, (2, 4), (2, 4), (None, ("x", "y"), None), (("x", "y"), None, None), "all-to-all over 8 devices"),
        ("case5", big, (2, 4), (2, 4), ("y", None, None), ("x", None, None), "dim0 over devices -> dim0 over hosts"),
        ("case6", (3072, mid, 170), (2, 4), (3, 4), ("x", None, None), ("x", None, None), "2 hosts -> 3 hosts, unaligned"),
        ("case7", big, (1, 4), (2, 4), ("y", None, None), (None, None, None), "4 devices -> replicated x8"),
        ("case9", big, (2, 4), (2, 4), (None, "x", None), (None, None, "x"), "dim1 over hosts -> dim2 over hosts"),
    ]
    out = []
    for name, shape, sm, dm, ss, ds, desc in specs:
        h = _hosts(hosts, sm[0] + dm[0])
        src = Sharding(_mesh(h, 0, sm), ss)
        dst = Sharding(_mesh(h, sm[0], dm), ds)
        out.append(Case(name, shape, "int32", src, dst, desc))
    return out


def one_to_m_cases(
    hosts: Optional[Sequence[str]] = None,
    nbytes: int = ONE_TO_M_BYTES,
    meshes: Sequence[tuple[int, int]] = ONE_TO_M_MESHES,
) -> list[Case]:
    """One source device to a replicated destination on (hosts x devices) receivers."""
    n = max(1, nbytes // 4)
    out = []
    for shape in meshes:
        h = _hosts(hosts, 1 + shape[0])
        src = Sharding(_mesh(h, 0, (1, 1)), (None,))
        dst = Sharding(_mesh(h, 1, shape), (None,))
        out.append(Case(f"1to{shape[0]}x{shape[1]}", (n,), "int32", src, dst, f"1 device -> {shape[0]}x{shape[1]} replicas"))
    return out


def overlap_cases(hosts: Optional[Sequence[str]] = None, nbytes: int = N_TO_M_BYTES) -> list[Case]:
    """Reshards whose source and destination share hosts, as inside one training job.

    The paper's cases keep the meshes disjoint; here a receiver's own host often
    holds a replica, and hosts forward broadcast chains while they send their own
    data, so the order of a chain and the choice of a local sender matter. Cases
    that need more hosts than ``hosts`` has are left out.
    """
    n = max(8, nbytes // 4 // 1024)
    shape = (n, 1024)
    # (name, hosts needed, source mesh, spec, destination mesh, spec, description); hosts are taken in order.
    specs = [
        ("allgather4", 4, (4, 2), ("x", None), (4, 2), (None, None), "dim0 over 4 hosts -> replicated on the same hosts"),
        ("allgather8", 8, (8, 2), ("x", None), (8, 2), (None, None), "dim0 over 8 hosts -> replicated on the same hosts"),
        ("grow2to4", 4, (2, 4), ("y", None), (4, 2), (None, None), "2 hosts' devices -> replicated over 4 hosts, 2 shared"),
        ("regroup", 4, (4, 2), ("x", None), (2, 4), (None, "x"), "4x2 dim0 over hosts -> 2x4 dim1 over hosts"),
        ("shift1", 5, (4, 2), ("x", None), None, ("x", None), "dim0 over hosts, mesh moved by one host"),
    ]
    out = []
    for name, needed, sm, ss, dm, ds, desc in specs:
        if hosts is not None and len(hosts) < needed:
            continue
        h = _hosts(hosts, needed)
        dst_mesh = _mesh(h, 0, dm) if dm else Mesh.from_hosts({"x": 4, "y": 2}, h[1:5], 2)
        out.append(Case(name, shape, "float32", Sharding(_mesh(h, 0, sm), ss), Sharding(dst_mesh, ds), desc))
    return out
