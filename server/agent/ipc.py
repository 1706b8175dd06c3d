"""Same-host CUDA hand-over: a training rank's CUDA shard mapped by CUDA IPC, copied on the GPU, checked by digest.

A rank on the agent's machine shares its tensor's memory
(`reshard.proto.devices.share_cuda`) and sends the handle with the tensor's
digest, computed on its GPU. The agent maps the memory, copies it into a buffer
of its own on its device (device to device, no host round trip) and digests the
copy in the same pass; a digest that differs is `DataLossError` and nothing is
staged. The rank may free its tensor as soon as the call returns. Reading back
runs the other way round: the rank shares an empty contiguous tensor of the
tile's shape, the agent copies its shard in and answers with the shard's digest,
which the rank checks against what it got.

The agent keeps the mappings of the last ``PUT_MAPPINGS_KEPT`` tensors a rank
put (`reshard.proto.devices.IpcMappings`): a rank that publishes the same
parameters every step shares the same memory every step, and on an H200
opening a handle took 0.5-2 ms and closing it 0.3 ms, against 0.15 ms to reuse
a mapping (a 4 GiB tensor's copy takes 2 ms). torch's reference counter keeps a mapped tensor's memory
allocated on the rank's GPU, even once the rank frees it, until the agent drops
the mapping; a read's destination is mapped for the one copy and dropped at once
(a rank reads into new memory each time).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import xxhash

from reshard.box import Box
from reshard.dtypes import itemsize
from reshard.proto.devices import CudaIpcHandle, IpcMappings, machine_id, open_cuda, release_cuda, torch_dtype
from reshard.proto.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from reshard.proto.layout import tile_shape
from reshard.proto.shared_memory import Opened
from reshard.server.agent.store import ShardStore, TileBuffer
from reshard.server.transport import buffers

__all__ = ["DeviceInfo", "CudaHandover", "ShmHandover", "PUT_MAPPINGS_KEPT", "PUT_MAPPED_BYTES"]

PUT_MAPPINGS_KEPT = 64  # ranks' tensors kept mapped: a state dict's largest tensors, published every step
PUT_MAPPED_BYTES = 32 * 2**30  # and at most this many bytes of them
SHM_SEGMENTS_KEPT = 16  # clients' shared-memory segments kept mapped
SHM_MAPPED_BYTES = 32 * 2**30  # and at most this many bytes of them


@dataclass(frozen=True)
class DeviceInfo:
    """Where an agent keeps its shards, and what a client needs to tell whether it runs beside it."""

    host: str
    device: str  # "cpu" or "cuda:N"
    gpu_uuid: str  # "" for cpu
    machine_id: str  # the kernel's boot id
    pid: int


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class CudaHandover:
    """The agent's side of CUDA IPC hand-overs, on the GPU of ``store``."""

    def __init__(self, host: str, store: ShardStore):
        self.host = host
        self.store = store
        self.mapped = IpcMappings(PUT_MAPPINGS_KEPT, PUT_MAPPED_BYTES)

    def describe(self) -> DeviceInfo:
        return DeviceInfo(self.host, self.store.device, buffers.gpu_uuid(self.store.device), machine_id(), os.getpid())

    def _check(self, handle: CudaIpcHandle, tile: Box, dtype: str, what: str) -> None:
        """Refuse before mapping; a refused handle's reference goes back to its producer."""
        if self.store.device == "cpu":
            release_cuda(handle)
            raise FailedPreconditionError(
                f"the agent of host {self.host} keeps its shards in host memory (--device cpu); the CUDA IPC "
                f"hand-over needs an agent on a GPU (--device cuda:N): stream the bytes instead (ipc=False)")
        if handle.shape != tile_shape(tile) or handle.dtype != dtype:
            release_cuda(handle)
            raise InvalidArgumentError(f"the CUDA IPC tensor is {handle.dtype}{list(handle.shape)}, but {what} is "
                                       f"the tile {list(tile)} of {dtype}{list(tile_shape(tile))}")

    def put(self, upload_id: str, device: str, tile: Box, dtype: str, source: CudaIpcHandle,
            digest: int) -> tuple[int, int]:
        """Copy the rank's tensor ``source`` into a new buffer and stage it as ``device``'s shard of the upload.

        Returns (bytes, digest of the agent's copy).
        """
        self._check(source, tile, dtype, f"device {device}'s shard")
        mapped = self.mapped.open(source)
        buf = self.store.empty(source.shape, dtype)
        got = buffers.copy_digest(buf, mapped)  # one pass: copies and digests; waits for it
        if got != digest:
            raise DataLossError(
                f"CUDA IPC hand-over of device {device}'s shard to host {self.host}: the digest of the agent's copy "
                f"{got:016x} differs from the sender's {digest:016x}; nothing was staged"
            )
        self.store.stage(upload_id, device, TileBuffer(buf, tile, dtype))
        return buf.nbytes, got

    def get(self, shard: TileBuffer, destination: CudaIpcHandle) -> tuple[int, int]:
        """Copy ``shard`` into the rank's empty tensor ``destination``; returns (bytes, digest of the shard)."""
        self._check(destination, shard.tile, shard.dtype, "the shard")
        if destination.stride != _c_strides(destination.shape):
            release_cuda(destination)
            raise InvalidArgumentError(f"the CUDA IPC tensor to read into must be contiguous; its strides are "
                                       f"{destination.stride} for shape {destination.shape}")
        mapped = open_cuda(destination)
        try:
            digest = buffers.copy_digest(mapped, shard.array)  # one pass; waits for it
        finally:
            del mapped
        return shard.nbytes, digest


