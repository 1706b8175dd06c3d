"""The CPU agent's elementwise kernels written straight into the output tile give the bits the plain path gives.

`kernels._INTO` computes add, sub, mul, scale, relu, relu_grad and axpy into the output tile instead of making a
result array and copying it over; relu_grad masks bits instead of calling ``np.where``. Both must agree with
`kernels._MATH` (and relu_grad with ``np.where``) bit for bit, signed zeros, NaN and infinities included.
"""

from __future__ import annotations

import numpy as np
import pytest

from reshard.server.agent.kernels import _INTO, _MATH, KERNELS, _Numpy

OPS = [("add", {}), ("sub", {}), ("mul", {}), ("scale", {"factor": 0.3}), ("relu", {}), ("relu_grad", {}),
       ("axpy", {"alpha": 0.1})]


def _operands(dtype) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((48, 33)) * 4).astype(dtype)
    b = (rng.standard_normal((48, 33)) * 4).astype(dtype)
    if np.dtype(dtype).kind == "f":
        a[0, :6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0]
        b[0, :6] = [np.nan, -0.0, -1.0, np.inf, 2.0, -0.0]
    return a, b


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(f"i{x.dtype.itemsize}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf and NaN on purpose
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32])
@pytest.mark.parametrize("op, params", OPS)
def test_into_gives_the_plain_paths_bits(op, params, dtype):
    a, b = _operands(dtype)
    xs = [a] if op in ("relu", "scale") else [a, b]
    want = np.asarray(_MATH[op](_Numpy, xs, params)).astype(dtype)
    out = np.full_like(a, 9)
    KERNELS[op](xs, out, params)
    assert np.array_equal(_bits(out), _bits(want))
    wide = np.full((a.shape[0], 2 * a.shape[1]), 9, dtype)  # a strided output tile: a view into a wider buffer
    KERNELS[op](xs, wide[:, ::2], params)
    assert np.array_equal(_bits(wide[:, ::2]), _bits(want))
    assert (wide[:, 1::2] == 9).all()  # nothing written beside the tile


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_relu_grad_is_np_where_bit_for_bit(dtype):
    x, g = _operands(dtype)
    want = np.where(x > 0, g, np.zeros((), g.dtype))
    assert np.array_equal(_bits(_Numpy.relu_grad(x, g)), _bits(want))
    assert not np.signbit(_Numpy.relu_grad(x, g)[x <= 0]).any()  # +0, never -0, where x <= 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_into_is_used_only_where_it_cannot_change_the_result():
    a, b = _operands(np.float32)
    out = np.zeros_like(a)
    assert set(_INTO) <= set(_MATH)
    # an input that overlaps the output is read whole before the output is written: the plain path
    KERNELS["add"]([out, b], out, {})
    assert np.array_equal(_bits(out), _bits(np.zeros_like(b) + b))
    # broadcasting and mixed dtypes go the plain path too, and still give numpy's result
    row = np.ones((1, a.shape[1]), np.float32)
    KERNELS["add"]([a, row], out, {})
    assert np.array_equal(_bits(out), _bits(a + row))
    KERNELS["mul"]([a, b.astype(np.float64)], out, {})
    assert np.array_equal(_bits(out), _bits((a * b.astype(np.float64)).astype(np.float32)))
