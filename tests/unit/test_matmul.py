"""`einsum2`, the CPU agents' two-operand einsum as one batched matmul, against numpy.einsum."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.server.agent.matmul import einsum2

EQUATIONS = ["ij,jk->ik", "bij,bjk->bik", "i,j->ij", "ijk,jkl->il", "ij,jk->ki", "ij,ik->jk", "abc,cd->dba",
             "ij,j->i", "i,i->", "ij,kl->", "ij,k->ik", "bhk,bk->hb", "ab,ab->ab", "ab,ba->ab"]


@st.composite
def cases(draw):
    equation = draw(st.sampled_from(EQUATIONS))
    lhs = equation.split("->")[0].split(",")
    size = {c: draw(st.integers(0, 4)) for c in sorted(set("".join(lhs)))}
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    dtype = draw(st.sampled_from([np.float64, np.int64, np.float32]))
    a, b = (rng.integers(-5, 6, [size[c] for c in letters]).astype(dtype) for letters in lhs)
    return equation, a, b


@settings(max_examples=200, deadline=None)
@given(cases(), st.booleans(), st.booleans())
def test_einsum2_equals_numpy_einsum(case, into_out, strided_out):
    equation, a, b = case
    want = np.einsum(equation, a, b)
    if not into_out:
        got = einsum2(equation, a, b)
    else:
        base = np.full(want.shape + ((2,) if strided_out else ()), -7, want.dtype)
        out = base[..., 0] if strided_out else base
        got = einsum2(equation, a, b, out=out)
        assert got is out
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(got, want)


def test_einsum2_writes_a_matmul_into_the_output_without_a_copy():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    out = np.empty((2, 4))
    assert einsum2("ij,jk->ik", a, b, out=out) is out
    assert np.array_equal(out, a @ b)


@pytest.mark.parametrize("equation", ["ij,jk->ik", "bij,bjk->bik"])
def test_einsum2_of_empty_tiles_is_zeros(equation):
    lhs = equation.split("->")[0].split(",")
    shapes = [[0 if c == "j" else 3 for c in letters] for letters in lhs]
    want = np.einsum(equation, *(np.ones(s) for s in shapes))
    assert np.array_equal(einsum2(equation, *(np.ones(s) for s in shapes)), want)
