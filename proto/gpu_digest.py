"""The digest's Triton kernel: one pass over a CUDA buffer's bytes, optionally copying them on the way.

Imported only where a CUDA tensor is digested and Triton imports (it comes with
torch's CUDA wheels); ``reshard.proto.devices`` falls back to torch reductions
that compute the same numbers. Each program reads ``ROWS`` blocks of ``BLOCK``
bytes, writes them to ``dst`` when it copies, and stores each block's two sums:
``sum x_t`` and ``sum (t + 1) x_t`` over its bytes ``x_0 .. x_{BLOCK-1}``, both
below 2**31, so int32 holds them; `reshard.proto.devices` combines the blocks'
sums into the digest. ``bench/gpu.py`` times it beside a plain device copy.
"""

from __future__ import annotations

from contextlib import nullcontext as _nothing

import triton
import triton.language as tl

BLOCK = 2048  # bytes per block: 255 * BLOCK * (BLOCK + 1) / 2 < 2**31
ROWS = 8  # blocks per program: 16 KiB, four 16-byte loads per thread of 8 warps in flight


@triton.jit
def _fold(src, dst, sums_a, sums_b, n, blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr, COPY: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)  # the blocks this program sums
    local = tl.arange(0, BLOCK)
    offs = rows[:, None] * BLOCK + local[None, :]
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0)
    if COPY:
        tl.store(dst + offs, x, mask=mask)
    xi = x.to(tl.int32)
    tl.store(sums_a + rows, tl.sum(xi, axis=1), mask=rows < blocks)
    tl.store(sums_b + rows, tl.sum(xi * (local[None, :] + 1), axis=1), mask=rows < blocks)


def block_sums(src, dst=None):
    """Per-block sums (int32 tensors ``a``, ``b``) of 1-D contiguous uint8 CUDA tensor ``src``; copies it into
    ``dst`` (as many bytes, contiguous) in the same pass when given."""
    import torch

    n = src.numel()
    blocks = triton.cdiv(n, BLOCK)
    sums_a = torch.empty(blocks, dtype=torch.int32, device=src.device)
    sums_b = torch.empty(blocks, dtype=torch.int32, device=src.device)
    if blocks:
        with torch.cuda.device(src.device) if src.is_cuda else _nothing():  # Triton launches on the current GPU
            _fold[(triton.cdiv(blocks, ROWS),)](src, src if dst is None else dst, sums_a, sums_b, n, blocks,
                                                BLOCK=BLOCK, ROWS=ROWS, COPY=dst is not None, num_warps=8)
    return sums_a, sums_b
