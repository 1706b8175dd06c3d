"""Torch devices at both ends of the wire: host staging, the GPU digest, CUDA IPC handles.

The SDK stages CUDA tensors through pinned host memory for gRPC streams and hands
them to an agent on the same machine by CUDA IPC; the agent uses the same
functions (through ``reshard.server.transport.buffers`` and
``reshard.server.agent.ipc``), so the digest both sides compare and the fields of
a handle are defined once. torch is imported inside the functions: numpy-only
users of the SDK never load it.

===================== =========================================================================
``to_torch``          a numpy array (reshard's dtype name beside it) as a torch tensor on a
                      device; host to GPU through two pinned buffers of ``STAGE_BYTES``, the
                      copy into one overlapping the DMA out of the other
``copy_to_device``    the same into an existing contiguous GPU tensor
``numpy_view``        a CPU tensor as a numpy array sharing its memory (bfloat16 and float8 as
                      unsigned integers of their bits)
``to_host``           a torch tensor as a C-contiguous numpy array in host memory (a CUDA
                      tensor lands in one pinned buffer by DMA)
``device_digest``     64-bit digest of a tensor's bytes in C order, computed where it lives
``DeviceChecksum``    the same digest summed piece by piece (a stream's trailer between GPUs)
``copy_digest``       a device copy that digests the bytes it copies, in the same pass
``import_torch``      torch, or an error naming the install that brings it
``check_device``      a torch device this process has, normalised (``cuda`` -> ``cuda:0``), or
                      an error naming how many CUDA devices there are
``gpu_uuid``          the uuid of a CUDA device: ordinals differ between processes, uuids not
``visible_gpus``      the uuids of the GPUs this process sees
``cuda_index``        the ordinal this process gives a GPU uuid, or None
``machine_id``        the kernel's boot id: processes with equal ids run on one machine
``CudaIpcHandle``     what another process needs to map a CUDA tensor; the fields are those of
                      the protobuf message ``CudaIpcTensor``
``share_cuda``        a CUDA tensor's handle (the producer's side)
``open_cuda``         the tensor a handle names, mapped into this process (the consumer's side)
``release_cuda``      give back the producer's reference of a handle that will not be opened
===================== =========================================================================

The digest (``device_digest``, `DeviceChecksum`) reads the bytes ``x_1 .. x_n`` and,
with ``p = 2**31 - 1``, returns ``(b << 32) | a`` where ``a = (n + sum x_j) mod p``
and ``b = sum (j * x_j) mod p``: a Fletcher-style sum that any single changed byte,
any change of length and any swap of two different bytes (less than 2 GiB apart)
alter. It is not cryptographic; it catches a copy that went wrong (a wrong offset,
stride or handle). Both sums are sums of blocks of 2048 bytes, so a GPU computes
them in one pass (`reshard.proto.gpu_digest`, a Triton kernel, which can copy the
bytes in the same pass), torch in two reductions where Triton is missing, and numpy
on host bytes: a CPU and a GPU agent get the same digest for the same bytes, and a
stream's digest can be summed piece by piece, the pieces cut anywhere.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from reshard.dtypes import BITS_DTYPES, DTYPE_SIZES, dtype_name
from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError
from reshard.proto.layout import np_dtype

__all__ = [
    "STAGE_BYTES", "import_torch", "is_cuda", "torch_dtype", "numpy_view", "to_torch", "copy_to_device", "to_host",
    "device_digest", "DeviceChecksum", "copy_digest", "check_device", "gpu_uuid",
    "visible_gpus", "cuda_index", "machine_id", "CudaIpcHandle", "share_cuda", "open_cuda", "release_cuda",
    "IpcMappings",
]

STAGE_BYTES = 16 * 2**20  # one pinned staging buffer: large enough to run the DMA at full rate

_PRIME = 2**31 - 1
_FOLD = 2048  # bytes summed as one block (`reshard.proto.gpu_digest.BLOCK`): the sums are exact in int64


def is_cuda(array: Any) -> bool:
    return type(array).__module__.startswith("torch") and array.device.type == "cuda"


def torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype_name(dtype))


def numpy_view(t) -> np.ndarray:
    """A CPU tensor as numpy, sharing its memory and strides (bfloat16 and float8 as unsigned bits, as ``np_dtype``)."""
    import torch

    bits = BITS_DTYPES.get(str(t.dtype).removeprefix("torch."))
    if bits is not None:  # torch's .numpy() refuses the dtypes numpy lacks, not a same-width view of their bits
        return t.view(getattr(torch, bits)).numpy()
    return t.numpy()


def to_host(t) -> np.ndarray:
    """The elements of torch tensor ``t`` as a C-contiguous numpy array in host memory.

    A CPU tensor that is already contiguous is not copied; a CUDA tensor is copied
    once into pinned memory, which the returned array keeps alive.
    """
    import torch

    t = t.detach()
    if t.device.type == "cpu":
        return numpy_view(t.contiguous())
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return numpy_view(staged)


def to_torch(array: np.ndarray, dtype: str, device: str = "cpu"):
    """numpy ``array`` holding elements of ``dtype`` as a torch tensor on ``device``.

    On ``cpu`` the tensor shares the array's memory (a read-only array is copied).
    On a GPU the bytes go through two pinned buffers of ``STAGE_BYTES`` in turn: the
    host copies into one while the GPU's DMA engine reads the other, and pinned
    memory stays bounded however large the array.
    """
    import torch

    array = np.ascontiguousarray(array).view(np_dtype(dtype))  # an ml_dtypes array as the bits torch.from_numpy takes
    if torch.device(device).type == "cpu":
        return torch.from_numpy(array if array.flags.writeable else array.copy()).view(torch_dtype(dtype))
    out = torch.empty(array.shape, dtype=torch_dtype(dtype), device=device)
    copy_to_device(out, array)
    return out


def copy_to_device(out, host: np.ndarray) -> None:
    """Copy the bytes of numpy ``host`` into the contiguous GPU tensor ``out`` of as many bytes, staged (``to_torch``)."""
    import torch

    src = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    dst = out.reshape(-1).view(torch.uint8)
    nbytes = src.size
    if nbytes != dst.numel():
        raise InvalidArgumentError(f"{nbytes} bytes do not fill a {out.dtype} tensor of shape {tuple(out.shape)}")
    if nbytes == 0:
        return
    stream = torch.cuda.current_stream(out.device)
    stages = [torch.empty(min(STAGE_BYTES, nbytes), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done: list[Optional[torch.cuda.Event]] = [None, None]
    with torch.cuda.device(out.device):
        for i, lo in enumerate(range(0, nbytes, STAGE_BYTES)):
            k = i % 2
            if done[k] is not None:
                done[k].synchronize()  # the DMA out of this buffer has finished: refill it
            n = min(STAGE_BYTES, nbytes - lo)
            stages[k].numpy()[:n] = src[lo:lo + n]
            dst[lo:lo + n].copy_(stages[k][:n], non_blocking=True)
            done[k] = torch.cuda.Event()
            done[k].record(stream)
        stream.synchronize()


class DeviceChecksum:
    """The digest (see the module notes) of bytes fed in order, each piece summed where it lives.

    ``update`` takes a torch tensor on any device (its bytes in C order) or a host buffer
    (numpy array, bytes, memoryview); a CUDA piece is summed on its GPU (one Triton pass
    where Triton imports, else torch reductions) and nothing waits for the GPU until
    ``value`` is read, which fetches every pending piece's two sums at once. ``copy``
    copies a CUDA tensor into another and digests the bytes in the same pass. Pieces may
    start and end at any byte.
    """

    __slots__ = ("nbytes", "_a", "_b", "_pending")

    def __init__(self):
        self.nbytes = 0
        self._a = 0  # the sums of the pieces summed on the CPU, and of the GPU ones once read
        self._b = 0
        self._pending: list[tuple[int, Any]] = []  # (bytes before the piece, its int64 tensor of two sums)

    def update(self, data) -> "DeviceChecksum":
        flat = _flat_bytes(data)
        if type(flat) is np.ndarray:
            self._add(flat.size, *_numpy_sums(flat))
        else:
            self._later(flat.numel(), _torch_sums(flat))
        return self

    def copy(self, dst, src) -> "DeviceChecksum":
        """``dst.copy_(src)`` for torch tensors of one shape and dtype, adding ``src``'s bytes to the digest."""
        sums = None
        if is_cuda(src) and is_cuda(dst) and src.device == dst.device and src.is_contiguous() \
                and dst.is_contiguous() and src.dtype == dst.dtype and src.shape == dst.shape and src.numel():
            flat = src.reshape(-1).view(_torch_uint8())
            sums = _digest_sums(flat, dst.reshape(-1).view(_torch_uint8()))
        if sums is None:
            dst.copy_(src)
            return self.update(dst)
        self._later(flat.numel(), sums)
        return self

    def _add(self, n: int, a: int, b: int) -> None:
        self._b = (self._b + b + (self.nbytes % _PRIME) * a) % _PRIME  # the piece's positions start after nbytes
        self._a = (self._a + a) % _PRIME
        self.nbytes += n

    def _later(self, n: int, sums) -> None:
        self._pending.append((self.nbytes, sums))
        self.nbytes += n

    @property
    def value(self) -> int:
        if self._pending:
            self._settle()
        return ((self._b % _PRIME) << 32) | ((self._a + self.nbytes) % _PRIME)

    def _settle(self) -> None:
        """Fetch the pending GPU sums (one wait where they share a device) and fold them in."""
        import torch

        pending, self._pending = self._pending, []
        tensors = [t for _, t in pending]
        if len(tensors) == 1:
            values = [tensors[0].tolist()]
        elif len({t.device for t in tensors}) == 1:
            values = torch.stack(tensors).tolist()
        else:
            values = [t.tolist() for t in tensors]
        for (before, _), (a, b) in zip(pending, values):
            self._b = (self._b + b + (before % _PRIME) * a) % _PRIME
            self._a = (self._a + a) % _PRIME


