"""The agent-side implementations of the compute kernels: what a ``compute`` step runs on this host's tiles.

The core's ``reshard.kernels`` holds the same kernels' shape rules, parameters and flop counts, for the same names;
a program's steps were checked against them when it was validated, so this module only computes.

The math of every kernel is written once, over a backend: numpy on CPU agents, torch on the GPU of a CUDA agent
(the output buffer says which). numpy holds bfloat16 as uint16 bits (`buffers`), so a CPU agent computes on
those tiles in float32 and rounds back. Integer einsums run in numpy wherever the tiles live: CUDA has no
integer matmul.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.kernels import FP8_E4M3_MAX, axis_param, block_param, dims_param, float_param
from reshard.server.agent.matmul import einsum2
from reshard.server.common.torch_support import torch_installed
from reshard.server.transport import buffers

__all__ = ["KERNELS"]


class _Numpy:
    @staticmethod
    def operand(x):
        x = _host(x)
        if x.dtype == np.uint16:  # bfloat16 bits: the high half of a float32
            return bfloat16_to_float32(x)
        return x

    @staticmethod
    def result(values, output):
        values = np.asarray(values)
        if output.dtype == np.uint16 and values.dtype != np.uint16:  # round to nearest even bfloat16
            return float32_to_bfloat16(values)
        return values

    @staticmethod
    def einsum(eq, *xs):
        return einsum2(eq, *xs) if len(xs) == 2 else np.einsum(eq, *xs, optimize=True)  # BLAS for contractions
    relu = staticmethod(lambda x: np.maximum(x, np.zeros((), x.dtype)))

    @staticmethod
    def relu_grad(x, g, out=None):
        """``g`` where ``x > 0``, else +0, bit for bit as ``np.where`` gives it in about a quarter of its time
        (``np.where`` on a mask takes a slow path): ``g``'s bits ANDed with all ones where ``x > 0``, all
        zeros (+0.0) elsewhere. Into ``out`` when given (``g``'s shape and dtype)."""
        if x.shape != g.shape or g.dtype.kind != "f":
            values = np.where(x > 0, g, np.zeros((), g.dtype))
            if out is None:
                return values
            out[...] = values
            return out
        out = np.empty_like(g) if out is None else out
        mask = out.view(f"i{g.dtype.itemsize}")  # 1 where x > 0, then -1 (all ones), then g's bits or none
        np.greater(x, 0, out=mask, casting="unsafe")
        np.negative(mask, out=mask)
        np.bitwise_and(g.view(mask.dtype), mask, out=mask)
        return out
    exp = staticmethod(np.exp)
    log = staticmethod(np.log)

    @staticmethod
    def sum(x, dims, keep=False):
        return np.sum(x, axis=dims, keepdims=keep)

    @staticmethod
    def max(x, dims, keep=False):
        info = np.finfo if np.issubdtype(x.dtype, np.floating) else np.iinfo
        least = -np.inf if info is np.finfo else (False if x.dtype == bool else info(x.dtype).min)
        return np.max(x, axis=dims, keepdims=keep, initial=least)


class _Torch:
    @staticmethod
    def operand(x, device):
        if buffers.is_torch(x):
            return x.to(device)
        x = np.asarray(x)
        return buffers.to_device(x, "bfloat16" if x.dtype == np.uint16 else x.dtype.name, str(device))

    @staticmethod
    def result(values, output):
        return values

    @staticmethod
    def einsum(eq, *xs):
        import torch

        if not all(x.is_floating_point() or x.is_complex() for x in xs):  # no integer matmul on CUDA
            values = np.einsum(eq, *(buffers.host_array(x) for x in xs), optimize=True)
            return torch.from_numpy(np.ascontiguousarray(values)).to(xs[0].device)
        return torch.einsum(eq, *xs)

    @staticmethod
    def relu(x):
        import torch

        return torch.clamp_min(x, 0)

    @staticmethod
    def relu_grad(x, g):
        import torch

        return torch.where(x > 0, g, torch.zeros((), dtype=g.dtype, device=g.device))

    exp = staticmethod(lambda x: x.exp())
    log = staticmethod(lambda x: x.log())

    @staticmethod
    def sum(x, dims, keep=False):
        return x.sum(dim=dims, keepdim=keep)

    @staticmethod
    def max(x, dims, keep=False):
        import torch

        if x.numel() == 0 or any(x.shape[d] == 0 for d in dims):
            shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape)) if keep else \
                tuple(n for d, n in enumerate(x.shape) if d not in dims)
            least = float("-inf") if x.is_floating_point() else (False if x.dtype == torch.bool
                                                                 else torch.iinfo(x.dtype).min)
            return torch.full(shape, least, dtype=x.dtype, device=x.device)
        return x.amax(dim=dims, keepdim=keep)


