"""Dtypes numpy lacks (bfloat16, float8) and float16: names, the bits numpy holds, the bytes on the wire, compute rules.

The core part needs numpy only; the torch and ml_dtypes parts (the SDK's views of a
tensor's bits) skip where those are not installed, saying so.
"""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Mesh, Sharding, plan_apply, plan_einsum, reshard_program
from reshard.box import volume
from reshard.dtypes import (
    BITS_DTYPES,
    bfloat16_to_float32,
    check_computable,
    dtype_name,
    float32_to_bfloat16,
    holder_name,
    itemsize,
)
from reshard.errors import DtypeComputeError, UnknownDtypeError
from reshard.program import TensorDecl
from reshard.proto.layout import Checksum, chunk_boxes, digest, np_dtype

# name, bytes, what numpy holds it as
TABLE = [
    ("bfloat16", 2, "uint16"),
    ("float16", 2, "float16"),
    ("float8_e4m3fn", 1, "uint8"),
    ("float8_e5m2", 1, "uint8"),
    ("uint8", 1, "uint8"),
    ("float32", 4, "float32"),
]
FP8 = ("float8_e4m3fn", "float8_e5m2")
NEW = ("bfloat16", "float16", *FP8)


@pytest.mark.parametrize("name,size,holder", TABLE)
def test_names_sizes_and_the_numpy_dtype_that_holds_them(name, size, holder):
    assert dtype_name(name) == name and itemsize(name) == size
    assert holder_name(name) == holder and np_dtype(name) == np.dtype(holder)
    assert np_dtype(name).itemsize == size
    assert (name in BITS_DTYPES) == (holder != name)


def test_numpy_dtypes_and_scalar_types_name_their_dtype():
    assert dtype_name(np.dtype("float16")) == "float16"
    assert dtype_name(np.float32) == "float32"
    assert dtype_name(np.uint8) == "uint8"  # the bits of float8, but a uint8 array is stored as integers


def test_an_unsupported_float8_format_is_refused_naming_the_ones_reshard_stores():
    with pytest.raises(UnknownDtypeError, match=r"unknown dtype 'float8_e4m3fnuz'; known dtypes are \[.*\]; of the "
                                                r"float8 formats reshard stores \['float8_e4m3fn', 'float8_e5m2'\], "
                                                r"the OCP ones torch and JAX share"):
        dtype_name("float8_e4m3fnuz")
    with pytest.raises(UnknownDtypeError, match=r"unknown dtype 'int4'; known dtypes are \[.*'float8_e5m2'.*\]$"):
        dtype_name("int4")


@pytest.mark.parametrize("name", FP8)
def test_float8_is_stored_and_moved_but_not_computed(name):
    with pytest.raises(DtypeComputeError, match=rf"add of 'w' computes on {name} elements, but reshard only stores "
                                                rf"and moves {name} tensors \(as their bytes\), while the kernels "
                                                rf"compute on every other dtype \(bfloat16 through float32\)\. Convert "
                                                rf"first: c.get the tensor, cast it in torch"):
        check_computable(name, "add of 'w'")
    assert isinstance(DtypeComputeError("x"), ValueError)  # the service answers INVALID_ARGUMENT


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "int64", "complex64"])
def test_the_other_dtypes_are_computed(name):
    check_computable(name, "einsum")


def test_bfloat16_widens_exactly_for_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint16)
    wide = bfloat16_to_float32(bits)
    assert wide.dtype == np.float32 and np.array_equal(wide.view(np.uint32) >> 16, bits)
    assert np.array_equal(float32_to_bfloat16(wide[~np.isnan(wide)]), bits[~np.isnan(wide)])  # and back


def test_float32_rounds_to_the_nearest_bfloat16_ties_to_even():
    cases = {
        0x3F808000: 0x3F80,  # a tie below an even mantissa stays
        0x3F818000: 0x3F82,  # a tie below an odd one goes up
        0x3F808001: 0x3F81,  # past the tie goes up
        0x7F7FFFFF: 0x7F80,  # the largest float32 rounds to inf
        0xFF800000: 0xFF80,  # -inf stays
        0x80000001: 0x8000,  # the smallest negative subnormal rounds to -0
    }
    got = float32_to_bfloat16(np.array(list(cases), np.uint32).view(np.float32))
    assert [hex(b) for b in got] == [hex(b) for b in cases.values()]
    nans = float32_to_bfloat16(np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001], np.uint32).view(np.float32))
    assert np.isnan(bfloat16_to_float32(nans)).all() and list(nans >> 15) == [0, 1, 0]  # the sign stays