def device_digest(t) -> int:
    """The digest of torch tensor ``t``'s bytes in C order (see the module notes), computed on ``t``'s device; a
    host buffer (numpy, bytes) is digested on the CPU, with the same result for the same bytes."""
    return DeviceChecksum().update(t).value


def copy_digest(dst, src) -> int:
    """``dst.copy_(src)`` and the digest of the bytes copied, in one pass on the GPU where it can."""
    return DeviceChecksum().copy(dst, src).value


def _torch_uint8():
    import torch

    return torch.uint8


def _flat_bytes(data):
    """``data``'s bytes in C order: a 1-D uint8 torch tensor where it lives, or a 1-D uint8 numpy array."""
    if type(data).__module__.startswith("torch"):
        import torch

        t = data.detach().contiguous().reshape(-1)
        return t.view(torch.uint8)
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


_TRITON: list = []  # [module or None] once looked up


def _triton_kernel():
    """``reshard.proto.gpu_digest`` where Triton imports, else None (the torch reductions run instead)."""
    if not _TRITON:
        try:
            from reshard.proto import gpu_digest
        except Exception:  # noqa: BLE001 - no Triton, or a broken one: torch's reductions do the same sums
            gpu_digest = None
        _TRITON.append(gpu_digest)
    return _TRITON[0]


