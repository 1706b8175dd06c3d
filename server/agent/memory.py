"""How an agent process holds memory: how much it may hold, and keeping freed blocks for reuse.

The limit: an agent holds at most ``--memory-limit`` bytes of shards, committed
and staged, the working buffers a program makes as it runs (a Partial result's
addends, an input moved to another layout first: each held until its job ends), and
on a cpu agent the bucket buffers a reshard_many may have in flight
(`reshard.server.agent.store.ShardStore` refuses before allocating);
by default three quarters of what this process may use: the machine's memory, or
its cgroup's limit when a container has a lower one, or the GPU's for a cuda agent.
The rest is headroom for the process itself: message buffers, gRPC, torch, the
freed blocks kept for reuse (below), and what one step needs while it runs (a
ring's accumulator and landing buffer, an input tile assembled from pieces).

Reuse: an agent allocates large blocks all the time: a destination buffer per device per
job, a message buffer per chunk. glibc serves every block above 32 MiB (and, by
its dynamic threshold, often far smaller ones) with a fresh ``mmap`` and unmaps it
on free, so every job pays again for the kernel to fault in and zero its pages;
on the emulated cluster that page zeroing was a quarter of all CPU time during a
chain broadcast. Like a caching allocator (PyTorch's CUDA allocator, for one),
the agent keeps what it freed: its resident size stays at its high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

__all__ = ["keep_freed_memory", "default_memory_limit"]

log = logging.getLogger(__name__)

DEFAULT_SHARE = 0.75
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def _host_memory_bytes() -> int:
    """This machine's physical memory, or the cgroup's limit where it is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = open(path, encoding="ascii").read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means none; v1 says none with a huge number, which min() ignores
            total = min(total, int(text))
    return total


def default_memory_limit(device: str) -> int:
    """The memory limit of an agent whose shards live on ``device`` when none is given (see the module)."""
    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        total = _host_memory_bytes()
    return int(total * DEFAULT_SHARE)


# mallopt parameters of glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed memory (no mmap per block, no trimming); False where not glibc.

    Call once, early in the process, before threads allocate: with one arena every
    thread's frees are reusable by every other thread, which matters because
    chunks are allocated on gRPC's threads and freed on the executor's.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt): keep the defaults
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))
    if not ok:
        log.info("mallopt refused a setting; the agent keeps the allocator's defaults")
    return ok
