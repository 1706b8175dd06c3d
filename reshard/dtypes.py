"""Dtype names the service accepts, and their sizes in bytes.

Names follow numpy and torch (``float32``, ``bfloat16``, ``int64``, ``bool``).
"""

from __future__ import annotations

from reshard.errors import UnknownDtypeError

__all__ = ["DTYPE_SIZES", "dtype_name", "itemsize"]

DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def dtype_name(dtype) -> str:
    """Canonical name of a dtype given as a string, numpy dtype or torch dtype."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in DTYPE_SIZES:
        raise UnknownDtypeError(
            f"unknown dtype {dtype!r}; known dtypes are {sorted(DTYPE_SIZES)}"
        )
    return name


def itemsize(dtype) -> int:
    return DTYPE_SIZES[dtype_name(dtype)]
