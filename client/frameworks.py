"""The SDK's framework adapters: DTensors and jax.Arrays in and out of the catalog, as methods of `Client`.

Every rank of a DTensor's mesh (every JAX process) hands over the shards it holds with `put_dtensor` / `put_jax`;
the tensor enters the catalog once every device's shard is in (the upload transaction of `Client.put_shard`).
`get_dtensor` / `get_jax` read it back in the caller's layout; when the stored layout differs, the tensor is first
resharded in place: the first rank of the mesh (the process holding the mesh's first JAX device) submits the job,
the others wait, under a deadline, for the catalog to show the new layout.

Layouts are reshard's tiles: DTensor's local shards (``torch.chunk`` cuts, uneven included; the rule is checked
against ``distribute_tensor`` in tests/integration/test_dtensor.py) and JAX's shards (JAX splits evenly only). A
shard that is not the tile the rule gives its device is refused, never stored. torch and JAX are imported inside
the methods only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from reshard.box import Box
from reshard.errors import InvalidShardingError
from reshard.proto import devices as torch_devices
from reshard.proto.errors import DeadlineExceededError, InvalidArgumentError
from reshard.proto.layout import tile_shape
from reshard.client.state_dict import StateDictAdapters, rank_position
from reshard.sharding import Sharding

__all__ = ["FrameworkAdapters"]

_POLL_S = 0.05  # how often a rank that waits for another rank's reshard reads the catalog


class FrameworkAdapters(StateDictAdapters):
    """DTensor and JAX methods of `reshard.Client`, which inherits them (and, through them, the state-dict calls of
    `reshard.client.state_dict`); they call its public methods only."""

    # -- DTensor ---------------------------------------------------------------------------------

    def put_dtensor(self, name: str, dtensor, devices, *, step: Optional[int] = None, ipc="auto") -> bool:
        """Hand over this rank's shard of ``dtensor``; every rank of its mesh calls it, each with its own client.

        ``devices[r]`` is the reshard device (``"host/index"``) of global rank ``r``: a list indexed by rank or a
        dict ``{rank: device}`` (see `Sharding.from_device_mesh`). The global shape and layout come from the
        DTensor, uneven shapes included; a ``Partial()`` DTensor's local tensors are stored as addends. The tensor
        appears in the catalog once every rank has handed over; returns True for the call that completed it.
        ``step`` labels the version (every rank gives the same) and ``ipc``, as in `put_shard`.
        """
        sharding, device, local = self.dtensor_shard(dtensor, devices)
        return self.put_shard(name, device, local, sharding, shape=tuple(dtensor.shape), step=step, ipc=ipc)

    @staticmethod
    def dtensor_shard(dtensor, devices) -> tuple[Sharding, str, object]:
        """This rank's part of ``dtensor`` as reshard stores it: its layout (``devices`` as in `put_dtensor`), this
        rank's device, and its local tensor, refused (InvalidShardingError) unless it is the tile reshard gives that
        device (torch.chunk cuts, as ``distribute_tensor`` makes them)."""
        sharding = Sharding.from_device_mesh(dtensor.device_mesh, dtensor.placements, devices, ndim=dtensor.ndim)
        position = rank_position(dtensor.device_mesh)
        local = dtensor.to_local()
        _check_shard(sharding, tuple(dtensor.shape), position, tuple(local.shape), f"the DTensor's local shard on "
                     f"rank {dtensor.device_mesh.get_rank()}", "a DTensor made from_local of shards cut otherwise")
        return sharding, sharding.mesh.devices[position], local

    def get_dtensor(self, name: str, device_mesh, placements: Sequence, devices, *, timeout: float = 120.0,
                    ipc="auto"):
        """This rank's part of tensor ``name`` as a DTensor on ``device_mesh`` with ``placements``; every rank of
        the mesh calls it.

        ``devices`` as in `put_dtensor`. When the stored layout differs, the mesh's first rank reshards the tensor
        in place (the catalog keeps the new layout) and the other ranks wait for it, all within ``timeout``
        seconds. For ``Partial()`` placements, a tensor stored as those same addends is returned as it is;
        otherwise the first rank along the partial mesh dims holds the value and the others zeros, so the sum is
        exact in every dtype.
        """
        import torch
        from torch.distributed.tensor import DTensor

        info = self.info(name)
        shape = info.shape
        target = Sharding.from_device_mesh(device_mesh, placements, devices, ndim=len(shape))
        position = rank_position(device_mesh)
        rank = device_mesh.get_rank()
        layout = self._laid_out(name, target, position == 0, timeout,
                                f"rank {rank} (get_dtensor; the mesh's first rank reshards)")
        kind = device_mesh.device_type
        to = "cpu" if kind == "cpu" else f"{kind}:{torch.get_device_module(kind).current_device()}"
        if _holds_value(layout, target, position):
            local = self.get_shard(name, layout.mesh.devices[position], to=to, ipc=ipc)
        else:
            local = torch.zeros(tile_shape(target.tile(shape, position)), dtype=torch_devices.torch_dtype(info.dtype),
                                device=to)
        return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_strides(shape))

    # -- JAX ---------------------------------------------------------------------------------------

    def put_jax(self, name: str, array, devices) -> bool:
        """Hand over every addressable shard of ``array``, a ``jax.Array`` laid out by a ``NamedSharding``.

        ``devices[i]`` is the reshard device of the JAX device whose ``id`` is ``i``: a list indexed by id, or a
        dict keyed by id or by JAX device (see `Sharding.from_named_sharding`). The ``unreduced`` axes of the
        spec (a jitted einsum's ``out_sharding=P('x', None, unreduced={'y'})``) are stored as Partial: each device's
        shard as addends. In multi-process JAX every process calls it for its own shards; the tensor appears once
        every device's shard is in, and the call that completed it returns True.
        """
        named_sharding = _named_sharding_of(array)
        sharding = Sharding.from_named_sharding(named_sharding, devices)
        shape = tuple(array.shape)
        positions = _jax_positions(array.sharding.mesh)
        indices = _tiled(named_sharding).addressable_devices_indices_map(shape)
        work = []
        for shard in array.addressable_shards:
            position = positions[shard.device.id]
            _check_shard(sharding, shape, position, _index_box(indices[shard.device], shape),
                         f"the shard of JAX device {shard.device.id}", "a layout JAX cut unlike torch.chunk", box=True)
            work.append((sharding.mesh.devices[position], np.asarray(shard.data)))
        with ThreadPoolExecutor(min(len(work), 8) or 1) as pool:
            done = list(pool.map(lambda w: self.put_shard(name, w[0], w[1], sharding, shape=shape), work))
        return any(done)

    def get_jax(self, name: str, named_sharding, devices, *, timeout: float = 120.0):
        """Tensor ``name`` as a ``jax.Array`` laid out by ``named_sharding`` on this process's devices.

        ``devices`` as in `put_jax`. When the stored layout differs, the process holding the mesh's first device
        reshards the tensor in place (the catalog keeps the new layout) and other processes wait for it, all within
        ``timeout`` seconds. For ``unreduced`` axes, as for ``Partial()`` in `get_dtensor`: a tensor stored as
        those same addends is returned as it is; otherwise the first device along the unreduced axes holds the
        value and the others zeros, as ``jax.device_put`` lays it out.
        """
        import jax

        info = self.info(name)
        shape = info.shape
        target = Sharding.from_named_sharding(named_sharding, devices)
        _check_even(target, shape, name)
        jax_mesh = named_sharding.mesh
        positions = _jax_positions(jax_mesh)
        leader = jax_mesh.devices.flat[0].process_index == jax.process_index()
        layout = self._laid_out(name, target, leader, timeout,
                                f"JAX process {jax.process_index()} (get_jax; the process of the mesh's first device "
                                f"reshards)")
        dtype = jax.numpy.dtype(info.dtype)
        wanted = _tiled(named_sharding).addressable_devices_indices_map(shape)

        def read(jax_device):
            position = positions[jax_device.id]
            _check_shard(target, shape, position, _index_box(wanted[jax_device], shape),
                         f"the shard JAX wants on device {jax_device.id}", "a layout JAX cuts unlike torch.chunk",
                         box=True)
            if _holds_value(layout, target, position):
                host = _numpy_bits(self.get_shard(name, layout.mesh.devices[position]), dtype)
            else:
                host = np.zeros(tile_shape(target.tile(shape, position)), dtype=dtype)
            return jax.device_put(host, jax_device)

        with ThreadPoolExecutor(min(len(wanted), 8) or 1) as pool:
            arrays = list(pool.map(read, wanted))
        return jax.make_array_from_single_device_arrays(shape, named_sharding, arrays)

    # -- shared ------------------------------------------------------------------------------------

    def _laid_out(self, name: str, target: Sharding, leader: bool, timeout: float, who: str) -> Sharding:
        """The layout ``name`` is stored in once it matches ``target``: as it is, or (for a Partial target) as the
        summed tensor. Otherwise ``leader`` reshards it in place and the other callers wait for the catalog."""
        info = self.info(name)
        summed = target.without_partial()
        for layout in (target, summed):
            if _same_holdings(info.sharding, layout, info.shape):
                return layout
        if leader:
            self.reshard(name, summed).result(timeout=timeout)
            return summed
        deadline = time.monotonic() + timeout
        while not _same_holdings(self.info(name).sharding, summed, info.shape):
            if time.monotonic() > deadline:
                raise DeadlineExceededError(
                    f"{who}: tensor {name!r} is still {info.sharding} after {timeout:g}s, not yet resharded to "
                    f"{summed}; every rank of the mesh must call, the first one submits the reshard (did it fail?); "
                    f"pass a larger timeout= for a tensor that takes longer to move")
            time.sleep(_POLL_S)
        return summed


def _jax_positions(jax_mesh) -> dict[int, int]:
    """JAX device id -> row-major position in ``jax_mesh``."""
    return {int(d.id): i for i, d in enumerate(jax_mesh.devices.flat)}


def _named_sharding_of(array):
    sharding = getattr(array, "sharding", None)
    if type(sharding).__name__ != "NamedSharding":
        raise InvalidShardingError(
            f"put_jax takes a jax.Array laid out by a NamedSharding; this one has {type(sharding).__name__}; "
            f"jax.device_put it to NamedSharding(mesh, PartitionSpec(...)) first")
    return sharding


def _tiled(named_sharding):
    """``named_sharding`` with its ``unreduced`` axes dropped, for JAX's index maps, which refuse an unreduced spec
    (jax 0.10.2 raises NotImplementedError): every device's tile is the same either way, since an unreduced axis
    splits no dim (its devices hold addends of the same tile)."""
    spec = named_sharding.spec
    if not getattr(spec, "unreduced", None):
        return named_sharding
    return named_sharding.update(spec=spec.update(unreduced=frozenset()))


def _index_box(index, shape) -> Box:
    """A JAX shard index (a slice per dim) as a box of ``shape``."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _check_shard(sharding: Sharding, shape, position: int, got, what: str, cause: str, box: bool = False) -> None:
    """Refuse a shard whose shape (or, with ``box``, whose box) is not the tile reshard gives its mesh position:
    storing it would put elements at the wrong place."""
    tile = sharding.tile(shape, position)
    want = tile if box else tile_shape(tile)
    if tuple(got) != want:
        raise InvalidShardingError(
            f"{what} is {'the box' if box else 'of shape'} {tuple(got)}, but {sharding.spec_str()} on "
            f"({', '.join(f'{n}={s}' for n, s in sharding.mesh.axes)}) of shape {tuple(shape)} gives that device "
            f"the tile {list(tile)}{'' if box else f' of shape {want}'}: reshard stores torch.chunk tiles (as "
            f"distribute_tensor cuts them), and this looks like {cause}; redistribute to such a layout first")


def _check_even(sharding: Sharding, shape, name: str) -> None:
    for d, (length, pieces) in enumerate(zip(shape, sharding.dim_chunks(shape))):
        if length % len(pieces):
            raise InvalidShardingError(
                f"JAX splits a dim evenly only, but dim {d} of {name!r}, shape {tuple(shape)}, is {length} long and "
                f"split {len(pieces)} ways by {sharding.spec_str()}; read it with get_dtensor or get, or choose a "
                f"PartitionSpec whose splits divide it")


def _holdings(sharding: Sharding, shape) -> dict[str, tuple[Box, frozenset]]:
    """device -> (its tile, the devices whose addends are summed with its own): what a layout means, whatever
    its mesh's axis names and shape."""
    mesh = sharding.mesh
    kept = [i for i, n in enumerate(mesh.axis_names) if n not in sharding.partial]
    groups: dict[tuple, set] = {}
    keys = {}
    for p, d in enumerate(mesh.require_devices()):
        keys[d] = tuple(mesh.coords(p)[i] for i in kept)
        groups.setdefault(keys[d], set()).add(d)
    tiles = sharding.tiles(shape)
    return {d: (tiles[d], frozenset(groups[keys[d]])) for d in tiles}


def _same_holdings(a: Sharding, b: Sharding, shape) -> bool:
    return _holdings(a, shape) == _holdings(b, shape)


def _holds_value(layout: Sharding, target: Sharding, position: int) -> bool:
    """Whether the device at ``position`` of Partial ``target`` holds the value rather than zeros, when the tensor
    is stored summed (``layout``): the first device along every partial axis does."""
    if layout.partial or not target.partial:
        return True
    coords = target.mesh.coords(position)
    return all(coords[target.mesh.axis_index(a)] == 0 for a in target.partial)


def _contiguous_strides(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _numpy_bits(x, dtype: np.dtype) -> np.ndarray:
    """A tile read by `get_shard` (numpy, or torch for dtypes numpy lacks) as numpy of ``dtype``, JAX's dtype."""
    if not isinstance(x, np.ndarray):
        import torch

        flat = x.detach().cpu().contiguous().reshape(-1)
        x = flat.view(torch.uint8).numpy().view(dtype).reshape(tuple(x.shape))
    return x if x.dtype == dtype else x.view(dtype)
