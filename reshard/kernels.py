"""Compute kernels a program's compute steps may name, with their shape rules.

A kernel is known to the core by its name, how many input tiles it reads and
the rule that gives its output shape from the input shapes and its parameters.
The core checks programs with these rules; agents own the implementations
(``reshard.server.agent.kernels``). Parameters are strings, as a step carries
them. Shapes below are tile shapes: a kernel sees one device's tiles, never the
sharding; the planner lines tiles up before a kernel runs.

======================= ========== ============================== ============================================
kernel                  inputs     params                         output tile
======================= ========== ============================== ============================================
``copy``                x          none                           x
``einsum``              x0, x1...  ``equation`` (numpy notation,  numpy.einsum of the inputs; a letter names
                        (1 or      e.g. ``"bij,bjk->bik"``)       one dim of one size in every input; an
                        more)                                     empty summed dim sums to zeros
``add``                 a, b       none                           a + b (same shapes)
``sub``                 a, b       none                           a - b
``mul``                 a, b       none                           a * b
``scale``               x          ``factor``                     factor * x
``relu``                x          none                           max(x, 0)
``relu_grad``           x, g       none                           g where x > 0, else 0 (x: relu's input,
                                                                  g: the gradient of its output)
``axpy``                w, g       ``alpha``                      w - alpha * g (an SGD step: w - lr * g)
``sum``                 x          ``dims`` (``"0,2"``)           x summed over those dims, which are
                                                                  dropped; an empty tile sums to 0
``max``                 x          ``dims``                       the maximum over those dims, dropped; an
                                                                  empty tile gives -inf (the least integer
                                                                  for ints)
``softmax_xent``        logits, t  ``axis`` (default the last)    per-row loss -sum(t * log_softmax(logits))
                                                                  over ``axis`` (dropped); ``t`` holds
                                                                  target probabilities (one-hot labels),
                                                                  logits' shape
``softmax_xent_grad``   logits, t  ``axis``, ``scale`` (default   scale * (softmax(logits) - t): the gradient
                                   1)                             of the loss summed over rows, times
                                                                  ``scale`` (``1/batch`` for the mean);
                                                                  logits' shape
``fp8_quantize``        x (2-D)    ``block`` (default 128)        x / its block's scale, rounded to the nearest
                                                                  float8_e4m3fn (ties to even) and saturated
                                                                  at +-448; x's shape, dtype float8_e4m3fn
``fp8_scales``          x (2-D)    ``block`` (default 128)        each block's scale: the largest magnitude of
                                                                  its finite values / 448 (1 where that is 0);
                                                                  (ceil(m/block), ceil(n/block)), float32
``fp8_quantize_scaled`` x (2-D),   ``block`` (default 128)        fp8_quantize's output from the block scales
                        s                                         given (``s``: fp8_scales of x, same block),
                                                                  so a sender that makes both reads x's blocks
                                                                  once for their scales; s's shape must be
                                                                  fp8_scales' of x
======================= ========== ============================== ============================================

The fp8 kernels make the DeepSeek / Kimi serving format (``weight_scale_inv`` beside each weight: the weight is
the fp8 values times their block's scale). Blocks are ``block`` x ``block`` elements counted from the tile's
first element, the last ones along a dim smaller where ``block`` does not divide it; a tile that starts on a block
boundary of its tensor (every tile of a layout whose split dims are cut at multiples of ``block``) gets the blocks
of the whole tensor. They compute in float32 (bfloat16 is exact in it). Where the values are not all finite:
a NaN stays a NaN (0x7F, with its sign) and an infinity saturates to +-448 like any value too large, as CUDA's
saturating conversion (``__NV_SATFINITE``) does, and neither counts towards its block's scale, so one bad value
does not turn its block's other values into NaN or zero. A block with no finite value other than zero has scale 1
(its values are then zeros, NaNs and +-448), so a scale is always a positive finite number.

``sum`` and ``max`` over a dim the tile holds only part of give a partial
result; the planner completes it with a reduce step (op ``sum`` or ``max``).
The softmax kernels need the whole ``axis`` in every tile. An einsum equation
is at most ``MAX_EQUATION_CHARS`` characters (`parse_equation`).

Each kernel also counts its floating-point operations (``Kernel.flops``), which the
cost model prices with the device's rate: an einsum of two operands does a multiply
and an add for every combination of its letters (2 x the product of their sizes, as
a matmul's 2mnk), one of one operand an add per combination; more operands are
counted by contracting them pairwise left to right. Elementwise kernels count a few
operations per output element, reductions one per input element, the softmax
kernels about ten per logit (exp, log, the sums).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

from reshard.errors import ReshardError

__all__ = ["Kernel", "KERNELS", "KernelShapeError", "parse_equation", "letter_sizes", "float_param", "dims_param",
           "axis_param", "block_param", "MAX_EQUATION_CHARS", "FP8_BLOCK", "FP8_E4M3_MAX"]

Shape = tuple[int, ...]
# The longest einsum equation accepted. A real one is a few dozen characters (an operand names each of the 52 letters
# at most once); a cap keeps a megabyte of letters from tying up the planner and every agent that checks it.
MAX_EQUATION_CHARS = 512


class KernelShapeError(ReshardError, ValueError):
    """Input shapes or parameters a kernel's shape rule does not accept; the message says why."""