def _log_softmax(xp, logits, axis: int):
    top = xp.max(logits, (axis,), keep=True)
    shifted = logits - top
    return shifted - xp.log(xp.sum(xp.exp(shifted), (axis,), keep=True))


def _xent(xp, xs, params):
    logits, targets = xs
    axis = axis_param("softmax_xent", params, logits.ndim)
    return -xp.sum(targets * _log_softmax(xp, logits, axis), (axis,))


def _xent_grad(xp, xs, params):
    logits, targets = xs
    axis = axis_param("softmax_xent_grad", params, logits.ndim)
    scale = float_param("softmax_xent_grad", params, "scale", 1.0)
    return (xp.exp(_log_softmax(xp, logits, axis)) - targets) * scale


# name -> fn(backend, input tiles as the backend's arrays, params) -> the output tile's values
_MATH: dict[str, Callable[[Any, list, dict], Any]] = {
    "einsum": lambda xp, xs, p: xp.einsum(p["equation"].replace(" ", ""), *xs),
    "add": lambda xp, xs, p: xs[0] + xs[1],
    "sub": lambda xp, xs, p: xs[0] - xs[1],
    "mul": lambda xp, xs, p: xs[0] * xs[1],
    "scale": lambda xp, xs, p: xs[0] * float_param("scale", p, "factor"),
    "relu": lambda xp, xs, p: xp.relu(xs[0]),
    "relu_grad": lambda xp, xs, p: xp.relu_grad(xs[0], xs[1]),
    "axpy": lambda xp, xs, p: xs[0] - float_param("axpy", p, "alpha") * xs[1],
    "sum": lambda xp, xs, p: xp.sum(xs[0], dims_param("sum", p, xs[0].ndim)),
    "max": lambda xp, xs, p: xp.max(xs[0], dims_param("max", p, xs[0].ndim)),
    "softmax_xent": _xent,
    "softmax_xent_grad": _xent_grad,
}


# name -> fn(input arrays, params, out): the elementwise kernels written straight into a host output tile,
# as `_MATH` computes them (the same operations in the same order, so the same bits). A result array made
# and then copied into the tile costs a page fault per 4 KiB and a copy: for a pipeline stage's relu
# and gradient sums, more than the arithmetic.
_INTO: dict[str, Callable[[list, dict, np.ndarray], Any]] = {
    "add": lambda xs, p, out: np.add(xs[0], xs[1], out=out),
    "sub": lambda xs, p, out: np.subtract(xs[0], xs[1], out=out),
    "mul": lambda xs, p, out: np.multiply(xs[0], xs[1], out=out),
    "scale": lambda xs, p, out: np.multiply(xs[0], float_param("scale", p, "factor"), out=out),
    "relu": lambda xs, p, out: np.maximum(xs[0], np.zeros((), out.dtype), out=out),
    "relu_grad": lambda xs, p, out: _Numpy.relu_grad(xs[0], xs[1], out=out),
    "axpy": lambda xs, p, out: np.subtract(xs[0], float_param("axpy", p, "alpha") * xs[1], out=out),
}


