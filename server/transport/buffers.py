"""Tile buffers where they live: numpy arrays on CPU agents, torch tensors on ``cuda:N`` agents.

Everything that reads or writes a tile's bytes (the shard store, the runtime, the
transports) goes through these functions, so a CUDA-resident shard is never
copied to the host unless a byte stream needs host memory (the gRPC path), and a
copy between two CUDA buffers is a device-to-device copy:

==================== ==========================================================================
``empty``            a buffer of ``shape`` and dtype name on a device (``"cpu"`` or ``"cuda:N"``);
                     in host memory a shared segment while a transport shares it (`shm`)
``region``           the view of ``box`` (global coordinates) in a buffer that holds ``origin``
``write``            copy ``data`` (numpy or torch, any device) into ``box`` of a buffer: torch
                     to torch is a device copy, host to GPU is staged through pinned buffers
``to_device``        an array (numpy, or torch on any device) as a buffer on a device: itself
                     when it is already there, else a copy
``host_array``       a view's elements as a C-contiguous numpy array in host memory (a CUDA
                     view is copied into a pinned host buffer; a contiguous numpy view is not
                     copied)
``host_bytes``       the same as a ``memoryview`` of bytes
``device_digest``    a digest of a buffer's bytes computed where it lives (on the GPU for CUDA
                     buffers; the one the SDK computes for a CUDA IPC hand-over)
``copy_digest``      a device copy that digests the bytes it copies (one pass on a GPU)
``device_of``        ``"cpu"`` or ``"cuda:N"``
``synchronize``      wait for the GPU work queued on a buffer
``check_device``     an agent's device at start-up, normalised, or an error naming how many
                     CUDA devices this host has
``gpu_uuid``         the GPU uuid of a device ("" for cpu): what agents report at registration
``backend_refusal``  why a collective backend cannot run in this process ("" when it can)
``Recycler``         host buffers kept by size for reuse (the shard store's released versions, a
                     ring's scratch): the first write to fresh memory pays a page fault per 4 KiB
==================== ==========================================================================

Dtypes are reshard's names (``reshard.dtypes``); bfloat16 and float8, which numpy
lacks, are held by numpy as same-size unsigned integers of their bits (what
``proto.layout.np_dtype`` maps them to), and by torch as themselves, so a CPU and a
CUDA agent hold the same bytes. The staging, the digest and the device checks are
the SDK's (``reshard.proto.devices``): the agent and a training rank must compute
them alike.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.proto.devices import (
    check_device,
    copy_digest,
    copy_to_device,
    device_digest,
    gpu_uuid,
    numpy_view,
    to_host,
    to_torch,
    torch_dtype,
)
from reshard.dtypes import itemsize
from reshard.proto.errors import ResourceExhaustedError
from reshard.proto.layout import np_dtype
from reshard.server.common.sizes import format_size
from reshard.server.transport import shm

__all__ = ["is_torch", "device_of", "empty", "region", "write", "to_device", "host_array", "host_bytes",
           "device_digest", "copy_digest", "synchronize", "check_device", "gpu_uuid", "backend_refusal", "Recycler",
           "RECYCLE_MIN_BYTES"]


def is_torch(array: Any) -> bool:
    return type(array).__module__.startswith("torch")


def device_of(array: Any) -> str:
    if type(array) is np.ndarray:
        return "cpu"
    if is_torch(array):
        return str(array.device)
    return "cpu"


def empty(shape: tuple[int, ...], dtype: str, device: str = "cpu"):
    """A buffer of ``shape`` on ``device``; `ResourceExhaustedError` naming the size and the device where it does not
    fit (a GPU's free memory is tried twice: once more after giving back what torch's allocator cached unused)."""
    if device == "cpu":
        return host_empty(shape, dtype, math.prod(shape) * np_dtype(dtype).itemsize)
    import torch

    for last in (False, True):
        try:
            return torch.empty(shape, dtype=torch_dtype(dtype), device=device)
        except torch.OutOfMemoryError as e:
            if last:
                free, total = torch.cuda.mem_get_info(torch.device(device))
                raise _exhausted(shape, dtype, device, f"{format_size(free)} of its {format_size(total)} are free; "
                                                       f"{str(e).splitlines()[0]}") from None
            torch.cuda.empty_cache()


def host_empty(shape: tuple[int, ...], dtype: str, nbytes: int) -> np.ndarray:
    """`empty` in host memory, ``nbytes`` in all (worked out by the caller, which staging a state dict asks per
    tile): a shared segment while a transport shares host memory with agents of this machine (`shm`), whose senders
    then copy straight into it. A refusal names ``dtype`` as the caller knows it (bfloat16, not its uint16 bits)."""
    np_type = np_dtype(dtype)
    try:
        shared = shm.empty(nbytes)
        return np.empty(shape, dtype=np_type) if shared is None else shared.view(np_type).reshape(shape)
    except MemoryError as e:
        raise _exhausted(shape, dtype, "cpu", str(e)) from None


def _exhausted(shape: tuple[int, ...], dtype: str, device: str, why: str) -> ResourceExhaustedError:
    nbytes = math.prod(shape) * itemsize(dtype)
    return ResourceExhaustedError(
        f"cannot allocate {format_size(nbytes)} on {device} for a {dtype}{list(shape)} buffer: {why}. Free memory "
        f"there (delete tensors, release pins), or shard the tensor over more devices")


def region(array, box: Box, origin: Box):
    """The part of ``array`` (which holds the global box ``origin``) that covers ``box``: a view."""
    return array[boxes.to_slices(box, origin)]


def write(array, box: Box, origin: Box, data) -> None:
    """Copy ``data`` into the part of ``array`` that covers ``box``."""
    target = array[boxes.to_slices(box, origin)]
    if is_torch(target) and is_torch(data):
        target.copy_(data.reshape(target.shape))  # device to device where both are on GPUs
        return
    if not is_torch(target):
        target[...] = host_array(data).view(target.dtype).reshape(target.shape) if is_torch(data) else data
    elif target.device.type == "cpu":
        view = numpy_view(target)
        view[...] = np.ascontiguousarray(data).view(view.dtype).reshape(view.shape)
    elif target.is_contiguous():
        copy_to_device(target, data)
    else:
        staged = target.new_empty(target.shape)
        copy_to_device(staged, data)
        target.copy_(staged)


def to_device(array, dtype: str, device: str):
    """``array`` (numpy, or torch on any device) as a buffer on ``device``: itself when it is there already."""
    if device == "cpu":
        return host_array(array) if is_torch(array) else array
    if is_torch(array):
        return array if str(array.device) == device else array.to(device)
    return to_torch(array, dtype, device)


def host_array(view) -> np.ndarray:
    """The elements of ``view`` as a C-contiguous numpy array in host memory."""
    if is_torch(view):
        return to_host(view)
    return np.ascontiguousarray(view)


def host_bytes(view) -> memoryview:
    """The bytes of ``view`` in C order, in host memory."""
    return memoryview(host_array(view)).cast("B")


def synchronize(array) -> None:
    """Wait for the work queued on ``array``'s GPU (its current stream); nothing for host memory."""
    if is_torch(array) and array.device.type == "cuda":
        import torch

        torch.cuda.current_stream(array.device).synchronize()