@dataclass(frozen=True)
class Kernel:
    """A named compute kernel: ``num_inputs`` tiles in (or more when ``variadic``), one tile out, shaped by
    ``output_shape``."""

    name: str
    num_inputs: int
    output_shape: Callable[[tuple[Shape, ...], Mapping[str, str]], Shape]
    doc: str
    variadic: bool = False
    # floating-point operations on tiles of these shapes: per output element, or a rule of its own
    flops_per_element: float = 1.0
    count_flops: Optional[Callable[[tuple[Shape, ...], Mapping[str, str]], float]] = None
    # the output's dtype when it is not the inputs' (a cast's)
    output_dtype: Optional[str] = None

    def flops(self, inputs: tuple[Shape, ...], params: Mapping[str, str]) -> float:
        """Floating-point operations one run on tiles shaped ``inputs`` does (see the module docstring)."""
        if self.count_flops is not None:
            return self.count_flops(inputs, params)
        return self.flops_per_element * math.prod(self.output_shape(inputs, params))

    def takes(self, num_inputs: int) -> bool:
        return num_inputs >= self.num_inputs if self.variadic else num_inputs == self.num_inputs

    @property
    def arity(self) -> str:
        return f"{self.num_inputs} or more" if self.variadic else str(self.num_inputs)

    def __str__(self) -> str:
        return f"{self.name}/{self.arity.replace(' or more', '+')}"


# -- parameters ---------------------------------------------------------------------------------------------


def _params(kernel: str, params: Mapping[str, str], required: tuple[str, ...] = (),
            optional: tuple[str, ...] = ()) -> None:
    """Refuse unknown and missing parameters, naming the ones the kernel takes."""
    allowed = (*required, *optional)
    stray = sorted(set(params) - set(allowed))
    if stray and not allowed:
        raise KernelShapeError(f"{kernel} takes no parameters; got {stray}")
    if stray:
        raise KernelShapeError(f"{kernel} takes parameters {list(allowed)}; got unknown {stray}")
    missing = [p for p in required if p not in params]
    if missing:
        raise KernelShapeError(f"{kernel} needs parameter(s) {missing}; got {sorted(params)}")


def float_param(kernel: str, params: Mapping[str, str], name: str, default: Optional[float] = None) -> float:
    """Parameter ``name`` as a finite float (``default`` when absent and a default exists)."""
    raw = params.get(name)
    if raw is None:
        assert default is not None, f"{kernel}: parameter {name} is required; _params checks that"
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise KernelShapeError(f"{kernel} parameter {name}={raw!r} is not a finite number such as '0.01'")
    return value