def _writes_into(inputs: list, output) -> bool:
    """Whether an elementwise kernel may write into ``output`` itself: a writable host tile of a float dtype
    (integers take a float factor through float64; bfloat16 is stored as integer bits), and inputs of its
    shape and dtype that do not overlap it."""
    if buffers.is_torch(output) or output.dtype.kind != "f" or not output.flags.writeable:
        return False
    return all(isinstance(x, np.ndarray) and x.shape == output.shape and x.dtype == output.dtype
               and not np.may_share_memory(x, output) for x in inputs)


def _kernel(math: Callable[[Any, list, dict], Any], into=None) -> Callable[[list, Any, dict], None]:
    def run(inputs: list, output, params: dict) -> None:
        if into is not None and _writes_into(inputs, output):
            into(inputs, params, output)
            return
        whole = tuple((0, n) for n in output.shape)
        if buffers.is_torch(output):
            xs = [_Torch.operand(x, output.device) for x in inputs]
            values = math(_Torch, xs, params)
        else:
            values = _Numpy.result(math(_Numpy, [_Numpy.operand(x) for x in inputs], params), output)
        buffers.write(output, whole, whole, values)

    return run


def _einsum(inputs: list, output, params: dict) -> None:
    """``einsum``, written straight into the output tile where numpy can (a matmul's ``out``): no result array
    to allocate and copy over, which on fresh memory costs as much as a mid-size matmul."""
    if (len(inputs) == 2 and not buffers.is_torch(output) and output.dtype != np.uint16 and output.flags.writeable
            and all(not buffers.is_torch(x) and np.asarray(x).dtype == output.dtype for x in inputs)):
        einsum2(params["equation"], *inputs, out=output)
        return
    _kernel(_MATH["einsum"])(inputs, output, params)


def _copy(inputs: list, output, params: dict) -> None:
    whole = tuple((0, n) for n in output.shape)
    buffers.write(output, whole, whole, inputs[0])  # bytes as they are, whatever the dtype


# -- the fp8 cast of the serving format (the rules, zeros and non-finite values: `reshard.kernels`) ----------------


def _host(x) -> np.ndarray:
    """A tile as a numpy array on the host: a CPU torch tensor's memory, or the array itself."""
    return buffers.host_array(x) if buffers.is_torch(x) else np.asarray(x)


def _float32(x) -> np.ndarray:
    """A host tile's values as float32: bfloat16 bits widened exactly, any other dtype converted."""
    x = _host(x)
    return bfloat16_to_float32(x) if x.dtype == np.uint16 else x.astype(np.float32, copy=False)


def _blocks_of(scales: np.ndarray, block: int, shape: tuple[int, int]) -> np.ndarray:
    """Each element's block scale: ``scales`` repeated over its blocks, cut to ``shape``."""
    return np.repeat(np.repeat(scales, block, axis=0)[:shape[0]], block, axis=1)[:, :shape[1]]


def _block_max(mag: np.ndarray, block: int) -> np.ndarray:
    """Per ``block`` x ``block`` block of a matrix of non-negative values (magnitudes, or their bits), the largest;
    the last blocks along a dim may be short. Rows first, each group of ``block`` rows reduced to one by a reduce
    along an axis of contiguous rows (vectorised, where a 4-D reshape's max over two axes walks strides), then the
    columns of what is left, a ``block``-th of the bytes."""
    return _groups_max(_groups_max(mag, block, 0), block, 1)


def _groups_max(a: np.ndarray, block: int, axis: int) -> np.ndarray:
    """The largest of each group of ``block`` consecutive rows (``axis`` 0) or columns (1) of a matrix; the last
    group may be short."""
    size, other = a.shape[axis], a.shape[1 - axis]
    full = size // block
    parts = []
    if axis == 0:
        if full:
            parts.append(a[:full * block].reshape(full, block, other).max(axis=1))
        if size % block or not size:
            parts.append(a[full * block:].max(axis=0, keepdims=True, initial=a.dtype.type(0)))
    else:
        if full:
            parts.append(a[:, :full * block].reshape(other, full, block).max(axis=2))
        if size % block or not size:
            parts.append(a[:, full * block:].max(axis=1, keepdims=True, initial=a.dtype.type(0)))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def _scales_of(amax: np.ndarray) -> np.ndarray:
    """Block scales from each block's largest finite magnitude (float32): it / 448, or 1 where that is 0 (a block of
    zeros, or one whose scale underflows, divides by 1)."""
    scales = amax / np.float32(FP8_E4M3_MAX)
    scales[scales == 0] = 1
    return scales