def test_float32_rounds_to_bfloat16_as_torch_does():
    torch = pytest.importorskip("torch")
    values = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = float32_to_bfloat16(values)
    numbers = ~np.isnan(values)
    assert np.array_equal(got[numbers], want[numbers])


@pytest.mark.parametrize("name", FP8)
def test_one_byte_elements_cut_into_chunks_and_digest_as_their_bytes(name):
    box = ((0, 5), (3, 10))
    subs = list(chunk_boxes(box, name, 16))
    assert all(volume(s) <= 16 for s in subs) and sum(volume(s) for s in subs) == volume(box)
    tile = np.random.default_rng(1).integers(0, 256, (5, 7), dtype=np.uint8).view(np_dtype(name))
    check = Checksum()
    for (r0, r1), (c0, c1) in subs:
        check.update(np.ascontiguousarray(tile[r0:r1, c0 - 3:c1 - 3]))
    assert check.nbytes == 35 and check.xxh3_64 == digest(tile.tobytes())


# -- the planner's rule on compute requests ------------------------------------------------------------------------

_MESH = Mesh.from_hosts({"x": 2}, ["a", "b"], 1)


def _fp8(name: str) -> TensorDecl:
    return TensorDecl(name, (4, 4), "float8_e4m3fn", src=Sharding(_MESH, ("x", None)))


@pytest.mark.parametrize("op", ["einsum", "apply", "partial"])
def test_the_planner_refuses_to_compute_on_float8(op):
    with pytest.raises(DtypeComputeError, match=r"computes on float8_e4m3fn elements, .* Convert first"):
        if op == "einsum":
            plan_einsum("ij,jk->ik", [_fp8("a"), _fp8("b")], "c")
        elif op == "apply":
            plan_apply("add", [_fp8("a"), _fp8("b")], "c")
        else:
            reshard_program((4, 4), "float8_e4m3fn", Sharding(_MESH, (), ("x",)), Sharding(_MESH, ("x", None)))


# -- torch and ml_dtypes: what the SDK and the agents hand each other ----------------------------------------------

@pytest.mark.parametrize("name", NEW)
def test_a_torch_tensor_is_viewed_as_its_bits_and_back(name):
    torch = pytest.importorskip("torch")
    from reshard.proto import devices

    t = (torch.randn(6, 5) * 8).to(getattr(torch, name))
    host = devices.numpy_view(t)
    assert host.dtype == np_dtype(name) and host.shape == (6, 5)
    assert host.tobytes() == t.view(torch.uint8).numpy().tobytes()
    assert np.shares_memory(host, devices.numpy_view(t))  # a view, not a copy
    back = devices.to_torch(host, name)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    strided = t.t()  # to_host makes C order before the bytes go out
    assert devices.to_host(strided).tobytes() == strided.contiguous().view(torch.uint8).numpy().tobytes()
    assert devices.device_digest(t) == devices.device_digest(torch.from_numpy(host))
    assert devices.torch_dtype(name) == t.dtype


def test_a_torch_dtype_names_itself():
    torch = pytest.importorskip("torch")
    for name in NEW:
        assert dtype_name(getattr(torch, name)) == name
    with pytest.raises(UnknownDtypeError, match=r"unknown dtype torch.float8_e4m3fnuz; .*float8 formats reshard"):
        dtype_name(torch.float8_e4m3fnuz)


@pytest.mark.parametrize("name", ["bfloat16", *FP8])
def test_an_ml_dtypes_array_names_its_dtype_and_holds_the_bits_torch_does(name):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes comes with jax; reshard does not depend on it")
    torch = pytest.importorskip("torch")
    from reshard.proto import devices

    values = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    a = values.astype(getattr(ml_dtypes, name))
    assert dtype_name(a.dtype) == name and dtype_name(getattr(ml_dtypes, name)) == name
    t = devices.to_torch(a, name)
    assert t.dtype == getattr(torch, name)
    assert torch.equal(t.view(torch.uint8), torch.from_numpy(values).to(t.dtype).view(torch.uint8))