def dims_param(kernel: str, params: Mapping[str, str], ndim: int) -> tuple[int, ...]:
    """``dims`` as sorted distinct dim indices of a tile of ``ndim`` dims (negative ones count from the end)."""
    raw = params["dims"]
    try:
        dims = [int(d) for d in raw.split(",")]
    except ValueError:
        raise KernelShapeError(
            f"{kernel} parameter dims={raw!r} is not a comma-separated list of dim indices such as '0,2'"
        ) from None
    out = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise KernelShapeError(f"{kernel} over dims {raw!r}: dim {d} is not a dim of a {ndim}-dim tile "
                                   f"(0..{ndim - 1}, or -{ndim}..-1)")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise KernelShapeError(f"{kernel} over dims {raw!r} names a dim twice")
    return tuple(sorted(out))


def axis_param(kernel: str, params: Mapping[str, str], ndim: int) -> int:
    """``axis`` (default the last dim) as a dim index of a tile of ``ndim`` dims."""
    if ndim == 0:
        raise KernelShapeError(f"{kernel} needs tiles with at least one dim (the class dim); got a scalar")
    return dims_param(kernel, {"dims": params.get("axis", "-1")}, ndim)[0]


# -- einsum notation ----------------------------------------------------------------------------------------


def parse_equation(equation: str, error: type[ValueError] = KernelShapeError) -> tuple[tuple[str, ...], str]:
    """The operands' letters and the output's letters of a numpy einsum equation.

    Letters are ``a-z`` and ``A-Z``; spaces are ignored. Without ``->`` the output
    is numpy's implicit one: the letters that appear once, sorted. A letter may
    appear once per operand (no diagonals) and once in the output, and every
    output letter must appear in an operand. An equation is at most
    `MAX_EQUATION_CHARS` long. Raises ``error`` saying which rule the equation
    breaks; the checks take time linear in its length.
    """
    if not isinstance(equation, str):
        raise error(f"an einsum equation is a string such as 'ij,jk->ik'; got {type(equation).__name__}")
    if len(equation) > MAX_EQUATION_CHARS:
        raise error(f"einsum equation {equation[:32]!r}... is {len(equation)} characters long, but an equation may be "
                    f"at most {MAX_EQUATION_CHARS} characters (an operand names each of the 52 letters at most once, "
                    f"so a real one is far shorter); name each dim once per operand")
    eq = equation.replace(" ", "")
    if "..." in eq:
        raise error(f"einsum {equation!r}: ellipsis ('...') is not supported; name every dim with a letter")
    lhs, arrow, rhs = eq.partition("->")
    if "->" in rhs:
        raise error(f"einsum {equation!r} has more than one '->'; write inputs->output once")
    operands = tuple(lhs.split(","))
    for text in (*operands, rhs):
        bad = sorted({c for c in text if not (c.isascii() and c.isalpha())})
        if bad:
            raise error(f"einsum {equation!r}: {bad} are not dim letters; use a-z and A-Z, commas between "
                        f"inputs and one '->' before the output")
    for i, letters in enumerate(operands):
        twice = _repeated(letters)
        if twice:
            raise error(f"einsum {equation!r}: input {i} ({letters!r}) repeats letter(s) {twice}; a letter may name "
                        f"one dim of each input (diagonals are not supported)")
    seen = Counter("".join(operands))
    if not arrow:
        return operands, "".join(sorted(c for c, n in seen.items() if n == 1))
    twice = _repeated(rhs)
    if twice:
        raise error(f"einsum {equation!r}: the output ({rhs!r}) repeats letter(s) {twice}; each output dim needs its "
                    f"own letter")
    unknown = [c for c in rhs if c not in seen]
    if unknown:
        raise error(f"einsum {equation!r}: output letter(s) {unknown} appear in no input; every output dim must be "
                    f"a dim of some input")
    return operands, rhs


def _repeated(letters: str) -> list[str]:
    """The letters that appear more than once, sorted."""
    return sorted(c for c, n in Counter(letters).items() if n > 1)