def _digest_sums(flat, dst=None):
    """The Triton pass's two sums of CUDA bytes ``flat`` (copied into ``dst`` on the way; an int64 tensor of two,
    not reduced mod p), or None where Triton is missing or cannot build its kernel here (no C compiler, say): then
    never again in this process."""
    kernel = _triton_kernel()
    if kernel is None:
        return None
    try:
        return kernel.digest_sums(flat, dst)
    except Exception as e:  # noqa: BLE001 - Triton's build errors have no common type
        import logging

        logging.getLogger(__name__).warning("the GPU digest's Triton kernel does not run here (%s: %s); torch's "
                                            "reductions compute it instead", type(e).__name__, e)
        _TRITON[:] = [None]
        return None


def _torch_sums(flat):
    """(sum x_j, sum j * x_j) over 1-D uint8 tensor ``flat`` (positions from 1), as an int64 tensor of two on its
    device (reduced mod p by the torch reductions, not by the Triton pass)."""
    import torch

    sums = _digest_sums(flat) if flat.is_cuda and flat.numel() else None
    if sums is not None:
        return sums
    n, device = flat.numel(), flat.device
    rows = n // _FOLD
    a = b = torch.zeros((), dtype=torch.int64, device=device)
    if rows:
        main = flat[:rows * _FOLD].view(rows, _FOLD)
        per_row = main.sum(1, dtype=torch.int64)  # <= 255 * _FOLD
        per_col = main.sum(0, dtype=torch.int64)  # <= 255 * rows
        starts = torch.arange(rows, dtype=torch.int64, device=device) * _FOLD % _PRIME
        cols = torch.arange(1, _FOLD + 1, dtype=torch.int64, device=device)
        a = per_row.sum()
        b = (starts * per_row % _PRIME).sum() + (cols * per_col % _PRIME).sum()
    if n > rows * _FOLD:
        tail = flat[rows * _FOLD:].to(torch.int64)
        pos = torch.arange(rows * _FOLD + 1, n + 1, dtype=torch.int64, device=device) % _PRIME
        a = a + tail.sum()
        b = b + (pos * tail).sum()
    return torch.stack([a % _PRIME, b % _PRIME])


