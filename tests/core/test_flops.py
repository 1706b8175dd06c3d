"""Compute steps on the cost model: a roofline of memory traffic and arithmetic."""

import pytest

from reshard import Mesh, Sharding, Topology
from reshard.einsum import plan_einsum
from reshard.kernels import KERNELS
from reshard.program import TensorDecl


@pytest.mark.parametrize("equation, shapes, flops", [
    ("ij,jk->ik", ((3, 5), (5, 7)), 2 * 3 * 5 * 7),  # a matmul's 2mnk
    ("bij,bjk->bik", ((2, 3, 4), (2, 4, 5)), 2 * 2 * 3 * 4 * 5),
    ("i,j->ij", ((3,), (4,)), 2 * 12),  # an outer product: one multiply (and a trivial add) per element
    ("ij->i", ((6, 7),), 42),
    ("ij,jk,kl->il", ((2, 3), (3, 4), (4, 5)), 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5),  # pairwise, left to right
    ("ij,jk->ik", ((0, 5), (5, 7)), 0),  # an empty tile does nothing
])
def test_einsum_counts_a_multiply_and_an_add_per_combination_of_its_letters(equation, shapes, flops):
    assert KERNELS["einsum"].flops(shapes, {"equation": equation}) == flops


def test_other_kernels_count_per_element():
    assert KERNELS["add"].flops(((4, 5), (4, 5)), {}) == 20
    assert KERNELS["axpy"].flops(((4, 5), (4, 5)), {"alpha": "0.1"}) == 40
    assert KERNELS["sum"].flops(((4, 5),), {"dims": "1"}) == 20
    assert KERNELS["copy"].flops(((4, 5),), {}) == 0


def _matmul(m: int, k: int, n: int, topology: Topology):
    mesh = Mesh.from_hosts({"x": 2}, ["h0", "h1"], 1)
    a = TensorDecl("a", (m, k), "float32", src=Sharding(mesh, ("x", None)))
    b = TensorDecl("b", (k, n), "float32", src=Sharding(mesh, (None, None)))
    program = plan_einsum("ij,jk->ik", [a, b], "c", topology=topology)
    return [e for e in program.step_estimates(topology) if e.kind == "compute"]


def test_a_big_matmul_is_priced_by_arithmetic_and_a_thin_one_by_memory():
    topo = Topology(memory_gb_per_s=10.0, device_gflops=5.0)
    (big, _) = _matmul(512, 512, 512, topo)
    assert big.seconds == pytest.approx(2 * 256 * 512 * 512 / 5e9)
    assert big.bottleneck.startswith("arithmetic of ")
    (thin, _) = _matmul(4096, 1, 4096, topo)  # 2mnk is small; the 2048 x 4096 output dominates
    assert thin.seconds == pytest.approx((2048 * 1 + 1 * 4096 + 2048 * 4096) * 4 / 10e9)
    assert thin.bottleneck.startswith("memory of ")


def test_a_host_s_own_rate_overrides_the_default():
    topo = Topology(device_gflops=5.0, host_device_gflops={"h0": 50.0})
    steps = {e.bottleneck.split()[-1].split("/")[0]: e.seconds for e in _matmul(512, 512, 512, topo)}
    assert steps["h1"] == pytest.approx(10 * steps["h0"])


def test_topology_json_carries_the_rates_and_reads_older_json_with_defaults():
    topo = Topology(device_gflops=7.5, host_device_gflops={"h0": 30.0})
    again = Topology.from_json(topo.to_json())
    assert again == topo and again.flops_per_s("h0") == 30e9 and again.flops_per_s("h9") == 7.5e9
    old = {k: v for k, v in topo.to_json().items() if "gflops" not in k}
    assert Topology.from_json(old).device_gflops == 20.0
    with pytest.raises(ValueError, match="device_gflops is 0; bandwidths must be positive numbers of GFLOP/s"):
        Topology(device_gflops=0)
