"""The digest's Triton kernels: one pass over a CUDA buffer's bytes, optionally copying them on the way.

Imported only where a CUDA tensor is digested and Triton imports (it comes with
torch's CUDA wheels); ``reshard.proto.devices`` falls back to torch reductions
that compute the same numbers. Each program reads ``ROWS`` blocks of ``BLOCK``
bytes, writes them to ``dst`` when it copies, sums each block (``sum x_t`` and
``sum (t + 1) x_t`` over its bytes ``x_0 .. x_{BLOCK-1}``, both below 2**31),
and stores its share of the whole buffer's two sums, each block's placed at its
offset (mod p). One torch sum over the programs leaves two numbers, which
`reshard.proto.devices` reduces mod p when the digest is read: a digest costs
the kernel, one reduction and one read of 16 bytes, whatever the size.

Two kernels compute the same sums. `_fold_words` reads the bytes as 32-bit
little-endian words and sums a word's four bytes with masks and shifts (two
bytes per 16-bit lane): a quarter of the arithmetic per byte of `_fold`, which
widens each byte to int32 (on an H200 the bytes kernel was bound by its
arithmetic: it read 4 GiB no faster than a copy moved it). The words kernel
needs both buffers 16-byte aligned and a whole number of words; `_fold` takes
any bytes. ``bench/gpu.py`` times the digest and the copy that digests beside a
plain device copy (its ``gpu digest`` and ``copy and digest`` rows).
"""

from __future__ import annotations

from contextlib import nullcontext as _nothing

import triton
import triton.language as tl

BLOCK = 2048  # bytes per block: 255 * BLOCK * (BLOCK + 1) / 2 < 2**31
WORDS = BLOCK // 4
ROWS = 8  # blocks per program that copies: 16 KiB, four 16-byte loads per thread of 8 warps in flight
READ_ROWS = 16  # blocks per program that only reads: 32 KiB (on an H200, 8% faster than 8 rows at 4 GiB; copying,
# 16 rows were 2% slower than 8)
ALIGN = 16  # bytes: where both buffers start on it, the words kernel runs
PRIME = tl.constexpr(2**31 - 1)  # the digest's modulus (`reshard.proto.devices`)


@triton.jit
def _store_parts(parts, pid, programs, rows, a, b, BLOCK: tl.constexpr):
    """The program's share of the digest's two sums, positions included: ``sum a_r`` and
    ``sum ((r * BLOCK mod p) * a_r mod p + b_r)`` over its blocks ``r`` (a block past the end sums to 0). Each term
    is below 2**32 and a program's sum below 2**36, so int64 holds the sum over 2**27 programs: 256 TiB."""
    starts = (rows * BLOCK) % PRIME
    tl.store(parts + pid, tl.sum(a.to(tl.int64)))
    tl.store(parts + programs + pid, tl.sum(starts * a.to(tl.int64) % PRIME + b.to(tl.int64)))


@triton.jit
def _fold(src, dst, parts, n, programs, BLOCK: tl.constexpr, ROWS: tl.constexpr, COPY: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)  # the blocks this program sums
    local = tl.arange(0, BLOCK)
    offs = rows[:, None] * BLOCK + local[None, :]
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0)
    if COPY:
        tl.store(dst + offs, x, mask=mask)
    xi = x.to(tl.int32)
    _store_parts(parts, pid, programs, rows, tl.sum(xi, axis=1), tl.sum(xi * (local[None, :] + 1), axis=1), BLOCK)


@triton.jit
def _fold_words(src, dst, parts, n_words, programs, WORDS: tl.constexpr, ROWS: tl.constexpr, COPY: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    local = tl.arange(0, WORDS)
    offs = rows[:, None] * WORDS + local[None, :]
    mask = offs < n_words
    w = tl.load(src + offs, mask=mask, other=0)
    if COPY:
        tl.store(dst + offs, w, mask=mask)
    # Word j holds bytes 4j .. 4j+3 (little-endian): b0 | b1 << 8 | b2 << 16 | b3 << 24. The masks keep each
    # 16-bit lane one byte wide, so the sign of w (and of an arithmetic shift) never reaches a sum.
    even = w & 0x00FF00FF  # b0, b2
    odd = (w >> 8) & 0x00FF00FF  # b1, b3
    pair = even + odd  # b0 + b1, b2 + b3
    s = (pair & 0xFFFF) + (pair >> 16)  # the word's byte sum
    inner = (odd & 0xFFFF) + 2 * (even >> 16) + 3 * (odd >> 16)  # b1 + 2 b2 + 3 b3
    # sum over the word's bytes of (4j + k + 1) b_k = (4j + 1) s + inner
    _store_parts(parts, pid, programs, rows, tl.sum(s, axis=1), tl.sum(s * (4 * local[None, :] + 1) + inner, axis=1),
                 WORDS * 4)


def _words_fit(src, dst) -> bool:
    return src.numel() % 4 == 0 and src.data_ptr() % ALIGN == 0 and (dst is None or dst.data_ptr() % ALIGN == 0)


def digest_sums(src, dst=None, rows: int | None = None, words: bool | None = None):
    """The digest's two sums over 1-D contiguous uint8 CUDA tensor ``src`` (positions from 1), not yet reduced mod
    p: an int64 tensor of 2 on its device, which nothing waits for. Copies ``src`` into ``dst`` (as many bytes,
    contiguous) in the same pass when given. ``words`` picks the kernel (None: the words kernel where the buffers
    allow it); ``rows`` is blocks per program (None: `ROWS` to copy, `READ_ROWS` to read only)."""
    import torch

    n = src.numel()
    rows = rows or (READ_ROWS if dst is None else ROWS)
    programs = triton.cdiv(triton.cdiv(n, BLOCK), rows)
    parts = torch.empty((2, max(programs, 1)), dtype=torch.int64, device=src.device)
    if not programs:
        return parts.zero_().sum(1)
    if words is None:
        words = _words_fit(src, dst)
    with torch.cuda.device(src.device) if src.is_cuda else _nothing():  # Triton launches on the current GPU
        if words:
            w_src = src.view(torch.int32)
            w_dst = w_src if dst is None else dst.view(torch.int32)
            _fold_words[(programs,)](w_src, w_dst, parts, n // 4, programs, WORDS=WORDS, ROWS=rows,
                                     COPY=dst is not None, num_warps=8)
        else:
            _fold[(programs,)](src, src if dst is None else dst, parts, n, programs, BLOCK=BLOCK, ROWS=rows,
                               COPY=dst is not None, num_warps=8)
    # sum ((r * BLOCK mod p) * a_r + b_r) over blocks, r from 0: the positions of the bytes from 1 are in b_r
    return parts.sum(1)
