"""How many threads one kernel call may use: BLAS and OpenMP pools, and torch's intra-op pool.

By default the libraries take every core, which is right for an agent alone on its machine. Agents that share
a machine (``reshard up``, ``local_cluster``, the lab's emulated hosts) each get their share instead
(`reshard.client.cluster.share_of_cores`): OpenBLAS threads spin while they wait for work, so four agents of two
threads each on two cores spend a 7 ms matmul's time several times over waiting for one another (a split
matmul's job on four local agents: 71 ms, 38 ms with one thread each).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["limit_compute_threads"]

log = logging.getLogger(__name__)


def limit_compute_threads(threads: int) -> None:
    """Cap the BLAS/OpenMP pools (threadpoolctl) and torch's intra-op pool at ``threads``; 0 leaves the
    libraries' defaults."""
    if threads <= 0:
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # installed with reshard; an install without it keeps the defaults
        log.warning("threadpoolctl is not installed: --compute-threads %d is not applied to BLAS", threads)
    else:
        threadpool_limits(limits=threads)
    torch = sys.modules.get("torch")  # only where already loaded: a numpy agent need not import torch for this
    if torch is not None:
        torch.set_num_threads(threads)
