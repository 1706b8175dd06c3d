"""Tile buffers where they live: numpy arrays on CPU agents, torch tensors on ``cuda:N`` agents.

Everything that reads or writes a tile's bytes (the shard store, the runtime, the
transports) goes through these functions, so a CUDA-resident shard is never
copied to the host unless a byte stream needs host memory (the gRPC path):

=================== ==========================================================================
``empty``           a buffer of ``shape`` and dtype name on a device (``"cpu"`` or ``"cuda:N"``)
``region``          the view of ``box`` (global coordinates) in a buffer that holds ``origin``
``write``           copy ``data`` (numpy or torch, any device) into ``box`` of a buffer
``host_bytes``      the bytes of a view in host memory, C order, as a ``memoryview`` (a CUDA
                    view is copied into a pinned host buffer; a contiguous numpy view is not
                    copied)
``device_of``       ``"cpu"`` or ``"cuda:N"``
=================== ==========================================================================

Dtypes are reshard's names (``reshard.dtypes``); bfloat16 and the other dtypes numpy
lacks are held by numpy as same-size unsigned integers (what ``proto.layout.np_dtype``
maps them to), and by torch as themselves.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.proto.layout import np_dtype

__all__ = ["is_torch", "device_of", "empty", "region", "write", "host_bytes"]


def is_torch(array: Any) -> bool:
    return type(array).__module__.startswith("torch")


def device_of(array: Any) -> str:
    if is_torch(array):
        return str(array.device)
    return "cpu"


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def empty(shape: tuple[int, ...], dtype: str, device: str = "cpu"):
    if device == "cpu":
        return np.empty(shape, dtype=np_dtype(dtype))
    import torch

    return torch.empty(shape, dtype=_torch_dtype(dtype), device=device)


def region(array, box: Box, origin: Box):
    """The part of ``array`` (which holds the global box ``origin``) that covers ``box``: a view."""
    return array[boxes.to_slices(box, origin)]


def write(array, box: Box, origin: Box, data) -> None:
    """Copy ``data`` into the part of ``array`` that covers ``box``."""
    target = array[boxes.to_slices(box, origin)]
    if is_torch(target):
        if not is_torch(data):
            import torch

            data = torch.from_numpy(np.ascontiguousarray(data)).view(target.dtype)
        target.copy_(data.reshape(target.shape), non_blocking=False)
    elif is_torch(data):
        target[...] = data.detach().cpu().numpy().view(target.dtype).reshape(target.shape)
    else:
        target[...] = data


def host_bytes(view) -> memoryview:
    """The bytes of ``view`` in C order, in host memory."""
    if is_torch(view):
        import torch

        src = view.contiguous()
        if src.device.type != "cpu":
            staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            staged.copy_(src)
            src = staged
        flat = src.reshape(-1).view(torch.uint8)
        return memoryview(flat.numpy()).cast("B")
    return memoryview(np.ascontiguousarray(view)).cast("B")