def _numpy_sums(flat: np.ndarray) -> tuple[int, int]:
    """`_torch_sums` of host bytes, with numpy."""
    n = flat.size
    rows = n // _FOLD
    a = b = 0
    if rows:
        main = flat[:rows * _FOLD].reshape(rows, _FOLD)
        per_row = main.sum(1, dtype=np.int64)
        per_col = main.sum(0, dtype=np.int64)
        starts = np.arange(rows, dtype=np.int64) * _FOLD % _PRIME
        a = int(per_row.sum())
        b = int((starts * per_row % _PRIME).sum()) + int((np.arange(1, _FOLD + 1, dtype=np.int64) * per_col
                                                          % _PRIME).sum())
    if n > rows * _FOLD:
        tail = flat[rows * _FOLD:].astype(np.int64)
        a += int(tail.sum())
        b += int((np.arange(rows * _FOLD + 1, n + 1, dtype=np.int64) % _PRIME * tail).sum())
    return a % _PRIME, b % _PRIME


def import_torch(purpose: str):
    """The torch module, or a `FailedPreconditionError` saying that ``purpose`` needs it and how to install it."""
    try:
        import torch
    except ImportError:
        raise FailedPreconditionError(f"{purpose} needs torch, which is not installed here: "
                                      f"pip install 'reshard[torch]'") from None
    return torch


def _torch_build() -> str:
    import torch

    return f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")


def check_device(device: str) -> str:
    """``device`` normalised (``cpu``, ``cuda:N``), once this process is known to have it.

    Raises `InvalidArgumentError` for what is no device name, and
    `FailedPreconditionError` naming the number of CUDA devices for a GPU this
    process cannot use.
    """
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise InvalidArgumentError(f"device {device!r} is neither cpu nor cuda[:N]")
    try:
        import torch
    except ImportError:
        raise FailedPreconditionError(f"device {device} needs torch with CUDA: pip install 'reshard[torch]'") from None
    count = torch.cuda.device_count()
    ordinal = int(index) if index else 0
    if ordinal >= count:
        seen = (f"{count} CUDA device{'s' if count != 1 else ''}" if count
                else f"no CUDA device (device count 0; {_torch_build()})")
        valid = f"cpu or cuda:0..cuda:{count - 1}" if count else "cpu"
        raise FailedPreconditionError(f"device {device} does not exist here: this process sees {seen}; use {valid}")
    return f"cuda:{ordinal}"


