"""Split einsum and kernels through the service: real planner and agent processes, every transport.

Random two-input equations on random layouts (the strategy of tests/unit/test_einsum_programs.py,
whose meshes use this cluster's hosts) run through ``c.einsum`` and must equal ``numpy.einsum``
exactly (small integers in float64) on every device; Partial inputs are handed over as addends by ``put_shard``.
Partial results read back as their sum and reshard into values, checked on every device. Bad requests name the rule, the
letter and the sizes, and change nothing stored.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import Mesh, Op, Sharding
from reshard.einsum import EinsumError
from reshard.errors import InvalidShardingError
from reshard.kernels import MAX_EQUATION_CHARS
from reshard.program import MOVE, REDUCE
from reshard.proto.errors import InvalidArgumentError, NotFoundError
from reshard.proto.layout import tile_shape

from unit.test_einsum_programs import problems

from .every_device import assert_every_device

_NAMES = itertools.count()
MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2)
ACROSS = Mesh.from_hosts({"x": 4}, ["host0", "host1", "host2", "host3"], 1)


def _put(c, name: str, array: np.ndarray, sharding: Sharding, rng) -> None:
    """``array`` in ``sharding``; along its partial axes as random integer addends, one put_shard per device."""
    if not sharding.partial:
        c.put(name, array, sharding)
        return
    mesh = sharding.mesh
    index = [mesh.axis_index(a) for a in sharding.partial]
    corners = list(itertools.product(*(range(mesh.shape[i]) for i in index)))
    addends = {k: rng.integers(-4, 5, array.shape).astype(array.dtype) for k in corners[1:]}
    addends[corners[0]] = array - sum(addends.values(), np.zeros_like(array))
    for pos, (dev, box) in enumerate(sharding.tiles(array.shape).items()):
        tile = addends[tuple(mesh.coords(pos)[i] for i in index)][tuple(slice(*r) for r in box)]
        c.put_shard(name, dev, np.ascontiguousarray(tile).reshape(tile_shape(box)), sharding, shape=array.shape)


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(problem=problems(), seed=st.integers(0, 2**32 - 1))
def test_random_einsums_on_real_agents_equal_numpy(client, problem, seed):
    eq, operands, out, sizes, shardings, out_sharding = problem
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(-4, 5, tuple(sizes[c] for c in ls)).astype(np.float64) for ls in operands]
    k = next(_NAMES)
    names = [f"es{k}_{i}" for i in range(len(arrays))]
    for name, a, s in zip(names, arrays, shardings):
        _put(client, name, a, s, rng)
    try:
        try:
            program = client.plan_einsum(eq, *names, out=f"es{k}_out", out_sharding=out_sharding)
        except InvalidArgumentError as e:  # a Partial output where no sum is left pending: refused, as in the core
            assert "Partial over" in str(e)
            return
        client.einsum(eq, *names, out=f"es{k}_out", out_sharding=out_sharding).result(timeout=60)
        want, held = np.einsum(eq, *arrays), client.info(f"es{k}_out").sharding
        assert held == program.tensor(f"es{k}_out").dst
        if held.is_partial:  # addends on its devices: read as their sum
            np.testing.assert_array_equal(client.get(f"es{k}_out"), want)
        else:
            assert_every_device(client, f"es{k}_out", want, held)
    finally:
        for name in [*names, f"es{k}_out"]:
            if name in {t.name for t in client.tensors()}:
                client.delete(name)


def test_nothing_moves_when_the_layouts_line_up(client, fresh_name):
    a, b = np.arange(48.0).reshape(8, 6), np.arange(24.0).reshape(6, 4)
    client.put(f"{fresh_name}_a", a, Sharding(MESH, ("x", None)))
    client.put(f"{fresh_name}_b", b, Sharding(MESH, (None, "y")))
    program = client.plan_einsum("ij,jk->ik", f"{fresh_name}_a", f"{fresh_name}_b", out=f"{fresh_name}_c")
    assert not any(s.kind in (MOVE, REDUCE) for s in program.steps), program.summary()
    result = client.einsum("ij,jk->ik", f"{fresh_name}_a", f"{fresh_name}_b", out=f"{fresh_name}_c").result(60)
    assert result.network_bytes == 0 and all(t["local_bytes"] == 0 for t in result.traffic.values())
    np.testing.assert_array_equal(client.get(f"{fresh_name}_c"), a @ b)
    assert client.info(f"{fresh_name}_c").sharding == Sharding(MESH, ("x", "y"))


def test_an_all_reduce_across_hosts_sends_the_ring_share(client, fresh_name):
    """A contracting dim split over 4 hosts: each host sends 2(n-1)/n of its output tile, nothing more; every host
    ends with the whole sum (distinct small integers, exact: a row or a host's part misplaced does not read back)."""
    rng = np.random.default_rng(4)
    a, b = rng.integers(-4, 5, (16, 64)).astype(np.float64), rng.integers(-4, 5, (64, 32)).astype(np.float64)
    client.put(f"{fresh_name}_a", a, Sharding(ACROSS, (None, "x")))
    client.put(f"{fresh_name}_b", b, Sharding(ACROSS, ("x", None)))
    result = client.einsum("ij,jk->ik", f"{fresh_name}_a", f"{fresh_name}_b", out=f"{fresh_name}_c").result(60)
    tile = 16 * 32 * 8
    for host, t in result.traffic.items():
        assert sum(t["bytes_out"].values()) == 2 * 3 * tile // 4, (host, t)
    assert_every_device(client, f"{fresh_name}_c", a @ b, Sharding(ACROSS, (None, None)))


def test_a_partial_result_reads_as_its_sum_and_reshards_into_values(client, fresh_name):
    rng = np.random.default_rng(3)
    a, b = rng.integers(-4, 5, (8, 6)).astype(np.float64), rng.integers(-4, 5, (6, 4)).astype(np.float64)
    client.put(f"{fresh_name}_a", a, Sharding(MESH, ("x", "y")))
    client.put(f"{fresh_name}_b", b, Sharding(MESH, ("y", None)))
    pending = Sharding(MESH, ("x", None), partial=("y",))
    client.einsum("ij,jk->ik", f"{fresh_name}_a", f"{fresh_name}_b", out=f"{fresh_name}_c",
                  out_sharding=pending).result(60)
    assert client.info(f"{fresh_name}_c").sharding == pending
    np.testing.assert_array_equal(client.get(f"{fresh_name}_c"), a @ b)
    for target in (Sharding(MESH, ("x", "y")), Sharding(MESH, (None, None)),
                   Sharding(Mesh.from_hosts({"x": 2}, ["host2", "host3"], 1), (None, "x"))):
        client.reshard(f"{fresh_name}_c", target).result(60)
        assert_every_device(client, f"{fresh_name}_c", a @ b, target)
    with pytest.raises(InvalidArgumentError, match="is Partial: its devices hold addends"):
        client.put(f"{fresh_name}_d", a, pending)


@pytest.mark.parametrize("call,error,message", [
    (lambda c, n: c.einsum("ij,jk->ik", f"{n}_a", f"{n}_a", out=f"{n}_c"), InvalidArgumentError,
     r"dim letter 'j' has size 6 in input 0 .* but 8 in input 1"),
    (lambda c, n: c.einsum("ij,jk->ik", f"{n}_a", f"{n}_missing", out=f"{n}_c"), NotFoundError,
     r"no tensor named '.*_missing'"),
    (lambda c, n: c.einsum("ij,jk->iz", f"{n}_a", f"{n}_b", out=f"{n}_c"), InvalidArgumentError,
     r"output letter\(s\) \['z'\] appear in no input"),
    (lambda c, n: c.einsum("ij,jk->ik", f"{n}_a", f"{n}_b", out=f"{n}_c",
                           out_sharding=Sharding(MESH, ("x", "x"))), InvalidShardingError,
     r"axis 'x' splits dim 1 but is already used by dim 0; a mesh axis may split at most one tensor dim"),
    (lambda c, n: c.apply("add", f"{n}_a", f"{n}_b", out=f"{n}_c"), InvalidArgumentError,
     r"add: input '.*_a' has shape \(8, 6\) but '.*_b' has shape \(6, 4\) \(dim 0: 8 vs 6\)"),
    (lambda c, n: c.apply("frobnicate", f"{n}_a", out=f"{n}_c"), InvalidArgumentError, r"unknown op 'frobnicate'"),
    (lambda c, n: c.apply("sum", f"{n}_a", out=f"{n}_c", dims=[5]), InvalidArgumentError, r"dims"),
], ids=["sizes", "unknown-tensor", "output-letter", "axis-twice", "shapes", "unknown-op", "dims"])
def test_bad_requests_are_named_and_change_nothing(client, fresh_name, call, error, message):
    a, b = np.arange(48.0).reshape(8, 6), np.arange(24.0).reshape(6, 4)
    client.put(f"{fresh_name}_a", a, Sharding(MESH, ("x", None)))
    client.put(f"{fresh_name}_b", b, Sharding(MESH, (None, "y")))
    before = {t.name: (t.version, t.sharding) for t in client.tensors()}
    digests = client.digests(f"{fresh_name}_a")
    with pytest.raises(error, match=message):
        call(client, fresh_name)
    assert {t.name: (t.version, t.sharding) for t in client.tensors()} == before
    assert client.digests(f"{fresh_name}_a") == digests
    np.testing.assert_array_equal(client.get(f"{fresh_name}_a"), a)


def test_core_errors_are_value_errors():
    """The SDK raises the planner's refusal as InvalidArgumentError; the core's own error is a ValueError too."""
    assert issubclass(EinsumError, ValueError) and issubclass(InvalidArgumentError, ValueError)


@pytest.mark.parametrize("eq, spec, reduces", [
    ("ij->i", (None, "x"), 2),  # the summed dim split over x: all-reduced over x, one ring per y
    ("ij->", ("x", "y"), 1),  # a sum over every dim: one all-reduce over all four devices
    ("ij->ji", ("x", "y"), 0),  # a transpose: each device transposes its tile, nothing moves
], ids=["sum-over-a-split-dim", "sum-over-all", "transpose"])
def test_one_operand_einsums_equal_numpy_on_every_device(client, fresh_name, eq, spec, reduces):
    """Mesh-TensorFlow's and numpy's einsum of one operand: a sum over dims or a transpose, with the same reduce
    over the axes that split a summed dim as an einsum of two operands has."""
    a = np.random.default_rng(6).integers(-4, 5, (8, 6)).astype(np.float64)
    client.put(f"{fresh_name}_a", a, Sharding(MESH, spec))
    program = client.plan_einsum(eq, f"{fresh_name}_a", out=f"{fresh_name}_c")
    assert [s.kind for s in program.steps].count(REDUCE) == reduces and MOVE not in {s.kind for s in program.steps}
    client.einsum(eq, f"{fresh_name}_a", out=f"{fresh_name}_c").result(60)
    assert_every_device(client, f"{fresh_name}_c", np.einsum(eq, a), program.tensor(f"{fresh_name}_c").dst)
    with pytest.raises(InvalidArgumentError, match=r"einsum 'ii->i': input 0 \('ii'\) repeats letter\(s\) \['i'\]; a "
                                                   r"letter may name one dim of each input \(diagonals are not"):
        client.einsum("ii->i", f"{fresh_name}_a", out=f"{fresh_name}_d")


def test_a_megabyte_equation_is_refused_at_once_and_the_service_keeps_working(client, fresh_name):
    """An equation of 1 MiB (under the message limit) is refused by its length before any letter is checked: it once
    took the planner time quadratic in its length, past the client's deadline."""
    a, b = np.arange(48.0).reshape(8, 6), np.arange(24.0).reshape(6, 4)
    client.put(f"{fresh_name}_a", a, Sharding(MESH, ("x", None)))
    client.put(f"{fresh_name}_b", b, Sharding(MESH, (None, "y")))
    huge = "ij,jk->ik" + "k" * (2**20 - 9)
    message = (rf"einsum equation 'ij,jk->ikkkkkkkkkkkkkkkkkkkkkkkk'\.\.\. is {2**20} characters long, but an "
               rf"equation may be at most {MAX_EQUATION_CHARS} characters")
    names, out = (f"{fresh_name}_a", f"{fresh_name}_b"), f"{fresh_name}_c"
    for call in (lambda: client.einsum(huge, *names, out=out), lambda: client.plan_einsum(huge, *names, out=out),
                 lambda: client.compute_many([Op.einsum(huge, *names, out=out)])):
        start = time.monotonic()
        with pytest.raises(InvalidArgumentError, match=message):
            call()
        assert time.monotonic() - start < 2.0
    assert f"{fresh_name}_c" not in {t.name for t in client.tensors()}
    client.einsum("ij,jk->ik", f"{fresh_name}_a", f"{fresh_name}_b", out=f"{fresh_name}_c").result(60)
    np.testing.assert_array_equal(client.get(f"{fresh_name}_c"), a @ b)
