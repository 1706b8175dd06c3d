"""How many threads one kernel call may use: BLAS and OpenMP pools, and torch's intra-op pool.

By default the libraries take every core, which is right for an agent alone on its machine. Agents that share
a machine (``reshard up``, ``local_cluster``, the lab's emulated hosts) each get their share instead
(`reshard.client.cluster.share_of_cores`): OpenBLAS threads spin while they wait for work, so four agents of two
threads each on two cores spend a 7 ms matmul's time several times over waiting for one another (a split
matmul's job on four local agents: 71 ms, 38 ms with one thread each).

OpenMP (torch's intra-op pool on CPU) keeps its thread count per thread: a thread takes the process's default,
read from ``OMP_NUM_THREADS`` when libgomp loads, whatever another thread set. An agent imports torch after it
applies its limit (with the collective transport, or at its first quantize of a host tile), so the limit goes into
the environment first, for every thread of the libraries loaded later; where torch is loaded already, each of the
runtime's threads applies it as it starts (`limit_this_thread`). Without that, every kernel the runtime ran in a
worker thread forked an OpenMP team of every core, whose idle members spin: on the lab's 8 agents on 2 cores a
quantized MoE sync spent half its CPU in libgomp's wait loop (bench/moe_sync.py: 0.8 s a sync against 0.43 s with
the limit).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable

__all__ = ["Spares", "limit_compute_threads", "limit_this_thread"]

# The OpenMP and BLAS libraries read these as they load; OMP_NUM_THREADS is also each new thread's OpenMP default.
_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_limit = 0  # the process's limit, once `limit_compute_threads` set one

log = logging.getLogger(__name__)


def limit_compute_threads(threads: int) -> None:
    """Cap the BLAS/OpenMP pools (threadpoolctl) and torch's intra-op pool at ``threads``, in the libraries
    loaded now and, through the environment, in those loaded later; 0 leaves the libraries' defaults."""
    global _limit
    if threads <= 0:
        return
    _limit = threads
    for name in _ENV:
        os.environ[name] = str(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # installed with reshard; an install without it keeps the defaults
        log.warning("threadpoolctl is not installed: --compute-threads %d is not applied to BLAS", threads)
    else:
        threadpool_limits(limits=threads)
    limit_this_thread()


def limit_this_thread() -> None:
    """Apply the process's limit to the calling thread's OpenMP pool (torch's), where torch is loaded and a limit
    was set: a thread pool's initializer, for threads that run kernels."""
    if not _limit or "torch" not in sys.modules:  # only where loaded: a numpy agent need not import torch for this
        return
    import torch  # not the module as sys.modules holds it: another thread may be making it (the fp8 kernels)

    if torch.get_num_threads() != _limit:
        torch.set_num_threads(_limit)


class Spares:
    """Daemon threads kept for reuse: `start` hands a call to an idle one, and makes a thread only where none is
    idle. A new thread's ``start`` waits until the thread runs, and on cores that 8 agents share that wait was
    milliseconds of a job's start on every host (an agent starts a thread per job to run it, and one to load its
    prepare); a spare thread is woken, not made. Each call's exceptions are its own: one that raises is logged."""

    def __init__(self, name: str):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._numbers = itertools.count()

    @property
    def threads(self) -> int:
        """Threads made so far (each kept until `close`)."""
        return self._threads

    def start(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on a spare thread."""
        with self._lock:
            spare = self._idle > 0
            if spare:
                self._idle -= 1
            else:
                self._threads += 1
        self._calls.put((fn, args))
        if not spare:
            threading.Thread(target=self._serve, daemon=True, name=f"{self.name}-{next(self._numbers)}").start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            fn, args = call
            try:
                fn(*args)
            except BaseException:  # the call's own failure, logged; the thread serves the next one
                log.exception("%s: a call on a spare thread failed", self.name)
            del fn, args, call  # nothing of the call is held while the thread waits for the next
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """End the idle threads, and each busy one once its call returns."""
        with self._lock:
            threads, self._threads = self._threads, 0
            self._idle = 0
        for _ in range(threads):
            self._calls.put(None)
