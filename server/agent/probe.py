"""What one device of this agent computes and copies per second, measured once as the agent starts.

The planner's cost model prices a compute step as the longer of its bytes over the
device's memory bandwidth and its floating-point operations over the device's rate
(`reshard.Topology`, ``host_memory_gb_per_s`` and ``host_device_gflops``). The
defaults there are a guess; these figures are the agent's own, reported at
registration: a float32 matmul through the kernels' library (BLAS on a CPU, cuBLAS
on a GPU) and a copy between two warm buffers, best of a few runs within a small
time budget, so a start costs a fraction of a second.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["DeviceRates", "probe"]

log = logging.getLogger(__name__)

_MATMUL_N = 384  # 2 * 384^3 = 113 MFLOP: long enough to time, short enough to repeat
_COPY_BYTES = 32 << 20  # past the caches (16 MiB measured 5x memory speed on a server's L3), at memory speed


@dataclass(frozen=True)
class DeviceRates:
    gflops: float  # float32 multiply-adds count two
    memory_gb_per_s: float  # bytes read plus bytes written, 10^9 per second

    def __str__(self) -> str:
        return f"{self.gflops:.1f} GFLOP/s, {self.memory_gb_per_s:.1f} GB/s"


def _best(run, budget_s: float, sync=lambda: None) -> float:
    """The shortest of a few timed runs of ``run`` (after one untimed), within about ``budget_s``."""
    run()
    sync()
    best, spent = float("inf"), 0.0
    for _ in range(8):
        t0 = time.perf_counter()
        run()
        sync()
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent > budget_s:
            break
    return max(best, 1e-9)


def probe(device: str = "cpu", budget_s: float = 0.1) -> DeviceRates:
    """Measure ``device`` ("cpu" or "cuda:N"); each of the two figures takes about ``budget_s / 2``."""
    n, half = _MATMUL_N, budget_s / 2
    if device == "cpu":
        rng = np.random.default_rng(0)
        a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
        out = np.empty((n, n), np.float32)
        src, dst = np.ones(_COPY_BYTES // 4, np.float32), np.zeros(_COPY_BYTES // 4, np.float32)
        matmul = _best(lambda: np.matmul(a, b, out=out), half)
        copy = _best(lambda: np.copyto(dst, src), half)
    else:
        import torch

        a, b = torch.rand(n, n, device=device), torch.rand(n, n, device=device)
        src, dst = torch.ones(_COPY_BYTES // 4, device=device), torch.zeros(_COPY_BYTES // 4, device=device)
        sync = torch.cuda.current_stream(torch.device(device)).synchronize
        matmul = _best(lambda: torch.matmul(a, b), half, sync)
        copy = _best(lambda: dst.copy_(src), half, sync)
    rates = DeviceRates(2 * n ** 3 / matmul / 1e9, 2 * _COPY_BYTES / copy / 1e9)
    log.info("device %s: %s", device, rates)
    return rates
