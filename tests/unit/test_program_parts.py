"""bench/_program_parts.py, what the MoE benches measure of a program beyond its own figures: the lower bound over
many tensors is the core's bound where there is one tensor, adding up where there are more.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from reshard import Mesh, Sharding, Topology, plan
from reshard.program import TensorDecl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parts():
    spec = importlib.util.spec_from_file_location("bench_program_parts", ROOT / "bench" / "_program_parts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


TRAIN = Mesh.grid({"host": 2, "gpu": 2}, 2, "t")
SERVE = Mesh.grid({"host": 3, "gpu": 2}, 2, "s")


def test_the_many_tensor_bound_is_the_cores_for_one_tensor_and_adds_up(parts):
    topo = Topology(nic_gbps=10.0)
    one = TensorDecl("a", (512, 256), "float32", Sharding(TRAIN, (("host", "gpu"), None)),
                     Sharding(SERVE, ("gpu", None)))
    whole = TensorDecl("b", (300, 70), "bfloat16", Sharding(TRAIN, ("gpu", None)), Sharding(SERVE, (None, "gpu")))
    for t in (one, whole):
        assert parts.many_lower_bound([t], topo) == pytest.approx(
            plan(t.shape, t.dtype, t.src, t.dst, topo).lower_bound_seconds, rel=1e-12)
    assert parts.many_lower_bound([one, TensorDecl("c", one.shape, one.dtype, one.src, one.dst)], topo) == \
        pytest.approx(2 * parts.many_lower_bound([one], topo), rel=1e-12)
    # counted at the itemsize it travels in: one byte an element instead of four
    assert parts.many_lower_bound([one], topo, {"a": 1}) == pytest.approx(
        parts.many_lower_bound([one], topo) / 4, rel=1e-12)
    # on the same hosts: what a host already holds is not needed
    same = TensorDecl("d", (512, 256), "float32", Sharding(TRAIN, ("host", None)), Sharding(TRAIN, ("gpu", None)))
    assert parts.many_lower_bound([same], topo) == pytest.approx(
        plan(same.shape, same.dtype, same.src, same.dst, topo).lower_bound_seconds, rel=1e-12)
