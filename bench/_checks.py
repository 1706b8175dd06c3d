"""How the benches check a result: every device's tile, by its blake2b digest computed where it lives
(`Client.digests`), so every replica is read, not the one copy per tile a get reads."""

from __future__ import annotations

import hashlib

import numpy as np

from reshard.box import to_slices


def tile_digests(array: np.ndarray, sharding) -> dict[str, str]:
    """The blake2b of every device's tile of ``array`` in ``sharding``: what `Client.digests` returns once the
    tensor is there."""
    return {dev: hashlib.blake2b(np.ascontiguousarray(array[to_slices(tile)]).tobytes()).hexdigest()
            for dev, tile in sharding.tiles(array.shape).items()}


def differing(got: dict[str, str], want: dict[str, str]) -> list[str]:
    """The devices whose digest differs, or that hold a tile they should not, or lack one they should."""
    return sorted(d for d in set(got) | set(want) if got.get(d) != want.get(d))


def expected_digests(tensors: dict, layouts: dict) -> dict[str, dict[str, str]]:
    """`tile_digests` per tensor of ``tensors`` ({name: (array, sharding)}) in its layout of ``layouts``."""
    return {name: tile_digests(a, layouts[name]) for name, (a, _) in tensors.items()}


def check_every_device(c, expected: dict[str, dict[str, str]], what: str) -> None:
    """Every device holds its tile of every tensor of ``expected`` (`expected_digests`) bit for bit."""
    bad = {name: wrong for name, want in expected.items() if (wrong := differing(c.digests(name), want))}
    if bad:
        first = next(iter(bad))
        raise AssertionError(f"{what} left {len(bad)} of {len(expected)} tensors with a device whose tile differs "
                             f"from the array's (or is missing or extra), {list(bad)[:3]} first; {first!r} on "
                             f"{bad[first]}")
