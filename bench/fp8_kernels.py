"""What a sender's fp8 kernels cost on one bfloat16 tile (issue 41's quantize on the way), per element.

A seeded bfloat16 matrix (held as its uint16 bits, as an agent holds it) of Kimi-K2's expert shape by default goes
through the agent's three kernels as a sender runs them (`reshard.server.agent.kernels.KERNELS`: ``fp8_scales``,
then ``fp8_quantize_scaled`` with those scales; and ``fp8_quantize``, which makes its own), beside what they
replaced: the float32 route to the block scales (`fp8_block_scales` of the widened tile, which every tile that is
not bfloat16 takes and which bfloat16 tiles took before `bf16_block_scales`), and the quantize of the whole tile
widened at once (`quantize_whole`, before the kernel's bands, `_quantized_in_bands`; it must give the kernel's
codes), and the kernel's bands each first checked for NaNs and values past 448 (`band_checked`: what a torch whose
cast does not saturate and keep a NaN's sign as the reference does would run; the pinned torch's does, so its bands
skip that pass; same codes). Both routes' scales are compared bit for bit outside the timing, on the matrix and on
a copy with a NaN, an infinity and a subnormal in it (weights hold none, so the timed matrix holds none). torch runs
on ``--threads`` (an agent's share of this machine's cores by default). Prints the best of ``--runs`` for each,
timed a round of every row at a time, in ns per element, and the new routes' speed against the old; it writes no
BENCHMARKS.md section.

    python bench/fp8_kernels.py [--rows 2048] [--cols 7168] [--block 128] [--runs 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from reshard.dtypes import float32_to_bfloat16
from reshard.kernels import FP8_E4M3_MAX
from reshard.server.agent import kernels as agent_kernels
from reshard.server.agent.kernels import KERNELS, _float32, bf16_block_scales, fp8_block_scales
from reshard.server.common.torch_support import torch_installed


def quantize_whole(bits: np.ndarray, scales: np.ndarray, block: int, output: np.ndarray) -> None:
    """The quantize as the kernel ran it before `_quantized_in_bands`: the whole tile widened to float32 at once,
    then the same operations (divide by the blocks' scales, saturate, cast into ``output``) over all of it."""
    import torch

    m, n = bits.shape
    t = torch.from_numpy(_float32(bits))
    t.view(m // block, block, n // block, block).div_(torch.from_numpy(scales)[:, None, :, None])
    t.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    torch.from_numpy(output).view(torch.float8_e4m3fn).copy_(t)


def best_seconds(rows: list, runs: int) -> dict[str, float]:
    """Each row's best of ``runs``, timed a round of every row at a time, so a drift of this machine's speed reaches
    every row alike."""
    best = {what: float("inf") for what, _ in rows}
    for _ in range(runs):
        for what, fn in rows:
            t0 = time.perf_counter()
            fn()
            best[what] = min(best[what], time.perf_counter() - t0)
    return best


def band_checked(fn):
    """``fn`` with every band's NaN and saturation pass, which a torch whose cast differs from the reference's
    takes (`kernels._band_cast_saturates` says no); the kernel's route otherwise."""
    def run():
        saturates = agent_kernels._band_cast_saturates
        agent_kernels._band_cast_saturates = lambda torch: False
        try:
            fn()
        finally:
            agent_kernels._band_cast_saturates = saturates

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="the tile's rows (default 2048: an expert's)")
    parser.add_argument("--cols", type=int, default=7168, help="the tile's columns (default 7168: the hidden size)")
    parser.add_argument("--block", type=int, default=128, help="the scales' block (default 128)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each; the best is printed (default 7)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads (default 1: an agent's share where 8 agents share this machine's "
                             "cores, `reshard.client.cluster.share_of_cores`; 0 leaves torch's default)")
    args = parser.parse_args()
    if torch_installed():  # the kernels' cast, loaded before the timing (an agent loads it at its first quantize)
        import torch

        if args.threads > 0:
            torch.set_num_threads(args.threads)

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
    if "torch" in sys.modules and not (args.rows % args.block or args.cols % args.block):
        whole = np.empty_like(codes)
        quantize_whole(bits, scales, args.block, whole)
        KERNELS["fp8_quantize_scaled"]([bits, scales], codes, params)
        if not np.array_equal(whole, codes):
            raise AssertionError("the whole-tile quantize's codes differ from the kernel's")
        rows.insert(3, ("quantize with those scales, the whole tile widened at once (before bands)",
                        lambda: quantize_whole(bits, scales, args.block, whole)))
        checked = np.empty_like(codes)
        band_checked(lambda: KERNELS["fp8_quantize_scaled"]([bits, scales], checked, params))()
        if not np.array_equal(checked, codes):
            raise AssertionError("the bands' codes with their NaN and saturation pass differ from the kernel's")
        rows.append(("kernel fp8_quantize_scaled, each band first checked for NaNs and values past 448",
                     band_checked(lambda: KERNELS["fp8_quantize_scaled"]([bits, scales], checked, params))))
    n = bits.size
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    print(f"a {args.rows} x {args.cols} bfloat16 tile ({bits.nbytes / 2**20:.1f} MiB), blocks of {args.block}; "
          f"best of {args.runs}; torch's threads: {threads if threads is not None else 'no torch (numpy passes)'}")
    print("| what | ms | ns per element |\n|---|---:|---:|")
    seconds = best_seconds(rows, args.runs)
    for what, _ in rows:
        print(f"| {what} | {seconds[what] * 1e3:.2f} | {seconds[what] / n * 1e9:.2f} |")
    print(f"the bits route takes the block scales {seconds[rows[0][0]] / seconds[rows[1][0]]:.2f}x faster than the "
          f"float32 route", end="")
    if len(rows) > 5:
        print(f"; the kernel quantizes in bands {seconds[rows[3][0]] / seconds[rows[4][0]]:.2f}x faster than the whole "
              f"tile at once, and {seconds[rows[6][0]] / seconds[rows[4][0]]:.2f}x faster than with each band checked "
              f"(torch's cast saturates as the reference does: {agent_kernels._band_cast_saturates(torch)})", end="")
    print()


if __name__ == "__main__":
    main()
