"""What the delta codec (`reshard.delta`) costs on one large box: bytes on the wire and seconds to encode and apply.

A 64 MiB bfloat16 tensor (held as its uint16 bits) gets a random share of its elements changed, at each rate;
the delta of each is encoded (the codec picks its kind), applied to the old version into a fresh buffer, and
checked byte for byte against the new one (outside the timing). Prints, per rate, the kind, the encoded bytes
against the full box's, the bytes a changed element costs, and the best of ``--runs`` seconds to encode and to
apply, with the box's bytes per second. Then, at each rate, what an agent does per box of a delta stream
(`reshard.server.transport.deltas`: the sender's frame with both digests, a receiver's checks and apply into the
destination) against the memory rate the agents' probe reports, measured in the same process: the passes over the
box's bytes each side costs, which is how the planner prices a delta (`reshard.delta.SENDER_PASSES`,
``RECEIVER_PASSES``). Prints only; it writes no BENCHMARKS.md section yet.

    python bench/delta_codec.py [--mib 64] [--rates 0.5,1,2,4,12,50] [--runs 3] [--numpy]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from reshard.delta import COMPILED, RECEIVER_PASSES, SENDER_PASSES, apply, encode
from reshard.server.agent.probe import probe
from reshard.server.transport.deltas import DeltaStream, Segment, apply_frame, encode_frame


def versions(num_elements: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(old, new) bf16 bits where each element changed with probability ``rate``, its bits always different."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2**16, size=num_elements, dtype=np.uint16)
    new = old.copy()
    changed = rng.random(num_elements, dtype=np.float32) < rate
    new[changed] ^= rng.integers(1, 2**16, size=int(np.count_nonzero(changed)), dtype=np.uint16)
    return old, new


def best_seconds(fn, runs: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="the box's size in MiB (default 64)")
    parser.add_argument("--rates", default="0.5,1,2,4,12,50", help="change rates in percent, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per rate; the best is printed")
    parser.add_argument("--numpy", action="store_true",
                        help="the numpy codec, as an install without a C compiler runs it (default: the compiled "
                             "passes, reshard/_delta_kernel.c, where built)")
    args = parser.parse_args()
    if args.numpy:
        import reshard.delta
        from reshard.proto import layout

        reshard.delta._kernel = layout._kernel = None
    num_elements = args.mib * 2**20 // 2
    box_nbytes = num_elements * 2
    codec = "numpy" if args.numpy or not COMPILED else "compiled"
    print(f"delta codec ({codec}) on a {args.mib} MiB bfloat16 box ({num_elements:,} elements), best of {args.runs}")
    header = (f"{'rate':>6} {'changed':>7} {'kind':>6} {'delta MiB':>10} {'of full':>8} {'B/changed':>9} "
              f"{'encode s':>9} {'GB/s':>6} {'apply s':>8} {'GB/s':>6}")
    print(header)
    print("-" * len(header))
    for i, rate in enumerate(float(r) / 100 for r in args.rates.split(",")):
        old, new = versions(num_elements, rate, seed=i)
        encode_s, delta = best_seconds(lambda: encode(old, new), args.runs)
        out = np.empty_like(old)
        apply_s, _ = best_seconds(lambda: apply(old, delta, out=out), args.runs)
        if out.tobytes() != new.tobytes():
            raise SystemExit(f"the {delta.kind} delta at {rate:.1%} did not rebuild the new version bit for bit")
        per_changed = delta.nbytes / delta.num_changed if delta.num_changed else float("nan")
        encode_gbs, apply_gbs = box_nbytes / encode_s / 1e9, box_nbytes / apply_s / 1e9
        print(f"{rate:>6.1%} {delta.num_changed / num_elements:>7.2%} {delta.kind:>6} {delta.nbytes / 2**20:>10.2f} "
              f"{delta.nbytes / box_nbytes:>8.2%} {per_changed:>9.2f} "
              f"{encode_s:>9.3f} {encode_gbs:>6.2f} {apply_s:>8.3f} {apply_gbs:>6.2f}")
    frames(num_elements, [float(r) / 100 for r in args.rates.split(",")], args.runs)


def frames(num_elements: int, rates: list[float], runs: int) -> None:
    """An agent's work per box of a delta stream, in passes over the box at the probe's memory rate."""
    nbytes = num_elements * 2
    print(f"\nper box of a delta stream, against the agents' memory probe (the planner prices a delta at "
          f"{SENDER_PASSES:g} passes to send, {RECEIVER_PASSES:g} to receive)")
    header = f"{'rate':>6} {'memory GB/s':>11} {'send s':>7} {'passes':>6} {'receive s':>9} {'passes':>6}"
    print(header)
    print("-" * len(header))
    for i, rate in enumerate(rates):
        old, new = (v.view(np.uint8) for v in versions(num_elements, rate, seed=i))
        seg = Segment("w", "w", ((0, num_elements),), 0, nbytes, 2, (1, 2))
        stream = DeltaStream(0, "host0/0", (seg,), nbytes, lambda k: old, lambda device, k: old)
        memory = probe("cpu").memory_gb_per_s  # beside the timings: this machine's load drifts
        send_s, frame = best_seconds(lambda: encode_frame("bench", stream, new), runs)
        out = np.empty_like(new)
        receive_s, _ = best_seconds(lambda: apply_frame("bench", stream, frame.data, "host1/0", out), runs)
        if out.tobytes() != new.tobytes():
            raise SystemExit(f"the delta frame at {rate:.1%} did not rebuild the new version bit for bit")
        per_pass = nbytes / (memory * 1e9)
        print(f"{rate:>6.1%} {memory:>11.1f} {send_s:>7.3f} {send_s / per_pass:>6.1f} {receive_s:>9.3f} "
              f"{receive_s / per_pass:>6.1f}")


if __name__ == "__main__":
    main()
