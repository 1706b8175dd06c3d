"""Dtype names the service accepts, their sizes in bytes, how numpy holds them and which the kernels compute on.

Names follow numpy and torch (``float32``, ``bfloat16``, ``float8_e4m3fn``, ``int64``, ``bool``).
Every tensor is stored and moved as its bytes, so a dtype needs only a size to be
moved bit for bit. Four of them need a word more:

=============== ===== ==================== ===============================================
dtype           bytes numpy holds it as    the agents' kernels
=============== ===== ==================== ===============================================
bfloat16        2     ``uint16`` (bits)    compute in float32 and round to nearest even
float16         2     ``float16``          compute natively (numpy and torch have it)
float8_e4m3fn   1     ``uint8`` (bits)     none: stored and moved only
float8_e5m2     1     ``uint8`` (bits)     none: stored and moved only
=============== ===== ==================== ===============================================

numpy has no bfloat16 or float8, so numpy code (the agents' CPU buffers, the wire,
the SDK until it hands a tensor back) holds their elements as unsigned integers of
the same bits (`BITS_DTYPES`); torch has all four, and so do numpy arrays of the
``ml_dtypes`` package (JAX's), whose dtype names are these names.

`bfloat16_to_float32` and `float32_to_bfloat16` are the one pair of conversions that
numpy code computes bfloat16 through; they round as torch does. `check_computable`
refuses float8: the OCP formats torch and JAX share have no arithmetic on CPUs (torch
implements no ``add`` for them), and a quantised weight means little without its
scale, which a kernel would not see.
"""

from __future__ import annotations

import numpy as np

from reshard.errors import DtypeComputeError, UnknownDtypeError

__all__ = ["DTYPE_SIZES", "BITS_DTYPES", "STORE_ONLY_DTYPES", "dtype_name", "itemsize", "holder_name",
           "check_computable", "bfloat16_to_float32", "float32_to_bfloat16"]

DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

BITS_DTYPES: dict[str, str] = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}

STORE_ONLY_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")


def dtype_name(dtype) -> str:
    """Canonical name of a dtype given as a string, a numpy dtype or scalar type (ml_dtypes' too) or a torch dtype."""
    if isinstance(dtype, type):  # a scalar type such as np.float32 or ml_dtypes.bfloat16 prints as its class
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            pass
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in DTYPE_SIZES:
        hint = (f"; of the float8 formats reshard stores {list(STORE_ONLY_DTYPES)}, the OCP ones torch and JAX share"
                if "float8" in name else "")
        raise UnknownDtypeError(f"unknown dtype {dtype!r}; known dtypes are {sorted(DTYPE_SIZES)}{hint}")
    return name


def itemsize(dtype) -> int:
    return DTYPE_SIZES[dtype_name(dtype)]


def holder_name(dtype) -> str:
    """The numpy dtype name whose elements hold elements of ``dtype``: itself, or unsigned bits of its width."""
    name = dtype_name(dtype)
    return BITS_DTYPES.get(name, name)


def check_computable(dtype, what: str) -> None:
    """Raise `DtypeComputeError` when ``what`` (an op on tensors of ``dtype``) needs arithmetic the kernels lack."""
    name = dtype_name(dtype)
    if name in STORE_ONLY_DTYPES:
        raise DtypeComputeError(
            f"{what} computes on {name} elements, but reshard only stores and moves {name} tensors (as their "
            f"bytes), while the kernels compute on every other dtype (bfloat16 through float32). Convert "
            f"first: c.get the tensor, cast it in torch (t.to(torch.bfloat16), times its scale), put the result "
            f"under another name and compute on that"
        )


def bfloat16_to_float32(bits) -> np.ndarray:
    """bfloat16 elements held as ``uint16`` bits, as float32 values: exact, bfloat16 is float32's upper half."""
    bits = np.asarray(bits, dtype=np.uint16)
    out = np.empty(bits.shape, dtype=np.uint32)
    np.left_shift(bits, 16, out=out, dtype=np.uint32)  # one pass, no uint32 temporary (half the time)
    return out.view(np.float32)


def float32_to_bfloat16(values) -> np.ndarray:
    """``values`` rounded to the nearest bfloat16, ties to even (as torch and ml_dtypes), as ``uint16`` bits.

    A NaN keeps its sign and upper payload and sets the quiet bit, so it stays a NaN (torch's CPU kernels
    answer 0xFFFF for every NaN, ml_dtypes 0x7FC0 with the sign: no one pattern is the rule).
    """
    f = np.asarray(values, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), (bits >> 16).astype(np.uint16) | np.uint16(0x0040), rounded)
