"""Several einsum and kernel ops as ONE job (``c.compute_many``): real planner and agent processes, every transport.

A layer's forward (einsum, relu, the loss) and its backward run as one job each and must equal numpy; every
output commits together (new tensors at version 1, a replaced one at its next version); an op that reads an
earlier op's output reads that result, in place or through a copy when it has to move it; a sequence that cannot
run is refused at once, naming the op, and changes nothing stored.
"""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Mesh, Op, Sharding
from reshard.proto.errors import InvalidArgumentError, NotFoundError

from .every_device import assert_every_device

MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2)
ACROSS = Mesh.from_hosts({"x": 4}, ["host0", "host1", "host2", "host3"], 1)
ROWS = Sharding(MESH, ("x", None))


def _ints(rng, shape) -> np.ndarray:
    return rng.integers(-3, 4, shape).astype(np.float64)


def test_a_layer_forward_then_backward_as_two_jobs_equal_numpy(client, fresh_name):
    n, rng = fresh_name, np.random.default_rng(0)
    x, w, dy = _ints(rng, (8, 6)), _ints(rng, (6, 4)), _ints(rng, (8, 4))
    client.put(f"{n}.x", x, ROWS)
    client.put(f"{n}.w", w, Sharding(MESH, (None, "y")))
    client.put(f"{n}.dy", dy, Sharding(ACROSS, ("x", None)))  # arrives in another layout: moved inside the job
    forward = [Op.einsum("bi,io->bo", f"{n}.x", f"{n}.w", out=f"{n}.z", out_sharding=ROWS),
               Op.apply("relu", f"{n}.z", out=f"{n}.h")]
    result = client.compute_many(forward).result(timeout=60)
    assert result.state == "succeeded"
    z = x @ w
    assert_every_device(client, f"{n}.z", z, ROWS)  # ROWS: each row tile on two devices
    assert_every_device(client, f"{n}.h", np.maximum(z, 0))
    backward = [Op.apply("relu_grad", f"{n}.z", f"{n}.dy", out=f"{n}.dz"),
                Op.einsum("bi,bo->io", f"{n}.x", f"{n}.dz", out=f"{n}.gw"),
                Op.einsum("bo,io->bi", f"{n}.dz", f"{n}.w", out=f"{n}.dx", out_sharding=ROWS),
                Op.apply("axpy", f"{n}.w", f"{n}.gw", out=f"{n}.w", alpha=0.5)]
    client.compute_many(backward).result(timeout=60)
    dz = np.where(z > 0, dy, 0.0)
    assert_every_device(client, f"{n}.dz", dz)
    assert_every_device(client, f"{n}.gw", x.T @ dz)
    assert_every_device(client, f"{n}.dx", dz @ w.T, ROWS)  # read w as it was before the axpy replaced it
    assert_every_device(client, f"{n}.w", w - 0.5 * (x.T @ dz))
    versions = {t.name: t.version for t in client.tensors() if t.name.startswith(f"{n}.")}
    assert versions == {f"{n}.{k}": 1 for k in ("x", "dy", "z", "h", "dz", "gw", "dx")} | {f"{n}.w": 2}


def test_a_later_op_that_moves_an_earlier_output_reads_a_copy(client, fresh_name):
    n, rng = fresh_name, np.random.default_rng(1)
    cols = Sharding(ACROSS, (None, "x"))
    x, w, q = _ints(rng, (8, 6)), _ints(rng, (6, 8)), _ints(rng, (8, 8))
    client.put(f"{n}.x", x, ROWS)
    client.put(f"{n}.w", w, Sharding(MESH, (None, None)))
    client.put(f"{n}.q", q, cols)
    ops = [Op.einsum("bi,io->bo", f"{n}.x", f"{n}.w", out=f"{n}.z", out_sharding=ROWS),
           Op.apply("add", f"{n}.z", f"{n}.q", out=f"{n}.y", out_sharding=cols)]
    program = client.plan_compute_many(ops)
    assert any(s.kind == "compute" and s.kernel == "copy" and s.inputs[0].tensor == f"{n}.z" for s in program.steps)
    assert not [t for t in client.tensors() if t.name == f"{n}.z"]  # a dry run commits nothing
    client.compute_many(ops).result(timeout=60)
    assert_every_device(client, f"{n}.z", x @ w, ROWS)
    assert_every_device(client, f"{n}.y", x @ w + q, cols)


@pytest.mark.parametrize("ops, error, message", [
    (lambda n: [Op.apply("relu", f"{n}.missing", out=f"{n}.a")], NotFoundError, r"no tensor named '.*\.missing'"),
    (lambda n: [Op.apply("relu", f"{n}.x", out=f"{n}.a"), Op.apply("relu", f"{n}.a", out=f"{n}.a")],
     InvalidArgumentError, r"op 1 .* writes '.*\.a', which op 0 already writes"),
    (lambda n: [Op.apply("relu", f"{n}.x", out=f"{n}.a"), Op.einsum("ij,jk->iz", f"{n}.a", f"{n}.w", out=f"{n}.b")],
     InvalidArgumentError, r"op 1 .*output letter\(s\) \['z'\] appear in no input"),
    (lambda n: [Op.apply("relu", f"{n}.x", out=f"{n}.x"), Op.apply("add", f"{n}.x", f"{n}.w", out=f"{n}.b")],
     InvalidArgumentError, r"op 1 .*add: input '.*\.x' has shape \(8, 6\) but '.*\.w' has shape \(6, 4\)"),
    (lambda n: [], InvalidArgumentError, "at least one op"),
], ids=["unknown-tensor", "written-twice", "output-letter", "shapes", "empty"])
def test_a_sequence_that_cannot_run_is_refused_and_changes_nothing(client, fresh_name, ops, error, message):
    n, rng = fresh_name, np.random.default_rng(2)
    x = _ints(rng, (8, 6))
    client.put(f"{n}.x", x, ROWS)
    client.put(f"{n}.w", _ints(rng, (6, 4)), Sharding(MESH, (None, "y")))
    before = {t.name: (t.version, t.sharding) for t in client.tensors()}
    with pytest.raises(error, match=message):
        client.compute_many(ops(n))
    assert {t.name: (t.version, t.sharding) for t in client.tensors()} == before
    np.testing.assert_array_equal(client.get(f"{n}.x"), x)


def test_compute_many_takes_ops_only(client):
    with pytest.raises(InvalidArgumentError, match="takes a list of reshard.Op"):
        client.compute_many([("relu", "x")])
