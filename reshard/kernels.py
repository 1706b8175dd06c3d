"""Compute kernels a program's compute steps may name, with their shape rules.

A kernel is known to the core by its name, how many input tiles it reads and
the rule that gives its output shape from the input shapes and its parameters.
The core checks programs with these rules; agents own the implementations.
Only ``copy`` exists so far; einsum and elementwise kernels join `KERNELS`
with their own rules (an einsum's rule parses its ``equation`` parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from reshard.errors import ReshardError

__all__ = ["Kernel", "KERNELS", "KernelShapeError"]

Shape = tuple[int, ...]


class KernelShapeError(ReshardError, ValueError):
    """Input shapes or parameters a kernel's shape rule does not accept; the message says why."""


@dataclass(frozen=True)
class Kernel:
    """A named compute kernel: ``num_inputs`` tiles in, one tile out, shaped by ``output_shape``."""

    name: str
    num_inputs: int
    output_shape: Callable[[tuple[Shape, ...], Mapping[str, str]], Shape]
    doc: str

    def __str__(self) -> str:
        return f"{self.name}/{self.num_inputs}"


def _copy_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    if params:
        raise KernelShapeError(f"copy takes no parameters; got {sorted(params)}")
    return inputs[0]


# Read-only, so no caller can add a kernel the agents do not implement.
KERNELS: Mapping[str, Kernel] = MappingProxyType({
    k.name: k
    for k in (
        Kernel("copy", 1, _copy_shape, "the output tile is a copy of the input tile; same shape"),
    )
})