def backend_refusal(backend: str) -> str:
    """Why a ``backend`` (gloo, nccl) process group cannot run in this process, or "" when it can."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install 'reshard[torch]')"
    if not dist.is_available():
        return f"torch {torch.__version__} has no torch.distributed"
    if backend == "nccl" and not torch.cuda.is_available():
        return "this process sees no CUDA device"
    if backend == "nccl" and not dist.is_nccl_available():
        return f"torch {torch.__version__} is built without NCCL"
    return ""


RECYCLE_MIN_BYTES = 1 << 16  # smaller buffers come from malloc's own free lists already


class Recycler:
    """Free host buffers by size, newest last, at most ``cap_bytes`` in all (see the module docstring)."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self._free: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again, for tests and stats

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, array) -> None:
        """Keep ``array``'s memory for reuse, if it is a host buffer of its own (or a view of all of one)."""
        base = array.base if isinstance(array, np.ndarray) and isinstance(array.base, np.ndarray) else array
        if not (isinstance(base, np.ndarray) and (base.flags.owndata or shm.segment_of(base) is not None)
                and base.flags.c_contiguous
                and base.nbytes == array.nbytes and RECYCLE_MIN_BYTES <= base.nbytes <= self.cap_bytes):
            return
        with self._lock:
            self._free.setdefault(base.nbytes, []).append(base)
            self._free.move_to_end(base.nbytes)
            self._bytes += base.nbytes
            self._trim_locked()

    def resize(self, cap_bytes: int) -> None:
        """Keep at most ``cap_bytes`` from now on, dropping the oldest buffers beyond it at once."""
        with self._lock:
            self.cap_bytes = cap_bytes
            self._trim_locked()

    def _trim_locked(self) -> None:
        while self._bytes > self.cap_bytes:
            size, arrays = next(iter(self._free.items()))
            arrays.pop(0)
            self._bytes -= size
            if not arrays:
                del self._free[size]

    def take(self, nbytes: int) -> np.ndarray | None:
        """A free buffer of exactly ``nbytes`` (uint8, 1-D), or None."""
        if nbytes < RECYCLE_MIN_BYTES:  # never kept (`put`)
            return None
        with self._lock:
            arrays = self._free.get(nbytes)
            while arrays:
                array = arrays.pop()
                self._bytes -= nbytes
                if not arrays:
                    del self._free[nbytes]
                # held only here (this name and the call's argument): no reader or view still uses it
                if sys.getrefcount(array) == 2:
                    self.reused += 1
                    return array.reshape(-1).view(np.uint8)
                arrays = self._free.get(nbytes)
        return None

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0