def gpu_uuid(device) -> str:
    """The uuid of CUDA device ``device`` (``"cuda:N"``, an ordinal or a torch.device); "" for cpu."""
    if device == "cpu":  # a CPU agent of a light install (no torch) asks too
        return ""
    import torch

    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return ""
    return f"GPU-{torch.cuda.get_device_properties(device.index or 0).uuid}"  # as nvidia-smi -L prints it


def visible_gpus() -> list[str]:
    """The uuids of the GPUs this process sees (none without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def cuda_index(uuid: str) -> Optional[int]:
    """The ordinal this process gives the GPU ``uuid``, or None when it does not see that GPU."""
    import torch

    return next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == uuid), None)


def machine_id() -> str:
    """This kernel's boot id; "" where there is none to read (CUDA IPC is then never assumed)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class CudaIpcHandle:
    """A CUDA tensor of one process as another process can map it (``torch.UntypedStorage._share_cuda_``).

    The storage fields are torch's: the allocation's ``cudaIpcMemHandle``, the
    storage's place in it, the shared-memory reference counter the producer's
    allocator keeps the memory alive by, and the event the consumer waits on before
    reading. ``offset``, ``shape`` and ``stride`` (elements) place the tensor in
    the storage. All plain bytes and integers: no pickle.
    """

    gpu_uuid: str
    handle: bytes
    storage_nbytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "stride", tuple(int(s) for s in self.stride))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if len(self.shape) != len(self.stride) or any(n < 0 for n in self.shape) or any(s < 0 for s in self.stride):
            raise InvalidArgumentError(f"CUDA IPC tensor of shape {self.shape} and stride {self.stride}: one "
                                       f"non-negative stride per dim is needed")
        if self.nbytes and self.end_byte > self.storage_nbytes:
            raise InvalidArgumentError(
                f"CUDA IPC tensor {self.dtype}{list(self.shape)} at element offset {self.offset} with stride "
                f"{self.stride} reaches byte {self.end_byte}, past its storage of {self.storage_nbytes} bytes"
            )

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_SIZES[self.dtype]

    @property
    def end_byte(self) -> int:
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return (last + 1) * DTYPE_SIZES[self.dtype]

    def fields(self) -> dict[str, Any]:
        """The message fields (protobuf ``CudaIpcTensor`` has the same names)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_message(cls, msg) -> "CudaIpcHandle":
        """From any object with these fields as attributes (a ``CudaIpcTensor`` message)."""
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})


def share_cuda(t) -> CudaIpcHandle:
    """Share CUDA tensor ``t``'s memory with other processes; keep ``t`` alive until they are done with it."""
    if not is_cuda(t):
        raise InvalidArgumentError(f"only CUDA tensors are shared by CUDA IPC; this one is on {t.device}")
    if t.numel() == 0:
        raise InvalidArgumentError("an empty tensor has no memory to share by CUDA IPC")
    try:
        device, handle, nbytes, offset, counter, counter_offset, event, sync = t.untyped_storage()._share_cuda_()
    except RuntimeError as e:  # e.g. a tensor that was itself received by CUDA IPC
        raise FailedPreconditionError(f"this CUDA tensor cannot be shared by CUDA IPC: {e}") from None
    return CudaIpcHandle(gpu_uuid(device), handle, nbytes, offset, counter, counter_offset, event, bool(sync),
                         t.storage_offset(), tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype))


