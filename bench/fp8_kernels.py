"""What a sender's fp8 kernels cost on one bfloat16 tile (issue 41's quantize on the way), per element.

A seeded bfloat16 matrix (held as its uint16 bits, as an agent holds it) of Kimi-K2's expert shape by default goes
through the agent's three kernels as a sender runs them
(`reshard.server.agent.kernels.KERNELS`: ``fp8_scales``, then ``fp8_quantize_scaled`` with those scales; and
``fp8_quantize``, which makes its own), and through the float32 route to the block scales beside them:
`fp8_block_scales` of the widened tile, which every tile that is not bfloat16 takes and which bfloat16 tiles took
before `bf16_block_scales`. Both routes' scales are compared bit for bit outside the timing, on the matrix and on a
copy with a NaN, an infinity and a subnormal in it (a tile with a NaN quantizes on numpy's slower passes, which
keep the NaN's sign; weights hold none, so the timed matrix holds none). Prints the best of
``--runs`` for each, in ns per element, and the bits route's speed against the float32 route's; it writes no
BENCHMARKS.md section.

    python bench/fp8_kernels.py [--rows 2048] [--cols 7168] [--block 128] [--runs 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from reshard.dtypes import float32_to_bfloat16
from reshard.server.agent.kernels import KERNELS, _float32, bf16_block_scales, fp8_block_scales


def best_seconds(fn, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="the tile's rows (default 2048: an expert's)")
    parser.add_argument("--cols", type=int, default=7168, help="the tile's columns (default 7168: the hidden size)")
    parser.add_argument("--block", type=int, default=128, help="the scales' block (default 128)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each; the best is printed (default 7)")
    args = parser.parse_args()

    rng = np.random.default_rng(41)
    bits = float32_to_bfloat16((rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32))
    params = {"block": str(args.block)}
    bm, bn = -(-args.rows // args.block), -(-args.cols // args.block)
    scales = np.empty((bm, bn), dtype=np.float32)
    codes = np.empty(bits.shape, dtype=np.uint8)
    odd = bits.copy()
    odd.reshape(-1)[:3] = [0x7FC0, 0x7F80, 0x0001]  # a NaN, an infinity and a subnormal: none sets a scale
    for tile in (bits, odd):
        KERNELS["fp8_scales"]([tile], scales, params)
        via_float32 = fp8_block_scales(_float32(tile), args.block)
        if not np.array_equal(bf16_block_scales(tile, args.block).view(np.uint32), via_float32.view(np.uint32)) or \
                not np.array_equal(scales.view(np.uint32), via_float32.view(np.uint32)):
            raise AssertionError("the bits route's block scales differ from the float32 route's")

    rows = [
        ("block scales, float32 route (widen, magnitudes, finiteness, max)",
         lambda: fp8_block_scales(_float32(bits), args.block)),
        ("block scales, bits route (`bf16_block_scales`)", lambda: bf16_block_scales(bits, args.block)),
        ("kernel fp8_scales", lambda: KERNELS["fp8_scales"]([bits], scales, params)),
        ("kernel fp8_quantize_scaled (with those scales)",
         lambda: KERNELS["fp8_quantize_scaled"]([bits, scales], codes, params)),
        ("kernel fp8_quantize (its own scales)", lambda: KERNELS["fp8_quantize"]([bits], codes, params)),
    ]
    n = bits.size
    print(f"a {args.rows} x {args.cols} bfloat16 tile ({bits.nbytes / 2**20:.1f} MiB), blocks of {args.block}; "
          f"best of {args.runs}")
    print("| what | ms | ns per element |\n|---|---:|---:|")
    seconds = {}
    for what, fn in rows:
        seconds[what] = best_seconds(fn, args.runs)
        print(f"| {what} | {seconds[what] * 1e3:.2f} | {seconds[what] / n * 1e9:.2f} |")
    print(f"the bits route takes the block scales {seconds[rows[0][0]] / seconds[rows[1][0]]:.2f}x faster than the "
          f"float32 route")


if __name__ == "__main__":
    main()