def letter_sizes(equation: str, operands: tuple[str, ...], shapes: tuple[Shape, ...],
                 error: type[ValueError] = KernelShapeError, labels: Optional[Sequence[str]] = None) -> dict[str, int]:
    """Each letter's size, checked: one letter per dim of each shape, one size per letter. ``labels`` name the
    operands in messages (default ``input 0``, ``input 1``, ...)."""
    if len(shapes) != len(operands):
        raise error(f"einsum {equation!r} has {len(operands)} inputs but {len(shapes)} are given")
    labels = list(labels) if labels is not None else [f"input {i}" for i in range(len(shapes))]
    sizes: dict[str, tuple[int, int]] = {}
    for i, (letters, shape) in enumerate(zip(operands, shapes)):
        if len(letters) != len(shape):
            raise error(f"einsum {equation!r}: {labels[i]} has shape {tuple(shape)} ({len(shape)} dims) but its "
                        f"subscripts {letters!r} name {len(letters)}; give one letter per dim")
        for c, n in zip(letters, shape):
            first = sizes.setdefault(c, (n, i))
            if first[0] != n:
                j = first[1]
                raise error(f"einsum {equation!r}: dim letter {c!r} has size {first[0]} in {labels[j]} (shape "
                            f"{tuple(shapes[j])}) but {n} in {labels[i]} (shape {tuple(shape)}); a letter names one "
                            f"dim, of one size everywhere")
    return {c: n for c, (n, _) in sizes.items()}


# -- shape rules ----------------------------------------------------------------------------------------------


def _copy_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    _params("copy", params)
    return inputs[0]


def _einsum_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    _params("einsum", params, required=("equation",))
    operands, out = parse_equation(params["equation"])
    sizes = letter_sizes(params["equation"], operands, inputs)
    return tuple(sizes[c] for c in out)


def _same_shapes(name: str, inputs: tuple[Shape, ...], names: tuple[str, ...]) -> Shape:
    first = inputs[0]
    for n, shape in zip(names[1:], inputs[1:]):
        if tuple(shape) != tuple(first):
            raise KernelShapeError(f"{name}: {names[0]} has shape {tuple(first)} but {n} has shape {tuple(shape)}; "
                                   f"{name} works element by element on tiles of one shape")
    return tuple(first)


