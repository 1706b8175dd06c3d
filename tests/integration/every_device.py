"""Checks that read every device's copy of a tensor.

`Client.get` reads one copy of each tile, so a test that checks a replicated result, or
a reshard to replicas, with `get` alone passes whatever the other copies hold.
"""

from __future__ import annotations

import numpy as np


def assert_every_device(client, name: str, array: np.ndarray, sharding=None) -> None:
    """Every device of ``name``'s sharding (the catalog's, unless ``sharding`` is given, which must then be it)
    holds its tile of ``array``, bit for bit."""
    held = client.info(name).sharding
    if sharding is not None:
        assert held == sharding, f"{name!r} is held as {held}, not {sharding}"
    assert not held.is_partial, f"{name!r} is a pending sum ({held}): its devices hold addends, not tiles"
    wrong = []
    for dev, box in held.tiles(array.shape).items():
        want = np.ascontiguousarray(array[tuple(slice(lo, hi) for lo, hi in box)])
        got = np.ascontiguousarray(client.get_shard(name, dev))
        if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
            wrong.append(f"{dev} (tile {box}: got {got.dtype}{list(got.shape)})")
    assert not wrong, f"{name!r} differs from the expected array on {len(wrong)} device(s): {', '.join(wrong)}"