def fp8_block_scales(x32: np.ndarray, block: int) -> np.ndarray:
    """Per ``block`` x ``block`` block of a float32 matrix, the largest finite magnitude / 448, or 1 where that
    is 0, as float32."""
    mag = np.abs(x32)
    mag[~np.isfinite(mag)] = 0  # a NaN or an infinity does not set its block's scale
    return _scales_of(_block_max(mag, block))


def bf16_block_scales(bits: np.ndarray, block: int) -> np.ndarray:
    """`fp8_block_scales` of a matrix of bfloat16 bits (uint16), read as its bits: the same float32 scales.

    A finite bfloat16 magnitude orders as its 15 low bits do, and those bits widened (shifted 16 places up) are its
    float32, so a block's largest finite magnitude is its largest magnitude bits under 0x7F80 (infinities and NaNs
    lie at and above), widened once per block. Why: the float32 path widens the tile, then takes its magnitudes and
    their finiteness in two more passes, over twice the bytes; this reads the tile once, and a sender that quantizes
    on the way runs it on every weight it serves as fp8. A band of blocks' rows at a time (about `_BAND_BYTES` / 2
    of magnitude bits, one buffer reused, so no fresh memory and no pass reads back from DRAM), and the masking of
    non-finite values only in a band that holds one: about a third of the time the whole tile at once took
    (``bench/fp8_kernels.py`` prints both routes)."""
    m, n = bits.shape
    amax = np.zeros((-(-m // block), -(-n // block)), dtype=np.uint16)
    if bits.size:
        rows = _band_rows(n, block)
        buf = np.empty((min(rows, m), n), dtype=np.uint16)
        for top in range(0, m, rows):
            mag = buf[:min(rows, m - top)]
            np.bitwise_and(bits[top:top + len(mag)], np.uint16(0x7FFF), out=mag)
            part = _block_max(mag, block)
            if part.max() >= 0x7F80:  # a NaN or an infinity does not set its block's scale
                mag[mag >= np.uint16(0x7F80)] = 0
                part = _block_max(mag, block)
            amax[top // block:top // block + len(part)] = part
    return _scales_of(bfloat16_to_float32(amax))


def _block_scales(x: np.ndarray, block: int, x32: np.ndarray | None = None) -> np.ndarray:
    """A host tile's block scales: from its bits where it holds bfloat16 (`bf16_block_scales`), else from its
    float32 values (``x32`` where the caller widened them already)."""
    if x.dtype == np.uint16:
        return bf16_block_scales(x, block)
    return fp8_block_scales(x32 if x32 is not None else _float32(x), block)


def float32_to_float8_e4m3fn(values: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``values`` rounded to the nearest float8_e4m3fn, ties to even, saturating at +-448, as ``uint8`` bits; a
    NaN is 0x7F with the sign bit of ``signs`` (the input it came from: a division's NaN keeps no sign on GPUs).

    Where torch is installed (`_cast_torch`), torch's own cast does it, 3-4x faster than the numpy passes below on
    a CPU tile; an install without torch takes the numpy passes. Both give the same bits (tested against each other
    and against the tests' reference quantizer)."""
    torch = _cast_torch()
    if torch is not None and values.size:
        return _e4m3_torch(values, signs, torch)
    return _e4m3_numpy(values, signs)


def _cast_torch():
    """torch for a host tile's quantize: the module where this process has loaded it, else imported now where it is
    installed, else None. An agent on gRPC or nixl has not loaded torch, and used to quantize with numpy's passes
    for that alone: bench/moe_sync.py's sync on loopback spent 1.05 CPU s on nixl against 0.65 on collective,
    the difference in its senders' fp8 casts. The import happens once, in the first quantize's thread (about 1.3 s
    and 200 MiB here; the thread limit is in the environment by then, `threads`); a light install never pays it.
    An import statement, never ``sys.modules`` alone: while one thread imports torch, another finds it there only
    partly made, and the statement waits for it to be whole."""
    if "torch" not in sys.modules and not torch_installed():
        return None
    import torch

    return torch


def _e4m3_torch(values: np.ndarray, signs: np.ndarray, torch) -> np.ndarray:
    """`float32_to_float8_e4m3fn` by torch's cast on the CPU: saturated first (torch makes NaN of what is past
    e4m3fn's range), NaNs given ``signs``' sign bits after (torch keeps the quotient's)."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    out = torch.clamp(t, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    if values.size and np.isnan(values.max()):  # NaN where any element is, in one pass with no mask
        nan = np.isnan(values)
        out[nan] = np.where(np.signbit(signs[nan]), np.uint8(0xFF), np.uint8(0x7F))
    return out.reshape(values.shape)


def _e4m3_numpy(values: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """`float32_to_float8_e4m3fn` in numpy: written in place on two buffers of the input's size, and subnormals
    worked out only where they are (the serving format's values are mostly normal)."""
    a = np.abs(values)
    # the maximum is NaN where any element is, in one pass with no mask; the mask only where it is needed
    any_nan = bool(a.size) and bool(np.isnan(a.max()))
    nan = np.isnan(a) if any_nan else None
    np.minimum(a, np.float32(FP8_E4M3_MAX), out=a)  # saturate: 448 and above (inf too) are 448
    if any_nan:
        a[nan] = 0
    bits = a.view(np.uint32)
    # From 2**-6 (e4m3's least normal): float32's exponent rebiased from 127 to 7 and its mantissa rounded from
    # 23 bits to 3, ties to even (the kept mantissa's last bit, plus 0x7FFFF); a mantissa that rounds up carries into
    # the exponent. The rebias is subtracted before the shift, in one addition with the rounding (uint32 wraps
    # below 2**-6; those codes are replaced next).
    code = bits >> np.uint32(20)
    code &= np.uint32(1)
    code += bits
    code += np.uint32((0x7FFFF - ((127 - 7) << 23)) % 2**32)
    code >>= np.uint32(20)
    # Below it, subnormals: whole multiples of 2**-9 (8 of them is the least normal, code 8).
    tiny = np.flatnonzero(a < np.float32(2**-6))
    if tiny.size:
        code.reshape(-1)[tiny] = np.rint(a.reshape(-1)[tiny] * np.float32(2**9)).astype(np.uint32)
    if any_nan:
        code[nan] = 0x7F
    out = code.astype(np.uint8)
    sign = np.signbit(signs).view(np.uint8)
    sign <<= np.uint8(7)
    out |= sign
    return out


def _over_blocks(x32: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """Each element of a float32 matrix divided by its block's scale: broadcast over the blocks where the matrix is
    whole blocks (no copy of the scales at the matrix's size), else the scales repeated out to it."""
    m, n = x32.shape
    if m % block or n % block:
        return x32 / _blocks_of(scales, block, x32.shape)
    return (x32.reshape(m // block, block, n // block, block) / scales[:, None, :, None]).reshape(m, n)


def _torch_fp8(x, block: int, want_scales: bool, scales=None):
    """The fp8 kernels on a torch tile, where it lives: the numpy path's operations, in float32, in its order;
    ``scales`` given (fp8_quantize_scaled), the values are divided by them."""
    import torch
    import torch.nn.functional as F

    x32 = x.float()
    m, n = x32.shape
    bm, bn = -(-m // block), -(-n // block)
    if scales is None:
        mag = torch.where(torch.isfinite(x32), x32.abs(), torch.zeros((), dtype=torch.float32, device=x.device))
        mag = F.pad(mag, (0, bn * block - n, 0, bm * block - m))
        if mag.numel():
            scales = mag.reshape(bm, block, bn, block).amax(dim=(1, 3)) / FP8_E4M3_MAX
        else:
            scales = torch.zeros((bm, bn), dtype=torch.float32, device=x.device)
        scales = torch.where(scales == 0, torch.ones((), dtype=torch.float32, device=x.device), scales)
        if want_scales:
            return scales
    else:
        scales = scales.to(device=x.device, dtype=torch.float32)
    full = scales.repeat_interleave(block, dim=0)[:m].repeat_interleave(block, dim=1)[:, :n]
    codes = (x32 / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    nan = torch.isnan(x32)
    signed_nan = torch.where(torch.signbit(x32), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(nan, signed_nan, codes).view(torch.float8_e4m3fn)


def _fp8_kernel(want_scales: bool, scaled: bool = False) -> Callable[[list, Any, dict], None]:
    """``fp8_scales`` (``want_scales``), ``fp8_quantize``, or with ``scaled`` ``fp8_quantize_scaled``: the values
    divided by the scales its second input holds, which a sender made with fp8_scales of the same tile, so the
    tile's blocks are read for their scales once, not once per kernel."""
    name = "fp8_scales" if want_scales else "fp8_quantize_scaled" if scaled else "fp8_quantize"

    def run(inputs: list, output, params: dict) -> None:
        block = block_param(name, params)
        whole = tuple((0, n) for n in output.shape)
        if buffers.is_torch(output):
            given = _Torch.operand(inputs[1], output.device) if scaled else None
            values = _torch_fp8(_Torch.operand(inputs[0], output.device), block, want_scales, given)
        else:
            x = _host(inputs[0])
            if want_scales:  # a bfloat16 tile's scales need no float32 copy of it
                buffers.write(output, whole, whole, _block_scales(x, block))
                return
            bf16 = x.dtype == np.uint16  # bfloat16 bits: quantized in bands, without a float32 copy of the tile
            x32 = None if bf16 else _float32(x)
            scales = _float32(inputs[1]) if scaled else _block_scales(x, block, x32)
            if bf16 and _quantized_in_bands(x, scales, block, output):
                return
            x32 = _float32(x) if x32 is None else x32
            values = float32_to_float8_e4m3fn(_over_blocks(x32, scales, block), x32)
        buffers.write(output, whole, whole, values)

    return run


# Past e4m3fn's 448 the next step would be 480: to nearest, what lies below their midpoint, 464, casts to 448 as its
# clamp would (the largest element of a block, divided by its scale, is 448 give or take a rounding, so bands need no
# clamp at all); a band reaching past this is clamped first
_ROUNDS_TO_MAX = 456.0
_BAND_BYTES = 2 << 20  # about this many bytes of float32 in a band of `_quantized_in_bands` (at least a block's rows)


def _band_rows(n: int, block: int) -> int:
    """The rows of a band of an ``n``-column matrix: whole blocks' rows, about `_BAND_BYTES` of float32."""
    return block * max(1, _BAND_BYTES // (4 * n * block))


# bfloat16 bits, a scale and the code the reference gives their quotient, where torch's casts differ: past what rounds
# to 448 (464 and beyond, infinities) and NaNs of both signs (the input's sign bit, whatever the division made of it)
_CAST_CASES = ((0x43E8, 1.0, 0x7E), (0xC3E8, 1.0, 0xFE), (0x7149, 1.0, 0x7E), (0x7F80, 1.0, 0x7E),
               (0xFF80, 1.0, 0xFE), (0x4000, 2.0**-10, 0x7E), (0x7FC0, 1.0, 0x7F), (0xFFC0, 1.0, 0xFF),
               (0xFFC0, 3.0, 0xFF), (0x43E3, 1.0, 0x7E), (0x0000, 1.0, 0x00))


@functools.cache
def _band_cast_saturates(torch) -> bool:
    """Whether this torch's CPU cast, after `_quantized_in_bands`' division, gives the reference's codes where casts
    differ (`_CAST_CASES`): saturated at +-448 past it, and a NaN as 0x7F with its input's sign bit. Where it does,
    the bands skip their pass that finds NaNs and values to clamp (about a tenth of the kernel's time): torch 2.x's
    CPU cast saturates, but a build that makes NaN of what is past 448, or a division that drops a NaN's sign,
    takes that pass as before. Checked once a process, through the same operations as a band."""
    bits = torch.tensor([[b for b, _, _ in _CAST_CASES]], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    scales = torch.tensor([[s for _, s, _ in _CAST_CASES]], dtype=torch.float32)
    values = torch.empty(bits.shape, dtype=torch.float32)
    values.copy_(bits)
    values.div_(scales)
    codes = torch.empty(bits.shape, dtype=torch.uint8)
    codes.view(torch.float8_e4m3fn).copy_(values)
    return codes[0].tolist() == [c for _, _, c in _CAST_CASES]


def _quantized_in_bands(bits: np.ndarray, scales: np.ndarray, block: int, output) -> bool:
    """Quantize a bfloat16 tile (its uint16 ``bits``) by torch's ops, where torch is installed (`_cast_torch`), a band
    of blocks' rows at a time: each band widened into one float32 buffer of about `_BAND_BYTES`, divided by its
    blocks' scales, and cast into ``output`` (a host tile of fp8 codes, C-contiguous). Where this torch's cast does
    not itself saturate and keep a NaN's sign as the reference does (`_band_cast_saturates`), a band is first
    saturated where any of it lies past what rounds to e4m3fn's largest value (one pass finds that and any NaN, no
    clamp of every band), and a NaN sends the tile to the general path. The numpy path's operations in its order,
    so the same bits (tests/core/test_fp8_kernels.py runs both against the reference). Why bands: widening the
    whole tile made a float32 temporary of four times its elements, fresh memory (a page fault per 4 KiB) that every
    later pass read back from DRAM; a band's buffer is made once and stays in cache, which takes about a third off
    the kernel's time (``bench/fp8_kernels.py``). False where it does not apply: no torch, another output, a matrix
    of short blocks, or, on a cast unlike the reference's, a NaN (whose sign the general path takes from the input; a
    block scale is never 0 or infinite, so a NaN after the division was one in the input; ``output`` may then hold
    some bands, which the general path overwrites)."""
    torch = _cast_torch()
    m, n = bits.shape
    if (torch is None or not bits.size or m % block or n % block or not isinstance(output, np.ndarray)
            or output.dtype != np.uint8 or output.shape != bits.shape or not output.flags.c_contiguous
            or not output.flags.writeable):
        return False
    as_reference = _band_cast_saturates(torch)
    rows = _band_rows(n, block)
    band = torch.empty((min(rows, m), n), dtype=torch.float32)
    src = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    codes = torch.from_numpy(output).view(torch.float8_e4m3fn)
    per_block = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
    for top in range(0, m, rows):
        k = min(rows, m - top)
        values = band[:k]
        blocks = per_block[top // block:(top + k) // block, None, :, None]
        values.copy_(src[top:top + k])  # bfloat16 widened: the float32 of the same value
        values.view(k // block, block, n // block, block).div_(blocks)
        if not as_reference:
            lo, hi = (v.item() for v in torch.aminmax(values))  # one pass for the NaN test and the saturation's
            if lo != lo or hi != hi:  # a NaN
                return False
            if lo < -_ROUNDS_TO_MAX or hi > _ROUNDS_TO_MAX:
                values.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        codes[top:top + k].copy_(values)
    return True


# name -> fn(input regions, output region, params): the compute steps' implementations on this agent; the
# core's ``reshard.kernels`` holds their shape rules, for the same names.
KERNELS: dict[str, Callable[[list, Any, dict], None]] = {"copy": _copy,
                                                         **{name: _kernel(m, _INTO.get(name))
                                                            for name, m in _MATH.items()},
                                                         "einsum": _einsum,
                                                         "fp8_quantize": _fp8_kernel(want_scales=False),
                                                         "fp8_scales": _fp8_kernel(want_scales=True),
                                                         "fp8_quantize_scaled": _fp8_kernel(want_scales=False,
                                                                                            scaled=True)}