def open_cuda(h: CudaIpcHandle):
    """The tensor ``h`` names, mapped into this process on the GPU of its uuid.

    Dropping the tensor unmaps it and releases the producer's reference, after
    this process's work on it has finished. Raises `FailedPreconditionError` when
    this process does not see that GPU or CUDA cannot open the handle (another
    container, or this very process); the producer's reference is released then.
    """
    import torch

    index = cuda_index(h.gpu_uuid) if torch.cuda.is_available() else None
    if index is None:
        release_cuda(h)
        seen = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
        raise FailedPreconditionError(f"GPU {h.gpu_uuid} of the CUDA IPC handle is not visible to this process "
                                      f"(it sees {seen or 'no GPU'})")
    torch.cuda.init()  # the caching allocator keeps the opened handles
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, h.handle, h.storage_nbytes, h.storage_offset_bytes, h.ref_counter_handle, h.ref_counter_offset,
            h.event_handle, h.event_sync_required)
    except RuntimeError as e:
        release_cuda(h)
        raise FailedPreconditionError(f"CUDA could not open the IPC handle of GPU {h.gpu_uuid}: {e}") from None
    out = torch.empty(0, dtype=torch_dtype(h.dtype), device=f"cuda:{index}")
    return out.set_(storage, h.offset, h.shape, h.stride)


class IpcMappings:
    """CUDA IPC handles kept open, so that a buffer shared again pays CUDA's open (milliseconds) only once.

    ``open`` maps a handle as `open_cuda` does the first time, and afterwards
    returns a view of the same mapping: the producer's new reference goes back at
    once and the consumer only waits for the producer's event. The least recently
    used mapping is dropped past ``keep`` of them or ``keep_bytes`` in all (and,
    with ``share``, past that share of the memory of the GPU it maps). A mapping
    kept holds its allocation on the producer's GPU: torch does not reuse memory a
    consumer has mapped, even after the producer frees its tensor, until the
    mapping is dropped (``clear``, or pushed out by newer ones).
    """

    def __init__(self, keep: int, keep_bytes: int, share: float | None = None):
        self.keep, self.keep_bytes, self.share = keep, keep_bytes, share
        self._lock = threading.Lock()
        self._mapped: OrderedDict[tuple, Any] = OrderedDict()  # handle -> its storage, mapped here
        self._limits: dict[str, int] = {}  # GPU uuid -> the bytes kept mapped while a mapping of it is the newest

    def open(self, h: CudaIpcHandle):
        import torch

        key = (h.gpu_uuid, bytes(h.handle), h.storage_offset_bytes, h.storage_nbytes)
        with self._lock:
            storage = self._mapped.get(key)
            if storage is not None:
                self._mapped.move_to_end(key)
        if storage is not None:
            try:
                if h.event_sync_required:  # the producer's writes queued before it shared the region come first
                    torch.cuda.Event.from_ipc_handle(cuda_index(h.gpu_uuid), bytes(h.event_handle)).wait()
            except RuntimeError:
                storage = None  # map it afresh: opening the handle waits for the producer's event itself
            else:
                release_cuda(h)
                out = torch.empty(0, dtype=torch_dtype(h.dtype), device=storage.device)
                return out.set_(storage, h.offset, h.shape, h.stride)
        mapped = open_cuda(h)
        limit = self._limit(h.gpu_uuid, mapped.device)
        with self._lock:
            self._mapped[key] = mapped.untyped_storage()
            total = sum(key[3] for key in self._mapped)
            while len(self._mapped) > 1 and (len(self._mapped) > self.keep or total > limit):
                total -= self._mapped.popitem(last=False)[0][3]
        return mapped

    def _limit(self, uuid: str, device) -> int:
        if self.share is None:
            return self.keep_bytes
        if uuid not in self._limits:
            import torch

            total = torch.cuda.get_device_properties(device).total_memory
            self._limits[uuid] = min(self.keep_bytes, int(total * self.share))
        return self._limits[uuid]

    def __len__(self) -> int:
        return len(self._mapped)

    def clear(self) -> None:
        with self._lock:
            self._mapped.clear()


def release_cuda(h: CudaIpcHandle) -> None:
    """Give back the producer's reference of a handle that will not be opened (best effort, as torch's own)."""
    try:
        import torch

        torch.UntypedStorage._release_ipc_counter_cuda(h.ref_counter_handle, h.ref_counter_offset)
    except (ImportError, RuntimeError):
        pass