class ShmHandover:
    """The agent's side of the same-machine host path: shards put and read through a client's shared-memory segment
    (`reshard.proto.shared_memory`), one copy each way, checked by digest.

    The digest is the GPU digest where the client's tensor and this agent's shards are both on GPUs (each end
    computes it on its GPU, as the CUDA IPC hand-over does), else the XXH3-64 of the bytes in host memory. The
    segments clients name stay mapped (pinned on a GPU agent) for their next calls.
    """

    def __init__(self, host: str, store: ShardStore):
        self.host = host
        self.store = store
        self.opened = Opened(SHM_SEGMENTS_KEPT, SHM_MAPPED_BYTES)

    def _region(self, region, nbytes: int, what: str):
        if region.nbytes != nbytes:
            raise InvalidArgumentError(f"{what}: the shared-memory region holds {region.nbytes} bytes, the shard "
                                       f"{nbytes}")
        segment = self.opened.get(region.name, region.offset + region.nbytes)
        if self.store.device != "cpu":
            segment.pin()
        return segment.view(region.offset, region.nbytes)

    def put(self, upload_id: str, device: str, tile: Box, dtype: str, region, digest: int,
            device_digest: bool) -> tuple[int, int]:
        """Copy the shard's bytes out of the client's segment into a new buffer and stage it as ``device``'s shard
        of the upload. Returns (bytes, digest of the agent's copy, of the kind the client computed)."""
        shape = tile_shape(tile)
        what = f"shared-memory hand-over of device {device}'s shard to host {self.host}"
        view = self._region(region, math.prod(shape) * itemsize(dtype), what)
        buf = self.store.empty(shape, dtype)
        if device_digest and self.store.device != "cpu":
            flat = buf.reshape(-1).view(torch_dtype("uint8"))
            flat.copy_(_torch_from(view))  # host to GPU, pinned
            got = buffers.device_digest(buf)
        else:
            got = xxhash.xxh3_64_intdigest(view)
            if self.store.device == "cpu":
                np.copyto(buf.reshape(-1).view(np.uint8), view)
            else:
                buf.reshape(-1).view(torch_dtype("uint8")).copy_(_torch_from(view))
        if got != digest:
            kind = "GPU digest" if device_digest else "XXH3-64"
            raise DataLossError(f"{what}: the {kind} of the agent's copy {got:016x} differs from the client's "
                                f"{digest:016x}; nothing was staged")
        self.store.stage(upload_id, device, TileBuffer(buf, tile, dtype))
        return buf.nbytes, got

    def get(self, shard: TileBuffer, region, device_digest: bool) -> tuple[int, int]:
        """Copy ``shard`` into the client's segment; returns (bytes, digest of the shard, of the kind asked)."""
        view = self._region(region, shard.nbytes, f"shared-memory read of a shard from host {self.host}")
        if buffers.is_torch(shard.array):
            src = shard.array.contiguous().reshape(-1).view(torch_dtype("uint8"))
            _torch_from(view).copy_(src)  # GPU to host, pinned; waits for it
        else:
            np.copyto(view, np.ascontiguousarray(shard.array).reshape(-1).view(np.uint8))
        return shard.nbytes, buffers.device_digest(shard.array) if device_digest else xxhash.xxh3_64_intdigest(view)


def _torch_from(view: np.ndarray):
    import torch

    return torch.from_numpy(view)