def _elementwise(name: str, names: tuple[str, ...], required: tuple[str, ...] = ()):
    def rule(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
        _params(name, params, required=required)
        for p in required:
            float_param(name, params, p)
        return _same_shapes(name, inputs, names)

    return rule


def _reduction(name: str):
    def rule(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
        _params(name, params, required=("dims",))
        dims = dims_param(name, params, len(inputs[0]))
        return tuple(n for d, n in enumerate(inputs[0]) if d not in dims)

    return rule


def _xent_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    _params("softmax_xent", params, optional=("axis",))
    shape = _same_shapes("softmax_xent", inputs, ("logits", "targets"))
    axis = axis_param("softmax_xent", params, len(shape))
    return shape[:axis] + shape[axis + 1:]


def _xent_grad_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    _params("softmax_xent_grad", params, optional=("axis", "scale"))
    shape = _same_shapes("softmax_xent_grad", inputs, ("logits", "targets"))
    axis_param("softmax_xent_grad", params, len(shape))
    float_param("softmax_xent_grad", params, "scale", 1.0)
    return shape


FP8_BLOCK = 128  # the DeepSeek / Kimi serving format's block: 128 x 128 elements share a scale
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MAX_FP8_BLOCK = 2**16


def block_param(kernel: str, params: Mapping[str, str]) -> int:
    """``block`` (default `FP8_BLOCK`) as a whole number of elements from 1 to `MAX_FP8_BLOCK`."""
    raw = params.get("block", str(FP8_BLOCK))
    try:
        block = int(raw)
    except ValueError:
        block = 0
    if not 1 <= block <= MAX_FP8_BLOCK:
        raise KernelShapeError(f"{kernel} parameter block={raw!r} is not a whole number of elements from 1 to "
                               f"{MAX_FP8_BLOCK}; the serving format's blocks are {FP8_BLOCK}")
    return block


def _fp8_tile(kernel: str, inputs: tuple[Shape, ...], params: Mapping[str, str]) -> tuple[Shape, int]:
    _params(kernel, params, optional=("block",))
    shape = tuple(inputs[0])
    if len(shape) != 2:
        raise KernelShapeError(f"{kernel} quantizes 2-D tiles in square blocks, as the serving format does its "
                               f"weight matrices; got a tile of shape {shape}. Leave 1-D tensors (norms, biases) "
                               f"unquantized, and quantize a stack of matrices one matrix at a time")
    return shape, block_param(kernel, params)


def _fp8_quantize_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    return _fp8_tile("fp8_quantize", inputs, params)[0]


def _fp8_scales_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    (m, n), block = _fp8_tile("fp8_scales", inputs, params)
    return (-(-m // block), -(-n // block))


def _fp8_quantize_scaled_shape(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> Shape:
    (m, n), block = _fp8_tile("fp8_quantize_scaled", inputs, params)
    want = (-(-m // block), -(-n // block))
    if tuple(inputs[1]) != want:
        raise KernelShapeError(f"fp8_quantize_scaled divides x {(m, n)} by one scale per {block} x {block} block, "
                               f"so its scales are {want} (fp8_scales of x); got {tuple(inputs[1])}")
    return m, n


def _einsum_flops(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> float:
    operands, out = parse_equation(params["equation"])
    sizes = letter_sizes(params["equation"], operands, inputs)
    if len(operands) == 1:
        return float(math.prod(sizes[c] for c in set(operands[0])))
    total, held = 0.0, set(operands[0])
    for i, letters in enumerate(operands[1:], 1):
        both = held | set(letters)
        total += 2.0 * math.prod(sizes[c] for c in both)
        later = set(out).union(*map(set, operands[i + 1:]))
        held = both & later  # what the pairwise product keeps: letters still needed
    return total


def _input_flops(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> float:
    return float(math.prod(inputs[0]))


def _xent_flops(inputs: tuple[Shape, ...], params: Mapping[str, str]) -> float:
    return 10.0 * math.prod(inputs[0])


# Read-only, so no caller can add a kernel the agents do not implement.
KERNELS: Mapping[str, Kernel] = MappingProxyType({
    k.name: k
    for k in (
        Kernel("copy", 1, _copy_shape, "the output tile is a copy of the input tile; same shape", flops_per_element=0),
        Kernel("einsum", 1, _einsum_shape, "numpy.einsum of the input tiles by the equation parameter",
               variadic=True, count_flops=_einsum_flops),
        Kernel("add", 2, _elementwise("add", ("a", "b")), "a + b"),
        Kernel("sub", 2, _elementwise("sub", ("a", "b")), "a - b"),
        Kernel("mul", 2, _elementwise("mul", ("a", "b")), "a * b"),
        Kernel("scale", 1, _elementwise("scale", ("x",), ("factor",)), "factor * x"),
        Kernel("relu", 1, _elementwise("relu", ("x",)), "max(x, 0)"),
        Kernel("relu_grad", 2, _elementwise("relu_grad", ("x", "g")), "g where x > 0, else 0"),
        Kernel("axpy", 2, _elementwise("axpy", ("w", "g"), ("alpha",)), "w - alpha * g", flops_per_element=2),
        Kernel("sum", 1, _reduction("sum"), "the sum over the dims parameter, which are dropped",
               count_flops=_input_flops),
        Kernel("max", 1, _reduction("max"), "the maximum over the dims parameter, which are dropped",
               count_flops=_input_flops),
        Kernel("softmax_xent", 2, _xent_shape, "per-row softmax cross-entropy of logits against target "
                                               "probabilities over axis, which is dropped", count_flops=_xent_flops),
        Kernel("softmax_xent_grad", 2, _xent_grad_shape, "scale * (softmax(logits) - targets) over axis",
               count_flops=_xent_flops),
        # per element: its magnitude and its block's maximum (the scale pass), then a division and a rounding
        Kernel("fp8_quantize", 1, _fp8_quantize_shape, "x / its block's scale as float8_e4m3fn, saturating",
               flops_per_element=4, output_dtype="float8_e4m3fn"),
        Kernel("fp8_scales", 1, _fp8_scales_shape, "per block, the largest finite magnitude / 448",
               count_flops=lambda inputs, params: 2.0 * math.prod(inputs[0]), output_dtype="float32"),
        # per element: a division and a rounding (the scales are an input)
        Kernel("fp8_quantize_scaled", 2, _fp8_quantize_scaled_shape,
               "x / its block's scale (the second input) as float8_e4m3fn, saturating", flops_per_element=2,
               output_dtype="float8_e4m3fn"),
    )
})
