"""The SDK's state-dict calls: a whole model's weights published, resharded and read into a module in place, as
methods of `Client`.

A trainer's ranks publish with `put_state_dict` (FSDP2 or any DTensor state dict, torch's own placements, uneven
shards included: every rank calls it with its own client; or plain tensors from one process), one call per rank
per step, each version labeled with the step: ONE upload transaction for every tensor of every rank, so readers
see every name's new version appear at once. `sync_state_dict` moves a published version into
the layout of a serving module in one `reshard_many` job, whose shardings it derives from the module's DTensor
parameters (the plain ones are replicated on every serving device). `get_state_dict` fills a module's existing
parameters in place, each rank its own part (a transformers model under its tensor-parallel plan, or a plain
``nn.Module`` on one rank), converting dtypes on the way, from one catalog read and one stream per agent.

Which reshard device each rank is comes from one helper, `StateDictAdapters.mesh_devices`, never from a table
written per job: ``c.mesh_devices(device_mesh, hosts)`` puts the mesh's ranks, in rank order, on ``hosts`` as
torchrun does (consecutive ranks share a host). Catalog names are the state dict's own names, after ``prefix``.
torch is imported inside the methods only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from reshard.box import Box, intersect, to_slices, volume
from reshard.errors import InvalidShardingError
from reshard.manifest import Manifest
from reshard.mesh import Mesh, host_of
from reshard.proto import devices as torch_devices
from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.layout import tile_shape
from reshard.proto.wire import box_from_pb
from reshard.sharding import Sharding

__all__ = ["StateDictAdapters"]

_KEY_BYTES = 16  # a publish's group key: random bytes the mesh's first rank draws and broadcasts


class StateDictAdapters:
    """State-dict methods of `reshard.Client`, which inherits them."""

    # -- the rank-to-device table --------------------------------------------------------------

    @staticmethod
    def mesh_devices(device_mesh, hosts: Sequence[str]) -> dict[int, str]:
        """``{global rank: "host/index"}`` for every rank of ``device_mesh``: its ranks in rank order, the first
        ``n`` on ``hosts[0]`` as devices 0..n-1, the next ``n`` on ``hosts[1]``, ..., ``n`` = ranks / hosts (as
        torchrun places ranks). Every call that takes ``devices=`` takes this table, or ``hosts=`` to build it."""
        ranks = getattr(device_mesh, "mesh", None)
        if ranks is None or not hasattr(ranks, "flatten"):
            raise InvalidArgumentError(f"mesh_devices takes a torch DeviceMesh; got {type(device_mesh).__name__}")
        ranks = sorted(int(r) for r in ranks.flatten().tolist())
        hosts = [hosts] if isinstance(hosts, str) else list(hosts)
        if not hosts or len(ranks) % len(hosts):
            raise InvalidArgumentError(
                f"the mesh's {len(ranks)} ranks do not split evenly over hosts {hosts}: mesh_devices puts the same "
                f"number of ranks on every host; give a host list whose length divides {len(ranks)}, or pass "
                f"devices={{rank: 'host/index'}} for another placement")
        per_host = len(ranks) // len(hosts)
        return {rank: f"{hosts[i // per_host]}/{i % per_host}" for i, rank in enumerate(ranks)}

    # -- publish -----------------------------------------------------------------------------------

    def put_state_dict(self, state_dict_or_module, devices=None, *, hosts: Optional[Sequence[str]] = None,
                       step: Optional[int] = None, manifest: Optional[Manifest] = None, prefix: str = "",
                       sharding: Optional[Sharding] = None) -> Manifest:
        """Publish a model's weights as tensors ``prefix + name``: their next versions, labeled ``step``.

        DTensors (an FSDP2 or tensor-parallel model's ``state_dict()``): every rank of their mesh calls, with its
        own client; each hands over its own shards, in torch's placements as they are, and the publish is ONE
        transaction over every rank and tensor: the mesh's first rank draws a group key and broadcasts it through
        the mesh's process group, every rank joins that upload group (`Client.put_shard_group`), and every name's
        new version becomes visible at once, when the last rank's shards are in; every rank returns then. A rank
        that dies midway leaves no new version (the others raise once the group expires). ``devices`` is the
        rank-to-device table (`mesh_devices`; ``hosts=`` builds it). Plain tensors among them are put by the first
        rank of the first DTensor's mesh, on its device, in the same transaction. A state dict of plain tensors only
        is put by one process, in one transaction: each tensor laid out by ``sharding`` when given, else split along
        dim 0 over ``devices`` (a list of devices).

        ``manifest`` (the consumer's, `Manifest.from_module(serving_model)`) is checked first: a name missing,
        extra, or of another global shape or dtype raises `ManifestError` listing each, and nothing is sent.
        Returns the manifest of what was published (global names, shapes, dtypes), which a consumer may check
        against its own.
        """
        entries = _entries(state_dict_or_module)
        published = Manifest.from_state_dict(entries)
        if manifest is not None:
            if not isinstance(manifest, Manifest):
                raise InvalidArgumentError(f"manifest must be a reshard.Manifest; got {type(manifest).__name__}")
            manifest.check(dict(published.tensors), f"put_state_dict of {len(entries)} tensors")
        dtensors = {n: t for n, t in entries.items() if _is_dtensor(t)}
        if not dtensors:
            table = self._device_list(devices, hosts, "put_state_dict of plain tensors")
            self.put_many({prefix + n: (t, sharding or _split_rows(t, table)) for n, t in entries.items()}, step=step)
            return published
        if sharding is not None:
            raise InvalidArgumentError("sharding= lays out plain tensors put by one process; a DTensor state dict "
                                       "keeps torch's placements")
        mesh = next(iter(dtensors.values())).device_mesh
        table = self._rank_table(devices, hosts, mesh)
        ranks = mesh.mesh.flatten().tolist()
        for name, t in dtensors.items():
            other = sorted(set(t.device_mesh.mesh.flatten().tolist()) - set(ranks))
            if other:
                raise InvalidArgumentError(
                    f"DTensor {name!r} lives on ranks {other} outside the mesh of the state dict's first DTensor "
                    f"(ranks {ranks}), and one publish is agreed over that mesh's process group; publish each mesh's "
                    f"state dict by its own call")
        # Every rank holds the plain tensors whole (replicated buffers): the mesh's first rank publishes them.
        first = table[int(ranks[0])]
        declared, shards = {}, []
        for name, t in entries.items():
            if name in dtensors:
                layout, device, local = self.dtensor_shard(t, table)
                shards.append((prefix + name, device, local))
            else:
                layout = Sharding(Mesh({"r": 1}, [first]), (None,) * t.ndim)
                if rank_position(mesh) == 0:
                    shards.append((prefix + name, first, t.detach()))
            declared[prefix + name] = (tuple(t.shape), t.dtype, layout)
        self.put_shard_group(_group_key(mesh), declared, shards, step=step)
        return published

    # -- move --------------------------------------------------------------------------------------

    def state_dict_shardings(self, module_or_state_dict, devices=None, *, hosts: Optional[Sequence[str]] = None,
                             prefix: str = "") -> dict[str, Sharding]:
        """``{prefix + name: sharding}`` of a destination module: each DTensor parameter's own layout (its mesh and
        placements, through the rank-to-device table), each plain one replicated on every device of the first
        DTensor's mesh (with no DTensor: on ``devices``, a list). What `sync_state_dict` moves the weights into."""
        entries = _entries(module_or_state_dict)
        dtensors = [t for t in entries.values() if _is_dtensor(t)]
        if dtensors:
            table = self._rank_table(devices, hosts, dtensors[0].device_mesh)
            first = dtensors[0]
            everywhere = Sharding.from_device_mesh(first.device_mesh, first.placements, table, ndim=first.ndim).mesh
        else:
            everywhere = Mesh({"r": len(table := self._device_list(devices, hosts, "a plain module's layout"))}, table)
        out = {}
        for name, t in entries.items():
            if _is_dtensor(t):
                out[prefix + name] = Sharding.from_device_mesh(t.device_mesh, t.placements, table, ndim=t.ndim)
                if out[prefix + name].partial:
                    raise InvalidShardingError(
                        f"parameter {name!r} is a Partial() DTensor: a module's weights hold values, so give it "
                        f"Shard or Replicate placements")
            else:
                out[prefix + name] = Sharding(everywhere, (None,) * t.ndim)
        return out

    def sync_state_dict(self, module_or_state_dict, devices=None, *, hosts: Optional[Sequence[str]] = None,
                        version=None, manifest: Optional[Manifest] = None, prefix: str = "", strategy: str = "auto",
                        bucket_mib: Optional[float] = None, timeout: Optional[float] = None,
                        delta: Optional[bool] = None):
        """Move the published weights into the layout of a destination module (`state_dict_shardings`) in one
        `reshard_many` job, and wait for it; returns its `JobResult`.

        One process calls it (the serving side's first rank, or a controller). ``version`` (a `Pin` or a step
        label; None: the current versions) names what moves; the versions committed carry its step label, and the
        destination's previous ones stay readable until they commit (longer, while pinned). ``manifest`` (the
        consumer's, unprefixed) is checked by the planner before anything moves (`Client.reshard_many`), and the
        job records the digest of ``manifest.with_prefix(prefix)``. ``delta`` as in `Client.reshard_many`: None
        moves only what changed since the previous sync where that pays, False every byte, True changes wherever
        the planner holds the previous sync's versions.
        """
        shardings = self.state_dict_shardings(module_or_state_dict, devices, hosts=hosts, prefix=prefix)
        if manifest is not None and prefix:
            manifest = manifest.with_prefix(prefix)
        kwargs: dict[str, Any] = {"manifest": manifest, "strategy": strategy, "bucket_mib": bucket_mib, "delta": delta}
        if version is not None:
            kwargs["version"] = version
        return self.reshard_many(shardings, **kwargs).result(timeout=timeout)

    # -- read --------------------------------------------------------------------------------------

    def get_state_dict(self, module_or_state_dict, devices=None, *, hosts: Optional[Sequence[str]] = None,
                       version=None, dtype=None, prefix: str = "") -> dict[str, Any]:
        """Read the published weights into a module's existing parameters and buffers, in place; returns its
        state dict (the same tensors, filled).

        Each rank reads its own part: a DTensor parameter (a transformers model under its tensor-parallel plan)
        its local shard, a plain one the whole tensor; a plain ``nn.Module`` on one rank reads everything. A dict of
        existing tensors (DTensors or not) is filled the same way, and a `Manifest` gets new CPU tensors of its
        shapes. ``version`` (a `Pin` or a step label; None: the current versions) as in `get_many`; every name is
        read as the catalog holds it at one instant, in one planner call, with one stream per agent. Values are
        cast to each tensor's own dtype on the way (a bfloat16 module gets bfloat16 weights); ``dtype`` is the
        dtype a `Manifest`'s new floating-point tensors take, and must agree with an existing floating-point
        tensor's. ``devices`` (or
        ``hosts``) tells which copies are this rank's own, read first; any copy serves without it.
        """
        import torch

        wanted = dtype if dtype is None else torch_devices.torch_dtype(str(dtype).removeprefix("torch."))
        if isinstance(module_or_state_dict, Manifest):
            entries = {n: torch.empty(s, dtype=wanted if wanted is not None and stored.is_floating_point else stored)
                       for n, (s, d) in module_or_state_dict.tensors.items()
                       for stored in [torch_devices.torch_dtype(d)]}
        else:
            entries = _entries(module_or_state_dict, keep_vars=True)
        if wanted is not None:
            # As model.to(dtype) converts: floating-point tensors only (an integer buffer keeps its dtype)
            other = [f"{n!r} ({t.dtype})" for n, t in entries.items() if t.dtype.is_floating_point
                     and t.dtype != wanted]
            if other:
                raise InvalidArgumentError(
                    f"get_state_dict(dtype={wanted}) fills tensors in place, but {len(other)} are of another dtype: "
                    f"{', '.join(other[:5])}{', ...' if len(other) > 5 else ''}; convert the module first "
                    f"(model.to({wanted})): values are cast to each tensor's own dtype on the way")
        first = next((t for t in entries.values() if _is_dtensor(t)), None)
        mine = ""
        if devices is not None or hosts is not None:
            if first is not None:
                mine = self._rank_table(devices, hosts, first.device_mesh).get(first.device_mesh.get_rank(), "")
            elif isinstance(devices, str):
                mine = devices
        infos = self.locate([prefix + n for n in entries], version=version)
        tiles = []
        with torch.no_grad():
            for (name, t), info in zip(entries.items(), infos):
                tiles += _tile_reads(info, name, t, mine)
            self.read_tiles(tiles)
        return entries

    # -- shared ------------------------------------------------------------------------------------

    def _rank_table(self, devices, hosts, device_mesh) -> dict[int, str]:
        """The rank-to-device table of ``devices`` (a list indexed by rank, or a dict) or of ``hosts``."""
        if (devices is None) == (hosts is None):
            raise InvalidArgumentError("give devices= (a rank-to-device table: c.mesh_devices(mesh, hosts)) or "
                                       "hosts= (the hosts the mesh's ranks run on, in rank order), one of them")
        if hosts is not None:
            return self.mesh_devices(device_mesh, hosts)
        if isinstance(devices, Mapping):
            return {int(r): d for r, d in devices.items()}
        if isinstance(devices, str):
            raise InvalidArgumentError(f"devices={devices!r}: give a device per rank (a list or dict), or hosts=")
        return dict(enumerate(devices))

    @staticmethod
    def _device_list(devices, hosts, what: str) -> list[str]:
        if hosts is not None or devices is None:
            raise InvalidArgumentError(f"{what} needs devices=, a list of devices ('host/index') to lay them on")
        return [devices] if isinstance(devices, str) else list(devices.values() if isinstance(devices, Mapping)
                                                               else devices)


def _entries(state_dict_or_module, keep_vars: bool = False) -> dict[str, Any]:
    """A module's state dict (``keep_vars``: its parameters themselves, to write into), or a mapping's items."""
    if isinstance(state_dict_or_module, Mapping):
        entries = dict(state_dict_or_module)
    elif callable(getattr(state_dict_or_module, "state_dict", None)):
        entries = dict(state_dict_or_module.state_dict(keep_vars=True) if keep_vars
                       else state_dict_or_module.state_dict())
    else:
        raise InvalidArgumentError(f"expected a module (with .state_dict()) or a dict of tensors; got "
                                   f"{type(state_dict_or_module).__name__}")
    if not entries:
        raise InvalidArgumentError("the state dict is empty: nothing to publish or read")
    bad = [n for n, t in entries.items() if not (hasattr(t, "shape") and hasattr(t, "dtype"))]
    if bad:
        raise InvalidArgumentError(f"state dict entries {bad[:5]} are not tensors; keep tensors only (an "
                                   f"optimizer's step count belongs elsewhere)")
    return entries


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or (hasattr(t, "device_mesh") and hasattr(t, "placements"))


def rank_position(device_mesh) -> int:
    """This rank's row-major position in ``device_mesh`` (the index of its device in a `Sharding` made by
    ``Sharding.from_device_mesh``); shared with the DTensor calls of `reshard.client.frameworks`."""
    coords = device_mesh.get_coordinate()
    if coords is None:
        raise InvalidArgumentError(
            f"rank {device_mesh.get_rank()} is not in the DeviceMesh (its ranks are "
            f"{device_mesh.mesh.flatten().tolist()}); call from the ranks of the mesh only")
    return int(np.ravel_multi_index(tuple(coords), tuple(device_mesh.mesh.shape)))


def _split_rows(t, table: list[str]) -> Sharding:
    """Dim 0 split over ``table`` (torch.chunk tiles, uneven included); a scalar replicated."""
    mesh = Mesh({"x": len(table)}, table)
    return Sharding(mesh, ("x",) + (None,) * (t.ndim - 1) if t.ndim else ())


def _group_key(device_mesh) -> str:
    """A key every rank of ``device_mesh`` shares for one publish: random bytes drawn by the mesh's first rank and
    broadcast as a uint8 tensor (on the GPU for NCCL) through the mesh's process groups, one mesh dim after the
    other, each from the rank at coordinate 0 of that dim (after dim d, every rank whose later coordinates are 0
    holds the key). No pickle: the bytes travel as a tensor."""
    import torch
    import torch.distributed as dist

    key = torch.zeros(_KEY_BYTES, dtype=torch.uint8)
    if rank_position(device_mesh) == 0:
        key = torch.frombuffer(bytearray(os.urandom(_KEY_BYTES)), dtype=torch.uint8)
    coords = list(device_mesh.get_coordinate())
    ranks = device_mesh.mesh
    for dim in range(ranks.ndim):
        if ranks.shape[dim] == 1:
            continue
        group = device_mesh.get_group(dim)
        root = int(ranks[tuple(coords[:dim] + [0] + coords[dim + 1:])])
        on = key.to(f"cuda:{torch.cuda.current_device()}") if dist.get_backend(group) == "nccl" else key
        dist.broadcast(on, src=root, group=group)
        key = on.cpu()
    return bytes(key.tolist()).hex()


def _tile_reads(info: pb.TensorInfo, name: str, dst, mine: str) -> list:
    """The tiles (`Client.read_tiles`) that fill ``dst`` (this rank's part of tensor ``name``: its DTensor's local
    shard, or the whole tensor) from ``info``'s: one copy of every stored tile that meets its box, this rank's own
    device first, then its host's, each delivering the overlap into ``dst`` (cast to its dtype)."""
    shape = tuple(info.shape)
    if tuple(dst.shape) != shape:
        raise InvalidArgumentError(f"tensor {info.name!r} is {info.dtype}{list(shape)} in the catalog, but the "
                                   f"module's {name!r} is of shape {list(dst.shape)}; load a module of the "
                                   f"published architecture (check with a Manifest)")
    layout = Sharding.from_json(json.loads(info.sharding_json))
    if layout.partial:
        raise InvalidShardingError(f"tensor {info.name!r} is stored as a pending sum ({layout}); reshard it to "
                                   f"values first (c.reshard(name, layout.without_partial()))")
    # Detached: the same memory, written from the read threads, where no_grad (thread-local) is not in force.
    if _is_dtensor(dst):
        local = dst.to_local().detach()
        want = Sharding.from_device_mesh(dst.device_mesh, dst.placements,
                                         {r: f"rank/{r}" for r in dst.device_mesh.mesh.flatten().tolist()},
                                         ndim=len(shape))
        if want.partial:
            raise InvalidShardingError(f"{name!r} is a Partial() DTensor; read weights into Shard/Replicate ones")
        box = want.tile(shape, rank_position(dst.device_mesh))
    else:
        local, box = dst.detach(), tuple((0, n) for n in shape)
    if tuple(local.shape) != tile_shape(box):
        raise InvalidShardingError(f"the local shard of {name!r} is of shape {tuple(local.shape)}, but its "
                                   f"placements give this rank the tile {list(box)}: reshard reads torch.chunk tiles")
    by_tile: dict[Box, pb.TileLocation] = {}
    rank = {mine: 0, host_of(mine) if mine else None: 1}
    for loc in info.locations:
        tile = box_from_pb(loc.box)
        if loc.lost or not volume(tile) or intersect(tile, box) is None:
            continue
        best = by_tile.get(tile)
        if best is None or _nearness(loc, rank) < _nearness(best, rank):
            by_tile[tile] = loc
    reads = [(info, loc, _deliver(tile, box, local, info.dtype)) for tile, loc in by_tile.items()]
    covered = sum(volume(intersect(tile, box)) for tile in by_tile)
    if covered != volume(box):
        raise InvalidArgumentError(f"tensor {info.name!r} v{info.version} has no copy left of part of this rank's "
                                   f"tile {list(box)} (its agents restarted); publish it again")
    return reads


def _nearness(loc: pb.TileLocation, rank: dict) -> int:
    """0: this rank's own device, 1: its host, 2: elsewhere."""
    return rank.get(loc.device, rank.get(host_of(loc.device), 2))


def _deliver(tile: Box, box: Box, local, dtype: str):
    """What takes the values of stored ``tile``: its overlap with ``box`` (``local``'s place in the tensor), copied
    into ``local`` with a cast to its dtype. Reads of distinct tiles write distinct parts, so they run at once."""
    part = intersect(tile, box)
    src = to_slices(tuple((lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(part, tile)))
    dst = to_slices(tuple((lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(part, box)))

    def deliver(values: np.ndarray) -> None:
        values = values.reshape(tile_shape(tile))[src]
        local[dst].copy_(torch_devices.to_torch(np.ascontiguousarray(values), dtype))

    return deliver

